"""One session over gRPC workers through the engine's loop, for tests that drive servicers directly (the
coordinator does the same with restarts, metrics and cancellation)."""

from __future__ import annotations

import uuid

from specserve.engine.loop import speculate
from specserve.engine.stats import GenerationStats
from specserve.rpc.remote import RemoteProposer, RemoteVerifier
from specserve.speculation import GammaController, PositionRNG, SamplingParams


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
    pipelined: bool = False,
    draft_lookup: bool = True,
) -> tuple[list[int], str, GenerationStats]:
    """Run one session over gRPC workers; returns (new tokens, finish reason, stats). Both sessions are released."""
    rng = PositionRNG(params.seed)  # fixes the seed both workers key their randomness on
    session_id = uuid.uuid4().hex
    proposer = (RemoteProposer(draft_stub, session_id, params, rng.seed, vocab, draft_is_free, draft_lookup)
                if draft_stub else None)
    verifier = RemoteVerifier(target_stub, session_id, params, rng.seed, vocab)
    stats = stats if stats is not None else GenerationStats()
    stats.controller = controller.name
    tokens: list[int] = []
    finish = "length"
    for rnd in speculate(prompt_ids, proposer, verifier, controller, params, rng, max_new_tokens, vocab, eos_ids,
                         pipelined=pipelined):
        stats.record(rnd)
        tokens.extend(rnd.tokens)
        finish = rnd.finish_reason or finish
    stats.new_tokens = len(tokens)
    return tokens, finish, stats
