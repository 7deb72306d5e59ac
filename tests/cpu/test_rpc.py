"""The internal gRPC data plane: real servers and stubs on localhost, tiny random models.

Served generation runs the same loop as in-process generation, so for a seed
and a fixed γ the tokens must be identical — with q crossing the wire sparse.
"""

from __future__ import annotations

import filecmp
import pathlib
from concurrent import futures

import grpc
import pytest

from specserve import SamplingParams, SpeculativeDecoder
from specserve.engine.proposers import ModelProposer, NgramProposer
from specserve.rpc import codegen
from specserve.rpc.convert import sampling_to_proto
from tests.remote import remote_generate
from specserve.rpc.servicers import DraftWorkerServicer, TargetWorkerServicer
from specserve.speculation import make_controller
from specserve.v1 import workers_pb2, workers_pb2_grpc
from tests.conftest import perturbed_copy, tiny_llama

VOCAB = 64
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
TOP_K_Q = 4  # the served model draft ships its top-4 q


@pytest.fixture(scope="module")
def models():
    target = tiny_llama(0, vocab=VOCAB, layers=2, hidden=32, scale=8)
    return target, perturbed_copy(target, 0.3)


def _serve(servicer, add):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    add(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, grpc.insecure_channel(f"127.0.0.1:{port}")


@pytest.fixture(scope="module")
def workers(models):
    target, draft = models
    servicers = {
        "target": TargetWorkerServicer(target, VOCAB),
        "model": DraftWorkerServicer(lambda: ModelProposer(draft, VOCAB, TOP_K_Q), VOCAB),
        "ngram": DraftWorkerServicer(lambda: NgramProposer(VOCAB), VOCAB),
    }
    adders = {
        "target": workers_pb2_grpc.add_TargetWorkerServicer_to_server,
        "model": workers_pb2_grpc.add_DraftWorkerServicer_to_server,
        "ngram": workers_pb2_grpc.add_DraftWorkerServicer_to_server,
    }
    started = {name: _serve(s, adders[name]) for name, s in servicers.items()}
    stubs = {
        "target": workers_pb2_grpc.TargetWorkerStub(started["target"][1]),
        "model": workers_pb2_grpc.DraftWorkerStub(started["model"][1]),
        "ngram": workers_pb2_grpc.DraftWorkerStub(started["ngram"][1]),
    }
    yield servicers, stubs
    for server, channel in started.values():
        channel.close()
        server.stop(grace=1).wait()
    for servicer in servicers.values():
        servicer.close()


MODES = {
    "greedy": dict(temperature=0.0),
    "T=1": dict(temperature=1.0, seed=11),
    "T=0.8 top-k": dict(temperature=0.8, top_k=10, seed=12),
    "T=1.2 top-p": dict(temperature=1.2, top_p=0.9, seed=13),
}


@pytest.mark.parametrize("draft", ["model + lookup", "model", "ngram"])
@pytest.mark.parametrize("mode", list(MODES))
def test_served_tokens_equal_in_process(models, workers, draft, mode):
    """Prompt lookup in front of a remote model draft runs in the client, as it does in process; this prompt
    ends with a 2-gram seen before, so the first block is the lookup's."""
    target, draft_model = models
    servicers, stubs = workers
    params = SamplingParams(**MODES[mode], ignore_eos=True)
    lookup, kind = draft == "model + lookup", draft.split()[0]
    prompt = PROMPT + [2, 6, 8, 3, 1, 4] if lookup else PROMPT
    local = SpeculativeDecoder(target, draft_model if kind == "model" else "ngram", gamma=3, draft_top_k=TOP_K_Q,
                               draft_lookup=lookup)
    expected = local.generate(prompt, params, 40)
    tokens, finish, stats = remote_generate(
        stubs[kind], stubs["target"], prompt, params, 40, make_controller(3), VOCAB, set(),
        draft_is_free=kind == "ngram", draft_lookup=lookup,
    )
    assert tokens == expected.token_ids and finish == "length"
    assert stats.accepted == expected.stats.accepted and stats.rounds == expected.stats.rounds
    assert stats.lookup_rounds == expected.stats.lookup_rounds and (stats.lookup_rounds > 0) == lookup
    if kind == "model":
        assert 0 < stats.acceptance_rate < 1
    if mode == "greedy":
        assert tokens == SpeculativeDecoder(target, None, gamma=0).generate(prompt, params, 40).token_ids
    assert len(servicers[kind].sessions) == 0 and len(servicers["target"].sessions) == 0


def test_q_crosses_the_wire_sparse(workers):
    _, stubs = workers
    sampling = sampling_to_proto(SamplingParams(temperature=1.0, seed=5))
    stubs["model"].Prefill(workers_pb2.PrefillRequest(session_id="s", prompt_ids=PROMPT, sampling=sampling))
    update = workers_pb2.SessionUpdate(session_id="s", base_length=len(PROMPT))
    reply = stubs["model"].Propose(workers_pb2.ProposeRequest(update=update, gamma=3))
    assert len(reply.tokens) == 3 and [len(d.ids) for d in reply.q] == [TOP_K_Q] * 3
    assert all(t in d.ids for t, d in zip(reply.tokens, reply.q))
    assert all(abs(sum(d.probs) - 1) < 1e-5 for d in reply.q)
    assert stubs["model"].Release(workers_pb2.ReleaseRequest(session_id="s")).released


def test_one_hot_q_is_built_only_where_needed():
    """A greedy draft's or a lookup's q is one-hot: it crosses the wire as one id per token and is not built as
    [k, vocab] rows unless asked for; any other q arrives dense, as sent."""
    import torch

    from specserve.engine.proposers import Proposal, one_hot
    from specserve.rpc.convert import proposal_from_wire, proposal_q_to_wire

    lazy = Proposal([4, 9, 2], 16, key="ngram-3")
    wire = proposal_q_to_wire(lazy)
    assert [(list(d.ids), list(d.probs)) for d in wire] == [([4], [1.0]), ([9], [1.0]), ([2], [1.0])]
    back = proposal_from_wire([4, 9, 2], wire, 16, "ngram-3")
    assert back.one_hot and back.truncate(2).one_hot and back.truncate(2).tokens == [4, 9]
    assert torch.equal(back.q, one_hot([4, 9, 2], 16)) and back.q is back.q  # built once, on first use
    dense = torch.full((2, 16), 1 / 16)
    other = proposal_from_wire([4, 9], proposal_q_to_wire(Proposal([4, 9], dense)), 16)
    assert not other.one_hot and torch.equal(other.q, dense)
    # one-hot on another token than the one proposed is not a one-hot proposal: it is kept as sent
    odd = proposal_from_wire([4], proposal_q_to_wire(Proposal([4], one_hot([5], 16))), 16)
    assert not odd.one_hot and torch.equal(odd.q, one_hot([5], 16))


def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def test_errors_name_the_field(workers):
    _, stubs = workers
    target = stubs["target"]
    good = sampling_to_proto(SamplingParams(temperature=1.0, seed=1))
    unknown = workers_pb2.VerifyRequest(update=workers_pb2.SessionUpdate(session_id="nope"))
    assert _code(lambda: target.Verify(unknown))[0] == grpc.StatusCode.NOT_FOUND
    no_seed = sampling_to_proto(SamplingParams(temperature=1.0))
    cases = [
        (workers_pb2.PrefillRequest(session_id="a", prompt_ids=PROMPT, sampling=no_seed), "sampling.seed"),
        (workers_pb2.PrefillRequest(session_id="a", prompt_ids=[], sampling=good), "prompt_ids"),
        (workers_pb2.PrefillRequest(session_id="a", prompt_ids=[VOCAB], sampling=good), "prompt_ids"),
        (workers_pb2.PrefillRequest(session_id="", prompt_ids=PROMPT, sampling=good), "session_id"),
    ]
    bad_top_p = sampling_to_proto(SamplingParams(temperature=1.0, seed=1))
    bad_top_p.top_p = 1.5
    cases.append((workers_pb2.PrefillRequest(session_id="a", prompt_ids=PROMPT, sampling=bad_top_p), "sampling.top_p"))
    for request, field in cases:
        code, details = _code(lambda: target.Prefill(request))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and field in details
    target.Prefill(workers_pb2.PrefillRequest(session_id="b", prompt_ids=PROMPT, sampling=good))
    too_far = workers_pb2.SessionUpdate(session_id="b", base_length=len(PROMPT) + 1)
    code, details = _code(lambda: target.Verify(workers_pb2.VerifyRequest(update=too_far)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "update.base_length" in details
    ok = workers_pb2.SessionUpdate(session_id="b", base_length=len(PROMPT))
    code, details = _code(lambda: target.Verify(workers_pb2.VerifyRequest(update=ok, tokens=[1, 2])))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "q" in details
    # The failed calls left the session usable.
    reply = target.Verify(workers_pb2.VerifyRequest(update=ok))
    assert reply.n_accepted == 0 and 0 <= reply.next_token < VOCAB
    assert target.Release(workers_pb2.ReleaseRequest(session_id="b")).active_sessions == 0


def test_generated_code_matches_protos(tmp_path):
    generated = codegen.generate(tmp_path)
    assert generated, "codegen produced nothing"
    committed = pathlib.Path(codegen.OUTPUT_ROOT)
    for path in generated:
        relative = path.relative_to(tmp_path)
        assert filecmp.cmp(path, committed / relative, shallow=False), f"{relative} is stale: run python -m specserve.rpc.codegen"


@pytest.mark.parametrize("mode", ["greedy", "T=1", "T=1.2 top-p"])
def test_pipelined_tokens_equal_sequential(models, workers, mode, monkeypatch):
    """Prefetching the next block on the all-accepted branch changes timing, never tokens."""
    from specserve.rpc import remote

    target = models[0]
    close_draft = perturbed_copy(target, 0.05)  # accepts whole blocks often enough to exercise the hit path
    servicer = DraftWorkerServicer(lambda: ModelProposer(close_draft, VOCAB, TOP_K_Q), VOCAB)
    server, channel = _serve(servicer, workers_pb2_grpc.add_DraftWorkerServicer_to_server)
    draft_stub = workers_pb2_grpc.DraftWorkerStub(channel)
    target_stub = workers[1]["target"]
    params = SamplingParams(**MODES[mode], ignore_eos=True)
    proxies = []
    original = remote.RemoteProposer.__init__

    def record(self, *args, **kwargs):
        original(self, *args, **kwargs)
        proxies.append(self)

    monkeypatch.setattr(remote.RemoteProposer, "__init__", record)
    try:
        runs = {
            pipelined: remote_generate(
                draft_stub, target_stub, PROMPT, params, 60, make_controller(2), VOCAB, set(), pipelined=pipelined
            )
            for pipelined in (False, True)
        }
    finally:
        channel.close()
        server.stop(grace=1).wait()
        servicer.close()
    expected = SpeculativeDecoder(target, close_draft, gamma=2, draft_top_k=TOP_K_Q).generate(PROMPT, params, 60)
    assert runs[True][0] == runs[False][0] == expected.token_ids
    sequential, pipelined = proxies
    assert sequential.prefetch_hits == sequential.prefetch_misses == 0
    assert pipelined.prefetch_misses > 0
    if mode != "T=1.2 top-p":  # at high temperature the bonus guess rarely matches
        assert pipelined.prefetch_hits > 0  # the pre-drafted block was used
    assert len(servicer.sessions) == 0 and len(workers[0]["target"].sessions) == 0


def test_worker_token_is_required_when_set(models):
    """A worker started with a token answers only calls that carry it (unary and streaming alike)."""
    from specserve.rpc.auth import server_interceptors, worker_channel

    target, _ = models
    servicer = TargetWorkerServicer(target, VOCAB)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), interceptors=server_interceptors("s3cret"))
    workers_pb2_grpc.add_TargetWorkerServicer_to_server(servicer, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    try:
        prefill = workers_pb2.PrefillRequest(session_id="a", prompt_ids=PROMPT,
                                             sampling=sampling_to_proto(SamplingParams(temperature=0.0), 1))
        for channel in (grpc.insecure_channel(address), worker_channel(address, "wrong")):
            stub = workers_pb2_grpc.TargetWorkerStub(channel)
            with pytest.raises(grpc.RpcError) as err:
                stub.Prefill(prefill)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(workers_pb2.SessionRequest(session_id="b", prompt_ids=PROMPT, max_tokens=2)))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert len(servicer.sessions) == 0  # nothing ran
        stub = workers_pb2_grpc.TargetWorkerStub(worker_channel(address, "s3cret"))
        assert stub.Prefill(prefill).cached_tokens == len(PROMPT)
        assert stub.Prefill.future(prefill).result().cached_tokens == len(PROMPT)  # futures carry it too
        assert stub.Release(workers_pb2.ReleaseRequest(session_id="a")).released
    finally:
        server.stop(grace=1).wait()
        servicer.close()


def test_idle_sessions_are_reaped_and_streaming_ones_kept(models):
    """Sessions a dead coordinator left behind are released once idle; a colocated stream's session never is."""
    import time

    target, _ = models
    servicer = TargetWorkerServicer(target, VOCAB)
    try:
        sampling = sampling_to_proto(SamplingParams(temperature=0.0), 1)
        for sid in ("idle", "busy", "stream"):
            servicer.Prefill(workers_pb2.PrefillRequest(session_id=sid, prompt_ids=PROMPT, sampling=sampling), None)
        servicer.sessions.get("stream").streaming = True
        used = servicer.pool.describe()["kv_used_tokens"]
        time.sleep(0.3)
        servicer.sessions.get("busy")  # a call touches it
        assert servicer.on_compute_thread(servicer.sessions.reap, 0.2) == 1
        assert sorted(servicer.sessions._sessions) == ["busy", "stream"]
        assert servicer.pool.describe()["kv_used_tokens"] < used  # the idle one's KV block went back to the pool
    finally:
        servicer.close()


def test_a_round_crosses_the_wire_whole():
    """The worker sends a round as one RoundReply and the coordinator gets the same Round back: every field,
    floats to float32 precision."""
    from specserve.engine.loop import Round
    from specserve.rpc.convert import round_from_wire, round_to_wire

    rnd = Round([5, 6, 2], None, 3, [5, 6, 7], 2, True, 0.0125, 0.0375, 0.03, 0.5,
                [(5, -0.25, [(5, -0.25), (9, -2.0)]), (6, -0.5, []), (2, -1.0, [])])
    back = round_from_wire(round_to_wire(rnd))
    for name in ("tokens", "finish_reason", "gamma", "drafted", "accepted", "looked_up", "logprobs"):
        assert getattr(back, name) == getattr(rnd, name), name
    for name in ("draft_time_s", "verify_time_s", "step_time_s", "prefill_time_s"):
        assert getattr(back, name) == pytest.approx(getattr(rnd, name), rel=1e-6), name
    done = round_from_wire(round_to_wire(Round([2], "stop", 0)))
    assert done.finish_reason == "stop" and done.drafted == [] and done.logprobs is None


def test_serves_grpc_proxy_imports_the_wire_code_alone():
    """Serve's gRPC proxy imports the servicer registration a config names (`grpc_servicer_functions`); that
    module pulls in neither torch nor transformers (seconds of every start on a small machine)."""
    import subprocess
    import sys

    from specserve.serve import GRPC_SERVICER_FUNCTION

    module = GRPC_SERVICER_FUNCTION.rsplit(".", 1)[0]
    code = (f"import sys, {module}; heavy = sorted(m for m in ('torch', 'transformers', 'ray') if m in sys.modules); "
            "print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == ""
