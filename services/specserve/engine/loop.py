"""The speculation loop, shared by the in-process decoder and the remote (gRPC) path.

One round: choose γ → the proposer drafts → the verifier scores and accepts
→ emit accepted tokens plus one → feed the controller. Proposer and verifier
may be local objects owning KV caches or proxies for remote workers; the
loop only sees the `Proposer` / verifier interface, so every path produces
the same tokens for the same seed and fixed γ.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from specserve.engine.proposers import Proposal, Proposer, empty_proposal
from specserve.engine.stats import GenerationStats
from specserve.speculation import GammaController, PositionRNG, RoundObservation, SamplingParams


class Round(tuple):
    """What `speculate` yields each round: a (new tokens, finish reason or None) pair, which is how most callers
    unpack it, with the round's detail as attributes: `drafted` (the block the target verified), `accepted`
    (how many of it were kept), `looked_up` (prompt lookup drafted it) and `logprobs` (of the new tokens,
    when the request asked for them; see `spec.sampling.token_logprobs`)."""

    drafted: list[int]
    accepted: int
    looked_up: bool
    logprobs: list | None

    def __new__(cls, tokens: list[int], reason: str | None, drafted=(), accepted: int = 0, looked_up: bool = False,
                logprobs: list | None = None):
        self = super().__new__(cls, (tokens, reason))
        self.drafted, self.accepted, self.looked_up, self.logprobs = list(drafted), accepted, looked_up, logprobs
        return self


def draft_block(
    proposer: Proposer | None,
    controller: GammaController,
    context: list[int],
    remaining: int,
    params: SamplingParams,
    rng: PositionRNG,
    vocab: int,
) -> tuple[Proposal, int, bool]:
    """(proposal, γ chosen, whether prompt lookup drafted it). A free draft proposes first so γ can depend on
    the proposal's quality; a draft that stops early gets γ as a ceiling and asks the controller after each
    token."""
    if proposer is None:
        return empty_proposal(vocab), 0, False

    def trimmed(propose) -> tuple[Proposal, int]:  # a free proposal, cut to the γ its quality class is worth
        full = propose(context, min(controller.max_gamma, remaining - 1), params, rng)
        g = controller.choose(remaining, key=full.key, available=len(full))
        return full.truncate(g), g

    if proposer.free:
        return *trimmed(proposer.propose), False
    if proposer.looks_up:  # a model draft that copies from the context first, where that pays
        found, g = trimmed(proposer.lookup_proposal)
        if g:
            return found, g, True
    g = controller.choose(remaining, open_ended=proposer.stops_early)
    if g == 0:
        return empty_proposal(vocab), 0, False
    if proposer.stops_early:  # γ: the depth the draft went on to; verified: what is worth it of that
        proposal = proposer.propose(context, g, params, rng, keep_going=controller.keep_drafting)
        if len(proposal.confidences) == len(proposal):
            return proposal.truncate(controller.worth_verifying(proposal.confidences)), len(proposal), False
        return proposal, len(proposal), False
    return proposer.propose(context, g, params, rng), g, False


def finish_reason(new: list[int], eos_ids: set[int], params: SamplingParams, room: int) -> tuple[list[int], str | None]:
    """Cut a round's tokens at eos (kept) or at the token budget."""
    if not params.ignore_eos:
        for i, token in enumerate(new[:room]):
            if token in eos_ids:
                return new[: i + 1], "stop"
    if len(new) >= room:
        return new[:room], "length"
    return new, None


def speculate(
    prompt_ids: list[int],
    proposer: Proposer | None,
    verifier,  # TargetVerifier or a remote proxy: prefill(ids), verify(context, proposal, params, rng), release()
    controller: GammaController,
    params: SamplingParams,
    rng: PositionRNG,
    max_new_tokens: int,
    vocab: int,
    eos_ids: set[int],
    stats: GenerationStats,
    hit_stop: Callable[[list[int]], bool] | None = None,
    pipelined: bool = False,
) -> Iterator[tuple[list[int], str | None]]:
    """Yield (new tokens, finish reason or None) once per round; releases both sides at the end.

    pipelined: before each verify, ask the proposer to prefetch the next block
    on the all-accepted branch (γ chosen now, one round early). With
    position-keyed randomness the tokens are the same as without pipelining.
    """
    context = list(prompt_ids)
    produced = 0
    try:
        t0 = time.perf_counter()
        verifier.prefill(context)
        if proposer is not None:
            proposer.prefill(context)
        stats.prefill_time_s = time.perf_counter() - t0
        while produced < max_new_tokens:
            t_round = time.perf_counter()
            remaining = max_new_tokens - produced
            proposal, g, looked_up = draft_block(proposer, controller, context, remaining, params, rng, vocab)
            t_drafted = time.perf_counter()
            after = remaining - len(proposal) - 1  # tokens still wanted if this block is fully accepted
            if pipelined and proposer is not None and not proposer.free and len(proposal) and after > 0:
                proposer.prefetch(context, proposal, controller.choose(after), params, rng)
            verdict = verifier.verify(context, proposal, params, rng)
            t_verified = time.perf_counter()
            draft_s, verify_s = t_drafted - t_round, t_verified - t_drafted
            stats.record_round(g, len(proposal), verdict.n_accepted, draft_s, verify_s, looked_up)
            step = getattr(verifier, "last_step", None)  # a batched target step reports itself
            controller.update(
                RoundObservation(
                    g, len(proposal), verdict.n_accepted, verdict.betas,
                    draft_s, verify_s, time.perf_counter() - t_round, proposal.key, proposal.confidences,
                    *((step.tokens, step.sessions, step.seconds) if step is not None else ()),
                )
            )
            new = proposal.tokens[: verdict.n_accepted] + [verdict.next_token]
            new, reason = finish_reason(new, eos_ids, params, remaining)
            context.extend(new)
            produced += len(new)
            if reason is None and hit_stop is not None and hit_stop(context[len(prompt_ids) :]):
                reason = "stop"
            logprobs = verdict.logprobs[: len(new)] if verdict.logprobs is not None else None
            yield Round(new, reason, proposal.tokens, verdict.n_accepted, looked_up, logprobs)
            if reason is not None:
                return
    finally:
        verifier.release()
        if proposer is not None:
            proposer.release()
