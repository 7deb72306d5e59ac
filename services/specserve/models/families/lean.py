"""specserve's own incremental forward, for drafts and (over a KV pool) targets of the families `models.families.arch`
describes.

A 2-layer draft spends most of an HF forward outside its matmuls: mask
building, rotary tables, cache bookkeeping and module dispatch cost more
than the layers themselves (docs/benchmarks.md). `LeanSequence` runs the same
layers with fused weights (q|k|v, gate|up), a preallocated KV cache that a
rollback only shortens, and rotary angles computed for the new positions
only. On a CPU a bfloat16 draft computes in float32: for weights that fit
the cache, float32 matrix-vector products are faster there than bfloat16 ones.

Speculative sampling is exact for any draft distribution, so computing the
draft differently from HF changes which tokens are proposed, never what the
target emits. The families covered, and how their layers differ, are
`models.families.arch`'s; for a model outside them `draft_sequence` falls back to the
HF `CachedSequence`.

A `SubsetDraftForCausalLM` keeps its head over its token subset here:
`feed_subset` returns logits over `token_subset` (sorted ascending, so
inverse-CDF sampling over the subset picks the same token as over the full
vocabulary with zeros elsewhere).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.models.families.arch import Unsupported, arch_of
from specserve.models.families.sequence import CachedSequence, TokenSequence
from specserve.models.families.weights import Layer, LeanWeights, lean_weights
from specserve.models.kernels import cpu
from specserve.models.kernels.fused import FusedLayers
from specserve.models.kernels.quant import linear


def unsupported_reason(model) -> str | None:
    """Why `LeanSequence` cannot run `model`, or None when it can."""
    return unsupported_config(model.config)


def unsupported_config(cfg) -> str | None:
    """Why `LeanSequence` cannot run a model of config `cfg`, or None when it can (`models.families.arch`)."""
    try:
        arch_of(cfg)
    except Unsupported as e:
        return str(e)
    return None


def draft_dtype(model) -> torch.dtype:
    """The dtype a draft computes in: its own, except half precision on a CPU, which computes in float32
    (faster there for a small draft's matrix-vector products)."""
    param = next(model.parameters())
    half = param.dtype in (torch.bfloat16, torch.float16)
    quantized = getattr(model, "specserve_quant", None) is not None  # its packed kernels want bfloat16
    return torch.float32 if half and param.device.type == "cpu" and not quantized else param.dtype


def draft_sequence(model) -> TokenSequence:
    """The fastest cache this package has for running `model` as a draft."""
    return LeanSequence(model) if unsupported_reason(model) is None else CachedSequence(model)


def model_sequence(model) -> TokenSequence:
    """A private cache for a target outside a KV pool: HF's, or the lean one for a quantized model (whose dense
    linear weights are gone)."""
    return LeanSequence(model) if getattr(model, "specserve_quant", None) is not None else CachedSequence(model)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, -1)
    return torch.cat((-b, a), -1)


def lean_forward(w: LeanWeights, caches: list, new_tokens: list[list[int]], keeps: list[int],
                 arena: tuple[torch.Tensor, torch.Tensor, list[int]] | None = None,
                 hidden: torch.Tensor | None = None, features: torch.Tensor | None = None, head: bool = True,
                 aux: tuple[int, ...] | None = None) -> torch.Tensor:
    """`_lean_forward`, on a GPU without cuDNN's attention: it builds an execution plan for each new shape,
    and a served batch's shapes change every step (its lengths grow), so every step paid for a new plan
    (docs/benchmarks.md, one H100)."""
    if w.device.type != "cuda":
        return _lean_forward(w, caches, new_tokens, keeps, arena, hidden, features, head, aux)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        return _lean_forward(w, caches, new_tokens, keeps, arena, hidden, features, head, aux)


def _lean_forward(w: LeanWeights, caches: list, new_tokens: list[list[int]], keeps: list[int],
                  arena: tuple[torch.Tensor, torch.Tensor, list[int]] | None = None,
                  hidden: torch.Tensor | None = None, features: torch.Tensor | None = None, head: bool = True,
                  aux: tuple[int, ...] | None = None) -> torch.Tensor:
    """ONE forward over the new tokens of several sequences, each against its own cache.

    caches[j] has `tokens` (the tokens its cache holds; the new ones go right after) and `kv(layer)` -> (k, v),
    each [kv_heads, capacity, head_dim] with room for the new tokens. The matmuls run over all new tokens at
    once. Attention runs per sequence over its own cache (a view, no copy), or, given the pool's `arena`
    (k, v: [layers, kv_heads, positions, head_dim]; each cache's block offset), as ONE padded call for the
    sequences with short blocks (`_PaddedAttention`). Returns the head's float32 logits for the last
    `keeps[j]` new tokens of each sequence, in order: [sum(keeps), head rows]. The caller extends each
    cache's `tokens`.

    A pipeline stage's weights (`LeanWeights.layers`) take the hidden states the stage before made for every
    new token ([T, hidden]) in place of embedding them, and a stage before the last returns its own.

    features: the pool's feature arena ([positions, hidden], with `arena`): every new token's normed final
    hidden state (what the head multiplies) is written at its arena row, for a draft head that reads the
    target's features (`models.drafts.head`). head=False: every new row's final hidden state, before the final norm
    (the feature head's own steps). aux: the layers whose input hidden states the feature arena keeps instead,
    side by side ([positions, len(aux) x hidden]: an EAGLE-3 head's, `models.drafts.eagle3`), computed op by op.
    """
    starts = [len(c.tokens) for c in caches]
    sizes = [len(t) for t in new_tokens]
    ids = torch.tensor([t for ts in new_tokens for t in ts], dtype=torch.long, device=w.device)
    total = ids.shape[0]
    x = embed(w, ids) if hidden is None else hidden.to(w.device, w.dtype)  # [T, hidden]
    positions = torch.cat([torch.arange(s, s + n, dtype=torch.float32) for s, n in zip(starts, sizes)])
    cs = rope_tables(w, positions.to(w.device))
    offsets = [0]
    for n in sizes:
        offsets.append(offsets[-1] + n)
    # query i of a sequence sees its cache and its new tokens up to itself
    padded = kernel = None
    if arena is not None and not torch.compiler.is_compiling() and w.kernel_attention \
            and cpu.step_kernels(w.dtype, w.device, w.head_dim):
        # every block straight from the arena, prompts too: each row then computes what it would alone, so a
        # session resumed by re-prefill, or after a cached prefix, goes on with the same values
        kernel = cpu.Attention(*arena, starts, sizes, offsets, w.heads, w.scale, w.arch.attn_softcap)
        looped = []
    else:
        padded = _PaddedAttention.plan(w, arena, starts, sizes, offsets) if arena is not None else None
        looped = [j for j in range(len(caches)) if padded is None or j not in padded.members]
    masks: dict = {}  # (sequence, window) -> its block's mask, made once per forward
    fused = _fused_layers(w, total) if kernel is not None and not looped and w.tp is None and not aux else None
    slots = None
    if features is not None:
        slots = torch.cat([torch.arange(b + s, b + s + n) for b, s, n in zip(arena[2], starts, sizes)]).to(w.device)
    if fused is not None:  # every layer in one kernel call each
        x = x.contiguous() if hidden is None else x.clone()  # updated in place: never the caller's states
        fused.run(x, cs, kernel, w.heads, w.kv_heads, w.head_dim, w.eps)
    for i, layer in enumerate(w.layers if fused is None else ()):
        for at, layer_id in enumerate(aux or ()):
            if layer_id == i:
                features[slots, at * x.shape[1] : (at + 1) * x.shape[1]] = x.to(features.dtype)
        q, k, v = rotated_qkv(w, layer, x, cs)
        outs = []
        for j in looped:
            s, n, o = starts[j], sizes[j], offsets[j]
            k_cache, v_cache = caches[j].kv(i)
            k_cache[:, s : s + n] = k[o : o + n].transpose(0, 1)
            v_cache[:, s : s + n] = v[o : o + n].transpose(0, 1)
            lo = 0 if layer.window is None else max(0, s + 1 - layer.window)  # the first key any query sees
            if n > 1 and (j, layer.window) not in masks:
                masks[j, layer.window] = _block_mask(s, n, lo, layer.window, w.device)
            outs.append(_attend(w, q[o : o + n], k_cache[:, lo : s + n], v_cache[:, lo : s + n],
                                masks.get((j, layer.window))))
        if kernel is not None:
            att = q.new_empty(total, q.shape[1] * q.shape[2])
            kernel(i, q, k, v, att, layer.window)
        elif padded is None:
            att = outs[0] if len(outs) == 1 else torch.cat(outs)
        else:
            att = padded.attend(i, q, k, v)
            if looped:
                att = att.index_copy(0, padded.looped_rows, torch.cat(outs))
        x = layer_output(w, layer, x, att)
    if w.head is None or not head:
        return x
    normed = features is not None and not aux
    if normed:  # every new row's, normed once for the arena and the head both
        x = norm(w, x, w.norm)
        features.index_copy_(0, slots, x.to(features.dtype))
    if len(caches) == 1:
        rows = x[total - keeps[0] :]
    else:
        rows = x[torch.cat([torch.arange(offsets[j + 1] - keep, offsets[j + 1]) for j, keep in enumerate(keeps)])]
    return head_logits(w, rows, normed=normed)


def embed(w: LeanWeights, ids: torch.Tensor) -> torch.Tensor:
    """The embedding rows of ids in the compute dtype (Gemma's scaled by sqrt(hidden) in the weights' dtype, as HF)."""
    x = w.embed[ids]
    if w.arch.embed_scale is not None:
        x = x * torch.tensor(w.arch.embed_scale, dtype=x.dtype)
    return x.to(w.dtype)


def rope_tables(w: LeanWeights, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(cos, sin) [T, 1, rotary dim] of each of the model's ropes at positions [T] (float32, on its device)."""
    return [rope.cos_sin(positions, w.dtype) for rope in w.ropes]


def _block_mask(start: int, n: int, lo: int, window: int | None, device) -> torch.Tensor:
    """Which keys lo .. start+n-1 each of n new tokens (positions start ..) sees: [n, start + n - lo]."""
    pos = torch.arange(start, start + n)[:, None]
    keys = torch.arange(lo, start + n)[None]
    seen = keys <= pos
    if window is not None:
        seen &= keys > pos - window
    return seen.to(device)


def _fused_layers(w: LeanWeights, rows: int) -> FusedLayers | None:
    """w's layers as `FusedLayers` (planned once) for a step of `rows`, or None where they do not fuse."""
    if not cpu.FUSED:
        return None
    if not hasattr(w, "_fused"):
        w._fused = FusedLayers.plan(w)
    return w._fused if w._fused is not None and rows < w._fused.rows_below else None


def head_logits(w: LeanWeights, x: torch.Tensor, normed: bool = False) -> torch.Tensor:
    """The head's float32 logits of x [n, hidden] (normed: the final norm applied already): [n, head rows] (a
    tensor-parallel group's, on rank 0)."""
    logits = linear(x if normed else norm(w, x, w.norm), w.head)
    cap = w.arch.final_softcap
    if cap is not None:  # Gemma 2/3, in the compute dtype as HF (elementwise: each rank its own columns)
        logits = torch.tanh(logits / cap) * cap
    logits = logits.float()
    return logits if w.tp is None else w.tp.gather_columns(logits, w.vocab_rows)


def rotated_qkv(w: LeanWeights, layer: Layer, x: torch.Tensor, cs: list) -> tuple[torch.Tensor, torch.Tensor,
                                                                                 torch.Tensor]:
    """One layer's queries [T, heads, d], keys and values [T, kv_heads, d] of x [T, hidden], q/k norms and rotary
    applied. cs: `rope_tables`."""
    h, kvh, d, total = w.heads, w.kv_heads, w.head_dim, x.shape[0]
    qkv = linear(x if layer.norm_in is None else norm(w, x, layer.norm_in), layer.qkv, layer.b_qkv)
    qk = qkv[:, : (h + kvh) * d]
    kind = w.arch.qk_norm
    if kind == "full":  # over all of a token's heads (OLMo 2)
        qk = torch.cat((norm(w, qk[:, : h * d], layer.q_norm), norm(w, qk[:, h * d :], layer.k_norm)), 1)
    elif kind == "head":  # over each head (Qwen3, Gemma 3)
        qk = qk.reshape(total, h + kvh, d)
        qk = torch.cat((norm(w, qk[:, :h], layer.q_norm), norm(w, qk[:, h:], layer.k_norm)), 1)
    qk = qk.reshape(total, h + kvh, d)  # queries and keys rotated together: half the ops
    cos, sin = cs[layer.rope]
    rot = w.arch.rotary_dim
    if rot == d:
        qk = qk * cos + _rotate_half(qk) * sin
    else:  # partial rotary (Phi-4-mini): the first rot channels of each head
        part = qk[..., :rot]
        qk = torch.cat((part * cos + _rotate_half(part) * sin, qk[..., rot:]), -1)
    return qk[:, :h], qk[:, h:], qkv[:, (h + kvh) * d :].view(total, kvh, d)


def layer_output(w: LeanWeights, layer: Layer, x: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
    """x after one layer: the attention output att [T, heads·d] projected and added, then the MLP."""
    if w.tp is None:
        y = linear(att, layer.o, layer.b_o)
    else:  # each rank's heads' share of the projection, summed over the ranks
        y = w.tp.all_reduce(linear(att, layer.o))
        y = y if layer.b_o is None else y + layer.b_o
    if layer.norm_attn_out is not None:
        y = norm(w, y, layer.norm_attn_out)
    x = x + y
    gate_up = linear(x if layer.norm_mlp is None else norm(w, x, layer.norm_mlp), layer.gate_up)
    if w.arch.act in _KERNEL_ACT and cpu.rms_ok(gate_up):  # the kernels' activation, as `FusedLayers`
        act = _KERNEL_ACT[w.arch.act](gate_up)
    else:
        gate, up = gate_up.chunk(2, -1)
        act = _ACT[w.arch.act](gate) * up
    down = linear(act, layer.down)
    if w.tp is not None:
        down = w.tp.all_reduce(down)
    if layer.norm_mlp_out is not None:
        down = norm(w, down, layer.norm_mlp_out)
    return x + down


_ACT = {"silu": F.silu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "gelu": F.gelu}
_KERNEL_ACT = {"silu": cpu.silu_mul, "gelu_tanh": cpu.gelu_mul}


def sdpa(w: LeanWeights, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
         ) -> torch.Tensor:
    """Attention of q [B, kv_heads, m, d] against k, v [B, kv_heads, L, d] (mask [B or 1, 1 or kv_heads, m, L],
    True: seen), with the model's scale, and its soft-capping (Gemma 2: as HF's eager attention computes it)."""
    cap = w.arch.attn_softcap
    if cap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=w.scale)
    scores = torch.tanh((q @ k.transpose(-1, -2)) * w.scale / cap) * cap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, -1, dtype=torch.float32).to(q.dtype) @ v


def _attend(w: LeanWeights, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
            ) -> torch.Tensor:
    """One sequence's attention: q [n, heads, d] against k, v [kv_heads, L, d]; mask [n, L] or None → [n, heads·d].

    A long block (a prefill chunk) goes with enable_gqa; a short one as kv_heads heads of (group · n) queries,
    faster for a few tokens. Both 4-d: that takes the CPU's fused kernel (2-4x faster than the 3-d call, which
    falls back to the math one). Neither copies keys or values.
    """
    n, h, d = q.shape
    kvh = w.kv_heads
    if n > _PaddedAttention.MAX_NEW and w.arch.attn_softcap is None:
        att = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], attn_mask=mask,
                                             scale=w.scale, enable_gqa=True)[0]  # [h, n, d]
    else:
        att = sdpa(w, q.transpose(0, 1).reshape(1, kvh, h // kvh * n, d), k[None], v[None],
                   None if mask is None else mask.repeat(h // kvh, 1)).reshape(h, n, d)
    return att.transpose(0, 1).reshape(n, h * d)


class _PaddedAttention:
    """Attention of several pooled sequences in ONE call: their keys and values gathered from the arena into
    a padded batch [B, kv_heads, longest, head_dim], their queries padded to the longest new block, a mask for
    causality and length. Per sequence, a loop costs ~10 small ops per layer and session; this is ~10 ops per
    layer for all of them, at the
    price of copying their caches once per layer. Sequences with long new blocks (prefill chunks) stay in
    the loop: padding every query to theirs would cost more than it saves.
    """

    MAX_NEW = 16  # sequences feeding at most this many tokens are padded together

    @classmethod
    def plan(cls, w: LeanWeights, arena, starts, sizes, offsets) -> _PaddedAttention | None:
        members = [j for j, n in enumerate(sizes) if n <= cls.MAX_NEW]
        return cls(w, arena, members, starts, sizes, offsets) if len(members) > 1 else None

    def __init__(self, w: LeanWeights, arena, members: list[int], starts, sizes, offsets):
        self.k_arena, self.v_arena, blocks = arena
        self.w, self.members = w, members
        dev = w.device
        start = torch.tensor([starts[j] for j in members])
        new = torch.tensor([sizes[j] for j in members])
        base = torch.tensor([blocks[j] for j in members])
        self.batch, self.nmax, self.lmax = len(members), int(new.max()), int((start + new).max())
        query = torch.arange(self.nmax).expand(self.batch, -1).minimum(new[:, None] - 1)  # [B, nmax], pads repeat
        self.query_rows = (torch.tensor([offsets[j] for j in members])[:, None] + query).flatten().to(dev)
        # key t is seen by query i iff t <= start + i (its cache, the new tokens up to itself); pads copy a row
        keys = torch.arange(self.lmax).expand(self.batch, -1)
        pos = (start[:, None] + query)[..., None]
        seen = keys[:, None, :] <= pos  # [B, nmax, lmax]
        group = w.heads // w.kv_heads
        self.masks = {}  # per sliding window (None: full attention), [B, 1, group·nmax, lmax]
        for window in {layer.window for layer in w.layers}:
            sees = seen if window is None else seen & (keys[:, None, :] > pos - window)
            self.masks[window] = sees.repeat(1, group, 1)[:, None].to(dev)
        self.key_rows = (base[:, None] + keys.minimum((start + new)[:, None] - 1)).flatten().to(dev)
        rows = [(b, offsets[j], i) for b, j in enumerate(members) for i in range(sizes[j])]
        self.new_rows = torch.tensor([o + i for _, o, i in rows], device=dev)  # flat rows of the members' tokens
        self.arena_rows = torch.tensor([blocks[j] + starts[j] + i for j in members for i in range(sizes[j])],
                                       device=dev)
        self.out_rows = torch.tensor([b * self.nmax + i for b, _, i in rows], device=dev)
        member_set = set(members)
        self.looped_rows = torch.tensor([offsets[j] + i for j in range(len(sizes)) if j not in member_set
                                         for i in range(sizes[j])], dtype=torch.long, device=dev)
        self.total = sum(sizes)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, heads, d], k, v: [T, kv_heads, d] (all new tokens, rotated) → [T, heads·d], zeros outside
        the members' rows."""
        w, b, nmax, lmax = self.w, self.batch, self.nmax, self.lmax
        h, kvh, d = w.heads, w.kv_heads, w.head_dim
        k_layer, v_layer = self.k_arena[layer], self.v_arena[layer]  # [kvh, positions, d]
        k_layer.index_copy_(1, self.arena_rows, k.index_select(0, self.new_rows).transpose(0, 1))
        v_layer.index_copy_(1, self.arena_rows, v.index_select(0, self.new_rows).transpose(0, 1))
        # index_select, not k_layer[:, rows]: a row copy each, 4x faster here than advanced indexing
        keys = k_layer.index_select(1, self.key_rows).view(kvh, b, lmax, d).transpose(0, 1)  # [B, kvh, lmax, d]
        values = v_layer.index_select(1, self.key_rows).view(kvh, b, lmax, d).transpose(0, 1)
        # grouped-query attention as kvh heads of (group · nmax) queries each (faster here than enable_gqa
        # for these short blocks)
        queries = q.index_select(0, self.query_rows).view(b, nmax, h, d).permute(0, 2, 1, 3)
        queries = queries.reshape(b, kvh, h // kvh * nmax, d)
        att = sdpa(w, queries, keys, values, self.masks[w.layers[layer].window])
        att = att.reshape(b, h, nmax, d).permute(0, 2, 1, 3).reshape(b * nmax, h * d)
        if len(self.new_rows) == self.total:  # every sequence is a member: rows already in order
            return att.index_select(0, self.out_rows)
        return att.new_zeros(self.total, h * d).index_copy_(0, self.new_rows, att.index_select(0, self.out_rows))


def norm(w: LeanWeights, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """An RMS norm of x over its last dimension with `weight` as `weights.LeanWeights` keeps it: Llama's scales
    after casting back, Gemma's and OLMo 2's before (their weights float32; the kernels' norm reads the dtype)."""
    if not w.arch.norm_in_float32 or _kernel_rows(x):
        return _rms(x, weight, w.eps)
    return (F.rms_norm(x.float(), (x.shape[-1],), eps=w.eps) * weight).to(x.dtype)


def _kernel_rows(x: torch.Tensor) -> bool:
    """Whether the kernels' RMS norm takes x: [M, H], or [T, heads, D] a head a row."""
    return (x.dim() == 3 and x.shape[0] and cpu.rms_ok(x[0])) or (x.dim() == 2 and cpu.rms_ok(x))


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # as HF: normalise in float32, scale in the compute dtype (one fused op for HF's four, one call on a CPU)
    if _kernel_rows(x):  # per head (q/k norms): a head a row, as the fused layers
        return cpu.rms_norm(x.reshape(-1, x.shape[-1]) if x.dim() == 3 else x, weight, eps).view(x.shape)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def widen(logits: torch.Tensor, token_subset: torch.Tensor | None, vocab: int) -> torch.Tensor:
    """[n, subset] logits -> [n, vocab] with -inf outside the subset (unchanged without one)."""
    if token_subset is None:
        return logits
    full = logits.new_full((logits.shape[0], vocab), float("-inf"))
    full[:, token_subset] = logits
    return full


class LeanSequence(TokenSequence):
    """One sequence's cache for a model of `models.families.arch`'s families, with the `TokenSequence` contract of `CachedSequence`."""

    def __init__(self, model, dtype: torch.dtype | None = None, capacity: int = 256):
        self.w = lean_weights(model, dtype or draft_dtype(model))
        self.token_subset = self.w.token_subset
        self.vocab = model.config.vocab_size
        self.tokens: list[int] = []
        self.forward_calls = 0
        self.capacity = capacity
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def _reserve(self, length: int) -> None:
        if self.k is not None and length <= self.k.shape[2]:
            return
        old = 0 if self.k is None else self.k.shape[2]
        size = max(length, 2 * old, self.capacity)
        shape = (len(self.w.layers), self.w.kv_heads, size, self.w.head_dim)
        k = torch.empty(shape, dtype=self.w.dtype, device=self.w.device)
        v = torch.empty_like(k)
        if self.k is not None:
            n = len(self.tokens)
            k[:, :, :n] = self.k[:, :, :n]
            v[:, :, :n] = self.v[:, :, :n]
        self.k, self.v = k, v

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer], self.v[layer]

    def rollback(self, length: int) -> None:
        del self.tokens[length:]  # the cache rows past `length` are overwritten by the next feed

    @torch.inference_mode()
    def feed_subset(self, new_tokens: list[int], keep_logits: int = 1) -> torch.Tensor:
        """Append tokens; float32 CPU logits over the head's tokens (the subset, or the vocabulary): [keep, n]."""
        if not new_tokens:
            raise ValueError("feed needs at least one token")
        self._reserve(len(self.tokens) + len(new_tokens))
        logits = lean_forward(self.w, [self], [new_tokens], [keep_logits])
        self.tokens.extend(new_tokens)
        self.forward_calls += 1
        return logits.cpu()

    def feed(self, new_tokens: list[int], keep_logits: int = 1) -> torch.Tensor:
        """Append tokens; float32 CPU logits over the full vocabulary (-inf outside a subset): [keep, vocab]."""
        return widen(self.feed_subset(new_tokens, keep_logits), self.token_subset, self.vocab)

    def release(self) -> None:
        self.k = self.v = None
        self.tokens = []
