"""Weight-only quantized linear layers for the lean forward (`weights.LeanWeights`), target and draft alike.

A decode step reads every weight once per token, so its time is the bytes read; int8 halves them against
bfloat16 and int4 quarters them. Activations stay in the compute dtype (bfloat16: torch's packed CPU kernels
are fast only there), weights stay packed, and each layer multiplies through torch's own kernels:

- int8, one scale per output row: `aten._weight_int8pack_mm`;
- int4, groups of 32/64/128 inputs with a scale and an offset each (w = (q - 8)·scale + zero):
  `aten._weight_int4pack_mm_for_cpu` on CPUs, `aten._weight_int4pack_mm` on CUDA;
- on AVX-512 CPUs with bfloat16 dot products, specserve's own kernels for both (`kernels.cpu`), which read the
  weights once for up to 8 rows where torch's read them every 4.

From enough rows on (8 with torch's CPU kernels; with ours on AVX-512, `cpu.DENSE_FROM` when set: a
batch of streams, a prefill chunk) a dense bfloat16 GEMM over the same values beats them (docs/benchmarks.md). A layer
therefore also keeps its weights dequantized to bfloat16 when `dense_from` rows or more are common
(`QuantizedLinear.dense_from`; on CPUs in oneDNN's layout, `PackedDense`, as a dense model's are);
both compute the same quantized values, the kernel choice only changes rounding in the last bits, as a
different batch size does for a dense model.

A GGUF file's own quantization reaches these layers through `formats.gguf`. A quantized target is a different model from the dense one; the
output is exactly the quantized target's distribution (docs/serving.md, tests/cpu/test_quant.py).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specserve.models.kernels import cpu

METHODS = ("auto", "none", "gguf", "int8", "int4")
# Rows from which a CPU layer multiplies a dense bfloat16 copy instead (`QuantizedLinear`): the packed
# kernels' time grows with every row, a bfloat16 GEMM's barely (docs/benchmarks.md). None on CUDA until measured.
CPU_DENSE_FROM = 8
# Dense bfloat16 CPU weights kept in oneDNN's layout (`PackedDense`); SPECSERVE_PACK_DENSE=0 keeps plain tensors.
PACK_DENSE: bool = os.environ.get("SPECSERVE_PACK_DENSE", "1") != "0"


def dense_from(device) -> int:
    return CPU_DENSE_FROM if torch.device(device).type == "cpu" else 0
INT4_GROUPS = (32, 64, 128)


def parse(spec: str | None) -> tuple[str, int]:
    """(method, int4 group) of a quantization spec: auto, none, gguf, int8, int4 or int4-g32/-g64/-g128."""
    text = "auto" if spec is None else str(spec).lower()
    m = re.fullmatch(r"int4(?:-g(\d+))?", text)
    if m:
        group = int(m.group(1) or 32)
        if group not in INT4_GROUPS:
            raise ValueError(f"quantization int4 groups must be one of {INT4_GROUPS}, got {group}")
        return "int4", group
    if text not in METHODS:
        raise ValueError(f"quantization must be one of {', '.join(METHODS)} or int4-g64/int4-g128, got {spec!r}")
    return text, 32


@dataclass
class Int8Rows:
    """An int8 weight [N, K] with one scale per row: w = codes · scale."""

    codes: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # float32 [N]

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int8Rows:
        w = weight.detach().float()
        scale = (w.abs().amax(1) / 127).clamp(min=1e-12)
        return cls((w / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale)

    def dequantize(self) -> torch.Tensor:
        return self.codes.float() * self.scale[:, None]

    @staticmethod
    def cat(parts: list[Int8Rows]) -> Int8Rows:
        return Int8Rows(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]))

    def rows(self, index: torch.Tensor) -> Int8Rows:
        return Int8Rows(self.codes[index], self.scale[index])

    def cols(self, start: int, stop: int) -> Int8Rows:
        """Inputs [start, stop) of every row (a row-parallel shard keeps the whole row's scale)."""
        return Int8Rows(self.codes[:, start:stop].contiguous(), self.scale)


@dataclass
class Int4Groups:
    """An int4 weight [N, K] in groups of `group` inputs: w = (codes - 8) · scale + zero."""

    codes: torch.Tensor  # uint8 [N, K], values 0..15
    scale: torch.Tensor  # float32 [N, K / group]
    zero: torch.Tensor  # float32 [N, K / group]
    group: int

    @classmethod
    def quantize(cls, weight: torch.Tensor, group: int) -> Int4Groups:
        n, k = weight.shape
        if k % group:
            raise ValueError(f"int4 groups of {group} do not divide a layer's {k} inputs; use a smaller group")
        w = weight.detach().float().view(n, k // group, group)
        low, high = w.amin(-1), w.amax(-1)
        # scale and minimum in float16, as GGUF's Q4_1 blocks keep them (and specserve's CPU kernel reads them)
        low = low.clamp(-65504, 65504).half().float()
        scale = ((high - low) / 15).clamp(2**-24, 65504).half().float()
        codes = ((w - low[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8)
        return cls(codes.view(n, k), scale, low + 8 * scale, group)

    def dequantize(self) -> torch.Tensor:
        n, k = self.codes.shape
        q = self.codes.view(n, k // self.group, self.group).float() - 8
        return (q * self.scale[..., None] + self.zero[..., None]).view(n, k)

    @staticmethod
    def cat(parts: list[Int4Groups]) -> Int4Groups:
        return Int4Groups(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]),
                          torch.cat([p.zero for p in parts]), parts[0].group)

    def rows(self, index: torch.Tensor) -> Int4Groups:
        return Int4Groups(self.codes[index], self.scale[index], self.zero[index], self.group)

    def cols(self, start: int, stop: int) -> Int4Groups:
        """Inputs [start, stop) of every row, whole groups only."""
        if start % self.group or stop % self.group:
            raise ValueError(f"a shard's inputs [{start}, {stop}) split int4 groups of {self.group}")
        g = slice(start // self.group, stop // self.group)
        return Int4Groups(self.codes[:, start:stop].contiguous(), self.scale[:, g].contiguous(),
                          self.zero[:, g].contiguous(), self.group)


Quantized = Int8Rows | Int4Groups


@dataclass
class QuantSpec:
    """How a loaded model's linear layers are quantized (`model.specserve_quant`, read by `weights.LeanWeights`).

    method: "gguf" (as `stored`, from the file), "int8" or "int4" (groups of `group`, quantized at load).
    """

    method: str
    group: int = 32
    stored: dict | None = None  # `formats.gguf.gguf_linears` of the file
    dense_from: int = 0  # `QuantizedLinear.dense_from`
    source: str = ""  # the file's main tensor type, for "gguf"

    def for_head(self) -> QuantSpec:
        """The LM head's: int8 rows unless the file stores its own."""
        return QuantSpec("int8", self.group, None, self.dense_from) if self.method == "int4" else self

    def describe(self) -> str:
        if self.method == "gguf":
            return f"gguf-{self.source}" if self.source else "gguf"
        return f"int4-g{self.group}" if self.method == "int4" else self.method


class QuantizedLinear:
    """x [M, K] → x·Wᵀ [M, N] in x's dtype, for a packed weight-only quantized W (see the module docstring).

    dense_from: from this many rows of x on, multiply by the weight dequantized to the compute dtype (kept
    beside the packed one); 0 keeps no dense copy.
    """

    def __init__(self, weight: Quantized, dtype: torch.dtype, device: torch.device | str, dense_from: int = 0):
        self.bits = 8 if isinstance(weight, Int8Rows) else 4
        self.out_features, self.in_features = weight.codes.shape
        self.dtype, self.device = dtype, torch.device(device)
        self.dense_from = dense_from
        self.group = getattr(weight, "group", None)
        cuda = self.device.type == "cuda"
        # specserve's CPU kernels where they run (kernels/cpu.py), else torch's
        self.kernel = None if cuda or dtype != torch.bfloat16 else cpu.packed(weight)
        if self.kernel is not None:
            self.packed, self.scales = self.kernel[1:3]
            self.dense_from = dense_from = max(dense_from, cpu.DENSE_FROM) if dense_from and \
                cpu.kernels_keep_dense_copy() else 0
        elif self.bits == 8:
            self.packed = weight.codes.to(self.device).contiguous()
            self.scales = weight.scale.to(self.device, dtype)
        else:
            codes = weight.codes.to(torch.int32 if not cuda else torch.uint8)
            if cuda:  # two codes a byte, the first high (the layout aten expects since torch 2.5)
                codes = (codes[:, ::2] << 4 | codes[:, 1::2]).to(self.device)
                tiles = max(t for t in (8, 4, 2) if self.in_features % (t * 16) == 0)
                self.packed = torch.ops.aten._convert_weight_to_int4pack(codes, tiles)
            else:
                self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
            self.scales = torch.stack([weight.scale.t(), weight.zero.t()], -1).to(self.device, dtype).contiguous()
        self.dense = dense(weight.dequantize().to(self.device, dtype)) if dense_from else None

    @property
    def nbytes(self) -> int:
        """Bytes a multiply below `dense_from` rows reads (the packed weight and its scales)."""
        return self.packed.nbytes + self.scales.nbytes

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.dense is not None and x.shape[0] >= self.dense_from:
            return linear(x, self.dense, bias)
        if self.kernel is not None:
            y = cpu.multiply(x, self.kernel)
        elif self.bits == 8:
            y = torch.ops.aten._weight_int8pack_mm(x, self.packed, self.scales)
        elif self.device.type == "cuda":
            y = torch.ops.aten._weight_int4pack_mm(x, self.packed, self.group, self.scales)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group, self.scales)
        return y if bias is None else y + bias


class PackedDense:
    """A dense bfloat16 CPU weight [N, K] kept in oneDNN's blocked layout, reordered once: `F.linear` reorders
    a plain weight on every call, which on a small step costs as much as the multiply (docs/benchmarks.md).
    Results equal `F.linear`'s where that runs oneDNN too, else differ in bfloat16 rounding only."""

    def __init__(self, weight: torch.Tensor):
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 1)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if torch.compiler.is_compiling():  # an opaque op there: Inductor's own lowering rejects the packed layout
            return torch.ops.specserve.packed_linear(x, self.packed, bias)
        return _onednn_linear(x, self.packed, bias)


def _onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@torch.library.custom_op("specserve::packed_linear", mutates_args=())
def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _onednn_linear(x, packed, bias)


@_packed_linear.register_fake
def _(x, packed, bias):
    return x.new_empty(*x.shape[:-1], packed.shape[0])  # oneDNN's blocked weight keeps its [N, K] shape


def dense(weight: torch.Tensor | None):
    """A dense linear weight for the lean forward: `PackedDense` where oneDNN's bfloat16 path runs it (CPU, bf16),
    else the tensor as it is."""
    if (weight is not None and PACK_DENSE and weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and cpu.onednn_bf16()):
        return PackedDense(weight)
    return weight


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for a dense weight tensor, a `PackedDense` or a `QuantizedLinear`."""
    return F.linear(x, weight, bias) if isinstance(weight, torch.Tensor) else weight(x, bias)


def nbytes(weight) -> int:
    """Bytes one small step reads of a dense or quantized weight (0 for None)."""
    return 0 if weight is None else weight.nbytes


def quantize(weight: torch.Tensor, method: str, group: int = 32) -> Quantized:
    """A dense weight [N, K] quantized by `method` ("int8" or "int4")."""
    return Int4Groups.quantize(weight, group) if method == "int4" else Int8Rows.quantize(weight)
