"""Split a decoder-only LM into pipeline stages (layers split, hidden states passed on).

A stage keeps a contiguous slice of the decoder layers; the first stage also
embeds the tokens, the last also applies the final norm and the LM head.
Each stage has its own KV cache over its own layers, so stage i only needs
the hidden states stage i-1 produced for the new positions. Works for the
Llama family layout of transformers (`model.model.layers`, `.norm`,
`.lm_head`, rotary embeddings computed per stage from the cache length),
which covers Llama, Mistral, Qwen2 and SmolLM.
"""

from __future__ import annotations

import copy

import torch
from torch import nn


def stage_bounds(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Contiguous, near-equal layer ranges."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"num_stages must be in [1, {num_layers}] (the model's layers), got {num_stages}")
    edges = [round(i * num_layers / num_stages) for i in range(num_stages + 1)]
    return list(zip(edges[:-1], edges[1:]))


class PipelineStage(nn.Module):
    """Layers [start, end) of `model` (consumed: its other layers are dropped)."""

    def __init__(self, model, start: int, end: int):
        super().__init__()
        body = model.model
        n = len(body.layers)
        if not 0 <= start < end <= n:
            raise ValueError(f"stage layers [{start}, {end}) outside the model's {n} layers")
        self.first, self.last = start == 0, end == n
        config = copy.deepcopy(body.config)
        config.num_hidden_layers = end - start
        if getattr(config, "layer_types", None):
            config.layer_types = list(config.layer_types)[start:end]
        layers = list(body.layers)[start:end]
        for i, layer in enumerate(layers):  # the stage's cache has its own layer numbering
            layer.self_attn.layer_idx = i
        body.config = config
        body.layers = nn.ModuleList(layers)
        if not self.last:
            body.norm = nn.Identity()
        if not self.first:
            body.embed_tokens = None
        self.body = body
        self.lm_head = model.lm_head if self.last else None
        self.config = config
        self.start, self.end = start, end

    @torch.inference_mode()
    def forward(self, x: torch.Tensor, cache, keep: int = 1) -> torch.Tensor:
        """x: token ids [1, n] (first stage) or hidden states [1, n, d]; returns hidden states or [1, keep, vocab]."""
        inputs = {"input_ids": x} if self.first else {"inputs_embeds": x}
        hidden = self.body(**inputs, past_key_values=cache, use_cache=True).last_hidden_state
        return self.lm_head(hidden[:, -keep:]) if self.last else hidden
