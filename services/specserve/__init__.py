"""specserve: lossless speculative decoding, from a laptop to a Ray cluster."""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# imported on first use: a process that needs only the wire code (Serve's gRPC proxy, the CLI before its models
# load) does not pay for torch and transformers
_LAZY = {"GenerationResult": "specserve.engine", "GenerationStats": "specserve.engine",
         "SpeculativeDecoder": "specserve.engine", "SamplingParams": "specserve.speculation"}

__all__ = ["GenerationResult", "GenerationStats", "SamplingParams", "SpeculativeDecoder", "__version__"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'specserve' has no attribute {name!r}")
