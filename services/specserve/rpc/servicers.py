"""gRPC servicers for the internal DraftWorker and TargetWorker services.

Each servicer owns a table of sessions: the committed token list, the
sampling parameters and seed, and the engine object holding that session's
KV cache (a `Proposer` for the draft, a `TargetVerifier` for the target).
The math is the engine's; this module only maps messages and errors:
unknown session → NOT_FOUND, bad input → INVALID_ARGUMENT naming the field.
Ray placement lives elsewhere (workers/); these run in any gRPC server.

All model work of a servicer runs on ONE compute thread, whatever gRPC
thread received the call. torch's OpenMP pool belongs to the thread that
launches the work: forwards issued from a rotating pool of gRPC threads each
built their own pool and oversubscribed the cores. That thread is the
target's step scheduler (`scheduler.steps`): Prefill and Verify calls of all
sessions are queued and run as one batched forward per step over the KV
pool (`models.memory.pool`) where `models.families.arch` describes the model, one session at a time
otherwise. A full KV pool is RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from specserve.engine.pacing import Pacer
from specserve.engine.proposers import Proposer, TargetVerifier
from specserve.models.families.lean import unsupported_reason
from specserve.models.kernels.tp import Collective
from specserve.models.memory.pool import KVCacheFull, KVPool
from specserve.rpc.convert import (
    logprobs_to_wire,
    proposal_from_wire,
    proposal_q_to_wire,
    round_to_wire,
    sampling_from_proto,
)
from specserve.scheduler.colocated import ColocatedSessions
from specserve.scheduler.steps import StepScheduler
from specserve.speculation import PositionRNG, SamplingParams, parse_gamma
from specserve.v1 import workers_pb2, workers_pb2_grpc


@dataclass
class Session:
    tokens: list[int]
    params: SamplingParams
    rng: PositionRNG
    engine: Any  # Proposer or TargetVerifier, owning this session's KV cache
    last_used: float = field(default_factory=time.monotonic)  # when a call last touched it
    streaming: bool = False  # a colocated Generate runs it: it ends with its stream, never idle


class SessionTable:
    """Sessions by id; safe for a threaded gRPC server."""

    def __init__(self, vocab: int):
        self.vocab = vocab
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._sessions)

    def open(self, request: workers_pb2.PrefillRequest, engine) -> Session:
        if not request.session_id:
            raise ValueError("session_id: must not be empty")
        prompt = list(request.prompt_ids)
        if not prompt:
            raise ValueError("prompt_ids: must not be empty")
        if min(prompt) < 0 or max(prompt) >= self.vocab:
            raise ValueError(f"prompt_ids: token ids must be in [0, {self.vocab})")
        params = sampling_from_proto(request.sampling)
        if params.seed is None:
            raise ValueError("sampling.seed: must be set (both workers key their randomness on it)")
        session = Session(prompt, params, PositionRNG(params.seed), engine)
        with self._lock:
            old = self._sessions.pop(request.session_id, None)
            self._sessions[request.session_id] = session
        if old is not None:  # a re-prefill (e.g. after a coordinator retry) replaces the session
            old.engine.release()
        return session

    def get(self, session_id: str) -> Session:
        try:
            session = self._sessions[session_id]
        except KeyError:
            raise KeyError(f"unknown session_id {session_id!r}") from None
        session.last_used = time.monotonic()
        return session

    def reap(self, idle_s: float) -> int:
        """Release the sessions no call touched for idle_s seconds (their coordinator died without releasing
        them); run on the compute thread, between steps. Returns how many."""
        now = time.monotonic()
        with self._lock:
            stale = [sid for sid, s in self._sessions.items() if not s.streaming and now - s.last_used > idle_s]
            dropped = [self._sessions.pop(sid) for sid in stale]
        for session in dropped:
            session.engine.release()
        return len(dropped)

    def close(self, session_id: str) -> bool:
        with self._lock:
            session = self._sessions.pop(session_id, None)
        if session is None:
            return False
        session.engine.release()
        return True

    def apply(self, update: workers_pb2.SessionUpdate) -> tuple[Session, list[int]]:
        """Bring a session's committed tokens up to date; return (session, tokens)."""
        session = self.get(update.session_id)
        if not 0 <= update.base_length <= len(session.tokens):
            raise ValueError(f"update.base_length: {update.base_length} outside [0, {len(session.tokens)}]")
        append = list(update.append)
        if append and (min(append) < 0 or max(append) >= self.vocab):
            raise ValueError(f"update.append: token ids must be in [0, {self.vocab})")
        session.tokens = session.tokens[: update.base_length] + append
        return session, session.tokens


_ERRORS = (KeyError, ValueError, KVCacheFull)


def _abort(context, exc: Exception) -> None:
    """Map an engine error onto its gRPC status (unknown session, bad input, no room in the KV pool)."""
    if isinstance(exc, KeyError):
        context.abort(grpc.StatusCode.NOT_FOUND, str(exc.args[0]))
    if isinstance(exc, KVCacheFull):
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
    context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))


def _rpc(method):
    """Map engine errors onto gRPC status codes."""

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except _ERRORS as exc:
            _abort(context, exc)

    return wrapper


def _rpc_stream(method):
    """`_rpc` for a server-streaming method (its errors surface while the stream is consumed)."""

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            yield from method(self, request, context)
        except _ERRORS as exc:
            _abort(context, exc)

    return wrapper


class _SessionService:
    """Prefill and Release, the same for both workers; subclasses say which engine a session gets."""

    sessions: SessionTable
    scheduler: StepScheduler

    def _init_compute(self, threads: int | None, scheduler: StepScheduler | None, **scheduling) -> None:
        """Use `scheduler` (a compute thread the model was loaded on: keep torch on one thread) or start one."""
        self.scheduler = scheduler or StepScheduler(threads=threads)
        self.scheduler.expected = lambda: len(self.sessions)
        for name, value in scheduling.items():
            setattr(self.scheduler, name, value)

    def close(self) -> None:
        """Stop the compute thread (after the gRPC server has stopped)."""
        self.scheduler.close()

    direct = False  # the engines send their forwards to the scheduler themselves: run calls where they arrive

    def on_compute_thread(self, fn: Callable[..., Any], *args) -> Any:
        """Run fn on the compute thread (every torch op of the servicer goes through here)."""
        if self.direct:
            return fn(*args)
        return self.scheduler.call(fn, *args).result()

    def new_engine(self):
        raise NotImplementedError

    def _prefill(self, session: Session) -> None:
        self.on_compute_thread(session.engine.prefill, session.tokens)

    @_rpc
    def Prefill(self, request, context):
        # on the compute thread: a re-prefill releases the session's old cache, which a step may be using
        session = self.on_compute_thread(self.sessions.open, request, self.new_engine())
        self._prefill(session)
        return workers_pb2.PrefillReply(cached_tokens=len(session.tokens),
                                        prefix_hit_tokens=getattr(session.engine, "cached_tokens", 0))

    @_rpc
    def Release(self, request, context):
        released = self.on_compute_thread(self.sessions.close, request.session_id)
        return workers_pb2.ReleaseReply(released=released, active_sessions=len(self.sessions))


class DraftWorkerServicer(_SessionService, workers_pb2_grpc.DraftWorkerServicer):
    """scheduled: the proposers' forwards are `scheduler`'s batched draft steps (a `ScheduledDraft`), so each
    call runs on its own gRPC thread and the sessions' draft tokens share forwards."""

    def __init__(self, new_proposer: Callable[[], Proposer], vocab: int, threads: int | None = None,
                 scheduler: StepScheduler | None = None, scheduled: bool = False):
        self.new_engine = new_proposer
        self.sessions = SessionTable(vocab)
        self.direct = scheduled
        self._init_compute(threads, scheduler)

    @_rpc
    def Propose(self, request, context):
        if request.gamma < 0:
            raise ValueError("gamma: must be >= 0")
        session, tokens = self.sessions.apply(request.update)

        def propose():
            t0 = time.perf_counter()
            proposal = session.engine.propose(tokens, request.gamma, session.params, session.rng)
            elapsed = time.perf_counter() - t0
            return workers_pb2.ProposeReply(
                tokens=proposal.tokens, q=proposal_q_to_wire(proposal), key=proposal.key or "", draft_time_s=elapsed
            )

        return self.on_compute_thread(propose)


class TargetWorkerServicer(_SessionService, workers_pb2_grpc.TargetWorkerServicer):
    """batching: run targets of `models.families.arch`'s families through the KV pool, one forward per step over all sessions
    (kv_cache_tokens positions in all; max_step_tokens and prefill_chunk bound a step, see `StepScheduler`;
    prefix_caching: finished sessions' KV kept for new ones with the same prefix, `models.memory.prefix`;
    kv_wait_s: how long a new session waits for room in a full pool; compute_lanes: `StepScheduler.lanes`).
    Other models (`new_sequence`) and batching=False run one session at a time.
    tp: this worker is rank 0 of a tensor-parallel group (`models.kernels.tp`): its pool's steps run on every rank.
    pool: the pool to batch on, made by the caller (a staged target's, `workers.stages.StagedPool`).
    features: the pool keeps each position's final hidden state, for a feature head drafting here (`models.drafts.head`)."""

    def __init__(self, model, vocab: int, threads: int | None = None, new_sequence: Callable | None = None, *,
                 batching: bool = True, kv_cache_tokens: int = 65536, max_step_tokens: int = 512,
                 prefill_chunk: int = 256, scheduler: StepScheduler | None = None, tp: Collective | None = None,
                 prefix_caching: bool = True, kv_wait_s: float = 60.0, pool: KVPool | None = None,
                 features: bool = False, compute_lanes: int | None = None):
        self.model = model
        self.new_sequence = new_sequence
        self.sessions = SessionTable(vocab)
        self._init_compute(threads, scheduler, max_step_tokens=max_step_tokens, prefill_chunk=prefill_chunk,
                           kv_wait_s=kv_wait_s, lanes=compute_lanes)
        self.pool = None
        if pool is not None:
            self.pool = self.scheduler.pool = pool
            self.new_sequence = pool.sequence
        elif batching and new_sequence is None and model is not None and unsupported_reason(model) is None:
            # every attach and forward of this pool runs on the compute thread: new sessions may copy from running ones
            pool = functools.partial(KVPool, tp=tp, prefix_caching=prefix_caching, share_running=True,
                                     features=features)
            self.pool = self.scheduler.pool = self.on_compute_thread(pool, model, kv_cache_tokens)
            self.new_sequence = self.pool.sequence
        elif tp is not None:
            raise ValueError("tensor_parallel: needs batching and a target the pooled step runs "
                             f"({unsupported_reason(model) if model is not None else 'no model'})")
        elif features:
            raise ValueError("draft: a feature head needs batching and a target the pooled step runs "
                             f"({unsupported_reason(model) if model is not None else 'no model'})")
        self.kv_cache_tokens, self.prefix_caching = kv_cache_tokens, prefix_caching
        self.colocated: ColocatedSessions | None = None

    def attach_draft(self, draft, eos_ids, gamma_max: int = 8, name: str = "draft", top_k_q: int = 0) -> None:
        """Hold a draft model (or a feature head) too (colocated): `Generate` then runs whole sessions here."""
        self.colocated = ColocatedSessions(self.scheduler, self.model, draft, self.sessions.vocab, eos_ids,
                                           gamma_max=gamma_max, kv_cache_tokens=self.kv_cache_tokens, name=name,
                                           top_k_q=top_k_q, prefix_caching=self.prefix_caching)

    def new_engine(self) -> TargetVerifier:
        sequence = self.new_sequence() if self.new_sequence is not None else None
        return TargetVerifier(self.model, self.sessions.vocab, sequence)

    def _prefill(self, session: Session) -> None:
        self.scheduler.prefill(session.engine, session.tokens).result()

    @_rpc
    def Verify(self, request, context):
        session, tokens = self.sessions.apply(request.update)
        proposal = proposal_from_wire(request.tokens, request.q, self.sessions.vocab)
        verdict, step = self.scheduler.verify(session.engine, tokens, proposal, session.params, session.rng).result()
        return workers_pb2.VerifyReply(
            n_accepted=verdict.n_accepted, next_token=verdict.next_token,
            accept_probs=verdict.accept_probs, betas=verdict.betas, verify_time_s=step.seconds,
            step_tokens=step.tokens, step_sessions=step.sessions, logprobs=logprobs_to_wire(verdict.logprobs),
            step_prompt_tokens=step.prompt_tokens, step_prompt_sessions=step.prompt_sessions,
        )

    @_rpc_stream
    def Generate(self, request, context):
        if self.colocated is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this target worker holds no draft (not colocated)")
        try:
            gamma = parse_gamma(request.gamma or "auto", self.colocated.gamma_max)
        except ValueError as exc:
            raise ValueError(f"gamma: {exc}") from None
        if request.max_tokens < 1:
            raise ValueError("max_tokens: must be >= 1")
        if not request.stream_interval_s >= 0:
            raise ValueError("stream_interval_s: must be >= 0")
        session = self.on_compute_thread(self.sessions.open, request, self.new_engine())
        session.streaming = True
        rounds = self.colocated.rounds(session.engine, session.tokens, session.params, session.rng,
                                       request.max_tokens, gamma, not request.no_lookup, len(self.sessions))
        last = None
        pacer, held = Pacer(request.stream_interval_s), []
        try:
            for rnd in rounds:
                held.append(round_to_wire(rnd))
                if rnd.finish_reason is not None:
                    last = workers_pb2.Rounds(rounds=held)
                    break
                if not pacer.hold():
                    yield workers_pb2.Rounds(rounds=held)
                    held = []
                if not context.is_active():
                    break
        finally:
            rounds.close()
            self.on_compute_thread(self.sessions.close, request.session_id)
        if last is not None:  # after the release: a client that has the last round has a clean worker
            yield last
