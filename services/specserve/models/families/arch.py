"""What a decoder-only family's layer does, read from its config: one description the lean forward
(`models.families.lean`), the step runner (`models.memory.runner`) and the CPU kernels (`models.kernels.cpu`) all follow, so the
families below run through one layer implementation (as llama.cpp's graph builder and vLLM's model classes
differ per family by options, not by copies of the attention).

`arch_of(config)` returns an `Arch`, or raises `Unsupported` naming what is outside it; `FAMILIES` is the table
docs/serving.md prints (tests/cpu/test_arch.py checks the two agree).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class Unsupported(ValueError):
    """A config the lean forward does not run (the message says what)."""


# model_type -> how its decoder layer differs from Llama's
_FAMILY = {
    "llama": {},
    "specserve_draft": {},
    "specserve_head": {},
    "mistral": {},
    "qwen2": {},
    "qwen3": {"qk_norm": "head"},
    "phi3": {"fused": True},
    "olmo2": {"qk_norm": "full", "norms": "post"},
    "gemma": {"gemma": True},
    "gemma2": {"gemma": True, "norms": "sandwich"},
    "gemma3_text": {"gemma": True, "norms": "sandwich", "qk_norm": "head"},
}

# the families docs/serving.md lists, with an example checkpoint each (tests build a tiny random one per row)
FAMILIES = {
    "llama": "Llama 2, Llama 3.x (rope llama3), SmolLM, TinyLlama, DeepSeek-R1-Distill-Llama",
    "mistral": "Mistral 7B (sliding window)",
    "qwen2": "Qwen2, Qwen2.5 (attention biases; sliding window where set)",
    "qwen3": "Qwen3 dense (q/k norms)",
    "phi3": "Phi-3, Phi-3.5, Phi-4-mini (fused qkv/gate-up, longrope, partial rotary)",
    "olmo2": "OLMo 2 (q/k norms over all heads, norms after attention and MLP)",
    "gemma": "Gemma (GeGLU, scaled embedding, 1+w norms)",
    "gemma2": "Gemma 2 (sliding window every other layer, soft-capping, four norms a layer)",
    "gemma3_text": "Gemma 3 text (q/k norms, local and global rope, sliding windows)",
}

# llama.cpp's `general.architecture` for a model_type; those whose GGUF linears `formats.gguf` reads as stored (the
# files transformers reads too: their other tensors still come through it), and those whose q/k rows llama.cpp
# permutes per rotary pair (its interleaved rope: Llama's files, Mistral's among them)
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3", "olmo2": "olmo2",
             "gemma": "gemma", "gemma2": "gemma2", "gemma3_text": "gemma3"}
GGUF_STORED = ("llama", "qwen2", "qwen3", "gemma2", "gemma3")
GGUF_PERMUTED = ("llama",)

ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")


@dataclass
class Rope:
    """One rotary embedding: cos/sin of a token's position over the first `dim` channels of a head.

    inv_freq: float32 [dim/2] (HF's `original_inv_freq`); scaling: HF's `attention_scaling` on cos and sin.
    longrope: from position `original` on, the long factors' `long_inv_freq` (per position: HF picks them for a
    whole forward call at once, and re-prefills a sequence that crosses; a batched step cannot). dynamic: from
    position `original` on, NTK-scaled frequencies for the position's own length (HF's rule when decoding one
    token a call)."""

    inv_freq: torch.Tensor
    scaling: float = 1.0
    dim: int = 0
    kind: str = "static"  # "static" | "longrope" | "dynamic"
    original: int = 0
    long_inv_freq: torch.Tensor | None = None
    base: float = 0.0
    factor: float = 1.0

    def to(self, device) -> Rope:
        inv = self.inv_freq.to(device)
        long = None if self.long_inv_freq is None else self.long_inv_freq.to(device)
        return Rope(inv, self.scaling, self.dim, self.kind, self.original, long, self.base, self.factor)

    def angles(self, positions: torch.Tensor) -> torch.Tensor:
        """positions [T] (float32, on the device) -> angles [T, dim/2] (capturable: no host reads)."""
        angles = positions[:, None] * self.inv_freq
        if self.kind == "longrope":
            angles = torch.where(positions[:, None] >= self.original, positions[:, None] * self.long_inv_freq, angles)
        elif self.kind == "dynamic":
            length = (positions + 1).double().clamp(min=self.original)
            base = self.base * ((self.factor * length / self.original) - (self.factor - 1)) ** (self.dim / (self.dim - 2))
            exps = torch.arange(0, self.dim, 2, device=positions.device).float() / self.dim
            scaled = positions[:, None] * (1.0 / (base.float()[:, None] ** exps))
            angles = torch.where(positions[:, None] >= self.original, scaled, angles)
        return angles

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, dim] in `dtype`, as HF's rotary embedding computes them."""
        angles = self.angles(positions)
        angles = torch.cat((angles, angles), -1)
        cos, sin = angles.cos(), angles.sin()
        if self.scaling != 1.0:
            cos, sin = cos * self.scaling, sin * self.scaling
        return cos.to(dtype)[:, None], sin.to(dtype)[:, None]


@dataclass
class Arch:
    """How one family's decoder layer computes (see `_FAMILY`); per-layer lists have one entry a layer."""

    model_type: str
    act: str = "silu"
    gemma: bool = False  # norms scale by (1 + w) in float32, the embedding by sqrt(hidden)
    norms: str = "pre"  # "pre" (Llama), "sandwich" (Gemma 2/3: also after attention and MLP), "post" (OLMo 2)
    qk_norm: str | None = None  # "head" (over each head: Qwen3, Gemma 3) or "full" (over all heads: OLMo 2)
    fused: bool = False  # q|k|v and gate|up stored as one weight each (Phi-3)
    qkv_bias: bool = False  # biases on q, k, v (Qwen2; Llama's attention_bias)
    scale: float = 1.0  # queries' scale
    attn_softcap: float | None = None
    final_softcap: float | None = None
    embed_scale: float | None = None
    windows: list[int | None] = field(default_factory=list)  # each layer's sliding window, None: full attention
    rope_of_layer: list[int] = field(default_factory=list)  # each layer's index into the model's ropes
    rotary_dim: int = 0
    head_dim: int = 0

    @property
    def norm_in_float32(self) -> bool:
        """Whether norms scale in float32 before casting back (Gemma's 1 + w, OLMo 2's w), not after (Llama's)."""
        return self.gemma or self.norms == "post"

    @property
    def fused_layer(self) -> bool:
        """Whether the fused CPU kernel computes this family's layer: Llama's, with q|k|v biases, q/k norms (per head
        or over all heads), GeGLU, and float32 norms (Gemma's 1 + w, OLMo 2's) before, around or after the
        attention and the MLP as options."""
        return self.act in ("silu", "gelu_tanh") and self.rotary_dim == self.head_dim

    def tp_reason(self) -> str | None:
        """Why tensor parallelism does not split this family, or None."""
        if self.qk_norm == "full":
            return "q/k norms over all heads (a rank holds some heads only)"
        return None


def arch_of(config) -> Arch:
    """The `Arch` of `config`, or `Unsupported` naming what is outside the lean forward."""
    family = _FAMILY.get(config.model_type)
    if family is None:
        raise Unsupported(f"model type {config.model_type!r}")
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    if config.model_type.startswith("gemma") and act == "gelu":
        act = "gelu_pytorch_tanh"  # as HF's Gemma configs read the legacy value
    if act not in ACTIVATIONS:
        raise Unsupported(f"activation {act!r}")
    if getattr(config, "mlp_bias", False):
        raise Unsupported("MLP bias")
    if getattr(config, "pretraining_tp", 1) not in (1, None):
        raise Unsupported("pretraining_tp")
    if getattr(config, "use_bidirectional_attention", False):
        raise Unsupported("bidirectional attention")
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    count = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if types is not None:
        if any(t not in ("full_attention", "sliding_attention") for t in types):
            raise Unsupported(f"layer types {sorted(set(types))}")
        windows = [window if t == "sliding_attention" else None for t in types[:count]]
    else:  # Mistral, Phi-3: one window for every layer, where set
        windows = [window] * count
    longest = getattr(config, "max_position_embeddings", None)
    windows = [w if w is not None and (longest is None or w < longest) else None for w in windows]  # else: never masks
    gemma = family.get("gemma", False)
    scalar = getattr(config, "query_pre_attn_scalar", None)
    a = Arch(config.model_type, act=ACTIVATIONS[act], gemma=gemma, norms=family.get("norms", "pre"),
             qk_norm=family.get("qk_norm"), fused=family.get("fused", False),
             scale=(scalar if gemma and scalar else head_dim) ** -0.5,
             attn_softcap=getattr(config, "attn_logit_softcapping", None) if config.model_type == "gemma2" else None,
             final_softcap=getattr(config, "final_logit_softcapping", None),
             embed_scale=config.hidden_size**0.5 if gemma else None, windows=windows, head_dim=head_dim,
             qkv_bias=config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False)))
    ropes = _rope_params(config)
    for params in ropes.values():
        kind = params.get("rope_type", "default")
        if kind not in ROPE_TYPES:
            raise Unsupported(f"rope type {kind!r}")
    partial = next(iter(ropes.values())).get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    a.rotary_dim = int(head_dim * (partial or 1.0))
    return a


def _rope_params(config) -> dict[str, dict]:
    """{layer type or "": rope parameters} (Gemma 3 has one per attention type)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if params and all(isinstance(v, dict) for v in params.values()):
        return params
    return {"": params}


def model_ropes(model, a: Arch) -> list[Rope]:
    """The model's rotary embeddings, read from its HF rotary module (the frequencies HF computes with), and
    `a.rope_of_layer` set."""
    config = model.config
    rotary = model.model.rotary_emb
    types = _rope_params(config)
    layer_types = getattr(config, "layer_types", None)
    present = set(layer_types[: config.num_hidden_layers]) if layer_types else None
    # the rope types some layer uses (HF builds no rope for a type no layer has: an all-sliding Gemma 3)
    names = [t for t in types if t and (present is None or t in present)] or [""]
    ropes = []
    for name in names:
        prefix = f"{name}_" if name else ""
        params = types.get(name, {})
        kind = params.get("rope_type", "default")
        inv = getattr(rotary, f"{prefix}original_inv_freq", None)
        if inv is None:
            inv = getattr(rotary, f"{prefix}inv_freq")
        scaling = getattr(rotary, f"{prefix}attention_scaling", getattr(rotary, "attention_scaling", 1.0))
        rope = Rope(inv.detach().float().cpu(), float(scaling), 2 * inv.shape[0])
        if kind == "longrope":
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            original = params.get("original_max_position_embeddings") or config.max_position_embeddings
            kwargs = {"layer_type": name} if name else {}
            long, _ = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=original + 1, **kwargs)
            rope.kind, rope.original, rope.long_inv_freq = "longrope", original, long.float()
        elif kind == "dynamic":
            rope.kind, rope.original = "dynamic", config.max_position_embeddings
            rope.base, rope.factor = float(params["rope_theta"]), float(params["factor"])
        ropes.append(rope)
    if len(names) == 1:
        a.rope_of_layer = [0] * config.num_hidden_layers
    else:
        a.rope_of_layer = [names.index(t) for t in layer_types[: config.num_hidden_layers]]
    if any(rope.dim != a.rotary_dim for rope in ropes):
        raise Unsupported(f"rotary dimensions {[r.dim for r in ropes]} where the config says {a.rotary_dim}")
    return ropes


def kernel_path(a: Arch) -> str:
    """What specserve's CPU kernels run of a bfloat16 step of this arch (where they run at all: `kernels.cpu`)."""
    if not a.fused_layer:
        return "attention; the rest op by op (" + _not_fused(a) + ")"
    return "fused layers"


def _not_fused(a: Arch) -> str:
    parts = []
    if a.act not in ("silu", "gelu_tanh"):
        parts.append(f"activation {a.act}")
    if a.rotary_dim != a.head_dim:
        parts.append("partial rotary")
    return ", ".join(parts)


def describe_path(config) -> str:
    """Which path a model of `config` takes in a serving worker, and why (a worker says it once it loaded the
    model: `workers.actors.say_path`)."""
    try:
        a = arch_of(config)
    except Unsupported as e:
        return f"one session at a time through the Hugging Face forward ({e} is outside the lean forward)"
    windows = sorted({w for w in a.windows if w is not None})
    extra = f", sliding window {windows[0]} on {sum(w is not None for w in a.windows)} of {len(a.windows)} layers" \
        if windows else ""
    return f"{a.model_type}: the batched KV pool{extra}; bfloat16 CPU kernels: {kernel_path(a)}"


def table() -> str:
    """docs/serving.md's table of supported architectures, from the code (each family's transformers defaults)."""
    from transformers import AutoConfig

    rows = [("| family (`model_type`) | for example | batched pool, step runner / CUDA graphs | CPU kernels (bfloat16) "
             "| tensor parallel | int8 / int4 at load | GGUF as stored |"),
            "|---|---|---|---|---|---|---|"]
    for model_type, example in FAMILIES.items():
        a = arch_of(AutoConfig.for_model(model_type))
        tp = "yes" if a.tp_reason() is None else f"no: {a.tp_reason()}"
        gguf = "yes" if GGUF_ARCH[model_type] in GGUF_STORED else "no: loads dense (int8/int4 at load)"
        rows.append(f"| {model_type} | {example} | yes | {kernel_path(a)} | {tp} | yes | {gguf} |")
    return "\n".join(rows)




if __name__ == "__main__":
    print(table())
