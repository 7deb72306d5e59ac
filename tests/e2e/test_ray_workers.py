"""Draft and target workers as real Ray actors (local cluster), driven over real gRPC."""

from __future__ import annotations

import grpc
import pytest
import ray
import torch

from specserve import SamplingParams, SpeculativeDecoder
from tests.remote import remote_generate
from specserve.speculation import make_controller
from specserve.v1 import workers_pb2_grpc
from specserve.workers import RoleResources, WorkersConfig
from specserve.workers.actors import start_workers
from tests.conftest import perturbed_copy, tiny_llama

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ray-models")
    target = tiny_llama(0, vocab=64, layers=2, hidden=32, scale=8, dtype=torch.float32)
    for name, model in (("target", target), ("draft", perturbed_copy(target, 0.3))):
        model.save_pretrained(str(root / name))
    return root


def served(target_actor, draft_actor, params, gamma=3, max_new=30):
    target_stub = workers_pb2_grpc.TargetWorkerStub(grpc.insecure_channel(ray.get(target_actor.address.remote())))
    draft_stub = workers_pb2_grpc.DraftWorkerStub(grpc.insecure_channel(ray.get(draft_actor.address.remote())))
    info = ray.get(target_actor.info.remote())
    free = ray.get(draft_actor.is_free.remote())
    tokens, _, stats = remote_generate(
        draft_stub, target_stub, PROMPT, params, max_new, make_controller(gamma), info["vocab"], set(info["eos_ids"]), free
    )
    return tokens, stats


@pytest.fixture(scope="module")
def local_ray():
    ray.init(address="local", include_dashboard=False, num_cpus=4, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.parametrize("draft", ["model", "ngram"])
def test_ray_workers_serve_the_same_tokens_as_in_process(local_ray, model_dirs, draft):
    config = WorkersConfig(
        target=str(model_dirs / "target"),
        draft=str(model_dirs / "draft") if draft == "model" else "ngram",
        ngram_worker=True,
        dtype="float32",
        draft_top_k=4,
        target_resources=RoleResources(torch_threads=1),
        draft_resources=RoleResources(torch_threads=1),
        draft_placement="split",
    )
    target_actor, draft_actor = start_workers(config)
    try:
        # as served: prompt lookup first, then the model draft
        local = SpeculativeDecoder(config.target, config.draft, gamma=3, dtype="float32", draft_top_k=4)
        for mode in (dict(temperature=0.0), dict(temperature=1.0, seed=21), dict(temperature=0.7, top_p=0.9, seed=22)):
            params = SamplingParams(**mode, ignore_eos=True)
            tokens, stats = served(target_actor, draft_actor, params)
            assert tokens == local.generate(PROMPT, params, 30).token_ids
            assert stats.rounds < len(tokens) or draft == "ngram"
        assert ray.get(target_actor.active_sessions.remote()) == 0
        assert ray.get(draft_actor.active_sessions.remote()) == 0
    finally:
        for actor in (target_actor, draft_actor):
            ray.kill(actor)
