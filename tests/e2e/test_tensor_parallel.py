"""A tensor-parallel target served for real: two rank actors in a placement group (gloo), Serve, the `openai`
client; the same tokens as the unsplit target in process, and a rank killed mid-stream costs no request."""

from __future__ import annotations

import os
import signal
import time

import pytest
import requests
from ray import serve

from specserve import SamplingParams
from specserve.serve import build_app
from tests.conftest import save_tokenized_pair, start_local_serve, stop_local_serve
from tests.e2e.test_faults import MAX_TOKENS, PROMPT, _Clients, _mismatched, _reference, _request

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = save_tokenized_pair(tmp_path_factory.mktemp("tp-models"), noise=0.05, kv_heads=2)
    addresses = start_local_serve()
    args = {"target": str(root / "target"), "draft": str(root / "draft"), "dtype": "float32", "gamma": 3,
            "model_name": "tiny", "draft_placement": "colocated",
            "target_resources": {"torch_threads": 1, "tensor_parallel": 2}}
    serve.run(build_app(args), name="faults", route_prefix="/")  # the name test_faults' clients address
    # the draft in a worker of its own, pipelined, beside the split target
    serve.run(build_app({**args, "draft_placement": "split", "pipelined": True, "draft_top_k": 64,
                         "draft_resources": {"torch_threads": 1}}), name="split", route_prefix="/split")
    yield {"root": root, **addresses, "app": serve.get_app_handle("faults"), "split": serve.get_app_handle("split")}
    stop_local_serve()


def test_the_split_target_serves_the_unsplit_targets_tokens(server):
    import openai

    health = requests.get(server["http"] + "/health", timeout=30).json()
    assert health["target"]["tensor_parallel"] == 2 and health["target"]["tp_all_reduces"] > 0
    reference = _reference(server)
    client = openai.OpenAI(base_url=f"{server['http']}/v1", api_key="-", max_retries=0, timeout=180)
    greedy = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                       extra_body={"ignore_eos": True})
    want = reference.generate(PROMPT, SamplingParams(temperature=0, ignore_eos=True), MAX_TOKENS).text
    assert greedy.choices[0].text == want
    replies = [(kind, seed, _request(server, kind, seed, app)) for kind, seed in (("http-stream", 1), ("grpc", 2))
               for app in ("faults", "split")]
    assert not _mismatched(reference, replies)
    pids = server["app"].process_ids.remote().result(timeout_s=120)
    assert set(pids) == {"target", "target-rank-1", "coordinator"}
    assert set(server["split"].process_ids.remote().result(timeout_s=120)) == {
        "target", "target-rank-1", "draft", "coordinator"}


def test_a_lost_rank_restarts_the_group_and_streams_go_on(server):
    """SIGKILL rank 1 with a session mid-stream, twice: rank 0 sees it gone and exits, Ray restarts the group,
    and every stream completes equal to the uninterrupted run."""
    app = server["app"]
    clients = _Clients(server, ["http-stream", "grpc-stream"], first_seed=7000)
    killed, degraded = [], 0
    try:
        for _ in range(2):
            clients.wait_for_one_more(300)
            pids = app.process_ids.remote().result(timeout_s=180)
            deadline = time.time() + 300
            while app.worker_sessions.remote().result()["target"] == 0 and time.time() < deadline:
                time.sleep(0.01)
            os.kill(pids["target-rank-1"], signal.SIGKILL)
            killed.append(pids)
            seen, until = False, time.time() + 30
            while not seen and time.time() < until:  # rank 0 goes down with it: the group restarts
                health = requests.get(server["http"] + "/health", timeout=30)
                seen = health.status_code == 503 and health.json()["status"] == "degraded"
                time.sleep(0.1)
            degraded += seen
            healed = app.process_ids.remote().result(timeout_s=180)
            while healed["target"] == pids["target"] and time.time() < deadline:
                time.sleep(0.5)
                healed = app.process_ids.remote().result(timeout_s=180)
        time.sleep(2.0)
    finally:
        clients.stop()
    assert healed["target"] not in {p["target"] for p in killed}  # rank 0 went down with its rank and came back
    assert healed["target-rank-1"] not in {p["target-rank-1"] for p in killed}
    assert degraded >= 1  # /health told the truth while the group was down
    assert not clients.errors, clients.errors
    assert len(clients.results) >= 3, len(clients.results)
    mismatched = _mismatched(_reference(server), clients.results)
    assert not mismatched, f"{len(mismatched)} of {len(clients.results)} replies differ from the uninterrupted run"


def test_a_crashed_replica_leaves_no_placement_group_behind(server):
    """The ranks' placement group is created by the application's replica, a detached actor, so Ray removes it
    when the replica dies however it dies: a replica killed outright (no graceful shutdown, no `__del__`) is
    replaced by one that reserves a new group, and the old one is gone (a node with exactly N GPUs would
    otherwise keep them reserved and the new replica wait for them)."""
    import ray

    def groups() -> set[str]:
        return {pid for pid, g in ray.util.placement_group_table().items() if g["state"] == "CREATED"}

    before = groups()
    old_target = server["app"].process_ids.remote().result(timeout_s=180)["target"]
    replica = next(a for a in ray.util.list_named_actors(all_namespaces=True)
                   if "faults" in a["name"] and "SpecServe" in a["name"])
    ray.kill(ray.get_actor(replica["name"], namespace=replica["namespace"]), no_restart=True)
    deadline, served = time.time() + 300, None
    while served is None and time.time() < deadline:
        try:  # the replacement replica: new workers, a new group
            pids = server["app"].process_ids.remote().result(timeout_s=60)
            served = pids if pids["target"] != old_target else None
        except Exception:  # noqa: BLE001 - the replica is down or still starting
            time.sleep(1.0)
    assert served is not None, "no replacement replica within 300 s"
    after = groups()
    assert len(after) == len(before) and len(after - before) == 1  # the old group removed, one new
    assert ray.util.placement_group_table()[(before - after).pop()]["state"] == "REMOVED"
    assert not _mismatched(_reference(server), [("grpc", 11, _request(server, "grpc", 11))])  # serves, exactly


def test_deleting_an_application_gives_back_its_ranks_placement(server):
    import ray

    def reserved() -> int:
        return sum(g["state"] == "CREATED" for g in ray.util.placement_group_table().values())

    before = reserved()
    serve.delete("split")
    deadline = time.time() + 60
    while reserved() != before - 1 and time.time() < deadline:
        time.sleep(0.2)
    assert reserved() == before - 1
