"""Pure speculative-sampling math: distributions, acceptance, randomness, γ control.

Nothing here knows about models, tokenizers, Ray or gRPC: functions take
tensors (and plain numbers) and return tensors, so every worker can share them
and every statistical claim can be tested on small synthetic inputs.
"""

from specserve.lazy import exports

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

__getattr__ = exports("specserve.speculation",
                      {name: f"specserve.speculation.{module}" for name, module in _LAZY.items()})
__all__ = sorted(_LAZY)
