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

import os
from types import SimpleNamespace
from typing import Any

import ray
import torch

from specserve.models import load_model
from specserve.models.lean import unsupported_reason
from specserve.models.pool import KVPool
from specserve.scheduler.steps import torch_threads
from specserve.workers.quiet import data_plane_priority


class TargetStageActor:
    """Layers [start, end) of the target and their KV arena (see the module docstring)."""

    def __init__(self, target: Any, dtype: str | None, quantization: str, start: int, end: int,
                 kv_cache_tokens: int, threads: int | None = None):
        data_plane_priority()  # a stage is on the request path (`workers.quiet`)
        torch_threads(threads or os.cpu_count() or 1)
        # TODO(scale): read only this stage's tensors (as `models.slices` reads a rank's)
        loaded = load_model(target, dtype, quantization=quantization, layers=(start, end))
        problem = unsupported_reason(loaded.model)
        if problem is not None:
            raise ValueError(f"target_stages: the staged forward runs Llama-family models, not this one ({problem})")
        self.start, self.end = start, end
        self.pool = KVPool(loaded.model, kv_cache_tokens, layers=(start, end))  # the rest of the model is freed

    def step(self, moves: list, blocks: list, starts: list[int], new_tokens: list[list[int]], keeps: list[int],
             hidden: torch.Tensor | None = None) -> torch.Tensor:
        """One step over this stage's layers: the next stage's input (hidden states, in the compute dtype), or,
        from the last stage, the logits kept."""
        return self.pool.run_step(moves, blocks, starts, new_tokens, keeps, hidden).cpu()

    def geometry(self) -> dict[str, Any]:
        """What the front's pool must match (positions, longest sequence), and what this stage's arena costs."""
        pool = self.pool
        return {"capacity": pool.capacity, "max_length": pool.max_length, "bytes_per_token": pool.bytes_per_token,
                "kv_dtype": pool.kv_dtype, "layers": [self.start, self.end]}

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def layers(self) -> tuple[int, int]:
        return self.start, self.end


class StagedPool(KVPool):
    """The sequences of a target whose layers live in stage actors: a `KVPool`'s allocator, prefix cache and
    batching, each step run by the stages (see the module docstring). `config`: the target's HF config."""

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
                 kv_cache_tokens: int) -> list:
    """One stage actor per entry of `stage_resources` (RoleResources), layers split evenly, in order."""
    actors = []
    for (start, end), resources in zip(stage_bounds(num_layers, len(stage_resources)), stage_resources):
        cls = ray.remote(TargetStageActor).options(**resources.actor_options())
        actors.append(cls.remote(target, dtype, quantization, start, end, kv_cache_tokens, resources.threads()))
    return actors
