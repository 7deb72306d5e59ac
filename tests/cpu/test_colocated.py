"""A draft colocated with the target: whole sessions run in the target worker, draft steps batched too.

Served through the coordinator and real gRPC (one stream per session, a message per round or per the
rounds within the stream interval), each of 16
concurrent seeded sessions equals the same request alone and the in-process decoder; the first-two-token
chi-square runs through the colocated sessions with 16 at a time sharing draft and target steps.
"""

from __future__ import annotations

import asyncio
from concurrent import futures

import grpc
import numpy as np
import pytest

from specserve import SamplingParams, SpeculativeDecoder
from specserve.coordinator import ColocatedRelay, Coordinator, SessionRequest
from specserve.rpc.convert import sampling_to_proto
from specserve.rpc.servicers import TargetWorkerServicer
from specserve.speculation import PositionRNG, rejection
from specserve.v1 import workers_pb2, workers_pb2_grpc
from tests.conftest import perturbed_copy, tiny_llama
from tests.cpu.test_batching import CONCURRENT, requests
from tests.cpu.test_exactness import N, PROMPT, chi_square_pvalue, target_joint

VOCAB = 64
TOP_K_Q = 4


def serve(servicer):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=64))
    workers_pb2_grpc.add_TargetWorkerServicer_to_server(servicer, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    return server, address


@pytest.fixture(scope="module")
def colocated():
    target = tiny_llama(0, vocab=VOCAB, layers=2, hidden=32, scale=8)
    draft = perturbed_copy(target, 0.3)
    servicer = TargetWorkerServicer(target, VOCAB, kv_cache_tokens=4096)
    servicer.attach_draft(draft, set(), gamma_max=4, top_k_q=TOP_K_Q)
    servicer.scheduler.gather = 20.0  # tiny steps: wait for the others (see test_batching)
    server, address = serve(servicer)
    yield {"target": target, "draft": draft, "servicer": servicer, "address": address}
    server.stop(0).wait()
    servicer.close()


def test_colocated_sessions_equal_alone_and_in_process(colocated):
    servicer = colocated["servicer"]
    coord = Coordinator(ColocatedRelay(colocated["address"], gamma=3))
    scheduler = servicer.scheduler

    async def tokens_of(request: SessionRequest) -> list[int]:
        return [t async for chunk in coord.generate(request) for t in chunk.tokens]

    async def together():
        return await asyncio.gather(*(tokens_of(r) for r in requests()))

    shared = asyncio.run(together())
    assert max(scheduler.sessions_per_draft_step) >= CONCURRENT // 2  # draft steps were batched
    assert max(scheduler.sessions_per_step) >= CONCURRENT // 2  # and target steps
    local = SpeculativeDecoder(colocated["target"], colocated["draft"], gamma=3, draft_top_k=TOP_K_Q)
    for request, tokens in zip(requests(), shared):
        expected = local.generate(request.prompt_ids, request.params, request.max_tokens)
        assert tokens == expected.token_ids == asyncio.run(tokens_of(request))
    assert len(servicer.sessions) == 0 and servicer.pool.used_tokens == 0
    assert servicer.colocated.draft.pool.used_tokens == 0


@pytest.mark.parametrize("gamma", ["auto", "heuristic"])
def test_colocated_adaptive_gamma_keeps_greedy_output_and_reports_rounds(colocated, gamma, monkeypatch):
    from specserve.speculation.controllers import WarmStarts

    coord = Coordinator(ColocatedRelay(colocated["address"], gamma=gamma))
    greedy = SamplingParams(temperature=0.0, ignore_eos=True)
    # this draft is a copy of the target, as slow as it, and `auto` rightly stays at γ=0 once it has measured that
    # (it then does not even probe); nor does it draft where a verify block costs its width in single steps (the
    # AVX2 kernels are compute-bound). Calibrated as a free draft and a free block, its first blocks are a clear
    # yes, and a copy's are all accepted; given to a session that does not start from what earlier sessions
    # learned of the real costs.
    colocated_sessions = colocated["servicer"].colocated
    monkeypatch.setattr(colocated_sessions.sessions, "_warm_starts", WarmStarts())
    measured = colocated_sessions.cost_profile()
    colocated_sessions._profile = (dict.fromkeys(measured[0], min(measured[0].values())), 0.0)
    try:
        chunks = asyncio.run(_collect(coord, SessionRequest(PROMPT * 3, greedy, 40)))
    finally:
        colocated_sessions._profile = measured
    plain = SpeculativeDecoder(colocated["target"], None, gamma=0).generate(PROMPT * 3, greedy, 40)
    assert [t for c in chunks for t in c.tokens] == plain.token_ids
    stats = chunks[-1].stats
    assert stats["rounds"] == len(stats["gamma_history"]) < 40 and stats["drafted"] > 0


def test_the_worker_sends_the_rounds_within_its_interval_as_one_message(colocated):
    """Over real gRPC: with no interval a message a round; with one longer than the session the first round alone
    (the first token's latency), then every other round in one message with the finish: the same rounds, field
    for field (tokens, γ, drafts, statistics). Through the coordinator the chunks are the same either way."""
    stub = workers_pb2_grpc.TargetWorkerStub(grpc.insecure_channel(colocated["address"]))

    def messages(interval: float, sid: str) -> list:
        request = workers_pb2.SessionRequest(session_id=sid, prompt_ids=PROMPT, max_tokens=24, gamma="2",
                                             sampling=sampling_to_proto(SamplingParams(temperature=1.0), 9),
                                             stream_interval_s=interval)
        return list(stub.Generate(request))

    each, held = messages(0.0, "each"), messages(60.0, "held")
    assert len(each) > 3 and all(len(m.rounds) == 1 for m in each)
    assert [len(m.rounds) for m in held] == [1, len(each) - 1] and held[-1].rounds[-1].finish_reason == "length"
    strip = ("draft_time_s", "verify_time_s", "step_time_s", "prefill_time_s")  # timings differ run to run
    for a, b in zip([r for m in each for r in m.rounds], [r for m in held for r in m.rounds]):
        for field in strip:
            a.ClearField(field), b.ClearField(field)
        assert a == b

    request = SessionRequest(PROMPT, SamplingParams(temperature=1.0, seed=9, ignore_eos=True), 24, gamma=2)
    per_round = asyncio.run(_collect(Coordinator(ColocatedRelay(colocated["address"])), request))
    paced = asyncio.run(_collect(Coordinator(ColocatedRelay(colocated["address"]), stream_interval_s=60.0),
                                 SessionRequest(request.prompt_ids, request.params, 24, gamma=2)))
    assert len(per_round) > 3 and [len(c.rounds) for c in paced] == [1, len(per_round) - 1]
    assert [t for c in paced for t in c.tokens] == [t for c in per_round for t in c.tokens]
    assert paced[-1].stats["gamma_history"] == per_round[-1].stats["gamma_history"]
    assert len(colocated["servicer"].sessions) == 0


async def _collect(coord, request):
    return [chunk async for chunk in coord.generate(request)]


def test_colocated_errors_name_the_field(colocated):
    stub = workers_pb2_grpc.TargetWorkerStub(grpc.insecure_channel(colocated["address"]))
    sampling = sampling_to_proto(SamplingParams(temperature=0.0), 1)
    for request, field in ((workers_pb2.SessionRequest(session_id="x", prompt_ids=PROMPT, sampling=sampling,
                                                       max_tokens=4, gamma="lots"), "gamma"),
                           (workers_pb2.SessionRequest(session_id="x", prompt_ids=PROMPT, sampling=sampling,
                                                       max_tokens=0), "max_tokens"),
                           (workers_pb2.SessionRequest(session_id="x", prompt_ids=[VOCAB], sampling=sampling,
                                                       max_tokens=4), "prompt_ids")):
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(request))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in info.value.details()
    plain = TargetWorkerServicer(tiny_llama(0, vocab=VOCAB, layers=1, hidden=16), VOCAB)
    server, address = serve(plain)
    try:
        with pytest.raises(grpc.RpcError) as info:
            list(workers_pb2_grpc.TargetWorkerStub(grpc.insecure_channel(address)).Generate(
                workers_pb2.SessionRequest(session_id="y", prompt_ids=PROMPT, sampling=sampling, max_tokens=4)))
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        server.stop(0).wait()
        plain.close()


def colocated_first_two(servicer, mode: dict) -> np.ndarray:
    """Counts of the first two tokens over N seeds, CONCURRENT colocated sessions at a time."""
    vocab = servicer.sessions.vocab

    def run(seed: int) -> list[int]:
        params = SamplingParams(**mode, seed=seed, ignore_eos=True)
        engine = servicer.new_engine()
        rounds = servicer.colocated.rounds(engine, PROMPT, params, PositionRNG(seed), 3, 2, False)
        tokens = [t for rnd in rounds for t in rnd.tokens]
        servicer.scheduler.call(engine.release).result()
        return tokens

    counts = np.zeros((vocab, vocab))
    with futures.ThreadPoolExecutor(CONCURRENT) as threads:
        for tokens in threads.map(run, range(N)):
            counts[tokens[0], tokens[1]] += 1
    return counts


@pytest.mark.parametrize("fused", [False, True], ids=["draft steps", "fused draft blocks"])
def test_first_two_tokens_follow_target_through_colocated_sessions(tiny_pair, fused, monkeypatch):
    target, draft = tiny_pair
    servicer = TargetWorkerServicer(target, target.config.vocab_size, kv_cache_tokens=CONCURRENT * 64)
    servicer.attach_draft(draft, set(), gamma_max=2)
    servicer.colocated.draft.fused = fused  # each γ=2 block drafted whole (`scheduler.drafting`), or per token
    servicer.scheduler.expected = lambda: CONCURRENT
    try:
        mode = dict(temperature=1.0)
        expected = target_joint(target, mode)
        assert chi_square_pvalue(colocated_first_two(servicer, mode), expected) > 1e-3
        assert max(servicer.scheduler.sessions_per_draft_step) >= CONCURRENT // 2
        assert (servicer.scheduler.fused_blocks > 0) == fused
        monkeypatch.setattr(rejection, "residual_distribution", lambda p, q: p)
        broken = colocated_first_two(servicer, mode)
        assert chi_square_pvalue(broken, expected) < 1e-3, "the test cannot tell a missing residual step"
    finally:
        servicer.scheduler.close()
