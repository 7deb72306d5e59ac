"""`auto`'s calibration kept on disk: a worker that starts again with the same model files, loaded the same way
on the same machine, reads what it measured before (`engine.profile`: seconds per target step over 1..γ_max+1
positions, per drafted token) instead of spending seconds of its start measuring it again.

The key is what the timings depend on: each model file's path, size and modification time, how the models were
loaded (dtype, quantization, device), the compute threads, the CPU (its model name, cores, the kernels'
instruction set) or GPU, torch's version and specserve's own code. A calibration only steers `auto` (never what is
sampled), and `auto` refines it online from the rounds it sees. `SPECSERVE_CALIBRATION_CACHE=0` measures on every
start; the entries live in `$SPECSERVE_CACHE/calibration`, a few hundred bytes each.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import sys
from collections.abc import Callable
from typing import Any

from specserve.models.formats import cachefiles

CostProfile = tuple[dict[int, float] | None, float | None]

ENABLED: bool = os.environ.get("SPECSERVE_CALIBRATION_CACHE", "1") != "0"
_FORMAT = 1
_PACKAGE = pathlib.Path(__file__).resolve().parents[1]
_TIMED = ("models", "engine", "scheduler", "speculation")  # the code the timed steps run


def cache_dir() -> pathlib.Path:
    from specserve.models.kernels.cpu import cache_root

    return cache_root() / "calibration"


def _code_digest() -> str:
    return cachefiles.sources_digest(_PACKAGE, _TIMED)


def _files(spec: Any) -> list[pathlib.Path] | None:
    """The files a model spec loads from (None: not local files, e.g. a hub id or a model passed loaded)."""
    if not isinstance(spec, (str, pathlib.Path)):
        return None
    from specserve.models.formats import embedded

    name = str(spec)
    for prefix in ("head:", "eagle3:"):
        name = name.removeprefix(prefix)
    if name == "embedded":
        return [embedded.embedded_gguf_path()]
    path = embedded.shipped_draft_dir() if name == "embedded-draft" else pathlib.Path(name).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        return sorted(p for p in path.iterdir() if p.is_file())
    return None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    except OSError:
        return "?"


def identity(target: Any, draft: Any, loaded: dict[str, Any], threads: int | None) -> dict[str, Any] | None:
    """What a calibration of `target` with `draft` depends on (None where it cannot be told: no local files).
    loaded: how the models were loaded (dtype, quantization, device, γ_max, ...)."""
    import torch

    from specserve.models.kernels import cpu

    parts: dict[str, Any] = {"format": _FORMAT}
    for role, spec in (("target", target), ("draft", draft)):
        files = _files(spec)
        if not files:
            return None
        parts[role] = cachefiles.stamps(files)
    device = str(loaded.get("device", "cpu"))
    if device.startswith("cuda"):
        machine = {"gpu": torch.cuda.get_device_name(torch.device(device))}
    else:
        machine = {"cpu": _cpu_name(), "cores": os.cpu_count(), "isa": cpu.chosen_isa(), "kernels": cpu.available()}
    parts.update(loaded=loaded, threads=threads, machine=machine, torch=torch.__version__, code=_code_digest())
    return parts


def _path(parts: dict[str, Any]) -> pathlib.Path:
    key = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]
    return cache_dir() / f"{key}.json"


def _read(path: pathlib.Path) -> CostProfile | None:
    """The saved calibration, or None where there is none or it is not one (then it is measured again)."""
    try:
        saved = json.loads(path.read_text())
        verify = {int(n): float(t) for n, t in saved["verify_s"].items()}
        step = saved["draft_token_s"]
        step = None if step is None else float(step)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if not verify or sorted(verify) != list(range(1, len(verify) + 1)) or min(verify.values()) <= 0 \
            or (step is not None and step < 0):
        return None
    return verify, step


def _write(path: pathlib.Path, parts: dict[str, Any], costs: CostProfile) -> None:
    verify, step = costs
    body = json.dumps({"verify_s": {str(n): t for n, t in sorted(verify.items())}, "draft_token_s": step,
                       "key": parts}, default=str)
    try:
        cachefiles.write_whole(path, lambda f: f.write(body.encode()))
    except OSError as exc:  # a read-only cache: measured on every start, said once here
        print(f"specserve: auto's calibration not saved ({exc})", file=sys.stderr, flush=True)


def cached(parts: dict[str, Any] | None, measure: Callable[[], CostProfile]) -> CostProfile:
    """The calibration saved under `parts` (`identity`), else `measure()`'s, saved there when it is complete."""
    if not ENABLED or parts is None:
        return measure()
    path = _path(parts)
    costs = _read(path)
    if costs is not None:
        print(f"specserve: auto's calibration read from the cache ({path})", file=sys.stderr, flush=True)
        return costs
    costs = measure()
    if costs[0]:
        _write(path, parts, costs)
    return costs
