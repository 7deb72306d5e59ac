"""The coordinator: runs generation sessions against the workers over gRPC.

One `Coordinator` (in serving a Ray actor, or with a colocated draft an object
in the ingress replica: `hosting`) drives many sessions at once.
Each session is the engine's own speculation loop (`engine.loop.speculate`)
over remote proxies: Prefill on both workers, then rounds of Propose →
Verify → commit, with the γ controller fed each round by the acceptance
and the wall time of the draft and verify calls as seen from here (so gRPC
and queueing are part of the cost it optimises). With `pipelined`, the
draft worker drafts block k+1 on the all-accepted branch while the target
verifies block k; the controller's cost model then takes max(draft, verify).

Sessions run on threads (the gRPC calls release the GIL) and hand their
tokens to asyncio, so the actor's event loop stays free for new requests
and cancellations. Cancelling a session, or the consumer going away, ends
it after the current round and releases both workers' KV caches.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import grpc

from specserve.coordinator.links import WorkerLink, resumable
from specserve.coordinator.metrics import ServingMetrics, SessionMetrics
from specserve.engine.batching import one_thread_torch
from specserve.engine.loop import Round, speculate
from specserve.engine.proposers import NgramProposer
from specserve.engine.stats import GenerationStats
from specserve.rpc.remote import RemoteProposer, RemoteSession, RemoteVerifier
from specserve.speculation import PositionRNG, SamplingParams, WarmStarts, make_controller, parse_gamma
from specserve.v1 import workers_pb2_grpc
from specserve.workers.quiet import data_plane_priority


log = logging.getLogger("specserve.coordinator")


class Overloaded(RuntimeError):
    """The coordinator already runs `max_sessions` sessions (HTTP 503 / gRPC RESOURCE_EXHAUSTED)."""


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
    """Sessions over a TargetWorker and a draft.

    draft: "ngram" (prompt lookup run here: it needs only the committed
    tokens, so a worker hop would only add latency), "remote" (a DraftWorker
    at `draft_address`; `draft_free` when that worker is an n-gram draft),
    "colocated" (the target worker holds the draft and runs whole sessions,
    controller included: one stream per session, one message per round) or
    "none" (plain target decoding through the same path). draft_lookup: a model
    draft first looks the context up here (prompt lookup) and is called only
    where that finds nothing worth verifying, as the in-process decoder does.
    """

    def __init__(
        self,
        target_address: str,
        vocab: int,
        eos_ids: list[int],
        *,
        draft: str = "ngram",
        draft_address: str | None = None,
        draft_free: bool = False,
        draft_lookup: bool = True,
        gamma: int | str = "auto",
        gamma_max: int = 8,
        pipelined: bool = True,
        verify_profile: dict[int, float] | None = None,
        draft_step_s: float | None = None,
        max_sessions: int = 64,
        model_name: str = "",
        export_metrics: bool = False,
        target_actor: Any = None,
        draft_actor: Any = None,
        restart_timeout_s: float = 120.0,
        worker_token: str | None = None,
    ):
        data_plane_priority()  # on the request path (`workers.quiet`)
        if draft not in ("ngram", "remote", "colocated", "none"):
            raise ValueError(f"draft must be 'ngram', 'remote', 'colocated' or 'none', got {draft!r}")
        if draft == "remote" and not draft_address:
            raise ValueError("draft='remote' needs draft_address")
        self.vocab = vocab
        self.eos_ids = set(eos_ids)
        self.draft = draft
        self.draft_free = draft_free or draft == "ngram"
        self.draft_lookup = draft_lookup and draft == "remote" and not self.draft_free
        self.colocated_lookup = draft_lookup
        self.gamma = parse_gamma(gamma)
        self.gamma_max = gamma_max
        self.pipelined = pipelined and draft == "remote" and not self.draft_free
        self.verify_profile = {int(n): t for n, t in (verify_profile or {}).items()}
        self.draft_step_s = 0.0 if self.draft_free else draft_step_s
        # the workers' stubs, following their actors (when given) through restarts
        self._target = WorkerLink("target", workers_pb2_grpc.TargetWorkerStub, target_address, target_actor,
                                  worker_token)
        self._draft = (WorkerLink("draft", workers_pb2_grpc.DraftWorkerStub, draft_address, draft_actor, worker_token)
                       if draft == "remote" else None)
        self.restart_timeout_s = restart_timeout_s
        self._pool = ThreadPoolExecutor(max_sessions, thread_name_prefix="specserve-session",
                                        initializer=one_thread_torch)
        self._sessions: dict[str, threading.Event] = {}
        self._warm_starts = WarmStarts()  # each request's auto starts from what the last one learned
        self.max_sessions = max_sessions
        # Prometheus metrics (coordinator/metrics.py) need a Ray worker; in-process tests run without them.
        self._metrics = ServingMetrics(model_name, gamma_max) if export_metrics else None

    # -- control -------------------------------------------------------------
    def active_sessions(self) -> int:
        return len(self._sessions)

    def pid(self) -> int:
        return os.getpid()

    def cancel(self, request_id: str, reason: str = "cancelled") -> bool:
        """Stop a session after its current round; its worker caches are released. False if unknown.
        reason: the finish reason its metrics record ("stop": the ingress found a stop string)."""
        event = self._sessions.get(request_id)
        if event is None:
            return False
        event.reason = reason
        event.set()
        return True

    def links(self) -> list[WorkerLink]:
        return [link for link in (self._target, self._draft) if link is not None]

    def describe(self) -> dict[str, Any]:
        return {
            "draft": self.draft, "draft_lookup": self.draft_lookup, "gamma": self.gamma, "gamma_max": self.gamma_max,
            "pipelined": self.pipelined,
            "active_sessions": self.active_sessions(), "max_sessions": self.max_sessions,
            # a worker some session found gone, not back yet (Ray is restarting it)
            "workers_down": [link.role for link in self.links() if link.recovering],
        }

    def controller(self, gamma: int | str | None):
        gamma = self.gamma if gamma is None else gamma
        if self.draft == "none":
            gamma = 0
        return self._warm_starts(
            make_controller(gamma, self.gamma_max, self.verify_profile or None, self.draft_step_s, self.pipelined))

    # -- sessions --------------------------------------------------------------
    def _rounds(self, request: SessionRequest, stats: GenerationStats) -> Iterator[Round]:
        """The session's rounds on the workers (`stats` gets the controller's name)."""
        params, rng = request.params, PositionRNG(request.params.seed)
        sid = request.request_id
        if self.draft == "colocated":
            gamma = self.gamma if request.gamma is None else request.gamma
            stats.controller = str(gamma)
            return RemoteSession(self._target.stub, sid, request.prompt_ids, params, rng.seed, request.max_tokens,
                                 gamma, self.colocated_lookup).rounds()
        proposer = None
        if self.draft == "ngram":
            proposer = NgramProposer(self.vocab)
        elif self.draft == "remote":
            proposer = RemoteProposer(self._draft.stub, sid, params, rng.seed, self.vocab, self.draft_free,
                                      self.draft_lookup)
        verifier = RemoteVerifier(self._target.stub, sid, params, rng.seed, self.vocab)
        controller = self.controller(request.gamma)
        stats.controller = controller.name
        return speculate(request.prompt_ids, proposer, verifier, controller, params, rng, request.max_tokens,
                         self.vocab, self.eos_ids, pipelined=self.pipelined)

    async def generate(self, request: SessionRequest) -> AsyncIterator[Chunk]:
        """Yield one `Chunk` per round. Raises ValueError / grpc.RpcError from the workers unchanged."""
        if request.request_id in self._sessions:
            raise ValueError(f"request_id: {request.request_id!r} is already running")
        if len(self._sessions) >= self.max_sessions:
            raise Overloaded(f"too many concurrent sessions (max_sessions={self.max_sessions}); retry later")
        request = request.seeded()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancel = _Cancel()
        self._sessions[request.request_id] = cancel
        stats = GenerationStats()
        observed = SessionMetrics(self._metrics, len(request.prompt_ids))
        self._gauge_sessions()

        def emit(item) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        t0 = time.perf_counter()
        committed: list[int] = []  # every token of the session's finished rounds
        held: list[Round] = []  # rounds not handed over yet

        def consume(rounds) -> str:
            """Hand over one worker incarnation's rounds; the session's finish reason."""
            for rnd in rounds:
                if cancel.is_set():  # the consumer is gone: this round is neither delivered nor counted
                    return cancel.reason
                committed.extend(rnd.tokens)
                stats.record(rnd)
                observed.round_done(rnd)
                held.append(rnd)
                if rnd.finish_reason is not None:
                    stats.total_time_s, stats.new_tokens = time.perf_counter() - t0, len(committed)
                    emit(Chunk(list(held), rnd.finish_reason, stats.to_dict()))
                    return rnd.finish_reason
                if request.stream:
                    # statistics so far only where the consumer may end the session early (stop strings)
                    emit(Chunk(list(held), None, stats.to_dict() if request.params.stop else None))
                    held.clear()
                if cancel.is_set():
                    return cancel.reason
            return cancel.reason  # speculate always ends with a reason; only a closed generator gets here

        def drive() -> None:  # one thread per session; the generators never leave it
            finish, part = "error", request
            try:
                while True:  # one pass per worker incarnation: a lost worker's session goes on on its replacement
                    rounds = self._rounds(part, stats)
                    try:
                        finish = consume(rounds)
                        break
                    except Exception as exc:  # noqa: BLE001 - a lost worker is waited for, anything else re-raised
                        if not resumable(exc) or cancel.is_set():
                            raise
                        self._recover(exc, request.request_id, cancel.is_set)
                        stats.resumes += 1
                        observed.resumed()
                        # a worker session id of its own: a call of the lost incarnation still running on a surviving
                        # worker (a pipelined prefetch) must not land in the new session
                        part = replace(request.resumed(committed), request_id=f"{request.request_id}.{stats.resumes}")
                    finally:
                        try:
                            rounds.close()  # runs speculate's finally: Release on both workers
                        except Exception:  # noqa: BLE001 - that incarnation of the session is over either way
                            pass
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer
                finish = "error"
                emit(exc)
            finally:
                observed.finished(finish)
                emit(None)

        self._pool.submit(drive)
        try:
            pending = None
            while True:
                item, pending = (pending, None) if pending is not None else (await queue.get(), None)
                while isinstance(item, Chunk) and item.finish_reason is None and not queue.empty():
                    after = queue.get_nowait()  # the consumer fell behind: hand over what is there in one chunk
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
        finally:
            cancel.set()
            self._sessions.pop(request.request_id, None)
            self._gauge_sessions()

    def _recover(self, exc: grpc.RpcError, request_id: str, cancelled) -> None:
        """A worker call failed as if the worker were gone: wait for every worker to answer again (a restarted
        one at its new address). Raises WorkerLost when one does not within restart_timeout_s."""
        log.warning("session %s lost a worker (%s); resuming from its committed tokens", request_id, exc.code().name)
        deadline = time.monotonic() + self.restart_timeout_s
        for link in self.links():
            link.reconnect(deadline, cancelled)

    def _gauge_sessions(self) -> None:
        if self._metrics is not None:
            self._metrics.set("active_sessions", len(self._sessions))


class _Cancel(threading.Event):
    """A session's cancel flag and why it was set (the finish reason its metrics record)."""

    reason = "cancelled"
