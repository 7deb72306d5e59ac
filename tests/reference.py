"""Plain-loop NumPy references the vectorized code is checked against."""

from __future__ import annotations

import numpy as np


def reference_probs(logits, temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """The distribution sampled from for one logits vector (temperature → top-k → top-p)."""
    logits = np.asarray(logits, dtype=np.float64)
    vocab = logits.shape[0]
    if temperature == 0:
        out = np.zeros(vocab)
        out[int(np.argmax(logits))] = 1.0
        return out
    z = logits / temperature
    if 0 < top_k < vocab:
        kth = np.sort(z)[::-1][top_k - 1]
        z = np.where(z < kth, -np.inf, z)
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1.0:
        kept = np.zeros(vocab, dtype=bool)
        mass = 0.0
        for idx in np.argsort(-p, kind="stable"):
            if mass >= top_p:
                break
            kept[idx] = True
            mass += p[idx]
        p = np.where(kept, p, 0.0)
        p /= p.sum()
    return p


def reference_accept(draft_tokens, q, p, u_accept, u_final):
    """Leviathan et al. Algorithm 1, one position at a time."""
    gamma = len(draft_tokens)
    for i, x in enumerate(draft_tokens):
        if u_accept[i] < min(1.0, p[i][x] / q[i][x]):
            continue
        residual = np.maximum(p[i] - q[i], 0.0)
        residual /= residual.sum()
        return i, _inverse_cdf(residual, u_final[i])
    return gamma, _inverse_cdf(p[gamma], u_final[gamma])


def _inverse_cdf(probs, u) -> int:
    cdf = np.cumsum(probs)
    return int(min(np.searchsorted(cdf, u * cdf[-1], side="right"), np.nonzero(probs)[0][-1]))
