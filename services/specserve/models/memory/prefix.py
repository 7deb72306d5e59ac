"""Automatic prefix caching: what finished sequences computed, kept in the KV pool and found by token prefix.

When a sequence of a `KVPool` is released, its block stays in the arena as an *entry* (its tokens and
block) instead of going back to the allocator. A new sequence's first feed looks its tokens up; the entry
sharing the longest prefix with them (at least one `CHUNK`) supplies that prefix's keys and values, so only
the rest is prefilled:

- the whole entry matched (the next turn of a conversation, a session resumed): the sequence takes the
  entry's block as its own, no copy; the entry leaves the cache and comes back, longer, when the
  sequence ends;
- part of it matched (another request with the same system prompt): the matched rows are copied into a
  block of the sequence's own (copy-on-admit). The pool stays contiguous, so attention reads plain views;
  the cost is one copy of the prefix's K and V (23 KB a token for the embedded target in bf16), against a
  forward over those tokens without it.

The index hashes each entry's tokens in chunks of `CHUNK` along the prefix chain (the hash of chunk k
covers tokens 0 .. k·CHUNK), as vLLM's block hashes do; a lookup walks the new tokens' chain to the
deepest chunk any entry holds, then compares tokens (hashes only narrow the search). Entries are evicted
least recently used, and only when the pool needs room (`KVPool.reserve`); a running sequence's block is
never an entry, so nothing a session reads is evicted under it. An entry that is a prefix of a newer one
is dropped when the newer one arrives (it can serve nothing the newer cannot).

A pool that runs every step on one thread (the target's) also lets a new sequence copy from a running one
that shares more (`KVPool.attach`, `share_running`), and its scheduler holds a new prefill back while a
prefill ahead of it computes the same tokens (`StepScheduler._follows`): requests that arrive together (n > 1
choices, a burst behind one system prompt) compute their shared prompt once.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

CHUNK = 16  # tokens per hashed chunk; the shortest prefix worth reusing


@dataclass
class Entry:
    tokens: list[int]
    block: tuple[int, int]  # (offset, size) in the pool's arena
    hashes: list[int] = field(default_factory=list)  # chain hash after each whole chunk


@dataclass
class PrefixStats:
    lookups: int = 0  # sequences looked up
    query_tokens: int = 0  # tokens they asked for (what a cache could at most supply)
    hit_tokens: int = 0  # tokens supplied from the cache
    evictions: int = 0  # entries evicted for room

    def as_dict(self) -> dict[str, float]:
        return {"prefix_cache_lookups": self.lookups, "prefix_cache_query_tokens": self.query_tokens,
                "prefix_cache_hit_tokens": self.hit_tokens, "prefix_cache_evictions": self.evictions,
                "prefix_cache_hit_rate": round(self.hit_tokens / self.query_tokens, 4) if self.query_tokens else 0.0}


def chain(tokens: list[int]) -> list[int]:
    """The chain hash after each whole CHUNK of `tokens` (Python hashes ints and tuples of ints the same in every
    process)."""
    out, h = [], 0
    for end in range(CHUNK, len(tokens) + 1, CHUNK):
        h = hash((h, tuple(tokens[end - CHUNK : end])))
        out.append(h)
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two token lists (compared CHUNK at a time: list slices compare in C)."""
    n, i = min(len(a), len(b)), 0
    while i + CHUNK <= n and a[i : i + CHUNK] == b[i : i + CHUNK]:
        i += CHUNK
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """The entries of one pool, by chain hash and in LRU order. Not thread-safe: the pool holds its lock."""

    def __init__(self):
        self.entries: OrderedDict[int, Entry] = OrderedDict()  # by id(entry), least recently used first
        self.index: dict[int, dict[int, Entry]] = {}  # chain hash -> the entries whose chain has it
        self.stats = PrefixStats()

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def positions(self) -> int:
        """Arena positions the entries' blocks hold."""
        return sum(e.block[1] for e in self.entries.values())

    @property
    def tokens(self) -> int:
        return sum(len(e.tokens) for e in self.entries.values())

    def match(self, tokens: list[int], hashes: list[int] | None = None) -> tuple[Entry | None, int]:
        """The entry sharing the longest prefix with `tokens` (the newest of equals) and that length; (None, 0)
        below one CHUNK. The entry counts as used now (LRU)."""
        hashes = chain(tokens) if hashes is None else hashes
        depth = 0
        while depth < len(hashes) and hashes[depth] in self.index:
            depth += 1
        if depth == 0:
            return None, 0
        start = depth * CHUNK
        best, best_len = None, 0
        for entry in reversed(self.index[hashes[depth - 1]].values()):
            if entry.tokens[:start] != tokens[:start]:
                continue  # a hash collision
            n = common_prefix(entry.tokens, tokens)
            if n > best_len or best is None:
                best, best_len = entry, n
        if best is not None:
            self.entries.move_to_end(id(best))
        return best, best_len

    def insert(self, tokens: list[int], block: tuple[int, int]) -> list[tuple[int, int]]:
        """Keep a released sequence's tokens and block; the blocks that are now free (the new entry's own if an
        entry already holds all its tokens, or older entries it holds all of)."""
        hashes = chain(tokens)
        if not hashes:
            return [block]
        entry = Entry(tokens, block, hashes)
        if self.match(tokens, hashes)[1] == len(tokens):  # an entry holds all of these already
            return [block]
        freed = []
        for depth, h in enumerate(hashes):  # older entries that are prefixes of this one end at some chunk of its
            for older in [e for e in self.index.get(h, {}).values() if len(e.hashes) == depth + 1]:
                if len(older.tokens) <= len(tokens) and tokens[: len(older.tokens)] == older.tokens:
                    self.remove(older)
                    freed.append(older.block)
        self.entries[id(entry)] = entry
        for h in hashes:
            self.index.setdefault(h, {})[id(entry)] = entry
        return freed

    def remove(self, entry: Entry) -> None:
        del self.entries[id(entry)]
        for h in entry.hashes:
            holders = self.index[h]
            del holders[id(entry)]
            if not holders:
                del self.index[h]

    def evict(self, keep: Entry | None = None) -> tuple[int, int] | None:
        """Drop the least recently used entry (never `keep`); its block, or None when there is none to drop."""
        for entry in self.entries.values():
            if entry is not keep:
                self.remove(entry)
                self.stats.evictions += 1
                return entry.block
        return None

    def clear(self) -> list[tuple[int, int]]:
        blocks = [e.block for e in self.entries.values()]
        self.entries.clear()
        self.index.clear()
        return blocks
