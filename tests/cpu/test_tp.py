"""Tensor parallelism (`models.kernels.tp`): a target split over ranks computes what the whole target computes.

The ranks here are threads of this process, each with its own gloo group over a shared HashStore: the same
collectives, sharded weights and step broadcasts as rank processes placed by Ray, in milliseconds.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch
import torch.distributed as dist
from specserve.models import load_model
from specserve.models.kernels.quant import Int4Groups
from specserve.models.kernels.tp import Shard, check, connect
from specserve.models.memory.pool import KVPool
from specserve.scheduler.steps import StepScheduler
from specserve.speculation import rejection
from transformers import LlamaConfig, LlamaForCausalLM

from tests.conftest import perturbed_copy
from tests.cpu.test_batching import CONCURRENT, batched_first_two
from tests.cpu.test_exactness import chi_square_pvalue, target_joint

VOCAB = 41


def tiny(heads: int, kv_heads: int, dtype=torch.float64, vocab: int = VOCAB, scale: float = 0.2,
         attention_bias: bool = False):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
                         initializer_range=scale, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                         attention_bias=attention_bias)
    return LlamaForCausalLM(config).to(dtype).eval()


def run_group(world: int, model_for, run, **pool_args):
    """run(rank 0's pool) with ranks 1.. following in threads; returns (its result, rank 0's counters, the
    followers' step counts). model_for(shard) gives each rank its model (on a GPU: an NCCL group)."""
    store = dist.HashStore()
    followed: dict[int, int] = {}
    models = {rank: model_for(Shard(rank, world)) for rank in range(world)}  # loaded one after another

    def pool(shard: Shard) -> KVPool:
        model = models[shard.rank]
        return KVPool(model, tp=connect(shard, store, next(model.parameters()).device), **pool_args)

    def follower(rank: int) -> None:
        followed[rank] = pool(Shard(rank, world)).follow()

    threads = [threading.Thread(target=follower, args=(rank,)) for rank in range(1, world)]
    for thread in threads:
        thread.start()
    first = pool(Shard(0, world))
    try:
        return run(first), first.tp.stats(), followed
    finally:
        first.close()
        for thread in threads:
            thread.join(timeout=60)


def ragged_steps(pool: KVPool) -> torch.Tensor:
    """Prefill chunks, verify blocks and decode steps of four sequences in shared steps, blocks that outgrow
    their place (moved), a rollback, a sequence freed and a new one in its place, then a decode and a verify
    step of equal widths: every step's logits."""
    rng = random.Random(0)
    seqs = [pool.sequence() for _ in range(4)]
    out = [pool.forward(seqs, [[rng.randrange(VOCAB) for _ in range(n)] for n in (3, 9, 1, 17)], [1, 3, 1, 2])]
    for _ in range(4):
        out.append(pool.forward(seqs, [[rng.randrange(VOCAB) for _ in range(n)] for n in (1, 5, 1, 30)],
                                [1, 5, 1, 1]))
    seqs[1].rollback(4)
    seqs[2].release()
    seqs[2] = pool.sequence()
    out.append(pool.forward(seqs, [[1, 2, 3], [4], [5, 6], [7]], [3, 1, 2, 1]))
    for width in (1, 3):  # a decode step and a verify step: every sequence the same width (runner buckets)
        out.append(pool.forward(seqs, [[rng.randrange(VOCAB) for _ in range(width)] for _ in seqs], [width] * 4))
    return torch.cat(out)


POOL = dict(tokens=1024, max_length=256, min_block=4)


@pytest.mark.parametrize("heads,kv_heads,world,runner", [(4, 2, 2, False), (6, 3, 2, False), (6, 3, 3, False),
                                                        (6, 3, 2, True)])
def test_sharded_forward_equals_the_whole_model(heads, kv_heads, world, runner):
    """Even and uneven head splits (3 KV heads over 2 ranks: 2 + 1), in float64: the same logits to rounding;
    also with the static-shape step runner on every rank (its decode and verify steps)."""
    model = tiny(heads, kv_heads)
    whole = ragged_steps(KVPool(model, **POOL))
    def steps_and_buckets(pool: KVPool):
        return ragged_steps(pool), sorted(pool.runner.buckets) if pool.runner else []

    (logits, buckets), stats, followed = run_group(world, lambda shard: model, steps_and_buckets, runner=runner,
                                                   **POOL)
    assert logits.shape == whole.shape and torch.allclose(logits, whole, atol=1e-10, rtol=0)
    assert len(buckets) == (2 if runner else 0)  # the equal-width steps went through the runner
    steps = 8
    assert followed == {rank: steps for rank in range(1, world)}
    # per step: one all-reduce after o and one after down in each layer, one gather of the head's logits
    assert stats["tp_steps"] == steps and stats["tp_all_reduces"] == 2 * 2 * steps and stats["tp_gathers"] == steps
    new_tokens = 30 + 4 * 37 + 7 + 4 + 12  # every step's new tokens, all sequences
    assert stats["tp_all_reduce_bytes"] == 2 * 2 * new_tokens * 48 * 8


# CUDA runs only where there is a GPU (a device session: `pytest tests -k cuda`); CI has none
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


@pytest.mark.parametrize("device", DEVICES)
def test_a_group_of_one_equals_the_plain_pool(device):
    """The group path with one rank (gloo on a CPU, NCCL on a GPU): the same logits as no group at all."""
    model = tiny(4, 2, torch.float32).to(device)
    plain = ragged_steps(KVPool(model, **POOL))
    grouped, stats, _ = run_group(1, lambda shard: model, ragged_steps, **POOL)
    assert torch.allclose(grouped, plain, atol=1e-5, rtol=0) and stats["tp_all_reduces"] == 2 * 2 * 8


def test_each_rank_holds_its_heads_and_its_share_of_the_kv_pool():
    model = tiny(6, 3)
    whole = KVPool(model, **POOL)
    assert (whole.w.heads, whole.w.kv_heads, whole.k.shape[1]) == (6, 3, 3)
    rank0 = run_group(2, lambda shard: model, lambda pool: (pool.w.heads, pool.w.kv_heads, pool.k.shape[1]), **POOL)
    assert rank0[0] == (4, 2, 2)  # rank 0 of 2: two of the three KV groups


def test_a_dense_rank_keeps_only_its_part_after_loading(tmp_path):
    """Loaded from a checkpoint with a shard, a dense rank builds its part and drops the whole model's linear
    weights (it then holds 1/N of them); the group still computes the whole model's logits."""
    tiny(6, 3, torch.float32).save_pretrained(str(tmp_path))
    whole = ragged_steps(KVPool(load_model(str(tmp_path), "float32").model, **POOL))
    ranks = {}

    def rank_model(shard: Shard):
        ranks[shard.rank] = load_model(str(tmp_path), "float32", shard=shard).model
        return ranks[shard.rank]

    split = run_group(2, rank_model, ragged_steps, **POOL)[0]
    assert torch.allclose(split, whole, atol=1e-4, rtol=0)
    for model in ranks.values():
        assert model.model.layers[0].mlp.down_proj.weight.numel() == 0
        assert model.model.layers[0].self_attn.q_proj.weight.numel() == 0


def _lean_tensors(w) -> list[torch.Tensor]:
    """Every tensor a rank's lean weights multiply or read (dense weights: their tensors)."""
    out = [w.norm, w.head.weight if hasattr(w.head, "weight") else w.head, w.embed]
    for layer in w.layers:
        out += [t.weight if hasattr(t, "weight") else t for t in layer.weights()]
    return out


@pytest.mark.parametrize("tied,max_shard", [(True, None), (False, "40KB")], ids=["tied-one-file", "untied-index"])
def test_a_rank_reads_only_its_slices_of_a_safetensors_checkpoint(tmp_path, tied, max_shard):
    """A dense rank of a safetensors checkpoint (one file, or several under an index) reads its part of every
    layer's linear weights (and biases) and nothing more of them, and ends with the weights the whole model cut
    would give."""
    from specserve.models.families.weights import lean_weights
    from specserve.models.formats import slices

    model = tiny(6, 3, torch.float32, attention_bias=not tied)  # q, k, v biases cut by rows, o's whole
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            p.data.normal_()  # initialised to zeros
    if tied:
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
    model.generation_config.eos_token_id = 7
    model.save_pretrained(str(tmp_path), **({"max_shard_size": max_shard} if max_shard else {}))
    assert (tmp_path / "model.safetensors.index.json").is_file() == (max_shard is not None)
    whole = load_model(str(tmp_path), "float32").model
    files = slices.checkpoint_files(tmp_path)
    for world in (2, 3):
        for rank in range(world):
            shard = Shard(rank, world)
            part = slices.load_rank(tmp_path, files, whole.config, shard, torch.float32, "cpu")
            layer, full = part.model.layers[1], whole.model.layers[1]
            rows = 16 * len(shard.kv_groups(3))  # per KV group: 2 query heads of 48 / 6 = 8 features
            assert layer.self_attn.q_proj.weight.shape == (rows, 48)
            assert layer.self_attn.k_proj.weight.shape == (rows // 2, 48)
            assert layer.self_attn.o_proj.weight.shape == (48, rows)
            assert layer.mlp.down_proj.weight.shape == (48, 96 // world)
            assert torch.equal(layer.mlp.gate_proj.weight, full.mlp.gate_proj.weight[shard.part(96)])
            loaded = load_model(str(tmp_path), "float32", shard=shard)
            sliced = loaded.model
            assert sliced.specserve_shard == shard
            assert loaded.eos_ids == {7}  # from generation_config.json
            assert sliced.model.layers[0].mlp.up_proj.weight.numel() == 0  # dropped once the lean weights hold it
            ours, cut = lean_weights(sliced, torch.float32, shard), lean_weights(whole, torch.float32, shard)
            assert (ours.heads, ours.kv_heads) == (cut.heads, cut.kv_heads)
            assert all(torch.equal(a, b) for a, b in zip(_lean_tensors(ours), _lean_tensors(cut), strict=True))
            with pytest.raises(ValueError, match=f"holds rank {rank} of {world}'s part"):
                lean_weights(sliced, torch.float32)


def test_greedy_decoding_through_the_group_equals_the_whole_model():
    model = tiny(4, 2, torch.float32)

    def greedy(pool: KVPool) -> list[int]:
        seq, tokens = pool.sequence(), [3, 1, 4, 1, 5]
        logits = pool.forward([seq], [tokens], [1])
        for _ in range(24):
            tokens.append(int(logits[-1].argmax()))
            logits = pool.forward([seq], [tokens[-1:]], [1])
        return tokens

    assert run_group(2, lambda shard: model, greedy, **POOL)[0] == greedy(KVPool(model, **POOL))


def test_cached_prefixes_reach_every_rank():
    """Prefix caching under TP: a prefix copied into a new block (copy-on-admit) is copied on every rank's shard
    of the arena before the next step; a taken-over block needs nothing sent."""
    model = tiny(4, 2)
    system, rng = [7] * 20 + list(range(20)), random.Random(1)

    def turns(pool: KVPool) -> torch.Tensor:
        out, first = [], pool.sequence()
        out.append(first.logits_after(system + [1, 2, 3]))
        first.release()
        for tail in ([4, 5], [6, 7, 8]):  # two others with the same system prompt: copied
            seq = pool.sequence()
            out.append(seq.logits_after(system + tail + [rng.randrange(VOCAB) for _ in range(5)], 3))
        again = pool.sequence()  # the first conversation's next turn: taken over
        out.append(again.logits_after(system + [1, 2, 3, 9, 9], 2))
        return torch.cat(out)

    whole = turns(KVPool(model, **POOL))
    rng = random.Random(1)
    logits, stats, _ = run_group(2, lambda shard: model, turns, prefix_caching=True, **POOL)
    assert torch.allclose(logits, whole, atol=1e-10, rtol=0)
    # what was fed: 43, then 7 and 8 after the 40 shared, then 2 after the 43 held (not 43 + 47 + 48 + 45)
    assert stats["tp_all_reduce_bytes"] == 2 * 2 * (43 + 7 + 8 + 2) * 48 * 8


def test_the_embedded_target_split_over_two_ranks():
    """The shipped Q4_1 target (9 heads, 3 KV heads): each rank packs only its part of the file's int4 blocks;
    logits equal the whole model's up to bfloat16 rounding (the partial sums round per rank), same argmax but
    at near-ties, with bf16 or int8 activations (SPECSERVE_CPU_ACTIVATIONS)."""

    def steps(pool: KVPool) -> torch.Tensor:
        seqs = [pool.sequence() for _ in range(2)]
        out = [pool.forward(seqs, [list(range(100, 160)), list(range(200, 233))], [1, 1])]
        for i in range(3):
            out.append(pool.forward(seqs, [[300 + i], [400 + i, 401, 402]], [1, 3]))
        return torch.cat(out)

    whole = steps(KVPool(load_model("embedded").model, 1024))
    split, stats, _ = run_group(2, lambda shard: load_model("embedded", shard=shard).model, steps, tokens=1024)
    assert split.shape == whole.shape == (2 + 3 * 4, 49152)
    diff = (split - whole).abs().max()
    # (bf16 activations: 0.53 of logits up to 33; int8 ones 1.1: a partial sum's rounding can move an int8 code)
    assert diff < 0.05 * whole.abs().max()
    # the same argmax, but where the whole model's top two are within the rounding (how near a tie is depends
    # on the CPU's kernels)
    chosen = whole.gather(1, split.argmax(-1, keepdim=True)).squeeze(1)
    assert (whole.max(-1).values - chosen <= 2 * diff).all()
    assert (split.argmax(-1) == whole.argmax(-1)).float().mean() >= 0.9
    assert stats["tp_all_reduces"] == 4 * 2 * 30


@pytest.mark.parametrize("mode", [dict(temperature=1.0), dict(temperature=0.8, top_k=5)], ids=["T=1", "top-k"])
def test_speculative_tokens_through_the_group_follow_the_target(mode, monkeypatch):
    """Chi-square of the first two tokens, 16 sessions at a time sharing the group's steps (test_batching's
    harness), with the missing-residual negative control."""
    target = tiny(4, 2, vocab=8, scale=0.5)
    draft = perturbed_copy(target, 0.3)
    expected = target_joint(target, mode)

    def sample(pool: KVPool) -> tuple[float, float]:
        scheduler = StepScheduler(pool, expected=lambda: CONCURRENT, gather=0.5)
        try:
            p = chi_square_pvalue(batched_first_two(scheduler, pool, target, draft, mode), expected)
            with monkeypatch.context() as patch:
                patch.setattr(rejection, "residual_distribution", lambda p, q: p)
                broken = chi_square_pvalue(batched_first_two(scheduler, pool, target, draft, mode), expected)
            assert pool.used_tokens == 0 and max(scheduler.sessions_per_step) >= CONCURRENT // 2
            return p, broken
        finally:
            scheduler.close()

    p, broken = run_group(2, lambda shard: target, sample, tokens=CONCURRENT * 64, min_block=8)[0]
    assert p > 1e-3
    assert broken < 1e-3, "the test cannot tell a missing residual step"


def test_splits_that_cannot_be_made_are_refused_by_name():
    config = tiny(6, 3).config
    check(config, 3)
    with pytest.raises(ValueError, match="tensor_parallel: 4 ranks need at least 4 key/value heads"):
        check(config, 4)
    config.intermediate_size = 95
    with pytest.raises(ValueError, match="tensor_parallel: 2 ranks must divide the MLP's 95"):
        check(config, 2)
    with pytest.raises(ValueError, match="tensor_parallel must be >= 1"):
        check(config, 0)
    groups = Int4Groups.quantize(torch.randn(8, 128), 64)
    assert groups.cols(64, 128).codes.shape == (8, 64)
    with pytest.raises(ValueError, match="split int4 groups of 64"):
        groups.cols(0, 32)


@pytest.mark.parametrize("world,kv_heads,expect", [(2, 3, [range(0, 2), range(2, 3)]), (3, 3, [range(i, i + 1)
                                                   for i in range(3)]), (2, 8, [range(0, 4), range(4, 8)])])
def test_kv_groups_cover_every_head_once(world, kv_heads, expect):
    assert [Shard(rank, world).kv_groups(kv_heads) for rank in range(world)] == expect
    assert [Shard(rank, world).vocab(5) for rank in range(world)][-1].stop == 5
