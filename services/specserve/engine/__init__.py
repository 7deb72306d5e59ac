"""The speculation engine: the loop, proposers and verifier, session assembly, and the single-process library
decoder built on them (`SpeculativeDecoder`). What runs only inside a worker is `scheduler`."""

import importlib

# on first use: the coordinator (a Serve replica's) imports the loop without the models' code
_LAZY = {"GenerationResult": "decoder", "SpeculativeDecoder": "decoder", "GenerationStats": "stats",
         **{name: "proposers" for name in ("ModelProposer", "NgramProposer", "Proposal", "Proposer", "TargetVerifier")}}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"specserve.engine.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'specserve.engine' has no attribute {name!r}")
