"""Automatic prefix caching in the KV pool: a new sequence starts from what a finished one computed."""

from __future__ import annotations

import random

import pytest
import torch
from specserve.models.memory.pool import KVCacheFull, KVPool
from specserve.models.memory.prefix import CHUNK, PrefixCache

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
    # each sequence's own count (what a served request reports as its cached prompt tokens)
    assert (first.hit_tokens, second.hit_tokens, third.hit_tokens) == (0, len(system), len(held))
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


def test_requests_arriving_together_compute_their_shared_prompt_once(model):
    """n choices of one prompt and a burst behind one system prompt, queued together: the first prefills, the
    others wait for it and copy its keys and values from its running sequence; later arrivals copy from running
    sequences at once; every session's logits are those of a whole prefill."""
    from threading import Event

    from specserve.engine.proposers import TargetVerifier
    from specserve.scheduler.steps import StepScheduler

    pool = KVPool(model, tokens=4096, max_length=256, min_block=16, prefix_caching=True, share_running=True)
    scheduler = StepScheduler(pool, prefill_chunk=32)  # the prompt takes several steps
    system = tokens(5 * CHUNK + 3, 30)
    prompts = [system + [1, 2]] * 3 + [system + tokens(6, 31), system + tokens(4, 32), tokens(90, 33)]
    engines = [TargetVerifier(model, VOCAB, pool.sequence()) for _ in prompts]
    try:
        gate = Event()
        scheduler.call(gate.wait)  # the compute thread is busy until every prefill is queued
        prefills = [scheduler.prefill(engine, prompt) for engine, prompt in zip(engines, prompts)]
        gate.set()
        for future in prefills:
            future.result(timeout=60)
        stats = pool.prefix.stats
        # the two duplicates copied all of the first's prompt, the two others its system prompt; the unrelated
        # prompt (last) shared nothing and prefilled beside them
        assert stats.hit_tokens == 2 * (len(prompts[0]) - 1) + 2 * len(system)
        # three steps for the two prompts that share nothing (32-token chunks), then ONE for the two that waited
        # and still had tokens to feed (not one by one); the duplicates had none
        assert scheduler.sessions_per_step == {2: 4}
        for engine, prompt in zip(engines, prompts):
            got = scheduler.call(engine.seq.logits_after, prompt + [7], 2).result()
            torch.testing.assert_close(got, hf_logits(model, prompt + [7])[-2:], rtol=0, atol=1e-6)
        # a late arrival copies from a running session: more than the cache has (nothing yet)
        late = TargetVerifier(model, VOCAB, pool.sequence())
        before = stats.hit_tokens
        scheduler.prefill(late, prompts[3] + [7, 9]).result(timeout=60)
        assert stats.hit_tokens - before == len(prompts[3]) + 1 and len(pool.prefix) == 0
        for engine in engines + [late]:
            scheduler.call(engine.release).result()
        assert pool.used_tokens == 0

        # n choices of a cached prompt: the first takes the entry over, the others copy from it at once
        again = [TargetVerifier(model, VOCAB, pool.sequence()) for _ in range(3)]
        before = stats.hit_tokens
        gate.clear()
        scheduler.call(gate.wait)
        prefills = [scheduler.prefill(engine, prompts[0] + [7, 5]) for engine in again]
        gate.set()
        for future in prefills:
            future.result(timeout=60)
        assert stats.hit_tokens - before == 3 * (len(prompts[0]) + 1)
        for engine in again:
            got = scheduler.call(engine.seq.logits_after, prompts[0] + [7, 5], 1).result()
            torch.testing.assert_close(got, hf_logits(model, prompts[0] + [7, 5])[-1:], rtol=0, atol=1e-6)
            scheduler.call(engine.release).result()
    finally:
        scheduler.close()


def test_a_copy_from_a_running_sequence_holds_only_its_current_tokens(model):
    """A new sequence copies from a running one only the tokens it holds now (not rows a rejection rolled back),
    and neither is touched by what the other writes afterwards."""
    pool = KVPool(model, tokens=2048, max_length=256, min_block=16, prefix_caching=True, share_running=True)
    prompt = tokens(3 * CHUNK + 4, 40)
    a = pool.sequence()
    a.logits_after(prompt + [1, 2, 3], 3)
    a.rollback(2 * CHUNK + 5)  # rejected back into the prompt
    b = pool.sequence()
    assert b.unfed(prompt + [5], 1) == (prompt + [5])[2 * CHUNK + 5 :] and pool.prefix.stats.hit_tokens == 2 * CHUNK + 5
    branch = prompt[: 2 * CHUNK + 5] + tokens(20, 41)  # a takes another branch over the rows b copied
    torch.testing.assert_close(a.logits_after(branch, 4), hf_logits(model, branch)[-4:], rtol=0, atol=1e-6)
    torch.testing.assert_close(b.logits_after(prompt + [5], 2), hf_logits(model, prompt + [5])[-2:], rtol=0,
                               atol=1e-6)
    a.release()
    b.release()
    assert pool.used_tokens == 0 and pool.shares_running and not pool._running
