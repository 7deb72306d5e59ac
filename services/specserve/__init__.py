"""specserve: lossless speculative decoding, from a laptop to a Ray cluster."""

from specserve.engine import GenerationResult, GenerationStats, SpeculativeDecoder
from specserve.speculation import SamplingParams

__version__ = "0.1.0"

__all__ = ["GenerationResult", "GenerationStats", "SamplingParams", "SpeculativeDecoder", "__version__"]
