"""A model directory's tokenizer, cached on disk as the object transformers built.

`AutoTokenizer.from_pretrained` parses a large tokenizer.json several times over in Python (a second for a
150k-token vocabulary on two cores), and a Serve replica cannot answer before it has its tokenizer. The built
tokenizer is pickled once; later reads unpickle it (its Rust tokenizer rebuilt from its own serialization), about
a third of the time. The key is the directory's files (name, size, modification time; weights aside) and the
versions of transformers and tokenizers, so a changed file or an upgrade reads it afresh.
`SPECSERVE_TOKENIZER_CACHE=0` turns it off; entries live in `$SPECSERVE_CACHE/tokenizers`, about the size of
tokenizer.json each, the `KEEP` most recently used kept.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pathlib
import pickle
from collections.abc import Callable
from typing import Any

from specserve.models.formats import cachefiles

ENABLED: bool = os.environ.get("SPECSERVE_TOKENIZER_CACHE", "1") != "0"
KEEP = 8
_FORMAT = 1
_WEIGHTS = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".msgpack", ".h5")


def cache_dir() -> pathlib.Path:
    from specserve.models.kernels.cpu import cache_root

    return cache_root() / "tokenizers"


def _key(directory: pathlib.Path) -> str | None:
    """The cache key of the tokenizer in `directory` (None: not a local directory)."""
    if not directory.is_dir():
        return None
    import tokenizers
    import transformers

    files = cachefiles.stamps(p for p in sorted(directory.iterdir()) if p.is_file() and not p.name.endswith(_WEIGHTS))
    parts = {"format": _FORMAT, "files": files,
             "transformers": transformers.__version__, "tokenizers": tokenizers.__version__}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def cached(path: Any, build: Callable[[], Any]) -> Any:
    """The tokenizer of the directory `path`: unpickled from the cache, else `build()`'s, saved there."""
    key = _key(pathlib.Path(str(path))) if ENABLED else None
    if key is None:
        return build()
    entry = cache_dir() / f"{key}.pkl"
    try:
        with open(entry, "rb") as f:
            tokenizer = pickle.load(f)
        with contextlib.suppress(OSError):
            os.utime(entry)  # most recently used
        return tokenizer
    except Exception:  # noqa: BLE001 - none yet, or a damaged one (or one of other code): built below, replaced
        pass
    tokenizer = build()
    if tokenizer is not None:
        _save(entry, tokenizer)
    return tokenizer


def _save(entry: pathlib.Path, tokenizer: Any) -> None:
    try:
        cachefiles.write_whole(entry, lambda f: pickle.dump(tokenizer, f, protocol=pickle.HIGHEST_PROTOCOL))
    except Exception:  # noqa: BLE001 - a read-only cache or an object that does not pickle: read afresh each time
        return
    cachefiles.keep_recent(list(entry.parent.glob("*.pkl")), KEEP)
