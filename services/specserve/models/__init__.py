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

from specserve.lazy import exports

# on first use: a process that only reads files (the CLI, a Serve replica) imports no modelling code (whose
# transformers imports cost seconds on two cores); what reads a draft's config imports `drafts.configs`
_LAZY = {
    "match_ngram": "specserve.models.drafts.ngram",
    "propose_ngram": "specserve.models.drafts.ngram",
    "SubsetDraftConfig": "specserve.models.drafts.configs",
    "SubsetDraftForCausalLM": "specserve.models.drafts.subset",
    "CachedSequence": "specserve.models.families.sequence",
    **{name: "specserve.models.formats.loading" for name in (
        "LoadedModel", "default_device", "default_dtype", "load_model", "load_tokenizer", "resolve_dtype")},
    "resolve_draft": "specserve.models.formats.embedded",
}

__all__ = sorted(_LAZY)

__getattr__ = exports("specserve.models", _LAZY)
