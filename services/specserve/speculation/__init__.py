"""Pure speculative-sampling math: distributions, acceptance, randomness, γ control.

Nothing here knows about models, tokenizers, Ray or gRPC: functions take
tensors (and plain numbers) and return tensors, so every worker can share them
and every statistical claim can be tested on small synthetic inputs.
"""

from specserve.speculation.controllers import (
    AutoGamma,
    FixedGamma,
    GammaController,
    HeuristicGamma,
    RoundObservation,
    WarmStarts,
    expected_tokens_per_round,
    make_controller,
    parse_gamma,
)
from specserve.speculation.params import SamplingParams
from specserve.speculation.rejection import (
    Verdict,
    accept_batch,
    accept_greedy,
    accept_prefix,
    residual_distribution,
)
from specserve.speculation.rng import PositionRNG, Purpose
from specserve.speculation.sampling import probs_from_logits, sample_from_probs, sparse_to_dense

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
    "accept_batch",
    "accept_greedy",
    "accept_prefix",
    "expected_tokens_per_round",
    "make_controller",
    "parse_gamma",
    "probs_from_logits",
    "residual_distribution",
    "sample_from_probs",
    "sparse_to_dense",
]
