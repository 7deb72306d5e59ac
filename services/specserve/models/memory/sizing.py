"""The positions of a KV pool that `kv_cache_tokens` does not fix: a share of the memory free after the weights.

A GPU gives the pools `fraction` (default 0.9) of its total memory less what is in use once the target is loaded
(vLLM's gpu_memory_utilization); a CPU machine `fraction` (default 0.25) of its available RAM, at most
CPU_CAP_BYTES. What is still to load (a colocated draft's weights) is set aside first.
"""

from __future__ import annotations

import os
import pathlib

import torch

GPU_FRACTION, CPU_FRACTION = 0.9, 0.25
CPU_CAP_BYTES = 8 << 30
MIN_POSITIONS = 256
MOST_SESSIONS = 64  # no pool is sized past this many sessions of the model's whole context


def bytes_per_position(config, dtype: torch.dtype) -> int:
    """Key and value bytes of one position over every layer of a model of this config."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def free_memory(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of a CUDA device, or of this machine's RAM (MemAvailable, MemTotal)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)
    try:
        info = dict(line.split(":", 1) for line in pathlib.Path("/proc/meminfo").read_text().splitlines())
        return int(info["MemAvailable"].split()[0]) * 1024, int(info["MemTotal"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):  # not Linux: all of it free, as far as is known
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return total, total


def kv_positions(per_position: int, device: torch.device, fraction: float | None = None, reserve: int = 0,
                 memory: tuple[int, int] | None = None, most: int | None = None) -> tuple[int, str]:
    """(positions, how they were sized) for pools of `per_position` bytes a position in all; reserve: bytes still
    to be loaded on the device; memory: (free, total), measured here when None; most: positions no more of which
    can be used. ValueError when fewer than MIN_POSITIONS fit."""
    free, total = memory if memory is not None else free_memory(device)
    gib = 1 << 30
    if device.type == "cuda":
        fraction = GPU_FRACTION if fraction is None else fraction
        budget = fraction * total - (total - free) - reserve
        source = f"{fraction:g} of the GPU's {total / gib:.1f} GiB less {(total - free) / gib:.1f} GiB in use"
    else:
        fraction = CPU_FRACTION if fraction is None else fraction
        budget = min(fraction * free, CPU_CAP_BYTES) - reserve
        source = f"{fraction:g} of {free / gib:.1f} GiB of available RAM, at most {CPU_CAP_BYTES / gib:.0f} GiB"
    if reserve:
        source += f", {reserve / gib:.1f} GiB set aside for the draft"
    positions = int(max(budget, 0) // per_position) // MIN_POSITIONS * MIN_POSITIONS
    if most is not None and positions > most:
        positions = max(MIN_POSITIONS, most // MIN_POSITIONS * MIN_POSITIONS)
        source += f"; {positions} are {MOST_SESSIONS} sessions of the model's whole context"
    if positions < MIN_POSITIONS:
        raise ValueError(f"kv_cache_tokens: the KV pools would get {positions} positions ({source}); free memory, "
                         "raise kv_memory_fraction or set kv_cache_tokens")
    return positions, f"{positions} positions, {positions * per_position / gib:.2f} GiB ({source})"


def weights_bytes(spec) -> int:
    """The bytes of a model's weight files on disk (a .gguf file, a directory's safetensors/bin), 0 if unknown."""
    path = pathlib.Path(str(spec)) if isinstance(spec, (str, os.PathLike)) else None
    if path is None or not path.exists():
        return 0
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for pattern in ("*.safetensors", "*.bin") for p in path.glob(pattern))
