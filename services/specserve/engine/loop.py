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
from dataclasses import dataclass, field

from specserve.engine.proposers import Proposal, Proposer, empty_proposal
from specserve.speculation import GammaController, PositionRNG, RoundObservation, SamplingParams


@dataclass
class Round:
    """One speculation round, the one record of it from the step that produced it to the client: the worker
    sends it as a `RoundReply` (`rpc.convert`), the coordinator hands it to the ingress in a `Chunk`, and
    whoever consumes it records it once (`GenerationStats.record`)."""

    tokens: list[int]  # emitted: the accepted draft tokens and the target's own, cut at eos or the budget
    finish_reason: str | None  # "stop", "length", or None while the session goes on
    gamma: int  # the depth asked for (a draft that stops early: the depth it went to)
    drafted: list[int] = field(default_factory=list)  # the block the target verified
    accepted: int = 0  # how many of `drafted` were kept
    looked_up: bool = False  # prompt lookup drafted the block
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0  # as the session saw it (waiting for a shared step, or the wire, included)
    step_time_s: float = 0.0  # compute time of the target step that verified it, where a worker reports it
    prefill_time_s: float = 0.0  # the session's prefill, on the first round after it
    logprobs: list | None = None  # per emitted token, when asked (`speculation.sampling.token_logprobs`)
    cached_tokens: int = 0  # on the first round: prompt tokens the target's prefill found computed (prefix cache)


def draft_block(
    proposer: Proposer | None,
    controller: GammaController,
    context: list[int],
    remaining: int,
    params: SamplingParams,
    rng: PositionRNG,
    vocab: int,
    lag: int = 0,
) -> tuple[Proposal, int, bool]:
    """(proposal, γ chosen, whether prompt lookup drafted it). A free draft proposes first so γ can depend on
    the proposal's quality; a draft that stops early gets γ as a ceiling and asks the controller after each
    token. lag: context tokens a model draft would feed first (`GammaController.choose`)."""
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
    g = controller.choose(remaining, open_ended=proposer.stops_early, lag=lag)
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
    verifier,  # TargetVerifier or a proxy: prefill(ids), verify(context, proposal, params, rng), release(), last_step
    controller: GammaController,
    params: SamplingParams,
    rng: PositionRNG,
    max_new_tokens: int,
    vocab: int,
    eos_ids: set[int],
    hit_stop: Callable[[list[int]], bool] | None = None,
    pipelined: bool = False,
) -> Iterator[Round]:
    """Yield one `Round` per round until a finish reason; releases both sides at the end.

    pipelined: before each verify, ask the proposer to prefetch the next block
    on the all-accepted branch (γ chosen now, one round early). With
    position-keyed randomness the tokens are the same as without pipelining.
    """
    context = list(prompt_ids)
    produced = 0
    try:
        t0 = time.perf_counter()
        verifier.prefill(context)
        eager = proposer is not None and not proposer.lazy_prefill
        if eager:
            proposer.prefill(context)
        prefill_s = time.perf_counter() - t0
        cached = getattr(verifier, "cached_tokens", 0)
        in_draft = len(context) - 1 if eager else 0  # context tokens the model draft's cache holds
        while produced < max_new_tokens:
            t_round = time.perf_counter()
            remaining = max_new_tokens - produced
            proposal, g, looked_up = draft_block(proposer, controller, context, remaining, params, rng, vocab,
                                                 len(context) - in_draft)
            t_drafted = time.perf_counter()
            model_drafted = g > 0 and not looked_up and proposer is not None and not proposer.free
            draft_fed = len(context) - in_draft if model_drafted else 0
            after = remaining - len(proposal) - 1  # tokens still wanted if this block is fully accepted
            if pipelined and proposer is not None and not proposer.free and len(proposal) and after > 0:
                proposer.prefetch(context, proposal, controller.choose(after), params, rng)
            verdict = verifier.verify(context, proposal, params, rng)
            t_verified = time.perf_counter()
            draft_s, verify_s = t_drafted - t_round, t_verified - t_drafted
            step = verifier.last_step  # the target step that verified this block (None: not reported)
            shared = {} if step is None or not step.sessions else {
                "step_tokens": step.tokens, "step_sessions": step.sessions, "step_time_s": step.seconds,
                "step_prompt_tokens": step.prompt_tokens, "step_prompt_sessions": step.prompt_sessions}
            controller.update(
                RoundObservation(
                    g, len(proposal), verdict.n_accepted, verdict.betas,
                    draft_s, verify_s, time.perf_counter() - t_round, proposal.key, proposal.confidences,
                    draft_fed=draft_fed, **shared,
                )
            )
            if model_drafted:  # it fed its drafted tokens but the last; the accepted ones stay valid
                ran = max(len(proposal), len(proposal.confidences))
                in_draft = len(context) + max(0, min(verdict.n_accepted, ran - 1))
            new = proposal.tokens[: verdict.n_accepted] + [verdict.next_token]
            new, reason = finish_reason(new, eos_ids, params, remaining)
            context.extend(new)
            produced += len(new)
            if reason is None and hit_stop is not None and hit_stop(context[len(prompt_ids) :]):
                reason = "stop"
            logprobs = verdict.logprobs[: len(new)] if verdict.logprobs is not None else None
            yield Round(new, reason, g, proposal.tokens, verdict.n_accepted, looked_up, draft_s, verify_s,
                        step.seconds if step is not None else 0.0, prefill_s, logprobs, cached)
            prefill_s, cached = 0.0, 0
            if reason is not None:
                return
    finally:
        verifier.release()
        if proposer is not None:
            proposer.release()
