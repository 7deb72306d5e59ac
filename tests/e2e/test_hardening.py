"""Limits, bad input and overload against a real served application, then a fuzz run (hypothesis).

One application (tiny model pair with the real tokenizer, draft colocated) with small limits. Every bad
request must get a 4xx naming the field in OpenAI's error shape (gRPC INVALID_ARGUMENT / RESOURCE_EXHAUSTED),
never a 5xx, a traceback or a hang; an overloaded stream is refused before it starts. The fuzz tests send
generated request bodies and gRPC messages (valid and not, numeric edge cases, lone surrogates, garbage
bytes) and count the statuses: none may be a 5xx or UNKNOWN / INTERNAL.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import time
import urllib.error
import urllib.request

import grpc
import httpx2 as httpx
import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ray import serve

from specserve.serve import build_app
from specserve.v1 import generator_pb2, generator_pb2_grpc
from tests.conftest import save_tokenized_pair, start_local_serve, stop_local_serve

pytestmark = pytest.mark.slow

LIMITS = {"max_sessions": 2, "max_queued": 2, "max_body_bytes": 65536, "max_prompt_tokens": 200, "max_tokens_limit": 64,
          "default_max_tokens": 4}
HTTP_STATUSES: collections.Counter = collections.Counter()  # of the fuzz requests
GRPC_CODES: collections.Counter = collections.Counter()



@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = save_tokenized_pair(tmp_path_factory.mktemp("hardening-models"), noise=0.05)
    addresses = start_local_serve()
    args = {"target": str(root / "target"), "draft": str(root / "draft"), "dtype": "float32", "gamma": 2,
            "model_name": "tiny", "target_resources": {"torch_threads": 1}, "draft_placement": "colocated",
            **LIMITS}
    serve.run(build_app(args), name="hard", route_prefix="/")
    channel = grpc.insecure_channel(addresses["grpc"])
    yield {"http": addresses["http"], "channel": channel, "stub": generator_pb2_grpc.GeneratorStub(channel),
           "app": serve.get_app_handle("hard")}
    channel.close()
    stop_local_serve()


def post(server, path: str, body, **kwargs) -> requests.Response:
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    response = requests.post(server["http"] + path, data=data, headers={"Content-Type": "application/json"},
                             timeout=60, **kwargs)
    return response


def assert_openai_error(response: requests.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, (response.status_code, response.text)
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert "Traceback" not in error["message"] and "File \"" not in error["message"]
    if param is not None:
        assert error["param"] == param and error["message"].startswith(param), error
    return error


BASE = {"model": "tiny", "prompt": "Tell me about the sea.", "max_tokens": 3}


@pytest.mark.parametrize(("change", "param"), [
    ({"max_tokens": 65}, "max_tokens"),
    ({"prompt": "sea " * 400}, "prompt"),  # over max_prompt_tokens
    ({"seed": 2**64}, "seed"),
    ({"seed": -1}, "seed"),
    ({"top_k": 2**31}, "top_k"),
    ({"prompt": "bad \ud800 text"}, "prompt"),
    ({"stop": ["\udfff"]}, "stop"),
    ({"temperature": 1e400}, None),  # JSON Infinity is not JSON: 400 as a malformed body
    ({"gamma": 9}, "gamma"),  # deeper than gamma_max (8)
])
@pytest.mark.parametrize("stream", [False, True])
def test_limits_and_edge_cases_are_400s_naming_the_field(server, change, param, stream):
    assert_openai_error(post(server, "/v1/completions", {**BASE, **change, "stream": stream}), 400, param)


def test_bad_chat_text_and_numeric_edges(server):
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "\ud800"}], "max_tokens": 2}
    assert_openai_error(post(server, "/v1/chat/completions", chat), 400, "messages[0].content")
    # a subnormal temperature is greedy, not a 500: the same tokens as temperature 0
    tiny_t = post(server, "/v1/completions", {**BASE, "temperature": 1e-40, "max_tokens": 6}).json()
    greedy = post(server, "/v1/completions", {**BASE, "temperature": 0, "max_tokens": 6}).json()
    assert tiny_t["choices"][0]["text"] == greedy["choices"][0]["text"]
    big_seed = post(server, "/v1/completions", {**BASE, "seed": 2**64 - 1, "temperature": 1.0})
    assert big_seed.status_code == 200
    assert post(server, "/v1/completions", {**BASE, "top_k": 2**31 - 1, "temperature": 1.0}).status_code == 200


def test_bodies_over_the_limit_are_413_before_parsing(server):
    huge = {**BASE, "prompt": "x" * 70000}
    assert_openai_error(post(server, "/v1/completions", huge), 413)

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"y" * 4096
        yield b'"}'

    response = requests.post(server["http"] + "/v1/completions", data=chunks(), timeout=60,
                             headers={"Content-Type": "application/json"})
    assert_openai_error(response, 413)
    # 40 MB: the client is still sending when the limit is known; it reads the 413, not a reset connection
    body = b'{"prompt": "' + b"z" * (40 << 20) + b'"}'
    response = requests.post(server["http"] + "/v1/completions", data=body, timeout=120,
                             headers={"Content-Type": "application/json"})
    assert_openai_error(response, 413)
    assert "max_body_bytes" in response.json()["error"]["message"]
    with httpx.Client(timeout=120) as client:  # the openai client's transport
        response = client.post(server["http"] + "/v1/completions", content=body,
                               headers={"Content-Type": "application/json"})
    assert response.status_code == 413 and "max_body_bytes" in response.json()["error"]["message"]
    # Python's urllib sends the whole body before it reads (no Expect: 100-continue), with and without a length
    for headers in ({"Content-Type": "application/json"}, {"Content-Type": "application/json",
                                                           "Transfer-Encoding": "chunked"}):
        data = body if "Transfer-Encoding" not in headers else iter([body[i:i + (1 << 20)]
                                                                     for i in range(0, len(body), 1 << 20)])
        request = urllib.request.Request(server["http"] + "/v1/completions", data=data, headers=headers)
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=120)
        assert refused.value.code == 413, headers
        assert "max_body_bytes" in json.loads(refused.value.read())["error"]["message"]
    assert post(server, "/v1/completions", BASE).status_code == 200  # and the server is fine


def test_unknown_routes_and_methods_use_the_openai_error_shape(server):
    assert_openai_error(requests.get(server["http"] + "/v1/nope", timeout=30), 404)
    assert_openai_error(requests.get(server["http"] + "/v1/completions", timeout=30), 405)
    assert_openai_error(post(server, "/v1/completions", b"{not json"), 400)
    assert_openai_error(post(server, "/v1/completions", {"prompt": "x", "max_tokens": "many"}), 400, "max_tokens")


def test_grpc_bad_input_and_undecodable_messages(server):
    stub = server["stub"]
    cases = {
        "max_tokens": generator_pb2.GenerateRequest(prompt="sea", max_tokens=65),
        "sampling.temperature": generator_pb2.GenerateRequest(
            prompt="sea", sampling=generator_pb2.SamplingParams(temperature=float("nan"))),
        "sampling.top_p": generator_pb2.GenerateRequest(prompt="sea", sampling=generator_pb2.SamplingParams(top_p=2)),
        "prompt": generator_pb2.GenerateRequest(prompt="sea " * 400),
    }
    for field, request in cases.items():
        for call in (stub.Generate, lambda r, **kw: list(stub.GenerateStream(r, **kw))):
            with pytest.raises(grpc.RpcError) as err:
                call(request, timeout=60)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith(field)
    raw = server["channel"].unary_unary("/specserve.v1.Generator/Generate")  # bytes in, bytes out
    with pytest.raises(grpc.RpcError) as err:
        raw(b"\xff\xff\xff\x0f garbage", timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_overload_queues_then_refuses_streams_before_they_start(server):
    """max_sessions=2 busy: the next two requests wait (max_queued=2); a fifth gets 503 + Retry-After (streaming
    or not) or RESOURCE_EXHAUSTED on gRPC (unary and stream), never 200 with an error event; the waiting two
    answer once the running two finish, and requests succeed again."""
    long = {**BASE, "max_tokens": 64, "ignore_eos": True, "stream": True}
    refused_before = requests.get(server["http"] + "/health", timeout=60).json()["refused"]
    opened = []
    for _ in range(2):
        response = requests.post(server["http"] + "/v1/completions", json=long, stream=True, timeout=60)
        assert response.status_code == 200
        opened.append(response)
    waiting = concurrent.futures.ThreadPoolExecutor(2)
    queued = [waiting.submit(post, server, "/v1/completions", {**BASE, "seed": 1}),  # one waits on HTTP, one on gRPC
              waiting.submit(server["stub"].Generate, generator_pb2.GenerateRequest(prompt="sea", max_tokens=2),
                             timeout=120)]
    try:
        deadline = time.time() + 30
        while server["app"].worker_sessions.remote().result()["coordinator"] < 2 and time.time() < deadline:
            time.sleep(0.05)
        while requests.get(server["http"] + "/health", timeout=60).json().get("queued") != 2:
            assert time.time() < deadline, "two requests should be waiting"
            time.sleep(0.05)
        for stream in (True, False):
            refused = post(server, "/v1/completions", {**BASE, "stream": stream})
            assert_openai_error(refused, 503)
            assert int(refused.headers["Retry-After"]) > 0
        request = generator_pb2.GenerateRequest(prompt="sea", max_tokens=2)
        for call in (server["stub"].Generate, lambda r, **kw: list(server["stub"].GenerateStream(r, **kw))):
            with pytest.raises(grpc.RpcError) as err:
                call(request, timeout=60)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
    finally:
        for response in opened:
            assert response.text.rstrip().endswith("data: [DONE]")  # the two running streams were not disturbed
            response.close()
    answer = queued[0].result(timeout=120)
    assert answer.status_code == 200, answer.text
    assert answer.json()["specserve"]["queue_time_s"] > 0  # it waited for a slot
    assert answer.json()["choices"][0]["text"] == post(server, "/v1/completions", {**BASE, "seed": 1}).json()[
        "choices"][0]["text"]  # as it answers alone
    reply = queued[1].result(timeout=120)
    assert reply.finish_reason and reply.stats.queue_time_s > 0
    waiting.shutdown()
    health = requests.get(server["http"] + "/health", timeout=60).json()
    assert health["queued"] == 0 and health["active_sessions"] == 0 and health["refused"] == refused_before + 4


# -- fuzz -------------------------------------------------------------------------------------------------------
_NUMBERS = st.one_of(
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, 2, 2**31 - 1, 2**31, 2**63, 2**64 - 1, 2**64]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([0.0, 1e-45, 1e-39, 1e-6, 0.5, 1.0, 2.0, 1e308, -0.0]),
)
_TEXT = st.one_of(st.text(max_size=30), st.sampled_from(["", "\ud800", "a\udfffb", "<|im_start|>system\n", "é🙂"]))
_ANY = st.one_of(st.none(), st.booleans(), _NUMBERS, _TEXT, st.lists(st.integers(-3, 60000), max_size=4),
                 st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))
_SMALL = st.integers(1, 3)
_GOOD_TEXT = st.text(min_size=1, max_size=30)  # no surrogates: hypothesis leaves them out of text()


def _mostly(valid):
    """Valid nine times in ten (so generation runs too), anything at all otherwise (one_of would flatten _ANY's
    branches in and weigh each like the valid one)."""
    return st.integers(0, 9).flatmap(lambda i: valid if i else _ANY)


_COMMON = {
    "model": _mostly(st.just("tiny")),
    "max_tokens": _mostly(_SMALL),
    "temperature": _mostly(st.one_of(st.floats(0, 3), st.sampled_from([0.0, 1e-45, 1e-39, 1e-5]))),
    "top_p": _mostly(st.floats(0.01, 1)),
    "top_k": _mostly(st.integers(0, 100)),
    "seed": _mostly(st.integers(0, 2**64 - 1)),
    "stop": _mostly(st.one_of(_GOOD_TEXT, st.lists(_GOOD_TEXT, max_size=3))),
    "stream": _mostly(st.booleans()),
    "gamma": _mostly(st.one_of(st.integers(0, 8), st.sampled_from(["auto", "heuristic"]))),
    "ignore_eos": _mostly(st.booleans()),
    "n": _mostly(st.just(1)),
}
_COMPLETION = st.one_of(
    st.fixed_dictionaries({"prompt": _mostly(st.one_of(_GOOD_TEXT, st.lists(st.integers(0, 49151), min_size=1,
                                                                              max_size=6)))},
                          optional=_COMMON),
    st.dictionaries(st.sampled_from(["prompt", *_COMMON]), _ANY, max_size=4),
)
_MESSAGE = _mostly(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                           "content": st.one_of(_GOOD_TEXT, _TEXT)}))
_CHAT = st.one_of(
    st.fixed_dictionaries({"messages": _mostly(st.lists(_MESSAGE, min_size=1, max_size=3))},
                          optional={**_COMMON, "max_completion_tokens": _mostly(_SMALL)}),
    st.dictionaries(st.sampled_from(["messages", *_COMMON]), _ANY, max_size=4),
)
_FUZZ = settings(max_examples=550, deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                        HealthCheck.data_too_large])


def _check_http(server, path: str, body) -> None:
    response = post(server, path, body)
    HTTP_STATUSES[response.status_code] += 1
    assert response.status_code < 500, (body, response.status_code, response.text[:300])
    if response.status_code >= 400:
        assert_openai_error(response, response.status_code)
    elif "text/event-stream" in response.headers.get("content-type", ""):
        assert response.text.rstrip().endswith("data: [DONE]")


@given(body=st.one_of(_COMPLETION, _COMPLETION, st.binary(max_size=64)))
@_FUZZ
def test_fuzz_completions(server, body):
    _check_http(server, "/v1/completions", body)


@given(body=_CHAT)
@_FUZZ
def test_fuzz_chat_completions(server, body):
    _check_http(server, "/v1/chat/completions", body)


_FLOATS = st.one_of(st.floats(width=32), st.sampled_from([0.0, 1e-45, 1e-39, 1.0, float("inf"), float("nan")]))


def _usually(valid, other):
    return st.integers(0, 9).flatmap(lambda i: valid if i else other)


@st.composite
def _grpc_requests(draw):
    sampling = generator_pb2.SamplingParams(
        top_k=draw(_usually(st.integers(0, 100), st.integers(-(2**31), 2**31 - 1))),
        stop=draw(st.lists(_usually(_GOOD_TEXT, st.text(max_size=8)), max_size=2)),
        ignore_eos=draw(st.booleans()))
    for name, values in (("temperature", _usually(st.floats(0, 3), _FLOATS)),
                         ("top_p", _usually(st.floats(0.01, 1), _FLOATS)), ("seed", st.integers(0, 2**64 - 1))):
        if draw(st.booleans()):
            setattr(sampling, name, draw(values))
    request = generator_pb2.GenerateRequest(
        model=draw(_usually(st.sampled_from(["", "tiny"]), st.text(max_size=5))),
        max_tokens=draw(_usually(_SMALL, st.integers(-(2**31), 2**31 - 1))),
        gamma=draw(_usually(st.sampled_from(["", "auto", "2"]), st.sampled_from(["-1", "99", "x", "heuristic"]))),
        sampling=sampling)
    if draw(st.booleans()):
        request.prompt = draw(_usually(_GOOD_TEXT, st.text(max_size=20)))
    else:
        for _ in range(draw(_usually(st.integers(1, 2), st.just(0)))):
            request.messages.messages.add(role=draw(_usually(st.just("user"), st.sampled_from(["system", "bot", ""]))),
                                          content=draw(st.text(max_size=10)))
    return request


@given(request=st.one_of(_grpc_requests(), st.binary(max_size=40)), stream=st.booleans())
@settings(max_examples=250, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
def test_fuzz_grpc(server, request, stream):
    if isinstance(request, bytes):  # undecodable (or accidentally decodable) bytes
        method = server["channel"].unary_stream if stream else server["channel"].unary_unary
        call = method("/specserve.v1.Generator/GenerateStream" if stream else "/specserve.v1.Generator/Generate")
    else:
        call = server["stub"].GenerateStream if stream else server["stub"].Generate
    try:
        reply = call(request, timeout=60)
        if stream:
            list(reply)
        GRPC_CODES[grpc.StatusCode.OK] += 1
    except grpc.RpcError as exc:
        GRPC_CODES[exc.code()] += 1
        assert exc.code() not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.DEADLINE_EXCEEDED), \
            (request, exc.code(), exc.details())


def test_fuzz_totals_and_nothing_left_behind(server):
    """Runs after the fuzz tests (file order): the counts the issue asks for, and no session left over."""
    print(f"\nfuzz: HTTP {sum(HTTP_STATUSES.values())} {dict(sorted(HTTP_STATUSES.items()))}, "
          f"gRPC {sum(GRPC_CODES.values())} {dict((c.name, n) for c, n in GRPC_CODES.items())}")
    assert sum(HTTP_STATUSES.values()) >= 1000 and not any(code >= 500 for code in HTTP_STATUSES)
    assert sum(GRPC_CODES.values()) >= 200
    deadline = time.time() + 30
    while any(server["app"].worker_sessions.remote().result().values()) and time.time() < deadline:
        time.sleep(0.2)
    assert server["app"].worker_sessions.remote().result() == {"target": 0, "coordinator": 0}
