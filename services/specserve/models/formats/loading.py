"""Turn a user's model spec into a loaded model (and tokenizer when there is one).

Accepted specs: a Hugging Face id or local directory, a `.gguf` file, the
name "embedded", or an already-loaded `transformers.PreTrainedModel`.
"""

from __future__ import annotations

import functools
import json
import pathlib
import sys
import threading
from dataclasses import dataclass
from typing import Any

import torch

from specserve.models.families.arch import GGUF_STORED
from specserve.models.families.weights import drop_linears
from specserve.models.formats import embedded, ggufmodel, packcache, slices, tokcache
from specserve.models.formats.gguf import DENSE_TYPES, gguf_architecture, gguf_linears, gguf_weight_type
from specserve.models.kernels import quant
from specserve.models.kernels.tp import Shard
from specserve.quantization import parse

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "float64": torch.float64}


@dataclass(frozen=True)
class TokenizerAt:
    """A model's tokenizer not read yet: the directory it is read from on first use."""

    path: Any


@dataclass
class LoadedModel:
    model: Any  # transformers.PreTrainedModel, in eval mode
    # PreTrainedTokenizerBase, None when the caller passed a bare model, or a `TokenizerAt` (read on first use: a
    # worker, which needs only the end-of-sequence ids, does not spend a second of two cores' time on it)
    _tokenizer: Any | None
    name: str

    @property
    def tokenizer(self) -> Any | None:
        if isinstance(self._tokenizer, TokenizerAt):
            self._tokenizer = _tokenizer_at(self._tokenizer.path)
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def quantization(self) -> str:
        """How its linear layers are stored: "none", "int8", "int4-g32", "gguf-Q4_1", ..."""
        spec = getattr(self.model, "specserve_quant", None)
        return "none" if spec is None else spec.describe()

    @property
    def max_positions(self) -> int | None:
        return getattr(self.model.config, "max_position_embeddings", None)

    @property
    def eos_ids(self) -> set[int]:
        """End-of-sequence ids from the generation config, the model config and the tokenizer."""
        ids: set[int] = set()
        for source in (getattr(self.model, "generation_config", None), self.model.config):
            value = getattr(source, "eos_token_id", None) if source is not None else None
            if value is not None:
                ids.update(value if isinstance(value, list) else [value])
        eos = _UNKNOWN
        if isinstance(self._tokenizer, TokenizerAt):
            eos = tokenizer_eos_id(self._tokenizer.path)
        if eos is _UNKNOWN:
            eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        if eos is not None:
            ids.add(eos)
        return ids


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@functools.cache
def _cpu_has_fast_bf16() -> bool:
    try:
        flags = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def default_dtype(device: str | torch.device) -> torch.dtype:
    """bf16 where it is the fast path (GPUs, CPUs with bf16 instructions), else fp32."""
    if torch.device(device).type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if _cpu_has_fast_bf16() else torch.float32


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(set(DTYPES))} or None, got {dtype!r}") from None


# transformers builds a model with torch's parameter registration patched process-wide (weights on the meta
# device until loaded): two threads loading at once can leave each other's model, or the patch, behind
_LOADING = threading.Lock()


def load_model(
    spec: Any, dtype: str | torch.dtype | None = None, device: str | None = None, device_map: Any = None,
    quantization: str | None = None, shard: Shard | None = None, layers: tuple[int, int] | None = None,
    draft: bool = False,
) -> LoadedModel:
    """Load a causal LM from any accepted spec.

    dtype None keeps an already-loaded model's dtype and picks `default_dtype`
    for models loaded here. device_map (e.g. "auto") shards the layers over
    the visible GPUs with accelerate instead of moving the model to `device`.
    quantization (`specserve.quantization.parse`): "auto" (None) keeps a GGUF file's quantized weights
    ("gguf") unless dtype float32 is asked (then its values are dequantized), and
    loads anything else dense; "none" loads dense; "int8" / "int4" quantize the
    linear layers at load (a passed model in place: its dense linear weights are
    dropped). Quantized models compute in bfloat16 unless dtype says otherwise.
    shard: a tensor-parallel rank's part (`models.kernels.tp`); a quantized model packs only that part.
    layers: (start, end), a pipeline stage's decoder layers (`workers.stages`); quantized or sharded, only those
    are packed.
    draft: the model drafts: under int4 its LM head is int4 too (a target's stays int8). The head is a large part
    of a draft step's bytes, and a draft's precision moves only its acceptance, never what is sampled.
    """
    from transformers import AutoModelForCausalLM, PreTrainedModel

    from specserve.models.drafts.configs import register_models

    register_models()
    method, group = parse(quantization)
    torch_dtype = resolve_dtype(dtype)
    if isinstance(spec, LoadedModel):  # already loaded (e.g. one target shared by several decoders)
        same_device = device is None or torch.device(device) == spec.device
        same_quant = method == "auto" or parse(spec.quantization.split("-")[0])[0] == method
        if same_device and torch_dtype in (None, spec.dtype) and same_quant:
            return spec
        if spec.quantization != "none":
            raise ValueError(f"{spec.name} is loaded quantized ({spec.quantization}); load it again to change that")
        spec = spec.model
    if isinstance(spec, PreTrainedModel):
        model = spec
        if device is not None:
            model = model.to(device)
        torch_dtype = _quantized_dtype(torch_dtype) if method in ("int8", "int4") else torch_dtype
        if torch_dtype is not None and torch_dtype != next(model.parameters()).dtype:
            model = model.to(torch_dtype)
        loaded = LoadedModel(model.eval(), None, type(model).__name__)
        if method == "gguf":
            raise ValueError("quantization 'gguf' keeps a GGUF file's weights; this model was passed loaded")
        return _quantize(loaded, method, group, shard=shard, layers=layers, draft=draft) \
            if method in ("int8", "int4") else loaded
    if not isinstance(spec, (str, pathlib.Path)):
        raise TypeError(f"model must be a name, a path or a PreTrainedModel, got {type(spec).__name__}")

    device = device or default_device()
    path, name = resolve_model_path(spec)
    gguf = gguf_file(spec)
    if method == "auto":  # float32 asked: the file's values dequantized, the same model in exact arithmetic
        kept = gguf is not None and torch_dtype in (None, torch.bfloat16)
        if kept and torch_dtype is None and torch.device(device).type == "cpu" and not _cpu_kernels_run():
            kept, torch_dtype = False, torch.float32  # torch's bf16 int4 kernels round a row by the batch it is in
        kept = kept and gguf_weight_type(gguf) not in DENSE_TYPES
        if kept and gguf_architecture(gguf) not in GGUF_STORED:
            print(f"specserve: {name}: a {gguf_architecture(gguf)!r} GGUF file loads dense (its quantized "
                  f"weights are kept as stored for {', '.join(GGUF_STORED)} files; int8 or int4 quantize it at load)",
                  file=sys.stderr, flush=True)
            kept = False
        method = "gguf" if kept else "none"
    if method == "gguf" and gguf is None:
        raise ValueError(f"quantization 'gguf' keeps a GGUF file's own weights; {name!r} is not a .gguf file "
                         "(use int8 or int4 to quantize it at load)")
    if method == "gguf" and gguf_architecture(gguf) not in GGUF_STORED:
        raise ValueError(f"quantization 'gguf' keeps the weights of {', '.join(GGUF_STORED)} GGUF files; {name!r} "
                         f"is {gguf_architecture(gguf)!r} (auto loads it dense; int8 or int4 quantize it at load)")
    torch_dtype = _quantized_dtype(torch_dtype) if method != "none" else torch_dtype
    torch_dtype = torch_dtype or default_dtype(device)
    _refuse_prequantized(path, name)
    sliced = _sliced_part(path, name, shard, layers, method, device_map, torch_dtype, device)
    if sliced is not None:
        return _keep_shard(sliced, shard, layers)
    # the linears from the file's blocks, as stored or requantized layer by layer (not through a dense model)
    from_blocks = gguf is not None and (method == "gguf" or (method != "none" and
                                                              gguf_weight_type(gguf) not in DENSE_TYPES))
    if gguf is not None:
        if device_map is not None:
            raise ValueError(f"{name}: a GGUF file loads on one device; shard it with tensor_parallel instead")
        with _LOADING:
            model = ggufmodel.build_model(gguf, torch_dtype, device, keep_linears=from_blocks)
    else:
        try:
            with _LOADING:
                model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype, device_map=device_map)
        except OSError as exc:
            raise ValueError(
                f"could not load model {name!r}: {exc}. Pass a local directory or .gguf file when offline."
            ) from exc
        if device_map is None:
            model = model.to(device)
    loaded = LoadedModel(model.eval(), TokenizerAt(path), name)
    if method == "none":
        return loaded if shard is None else _keep_shard(loaded, shard, layers)
    if from_blocks and method != "gguf":
        print(f"specserve: {name}: its {gguf_weight_type(gguf)} linears requantized to {method} at load (quantization "
              "'gguf' keeps them as stored)", file=sys.stderr, flush=True)
    return _quantize(loaded, method, group, gguf if from_blocks else None, shard, layers, draft)


def _sliced_part(path, name: str, shard: Shard | None, layers: tuple[int, int] | None, method: str,
                 device_map: Any, dtype: torch.dtype, device: str) -> LoadedModel | None:
    """A dense tensor-parallel rank or pipeline stage of a safetensors checkpoint, read as its part only
    (`models.formats.slices`); None where that does not apply (neither, quantized at load: int8 scales span whole rows,
    GGUF, device_map)."""
    from transformers import AutoConfig

    from specserve.models.drafts import configs  # noqa: F401 - registers the drafts' configs
    from specserve.models.families.arch import arch_of
    from specserve.models.families.lean import unsupported_config

    if (shard is None and layers is None) or method != "none" or device_map is not None \
            or not pathlib.Path(path).is_dir():
        return None
    files = slices.checkpoint_files(path)
    if files is None:
        return None
    config = AutoConfig.from_pretrained(str(path))
    reason = unsupported_config(config)
    if reason is not None:
        raise ValueError(f"{'tensor_parallel' if shard else 'target_stages'} run in the lean forward "
                         f"(docs/serving.md lists its families); {name} has {reason}")
    if shard is not None and arch_of(config).fused:  # q|k|v in one tensor: read whole, cut by `LeanWeights`
        return None
    with _LOADING:
        model = slices.load_rank(path, files, config, shard, dtype, device, layers)
    return LoadedModel(model, TokenizerAt(path), name)


def _cpu_kernels_run() -> bool:
    """Whether specserve's CPU kernels run here; where they do not, says what a GGUF file loads as instead."""
    from specserve.models.kernels import cpu

    if cpu.available():
        return True
    print(f"specserve: {cpu.describe()}: a GGUF file loads dense in float32 (seeded streams then do not "
          "depend on the batch; quantization: gguf keeps its quantized weights)", file=sys.stderr, flush=True)
    return False


def load_draft(draft: Any, dtype: Any = None, device: str | None = None, quantization: str | None = None
               ) -> LoadedModel:
    """`load_model` for a model draft, its quantization resolved by `draft_quantization`."""
    return load_model(draft, dtype, device, quantization=draft_quantization(quantization, draft, dtype, device),
                      draft=True)


def draft_quantization(quantization: str | None, draft: Any, dtype: Any = None, device: Any = None) -> str | None:
    """A model draft's quantization: "auto" on a CPU that runs specserve's int4/int8 kernels (`cpu`) is int8 for
    a dense draft, whose step there reads a quarter of float32's bytes for a few percent of the acceptance, and
    int4 for a GGUF draft stored in 5 bits or more (Q5_0, Q6_K, Q8_0, ...), requantized from the file's values:
    a cheaper step for the same acceptance on a real pair (docs/benchmarks.md; exactness holds for any draft);
    a model passed loaded, a dtype other than bfloat16 asked, a 4-bit GGUF draft or another device: as given."""
    if (parse(quantization)[0] != "auto" or not isinstance(draft, (str, pathlib.Path))
            or resolve_dtype(dtype) not in (None, torch.bfloat16)):
        return quantization
    if torch.device(device or default_device()).type != "cpu":
        return quantization
    from specserve.models.kernels import cpu

    if not cpu.available():
        return quantization
    gguf = gguf_file(draft)
    if gguf is None:
        return "int8"
    return "int4" if gguf.is_file() and gguf_weight_type(gguf) in WIDE_TYPES else quantization


# GGUF types a draft stored in which is requantized to int4 by default (`draft_quantization`)
WIDE_TYPES = ("Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "F16", "BF16", "F32")


def _refuse_prequantized(path, name: str) -> None:
    """A checkpoint quantized by another tool (AWQ, GPTQ, bitsandbytes, FP8, ...) loads only through that tool's
    kernels in transformers; say so by name instead of failing deep inside it."""
    config = pathlib.Path(path) / "config.json"
    if not config.is_file():
        return
    found = (json.loads(config.read_text()).get("quantization_config") or {}).get("quant_method")
    if found:
        raise ValueError(
            f"{name} is a pre-quantized {found!r} checkpoint; specserve does not load {found} packing yet. It serves "
            "GGUF files as stored (Q4_0, Q4_1, Q8_0) and quantizes dense checkpoints at load (--quantization int8 "
            "or int4): pass the dense checkpoint or a GGUF file of the model")


def gguf_file(spec: Any) -> pathlib.Path | None:
    """The GGUF file a spec loads from ("embedded" is the shipped one), else None."""
    name = str(spec) if isinstance(spec, (str, pathlib.Path)) else ""
    if name == "embedded":
        return embedded.embedded_gguf_path()
    return pathlib.Path(name).expanduser() if name.endswith(".gguf") else None


def _quantized_dtype(dtype: torch.dtype | None) -> torch.dtype:
    """bfloat16 unless asked otherwise: torch's packed CPU kernels are fast only there (float32 works, ~10x
    slower; docs/benchmarks.md)."""
    return dtype or torch.bfloat16


def _quantize(loaded: LoadedModel, method: str, group: int, gguf: pathlib.Path | None = None,
              shard: Shard | None = None, layers: tuple[int, int] | None = None, draft: bool = False) -> LoadedModel:
    """Give the model's linear layers packed quantized weights (`quant.QuantSpec`, made into the lean forward's
    weights now) and drop their dense copies."""
    from specserve.models.families.lean import lean_weights

    model = loaded.model
    _require_lean(loaded, f"quantization {method}")
    if method == "int8" and loaded.device.type == "cuda":
        print("specserve: int8 weights multiply through aten._weight_int8pack_mm, which has no fast CUDA path: "
              "a 7B step took 8.4x bfloat16's on an H200 (docs/benchmarks.md); int4 or none is faster there",
              file=sys.stderr, flush=True)
    # a whole model on the CPU: what the packed cache keeps (`formats.packcache`)
    whole = gguf is not None and shard is None and layers is None and loaded.device.type == "cpu"
    spec = quant.QuantSpec(method, group, None, quant.dense_from(loaded.device), gguf_weight_type(gguf) if gguf else "",
                           int4_head=draft and method == "int4")
    if whole and packcache.load(gguf, model, loaded.dtype, spec) is not None:
        _drop_linears(model)
        return loaded
    stored = gguf_linears(gguf, model.config) if gguf is not None else None
    spec.stored = stored
    model.specserve_quant = spec
    weights = lean_weights(model, loaded.dtype, shard, layers)
    model.specserve_quant.stored = None  # packed by now
    if whole:
        packcache.save(gguf, weights, loaded.dtype, spec)
    _drop_linears(model)
    return loaded


def _keep_shard(loaded: LoadedModel, shard: Shard | None, layers: tuple[int, int] | None = None) -> LoadedModel:
    """A dense tensor-parallel rank (or pipeline stage): its part of the weights made (`weights.LeanWeights`), the
    HF modules' linear weights dropped, so the rank holds 1/N of them (the stage its layers) after loading."""
    from specserve.models.families.lean import lean_weights

    _require_lean(loaded, "tensor_parallel" if shard is not None else "target_stages")
    lean_weights(loaded.model, loaded.dtype, shard, layers)
    _drop_linears(loaded.model)
    return loaded


def _require_lean(loaded: LoadedModel, what: str) -> None:
    from specserve.models.families.lean import unsupported_reason

    reason = unsupported_reason(loaded.model)
    if reason is not None:
        raise ValueError(f"{what} runs in the lean forward (docs/serving.md lists its families); {loaded.name} has "
                         f"{reason}")


def _drop_linears(model) -> None:
    """Free the HF modules' linear weights (and an untied head) once the lean forward holds its own."""
    for layer in model.model.layers:
        drop_linears(layer)
    if model.lm_head.weight is not getattr(model.model.embed_tokens, "weight", None):
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.new_empty(0), requires_grad=False)


def model_config(spec: Any):
    """A model's HF config: a loaded model's own, else read from its files (no weights loaded)."""
    config = getattr(spec, "config", None)
    if config is not None:
        return config
    from transformers import AutoConfig

    from specserve.models.drafts import configs  # noqa: F401 - registers the drafts' configs

    return AutoConfig.from_pretrained(str(resolve_model_path(spec)[0]))


def resolve_model_path(spec: str | pathlib.Path) -> tuple[str | pathlib.Path, str]:
    """(directory or hub id to load from, display name). A GGUF file's directory is its metadata's
    (`ggufmodel.metadata_dir`: config and tokenizer, no weights); its weights load from the file itself."""
    name = str(spec)
    if name == "embedded":
        return ggufmodel.metadata_dir(embedded.embedded_gguf_path()), "SmolLM2-135M-Instruct"
    if name == "embedded-draft":
        path = embedded.shipped_draft_dir()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"the distilled draft is missing from {path}; reinstall specserve")
        return path, "SmolLM2-135M-Instruct-draft"
    if name.endswith(".gguf"):
        gguf = pathlib.Path(name).expanduser()
        if not gguf.is_file():
            raise FileNotFoundError(f"GGUF file not found: {gguf}")
        return ggufmodel.metadata_dir(gguf), name
    path = pathlib.Path(name).expanduser()
    if not path.exists():
        if name.startswith((".", "/", "~")) or name.count("/") > 1:
            raise FileNotFoundError(f"model directory not found: {path}")
        return name, name  # a hub id; works only where the hub (or its cache) is reachable
    return path, name


_UNKNOWN = object()


def tokenizer_eos_id(path) -> Any:
    """The end-of-sequence id the tokenizer in `path` would report, read from its files without building it: the
    `eos_token` of tokenizer_config.json found among tokenizer.json's added tokens (where special tokens live);
    `_UNKNOWN` where the files do not say it that plainly (the tokenizer is then read)."""
    directory = pathlib.Path(str(path))
    if (directory / "special_tokens_map.json").exists():  # a second say on the special tokens
        return _UNKNOWN
    try:
        eos = json.loads((directory / "tokenizer_config.json").read_text()).get("eos_token", _UNKNOWN)
        if isinstance(eos, dict):
            eos = eos.get("content", _UNKNOWN)
        if not isinstance(eos, str):
            return _UNKNOWN
        text = (directory / "tokenizer.json").read_text()
        start = text.index("[", text.index('"added_tokens"'))
        added, _ = json.JSONDecoder().raw_decode(text, start)
    except (OSError, ValueError, AttributeError):
        return _UNKNOWN
    ids = [t["id"] for t in added if isinstance(t, dict) and t.get("content") == eos and isinstance(t.get("id"), int)]
    return ids[0] if len(ids) == 1 else _UNKNOWN


def _tokenizer_at(path):
    def read():
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError):
            return None

    return tokcache.cached(path, read)


def load_tokenizer(spec: Any):
    """The tokenizer of a model spec without loading its weights (None when the model has none)."""
    if not isinstance(spec, (str, pathlib.Path)):
        return None
    return _tokenizer_at(resolve_model_path(spec)[0])
