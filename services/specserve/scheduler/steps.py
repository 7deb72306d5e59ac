"""The target's step scheduler: ONE forward per step over the ready work of every session.

Sessions (gRPC handler threads, or any caller) submit work and wait on a
future; one compute thread owns torch and runs steps:

1. wait for work, and briefly for the sessions it knows of to catch up (a
   session whose verdict just came back needs a moment to send its next
   block; without the wait, sessions split into two cohorts and every step
   carries half the batch);
2. take ready work in arrival order up to `max_step_tokens`: verify blocks
   (a session's γ+1 new tokens, whole) and prefill chunks (at most
   `prefill_chunk` tokens of one prompt per step, so a long prompt shares
   steps with running sessions instead of freezing them);
3. ONE forward over all of it (`KVPool.forward`: matmuls over every new
   token, attention per session over its own cache), then acceptance for
   every session at once (`engine.proposers.judge_many`: the `speculation/`
   rules, batched over the step's blocks).

A draft that runs in the same process (colocated: the target worker owns
both models) submits its steps here too (`ScheduledSequence`): every
session's next draft token in ONE draft forward. Draft steps go first — they
are cheap, and a session that finishes drafting joins the next target step —
so a round is a few batched draft steps and one batched target step. Where the draft's steps replay CUDA
graphs, each session submits its whole block instead, and the queued blocks are drafted together on the
device (`scheduler.drafting`).

Each session's tokens depend only on its own inputs and its position-keyed
randomness, never on who shares its step: the forward computes every row
from that session's cache alone. (In floating point, a batched matmul may
round a row differently from a batch of one; at near-ties in bf16 that can
change a greedy token, as with every batched engine. Tests use float64.)

Models the pooled forward does not cover run the same queue one session at a
time on their own caches (`pool=None`): no batching, same results.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from specserve.engine.proposers import Proposal, TargetVerifier, judge_many
from specserve.engine.stats import StepInfo
from specserve.models.families.sequence import TokenSequence
from specserve.models.memory.pool import KVCacheFull, KVPool
from specserve.models.memory.prefix import CHUNK, common_prefix
from specserve.scheduler.drafting import DraftBlock, DraftedBlock, draft_blocks, room
from specserve.scheduler.threads import one_torch_thread, torch_threads
from specserve.speculation import PositionRNG, SamplingParams, Verdict


@dataclass
class _Work:
    seq: Any  # the cache this work feeds: a session's target sequence, or its draft's
    pool: KVPool | None  # the pool `seq` lives in (None: fed on its own through its model's forward)
    kind: str  # "prefill", "verify", "feed" (a draft step) or "block" (a draft's whole block, `scheduler.drafting`)
    tokens: list[int]  # prefill, verify: what the cache must hold afterwards; feed: the tokens to append
    future: Future
    keep: int = 0  # logits wanted back (verify: k+1)
    verify: tuple | None = None  # (TargetVerifier, context length, proposal, params, rng)
    block: DraftBlock | None = None
    started: bool = False  # a prefill: a chunk of it has been fed
    held: bool = False  # waiting for KV memory; skipped until a call (a session's release) or a retry tick
    busy: bool = False  # in a lane's step (`StepScheduler.lanes`)
    waiting_since: float | None = None


_LIVE: "weakref.WeakSet[StepScheduler]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """Stop every compute thread before the interpreter tears down (a torch op left running then can crash it)."""
    for scheduler in list(_LIVE):
        scheduler.close()


class StepScheduler:
    """Runs submitted work in batched steps on one compute thread (see the module docstring).

    pool: the target's KV pool (None: target work runs one session at a time). expected: how many sessions
    are open (a target step waits up to `gather` × the last step's time for that many to be ready).
    """

    def __init__(self, pool: KVPool | None = None, *, max_step_tokens: int = 512, prefill_chunk: int = 256,
                 gather: float = 0.1, expected: Callable[[], int] | None = None, threads: int | None = None,
                 kv_wait_s: float = 60.0, lanes: int | None = None, lane_sessions: int = 8):
        if max_step_tokens < 1 or prefill_chunk < 1:
            raise ValueError("max_step_tokens and prefill_chunk must be >= 1")
        self.pool = pool
        self.max_step_tokens = max_step_tokens
        self.prefill_chunk = prefill_chunk
        self.gather = gather
        self.expected = expected or (lambda: 0)
        self.kv_wait_s = kv_wait_s
        self.threads = threads
        self.steps = 0
        self.draft_steps = 0
        self.fused_blocks = 0  # draft steps run as whole blocks (`_draft`)
        self.last_step_s = 0.0
        self.sessions_per_step: Counter[int] = Counter()  # how many sessions shared each target step
        self.lane_steps: Counter[int] = Counter()  # target steps each lane ran (`lanes`)
        self.sessions_per_draft_step: Counter[int] = Counter()  # and each draft step (a colocated draft)
        self._work: deque[_Work] = deque()
        self._calls: deque[tuple[Callable, tuple, Future]] = deque()
        lock = threading.RLock()
        self._cond = threading.Condition(lock)  # the first lane waits on it (for work, calls, other lanes' steps)
        self._wake = threading.Condition(lock)  # the other lanes wait on it: woken only while split
        self._select = threading.Lock()  # one lane at a time picks (and claims) its step's work
        self._closed = False
        # lanes: with lane_sessions or more sessions open (and a pool that allows it), `lanes` compute threads
        # each step their own share of the sessions on threads / lanes cores, so that another process taking a
        # core stalls one lane, not every thread of one step at its next barrier (docs/benchmarks.md); None: 2
        # where there are 2 threads or more
        self.lanes, self.lane_sessions = lanes, lane_sessions
        self._split = False
        self._helpers_busy = 0
        self._helpers: list[threading.Thread] = []  # started at the first split
        self._thread = threading.Thread(target=self._loop, name="specserve-compute", daemon=True)
        self._thread.start()
        _LIVE.add(self)

    @property
    def lane_count(self) -> int:
        """The compute threads the sessions are split among under load (`lanes`, resolved; at most one a thread)."""
        threads = max(1, self.threads or 1)
        return min(max(1, self.lanes), threads) if self.lanes is not None else min(2, threads)

    @property
    def _lane_threads(self) -> int:
        return max(1, (self.threads or 1) // self.lane_count)

    @property
    def _share(self) -> int:
        """The most sessions a lane's step takes while split."""
        return -(-self.expected() // self.lane_count)

    # -- submitting ------------------------------------------------------------
    def call(self, fn: Callable[..., Any], *args) -> Future:
        """Run fn(*args) on the compute thread between steps (every torch op of a worker goes through here)."""
        future: Future = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the step scheduler is stopped")
            self._calls.append((fn, args, future))
            self._cond.notify()
        return future

    def prefill(self, engine: TargetVerifier, prompt: list[int]) -> Future:
        """Bring the session's cache to all of `prompt` but its last token (chunked); resolves to None."""
        return self._submit(_Work(engine.seq, self.pool, "prefill", list(prompt[:-1]), Future()))

    def verify(self, engine: TargetVerifier, context: list[int], proposal: Proposal, params: SamplingParams,
               rng: PositionRNG) -> Future:
        """Score context + proposal in the next target step and accept a prefix; resolves to (Verdict, StepInfo)."""
        return self._submit(_Work(engine.seq, self.pool, "verify", context + proposal.tokens, Future(),
                                  len(proposal) + 1, (engine, len(context), proposal, params, rng)))

    def feed(self, seq, pool: KVPool | None, tokens: list[int], keep: int = 1) -> Future:
        """A draft step: append `tokens` to `seq` in the next draft forward; resolves to its head logits [keep, n]."""
        return self._submit(_Work(seq, pool, "feed", list(tokens), Future(), keep))

    def draft(self, block: DraftBlock, pool: KVPool) -> Future:
        """A draft's whole block, drafted with every other queued block on the device; resolves to a
        `DraftedBlock`."""
        return self._submit(_Work(block.seq, pool, "block", block.tail, Future(), block.gamma, block=block))

    def _submit(self, work: _Work) -> Future:
        with self._cond:
            if self._closed:
                raise RuntimeError("the step scheduler is stopped")
            self._work.append(work)
            self._notify()
        return work.future

    def close(self) -> None:
        """Stop the compute thread (work still queued fails); safe to call twice."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            self._wake.notify_all()
        for thread in [self._thread, *self._helpers]:
            if thread is not threading.current_thread():
                thread.join(timeout=5)
        _LIVE.discard(self)

    # -- the compute thread ------------------------------------------------------
    def _loop(self) -> None:
        if self.threads:
            torch_threads(self.threads)
        while True:
            with self._cond:
                while not (self._calls or self._closed or self._ready(0)):
                    if not self._cond.wait(1.0 if self._work else None):
                        self._retry_held()  # a tick: deadlines, and room freed other than by a release
                if self._closed:
                    break
                if not self._calls:
                    self._gather_locked(0)
                calls, self._calls = list(self._calls), deque()
            for fn, args, future in calls:
                self._settle(future, fn, *args)
            if calls:
                self._retry_held()  # a released session may have made room
            self._set_split(self._wants_split())
            self._run_lane(0)
        with self._cond:
            self._cond.notify_all()
            deadline = time.monotonic() + 5.0
            while self._helpers_busy and time.monotonic() < deadline:  # their steps settle their own work
                self._cond.wait(0.1)
        stopped = RuntimeError("the step scheduler stopped")
        for future in [w.future for w in self._work] + [call[2] for call in self._calls]:
            future.set_exception(stopped)

    def _helper(self, lane: int) -> None:
        """A lane past the first: steps while the sessions are split among the lanes (`_set_split`)."""
        torch_threads(self._lane_threads)
        while True:
            with self._cond:
                while not (self._closed or (self._split and self._ready(lane))):
                    self._wake.wait(1.0)
                if self._closed:
                    return
                self._helpers_busy += 1
                self._gather_locked(lane)
            try:
                self._run_lane(lane)
            finally:
                with self._cond:
                    self._helpers_busy -= 1
                    if not self._split or self._closed:  # the first lane may be waiting for this step
                        self._cond.notify()

    def _run_lane(self, lane: int) -> None:
        """One step of lane `lane`: the queued draft blocks, else draft steps, else a target step."""
        if lane and not self._split:
            return  # the sessions were joined meanwhile: the first lane steps them all
        with self._cond:
            work = [w for w in self._work if self._takes(lane, w)]
        blocks = [w for w in work if w.kind == "block"]
        feeds = [w for w in work if w.kind == "feed"]
        limit = self._share if self._split else None
        if blocks:
            self._draft(blocks, limit)
        elif feeds or work:
            self._step(feeds or work, limit, lane)  # draft steps first: they are cheap and lead to verifies

    def _notify(self) -> None:
        """Under the lock: work is ready (for the first lane; and the others while split)."""
        self._cond.notify()
        if self._split:
            self._wake.notify_all()

    def _takes(self, lane: int, work: _Work) -> bool:
        """Whether lane `lane` may take `work` now: not another lane's; past the first lane, no prefills (they
        share prompts through the pool's running sequences: `_follows`) and only pools that allow it."""
        if work.busy or work.held:
            return False
        return lane == 0 or (work.kind != "prefill" and getattr(work.pool, "concurrent_forwards", False))

    def _ready(self, lane: int) -> bool:
        return any(self._takes(lane, w) for w in self._work)

    def _wants_split(self) -> bool:
        return (self.lane_count > 1 and getattr(self.pool, "concurrent_forwards", False)
                and self.expected() >= self.lane_sessions)

    def _set_split(self, split: bool) -> None:
        """Split the sessions among the lanes (each on its share of the threads), or join them on the first
        lane's threads once the other lanes' steps are done: never more threads than cores at once."""
        if split == self._split:
            return
        if split:
            torch_threads(self._lane_threads)
            for lane in range(len(self._helpers) + 1, self.lane_count):
                helper = threading.Thread(target=self._helper, args=(lane,), name=f"specserve-compute-{lane}",
                                          daemon=True)
                helper.start()
                self._helpers.append(helper)
        with self._cond:
            self._split = split
            self._wake.notify_all()
            while not split and self._helpers_busy and not self._closed:
                self._cond.wait(1.0)
        if not split and self.threads:
            torch_threads(self.threads)

    def _retry_held(self) -> None:
        with self._cond:  # sessions' threads append work meanwhile (the lock is reentrant)
            for work in self._work:
                work.held = False

    def _gather_locked(self, lane: int) -> None:
        """Wait (bounded) until every open session not in another lane's step has target work queued, so they
        share the step (split among lanes: this lane's share of them)."""
        deadline = time.perf_counter() + self.gather * self.last_step_s
        while not self._calls and not any(w.kind in ("feed", "block") for w in self._work):
            busy = {id(w.seq) for w in self._work if w.busy}
            want = self.expected() - len(busy)
            if self._split:
                want = min(want, self._share)
            if len({id(w.seq) for w in self._work if self._takes(lane, w)}) >= want:
                return
            left = deadline - time.perf_counter()
            if left <= 0:
                return
            (self._cond if lane == 0 else self._wake).wait(left)

    @staticmethod
    def _settle(future: Future, fn: Callable, *args) -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            future.set_exception(exc)

    def _step(self, queued: list[_Work], limit: int | None = None, lane: int = 0) -> None:
        t0 = time.perf_counter()
        with self._select:
            taken = self._take(queued, limit)
        if not taken:
            return
        try:
            logits = self._forward([(w.seq, w.pool, chunk, w.keep if done else 0) for w, chunk, done in taken],
                                   host=taken[0][0].kind == "feed")  # a verify's logits are judged on the device
        except BaseException as exc:  # noqa: BLE001 - every session in the step sees it
            for work, _, _ in taken:
                self._drop(work, exc)
            return
        prompts = [len(c) for w, c, _ in taken if w.kind == "prefill"]
        info = StepInfo(sum(len(c) for _, c, _ in taken), len(taken), time.perf_counter() - t0, sum(prompts),
                        len(prompts))
        verifies: list[tuple[_Work, torch.Tensor]] = []
        for (work, _, done), rows in zip(taken, logits):
            with self._cond:
                work.busy = False
                if not done:
                    self._notify()
                    continue  # a prefill with chunks to go stays queued
                self._work.remove(work)
            if work.kind == "feed":
                work.future.set_result(rows)
            elif work.kind == "prefill":
                work.future.set_result(None)
            else:
                verifies.append((work, rows))
        if verifies:
            with one_torch_thread():
                self._judge(verifies, info)
        if taken[0][0].kind == "feed":
            self.draft_steps += 1
            self.sessions_per_draft_step[len(taken)] += 1
            return
        self.steps += 1
        self.lane_steps[lane] += 1
        self.sessions_per_step[len(taken)] += 1
        self.last_step_s = time.perf_counter() - t0

    def _take(self, queued: list[_Work], limit: int | None) -> list[tuple[_Work, list[int], bool]]:
        """The step's work, claimed (`busy`) from `queued` in order: (work, tokens fed this step, finishes this
        step); at most `limit` pieces (a lane's share)."""
        taken: list[tuple[_Work, list[int], bool]] = []
        budget = self.max_step_tokens
        prefills: list[_Work] = []  # prefills ahead in the queue (`_follows`)
        for work in queued:
            if budget <= 0 or (limit is not None and len(taken) >= limit):
                break
            if work.held or work.busy or work.future.done():
                continue
            if work.kind == "prefill" and work.pool is not None and work.pool.shares_running:
                if self._follows(work, prefills):
                    continue  # it waits for a prefill ahead of it to share its prompt
                prefills.append(work)
            try:
                tail = self._unfed(work)
                if not tail:  # nothing to feed (a one-token prompt, or a prefix already cached)
                    self._drop(work, None)
                    continue
                if work.kind == "prefill":
                    chunk = tail[: min(self.prefill_chunk, budget)]
                elif len(tail) <= budget or not taken:
                    chunk = tail
                else:
                    continue  # a block is fed whole; it leads the next step
                if work.pool is not None:  # a prefill's whole prompt at once: it never stops half-way for room
                    need = len(work.seq.tokens) + len(chunk) if work.kind == "feed" else len(work.tokens)
                    work.pool.reserve(work.seq, need)
            except KVCacheFull as exc:
                if not self._wait_for_room(work):
                    self._drop(work, exc)
                continue
            except ValueError as exc:
                self._drop(work, exc)
                continue
            work.started = True
            work.busy = True
            taken.append((work, chunk, len(chunk) == len(tail)))
            budget -= len(chunk)
        return taken

    def _draft(self, queued: list[_Work], limit: int | None = None) -> None:
        """Every queued block of one draft pool (at most `limit`), drafted together (`drafting.draft_blocks`)."""
        pool = queued[0].pool
        works = []
        with self._select:
            for work in (w for w in queued if w.pool is pool):
                if work.busy or work.future.done() or (limit is not None and len(works) >= limit):
                    continue
                try:
                    pool.reserve(work.seq, room(work.block))
                except (ValueError, KVCacheFull) as exc:  # this block alone fails
                    self._drop(work, exc)
                    continue
                work.busy = True
                works.append(work)
        if not works:
            return
        with self._cond:
            for work in works:
                self._work.remove(work)
        try:
            drafted = draft_blocks(pool, [w.block for w in works])
        except BaseException as exc:  # noqa: BLE001 - every session in the block sees it
            for work in works:
                work.future.set_exception(exc)
            return
        for work, result in zip(works, drafted):
            work.future.set_result(result)
        longest = max(w.block.gamma for w in works)
        self.fused_blocks += 1
        self.draft_steps += longest
        for step in range(longest):
            self.sessions_per_draft_step[sum(w.block.gamma > step for w in works)] += 1

    def _judge(self, verifies: list[tuple[_Work, torch.Tensor]], info: StepInfo) -> None:
        """Every verify block of the step accepted at once (`judge_many`); should that fail, each alone, so that
        one bad block fails only its own session."""
        try:
            verdicts = judge_many([(w.verify[0], rows, *w.verify[1:]) for w, rows in verifies])
        except Exception:  # noqa: BLE001 - retried block by block below
            for work, rows in verifies:
                engine, start, proposal, params, rng = work.verify
                self._settle(work.future, lambda: (engine.judge(rows, start, proposal, params, rng), info))
            return
        for (work, _), verdict in zip(verifies, verdicts):
            work.future.set_result((verdict, info))

    @staticmethod
    def _follows(work: _Work, ahead: list[_Work]) -> bool:
        """Whether a new session's prefill waits for one ahead of it in the queue, to copy its prompt's keys and
        values once they are computed (`KVPool.attach` copies from running sequences) instead of computing them
        again: it does when they share a CHUNK or more beyond what the pool could supply now, and at least half
        of what it would prefill (n > 1 choices; a burst of requests behind one system prompt)."""
        if work.started or work.seq.block is not None:
            return False
        cached = None
        for other in ahead:
            if other.future.done():
                continue  # done (all of it was cached): its sequence runs, and is copied from at once
            shared = common_prefix(other.tokens, work.tokens)
            if shared < CHUNK:
                continue
            if cached is None:
                cached = work.pool.cached_prefix(work.tokens)
            gain = shared - cached
            if gain >= CHUNK and 2 * gain >= len(work.tokens) - cached:
                return True
        return False

    def _wait_for_room(self, work: _Work) -> bool:
        """A new session's prefill that finds the KV pool full waits (up to kv_wait_s) for running sessions to
        end, holding nothing meanwhile; False where it must fail now (nothing running, or waited too long)."""
        pool = work.pool
        if work.kind != "prefill" or work.started or pool is None or len(work.tokens) > pool.max_length:
            return False
        if work.seq.block is not None:  # a copied prefix: back to the cache while it waits
            work.seq.release()
        now = time.monotonic()
        work.waiting_since = work.waiting_since or now
        if pool.used_tokens == 0 or now - work.waiting_since > self.kv_wait_s:
            return False
        work.held = True
        return True

    @staticmethod
    def _unfed(work: _Work) -> list[int]:
        """Roll the cache back to what it shares with the work's tokens; the tokens still to feed (a draft step's
        are all new; a prefill's keep no logits, so an empty one — a one-token prompt — feeds nothing)."""
        if work.kind == "feed":
            return work.tokens
        return work.seq.unfed(work.tokens, work.keep) if work.tokens else []

    def _drop(self, work: _Work, exc: BaseException | None) -> None:
        with self._cond:
            if work in self._work:
                self._work.remove(work)
        if exc is None:
            work.future.set_result(None)
        else:
            work.future.set_exception(exc)

    @staticmethod
    def _forward(items: list[tuple[Any, KVPool | None, list[int], int]], host: bool = True
                 ) -> list[torch.Tensor | None]:
        """Each item's kept logits ([keep, head rows], None where keep is 0): ONE forward per pool, the items
        without one fed alone. host: on the CPU (else where a pool computed them)."""
        out: list[torch.Tensor | None] = [None] * len(items)
        groups: dict[int, list[int]] = {}
        for i, (_, pool, _, _) in enumerate(items):
            groups.setdefault(id(pool) if pool is not None else -1 - i, []).append(i)
        for members in groups.values():
            pool = items[members[0]][1]
            if pool is None:
                seq, _, chunk, keep = items[members[0]]
                logits = seq.feed_subset(chunk, max(keep, 1))  # HF forwards keep at least one position
                out[members[0]] = logits[-keep:] if keep else None
                continue
            logits = pool.forward([items[i][0] for i in members], [items[i][2] for i in members],
                                  [items[i][3] for i in members], host=host)
            row = 0
            for i in members:
                keep = items[i][3]
                out[i] = logits[row : row + keep] if keep else None
                row += keep
        return out


class ScheduledVerifier:
    """A session's target side on a `StepScheduler`, with the verifier interface `engine.loop.speculate` drives:
    each verify joins the next batched step. Used by sessions that run in the target's own process."""

    def __init__(self, scheduler: StepScheduler, engine: TargetVerifier):
        self.scheduler = scheduler
        self.engine = engine
        self.last_step = StepInfo()

    def prefill(self, prompt: list[int]) -> None:
        self.scheduler.prefill(self.engine, prompt).result()

    @property
    def cached_tokens(self) -> int:
        return self.engine.cached_tokens

    def verify(self, context: list[int], proposal: Proposal, params: SamplingParams, rng: PositionRNG) -> Verdict:
        verdict, self.last_step = self.scheduler.verify(self.engine, context, proposal, params, rng).result()
        return verdict

    def release(self) -> None:
        self.scheduler.call(self.engine.release).result()


class ScheduledSequence(TokenSequence):
    """A draft's cache whose forwards run as the scheduler's batched draft steps (a colocated draft: every
    session's next draft token in one forward). Bookkeeping (rollback, prefix reuse) stays with the caller's
    thread; only `feed` (or a whole block, `draft_block`, where `fused`) crosses to the compute thread, which
    the caller then waits for."""

    def __init__(self, scheduler: StepScheduler, seq, pool: KVPool | None, fused: bool = False):
        self.scheduler, self.inner, self.pool = scheduler, seq, pool
        self.token_subset = seq.token_subset
        self.vocab = pool.vocab if pool is not None else getattr(seq, "vocab", None)
        self.fused = fused and pool is not None  # blocks drafted whole on the device (`draft_block`)

    @property
    def tokens(self) -> list[int]:
        return self.inner.tokens

    def rollback(self, length: int) -> None:
        self.inner.rollback(length)

    def unfed(self, tokens: list[int], keep_logits: int) -> list[int]:
        return self.inner.unfed(tokens, keep_logits)  # a pooled cache may start from a cached prefix

    def feed_subset(self, new_tokens: list[int], keep_logits: int = 1) -> torch.Tensor:
        chunk = self.scheduler.prefill_chunk  # a long prompt goes in chunks, between other sessions' draft steps
        while len(new_tokens) > max(chunk, keep_logits):
            self.scheduler.feed(self.inner, self.pool, new_tokens[:chunk], 0).result()
            new_tokens = new_tokens[chunk:]
        return self.scheduler.feed(self.inner, self.pool, new_tokens, keep_logits).result()

    def draft_block(self, context: list[int], gamma: int, params: SamplingParams, rng: PositionRNG,
                    top_k_q: int = 0) -> DraftedBlock:
        """Bring the cache to `context` and draft `gamma` tokens after it as one block on the device."""
        tail = self.inner.unfed(context, 1)
        chunk = self.scheduler.prefill_chunk
        while len(tail) > chunk:  # a long prompt goes in chunks first, between other sessions' steps
            self.scheduler.feed(self.inner, self.pool, tail[:chunk], 0).result()
            tail = tail[chunk:]
        head = len(self.token_subset) if self.token_subset is not None else self.vocab
        block = DraftBlock(self.inner, tail, gamma, params, rng, len(context), top_k_q, head)
        return self.scheduler.draft(block, self.pool).result()

    def feed(self, new_tokens: list[int], keep_logits: int = 1) -> torch.Tensor:
        from specserve.models.families.lean import widen

        return widen(self.feed_subset(new_tokens, keep_logits), self.token_subset, self.vocab)

    def release(self) -> None:
        self.scheduler.call(self.inner.release).result()
