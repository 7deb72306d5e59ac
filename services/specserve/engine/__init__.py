"""Single-process engine: the library API, its CLI and the benchmark harness."""

from specserve.engine.decoder import GenerationResult, SpeculativeDecoder
from specserve.engine.proposers import ModelProposer, NgramProposer, Proposal, Proposer, TargetVerifier
from specserve.engine.stats import GenerationStats

__all__ = [
    "GenerationResult",
    "GenerationStats",
    "ModelProposer",
    "NgramProposer",
    "Proposal",
    "Proposer",
    "SpeculativeDecoder",
    "TargetVerifier",
]
