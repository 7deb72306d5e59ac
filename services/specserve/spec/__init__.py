"""Pure speculative-sampling math: distributions, acceptance, randomness, γ control.

Nothing here knows about models, tokenizers, Ray or gRPC: functions take
tensors (and plain numbers) and return tensors, so every worker can share them
and every statistical claim can be tested on small synthetic inputs.
"""

from specserve.spec.controllers import (
    AutoGamma,
    FixedGamma,
    GammaController,
    HeuristicGamma,
    RoundObservation,
    WarmStarts,
    expected_tokens_per_round,
    make_controller,
    served_gamma,
)
from specserve.spec.params import SamplingParams
from specserve.spec.rejection import Verdict, accept_greedy, accept_prefix, residual_distribution
from specserve.spec.rng import PositionRNG, Purpose
from specserve.spec.sampling import probs_from_logits, sample_from_probs, sparse_to_dense

__all__ = [
    "AutoGamma",
    "FixedGamma",
    "GammaController",
    "HeuristicGamma",
    "PositionRNG",
    "Purpose",
    "RoundObservation",
    "SamplingParams",
    "Verdict",
    "WarmStarts",
    "accept_greedy",
    "accept_prefix",
    "expected_tokens_per_round",
    "make_controller",
    "served_gamma",
    "probs_from_logits",
    "residual_distribution",
    "sample_from_probs",
    "sparse_to_dense",
]
