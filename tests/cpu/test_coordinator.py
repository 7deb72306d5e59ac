"""The coordinator without Ray: real gRPC workers on localhost, sessions driven through its asyncio API."""

from __future__ import annotations

import asyncio
from concurrent import futures
from dataclasses import replace

import grpc
import pytest

from specserve import SamplingParams, SpeculativeDecoder
from specserve.coordinator import Coordinator, Overloaded, SessionRequest, SplitDriver
from specserve.engine.loop import Round
from specserve.engine.proposers import ModelProposer
from specserve.rpc.servicers import DraftWorkerServicer, TargetWorkerServicer
from specserve.v1 import workers_pb2_grpc
from tests.conftest import perturbed_copy, tiny_llama

VOCAB = 64
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
TOP_K_Q = 4


@pytest.fixture(scope="module")
def setup():
    target = tiny_llama(0, vocab=VOCAB, layers=2, hidden=32, scale=8)
    draft = perturbed_copy(target, 0.3)
    servicers = {
        "target": (TargetWorkerServicer(target, VOCAB), workers_pb2_grpc.add_TargetWorkerServicer_to_server),
        "draft": (DraftWorkerServicer(lambda: ModelProposer(draft, VOCAB, TOP_K_Q), VOCAB),
                  workers_pb2_grpc.add_DraftWorkerServicer_to_server),
    }
    servers, addresses = [], {}
    for name, (servicer, add) in servicers.items():
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        add(servicer, server)
        addresses[name] = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        server.start()
        servers.append(server)
    local = SpeculativeDecoder(target, draft, gamma=3, draft_top_k=TOP_K_Q)  # as served: prompt lookup first
    yield {"addresses": addresses, "servicers": {k: v[0] for k, v in servicers.items()}, "local": local}
    for server in servers:
        server.stop(0).wait()
    for servicer, _ in servicers.values():
        servicer.close()


def coordinator(setup, max_sessions: int = 64, max_queued: int = 256, queue_timeout_s: float = 300.0,
                stream_interval_s: float = 0.0, stream_chunks_per_s: float = 0.0, **kwargs) -> Coordinator:
    a = setup["addresses"]
    driver = SplitDriver(a["target"], VOCAB, [], draft="remote", draft_address=a["draft"], gamma=3, **kwargs)
    return Coordinator(driver, max_sessions=max_sessions, max_queued=max_queued, queue_timeout_s=queue_timeout_s,
                       stream_interval_s=stream_interval_s, stream_chunks_per_s=stream_chunks_per_s)


async def collect(coord, request):
    return [chunk async for chunk in coord.generate(request)]


def open_sessions(setup) -> list[int]:
    return [len(s.sessions) for s in setup["servicers"].values()]


@pytest.mark.parametrize("pipelined", [False, True])
def test_sessions_match_in_process_and_run_concurrently(setup, pipelined):
    coord = coordinator(setup, pipelined=pipelined)
    seeds = [1, 2, 3]
    requests = [SessionRequest(PROMPT, SamplingParams(temperature=1.0, seed=s, ignore_eos=True), 25) for s in seeds]

    async def both():
        return await asyncio.gather(*(collect(coord, r) for r in requests))

    for seed, chunks in zip(seeds, asyncio.run(both())):
        expected = setup["local"].generate(PROMPT, SamplingParams(temperature=1.0, seed=seed, ignore_eos=True), 25)
        assert [t for c in chunks for t in c.tokens] == expected.token_ids
        assert chunks[-1].finish_reason == "length" and chunks[-1].stats["rounds"] == len(chunks)
        assert all(c.finish_reason is None for c in chunks[:-1])
    assert open_sessions(setup) == [0, 0] and coord.active_sessions() == 0


def test_non_streaming_request_is_one_chunk(setup):
    request = SessionRequest(PROMPT, SamplingParams(temperature=0.0, ignore_eos=True), 20, stream=False)
    chunks = asyncio.run(collect(coordinator(setup), request))
    assert len(chunks) == 1 and len(chunks[0].tokens) == 20 and chunks[0].stats["rounds"] > 1


def test_a_stream_interval_sends_the_rounds_within_it_as_one_chunk(setup):
    """Over real gRPC workers: an interval longer than the session sends its first round (the first token's
    latency is kept), then everything else with the finish; the tokens and statistics are the per-round stream's."""
    request = SessionRequest(PROMPT, SamplingParams(temperature=1.0, seed=8, ignore_eos=True), 30)
    per_round = asyncio.run(collect(coordinator(setup), request))
    held = asyncio.run(collect(coordinator(setup, stream_interval_s=60.0), replace(request, request_id="held")))
    assert len(per_round) > 2 and len(held) == 2
    assert len(held[0].rounds) == 1 and held[0].tokens == per_round[0].tokens and held[1].finish_reason == "length"
    assert [t for c in held for t in c.tokens] == [t for c in per_round for t in c.tokens]
    assert held[1].stats["rounds"] == per_round[-1].stats["rounds"] == len(held[0].rounds + held[1].rounds)


def test_one_request_id_on_two_coordinators_keeps_two_sessions_on_the_workers(setup):
    """Two coordinators (two ingress replicas) share the workers and get the same request id at once: each
    session holds a worker session of its own, so each decodes what it would alone (one id for both: the
    second Prefill replaces the first's session, whose next call reads the other's tokens or is refused)."""
    params = [SamplingParams(temperature=1.0, seed=s, ignore_eos=True) for s in (4, 5)]
    requests = [SessionRequest(PROMPT, p, 30, request_id="same") for p in params]

    async def both():
        return await asyncio.gather(*(collect(coordinator(setup), r) for r in requests))

    for p, chunks in zip(params, asyncio.run(both())):
        assert [t for c in chunks for t in c.tokens] == setup["local"].generate(PROMPT, p, 30).token_ids
    assert open_sessions(setup) == [0, 0]


def test_open_streams_stretch_each_streams_interval(setup):
    """Over real gRPC workers: with three streams open and a rate of 12 chunks a second for all of them, each
    stream's interval is 250 ms (3 / 12, the cap; one stream alone: 83 ms), so its rounds (milliseconds apart) go
    several to a chunk; the same tokens as with the rate off; the count of open streams is back at 0
    afterwards, a non-streamed request never counted."""
    requests = [SessionRequest(PROMPT, SamplingParams(temperature=1.0, seed=s, ignore_eos=True), 30, request_id=f"s{s}")
                for s in (1, 2, 3)]
    seen: list[float] = []

    async def three(coord):
        async def watch():
            while coord._streams < 3:
                await asyncio.sleep(0)
            seen.append(coord.stream_interval())
        watcher = asyncio.ensure_future(watch())
        chunks = await asyncio.gather(*(collect(coord, r) for r in requests))
        watcher.cancel()
        return chunks

    stretched_coord = coordinator(setup, stream_interval_s=0.001, stream_chunks_per_s=12.0)
    stretched = asyncio.run(three(stretched_coord))
    per_round = asyncio.run(three(coordinator(setup, stream_interval_s=0.001, stream_chunks_per_s=0.0)))
    assert seen == [0.25, 0.001]
    assert stretched_coord._streams == 0 and stretched_coord.stream_interval() == 0.001
    for held, each in zip(stretched, per_round):
        assert [t for c in held for t in c.tokens] == [t for c in each for t in c.tokens]
        assert len(held) < sum(len(c.rounds) for c in held) == sum(len(c.rounds) for c in each)
    asyncio.run(collect(stretched_coord, SessionRequest(PROMPT, SamplingParams(temperature=0.0), 5, stream=False)))
    assert stretched_coord._streams == 0


@pytest.mark.parametrize("base,streams,rate,interval", [
    (0.04, 16, 100.0, 0.16),  # 16 streams at 100 chunks a second: each every 160 ms
    (0.04, 4, 100.0, 0.04),  # few streams: the base
    (0.04, 64, 100.0, 0.25),  # many: at most 250 ms
    (0.5, 64, 100.0, 0.5),  # never below the base
    (0.04, 64, 0.0, 0.04),  # rate 0: the base whatever the load
    (0.0, 64, 100.0, 0.0),  # base 0: a chunk per round whatever the load
])
def test_stream_interval_under_load(base, streams, rate, interval):
    from specserve.engine.pacing import stream_interval

    assert stream_interval(base, streams, rate) == pytest.approx(interval)


class _Clocked:
    """A driver whose rounds come at set times of a fake clock (the hold rule, not the gRPC path)."""

    def __init__(self, clock, arrivals):
        self.clock, self.arrivals = clock, arrivals

    def rounds(self, request, stats, interval):
        for i, t in enumerate(self.arrivals):
            self.clock[0] = t
            yield [Round([i], "length" if i == len(self.arrivals) - 1 else None, 0)]


@pytest.mark.parametrize("arrivals,interval,chunks", [
    # rounds every 10 ms, 35 ms: a round waits while the next is due within 35 ms of the last chunk
    ([0, 10, 20, 30, 40, 50, 60, 70, 80, 90], 35, [[0], [1, 2, 3], [4, 5, 6], [7, 8, 9]]),
    ([0, 10, 20, 30], 0, [[0], [1], [2], [3]]),  # 0: a chunk per round
    # a round that comes late holds the ones before it (the rule expects the last gap again), then goes at once
    ([0, 10, 20, 200, 210, 220, 400], 35, [[0], [1, 2, 3], [4, 5, 6]]),
])
def test_stream_interval_hold_rule(monkeypatch, arrivals, interval, chunks):
    from specserve.coordinator import core
    from specserve.coordinator.metrics import SessionMetrics
    from specserve.engine import pacing

    clock = [0.0]
    monkeypatch.setattr(pacing.time, "perf_counter", lambda: clock[0] / 1000)
    emitted = []
    request = SessionRequest([1], SamplingParams(temperature=0.0), len(arrivals))
    session = core._Session(request, _Clocked(clock, arrivals), SessionMetrics(None, 1), emitted.append,
                            None, interval / 1000)
    session.drive()
    assert emitted[-1] is None
    assert [c.tokens for c in emitted[:-1]] == chunks


def test_the_hold_rule_asks_for_the_interval_at_every_round(monkeypatch):
    """A session given the interval as a function (the replica's, stretched by its load) holds by its value
    now: 35 ms at first, 100 ms from the fifth round on (fake clock, rounds every 10 ms)."""
    from specserve.coordinator import core
    from specserve.coordinator.metrics import SessionMetrics
    from specserve.engine import pacing

    clock = [0.0]
    monkeypatch.setattr(pacing.time, "perf_counter", lambda: clock[0] / 1000)
    arrivals = list(range(0, 200, 10))
    emitted = []
    session = core._Session(SessionRequest([1], SamplingParams(temperature=0.0), len(arrivals)),
                            _Clocked(clock, arrivals), SessionMetrics(None, 1), emitted.append, None,
                            lambda: 0.035 if clock[0] < 40 else 0.1)
    session.drive()
    assert [c.tokens for c in emitted[:-1]] == [[0], [1, 2, 3], list(range(4, 13)), list(range(13, 20))]


def test_cancel_and_overload(setup):
    coord = coordinator(setup, max_sessions=1, max_queued=0)

    async def scenario():
        first = SessionRequest(PROMPT, SamplingParams(temperature=1.0, seed=4, ignore_eos=True), 400)
        stream = coord.generate(first)
        await stream.__anext__()
        assert open_sessions(setup) == [1, 1]
        with pytest.raises(Overloaded, match="max_sessions=1.*max_queued=0"):
            await collect(coord, SessionRequest(PROMPT, SamplingParams(seed=5), 5))
        assert coord.cancel(first.request_id) and not coord.cancel("no-such-request")
        rest = [chunk async for chunk in stream]
        return rest

    rest = asyncio.run(scenario())
    assert len(rest) <= 2  # at most the round in flight and the one after, then it stops
    assert open_sessions(setup) == [0, 0] and coord.active_sessions() == 0


def test_requests_over_max_sessions_wait_their_turn(setup):
    """max_sessions=2, max_queued=3: five requests at once all finish, each as it would alone (seeded), the last
    three after waiting, in arrival order; a sixth is refused at once; a waiting one cancelled leaves the queue;
    one that waits too long is refused; nothing is left running or waiting afterwards."""
    coord = coordinator(setup, max_sessions=2, max_queued=3)
    params = [SamplingParams(temperature=1.0, seed=10 + i, ignore_eos=True) for i in range(6)]
    requests = [SessionRequest(PROMPT, p, 12) for p in params]

    async def burst():
        started: list[int] = []

        async def run(i):
            chunks = []
            async for chunk in coord.generate(requests[i]):
                if not chunks:
                    started.append(i)
                chunks.append(chunk)
            return chunks

        tasks = [asyncio.ensure_future(run(i)) for i in range(5)]
        while coord.queued() < 3:
            await asyncio.sleep(0.001)
        assert coord.active_sessions() == 2 and coord.describe()["queued"] == 3
        with pytest.raises(Overloaded, match="max_queued=3"):
            await collect(coord, requests[5])
        return await asyncio.gather(*tasks), started

    results, started = asyncio.run(burst())
    # first come, first served: 2 and 3 are let in as 0 and 1 finish (often together, so their first chunks
    # race: [3, 2, 4] was seen under load), 4 only after one of them
    assert sorted(started[:2]) == [0, 1] and sorted(started[2:4]) == [2, 3] and started[4] == 4
    for p, chunks in zip(params, results):
        assert [t for c in chunks for t in c.tokens] == setup["local"].generate(PROMPT, p, 12).token_ids
    waits = [chunks[-1].stats["queue_time_s"] for chunks in results]
    assert waits[0] == waits[1] == 0.0 and all(w > 0 for w in waits[2:])
    assert coord.refused == 1 and coord.queued() == 0 and coord.active_sessions() == 0 and coord._taken == 0

    slow = coordinator(setup, max_sessions=1, max_queued=4, queue_timeout_s=0.2)

    async def timeout_and_cancel():
        hog = slow.generate(SessionRequest(PROMPT, SamplingParams(seed=1, ignore_eos=True), 400))
        await hog.__anext__()
        with pytest.raises(Overloaded, match="queue_timeout_s"):
            await collect(slow, SessionRequest(PROMPT, SamplingParams(seed=2), 5))
        assert not slow._waiting  # a request that gave up holds no place in the queue
        slow.queue_timeout_s = 300.0
        waiting = SessionRequest(PROMPT, SamplingParams(seed=3), 5)
        task = asyncio.ensure_future(collect(slow, waiting))
        while slow.queued() < 1:
            await asyncio.sleep(0.001)
        assert slow.cancel(waiting.request_id)
        assert await task == [] and slow.queued() == 0 and not slow._waiting  # left the queue without running
        assert slow.cancel(hog_id := next(iter(slow._sessions)))
        rest = [chunk async for chunk in hog]
        return hog_id, rest

    asyncio.run(timeout_and_cancel())
    assert slow.refused == 1 and slow.queued() == 0 and slow.active_sessions() == 0 and slow._taken == 0
    assert open_sessions(setup) == [0, 0]


def test_worker_errors_reach_the_caller(setup):
    coord = coordinator(setup)
    bad = SessionRequest([VOCAB + 5], SamplingParams(seed=1), 5)  # the worker rejects the token id
    with pytest.raises(grpc.RpcError) as info:
        asyncio.run(collect(coord, bad))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt_ids" in info.value.details()
    assert open_sessions(setup) == [0, 0]
