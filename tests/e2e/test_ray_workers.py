"""Draft and target workers as real Ray actors (local cluster), driven over real gRPC."""

from __future__ import annotations

import grpc
import pytest
import ray
import torch
from specserve import SamplingParams, SpeculativeDecoder
from specserve.speculation import make_controller
from specserve.v1 import workers_pb2_grpc
from specserve.workers import RoleResources, WorkersConfig
from specserve.workers.launch import start_workers

from tests.conftest import perturbed_copy, tiny_llama
from tests.remote import remote_generate

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


def test_a_feature_head_served_from_its_directory_in_the_target_actor(local_ray, model_dirs):
    """`draft: head:PATH` through `start_workers`: the target actor loads the head beside its model (no draft
    actor), keeps features in its pool, and its sessions over the coordinator emit the in-process decoder's
    tokens (greedy: target-only's)."""
    import asyncio

    from specserve.coordinator import ColocatedRelay, Coordinator, SessionRequest
    from specserve.models.drafts.head import FeatureHeadForCausalLM
    from specserve.models.formats.loading import load_model

    target = load_model(str(model_dirs / "target"), "float32").model
    FeatureHeadForCausalLM.for_target(target, seed=3, shared_from=str(model_dirs / "target")).save_pretrained(
        str(model_dirs / "head"))
    config = WorkersConfig(target=str(model_dirs / "target"), draft=f"head:{model_dirs / 'head'}", dtype="float32",
                           target_resources=RoleResources(torch_threads=1))
    target_actor, draft_actor = start_workers(config)
    try:
        assert draft_actor is None
        info = ray.get(target_actor.info.remote())
        assert info["colocated_draft"] == str(model_dirs / "head") and info["batching"]
        coord = Coordinator(ColocatedRelay(ray.get(target_actor.address.remote()), gamma=3))
        local = SpeculativeDecoder(config.target, config.draft, gamma=3, dtype="float32")
        plain = SpeculativeDecoder(config.target, None, gamma=0, dtype="float32")
        for mode in (dict(temperature=0.0), dict(temperature=1.0, seed=21), dict(temperature=0.7, top_p=0.9, seed=22)):
            params = SamplingParams(**mode, ignore_eos=True)

            async def tokens_of(request):
                return [t async for chunk in coord.generate(request) for t in chunk.tokens]

            tokens = asyncio.run(tokens_of(SessionRequest(PROMPT, params, 30)))
            assert tokens == local.generate(PROMPT, params, 30).token_ids
            if mode["temperature"] == 0.0:
                assert tokens == plain.generate(PROMPT, params, 30).token_ids
        assert ray.get(target_actor.active_sessions.remote()) == 0
    finally:
        ray.kill(target_actor)
