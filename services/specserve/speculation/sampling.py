"""Logits → the distribution actually sampled from, and sampling with given uniforms.

Speculative sampling is exact only if the verifier uses the very distribution
each token was drawn from, so both the draft and the target go through
`probs_from_logits` with the same parameters, and every draw goes through
`sample_from_probs` with an explicit uniform (see `rng.py`).
"""

from __future__ import annotations

import torch

from specserve.speculation.params import SamplingParams


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Distribution sampled from under `params`.

    logits: [..., vocab] (any float dtype). Returns float32 [..., vocab] that
    sums to 1 along the last axis. Greedy (temperature 0) is the one-hot of
    the argmax, so the acceptance rule reduces to "accept iff equal".
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        probs = _top_p_filter(probs, params.top_p)
    return probs


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest prefix of the sorted distribution with mass ≥ top_p."""
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)  # [..., vocab]
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    keep_sorted = mass_before < top_p  # the most probable token always survives
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    probs = probs * keep
    return probs / probs.sum(-1, keepdim=True)


def truncate_top_k(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse, renormalised top-k of a distribution: what a draft ships over the wire.

    probs: [n, vocab]. Returns (ids [n, k'], probs [n, k']) with k' = min(k, vocab);
    tokens with zero probability may appear with probability 0.
    """
    k = min(k, probs.shape[-1])
    values, ids = torch.topk(probs, k, dim=-1)
    return ids, values / values.sum(-1, keepdim=True)


def sparse_to_dense(ids: torch.Tensor, probs: torch.Tensor, vocab: int) -> torch.Tensor:
    """ids, probs: [n, k] → dense [n, vocab] float32."""
    dense = torch.zeros(ids.shape[0], vocab, dtype=torch.float32, device=probs.device)
    return dense.scatter_(-1, ids.long(), probs.float())


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling with given uniforms.

    probs: [n, vocab] (need not be normalised), uniforms: [n] in [0, 1).
    Returns [n] int64 token ids; a token with probability 0 is never returned.
    """
    cdf = torch.cumsum(probs.double(), dim=-1)  # [n, vocab]
    total = cdf[:, -1:]
    targets = uniforms.double().unsqueeze(-1) * total  # [n, 1], strictly below total
    ids = torch.searchsorted(cdf, targets, right=True).squeeze(-1)
    # u·total can round up to total; fall back to the last token with mass.
    last_nonzero = vocab_last_nonzero(probs)
    return torch.minimum(ids, last_nonzero)


def vocab_last_nonzero(probs: torch.Tensor) -> torch.Tensor:
    """probs: [n, vocab] → [n] index of the last entry > 0."""
    vocab = probs.shape[-1]
    positions = torch.arange(vocab, device=probs.device).expand_as(probs)
    return torch.where(probs > 0, positions, -1).max(-1).values


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[tuple[int, float, list[tuple[int, float]]]]:
    """(token, its log-probability, the `top` most likely (token, log-probability) pairs) per row of logits
    [len(tokens), vocab]: the raw distribution (OpenAI's and vLLM's default), not the sampled one, which
    temperature, top-k and top-p change."""
    logp = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)
    chosen = logp[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)].tolist()
    if top:
        values, ids = torch.topk(logp, top, dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        tops = [[] for _ in tokens]
    return [(t, lp, tp) for t, lp, tp in zip(tokens, chosen, tops)]
