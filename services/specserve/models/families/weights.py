"""The weights the lean forward (`models.families.lean`) multiplies: a model's layers fused (q|k|v, gate|up), cast to the
compute dtype, packed (dense, or quantized: `models.kernels.quant`) and, for a tensor-parallel rank, cut to its shard
(`models.kernels.tp`). Made once per model, dtype and shard; the forward never looks at the HF modules again.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from specserve.models.families.arch import Arch, Rope, arch_of, model_ropes
from specserve.models.kernels.quant import QuantizedLinear, concat, quantize
from specserve.models.kernels.quant import dense as packed_dense
from specserve.models.kernels.tp import Collective, Shard, linear_parts, take

# each linear role of a decoder layer and the module holding it (in HF's names, as checkpoints store them)
LINEAR_ROLES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
                "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}


# Phi-3 stores q|k|v and gate|up as one weight each: a role is a slice of its rows
FUSED_ROLES = {"q": "self_attn.qkv_proj", "k": "self_attn.qkv_proj", "v": "self_attn.qkv_proj",
               "o": "self_attn.o_proj", "gate": "mlp.gate_up_proj", "up": "mlp.gate_up_proj", "down": "mlp.down_proj"}


class Layer(NamedTuple):
    """One decoder layer's weights as the lean forward multiplies them (`models.families.arch` says which are set)."""

    norm_in: torch.Tensor | None  # before attention (None: OLMo 2)
    qkv: object  # q|k|v fused (dense or `quant.QuantizedLinear`)
    b_qkv: torch.Tensor | None
    o: object
    b_o: torch.Tensor | None  # added once, after a tensor-parallel all-reduce
    norm_mlp: torch.Tensor | None  # before the MLP (None: OLMo 2)
    gate_up: object
    down: object
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    norm_attn_out: torch.Tensor | None = None  # on the attention's output (Gemma 2/3, OLMo 2)
    norm_mlp_out: torch.Tensor | None = None  # on the MLP's output
    window: int | None = None  # sliding window (None: full attention)
    rope: int = 0  # index into `LeanWeights.ropes`

    def weights(self) -> list:
        """Its weights that are set (tensors and linear layers), not its window and rope."""
        return [t for t in self[:-2] if t is not None]


def role_weights(layer, arch: Arch, config) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """{role: (weight, bias)} of an HF decoder layer, fused weights (Phi-3) cut into their roles (views)."""
    if not arch.fused:
        out = {}
        for role, path in LINEAR_ROLES.items():
            module = layer.get_submodule(path)
            out[role] = (module.weight, module.bias)
        return out
    d = arch.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    qkv, gate_up = layer.self_attn.qkv_proj, layer.mlp.gate_up_proj
    inter = gate_up.weight.shape[0] // 2

    def rows(module, start, stop):
        return module.weight[start:stop], None if module.bias is None else module.bias[start:stop]

    return {"q": rows(qkv, 0, q), "k": rows(qkv, q, q + kv), "v": rows(qkv, q + kv, q + 2 * kv),
            "o": (layer.self_attn.o_proj.weight, layer.self_attn.o_proj.bias),
            "gate": rows(gate_up, 0, inter), "up": rows(gate_up, inter, 2 * inter),
            "down": (layer.mlp.down_proj.weight, layer.mlp.down_proj.bias)}


class LeanWeights:
    """A model's weights fused for `LeanSequence`, made once per model and compute dtype (and shard).

    A model loaded with a quantization (`loading.load_model`, `model.specserve_quant`) gets its linear layers as
    `quant.QuantizedLinear`s: quantized here from the dense weights (int8, int4), or taken as the GGUF file
    stores them; norms, biases and the embedding stay dense.

    shard: one rank's part of a tensor-parallel group (`models.kernels.tp`): its key/value groups' heads, its slice of
    the MLP and of the vocabulary; `heads` and `kv_heads` are then this rank's. The weights are quantized whole
    first, then cut, so every rank computes the values the unsharded model would.

    layers: (start, end), a pipeline stage's decoder layers only (`workers.stages`): the embedding is kept by the
    first stage alone (`first`), the final norm and the head by the last (`last`); None elsewhere.
    """

    def __init__(self, model, dtype: torch.dtype, shard: Shard | None = None, layers: tuple[int, int] | None = None):
        cfg = model.config
        spec = getattr(model, "specserve_quant", None)

        def cast(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.detach().to(dtype).contiguous()

        def fuse(parts: list, device: torch.device) -> object:
            """One (fused) linear weight from its roles' weights, dense tensors or `quant.Quantized` alike."""
            if spec is None:
                return packed_dense(cast(torch.cat(parts)))
            return QuantizedLinear(concat(parts), dtype, device, spec.dense_from)

        def quantized(stored, weight: torch.Tensor, spec):
            """A role's weight as the unsharded model holds it: dense, the file's, or quantized here (from the
            file's values where there is a file: a cheaper draft than the file's own types)."""
            if spec is None:
                return weight.detach()
            if stored is None:
                return quantize(weight.detach(), spec.method, spec.group)
            return stored if spec.method == "gguf" else quantize(stored.dequantize(), spec.method, spec.group)

        device = model.lm_head.weight.device
        self.dtype = dtype
        stored = spec.stored if spec is not None else None
        self.arch = arch = arch_of(cfg)
        self.ropes: list[Rope] = [r.to(device) for r in model_ropes(model, arch)]
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        per_group = self.heads // self.kv_heads
        rows: dict[str, slice | None] = {}
        cols: dict[str, slice | None] = {}
        held = getattr(model, "specserve_shard", None)  # loaded as a rank's slices (`models.formats.slices`)
        if held is not None and held != shard:
            raise ValueError(f"this model holds rank {held.rank} of {held.world}'s part of its linear layers only")
        if shard is not None:
            if arch.tp_reason() is not None:
                raise ValueError(f"tensor_parallel: {cfg.model_type} has {arch.tp_reason()}")
            groups = shard.kv_groups(self.kv_heads)
            self.heads, self.kv_heads = len(groups) * per_group, len(groups)
            if held is None:
                parts = linear_parts(shard, cfg)
                rows, cols = {r: p[0] for r, p in parts.items()}, {r: p[1] for r, p in parts.items()}
        self.eps = cfg.rms_norm_eps
        count = len(model.model.layers)
        start, end = layers or (0, count)
        if not 0 <= start < end <= count:
            raise ValueError(f"stage layers [{start}, {end}) outside the model's {count} layers")
        read = getattr(model, "specserve_layers", None)  # loaded as a stage's part (`models.formats.slices`)
        if read is not None and tuple(read) != (start, end):
            raise ValueError(f"this model holds layers [{read[0]}, {read[1]}) only, not [{start}, {end})")
        self.first, self.last = start == 0, end == count
        self.layers = []
        norm = self._norm_weight

        def optional(module, name: str):
            found = getattr(module, name, None)
            return None if found is None else norm(found.weight)

        for i in range(start, end):
            layer = model.model.layers[i]
            attn = layer.self_attn
            own = stored["layers"][i] if stored is not None else {}
            dense = role_weights(layer, arch, cfg)

            def weight(role: str, own=own, dense=dense):
                w = quantized(own.get(role), dense[role][0], spec)
                return take(w, rows.get(role), cols.get(role))

            def bias(role: str, dense=dense):
                b = dense[role][1]
                return b if b is None or rows.get(role) is None else b[rows[role]]

            at = attn.o_proj.weight.device
            b_qkv = [bias("q"), bias("k"), bias("v")]
            sandwich = arch.norms == "sandwich"
            self.layers.append(Layer(
                optional(layer, "input_layernorm"),
                fuse([weight("q"), weight("k"), weight("v")], at),
                None if b_qkv[0] is None else cast(torch.cat(b_qkv)),
                fuse([weight("o")], at),
                cast(dense["o"][1]),
                optional(layer, "pre_feedforward_layernorm" if sandwich else "post_attention_layernorm")
                if arch.norms != "post" else None,
                fuse([weight("gate"), weight("up")], at),
                fuse([weight("down")], at),
                q_norm=self._qk_norm(attn, "q_norm", rows.get("q")),
                k_norm=self._qk_norm(attn, "k_norm", rows.get("k")),
                norm_attn_out=optional(layer, "post_attention_layernorm") if arch.norms != "pre" else None,
                norm_mlp_out=optional(layer, "post_feedforward_layernorm") if arch.norms != "pre" else None,
                window=arch.windows[i],
                rope=arch.rope_of_layer[i],
            ))
            if held is not None or read is not None:  # a part read for this serves nothing else: freed now,
                # so a load peaks one layer over
                drop_linears(layer)
        self.norm = norm(model.model.norm.weight) if self.last else None
        head = model.lm_head.weight
        head_stored = stored["head"] if stored is not None else None
        subset = getattr(model, "token_subset", None)
        if subset is not None:
            if shard is not None:
                raise ValueError("a draft over a token subset does not run tensor-parallel")
            order = torch.argsort(subset)
            subset, head = subset[order], head[order]
            head_stored = None if head_stored is None else head_stored.rows(order)
            self.token_subset = subset.to("cpu")
        else:
            self.token_subset = None
        self.vocab_rows = head.shape[0] if self.last else cfg.vocab_size  # the head's rows, unsharded
        # a target's head stays int8 under int4 (as llama.cpp's Q4 files keep theirs at 6-8 bits); a draft's goes int4
        head_spec = None if spec is None else spec.for_head(head.shape[0])
        self.head = None  # a stage before the last hands its hidden states on
        if self.last:
            head = quantized(head_stored, head, head_spec)
            if shard is not None:
                head = take(head, shard.vocab(self.vocab_rows))
            self.head = packed_dense(cast(head)) if head_spec is None else \
                QuantizedLinear(head, dtype, device, head_spec.dense_from)
        # indexed per call, cast only the rows used
        embedding = model.model.embed_tokens  # its weight, or a module that looks rows up itself (a GGUF file's)
        self.embed = (embedding.weight if hasattr(embedding, "weight") else embedding) if self.first else None
        self.scale = arch.scale
        self.kernel_attention = True  # the CPU kernels' attention computes every family's (soft-capping too)
        self.device = device
        self.quantization = "none" if spec is None else spec.describe()
        self.tp: Collective | None = None  # set by a tensor-parallel pool (`KVPool`)


    def _norm_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """A norm's weight as `lean._rms` multiplies it: in the compute dtype after normalising (Llama's), or in
        float32 before casting (Gemma's 1 + w, OLMo 2's w)."""
        if self.arch.gemma:
            return (1.0 + weight.detach().float()).contiguous()
        if self.arch.norms == "post":
            return weight.detach().float().contiguous()
        return weight.detach().to(self.dtype).contiguous()

    def _qk_norm(self, attn, name: str, rows: slice | None) -> torch.Tensor | None:
        """A q/k norm's weight: per head (shared by a rank's heads) or over all heads (this rank's rows)."""
        module = getattr(attn, name, None)
        if module is None:
            return None
        weight = self._norm_weight(module.weight)
        return weight if self.arch.qk_norm == "head" or rows is None else weight[rows].contiguous()


def drop_linears(layer) -> None:
    """Free an HF decoder layer's linear weights once the lean forward holds its own."""
    for module in layer.modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        module.weight = torch.nn.Parameter(module.weight.new_empty(0), requires_grad=False)


def lean_weights(model, dtype: torch.dtype, shard: Shard | None = None, layers: tuple[int, int] | None = None
                 ) -> LeanWeights:
    cache = model.__dict__.setdefault("_specserve_lean", {})
    key = dtype if shard is None and layers is None else (dtype, shard, layers)
    dtypes = {k if isinstance(k, torch.dtype) else k[0] for k in cache}
    if dtype not in dtypes and dtypes and getattr(model, "specserve_quant", None) is not None:
        raise ValueError(f"a quantized model computes in {next(iter(dtypes))}, not {dtype}")
    if key not in cache:
        cache[key] = LeanWeights(model, dtype, shard, layers)
    return cache[key]
