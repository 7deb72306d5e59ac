"""The speculation engine: the loop, proposers and verifier, session assembly, and the single-process library
decoder built on them (`SpeculativeDecoder`). What runs only inside a worker is `scheduler`."""

from specserve.lazy import exports

# on first use: the coordinator (a Serve replica's) imports the loop without the models' code
_LAZY = {"GenerationResult": "decoder", "SpeculativeDecoder": "decoder", "GenerationStats": "stats",
         **{name: "proposers" for name in ("ModelProposer", "NgramProposer", "Proposal", "Proposer", "TargetVerifier")}}

__all__ = sorted(_LAZY)

__getattr__ = exports("specserve.engine", {name: f"specserve.engine.{module}" for name, module in _LAZY.items()})
