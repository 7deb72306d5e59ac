"""A distilled draft that borrows the target's embedding and predicts over a token subset.

`SubsetDraftForCausalLM` is a Llama stack of a few layers whose LM head
covers only the `token_subset_size` tokens the target writes most often.
Its logits are full-vocabulary with -inf outside the subset, so every
consumer (our decoder, the serving workers, HF `generate(assistant_model=…)`)
sees an ordinary causal LM whose q is 0 there; speculative sampling is exact
for any q, so the output stays the target's. The small head is where the
speed comes from: for SmolLM2-135M the full 49152-row head costs as much as
two layers.

The input embedding is the target's own, frozen during distillation, and is
NOT stored in the draft's directory: `config.shared_from` names the target
(a spec `load_model` accepts, e.g. "embedded"), and loading reads that one
tensor from the target's safetensors and checks its digest. So the shipped
draft is just its layers, norm, head and the subset ids.
"""

from __future__ import annotations

import hashlib
import json
import pathlib

import torch
from torch import nn
from transformers import AutoModelForCausalLM, GenerationMixin
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.llama.modeling_llama import LlamaModel, LlamaPreTrainedModel

from specserve.models.drafts.configs import SubsetDraftConfig

EMBEDDING = "model.embed_tokens.weight"


def embedding_digest(weight: torch.Tensor) -> str:
    """A short digest of an embedding's values (float32 bytes), to check the draft meets its own target."""
    return hashlib.sha256(weight.detach().float().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


class SubsetDraftForCausalLM(LlamaPreTrainedModel, GenerationMixin):
    config_class = SubsetDraftConfig
    _keys_to_ignore_on_save = [EMBEDDING]  # the target's; loaded from `shared_from`
    _keys_to_ignore_on_load_missing = [r"model\.embed_tokens\.weight"]

    def __init__(self, config: SubsetDraftConfig):
        super().__init__(config)
        self.model = LlamaModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.token_subset_size, bias=False)
        self.register_buffer("token_subset", torch.arange(config.token_subset_size), persistent=True)
        self.post_init()

    def expand(self, subset_logits: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits: -inf wherever the draft never proposes."""
        full = subset_logits.new_full((*subset_logits.shape[:-1], self.vocab_size), float("-inf"))
        full[..., self.token_subset] = subset_logits
        return full

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep: int | torch.Tensor = 0,
                **kwargs) -> CausalLMOutputWithPast:
        if labels is not None:
            raise ValueError("SubsetDraftForCausalLM is trained by `specserve distill`, not with labels")
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
        hidden = out.last_hidden_state
        if isinstance(logits_to_keep, int):
            hidden = hidden[:, -logits_to_keep:] if logits_to_keep else hidden
        else:
            hidden = hidden[:, logits_to_keep]
        return CausalLMOutputWithPast(logits=self.expand(self.lm_head(hidden)),
                                      past_key_values=out.past_key_values)

    @classmethod
    def from_pretrained(cls, path, *args, **kwargs):
        model = super().from_pretrained(path, *args, **kwargs)
        model.attach_shared_embedding()
        return model

    def attach_shared_embedding(self) -> None:
        """Fill the input embedding from the target named by `config.shared_from`, checking its digest."""
        if not getattr(self.config, "shared_from", None):
            raise ValueError("this draft has no embedding of its own and no `shared_from` target in its config")
        weight = read_tensor(self.config.shared_from, EMBEDDING)
        expected = getattr(self.config, "shared_embedding_digest", None)
        if expected and embedding_digest(weight) != expected:
            raise ValueError(
                f"the embedding of {self.config.shared_from!r} is not the one this draft was distilled with "
                f"(digest {embedding_digest(weight)} != {expected}); distill a draft for this target"
            )
        target = self.model.embed_tokens.weight
        if tuple(weight.shape) != tuple(target.shape):
            raise ValueError(f"shared embedding has shape {tuple(weight.shape)}, the draft needs {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(weight.to(dtype=target.dtype, device=target.device))


def read_tensor(spec: str, name: str) -> torch.Tensor:
    """One tensor of a model's files (safetensors, or a GGUF file), without loading the model."""
    from safetensors import safe_open

    from specserve.models.formats import ggufmodel
    from specserve.models.formats.loading import gguf_file, resolve_model_path

    gguf = gguf_file(spec)
    if gguf is not None:
        return ggufmodel.read_tensor(gguf, name)
    path, _ = resolve_model_path(spec)
    directory = pathlib.Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(f"the draft shares its embedding with {spec!r}, which is not a local model directory")
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files = [json.loads(index.read_text())["weight_map"][name]]
    else:
        files = sorted(p.name for p in directory.glob("*.safetensors"))
    for file in files:
        with safe_open(str(directory / file), framework="pt") as f:
            if name in f.keys():
                return f.get_tensor(name)
    raise ValueError(f"{spec!r} has no tensor {name!r} in its safetensors files")


AutoModelForCausalLM.register(SubsetDraftConfig, SubsetDraftForCausalLM)
