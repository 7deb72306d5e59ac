"""A worker's KV memory: one preallocated arena shared by all its sessions, bounded and reused.

`KVPool` holds K and V for `capacity` token positions of every layer
([layers, kv_heads, capacity, head_dim] each) and hands out contiguous
blocks of it with a buddy allocator: block sizes are powers of two, a freed
block merges with its free buddy, and a sequence that outgrows its block
first tries to absorb the free buddy to its right (no copy) before moving
to a bigger block. Memory held is at most twice the tokens cached; the
arena never grows, and a request for more than is free raises `KVCacheFull`
(the worker's callers see RESOURCE_EXHAUSTED). Contiguous blocks keep each
sequence's keys and values a plain view for attention, so a batched forward
(`lean.lean_forward`) reads them without gathering pages.

`PooledSequence` is one sequence's cache in the pool with the usual
`TokenSequence` contract (rollback only shortens its length), so a single
session runs on it exactly as on a private cache, and many run in one
forward through `KVPool.forward`. Steps where every sequence feeds the same
number of tokens (decode, verify) go through a static-shape `StepRunner`
(`models/memory/runner.py`; CUDA graphs on GPUs) where the pool has one: by default
a CUDA pool that is not tensor-parallel; `SPECSERVE_STEP_RUNNER=1` / `=0`
turns it on / off everywhere (`STEP_RUNNER`).

With `prefix_caching`, released sequences' blocks stay as a cache of computed
prefixes that new sequences start from (`models.memory.prefix`), evicted least
recently used when an allocation needs their room.
"""

from __future__ import annotations

import os
import threading

import torch

from specserve.models.families.lean import _fused_layers, lean_forward, lean_weights, widen
from specserve.models.families.sequence import TokenSequence
from specserve.models.kernels import cpu
from specserve.models.kernels.tp import Collective
from specserve.models.memory.prefix import CHUNK, PrefixCache, common_prefix
from specserve.models.memory.runner import StepRunner

# Whether pools get a static-shape step runner; None: CUDA pools without tensor parallelism only (on a CPU, not
# launch-bound, it measured slower from 4 sequences on; graphs around NCCL calls are not checked on a GPU yet).
# The environment reaches worker processes too; tests set this to run through the runner.
STEP_RUNNER: bool | None = {"1": True, "0": False}.get(os.environ.get("SPECSERVE_STEP_RUNNER", ""))


def wants_runner(device: torch.device, tp: Collective | None) -> bool:
    """Whether a pool on `device` gets a step runner when its caller does not say."""
    return STEP_RUNNER if STEP_RUNNER is not None else (device.type == "cuda" and tp is None)


UNKNOWN = -1  # a token a sequence holds whose id is still on the device (`KVPool.feed_ids`)


class KVCacheFull(RuntimeError):
    """The pool cannot hold a sequence's tokens (served as RESOURCE_EXHAUSTED / HTTP 503)."""


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class BuddyAllocator:
    """Offsets into `top_count` top blocks of `top` positions; blocks of min_block·2^k positions."""

    def __init__(self, capacity: int, top: int, min_block: int):
        if top & (top - 1) or min_block & (min_block - 1) or min_block > top:
            raise ValueError("top and min_block must be powers of two with min_block <= top")
        self.top, self.min_block = top, min_block
        self.capacity = (capacity // top) * top
        self.free: dict[int, set[int]] = {top: set(range(0, self.capacity, top))}
        self.used = 0

    def size_for(self, length: int) -> int:
        return max(self.min_block, _next_pow2(length))

    def alloc(self, length: int) -> tuple[int, int] | None:
        """(offset, size) of a free block holding `length` positions, or None."""
        size = self.size_for(length)
        if size > self.top:
            return None
        have = size
        while have <= self.top and not self.free.get(have):
            have *= 2
        if have > self.top:
            return None
        offset = min(self.free[have])  # the lowest: sequences pack to the front, big blocks stay whole
        self.free[have].discard(offset)
        while have > size:  # split, keep the left half, free the right
            have //= 2
            self.free.setdefault(have, set()).add(offset + have)
        self.used += size
        return offset, size

    def grow_in_place(self, offset: int, size: int, length: int) -> int | None:
        """Absorb free right buddies until the block holds `length`; the new size, or None (nothing changed)."""
        want = self.size_for(length)
        absorbed, s = [], size
        while s < want:
            if offset % (2 * s) or (offset + s) not in self.free.get(s, ()):  # our buddy is on the left, or busy
                return None
            absorbed.append(s)
            s *= 2
        for s in absorbed:
            self.free[s].discard(offset + s)
        self.used += want - size
        return want

    def release(self, offset: int, size: int) -> None:
        self.used -= size
        while size < self.top:
            buddy = offset ^ size
            if buddy not in self.free.get(size, ()):
                break
            self.free[size].discard(buddy)
            offset, size = min(offset, buddy), size * 2
        self.free.setdefault(size, set()).add(offset)


class KVPool:
    """K/V arena for many sequences of one model of `models.families.arch`'s families (see the module docstring).

    tokens: positions the arena holds in all (rounded down to whole top blocks); max_length: the longest
    sequence (default: the model's max_position_embeddings). prefix_caching: keep released sequences'
    keys and values for new sequences that start with the same tokens (`models.memory.prefix`); share_running: and
    let them copy a prefix from sequences still running, too (callers that run every step on one thread).
    runner: give it a static-shape step runner (default: `wants_runner`); compile_steps: compile the runner's
    steps, True or "dynamic" (default: `SPECSERVE_COMPILE_STEPS`, `models.memory.runner`).
    layers: (start, end), a pipeline stage's layers only (`workers.stages`): its arena holds those, and its steps
    come described by the pool that keeps the sequences (`run_step`).
    """

    def __init__(self, model, tokens: int, dtype: torch.dtype | None = None, max_length: int | None = None,
                 min_block: int = 32, runner: bool | None = None, max_width: int = 9, tp: Collective | None = None,
                 prefix_caching: bool = False, share_running: bool = False, compile_steps: bool | str | None = None,
                 layers: tuple[int, int] | None = None, features: bool | tuple[int, ...] = False):
        param = next(model.parameters())
        self.tp = tp
        self.staged = layers is not None
        self._concurrent: bool | None = None  # `concurrent_forwards`
        self.w = lean_weights(model, dtype or param.dtype, None if tp is None else tp.shard, layers)
        self.w.tp = tp
        self._keep_sequences(model.config, tokens, max_length, min_block, prefix_caching, share_running)
        # one row past the blocks: where the step runner's padding rows write (never read by a session)
        shape = (len(self.w.layers), self.w.kv_heads, self.allocator.capacity + 1, self.w.head_dim)
        self.k = torch.empty(shape, dtype=self.w.dtype, device=self.w.device)
        self.v = torch.empty_like(self.k)
        # each position's normed final hidden state, for a draft head on the target's features (`models.drafts.head`),
        # or (features: layer ids) the hidden states entering those layers side by side (`models.drafts.eagle3`)
        self.aux_layers = tuple(features) if isinstance(features, (tuple, list)) else None
        width = model.config.hidden_size * (len(self.aux_layers) if self.aux_layers else 1)
        self.features = torch.empty(self.k.shape[2], width, dtype=self.w.dtype, device=self.w.device) \
            if features and self.w.head is not None else None
        runner = False if layers is not None or self.aux_layers else \
            wants_runner(self.w.device, tp) if runner is None else runner
        # max_width: the widest step it takes (a verify of gamma_max + 1 tokens)
        self.runner = StepRunner(self.w, (self.k, self.v), self.max_length, max_width=max_width,
                                 compile=compile_steps, features=self.features) if runner else None

    def _keep_sequences(self, config, tokens: int, max_length: int | None, min_block: int, prefix_caching: bool,
                        share_running: bool) -> None:
        """The bookkeeping half of a pool: its allocator, prefix cache and the moves the other ranks or stages
        replay (a pool whose layers live elsewhere has this half only: `workers.stages.StagedPool`)."""
        self.prefix = PrefixCache() if prefix_caching else None
        # running sequences a new one may copy its prefix from (`attach`); only where every attach and forward
        # runs on one thread (a step scheduler's pool), so the rows copied are not being written meanwhile
        self._running: dict[int, PooledSequence] | None = {} if prefix_caching and share_running else None
        self._moves: list[tuple[int, int, int]] = []  # blocks moved since the last step (for the other ranks)
        self.vocab = config.vocab_size
        max_length = max_length or getattr(config, "max_position_embeddings", None) or 4096
        top = min(_next_pow2(max_length), 1 << (max(tokens, min_block).bit_length() - 1))
        self.allocator = BuddyAllocator(tokens, top, min(min_block, top))
        self.max_length = min(max_length, top)
        self._lock = threading.Lock()  # allocations may come from any thread; forwards from one

    @property
    def replays_moves(self) -> bool:
        """Whether other processes hold parts of this arena and replay its moves at the next step."""
        return self.tp is not None

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    @property
    def fuses_layers(self) -> bool:
        """Whether a one-token step runs each decoder layer as one call of specserve's CPU kernels."""
        w = self.w
        return (self.tp is None and w.kernel_attention and cpu.step_kernels(w.dtype, w.device, w.head_dim)
                and _fused_layers(w, 1) is not None)

    @property
    def bytes_per_token(self) -> int:
        return 2 * len(self.w.layers) * self.w.kv_heads * self.w.head_dim * self.k.element_size()

    @property
    def kv_dtype(self) -> str:
        return str(self.k.dtype).removeprefix("torch.")

    @property
    def cached_tokens(self) -> int:
        """Positions held by the prefix cache's blocks (free for sequences that need them)."""
        return self.prefix.positions if self.prefix is not None else 0

    @property
    def used_tokens(self) -> int:
        """Positions held by sequences' blocks (at most twice the tokens they cache)."""
        return self.allocator.used - self.cached_tokens

    def describe(self) -> dict:
        out = {"kv_capacity_tokens": self.capacity, "kv_used_tokens": self.used_tokens,
               "kv_bytes": self.capacity * self.bytes_per_token, "kv_max_sequence": self.max_length,
               "kv_dtype": self.kv_dtype, "prefix_caching": self.prefix is not None}
        if self.prefix is not None:
            with self._lock:
                out.update(self.prefix.stats.as_dict(), prefix_cache_entries=len(self.prefix),
                           prefix_cache_tokens=self.prefix.tokens, kv_cached_tokens=self.cached_tokens)
        return out

    def sequence(self) -> PooledSequence:
        return PooledSequence(self)

    def reserve(self, seq: PooledSequence, length: int) -> None:
        """Make `seq`'s block hold `length` positions (grow in place, else move); KVCacheFull if it cannot."""
        if seq.block is not None and length <= seq.block[1]:
            return
        if length > self.max_length:
            raise KVCacheFull(f"sequence of {length} tokens exceeds the KV pool's longest ({self.max_length})")
        with self._lock:
            while True:
                if seq.block is not None:
                    grown = self.allocator.grow_in_place(*seq.block, length)
                    if grown is not None:
                        seq.block = (seq.block[0], grown)
                        return
                block = self.allocator.alloc(length)
                if block is not None or not self._evict():
                    break
            if block is None:
                raise KVCacheFull(
                    f"KV cache full: {length} positions wanted, {self.capacity - self.used_tokens} of "
                    f"{self.capacity} free; retry later or raise kv_cache_tokens"
                )
            if seq.block is not None:
                (old, old_size), held = seq.block, len(seq.tokens)
                self._copy(old, block[0], held)
                self.allocator.release(old, old_size)
            elif self._running is not None:
                self._running[id(seq)] = seq
            seq.block = block

    def _evict(self, keep=None) -> bool:
        """Give the least recently used prefix-cache entry's block back (never `keep`); False if there is none."""
        block = self.prefix.evict(keep) if self.prefix is not None else None
        if block is None:
            return False
        self.allocator.release(*block)
        return True

    def _copy(self, old: int, new: int, held: int) -> None:
        """Rows [old, old + held) to [new, new + held), here and (at the next step) on the other ranks."""
        self._move(old, new, held)
        if self.replays_moves:
            self._moves.append((old, new, held))

    def attach(self, seq: PooledSequence, tokens: list[int], limit: int) -> int:
        """Start a new sequence from the cached or running prefix sharing the most of tokens[:limit] (its first feed);
        how many tokens it now holds."""
        wanted = tokens[:limit]
        with self._lock:
            stats = self.prefix.stats
            stats.lookups += 1
            stats.query_tokens += len(wanted)
            entry, n = self.prefix.match(wanted)
            source, m = self._running_match(wanted, n)
            if len(tokens) > self.max_length or (entry is None and source is None):  # (too long: `reserve` says)
                return 0
            if source is not None:  # a running sequence shares more: copied from its block
                block = self._alloc_evicting(len(tokens))
                if block is None:
                    return 0
                self._copy(source.block[0], block[0], m)
                seq.block, n = block, m
            elif n == len(entry.tokens):  # all of it: the sequence takes the block over
                self.prefix.remove(entry)
                seq.block = entry.block
            else:  # part of it: copied into a block of the sequence's own, sized for all its tokens
                block = self._alloc_evicting(len(tokens), keep=entry)
                if block is None:
                    return 0  # no room for a copy: the sequence prefills, and `reserve` says whether it fits
                self._copy(entry.block[0], block[0], n)
                seq.block = block
            seq.tokens = wanted[:n]
            if self._running is not None:
                self._running[id(seq)] = seq
            stats.hit_tokens += n
            seq.hit_tokens = n
            return n

    def _alloc_evicting(self, length: int, keep=None) -> tuple[int, int] | None:
        block = self.allocator.alloc(length)
        while block is None and self._evict(keep=keep):
            block = self.allocator.alloc(length)
        return block

    def _running_match(self, tokens: list[int], beat: int) -> tuple[PooledSequence | None, int]:
        """The running sequence sharing the longest prefix with `tokens`, if that is a CHUNK or more and longer
        than `beat` (what the cache has); (None, 0) otherwise."""
        best, best_len = None, max(beat, CHUNK - 1)
        for other in (self._running or {}).values():
            if other.tokens[:CHUNK] == tokens[:CHUNK]:
                n = common_prefix(other.tokens, tokens)  # (stops at a token still on the device, UNKNOWN)
                if n > best_len:
                    best, best_len = other, n
        return (best, best_len) if best is not None else (None, 0)

    @property
    def shares_running(self) -> bool:
        return self._running is not None

    @property
    def concurrent_forwards(self) -> bool:
        """Whether two threads may run forwards of different sequences at once, each row's values the same on
        any number of threads: a CPU pool whose steps run on specserve's fused layer kernels (each output summed
        by one thread) without a step runner (its static buffers), other ranks or stages."""
        if self._concurrent is None:  # (asked for every queued piece of work: decided once)
            self._concurrent = bool(
                self.runner is None and self.tp is None and not self.staged and self.w.device.type == "cpu"
                and self.w.kernel_attention and cpu.step_kernels(self.w.dtype, self.w.device, self.w.head_dim)
                and _fused_layers(self.w, 1) is not None)
        return self._concurrent

    def cached_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` a new sequence would find now, cached or running (0 without a prefix cache)."""
        if self.prefix is None:
            return 0
        with self._lock:
            n = self.prefix.match(tokens)[1]
            return max(n, self._running_match(tokens, n)[1])

    def _move(self, old: int, new: int, held: int) -> None:
        self.k[:, :, new : new + held] = self.k[:, :, old : old + held]
        self.v[:, :, new : new + held] = self.v[:, :, old : old + held]
        if getattr(self, "features", None) is not None:
            self.features[new : new + held] = self.features[old : old + held]

    def _static_step(self, seqs: list[PooledSequence], new_tokens: list[list[int]], keeps: list[int]
                     ) -> torch.Tensor | None:
        """The step through the runner when it fits a bucket (every sequence feeding the same number of
        tokens); None otherwise. Its rows are copied out of the runner's static output."""
        width = len(new_tokens[0])
        if self.runner is None or any(len(t) != width for t in new_tokens):
            return None
        key = self.runner.bucket_for(len(seqs), width, max(len(s.tokens) for s in seqs) + width)
        if key is None:
            return None
        out = self.runner.forward(key, [s.block[0] for s in seqs], [len(s.tokens) for s in seqs], new_tokens)
        rows = [j * width + r for j, keep in enumerate(keeps) for r in range(width - keep, width)]
        return out[torch.tensor(rows, dtype=torch.long, device=out.device)]

    def free(self, seq: PooledSequence) -> None:
        """Give the sequence's block back: to the prefix cache with the tokens it holds, if there is one."""
        with self._lock:
            if seq.block is None:
                return
            if self._running is not None:
                self._running.pop(id(seq), None)
            blocks = [seq.block]
            if self.prefix is not None:
                held = seq.tokens[: seq.tokens.index(UNKNOWN)] if UNKNOWN in seq.tokens else seq.tokens
                blocks = self.prefix.insert(list(held), seq.block)
            for block in blocks:
                self.allocator.release(*block)
            seq.block = None

    def clear_prefix_cache(self) -> int:
        """Drop every cached prefix; the positions given back."""
        if self.prefix is None:
            return 0
        with self._lock:
            blocks = self.prefix.clear()
            for block in blocks:
                self.allocator.release(*block)
        return sum(size for _, size in blocks)

    @torch.inference_mode()
    def forward(self, seqs: list[PooledSequence], new_tokens: list[list[int]], keeps: list[int],
                host: bool = True) -> torch.Tensor:
        """ONE forward over every sequence's new tokens; head logits of the last keeps[j] of each: [Σ keeps, n],
        on the CPU (host=False: where they were computed, for a caller that reduces them there first).

        Reserve first (`reserve`), so a sequence the pool cannot hold fails alone, before the forward.
        """
        for seq, tokens in zip(seqs, new_tokens):
            if not tokens:
                raise ValueError("feed needs at least one token")
            self.reserve(seq, len(seq.tokens) + len(tokens))
        logits = self._compute(seqs, new_tokens, keeps)
        for seq, tokens in zip(seqs, new_tokens):
            seq.tokens.extend(tokens)
            seq.forward_calls += 1
        return logits.cpu() if host else logits

    def _take_moves(self) -> list[tuple[int, int, int]]:
        with self._lock:
            moves, self._moves = self._moves, []
        return moves

    def _compute(self, seqs: list[PooledSequence], new_tokens: list[list[int]], keeps: list[int]) -> torch.Tensor:
        """The step's logits, the sequences' blocks reserved (the other ranks told first)."""
        if self.tp is not None:  # the other ranks run this step too, on their shards
            self.tp.send_step(self._take_moves(), [seq.block for seq in seqs], [len(seq.tokens) for seq in seqs],
                              new_tokens, keeps)
        logits = self._static_step(seqs, new_tokens, keeps)
        if logits is None:
            logits = lean_forward(self.w, seqs, new_tokens, keeps, (self.k, self.v, [seq.block[0] for seq in seqs]),
                                  features=self.features, aux=self.aux_layers)
        return logits

    @torch.inference_mode()
    def feed_ids(self, seqs: list[PooledSequence], ids: torch.Tensor) -> torch.Tensor:
        """A decode step whose tokens are still on the device (ids: [len(seqs)], one each; a draft's samples):
        head logits [len(seqs), n] on the device, read from nowhere on the host. The sequences hold UNKNOWN (-1)
        in place of these tokens until the caller, having read them back, fills them in."""
        if self.tp is not None:
            raise ValueError("a draft's device-side steps do not run tensor-parallel")
        for seq in seqs:
            self.reserve(seq, len(seq.tokens) + 1)
        blocks, starts = [seq.block[0] for seq in seqs], [len(seq.tokens) for seq in seqs]
        key = self.runner.bucket_for(len(seqs), 1, max(starts) + 1) if self.runner is not None else None
        if key is not None:
            logits = self.runner.forward(key, blocks, starts, ids[:, None])
        else:  # outside the buckets: an eager step, which takes its tokens from the host
            logits = lean_forward(self.w, seqs, [[t] for t in ids.tolist()], [1] * len(seqs), (self.k, self.v, blocks))
        for seq in seqs:
            seq.tokens.append(UNKNOWN)
            seq.forward_calls += 1
        return logits

    def warm_up(self, widths=None, progress=None) -> dict | None:
        """Compile and capture every step shape of the runner before any sequence is served (`StepRunner.warm_up`);
        None where there is no runner."""
        if self.runner is None:
            return None
        if self.used_tokens:
            raise RuntimeError("warm a pool up before it holds sequences (its steps write arena row 0)")
        return self.runner.warm_up(widths, progress)

    def block_kv(self, block: tuple[int, int], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s keys and values over the arena block (offset, size): views, no copy."""
        offset, size = block
        return self.k[layer, :, offset : offset + size], self.v[layer, :, offset : offset + size]

    @torch.inference_mode()
    def follow(self) -> int:
        """A tensor-parallel rank other than 0: run every step rank 0 describes on this rank's shard of the
        weights and of the arena, until rank 0 stops the group (`close`). Returns the steps run."""
        if self.tp is None or self.tp.rank == 0:
            raise ValueError("only a tensor-parallel rank other than 0 follows")
        steps = 0
        while (step := self.tp.receive_step(self.w.dtype, self.w.device)) is not None:
            self.run_step(*step)
            steps += 1
        return steps

    @torch.inference_mode()
    def run_step(self, moves: list, blocks: list, starts: list[int], new_tokens: list[list[int]], keeps: list[int],
                 hidden: torch.Tensor | None = None) -> torch.Tensor:
        """A step the pool keeping the sequences took (a tensor-parallel rank 0, or a staged target's worker),
        on this pool's part of the model: its moves replayed, then the forward over (block, start) pairs.
        hidden: the stage before's output, for a pipeline stage after the first. Returns the logits, or a stage
        before the last its hidden states [Σ new tokens, hidden size]. A stage's tensor-parallel rank 0 tells its
        other ranks first."""
        if hidden is not None:
            hidden = hidden.to(self.w.device, self.w.dtype)
        if self.tp is not None and self.tp.rank == 0:
            self.tp.send_step(moves, blocks, starts, new_tokens, keeps, hidden)
        for move in moves:
            self._move(*move)
        caches = [_Mirror(self, block, start) for block, start in zip(blocks, starts)]
        out = self._static_step(caches, new_tokens, keeps) if hidden is None else None  # rank 0's path, same rule
        if out is None:
            out = lean_forward(self.w, caches, new_tokens, keeps, (self.k, self.v, [block[0] for block in blocks]),
                               hidden)
        return out

    def close(self) -> None:
        """Rank 0 of a tensor-parallel group: end the other ranks' `follow`."""
        if self.tp is not None and self.tp.rank == 0:
            self.tp.stop()


class _Mirror:
    """A sequence as a following rank sees it during one step: its block of this rank's arena, its length."""

    def __init__(self, pool: KVPool, block: tuple[int, int], start: int):
        self.pool, self.block, self.tokens = pool, block, range(start)

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pool.block_kv(self.block, layer)


class PooledSequence(TokenSequence):
    """One sequence's cache in a `KVPool`: a block of the arena and the tokens it holds."""

    def __init__(self, pool: KVPool):
        self.pool = pool
        self.token_subset = pool.w.token_subset
        self.tokens: list[int] = []
        self.block: tuple[int, int] | None = None  # (offset, size) in the arena
        self.forward_calls = 0

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pool.block_kv(self.block, layer)

    def unfed(self, tokens: list[int], keep_logits: int) -> list[int]:
        if self.block is None and self.pool.prefix is not None and len(tokens) - keep_logits >= CHUNK:
            self.pool.attach(self, tokens, len(tokens) - keep_logits)  # a new sequence: from a cached prefix
        return super().unfed(tokens, keep_logits)

    def rollback(self, length: int) -> None:
        del self.tokens[length:]  # rows past `length` are overwritten by the next feed

    def feed_subset(self, new_tokens: list[int], keep_logits: int = 1) -> torch.Tensor:
        return self.pool.forward([self], [new_tokens], [keep_logits])

    def feed(self, new_tokens: list[int], keep_logits: int = 1) -> torch.Tensor:
        return widen(self.feed_subset(new_tokens, keep_logits), self.token_subset, self.pool.vocab)

    def release(self) -> None:
        self.pool.free(self)  # (to the prefix cache with its tokens, where there is one)
        self.tokens = []
