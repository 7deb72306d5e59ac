"""Pure speculative-sampling math: distributions, acceptance, randomness, γ control.

Nothing here knows about models, tokenizers, Ray or gRPC: functions take
tensors (and plain numbers) and return tensors, so every worker can share them
and every statistical claim can be tested on small synthetic inputs.
"""

import importlib

# on first use: the command line reads γ specs without importing torch
_LAZY = {
    **{name: "controllers" for name in ("AutoGamma", "FixedGamma", "GammaController", "HeuristicGamma",
                                         "RoundObservation", "WarmStarts", "expected_tokens_per_round",
                                         "make_controller", "parse_gamma")},
    "SamplingParams": "params",
    **{name: "rejection" for name in ("Verdict", "accept_batch", "accept_greedy", "accept_prefix",
                                       "residual_distribution")},
    "PositionRNG": "rng", "Purpose": "rng",
    **{name: "sampling" for name in ("probs_from_logits", "sample_from_probs", "sparse_to_dense")},
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"specserve.speculation.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'specserve.speculation' has no attribute {name!r}")


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
