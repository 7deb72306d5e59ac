"""What specserve's caches on disk share (`packcache`, `tokcache`, `engine.calibration`): an entry written whole,
the most recently used entries kept, a digest of the code an entry depends on, files told apart by name, size and
modification time."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import pathlib
import tempfile
from collections.abc import Callable, Iterable
from typing import IO


def write_whole(path: pathlib.Path, write: Callable[[IO[bytes]], None]) -> None:
    """An entry written by `write` into a file beside `path`, renamed into place whole (another process may read
    `path` meanwhile). Raises what writing raised, the partial file removed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False)
    try:
        with tmp:
            write(tmp)
        os.replace(tmp.name, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp.name)
        raise


def keep_recent(entries: list[pathlib.Path], keep: int) -> None:
    """Remove all but the `keep` most recently used (modified or touched) of a cache's entries."""
    for stale in sorted(entries, key=_used, reverse=True)[keep:]:
        with contextlib.suppress(OSError):
            stale.unlink()


def _used(path: pathlib.Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:  # removed by another start meanwhile
        return 0.0


@functools.cache
def sources_digest(root: pathlib.Path, rooms: tuple[str, ...]) -> str:
    """sha256 of the Python and C++ sources under `root`'s folders `rooms` (names and contents)."""
    sha = hashlib.sha256()
    for path in sorted(p for room in rooms for p in (root / room).rglob("*")):
        if path.suffix in (".py", ".cpp", ".h") and path.is_file():
            sha.update(str(path.relative_to(root)).encode())
            sha.update(path.read_bytes())
    return sha.hexdigest()


def stamps(paths: Iterable[pathlib.Path]) -> list[list]:
    """[path, size, modification time in ns] of each file: a changed or replaced file reads differently."""
    return [[str(p.resolve()), (s := p.stat()).st_size, s.st_mtime_ns] for p in paths]
