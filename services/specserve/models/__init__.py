"""The models a worker runs: loading targets and drafts, their forward, their kernels and their KV memory.

Four rooms, each importing only the rooms listed before it:

- `kernels/`: the quantized linears, specserve's C++ CPU kernels (`csrc/`) and tensor-parallel collectives;
- `families/`: what each family's decoder layer computes (`arch`), its packed weights and the lean forward;
- `memory/`: a worker's KV pool, its static-shape step runner and the prefix cache;
- `formats/`: turning a user's spec (HF checkpoint, GGUF file, the embedded model) into a loaded model;

and `drafts/` above them: the distilled draft, the feature head on the target's hidden states, prompt lookup.

This package knows about transformers models and tokenizers; it knows nothing about how tokens are accepted
(that is `speculation/`) or served.
"""

from specserve.models.drafts.ngram import match_ngram, propose_ngram
from specserve.models.drafts.subset import SubsetDraftConfig, SubsetDraftForCausalLM
from specserve.models.families.sequence import CachedSequence
from specserve.models.formats.loading import (
    LoadedModel,
    default_device,
    default_dtype,
    load_model,
    load_tokenizer,
    resolve_draft,
    resolve_dtype,
)
from specserve.models.kernels import cpu

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

cpu.guard_forced_aten_isa()  # in every process that loads a model (a forced AVX2 run)
