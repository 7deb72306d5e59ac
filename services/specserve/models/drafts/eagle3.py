"""Public EAGLE-3 draft heads (Li et al. 2025) as drafts: the checkpoints vLLM, SGLang and llama.cpp load.

An EAGLE-3 head is one Llama decoder layer (`midlayer`) beside the target. At position j it reads the target's
hidden states entering three of its layers (by default 2, L/2 and L-3 of L; the config's
`eagle_config.eagle_aux_hidden_state_layer_ids` names the layers whose outputs it reads instead), concatenated
and projected by `fc` (3H -> H) into a feature g_j, and the embedding of the next token x_{j+1} (the target's
embedding: the checkpoints do not carry one). Its attention reads [input_layernorm(e), hidden_norm(g)] (2H
inputs to q, k and v), its residual stream starts at g; the stream after the layer (before the final norm)
is the feature it drafts on next, and `lm_head` scores a reduced vocabulary of `draft_vocab_size` tokens, draft
id i being target id i + d2t[i].

The reduced vocabulary is a token subset as a specserve head's (`models.drafts.head`): q is zero outside it,
which the rejection sampler takes as it takes any draft's, so the output is the target's distribution. Sessions
draft through the same `_FeaturePositions` bookkeeping as a feature head; the target's pool keeps the three
layers' hidden states per position (`KVPool(features=aux layers)`), and the head's steps run op by op on a
cache of its own (served: on the target worker's compute thread, `scheduler.colocated.ScheduledEagle3Sequence`).
"""

from __future__ import annotations

import json
import pathlib

import torch
import torch.nn.functional as F
from torch import nn

from specserve.models.drafts.head import _FeaturePositions
from specserve.models.drafts.names import EAGLE3_PREFIX, names_eagle3
from specserve.models.families.lean import _rotate_half
from specserve.models.memory.prefix import common_prefix

PREFIX = EAGLE3_PREFIX
# name -> shape, in units of (hidden H, target hidden T, heads*head_dim Q, kv_heads*head_dim KV, intermediate I,
# draft vocabulary D); as vLLM's and SGLang's loaders read them
TENSORS = {
    "fc.weight": ("H", "3T"),
    "midlayer.input_layernorm.weight": ("H",),
    "midlayer.hidden_norm.weight": ("H",),
    "midlayer.post_attention_layernorm.weight": ("H",),
    "midlayer.self_attn.q_proj.weight": ("Q", "2H"),
    "midlayer.self_attn.k_proj.weight": ("KV", "2H"),
    "midlayer.self_attn.v_proj.weight": ("KV", "2H"),
    "midlayer.self_attn.o_proj.weight": ("H", "Q"),
    "midlayer.mlp.gate_proj.weight": ("I", "H"),
    "midlayer.mlp.up_proj.weight": ("I", "H"),
    "midlayer.mlp.down_proj.weight": ("H", "I"),
    "norm.weight": ("H",),
    "lm_head.weight": ("D", "H"),
    "d2t": ("D",),
}


def is_eagle3(spec) -> bool:
    """Whether a draft spec names an EAGLE-3 head: a loaded one, "eagle3:PATH", or a directory whose config's
    architectures say so."""
    return isinstance(spec, Eagle3Head) or names_eagle3(spec)


def aux_layers(config: dict, target_layers: int) -> tuple[int, ...]:
    """The target layers whose input hidden states the head reads: the config's layer ids' next layers (it names
    the layers whose outputs it reads), else the engines' default (2, L // 2, L - 3)."""
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    layers = tuple(int(i) + 1 for i in ids) if ids else (2, target_layers // 2, target_layers - 3)
    if not all(1 <= layer < target_layers for layer in layers):
        raise ValueError(f"EAGLE-3 head: it reads the target's layers {layers}, and the target has {target_layers}")
    return layers


def spec_aux_layers(spec, target_layers: int) -> tuple[int, ...]:
    """`aux_layers` of the head a spec names, from its config alone (before its weights load)."""
    if isinstance(spec, Eagle3Head):
        return spec.aux
    path = pathlib.Path(str(spec).removeprefix(PREFIX)) / "config.json"
    try:
        return aux_layers(json.loads(path.read_text()), target_layers)
    except (OSError, ValueError) as exc:
        raise ValueError(f"draft {spec!r}: no EAGLE-3 config.json at {path.parent} ({exc})") from None


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


class Eagle3Head(nn.Module):
    """A loaded EAGLE-3 head (`load_eagle3`): its weights, the target's embedding, the sorted target ids of its
    vocabulary (`token_subset`, lm_head's rows in that order) and the target layers it reads (`aux`)."""

    def __init__(self, config: dict, tensors: dict[str, torch.Tensor], embedding: nn.Module, aux: tuple[int, ...],
                 dtype: torch.dtype):
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.config_dict, self.aux = config, aux
        self.hidden = config["hidden_size"]
        self.heads = config["num_attention_heads"]
        self.kv_heads = config.get("num_key_value_heads") or self.heads
        self.head_dim = config.get("head_dim") or self.hidden // self.heads
        self.eps = config.get("rms_norm_eps", 1e-6)
        self.residual_normed = bool(config.get("norm_before_residual", False))
        rope = {k: config[k] for k in ("rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings",
                                       "partial_rotary_factor") if config.get(k) is not None}
        self.rotary = LlamaRotaryEmbedding(LlamaConfig(hidden_size=self.hidden, num_attention_heads=self.heads,
                                                       head_dim=self.head_dim, **rope))
        for name, tensor in tensors.items():
            self.register_buffer(name.replace(".", "_"), tensor, persistent=False)
        self.embedding = [embedding]  # the target's (a list: not a submodule of the head's)
        self._dtype = dtype
        vocab = embedding.num_embeddings
        targets = torch.arange(len(tensors["d2t"])) + tensors["d2t"].long()
        order = torch.argsort(targets)  # the rejection sampler wants the subset sorted
        self.token_subset = targets[order]
        if self.token_subset.min() < 0 or self.token_subset.max() >= vocab or len(set(self.token_subset.tolist())) \
                != len(self.token_subset):
            raise ValueError("EAGLE-3 head: d2t maps its vocabulary outside the target's, or two ids to one")
        self.lm_head_weight = self.lm_head_weight[order]
        self.vocab = vocab

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self.fc_weight.device

    def embed(self, tokens: list[int]) -> torch.Tensor:
        module = self.embedding[0]
        weight = getattr(module, "weight", None)  # (a GGUF file's embedding has none: it stays in the file, on the CPU)
        ids = torch.tensor(tokens, device=weight.device if weight is not None else "cpu")
        return module(ids).to(self.device, self.dtype)

    def fc(self, aux_features: torch.Tensor) -> torch.Tensor:
        """The target's concatenated hidden states [T, 3H] -> the head's features [T, H]."""
        return aux_features.to(self.dtype) @ self.fc_weight.T

    def step(self, cache: list, positions: torch.Tensor, features: torch.Tensor, tokens: list[int]
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows (features [T, H], tokens [T]) at `positions` after the cache's (k, v) ([kv_heads, n, head_dim],
        appended to in place): (the stream after the layer [T, H], the logits over its vocabulary [T, D])."""
        t = len(tokens)
        e = self.embed(tokens)
        h = features.to(self.dtype)
        normed_h = _rms(h, self.midlayer_hidden_norm_weight, self.eps)
        x = torch.cat([_rms(e, self.midlayer_input_layernorm_weight, self.eps), normed_h], -1)
        q = (x @ self.midlayer_self_attn_q_proj_weight.T).view(t, self.heads, self.head_dim).transpose(0, 1)
        k = (x @ self.midlayer_self_attn_k_proj_weight.T).view(t, self.kv_heads, self.head_dim).transpose(0, 1)
        v = (x @ self.midlayer_self_attn_v_proj_weight.T).view(t, self.kv_heads, self.head_dim).transpose(0, 1)
        cos, sin = self.rotary(v, positions[None].to(v.device))
        q, k = _rotate(q, cos[0], sin[0]), _rotate(k, cos[0], sin[0])
        past = cache[0].shape[1] if cache else 0
        keys = torch.cat([cache[0], k], 1) if cache else k
        values = torch.cat([cache[1], v], 1) if cache else v
        cache[:] = [keys, values]
        group = self.heads // self.kv_heads
        mask = torch.ones(t, past + t, dtype=torch.bool, device=q.device).tril(past)
        att = F.scaled_dot_product_attention(q, keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0),
                                             attn_mask=mask)
        residual = (normed_h if self.residual_normed else h) + att.transpose(0, 1).reshape(t, -1) \
            @ self.midlayer_self_attn_o_proj_weight.T
        m = _rms(residual, self.midlayer_post_attention_layernorm_weight, self.eps)
        m = (F.silu(m @ self.midlayer_mlp_gate_proj_weight.T) * (m @ self.midlayer_mlp_up_proj_weight.T)) \
            @ self.midlayer_mlp_down_proj_weight.T
        stream = residual + m
        return stream, (_rms(stream, self.norm_weight, self.eps) @ self.lm_head_weight.T).float()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return (x * cos.to(x.dtype) + _rotate_half(x) * sin.to(x.dtype)).to(x.dtype)


def load_eagle3(spec, target) -> Eagle3Head:
    """The EAGLE-3 head a spec names ("eagle3:PATH" or its directory), for `target` (a `LoadedModel`): on its device,
    in its dtype, its embedding shared; the checkpoint checked against the names and shapes vLLM's and SGLang's
    loaders read (ValueError naming what does not fit)."""
    if isinstance(spec, Eagle3Head):
        return spec
    path = pathlib.Path(str(spec).removeprefix(PREFIX))
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"draft {spec!r}: no EAGLE-3 config.json at {path} ({exc})") from None
    tensors = _read(path, spec)
    tc = target.model.config
    hidden, tl = config.get("hidden_size"), tc.num_hidden_layers
    heads = config.get("num_attention_heads") or 0
    head_dim = config.get("head_dim") or (hidden // heads if heads else 0)
    kv = config.get("num_key_value_heads") or heads
    units = {"H": hidden, "T": config.get("target_hidden_size") or hidden, "Q": heads * head_dim,
             "KV": kv * head_dim, "I": config.get("intermediate_size"),
             "D": config.get("draft_vocab_size") or config.get("vocab_size")}
    for name, shape in TENSORS.items():
        if name not in tensors:
            raise ValueError(f"draft {spec!r}: the checkpoint has no {name!r} (an EAGLE-3 head's tensors: "
                             f"{', '.join(TENSORS)})")
        want = tuple(int(u[:-1]) * units[u[-1]] if u[0].isdigit() else units[u] for u in shape)
        if tuple(tensors[name].shape) != want:
            raise ValueError(f"draft {spec!r}: {name} is {tuple(tensors[name].shape)}, its config makes it {want}")
    if units["T"] != tc.hidden_size:
        raise ValueError(f"draft {spec!r}: a head for a target of hidden size {units['T']}, and this target's is "
                         f"{tc.hidden_size}")
    if config.get("vocab_size", tc.vocab_size) != tc.vocab_size:
        raise ValueError(f"draft {spec!r}: a head for a vocabulary of {config['vocab_size']} tokens, and this "
                         f"target's has {tc.vocab_size}")
    device, dtype = target.device, target.dtype if target.dtype.is_floating_point else torch.float32
    own = tensors.pop("embed_tokens.weight", None)
    embedding = nn.Embedding.from_pretrained(own.to(device, dtype)) if own is not None \
        else target.model.get_input_embeddings()  # the target's, as the engines share it (a GGUF's stays in its file)
    kept = {name: tensors[name].to(device, torch.long if name == "d2t" else dtype) for name in TENSORS}
    return Eagle3Head(config, kept, embedding, aux_layers(config, tl), dtype).eval()


def _read(path: pathlib.Path, spec) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory (safetensors, else PyTorch's .bin), names without a `model.` prefix."""
    tensors: dict[str, torch.Tensor] = {}
    files = sorted(path.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file

        for file in files:
            tensors.update(load_file(str(file)))
    else:
        for file in sorted(path.glob("*.bin")):
            tensors.update(torch.load(file, map_location="cpu", weights_only=True))
    if not tensors:
        raise ValueError(f"draft {spec!r}: no weights (*.safetensors, *.bin) in {path}")
    return {name.removeprefix("model."): tensor for name, tensor in tensors.items()}


class Eagle3Sequence(_FeaturePositions):
    """One session's EAGLE-3 cache over its target sequence (a `KVPool(features=head.aux)` sequence): the
    `TokenSequence` methods `ModelProposer` drafts through, as `HeadSequence`'s."""

    fused = False

    def __init__(self, head: Eagle3Head, target_sequence):
        self.head, self.target = head, target_sequence
        self.token_subset = head.token_subset
        self.vocab = head.vocab
        self.tokens: list[int] = []
        self.cache: list = []
        self.forward_calls = 0

    def common_prefix(self, tokens: list[int]) -> int:
        return common_prefix(self.tokens, tokens)

    def rollback(self, length: int) -> None:
        del self.tokens[length:]
        if self.cache:
            self.cache = [self.cache[0][:, :length], self.cache[1][:, :length]]
        self.true = min(self.true, length)

    def release(self) -> None:
        self.tokens, self.cache = [], []
        self.true, self.last = 0, None

    @torch.inference_mode()
    def _feed(self, features: torch.Tensor, tokens: list[int]) -> torch.Tensor:
        start = len(self.tokens)
        positions = torch.arange(start, start + len(tokens))
        stream, logits = self.head.step(self.cache, positions, features, tokens)
        self.tokens.extend(tokens)
        self.forward_calls += 1
        self.last = stream[-1:]
        return logits[-1:].cpu()

    def subset_logits_after(self, tokens: list[int]) -> torch.Tensor:
        """Logits over the head's vocabulary for the token after `tokens` (the committed context), the target's
        hidden states of every position it holds of them fed first."""
        tail = self.true_tail(tokens)
        if not tail:
            self.last = torch.zeros(1, self.head.hidden, dtype=self.head.dtype, device=self.head.device)
            return self.equal_logits()
        pool, block = self.target.pool, self.target.block
        start = len(self.tokens)
        return self._feed(self.head.fc(pool.features[block[0] + start : block[0] + self.true]), tail)

    def feed_subset(self, new_tokens: list[int], keep_logits: int = 1) -> torch.Tensor:
        """Draft on: the head's own last stream with the token drafted from it."""
        if len(new_tokens) != 1 or keep_logits != 1:
            raise ValueError("an EAGLE-3 head drafts one token at a time")
        return self._feed(self.last, new_tokens)

    def logits_after(self, tokens: list[int], keep_logits: int = 1) -> torch.Tensor:
        from specserve.models.families.lean import widen

        return widen(self.subset_logits_after(tokens), self.token_subset, self.vocab)
