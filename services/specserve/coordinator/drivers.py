"""What a coordinator session runs, by placement: the speculation loop here, or a relay of the target worker's.

`SplitDriver`: the draft is not in the target worker (a DraftWorker of its own, n-gram lookup in this process,
or none), so each session runs the engine's loop here over remote proxies: Prefill on both workers, then
rounds of Propose → Verify, with the γ controller fed each round by the acceptance and the wall time of the
draft and verify calls as seen from here (gRPC and queueing are part of the cost it optimises). With
`pipelined`, the draft worker drafts block k+1 on the all-accepted branch while the target verifies block k.

`ColocatedRelay`: the target worker holds the draft and runs whole sessions, controller included; a session
here is one `TargetWorker.Generate` stream, one message per round.

Both give `Coordinator` the same three things: the rounds of a request, the worker links to recover when a
worker is lost, and what /health shows.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from specserve.coordinator.links import WorkerLink
from specserve.engine.loop import Round
from specserve.engine.proposers import NgramProposer
from specserve.engine.session import SessionFactory
from specserve.engine.stats import GenerationStats
from specserve.rpc.remote import RemoteProposer, RemoteSession, RemoteVerifier
from specserve.speculation import PositionRNG, parse_gamma
from specserve.v1 import workers_pb2_grpc

if TYPE_CHECKING:
    from specserve.coordinator.core import SessionRequest


class SplitDriver:
    """draft: "ngram" (prompt lookup run here: it needs only the committed tokens, so a worker hop would only
    add latency), "remote" (a DraftWorker at `draft_address`; `draft_free` when that worker is an n-gram draft)
    or "none" (plain target decoding through the same path). draft_lookup: a model draft first looks the
    context up here and is called only where that finds nothing worth verifying, as in process.
    verify_profile / draft_step_s: the workers' calibration for `auto`. *_actor: the workers' Ray handles,
    followed through restarts (None: fixed addresses)."""

    def __init__(self, target_address: str, vocab: int, eos_ids: list[int], *, draft: str = "ngram",
                 draft_address: str | None = None, draft_free: bool = False, draft_lookup: bool = True,
                 gamma: int | str = "auto", gamma_max: int = 8, pipelined: bool = True,
                 verify_profile: dict[int, float] | None = None, draft_step_s: float | None = None,
                 target_actor: Any = None, draft_actor: Any = None, worker_token: str | None = None):
        if draft not in ("ngram", "remote", "none"):
            raise ValueError(f"draft must be 'ngram', 'remote' or 'none', got {draft!r}")
        if draft == "remote" and not draft_address:
            raise ValueError("draft='remote' needs draft_address")
        self.vocab = vocab
        self.draft = draft
        self.draft_free = draft_free or draft == "ngram"
        self.draft_lookup = draft_lookup and draft == "remote" and not self.draft_free
        self.gamma_max = gamma_max
        profile = {int(n): t for n, t in (verify_profile or {}).items()}
        step = 0.0 if self.draft_free else draft_step_s
        self.sessions = SessionFactory(vocab, set(eos_ids), gamma=gamma, gamma_max=gamma_max,
                                       has_draft=draft != "none", cost_profile=lambda: (profile or None, step),
                                       pipelined=pipelined and draft == "remote" and not self.draft_free)
        self.target = WorkerLink("target", workers_pb2_grpc.TargetWorkerStub, target_address, target_actor,
                                 worker_token)
        self.draft_link = (WorkerLink("draft", workers_pb2_grpc.DraftWorkerStub, draft_address, draft_actor,
                                      worker_token) if draft == "remote" else None)

    def links(self) -> list[WorkerLink]:
        return [link for link in (self.target, self.draft_link) if link is not None]

    def describe(self) -> dict[str, Any]:
        return {"draft": self.draft, "draft_lookup": self.draft_lookup, "gamma": self.sessions.gamma,
                "gamma_max": self.gamma_max, "pipelined": self.sessions.pipelined}

    def rounds(self, request: SessionRequest, stats: GenerationStats, interval: float = 0.0) -> Iterator[list[Round]]:
        """The session's rounds, each alone in a list (`ColocatedRelay.rounds`'s batches); they are run here, so
        `interval` is the coordinator's to keep."""
        params, rng, sid = request.params, PositionRNG(request.params.seed), request.request_id
        proposer = None
        if self.draft == "ngram":
            proposer = NgramProposer(self.vocab)
        elif self.draft == "remote":
            proposer = RemoteProposer(self.draft_link.stub, sid, params, rng.seed, self.vocab, self.draft_free,
                                      self.draft_lookup)
        verifier = RemoteVerifier(self.target.stub, sid, params, rng.seed, self.vocab)
        controller = self.sessions.controller(request.gamma)
        stats.controller = controller.name
        return _one_by_one(self.sessions.rounds(request.prompt_ids, proposer, verifier, controller, params, rng,
                                                request.max_tokens))


class ColocatedRelay:
    """Sessions on a target worker that holds the draft. lookup: its model draft looks the context up first."""

    def __init__(self, target_address: str, *, gamma: int | str = "auto", gamma_max: int = 8, lookup: bool = True,
                 target_actor: Any = None, worker_token: str | None = None):
        self.gamma = parse_gamma(gamma, gamma_max)
        self.gamma_max = gamma_max
        self.lookup = lookup
        self.target = WorkerLink("target", workers_pb2_grpc.TargetWorkerStub, target_address, target_actor,
                                 worker_token)

    def links(self) -> list[WorkerLink]:
        return [self.target]

    def describe(self) -> dict[str, Any]:
        return {"draft": "colocated", "draft_lookup": self.lookup, "gamma": self.gamma, "gamma_max": self.gamma_max,
                "pipelined": False}

    def rounds(self, request: SessionRequest, stats: GenerationStats, interval: float = 0.0) -> Iterator[list[Round]]:
        """The session's rounds as the worker sends them: the rounds within `interval` of its last message
        together (`engine.pacing`), so a round costs the worker, the wire and this process less than a message."""
        gamma = self.gamma if request.gamma is None else request.gamma
        stats.controller = str(gamma)
        params = request.params
        return RemoteSession(self.target.stub, request.request_id, request.prompt_ids, params,
                             PositionRNG(params.seed).seed, request.max_tokens, gamma, self.lookup,
                             interval).rounds()


def _one_by_one(rounds: Iterator[Round]) -> Iterator[list[Round]]:
    """Each round in a list of its own; closing this closes `rounds` (its loop's release)."""
    try:
        for rnd in rounds:
            yield [rnd]
    finally:
        rounds.close()
