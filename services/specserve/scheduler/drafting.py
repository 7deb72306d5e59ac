"""A draft's whole block of γ tokens for every session at once, with no trip to the host between its steps.

The per-token path (`ModelProposer` over a `ScheduledSequence`) reads every draft token back to the host: the
session samples it there, then sends it into the next batched draft step. On a GPU each of those trips is a
synchronisation and a step's kernel launches start only after it. `draft_blocks` instead keeps the block on
the device: step 0 feeds each session's new context tokens, then every step samples each session's next token
from its logits on the device (the position-keyed uniforms of all γ steps are computed up front and copied
once), feeds the samples straight back as the next step's input ids (`KVPool.feed_ids`, a captured graph per
bucket on CUDA), and only after the last step are the tokens, q rows and confidences read back, once.

The sampling is the per-token path's, row by row: the same head logits, `probs_from_logits`, top-k truncation
of q where the draft ships a sparse q, `sample_from_probs` with the same uniform, argmax at temperature 0, and
the same confidence (the top probability of the raw logits). A block runs to its γ ceiling; the proposer then
applies its stopping rules to the confidences, which depend on nothing a later token changes, so it keeps
exactly the tokens the per-token path would have drafted (tested). What it drafts past the cut is wasted,
which is why the per-token path stays the default where a step is not launch-bound (CPUs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.models.memory.pool import KVPool, PooledSequence
from specserve.speculation import PositionRNG, Purpose, SamplingParams, probs_from_logits, sample_from_probs
from specserve.speculation.sampling import sparse_to_dense, truncate_top_k


@dataclass
class DraftBlock:
    """One session's block: feed `tail` (its context tokens the cache lacks: ≥ 1, but none for a feature head
    with no target feature yet), then draft `gamma` tokens."""

    seq: PooledSequence
    tail: list[int]
    gamma: int
    params: SamplingParams
    rng: PositionRNG
    start: int  # the context's length: the position of the first drafted token
    top_k_q: int = 0  # sample from the top-k-truncated q (what a split draft ships)
    head: int = 0  # the logits columns it samples over: its token subset's size, else the shared vocabulary


@dataclass
class DraftedBlock:
    tokens: list[int]  # head indices (positions in the token subset where the draft's head has one, else ids)
    q: torch.Tensor | None  # [gamma, head] the rows they were sampled from (None at temperature 0: one-hot)
    confidences: list[float]  # the raw logits' top probability at each token


def _mode(block: DraftBlock) -> tuple:
    """The sampling group of a block: its (temperature, top-k, top-p, top_k_q), or greedy."""
    p = block.params
    return ("greedy",) if p.greedy else (p.temperature, p.top_k, p.top_p, block.top_k_q)


def _draw(block: DraftBlock, logits: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(token, q or None when greedy) of rows that all sample as `block` does, on their device."""
    if block.params.greedy:
        return logits.argmax(-1), None
    probs = probs_from_logits(logits, block.params)
    if block.top_k_q:
        ids, kept = truncate_top_k(probs, block.top_k_q)
        probs = sparse_to_dense(ids, kept, probs.shape[-1])
    return sample_from_probs(probs, uniforms), probs


def _confidence(logits: torch.Tensor) -> torch.Tensor:
    """The raw logits' top probability per row."""
    return torch.softmax(logits.float(), -1).max(-1).values


def _sample(logits: torch.Tensor, blocks: list[DraftBlock], uniforms: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(token [A], q [A, head] or None when every row is greedy, confidence [A]) for the A rows of `logits`,
    on their device; one sampling call per sampling group (`_mode`)."""
    tokens = torch.empty(len(blocks), dtype=torch.long, device=logits.device)
    q = None
    groups: dict[tuple, list[int]] = {}
    for i, b in enumerate(blocks):
        groups.setdefault(_mode(b), []).append(i)
    for rows in groups.values():
        # (one group, the usual case, takes every row: no index sent to the device, which would wait for it)
        index = slice(None) if len(groups) == 1 else torch.tensor(rows, dtype=torch.long, device=logits.device)
        tokens[index], probs = _draw(blocks[rows[0]], logits[index], uniforms[index])
        if probs is not None:
            if q is None:
                q = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
            q[index] = probs
    return tokens, q, _confidence(logits)


def _device_sampler(block: DraftBlock):
    """`_sample` for a static batch of rows that all sample as `block` does: (logits, uniforms) -> (token, q or
    None, confidence), nothing read on the host (capturable)."""
    return lambda logits, uniforms: (*_draw(block, logits, uniforms), _confidence(logits))


def _rest_at_once(pool: KVPool, blocks: list[DraftBlock], ids: torch.Tensor, uniforms: torch.Tensor,
                  subset: torch.Tensor | None):
    """Every block's steps after the first in one call where the pool drafts whole blocks (`HeadPool.drafted_block`:
    one graph on CUDA): blocks of one γ and one sampling group. (tokens, confidences, q or None) [n, γ - 1, ...],
    or None (then step by step)."""
    drafted_block = getattr(pool, "drafted_block", None)
    if drafted_block is None or len({_mode(b) for b in blocks}) > 1 or not all(b.tail for b in blocks):
        return None
    return drafted_block([b.seq for b in blocks], ids, blocks[0].gamma - 1, blocks[0].head, _mode(blocks[0]),
                         _device_sampler(blocks[0]), uniforms, subset)


def room(block: DraftBlock) -> int:
    """The positions `block`'s cache must hold for its whole block (reserve them before `draft_blocks`, so a
    block the pool cannot hold fails alone, before any forward)."""
    return len(block.seq.tokens) + len(block.tail) + block.gamma - 1


@torch.inference_mode()
def draft_blocks(pool: KVPool, blocks: list[DraftBlock]) -> list[DraftedBlock]:
    """Every block's tokens (see the module docstring), the blocks of one draft (one `head`). Each block's cache
    ends holding its tail and all but its last drafted token, as after the per-token path."""
    dev, longest, head = pool.w.device, max(b.gamma for b in blocks), blocks[0].head
    uniforms = torch.tensor([[b.rng.uniform(b.start + i, Purpose.DRAFT) for i in range(longest)] for b in blocks],
                            dtype=torch.float64).to(dev, non_blocking=True)
    tokens = torch.zeros(len(blocks), longest, dtype=torch.long, device=dev)
    confidences = torch.zeros(len(blocks), longest, dtype=torch.float64, device=dev)
    q = None
    subset = pool.w.token_subset.to(dev) if pool.w.token_subset is not None else None  # head index → token id
    live = list(range(len(blocks)))  # the blocks the current step's logits rows belong to
    fed = [i for i, b in enumerate(blocks) if b.tail]  # (a feature head with no feature yet feeds nothing)
    logits = pool.forward([blocks[i].seq for i in fed], [blocks[i].tail for i in fed], [1] * len(fed), host=False) \
        if fed else None
    if len(fed) < len(blocks):  # those start from equal logits, as a head's `equal_logits`
        first = torch.zeros(len(blocks), head if logits is None else logits.shape[1], device=dev)
        if logits is not None:
            first[torch.tensor(fed, device=dev)] = logits.float()
        logits = first
    for step in range(longest):
        # every block still drafting (the usual case): slices, not an index copied to the device at each step
        rows = slice(None) if len(live) == len(blocks) else torch.tensor(live, dtype=torch.long, device=dev)
        token, q_step, confidence = _sample(logits[:, :head], [blocks[i] for i in live], uniforms[rows, step])
        tokens[rows, step], confidences[rows, step] = token, confidence.double()
        if q_step is not None:
            if q is None:
                q = torch.zeros(len(blocks), longest, head, dtype=torch.float32, device=dev)
            q[rows, step] = q_step
        going = [j for j, i in enumerate(live) if blocks[i].gamma > step + 1]
        if not going:
            break
        if step == 0 and len(going) == len(blocks) == len(live) and len({b.gamma for b in blocks}) == 1:
            rest = _rest_at_once(pool, blocks, token if subset is None else subset[token], uniforms[:, 1:], subset)
            if rest is not None:  # the steps after the first as one graph (a head's runner)
                tokens[:, 1:], confidences[:, 1:] = rest[0], rest[1]
                if rest[2] is not None:
                    q[:, 1:] = rest[2]
                break
        fed = token if len(going) == len(live) else token[torch.tensor(going, device=dev)]
        live = [live[j] for j in going]
        logits = pool.feed_ids([blocks[i].seq for i in live], fed if subset is None else subset[fed])
    host = torch.cat((tokens.double(), confidences), 1).tolist()  # the one read back of the block
    out = []
    for i, b in enumerate(blocks):
        drafted = [int(t) for t in host[i][: b.gamma]]
        if b.gamma > 1:  # the placeholders `feed_ids` left for the tokens fed back
            fed = drafted[:-1] if subset is None else pool.w.token_subset[drafted[:-1]].tolist()
            b.seq.tokens[-(b.gamma - 1):] = fed
        q_rows = None if b.params.greedy else q[i, : b.gamma]
        out.append(DraftedBlock(drafted, q_rows, host[i][longest : longest + b.gamma]))
    return out
