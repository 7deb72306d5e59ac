"""Automatic prefix caching in the KV pool: a new sequence starts from what a finished one computed."""

from __future__ import annotations

import random

import pytest
import torch

from specserve.models.pool import KVCacheFull, KVPool
from specserve.models.prefix import CHUNK, PrefixCache
from tests.conftest import tiny_llama

VOCAB = 40


def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0].float()


@pytest.fixture(scope="module")
def model():
    return tiny_llama(7, vocab=VOCAB, layers=2, hidden=32, scale=8)


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def test_index_finds_the_longest_prefix_and_keeps_no_entry_another_covers():
    cache = PrefixCache()
    system = tokens(3 * CHUNK + 5, 0)
    a, b = system + tokens(20, 1), system + tokens(9, 2)
    assert cache.insert(a, (0, 128)) == [] and cache.insert(b, (128, 64)) == []
    entry, n = cache.match(system + tokens(30, 3))
    assert entry is not None and n >= len(system) and entry.tokens[:n] == (system + tokens(30, 3))[:n]
    assert cache.match(a[:60] + [VOCAB])[0].block == (0, 128)  # the longest shared prefix wins
    assert cache.match(tokens(CHUNK - 1, 0)) == (None, 0)  # under one chunk: not worth a lookup
    assert cache.match(tokens(100, 9)) == (None, 0)
    # a shorter sequence an entry already holds gives its own block straight back
    assert cache.insert(a[:-3], (192, 64)) == [(192, 64)] and len(cache) == 2
    # a longer one that holds all of an entry replaces it
    assert cache.insert(a + tokens(7, 4), (256, 256)) == [(0, 128)] and len(cache) == 2
    # least recently used first; a match counts as a use
    cache.match(b)
    assert cache.evict() == (256, 256) and cache.evict(keep=cache.match(b)[0]) is None
    assert cache.stats.evictions == 1 and cache.evict() == (128, 64) and len(cache) == 0 and cache.index == {}


def test_a_cached_prefix_gives_the_logits_of_a_whole_prefill(model):
    pool = KVPool(model, tokens=2048, max_length=256, min_block=16, prefix_caching=True)
    system = tokens(2 * CHUNK + 3, 10)
    first = pool.sequence()
    history = system + tokens(6, 11)
    first.logits_after(history)
    first.logits_after(history + [5, 6, 7], 3)  # a verify block
    first.rollback(len(history) + 1)  # two of it rejected
    held, block = list(first.tokens), first.block
    first.release()
    assert pool.used_tokens == 0 and pool.cached_tokens == block[1]

    # another request with the same system prompt: the shared rows are copied, the rest fed
    other = system + tokens(9, 12)
    second = pool.sequence()
    assert second.unfed(other, 1) == other[len(system) :]  # only what follows the shared prefix is left
    assert second.block != block and len(second.tokens) == len(system)
    logits = second.feed(other[len(system) :], len(other) - len(system))
    torch.testing.assert_close(logits, hf_logits(model, other)[len(system) :], rtol=0, atol=1e-6)

    # the next turn of the first conversation: the whole entry is taken over, no copy
    turn = held + tokens(5, 13)
    third = pool.sequence()
    torch.testing.assert_close(third.logits_after(turn, 4), hf_logits(model, turn)[-4:], rtol=0, atol=1e-6)
    assert third.block[0] == block[0] and len(pool.prefix) == 0
    stats = pool.describe()
    assert stats["prefix_cache_hit_tokens"] == len(system) + len(held)
    assert stats["prefix_cache_query_tokens"] == len(history) - 1 + len(other) - 1 + len(turn) - 4
    for seq in (second, third):
        seq.release()
    assert pool.used_tokens == 0 and len(pool.prefix) == 2


def test_a_rolled_back_sharer_leaves_the_others_untouched(model):
    pool = KVPool(model, tokens=2048, max_length=256, min_block=16, prefix_caching=True)
    prompt = tokens(3 * CHUNK, 20)
    seed = pool.sequence()
    seed.logits_after(prompt + [0])
    seed.release()
    a, b = pool.sequence(), pool.sequence()
    tail_a, tail_b = [1, 2, 3, 4], [2, 3, 4, 5]
    a.logits_after(prompt + tail_a)
    b.logits_after(prompt + tail_b)
    a.rollback(CHUNK)  # a rejection deep into the shared prefix; then a different branch overwrites a's rows
    branch = prompt[:CHUNK] + tokens(2 * CHUNK + 6, 23)
    torch.testing.assert_close(a.logits_after(branch, 3), hf_logits(model, branch)[-3:], rtol=0, atol=1e-6)
    more = prompt + tail_b + [9, 8]
    torch.testing.assert_close(b.logits_after(more, 2), hf_logits(model, more)[-2:], rtol=0, atol=1e-6)
    late = pool.sequence()  # the entry itself is intact too
    torch.testing.assert_close(late.logits_after(prompt + [3]), hf_logits(model, prompt + [3])[-1:], rtol=0,
                               atol=1e-6)
    assert pool.prefix.stats.hit_tokens == 3 * len(prompt)


def test_eviction_keeps_the_pool_from_filling(model):
    pool = KVPool(model, tokens=1024, max_length=256, min_block=16, prefix_caching=True)
    running = []
    for i in range(40):  # 40 distinct conversations of ~100 tokens through a pool that holds 8 blocks of 128
        seq = pool.sequence()
        seq.logits_after(tokens(90 + i % 7, 100 + i))
        if i % 10 == 0:
            running.append(seq)  # some stay open the whole time
        else:
            seq.release()
        assert pool.used_tokens + pool.cached_tokens <= pool.capacity
    stats = pool.describe()
    assert stats["prefix_cache_evictions"] >= 40 - 8 and stats["prefix_cache_entries"] <= 8 - len(running)
    assert stats["kv_used_tokens"] == 128 * len(running)
    # the open sequences were never evicted under: they still give whole-prefill logits
    for i, seq in zip(range(0, 40, 10), running):
        history = tokens(90 + i % 7, 100 + i) + [4]
        torch.testing.assert_close(seq.logits_after(history), hf_logits(model, history)[-1:], rtol=0, atol=1e-6)
    # with the running sequences holding everything, a new one fails cleanly and evicts nothing of theirs
    hogs = [pool.sequence() for _ in range(8 - len(running))]
    for hog in hogs:
        hog.logits_after(tokens(100, 999))
    assert len(pool.prefix) == 0
    with pytest.raises(KVCacheFull):
        pool.sequence().logits_after(tokens(50, 1000))
    pool.clear_prefix_cache()
    for seq in running + hogs:
        seq.release()
    assert pool.used_tokens == 0 and pool.clear_prefix_cache() > 0 and pool.allocator.used == 0


def test_off_keeps_nothing(model):
    pool = KVPool(model, tokens=1024, max_length=256, min_block=16)
    seq = pool.sequence()
    seq.logits_after(tokens(60, 1))
    seq.release()
    assert pool.allocator.used == 0 and "prefix_cache_hit_tokens" not in pool.describe()
    again = pool.sequence()
    assert again.unfed(tokens(60, 1), 1) == tokens(60, 1) and again.block is None
