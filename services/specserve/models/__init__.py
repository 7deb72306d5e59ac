"""Loading targets and drafts, KV caches with rollback, the n-gram draft.

This package knows about transformers models and tokenizers; it knows
nothing about how tokens are accepted (that is `speculation/`) or served.
"""

from specserve.models import cpukernels
from specserve.models.draft import SubsetDraftConfig, SubsetDraftForCausalLM
from specserve.models.kv import CachedSequence
from specserve.models.loading import (
    LoadedModel,
    default_device,
    default_dtype,
    load_model,
    load_tokenizer,
    resolve_draft,
    resolve_dtype,
)
from specserve.models.ngram import match_ngram, propose_ngram

__all__ = [
    "CachedSequence",
    "LoadedModel",
    "SubsetDraftConfig",
    "SubsetDraftForCausalLM",
    "default_device",
    "default_dtype",
    "load_model",
    "load_tokenizer",
    "match_ngram",
    "propose_ngram",
    "resolve_draft",
    "resolve_dtype",
]

cpukernels.guard_forced_aten_isa()  # in every process that loads a model (a forced AVX2 run)
