"""Batched target steps: exact, and a session's tokens do not depend on who shares its steps.

- chi-square of the first two tokens with 16 sessions at a time sharing the scheduler's steps (the same
  harness as test_exactness, so a missing residual step fails it here too);
- 16 seeded sessions served together through the coordinator and real gRPC workers, a cancelled and a bad
  request among them, each equal to the same request served alone and to the in-process decoder.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent import futures
from concurrent.futures import Future

import grpc
import numpy as np
import pytest
import torch
from specserve import SamplingParams, SpeculativeDecoder
from specserve.coordinator import Coordinator, SessionRequest, SplitDriver
from specserve.engine.loop import speculate
from specserve.engine.proposers import ModelProposer, Proposal, TargetVerifier
from specserve.models.memory import pool as pool_module
from specserve.models.memory.pool import KVPool
from specserve.rpc.servicers import DraftWorkerServicer, TargetWorkerServicer
from specserve.scheduler.colocated import ScheduledDraft
from specserve.scheduler.steps import ScheduledVerifier, StepScheduler, _Work
from specserve.speculation import PositionRNG, make_controller, rejection
from specserve.v1 import workers_pb2, workers_pb2_grpc

from tests.conftest import perturbed_copy, tiny_llama
from tests.cpu.test_exactness import PROMPT, N, chi_square_pvalue, target_joint

CONCURRENT = 16


def batched_first_two(scheduler, pool, target, draft, mode: dict) -> np.ndarray:
    """Counts of the first two tokens over N seeds, CONCURRENT sessions at a time on one scheduler."""
    vocab = target.config.vocab_size

    def run(seed: int) -> list[int]:
        params = SamplingParams(**mode, seed=seed, ignore_eos=True)
        verifier = ScheduledVerifier(scheduler, TargetVerifier(target, vocab, pool.sequence()))
        rounds = speculate(PROMPT, ModelProposer(draft, vocab), verifier, make_controller(2), params,
                           PositionRNG(seed), 3, vocab, set())
        return [t for rnd in rounds for t in rnd.tokens]

    counts = np.zeros((vocab, vocab))
    with futures.ThreadPoolExecutor(CONCURRENT) as pool_threads:
        for tokens in pool_threads.map(run, range(N)):
            counts[tokens[0], tokens[1]] += 1
    return counts


@pytest.mark.parametrize("mode", [dict(temperature=1.0), dict(temperature=1.3, top_p=0.85)], ids=["T=1", "top-p"])
@pytest.mark.parametrize("runner", [False, True], ids=["eager steps", "step runner"])
def test_first_two_tokens_follow_target_through_batched_steps(tiny_pair, mode, runner, monkeypatch):
    target, draft = tiny_pair
    pool = KVPool(target, tokens=CONCURRENT * 64, min_block=8, runner=runner)
    scheduler = StepScheduler(pool, expected=lambda: CONCURRENT, gather=0.5)
    try:
        expected = target_joint(target, mode)
        assert chi_square_pvalue(batched_first_two(scheduler, pool, target, draft, mode), expected) > 1e-3
        assert max(scheduler.sessions_per_step) >= CONCURRENT // 2  # sessions really shared steps
        assert pool.used_tokens == 0  # every session's block came back
        assert bool(pool.runner and pool.runner.buckets) == runner  # the steps went through the runner
        monkeypatch.setattr(rejection, "residual_distribution", lambda p, q: p)
        broken = batched_first_two(scheduler, pool, target, draft, mode)
        assert chi_square_pvalue(broken, expected) < 1e-3, "the test cannot tell a missing residual step"
    finally:
        scheduler.close()


def test_work_queued_while_held_work_is_marked_retryable_waits_for_the_queue():
    """Sessions queue work from their own threads while the compute thread marks held work retryable (after each
    call it runs, such as a session's release): that pass holds the queue's lock, so a session's append waits
    for it instead of changing the queue under its iteration (which ended the compute thread with "deque
    mutated during iteration" and left every session waiting)."""
    scheduler = StepScheduler()
    busy, release = threading.Event(), threading.Event()
    scheduler.call(lambda: busy.set() or release.wait(10))  # the compute thread keeps out of the queue
    assert busy.wait(10)

    class Meddler:  # a queued piece of work whose retry lets another session queue work, as a thread switch can
        def __init__(self):
            self._held = True

        @property
        def held(self):
            return self._held

        @held.setter
        def held(self, value):
            self._held = value
            other = threading.Thread(target=lambda: scheduler._submit(_Work(None, None, "feed", [1], Future())))
            other.start()
            other.join(0.3)  # with the lock held it waits here; without, it appends now

    meddlers = [Meddler(), Meddler()]
    try:
        with scheduler._cond:
            scheduler._work.extend(meddlers)
        scheduler._retry_held()
        assert not any(m.held for m in meddlers)
    finally:
        with scheduler._cond:
            scheduler._work.clear()
        release.set()
        scheduler.close()


def test_a_step_reports_the_prompt_chunks_it_carried_apart_from_the_blocks(tiny_pair):
    """A verify's StepInfo says how many of its step's tokens and sessions were other sessions' prompt chunks
    (what `AutoGamma` keeps out of the load a block shares), and carries it over the wire (`VerifyReply`)."""
    target, _ = tiny_pair
    vocab = target.config.vocab_size
    pool = KVPool(target, tokens=512, min_block=8)
    scheduler = StepScheduler(pool, prefill_chunk=16)
    running, arriving = TargetVerifier(target, vocab, pool.sequence()), TargetVerifier(target, vocab, pool.sequence())
    try:
        scheduler.prefill(running, PROMPT).result()
        held, release = threading.Event(), threading.Event()
        scheduler.call(lambda: held.set() or release.wait(10))  # the compute thread waits while both are queued
        assert held.wait(10)
        proposal = Proposal([3, 4], vocab)  # one-hot q: a greedy draft's block
        verified = scheduler.verify(running, PROMPT, proposal, SamplingParams(temperature=0.0), PositionRNG(0))
        prefilled = scheduler.prefill(arriving, [i % vocab for i in range(30)])  # 29 to feed: chunks of 16 and 13
        release.set()
        _, step = verified.result(timeout=10)
        prefilled.result(timeout=10)
        assert (step.tokens, step.sessions, step.prompt_tokens, step.prompt_sessions) == (3 + 16, 2, 16, 1)
        reply = workers_pb2.VerifyReply(step_tokens=step.tokens, step_sessions=step.sessions,
                                        step_prompt_tokens=step.prompt_tokens,
                                        step_prompt_sessions=step.prompt_sessions)
        parsed = workers_pb2.VerifyReply.FromString(reply.SerializeToString())
        assert (parsed.step_prompt_tokens, parsed.step_prompt_sessions) == (16, 1)
    finally:
        scheduler.close()


VOCAB = 64
TOP_K_Q = 4


# the last runs both workers' models on CUDA where there is a GPU (a device session: `pytest tests -k cuda`)
@pytest.fixture(scope="module", params=[
    "draft worker", "batched draft worker", "batched draft worker, step runner",
    pytest.param("batched on cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")),
])
def served(request):
    default_runner = pool_module.STEP_RUNNER
    pool_module.STEP_RUNNER = True if request.param.endswith("step runner") else default_runner
    target = tiny_llama(0, vocab=VOCAB, layers=2, hidden=32, scale=8)
    draft = perturbed_copy(target, 0.3)
    if request.param == "batched on cuda":
        target, draft = target.to("cuda"), draft.to("cuda")
    target_servicer = TargetWorkerServicer(target, VOCAB, kv_cache_tokens=4096)
    # a tiny model's step takes ~1 ms, less than a session's trip through the coordinator and the draft worker:
    # wait longer for the others than the default tenth of a step, so that they really share steps
    target_servicer.scheduler.gather = 20.0
    if request.param != "draft worker":  # its sessions' draft tokens share draft forwards
        compute = StepScheduler()
        draft_servicer = DraftWorkerServicer(ScheduledDraft(compute, draft, VOCAB, TOP_K_Q).proposer, VOCAB,
                                             scheduler=compute, scheduled=True)
    else:
        draft_servicer = DraftWorkerServicer(lambda: ModelProposer(draft, VOCAB, TOP_K_Q), VOCAB)
    servicers = [
        (target_servicer, workers_pb2_grpc.add_TargetWorkerServicer_to_server),
        (draft_servicer, workers_pb2_grpc.add_DraftWorkerServicer_to_server),
    ]
    servers, addresses = [], []
    for servicer, add in servicers:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=64))
        add(servicer, server)
        addresses.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
        server.start()
        servers.append(server)
    yield {"target": target, "draft": draft, "servicer": target_servicer, "addresses": addresses,
           "draft_servicer": draft_servicer, "step_runner": request.param.endswith("step runner")}
    for server in servers:
        server.stop(0).wait()
    for servicer, _ in servicers:
        servicer.close()
    pool_module.STEP_RUNNER = default_runner


def requests() -> list[SessionRequest]:
    out = []
    for i in range(CONCURRENT):
        prompt = [(7 * i + j * j) % VOCAB for j in range(5 + i % 7)]
        mode = dict(temperature=0.0) if i % 4 == 0 else dict(temperature=1.0, top_p=0.9 if i % 3 else 1.0)
        out.append(SessionRequest(prompt, SamplingParams(**mode, seed=100 + i, ignore_eos=True), 24 + i % 5))
    return out


def test_a_session_served_beside_others_gets_exactly_its_tokens_alone(served):
    target_address, draft_address = served["addresses"]
    coord = Coordinator(SplitDriver(target_address, VOCAB, [], draft="remote", draft_address=draft_address, gamma=3))
    scheduler = served["servicer"].scheduler

    async def tokens_of(request: SessionRequest) -> list[int]:
        return [t async for chunk in coord.generate(request) for t in chunk.tokens]

    async def cancelled() -> None:
        request = SessionRequest([1, 2, 3, 4], SamplingParams(temperature=1.0, seed=9, ignore_eos=True), 400)
        stream = coord.generate(request)
        await stream.__anext__()
        coord.cancel(request.request_id)
        async for _ in stream:
            pass

    async def bad() -> str:
        try:
            await tokens_of(SessionRequest([VOCAB + 1], SamplingParams(seed=1), 5))
        except grpc.RpcError as exc:
            return exc.code().name
        return "accepted"

    async def together():
        runs = [tokens_of(r) for r in requests()]
        return await asyncio.gather(*runs, cancelled(), bad())

    before = dict(scheduler.sessions_per_step)
    *shared, _, bad_code = asyncio.run(together())
    during = {n: c - before.get(n, 0) for n, c in scheduler.sessions_per_step.items() if c > before.get(n, 0)}
    assert max(during) >= CONCURRENT // 2, during  # they really shared steps
    assert bad_code == "INVALID_ARGUMENT"
    local = SpeculativeDecoder(served["target"], served["draft"], gamma=3, draft_top_k=TOP_K_Q)
    for request, tokens in zip(requests(), shared):
        alone = asyncio.run(tokens_of(request))
        assert tokens == alone and len(tokens) == request.max_tokens
        assert tokens == local.generate(request.prompt_ids, request.params, request.max_tokens).token_ids
    assert len(served["servicer"].sessions) == 0 and served["servicer"].pool.used_tokens == 0
    draft_steps = served["draft_servicer"].scheduler.sessions_per_draft_step
    assert (max(draft_steps, default=0) >= 2) == served["draft_servicer"].direct  # draft tokens shared forwards
    assert len(served["draft_servicer"].sessions) == 0
    if served["step_runner"]:  # the decode and verify steps went through the static-shape runner
        assert served["servicer"].pool.runner.buckets
    assert not scheduler.lane_steps[1]  # a float64 model's steps: one lane (`KVPool.concurrent_forwards`)


def kernel_model(seed: int = 0):
    """A small int4 bf16 Llama whose steps run on specserve's fused CPU kernels (None where they cannot)."""
    from specserve.models.formats.loading import load_model
    from specserve.models.kernels import cpu

    if cpu.library() is None:
        return None
    return load_model(tiny_llama(seed, vocab=64, layers=2, hidden=128, heads=4, kv_heads=2, dtype=torch.bfloat16),
                      quantization="int4").model


def test_sessions_split_among_lanes_only_where_the_pools_forwards_may_overlap(tiny_pair):
    target, _ = tiny_pair
    model = kernel_model()
    if model is None:
        pytest.skip("specserve's CPU kernels do not run here")
    kernels, runner = (KVPool(model, tokens=256, min_block=8, runner=r) for r in (False, True))
    float64 = KVPool(target, tokens=256, min_block=8, runner=False)
    assert kernels.concurrent_forwards
    assert not runner.concurrent_forwards  # a runner's static buffers are shared
    assert not float64.concurrent_forwards  # torch's products: their rounding may follow the thread count
    for pool, lanes, threads, split in ((kernels, None, 2, True), (kernels, None, 1, False), (kernels, 1, 2, False),
                                        (runner, None, 2, False), (float64, None, 2, False)):
        scheduler = StepScheduler(pool, threads=threads, lanes=lanes, expected=lambda: 8)
        try:
            assert scheduler._wants_split() == split, (lanes, threads)
            scheduler.expected = lambda: 7  # fewer than lane_sessions: one step over all of them
            assert not scheduler._wants_split()
        finally:
            scheduler.close()


def test_sessions_split_between_two_lanes_get_the_tokens_they_get_alone():
    """12 seeded sessions (greedy, T=1, top-p) on a scheduler that splits them between two compute threads of one
    thread each: every session's tokens are those it gets alone on one lane of two threads."""
    model = kernel_model()
    if model is None:
        pytest.skip("specserve's CPU kernels do not run here")
    draft = tiny_llama(3, vocab=64, layers=1, hidden=16, scale=8)
    sessions = 12
    modes = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=1.2, top_p=0.8)]

    def tokens(scheduler, pool, i: int) -> list[int]:
        params = SamplingParams(**modes[i % 3], seed=50 + i, ignore_eos=True)
        verifier = ScheduledVerifier(scheduler, TargetVerifier(model, 64, pool.sequence()))
        try:
            rounds = speculate([(5 * i + j * j) % 64 for j in range(6 + i % 5)], ModelProposer(draft, 64), verifier,
                               make_controller(2), params, PositionRNG(50 + i), 20, 64, set())
            return [t for rnd in rounds for t in rnd.tokens]
        finally:
            verifier.release()

    def run(lanes: int, together: bool) -> list[list[int]]:
        pool = KVPool(model, tokens=sessions * 64, min_block=8, runner=False)
        scheduler = StepScheduler(pool, threads=2, lanes=lanes, expected=lambda: sessions if together else 1,
                                  gather=2.0)
        scheduler.lane_sessions = 4
        try:
            if together:
                with futures.ThreadPoolExecutor(sessions) as threads:
                    out = list(threads.map(lambda i: tokens(scheduler, pool, i), range(sessions)))
            else:
                out = [tokens(scheduler, pool, i) for i in range(sessions)]
            return out, scheduler
        finally:
            scheduler.close()

    split, scheduler = run(2, True)
    assert scheduler.lane_steps[1] > 0, scheduler.lane_steps  # the second lane stepped sessions of its own
    assert max(scheduler.sessions_per_step) <= sessions // 2  # each lane its share
    alone, scheduler = run(1, False)
    assert not scheduler.lane_steps[1]
    assert split == alone and all(len(t) >= 20 for t in split)


@pytest.mark.parametrize("wait_s", [0.0, 30.0], ids=["refused", "waits"])
def test_a_full_kv_pool_makes_new_sessions_wait_and_spares_the_running_ones(wait_s):
    """A new session that finds the pool full of a running one's block waits for it to end (kv_wait_s; 0: refused
    at once); one longer than any block is refused at once either way. The running session goes on untouched."""
    from specserve.rpc.convert import sampling_to_proto
    from specserve.v1 import workers_pb2

    target = tiny_llama(0, vocab=VOCAB, layers=2, hidden=32, scale=8)
    servicer = TargetWorkerServicer(target, VOCAB, kv_cache_tokens=256, kv_wait_s=wait_s)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    workers_pb2_grpc.add_TargetWorkerServicer_to_server(servicer, server)
    stub = workers_pb2_grpc.TargetWorkerStub(
        grpc.insecure_channel(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"))
    server.start()
    sampling = sampling_to_proto(SamplingParams(temperature=0.0), 1)

    def prefill(sid: str, prompt: list[int]):
        return stub.Prefill(workers_pb2.PrefillRequest(session_id=sid, prompt_ids=prompt, sampling=sampling))

    try:
        held = [i % VOCAB for i in range(150)]
        other = [(7 * i + 3) % VOCAB for i in range(150)]  # shares nothing with `held`
        prefill("a", held)
        with pytest.raises(grpc.RpcError) as info:  # longer than any block: never fits
            prefill("c", held * 2)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "KV" in info.value.details()
        with futures.ThreadPoolExecutor(1) as waiter:
            b = waiter.submit(prefill, "b", other)
            update = workers_pb2.SessionUpdate(session_id="a", base_length=len(held))
            reply = stub.Verify(workers_pb2.VerifyRequest(update=update))  # "a" goes on untouched
            alone = SpeculativeDecoder(target, None, gamma=0).generate(held, SamplingParams(temperature=0.0), 1)
            assert reply.next_token == alone.token_ids[0]
            if wait_s:
                with pytest.raises(futures.TimeoutError):  # "b" waits for room ...
                    b.result(timeout=1.0)
                stub.Release(workers_pb2.ReleaseRequest(session_id="a"))
                b.result(timeout=30)  # ... and gets it once "a" ends
                update = workers_pb2.SessionUpdate(session_id="b", base_length=len(other))
                reply = stub.Verify(workers_pb2.VerifyRequest(update=update))
                alone = SpeculativeDecoder(target, None, gamma=0).generate(other, SamplingParams(temperature=0.0), 1)
                assert reply.next_token == alone.token_ids[0]
            else:
                with pytest.raises(grpc.RpcError) as info:
                    b.result(timeout=30)
                assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "KV" in info.value.details()
                stub.Release(workers_pb2.ReleaseRequest(session_id="a"))
        stub.Release(workers_pb2.ReleaseRequest(session_id="b"))
        assert servicer.pool.used_tokens == 0
    finally:
        server.stop(0).wait()
        servicer.close()


ONE_TEAM = """
import os, threading, torch
from specserve.scheduler.steps import StepScheduler
from specserve.scheduler.threads import one_thread_torch
x = torch.randn(1000, 1000)
ready, go, seen = threading.Event(), threading.Event(), {}
def session_thread():  # a gRPC thread: set up first, its first torch op only after the compute thread started
    one_thread_torch(); ready.set(); go.wait()
    (x @ x).sum(); seen["session"] = torch.get_num_threads()
t = threading.Thread(target=session_thread); t.start(); ready.wait()
compute = StepScheduler(threads=2)
seen["compute"] = compute.call(lambda: ((x @ x).sum(), torch.get_num_threads())[1]).result()
go.set(); t.join(); compute.close()
print(seen["session"], seen["compute"])
"""


def test_threads_other_than_the_compute_thread_keep_one_torch_thread():
    """torch re-applies the last thread count set by ANY thread at a thread's first parallel op: a gRPC thread
    that had set 1 then ran with 2, starting a second OpenMP team (and a slower compute thread). Run in a
    fresh interpreter: the count is process-wide state."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", ONE_TEAM], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["1", "2"], out.stdout + out.stderr
