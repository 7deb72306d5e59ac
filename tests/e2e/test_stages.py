"""A target split into pipeline stages (`workers.stages`): real stage actors on a local Ray, each with a KV arena
over its layers, steps described by the front's `StagedPool`. Every step's logits must equal one whole-model
pool's over the same sequences: batched prefill of different lengths, decode, verify blocks, rollbacks, blocks
that move as they grow and prefixes copied from running and cached sequences (moves every stage replays)."""

from __future__ import annotations

import pytest
import ray
import torch

from specserve.models import load_model
from specserve.models.pool import KVPool
from specserve.workers.stages import StagedPool, TargetStageActor, stage_bounds, start_stages
from specserve.workers import RoleResources
from tests.conftest import tiny_llama

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
    whole = load_model(target_dir, "float32", quantization=quantization).model
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the stages run: a GEMM's sums may split by thread count
    try:
        expected = _drive(KVPool(whole, TOKENS, prefix_caching=True, share_running=True))
    finally:
        torch.set_num_threads(threads)
    stages = start_stages(target_dir, "float32", quantization, [RoleResources(num_cpus=0.5, torch_threads=1)] * 3,
                          5, TOKENS)
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


def test_stages_sized_unlike_the_worker_are_refused(local_ray, target_dir):
    stage = ray.remote(TargetStageActor).options(num_cpus=0.5).remote(target_dir, "float32", "none", 0, 5, 512)
    try:
        config = load_model(target_dir, "float32").model.config
        with pytest.raises(ValueError, match="kv_cache_tokens"):
            StagedPool([stage], config, TOKENS)
    finally:
        ray.kill(stage)


def test_stage_bounds():
    assert stage_bounds(5, 3) == [(0, 2), (2, 3), (3, 5)]
    assert stage_bounds(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    with pytest.raises(ValueError, match="target_stages"):
        stage_bounds(2, 3)
