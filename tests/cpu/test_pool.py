"""The KV pool and the batched forward: many sequences in one forward give each its own HF logits."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from specserve.models.memory.pool import BuddyAllocator, KVCacheFull, KVPool

from tests.conftest import tiny_llama

VOCAB = 40


def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([tokens], device=model.device)).logits[0].float()


def test_buddy_allocator_splits_merges_and_grows_in_place():
    a = BuddyAllocator(capacity=256, top=128, min_block=16)
    assert a.capacity == 256
    blocks = [a.alloc(10) for _ in range(16)]  # 16 blocks of 16 fill the arena
    assert all(b is not None and b[1] == 16 for b in blocks) and a.alloc(1) is None
    assert len({b[0] for b in blocks}) == 16 and a.used == 256
    for b in blocks:
        a.release(*b)
    assert a.used == 0 and a.free[128] == {0, 128}  # everything merged back into the two top blocks
    first, second = a.alloc(16), a.alloc(16)
    assert (first, second) == ((0, 16), (16, 16))
    assert a.grow_in_place(*first, 20) is None  # its buddy is taken
    assert a.grow_in_place(*second, 20) is None  # its buddy is on the left
    a.release(*first)
    assert a.grow_in_place(*second, 20) is None
    a.release(*second)
    third = a.alloc(10)
    assert third == (0, 16) and a.grow_in_place(*third, 60) == 64 and a.used == 64  # absorbed 16 and 32, no move
    assert a.alloc(129) is None  # larger than a top block


@pytest.fixture(scope="module")
def model():
    return tiny_llama(5, vocab=VOCAB, layers=2, hidden=32, scale=8)


# CUDA runs only where there is a GPU (a device session: `pytest tests -k cuda`); CI has none
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


@pytest.mark.parametrize("device", DEVICES)
def test_one_forward_over_ragged_sequences_matches_each_alone(model, device):
    model = copy.deepcopy(model).to(device)
    pool = KVPool(model, tokens=1024, max_length=256, min_block=4)
    rng = random.Random(0)
    histories = [[rng.randrange(VOCAB) for _ in range(n)] for n in (3, 9, 1, 17)]
    seqs = [pool.sequence() for _ in histories]
    # prefill each with a different-length chunk in ONE forward, keeping logits of several positions
    keeps = [1, 3, 1, 2]
    logits = pool.forward(seqs, histories, keeps)
    expected = torch.cat([hf_logits(model, h)[-k:] for h, k in zip(histories, keeps)])
    torch.testing.assert_close(logits.cpu(), expected.cpu(), atol=1e-6, rtol=0)
    # rounds: a 1-token step for some, a 4-token verify block for others, rollbacks in between; blocks grow
    for step in range(12):
        chosen = [j for j in range(len(seqs)) if rng.random() < 0.7] or [0]
        new = [[rng.randrange(VOCAB) for _ in range(rng.choice([1, 4]))] for _ in chosen]
        for j in chosen:
            if step % 3 == 2 and len(seqs[j].tokens) > 2:
                seqs[j].rollback(len(seqs[j].tokens) - 2)
                del histories[j][len(seqs[j].tokens):]
        got = pool.forward([seqs[j] for j in chosen], new, [len(t) for t in new])
        for j, tokens in zip(chosen, new):
            histories[j] += tokens
        expected = torch.cat([hf_logits(model, histories[j])[-len(t):] for j, t in zip(chosen, new)])
        torch.testing.assert_close(got.cpu(), expected.cpu(), atol=1e-6, rtol=0)
    assert [s.tokens for s in seqs] == histories
    for s in seqs:
        s.release()
    assert pool.used_tokens == 0


def test_a_full_pool_refuses_clearly_and_reuses_freed_memory(model):
    pool = KVPool(model, tokens=64, max_length=64, min_block=16)
    assert pool.capacity == 64 and pool.describe()["kv_bytes"] == 64 * pool.bytes_per_token
    a, b = pool.sequence(), pool.sequence()
    a.feed(list(range(30)))  # a block of 32
    b.feed(list(range(20)))  # another 32: the pool is full
    c = pool.sequence()
    with pytest.raises(KVCacheFull, match="KV cache full"):
        c.feed([1, 2, 3])
    with pytest.raises(KVCacheFull, match="longest"):
        pool.reserve(c, 65)
    assert c.tokens == [] and c.block is None
    expected = hf_logits(model, list(range(20)) + [7])[-1:]
    a.release()
    torch.testing.assert_close(c.feed([1, 2, 3]), hf_logits(model, [1, 2, 3])[-1:], atol=1e-6, rtol=0)
    torch.testing.assert_close(b.feed([7]), expected, atol=1e-6, rtol=0)  # b's cache untouched by a and c


def test_a_growing_sequence_keeps_its_cache_when_its_block_moves(model):
    pool = KVPool(model, tokens=256, max_length=256, min_block=8)
    blocker, seq = pool.sequence(), pool.sequence()
    seq.feed([1, 2, 3])
    blocker.feed([4])  # likely sits right of seq, so seq must move to grow
    history = [1, 2, 3]
    for t in range(5, 45):
        history.append(t % VOCAB)
        torch.testing.assert_close(seq.feed([t % VOCAB]), hf_logits(model, history)[-1:], atol=1e-6, rtol=0)
    assert seq.block[1] == 64
