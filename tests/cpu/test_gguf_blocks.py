"""GGUF block types computed as stored (`formats.gguf.read_blocks`, `kernels.quant.Blocks`, csrc
`specserve_blocks_mm`): the numbers read from blocks the tests write are `gguf.quants.dequantize`'s, and the kernel
multiplies exactly those weights by its own int8 activations, to float32 rounding, on every build this CPU runs
(`SPECSERVE_CPU_ISA=avx2`'s too), each row as if alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize
from specserve.models.formats.gguf import BLOCK_TYPES, _q4_blocks, read_blocks
from specserve.models.kernels import cpu
from specserve.models.kernels.quant import Blocks, Int4Groups, QuantizedLinear, concat

ISAS_HERE = [isa for isa in cpu.ISAS if cpu.runs_here(isa)]
needs_kernels = pytest.mark.skipif(not cpu.available(), reason="specserve's CPU kernels need AVX-512 bf16 or "
                                   "AVX2+FMA+F16C, and g++")
# where each type's float16 fields sit in its block (the tests give them sane values; the rest is random bytes)
HALVES = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q2_K": [80, 82], "Q3_K": [108],
          "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}
SIZES = {"Q4_0": (18, 32), "Q4_1": (20, 32), **{kind: spec[:2] for kind, spec in BLOCK_TYPES.items()}}


def random_blocks(kind: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Raw blocks [n, k / values · bytes] of `kind`: random codes and sub-block scales, float16 scales ~0.01."""
    rng = np.random.default_rng(seed)
    size, values = SIZES[kind]
    raw = rng.integers(0, 256, (n * k // values, size), dtype=np.uint8)
    for at in HALVES[kind]:
        raw[:, at:at + 2] = (rng.standard_normal((len(raw), 1)) * 0.01).astype(np.float16).view(np.uint8)
    return raw.reshape(n, -1)


def stored(kind: str, raw: np.ndarray, n: int, k: int):
    return _q4_blocks(raw, n, k, kind == "Q4_1") if kind in ("Q4_0", "Q4_1") else read_blocks(raw, kind, n, k)


@pytest.mark.parametrize("kind", list(SIZES))
def test_each_block_type_holds_the_values_gguf_dequantizes(kind):
    n, k = 32, 512
    raw = random_blocks(kind, n, k)
    theirs = dequantize(raw, T[kind]).reshape(n, k)
    ours = stored(kind, raw, n, k).dequantize().numpy()
    assert np.isfinite(theirs).all() and np.array_equal(ours, theirs)


def reference(x: torch.Tensor, w: Blocks) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] bfloat16 times w as the kernel defines it, in float64: activations quantized per row and
    activation group (a span for K-quants, `Blocks.activation_group`) as the kernel does (d = max|x| / 127 and
    xq = round(x · 127 / max|x|) in float32, nearest even), times the weights gguf dequantizes. Returns (y [M, N],
    a bound on float32's rounding of the kernel's partial sums)."""
    m, k = x.shape
    n, g, a = w.codes.shape[0], w.group, w.activation_group
    xf = x.float().view(m, k // a, a)
    amax = xf.abs().amax(-1, keepdim=True)
    # 127 / max|x| correctly rounded, as the kernel's division (torch's own float32 division need not be)
    inv = torch.where(amax > 0, (127 / amax.double()).float(), torch.zeros_like(amax))
    xq = torch.round(xf * inv).clamp(-127, 127).double()
    dx = (amax / 127).double()
    y = (xq * dx).view(m, k) @ w.dequantize().double().T
    xq, dx = xq.view(m, k // g, g), dx.repeat_interleave(a // g, 1)  # per weight group
    scale, low = (t.double() for t in w.scales())
    codes = w.codes.view(n, k // g, g).double()
    terms = (torch.einsum("mgk,ngk->mng", xq.abs(), codes) * scale.abs()[None] * dx.squeeze(-1)[:, None]
             + (xq.sum(-1) * dx.squeeze(-1)).abs()[:, None] * (w.offset * scale + low).abs()[None])
    return y, terms.sum(-1) * 2**-18


@needs_kernels
@pytest.mark.parametrize("isa", ISAS_HERE)
@pytest.mark.parametrize("kind", list(BLOCK_TYPES))
def test_block_products_are_the_files_weights_times_the_kernels_activations(kind, isa, monkeypatch):
    monkeypatch.setattr(cpu, "ISA", isa)
    n, k = 48, 512
    w = read_blocks(random_blocks(kind, n, k, seed=1), kind, n, k)
    layer = QuantizedLinear(w, torch.bfloat16, "cpu")
    assert layer.kernel is not None and layer.kernel[0] == "blocks"
    torch.manual_seed(0)
    x = torch.randn(11, k).bfloat16()
    y = layer(x).float().double()
    exact, rounding = reference(x, w)
    # the output's bfloat16 rounding (half an ulp: 2^-9 of its value's binade) and float32's in the sums
    assert ((y - exact).abs() <= exact.abs() * 2**-8 + rounding).all()
    assert (y - exact).abs().max() > 0  # (the reference is not the kernel's own arithmetic)
    alone = torch.cat([layer(x[i:i + 1]) for i in range(len(x))]).float().double()
    assert torch.equal(alone, y) and torch.equal(layer(x[:3]).float().double(), y[:3])


@needs_kernels
@pytest.mark.parametrize("isa", ISAS_HERE)
@pytest.mark.parametrize("kind", list(BLOCK_TYPES))
def test_extreme_codes_and_activations_sum_exactly(kind, isa, monkeypatch):
    """Where the kernels' 16-bit sums come nearest their limit: every code at 0 or at its largest, every
    activation at +-127 (x constant in magnitude), a group's signs the same or alternating."""
    monkeypatch.setattr(cpu, "ISA", isa)
    n, k = 64, 512
    w = read_blocks(random_blocks(kind, n, k, seed=4), kind, n, k)
    top = (1 << w.bits) - 1
    w.codes[:16], w.codes[16:32] = 0, top
    w.codes[32:48] = torch.tensor([0, top], dtype=w.codes.dtype).repeat(k // 2)
    w.codes[48:] = torch.tensor([0, 0, top, top], dtype=w.codes.dtype).repeat(k // 4)
    signs = [torch.ones(k), -torch.ones(k), torch.tensor([1.0, -1.0]).repeat(k // 2),
             torch.tensor([1.0, 1.0, -1.0, -1.0]).repeat(k // 4), torch.tensor([-1.0, -1.0, 1.0, 1.0]).repeat(k // 4)]
    x = torch.stack(signs).bfloat16()
    layer = QuantizedLinear(w, torch.bfloat16, "cpu")
    y = layer(x).float().double()
    exact, rounding = reference(x, w)
    assert ((y - exact).abs() <= exact.abs() * 2**-8 + rounding).all()
    alone = torch.cat([layer(x[i:i + 1]) for i in range(len(x))]).float().double()
    assert torch.equal(alone, y)


@needs_kernels
def test_a_wrong_weight_is_seen_by_the_reference():
    n, k = 48, 512
    w = read_blocks(random_blocks("Q4_K", n, k, seed=2), "Q4_K", n, k)
    x = torch.randn(4, k).bfloat16()
    exact, rounding = reference(x, w)
    w.codes[7, 100] ^= 1  # one code off by one in the kernel's copy
    y = QuantizedLinear(w, torch.bfloat16, "cpu")(x).float().double()
    assert not ((y - exact).abs() <= exact.abs() * 2**-8 + rounding)[:, 7].all()


@needs_kernels
@pytest.mark.skipif(len(ISAS_HERE) < 2, reason="one build runs on this CPU")
@pytest.mark.parametrize("kind", list(BLOCK_TYPES))
def test_both_builds_compute_the_same_bits(kind, monkeypatch):
    # 5 blocks of 16 outputs: tiles of 4 (2) blocks and a block left over, for 1, 3 and 9 (8 + 1) rows
    n, k = 80, 512
    w = read_blocks(random_blocks(kind, n, k, seed=3), kind, n, k)
    x = torch.randn(9, k).bfloat16()
    for rows in (1, 3, 9):
        outs = []
        for isa in ISAS_HERE:
            monkeypatch.setattr(cpu, "ISA", isa)
            outs.append(QuantizedLinear(w, torch.bfloat16, "cpu")(x[:rows]))
        assert all(torch.equal(outs[0], o) for o in outs[1:]), rows


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 13])
def test_legacy_q4_blocks_on_the_blocks_kernel_give_the_int4_kernels_bits(rows):
    """The same numbers through both kernels: the int4 one (Q4_0/Q4_1 files) and the blocks one (a Q4 weight
    fused with K-quants) compute the same float operations."""
    torch.manual_seed(rows)
    w = Int4Groups.quantize(torch.randn(64, 256), 32)
    as_blocks = Blocks.from_int4(w)
    assert torch.equal(as_blocks.dequantize(), w.dequantize())
    x = torch.randn(rows, 256).bfloat16()
    int4, blocks = QuantizedLinear(w, torch.bfloat16, "cpu"), QuantizedLinear(as_blocks, torch.bfloat16, "cpu")
    assert (int4.kernel[0], blocks.kernel[0]) == ("int4", "blocks")
    assert torch.equal(int4(x), blocks(x))


def test_mixed_types_fuse_into_one_layer_without_loss():
    """q|k|v of a Q4_K_M file: Q4_K, Q4_K and Q6_K rows in one weight (finer groups, codes shifted to Q6_K's
    offset), the same values as the parts."""
    k = 512
    parts = [read_blocks(random_blocks(kind, n, k, seed=i), kind, n, k)
             for i, (kind, n) in enumerate([("Q4_K", 64), ("Q4_K", 16), ("Q6_K", 16)])]
    fused = concat(parts)
    assert isinstance(fused, Blocks) and (fused.bits, fused.group, fused.offset) == (6, 16, -32)
    assert fused.source == "Q4_K+Q6_K"
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    q4 = _q4_blocks(random_blocks("Q4_1", 16, k, seed=9), 16, k, True)
    with_q4 = concat([parts[0], q4])
    assert torch.equal(with_q4.dequantize(), torch.cat([parts[0].dequantize(), q4.dequantize()]))
    if cpu.available():
        x = torch.randn(3, k).bfloat16()
        y = QuantizedLinear(fused, torch.bfloat16, "cpu")(x).float().double()
        exact, rounding = reference(x, fused)
        assert ((y - exact).abs() <= exact.abs() * 2**-8 + rounding).all()


def test_shards_and_rows_of_blocks_keep_their_numbers():
    n, k = 32, 1024
    w = read_blocks(random_blocks("Q5_K", n, k, seed=4), "Q5_K", n, k)
    order = torch.randperm(n)
    assert torch.equal(w.rows(order).dequantize(), w.dequantize()[order])
    assert torch.equal(w.cols(256, 768).dequantize(), w.dequantize()[:, 256:768])
    with pytest.raises(ValueError, match="super-blocks of 256"):
        w.cols(128, 512)


def test_without_the_kernels_blocks_multiply_their_dequantized_values(monkeypatch):
    monkeypatch.setattr(cpu, "ENABLED", False)
    n, k = 32, 256
    w = read_blocks(random_blocks("Q6_K", n, k, seed=5), "Q6_K", n, k)
    layer = QuantizedLinear(w, torch.float32, "cpu")
    assert layer.kernel is None
    x = torch.randn(4, k)
    assert torch.allclose(layer(x), x @ w.dequantize().T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_files_linears_are_read_as_stored_with_llamas_rows_unpermuted(arch, tmp_path):
    """A GGUF file of one layer in a Q4_K_M file's mix of types (written here, linears only): every linear comes
    back as `Blocks` with the file's values; llama.cpp's q/k row order per rotary pair is undone for Llama files
    only (Qwen2's rope is the halves HF keeps, so its rows stay)."""
    from types import SimpleNamespace

    import gguf
    from specserve.models.formats.gguf import gguf_linears

    hidden, heads, kv_heads, head_dim, inter = 256, 2, 1, 128, 512
    shapes = {"attn_q": (heads * head_dim, hidden, "Q4_K"), "attn_k": (kv_heads * head_dim, hidden, "Q4_K"),
              "attn_v": (kv_heads * head_dim, hidden, "Q6_K"), "attn_output": (hidden, heads * head_dim, "Q4_K"),
              "ffn_gate": (inter, hidden, "Q5_K"), "ffn_up": (inter, hidden, "Q4_K"), "ffn_down": (hidden, inter, "Q6_K")}
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), arch)
    raws = {}
    for i, (name, (n, k, kind)) in enumerate(shapes.items()):
        raws[name] = random_blocks(kind, n, k, seed=10 + i)
        writer.add_tensor(f"blk.0.{name}.weight", raws[name], raw_dtype=T[kind])
    head = random_blocks("Q8_0", 64, hidden, seed=20)
    writer.add_tensor("output.weight", head, raw_dtype=T.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config = SimpleNamespace(num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv_heads,
                             tie_word_embeddings=False)
    read = gguf_linears(tmp_path / "m.gguf", config)
    roles = {"attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o", "ffn_gate": "gate", "ffn_up": "up",
             "ffn_down": "down"}
    for name, (n, k, kind) in shapes.items():
        w = read["layers"][0][roles[name]]
        assert isinstance(w, Blocks) and w.source == kind
        values = torch.from_numpy(dequantize(raws[name], T[kind]).reshape(n, k))
        if arch == "llama" and name in ("attn_q", "attn_k"):
            h = heads if name == "attn_q" else kv_heads
            values = values.view(h, head_dim // 2, 2, k).transpose(1, 2).reshape(n, k)
        assert torch.equal(w.dequantize(), values), name
    assert torch.equal(read["head"].dequantize(), torch.from_numpy(dequantize(head, T.Q8_0).reshape(64, hidden)))
