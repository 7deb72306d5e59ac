"""A step's decoder layers as one call each into specserve's CPU kernels (`kernels.cpu`): the plan of which
layers of a model's `LeanWeights` fuse, made once per weights, and the call that runs them over a step's rows.
"""

from __future__ import annotations

import ctypes

import torch

from specserve.models.kernels.cpu import Attention, int8_activations, library
from specserve.models.kernels.quant import QuantizedLinear


class _Linear(ctypes.Structure):  # csrc: struct Linear
    _fields_ = [("kind", ctypes.c_int64), ("codes", ctypes.c_void_p), ("scales", ctypes.c_void_p),
                ("group", ctypes.c_int64), ("N", ctypes.c_int64), ("K", ctypes.c_int64)]


class FusedLayers:
    """Every decoder layer of a bfloat16 model whose four linear layers all run on these kernels (a bias on q|k|v,
    q/k norms, GeGLU, float32 norms, sandwiched or after the attention and the MLP only, soft-capped attention:
    Qwen2's, Qwen3's, Gemma's, Gemma 2's and 3's, OLMo 2's; no bias on the output's), as one `specserve_layers`
    call a step: a decode step's or a short verify block's ~20 torch ops a layer, with their dispatch, took a
    third of its time (docs/benchmarks.md). The same kernels in the same order as the per-op path, so its values
    are the per-op path's (tests/cpu/test_cpukernels.py)."""

    def __init__(self, layers: list, rows_below: int, flags: int = 0, ropes: list[int] | None = None):
        # (norm_in, norm_post, ctypes array of 4 _Linear, the linears they point into, sliding window or 0,
        # (q|k|v bias, q norm, k norm, attention output's norm, MLP output's norm)); each layer's 4 structs a view
        # into one array of all of them, for `specserve_layers`. flags: csrc specserve_layer's
        n = len(layers)
        self.flags = flags
        self._linears = (_Linear * (4 * n))()
        self.layers = []
        for i, (norm_in, norm_post, structs, linears, window, extras) in enumerate(layers):
            view = (_Linear * 4).from_buffer(self._linears, 4 * i * ctypes.sizeof(_Linear))
            for j in range(4):
                view[j] = structs[j]
            self.layers.append((norm_in, norm_post, view, linears, window, extras))
        self._norms_in, self._norms_post = (
            (ctypes.c_void_p * n)(*[None if layer[j] is None else layer[j].data_ptr() for layer in layers])
            for j in range(2))
        # q|k|v's bias, the q and k norms, the outputs' norms: a layer's tensor or null (the layers keep them alive)
        self._b_qkv, self._q_norm, self._k_norm, self._norms_attn_out, self._norms_mlp_out = (
            (ctypes.c_void_p * n)(*[None if layer[5][j] is None else layer[5][j].data_ptr() for layer in layers])
            for j in range(5))
        self._windows = (ctypes.c_int64 * n)(*[layer[4] for layer in layers])
        self.ropes = ropes or [0] * n  # each layer's rotary table (Gemma 3: local and global)
        self.rows_below = rows_below  # steps of fewer rows than this (no layer's dense copy taking over)
        lin = layers[0][2]
        self.hidden, self.inter = lin[0].K, lin[2].N // 2
        self.qkv = lin[0].N
        self.max_groups = max(l.K // l.group if l.kind in (4, 5, 6) else 1 for layer in layers for l in layer[2])
        self.int8_activations = False
        self._int4_kind()

    def _int4_kind(self) -> None:
        """The int4 linears' kind for `ACTIVATIONS` now (4: bfloat16 activations, 5: int8), as `int4_mm` reads it."""
        if self.int8_activations != int8_activations():
            self.int8_activations = not self.int8_activations
            for _, _, structs, *_ in self.layers:
                for s in structs:
                    if s.kind in (4, 5):
                        s.kind = 5 if self.int8_activations else 4

    @classmethod
    def plan(cls, w) -> FusedLayers | None:
        """The plan for `LeanWeights` w, or None where a layer cannot be fused (made once per weights)."""
        if not (w.arch.fused_layer and w.kernel_attention):
            return None
        rows_below, layers = 1 << 30, []
        for layer in w.layers:
            linears = (layer.qkv, layer.o, layer.gate_up, layer.down)
            if layer.b_o is not None or any(not isinstance(q, QuantizedLinear) or q.kernel is None for q in linears):
                return None
            structs = (_Linear * 4)()
            for s, q in zip(structs, linears):
                kind, codes, scales, group = q.kernel
                if kind == "blocks":  # codes: the PackedBlocks, whose struct says the rest
                    s.kind, s.codes, s.scales = 6, codes.address, None
                else:
                    s.kind, s.codes, s.scales = (4 if kind == "int4" else 8), codes.data_ptr(), scales.data_ptr()
                s.group, s.N, s.K = group or 0, q.out_features, q.in_features
                if q.dense is not None:
                    rows_below = min(rows_below, q.dense_from)
            # the linears keep the addresses valid
            extras = tuple(None if t is None else t.contiguous() for t in (layer.b_qkv, layer.q_norm, layer.k_norm,
                                                                             layer.norm_attn_out, layer.norm_mlp_out))
            layers.append((layer.norm_in, layer.norm_mlp, structs, linears, layer.window or 0, extras))
        flags = (1 if w.arch.norm_in_float32 else 0) | (2 if w.arch.act == "gelu_tanh" else 0) \
            | (4 if w.arch.qk_norm == "full" else 0)
        return cls(layers, rows_below, flags, [layer.rope for layer in w.layers]) if layers else None

    def run(self, x: torch.Tensor, tables: list[tuple[torch.Tensor, torch.Tensor]], attention: Attention,
            heads: int, kv_heads: int, head_dim: int, eps: float) -> None:
        """Every layer over x [T, hidden] (bfloat16, contiguous; updated in place) with `attention`'s sequences
        (all of the step's). tables: the (cos, sin) of each of the model's ropes at the rows' positions."""
        self._int4_kind()
        t = x.shape[0]
        per_row = 2 * self.hidden + 2 * self.qkv + heads * head_dim + 3 * self.inter
        scratch = torch.empty(t * per_row, dtype=torch.bfloat16)
        xsum = torch.empty(t * self.max_groups, dtype=torch.float32)
        flat = [(c.reshape(t, head_dim).contiguous(), s.reshape(t, head_dim).contiguous()) for c, s in tables]
        n = len(self.layers)
        cos = (ctypes.c_void_p * n)(*[flat[r][0].data_ptr() for r in self.ropes])
        sin = (ctypes.c_void_p * n)(*[flat[r][1].data_ptr() for r in self.ropes])
        k, v = attention.k, attention.v
        library().specserve_layers(
            x.data_ptr(), t, self.hidden, n, self._norms_in, self._norms_post, self._norms_attn_out,
            self._norms_mlp_out, self.flags, eps, self._linears, self._b_qkv, self._q_norm, self._k_norm, cos, sin,
            k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), attention.info.data_ptr(), attention.count, heads,
            kv_heads, head_dim, attention.scale, attention.softcap, self._windows, scratch.data_ptr(), xsum.data_ptr())
