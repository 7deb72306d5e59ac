"""Package attributes imported on first use: a process that needs a package's light parts (the wire code, the
configs, the speculation loop) does not import torch, transformers or the models' code for its other names."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def exports(package: str, table: dict[str, str]) -> Callable[[str], Any]:
    """The module `__getattr__` of `package` that imports each name of `table` (name -> module) on first use."""

    def __getattr__(name: str) -> Any:
        if name in table:
            return getattr(importlib.import_module(table[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
