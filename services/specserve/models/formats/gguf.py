"""GGUF files read as stored: a file's linear weights as the quantized layers of `kernels.quant`.

Every block type users meet keeps its numbers: Q4_0 and Q4_1 blocks become int4 groups of 32 with their codes
as stored (`kernels.quant.Int4Groups`); Q5_0, Q5_1, Q8_0 and the K-quants Q2_K, Q3_K, Q4_K, Q5_K and Q6_K become
`kernels.quant.Blocks`, their codes, float16 scales and 6- or 8-bit sub-block scales unpacked as they are
(`BLOCK_TYPES`: one reader each, checked against `gguf.quants.dequantize`). Other tensor types (float ones in
a quantized file, the IQ types) are dequantized and requantized to int8 rows, which `gguf_linears` says on
stderr. Which families' files are read this way is `families.arch.GGUF_STORED`; where llama.cpp permutes a
file's q/k rows per rotary pair (`GGUF_PERMUTED`), `gguf_linears` undoes it.
"""

from __future__ import annotations

import functools
import os
import re
import struct
import sys
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from specserve.models.families.arch import GGUF_PERMUTED, GGUF_STORED
from specserve.models.kernels.quant import Blocks, Int4Groups, Int8Rows, Quantized

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


def _f16(raw: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte `at` of each block, as float32 [blocks, 1]."""
    return raw[:, at:at + 2].copy().view(np.float16).astype(np.float32)


def _bits(raw: np.ndarray, shifts: list[int], mask: int) -> np.ndarray:
    """(raw >> shift) & mask for each shift, shift-major: [blocks, len(shifts) · raw's bytes] (GGUF's order)."""
    return ((raw[:, None, :] >> np.array(shifts, np.uint8)[None, :, None]) & mask).reshape(len(raw), -1)


def _nibbles(qs: np.ndarray, chunk: int) -> np.ndarray:
    """Codes of `chunk` bytes at a time: their low nibbles, then their high ones."""
    n = len(qs)
    return _bits(qs.reshape(-1, chunk), [0, 4], 0x0F).reshape(n, -1)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of 6-bit scales and mins → (scales, mins) [blocks, 8]."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], -1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], -1)
    return sc, mn


# type → (bytes a block, values a block, bits, group, offset, reader: raw [blocks, bytes] →
#         (codes [blocks, values], d [blocks, 1], m [blocks, 1] or None, sc [blocks, groups] or None, mn or None))
def _q5(raw, with_min):
    at = 4 if with_min else 2
    qh = raw[:, at:at + 4].copy().view(np.uint32)
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    codes = _nibbles(raw[:, at + 4:], 16) | high << 4
    return codes, _f16(raw, 0), _f16(raw, 2) if with_min else None, None, None


def _q8_0(raw):
    return raw[:, 2:] ^ 0x80, _f16(raw, 0), None, None, None  # int8 q as q + 128


def _q2_k(raw):
    s = raw[:, 0:16]
    codes = _bits(raw[:, 16:80].reshape(-1, 32), [0, 2, 4, 6], 3).reshape(len(raw), -1)
    return codes, _f16(raw, 80), _f16(raw, 82), s & 0x0F, -(s >> 4).astype(np.int16)


def _q3_k(raw):
    n = len(raw)
    low = _bits(raw[:, 32:96].reshape(-1, 32), [0, 2, 4, 6], 3).reshape(n, -1)
    high = _bits(raw[:, 0:32], list(range(8)), 1)
    s = raw[:, 96:108]
    sc = (_bits(s[:, 0:8], [0, 4], 0x0F) | _bits(s[:, 8:12], [0, 2, 4, 6], 3) << 4).astype(np.int16) - 32
    return low | high << 2, _f16(raw, 108), None, sc, None  # q = low - 4 where the mask's bit is 0


def _q4_k(raw):
    sc, mn = _k_scales(raw[:, 4:16])
    return _nibbles(raw[:, 16:144], 32), _f16(raw, 0), _f16(raw, 2), sc, -mn.astype(np.int16)


def _q5_k(raw):
    sc, mn = _k_scales(raw[:, 4:16])
    codes = _nibbles(raw[:, 48:176], 32) | _bits(raw[:, 16:48], list(range(8)), 1) << 4
    return codes, _f16(raw, 0), _f16(raw, 2), sc, -mn.astype(np.int16)


def _q6_k(raw):
    n = len(raw)
    low = _bits(raw[:, 0:128].reshape(-1, 64), [0, 4], 0x0F).reshape(n, -1)
    high = _bits(raw[:, 128:192].reshape(-1, 32), [0, 2, 4, 6], 3).reshape(n, -1)
    return low | high << 4, _f16(raw, 208), None, raw[:, 192:208].view(np.int8), None


BLOCK_TYPES = {
    "Q5_0": (22, 32, 5, 32, -16, lambda raw: _q5(raw, False)),
    "Q5_1": (24, 32, 5, 32, 0, lambda raw: _q5(raw, True)),
    "Q8_0": (34, 32, 8, 32, -128, _q8_0),
    "Q2_K": (84, 256, 4, 16, 0, _q2_k),
    "Q3_K": (110, 256, 4, 16, -4, _q3_k),
    "Q4_K": (144, 256, 4, 32, 0, _q4_k),
    "Q5_K": (176, 256, 5, 32, 0, _q5_k),
    "Q6_K": (210, 256, 6, 16, -32, _q6_k),
}


def read_blocks(raw: np.ndarray, kind: str, n: int, k: int) -> Blocks:
    """A tensor [n, k] of GGUF type `kind` (a key of `BLOCK_TYPES`) from its raw bytes, as stored."""
    size, values, bits, group, offset, reader = BLOCK_TYPES[kind]
    if k % values:
        raise ValueError(f"a {kind} tensor's rows of {k} values do not divide into blocks of {values}")
    raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, size)
    codes, d, m, sc, mn = reader(raw)
    blocks = k // values

    def per_row(a: np.ndarray | None, width: int, dtype, fill: int = 0) -> torch.Tensor:
        a = np.full((n * blocks, width), fill) if a is None else a
        return torch.from_numpy(np.ascontiguousarray(a.reshape(n, blocks * width).astype(dtype)))

    groups = values // group
    return Blocks(torch.from_numpy(np.ascontiguousarray(codes.reshape(n, k).astype(np.uint8))), bits, group,
                  values, per_row(d, 1, np.float32), per_row(m, 1, np.float32), per_row(sc, groups, np.int8, 1),
                  per_row(mn, groups, np.int8, 0 if m is None else 1), offset, kind)


STORED_TYPES = ("Q4_0", "Q4_1", *BLOCK_TYPES)  # the types read as stored (others are dequantized)


def _as_stored(raw: np.ndarray, kind: str, n: int, k: int) -> Quantized | None:
    """A tensor [n, k] of GGUF type `kind` from its raw bytes, as stored; None for a type outside `STORED_TYPES`."""
    if kind in ("Q4_0", "Q4_1"):
        return _q4_blocks(raw, n, k, kind == "Q4_1")
    return read_blocks(raw, kind, n, k) if kind in BLOCK_TYPES else None


def _dense(raw: np.ndarray, kind: str, n: int, k: int) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return torch.from_numpy(np.asarray(dequantize(raw, GGMLQuantizationType[kind]), dtype=np.float32).reshape(n, k))


def _gguf_tensor(tensor, method_note: list[str]) -> Quantized:
    k, n = (int(s) for s in tensor.shape[:2])  # GGUF lists dimensions innermost first
    kind = tensor.tensor_type.name
    stored = _as_stored(tensor.data, kind, n, k)
    if stored is not None:
        return stored
    method_note.append(kind)
    return Int8Rows.quantize(_dense(tensor.data, kind, n, k))


def dequantize_rows(raw: np.ndarray, kind: str, k: int) -> torch.Tensor:
    """Rows [n, k] of a tensor of GGUF type `kind` from their raw bytes [n, bytes a row], as float32: the values
    `gguf.quants.dequantize` gives (tests/cpu/test_gguf_blocks.py), through the block readers."""
    stored = _as_stored(raw, kind, len(raw), k)
    return stored.dequantize() if stored is not None else _dense(raw, kind, len(raw), k)


class FileEmbedding(torch.nn.Module):
    """A GGUF file's token embedding as the file stores it (memory-mapped, its pages shared and evictable): the
    rows a step looks up are dequantized then, in the compute dtype, the values a dense copy would hold. It has
    no `weight`: code that wants the whole table (a new feature head's) loads the file dense."""

    def __init__(self, tensor: FileTensor, dtype: torch.dtype):
        super().__init__()
        cls = type(self)
        if not getattr(cls.__getitem__, "_compile_disabled", False):
            # numpy on the file's pages: outside a compiled step's graph (marked here, not at import: importing
            # torch's compiler costs a second the CLI and the replicas need not pay)
            cls.__getitem__ = torch.compiler.disable(cls.__getitem__)
            cls.__getitem__._compile_disabled = True
        self.tensor, self.dtype = tensor, dtype
        self.embedding_dim, self.num_embeddings = tensor.shape[:2]
        self.kind = tensor.tensor_type.name

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:  # [T] → [T, hidden]
        rows = self.tensor.data[ids.cpu().numpy()]
        return dequantize_rows(rows, self.kind, self.embedding_dim).to(ids.device, self.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self[ids.reshape(-1)].view(*ids.shape, self.embedding_dim)


def _unpermute_rows(w: Quantized, heads: int) -> Quantized:
    """llama.cpp stores q and k rows interleaved per rotary pair; HF (and the lean forward) keep halves."""
    n = w.codes.shape[0]
    dim = n // heads // 2
    order = torch.arange(n).view(heads, dim, 2).transpose(1, 2).reshape(n)
    return w.rows(order)


class FileTensor(NamedTuple):
    """One tensor of a GGUF file: `data` its bytes memory-mapped, [rows, bytes a row] (a row: the innermost
    dimension, `shape[0]`), which `gguf.quants.dequantize` and the block readers take as they are."""

    name: str
    shape: tuple[int, ...]  # innermost first, as the file lists them
    tensor_type: Any  # gguf.GGMLQuantizationType
    data: np.ndarray


class GGUFFile(NamedTuple):
    metadata: dict[str, Any]  # the scalar and string fields (arrays, e.g. the vocabulary, are skipped)
    tensors: list[FileTensor]


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def _parse(path: str) -> GGUFFile:
    """The file's header, scalar metadata and tensor table, its tensors memory-mapped. gguf's `GGUFReader` builds
    an object per field part (seconds for a vocabulary of 150 k tokens); this walks the arrays without keeping
    them."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    buf = np.memmap(path, dtype=np.uint8, mode="r")
    mem = memoryview(buf)
    if bytes(mem[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", mem, 4)
    if version < 2:
        raise ValueError(f"{path}: GGUF version {version} is too old (2 or later is read)")
    at = 24

    def string() -> str:
        nonlocal at
        (size,) = struct.unpack_from("<Q", mem, at)
        at += 8 + size
        return bytes(mem[at - size:at]).decode("utf-8", errors="replace")

    def skip_array() -> None:
        nonlocal at
        kind, count = struct.unpack_from("<IQ", mem, at)
        at += 12
        if kind in _SCALARS:
            at += count * struct.calcsize(_SCALARS[kind])
        elif kind == _STRING:
            for _ in range(count):
                at += 8 + struct.unpack_from("<Q", mem, at)[0]
        elif kind == _ARRAY:
            for _ in range(count):
                skip_array()
        else:
            raise ValueError(f"{path}: unknown GGUF value type {kind}")

    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = string()
        (kind,) = struct.unpack_from("<I", mem, at)
        at += 4
        if kind in _SCALARS:
            (metadata[key],) = struct.unpack_from(_SCALARS[kind], mem, at)
            at += struct.calcsize(_SCALARS[kind])
        elif kind == _STRING:
            metadata[key] = string()
        elif kind == _ARRAY:
            skip_array()
        else:
            raise ValueError(f"{path}: unknown GGUF value type {kind} (key {key})")
    table = []
    for _ in range(n_tensors):
        name = string()
        (dims,) = struct.unpack_from("<I", mem, at)
        shape = struct.unpack_from(f"<{dims}Q", mem, at + 4)
        kind, offset = struct.unpack_from("<IQ", mem, at + 4 + 8 * dims)
        at += 4 + 8 * dims + 12
        table.append((name, tuple(int(d) for d in shape), GGMLQuantizationType(kind), offset))
    alignment = int(metadata.get("general.alignment", 32))
    start = -(-at // alignment) * alignment
    tensors = []
    for name, shape, kind, offset in table:
        block, size = GGML_QUANT_SIZES[kind]
        rows = int(np.prod(shape[1:], dtype=np.int64))
        row_bytes = shape[0] // block * size
        data = buf[start + offset:start + offset + rows * row_bytes].reshape(rows, row_bytes)
        tensors.append(FileTensor(name, shape, kind, data))
    return GGUFFile(metadata, tensors)


@functools.lru_cache(maxsize=2)
def _reader(path: str, mtime_ns: int) -> GGUFFile:
    return _parse(path)


def file_reader(path) -> GGUFFile:
    """The file's metadata and tensors (`GGUFFile`), parsed once for the calls of one load."""
    path = str(path)
    return _reader(path, os.stat(path).st_mtime_ns)


def gguf_weight_type(path) -> str:
    """The tensor type most of a GGUF file's layer weights are stored in ("Q4_1", "F16", ...)."""
    from collections import Counter

    kinds = Counter(t.tensor_type.name for t in file_reader(path).tensors if t.name.startswith("blk.")
                    and t.name.split(".")[2] in _GGUF_LAYER)
    return kinds.most_common(1)[0][0] if kinds else "none"


DENSE_TYPES = {"F32", "F16", "BF16", "F64", "none"}


def gguf_architecture(path) -> str:
    """A GGUF file's `general.architecture` ("llama", "qwen2", ...)."""
    return str(file_reader(path).metadata.get("general.architecture", "unknown"))


class StoredLayers(Sequence):
    """A file's decoder layers' linears as stored, each layer read when asked for ({role: `Quantized`}), so that a
    load that packs layer by layer holds one layer's unpacked blocks at a time, not the model's."""

    def __init__(self, path, tensors: list[dict], permuted: bool, heads: int, kv_heads: int):
        self.path, self.tensors, self.permuted, self.heads, self.kv_heads = path, tensors, permuted, heads, kv_heads

    def __len__(self) -> int:
        return len(self.tensors)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        layer = {}
        for role, tensor in self.tensors[i].items():
            w = _gguf_tensor(tensor, [])
            if self.permuted and role in ("q", "k"):
                w = _unpermute_rows(w, self.heads if role == "q" else self.kv_heads)
            layer[role] = w
        return layer


def gguf_linears(path, config) -> dict:
    """The linear weights of a GGUF file of `GGUF_STORED`'s architectures as stored: {"layers": `StoredLayers`
    ({q, k, v, o, gate, up, down} a layer, read when indexed), "head": Quantized or None (tied to the embedding)},
    each `Int4Groups`, `Blocks` or `Int8Rows`."""
    permuted = gguf_architecture(path) in GGUF_PERMUTED
    tensors: list[dict] = [{} for _ in range(config.num_hidden_layers)]
    head = embedding = None
    requantized: list[str] = []
    for tensor in file_reader(path).tensors:
        name = tensor.name
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", name)
        if m and m.group(2) in _GGUF_LAYER:
            tensors[int(m.group(1))][_GGUF_LAYER[m.group(2)]] = tensor
            if tensor.tensor_type.name not in STORED_TYPES:  # `_gguf_tensor` requantizes it to int8 rows
                requantized.append(tensor.tensor_type.name)
        elif name == "output.weight":
            head = _gguf_tensor(tensor, requantized)
        elif name == "token_embd.weight" and getattr(config, "tie_word_embeddings", False):
            embedding = tensor
    if head is None and embedding is not None:
        head = _gguf_tensor(embedding, requantized)
    missing = [i for i, layer in enumerate(tensors) if len(layer) != len(_GGUF_LAYER)]
    if missing:
        raise ValueError(f"{path}: layers {missing[:5]} lack some of {sorted(_GGUF_LAYER)}; not a GGUF of {sorted(GGUF_STORED)}")
    if requantized:
        kinds = ", ".join(sorted(set(requantized)))
        print(f"specserve: {path}: {len(requantized)} tensors of type {kinds} requantized to int8 rows",
              file=sys.stderr, flush=True)
    layers = StoredLayers(path, tensors, permuted, config.num_attention_heads, config.num_key_value_heads)
    return {"layers": layers, "head": head, "source": gguf_weight_type(path)}

