"""The speculation engine: the loop, proposers and verifier, session assembly, and the single-process library
decoder built on them (`SpeculativeDecoder`). What runs only inside a worker is `scheduler`."""

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
