"""The coordinator without Ray: real gRPC workers on localhost, sessions driven through its asyncio API."""

from __future__ import annotations

import asyncio
from concurrent import futures

import grpc
import pytest

from specserve import SamplingParams, SpeculativeDecoder
from specserve.coordinator import Coordinator, Overloaded, SessionRequest, SplitDriver
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


def coordinator(setup, max_sessions: int = 64, **kwargs) -> Coordinator:
    a = setup["addresses"]
    driver = SplitDriver(a["target"], VOCAB, [], draft="remote", draft_address=a["draft"], gamma=3, **kwargs)
    return Coordinator(driver, max_sessions=max_sessions)


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


def test_cancel_and_overload(setup):
    coord = coordinator(setup, max_sessions=1)

    async def scenario():
        first = SessionRequest(PROMPT, SamplingParams(temperature=1.0, seed=4, ignore_eos=True), 400)
        stream = coord.generate(first)
        await stream.__anext__()
        assert open_sessions(setup) == [1, 1]
        with pytest.raises(Overloaded, match="max_sessions=1"):
            await collect(coord, SessionRequest(PROMPT, SamplingParams(seed=5), 5))
        assert coord.cancel(first.request_id) and not coord.cancel("no-such-request")
        rest = [chunk async for chunk in stream]
        return rest

    rest = asyncio.run(scenario())
    assert len(rest) <= 2  # at most the round in flight and the one after, then it stops
    assert open_sessions(setup) == [0, 0] and coord.active_sessions() == 0


def test_worker_errors_reach_the_caller(setup):
    coord = coordinator(setup)
    bad = SessionRequest([VOCAB + 5], SamplingParams(seed=1), 5)  # the worker rejects the token id
    with pytest.raises(grpc.RpcError) as info:
        asyncio.run(collect(coord, bad))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt_ids" in info.value.details()
    assert open_sessions(setup) == [0, 0]
