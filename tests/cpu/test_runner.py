"""The static-shape step runner (models/memory/runner.py): the same logits and cache writes as the eager pooled
forward, padding rows that never touch a session, buckets; on CUDA, graph replay equal to eager steps."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from specserve.models.kernels.quant import QuantizedLinear
from specserve.models.memory.pool import KVPool
from specserve.models.memory.runner import compiled_isa

from tests.conftest import tiny_llama

VOCAB = 40


@pytest.fixture(scope="module")
def model():
    return tiny_llama(5, vocab=VOCAB, layers=2, hidden=32, scale=8)


def twin_pools(model, **kwargs) -> tuple[KVPool, KVPool]:
    """The same pool twice, eager and through the runner, their arenas filled alike (so a stray write shows)."""
    eager = KVPool(model, tokens=1024, max_length=256, min_block=4, runner=False, **kwargs)
    static = KVPool(model, tokens=1024, max_length=256, min_block=4, runner=True, **kwargs)
    for pool in (eager, static):
        gen = torch.Generator(device="cpu").manual_seed(1)
        pool.k.copy_(torch.randn(pool.k.shape, generator=gen, dtype=torch.float64).to(pool.k))
        pool.v.copy_(torch.randn(pool.v.shape, generator=gen, dtype=torch.float64).to(pool.v))
    return eager, static


@pytest.mark.parametrize("width", [1, 3])
def test_runner_steps_equal_the_eager_forward_and_write_only_their_rows(model, width):
    eager, static = twin_pools(model)
    rng = random.Random(width)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (5, 12, 2)]  # 3 sequences: bucket 4, one pad
    runs = []
    for pool in (eager, static):
        seqs = [pool.sequence() for _ in prompts]
        pool.forward(seqs, prompts, [1, 1, 1])  # ragged prefill: eager in both
        steps = []
        for step in range(4):
            chunks = [[(7 * step + 3 * j + i) % VOCAB for i in range(width)] for j in range(len(seqs))]
            steps.append(pool.forward(seqs, chunks, [width, 1, width]))
        runs.append((steps, seqs))
    (eager_steps, eager_seqs), (static_steps, static_seqs) = runs
    assert static.runner.buckets and not eager.runner  # the runner really ran the steps
    assert [k[:2] for k in static.runner.buckets] == [(4, width)]
    for a, b in zip(eager_steps, static_steps):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-10, rtol=0)
    # every arena row but the scratch row holds what the eager steps left there (to rounding: the matmuls' row
    # counts differ): a padding row that wrote anywhere else would show as a whole wrong row
    scratch = static.runner.scratch
    assert torch.allclose(eager.k[:, :, :scratch], static.k[:, :, :scratch], atol=1e-12, rtol=0)
    assert torch.allclose(eager.v[:, :, :scratch], static.v[:, :, :scratch], atol=1e-12, rtol=0)
    assert [s.tokens for s in eager_seqs] == [s.tokens for s in static_seqs]


def test_buckets_and_what_runs_eagerly(model):
    _, static = twin_pools(model, max_width=3)
    runner = static.runner
    assert runner.bucket_for(3, 1, 10) == (4, 1, 64)
    assert runner.bucket_for(17, 3, 65) == (24, 3, 128)
    assert runner.bucket_for(1, 4, 10) is None  # wider than max_width: eager
    assert runner.bucket_for(65, 1, 10) is None  # more sequences than the largest bucket
    assert runner.contexts[-1] >= static.max_length
    seqs = [static.sequence(), static.sequence()]
    static.forward(seqs, [[1, 2], [3]], [1, 1])  # ragged: eager, no bucket made
    assert not runner.buckets
    static.forward(seqs, [[4], [5]], [1, 1])
    assert list(runner.buckets) == [(2, 1, 64)]


def test_a_padding_row_sees_only_the_scratch_row(model):
    eager, static = twin_pools(model)
    seq = static.sequence()
    static.forward([seq], [[1, 2, 3]], [1])
    before = static.k.clone()
    out = static.runner.forward((2, 1, 64), [seq.block[0]], [len(seq.tokens)], [[4]])
    assert out.shape[0] == 1 and torch.isfinite(out).all()
    changed = (static.k != before).any(dim=(0, 1, 3)).nonzero().flatten().tolist()
    assert changed == [seq.block[0] + 3, static.runner.scratch]  # the new token's row and the scratch row


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU (a device session: pytest tests -k cuda)")
def test_cuda_graph_replay_equals_eager_steps(model):
    cuda_model = copy.deepcopy(model).to("cuda")
    eager = KVPool(cuda_model, tokens=1024, max_length=256, min_block=4, runner=False)
    static = KVPool(cuda_model, tokens=1024, max_length=256, min_block=4, runner=True)
    assert static.runner.capture
    outs = []
    for pool in (eager, static):
        seqs = [pool.sequence() for _ in range(3)]
        pool.forward(seqs, [[1, 2, 3], [4, 5], [6]], [1, 1, 1])
        outs.append([pool.forward(seqs, [[(s + j) % VOCAB] for j in range(3)], [1, 1, 1]) for s in range(6)])
    assert static.runner.replays >= 4  # the first step of the bucket captured it, the rest replayed
    for a, b in zip(*outs):
        assert torch.allclose(a, b, atol=1e-6, rtol=0)


def test_an_in_process_draft_drafts_on_a_pool_where_the_runner_is_on(model, monkeypatch):
    """Where pools get a step runner (CUDA by default; forced here), SpeculativeDecoder's model draft drafts on a
    pool of its own, through the runner, with the same tokens as its private cache in every sampling mode."""
    from specserve import SpeculativeDecoder
    from specserve.models.memory import pool as pool_module
    from specserve.speculation import SamplingParams

    draft = tiny_llama(6, vocab=VOCAB, layers=1, hidden=32, scale=8)
    modes = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3),
             SamplingParams(temperature=0.8, top_k=5, seed=4), SamplingParams(temperature=1.0, top_p=0.7, seed=5)]
    outputs = {}
    for runner in (False, True):
        monkeypatch.setattr(pool_module, "STEP_RUNNER", runner)
        decoder = SpeculativeDecoder(model, draft, gamma=3, draft_lookup=False, kv_cache_tokens=1024)
        assert (decoder.draft_pool is not None) == runner
        outputs[runner] = [decoder.generate([1, 2, 3, 4, 5], params, 24).token_ids for params in modes]
        if runner:
            assert decoder.draft_pool.runner.buckets  # the draft's steps went through it
            assert decoder.draft_pool.allocator.used == 0  # every generation gave its draft sequence back
    assert outputs[True] == outputs[False]
    plain = SpeculativeDecoder(model, None, gamma=0, kv_cache_tokens=1024)
    assert outputs[True][0] == plain.generate([1, 2, 3, 4, 5], modes[0], 24).token_ids


@pytest.mark.parametrize("weights", ["float32", "int4"])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("mode", [True, "dynamic"], ids=["static", "dynamic"])
def test_compiled_steps_equal_the_eager_steps(model, monkeypatch, device, weights, mode):
    """`SPECSERVE_COMPILE_STEPS=1`: each bucket's step compiled by torch.compile (then captured on CUDA) gives the
    eager forward's logits and sequences, as one graph per (batch, width) whatever the context bucket (`dynamic`:
    the batch and width symbols, one graph per (batch is 1, width is 1) pair), with no
    graph break (a break leaves dynamo compiling the callees, eager forwards included). int4: a quantized
    bfloat16 model whose verify-width layers multiply a dense copy (oneDNN-packed on a CPU that has it).
    Needs a C++ compiler on a CPU (Inductor's CPU code) or a GPU."""
    import os
    import shutil
    import sysconfig

    import torch._dynamo
    from specserve.models.formats.loading import load_model
    from specserve.models.memory import runner as runner_module
    from torch._dynamo.utils import counters

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no GPU (a device session: pytest tests -k cuda)")
    headers = os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))
    if device == "cpu" and (shutil.which("g++") is None or not headers):
        pytest.skip("no C++ compiler or Python headers for Inductor's CPU code")
    monkeypatch.setattr(runner_module, "COMPILE_STEPS", mode)
    if weights == "int4":
        here = load_model(tiny_llama(5, vocab=VOCAB, hidden=64, scale=8.0, dtype=torch.bfloat16), device=device,
                          quantization="int4").model
    else:
        here = copy.deepcopy(model).to(device)
    torch._dynamo.reset()
    counters.clear()
    eager = KVPool(here, tokens=1024, max_length=256, min_block=4, runner=False)
    compiled = KVPool(here, tokens=1024, max_length=256, min_block=4, runner=True)
    assert compiled.runner._step is not compiled.runner._run  # the compiled step
    outs = []
    for pool in (eager, compiled):
        seqs = [pool.sequence() for _ in range(3)]
        pool.forward(seqs, [[1, 2, 3], [4, 5], [6]], [1, 1, 1])
        steps = [pool.forward(seqs, [[(s + j) % VOCAB] for j in range(3)], [1, 1, 1]) for s in range(3)]
        steps.append(pool.forward(seqs, [list(range(8, 17))] * 3, [9] * 3))  # a verify-width bucket (9 rows each)
        steps.append(pool.forward(seqs, [list(range(20, 25))] * 3, [5] * 3))  # another width: dynamic, no new graph
        for s in range(70):  # past the 64-position context bucket into the 128 one: no new graph
            steps.append(pool.forward(seqs, [[(s + j) % VOCAB] for j in range(3)], [1, 1, 1]))
        more = [pool.sequence() for _ in range(3)]  # batch buckets 2, 8 and 1: one new graph, for the 1
        pool.forward(more, [[1, 2], [3], [4, 5, 6]], [1, 1, 1])
        for batch in (seqs[:2], seqs + more, seqs[2:3]):
            steps.append(pool.forward(batch, [[(3 * j) % VOCAB] for j in range(len(batch))], [1] * len(batch)))
        outs.append((steps, [s.tokens for s in seqs + more]))
    assert {key[2] for key in compiled.runner.buckets} == {64, 128}
    assert {key[0] for key in compiled.runner.buckets} == {1, 2, 4, 8}
    assert not counters["graph_break"], dict(counters["graph_break"])
    if mode == "dynamic":  # 1 token at 1 sequence and at 2-8, 9 and 5 tokens at 4; a quantized layer that multiplies
        # a dense copy from 8 rows on (torch's CPU kernels: here the int8 head) branches on the batch: 2-7 and 8 apart
        linears = [part for layer in compiled.w.layers for part in (*layer, compiled.w.head)
                   if isinstance(part, QuantizedLinear)]
        branch = any(q.dense is not None and q.dense_from <= 8 for q in linears)
        assert bool(linears) == (weights == "int4")
        assert counters["stats"]["unique_graphs"] == (4 if branch else 3)
    else:  # 1 token at 1, 2, 4 and 8 sequences, 9 and 5 tokens at 4
        assert counters["stats"]["unique_graphs"] == 6
    assert outs[0][1] == outs[1][1]
    for a, b in zip(outs[0][0], outs[1][0]):
        if weights == "float32":
            assert torch.allclose(a, b, atol=1e-5, rtol=0), (a - b).abs().max()
        else:  # bfloat16: fused kernels round differently
            assert (a - b).abs().max() <= 0.05 * a.abs().max() + 0.05


def test_warm_up_runs_every_step_shape_before_serving_and_changes_no_result(model, capsys):
    """`warm_up` (what a serving worker runs before it reports ready): a step of every (batch bucket, width), at
    arena row 0 of an empty pool; the steps served after it equal an eager pool's. Refused once the pool holds
    sequences. The worker's wrapper prints its progress."""
    import types

    from specserve.scheduler.steps import StepScheduler
    from specserve.workers.actors import TargetWorkerActor

    eager, static = twin_pools(model)
    done = static.warm_up(widths=range(1, 4))
    assert done["steps"] == len(static.runner.batch_buckets) * 3 and not done["compiled"] and done["cache"] is None
    assert {(b, w) for b, w, _ in static.runner.buckets} == {(b, w) for b in static.runner.batch_buckets
                                                            for w in (1, 2, 3)}
    logits = []
    for pool in (eager, static):
        seqs = [pool.sequence() for _ in range(3)]
        pool.forward(seqs, [[1, 2, 3], [4, 5], [6]], [1, 1, 1])
        logits.append([pool.forward(seqs, [[(s + j) % VOCAB] * 2 for j in range(3)], [2] * 3) for s in range(4)])
    for got, want in zip(*logits):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=0)
    with pytest.raises(RuntimeError, match="before it holds sequences"):
        static.warm_up()
    assert eager.warm_up() is None  # no runner: nothing to warm
    scheduler = StepScheduler()
    try:
        fresh = KVPool(model, tokens=1024, max_length=256, min_block=4, runner=True)
        worker = types.SimpleNamespace(compute=scheduler)
        assert TargetWorkerActor._warm_up(worker, "target", fresh, (1, 2))["steps"] == 2 * len(BUCKETS)
    finally:
        scheduler.close()
    assert f"[specserve] target steps: {2 * len(BUCKETS)} shapes ready in" in capsys.readouterr().out


BUCKETS = __import__("specserve.models.memory.runner", fromlist=["BATCH_BUCKETS"]).BATCH_BUCKETS

_START = """
import json, os, sys, torch
from specserve.models.memory.pool import KVPool
from specserve.models.memory.runner import StepRunner
from tests.conftest import tiny_llama
model = tiny_llama(5, vocab=40, layers=1, hidden=16)
eager = KVPool(model, tokens=256, runner=False)
pool = KVPool(model, tokens=int(sys.argv[1]), runner=False)
pool.runner = StepRunner(pool.w, (pool.k, pool.v), 128, max_width=1, batch_buckets=(1, 2), capture=False,
                         compile="dynamic")
done = pool.warm_up()
outs = []
for p in (eager, pool):
    seqs = [p.sequence() for _ in range(2)]
    p.forward(seqs, [[1, 2, 3], [4]], [1, 1])
    outs.append(p.forward(seqs, [[5], [6]], [1, 1]))
done["diff"] = (outs[0] - outs[1]).abs().max().item()
done["inductor"] = os.environ["TORCHINDUCTOR_CACHE_DIR"]
print(json.dumps(done))
"""


def test_compiled_steps_persist_under_the_cache_and_a_second_start_loads_them(tmp_path):
    """A start that compiles saves its compilers' caches under `$SPECSERVE_CACHE/compile/<cpu isa>`; a second
    process starting the same model loads them (`cache_loaded`), with a pool of another size, compiles no graph
    (the arena's length is a symbol) and its compiled steps still equal the eager ones. A start under a lower
    `ATEN_CPU_CAPABILITY` before them (a forced AVX2 run on an AVX-512 CPU) keeps its own caches: its graphs,
    written for narrower vectors, aborted the process that read them. Needs a C++ compiler (Inductor's CPU code)."""
    import json
    import os
    import pathlib
    import shutil
    import subprocess
    import sys
    import sysconfig

    if shutil.which("g++") is None or not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")):
        pytest.skip("no C++ compiler or Python headers for Inductor's CPU code")
    root = pathlib.Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    env.update(SPECSERVE_CACHE=str(tmp_path), PYTHONPATH=os.pathsep.join([str(root / "services"), str(root)]))
    lower = "avx2" if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else "default"
    runs = []
    # the second start with another KV budget: the pool's size is a symbol of its graphs
    for tokens, isa in ((256, lower), (256, None), (512, None)):
        out = subprocess.run([sys.executable, "-c", _START, str(tokens)], capture_output=True, text=True,
                             timeout=600, env={**env, **({"ATEN_CPU_CAPABILITY": isa} if isa else {})})
        assert out.returncode == 0, out.stderr[-2000:]
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    forced, cold, warm = runs
    assert forced["slow_steps"] > 0 and not forced["cache_loaded"] and forced["diff"] < 1e-5
    assert forced["inductor"] == str(tmp_path / "compile" / f"cpu-{lower}" / "inductor")
    native = pathlib.Path(cold["inductor"]).parent
    assert native.parent == tmp_path / "compile" and native.name == compiled_isa() != f"cpu-{lower}"
    assert cold["compiled"] and cold["slow_steps"] > 0 and not cold["cache_loaded"] and cold["diff"] < 1e-5
    assert pathlib.Path(cold["cache"]).is_file() and pathlib.Path(cold["cache"]).parent == native
    assert warm["cache_loaded"] and warm["diff"] < 1e-5 and warm["cache"] == cold["cache"]
    assert cold["graphs_compiled"] > 0 and warm["graphs_compiled"] == 0 and warm["graphs_from_cache"] > 0
