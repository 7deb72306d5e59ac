"""A target split into pipeline stages (`workers.stages`): real stage actors on a local Ray, each with a KV arena
over its layers, steps described by the front's `StagedPool`. Every step's logits must equal one whole-model
pool's over the same sequences: batched prefill of different lengths, decode, verify blocks, rollbacks, blocks
that move as they grow and prefixes copied from running and cached sequences (moves every stage replays)."""

from __future__ import annotations

import pytest
import ray
import torch
from specserve import SamplingParams, SpeculativeDecoder
from specserve.models import load_model
from specserve.models.memory.pool import KVPool
from specserve.workers import RoleResources, WorkersConfig
from specserve.workers.launch import release_workers, start_workers
from specserve.workers.stages import StagedPool, TargetStageActor, stage_bounds, start_stages

from tests.conftest import perturbed_copy, tiny_llama
from tests.e2e.test_ray_workers import PROMPT, served

TOKENS = 1024  # each arena's positions: blocks of 32..512, so sequences move as they grow


@pytest.fixture(scope="module")
def local_ray():
    ray.init(address="local", include_dashboard=False, num_cpus=4, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("staged") / "target"
    tiny_llama(3, vocab=96, layers=5, hidden=64, heads=4, kv_heads=2, scale=8, dtype=torch.float32).save_pretrained(
        str(path))
    return str(path)


def _whole(target_dir: str, quantization: str = "none") -> list[torch.Tensor]:
    """`_drive` on one pool of the whole model, one thread as the stages run (a GEMM's sums may split by thread
    count)."""
    whole = load_model(target_dir, "float32", quantization=quantization).model
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _drive(KVPool(whole, TOKENS, prefix_caching=True, share_running=True))
    finally:
        torch.set_num_threads(threads)


def _drive(pool: KVPool) -> list[torch.Tensor]:
    """The same calls on any pool; every step's logits."""
    gen = torch.Generator().manual_seed(0)
    shared = torch.randint(0, 96, (48,), generator=gen).tolist()
    prompts = [shared + torch.randint(0, 96, (n,), generator=gen).tolist() for n in (10, 27, 3)]
    out = []
    a, b = pool.sequence(), pool.sequence()
    out.append(pool.forward([a, b], [prompts[0], prompts[1][:20]], [1, 2]))  # different lengths in one step
    c = pool.sequence()
    assert pool.attach(c, prompts[1], len(prompts[1]) - 1) >= 32  # copied from running `a` (a move)
    out.append(pool.forward([b, c], [prompts[1][20:], prompts[1][len(c.tokens):]], [1, 1]))
    for step in range(40):  # decode and verify blocks; a outgrows its block (moves), rollbacks in between
        widths = [1 + (step + j) % 4 for j in range(3)]
        blocks = [[(7 * step + 3 * j + i) % 96 for i in range(w)] for j, w in enumerate(widths)]
        out.append(pool.forward([a, b, c], blocks, widths))
        if step % 3 == 0:
            b.rollback(len(b.tokens) - widths[1] + 1)
    out.append(pool.forward([a], [list(range(40))], [3]))  # a prefill chunk beside nothing
    again = a.tokens[:70] + [5]
    a.release()
    d = pool.sequence()
    assert pool.attach(d, again, len(again) - 1) >= 64  # from the prefix cache
    out.append(pool.forward([d, c], [again[len(d.tokens):], [1, 2]], [1, 2]))
    for seq in (b, c, d):
        seq.release()
    return out


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_staged_steps_equal_the_whole_model(local_ray, target_dir, quantization):
    whole = load_model(target_dir, "float32").model
    expected = _whole(target_dir, quantization)
    stages, groups = start_stages(target_dir, "float32", quantization,
                                  [RoleResources(num_cpus=0.5, torch_threads=1)] * 3, 5, TOKENS)
    assert groups == []
    try:
        assert ray.get([s.layers.remote() for s in stages]) == [(0, 2), (2, 3), (3, 5)]
        pool = StagedPool(stages, whole.config, TOKENS, prefix_caching=True, share_running=True)
        got = _drive(pool)
        assert len(got) == len(expected)
        for step, (g, e) in enumerate(zip(got, expected)):
            assert torch.equal(g, e), f"step {step}: max |diff| {(g - e).abs().max()}"
        assert pool.used_tokens == 0 and pool.describe()["kv_dtype"] == "float32"
        assert pool.bytes_per_token == KVPool(whole, 64).bytes_per_token  # the stages' arenas add up to one
    finally:
        for stage in stages:
            ray.kill(stage)


def test_a_stage_split_over_tensor_parallel_ranks(local_ray, target_dir):
    """Stage 1 of 2 as a group of two ranks (gloo): the same logits up to float32 rounding (the split sums in
    another order), and per step one all-reduce pair per layer of the stage and one gather of the logits."""
    expected = _whole(target_dir)
    config = load_model(target_dir, "float32").model.config
    plain = RoleResources(num_cpus=0.5, torch_threads=1)
    split = RoleResources(num_cpus=0.5, torch_threads=1, tensor_parallel=2)
    stages, groups = start_stages(target_dir, "float32", "none", [plain, split], 5, TOKENS)
    try:
        assert len(groups) == 1 and ray.get([s.layers.remote() for s in stages]) == [(0, 2), (2, 5)]
        pool = StagedPool(stages, config, TOKENS, prefix_caching=True, share_running=True)
        assert [g["tensor_parallel"] for g in pool.geometry] == [1, 2]
        got = _drive(pool)
        for step, (g, e) in enumerate(zip(got, expected)):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5, msg=lambda m: f"step {step}: {m}")
        stats = ray.get(stages[1].tp_stats.remote())
        assert stats["tp_steps"] == len(got) and stats["tp_all_reduces"] == 2 * 3 * len(got)
        assert stats["tp_gathers"] == len(got)  # the last stage's head, vocabulary-parallel
    finally:
        for stage in stages:
            ray.kill(stage)
        for group in groups:
            ray.util.remove_placement_group(group)


def test_served_through_stages_with_a_tensor_parallel_stage(local_ray, target_dir, tmp_path):
    """The worker API over two stages, the second split over two ranks: the greedy tokens of the unsplit model
    (a model draft in a worker of its own proposing)."""
    perturbed_copy(load_model(target_dir, "float32").model, 0.05).save_pretrained(str(tmp_path / "draft"))
    config = WorkersConfig(
        target=target_dir, draft=str(tmp_path / "draft"), dtype="float32", kv_cache_tokens=TOKENS,
        draft_resources=RoleResources(num_cpus=0.5, torch_threads=1),
        target_resources=RoleResources(num_cpus=0.25, torch_threads=1),
        target_stages=[RoleResources(num_cpus=0.5, torch_threads=1),
                       RoleResources(num_cpus=0.5, torch_threads=1, tensor_parallel=2)],
    )
    target_actor, draft_actor = start_workers(config)
    stages = ray.get(target_actor.__ray_call__.remote(lambda self: self.stages))
    try:
        greedy = SamplingParams(temperature=0.0, ignore_eos=True)
        tokens, stats = served(target_actor, draft_actor, greedy)
        assert tokens == SpeculativeDecoder(target_dir, None, dtype="float32").generate(PROMPT, greedy, 30).token_ids
        assert stats.accepted > 0
        info = ray.get(target_actor.info.remote())
        assert info["stages"] == 2 and info["kv_used_tokens"] == 0 and info["steps"] > 0
    finally:
        for actor in (target_actor, draft_actor, *stages):
            ray.kill(actor)
        release_workers(target_actor)


def test_stages_sized_unlike_the_worker_are_refused(local_ray, target_dir):
    stage = ray.remote(TargetStageActor).options(num_cpus=0.5).remote(target_dir, "float32", "none", 0, 5, 512)
    try:
        config = load_model(target_dir, "float32").model.config
        with pytest.raises(ValueError, match="kv_cache_tokens"):
            StagedPool([stage], config, TOKENS)
    finally:
        ray.kill(stage)


@pytest.mark.parametrize("tied", [False, True])
def test_a_stage_reads_only_its_part_of_a_checkpoint(tmp_path, tied):
    """From safetensors, a stage reads its layers, the first also the embedding, the last the norm and the head
    (a tied head: the embedding); nothing else. Its lean weights equal those of the whole model loaded."""
    from specserve.models.families.weights import lean_weights

    model = tiny_llama(3, vocab=96, layers=5, hidden=64, heads=4, kv_heads=2, scale=8, dtype=torch.float32)
    if tied:
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
    model.save_pretrained(str(tmp_path))
    whole = lean_weights(load_model(str(tmp_path), "float32").model, torch.float32)
    for start, end in stage_bounds(5, 3):
        part = load_model(str(tmp_path), "float32", layers=(start, end)).model
        body = part.model
        assert [i for i, layer in enumerate(body.layers) if layer.input_layernorm.weight.numel()] == \
            list(range(start, end))
        assert (body.embed_tokens.weight.numel() > 0) == (start == 0 or (tied and end == 5))
        assert (body.norm.weight.numel() > 0) == (end == 5)  # (the head: in the lean weights, below)
        w = lean_weights(part, torch.float32, None, (start, end))
        for mine, theirs in zip(w.layers, whole.layers[start:end]):
            assert (mine.window, mine.rope) == (theirs.window, theirs.rope)
            for a, b in zip(mine.weights(), theirs.weights(), strict=True):
                assert torch.equal(a, b)
        assert (w.head is None) == (end < 5) and (end < 5 or torch.equal(w.head, whole.head))
        with pytest.raises(ValueError, match="holds layers"):
            KVPool(part, 64, layers=(0, 5))


def test_stage_bounds():
    assert stage_bounds(5, 3) == [(0, 2), (2, 3), (3, 5)]
    assert stage_bounds(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    with pytest.raises(ValueError, match="target_stages"):
        stage_bounds(2, 3)
