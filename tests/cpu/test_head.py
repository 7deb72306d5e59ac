"""The draft head on the target's features (`models.drafts.head`): the pool keeps the features HF computes, the head's
lean steps are its HF forward, and speculation through it is exact."""

from __future__ import annotations

import random

import pytest
import torch
from specserve import SamplingParams, SpeculativeDecoder
from specserve.models.drafts.head import FeatureHeadForCausalLM, HeadSequence, drafts_on_zeros, is_head, load_head
from specserve.models.formats.loading import load_model
from specserve.models.memory.pool import KVPool
from specserve.speculation import rejection

from tests.conftest import tiny_llama
from tests.cpu.test_exactness import chi_square_pvalue, sampled_joint, target_joint

VOCAB = 40


@pytest.fixture(scope="module")
def target():
    return tiny_llama(5, vocab=VOCAB, layers=2, hidden=32, scale=8)


def hf_features(model, tokens: list[int]) -> torch.Tensor:
    """The target's normed final hidden states (its LM head's input) at every position: [len, hidden]."""
    with torch.inference_mode():
        return model.model(torch.tensor([tokens])).last_hidden_state[0]


@pytest.mark.parametrize("runner", [False, True], ids=["eager", "runner"])
def test_the_pool_keeps_every_positions_features_through_steps_moves_and_copies(target, runner):
    pool = KVPool(target, tokens=1024, max_length=256, min_block=4, runner=runner, features=True,
                  prefix_caching=True)
    rng = random.Random(0)
    histories = [[rng.randrange(VOCAB) for _ in range(n)] for n in (3, 9, 1)]
    seqs = [pool.sequence() for _ in histories]
    pool.forward(seqs, histories, [1, 1, 1])
    for step in range(6):  # equal widths (the runner's steps), blocks outgrowing their place (moved)
        new = [[rng.randrange(VOCAB) for _ in range(3 if step % 2 else 1)] for _ in seqs]
        pool.forward(seqs, new, [1] * 3)
        for h, t in zip(histories, new):
            h += t
    for seq, h in zip(seqs, histories):
        got = pool.features[seq.block[0] : seq.block[0] + len(h)]
        torch.testing.assert_close(got, hf_features(target, h), atol=1e-10, rtol=0)
    held = list(seqs[1].tokens)
    seqs[1].release()  # into the prefix cache; a new sequence copies its rows
    other = pool.sequence()
    other.logits_after(held + [4, 5])
    torch.testing.assert_close(pool.features[other.block[0] : other.block[0] + len(held) + 1],
                               hf_features(target, held + [4]), atol=1e-10, rtol=0)
    assert other.hit_tokens > 0
    if runner:
        assert pool.runner.buckets


def test_the_heads_lean_steps_are_its_hf_forward(target):
    """On true features the head's logits are its HF forward's; drafting on, each step feeds its own
    prediction, as the HF forward does given that feature."""
    head = FeatureHeadForCausalLM.for_target(target, token_subset=torch.tensor([9, 3, 30, 1, 17, 22, 5, 38]), seed=2)
    pool = KVPool(target, tokens=512, features=True)
    context = [3, 1, 4, 1, 5, 9, 2, 6, 5]
    tseq = pool.sequence()
    tseq.logits_after(context[:-1])  # the target holds all but the last token, as after a verify
    seq = HeadSequence(head, tseq)
    f = hf_features(target, context[:-1])
    with torch.inference_mode():
        pred, logits = head(f[None], torch.tensor([context[1:]]))
    order = torch.argsort(head.token_subset)
    torch.testing.assert_close(seq.subset_logits_after(context)[0], logits[0, -1, order].float(), atol=1e-10, rtol=0)
    token = 17
    with torch.inference_mode():
        _, more = head(torch.cat([f, pred[0, -1:]])[None], torch.tensor([context[1:] + [token]]))
    torch.testing.assert_close(seq.feed_subset([token])[0], more[0, -1, order].float(), atol=1e-10, rtol=0)
    # the next block: the target verified two more positions; the head replaces its predicted one with them
    tseq.logits_after(context + [token])
    again = context + [token, 8]
    f2 = hf_features(target, again[:-1])
    with torch.inference_mode():
        _, third = head(f2[None], torch.tensor([again[1:]]))
    torch.testing.assert_close(seq.subset_logits_after(again)[0], third[0, -1, order].float(), atol=1e-10, rtol=0)
    assert seq.true == len(again) - 1


GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("runner", [False, True, "whole"],
                         ids=["head cache", "head pool with a runner", "head pool drafting whole blocks"])
@pytest.mark.parametrize("gamma", [1, 3, "auto"])
def test_greedy_through_a_head_equals_target_only(target, gamma, runner, monkeypatch):
    """In process the head drafts on a cache of its own, or, where the target's pool has a step runner (CUDA),
    through a `HeadPool` beside it whose drafted steps take the runner, each block's drafted steps at once where
    they are captured (`HeadPool.drafted_block`)."""
    from specserve.models.drafts import head as head_module
    from specserve.models.memory import pool as pool_module

    monkeypatch.setattr(pool_module, "STEP_RUNNER", bool(runner))
    monkeypatch.setattr(head_module, "WHOLE_BLOCKS", runner == "whole")
    head = FeatureHeadForCausalLM.for_target(target, seed=1)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    reference = SpeculativeDecoder(target, None, gamma=0).generate(prompt, GREEDY, 40)
    decoder = SpeculativeDecoder(target, head, gamma=gamma, draft_lookup=False)
    assert decoder.draft_kind == "head" and decoder.kv_pool.features is not None
    assert (decoder.head_pool is not None) == bool(runner)
    got = decoder.generate(prompt, GREEDY, 40)
    assert got.token_ids == reference.token_ids
    assert got.stats.drafted > 0 or gamma == "auto"
    if runner:  # (at γ=1 a round drafts from its first step alone, which feeds the target's features eagerly)
        assert bool(decoder.head_pool.runner.buckets) or gamma != 3  # drafted steps took the runner
        assert decoder.head_pool.used_tokens == 0
        assert bool(decoder.head_pool.runner.blocks) == (runner == "whole" and gamma != 1)


def zero_drafting(head: FeatureHeadForCausalLM) -> FeatureHeadForCausalLM:
    """The head set to draft on a zero feature where the target's is unknown (`distill --feature-dropout`)."""
    head.config.drafted_feature = "zero"
    return head


@pytest.mark.parametrize("runner", [False, True], ids=["head cache", "head pool with a runner"])
def test_greedy_through_a_head_drafting_on_zeros_equals_target_only(target, runner, monkeypatch):
    from specserve.models.memory import pool as pool_module

    monkeypatch.setattr(pool_module, "STEP_RUNNER", runner)
    head = zero_drafting(FeatureHeadForCausalLM.for_target(target, seed=1))
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    reference = SpeculativeDecoder(target, None, gamma=0).generate(prompt, GREEDY, 40)
    decoder = SpeculativeDecoder(target, head, gamma=3, draft_lookup=False)
    got = decoder.generate(prompt, GREEDY, 40)
    assert got.token_ids == reference.token_ids and got.stats.drafted > 0


def test_seeded_runs_through_a_head_repeat_and_one_token_prompts_draft_nothing_wrong(target):
    head = FeatureHeadForCausalLM.for_target(target, seed=1)
    decoder = SpeculativeDecoder(target, head, gamma=3, draft_lookup=False)
    params = SamplingParams(temperature=1.0, seed=11, ignore_eos=True)
    first = decoder.generate([3, 1, 4, 1], params, 30).token_ids
    assert decoder.generate([3, 1, 4, 1], params, 30).token_ids == first
    assert len(decoder.generate([7], params, 10).token_ids) == 10  # no feature yet: the head drafts blind, exactly


MODES = [{"temperature": 1.0}, {"temperature": 0.8, "top_k": 5}, {"temperature": 1.2, "top_p": 0.8}]


@pytest.mark.parametrize("mode", MODES + ["runner", "whole", "zero"],
                         ids=["T=1", "top-k", "top-p", "T=1, head pool with a runner",
                              "T=1, head pool drafting whole blocks", "T=1, drafting on zeros"])
def test_first_two_tokens_through_a_head_follow_the_target(mode, monkeypatch):
    """Chi-square against the target's joint distribution of the first two tokens; a missing residual step
    is caught by the same harness."""
    from specserve.models.drafts import head as head_module
    from specserve.models.memory import pool as pool_module

    zero, whole = mode == "zero", mode == "whole"
    if mode in ("runner", "whole"):
        monkeypatch.setattr(pool_module, "STEP_RUNNER", True)
        monkeypatch.setattr(head_module, "WHOLE_BLOCKS", whole)
    if mode in ("runner", "whole", "zero"):
        mode = MODES[0]
    target = tiny_llama(0)  # vocabulary 8, as test_exactness
    head = FeatureHeadForCausalLM.for_target(target, seed=4)
    if zero:
        zero_drafting(head)
    decoder = SpeculativeDecoder(target, head, gamma=2, draft_lookup=False)
    assert (decoder.head_pool is not None) == bool(pool_module.STEP_RUNNER)
    expected = target_joint(target, mode)
    # (3 tokens: a block of 2, its second token drafted by the whole-block path, decides the second token)
    assert chi_square_pvalue(sampled_joint(decoder, mode, 3 if whole else 2), expected) > 1e-3
    assert bool(decoder.head_pool is not None and decoder.head_pool.runner.blocks) == whole
    if mode == MODES[0]:
        monkeypatch.setattr(rejection, "residual_distribution", lambda p, q: p)
        assert chi_square_pvalue(sampled_joint(decoder, mode, 2), expected) < 1e-3


def test_heads_save_load_by_spec_and_refuse_a_target_they_do_not_fit(tmp_path, target, capsys):
    head = FeatureHeadForCausalLM.for_target(target, seed=3, shared_from=None)
    head.config.shared_from = str(tmp_path / "target")
    head.config.drafted_feature = "zero"
    target.save_pretrained(str(tmp_path / "target"))
    head.save_pretrained(str(tmp_path / "head"))
    spec = f"head:{tmp_path / 'head'}"
    assert is_head(spec) and not is_head("ngram")
    loaded = load_head(spec, load_model(target))
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), head.state_dict().values()))
    assert drafts_on_zeros(loaded) and not drafts_on_zeros(FeatureHeadForCausalLM.for_target(target))
    from specserve.workers.actors import say_path

    say_path(spec, loaded, True, "head")  # the worker's start-up line
    assert f"a feature head of 1 layer(s) over {VOCAB} tokens" in capsys.readouterr().err
    other = tiny_llama(1, vocab=VOCAB, layers=1, hidden=16)
    with pytest.raises(ValueError, match="does not fit a target"):
        load_head(spec, load_model(other))
    with pytest.raises(ValueError, match="no feature head"):
        load_head(f"head:{tmp_path / 'missing'}", load_model(target))


# -- the head served: in the target worker, its steps batched over sessions (`HeadPool`) -----------------------


@pytest.mark.parametrize("drafting_on", ["predicted", "zero"])
def test_the_pooled_heads_steps_equal_a_head_cache_of_its_own(target, drafting_on):
    """Three sessions' head steps in one forward (`HeadPool`) give each the logits its own `HeadSequence` gives,
    through true-feature blocks, drafted steps and the next block replacing the drafted positions."""
    from specserve.models.drafts.head import HeadPool

    head = FeatureHeadForCausalLM.for_target(target, token_subset=torch.tensor([9, 3, 30, 1, 17, 22, 5, 38]), seed=2)
    head.config.drafted_feature = drafting_on
    pool = KVPool(target, tokens=1024, features=True)
    heads = HeadPool(head, pool, tokens=1024)
    rng = random.Random(1)
    contexts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (9, 4, 13)]
    tseqs = [pool.sequence() for _ in contexts]
    pool.forward(tseqs, [c[:-1] for c in contexts], [1] * 3)  # the target holds all but the last token
    pooled = [heads.sequence(t) for t in tseqs]
    alone = [HeadSequence(head, t) for t in tseqs]
    for _ in range(2):  # two blocks
        tails = [seq.unfed(c, 1) for seq, c in zip(pooled, contexts)]
        got = heads.forward(pooled, tails, [1] * 3)
        for j, (seq, c) in enumerate(zip(alone, contexts)):
            torch.testing.assert_close(got[j], seq.subset_logits_after(c)[0], atol=1e-10, rtol=0)
        for _ in range(2):  # drafted on the head's own predictions
            drafted = [rng.randrange(VOCAB) for _ in contexts]
            got = heads.forward(pooled, [[t] for t in drafted], [1] * 3)
            for j, (seq, t) in enumerate(zip(alone, drafted)):
                torch.testing.assert_close(got[j], seq.feed_subset([t])[0], atol=1e-10, rtol=0)
                assert bool(pooled[j].last.any()) == (drafting_on == "predicted")  # what the next drafted step reads
        for c, t in zip(contexts, tseqs):  # the target verified two more positions of each
            c += [rng.randrange(VOCAB), rng.randrange(VOCAB)]
            t.logits_after(c[:-1])
    assert [s.true for s in pooled] == [len(c) - 3 for c in contexts]  # (the last two verified: not read yet)
    with pytest.raises(ValueError, match="keeps features"):
        HeadPool(head, KVPool(target, tokens=64), tokens=64)
    for seq in pooled:
        seq.release()
    assert heads.used_tokens == 0


@pytest.mark.parametrize("drafted", ["predicted", "zero"])
def test_the_head_runners_drafted_steps_equal_its_eager_steps(target, drafted):
    """`HeadStepRunner` (what a head's pool drafts through beside a CUDA target's runner): its drafted steps, tokens
    fed on the device with a padding row in the batch bucket, give the eager `feed_ids` logits and predictions."""
    from specserve.models.drafts.head import HeadPool

    head = FeatureHeadForCausalLM.for_target(target, token_subset=torch.tensor([9, 3, 30, 1, 17, 22, 5, 38]), seed=2)
    head.config.drafted_feature = drafted
    pool = KVPool(target, tokens=1024, features=True)
    contexts = [[(5 * i + 3 * j) % VOCAB for j in range(n)] for i, n in enumerate((9, 4, 13))]
    tseqs = [pool.sequence() for _ in contexts]
    pool.forward(tseqs, [c[:-1] for c in contexts], [1] * 3)
    outs = []
    for runner in (False, True):
        heads = HeadPool(head, pool, tokens=1024, runner=runner)
        assert (heads.runner is not None) == runner
        seqs = [heads.sequence(t) for t in tseqs]
        got = [heads.forward(seqs, [s.unfed(c, 1) for s, c in zip(seqs, contexts)], [1] * 3)]
        for step in range(3):
            got.append(heads.feed_ids(seqs, torch.tensor([(step * 7 + j) % VOCAB for j in range(3)])).clone())
            got.append(torch.cat([s.last for s in seqs]))
        if runner:
            assert heads.runner.buckets and all(key[:2] == (4, 1) for key in heads.runner.buckets)
        for seq in seqs:
            seq.release()
        outs.append(got)
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


@pytest.mark.parametrize("drafted", ["predicted", "zero"])
@pytest.mark.parametrize("mode", [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.8, top_k=5),
                                  dict(temperature=1.2, top_p=0.7), dict(temperature=1.0, top_k_q=3)],
                         ids=["greedy", "T=1", "top-k", "top-p", "sparse q"])
def test_a_heads_whole_block_at_once_drafts_what_its_steps_draft(target, mode, drafted):
    """`HeadPool.drafted_block` (a block's steps after the first and their sampling as one graph on CUDA; run
    uncaptured here) drafts the tokens, q rows and confidences of the step-by-step block (`draft_blocks`), for
    three sessions in a batch bucket with a padding row, over three rounds: the caches it leaves (tokens, last
    predictions, keys and values) serve the next round as the steps' do. A position fed off by one fails it."""
    from specserve.models.drafts.head import HeadPool
    from specserve.scheduler.drafting import DraftBlock, draft_blocks
    from specserve.speculation import PositionRNG

    mode = dict(mode)
    top_k_q = mode.pop("top_k_q", 0)
    subset = torch.tensor([9, 3, 30, 1, 17, 22, 5, 38, 11, 2])
    head = FeatureHeadForCausalLM.for_target(target, token_subset=subset, seed=2)
    head.config.drafted_feature = drafted
    outs = []
    for whole in (False, True):
        pool = KVPool(target, tokens=2048, features=True)
        heads = HeadPool(head, pool, tokens=2048, runner=True)
        heads.runner.whole_blocks = whole
        contexts = [[(5 * i + 3 * j) % VOCAB for j in range(n)] for i, n in enumerate((9, 4, 13))]
        tseqs = [pool.sequence() for _ in contexts]
        hseqs = [heads.sequence(t) for t in tseqs]
        got = []
        for round_ in range(3):
            pool.forward(tseqs, [c[len(t.tokens):] for c, t in zip(contexts, tseqs)], [1] * 3)  # the features
            blocks = [DraftBlock(h, h.unfed(c, 1), 4, SamplingParams(**mode, seed=i), PositionRNG(i), len(c),
                                 top_k_q, len(subset)) for i, (h, c) in enumerate(zip(hseqs, contexts))]
            for block in blocks:
                heads.reserve(block.seq, len(block.seq.tokens) + len(block.tail) + block.gamma)
            drafted_blocks = draft_blocks(heads, blocks)
            for block, out in zip(blocks, drafted_blocks):
                got.append((out.tokens, out.confidences, None if out.q is None else out.q.clone(),
                            list(block.seq.tokens), block.seq.last.clone()))
            # the next round: two drafted tokens accepted, then a token of the target's
            contexts = [c + [int(subset[t]) for t in out.tokens[:2]] + [(round_ + 7 * i) % VOCAB]
                        for i, (c, out) in enumerate(zip(contexts, drafted_blocks))]
            for h, c in zip(hseqs, contexts):
                h.rollback(len(c) - 2)
        assert (heads.runner.blocks != {}) == whole  # the whole blocks ran (one shape: bucket 4, 3 steps)
        for seq in hseqs + tseqs:
            seq.release()
        outs.append(got)
    for (tokens, conf, q, cache, last), (w_tokens, w_conf, w_q, w_cache, w_last) in zip(*outs):
        assert w_tokens == tokens and w_cache == cache
        assert w_conf == pytest.approx(conf, rel=1e-12)
        assert (q is None) == (w_q is None)
        if q is not None:
            torch.testing.assert_close(w_q, q, atol=1e-12, rtol=0)
        torch.testing.assert_close(w_last, last, atol=1e-10, rtol=0)


@pytest.fixture(scope="module")
def served_head(target, tmp_path_factory):
    """A target worker holding a feature head (colocated), served over real gRPC."""
    from specserve.rpc.servicers import TargetWorkerServicer

    from tests.cpu.test_colocated import serve

    head = FeatureHeadForCausalLM.for_target(target, seed=1)
    servicer = TargetWorkerServicer(target, VOCAB, kv_cache_tokens=4096, features=True)
    servicer.attach_draft(head, set(), gamma_max=4, name="head")
    servicer.scheduler.gather = 20.0  # tiny steps: wait for the others (see test_batching)
    server, address = serve(servicer)
    yield {"head": head, "servicer": servicer, "address": address}
    server.stop(0).wait()
    servicer.close()


def served_requests():
    """16 sessions: greedy, T=1, top-p and top-k, seeded, prompts of 1 to 11 tokens (one with no feature yet)."""
    from specserve.coordinator import SessionRequest

    out = []
    for i in range(16):
        prompt = [(7 * i + j * j) % VOCAB for j in range(1 + i % 11)]
        mode = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.9, top_p=0.8),
                dict(temperature=1.1, top_k=6)][i % 4]
        out.append(SessionRequest(prompt, SamplingParams(**mode, seed=200 + i, ignore_eos=True), 20 + i % 5))
    return out


@pytest.mark.parametrize("fused", [False, True], ids=["head steps", "head blocks on the device"])
def test_served_head_sessions_together_equal_each_alone_and_in_process(target, served_head, fused, monkeypatch):
    """16 seeded sessions through the coordinator and a target worker that drafts with a head: each emits the
    tokens it emits alone and the in-process decoder's, the head's steps and the target's batched; the same with
    each block drafted whole on the device (`scheduler.drafting`, what a GPU worker does)."""
    import asyncio

    from specserve.coordinator import ColocatedRelay, Coordinator

    servicer = served_head["servicer"]
    monkeypatch.setattr(servicer.colocated.draft, "fused", fused)
    blocks = servicer.scheduler.fused_blocks
    coord = Coordinator(ColocatedRelay(served_head["address"], gamma=3))

    async def tokens_of(request) -> list[int]:
        return [t async for chunk in coord.generate(request) for t in chunk.tokens]

    async def together():
        return await asyncio.gather(*(tokens_of(r) for r in served_requests()))

    shared = asyncio.run(together())
    assert max(servicer.scheduler.sessions_per_draft_step) >= 8  # head steps were batched
    assert max(servicer.scheduler.sessions_per_step) >= 8  # and target steps
    local = SpeculativeDecoder(target, served_head["head"], gamma=3)  # prompt lookup first, as served
    for request, tokens in zip(served_requests(), shared):
        expected = local.generate(request.prompt_ids, request.params, request.max_tokens)
        assert tokens == expected.token_ids == asyncio.run(tokens_of(request))
    greedy = SpeculativeDecoder(target, None, gamma=0)
    for request, tokens in zip(served_requests()[::4], shared[::4]):  # the greedy ones: target-only's tokens
        assert tokens == greedy.generate(request.prompt_ids, request.params, request.max_tokens).token_ids
    assert len(servicer.sessions) == 0 and servicer.pool.used_tokens == 0
    assert servicer.colocated.draft.pool.used_tokens == 0
    assert (servicer.scheduler.fused_blocks > blocks) == fused


def test_served_greedy_head_sessions_drafting_whole_blocks_together_equal_target_only(target, monkeypatch):
    """8 greedy sessions at γ=3 over real gRPC, the worker's pools with step runners and the head drafting each
    step's blocks at once (`HeadPool.drafted_block`, one graph on CUDA; uncaptured here): blocks of several
    sessions share a batch bucket with padding rows, and every session emits target-only's tokens."""
    import asyncio

    from specserve.coordinator import ColocatedRelay, Coordinator, SessionRequest
    from specserve.models.drafts import head as head_module
    from specserve.models.memory import pool as pool_module
    from specserve.rpc.servicers import TargetWorkerServicer

    from tests.cpu.test_colocated import serve

    monkeypatch.setattr(pool_module, "STEP_RUNNER", True)
    monkeypatch.setattr(head_module, "WHOLE_BLOCKS", True)
    servicer = TargetWorkerServicer(target, VOCAB, kv_cache_tokens=4096, features=True)
    servicer.attach_draft(FeatureHeadForCausalLM.for_target(target, seed=1), set(), gamma_max=4, name="head")
    servicer.colocated.draft.fused = True
    servicer.scheduler.gather = 20.0  # tiny steps: wait for the others (see test_batching)
    server, address = serve(servicer)
    try:
        coord = Coordinator(ColocatedRelay(address, gamma=3, lookup=False))
        requests = [SessionRequest([(7 * i + j * j) % VOCAB for j in range(2 + i)], GREEDY, 24) for i in range(8)]

        async def tokens_of(request) -> list[int]:
            return [t async for chunk in coord.generate(request) for t in chunk.tokens]

        async def together():
            return await asyncio.gather(*(tokens_of(r) for r in requests))

        shared = asyncio.run(together())
        greedy = SpeculativeDecoder(target, None, gamma=0)
        for request, tokens in zip(requests, shared):
            assert tokens == greedy.generate(request.prompt_ids, request.params, request.max_tokens).token_ids
        runner = servicer.colocated.draft.pool.runner
        assert max(key[0][0] for key in runner.blocks) > 1  # whole blocks of several sessions at once
        assert len(servicer.sessions) == 0 and servicer.colocated.draft.pool.used_tokens == 0
    finally:
        server.stop(0).wait()
        servicer.close()


@pytest.mark.parametrize("fused", [False, True, "whole"],
                         ids=["head steps", "head blocks on the device", "head blocks at once"])
def test_first_two_tokens_follow_the_target_through_served_head_sessions(monkeypatch, fused):
    """The chi-square of the first two tokens with 16 head sessions at a time sharing head and target steps; a
    missing residual step is caught. "at once": the block's drafted steps as one call through the head's runner
    (`HeadPool.drafted_block`, one graph on CUDA)."""
    from specserve.models.memory import pool as pool_module
    from specserve.rpc.servicers import TargetWorkerServicer

    from tests.cpu.test_colocated import colocated_first_two

    monkeypatch.setattr(pool_module, "STEP_RUNNER", fused == "whole")  # the pools get runners, as on CUDA
    target = tiny_llama(0)  # vocabulary 8, as test_exactness
    servicer = TargetWorkerServicer(target, target.config.vocab_size, kv_cache_tokens=16 * 64, features=True)
    servicer.attach_draft(FeatureHeadForCausalLM.for_target(target, seed=4), set(), gamma_max=2)
    servicer.colocated.draft.fused = bool(fused)
    if fused == "whole":
        servicer.colocated.draft.pool.runner.whole_blocks = True
    servicer.scheduler.expected = lambda: 16
    try:
        mode = dict(temperature=1.0)
        expected = target_joint(target, mode)
        assert chi_square_pvalue(colocated_first_two(servicer, mode), expected) > 1e-3
        assert max(servicer.scheduler.sessions_per_draft_step) >= 8
        assert (servicer.scheduler.fused_blocks > 0) == bool(fused)
        if fused == "whole":
            assert servicer.colocated.draft.pool.runner.blocks
        monkeypatch.setattr(rejection, "residual_distribution", lambda p, q: p)
        assert chi_square_pvalue(colocated_first_two(servicer, mode), expected) < 1e-3
    finally:
        servicer.scheduler.close()


def test_a_head_needs_a_target_pool_with_features_and_a_colocated_place():
    from specserve.rpc.servicers import TargetWorkerServicer
    from specserve.workers.config import WorkersConfig

    target = tiny_llama(0)
    plain = TargetWorkerServicer(target, target.config.vocab_size)
    try:
        with pytest.raises(ValueError, match="keeps features"):
            plain.attach_draft(FeatureHeadForCausalLM.for_target(target, seed=4), set())
    finally:
        plain.close()
    with pytest.raises(ValueError, match="draft: a feature head needs batching"):
        TargetWorkerServicer(target, target.config.vocab_size, batching=False, features=True)
    config = WorkersConfig(target="embedded", draft="head:/some/head")
    assert config.colocated() and not config.has_draft_worker()
    for bad, field in ((dict(draft_placement="split"), "draft_placement"), (dict(batching=False), "batching"),
                       (dict(target_stages=[{}, {}]), "target_stages"),
                       (dict(target_resources={"tensor_parallel": 2}), "target_resources.tensor_parallel")):
        with pytest.raises(ValueError, match=field):
            WorkersConfig(target="embedded", draft="head:/some/head", **bad)


def test_served_head_blocks_on_cuda_equal_the_in_process_decoder():
    """On a GPU the worker drafts each head block on the device (fused by default there) beside a captured
    target pool: seeded sessions together equal the in-process decoder on the same device (float64), and each
    alone, its drafted steps one graph."""
    if not torch.cuda.is_available():
        pytest.skip("no GPU (a device session: pytest tests -k cuda)")
    from concurrent import futures

    from specserve.rpc.servicers import TargetWorkerServicer
    from specserve.speculation import PositionRNG

    target = tiny_llama(5, vocab=VOCAB, layers=2, hidden=32, scale=8).to("cuda", torch.float64)
    head = FeatureHeadForCausalLM.for_target(target, seed=1)
    servicer = TargetWorkerServicer(target, VOCAB, kv_cache_tokens=4096, features=True)
    servicer.attach_draft(head, set(), gamma_max=4)
    assert servicer.colocated.draft.fused and servicer.pool.runner is not None
    local = SpeculativeDecoder(target, head, gamma=3, draft_lookup=False)
    requests = served_requests()[:8]

    def run(request) -> list[int]:
        engine = servicer.new_engine()
        rounds = servicer.colocated.rounds(engine, request.prompt_ids, request.params,
                                           PositionRNG(request.params.seed), request.max_tokens, 3, False)
        tokens = [t for rnd in rounds for t in rnd.tokens]
        servicer.scheduler.call(engine.release).result()
        return tokens

    try:
        with futures.ThreadPoolExecutor(8) as threads:
            served = list(threads.map(run, requests))
        assert servicer.scheduler.fused_blocks > 0
        for request, tokens in zip(requests, served):
            assert tokens == local.generate(request.prompt_ids, request.params, request.max_tokens).token_ids
        # alone, each block's drafted steps are one captured graph (`HeadPool.drafted_block`), replayed
        runner = servicer.colocated.draft.pool.runner
        for request, tokens in zip(requests, served):
            assert run(request) == tokens
        assert runner.whole_blocks and runner.blocks and runner.block_replays > 0
        assert all(blk.graph not in (None, False) for blk in runner.blocks.values())  # captured, not eager
    finally:
        servicer.scheduler.close()


def test_a_bfloat16_head_on_a_cpu_drafts_with_int8_weights_unless_told_otherwise(tmp_path):
    """`draft_quantization` ("auto" by default) applies to a head as to a model draft: int8 layers, fc and head
    rows for a bfloat16 head named by its path on a CPU that runs specserve's kernels, "none" keeps it dense, as
    does passing it loaded; either way the head only proposes, so greedy stays the target's."""
    from specserve.models.kernels import cpu
    from specserve.models.kernels.quant import QuantizedLinear

    target = tiny_llama(5, vocab=VOCAB, layers=2, hidden=64, scale=8, dtype=torch.bfloat16)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    reference = SpeculativeDecoder(target, None, gamma=0).generate(prompt, GREEDY, 24).token_ids
    saved = FeatureHeadForCausalLM.for_target(target, seed=1, shared_from=str(tmp_path / "target"))
    target.save_pretrained(str(tmp_path / "target"))
    saved.save_pretrained(str(tmp_path / "head"))
    for asked, loaded in ((None, False), ("none", False), (None, True)):
        head = FeatureHeadForCausalLM.for_target(target, seed=1) if loaded else f"head:{tmp_path / 'head'}"
        decoder = SpeculativeDecoder(target, head, gamma=3, draft_lookup=False, draft_quantization=asked)
        quantized = asked is None and not loaded and cpu.available()
        assert (getattr(decoder.head, "specserve_quant", None) is not None) == quantized
        proposer = decoder.new_proposer()
        assert isinstance(proposer.seq.fc, QuantizedLinear) == quantized
        got = decoder.generate(prompt, GREEDY, 24)
        assert got.token_ids == reference and got.stats.drafted > 0
