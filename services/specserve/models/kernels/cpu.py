"""specserve's own CPU kernels (csrc/cpu.cpp), built on first use: weight-only int4 and int8 layers, and the
attention and RMS norms of a bfloat16 step.

torch's CPU kernels (`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`) read the weights again for every
four rows of activations (a 5-row product costs twice a 4-row one), so a verify block cost two and a half
decode steps (docs/benchmarks.md). These read the weights once for up to eight rows. The attention reads the
pool's arena in place (torch's fused attention and composite RMS norm took a third of a decode step in dispatch
and threading). Each row of a result is computed the same way whatever else is computed with it.

One source is compiled for the CPU's instruction set: AVX-512 with bfloat16 dot products (`avx512_bf16`), else
AVX2 with FMA and F16C (most laptops); both round every value the same way, so they give the same bits.
`SPECSERVE_CPU_ISA=avx2` runs the AVX2 build on an AVX-512 CPU too (`avx512`, `auto` the default). They need
bfloat16 activations and a C++ compiler (`g++`, or `$CXX`); the shared library is cached under
`$SPECSERVE_CACHE` (default `~/.cache/specserve`) by a hash of the source and flags. Without them, or with
`SPECSERVE_CPU_KERNELS=0`, torch's ops run (`kernels.quant.QuantizedLinear`, `families.lean._lean_forward`, `families.lean._rms`);
`describe()` says which path runs and why.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("csrc") / "cpu.cpp"
FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp"]
# the builds, best first: (compiler flags, /proc/cpuinfo flags they need, name in messages)
ISAS = {
    "avx512": (["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni", "-mfma"],
               {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"}, "AVX-512 bf16+VNNI"),
    "avx2": (["-mavx2", "-mfma", "-mf16c"], {"avx2", "fma", "f16c"}, "AVX2+FMA"),
}
ISA: str = os.environ.get("SPECSERVE_CPU_ISA", "auto")  # a build of ISAS, or auto: the best this CPU runs
ENABLED: bool = os.environ.get("SPECSERVE_CPU_KERNELS", "1") != "0"
# int4 products' activations: "int8" quantized per row and weight group, as llama.cpp's Q4 x Q8 products do
# (integer dot products: exact, so both builds still compute the same bits), or "bf16" as given
ACTIVATIONS: str = os.environ.get("SPECSERVE_CPU_ACTIVATIONS", "int8")
# a step's decoder layers as one call each (`FusedLayers`); 0 keeps the per-op path (same values), to compare
FUSED: bool = os.environ.get("SPECSERVE_FUSED_LAYERS", "1") != "0"
ROWS = 8  # rows of activations a pass over the weights serves (csrc: kMaxRows)
# Rows from which a layer with these kernels multiplies a dense bfloat16 copy (oneDNN, AVX-512 CPUs) instead;
# 0 (the default): never, so every row is computed as if alone (a faster big step rounds apart from a small one)
DENSE_FROM: int = int(os.environ.get("SPECSERVE_CPU_DENSE_FROM", "0"))


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def guard_forced_aten_isa() -> bool:
    """Turn torch's flash SDPA off where ATEN_CPU_CAPABILITY is forced below an AVX-512 CPU's (a forced AVX2 run):
    its CPU kernel picks a bfloat16 micro-kernel by the CPU's features but packs by ATen's level, and raises
    ("pack_vnni2 is only supported when avx512 is supported"); the math kernel runs instead. Whether it did."""
    if "avx512f" not in cpu_flags() or torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        return False
    torch.backends.cuda.enable_flash_sdp(False)  # the flag is torch's global one, the CPU's selection reads it too
    return True


def cache_root() -> Path:
    """Where specserve keeps what it builds once and reuses: `$SPECSERVE_CACHE`, default `~/.cache/specserve`."""
    root = os.environ.get("SPECSERVE_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "specserve"


def cache_dir() -> Path:
    return cache_root() / "kernels"


def build(compiler: str, isa: str, verbose: bool = True) -> Path:
    """The shared library for this source and `isa`'s flags, compiled now unless cached."""
    flags = [*FLAGS, *ISAS[isa][0]]
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join([compiler, *flags]).encode()).hexdigest()[:16]
    target = cache_dir() / f"cpu-{isa}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    if verbose:
        print(f"specserve: compiling its CPU kernels ({ISAS[isa][2]}) into {target} (once, a few seconds)",
              file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # renamed into place: builds may race
        out = Path(tmp) / target.name
        subprocess.run([compiler, *flags, str(SOURCE), "-o", str(out)], check=True, capture_output=True, text=True)
        os.replace(out, target)
    return target


def runs_here(isa: str) -> bool:
    """Whether this CPU has the instructions of `isa`'s build."""
    return ISAS[isa][1] <= cpu_flags()


def chosen_isa() -> str | None:
    """The build `ISA` asks for on this CPU (None where the CPU has none of them); an unknown value is an error."""
    return _choose(ISA)


@functools.cache
def _choose(wanted: str) -> str | None:
    if wanted == "auto":
        return next((isa for isa in ISAS if runs_here(isa)), None)
    if wanted not in ISAS:
        raise ValueError(f"SPECSERVE_CPU_ISA must be auto or one of {', '.join(ISAS)}, got {wanted!r}")
    return wanted if runs_here(wanted) else None


def int8_activations() -> bool:
    """Whether int4 products quantize their activations to int8 (`ACTIVATIONS`); an unknown value is an error."""
    if ACTIVATIONS not in ("bf16", "int8"):
        raise ValueError(f"SPECSERVE_CPU_ACTIVATIONS must be bf16 or int8, got {ACTIVATIONS!r}")
    return ACTIVATIONS == "int8"


def library() -> ctypes.CDLL | None:
    """The loaded kernels of the chosen build, or None where they cannot run (`describe` says why)."""
    isa = chosen_isa()
    return None if isa is None else _load(isa)


@functools.cache
def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++")


@functools.cache
def _load(isa: str) -> ctypes.CDLL | None:
    compiler = _compiler()
    if compiler is None:
        print("specserve: no C++ compiler (g++ or $CXX): int4/int8 layers use torch's slower kernels",
              file=sys.stderr)
        return None
    try:
        path = build(compiler, isa)
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        print(f"specserve: could not compile the CPU kernels ({detail.strip()[:500]}); "
              "int4/int8 layers use torch's kernels", file=sys.stderr)
        return None
    lib = ctypes.CDLL(str(path))  # after torch: its OpenMP runtime (libgomp.so.1) is the one loaded
    p, i = ctypes.c_void_p, ctypes.c_int64
    lib.specserve_int4_mm.argtypes = lib.specserve_int4q8_mm.argtypes = [p, i, i, p, p, i, p, i, p]
    lib.specserve_int8_mm.argtypes = [p, i, i, p, p, p, i]
    lib.specserve_blocks_mm.argtypes = [p, i, i, p, p, i, p]
    lib.specserve_pack_codes.argtypes = [p, i, i, i, p, p]
    lib.specserve_attend.argtypes = [p, i, p, i, p, i, p, p, i, p, i, i, i, i, ctypes.c_float, i, ctypes.c_float, p]
    lib.specserve_rms_norm.argtypes = lib.specserve_rms_norm_f32.argtypes = [p, i, p, i, i, ctypes.c_float, p]
    lib.specserve_silu_mul.argtypes = lib.specserve_gelu_mul.argtypes = [p, i, i, p]
    lib.specserve_layers.argtypes = [p, i, i, i, p, p, p, p, i, ctypes.c_float, p, p, p, p, p, p, p, p, i, i, p,
                                     i, i, i, i, ctypes.c_float, ctypes.c_float, p, p, p]
    for f in (lib.specserve_int4_mm, lib.specserve_int4q8_mm, lib.specserve_int8_mm, lib.specserve_blocks_mm,
              lib.specserve_attend, lib.specserve_rms_norm, lib.specserve_rms_norm_f32, lib.specserve_silu_mul,
              lib.specserve_gelu_mul, lib.specserve_layers):
        f.restype = None
    lib.specserve_isa.restype = ctypes.c_int
    assert lib.specserve_isa() == (512 if isa == "avx512" else 2), f"{path} is not the {isa} build"
    return lib


def available() -> bool:
    """Whether the kernels run here (this CPU, a compiler, not turned off by SPECSERVE_CPU_KERNELS=0)."""
    return ENABLED and library() is not None


def kernels_keep_dense_copy() -> bool:
    """Whether a layer on specserve's kernels takes `DENSE_FROM`+ rows through a dense bf16 copy: only where asked
    (SPECSERVE_CPU_DENSE_FROM; those rows round apart from the kernels', so a seeded stream's tokens would depend
    on its batch), where oneDNN has a bfloat16 GEMM (AVX-512), and not where the AVX2 build runs (forced too,
    SPECSERVE_CPU_ISA=avx2: then as on a laptop, where torch's bf16 GEMM is far slower than the kernels)."""
    return DENSE_FROM > 0 and onednn_bf16() and chosen_isa() != "avx2"


@functools.cache
def onednn_bf16() -> bool:
    """Whether oneDNN runs bfloat16 on this CPU (it refuses without AVX-512; F.linear then takes another path)."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def describe() -> str:
    """Which path a bfloat16 CPU step takes here, and why (for start-up messages)."""
    if not ENABLED:
        return "torch's CPU kernels (SPECSERVE_CPU_KERNELS=0)"
    isa = chosen_isa()
    if isa is None:
        wanted = "any of " + ", ".join(ISAS[i][2] for i in ISAS) if ISA == "auto" else ISAS[ISA][2]
        return f"torch's CPU kernels (this CPU lacks {wanted})"
    if _load(isa) is None:
        return "torch's CPU kernels (specserve's could not be compiled: no g++ or $CXX, or it failed)"
    forced = " (SPECSERVE_CPU_ISA)" if ISA != "auto" else ""
    acts = "int8" if int8_activations() else "bfloat16"
    dense = (f", a dense bf16 copy from {DENSE_FROM} rows (SPECSERVE_CPU_DENSE_FROM: rows then depend on the batch)"
             if kernels_keep_dense_copy() else "")
    amx = ("; AMX tiles unused by the quantized products (torch's bfloat16 GEMMs may use them)"
           if "amx_int8" in cpu_flags() else "")
    return f"specserve's CPU kernels, {ISAS[isa][2]} build{forced}, int4 products of {acts} activations{dense}{amx}"


def fits(out_features: int, in_features: int, group: int | None) -> bool:
    """Whether a layer's shape suits the kernels' blocks (16 outputs; 4 inputs for int4, 2 for int8)."""
    return out_features % 16 == 0 and (in_features % 2 == 0 if group is None else group % 4 == 0)


def pack_int4(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int
              ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(codes, scale-and-bias) in the kernel's layout for w = (codes - 8) · scale + zero, groups of `group`;
    None unless the scale and the bias (zero - 8 · scale) are float16 values, as the kernel reads them."""
    n, k = codes.shape
    scale, zero = scale.float(), zero.float()
    sb = torch.stack([scale, zero - 8 * scale])
    if not torch.equal(sb.half().float(), sb):
        return None
    c = codes.to(torch.uint8).view(n // 16, 16, k // 4, 4).permute(0, 2, 1, 3)
    packed = (c[..., :2] | c[..., 2:] << 4).contiguous().view(n // 16, k // 4, 32)
    sb = sb.half().view(2, n // 16, 16, k // group).permute(1, 3, 0, 2)
    return packed, sb.contiguous()


def pack_int8(codes: torch.Tensor) -> torch.Tensor:
    n, k = codes.shape
    return codes.to(torch.int8).view(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()


class BlocksStruct(ctypes.Structure):  # csrc: struct Blocks
    _fields_ = [("lo", ctypes.c_void_p), ("hi", ctypes.c_void_p), ("dm", ctypes.c_void_p), ("scm", ctypes.c_void_p),
                ("bits", ctypes.c_int64), ("group", ctypes.c_int64), ("span", ctypes.c_int64),
                ("has_min", ctypes.c_int64), ("has_scale", ctypes.c_int64), ("offset", ctypes.c_float)]


class PackedBlocks:
    """A `quant.Blocks` weight in the kernel's layout (csrc: struct Blocks), and the struct that points into it."""

    def __init__(self, w):
        n, k = w.codes.shape
        self.group, self.out_features = w.group, n
        offset, hb = w.offset, w.bits - 4
        codes = w.codes.contiguous()
        self.lo = torch.empty((n // 16, k // 4, 64 if hb == 4 else 32), dtype=torch.uint8)
        self.hi = torch.empty((n // 16, k // 4 // (4 // hb), 32) if hb in (1, 2) else 0, dtype=torch.uint8)
        library().specserve_pack_codes(codes.data_ptr(), n, k, w.bits, self.lo.data_ptr(), self.hi.data_ptr())
        if hb == 4:  # signed bytes: codes less 128
            self.lo, offset = self.lo.view(torch.int8), offset + 128
        with_min, with_scale = w.has_min, bool((w.sc != 1).any())

        def by_block(parts: list[torch.Tensor], dtype) -> torch.Tensor:  # [N, X] each → [N/16, X, len, 16]
            return torch.stack([a.to(dtype).reshape(n // 16, 16, -1).transpose(1, 2) for a in parts], 2).contiguous()

        self.dm = by_block([w.d, w.m] if with_min else [w.d], torch.float16)
        scm = [w.sc] * with_scale + [w.mn] * with_min
        self.scm = by_block(scm, torch.int8) if scm else torch.zeros(0, dtype=torch.int8)
        self.params = (w.bits, w.group, w.span, int(with_min), int(with_scale), float(offset))
        self.struct = self._struct()

    def _struct(self) -> BlocksStruct:
        return BlocksStruct(self.lo.data_ptr(), self.hi.data_ptr(), self.dm.data_ptr(), self.scm.data_ptr(),
                            *self.params)

    def __getstate__(self) -> dict:  # saved as tensors and numbers (`formats.packcache`); the struct points into them
        return {k: v for k, v in self.__dict__.items() if k != "struct"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.struct = self._struct()

    @property
    def nbytes(self) -> int:
        return self.lo.nbytes + self.hi.nbytes + self.dm.nbytes + self.scm.nbytes

    @property
    def address(self) -> int:
        return ctypes.addressof(self.struct)


def packed(weight) -> tuple | None:
    """A `quant.Int8Rows`, `quant.Int4Groups` or `quant.Blocks` in the kernels' layout ("int8"|"int4"|"blocks",
    codes, scales, group), or None where the kernels cannot run it (this CPU, no compiler, its shape, scales not
    float16)."""
    group = getattr(weight, "group", None)
    n, k = weight.codes.shape
    if not fits(n, k, group) or not available():
        return None
    if hasattr(weight, "span"):
        if k % weight.span or weight.bits not in (4, 5, 6, 8):
            return None
        blocks = PackedBlocks(weight)
        return "blocks", blocks, torch.zeros(0), weight.group
    if group is None:
        return "int8", pack_int8(weight.codes), weight.scale.float().contiguous(), None
    parts = pack_int4(weight.codes, weight.scale, weight.zero, group)
    return None if parts is None else ("int4", *parts, group)


def multiply(x: torch.Tensor, kernel: tuple) -> torch.Tensor:
    """x [M, K] bfloat16 times a `packed` weight, transposed: [M, N]."""
    kind, codes, scales, group = kernel
    if kind == "blocks":
        if torch.compiler.is_compiling():
            return torch.ops.specserve.blocks_mm(x, codes.address, codes.out_features, group)
        return blocks_mm(x, codes.address, codes.out_features, group)
    if torch.compiler.is_compiling():  # opaque ops there (ctypes calls cannot be traced)
        return (torch.ops.specserve.int8_mm(x, codes, scales) if kind == "int8"
                else torch.ops.specserve.int4_mm(x, codes, scales, group))
    return int8_mm(x, codes, scales) if kind == "int8" else int4_mm(x, codes, scales, group)


def blocks_mm(x: torch.Tensor, address: int, n: int, group: int) -> torch.Tensor:
    """x [M, K] bfloat16 → [M, N] bfloat16 against the `PackedBlocks` whose struct is at `address`."""
    x = x.contiguous()
    m, k = x.shape
    out = x.new_empty(m, n)
    xsum = torch.empty(m * (k // group), dtype=torch.float32)
    library().specserve_blocks_mm(x.data_ptr(), m, k, address, out.data_ptr(), n, xsum.data_ptr())
    return out


def int4_mm(x: torch.Tensor, packed: torch.Tensor, sb: torch.Tensor, group: int) -> torch.Tensor:
    """x [M, K] bfloat16 → [M, N] bfloat16 against `pack_int4`'s weights."""
    x = x.contiguous()
    m, k = x.shape
    n = packed.shape[0] * 16
    out = x.new_empty(m, n)
    xsum = torch.empty(m * (k // group), dtype=torch.float32)
    lib = library()
    product = lib.specserve_int4q8_mm if int8_activations() else lib.specserve_int4_mm
    product(x.data_ptr(), m, k, packed.data_ptr(), sb.data_ptr(), group, out.data_ptr(), n, xsum.data_ptr())
    return out


def int8_mm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] bfloat16 → [M, N] bfloat16 against `pack_int8`'s codes and float32 row scales."""
    x = x.contiguous()
    m, k = x.shape
    n = packed.shape[0] * 16
    out = x.new_empty(m, n)
    library().specserve_int8_mm(x.data_ptr(), m, k, packed.data_ptr(), scales.data_ptr(), out.data_ptr(), n)
    return out


@torch.library.custom_op("specserve::int4_mm", mutates_args=())
def _int4_op(x: torch.Tensor, codes: torch.Tensor, sb: torch.Tensor, group: int) -> torch.Tensor:
    return int4_mm(x, codes, sb, group)


@_int4_op.register_fake
def _(x, codes, sb, group):
    return x.new_empty(x.shape[0], codes.shape[0] * 16)


@torch.library.custom_op("specserve::blocks_mm", mutates_args=())
def _blocks_op(x: torch.Tensor, address: int, n: int, group: int) -> torch.Tensor:
    return blocks_mm(x, address, n, group)


@_blocks_op.register_fake
def _(x, address, n, group):
    return x.new_empty(x.shape[0], n)


@torch.library.custom_op("specserve::int8_mm", mutates_args=())
def _int8_op(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return int8_mm(x, codes, scales)


@_int8_op.register_fake
def _(x, codes, scales):
    return x.new_empty(x.shape[0], codes.shape[0] * 16)


def step_kernels(dtype: torch.dtype, device, head_dim: int) -> bool:
    """Whether a lean forward in `dtype` on `device` takes the attention and RMS-norm kernels (eager only)."""
    return (dtype == torch.bfloat16 and torch.device(device).type == "cpu" and head_dim % 32 == 0
            and head_dim <= 256 and available())


def rms_ok(x: torch.Tensor) -> bool:
    """Whether `rms_norm` takes x (checked per call: cheap)."""
    if torch.compiler.is_compiling():  # a ctypes call cannot be traced
        return False
    return x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.dim() == 2 and x.stride(1) == 1 and available()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """An RMS norm over the last dimension of x [M, H] (bfloat16, rows contiguous): weight · bf16(x / rms(x)) for
    bfloat16 weights (Llama's), bf16(x / rms(x) · weight) in float32 for float32 ones (Gemma's 1 + w, OLMo 2's)."""
    m, h = x.shape
    out = torch.empty(m, h, dtype=torch.bfloat16)
    f = library().specserve_rms_norm_f32 if weight.dtype == torch.float32 else library().specserve_rms_norm
    weight = weight.contiguous()  # (held here: the call reads it)
    f(x.data_ptr(), x.stride(0), weight.data_ptr(), m, h, eps, out.data_ptr())
    return out


class Attention:
    """One step's attention, straight from the pool's arena (the keys and values of the new tokens written into it
    first): no gathers, no padding, one call a layer; each row computed as if alone, prompts' rows too."""

    def __init__(self, k_arena: torch.Tensor, v_arena: torch.Tensor, blocks, starts, sizes, offsets,
                 heads: int, scale: float, softcap: float | None = None):
        self.k, self.v = k_arena, v_arena  # [layers, kv_heads, positions, head_dim]
        info = [(blocks[j], starts[j], sizes[j], offsets[j]) for j in range(len(sizes))]
        self.info = torch.tensor(info, dtype=torch.int64)
        self.count, self.heads, self.scale = len(sizes), heads, scale
        self.softcap = softcap or 0.0  # scores capped to softcap · tanh(score / softcap) (Gemma 2); 0: none

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 window: int | None = None) -> None:
        """q [T, heads, d], k, v [T, kv_heads, d] (rows strided, heads contiguous); out [T, heads·d]; window: the
        layer's sliding window (None: every key)."""
        ka, va = self.k[layer], self.v[layer]
        kvh, _, d = ka.shape
        library().specserve_attend(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
                                   ka.data_ptr(), va.data_ptr(), ka.stride(0), self.info.data_ptr(), self.count,
                                   self.heads, kvh, d, self.scale, window or 0, self.softcap, out.data_ptr())


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """bfloat16(bfloat16(silu(gate)) · up) of gate_up [M, 2I] (gate first, rows contiguous): [M, I]. SiLU in float32
    with the kernels' exp, so a step's MLP gives the same values here as in `specserve_layer`."""
    gate_up = gate_up.contiguous()
    m, i = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(m, i, dtype=torch.bfloat16)
    library().specserve_silu_mul(gate_up.data_ptr(), m, i, out.data_ptr())
    return out


def gelu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """bfloat16(bfloat16(gelu_tanh(gate)) · up) of gate_up [M, 2I] (Gemma's GeGLU), as `silu_mul`: GELU's tanh form
    in float32 with the kernels' exp, the values `specserve_layer` computes."""
    gate_up = gate_up.contiguous()
    m, i = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(m, i, dtype=torch.bfloat16)
    library().specserve_gelu_mul(gate_up.data_ptr(), m, i, out.data_ptr())
    return out


guard_forced_aten_isa()  # in every process that runs the models' code (a forced AVX2 run)
