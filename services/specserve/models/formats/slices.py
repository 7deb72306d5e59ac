"""A tensor-parallel rank's or a pipeline stage's part of a safetensors checkpoint, read without the rest.

A rank of N (`models.kernels.tp.Shard`) multiplies 1/N of every layer's linear weights. Loading the whole checkpoint
and cutting it (what `loading.load_model` does for other formats) holds the whole model in the rank's memory,
and on a GPU on its device, while it loads: a 70B rank would need all 140 GB. Here the model is built on the
meta device, every layer's q, k, v, gate, up (by rows) and o, down (by columns) are read as the rank's slice
only (`safe_open(...).get_slice`), and norms, the embedding and the head whole (the head is cut to the rank's
vocabulary rows later, with the other weights, in `weights.LeanWeights`). The model is marked with its shard
(`specserve_shard`): its HF modules hold parts, so only the lean forward of that shard may run it.

A pipeline stage (`workers.stages`) reads only its layers the same way (the embedding if it is the first, the
final norm and the head if it is the last; a tied head is the embedding, read for the last stage too), so a
stage of a target larger than one node loads its share, not the whole model; the model is marked with its
layers (`specserve_layers`). A stage that is also a tensor-parallel rank reads its slices of its layers.
"""

from __future__ import annotations

import json
import pathlib
from collections import defaultdict

import torch

from specserve.models.families.weights import LINEAR_ROLES
from specserve.models.kernels.tp import Shard, linear_parts

ROLES = {path: role for role, path in LINEAR_ROLES.items()}  # a layer's module path → its linear role


def checkpoint_files(path: str | pathlib.Path) -> dict[str, pathlib.Path] | None:
    """Tensor name → the safetensors file holding it, for a checkpoint directory; None if it has none."""
    from safetensors import safe_open

    path = pathlib.Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return {name: path / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    single = path / "model.safetensors"
    if not single.is_file():
        return None
    with safe_open(str(single), "pt") as f:
        return {name: single for name in f.keys()}


def _part(name: str, parts: dict[str, tuple[slice | None, slice | None]]) -> tuple[slice | None, slice | None]:
    """(rows, columns) of tensor `name` a rank reads: its part of a layer's linear weight or bias, else all."""
    if not name.startswith("model.layers."):
        return None, None
    module, _, leaf = name.split(".", 3)[3].rpartition(".")
    role = ROLES.get(module)
    if role is None:
        return None, None
    rows, cols = parts[role]
    return (rows, cols) if leaf == "weight" else (rows, None)  # a bias runs along the rows (o's is whole)


def _in_part(name: str, layers: tuple[int, int] | None, count: int, tied: bool) -> bool:
    """Whether a pipeline stage of layers [start, end) reads tensor `name` (every tensor without a stage)."""
    if layers is None:
        return True
    start, end = layers
    if name.startswith("model.layers."):
        return start <= int(name.split(".")[2]) < end
    if name == "model.embed_tokens.weight":
        return start == 0 or (tied and end == count)
    return end == count  # the final norm and the head


def load_rank(path: str | pathlib.Path, files: dict[str, pathlib.Path], config, shard: Shard | None,
              dtype: torch.dtype, device: str | torch.device, layers: tuple[int, int] | None = None):
    """The causal LM of `config` with only `shard`'s part of its layers' linear weights (all of them without a
    shard), and only layers [start, end) with their neighbours' tensors for a pipeline stage, read from `files`
    (`checkpoint_files`) onto `device` in `dtype`. What it does not read stays empty."""
    from accelerate import init_empty_weights
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, GenerationConfig

    from specserve.models.drafts.configs import register_models

    register_models()
    with init_empty_weights():  # parameters on the meta device, buffers (rotary frequencies) real
        model = AutoModelForCausalLM.from_config(config)
    # as transformers does: a head the checkpoint stores is its own, else it is the embedding's
    tied = bool(getattr(config, "tie_word_embeddings", False)) and "lm_head.weight" not in files
    count = config.num_hidden_layers
    wanted = [n for n in dict.fromkeys([*dict(model.named_parameters()), "lm_head.weight"])
              if not (tied and n == "lm_head.weight") and _in_part(n, layers, count, tied)]
    missing = [n for n in wanted if n not in files]
    if missing:
        raise ValueError(f"{path}: the checkpoint lacks {missing[:3]}{' and more' if len(missing) > 3 else ''}")
    parts = linear_parts(shard, config) if shard is not None else defaultdict(lambda: (None, None))
    by_file: dict[pathlib.Path, list[str]] = defaultdict(list)
    for name in wanted:
        by_file[files[name]].append(name)
    for file, names in by_file.items():
        with safe_open(str(file), "pt", device="cpu") as f:
            for name in names:
                rows, cols = _part(name, parts)
                piece = f.get_slice(name)
                t = piece[:] if rows is None and cols is None else piece[rows] if cols is None else piece[:, cols]
                module_name, _, leaf = name.rpartition(".")
                setattr(model.get_submodule(module_name), leaf,
                        torch.nn.Parameter(t.to(device=device, dtype=dtype), requires_grad=False))
    for name, param in list(model.named_parameters(remove_duplicate=False)):
        if param.is_meta:  # another stage's: left empty
            module_name, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(module_name), leaf,
                    torch.nn.Parameter(torch.empty(0, device=device, dtype=dtype), requires_grad=False))
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.to(device)  # the buffers
    if (pathlib.Path(path) / "generation_config.json").is_file():  # end-of-sequence ids, as from_pretrained
        model.generation_config = GenerationConfig.from_pretrained(str(path))
    model.specserve_shard = shard
    model.specserve_layers = layers
    return model.eval()
