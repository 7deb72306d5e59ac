"""The Serve application end to end: real local Ray, real HTTP (openai client, raw SSE with requests) and a real gRPC stub.

Three applications run side by side on the same tiny model pair (real tokenizer): the draft in its own
worker with pipelined drafting or sequential, and the draft colocated in the target worker. Served tokens must equal the in-process engine's for the same seed and
fixed γ, and greedy output must equal target-only greedy decoding.
"""

from __future__ import annotations

import json
import pathlib
import statistics
import time

import grpc
import openai
import pytest
import requests
from ray import serve

from specserve import SamplingParams, SpeculativeDecoder
from specserve.coordinator.metrics import METRICS, scrape, scrape_until, since, total
from specserve.serve import build_app
from specserve.serve.listen import free_port
from specserve.v1 import generator_pb2, generator_pb2_grpc
from specserve.workers.quiet import cmdline
from tests.conftest import save_tokenized_pair, start_local_serve, stop_local_serve

pytestmark = pytest.mark.slow

APPS = {"pipelined": "/", "sequential": "/sequential", "colocated": "/colocated"}
PROMPT = "Write a short poem about the sea."



@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = save_tokenized_pair(tmp_path_factory.mktemp("serve-models"), noise=0.05)
    metrics_port = free_port()
    # Prometheus endpoint of this node, exporting every second (Ray's default is 10 s)
    addresses = start_local_serve(_metrics_export_port=metrics_port,
                                  _system_config={"metrics_report_interval_ms": 1000})
    args = {"target": str(root / "target"), "draft": str(root / "draft"), "dtype": "float32", "gamma": 3,
            "model_name": "tiny", "target_resources": {"torch_threads": 1}, "draft_resources": {"torch_threads": 1},
            "draft_placement": "split"}
    for name, prefix in APPS.items():
        placement = {"draft_placement": "colocated"} if name == "colocated" else {}
        serve.run(build_app({**args, "pipelined": name == "pipelined", **placement}), name=name, route_prefix=prefix)
    yield {"root": root, **addresses, "metrics": f"http://127.0.0.1:{metrics_port}/metrics"}
    stop_local_serve()


@pytest.fixture(scope="module")
def local(server):
    root = server["root"]
    return {
        # as served: prompt lookup first, then the model draft
        "spec": SpeculativeDecoder(str(root / "target"), str(root / "draft"), gamma=3, dtype="float32", draft_top_k=64),
        "plain": SpeculativeDecoder(str(root / "target"), None, dtype="float32"),
        "uncached": SpeculativeDecoder(str(root / "target"), str(root / "draft"), gamma=3, dtype="float32",
                                       draft_top_k=64, prefix_caching=False),
    }


def client(server, app="pipelined") -> openai.OpenAI:
    return openai.OpenAI(base_url=server["http"] + APPS[app].rstrip("/") + "/v1", api_key="unused", max_retries=0)


def grpc_stub(server):
    return generator_pb2_grpc.GeneratorStub(grpc.insecure_channel(server["grpc"]))


def metadata(app="pipelined"):
    return (("application", app),)


def sessions(app="pipelined") -> dict[str, int]:
    return serve.get_app_handle(app).worker_sessions.remote().result()


def wait_for_no_sessions(app="pipelined", timeout=30.0) -> dict[str, int]:
    deadline = time.time() + timeout
    while True:
        counts = sessions(app)
        if not any(counts.values()) or time.time() > deadline:
            return counts
        time.sleep(0.2)


def test_models_and_health(server):
    assert [m.id for m in client(server).models.list().data] == ["tiny"]
    health = requests.get(server["http"] + "/health").json()
    assert health["status"] == "ok" and health["draft"] == "remote" and health["pipelined"] is True


@pytest.mark.parametrize("app", list(APPS))
def test_seeded_served_output_equals_in_process(server, local, app):
    """T=1 with a seed, fixed γ=3: HTTP (completions + chat), pipelined or not, equals the in-process engine."""
    c = client(server, app)
    params = dict(temperature=1.0, top_p=0.9, seed=11)
    expected = local["spec"].generate(PROMPT, SamplingParams(**params), 24)
    served = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, **params)
    assert served.choices[0].text == expected.text
    assert served.usage.completion_tokens == len(expected.token_ids)
    messages = [{"role": "user", "content": PROMPT}]
    expected = local["spec"].generate(messages, SamplingParams(**params), 24)
    chat = c.chat.completions.create(model="tiny", messages=messages, max_tokens=24, **params)
    assert chat.choices[0].message.content == expected.text
    streamed = c.chat.completions.create(model="tiny", messages=messages, max_tokens=24, stream=True, **params)
    chunks = list(streamed)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == expected.finish_reason
    stats = chunks[-1].model_extra["specserve"]
    assert stats["rounds"] >= 1 and stats["gamma_history"][0] == 3


def test_greedy_served_equals_target_only(server, local):
    expected = local["plain"].generate(PROMPT, SamplingParams(temperature=0.0), 32)
    served = client(server).completions.create(model="tiny", prompt=PROMPT, max_tokens=32, temperature=0)
    assert served.choices[0].text == expected.text
    stats = served.model_extra["specserve"]
    assert stats["accepted"] > 0  # the draft did work, and the output is still the target's
    stream = client(server).completions.create(model="tiny", prompt=PROMPT, max_tokens=32, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream) == expected.text


def test_grpc_unary_and_stream(server, local):
    stub = grpc_stub(server)
    sampling = generator_pb2.SamplingParams(temperature=0.0)
    request = generator_pb2.GenerateRequest(prompt=PROMPT, max_tokens=20, sampling=sampling, model="tiny")
    expected = local["plain"].generate(PROMPT, SamplingParams(temperature=0.0), 20)
    reply = stub.Generate(request, metadata=metadata())
    assert list(reply.token_ids) == expected.token_ids and reply.text == expected.text
    assert reply.finish_reason == expected.finish_reason and reply.stats.rounds >= 1
    assert reply.completion_tokens == len(expected.token_ids) and reply.prompt_tokens > 0
    parts = list(stub.GenerateStream(request, metadata=metadata("sequential")))
    assert [t for p in parts for t in p.token_ids] == expected.token_ids
    assert "".join(p.text for p in parts) == expected.text
    # the first round alone (the first token's latency), later rounds within stream_interval_ms (40) together
    assert parts[-1].finish_reason and 2 <= len(parts) <= parts[-1].stats.rounds
    chat = generator_pb2.GenerateRequest(
        messages=generator_pb2.ChatMessages(messages=[generator_pb2.ChatMessage(role="user", content=PROMPT)]),
        max_tokens=12, sampling=generator_pb2.SamplingParams(temperature=1.0, seed=5), gamma="3",
    )
    messages = [{"role": "user", "content": PROMPT}]
    expected = local["spec"].generate(messages, SamplingParams(temperature=1.0, seed=5), 12)
    assert list(stub.Generate(chat, metadata=metadata()).token_ids) == expected.token_ids


def test_raw_sse(server):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "stream": True}
    with requests.post(server["http"] + "/v1/completions", json=body, timeout=60, stream=True) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in response.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    payloads = [json.loads(e) for e in events[:-1]]
    assert all(p["object"] == "text_completion" and "usage" not in p for p in payloads)  # as OpenAI: no usage asked
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"
    assert 2 <= len(payloads) <= payloads[-1]["specserve"]["rounds"]  # rounds within stream_interval_ms: one event


LONG = "word " * 600  # the tiny target's context is 512 positions

BAD_HTTP = [
    ("prompt", dict(prompt="")),
    ("max_tokens", dict(max_tokens=-1)),
    ("temperature", dict(temperature=-0.5)),
    ("top_p", dict(top_p=0.0)),
    ("top_p", dict(top_p=1.5)),
    ("model", dict(model="gpt-4")),
    ("prompt", dict(prompt=LONG)),
    ("gamma", dict(gamma="sometimes")),
    ("gamma", dict(gamma=5000)),  # deeper than the server's gamma_max (8): verifies of thousands of positions
]


@pytest.mark.parametrize(("field", "change"), BAD_HTTP)
def test_bad_http_requests_name_the_field(server, field, change):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, **change}
    response = requests.post(server["http"] + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and field in error["message"]
    assert error["type"] == "invalid_request_error"


def test_bad_chat_requests_and_openai_client_errors(server):
    c = client(server)
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model="tiny", messages=[], max_tokens=4)
    assert info.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], temperature=-1)
    assert info.value.body["param"] == "temperature"
    response = requests.post(server["http"] + "/v1/chat/completions", json={"model": "tiny"}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"


BAD_GRPC = [
    ("prompt", dict(prompt="")),
    ("prompt", dict()),
    ("max_tokens", dict(prompt=PROMPT, max_tokens=-3)),
    ("sampling.temperature", dict(prompt=PROMPT, sampling=generator_pb2.SamplingParams(temperature=-1))),
    ("sampling.top_p", dict(prompt=PROMPT, sampling=generator_pb2.SamplingParams(top_p=1.5))),
    ("sampling.top_p", dict(prompt=PROMPT, sampling=generator_pb2.SamplingParams(top_p=0.0))),
    ("model", dict(prompt=PROMPT, model="nope")),
    ("prompt", dict(prompt=LONG)),
    ("gamma", dict(prompt=PROMPT, gamma="5000")),
]


@pytest.mark.parametrize(("field", "kwargs"), BAD_GRPC)
def test_bad_grpc_requests_are_invalid_argument(server, field, kwargs):
    stub = grpc_stub(server)
    for call in (stub.Generate, lambda r, metadata: list(stub.GenerateStream(r, metadata=metadata))):
        with pytest.raises(grpc.RpcError) as info:
            call(generator_pb2.GenerateRequest(**kwargs), metadata=metadata())
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith(field + ":")


def test_bad_request_does_not_disturb_a_running_one(server, local):
    stub = grpc_stub(server)
    request = generator_pb2.GenerateRequest(prompt=PROMPT, max_tokens=30, sampling=generator_pb2.SamplingParams(
        temperature=1.0, seed=3))
    stream = stub.GenerateStream(request, metadata=metadata())
    first = next(stream)
    bad = requests.post(server["http"] + "/v1/completions", json={"prompt": PROMPT, "top_p": 2}, timeout=60)
    assert bad.status_code == 400
    tokens = list(first.token_ids) + [t for part in stream for t in part.token_ids]
    assert tokens == local["spec"].generate(PROMPT, SamplingParams(temperature=1.0, seed=3), 30).token_ids


def test_cancelled_streams_free_both_workers(server):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 400, "temperature": 1.0, "ignore_eos": True,
            "stream": True}
    with requests.post(server["http"] + "/v1/completions", json=body, timeout=60, stream=True) as response:
        lines = response.iter_lines(decode_unicode=True)
        assert next(lines).startswith("data: ")
        assert sessions()["target"] == 1 and sessions()["draft"] == 1
    # the client hung up after the first chunk
    assert wait_for_no_sessions() == {"target": 0, "draft": 0, "coordinator": 0}

    stub = grpc_stub(server)
    request = generator_pb2.GenerateRequest(prompt=PROMPT, max_tokens=400, sampling=generator_pb2.SamplingParams(
        ignore_eos=True))
    call = stub.GenerateStream(request, metadata=metadata("sequential"))
    next(call)
    assert sessions("sequential")["target"] == 1
    call.cancel()
    assert wait_for_no_sessions("sequential") == {"target": 0, "draft": 0, "coordinator": 0}


def test_stop_string_ends_the_session(server, local):
    """The session ends the round the stop string appears, not at max_tokens: metrics count it as "stop" and
    only the tokens up to then (it used to generate on to max_tokens in the background, counted "length")."""
    expected = local["plain"].generate(PROMPT, SamplingParams(temperature=0.0, ignore_eos=True), 40).text
    stop = expected[len(expected) // 2 : len(expected) // 2 + 3]
    url = server["metrics"]
    before = _settled(url)
    served = client(server).completions.create(model="tiny", prompt=PROMPT, max_tokens=300, temperature=0,
                                               stop=[stop], extra_body={"ignore_eos": True})
    assert served.choices[0].finish_reason == "stop"
    assert served.choices[0].text == expected[: expected.find(stop)]
    assert wait_for_no_sessions() == {"target": 0, "draft": 0, "coordinator": 0}
    after = scrape_until(url, "ray_specserve_requests_total", 1, baseline=before)
    moved = since(after, before)
    assert total(moved, "ray_specserve_requests_total", finish_reason="stop") == 1
    assert total(moved, "ray_specserve_requests_total") == 1
    assert 0 < total(moved, "ray_specserve_generation_tokens_total") <= 40  # not the 300 max_tokens allowed


def test_concurrent_sessions_keep_their_own_tokens(server, local):
    """Four seeded requests at once (HTTP and gRPC, both apps' coordinators busy): each gets its own tokens."""
    from concurrent.futures import ThreadPoolExecutor

    def http(seed):
        reply = client(server).completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=1.0,
                                                  seed=seed)
        return reply.choices[0].text

    def rpc(seed):
        request = generator_pb2.GenerateRequest(prompt=PROMPT, max_tokens=20, sampling=generator_pb2.SamplingParams(
            temperature=1.0, seed=seed))
        return grpc_stub(server).Generate(request, metadata=metadata()).text

    jobs = [(http, 101), (rpc, 102), (http, 103), (rpc, 104)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: job[0](job[1]), jobs))
    for (_, seed), text in zip(jobs, results):
        assert text == local["spec"].generate(PROMPT, SamplingParams(temperature=1.0, seed=seed), 20).text
    assert wait_for_no_sessions() == {"target": 0, "draft": 0, "coordinator": 0}


def _settled(url: str, timeout: float = 30.0) -> dict[str, float]:
    """A scrape that no longer changes: everything recorded so far has been exported."""
    deadline, last = time.time() + timeout, None
    while True:
        values = scrape(url)
        if values == last or time.time() > deadline:
            return values
        last = values
        time.sleep(2.5)


def test_metrics_endpoint_counts_real_requests(server):
    """Scrape the node's Prometheus endpoint around real HTTP and gRPC requests: every counter moves by what the
    responses report, the histograms by one observation per round or request, the session gauge returns to 0."""
    url = server["metrics"]
    series = {m.name: m.series()[-1] for m in METRICS}  # counters' `_total`, histograms' `_count`, the gauge
    before = _settled(url)
    replies = [client(server, "sequential").completions.create(model="tiny", prompt=PROMPT, max_tokens=20,
                                                               temperature=0),
               client(server).chat.completions.create(model="tiny", max_tokens=12, temperature=0.8, seed=3,
                                                      messages=[{"role": "user", "content": PROMPT}])]
    stats = [r.model_extra["specserve"] for r in replies]
    reasons = [r.choices[0].finish_reason for r in replies]
    usage = [(r.usage.prompt_tokens, r.usage.completion_tokens) for r in replies]
    reply = grpc_stub(server).Generate(
        generator_pb2.GenerateRequest(prompt=PROMPT, max_tokens=9, sampling=generator_pb2.SamplingParams(
            temperature=0.0)), metadata=metadata("sequential"))
    stats.append({"rounds": reply.stats.rounds, "drafted": reply.stats.drafted, "accepted": reply.stats.accepted,
                  "gamma_history": list(reply.stats.gamma_history)})
    usage.append((reply.prompt_tokens, reply.completion_tokens))
    reasons.append(reply.finish_reason)
    wait_for_no_sessions("sequential"), wait_for_no_sessions("pipelined")
    scrape_until(url, series["requests"], total(before, series["requests"]) + 3)  # the export has begun
    after = _settled(url)

    def moved(name: str, **labels: str) -> float:
        return total(after, series[name], **labels) - total(before, series[name], **labels)

    assert moved("requests", model="tiny") == 3
    for reason in set(reasons):
        assert moved("requests", finish_reason=reason) == reasons.count(reason)
    assert moved("prompt_tokens") == sum(p for p, _ in usage)
    assert moved("generation_tokens") == sum(c for _, c in usage)
    rounds = sum(s["rounds"] for s in stats)
    assert moved("spec_decode_rounds") == rounds > 0
    assert moved("spec_decode_num_draft_tokens") == sum(s["drafted"] for s in stats) > 0
    assert moved("spec_decode_num_accepted_tokens") == sum(s["accepted"] for s in stats) > 0
    assert moved("spec_decode_num_drafts") == sum(1 for s in stats for g in s["gamma_history"] if g > 0)
    per_pos = [moved("spec_decode_num_draft_tokens_per_pos", position=str(i)) for i in (1, 2, 3)]
    assert sum(per_pos) == moved("spec_decode_num_draft_tokens") and per_pos[0] >= per_pos[1] >= per_pos[2]
    assert sum(moved("spec_decode_num_accepted_tokens_per_pos", position=str(i)) for i in (1, 2, 3)) == moved(
        "spec_decode_num_accepted_tokens")
    gamma = "ray_specserve_gamma_bucket"
    assert total(after, gamma, le="3.5") - total(after, gamma, le="2.5") - (
        total(before, gamma, le="3.5") - total(before, gamma, le="2.5")) == sum(
        g == 3 for s in stats for g in s["gamma_history"])  # γ=3 fixed (the last round may draft fewer)
    for name, count in (("round_time_seconds", rounds), ("verify_call_seconds", rounds),
                        ("draft_call_seconds", rounds), ("time_to_first_token_seconds", 3),
                        ("e2e_request_latency_seconds", 3)):
        assert moved(name) == count, name  # `_count` series: one observation each
    itl = moved("inter_token_latency_seconds")
    assert 0 < itl <= sum(c for _, c in usage) - 3
    assert total(after, series["active_sessions"]) == 0


def test_workers_export_their_prefix_caches(server):
    """The target worker publishes its prefix cache's counters (every 5 s, in tokens): a long prompt sent twice
    moves hits by at least the shared part, never above the queries. Each request's own count comes back as
    OpenAI's usage.prompt_tokens_details.cached_tokens and gRPC's SpeculationStats.cached_tokens."""
    url = server["metrics"]
    before = scrape(url)
    prompt = "The sea is wide and deep, and the ships that cross it carry grain, wool and stories from far away."
    replies = [client(server).completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0)
               for _ in range(2)]
    first, again = (r.usage.prompt_tokens_details.cached_tokens for r in replies)
    assert 16 <= again <= replies[1].usage.prompt_tokens and first < again  # the first computed what the second found
    grpc_reply = grpc_stub(server).Generate(generator_pb2.GenerateRequest(
        prompt=prompt, max_tokens=4, model="tiny", sampling=generator_pb2.SamplingParams(temperature=0.0)),
        metadata=metadata())
    assert grpc_reply.stats.cached_tokens == again  # the same prompt found the same cached prefix
    hits, queries = "ray_specserve_prefix_cache_hits_total", "ray_specserve_prefix_cache_queries_total"
    moved = since(scrape_until(url, hits, 16, baseline=before, role="target"), before)
    for role in ("target", "draft"):  # a scrape may show a worker's hits before its queries (CI saw 44 and 0)
        moved = since(scrape_until(url, queries, total(moved, hits, role=role), baseline=before, role=role), before)
    assert 16 <= total(moved, hits, role="target", model="tiny") <= total(moved, queries, role="target")
    assert total(moved, hits, role="draft") <= total(moved, queries, role="draft")


@pytest.mark.parametrize("app", ["pipelined", "colocated"])
def test_prefix_caching_changes_no_token(server, local, app):
    """A long system prompt shared by a chat's turns and by other users' requests, greedy and seeded (fixed γ=3):
    the served answers, with the target's and the draft's prefix caches on (the default), equal an in-process
    engine's with prefix caching off; the workers report prompt tokens served from their caches."""
    url = server["http"] + APPS[app].rstrip("/") + "/health"
    before = requests.get(url).json()["target"]
    c = client(server, app)
    system = " ".join(f"Rule {k}: answer briefly, kindly and in plain words." for k in range(12))
    conversation = [{"role": "system", "content": system}]
    asks = [("Tell me about the sea.", dict(temperature=0.0)), ("And rivers?", dict(temperature=1.0, seed=3)),
            ("Lakes?", dict(temperature=1.0, top_k=5, seed=4)), ("Ponds?", dict(temperature=0.7, top_p=0.8, seed=5))]
    for question, params in asks:
        conversation.append({"role": "user", "content": question})
        expected = local["uncached"].generate(conversation, SamplingParams(**params), 16)
        params = dict(params)
        extra = {"top_k": params.pop("top_k")} if "top_k" in params else None  # not an openai client argument
        served = c.chat.completions.create(model="tiny", messages=conversation, max_tokens=16, extra_body=extra,
                                           **params)
        assert served.choices[0].message.content == expected.text, question
        conversation.append({"role": "assistant", "content": expected.text})
    system_tokens = len(local["uncached"].encode([{"role": "system", "content": system}]))
    for seed in (6, 7):  # other users, the same system prompt
        messages = [{"role": "system", "content": system}, {"role": "user", "content": f"Question {seed}?"}]
        expected = local["uncached"].generate(messages, SamplingParams(temperature=1.0, seed=seed), 16)
        streamed = {"stream": True, "stream_options": {"include_usage": True}} if seed == 7 else {}
        served = c.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=1.0, seed=seed,
                                           **streamed)
        if seed == 7:  # streamed: the usage comes in a last chunk without choices
            chunks = list(served)
            text, used = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices), chunks[-1].usage
        else:
            text, used = served.choices[0].message.content, served.usage
        assert text == expected.text
        # the request's own count of prompt tokens its target found cached: at least the system prompt (to a chunk)
        assert system_tokens - 16 <= used.prompt_tokens_details.cached_tokens <= used.prompt_tokens
    # n choices of a prompt nothing has cached: one computes it, the others copy it (waiting, or from it running)
    fresh = [{"role": "system", "content": "Answers come slowly. " + system}, {"role": "user", "content": "Why?"}]
    middle = requests.get(url).json()["target"]
    reply = c.chat.completions.create(model="tiny", messages=fresh, max_tokens=8, n=3, temperature=1.0, seed=9)
    assert [ch.message.content for ch in reply.choices] == [
        local["uncached"].generate(fresh, SamplingParams(temperature=1.0, seed=derived(9, i)), 8).text for i in range(3)]
    shared = requests.get(url).json()["target"]["prefix_cache_hit_tokens"] - middle["prefix_cache_hit_tokens"]
    assert shared >= 2 * (len(local["uncached"].encode(fresh)) - 16)
    assert wait_for_no_sessions(app) == {k: 0 for k in sessions(app)}
    after = requests.get(url).json()["target"]
    # every request after the first found at least the system prompt cached in the target (and a colocated draft)
    assert after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"] >= 5 * (system_tokens - 16)
    assert after["prefix_cache_entries"] > 0 and after["kv_used_tokens"] == 0
    if app == "colocated":
        assert after["draft_kv"]["prefix_cache_hit_tokens"] - before["draft_kv"]["prefix_cache_hit_tokens"] > 0


def test_load_bench_drives_concurrent_streams_and_writes_its_report(server, tmp_path):
    from specserve.cli import main

    url = server["http"] + "/v1"
    code = main(["bench", "--load", "--url", url, "--concurrency", "1,6", "--max-new-tokens", "12",
                 "--load-requests", "2", "--load-configs", "gamma0,auto", "--load-rounds", "2", "--out", str(tmp_path)])
    assert code == 0 and (tmp_path / "load.png").stat().st_size > 0
    report = json.loads((tmp_path / "load.json").read_text())
    for name in ("gamma0", "auto"):
        one, six = report["levels"][name]
        assert (one["concurrency"], six["concurrency"]) == (1, 6)
        assert one["requests"] == 2 and six["requests"] == 12 and one["errors"] == six["errors"] == 0
        assert six["tokens"] == 12 * 12  # eos ignored: every answer is max_tokens long
        assert six["aggregate_tokens_per_s"] > 0 and 0 < six["ttft_p50_s"] <= six["ttft_p95_s"] <= six["wall_s"]
    # each configuration ran the controller it asked for (whether auto drafts depends on the measured costs: with
    # this tiny pair the draft costs about what the target does, and auto rightly stays at γ=0 then)
    assert report["levels"]["gamma0"][1]["mean_gamma"] == 0
    assert [level["controllers"] for level in report["levels"]["auto"]] == [["auto"], ["auto"]]
    assert [level["controllers"] for level in report["levels"]["gamma0"]] == [["fixed:0"], ["fixed:0"]]
    # two rounds of each (ABBA): the median run is one of them, and the paired ratio is of the same rounds
    for i, level in enumerate((1, 6)):
        runs = {name: report["levels"][name][i]["runs_aggregate_tokens_per_s"] for name in ("gamma0", "auto")}
        assert len(runs["gamma0"]) == len(runs["auto"]) == 2
        assert report["levels"]["auto"][i]["aggregate_tokens_per_s"] == min(runs["auto"])  # lower middle of two
        ratio = report["ratio_to_first"]["auto"][i]
        assert ratio["concurrency"] == level and ratio["runs"] == [a / b for a, b in zip(runs["auto"], runs["gamma0"])]
    # and each level against the first, paired by round (the rounds interleave the levels)
    for name in ("gamma0", "auto"):
        one, six = (level["runs_aggregate_tokens_per_s"] for level in report["levels"][name])
        scaling = [a / b for a, b in zip(six, one)]
        assert report["scaling"][name] == [{"concurrency": 6, "median": statistics.median(scaling), "runs": scaling}]
    assert main(["bench", "--load", "--url", url, "--load-configs", "nope", "--out", str(tmp_path)]) == 2


def test_colocated_app_runs_sessions_in_the_target_worker_and_frees_them(server):
    health = requests.get(server["http"] + "/colocated/health").json()
    assert health["draft"] == "colocated" and health["target"]["colocated_draft"] and health["target"]["batching"]
    # the colocated relay runs in the ingress replica, the split placement's coordinator in an actor of its own
    if pathlib.Path("/proc/self/cmdline").exists():
        pids = {app: serve.get_app_handle(app).process_ids.remote().result() for app in ("colocated", "pipelined")}
        assert cmdline(pids["colocated"]["coordinator"]).startswith("ray::ServeReplica:colocated")
        assert cmdline(pids["pipelined"]["coordinator"]).startswith("ray::Coordinator")
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 400, "temperature": 1.0, "ignore_eos": True,
            "stream": True}
    with requests.post(server["http"] + "/colocated/v1/completions", json=body, timeout=60, stream=True) as response:
        assert next(response.iter_lines(decode_unicode=True)).startswith("data: ")
        assert set(sessions("colocated")) == {"target", "coordinator"}  # no draft worker at all
    assert wait_for_no_sessions("colocated") == {"target": 0, "coordinator": 0}


# -- OpenAI compatibility (issue 17): n, stream_options, models/{id}, content parts, refused parameters --------
def derived(seed: int, index: int) -> int:
    from specserve.coordinator import SessionRequest

    return SessionRequest([1], SamplingParams(seed=seed), 1).choice(index).params.seed


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_are_independent_seeded_samples(server, local, stream):
    c = client(server, "colocated")
    messages = [{"role": "user", "content": PROMPT}]
    params = dict(temperature=1.0, seed=7)
    results = [local["spec"].generate(messages, SamplingParams(temperature=1.0, seed=derived(7, i)), 10)
               for i in range(3)]
    expected = [r.text for r in results]
    assert expected[0] == local["spec"].generate(messages, SamplingParams(**params), 10).text  # choice 0 = n=1
    assert len(set(expected)) == 3
    if not stream:
        reply = c.chat.completions.create(model="tiny", messages=messages, max_tokens=10, n=3, **params)
        assert [ch.index for ch in reply.choices] == [0, 1, 2]
        assert [ch.message.content for ch in reply.choices] == expected
        assert reply.usage.completion_tokens == sum(len(r.token_ids) for r in results)
    else:
        chunks = list(c.chat.completions.create(model="tiny", messages=messages, max_tokens=10, n=3, stream=True,
                                                stream_options={"include_usage": True}, **params))
        texts, roles, finished = ["", "", ""], set(), set()
        for chunk in chunks[:-1]:
            assert len(chunk.choices) == 1 and chunk.usage is None
            choice = chunk.choices[0]
            texts[choice.index] += choice.delta.content or ""
            if choice.delta.role == "assistant":
                assert choice.index not in roles  # the role comes once per choice, first
                roles.add(choice.index)
            if choice.finish_reason:
                finished.add(choice.index)
        assert texts == expected and roles == finished == {0, 1, 2}
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == sum(len(r.token_ids) for r in results)
    completion = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, n=2, temperature=0)
    assert [ch.index for ch in completion.choices] == [0, 1]
    assert completion.choices[0].text == completion.choices[1].text  # greedy: the same sample twice
    assert wait_for_no_sessions("colocated") == {"target": 0, "coordinator": 0}


def test_stream_options_include_usage_ends_with_a_usage_only_chunk(server):
    c = client(server)
    chunks = list(c.completions.create(model="tiny", prompt=PROMPT, max_tokens=9, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    assert all(ch.usage is None and len(ch.choices) == 1 for ch in chunks[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 9 and last.usage.prompt_tokens > 0
    assert last.usage.total_tokens == last.usage.prompt_tokens + 9
    with pytest.raises(openai.BadRequestError) as info:  # as OpenAI: only with stream
        c.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, stream_options={"include_usage": True})
    assert info.value.body["param"] == "stream_options"


def test_a_model_is_retrieved_by_its_id(server):
    c = client(server)
    assert c.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError) as info:
        c.models.retrieve("gpt-4")
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"


def test_chat_content_given_as_text_parts(server, local):
    c = client(server)
    parts = [{"type": "text", "text": "Write a short poem"}, {"type": "text", "text": "about the sea."}]
    expected = local["plain"].generate([{"role": "user", "content": "Write a short poem\nabout the sea."}],
                                       SamplingParams(temperature=0.0), 12).text
    reply = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": parts}], max_tokens=12,
                                      temperature=0)
    assert reply.choices[0].message.content == expected
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": [parts[0], image]}])
    assert info.value.body["param"] == "messages.0.content.1.type"


REFUSED_CHAT = [  # (keyword of the openai client, value): each is a parameter this server does not implement
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]),
    ("tool_choice", "auto"), ("response_format", {"type": "json_object"}), ("logit_bias", {"42": 5}),
    ("presence_penalty", 0.5), ("frequency_penalty", 1.0),
    ("parallel_tool_calls", False), ("store", True), ("modalities", ["text", "audio"]),
    ("reasoning_effort", "low"), ("service_tier", "flex"), ("prediction", {"type": "content", "content": "x"}),
]
REFUSED_COMPLETIONS = [("best_of", 2), ("echo", True), ("suffix", "end"), ("logit_bias", {"1": -1}),
                       ("presence_penalty", -1.0)]


def test_parameters_it_does_not_implement_are_refused_by_name(server):
    c = client(server)
    messages = [{"role": "user", "content": "hi"}]
    for name, value in REFUSED_CHAT:
        with pytest.raises(openai.BadRequestError) as info:
            c.chat.completions.create(model="tiny", messages=messages, max_tokens=2, **{name: value})
        assert info.value.body["param"] == name, (name, info.value.body)
    for name, value in REFUSED_COMPLETIONS:
        with pytest.raises(openai.BadRequestError) as info:
            c.completions.create(model="tiny", prompt="hi", max_tokens=2, **{name: value})
        assert info.value.body["param"] == name, (name, info.value.body)
    with pytest.raises(openai.BadRequestError) as info:  # a parameter nobody defined
        c.completions.create(model="tiny", prompt="hi", max_tokens=2, extra_body={"temprature": 0.5})
    assert info.value.body["param"] == "temprature" and "not a parameter" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:  # a message field that would be dropped
        c.chat.completions.create(model="tiny", max_tokens=2, messages=[
            {"role": "assistant", "content": "x", "tool_calls": [{"id": "1", "type": "function",
                                                                  "function": {"name": "f", "arguments": "{}"}}]}])
    assert info.value.body["param"] == "messages.0.tool_calls"
    for name, value in [("n", 0), ("n", 17)]:
        with pytest.raises(openai.BadRequestError) as info:
            c.completions.create(model="tiny", prompt="hi", max_tokens=2, **{name: value})
        assert info.value.body["param"] == name
    # the values that mean "not used", and `user`, are accepted
    reply = c.chat.completions.create(model="tiny", messages=messages, max_tokens=2, presence_penalty=0,
                                      frequency_penalty=0.0, logprobs=False, user="someone", tool_choice="none")
    assert reply.choices[0].finish_reason in ("length", "stop")
    assert c.completions.create(model="tiny", prompt="hi", max_tokens=2, echo=False, best_of=1).choices
    nulls = {"n": None, "stream": None, "logprobs": None, "top_logprobs": None, "stream_options": None, "user": None}
    response = requests.post(server["http"] + "/v1/chat/completions", timeout=60,
                             json={"model": "tiny", "messages": messages, "max_tokens": 2, **nulls})
    assert response.status_code == 200 and len(response.json()["choices"]) == 1  # null means "left out"


@pytest.mark.parametrize("app", ["pipelined", "colocated"])
def test_logprobs_are_the_targets_for_the_emitted_tokens(server, local, app):
    """From the verify pass (a draft worker's session, or the colocated worker's): the in-process engine's values
    for the same tokens, through the openai client (chat and completions, streamed and not) and gRPC."""
    c = client(server, app)
    messages = [{"role": "user", "content": PROMPT}]
    params = dict(temperature=1.0, seed=3)
    expected = local["spec"].generate(messages, SamplingParams(**params, logprobs=3), 12)
    tokenizer = local["spec"].tokenizer
    reply = c.chat.completions.create(model="tiny", messages=messages, max_tokens=12, logprobs=True, top_logprobs=3,
                                      **params)
    content = reply.choices[0].logprobs.content
    assert reply.choices[0].message.content == expected.text and len(content) == len(expected.token_ids)
    for entry, (token, logprob, top) in zip(content, expected.logprobs):
        assert entry.token == tokenizer.decode([token]) and entry.bytes == list(entry.token.encode())
        assert entry.logprob == pytest.approx(logprob, abs=1e-4)
        assert [t.token for t in entry.top_logprobs] == [tokenizer.decode([i]) for i, _ in top]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx([v for _, v in top], abs=1e-4)
    streamed = list(c.chat.completions.create(model="tiny", messages=messages, max_tokens=12, logprobs=True,
                                              stream=True, **params))
    entries = [e for ch in streamed if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [e.logprob for e in entries] == pytest.approx([lp for _, lp, _ in expected.logprobs], abs=1e-4)
    assert all(e.top_logprobs == [] for e in entries)  # logprobs without top_logprobs: the tokens' own only
    plain = c.chat.completions.create(model="tiny", messages=messages, max_tokens=4, **params)
    assert plain.choices[0].logprobs is None  # not asked, not sent
    completion = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2)
    lp = completion.choices[0].logprobs
    assert "".join(lp.tokens) == completion.choices[0].text and len(lp.token_logprobs) == 8
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    assert all(len(top) == 2 and max(top.values()) >= v - 1e-6 for top, v in zip(lp.top_logprobs, lp.token_logprobs))
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model="tiny", messages=messages, max_tokens=2, top_logprobs=2)
    assert info.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as info:
        c.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, logprobs=21)
    assert info.value.body["param"] == "logprobs"
    request = generator_pb2.GenerateRequest(
        messages=generator_pb2.ChatMessages(messages=[generator_pb2.ChatMessage(role="user", content=PROMPT)]),
        max_tokens=12, sampling=generator_pb2.SamplingParams(temperature=1.0, seed=3, logprobs=3))
    reply = grpc_stub(server).Generate(request, metadata=metadata(app))
    assert [m.token_id for m in reply.logprobs] == list(reply.token_ids) == expected.token_ids
    assert [m.logprob for m in reply.logprobs] == pytest.approx([lp for _, lp, _ in expected.logprobs], abs=1e-4)
    assert [[t.token_id for t in m.top] for m in reply.logprobs] == [[i for i, _ in top] for _, _, top in
                                                                   expected.logprobs]


def test_grpc_n_samples_unary_and_streamed(server, local):
    stub = grpc_stub(server)
    request = generator_pb2.GenerateRequest(prompt=PROMPT, max_tokens=8, n=3,
                                            sampling=generator_pb2.SamplingParams(temperature=1.0, seed=21))
    expected = [local["spec"].generate(PROMPT, SamplingParams(temperature=1.0, seed=derived(21, i)), 8).token_ids
                for i in range(3)]
    reply = stub.Generate(request, metadata=metadata("colocated"))
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [list(c.token_ids) for c in reply.choices] == expected and list(reply.token_ids) == expected[0]
    streamed: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for part in stub.GenerateStream(request, metadata=metadata("colocated")):
        streamed[part.index] += list(part.token_ids)
    assert [streamed[i] for i in range(3)] == expected
    with pytest.raises(grpc.RpcError) as info:
        stub.Generate(generator_pb2.GenerateRequest(prompt=PROMPT, max_tokens=2, n=17), metadata=metadata())
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith("n")
