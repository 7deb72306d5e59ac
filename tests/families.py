"""Tiny random-weight models of every family the lean forward runs (`specserve.models.families.arch`), made by
transformers' own classes: milliseconds to build and run, sliding windows shorter than the test prompts,
rope scalings that change every frequency within a few positions."""

from __future__ import annotations

import torch
import transformers

WINDOW = 6  # shorter than every prompt the tests feed, so each sliding layer's window masks
SMALL = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 256, "bos_token_id": None, "eos_token_id": None,
         "pad_token_id": None}

# name -> (config class, its arguments beyond SMALL)
CONFIGS = {
    "llama": ("LlamaConfig", {}),
    "llama3": ("LlamaConfig", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 16}}),
    "llama-yarn": ("LlamaConfig", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                       "original_max_position_embeddings": 64}}),
    "llama-linear": ("LlamaConfig", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0,
                                                         "factor": 2.0}}),
    "mistral": ("MistralConfig", {"sliding_window": WINDOW, "head_dim": 16}),
    "qwen2": ("Qwen2Config", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    "phi3": ("Phi3Config", {"partial_rotary_factor": 0.5,
                            "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                                                "short_factor": [1.0, 1.5], "long_factor": [2.0, 4.0],
                                                "original_max_position_embeddings": 128,
                                                "partial_rotary_factor": 0.5}}),
    "olmo2": ("Olmo2Config", {}),
    "gemma": ("GemmaConfig", {"head_dim": 16}),
    "gemma2": ("Gemma2Config", {"head_dim": 8, "sliding_window": WINDOW, "query_pre_attn_scalar": 12,
                                "attn_logit_softcapping": 3.0, "final_logit_softcapping": 5.0}),
    "gemma3": ("Gemma3TextConfig", {"head_dim": 8, "sliding_window": WINDOW, "query_pre_attn_scalar": 12,
                                    "final_logit_softcapping": 5.0,
                                    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}),
    # fewer layers than Gemma 3's sliding pattern (6): every layer slides, no full-attention rope is built
    "gemma3-sliding": ("Gemma3TextConfig", {"head_dim": 8, "sliding_window": 16, "query_pre_attn_scalar": 12,
                                            "num_hidden_layers": 2}),
}

GEMMA_EMBED = 1.0
CAUSAL_LM = {"Gemma3TextConfig": "Gemma3ForCausalLM"}


SPREAD = {"gemma3": 0.1, "gemma3-sliding": 0.1}  # wider, its greedy output repeats one token


# heads of 32 channels, what specserve's CPU kernels take (`kernels.cpu.step_kernels`)
WIDE = {"hidden_size": 128, "intermediate_size": 256, "head_dim": 32}


def tiny_family(name: str, seed: int = 0, vocab: int = 40, dtype=torch.float64, spread: float | None = None,
                wide: bool = False):
    """A random model of family `name` (see CONFIGS): every weight drawn N(0, spread²), norms around 1. wide:
    heads of 32 channels (`WIDE`)."""
    spread = spread or SPREAD.get(name, 0.35)
    cls, extra = CONFIGS[name]
    torch.manual_seed(seed)
    shape = {**SMALL, **extra, **(WIDE if wide else {})}
    if wide and "query_pre_attn_scalar" in shape:
        shape["query_pre_attn_scalar"] = 32
    config = getattr(transformers, cls)(vocab_size=vocab, **shape)
    model_cls = getattr(transformers, CAUSAL_LM.get(cls, cls.replace("Config", "ForCausalLM")))
    model = model_cls(config).to(dtype).eval()
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if "norm" in pname:  # around 1 for Llama's w·x, around 0 for Gemma's (1 + w)·x
                param.copy_(param.mean() + 0.2 * torch.randn_like(param))
            else:
                param.normal_(0.0, spread)
        if config.model_type.startswith("gemma"):  # its embedding is scaled by sqrt(hidden): keep tokens' rows
            # from swamping the layers (each step would repeat its input)
            model.model.embed_tokens.weight.mul_(GEMMA_EMBED / config.hidden_size**0.5)
    return model
