"""What a draft spec names, told from the spec and its config file alone: the processes that only check configs
or start workers (the command line, a Serve replica) import no model code for it."""

from __future__ import annotations

import json
import pathlib
from typing import Any

EAGLE3_PREFIX = "eagle3:"
EAGLE3_ARCHITECTURES = {"LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM"}


def names_eagle3(spec: Any) -> bool:
    """Whether a spec (a string or path) names an EAGLE-3 head: "eagle3:PATH", or a directory whose config's
    architectures say so (`drafts.eagle3.is_eagle3` also knows a loaded one)."""
    if not isinstance(spec, (str, pathlib.Path)):
        return False
    if str(spec).startswith(EAGLE3_PREFIX):
        return True
    config = pathlib.Path(str(spec)) / "config.json"
    try:
        return bool(EAGLE3_ARCHITECTURES & set(json.loads(config.read_text()).get("architectures") or []))
    except (OSError, ValueError):
        return False
