"""A GGUF file loaded straight from the file: no safetensors copy, no dense detour.

The file's metadata becomes a small model directory once (config.json, generation_config.json and the
tokenizer's files, converted by transformers' GGUF readers) in the cache, keyed by the file's sha256; every
later use reads that directory, as it would an HF checkpoint's. The weights come from the file's tensors:
norms and biases dequantized (with llama.cpp's conventions undone, as transformers' GGUF loader does: q/k rows
of Llama files, Gemma's 1 + w norms), and the linear layers either read from their blocks
(`formats.gguf.gguf_linears`; the HF modules get shape-only placeholders; a quantized embedding stays in the
file, `formats.gguf.FileEmbedding`) or dequantized for a dense model.

It knows nothing of kernels or packing: `formats.loading` hands the linears to `kernels.quant`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import pathlib
import re
import shutil
import sys
import tempfile
import threading
import time

import numpy as np
import torch

from specserve.models.formats.gguf import _GGUF_LAYER, DENSE_TYPES, FileEmbedding, file_reader
from specserve.models.kernels.cpu import cache_root

_CHUNK = 1 << 24


def file_digest(path: pathlib.Path) -> str:
    """The file's sha256, computed once per (path, size, mtime) and remembered in the cache."""
    stat = path.stat()
    where = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    memo = cache_root() / "gguf" / "digests" / hashlib.sha256(where.encode()).hexdigest()[:24]
    if memo.is_file():
        return memo.read_text().strip()
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            sha.update(chunk)
    digest = sha.hexdigest()
    memo.parent.mkdir(parents=True, exist_ok=True)
    tmp = memo.with_name(f"{memo.name}.{os.getpid()}")  # renamed whole: a reader never sees half of it
    tmp.write_text(digest + "\n")
    os.replace(tmp, memo)
    return digest


def read_metadata(paths: list) -> None:
    """Several GGUF files' `metadata_dir`s made at once where not cached yet, a process a file (each takes seconds of
    Python in transformers' GGUF reader): a first start of a target and its draft reads both side by side."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

    files = [pathlib.Path(p) for p in paths if str(p).endswith(".gguf") and pathlib.Path(p).is_file()]
    if not files:
        return
    with ThreadPoolExecutor(len(files)) as threads:  # a first start's digests side by side too (hashlib frees the GIL)
        cached = list(threads.map(lambda p: (_metadata_target(p) / "config.json").is_file(), files))
    todo = [p for p, done in zip(files, cached) if not done]
    if len(todo) < 2:
        return
    with ProcessPoolExecutor(len(todo), mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(metadata_dir, todo))


def _metadata_target(path: pathlib.Path) -> pathlib.Path:
    return cache_root() / "gguf" / f"{path.stem}-{file_digest(path)[:16]}"


def metadata_dir(path: pathlib.Path) -> pathlib.Path:
    """A model directory holding the GGUF file's config, generation config and tokenizer (no weights), made from
    its metadata once into the cache and reused by every later load of the same file."""
    digest = file_digest(path)
    target = _metadata_target(path)
    if (target / "config.json").is_file():
        return target
    from transformers import AutoConfig, GenerationConfig

    started = time.monotonic()
    print(f"specserve: reading {path.name}'s config and tokenizer from its metadata once; cache: {target}",
          file=sys.stderr, flush=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        with _field_parts_from_one_view():
            config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
            config.architectures = [_causal_lm_class(config)]
            config.save_pretrained(str(tmp))
            GenerationConfig.from_model_config(config).save_pretrained(str(tmp))
            try:
                tokenizer = _tokenizer(path, config)
            except (ValueError, KeyError, OSError) as exc:  # a file without (a convertible) tokenizer
                print(f"specserve: {path.name} carries no tokenizer transformers can read ({exc}); token ids only",
                      file=sys.stderr, flush=True)
            else:
                tokenizer.save_pretrained(str(tmp))
        (tmp / "gguf.json").write_text(json.dumps({"file": str(path.resolve()), "sha256": digest}) + "\n")
        try:
            tmp.rename(target)
        except OSError:  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"specserve: {path.name}: metadata read in {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
    return target


@functools.cache
def _one_view_reader():
    """gguf's `GGUFReader` with its metadata arrays' parts built from one plain view of the file: the same fields,
    parts (the same bytes, dtypes and shapes), indices and types, but not a memmap slice and byte-order view per
    element, which took ~7 s for a vocabulary of 150 k tokens and its merges (and transformers reads a file twice:
    config, then tokenizer). Files of the other byte order, empty arrays and arrays of arrays are left to gguf's
    code."""
    import numpy as np
    from gguf import GGUFReader, GGUFValueType

    class OneViewReader(GGUFReader):
        def _get_field_parts(self, orig_offs, raw_type):
            if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype, alen = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
            itype, n = int(raw_itype[0]), int(alen[0])
            nptype = self.gguf_scalar_to_np.get(GGUFValueType(itype))
            if n == 0 or itype != GGUFValueType.STRING and nptype is None:
                return super()._get_field_parts(orig_offs, raw_type)
            view = self.data.view(np.ndarray)
            parts, types, offs = [raw_itype, alen], [GGUFValueType.ARRAY, GGUFValueType(itype)], orig_offs + 12
            if itype == GGUFValueType.STRING:  # each element: its length (uint64), its bytes (uint8)
                raw, idxs = memoryview(view), []
                for _ in range(n):
                    size = int.from_bytes(raw[offs:offs + 8], sys.byteorder)
                    parts += [view[offs:offs + 8].view(np.uint64), view[offs + 8:offs + 8 + size]]
                    idxs.append(len(parts) - 1)
                    offs += 8 + size
                return offs - orig_offs, parts, idxs, types
            size = np.dtype(nptype).itemsize
            values = view[offs:offs + size * n].view(nptype)
            parts += [values[i:i + 1] for i in range(n)]
            return 12 + size * n, parts, list(range(2, 2 + n)), types

    return OneViewReader


_READER_SWAP = threading.Lock()


@contextlib.contextmanager
def _field_parts_from_one_view():
    """transformers' GGUF readers (config, tokenizer) build gguf's `GGUFReader` by name: for the duration, it is
    `_one_view_reader()` (one swap at a time in a process)."""
    import gguf

    with _READER_SWAP:
        stock, gguf.GGUFReader = gguf.GGUFReader, _one_view_reader()
        try:
            yield
        finally:
            gguf.GGUFReader = stock


def _tokenizer(path: pathlib.Path, config):
    """The file's tokenizer in the class AutoTokenizer picks for `config`, given here: AutoTokenizer would read the
    whole file's metadata again to find it (~10 s for a vocabulary of 150 k tokens; the class's own reader ~1 s)."""
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    try:
        cls = TOKENIZER_MAPPING[type(config)]
    except KeyError:
        cls = TokenizersBackend
    return cls.from_pretrained(str(path.parent), gguf_file=path.name)


def _causal_lm_class(config) -> str:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM._model_mapping[type(config)].__name__


def _skeleton(path: pathlib.Path, dtype: torch.dtype):
    """(the file's HF model with its parameters on the meta device (rotary buffers computed), transformers'
    tensor processor for its architecture, GGUF tensor name → parameter name)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    from specserve.models.formats.gguf import gguf_architecture

    config = AutoConfig.from_pretrained(str(metadata_dir(path)))
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    architecture = gguf_architecture(path)
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())
    return model, processor, _hf_names(model, architecture)


def _hf_names(model, architecture: str) -> dict[str, str]:
    """GGUF tensor name → the HF model's parameter name (gguf-py's name map, built once: transformers' own
    `get_gguf_hf_weights_map` builds it again for every submodule, seconds per load)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch = next((key for key, value in MODEL_ARCH_NAMES.items() if value == architecture), None)
    if arch is None:
        raise ValueError(f"gguf-py does not know the architecture {architecture!r}")
    name_map = get_tensor_name_map(arch, model.config.num_hidden_layers)
    names = {}
    for hf_name in model.state_dict():
        base, _, suffix = hf_name.rpartition(".")
        found = name_map.get_name(base)
        if found is not None:
            names.setdefault(f"{found}.{suffix}", hf_name)
    return names


def _dequantized(tensor, processor, names: dict[str, str]) -> tuple[str | None, torch.Tensor]:
    """(HF name or None when the model has no such tensor, its float32 values in HF's layout)."""
    from gguf.quants import dequantize

    values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    result = processor.process(weights=values, name=tensor.name, tensor_key_mapping=names, parsed_parameters={})
    return names.get(result.name), torch.from_numpy(np.array(result.weights, dtype=np.float32))  # (a copy: mmap is read-only)


def _stored_linear(name: str) -> bool:
    """Whether a GGUF tensor is one of the linears `gguf_linears` reads as stored (the head included)."""
    m = re.fullmatch(r"blk\.\d+\.(\w+)\.weight", name)
    return (m is not None and m.group(1) in _GGUF_LAYER) or name == "output.weight"


def build_model(path: pathlib.Path, dtype: torch.dtype, device: str, keep_linears: bool):
    """The HF causal LM of a GGUF file, its weights read from the file in `dtype` on `device`.

    keep_linears: the decoder layers' linears and the head are left as shape-only placeholders (read as stored by
    `gguf_linears` afterwards); else every weight is dequantized (a dense model, e.g. float32)."""
    model, processor, names = _skeleton(path, dtype)
    config = model.config
    params = dict(model.named_parameters())
    reader = file_reader(path)
    started, done = time.monotonic(), 0
    embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    # kept as stored on a CPU: looked up from the file's pages (`gguf.FileEmbedding`), not held dense
    file_embedding = keep_linears and torch.device(device).type == "cpu" and embedding is not None \
        and embedding.tensor_type.name not in DENSE_TYPES
    for tensor in reader.tensors:
        if keep_linears and _stored_linear(tensor.name) or (file_embedding and tensor is embedding):
            continue
        name, values = _dequantized(tensor, processor, names)
        if name is None or name not in params:
            continue
        _assign(model, name, values.to(dtype).to(device).reshape(params[name].shape))
        done += 1
    model.tie_weights()
    for name, param in model.named_parameters():
        if param.device.type != "meta":
            continue
        if not keep_linears:
            raise ValueError(f"{path.name} has no tensor for {name}; not a GGUF file of a {config.model_type} model")
        # read as stored by `gguf_linears`, which replaces it: its shape and device matter, not its values
        _assign(model, name, torch.zeros((), dtype=dtype, device=device).expand(param.shape))
    if file_embedding:
        if model.lm_head.weight.device.type == "meta":  # tied to the embedding: the head is read as stored too
            _assign(model, "lm_head.weight", torch.zeros((), dtype=dtype, device=device).expand(
                model.lm_head.weight.shape))
        model.model.embed_tokens = FileEmbedding(embedding, dtype)
    print(f"specserve: {path.name}: {done} tensors read from the file in {time.monotonic() - started:.1f} s",
          file=sys.stderr, flush=True)
    return model.eval()


def _assign(model, name: str, value: torch.Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    setattr(module, attr, torch.nn.Parameter(value, requires_grad=False))


def read_tensor(path: pathlib.Path, hf_name: str) -> torch.Tensor:
    """One tensor of a GGUF file by its HF name (e.g. "model.embed_tokens.weight"), dequantized to float32."""
    model, processor, names = _skeleton(path, torch.float32)
    for tensor in file_reader(path).tensors:
        if names.get(tensor.name) == hf_name:
            return _dequantized(tensor, processor, names)[1].reshape(model.get_parameter(hf_name).shape)
    raise ValueError(f"{path.name} has no tensor for {hf_name!r}")
