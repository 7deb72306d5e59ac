"""GGUF files read as stored: a file's linear weights as the quantized layers of `kernels.quant`.

Q4_0 and Q4_1 blocks are int4 groups of 32 with their codes as stored, Q8_0 rows become int8 rows; other
tensor types are dequantized and requantized to int8 rows, which `gguf_linears` says on stderr. Which
families' files are read this way is `families.arch.GGUF_STORED`; llama.cpp permutes those files' q/k rows
per rotary pair, which `gguf_linears` undoes.
"""

from __future__ import annotations

import re
import sys

import numpy as np
import torch

from specserve.models.kernels.quant import Int4Groups, Int8Rows, Quantized

_GGUF_LAYER = {"attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o", "ffn_gate": "gate",
               "ffn_up": "up", "ffn_down": "down"}


def _q4_blocks(raw: np.ndarray, n: int, k: int, with_min: bool) -> Int4Groups:
    """Q4_0 (d, 16 bytes) or Q4_1 (d, m, 16 bytes) blocks of 32 → their int4 codes, exactly as stored.

    Q4_0 is w = d·(q - 8); Q4_1 is w = d·q + m = (q - 8)·d + (m + 8d)."""
    head = 4 if with_min else 2
    blocks = np.ascontiguousarray(raw).reshape(n, k // 32, head + 16)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., head:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, k)  # low nibbles are values 0..15
    if with_min:
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zero = m + 8 * d
    else:
        zero = np.zeros_like(d)
    return Int4Groups(torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(zero), 32)


def _gguf_tensor(tensor, method_note: list[str]) -> Quantized:
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize

    k, n = (int(s) for s in tensor.shape[:2])  # GGUF lists dimensions innermost first
    kind = tensor.tensor_type
    if kind in (T.Q4_0, T.Q4_1):
        return _q4_blocks(tensor.data, n, k, kind == T.Q4_1)
    dense = torch.from_numpy(np.asarray(dequantize(tensor.data, kind), dtype=np.float32).reshape(n, k))
    if kind != T.Q8_0:
        method_note.append(kind.name)
    return Int8Rows.quantize(dense)  # Q8_0's blocks of 32 become one scale per row


def _unpermute_rows(w: Quantized, heads: int) -> Quantized:
    """llama.cpp stores q and k rows interleaved per rotary pair; HF (and the lean forward) keep halves."""
    n = w.codes.shape[0]
    dim = n // heads // 2
    order = torch.arange(n).view(heads, dim, 2).transpose(1, 2).reshape(n)
    return w.rows(order)


def gguf_weight_type(path) -> str:
    """The tensor type most of a GGUF file's layer weights are stored in ("Q4_1", "F16", ...)."""
    from collections import Counter

    from gguf import GGUFReader

    kinds = Counter(t.tensor_type.name for t in GGUFReader(str(path)).tensors if t.name.startswith("blk.")
                    and t.name.split(".")[2] in _GGUF_LAYER)
    return kinds.most_common(1)[0][0] if kinds else "none"


DENSE_TYPES = {"F32", "F16", "BF16", "F64", "none"}


def gguf_architecture(path) -> str:
    """A GGUF file's `general.architecture` ("llama", "qwen2", ...)."""
    from gguf import GGUFReader

    field = GGUFReader(str(path)).fields.get("general.architecture")
    return bytes(field.parts[field.data[0]]).decode() if field is not None else "unknown"


def gguf_linears(path, config) -> dict:
    """The linear weights of a Llama-family GGUF file as stored: {"layers": [{q, k, v, o, gate, up, down}, ...],
    "head": Quantized or None (tied to the embedding)}, each `Int4Groups` or `Int8Rows`."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    layers: list[dict] = [{} for _ in range(config.num_hidden_layers)]
    head = embedding = None
    requantized: list[str] = []
    for tensor in reader.tensors:
        name = tensor.name
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", name)
        if m and m.group(2) in _GGUF_LAYER:
            w = _gguf_tensor(tensor, requantized)
            role = _GGUF_LAYER[m.group(2)]
            if role == "q":
                w = _unpermute_rows(w, config.num_attention_heads)
            elif role == "k":
                w = _unpermute_rows(w, config.num_key_value_heads)
            layers[int(m.group(1))][role] = w
        elif name == "output.weight":
            head = _gguf_tensor(tensor, requantized)
        elif name == "token_embd.weight" and getattr(config, "tie_word_embeddings", False):
            embedding = tensor
    if head is None and embedding is not None:
        head = _gguf_tensor(embedding, requantized)
    missing = [i for i, layer in enumerate(layers) if len(layer) != len(_GGUF_LAYER)]
    if missing:
        raise ValueError(f"{path}: layers {missing[:5]} lack some of {sorted(_GGUF_LAYER)}; not a Llama-family GGUF")
    if requantized:
        kinds = ", ".join(sorted(set(requantized)))
        print(f"specserve: {path}: {len(requantized)} tensors of type {kinds} requantized to int8 rows",
              file=sys.stderr, flush=True)
    return {"layers": layers, "head": head, "source": gguf_weight_type(path)}
