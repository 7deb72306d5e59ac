"""specserve: lossless speculative decoding, from a laptop to a Ray cluster."""

from __future__ import annotations

from specserve.lazy import exports

__version__ = "0.1.0"

# imported on first use: a process that needs only the wire code (Serve's gRPC proxy, the CLI before its models
# load) does not pay for torch and transformers
_LAZY = {"GenerationResult": "specserve.engine", "GenerationStats": "specserve.engine",
         "SpeculativeDecoder": "specserve.engine", "SamplingParams": "specserve.speculation"}

__all__ = ["GenerationResult", "GenerationStats", "SamplingParams", "SpeculativeDecoder", "__version__"]

__getattr__ = exports("specserve", _LAZY)
