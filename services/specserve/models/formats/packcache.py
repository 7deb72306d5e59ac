"""A GGUF model's packed weights, cached on disk.

Loading a GGUF file for the CPU kernels reads every linear's blocks, unpacks their codes, fuses q|k|v and
gate|up, requantizes where the quantization asks (an int4 draft of a Q5_0 file) and lays the result out for the
kernels: seconds of Python and copying a model on two cores. The result (`weights.LeanWeights` less the
file-backed embedding) is saved once, after the first load, and every later load memory-maps it instead: the
pages are the cache file's, shared with the page cache, and read on first use.

The key is everything the packed bytes depend on: the file's sha256, the compute dtype and quantization, the
kernels' build and activation rounding, torch's version and specserve's model code. A stale entry is never read;
`SPECSERVE_PACKED_CACHE=0` turns the cache off (`$SPECSERVE_CACHE/packed`, about the file's size a model).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pathlib
import sys
import time
from glob import escape as glob_escape

import torch

from specserve.models.formats import cachefiles
from specserve.models.kernels import cpu, quant
from specserve.models.kernels.quant import QuantSpec

ENABLED: bool = os.environ.get("SPECSERVE_PACKED_CACHE", "1") != "0"
_FORMAT = 1  # the layout of a cache file (what `save` writes): bumped when that changes
KEEP = 3  # entries kept of one file and quantization (other builds, forced ISAs), the most recently used
_MODELS = pathlib.Path(__file__).resolve().parents[1]  # specserve/models: the code that shapes the packing


def cache_dir() -> pathlib.Path:
    return cpu.cache_root() / "packed"


def _code_digest() -> str:
    """The model code's sources (formats, families, kernels with their C++): packing made by other code is not read."""
    return cachefiles.sources_digest(_MODELS.parent, ("models",))


def cache_path(gguf: pathlib.Path, dtype: torch.dtype, spec: QuantSpec) -> pathlib.Path:
    from specserve.models.formats.ggufmodel import file_digest

    digest = file_digest(gguf)
    parts = [f"format={_FORMAT}", f"file={digest}", f"dtype={dtype}", f"method={spec.method}", f"group={spec.group}",
             f"int4_head={spec.int4_head}",
             f"dense_from={spec.dense_from}", f"isa={cpu.chosen_isa()}", f"activations={cpu.ACTIVATIONS}",
             f"kernels={cpu.available()}", f"dense_copy={cpu.DENSE_FROM},{quant.PACK_DENSE}",
             f"torch={torch.__version__}", f"code={_code_digest()}"]
    key = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
    return cache_dir() / f"{gguf.stem}-{spec.describe()}-{key}.pt"


def cacheable(weights) -> bool:
    """Whether `weights` is a whole model's (not a tensor-parallel rank's or a pipeline stage's part) over its whole
    vocabulary: what the key names."""
    return weights.tp is None and weights.token_subset is None and weights.first and weights.last


def load(gguf: pathlib.Path, model, dtype: torch.dtype, spec: QuantSpec):
    """The cached `LeanWeights` of `model` (the file's skeleton: its embedding is attached from it), or None where
    there is none. The model gets the cached quantization (`specserve_quant`) and the weights in its lean cache."""
    if not ENABLED:
        return None
    path = cache_path(gguf, dtype, spec)
    if not path.is_file():
        return None
    from specserve.models.families.weights import LeanWeights

    started = time.monotonic()
    try:
        state = torch.load(path, mmap=True, weights_only=False)
    except Exception as exc:  # noqa: BLE001 - a damaged entry is packed again, and replaced
        print(f"specserve: {path} could not be read ({exc}); packing {gguf.name} again", file=sys.stderr, flush=True)
        return None
    with contextlib.suppress(OSError):
        os.utime(path)  # its last use, for `_prune`
    weights = LeanWeights.__new__(LeanWeights)
    weights.__dict__.update(state["weights"])
    embedding = model.model.embed_tokens  # as `LeanWeights` takes it: a weight, or the file's own lookup
    weights.embed = embedding.weight if hasattr(embedding, "weight") else embedding
    model.specserve_quant = QuantSpec(**state["spec"])
    model.__dict__.setdefault("_specserve_lean", {})[dtype] = weights
    print(f"specserve: {gguf.name}: packed weights mapped from the cache in {time.monotonic() - started:.1f} s "
          f"({path})", file=sys.stderr, flush=True)
    return weights


def save(gguf: pathlib.Path, weights, dtype: torch.dtype, spec: QuantSpec) -> pathlib.Path | None:
    """Write `weights` (just made from `gguf`) to the cache, renamed into place whole; None where it is not
    cacheable or the cache cannot be written (said on stderr: the next start packs again)."""
    if not ENABLED or not cacheable(weights):
        return None
    path = cache_path(gguf, dtype, spec)
    state = {"weights": {k: v for k, v in weights.__dict__.items() if k != "embed"},
             "spec": {"method": spec.method, "group": spec.group, "dense_from": spec.dense_from,
                      "source": spec.source, "int4_head": spec.int4_head}}
    try:
        cachefiles.write_whole(path, lambda f: torch.save(state, f))
    except OSError as exc:
        print(f"specserve: could not cache {gguf.name}'s packed weights in {path.parent} ({exc}); the next start "
              "packs them again", file=sys.stderr, flush=True)
        return None
    _prune(path)
    return path


def _prune(kept: pathlib.Path) -> None:
    """Remove the entries of `kept`'s file and quantization (other code, another build) beyond the `KEEP` most
    recently used, so that upgrades do not pile up copies of a model."""
    prefix = kept.name[: kept.name.rindex("-") + 1]
    cachefiles.keep_recent([p for p in kept.parent.glob(f"{glob_escape(prefix)}*.pt") if p != kept], KEEP - 1)
