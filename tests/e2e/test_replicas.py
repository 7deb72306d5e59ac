"""Two replicas of the application on a local Ray (`num_replicas`): each starts workers of its own, and concurrent
requests spread over them each get what they get alone."""

from __future__ import annotations

import concurrent.futures

import pytest
import ray
import requests
from ray import serve

from specserve.serve import build_app
from tests.conftest import save_tokenized_pair, start_local_serve, stop_local_serve

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = save_tokenized_pair(tmp_path_factory.mktemp("replica-models"), noise=0.05)
    addresses = start_local_serve()
    args = {"target": str(root / "target"), "draft": str(root / "draft"), "dtype": "float32", "gamma": 2,
            "model_name": "tiny", "num_replicas": 2, "kv_cache_tokens": 4096,
            "target_resources": {"torch_threads": 1, "num_cpus": 0.25}}
    serve.run(build_app(args), name="replicated", route_prefix="/")
    yield addresses
    stop_local_serve()


def _complete(server, body: dict) -> dict:
    response = requests.post(server["http"] + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_two_replicas_with_their_own_workers_answer_as_one(server):
    deployment = serve.status().applications["replicated"].deployments["SpecServe"]
    assert deployment.replica_states.get("RUNNING") == 2
    from ray._private.state import actors  # the state API's list_actors needs the dashboard

    workers = [a for a in actors().values() if a["ActorClassName"] == "TargetWorkerActor" and a["State"] == "ALIVE"]
    assert len(workers) == 2 and len({a["Pid"] for a in workers}) == 2  # a target worker for each replica
    bodies = [{"prompt": f"Tell me about the number {i}.", "max_tokens": 16, "temperature": 1.0, "seed": i,
               "ignore_eos": True} for i in range(32)]
    alone = [_complete(server, body) for body in bodies]
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        together = list(pool.map(lambda body: _complete(server, body), bodies))
    assert [r["choices"][0]["text"] for r in together] == [r["choices"][0]["text"] for r in alone]
    assert all(r["usage"]["completion_tokens"] == 16 for r in together)
    assert ray.is_initialized()
