"""Client-side proxies: a remote DraftWorker / TargetWorker behind the engine's interfaces.

`RemoteProposer` and `RemoteVerifier` let `engine.loop.speculate` drive
workers over gRPC exactly as it drives local objects, so served and
in-process generation share one loop. Each proxy remembers how much of the
committed sequence its worker already has and sends only the new tokens.
"""

from __future__ import annotations

from collections.abc import Iterator

from specserve.engine.loop import Round
from specserve.engine.proposers import Proposal, Proposer, prompt_lookup
from specserve.rpc.convert import (
    logprobs_from_wire,
    proposal_from_wire,
    proposal_q_to_wire,
    round_from_wire,
    sampling_to_proto,
)
from specserve.engine.stats import StepInfo
from specserve.speculation import PositionRNG, SamplingParams, Verdict
from specserve.v1 import workers_pb2


class _SessionProxy:
    def __init__(self, stub, session_id: str, params: SamplingParams, seed: int, vocab: int):
        self.stub = stub
        self.session_id = session_id
        self.sampling = sampling_to_proto(params, seed)
        self.vocab = vocab
        self.worker_tokens: list[int] = []  # the token list the worker holds for this session
        self.cached_tokens = 0

    def _update(self, tokens: list[int]) -> workers_pb2.SessionUpdate:
        """Keep the common prefix with what the worker holds, append the rest (commit and rollback in one)."""
        held = self.worker_tokens
        base = min(len(held), len(tokens))
        if held[:base] != tokens[:base]:
            base = next(i for i, (a, b) in enumerate(zip(held, tokens)) if a != b)
        self.worker_tokens = list(tokens)
        return workers_pb2.SessionUpdate(session_id=self.session_id, base_length=base, append=tokens[base:])

    def prefill(self, prompt: list[int]) -> None:
        reply = self.stub.Prefill(
            workers_pb2.PrefillRequest(session_id=self.session_id, prompt_ids=prompt, sampling=self.sampling)
        )
        self.worker_tokens = list(prompt)
        self.cached_tokens = reply.prefix_hit_tokens  # the worker's prefix cache supplied these

    def release(self) -> None:
        self.stub.Release(workers_pb2.ReleaseRequest(session_id=self.session_id))


class RemoteProposer(_SessionProxy, Proposer):
    """A DraftWorker session. free: the worker's draft costs ~nothing (n-gram). lookup: a model draft that
    first looks the context up here (prompt lookup needs only the committed tokens: no worker call), as
    `LookupOrModelProposer` does in process."""

    def __init__(self, stub, session_id, params, seed, vocab, free: bool = False, lookup: bool = False):
        super().__init__(stub, session_id, params, seed, vocab)
        self.free = free
        self.name = "remote"
        self.lookup = prompt_lookup(vocab) if lookup and not free else None
        self._prefetched = None  # (branch context, gamma, future of ProposeReply)
        self.prefetch_hits = 0
        self.prefetch_misses = 0

    def _proposal(self, reply, skip: int = 0) -> Proposal:
        return proposal_from_wire(list(reply.tokens)[skip:], reply.q[skip:], self.vocab, reply.key or None)

    def _settle(self):
        """(branch, γ, reply) of the pending prefetch, waited for (None if there is none)."""
        if self._prefetched is None:
            return None
        (branch, gamma, future), self._prefetched = self._prefetched, None
        return branch, gamma, future.result()

    def prefetch(self, context, proposal, gamma, params, rng) -> None:
        # A prefetch nobody used (a lookup block came first) is waited for: the worker applies a session's
        # updates in the order they were sent.
        if self._settle() is not None:
            self.prefetch_misses += 1
        # Draft the bonus position too (a guess of the target's bonus token), then γ tokens after it.
        branch = context + proposal.tokens
        request = workers_pb2.ProposeRequest(update=self._update(branch), gamma=gamma + 1)
        self._prefetched = (branch, gamma, self.stub.Propose.future(request))

    def propose(self, context: list[int], gamma: int, params: SamplingParams, rng: PositionRNG) -> Proposal:
        settled = self._settle()
        if settled is not None:
            branch, pre_gamma, reply = settled
            guess = reply.tokens[0] if reply.tokens else None
            if context == branch + [guess] and gamma <= pre_gamma:
                # The worker holds `branch` as committed; the next update appends the guess and what follows.
                self.prefetch_hits += 1
                return self._proposal(reply, skip=1).truncate(gamma)
            self.prefetch_misses += 1
        reply = self.stub.Propose(workers_pb2.ProposeRequest(update=self._update(context), gamma=gamma))
        return self._proposal(reply)

    def release(self) -> None:
        if self._prefetched is not None:
            self._prefetched[2].cancel()
            self._prefetched = None
        super().release()


class RemoteVerifier(_SessionProxy):
    """A TargetWorker session; `last_step` is the worker's step that verified the latest block (sessions 0: an
    unbatched worker, its compute time only)."""

    last_step: StepInfo | None = None

    def verify(self, context: list[int], proposal: Proposal, params: SamplingParams, rng: PositionRNG) -> Verdict:
        reply = self.stub.Verify(
            workers_pb2.VerifyRequest(update=self._update(context), tokens=proposal.tokens, q=proposal_q_to_wire(proposal))
        )
        self.last_step = StepInfo(reply.step_tokens, reply.step_sessions, reply.verify_time_s,
                                  reply.step_prompt_tokens, reply.step_prompt_sessions)
        return Verdict(reply.n_accepted, reply.next_token, list(reply.accept_probs), list(reply.betas),
                       logprobs_from_wire(reply.logprobs))


class RemoteSession:
    """A whole session on a TargetWorker that holds the draft (colocated): one stream, a message per round or,
    with an interval, per the rounds within it (`engine.pacing`). `rounds` yields each message's rounds, in
    order, as `engine.loop.speculate` yields them."""

    def __init__(self, stub, session_id: str, prompt: list[int], params: SamplingParams, seed: int,
                 max_tokens: int, gamma: int | str, lookup: bool = True, interval: float = 0.0):
        self.stub = stub
        self.request = workers_pb2.SessionRequest(
            session_id=session_id, prompt_ids=prompt, sampling=sampling_to_proto(params, seed),
            max_tokens=max_tokens, gamma=str(gamma), no_lookup=not lookup, stream_interval_s=interval,
        )

    def rounds(self) -> Iterator[list[Round]]:
        call = self.stub.Generate(self.request)
        try:
            for reply in call:
                yield [round_from_wire(rnd) for rnd in reply.rounds]
        finally:
            call.cancel()  # a consumer that stops early ends the session on the worker
