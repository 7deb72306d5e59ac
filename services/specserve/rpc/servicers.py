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
built their own pool and oversubscribed the cores (a verify forward measured
80-100 ms against 45 ms on the 2-core dev machine). One thread also
serialises the sessions' forwards, which a single model on one device
executes one at a time anyway.
"""

from __future__ import annotations

import functools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from specserve.engine.proposers import Proposal, Proposer, TargetVerifier
from specserve.rpc.convert import q_from_wire, q_to_wire, sampling_from_proto
from specserve.spec import PositionRNG, SamplingParams
from specserve.v1 import workers_pb2, workers_pb2_grpc


@dataclass
class Session:
    tokens: list[int]
    params: SamplingParams
    rng: PositionRNG
    engine: Any  # Proposer or TargetVerifier, owning this session's KV cache


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
            return self._sessions[session_id]
        except KeyError:
            raise KeyError(f"unknown session_id {session_id!r}") from None

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


def _rpc(method):
    """Map engine errors onto gRPC status codes."""

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except KeyError as exc:
            context.abort(grpc.StatusCode.NOT_FOUND, str(exc.args[0]))
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    return wrapper


class _SessionService:
    """Prefill and Release, the same for both workers; subclasses say which engine a session gets."""

    sessions: SessionTable

    def _init_compute(self, threads: int | None) -> None:
        import torch

        init = (lambda: torch.set_num_threads(threads)) if threads else None
        self._compute = ThreadPoolExecutor(1, thread_name_prefix="specserve-compute", initializer=init)

    def _run(self, fn: Callable[..., Any], *args) -> Any:
        """Run fn on the compute thread (every torch op of the servicer goes through here)."""
        return self._compute.submit(fn, *args).result()

    def new_engine(self):
        raise NotImplementedError

    @_rpc
    def Prefill(self, request, context):
        session = self.sessions.open(request, self.new_engine())
        self._run(session.engine.prefill, session.tokens)
        return workers_pb2.PrefillReply(cached_tokens=len(session.tokens))

    @_rpc
    def Release(self, request, context):
        released = self._run(self.sessions.close, request.session_id)
        return workers_pb2.ReleaseReply(released=released, active_sessions=len(self.sessions))


class DraftWorkerServicer(_SessionService, workers_pb2_grpc.DraftWorkerServicer):
    def __init__(self, new_proposer: Callable[[], Proposer], vocab: int, threads: int | None = None):
        self.new_engine = new_proposer
        self.sessions = SessionTable(vocab)
        self._init_compute(threads)

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
                tokens=proposal.tokens, q=q_to_wire(proposal.q), key=proposal.key or "", draft_time_s=elapsed
            )

        return self._run(propose)

    @_rpc
    def Commit(self, request, context):
        session, tokens = self.sessions.apply(request.update)
        self._run(session.engine.commit, tokens)
        return workers_pb2.CommitReply(committed_length=len(tokens))


class TargetWorkerServicer(_SessionService, workers_pb2_grpc.TargetWorkerServicer):
    def __init__(self, model, vocab: int, threads: int | None = None, new_sequence: Callable | None = None):
        """new_sequence: makes each session's KV cache (default: a local cache of `model`; a stage pipeline's)."""
        self.model = model
        self.new_sequence = new_sequence
        self.sessions = SessionTable(vocab)
        self._init_compute(threads)

    def new_engine(self) -> TargetVerifier:
        sequence = self.new_sequence() if self.new_sequence is not None else None
        return TargetVerifier(self.model, self.sessions.vocab, sequence)

    @_rpc
    def Verify(self, request, context):
        session, tokens = self.sessions.apply(request.update)
        if len(request.q) != len(request.tokens):
            raise ValueError(f"q: expected one distribution per token ({len(request.tokens)}), got {len(request.q)}")

        def verify():
            proposal = Proposal(list(request.tokens), q_from_wire(request.q, self.sessions.vocab))
            t0 = time.perf_counter()
            verdict = session.engine.verify(tokens, proposal, session.params, session.rng)
            elapsed = time.perf_counter() - t0
            return workers_pb2.VerifyReply(
                n_accepted=verdict.n_accepted, next_token=verdict.next_token,
                accept_probs=verdict.accept_probs, betas=verdict.betas, verify_time_s=elapsed,
            )

        return self._run(verify)
