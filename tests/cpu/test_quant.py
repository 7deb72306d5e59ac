"""Quantized weights (`models.kernels.quant`): the kernels compute the quantized values, a GGUF file is read as stored,
and speculative output is exactly the quantized target's (chi-square against its own distribution, greedy
identity with its target-only decoding)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from specserve import SamplingParams, SpeculativeDecoder
from specserve.models import load_model
from specserve.models.families.lean import lean_weights, model_sequence
from specserve.models.formats import embedded
from specserve.models.kernels import cpu, quant
from specserve.models.formats.gguf import _q4_blocks, gguf_linears
from specserve.models.kernels.quant import Int4Groups, Int8Rows, QuantizedLinear
from specserve.quantization import parse
from specserve.speculation import rejection

from tests.conftest import tiny_llama
from tests.cpu.test_exactness import N, chi_square_pvalue, sampled_joint
from tests.reference import reference_probs


@pytest.mark.parametrize("kernels", ["specserve", "specserve-dense-from-32", "torch"])
@pytest.mark.parametrize("weight", ["int8", "int4-g32", "int4-g64", "int4-g128"])
def test_kernels_multiply_by_the_dequantized_weights_row_by_row(weight, kernels, monkeypatch):
    """(specserve-dense-from-32: SPECSERVE_CPU_DENSE_FROM=32, a dense copy from 32 rows where oneDNN has bf16.)"""
    if kernels != "torch" and not cpu.available():
        pytest.skip("specserve's CPU kernels need AVX-512 bf16 or AVX2+FMA+F16C, and g++")
    if kernels == "specserve-dense-from-32":
        monkeypatch.setattr(cpu, "DENSE_FROM", 32)
        kernels = "specserve"
    monkeypatch.setattr(cpu, "ENABLED", kernels == "specserve")
    torch.manual_seed(0)
    dense = torch.randn(320, 256)
    method, group = parse(weight)
    stored = Int8Rows.quantize(dense) if method == "int8" else Int4Groups.quantize(dense, group)
    values = stored.dequantize()
    step = 127 if method == "int8" else 15
    assert (values - dense).abs().max() <= (dense.abs().max() if method == "int8" else 2 * dense.abs().max()) / step
    x = torch.randn(40, 256).bfloat16()
    packed = QuantizedLinear(stored, torch.bfloat16, "cpu")
    assert (packed.kernel is not None) == (kernels == "specserve")
    out = packed(x)
    reference = x.float() @ values.t()
    def close(y):  # bf16 activations and outputs: within 1% of the largest output
        return (y.float() - reference[: len(y)]).abs().max() <= 0.01 * reference.abs().max()

    assert out.dtype == torch.bfloat16 and close(out)
    # each row as if alone: a verify block's rows equal decode steps' (greedy identity in bf16 rests on it)
    assert torch.equal(out, torch.cat([packed(x[i : i + 1]) for i in range(len(x))]))
    dense_from = QuantizedLinear(stored, torch.bfloat16, "cpu", dense_from=8)
    if kernels == "specserve" and not cpu.kernels_keep_dense_copy():  # (by default) the kernels take every row
        assert dense_from.dense_from == 0 and dense_from.dense is None and torch.equal(dense_from(x), out)
        return
    rows = dense_from.dense_from  # specserve's kernels keep the quantized weights to more rows than torch's
    assert rows == (32 if kernels == "specserve" else 8) and rows < len(x)
    assert torch.equal(dense_from(x[: rows - 1]), out[: rows - 1])  # below the threshold: the kernel
    assert close(dense_from(x)) and not torch.equal(dense_from(x), out)  # from it on: the bf16 GEMM


@pytest.mark.skipif(not cpu.available(), reason="needs AVX-512 bf16 or AVX2+FMA+F16C, and g++")
def test_specserve_cpu_kernels_against_torchs(monkeypatch):
    """specserve's int4/int8 kernels compute what torch's do up to bf16 rounding (int4 with int8 activations, up
    to theirs: within 2^-6 of the largest output where bf16 activations are within 2^-8), with the stored float16
    scales exactly; shapes or scales they cannot take go to torch's kernels."""
    torch.manual_seed(1)
    for method, activations, bound in (("int8", "bf16", 2**-8), ("int4", "bf16", 2**-8), ("int4", "int8", 2**-6)):
        monkeypatch.setattr(cpu, "ACTIVATIONS", activations)
        stored = quant.quantize(torch.randn(96, 192) * 0.05, method, 64)
        ours = QuantizedLinear(stored, torch.bfloat16, "cpu")
        reference = stored.dequantize().double()
        for rows in (1, 3, 8, 9, 17):  # one pass, and passes of 8 rows over the weights
            x = torch.randn(rows, 192).bfloat16()
            exact = x.double() @ reference.t()
            assert (ours(x).double() - exact).abs().max() <= bound * exact.abs().max(), (method, activations, rows)
    # Q4_1's float16 minimum and scale are read as stored (torch's kernel rounds them to bfloat16)
    q4 = Int4Groups.quantize(torch.randn(32, 64), 32)
    assert torch.equal(q4.scale.half().float(), q4.scale) and cpu.packed(q4) is not None
    odd = Int4Groups(q4.codes, q4.scale + 1e-4, q4.zero, 32)  # not float16 values
    assert cpu.packed(odd) is None and QuantizedLinear(odd, torch.bfloat16, "cpu").kernel is None
    assert QuantizedLinear(Int8Rows.quantize(torch.randn(40, 64)), torch.bfloat16, "cpu").kernel is None  # 40 rows
    assert QuantizedLinear(q4, torch.float32, "cpu").kernel is None  # float32 activations: torch's kernels


@pytest.mark.skipif(not cpu.onednn_bf16(), reason="needs oneDNN's bfloat16 path (AVX-512)")
def test_packed_dense_weights_multiply_as_f_linear(monkeypatch):
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 64).bfloat16(), torch.randn(96).bfloat16()
    packed = quant.dense(weight)
    assert isinstance(packed, quant.PackedDense) and packed.nbytes == weight.nbytes
    for rows in (1, 3, 8, 40):
        x = torch.randn(rows, 64).bfloat16()
        for b in (None, bias):
            reference = F.linear(x.float(), weight.float(), None if b is None else b.float())
            out = quant.linear(x, packed, b)
            assert out.dtype == torch.bfloat16 and out.shape == (rows, 96)
            assert (out.float() - reference).abs().max() <= 0.01 * reference.abs().max()
    # float32 weights stay plain tensors (F.linear), as do all where packing is off
    assert isinstance(quant.dense(weight.float()), torch.Tensor) and quant.dense(None) is None
    monkeypatch.setattr(quant, "PACK_DENSE", False)
    assert isinstance(quant.dense(weight), torch.Tensor)
    monkeypatch.undo()
    # a dense bf16 model's layers and head, and a quantized one's bf16 copies, are packed once at load
    w = lean_weights(tiny_llama(0, vocab=32, hidden=64), torch.bfloat16)
    assert all(isinstance(t, quant.PackedDense) for t in (w.layers[0][1], w.layers[0][3], w.layers[0][6], w.head))
    copy = QuantizedLinear(Int8Rows.quantize(weight.float()), torch.bfloat16, "cpu", 8).dense
    assert isinstance(copy, quant.PackedDense) if cpu.kernels_keep_dense_copy() or not cpu.available() \
        else copy is None  # the kernels keep none unless asked (SPECSERVE_CPU_DENSE_FROM), the AVX2 build never


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("weight", ["int8", "int4-g32", "int4-g128"])
def test_cuda_kernels_multiply_by_the_dequantized_weights(weight):
    torch.manual_seed(0)
    dense = torch.randn(384, 512)
    method, group = parse(weight)
    stored = Int8Rows.quantize(dense) if method == "int8" else Int4Groups.quantize(dense, group)
    x = torch.randn(5, 512).bfloat16()
    reference = x.float() @ stored.dequantize().t()
    out = QuantizedLinear(stored, torch.bfloat16, "cuda")(x.cuda()).float().cpu()
    assert (out - reference).abs().max() <= 0.01 * reference.abs().max()


def test_q4_blocks_are_the_codes_gguf_stores():
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize, quantize

    rng = np.random.default_rng(0)
    dense = rng.standard_normal((6, 128)).astype(np.float32)
    for kind in (T.Q4_0, T.Q4_1):
        raw = quantize(dense, kind)
        ours = _q4_blocks(raw, 6, 128, kind == T.Q4_1)
        assert ours.codes.max() <= 15 and ours.group == 32
        np.testing.assert_allclose(ours.dequantize().numpy(), dequantize(raw, kind), rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def shipped():
    """The embedded target as served by default (its Q4_1 file, kept quantized) and dense in fp32."""
    return load_model("embedded", device="cpu"), load_model("embedded", "float32", "cpu")


def test_the_embedded_target_is_served_from_its_q4_1_weights(shipped):
    quantized, dense = shipped
    assert quantized.quantization == "gguf-Q4_1" and quantized.dtype == torch.bfloat16
    assert dense.quantization == "none"  # fp32 asked: the file's values dequantized
    layers = gguf_linears(embedded.embedded_gguf_path(), dense.model.config)
    # the stored codes dequantize to what transformers' GGUF loader made of the file (q and k rows unpermuted)
    for i in (0, 17):
        attn, mlp = dense.model.model.layers[i].self_attn, dense.model.model.layers[i].mlp
        for role, linear in (("q", attn.q_proj), ("k", attn.k_proj), ("v", attn.v_proj), ("o", attn.o_proj),
                             ("gate", mlp.gate_proj), ("up", mlp.up_proj), ("down", mlp.down_proj)):
            assert torch.allclose(layers["layers"][i][role].dequantize(), linear.weight, rtol=0, atol=2e-6), role
    head = layers["head"]  # the tied embedding's Q8_0 blocks, as stored too
    assert head.source == "Q8_0" and torch.equal(head.dequantize(), dense.model.lm_head.weight)
    # the dense linear weights are gone from the quantized model; its lean forward serves it
    assert quantized.model.model.layers[0].mlp.up_proj.weight.numel() == 0
    ids = quantized.tokenizer("The capital of France is")["input_ids"]
    a = model_sequence(quantized.model).feed(ids, keep_logits=len(ids))
    b = model_sequence(dense.model).feed(ids, keep_logits=len(ids))
    assert (a - b).abs().max() < 2.0 and (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.8


CHAT = [{"role": "user", "content": "What are three practical tips for staying focused while working from home?"}]


@pytest.mark.slow
@pytest.mark.parametrize("gamma", [3, "auto"])
def test_quantized_embedded_greedy_speculation_follows_its_target_to_bf16_near_ties(shipped, gamma):
    """In bf16 a verify block's attention sums a row over its masked length, a decode step over its own, so the
    two can round apart (docs/serving.md); greedy speculation then agrees with target-only decoding up to a
    position where the target's top two logits are within bf16 noise. A wrong acceptance rule departs at a
    clear margin. The exact identity is `test_quantized_greedy_speculation_equals_target_only` (float32)."""
    decoder = SpeculativeDecoder(shipped[0], "embedded-draft", gamma="auto")
    greedy = SamplingParams(temperature=0.0, logprobs=2)
    plain = decoder.generate(CHAT, greedy, max_new_tokens=48, gamma=0)
    spec = decoder.generate(CHAT, greedy, max_new_tokens=48, gamma=gamma)
    assert spec.stats.accepted > 0 and spec.stats.rounds < len(spec.token_ids)
    same = next((i for i, (a, b) in enumerate(zip(plain.token_ids, spec.token_ids)) if a != b), None)
    if same is not None:
        top = sorted((lp for _, lp in plain.logprobs[same][2]), reverse=True)
        assert same >= 8 and top[0] - top[1] < 0.5, (same, top)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_greedy_speculation_equals_target_only(method):
    target = load_model(tiny_llama(0, vocab=64, hidden=64, layers=2, scale=40.0), "float32", quantization=method)
    decoder = SpeculativeDecoder(target, tiny_llama(1, vocab=64, hidden=64, scale=40.0, dtype=torch.float32),
                                 gamma=3, draft_lookup=False)
    greedy = SamplingParams(temperature=0.0, ignore_eos=True)
    for prompt in ([1, 5, 2, 7], [3, 3, 9, 40, 12]):
        plain = decoder.generate(prompt, greedy, max_new_tokens=40, gamma=0)
        for gamma in (1, 3, 5):
            spec = decoder.generate(prompt, greedy, max_new_tokens=40, gamma=gamma)
            assert spec.token_ids == plain.token_ids and spec.stats.drafted > 0
    # and that is the quantized model's own argmax chain
    logits = model_sequence(target.model).feed(prompt + plain.token_ids[:-1], keep_logits=40)
    assert logits.argmax(-1).tolist() == plain.token_ids


def quantized_tiny(method: str, seed: int = 0):
    """A tiny random Llama (hidden 64: int4 groups of 32 and 64 divide it) loaded quantized."""
    return load_model(tiny_llama(seed, hidden=64, scale=40.0, dtype=torch.bfloat16), quantization=method)


def lean_joint(loaded, mode: dict, prompt: list[int]) -> np.ndarray:
    """P(first token = a, second = b) under the quantized target itself (its lean forward, one row at a time)."""
    vocab = loaded.vocab_size
    args = (mode.get("temperature", 1.0), mode.get("top_k", 0), mode.get("top_p", 1.0))
    p1 = reference_probs(model_sequence(loaded.model).feed(prompt)[-1].double().numpy(), *args)
    seconds = [model_sequence(loaded.model).feed(prompt + [a])[-1].double().numpy() for a in range(vocab)]
    return np.stack([p1[a] * reference_probs(seconds[a], *args) for a in range(vocab)])


@pytest.mark.parametrize("method,mode", [("int8", dict(temperature=1.0)),
                                         ("int4", dict(temperature=0.8, top_k=5, top_p=0.95))])
def test_quantized_target_first_two_tokens_follow_the_quantized_target(method, mode, monkeypatch):
    target = quantized_tiny(method)
    assert target.quantization in ("int8", "int4-g32")
    draft = tiny_llama(1, hidden=64, scale=40.0)
    decoder = SpeculativeDecoder(target, draft, gamma=2, draft_lookup=False)
    prompt = [1, 5, 2, 7]
    expected = lean_joint(target, mode, prompt)
    dense = load_model(tiny_llama(0, hidden=64, scale=40.0, dtype=torch.bfloat16), "float32")
    dense_expected = lean_joint(dense, mode, prompt)
    assert np.abs(expected - dense_expected).max() > 1e-3  # quantizing made a different model here
    counts = sampled_joint(decoder, mode, 3, prompt)
    assert counts.sum() == N and chi_square_pvalue(counts, expected) > 1e-3
    monkeypatch.setattr(rejection, "residual_distribution", lambda p, q: p)
    assert chi_square_pvalue(sampled_joint(decoder, mode, 3, prompt), expected) < 1e-3


def test_quantization_errors_name_what_is_wrong(tmp_path):
    tiny = tiny_llama(0, hidden=64, dtype=torch.bfloat16)
    tiny.config.quantization_config = {"quant_method": "gptq", "bits": 4, "group_size": 32}
    tiny.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="pre-quantized 'gptq' checkpoint"):
        load_model(str(tmp_path), quantization="int4")
    with pytest.raises(ValueError, match="pre-quantized 'gptq' checkpoint"):
        load_model(str(tmp_path))
    del tiny.config.quantization_config
    with pytest.raises(ValueError, match="not a .gguf file"):
        load_model(str(embedded.shipped_draft_dir()), quantization="gguf")
    with pytest.raises(ValueError, match="passed loaded"):
        load_model(tiny, quantization="gguf")
    with pytest.raises(ValueError, match="int4 groups must be one of"):
        parse("int4-g48")
    with pytest.raises(ValueError, match="quantization must be one of"):
        parse("int5")
    with pytest.raises(ValueError, match="do not divide"):
        load_model(tiny_llama(0, hidden=48, dtype=torch.bfloat16), quantization="int4-g64")

    from pydantic import ValidationError
    from specserve.serve.config import AppConfig

    with pytest.raises(ValidationError, match="draft_quantization"):
        AppConfig(draft_quantization="int3")


@pytest.mark.slow
def test_where_no_cpu_kernels_run_a_gguf_file_loads_dense_in_float32(monkeypatch, capsys):
    """torch's bf16 int4 kernels round a row by the batch around it; where specserve's do not run, the default
    (`auto`, no dtype) keeps seeded streams batch-independent by loading the file's values in float32, says so,
    and an explicit choice is kept."""
    monkeypatch.setattr(cpu, "ENABLED", False)
    loaded = load_model("embedded", device="cpu")
    assert loaded.quantization == "none" and loaded.dtype == torch.float32
    assert "loads dense in float32" in capsys.readouterr().err
    assert load_model("embedded", device="cpu", dtype="bfloat16").quantization.startswith("gguf")
