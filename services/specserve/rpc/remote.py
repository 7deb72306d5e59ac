"""Client-side proxies: a remote DraftWorker / TargetWorker behind the engine's interfaces.

`RemoteProposer` and `RemoteVerifier` let `engine.loop.speculate` drive
workers over gRPC exactly as it drives local objects, so served and
in-process generation share one loop. Each proxy remembers how much of the
committed sequence its worker already has and sends only the new tokens.
"""

from __future__ import annotations

import uuid

from specserve.engine.loop import speculate
from specserve.engine.proposers import Proposal, Proposer
from specserve.engine.stats import GenerationStats
from specserve.rpc.convert import q_from_wire, q_to_wire, sampling_to_proto
from specserve.spec import GammaController, PositionRNG, SamplingParams, Verdict
from specserve.v1 import workers_pb2


class _SessionProxy:
    def __init__(self, stub, session_id: str, params: SamplingParams, seed: int, vocab: int):
        self.stub = stub
        self.session_id = session_id
        self.sampling = sampling_to_proto(params, seed)
        self.vocab = vocab
        self.sent = 0  # committed tokens the worker already holds

    def _update(self, context: list[int]) -> workers_pb2.SessionUpdate:
        update = workers_pb2.SessionUpdate(
            session_id=self.session_id, base_length=self.sent, append=context[self.sent :]
        )
        self.sent = len(context)
        return update

    def prefill(self, prompt: list[int]) -> None:
        self.stub.Prefill(
            workers_pb2.PrefillRequest(session_id=self.session_id, prompt_ids=prompt, sampling=self.sampling)
        )
        self.sent = len(prompt)

    def release(self) -> None:
        self.stub.Release(workers_pb2.ReleaseRequest(session_id=self.session_id))


class RemoteProposer(_SessionProxy, Proposer):
    """A DraftWorker session. free: the worker's draft costs ~nothing (n-gram)."""

    def __init__(self, stub, session_id, params, seed, vocab, free: bool = False):
        super().__init__(stub, session_id, params, seed, vocab)
        self.free = free
        self.name = "remote"

    def propose(self, context: list[int], gamma: int, params: SamplingParams, rng: PositionRNG) -> Proposal:
        reply = self.stub.Propose(workers_pb2.ProposeRequest(update=self._update(context), gamma=gamma))
        return Proposal(list(reply.tokens), q_from_wire(reply.q, self.vocab), reply.key or None)


class RemoteVerifier(_SessionProxy):
    """A TargetWorker session."""

    def verify(self, context: list[int], proposal: Proposal, params: SamplingParams, rng: PositionRNG) -> Verdict:
        reply = self.stub.Verify(
            workers_pb2.VerifyRequest(update=self._update(context), tokens=proposal.tokens, q=q_to_wire(proposal.q))
        )
        return Verdict(reply.n_accepted, reply.next_token, list(reply.accept_probs), list(reply.betas))


def remote_generate(
    draft_stub,
    target_stub,
    prompt_ids: list[int],
    params: SamplingParams,
    max_new_tokens: int,
    controller: GammaController,
    vocab: int,
    eos_ids: set[int],
    draft_is_free: bool = False,
    stats: GenerationStats | None = None,
) -> tuple[list[int], str, GenerationStats]:
    """Run one session over gRPC workers; returns (new tokens, finish reason, stats). Both sessions are released."""
    rng = PositionRNG(params.seed)  # fixes the seed both workers key their randomness on
    session_id = uuid.uuid4().hex
    proposer = RemoteProposer(draft_stub, session_id, params, rng.seed, vocab, draft_is_free) if draft_stub else None
    verifier = RemoteVerifier(target_stub, session_id, params, rng.seed, vocab)
    stats = stats if stats is not None else GenerationStats()
    stats.controller = controller.name
    tokens: list[int] = []
    finish = "length"
    for new, reason in speculate(
        prompt_ids, proposer, verifier, controller, params, rng, max_new_tokens, vocab, eos_ids, stats
    ):
        tokens.extend(new)
        finish = reason or finish
    stats.new_tokens = len(tokens)
    return tokens, finish, stats
