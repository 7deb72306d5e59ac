"""Placement and model configuration for the draft and target workers (user-facing, validated)."""

from __future__ import annotations

import os
import pathlib
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


DEFAULT_KV_TOKENS = 65536  # pools sized before a model is loaded (tensor-parallel ranks, pipeline stages)


class RoleResources(BaseModel):
    """Ray resources one worker role asks for; Ray places the actor on a node that has them."""

    model_config = ConfigDict(extra="forbid")

    num_cpus: float = Field(0.5, ge=0, description="CPU slots reserved (fractions allowed).")
    num_gpus: float = Field(0, ge=0, description="GPUs owned by the worker; a target shards over all of them.")
    accelerator_type: str | None = Field(None, description="Ray accelerator type, e.g. 'L4' or 'H100'.")
    resources: dict[str, float] = Field(default_factory=dict, description="Custom Ray resources, e.g. {'small_gpu': 1}.")
    torch_threads: int | None = Field(
        None, ge=1, description="CPU threads for torch in the worker, per rank (default: the cores of the machine that "
        "starts it, shared among tensor_parallel ranks)."
    )
    tensor_parallel: int = Field(
        1, ge=1,
        description="Target only (target_resources, or each of target_stages): ranks the target's (the stage's) layers "
        "are split over (tensor parallelism). Each rank is an actor "
        "with the resources above (num_gpus: 1 for one GPU per rank), all packed on one node in a placement group; "
        "gloo between CPU ranks, NCCL between GPU ranks. At most the model's key/value heads, and a divisor of its "
        "MLP width.",
    )

    def threads(self) -> int:
        """torch threads per process: torch_threads, else the machine's cores shared among its ranks."""
        return self.torch_threads or max(1, (os.cpu_count() or 1) // self.tensor_parallel)

    def bundle(self) -> dict[str, float]:
        """One rank's share of a placement group: what `actor_options` asks for."""
        bundle = {"CPU": max(self.num_cpus, 0.01), **self.resources}
        if self.num_gpus:
            bundle["GPU"] = self.num_gpus
        if self.accelerator_type:
            bundle[f"accelerator_type:{self.accelerator_type}"] = 0.001
        return bundle

    def actor_options(self) -> dict[str, Any]:
        # Ray starts actors with OMP_NUM_THREADS=1; set before torch loads, it decides the thread pool
        # (torch.set_num_threads afterwards left forwards slower).
        options: dict[str, Any] = {
            "num_cpus": self.num_cpus,
            "num_gpus": self.num_gpus,
            "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(self.threads())}},
        }
        if self.accelerator_type:
            options["accelerator_type"] = self.accelerator_type
        if self.resources:
            options["resources"] = dict(self.resources)
        return options


def _is_eagle3(draft: Any) -> bool:
    if isinstance(draft, (str, pathlib.Path)):  # a spec: told without importing the models' code
        from specserve.models.drafts.names import names_eagle3

        return names_eagle3(draft)
    from specserve.models.drafts.eagle3 import is_eagle3  # a loaded head: that code is imported already

    return is_eagle3(draft)


def is_head(draft: Any) -> bool:
    """Whether a draft spec names a feature head (`models.drafts.head`), without importing the models."""
    if isinstance(draft, str):
        return draft.startswith("head:")
    return getattr(getattr(draft, "config", None), "model_type", None) == "specserve_head"


class WorkersConfig(BaseModel):
    """Which models the workers serve and where Ray puts them."""

    model_config = ConfigDict(extra="forbid")

    target: str = Field("embedded", description="HF id/dir, .gguf file, or 'embedded'.")
    draft: str = Field(
        "default",
        description="HF id/dir, .gguf file, 'embedded-draft', 'ngram', 'none', 'head:PATH' (a feature head "
        "`specserve distill --head` wrote: drafts inside the target worker from its features), 'eagle3:PATH' (a public "
        "EAGLE-3 head: the same, on three of the target's layers), or 'default' (the "
        "shipped distilled draft for the embedded target when the draft worker has a GPU, else 'ngram').",
    )
    dtype: str | None = Field(None, description="'float32', 'bfloat16', 'float64' (slow; for exactness checks) or None "
                                             "(bf16 where fast).")
    quantization: str = Field(
        "auto",
        description="The target's linear weights: 'auto' (a GGUF file, the embedded target included, is served from "
        "its own quantized weights; anything else dense), 'none' (dense), 'int8' (per row) or 'int4' (groups of 32; "
        "'int4-g64', 'int4-g128') quantized at load. Quantized targets compute in bf16 and are different models "
        "from their dense versions; the output is exactly the quantized target's distribution.",
    )
    draft_quantization: str = Field("auto", description="The same as `quantization`, for a model draft.")
    draft_top_k: int = Field(
        64, ge=1, description="A model draft samples from (and ships) its top-k q; exact for any k."
    )
    ngram_worker: bool = Field(
        False, description="Run the n-gram draft as a DraftWorker actor instead of inside the coordinator."
    )
    batching: bool = Field(
        True,
        description="The target worker runs the ready work of all sessions as ONE forward per step over a shared KV "
        "pool (the families of docs/serving.md's table: Llama 2/3.x, Mistral, Qwen2/2.5/3, Phi-3, OLMo 2, Gemma 1/2/3; "
        "others run one session at a time). false: one session at a time, each with its own cache (the unbatched path, for comparisons).",
    )
    kv_cache_tokens: int | None = Field(
        None, ge=256,
        description="Token positions the target's KV pool (and a model draft's) holds across all sessions, "
        "preallocated. Bytes = this x 2 x layers x kv_heads x head_dim x dtype size (23,040 per token for the "
        "embedded target in bf16). None: sized from the memory free once the target is loaded "
        "(kv_memory_fraction; 65,536 for a tensor-parallel or staged target). A session gets a power-of-two block "
        "(at most 2x its tokens); a new one that does not fit waits for running sessions to end (kv_wait_s), then "
        "fails with HTTP 503 / RESOURCE_EXHAUSTED.",
    )
    kv_memory_fraction: float | None = Field(
        None, gt=0, le=1,
        description="Where kv_cache_tokens is not set, the KV pools take: on a GPU this fraction of its total memory "
        "less what is in use once the target is loaded (default 0.9, as vLLM's gpu_memory_utilization), on a CPU "
        "this fraction of the machine's available RAM (default 0.25), at most 8 GiB; a colocated draft's weights "
        "are set aside first. Start-up prints the positions the pools got.",
    )
    kv_wait_s: float = Field(
        60.0, ge=0,
        description="How long a new session's prefill waits for KV pool room when the pool is full of running "
        "sessions' blocks (0: fail at once with HTTP 503 / RESOURCE_EXHAUSTED, as one that could never fit does).",
    )
    prefix_caching: bool = Field(
        True,
        description="Keep the keys and values of finished requests in the KV pools (target and model draft) and "
        "start a new request from the longest cached prefix of its prompt (a shared system prompt, the earlier "
        "turns of a chat), prefilling only the rest; evicted least recently used when the pool needs room. The "
        "output is the same with it off.",
    )
    compute_lanes: int | None = Field(
        None, ge=1,
        description="A CPU target worker with this many sessions open or more (8) splits them among N compute "
        "threads, each stepping its share on its share of the cores: another process taking a core then stalls "
        "one of them instead of every thread of one step. Default: 2 where the worker has 2 threads or more; 1: "
        "one step over all sessions. The output is the same either way.",
    )
    max_step_tokens: int = Field(
        512, ge=16, description="New tokens one batched target step may carry (verify blocks and prefill chunks)."
    )
    prefill_chunk: int = Field(
        256, ge=16,
        description="Prompt tokens prefilled per step: a long prompt shares steps with running sessions instead of "
        "stalling them for its whole prefill.",
    )
    draft_placement: Literal["auto", "colocated", "split"] = Field(
        "auto",
        description="Where a model draft runs. 'colocated': inside the target worker (one process, one device; "
        "draft steps batched like the target's; one stream message per round). 'split': its own DraftWorker "
        "(draft_resources; pipelined drafting possible). 'auto': colocated unless draft_resources ask for a GPU, "
        "an accelerator type or custom resources of their own.",
    )
    max_restarts: int = Field(
        -1, ge=-1,
        description="Times Ray restarts a worker (or the coordinator) whose process died; -1: every time. A restarted "
        "worker loads its model again, and the sessions it held go on from their committed tokens.",
    )
    session_idle_s: float = Field(
        300.0, gt=0,
        description="A worker releases a session no call has touched for this long (its coordinator died without "
        "releasing it); its KV memory returns to the pool.",
    )
    draft_resources: RoleResources = Field(default_factory=RoleResources)
    target_resources: RoleResources = Field(default_factory=RoleResources)
    target_stages: list[RoleResources] = Field(
        default_factory=list,
        description="Run the target as a pipeline of stage actors, one per entry (layers split evenly, in order), "
        "each with a KV arena over its layers; the target worker then keeps the sessions and batches their steps, "
        "which pass stage to stage. Targets of docs/serving.md's supported architectures. Empty = one target actor holding the whole model.",
    )

    def fixed_kv_tokens(self) -> int:
        """The positions of pools that are sized before any model loads (stages, ranks): kv_cache_tokens, else
        DEFAULT_KV_TOKENS."""
        return self.kv_cache_tokens or DEFAULT_KV_TOKENS

    def draft_device_of_its_own(self) -> bool:
        r = self.draft_resources
        return bool(r.num_gpus > 0 or r.accelerator_type or r.resources)

    def colocated(self, draft: Any = None) -> bool:
        """Whether a model draft runs inside the target worker (see `draft_placement`)."""
        draft = self.draft if draft is None else draft
        if isinstance(draft, str) and draft in ("none", "ngram"):
            return False
        if is_head(draft) or _is_eagle3(draft):  # a head reads the target's features: always beside it
            return True
        if self.draft_placement == "auto":
            return not self.draft_device_of_its_own() and not self.target_stages
        return self.draft_placement == "colocated"

    def has_draft_worker(self, draft: Any = None) -> bool:
        """Whether the draft (this config's, or `draft` passed instead) runs in a DraftWorker actor: the n-gram
        draft runs inside the coordinator unless `ngram_worker`, and 'none' has no draft at all."""
        draft = self.draft if draft is None else draft
        if self.colocated(draft):
            return False
        return not (isinstance(draft, str) and (draft == "none" or (draft == "ngram" and not self.ngram_worker)))

    def scheduling(self) -> dict[str, Any]:
        """The target worker's batching arguments (`TargetWorkerServicer`'s scheduling keywords)."""
        return {"batching": self.batching, "kv_cache_tokens": self.kv_cache_tokens,
                "kv_memory_fraction": self.kv_memory_fraction,
                "max_step_tokens": self.max_step_tokens, "prefill_chunk": self.prefill_chunk,
                "prefix_caching": self.prefix_caching, "kv_wait_s": self.kv_wait_s,
                "compute_lanes": self.compute_lanes}

    @model_validator(mode="after")
    def _check_quantization(self) -> WorkersConfig:
        from specserve.quantization import parse

        for key in ("quantization", "draft_quantization"):
            try:
                parse(getattr(self, key))
            except ValueError as exc:
                raise ValueError(f"{key}: {exc}") from None
        return self

    @model_validator(mode="after")
    def _check_head(self) -> WorkersConfig:
        """A feature head drafts inside the target worker, from its batched pool's features."""
        if not is_head(self.draft):
            return self
        if self.draft_placement == "split":
            raise ValueError("draft_placement: a feature head (draft: head:PATH) reads the target's features "
                             "and runs inside the target worker; use 'auto' or 'colocated'")
        for field, bad in (("target_stages", bool(self.target_stages)), ("batching", not self.batching),
                           ("target_resources.tensor_parallel", self.target_resources.tensor_parallel > 1)):
            if bad:
                raise ValueError(f"{field}: a feature head (draft: head:PATH) drafts beside one batched target "
                                 "worker that holds the whole model (no stages, one rank, batching on)")
        return self

    @model_validator(mode="after")
    def _check_tensor_parallel(self) -> WorkersConfig:
        if self.draft_resources.tensor_parallel > 1:
            raise ValueError("draft_resources.tensor_parallel: only the target splits over ranks")
        if self.target_resources.tensor_parallel > 1:
            if self.target_stages:
                raise ValueError("target_resources.tensor_parallel: with target_stages the worker holds no layers; "
                                 "set tensor_parallel on the stages")
            if not self.batching:
                raise ValueError("target_resources.tensor_parallel: needs batching (the ranks share the pooled step)")
        if self.target_stages and not self.batching:
            raise ValueError("target_stages: needs batching (the stages run the pooled step)")
        return self

    @model_validator(mode="after")
    def _resolve_default_draft(self) -> WorkersConfig:
        """'default' serves the distilled draft where it runs colocated with the target or has a GPU of its own;
        a split draft worker on the same CPU competes with the target's process for the cores (slower than the
        n-gram draft there: docs/benchmarks.md), so there it means n-gram."""
        from specserve.models.formats.embedded import resolve_draft

        pays = self.draft_resources.num_gpus > 0 or self.draft_placement != "split" and not self.target_stages
        self.draft = resolve_draft(self.target, self.draft, model_draft_pays=pays)
        return self
