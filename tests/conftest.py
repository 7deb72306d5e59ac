"""Shared fixtures: tiny random Llama models (milliseconds to build and run)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(seed: int, vocab: int = 8, layers: int = 1, hidden: int = 16, scale: float = 25.0, dtype=torch.float64):
    """A random Llama whose next-token distributions are far from uniform (scale widens the logits).

    float64 by default so batched (verify) and one-token (decode) forwards agree
    to ~1e-15 and greedy comparisons are not at the mercy of rounding.
    """
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        initializer_range=0.02 * scale,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return LlamaForCausalLM(config).to(dtype).eval()


def perturbed_copy(model, noise: float, seed: int = 123):
    """A draft that agrees with `model` often but not always."""
    import copy

    torch.manual_seed(seed)
    draft = copy.deepcopy(model)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(noise * param.std() * torch.randn_like(param))
    return draft


@pytest.fixture(scope="session")
def tiny_pair():
    """(target, draft): two different random models over the same 8-token vocabulary."""
    return tiny_llama(0), tiny_llama(1)
