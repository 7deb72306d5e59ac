"""The drafts' configuration classes, registered with transformers' `AutoConfig` on import (whatever reads a
model's config with `AutoConfig` imports this first); their model classes register with `AutoModelForCausalLM`
where they are defined (`register_models`)."""

from __future__ import annotations

from transformers import AutoConfig, LlamaConfig


class SubsetDraftConfig(LlamaConfig):
    model_type = "specserve_draft"

    def __init__(self, token_subset_size: int = 8192, shared_from: str | None = None,
                 shared_embedding_digest: str | None = None, **kwargs):
        kwargs["tie_word_embeddings"] = False  # the head has fewer rows than the embedding
        super().__init__(**kwargs)
        self.token_subset_size = token_subset_size
        self.shared_from = shared_from
        self.shared_embedding_digest = shared_embedding_digest


class FeatureHeadConfig(SubsetDraftConfig):
    model_type = "specserve_head"


def register_models() -> None:
    """Make `AutoModelForCausalLM` build the drafts' models (before it builds any model from a config)."""
    import specserve.models.drafts.head  # noqa: F401 - imports (and registers) the subset draft too


for _config in (SubsetDraftConfig, FeatureHeadConfig):
    AutoConfig.register(_config.model_type, _config, exist_ok=True)
