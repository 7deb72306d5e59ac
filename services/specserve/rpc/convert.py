"""Wire messages <-> engine types. Errors are ValueErrors that name the offending field."""

from __future__ import annotations

import torch
from pydantic import ValidationError

from specserve.engine.loop import Round
from specserve.engine.proposers import Proposal
from specserve.speculation import SamplingParams
from specserve.v1 import generator_pb2, workers_pb2


def sampling_to_proto(params: SamplingParams, seed: int | None = None) -> generator_pb2.SamplingParams:
    msg = generator_pb2.SamplingParams(
        temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
        stop=params.stop or [], ignore_eos=params.ignore_eos,
    )
    seed = params.seed if seed is None else seed
    if seed is not None:
        msg.seed = seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    return msg


def sampling_from_proto(msg: generator_pb2.SamplingParams, field: str = "sampling") -> SamplingParams:
    values = {
        "temperature": msg.temperature if msg.HasField("temperature") else 1.0,
        "top_k": msg.top_k,
        "top_p": msg.top_p if msg.HasField("top_p") else 1.0,
        "seed": msg.seed if msg.HasField("seed") else None,
        "stop": list(msg.stop) or None,
        "ignore_eos": msg.ignore_eos,
        "logprobs": msg.logprobs if msg.HasField("logprobs") else None,
    }
    try:
        return SamplingParams(**values)
    except ValidationError as exc:
        first = exc.errors()[0]
        name = ".".join(str(part) for part in first["loc"])
        raise ValueError(f"{field}.{name}: {first['msg']}") from None


def q_to_wire(q: torch.Tensor) -> list[workers_pb2.SparseDistribution]:
    """q: [k, vocab] → one sparse distribution per row, over its support only."""
    out = []
    for row in q:
        ids = torch.nonzero(row > 0).squeeze(-1)
        out.append(workers_pb2.SparseDistribution(ids=ids.tolist(), probs=row[ids].tolist()))
    return out


def proposal_q_to_wire(proposal) -> list[workers_pb2.SparseDistribution]:
    """A proposal's q on the wire; a one-hot q straight from its tokens, without building it."""
    if proposal.one_hot:
        return [workers_pb2.SparseDistribution(ids=[token], probs=[1.0]) for token in proposal.tokens]
    return q_to_wire(proposal.q)


def q_from_wire(dists, vocab: int) -> torch.Tensor:
    """Sparse distributions → dense [k, vocab] float32 (bit-identical values to what was sent)."""
    q = torch.zeros(len(dists), vocab, dtype=torch.float32)
    for i, dist in enumerate(dists):
        if len(dist.ids) != len(dist.probs) or not len(dist.ids):
            raise ValueError(f"q[{i}]: ids and probs must be non-empty and of equal length")
        ids = torch.tensor(list(dist.ids), dtype=torch.long)
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise ValueError(f"q[{i}].ids: token ids must be in [0, {vocab})")
        q[i, ids] = torch.tensor(list(dist.probs), dtype=torch.float32)
    return q


def proposal_from_wire(tokens, dists, vocab: int, key: str | None = None):
    """A Proposal from wire tokens and q; a one-hot q (each row all on its own token) stays unbuilt."""
    tokens = list(tokens)
    if len(dists) != len(tokens):
        raise ValueError(f"q: expected one distribution per token ({len(tokens)}), got {len(dists)}")
    if all(len(d.ids) == 1 and d.ids[0] == t and 0 <= t < vocab and d.probs[:] == [1.0] for d, t in zip(dists, tokens)):
        return Proposal(tokens, vocab, key)
    return Proposal(tokens, q_from_wire(dists, vocab), key)


def logprobs_to_wire(logprobs) -> list[generator_pb2.TokenLogprob]:
    """`Verdict.logprobs` entries (token, log-probability, [(token, log-probability)]) as messages."""
    return [generator_pb2.TokenLogprob(token_id=t, logprob=lp, top=[generator_pb2.TopLogprob(token_id=i, logprob=v)
                                                                    for i, v in top])
            for t, lp, top in logprobs or ()]


def logprobs_from_wire(messages) -> list | None:
    """The inverse of logprobs_to_wire (None for none: the request did not ask)."""
    if not len(messages):
        return None
    return [(m.token_id, m.logprob, [(t.token_id, t.logprob) for t in m.top]) for m in messages]


def round_to_wire(rnd: Round) -> workers_pb2.RoundReply:
    return workers_pb2.RoundReply(
        tokens=rnd.tokens, finish_reason=rnd.finish_reason or "", gamma=rnd.gamma, drafted_tokens=rnd.drafted,
        accepted=rnd.accepted, looked_up=rnd.looked_up, draft_time_s=rnd.draft_time_s,
        verify_time_s=rnd.verify_time_s, step_time_s=rnd.step_time_s, prefill_time_s=rnd.prefill_time_s,
        logprobs=logprobs_to_wire(rnd.logprobs), cached_tokens=rnd.cached_tokens,
    )


def round_from_wire(reply: workers_pb2.RoundReply) -> Round:
    return Round(list(reply.tokens), reply.finish_reason or None, reply.gamma, list(reply.drafted_tokens),
                 reply.accepted, reply.looked_up, reply.draft_time_s, reply.verify_time_s, reply.step_time_s,
                 reply.prefill_time_s, logprobs_from_wire(reply.logprobs), reply.cached_tokens)
