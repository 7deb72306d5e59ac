"""Random EAGLE-3 heads written in the public layout (config.json with `LlamaForCausalLMEagle3`, the tensors' names and
shapes as vLLM's and SGLang's loaders read them: `midlayer.*`, `fc`, `norm`, `lm_head` over a reduced vocabulary,
`d2t` and `t2d`; no embedding, the target's is shared)."""

from __future__ import annotations

import json
import pathlib

import torch
from safetensors.torch import save_file


def write_eagle3(path: pathlib.Path, target, draft_vocab: int, seed: int = 0, aux_ids: list[int] | None = None,
                 spread: float = 0.3) -> pathlib.Path:
    """A random EAGLE-3 head for `target` (a HF model) at `path`; its vocabulary a random sorted subset of the
    target's. Returns path."""
    tc = target.config
    h, heads, kv = tc.hidden_size, tc.num_attention_heads, tc.num_key_value_heads
    hd, inter, vocab = h // heads, 2 * h, tc.vocab_size
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=spread):
        return torch.randn(*shape, generator=g) * scale

    used = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[used] = True
    tensors = {
        "fc.weight": rnd(h, 3 * h, scale=spread / 2),
        "midlayer.input_layernorm.weight": 1 + rnd(h, scale=0.1),
        "midlayer.hidden_norm.weight": 1 + rnd(h, scale=0.1),
        "midlayer.post_attention_layernorm.weight": 1 + rnd(h, scale=0.1),
        "midlayer.self_attn.q_proj.weight": rnd(heads * hd, 2 * h),
        "midlayer.self_attn.k_proj.weight": rnd(kv * hd, 2 * h),
        "midlayer.self_attn.v_proj.weight": rnd(kv * hd, 2 * h),
        "midlayer.self_attn.o_proj.weight": rnd(h, heads * hd),
        "midlayer.mlp.gate_proj.weight": rnd(inter, h),
        "midlayer.mlp.up_proj.weight": rnd(inter, h),
        "midlayer.mlp.down_proj.weight": rnd(h, inter),
        "norm.weight": 1 + rnd(h, scale=0.1),
        "lm_head.weight": rnd(draft_vocab, h, scale=1.0),
        "d2t": used - torch.arange(draft_vocab),
        "t2d": t2d,
    }
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": h,
              "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv,
              "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "max_position_embeddings": tc.max_position_embeddings, "vocab_size": vocab,
              "draft_vocab_size": draft_vocab, "target_hidden_size": h, "tie_word_embeddings": False,
              "torch_dtype": "float32"}
    if aux_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_ids, "use_aux_hidden_state": True}
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path
