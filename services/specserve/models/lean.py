"""A lean incremental forward for small Llama-family drafts.

A 2-layer draft spends most of an HF forward outside its matmuls: mask
building, rotary tables, cache bookkeeping and module dispatch cost more
than the layers themselves (2.8 ms per token for the shipped draft on the
2-core CPU, of which about 0.9 ms is matmul). `LeanSequence` runs the same
layers with fused weights (q|k|v, gate|up), a preallocated KV cache that a
rollback only shortens, and rotary angles computed for the new positions
only. On a CPU a bfloat16 draft computes in float32: for weights that fit
the cache, float32 matrix-vector products are faster there than bfloat16 ones.

Speculative sampling is exact for any draft distribution, so computing the
draft differently from HF changes which tokens are proposed, never what the
target emits. Where a model is outside what this covers (other rotary
types, sliding windows, other architectures) `draft_sequence` falls back to
the HF `CachedSequence`.

A `SubsetDraftForCausalLM` keeps its head over its token subset here:
`feed_subset` returns logits over `token_subset` (sorted ascending, so
inverse-CDF sampling over the subset picks the same token as over the full
vocabulary with zeros elsewhere).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.models.kv import CachedSequence, TokenSequence

SUPPORTED = {"llama", "specserve_draft"}


def unsupported_reason(model) -> str | None:
    """Why `LeanSequence` cannot run `model`, or None when it can."""
    cfg = model.config
    if cfg.model_type not in SUPPORTED:
        return f"model type {cfg.model_type!r}"
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if rope.get("rope_type", "default") != "default":
        return f"rope type {rope.get('rope_type')!r}"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act!r}"
    if getattr(cfg, "mlp_bias", False):
        return "MLP bias"
    if getattr(cfg, "pretraining_tp", 1) not in (1, None):
        return "pretraining_tp"
    return None


def draft_sequence(model) -> TokenSequence:
    """The fastest cache this package has for running `model` as a draft."""
    return LeanSequence(model) if unsupported_reason(model) is None else CachedSequence(model)


class _LeanWeights:
    """A model's weights fused for `LeanSequence`, made once per model and compute dtype."""

    def __init__(self, model, dtype: torch.dtype):
        cfg = model.config

        def cast(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.detach().to(dtype).contiguous()

        def cat(*ts: torch.Tensor | None) -> torch.Tensor | None:
            return None if ts[0] is None else cast(torch.cat(ts))

        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.layers = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append((
                cast(layer.input_layernorm.weight),
                cat(attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight),
                cat(attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias),
                cast(attn.o_proj.weight),
                cast(attn.o_proj.bias),
                cast(layer.post_attention_layernorm.weight),
                cat(mlp.gate_proj.weight, mlp.up_proj.weight),
                cast(mlp.down_proj.weight),
            ))
        self.norm = cast(model.model.norm.weight)
        head = model.lm_head.weight
        subset = getattr(model, "token_subset", None)
        if subset is not None:
            order = torch.argsort(subset)
            subset, head = subset[order], head[order]
            self.token_subset = subset.to("cpu")
        else:
            self.token_subset = None
        self.head = cast(head)
        self.embed = model.model.embed_tokens.weight  # indexed per call; cast only the rows used
        self.inv_freq = model.model.rotary_emb.inv_freq.detach().float()
        self.scale = self.head_dim**-0.5
        self.dtype = dtype
        self.device = head.device


def _weights(model, dtype: torch.dtype) -> _LeanWeights:
    cache = model.__dict__.setdefault("_specserve_lean", {})
    if dtype not in cache:
        cache[dtype] = _LeanWeights(model, dtype)
    return cache[dtype]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, -1)
    return torch.cat((-b, a), -1)


class LeanSequence(TokenSequence):
    """One sequence's cache for a Llama-family model, with the `TokenSequence` contract of `CachedSequence`."""

    def __init__(self, model, dtype: torch.dtype | None = None, capacity: int = 256):
        param = next(model.parameters())
        if dtype is None:  # half precision computes in float32 on a CPU (faster there for a small draft)
            half = param.dtype in (torch.bfloat16, torch.float16)
            dtype = torch.float32 if half and param.device.type == "cpu" else param.dtype
        self.w = _weights(model, dtype)
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

    def rollback(self, length: int) -> None:
        del self.tokens[length:]  # the cache rows past `length` are overwritten by the next feed

    @torch.inference_mode()
    def feed_subset(self, new_tokens: list[int], keep_logits: int = 1) -> torch.Tensor:
        """Append tokens; float32 CPU logits over the head's tokens (the subset, or the vocabulary): [keep, n]."""
        w, n, start = self.w, len(new_tokens), len(self.tokens)
        if not n:
            raise ValueError("feed needs at least one token")
        self._reserve(start + n)
        end = start + n
        ids = torch.tensor(new_tokens, dtype=torch.long, device=w.device)
        x = w.embed[ids].to(w.dtype)  # [n, hidden]
        angles = torch.arange(start, end, dtype=torch.float32, device=w.device)[:, None] * w.inv_freq
        angles = torch.cat((angles, angles), -1)
        cos, sin = angles.cos().to(w.dtype), angles.sin().to(w.dtype)  # [n, head_dim]
        h, kvh, d = w.heads, w.kv_heads, w.head_dim
        group = h // kvh
        mask = None
        if n > 1:  # query i sees the cache and new tokens up to itself; one row per (head in group, query)
            mask = torch.ones(n, end, dtype=torch.bool, device=w.device).tril(start).repeat(group, 1)
        for i, (norm_in, w_qkv, b_qkv, w_o, b_o, norm_post, w_gate_up, w_down) in enumerate(w.layers):
            r = self._rms(x, norm_in)
            qkv = F.linear(r, w_qkv, b_qkv)
            q = qkv[:, : h * d].view(n, h, d).transpose(0, 1)  # [h, n, d]
            k = qkv[:, h * d : (h + kvh) * d].view(n, kvh, d).transpose(0, 1)  # [kvh, n, d]
            v = qkv[:, (h + kvh) * d :].view(n, kvh, d).transpose(0, 1)
            q = q * cos + _rotate_half(q) * sin
            self.k[i, :, start:end] = k * cos + _rotate_half(k) * sin
            self.v[i, :, start:end] = v
            # grouped-query attention as kvh batches of (group · n) queries: no key/value copies
            att = F.scaled_dot_product_attention(
                q.reshape(kvh, group * n, d), self.k[i, :, :end], self.v[i, :, :end], attn_mask=mask, scale=w.scale
            )  # [kvh, group·n, d] = [h, n, d]
            x = x + F.linear(att.view(h, n, d).transpose(0, 1).reshape(n, h * d), w_o, b_o)
            gate, up = F.linear(self._rms(x, norm_post), w_gate_up).chunk(2, -1)
            x = x + F.linear(F.silu(gate) * up, w_down)
        self.tokens.extend(new_tokens)
        self.forward_calls += 1
        return F.linear(self._rms(x[-keep_logits:], w.norm), w.head).float().cpu()

    def feed(self, new_tokens: list[int], keep_logits: int = 1) -> torch.Tensor:
        """Append tokens; float32 CPU logits over the full vocabulary (-inf outside a subset): [keep, vocab]."""
        logits = self.feed_subset(new_tokens, keep_logits)
        if self.token_subset is None:
            return logits
        full = logits.new_full((logits.shape[0], self.vocab), float("-inf"))
        full[:, self.token_subset] = logits
        return full

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x32 = x.float()  # as HF: normalise in float32, scale in the compute dtype
        return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.w.eps)).to(x.dtype)

    def release(self) -> None:
        self.k = self.v = None
        self.tokens = []
