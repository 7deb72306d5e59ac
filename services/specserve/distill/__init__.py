"""`specserve distill`: train a small draft against the target's own distributions."""

from specserve.distill.core import DistillConfig, distill
from specserve.distill.corpus import prompt_set

__all__ = ["DistillConfig", "distill", "prompt_set"]
