"""The coordinator: runs many generation sessions at once against the workers.

One `Coordinator` (in serving a Ray actor, or with a colocated draft an object in the ingress replica:
`hosting`) admits sessions (up to `max_sessions`; more wait in a bounded FIFO queue, `max_queued`, for at
most `queue_timeout_s`, and take a slot as a session ends), runs each on a thread of its own (the gRPC calls release
the GIL) and hands its rounds to asyncio as `Chunk`s, so the event loop stays free for new requests and
cancellations. What a session runs is its driver's (`drivers`): the speculation loop over remote proxies
(split placement) or a relay of the target worker's own session (colocated draft). When a worker is lost the
session waits for Ray's replacement and goes on from its committed tokens. Cancelling a session, or the
consumer going away, ends it after the current round and releases its worker caches.

A streamed session hands over a chunk per round, or, with `stream_interval_s`, the rounds that arrive within
that time of the last chunk as one (as SGLang's and vLLM's `stream_interval` do in tokens): on a small CPU each
chunk's relay (the event loop, Serve's stream, the proxy, HTTP, the client's parsing) costs as much as a
fraction of a step. With many streams open each one's interval stretches so that together they send at most
`stream_chunks_per_s` chunks a second (`engine.pacing.stream_interval`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import grpc

from specserve.coordinator.drivers import ColocatedRelay, SplitDriver
from specserve.coordinator.links import resumable
from specserve.coordinator.metrics import ServingMetrics, SessionMetrics
from specserve.engine.loop import Round
from specserve.engine.pacing import Pacer, default_chunk_rate, stream_interval
from specserve.engine.stats import GenerationStats
from specserve.scheduler.threads import one_thread_torch
from specserve.speculation import SamplingParams
from specserve.workers.quiet import data_plane_priority


log = logging.getLogger("specserve.coordinator")


class Overloaded(RuntimeError):
    """No session slot for the request: the waiting queue is full, or it waited `queue_timeout_s` (HTTP 503 with
    Retry-After / gRPC RESOURCE_EXHAUSTED)."""


@dataclass
class SessionRequest:
    """A validated, tokenized request (the ingress builds it)."""

    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    gamma: int | str | None = None  # None = the coordinator's default
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    # False: one chunk at the end. Each streamed chunk costs the ingress work while the target computes the
    # next round, which on a small CPU slows that forward; a non-streaming request need not pay it.
    stream: bool = True

    def resumed(self, committed: list[int]) -> SessionRequest:
        """The rest of this request after `committed` tokens (a session going on on a restarted worker). Keyed by
        position and seed, its randomness is the uninterrupted session's: the same tokens follow."""
        return replace(self, prompt_ids=self.prompt_ids + committed, max_tokens=self.max_tokens - len(committed))

    def choice(self, index: int) -> SessionRequest:
        """Choice `index` of a request for several (OpenAI's n): the same request with a seed of its own derived
        from this one's, which must be set (`seeded`). Choice 0 is this request, so the first of n draws what n=1
        would."""
        if index == 0:
            return self
        seed = (self.params.seed + index * 0x9E3779B97F4A7C15) % 2**64  # distinct for every index below 2^64
        return replace(self, params=self.params.model_copy(update={"seed": seed}),
                       request_id=f"{self.request_id}-{index}")

    def seeded(self) -> SessionRequest:
        """This request with a seed fixed (a random one if it had none), so a resumed part draws as it would have."""
        if self.params.seed is not None:
            return self
        return replace(self, params=self.params.model_copy(update={"seed": secrets.randbits(63)}))


@dataclass
class Chunk:
    """The rounds a session finished since its last chunk; the last chunk has a finish reason and the session's
    statistics (earlier chunks carry the statistics so far only for requests with stop strings, which the
    consumer may cut short)."""

    rounds: list[Round]
    finish_reason: str | None = None
    stats: dict[str, Any] | None = None

    @property
    def tokens(self) -> list[int]:
        return [token for rnd in self.rounds for token in rnd.tokens]

    @property
    def logprobs(self) -> list | None:
        """One entry per token, when the request asked (None otherwise)."""
        if not self.rounds or any(rnd.logprobs is None for rnd in self.rounds):
            return None
        return [entry for rnd in self.rounds for entry in rnd.logprobs]

    def then(self, after: Chunk) -> Chunk:
        """This chunk and the next as one (a consumer that fell behind gets them together)."""
        return Chunk(self.rounds + after.rounds, after.finish_reason, after.stats)


class Coordinator:
    """Sessions over a driver's workers (`SplitDriver` or `ColocatedRelay`)."""

    def __init__(self, driver: SplitDriver | ColocatedRelay, *, max_sessions: int = 64, model_name: str = "",
                 export_metrics: bool = False, restart_timeout_s: float = 120.0, max_queued: int = 256,
                 queue_timeout_s: float = 300.0, stream_interval_s: float = 0.0,
                 stream_chunks_per_s: float | None = None):
        data_plane_priority()  # on the request path (`workers.quiet`)
        self.driver = driver
        self.restart_timeout_s = restart_timeout_s
        self.stream_interval_s = stream_interval_s
        self.stream_chunks_per_s = default_chunk_rate() if stream_chunks_per_s is None else stream_chunks_per_s
        self._streams = 0  # streamed sessions running (read by sessions' threads: an int, no lock)
        self._pool = ThreadPoolExecutor(max_sessions, thread_name_prefix="specserve-session",
                                        initializer=one_thread_torch)
        self._sessions: dict[str, threading.Event] = {}
        self.max_sessions = max_sessions
        self.max_queued, self.queue_timeout_s = max_queued, queue_timeout_s
        # Admission runs on the event loop only (no lock): slots taken by running sessions and by waiters
        # already handed one; the waiters in arrival order, by request id.
        self._taken = 0
        self._waiting: deque[tuple[str, asyncio.Future]] = deque()
        self._waiters: dict[str, asyncio.Future] = {}
        self._abandoned: set[str] = set()  # cancelled after a slot was handed over, before they ran
        self.refused = 0  # requests refused: queue full or waited too long
        # Prometheus metrics (coordinator/metrics.py) need a Ray worker; in-process tests run without them.
        self._metrics = ServingMetrics(model_name, driver.gamma_max) if export_metrics else None

    # -- control -------------------------------------------------------------
    def active_sessions(self) -> int:
        return len(self._sessions)

    def pid(self) -> int:
        return os.getpid()

    def queued(self) -> int:
        return len(self._waiters)

    def cancel(self, request_id: str, reason: str = "cancelled") -> bool:
        """Stop a session after its current round; its worker caches are released; a request still waiting for
        a slot leaves the queue. False if unknown. reason: the finish reason its metrics record ("stop": the
        ingress found a stop string)."""
        waiter = self._waiters.get(request_id)
        if waiter is not None:
            if waiter.done():
                self._abandoned.add(request_id)
            else:
                waiter.get_loop().call_soon_threadsafe(waiter.cancel)
            return True
        event = self._sessions.get(request_id)
        if event is None:
            return False
        event.reason = reason
        event.set()
        return True

    def describe(self) -> dict[str, Any]:
        return {
            **self.driver.describe(), "active_sessions": self.active_sessions(), "max_sessions": self.max_sessions,
            "queued": self.queued(), "max_queued": self.max_queued, "queue_timeout_s": self.queue_timeout_s,
            "refused": self.refused, "stream_interval_s": self.stream_interval(),
            # a worker some session found gone, not back yet (Ray is restarting it)
            "workers_down": [link.role for link in self.driver.links() if link.recovering],
        }

    def stream_interval(self) -> float:
        """A stream's interval now: `stream_interval_s`, stretched by the streams open (`pacing.stream_interval`)."""
        return stream_interval(self.stream_interval_s, self._streams, self.stream_chunks_per_s)

    # -- sessions --------------------------------------------------------------
    async def generate(self, request: SessionRequest) -> AsyncIterator[Chunk]:
        """Yield the session's rounds in `Chunk`s (one per round while the consumer keeps up). Raises ValueError /
        grpc.RpcError from the workers unchanged."""
        if request.request_id in self._sessions or request.request_id in self._waiters:
            raise ValueError(f"request_id: {request.request_id!r} is already running")
        waited = await self._admit(request.request_id)
        if waited is None:
            return  # cancelled while it waited
        if request.request_id in self._abandoned:  # cancelled as its slot came: the slot goes on
            self._abandoned.discard(request.request_id)
            self._free_slot()
            return
        session = None
        try:
            loop = asyncio.get_running_loop()
            queue: asyncio.Queue = asyncio.Queue()
            session = _Session(request.seeded(), self.driver, SessionMetrics(self._metrics, len(request.prompt_ids)),
                               lambda item: loop.call_soon_threadsafe(queue.put_nowait, item), self._recover,
                               self.stream_interval)
            session.stats.queue_time_s = waited
            self._sessions[request.request_id] = session.cancel
            self._streams += 1 if request.stream else 0
            self._gauge_sessions()
            self._pool.submit(session.drive)
            async for chunk in _handed_over(queue):
                yield chunk
        finally:
            if session is not None:
                session.cancel.set()
                self._sessions.pop(request.request_id, None)
                self._streams -= 1 if request.stream else 0
            self._free_slot()
            self._gauge_sessions()

    async def _admit(self, request_id: str) -> float | None:
        """Take a session slot, waiting in FIFO order behind earlier requests if there is none; the seconds
        waited, or None if the request was cancelled meanwhile. Raises Overloaded when the queue is full or the
        wait passes queue_timeout_s."""
        if self._taken < self.max_sessions and not self._waiting:
            self._taken += 1
            self._observe_queue(0.0)
            return 0.0
        if len(self._waiting) >= self.max_queued:
            self._refuse()
            raise Overloaded(f"the server is full: {self._taken} sessions running (max_sessions="
                             f"{self.max_sessions}) and {len(self._waiting)} requests waiting (max_queued="
                             f"{self.max_queued}); retry later")
        waiter = asyncio.get_running_loop().create_future()
        self._waiting.append((request_id, waiter))
        self._waiters[request_id] = waiter
        self._gauge_sessions()
        t0 = time.perf_counter()
        try:
            await asyncio.wait_for(waiter, self.queue_timeout_s)
        except asyncio.CancelledError:
            if _handed(waiter):  # the slot came with the cancel: pass it on
                self._free_slot()
            if waiter.cancelled() and asyncio.current_task().cancelling() == 0:
                return None  # `cancel` (the client went away), not this task's own cancellation
            raise
        except asyncio.TimeoutError:
            self._refuse()
            raise Overloaded(f"waited {self.queue_timeout_s:g} s for a session slot (queue_timeout_s; "
                             f"max_sessions={self.max_sessions}); retry later") from None
        finally:
            self._waiters.pop(request_id, None)
            if (request_id, waiter) in self._waiting:  # timed out or cancelled: it no longer holds a place
                self._waiting.remove((request_id, waiter))
            self._gauge_sessions()
        waited = time.perf_counter() - t0
        self._observe_queue(waited)
        return waited

    def _free_slot(self) -> None:
        """A session ended: its slot goes to the longest-waiting request still waiting, else back."""
        while self._waiting:
            _, waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self._taken -= 1

    def _refuse(self) -> None:
        self.refused += 1
        if self._metrics is not None:
            self._metrics.inc("requests_refused")

    def _observe_queue(self, seconds: float) -> None:
        if self._metrics is not None:
            self._metrics.observe("request_queue_time_seconds", seconds)

    def _recover(self, exc: grpc.RpcError, request_id: str, cancelled) -> None:
        """A worker call failed as if the worker were gone: wait for every worker to answer again (a restarted
        one at its new address). Raises WorkerLost when one does not within restart_timeout_s."""
        log.warning("session %s lost a worker (%s); resuming from its committed tokens", request_id, exc.code().name)
        deadline = time.monotonic() + self.restart_timeout_s
        for link in self.driver.links():
            link.reconnect(deadline, cancelled)

    def _gauge_sessions(self) -> None:
        if self._metrics is not None:
            self._metrics.set("active_sessions", len(self._sessions))
            self._metrics.set("num_requests_waiting", len(self._waiters))


def _handed(waiter: asyncio.Future) -> bool:
    return waiter.done() and not waiter.cancelled()


class _Cancel(threading.Event):
    """A session's cancel flag and why it was set (the finish reason its metrics record)."""

    reason = "cancelled"


class _Session:
    """One session's thread side: runs its driver's rounds, again on a restarted worker after a loss, records
    each round once and emits `Chunk`s; then None, or the exception that ended it.

    interval: streamed rounds are held as `engine.pacing.Pacer` says (seconds, or a function of none that gives
    them now); a worker that runs the whole session (colocated) holds them the same way, for the interval at the
    time it starts, before they reach this process."""

    def __init__(self, request: SessionRequest, driver, observed: SessionMetrics, emit, recover,
                 interval: float | Callable[[], float] = 0.0):
        self.request, self.driver, self.observed, self.emit, self.recover = request, driver, observed, emit, recover
        self.pacer = Pacer(interval)
        self.cancel = _Cancel()
        self.stats = GenerationStats()
        self.committed: list[int] = []  # every token of the session's finished rounds
        self.held: list[Round] = []  # rounds not handed over yet
        self.t0 = time.perf_counter()

    def drive(self) -> None:
        """On the session's own thread; the round generators never leave it."""
        finish, part = "error", self._incarnation(self.request)
        try:
            while True:  # one pass per worker incarnation: a lost worker's session goes on on its replacement
                rounds = self.driver.rounds(part, self.stats, self.pacer.interval)
                try:
                    finish = self._consume(rounds)
                    break
                except Exception as exc:  # noqa: BLE001 - a lost worker is waited for, anything else re-raised
                    if not resumable(exc) or self.cancel.is_set():
                        raise
                    self.recover(exc, self.request.request_id, self.cancel.is_set)
                    self.stats.resumes += 1
                    self.observed.resumed()
                    part = self._incarnation(self.request.resumed(self.committed))
                finally:
                    try:
                        rounds.close()  # runs the loop's finally: Release on the workers
                    except Exception:  # noqa: BLE001 - that incarnation of the session is over either way
                        pass
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            finish = "error"
            self.emit(exc)
        finally:
            self.observed.finished(finish)
            self.emit(None)

    @staticmethod
    def _incarnation(request: SessionRequest) -> SessionRequest:
        """`request` under a worker session id of its own: the Release of a finished session with the same
        request id, or a call of a lost incarnation still running on a surviving worker (a pipelined prefetch),
        arrives after the next one opened and must not land in it."""
        return replace(request, request_id=f"{request.request_id}.{uuid.uuid4().hex[:12]}")

    def _consume(self, rounds) -> str:
        """Hand over one worker incarnation's rounds (lists of the rounds that came together); the session's
        finish reason."""
        for batch in rounds:
            for rnd in batch:
                if self.cancel.is_set():  # the consumer is gone: this round is neither delivered nor counted
                    return self.cancel.reason
                self.committed.extend(rnd.tokens)
                self.stats.record(rnd)
                self.observed.round_done(rnd)
                self.held.append(rnd)
                if rnd.finish_reason is not None:
                    self.stats.total_time_s = time.perf_counter() - self.t0
                    self.stats.new_tokens = len(self.committed)
                    self.emit(Chunk(list(self.held), rnd.finish_reason, self.stats.to_dict()))
                    return rnd.finish_reason
            if self.request.stream and not self.pacer.hold():
                # statistics so far only where the consumer may end the session early (stop strings)
                self.emit(Chunk(list(self.held), None, self.stats.to_dict() if self.request.params.stop else None))
                self.held.clear()
            if self.cancel.is_set():
                return self.cancel.reason
        return self.cancel.reason  # the loop always ends with a reason; only a closed generator gets here


async def _handed_over(queue: asyncio.Queue) -> AsyncIterator[Chunk]:
    """A session's chunks as its thread emits them, until the last; one that fell behind gets what is there
    as one chunk. An exception the thread emitted is raised here."""
    pending = None
    while True:
        item, pending = (pending, None) if pending is not None else (await queue.get(), None)
        while isinstance(item, Chunk) and item.finish_reason is None and not queue.empty():
            after = queue.get_nowait()
            if not isinstance(after, Chunk):
                pending = after  # an error or the end: delivered after this chunk
                break
            item = item.then(after)
        if item is None:
            return
        if isinstance(item, BaseException):
            raise item
        yield item
        if item.finish_reason is not None:
            return
