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
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specserve.models.kernels import cpu

# Rows from which a CPU layer multiplies a dense bfloat16 copy instead (`QuantizedLinear`): the packed
# kernels' time grows with every row, a bfloat16 GEMM's barely (docs/benchmarks.md). None on CUDA until measured.
CPU_DENSE_FROM = 8
# Dense bfloat16 CPU weights kept in oneDNN's layout (`PackedDense`); SPECSERVE_PACK_DENSE=0 keeps plain tensors.
PACK_DENSE: bool = os.environ.get("SPECSERVE_PACK_DENSE", "1") != "0"


def dense_from(device) -> int:
    return CPU_DENSE_FROM if torch.device(device).type == "cpu" else 0


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


@dataclass
class Blocks:
    """A weight [N, K] in GGUF's blocks, its stored numbers kept as they are (`formats.gguf` reads them):

        w[n, k] = scale · (codes[n, k] + offset) + m[n, k // span] · mn[n, g],  scale = d[n, k // span] · sc[n, g]

    for the group g = k // group. d and m are float16 values (a super-block's, or a legacy block's own), sc and
    mn small integers (K-quants' sub-block scales and mins; 1 for legacy blocks), so scale and the min term are
    exact in float32 and `dequantize` rounds as `gguf.quants.dequantize` does.
    """

    codes: torch.Tensor  # uint8 [N, K], 0 <= code < 2**bits
    bits: int  # 4, 5, 6 or 8
    group: int  # inputs per (sc, mn)
    span: int  # inputs per (d, m): 256 for K-quants, = group for legacy blocks
    d: torch.Tensor  # float32 [N, K / span]
    m: torch.Tensor  # float32 [N, K / span] (zeros without mins)
    sc: torch.Tensor  # int8 [N, K / group]
    mn: torch.Tensor  # int8 [N, K / group] (zeros without mins)
    offset: int  # added to every code: -128 (Q8_0), -32 (Q6_K), -16 (Q5_0), -8 (Q4_0), -4 (Q3_K) or 0
    source: str  # the GGUF types it holds, for messages ("Q4_K", "Q4_K+Q6_K")

    @property
    def has_min(self) -> bool:
        return bool(self.mn.any())

    @property
    def activation_group(self) -> int:
        """Inputs per activation scale in the CPU kernels: a span where they multiply sub-block scales into integer
        sums (6-bit K-quants: Q6_K and weights fused with it; csrc `integer_scaled`), else a group."""
        scaled = bool((self.sc != 1).any()) and self.bits == 6 and self.span <= 256 and self.span % self.group == 0
        return self.span if scaled else self.group

    def scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, min term) per group, float32 [N, K / group] each: exact products of the stored numbers."""
        per = self.span // self.group
        d, m = self.d.repeat_interleave(per, 1), self.m.repeat_interleave(per, 1)
        return d * self.sc.float(), m * self.mn.float()

    def dequantize(self) -> torch.Tensor:
        n, k = self.codes.shape
        scale, low = self.scales()
        q = (self.codes.view(n, k // self.group, self.group).to(torch.int32) + self.offset).float()
        return (scale[..., None] * q + low[..., None]).view(n, k)

    @staticmethod
    def cat(parts: list) -> Blocks:
        """Rows of several weights (`Blocks` or legacy `Int4Groups`, e.g. q|k|v of Q4_K and Q6_K) as one `Blocks`,
        losslessly: the finest group and span, codes shifted to the lowest offset, as many bits as that needs."""
        parts = [p if isinstance(p, Blocks) else Blocks.from_int4(p) for p in parts]
        group, span = min(p.group for p in parts), min(p.span for p in parts)
        offset = min(p.offset for p in parts)
        top = max((1 << p.bits) - 1 + p.offset - offset for p in parts)
        bits = next((b for b in (4, 5, 6, 8) if top < 1 << b), None)
        if bits is None or any(p.span % span or p.group % group or span % group for p in parts):
            raise ValueError(f"cannot fuse GGUF weights of types {[p.source for p in parts]} into one layer")

        def refined(p: Blocks) -> tuple[torch.Tensor, ...]:
            gs, ss = p.group // group, p.span // span
            return ((p.codes.to(torch.int16) + (p.offset - offset)).to(torch.uint8),
                    p.d.repeat_interleave(ss, 1), p.m.repeat_interleave(ss, 1),
                    p.sc.repeat_interleave(gs, 1), p.mn.repeat_interleave(gs, 1))

        codes, d, m, sc, mn = (torch.cat(f) for f in zip(*(refined(p) for p in parts)))
        source = "+".join(dict.fromkeys(s for p in parts for s in p.source.split("+")))
        return Blocks(codes, bits, group, span, d, m, sc, mn, offset, source)

    @staticmethod
    def from_int4(w: Int4Groups) -> Blocks:
        """A legacy Q4_0/Q4_1 `Int4Groups` (w = (codes - 8) · scale + zero) as `Blocks`, where that is exact."""
        low = w.zero - 8 * w.scale
        if not (torch.equal(low.half().float(), low) and torch.equal(low + 8 * w.scale, w.zero)):
            raise ValueError("an int4 weight whose zero is not a float16 minimum cannot join GGUF blocks")
        ones = torch.ones_like(w.scale, dtype=torch.int8)
        return Blocks(w.codes, 4, w.group, w.group, w.scale, low, ones, ones, 0, "Q4")

    def rows(self, index: torch.Tensor) -> Blocks:
        return Blocks(self.codes[index], self.bits, self.group, self.span, self.d[index], self.m[index],
                      self.sc[index], self.mn[index], self.offset, self.source)

    def cols(self, start: int, stop: int) -> Blocks:
        """Inputs [start, stop) of every row, whole super-blocks only."""
        if start % self.span or stop % self.span:
            raise ValueError(f"a shard's inputs [{start}, {stop}) split GGUF super-blocks of {self.span}")
        s, g = slice(start // self.span, stop // self.span), slice(start // self.group, stop // self.group)
        return Blocks(self.codes[:, start:stop].contiguous(), self.bits, self.group, self.span,
                      self.d[:, s].contiguous(), self.m[:, s].contiguous(), self.sc[:, g].contiguous(),
                      self.mn[:, g].contiguous(), self.offset, self.source)


Quantized = Int8Rows | Int4Groups | Blocks


def concat(parts: list[Quantized]) -> Quantized:
    """Rows of several quantized weights of one layer as one weight (q|k|v, gate|up)."""
    kinds = {type(p) for p in parts}
    if kinds == {Int8Rows} or kinds == {Int4Groups} and len({p.group for p in parts}) == 1:
        return parts[0].cat(parts)
    if kinds <= {Blocks, Int4Groups}:
        return Blocks.cat(parts)
    raise ValueError(f"cannot fuse weights of kinds {sorted(k.__name__ for k in kinds)} into one layer")


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
    int4_head: bool = False  # under int4, the LM head too (a draft's: `loading.load_model`)

    def for_head(self, rows: int) -> QuantSpec:
        """The LM head's (of `rows` outputs): under int4 int8 rows, unless `int4_head` and the rows fill the int4
        packing's tiles of 16; else as the linears."""
        int4 = self.int4_head and rows % 16 == 0
        return QuantSpec("int8", self.group, None, self.dense_from) if self.method == "int4" and not int4 else self

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
        self.bits = 8 if isinstance(weight, Int8Rows) else getattr(weight, "bits", 4)
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
        elif isinstance(weight, Blocks):  # no kernel of torch's reads GGUF blocks: their values, dense
            # dense_from 0: every call, one of no rows included, multiplies the dense values
            self.packed, self.scales, self.dense_from = dense(weight.dequantize().to(self.device, dtype)), None, 0
            self.dense = self.packed
            return
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
        return self.packed.nbytes + (0 if self.scales is None else self.scales.nbytes)

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

    def __getstate__(self) -> dict:  # oneDNN's layout has no file form: saved plain, packed again when read
        return {"weight": self.packed.to_dense()}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["weight"])

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
