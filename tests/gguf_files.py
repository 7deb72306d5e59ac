"""Tiny GGUF files written as llama.cpp writes them: a family's metadata, a byte-level BPE tokenizer with a chat
template, norms and biases in F32, and the linears (and the embedding) as random blocks of the K-quant types a
Q4_K_M file mixes, with sub-block scales small enough for a forward that neither explodes nor vanishes."""

from __future__ import annotations

import pathlib

import numpy as np
from gguf import GGMLQuantizationType as T

from tests.cpu.test_gguf_blocks import HALVES, SIZES

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MERGES = ["Ġ t", "h e", "i n", "Ġt he", "e r", "o n", "Ġ a", "r e"]
SPECIAL = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# family -> (file architecture, shape, extra config); every linear's input width a multiple of 256 (super-blocks);
# a head of its own where `head` names its type, else tied to the embedding (as small Qwen2.5 and Gemma 2 are)
FAMILIES = {
    "llama": ("llama", dict(heads=4, kv_heads=2, head_dim=64, head="Q6_K"), {}),
    "qwen2": ("qwen2", dict(heads=4, kv_heads=2, head_dim=64, bias=True), {}),
    "qwen3": ("qwen3", dict(heads=4, kv_heads=2, head_dim=128, qk_norm=True, head="Q8_0"), {}),  # head_dim != hidden / heads
    "gemma2": ("gemma2", dict(heads=4, kv_heads=2, head_dim=64, sandwich=True),
               {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "sliding_window": 4}),
}
HIDDEN, INTER, LAYERS = 256, 512, 2
# a Q4_K_M file's mix: most linears Q4_K, v and down Q6_K; one Q5_K to have it
TYPES = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K", "ffn_gate": "Q5_K",
         "ffn_up": "Q4_K", "ffn_down": "Q6_K"}
# the largest |code · sub-block scale| of each type (with its offset): float16 scales of 0.05 over it
REACH = {"Q4_K": 63 * 15, "Q5_K": 63 * 31, "Q6_K": 127 * 32, "Q8_0": 127, "Q4_0": 8, "Q4_1": 15, "Q5_0": 16,
         "Q5_1": 31, "Q2_K": 15 * 3, "Q3_K": 32 * 4}


def byte_tokens() -> list[str]:
    """GPT-2's byte-to-unicode alphabet: the 256 single-byte tokens, in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def vocabulary() -> list[str]:
    return byte_tokens() + [m.replace(" ", "") for m in MERGES] + SPECIAL


def blocks(kind: str, n: int, k: int, rng: np.random.Generator, reach: float = 0.05) -> np.ndarray:
    """Raw blocks of `kind` for an [n, k] weight: random codes and sub-block scales, float16 scales of `reach` over
    the type's largest code (so |w| ≲ reach)."""
    size, values = SIZES[kind]
    raw = rng.integers(0, 256, (n * k // values, size), dtype=np.uint8)
    for at in HALVES[kind]:
        scale = rng.uniform(0.5, 1.0, (len(raw), 1)) * reach / REACH[kind]
        raw[:, at:at + 2] = scale.astype(np.float16).view(np.uint8)
    return raw.reshape(n, -1)


def write_gguf(path: pathlib.Path, family: str, seed: int = 0, embedding: str = "Q6_K", head_reach: float = 0.4,
               linears: str | None = None) -> pathlib.Path:
    """A two-layer model of `family` (FAMILIES) as a GGUF file at `path`. head_reach: how wide an untied head's
    weights are (the same seed with another reach: the same model with flatter or sharper distributions).
    linears: one type for every linear (default: a Q4_K_M file's mix, `TYPES`)."""
    import gguf

    arch, shape, extra = FAMILIES[family]
    rng = np.random.default_rng(seed)
    heads, kv_heads, head_dim = shape["heads"], shape["kv_heads"], shape["head_dim"]
    vocab = vocabulary()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{family}")
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(INTER)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(len(vocab))
    if "sliding_window" in extra:
        w.add_sliding_window(extra["sliding_window"])
    if "attn_logit_softcapping" in extra:
        w.add_attn_logit_softcapping(extra["attn_logit_softcapping"])
        w.add_final_logit_softcapping(extra["final_logit_softcapping"])
    w.add_file_type(15)  # MOSTLY_Q4_K_M
    w.add_tokenizer_model("gpt2")
    w.add_token_list(vocab)
    w.add_token_types([1] * (len(vocab) - len(SPECIAL)) + [3] * len(SPECIAL))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(vocab.index("<|im_start|>"))
    w.add_eos_token_id(vocab.index("<|im_end|>"))
    w.add_unk_token_id(vocab.index("<unk>"))
    w.add_chat_template(CHAT_TEMPLATE)

    def norm(name: str, width: int) -> None:
        # llama.cpp writes Gemma's norms as 1 + w; every family's then sits around 1
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(width)).astype(np.float32))

    # the tied head's rows wider than the layers': logits spread over a few units, not a few tenths
    w.add_tensor("token_embd.weight", blocks(embedding, len(vocab), HIDDEN, rng, reach=0.4), raw_dtype=T[embedding])
    outs = {"attn_q": heads * head_dim, "attn_k": kv_heads * head_dim, "attn_v": kv_heads * head_dim,
            "attn_output": HIDDEN, "ffn_gate": INTER, "ffn_up": INTER, "ffn_down": HIDDEN}
    ins = {"attn_output": heads * head_dim, "ffn_down": INTER}
    for i in range(LAYERS):
        norm(f"blk.{i}.attn_norm.weight", HIDDEN)
        norm(f"blk.{i}.ffn_norm.weight", HIDDEN)
        for name, kind in TYPES.items():
            kind = linears or kind
            n, k = outs[name], ins.get(name, HIDDEN)
            w.add_tensor(f"blk.{i}.{name}.weight", blocks(kind, n, k, rng), raw_dtype=T[kind])
            if shape.get("bias") and name in ("attn_q", "attn_k", "attn_v"):
                w.add_tensor(f"blk.{i}.{name}.bias", (0.1 * rng.standard_normal(n)).astype(np.float32))
        if shape.get("qk_norm"):
            norm(f"blk.{i}.attn_q_norm.weight", head_dim)
            norm(f"blk.{i}.attn_k_norm.weight", head_dim)
        if shape.get("sandwich"):
            norm(f"blk.{i}.post_attention_norm.weight", HIDDEN)
            norm(f"blk.{i}.post_ffw_norm.weight", HIDDEN)
    norm("output_norm.weight", HIDDEN)
    if "head" in shape:
        w.add_tensor("output.weight", blocks(shape["head"], len(vocab), HIDDEN, rng, reach=head_reach),
                     raw_dtype=T[shape["head"]])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
