"""Placement on a simulated heterogeneous cluster (`ray.cluster_utils.Cluster` on one machine).

A "small GPU" node and two "large GPU" nodes are modelled with custom
resources; the config decides where each worker goes, and the actors' node
ids must say Ray put them there. A generation then runs across the nodes,
including a target split into two pipeline stages on the two large nodes.
"""

from __future__ import annotations

import pytest
import ray
import torch
from ray.cluster_utils import Cluster

from specserve import SamplingParams, SpeculativeDecoder
from specserve.workers import RoleResources, WorkersConfig
from specserve.workers.launch import release_workers, start_workers
from tests.conftest import perturbed_copy, tiny_llama
from tests.e2e.test_ray_workers import PROMPT, served


@pytest.fixture(scope="module")
def cluster():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    nodes = {
        "small": cluster.add_node(num_cpus=1, resources={"small_gpu": 1}),
        "large": cluster.add_node(num_cpus=1, resources={"large_gpu": 2}),
        "large2": cluster.add_node(num_cpus=1, resources={"large_gpu": 2}),
        "gpus": cluster.add_node(num_cpus=1, num_gpus=2),  # Ray's fake GPUs: no CUDA here, the models use the CPU
    }
    ray.init(address=cluster.address, log_to_driver=False)
    yield nodes
    ray.shutdown()
    cluster.shutdown()


def _pair(tmp_path, kv_heads: int = 1) -> tuple[str, str]:
    """A tiny target and a close draft saved under tmp_path: their directories."""
    target = tiny_llama(0, vocab=64, layers=2, hidden=32, scale=8, dtype=torch.float32, kv_heads=kv_heads)
    target.save_pretrained(str(tmp_path / "target"))
    perturbed_copy(target, 0.3).save_pretrained(str(tmp_path / "draft"))
    return str(tmp_path / "target"), str(tmp_path / "draft")


def _as_in_process(config: WorkersConfig, target_actor, draft_actor) -> None:
    """A seeded generation through the workers is what the in-process decoder gives (prompt lookup first, then the
    model draft, as served)."""
    params = SamplingParams(temperature=1.0, seed=5, ignore_eos=True)
    tokens, _ = served(target_actor, draft_actor, params)
    local = SpeculativeDecoder(config.target, config.draft, gamma=3, dtype="float32", draft_top_k=4)
    assert tokens == local.generate(PROMPT, params, 30).token_ids


def _from_flags(*flags: str, ray_gpus: float | None = None) -> WorkersConfig:
    """The workers' config `specserve serve FLAGS` makes; ray_gpus: what Ray has, for the default placement."""
    from specserve.cli import build_parser
    from specserve.serve.run import config_from_flags, default_gpus

    config = config_from_flags(build_parser().parse_args(["serve", "--dtype", "float32", *flags]))
    if ray_gpus is not None:
        default_gpus(config, ray_gpus)
    args = config["applications"][0]["args"]
    return WorkersConfig(**{k: v for k, v in args.items() if k in WorkersConfig.model_fields}, draft_top_k=4)


def test_draft_and_target_land_where_the_config_says(cluster, tmp_path):
    target, draft = _pair(tmp_path)
    config = WorkersConfig(
        target=target,
        draft=draft,
        dtype="float32",
        draft_top_k=4,
        draft_resources=RoleResources(num_cpus=0.5, resources={"small_gpu": 1}, torch_threads=1),
        target_resources=RoleResources(num_cpus=0.5, resources={"large_gpu": 2}, torch_threads=1),
    )
    target_actor, draft_actor = start_workers(config)
    try:
        assert ray.get(target_actor.node_id.remote()) in {cluster["large"].node_id, cluster["large2"].node_id}
        assert ray.get(draft_actor.node_id.remote()) == cluster["small"].node_id
        _as_in_process(config, target_actor, draft_actor)
    finally:
        ray.kill(target_actor)
        ray.kill(draft_actor)


def test_gpu_flags_have_ray_reserve_gpus(cluster, tmp_path):
    """`--gpus 1 --draft-gpus 1`: both workers land on the one node with GPUs, each holding one of its two."""
    target, draft = _pair(tmp_path)
    config = _from_flags("--target", target, "--draft", draft, "--gpus", "1", "--draft-gpus", "1")
    target_actor, draft_actor = start_workers(config)
    try:
        assert draft_actor is not None  # a draft with a GPU of its own: a worker of its own
        for actor in (target_actor, draft_actor):
            assert ray.get(actor.node_id.remote()) == cluster["gpus"].node_id
        gpus = [ray.get(actor.gpu_ids.remote()) for actor in (target_actor, draft_actor)]
        assert all(len(ids) == 1 for ids in gpus) and gpus[0] != gpus[1], gpus
        _as_in_process(config, target_actor, draft_actor)
    finally:
        ray.kill(target_actor)
        ray.kill(draft_actor)


def test_the_default_command_puts_the_target_on_a_gpu_and_each_rank_on_one(cluster, tmp_path):
    """`specserve serve --target T --draft D` (no GPU flags) on a Ray with (fake) GPUs: the target on one of them, its
    draft beside it; with `--tensor-parallel 2`, a GPU for each rank."""
    target, draft = _pair(tmp_path, kv_heads=2)
    gpus = ray.cluster_resources().get("GPU", 0)
    target_actor, draft_actor = start_workers(_from_flags("--target", target, "--draft", draft, ray_gpus=gpus))
    try:
        assert draft_actor is None  # colocated: in the target worker, on its GPU
        assert ray.get(target_actor.node_id.remote()) == cluster["gpus"].node_id
        assert len(ray.get(target_actor.gpu_ids.remote())) == 1
    finally:
        release_workers(target_actor)
        ray.kill(target_actor)
    target_actor, _ = start_workers(_from_flags("--target", target, "--draft", "none", "--tensor-parallel", "2",
                                                ray_gpus=gpus))
    try:
        ranks = ray.get(target_actor.rank_gpu_ids.remote())
        assert len(ranks) == 2 and all(len(ids) == 1 for ids in ranks) and ranks[0] != ranks[1], ranks
    finally:
        release_workers(target_actor)
        ray.kill(target_actor)


def test_role_resources_map_to_ray_options():
    options = RoleResources(num_gpus=4, accelerator_type="H100", torch_threads=3).actor_options()
    assert options == {
        "num_cpus": 0.5, "num_gpus": 4, "accelerator_type": "H100",
        "runtime_env": {"env_vars": {"OMP_NUM_THREADS": "3"}},
    }
    with pytest.raises(ValueError, match="num_gpus"):
        RoleResources(num_gpus=-1)


def _staged(tmp_path, stage: RoleResources, kv_heads: int = 1):
    """A 4-layer target in two stages of `stage` each, its draft on the small node: (config, target actor,
    draft actor, stage actors)."""
    target = tiny_llama(0, vocab=64, layers=4, hidden=32, scale=8, dtype=torch.float32, kv_heads=kv_heads)
    target.save_pretrained(str(tmp_path / "target"))
    perturbed_copy(target, 0.3).save_pretrained(str(tmp_path / "draft"))
    config = WorkersConfig(
        target=str(tmp_path / "target"), draft=str(tmp_path / "draft"), dtype="float32", draft_top_k=4,
        draft_resources=RoleResources(num_cpus=0.5, resources={"small_gpu": 1}, torch_threads=1),
        target_resources=RoleResources(num_cpus=0.25, torch_threads=1),
        target_stages=[stage, stage],
    )
    target_actor, draft_actor = start_workers(config)
    stages = ray.get(target_actor.__ray_call__.remote(lambda self: self.stages))
    return config, target_actor, draft_actor, stages


def _stop(target_actor, draft_actor, stages) -> None:
    for actor in (target_actor, draft_actor, *stages):
        ray.kill(actor)
    release_workers(target_actor)


def test_two_stage_target_matches_the_unsharded_one(cluster, tmp_path):
    """Layers split over two stage actors on the two large-GPU nodes: same greedy and seeded tokens."""
    stage = RoleResources(num_cpus=0.5, resources={"large_gpu": 2}, torch_threads=1)
    config, target_actor, draft_actor, stages = _staged(tmp_path, stage)
    try:
        assert ray.get([s.layers.remote() for s in stages]) == [(0, 2), (2, 4)]
        stage_nodes = ray.get([s.node_id.remote() for s in stages])
        assert sorted(stage_nodes) == sorted([cluster["large"].node_id, cluster["large2"].node_id])
        assert ray.get(draft_actor.node_id.remote()) == cluster["small"].node_id
        assert ray.get(target_actor.info.remote())["stages"] == 2

        greedy = SamplingParams(temperature=0.0, ignore_eos=True)
        plain = SpeculativeDecoder(config.target, None, dtype="float32")
        tokens, stats = served(target_actor, draft_actor, greedy)
        assert tokens == plain.generate(PROMPT, greedy, 30).token_ids
        assert stats.accepted > 0
        seeded = SamplingParams(temperature=1.0, seed=9, ignore_eos=True)
        # as served: prompt lookup first, then the model draft
        local = SpeculativeDecoder(config.target, config.draft, gamma=3, dtype="float32", draft_top_k=4)
        assert served(target_actor, draft_actor, seeded)[0] == local.generate(PROMPT, seeded, 30).token_ids
        profile = ray.get(target_actor.verify_profile.remote(4))
        assert sorted(profile) == [1, 2, 3, 4] and all(t > 0 for t in profile.values())
        info = ray.get(target_actor.info.remote())
        assert info["batching"] and info["kv_used_tokens"] == 0  # every session's blocks given back
    finally:
        _stop(target_actor, draft_actor, stages)


def test_two_nodes_each_running_a_tensor_parallel_stage(cluster, tmp_path):
    """The two-node shape of cluster/two-node.yaml on the simulated cluster: the target's layers in two stages,
    one per large node, each stage a group of two ranks packed on its node; the greedy tokens of the unsplit
    model."""
    stage = RoleResources(num_cpus=0.5, resources={"large_gpu": 1}, torch_threads=1, tensor_parallel=2)
    config, target_actor, draft_actor, stages = _staged(tmp_path, stage, kv_heads=2)
    try:
        nodes = ray.get([s.node_id.remote() for s in stages])
        assert sorted(nodes) == sorted([cluster["large"].node_id, cluster["large2"].node_id])
        for stage_actor, node in zip(stages, nodes):  # each stage's other rank on the stage's own node
            ranks = ray.get(stage_actor.__ray_call__.remote(lambda self: self._followers))
            assert len(ranks) == 1
            assert ray.get(ranks[0].__ray_call__.remote(
                lambda self: ray.get_runtime_context().get_node_id())) == node
        greedy = SamplingParams(temperature=0.0, ignore_eos=True)
        tokens, stats = served(target_actor, draft_actor, greedy)
        assert tokens == SpeculativeDecoder(config.target, None, dtype="float32").generate(PROMPT, greedy, 30).token_ids
        assert stats.accepted > 0
        assert [ray.get(s.tp_stats.remote())["tensor_parallel"] for s in stages] == [2, 2]
    finally:
        _stop(target_actor, draft_actor, stages)
