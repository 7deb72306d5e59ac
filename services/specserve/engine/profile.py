"""Calibration: how long a target forward over n new positions and a draft step take.

The γ cost model needs t_verify(n) for n = 1..γ_max+1 before it has seen
rounds of each size; this measures them once on scratch caches. The same
numbers are what `specserve bench` reports as the verify-cost table.
"""

from __future__ import annotations

import statistics
import time

import torch

from specserve.models.families.lean import model_sequence


def verify_profile(
    model, vocab: int, max_positions: int, context: int = 64, repeats: int = 3, sequence=None
) -> dict[int, float]:
    """Seconds for one cached forward over n new tokens after `context` tokens, n = 1..max_positions.

    sequence: a TokenSequence to time instead of a local cache of `model` (e.g. a stage pipeline).
    """
    gen = torch.Generator().manual_seed(0)
    base = torch.randint(0, vocab, (context + max_positions,), generator=gen).tolist()
    seq = sequence if sequence is not None else model_sequence(model)
    seq.feed(base[:context])
    seq.feed(base[context : context + 2], keep_logits=2)  # warm-up: first calls take slower paths

    def step(n: int) -> float:
        seq.rollback(context)
        t0 = time.perf_counter()
        seq.feed(base[context : context + n], keep_logits=n)
        return time.perf_counter() - t0

    sizes = range(1, max_positions + 1)
    samples: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(repeats + 1):  # round-robin, so drift on a shared machine hits every n alike
        for n in sizes:
            samples[n].append(step(n))
    seq.release()
    return {n: statistics.median(times[1:]) for n, times in samples.items()}


def profile_context(vocab: int, context: int = 64) -> list[int]:
    """The random context `draft_step_time` drafts after (a feature head's target is fed all but its last token)."""
    return torch.randint(0, vocab, (context,), generator=torch.Generator().manual_seed(1)).tolist()


def draft_step_time(proposer, vocab: int, context: int = 64, repeats: int = 3) -> float:
    """Seconds per drafted token for a proposer (γ=2 proposals on `profile_context`)."""
    from specserve.speculation import PositionRNG, SamplingParams

    tokens = profile_context(vocab, context)
    params, rng = SamplingParams(temperature=0.0), PositionRNG(0)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        proposer.propose(tokens, 2, params, rng)
        times.append(time.perf_counter() - t0)
    seconds = statistics.median(times[1:]) / 2
    proposer.release()
    return seconds
