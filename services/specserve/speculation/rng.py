"""Counter-based randomness keyed by (seed, absolute position, purpose).

Every uniform a generation consumes is a pure function of the request seed,
the absolute position of the token it decides and what it decides (draft
sample, acceptance test, residual/bonus sample). Output for a seed and a
fixed γ therefore does not depend on how rounds are split, overlapped or
placed on workers: there is no shared generator stream to fall out of step.

Reusing a position's uniform in a later round keeps the output exact: a
uniform is only ever reused when its earlier value never influenced a kept
outcome (a draft token, or an acceptance draw, after the first rejection).
"""

from __future__ import annotations

import enum
import secrets

import torch

_MASK = (1 << 64) - 1


class Purpose(enum.IntEnum):
    DRAFT = 0  # the draft's sample at this position
    ACCEPT = 1  # the acceptance test of the draft token at this position
    FINAL = 2  # the residual or bonus sample (also plain target sampling)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


class PositionRNG:
    """Uniforms in [0, 1) addressed by position and purpose; seed None = fresh random seed."""

    def __init__(self, seed: int | None = None):
        self.seed = secrets.randbits(63) if seed is None else int(seed)
        self._key = _splitmix64(self.seed & _MASK)

    def uniform(self, position: int, purpose: Purpose) -> float:
        h = _splitmix64(self._key ^ _splitmix64((position << 2) | int(purpose)))
        return (h >> 11) * (1.0 / (1 << 53))

    def uniforms(self, start: int, count: int, purpose: Purpose) -> torch.Tensor:
        """[count] float64 uniforms for positions start..start+count-1."""
        return torch.tensor([self.uniform(start + i, purpose) for i in range(count)], dtype=torch.float64)
