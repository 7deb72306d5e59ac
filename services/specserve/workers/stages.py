"""A target served as a pipeline of stage actors (for targets larger than one node).

Each `TargetStageActor` holds a contiguous slice of the decoder layers (the first also the embedding, the last
also the final norm and the head) and a KV arena over those layers only. The TargetWorker in front keeps the
sequences as a single worker does: a `StagedPool` allocates their blocks, caches prefixes and batches sessions
into steps (`scheduler.steps`), but holds no layers. Each step is described once (moves since the last step,
each sequence's block and length, the new tokens, the logits to keep) and sent to stage 0; each stage's output
ObjectRef goes straight to the next stage, so hidden states pass stage to stage through Ray's object store (node
to node on a real cluster) and only the last stage's logits come back. Every stage replays the same block moves,
so all arenas hold the same rows.
"""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace
from typing import Any

import ray
import torch

from specserve.models import load_model
from specserve.models.families.lean import unsupported_reason
from specserve.models.memory.pool import KVPool
from specserve.scheduler.threads import torch_threads
from specserve.workers.quiet import data_plane_priority

log = logging.getLogger("specserve.workers")


class TargetStageActor:
    """Layers [start, end) of the target and their KV arena (see the module docstring).

    tensor_parallel: the stage's layers split over that many ranks on its node (`workers.ranks`): this actor is
    rank 0, in bundle 0 of the stage's placement group, and starts the others (rank_options) in the rest; each
    step it takes, they take too."""

    def __init__(self, target: Any, dtype: str | None, quantization: str, start: int, end: int,
                 kv_cache_tokens: int, threads: int | None = None, tensor_parallel: int = 1,
                 rank_options: dict | None = None):
        data_plane_priority()  # a stage is on the request path (`workers.quiet`)
        threads = threads or os.cpu_count() or 1
        torch_threads(threads)
        self.start, self.end = start, end
        layers, tp = (start, end), None
        # from safetensors a dense stage (rank) reads only its layers (slices): `models.formats.slices`
        if tensor_parallel > 1:
            from specserve.workers.ranks import start_group

            loaded, tp, self._followers, self._store = start_group(
                target, dtype, quantization, tensor_parallel, kv_cache_tokens, threads, rank_options or {},
                self._rank_lost, layers)
        else:
            loaded = load_model(target, dtype, quantization=quantization, layers=layers)
        problem = unsupported_reason(loaded.model)
        if problem is not None:
            raise ValueError(f"target_stages: the staged forward runs the families of docs/serving.md's table, not this one ({problem})")
        self.pool = KVPool(loaded.model, kv_cache_tokens, tp=tp, layers=layers)  # the rest of the model is freed

    def _rank_lost(self, error: BaseException) -> None:
        """A rank of this stage's group is gone: the stage ends (its sessions fail; see docs/serving.md)."""
        log.error("stage [%d, %d): tensor-parallel rank lost (%s)", self.start, self.end, error)
        os._exit(1)

    def step(self, moves: list, blocks: list, starts: list[int], new_tokens: list[list[int]], keeps: list[int],
             hidden: torch.Tensor | None = None) -> torch.Tensor:
        """One step over this stage's layers: the next stage's input (hidden states, in the compute dtype), or,
        from the last stage, the logits kept."""
        return self.pool.run_step(moves, blocks, starts, new_tokens, keeps, hidden).cpu()

    def geometry(self) -> dict[str, Any]:
        """What the front's pool must match (positions, longest sequence), and what this stage's arena costs (all
        its ranks')."""
        pool = self.pool
        world = pool.tp.world if pool.tp is not None else 1
        return {"capacity": pool.capacity, "max_length": pool.max_length, "layers": [self.start, self.end],
                "bytes_per_token": pool.bytes_per_token * world, "kv_dtype": pool.kv_dtype,
                "tensor_parallel": world}

    def tp_stats(self) -> dict[str, Any]:
        """The stage group's collectives so far (`models.kernels.tp.Collective.stats`); {} without tensor parallelism."""
        return self.pool.tp.stats() if self.pool.tp is not None else {}

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def layers(self) -> tuple[int, int]:
        return self.start, self.end


class StagedPool(KVPool):
    """The sequences of a target whose layers live in stage actors: a `KVPool`'s allocator, prefix cache and
    batching, each step run by the stages (see the module docstring). `config`: the target's HF config."""

    concurrent_forwards = False  # one compute lane only (`StepScheduler.lanes`)

    def __init__(self, stages: list, config, tokens: int, prefix_caching: bool = False, share_running: bool = False):
        self.tp, self.runner, self.k, self.v = None, None, None, None
        self.stages = stages
        self.w = SimpleNamespace(token_subset=None)  # what a `PooledSequence` asks of its pool's weights
        self._keep_sequences(config, tokens, None, 32, prefix_caching, share_running)
        self.geometry = ray.get([stage.geometry.remote() for stage in stages])
        for g in self.geometry:
            if (g["capacity"], g["max_length"]) != (self.capacity, self.max_length):
                raise ValueError(f"stage of layers {g['layers']} holds {g['capacity']} positions of at most "
                                 f"{g['max_length']} a sequence, the target worker {self.capacity} of "
                                 f"{self.max_length}: every stage must size its arena alike (kv_cache_tokens)")

    @property
    def replays_moves(self) -> bool:
        return True

    def _move(self, old: int, new: int, held: int) -> None:
        pass  # the rows are the stages': each replays the move before its next step

    def _compute(self, seqs, new_tokens: list[list[int]], keeps: list[int]) -> torch.Tensor:
        step = (self._take_moves(), [seq.block for seq in seqs], [len(seq.tokens) for seq in seqs], new_tokens,
                keeps)
        out = None
        for stage in self.stages:
            out = stage.step.remote(*step, out)  # an ObjectRef handed to the next stage
        return ray.get(out)

    @property
    def bytes_per_token(self) -> int:
        return sum(g["bytes_per_token"] for g in self.geometry)

    @property
    def kv_dtype(self) -> str:
        return self.geometry[0]["kv_dtype"]


def stage_bounds(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Contiguous, near-equal layer ranges."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"target_stages: at most one stage per layer ({num_layers}), got {num_stages}")
    edges = [round(i * num_layers / num_stages) for i in range(num_stages + 1)]
    return list(zip(edges[:-1], edges[1:]))


def start_stages(target: Any, dtype: str | None, quantization: str, stage_resources: list, num_layers: int,
                 kv_cache_tokens: int) -> tuple[list, list]:
    """One stage actor per entry of `stage_resources` (RoleResources), layers split evenly, in order; a stage with
    tensor_parallel in a placement group of its own, packed on one node. Returns (actors, placement groups)."""
    from specserve.workers.launch import _rank_group

    actors, groups = [], []
    for i, ((start, end), resources) in enumerate(zip(stage_bounds(num_layers, len(stage_resources)),
                                                       stage_resources)):
        options = resources.actor_options()
        if resources.tensor_parallel > 1:
            strategy = _rank_group(resources, field=f"target_stages[{i}].tensor_parallel")
            groups.append(strategy.placement_group)
            options.pop("accelerator_type", None)  # the bundle carries it
            options["scheduling_strategy"] = strategy
        cls = ray.remote(TargetStageActor).options(**options)
        actors.append(cls.remote(target, dtype, quantization, start, end, kv_cache_tokens, resources.threads(),
                                 resources.tensor_parallel, resources.actor_options()))
    return actors, groups
