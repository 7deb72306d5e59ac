"""specserve's CPU kernels (`models.kernels.cpu`, csrc/cpu.cpp): attention straight from the pool's arena and RMS
norm compute what torch's ops do up to bf16 rounding; every row is computed as if alone, so in bfloat16 a
verify block's logits equal decode steps' and greedy speculation equals target-only decoding exactly.

Every test runs once for each build this CPU runs (AVX-512 bf16, AVX2+FMA): an AVX-512 machine checks the
AVX2 path too, as `SPECSERVE_CPU_ISA=avx2` forces it."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from specserve import SamplingParams, SpeculativeDecoder
from specserve.models import load_model
from specserve.models.families import lean
from specserve.models.kernels import cpu
from specserve.models.kernels.fused import FusedLayers
from specserve.models.memory.pool import KVPool

from tests.conftest import tiny_llama
from tests.families import tiny_family

pytestmark = pytest.mark.skipif(not cpu.available(),
                                reason="specserve's CPU kernels need AVX-512 bf16 or AVX2+FMA+F16C, and g++")
ISAS_HERE = [isa for isa in cpu.ISAS if cpu.runs_here(isa)]


@pytest.fixture(autouse=True, params=ISAS_HERE)
def isa(request, monkeypatch):
    monkeypatch.setattr(cpu, "ISA", request.param)
    return request.param


def _bf16_products_reference(x, w, order):
    """float32 sums of x [M, K] · w [N, K] (bfloat16 values, small integers) in the order of `order` (input
    offsets within a step of len(order)), each product added with one rounding, as vdpbf16ps defines it: [M, N]."""
    x, w = x.float(), w.float()
    acc = torch.zeros(x.shape[0], w.shape[0])
    for k in range(0, x.shape[1], len(order)):
        for j in order:
            acc = acc + x[:, None, k + j] * w[None, :, k + j]  # the product is exact in float32
    return acc


def _int4_weight(n: int, k: int, group: int, codes: torch.Tensor | None = None):
    """int4 codes (random unless given), float16 scales and biases (w = codes · scale + bias), and their packing:
    (codes, scale, bias, packed, sb)."""
    codes = torch.randint(0, 16, (n, k)) if codes is None else codes
    scale = (torch.rand(n, k // group) * 0.05).half().float()
    bias = (torch.randn(n, k // group) * 0.1).half().float()
    return codes, scale, bias, *cpu.pack_int4(codes, scale, bias + 8 * scale, group)


def _fma(a, b, c):
    """a · b + c rounded once to float32 (the product is exact in float64 for these operands)."""
    return (a.double() * b.double() + c.double()).float()


def test_quantized_products_round_as_the_dot_product_instruction_defines(isa, monkeypatch):
    """int4 and int8 products equal a float32 reference of the kernels' arithmetic bit for bit: pairs summed odd
    then even (vdpbf16ps's definition), int4 groups scaled and biased by one FMA each, bfloat16 out."""
    monkeypatch.setattr(cpu, "ACTIVATIONS", "bf16")  # (SPECSERVE_CPU_ACTIVATIONS=int8: the test below)
    torch.manual_seed(0)
    m, n, k, group = 13, 48, 128, 32  # two passes of rows over each tile of weights (8 + 5)
    x = (torch.randn(m, k) * 2).bfloat16()
    # rows where the order of the sums shows: 3/64 is lost beside 2^20 in float32, so output 0 (codes 1) is 3/64
    # summed after a cancellation and 0 summed before it
    big, small = 2.0**20, 3 / 64
    x[:3] = 0
    x[0, :8] = torch.tensor([0, big, small, -big, 0, 0, 0, 0])
    x[1, :8] = torch.tensor([big, 0, 0, 0, small, -big, 0, 0])
    x[2, :8] = torch.tensor([big, 0, small, -big, 0, 0, 0, 0])
    codes4 = torch.randint(0, 16, (n, k))
    codes4[0, :8] = 1
    _, scale, bias, packed, sb = _int4_weight(n, k, group, codes4)
    ours = cpu.int4_mm(x, packed, sb, group)
    acc = torch.zeros(m, n)
    for g in range(k // group):
        cols = slice(g * group, (g + 1) * group)
        part = _bf16_products_reference(x[:, cols], codes4[:, cols], (1, 0, 3, 2))
        xsum = torch.zeros(m)
        for i in range(g * group, (g + 1) * group):  # the kernel's sequential float32 sum
            xsum = xsum + x[:, i].float()
        acc = _fma(part, scale[:, g][None], acc)
        acc = _fma(xsum[:, None].expand(m, n), bias[:, g][None], acc)
    assert torch.equal(ours, acc.bfloat16())
    codes8 = torch.randint(-127, 128, (n, k))
    codes8[0, :8] = 1
    scales8 = torch.rand(n) * 0.01
    ours = cpu.int8_mm(x, cpu.pack_int8(codes8), scales8)
    assert torch.equal(ours, (_bf16_products_reference(x, codes8, (1, 0)) * scales8).bfloat16())
    # and each row as if alone
    for row in (2, 12):
        assert torch.equal(cpu.int8_mm(x[row:row + 1], cpu.pack_int8(codes8), scales8),
                           ours[row:row + 1])


@pytest.mark.parametrize("group", [32, 64])
def test_int8_activation_products_are_exact_integer_sums(isa, monkeypatch, group):
    """With SPECSERVE_CPU_ACTIVATIONS=int8 an int4 product quantizes each row's group of inputs to int8 (d = max|x|
    / 127, nearest even) and sums codes · xq exactly: it equals a reference of that arithmetic bit for bit (the
    scale times d, then one FMA for the sum and one for the bias times d · sum(xq)), every row as if alone."""
    monkeypatch.setattr(cpu, "ACTIVATIONS", "int8")
    torch.manual_seed(1)
    m, n, k = 11, 80, 128  # two passes of rows (8 + 3); tiles of 4 and of 2 blocks, and one block left over
    x = (torch.randn(m, k) * 3).bfloat16()
    x[1, :group] = 0  # a group of zeros: d = 0
    x[2, 5] = 2.0**30  # one input dwarfs its group: the others round to 0
    x[3, :group] = 0
    x[3, :6] = torch.tensor([127, 0.5, 1.5, 2.5, -0.5, -1.5])  # d = 1: halves, to the even neighbour
    # sums past 16 bits: every xq of the group ±127 against codes 15 and 0 (|sum| 32 · 15 · 127 for a group of 32)
    x[4, :group], x[5, :group] = 1.0, -1.0
    codes = torch.randint(0, 16, (n, k))
    codes[1, :group], codes[2, :group] = 15, 0
    codes, scale, bias, packed, sb = _int4_weight(n, k, group, codes)
    ours = cpu.int4_mm(x, packed, sb, group)
    acc = torch.zeros(m, n)
    for g in range(k // group):
        xg = x[:, g * group:(g + 1) * group].float()
        amax = xg.abs().amax(-1)
        d = amax / 127
        inv = torch.where(amax > 0, 127 / amax, torch.zeros(()))
        xq = (xg * inv[:, None]).round().clamp(-127, 127)  # round: nearest even, as the kernel's nearbyintf
        isum = (xq.long() @ codes[:, g * group:(g + 1) * group].long().t()).float()  # exact below 2^24
        acc = _fma(isum, scale[:, g][None] * d[:, None], acc)
        total = d * xq.sum(-1)
        acc = _fma(total[:, None].expand(m, n), bias[:, g][None], acc)
    assert torch.equal(ours, acc.bfloat16())
    for row in (2, 4, 10):
        assert torch.equal(cpu.int4_mm(x[row:row + 1], packed, sb, group), ours[row:row + 1])
    # further from the float product than bf16 activations, as llama.cpp's Q8 activations are
    exact = x.float() @ ((codes - 8).float() * scale.repeat_interleave(group, 1) + (bias + 8 * scale).repeat_interleave(
        group, 1)).t()
    err = ((ours.float() - exact).norm(dim=1) / exact.norm(dim=1))[[0, 6, 7]]
    assert (err < 0.02).all(), err
    monkeypatch.setattr(cpu, "ACTIVATIONS", "fp8")
    with pytest.raises(ValueError, match="SPECSERVE_CPU_ACTIVATIONS"):
        cpu.int4_mm(x, packed, sb, group)


@pytest.mark.skipif(len(ISAS_HERE) < 2, reason="one build runs on this CPU")
def test_both_builds_compute_the_same_values(monkeypatch):
    """Where both builds run, the AVX2 one computes what the AVX-512 one does (their products, attention, norms
    and SiLU round alike): a quantized model's logits through the fused layers."""
    model = load_model(tiny_llama(0, vocab=64, layers=2, hidden=128, heads=4, kv_heads=2, dtype=torch.bfloat16),
                       quantization="int4").model

    def logits(isa):
        monkeypatch.setattr(cpu, "ISA", isa)
        pool = KVPool(model, 1024)
        a, b = pool.sequence(), pool.sequence()
        with torch.inference_mode():
            pool.forward([a, b], [list(range(1, 30)), list(range(5, 12))], [1, 1])
            return pool.forward([a, b], [[3, 4, 5, 6], [7]], [4, 1])

    avx512, avx2 = logits("avx512"), logits("avx2")
    assert (avx512 - avx2).abs().max() <= 2**-7 * avx512.abs().max()
    assert torch.equal(avx512.argmax(-1), avx2.argmax(-1))


def test_the_build_is_chosen_from_the_cpu_and_the_switch(monkeypatch):
    monkeypatch.setattr(cpu, "ISA", "auto")
    assert cpu.chosen_isa() == ISAS_HERE[0]
    assert "specserve's CPU kernels" in cpu.describe() and "dense" not in cpu.describe()
    flags = cpu.cpu_flags()
    monkeypatch.setattr(cpu, "cpu_flags", lambda: flags | {"amx_int8"})  # an AMX CPU hears its tiles are unused
    assert "AMX tiles unused" in cpu.describe()
    monkeypatch.setattr(cpu, "cpu_flags", lambda: flags - {"amx_int8"})
    assert "AMX" not in cpu.describe()
    monkeypatch.setattr(cpu, "ISA", "avx3")
    with pytest.raises(ValueError, match="SPECSERVE_CPU_ISA"):
        cpu.available()
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"sse2", "avx"}))
    cpu._choose.cache_clear()
    try:
        for forced in ("auto", "avx2"):
            monkeypatch.setattr(cpu, "ISA", forced)
            assert not cpu.available() and "lacks" in cpu.describe()
    finally:
        cpu._choose.cache_clear()
    monkeypatch.setattr(cpu, "ENABLED", False)
    assert "SPECSERVE_CPU_KERNELS=0" in cpu.describe()


def _reference_attention(q, arena_k, arena_v, new_k, new_v, base, start, group, scale, window=None, softcap=None):
    """float64 attention of one sequence's new rows: its cached keys, then its new ones up to each row (with a
    sliding window, the last `window` of those; soft-capped scores, softcap · tanh(score / softcap), as Gemma 2)."""
    keys = torch.cat([arena_k[:, base : base + start].double(), new_k.transpose(0, 1).double()], 1)
    values = torch.cat([arena_v[:, base : base + start].double(), new_v.transpose(0, 1).double()], 1)
    n, heads, d = q.shape
    out = torch.empty(n, heads, d, dtype=torch.float64)
    for i in range(n):
        for h in range(heads):
            lo = 0 if window is None else max(0, start + i + 1 - window)
            s = keys[h // group, lo : start + i + 1] @ q[i, h].double() * scale
            s = s if softcap is None else softcap * torch.tanh(s / softcap)
            out[i, h] = torch.softmax(s, 0) @ values[h // group, lo : start + i + 1]
    return out.reshape(n, heads * d)


def _step(arena, seqs, heads, kv_heads, d, seed, window=None, softcap=None, spread=1.0):
    """q, k, v of a step's new rows laid out as the lean forward makes them (one [T, heads + 2·kv_heads, d]
    projection, viewed), and the kernel's output."""
    torch.manual_seed(seed)
    total = sum(n for _, _, n in seqs)
    qkv = (torch.randn(total, heads + 2 * kv_heads, d) * spread).bfloat16()
    q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    offsets = [0]
    for _, _, n in seqs:
        offsets.append(offsets[-1] + n)
    attention = cpu.Attention(arena[0], arena[1], [b for b, _, _ in seqs], [s for _, s, _ in seqs],
                                     [n for _, _, n in seqs], offsets, heads, d**-0.5, softcap)
    out = torch.empty(total, heads * d, dtype=torch.bfloat16)
    attention(1, q, k, v, out, window)
    return q, k, v, offsets, out


@pytest.mark.parametrize("window, softcap", [(None, None), (7, None), (64, None), (None, 3.0), (7, 3.0)],
                         ids=["full", "window-7", "window-64", "softcap", "window-7-softcap"])
def test_attention_reads_and_writes_the_arena_as_the_reference(window, softcap):
    """Soft-capped scores (Gemma 2) from keys and queries spread so that ~half the scores pass the cap."""
    heads, kv_heads, d = 6, 2, 64
    spread = 1.0 if softcap is None else 2.0
    torch.manual_seed(0)
    k_arena = (torch.randn(3, kv_heads, 512, d) * spread).bfloat16()
    v_arena = torch.randn(3, kv_heads, 512, d).bfloat16()
    before_k, before_v = k_arena.clone(), v_arena.clone()
    seqs = [(0, 10, 1), (64, 30, 5), (128, 0, 3), (256, 200, 16), (480, 17, 2)]  # (block, cached, new)
    q, k, v, offsets, out = _step((k_arena, v_arena), seqs, heads, kv_heads, d, 1, window, softcap, spread)
    for j, (base, start, n) in enumerate(seqs):
        rows = slice(offsets[j], offsets[j + 1])
        # the new keys and values land right after the cached ones, on the layer asked (1) only
        assert torch.equal(k_arena[1, :, base + start : base + start + n], k[rows].transpose(0, 1))
        assert torch.equal(v_arena[1, :, base + start : base + start + n], v[rows].transpose(0, 1))
        ref = _reference_attention(q[rows], before_k[1], before_v[1], k[rows], v[rows], base, start,
                                   heads // kv_heads, d**-0.5, window, softcap)
        assert (out[rows].double() - ref).abs().max() <= 2**-7 * max(1.0, ref.abs().max().item())
        if softcap is not None:  # and not the uncapped attention
            uncapped = _reference_attention(q[rows], before_k[1], before_v[1], k[rows], v[rows], base, start,
                                            heads // kv_heads, d**-0.5, window)
            assert n < 3 or (out[rows].double() - uncapped).abs().max() > 0.1
    untouched = torch.ones(512, dtype=torch.bool)
    for base, start, n in seqs:
        untouched[base + start : base + start + n] = False
    assert torch.equal(k_arena[1][:, untouched], before_k[1][:, untouched])
    assert torch.equal(k_arena[0], before_k[0]) and torch.equal(v_arena[2], before_v[2])


@pytest.mark.parametrize("heads, kv_heads, d", [(4, 1, 32), (9, 3, 64), (6, 1, 128), (2, 2, 64)])
def test_attention_rows_do_not_depend_on_the_rest_of_the_step(heads, kv_heads, d):
    """Bit for bit: a step's row alone, and a verify block's rows against decode steps. (A step of many rows
    takes a group of query heads that share keys and values at once; a lone row one head at a time.)"""
    torch.manual_seed(2)
    arena = torch.randn(2, 2, kv_heads, 300, d).bfloat16()
    together = _step((arena[0].clone(), arena[1].clone()), [(0, 40, 4), (100, 7, 1), (200, 90, 9)],
                     heads, kv_heads, d, 3)
    # the middle sequence's row again, alone, with the same q, k, v as in the group
    arena_k, arena_v = arena[0].clone(), arena[1].clone()
    q, k, v = together[0][4:5], together[1][4:5], together[2][4:5]
    out = torch.empty(1, heads * d, dtype=torch.bfloat16)
    cpu.Attention(arena_k, arena_v, [100], [7], [1], [0, 1], heads, d**-0.5)(1, q, k, v, out)
    assert torch.equal(out, together[4][4:5])
    # a verify block's row i equals the decode step that feeds the same token after rows 0..i-1
    arena_k, arena_v = arena[0].clone(), arena[1].clone()
    q, k, v, _, block = _step((arena_k, arena_v), [(0, 40, 4)], heads, kv_heads, d, 5)
    for i in range(4):
        step_k, step_v = arena[0].clone(), arena[1].clone()
        step_k[1, :, 40 : 40 + i], step_v[1, :, 40 : 40 + i] = arena_k[1, :, 40 : 40 + i], arena_v[1, :, 40 : 40 + i]
        row = torch.empty(1, heads * d, dtype=torch.bfloat16)
        cpu.Attention(step_k, step_v, [0], [40 + i], [1], [0, 1], heads, d**-0.5)(
            1, q[i : i + 1], k[i : i + 1], v[i : i + 1], row)
        assert torch.equal(row, block[i : i + 1]), i


@pytest.mark.parametrize("rows", [1, 4], ids=["one row, head by head", "four rows, heads grouped"])
def test_attention_scores_sum_pairs_as_the_dot_product_instruction_defines(isa, rows):
    """A score adds each pair of a key's inputs odd then even (vdpbf16ps), whether a head is computed alone or with
    the others of its group. Key 2 = [0, 2^20, 0 ..., 2^-5, -2^20, 0 ...] (inputs 0, 1 and 32, 33: one lane of the
    sums) against a query of ones scores 2^-5 (0 in the other order: 2^20 + 2^-5 rounds to 2^20); it is the only
    key with a value (ones), so every output is e^s / (e^s + 5)."""
    heads, kv_heads, d, cached = 3, 1, 64, 5
    k_arena = torch.zeros(2, kv_heads, 64 * rows, d).bfloat16()
    v_arena = torch.zeros_like(k_arena)
    for j in range(rows):
        k_arena[1, 0, 64 * j + 2, [1, 32, 33]] = torch.tensor([2.0**20, 2.0**-5, -(2.0**20)]).bfloat16()
        v_arena[1, 0, 64 * j + 2] = 1
    q = torch.ones(rows, heads, d).bfloat16()
    k, v = torch.zeros(rows, kv_heads, d).bfloat16(), torch.zeros(rows, kv_heads, d).bfloat16()
    out = torch.empty(rows, heads * d, dtype=torch.bfloat16)
    cpu.Attention(k_arena, v_arena, [64 * j for j in range(rows)], [cached] * rows, [1] * rows,
                         list(range(rows + 1)), heads, 1.0)(1, q, k, v, out)
    e = math.exp(2.0**-5)
    assert torch.equal(out, torch.full_like(out, e / (e + cached)))


def test_rms_norm_as_torch_up_to_rounding():
    torch.manual_seed(0)
    x = (torch.randn(37, 576) * 3).bfloat16()
    weight = torch.randn(576).bfloat16()
    ours = cpu.rms_norm(x, weight, 1e-5)
    ref = weight * F.rms_norm(x.float(), (576,), eps=1e-5).to(torch.bfloat16)
    assert ours.dtype == torch.bfloat16 and ours.shape == ref.shape
    # the same up to a bf16 step where float32 sums round apart
    assert (ours.float() - ref.float()).abs().max() <= 2**-7 * ref.float().abs().max()
    assert (ours == ref).float().mean() > 0.99
    assert torch.equal(cpu.rms_norm(x[5:6], weight, 1e-5), ours[5:6])  # a row as if alone
    # a view's rows (a stride over the hidden size) are read where they are
    wide = torch.randn(4, 1000).bfloat16()
    assert torch.equal(cpu.rms_norm(wide[:, :576], weight, 1e-5),
                       cpu.rms_norm(wide[:, :576].contiguous(), weight, 1e-5))


def test_pooled_bf16_steps_with_the_kernels_match_torchs_ops(monkeypatch):
    """A tiny bf16 model (head_dim 32) through a pool: the kernels' logits are torch's up to bf16 rounding, and a
    verify block's rows equal the decode steps' bit for bit."""
    model = tiny_llama(0, vocab=64, layers=2, hidden=128, heads=4, kv_heads=2, dtype=torch.bfloat16)

    def run(enabled: bool):
        monkeypatch.setattr(cpu, "ENABLED", enabled)
        pool = KVPool(model, 1024)
        a, b = pool.sequence(), pool.sequence()
        with torch.inference_mode():
            pool.forward([a, b], [list(range(1, 30)), list(range(5, 12))], [1, 1])
            block = pool.forward([a, b], [[3, 4, 5, 6], [7]], [4, 1])
            a.rollback(29)
            steps = torch.cat([pool.forward([a], [[t]], [1]) for t in (3, 4, 5, 6)])
        return block, steps

    spy = []
    monkeypatch.setattr(cpu, "rms_norm", lambda *a, _f=cpu.rms_norm: spy.append(1) or _f(*a))
    block, steps = run(True)
    assert spy, "the kernels were not used"
    assert torch.equal(block[:4], steps)
    torch_block, torch_steps = run(False)
    assert (block - torch_block).abs().max() <= 0.05 * torch_block.abs().max()
    assert torch.equal(block.argmax(-1), torch_block.argmax(-1))


def test_silu_mul_is_silu_times_up():
    torch.manual_seed(0)
    t = 9
    gate_up = (torch.randn(t, 2 * 96) * 3).bfloat16()
    gate, up = gate_up.chunk(2, -1)
    ours, ref = cpu.silu_mul(gate_up), F.silu(gate) * up
    assert ours.shape == ref.shape and ours.dtype == torch.bfloat16
    assert (ours.float() - ref.float()).abs().max() <= 2**-7 * ref.float().abs().max()
    assert (ours == ref).float().mean() > 0.95
    assert torch.equal(cpu.silu_mul(gate_up[4:5]), ours[4:5])  # a row as if alone


def test_gelu_mul_is_gelus_tanh_form_times_up():
    """Gemma's GeGLU: within a bfloat16 rounding of torch's, mostly equal to it, a row as if alone; negative inputs
    far out (where 1 + tanh cancels) included."""
    torch.manual_seed(0)
    gate_up = (torch.randn(9, 2 * 96) * 3).bfloat16()
    gate_up[0, :8] = torch.tensor([-12.0, -8.0, -5.0, -3.5, 0.0, 1e-3, -1e-3, 9.0]).bfloat16()
    gate, up = gate_up.chunk(2, -1)
    ours, ref = cpu.gelu_mul(gate_up), F.gelu(gate, approximate="tanh") * up
    assert ours.shape == ref.shape and ours.dtype == torch.bfloat16
    g = gate.double()  # as x · sigmoid(2u): float64's 1 + tanh(u) is 0 far out, where the function is not
    exact = g * torch.sigmoid(2 * math.sqrt(2 / math.pi) * (g + 0.044715 * g**3)) * up.double()
    assert ((ours.double() - exact).abs() <= 2**-7 * exact.abs() + 1e-30).all()
    assert (ours == ref).float().mean() > 0.9  # (torch's float32 tanh form rounds differently: 0 for x < -5)
    assert torch.equal(cpu.gelu_mul(gate_up[4:5]), ours[4:5])


def test_rms_norm_with_float32_weights_scales_before_the_cast():
    """Gemma's (1 + w) and OLMo 2's norms: bfloat16(x / rms(x) · w) in float32, one rounding, as torch's float32
    forward of it rounds: within a rounding of it, mostly equal, a row as if alone."""
    torch.manual_seed(0)
    x = (torch.randn(7, 160) * 4).bfloat16()
    w = 1.0 + torch.randn(160) * 0.3
    ours = cpu.rms_norm(x, w, 1e-6)
    ref = (F.rms_norm(x.float(), (160,), eps=1e-6) * w).bfloat16()
    assert ((ours.float() - ref.float()).abs() <= 2**-8 * ref.float().abs()).all()
    assert (ours == ref).float().mean() > 0.95
    assert torch.equal(cpu.rms_norm(x[3:4], w, 1e-6), ours[3:4])
    assert not torch.equal(ours, cpu.rms_norm(x, w.bfloat16(), 1e-6))  # the weights' dtype picks the kernel


def _quantization(method: str, monkeypatch) -> str:
    """"int4-q8": int4 weights, int8 activations (SPECSERVE_CPU_ACTIVATIONS=int8)."""
    if method == "int4-q8":
        monkeypatch.setattr(cpu, "ACTIVATIONS", "int8")
        return "int4"
    return method


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "olmo2"])
@pytest.mark.parametrize("method", ["int4", "int4-q8", "int8"])
def test_fused_layers_equal_the_per_op_path(monkeypatch, method, family):
    """A quantized bf16 model's prompts, decode steps and verify blocks through `FusedLayers` (one call a layer; its
    rotary, residual adds, q|k|v biases (Qwen2), q/k norms per head (Qwen3, Gemma 3) or over all heads (OLMo 2),
    GeGLU and Gemma's float32 norms, sandwiched (Gemma 2/3) or after attention and MLP only (OLMo 2), soft-capped
    attention (Gemma 2), local and global ropes (Gemma 3) and roundings in C++): the same logits as the per-op path bit for bit, a verify block's
    rows the decode steps'."""
    method = _quantization(method, monkeypatch)
    dense = tiny_llama(0, vocab=64, layers=2, hidden=128, heads=4, kv_heads=2, dtype=torch.bfloat16) \
        if family == "llama" else tiny_family(family, vocab=64, dtype=torch.bfloat16, spread=0.08, wide=True)
    model = load_model(dense, quantization=method).model
    runs = []
    monkeypatch.setattr(FusedLayers, "run", lambda *a, _f=FusedLayers.run: runs.append(1)
                        or _f(*a))

    def run(fused: bool):
        monkeypatch.setattr(cpu, "FUSED", fused)
        pool = KVPool(model, 1024)
        a, b = pool.sequence(), pool.sequence()
        with torch.inference_mode():
            prompts = pool.forward([a, b], [list(range(1, 20)), list(range(5, 12))], [1, 1])
            block = pool.forward([a, b], [[3, 4, 5, 6], [7]], [4, 1])
            a.rollback(19)
            steps = torch.cat([pool.forward([a], [[t]], [1]) for t in (3, 4, 5, 6)])
        return prompts, block, steps

    prompts, block, steps = run(True)
    assert len(runs) == 6, "the steps did not take the fused layers"
    assert torch.equal(block[:4], steps)
    per_op = run(False)
    assert len(runs) == 6
    for ours, theirs in zip((prompts, block, steps), per_op):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("method", ["int4", "int4-q8", "int8"])
def test_a_session_resumed_by_prefill_goes_on_with_the_same_logits(method, monkeypatch):
    """Prompts go through the kernels' attention too, so every row of every step is computed as if alone: a
    session whose committed tokens are fed again as one prompt (a worker restarted; a prefix found in the cache)
    gets the logits its uninterrupted run got, bit for bit, beside other sessions or not (below 32 rows, where
    an AVX-512 CPU's layers switch to their dense copy)."""
    method = _quantization(method, monkeypatch)
    model = load_model(tiny_llama(1, vocab=64, layers=2, hidden=128, heads=4, kv_heads=2, dtype=torch.bfloat16),
                       quantization=method).model
    prompt, generated = list(range(3, 17)), [9, 41, 2, 60, 17, 33]
    with torch.inference_mode():
        pool = KVPool(model, 1024)
        a = pool.sequence()
        uninterrupted = [pool.forward([a], [prompt], [1])]
        uninterrupted += [pool.forward([a], [[t]], [1]) for t in generated]
        for cut in (2, 5):  # resumed after `cut` generated tokens, alone and beside another session's prompt
            fresh = KVPool(model, 1024)
            r, other = fresh.sequence(), fresh.sequence()
            first = fresh.forward([other, r], [list(range(20, 31)), prompt + generated[:cut]], [1, 1])[1:]
            assert torch.equal(first, uninterrupted[cut])
            for i, t in enumerate(generated[cut:-1], start=cut + 1):
                assert torch.equal(fresh.forward([r], [[t]], [1]), uninterrupted[i])


@pytest.mark.slow
@pytest.mark.parametrize("gamma", [3, "auto"])
def test_quantized_embedded_greedy_speculation_equals_target_only_in_bf16(gamma):
    """The shipped Q4_1 target in bfloat16: every verify row is computed as the decode step's would be, so greedy
    speculation is target-only decoding token for token (prefix caching off: a prompt fed whole and one fed
    after a cached prefix are different shapes, which may round apart). The int8 draft drafts on a pool of its own,
    each of its layers one kernel call, and gives every sequence back."""
    decoder = SpeculativeDecoder(load_model("embedded", device="cpu"), "embedded-draft", gamma="auto",
                                 prefix_caching=False)
    assert decoder.draft_pool is not None and decoder.draft_pool.fuses_layers
    greedy = SamplingParams(temperature=0.0)
    for prompt in ("What are three practical tips for staying focused while working from home?",
                   "Write a python function that reverses a linked list."):
        chat = [{"role": "user", "content": prompt}]
        plain = decoder.generate(chat, greedy, max_new_tokens=64, gamma=0)
        spec = decoder.generate(chat, greedy, max_new_tokens=64, gamma=gamma)
        assert spec.token_ids == plain.token_ids
        assert spec.stats.accepted > 0 and spec.stats.rounds < len(spec.token_ids)
    assert decoder.draft_pool.allocator.used == 0


def test_compiled_code_takes_torchs_ops():
    """Under torch.compile the ctypes calls cannot be traced: the step's RMS norm falls back to torch's op."""
    x = torch.randn(2, 64).bfloat16()
    assert cpu.rms_ok(x)
    torch._dynamo.reset()
    compiled = torch.compile(lambda t, w: lean._rms(t, w, 1e-6), backend="eager", fullgraph=True)
    weight = torch.ones(64).bfloat16()
    assert torch.allclose(compiled(x, weight).float(), lean._rms(x, weight, 1e-6).float(), atol=0.02)


def test_a_dense_draft_named_for_a_cpu_is_int8_by_default():
    from specserve.models.formats.loading import draft_quantization

    assert draft_quantization(None, "embedded-draft", None, "cpu") == "int8"
    assert draft_quantization("auto", "some/draft", "bfloat16", "cpu") == "int8"
    # asked for, another dtype, a GGUF draft (not found here; 5-bit and wider ones: tests/cpu/test_gguf_files.py),
    # a model passed loaded, or a GPU: as given
    assert draft_quantization("none", "embedded-draft", None, "cpu") == "none"
    assert draft_quantization("int4", "embedded-draft", None, "cpu") == "int4"
    assert draft_quantization("auto", "embedded-draft", "float32", "cpu") == "auto"
    assert draft_quantization("auto", "d.gguf", None, "cpu") == "auto"
    assert draft_quantization("auto", tiny_llama(0), None, "cpu") == "auto"
    assert draft_quantization("auto", "embedded-draft", None, "cuda") == "auto"


def _head_kernel(loaded) -> str:
    return f"int{next(iter(loaded.model._specserve_lean.values())).head.bits}"


@pytest.mark.skipif(not cpu.available(), reason="needs the CPU kernels")
def test_an_int4_draft_has_an_int4_head_and_stays_exact():
    """Under int4 a draft's LM head is int4 too (a third less of the real pair's draft step), a target's stays
    int8, and a vocabulary that does not fill the int4 tiles of 16 rows keeps int8; greedy speculation with the
    int4 head equals γ=0."""
    draft = load_model(tiny_llama(0, vocab=64, hidden=64, dtype=torch.bfloat16), quantization="int4", draft=True)
    assert _head_kernel(draft) == "int4"
    target = load_model(tiny_llama(0, vocab=64, hidden=64, dtype=torch.bfloat16), quantization="int4")
    assert _head_kernel(target) == "int8"
    odd = load_model(tiny_llama(0, vocab=60, hidden=64, dtype=torch.bfloat16), quantization="int4", draft=True)
    assert _head_kernel(odd) == "int8"
    decoder = SpeculativeDecoder(tiny_llama(1, vocab=64, hidden=64, layers=2, scale=2.0, dtype=torch.bfloat16),
                                 tiny_llama(2, vocab=64, hidden=64, scale=2.0, dtype=torch.bfloat16), gamma=3,
                                 draft_quantization="int4", draft_lookup=False)
    assert _head_kernel(decoder.draft) == "int4"
    greedy = SamplingParams(temperature=0)
    for prompt in ([1, 2, 3], [7, 9, 11, 13, 5]):
        plain = decoder.generate(prompt, greedy, max_new_tokens=20, gamma=0)
        spec = decoder.generate(prompt, greedy, max_new_tokens=20, gamma=3)
        assert spec.token_ids == plain.token_ids and spec.stats.drafted > 0
