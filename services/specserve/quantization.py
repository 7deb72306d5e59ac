"""The syntax of a quantization spec (`quantization`, `draft_quantization`): read by the command line and the
configs without importing torch, and by the loaders (`models.kernels.quant`)."""

from __future__ import annotations

import re

METHODS = ("auto", "none", "gguf", "int8", "int4")
INT4_GROUPS = (32, 64, 128)


def parse(spec: str | None) -> tuple[str, int]:
    """(method, int4 group) of a quantization spec: auto, none, gguf, int8, int4 or int4-g32/-g64/-g128."""
    text = "auto" if spec is None else str(spec).lower()
    m = re.fullmatch(r"int4(?:-g(\d+))?", text)
    if m:
        group = int(m.group(1) or 32)
        if group not in INT4_GROUPS:
            raise ValueError(f"quantization int4 groups must be one of {INT4_GROUPS}, got {group}")
        return "int4", group
    if text not in METHODS:
        raise ValueError(f"quantization must be one of {', '.join(METHODS)} or int4-g64/int4-g128, got {spec!r}")
    return text, 32
