"""A draft's block drafted whole on the device (`scheduler.drafting`) is the token-by-token path's block.

Concurrent sessions with different sampling parameters, γ, sparse q and stopping rules draft the same tokens,
q rows and confidences through one fused block per round as through per-token draft steps, with and without
the step runner; their caches end with real tokens where the placeholders were; a pool that cannot hold a
block fails that round with KVCacheFull. The chi-square through fused colocated sessions is in
test_colocated.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures

import pytest
import torch
from specserve.models.memory import pool as pool_module
from specserve.models.memory.pool import UNKNOWN, KVCacheFull
from specserve.scheduler.colocated import ScheduledDraft
from specserve.scheduler.steps import StepScheduler
from specserve.speculation import PositionRNG, SamplingParams

from tests.conftest import tiny_llama

VOCAB = 32
MODES = [
    dict(temperature=0.0),
    dict(temperature=1.0),
    dict(temperature=0.8, top_k=5),
    dict(temperature=1.2, top_p=0.7),
]


def propose_all(draft: ScheduledDraft, top_k_q: int, stop_below: float, keep_going) -> list[tuple]:
    """Three rounds of 8 concurrent sessions (mixed modes and γ), each drafting after a growing context."""

    def session(i: int) -> list[tuple]:
        proposer = draft.proposer()
        proposer.stop_below = stop_below
        params = SamplingParams(**MODES[i % len(MODES)], seed=i)
        context = [1 + (i * 7 + j) % (VOCAB - 1) for j in range(5 + i)]
        out = []
        for round_ in range(3):
            gamma = 1 + (i + round_) % 5
            proposal = proposer.propose(context, gamma, params, PositionRNG(i), keep_going)
            q = None if proposal.one_hot else proposal.q
            out.append((proposal.tokens, q, proposal.confidences, list(proposer.seq.tokens)))
            context = context + proposal.tokens[: max(1, len(proposal) - 1)] + [round_ + 2]
        proposer.release()
        return out

    with futures.ThreadPoolExecutor(8) as threads:
        return list(threads.map(session, range(8)))


@pytest.mark.parametrize("runner", [False, True], ids=["eager steps", "step runner"])
@pytest.mark.parametrize("rules", ["none", "stop below", "keep going", "sparse q"])
def test_fused_blocks_draft_what_token_by_token_drafts(runner, rules, monkeypatch):
    monkeypatch.setattr(pool_module, "STEP_RUNNER", runner)  # the draft's pool gets a step runner, or not
    model = tiny_llama(4, vocab=VOCAB, layers=2, hidden=32, scale=4)
    top_k_q = 6 if rules == "sparse q" else 0
    stop_below = 0.08 if rules == "stop below" else 0.0
    keep_going = (lambda confidences: confidences[-1] > 0.09) if rules == "keep going" else None
    results = {}
    for fused in (False, True):
        scheduler = StepScheduler(None)
        try:
            draft = ScheduledDraft(scheduler, model, VOCAB, top_k_q, kv_cache_tokens=2048, fused=fused)
            results[fused] = propose_all(draft, top_k_q, stop_below, keep_going)
            if fused:
                assert scheduler.draft_steps and max(scheduler.sessions_per_draft_step) > 1  # blocks were shared
                assert not runner or draft.pool.runner.buckets  # the steps after the first went through it
            assert draft.pool.used_tokens == 0
        finally:
            scheduler.close()
    cut = 0
    for alone, together in zip(results[False], results[True]):
        for (tokens, q, confidences, cache), (f_tokens, f_q, f_confidences, f_cache) in zip(alone, together):
            assert f_tokens == tokens
            assert (q is None) == (f_q is None)
            if q is not None:
                torch.testing.assert_close(f_q, q, rtol=1e-9, atol=1e-12)
            assert f_confidences == pytest.approx(confidences, rel=1e-12)
            assert UNKNOWN not in f_cache
            assert f_cache[: len(cache)] == cache  # and past the cut, the tokens the block drafted on
            cut += len(f_cache) > len(cache)
    assert (cut > 0) == (rules in ("stop below", "keep going"))  # the rules did cut some blocks short


def test_a_block_the_pool_cannot_hold_fails_alone():
    """Two blocks queued for the same fused step: the one too long for the pool fails with KVCacheFull, the
    other is drafted."""
    model = tiny_llama(4, vocab=VOCAB, layers=1, hidden=16)
    scheduler = StepScheduler(None)
    try:
        draft = ScheduledDraft(scheduler, model, VOCAB, kv_cache_tokens=64, fused=True)
        draft.pool.max_length = 16
        greedy = SamplingParams(temperature=0)
        hold = threading.Event()
        scheduler.call(hold.wait)  # the compute thread waits here until both blocks are queued
        long, short = draft.proposer(), draft.proposer()
        with futures.ThreadPoolExecutor(2) as threads:
            too_long = threads.submit(long.propose, list(range(1, 14)), 5, greedy, PositionRNG(0))
            fits = threads.submit(short.propose, [1, 2, 3], 4, greedy, PositionRNG(0))
            while len(scheduler._work) < 2:
                time.sleep(0.01)
            hold.set()
            with pytest.raises(KVCacheFull):
                too_long.result()
            assert len(fits.result()) == 4
        assert scheduler.fused_blocks == 1  # they were queued for the same step
        short.release()
        long.release()
    finally:
        scheduler.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_blocks_on_cuda_replay_graphs_and_draft_what_token_by_token_drafts(monkeypatch):
    monkeypatch.setattr(pool_module, "STEP_RUNNER", True)
    model = tiny_llama(4, vocab=VOCAB, layers=2, hidden=32, scale=4).to("cuda")
    results = {}
    for fused in (False, None):  # None: the default on CUDA, which is fused
        scheduler = StepScheduler(None)
        try:
            draft = ScheduledDraft(scheduler, model, VOCAB, kv_cache_tokens=2048, fused=fused)
            assert draft.fused == (fused is None)
            results[fused] = propose_all(draft, 0, 0.0, None)
            if fused is None:
                assert scheduler.fused_blocks and draft.pool.runner.replays  # later steps replayed graphs
        finally:
            scheduler.close()
    for alone, together in zip(results[False], results[None]):
        for (tokens, q, _, _), (f_tokens, f_q, _, f_cache) in zip(alone, together):
            assert f_tokens == tokens and UNKNOWN not in f_cache
            if q is not None:  # float32 q: CUDA's batched and one-row softmax round differently (1.8e-7 seen)
                torch.testing.assert_close(f_q.cpu(), q.cpu(), rtol=1e-6, atol=1e-8)


def _auto_rounds(model, target, fused: bool) -> tuple[list, list, int]:
    """40 greedy tokens through the engine's loop with `auto` and a scheduled draft: (the rounds' observations,
    each `choose` call's open_ended, the fused blocks the scheduler ran)."""
    from specserve.engine.loop import speculate
    from specserve.engine.proposers import LookupOrModelProposer, TargetVerifier
    from specserve.speculation import AutoGamma

    scheduler = StepScheduler(None)
    try:
        draft = ScheduledDraft(scheduler, model, VOCAB, kv_cache_tokens=2048, fused=fused)
        proposer = draft.proposer()
        assert proposer.stops_early == (not fused) == LookupOrModelProposer(proposer).stops_early
        auto = AutoGamma(gamma_max=6, verify_profile={n: 0.010 for n in range(1, 8)}, draft_step_s=0.001)
        seen, asked = [], []
        update, choose = auto.update, auto.choose
        auto.update = lambda obs: (seen.append(obs), update(obs))[1]
        auto.choose = lambda *a, **k: (asked.append(k.get("open_ended", False)), choose(*a, **k))[1]
        rounds = list(speculate([1, 2, 3, 4], proposer, TargetVerifier(target, VOCAB), auto,
                                SamplingParams(temperature=0), PositionRNG(0), 40, VOCAB, set()))
        assert sum(len(r.tokens) for r in rounds) == 40
        return seen, asked, scheduler.fused_blocks
    finally:
        scheduler.close()


def test_auto_drafts_a_fused_block_at_the_depth_it_chose_and_prices_each_step_the_device_ran():
    """Where the device drafts whole blocks, stopping mid-block saves nothing: `auto` picks the depth up front
    (not an open-ended γ_max block cut after the fact), the block is as long as that depth, and the round's draft
    time is divided by the steps the device ran. Cut blocks divided a γ_max block's time by the tokens kept; on
    an H100 served `auto` then drafted at mean γ 0.15 where γ=3 paid 1.37x (docs/benchmarks-log.md)."""
    model = tiny_llama(4, vocab=VOCAB, layers=1, hidden=16)
    target = tiny_llama(5, vocab=VOCAB, layers=1, hidden=16)
    seen, asked, _ = _auto_rounds(model, target, fused=False)
    assert all(asked)  # token by token: γ is a ceiling and the draft may stop early
    seen, asked, blocks = _auto_rounds(model, target, fused=True)
    drafted = [obs for obs in seen if obs.gamma > 0]
    assert drafted, "auto drafted nothing at a draft step a tenth of the verify"
    assert not any(asked)  # the depth chosen up front
    assert all(obs.drafted == obs.gamma and not obs.confidences for obs in drafted)
    assert blocks >= sum(obs.gamma > 1 for obs in drafted)
