"""Every family `models.families.arch` describes runs through the pooled forward, the step runner and speculation with
Hugging Face as the oracle: tiny random-weight models saved by transformers' own classes (tests/families.py),
prompts longer than every sliding window."""

from __future__ import annotations

import random
import warnings
from concurrent import futures

import numpy as np
import pytest
import torch
from specserve import SamplingParams, SpeculativeDecoder
from specserve.models.families.arch import FAMILIES, arch_of
from specserve.models.families.lean import LeanSequence, draft_sequence, unsupported_config
from specserve.models.families.sequence import CachedSequence
from specserve.models.formats.loading import load_model
from specserve.models.kernels import cpu
from specserve.models.kernels.fused import FusedLayers
from specserve.models.memory.pool import KVPool
from specserve.scheduler.steps import StepScheduler
from specserve.speculation import rejection

from tests.conftest import batched_and_alone, perturbed_copy
from tests.cpu.test_exactness import chi_square_pvalue
from tests.families import CONFIGS, WINDOW, tiny_family
from tests.reference import reference_probs

NAMES = list(CONFIGS)
VOCAB = 40
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]  # longer than WINDOW
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)
assert len(PROMPT) > WINDOW


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():  # transformers' notes on the tiny configs' rope fields
        warnings.simplefilter("ignore")
        yield


@pytest.fixture(scope="module", params=NAMES)
def family(request):
    return request.param, tiny_family(request.param)


def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0].float()


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def test_every_family_of_the_docs_table_is_described_and_tested():
    """docs/serving.md's table lists `arch.FAMILIES`; each has a tiny model here, and the code takes it."""
    tested = {tiny_family(name).config.model_type for name in NAMES}
    assert set(FAMILIES) <= tested
    for name in NAMES:
        assert unsupported_config(tiny_family(name).config) is None


@pytest.mark.parametrize("runner", [False, True], ids=["eager", "runner"])
def test_pooled_steps_equal_the_hf_forward(family, runner):
    """Prefill, decode steps, a verify block and a rollback past the window, several sessions in one step, each
    equal to HF's forward over its whole history."""
    name, model = family
    pool = KVPool(model, tokens=1024, max_length=128, min_block=8, runner=runner)
    rng = random.Random(1)
    histories = [[rng.randrange(VOCAB) for _ in range(n)] for n in (13, 7, 1)]
    seqs = [pool.sequence() for _ in histories]
    got = pool.forward(seqs, histories, [len(h) for h in histories])
    expected = torch.cat([hf_logits(model, h) for h in histories])
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=0)
    for step in range(8):
        width = 1 if step % 2 else 4  # same width for all: the runner's static steps
        if step == 5:
            for j, seq in enumerate(seqs):  # a rejection reaching back past the window
                keep = max(1, len(seq.tokens) - WINDOW - 2)
                seq.rollback(keep)
                del histories[j][keep:]
        new = [[rng.randrange(VOCAB) for _ in range(width)] for _ in seqs]
        got = pool.forward(seqs, new, [width] * len(seqs))
        for h, t in zip(histories, new):
            h += t
        expected = torch.cat([hf_logits(model, h)[-width:] for h in histories])
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=0, msg=f"{name}, step {step}")
    if runner:
        assert pool.runner.buckets, "the static steps did not go through the runner"


def test_lean_sequence_and_the_hf_cache_roll_back_past_the_window(family):
    """The draft's own cache and the HF fallback cache: a rollback further back than a sliding window is exact
    (transformers' sliding caches keep no past; the HF cache of `CachedSequence` keeps it all)."""
    name, model = family
    tokens = [random.Random(2).randrange(VOCAB) for _ in range(20)]
    reference = hf_logits(model, tokens)
    assert isinstance(draft_sequence(model), LeanSequence)
    for seq in (LeanSequence(model), CachedSequence(model)):
        seq.feed(tokens[:17], keep_logits=17)
        seq.rollback(9)
        got = torch.cat([seq.feed(tokens[9:12], keep_logits=3)] + [seq.feed([t]) for t in tokens[12:]])
        torch.testing.assert_close(got, reference[9:], atol=2e-5, rtol=0, msg=f"{name}: {type(seq).__name__}")


def test_greedy_generation_equals_hf_generate(family):
    """gamma 0, a model draft that forces rejections, and the n-gram draft: HF generate's tokens, all 24."""
    name, target = family
    reference = hf_greedy(target, PROMPT, 24)
    alone = SpeculativeDecoder(target, None, gamma=0)
    assert alone.kv_pool is not None, f"{name} did not run on the pool"
    assert alone.generate(PROMPT, GREEDY, 24).token_ids == reference
    draft = perturbed_copy(target, 0.1)
    spec = SpeculativeDecoder(target, draft, gamma=3, draft_lookup=False).generate(PROMPT, GREEDY, 24)
    assert spec.token_ids == reference
    assert 0.0 < spec.stats.acceptance_rate < 1.0, "the draft should be accepted in part (rollbacks exercised)"
    ngram = SpeculativeDecoder(target, "ngram", gamma=3).generate(PROMPT, GREEDY, 24)
    assert ngram.token_ids == reference


def test_batched_sessions_each_equal_their_run_alone(family):
    """Six seeded sampling sessions with a model draft sharing a scheduler's steps: each emits what it emits
    alone."""
    name, target = family
    together, alone, shared = batched_and_alone(target, perturbed_copy(target, 0.1), VOCAB, PROMPT)
    assert shared >= 3, "the sessions did not share steps"
    assert together == alone, name


def test_a_gemma3_whose_layers_all_slide_runs_pooled():
    """A Gemma 3 with fewer layers than its sliding pattern (a small or pruned model): every layer is a sliding one,
    HF builds the local rope alone, and greedy output is HF generate's past the window."""
    target = tiny_family("gemma3-sliding")
    assert set(target.config.layer_types) == {"sliding_attention"}
    assert not hasattr(target.model.rotary_emb, "full_attention_inv_freq")
    prompt = [random.Random(3).randrange(VOCAB) for _ in range(20)]  # longer than the window of 16
    decoder = SpeculativeDecoder(target, None, gamma=0)
    assert decoder.kv_pool is not None, "it did not run on the pool"
    assert decoder.generate(prompt, GREEDY, 24).token_ids == hf_greedy(target, prompt, 24)


CHI_FAMILIES = ["llama3", "qwen3", "gemma2"]  # Llama 3.x rope, q/k norms, a sliding window and soft-capping
CHI_VOCAB, CHI_RUNS = 12, 1200


@pytest.mark.parametrize("name", CHI_FAMILIES)
def test_sampled_first_tokens_follow_the_target_distribution(name, monkeypatch):
    """Chi-square of the first two sampled tokens (temperature 1, a different draft) against the target's joint
    distribution computed from HF's forward; for one family also a broken sampler (no residual step), which the
    test must reject."""
    target = tiny_family(name, vocab=CHI_VOCAB, spread=0.5)
    draft = tiny_family(name, seed=7, vocab=CHI_VOCAB, spread=0.5)
    prompt = [1, 5, 2, 7, 3, 3, 8, 0, 4]  # past the window
    with torch.inference_mode():
        first = target(torch.tensor([prompt])).logits[0, -1].double().numpy()
        seconds = target(torch.tensor([prompt + [a] for a in range(CHI_VOCAB)])).logits[:, -1].double().numpy()
    p1 = reference_probs(first, 1.0, 0, 1.0)
    joint = np.stack([p1[a] * reference_probs(seconds[a], 1.0, 0, 1.0) for a in range(CHI_VOCAB)])
    decoder = SpeculativeDecoder(target, draft, gamma=2, draft_lookup=False)

    def counts() -> np.ndarray:
        found = np.zeros((CHI_VOCAB, CHI_VOCAB))
        for seed in range(CHI_RUNS):
            res = decoder.generate(prompt, SamplingParams(temperature=1.0, seed=seed, ignore_eos=True), 2)
            found[res.token_ids[0], res.token_ids[1]] += 1
        return found

    assert chi_square_pvalue(counts(), joint) > 1e-3
    if name == "gemma2":
        monkeypatch.setattr(rejection, "residual_distribution", lambda p, q: p)
        assert chi_square_pvalue(counts(), joint) < 1e-3, "the test cannot tell a missing residual step"


def test_families_outside_the_lean_forward_say_why():
    from transformers import GPT2Config, GPTNeoXConfig

    assert "gpt2" in unsupported_config(GPT2Config())
    assert "gpt_neox" in unsupported_config(GPTNeoXConfig())
    assert arch_of(tiny_family("gemma2").config).attn_softcap == 3.0


def test_the_docs_table_is_the_codes():
    """docs/serving.md's table of supported architectures is what `python -m specserve.models.families.arch` prints."""
    import pathlib

    from specserve.models.families.arch import table

    docs = (pathlib.Path(__file__).parents[2] / "docs" / "serving.md").read_text()
    assert table() in docs, "docs/serving.md's table differs from the code's: paste `python -m specserve.models.families.arch`"


# fused layers, with a sliding window (mistral, qwen2, gemma3), biases (qwen2), q/k norms per head (qwen3, gemma3) or
# over all heads (olmo2), GeGLU and Gemma's norms (gemma, gemma2, gemma3), norms after attention and MLP only (olmo2),
# soft-capped attention (gemma2)
KERNEL_FAMILIES = ["llama3", "mistral", "qwen2", "qwen3", "olmo2", "gemma", "gemma2", "gemma3"]


@pytest.mark.skipif(not cpu.available(), reason="specserve's CPU kernels do not run here")
@pytest.mark.parametrize("name", KERNEL_FAMILIES)
def test_bfloat16_kernel_steps_give_each_row_what_it_gets_alone(name):
    """int8 weights in bfloat16 on specserve's CPU kernels: a batched step's rows are bit for bit each sequence's
    step alone (the kernels' attention reads each row's keys as if alone), and near the float32 HF forward."""
    model = tiny_family(name, dtype=torch.float32, spread=0.08, wide=True)
    reference = tiny_family(name, dtype=torch.float32, spread=0.08, wide=True)
    loaded = load_model(model, dtype="bfloat16", quantization="int8")
    pool = KVPool(loaded.model, tokens=1024, min_block=8)
    assert pool.w.kernel_attention and cpu.step_kernels(pool.w.dtype, pool.w.device, pool.w.head_dim)
    assert FusedLayers.plan(pool.w) is not None
    rng = random.Random(0)
    histories = [[rng.randrange(VOCAB) for _ in range(n)] for n in (13, 7, 2)]
    together = pool.forward([pool.sequence() for _ in histories], histories, [1, 1, 1])
    alone = torch.cat([KVPool(loaded.model, tokens=1024, min_block=8).sequence().feed(h) for h in histories])
    assert torch.equal(together, alone)
    with torch.inference_mode():
        expected = torch.stack([reference(torch.tensor([h])).logits[0, -1] for h in histories])
    torch.testing.assert_close(together, expected, atol=0.15, rtol=0)


@pytest.mark.parametrize("name", ["llama3", "qwen2", "qwen3", "phi3", "gemma2", "gemma3"])
def test_tensor_parallel_ranks_compute_the_whole_models_logits(name):
    """Two ranks (gloo, threads) of each family whose layers split: biases, q/k norms per head, fused weights cut
    into their roles, soft-capping, sliding windows: the whole model's logits over ragged steps, in float64."""
    from tests.cpu.test_tp import POOL, ragged_steps, run_group
    from tests.cpu.test_tp import VOCAB as TP_VOCAB

    model = tiny_family(name, vocab=TP_VOCAB)
    whole = ragged_steps(KVPool(model, **POOL))
    logits, _, followed = run_group(2, lambda shard: model, ragged_steps, **POOL)
    assert followed == {1: 8}
    torch.testing.assert_close(logits, whole, atol=1e-9, rtol=0)


def test_olmo2_refuses_tensor_parallelism_by_name():
    from specserve.models.families.weights import LeanWeights
    from specserve.models.kernels.tp import Shard

    with pytest.raises(ValueError, match="tensor_parallel: olmo2 has q/k norms over all heads"):
        LeanWeights(tiny_family("olmo2"), torch.float64, Shard(0, 2))


@pytest.mark.parametrize("name", ["llama3", "qwen3", "gemma3"])
def test_served_sessions_over_grpc_workers_equal_the_in_process_decoder(name):
    """A batched target worker and a draft worker whose drafts share pooled forwards (`ScheduledDraft`), over
    real gRPC with the coordinator: eight sessions together (greedy and seeded sampling) emit the in-process
    decoder's tokens, and both workers' steps were shared."""
    import asyncio

    import grpc
    from specserve.coordinator import Coordinator, SessionRequest, SplitDriver
    from specserve.rpc.servicers import DraftWorkerServicer, TargetWorkerServicer
    from specserve.scheduler.colocated import ScheduledDraft
    from specserve.v1 import workers_pb2_grpc

    target = tiny_family(name)
    draft = perturbed_copy(target, 0.1)
    target_servicer = TargetWorkerServicer(target, VOCAB, kv_cache_tokens=4096)
    target_servicer.scheduler.gather = 20.0  # tiny steps: wait for the others so that they share steps
    compute = StepScheduler()
    draft_servicer = DraftWorkerServicer(ScheduledDraft(compute, draft, VOCAB, 4).proposer, VOCAB,
                                         scheduler=compute, scheduled=True)
    servers, addresses = [], []
    for servicer, add in ((target_servicer, workers_pb2_grpc.add_TargetWorkerServicer_to_server),
                          (draft_servicer, workers_pb2_grpc.add_DraftWorkerServicer_to_server)):
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
        add(servicer, server)
        addresses.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
        server.start()
        servers.append(server)
    requests = [SessionRequest(PROMPT[i:] + PROMPT[:i], SamplingParams(
        temperature=0.0 if i % 2 else 1.0, seed=10 + i, ignore_eos=True), 16) for i in range(8)]
    try:
        assert target_servicer.pool is not None, f"{name}: the target worker did not batch"
        coord = Coordinator(SplitDriver(addresses[0], VOCAB, [], draft="remote", draft_address=addresses[1],
                                        gamma=3))

        async def tokens_of(request: SessionRequest) -> list[int]:
            return [t async for chunk in coord.generate(request) for t in chunk.tokens]

        async def together():
            return await asyncio.gather(*(tokens_of(r) for r in requests))

        served = asyncio.run(together())
        assert max(target_servicer.scheduler.sessions_per_step) >= 4
        assert max(draft_servicer.scheduler.sessions_per_draft_step, default=0) >= 2
    finally:
        for server in servers:
            server.stop(0).wait()
        target_servicer.close()
        draft_servicer.close()
    local = SpeculativeDecoder(target, draft, gamma=3, draft_top_k=4)
    for request, tokens in zip(requests, served):
        assert tokens == local.generate(request.prompt_ids, request.params, request.max_tokens).token_ids


@pytest.mark.parametrize("name", ["mistral", "phi3", "gemma2"])
def test_a_cached_prefix_gives_the_logits_of_a_whole_prefill(name):
    """The prefix cache with a sliding window, longrope and partial rotary, soft-capping: a second request that
    shares a released one's prompt copies its rows and goes on with HF's logits."""
    from specserve.models.memory.prefix import CHUNK

    model = tiny_family(name)
    rng = random.Random(3)
    system = [rng.randrange(VOCAB) for _ in range(CHUNK + 5)]
    pool = KVPool(model, tokens=2048, max_length=256, min_block=16, prefix_caching=True)
    first = pool.sequence()
    first.logits_after(system + [1, 2, 3])
    first.release()
    other = system + [7, 8, 9, 10]
    second = pool.sequence()
    assert second.unfed(other, 1) == other[len(system):]
    got = second.feed(other[len(system):], 4)
    torch.testing.assert_close(got, hf_logits(model, other)[len(system):], atol=2e-5, rtol=0)
    assert second.hit_tokens == len(system)


def test_the_start_up_line_names_each_models_path(capsys):
    from specserve.models.families.arch import describe_path
    from specserve.serve.run import model_specs
    from specserve.workers.actors import say_path
    from transformers import GPT2Config

    assert describe_path(GPT2Config()).startswith("one session at a time through the Hugging Face forward")
    assert "'gpt2'" in describe_path(GPT2Config())
    path = describe_path(tiny_family("gemma3").config)
    assert path.startswith("gemma3_text: the batched KV pool, sliding window 6 on 2 of 3 layers")
    config = {"applications": [{"args": {"target": "/m/qwen", "draft": "/m/qwen-small", "batching": False}}]}
    assert model_specs(config) == ["/m/qwen", "/m/qwen-small"]  # the files `specserve serve` reads first
    say_path("tiny", tiny_family("gemma3"), True)  # what a worker prints once it loaded a model
    say_path("tiny", tiny_family("gemma3"), False)
    lines = capsys.readouterr().err.splitlines()
    assert lines == [f"specserve: tiny: {path}", "specserve: tiny: one session at a time (batching: false)"]
