"""A target served as a pipeline of stage actors (for targets larger than one node).

Each `TargetStageActor` holds a slice of the layers (`models.stages`) and
one KV cache per session over those layers. The TargetWorker in front of
them keeps the usual per-session token list; a verify forward sends the new
token ids to stage 0 and passes each stage's output ObjectRef straight to the
next stage, so hidden states go stage to stage through Ray's object store
(node to node on a real cluster) and only the last stage's logits come back.
Rollback is lazy: each forward carries the length of the prefix to keep.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import ray
import torch
from transformers import DynamicCache

from specserve.models import load_model
from specserve.models.kv import TokenSequence
from specserve.models.stages import PipelineStage
from specserve.scheduler.steps import torch_threads
from specserve.workers.quiet import data_plane_priority


class TargetStageActor:
    def __init__(self, target: Any, dtype: str | None, start: int, end: int, threads: int | None = None):
        data_plane_priority()  # a stage is on the request path (`workers.quiet`)
        torch_threads(threads or os.cpu_count() or 1)
        loaded = load_model(target, dtype, quantization="none")  # TODO(scale): read only this stage's tensors from the checkpoint
        self.stage = PipelineStage(loaded.model, start, end)
        self.device = next(self.stage.parameters()).device
        self.sessions: dict[str, DynamicCache] = {}

    def forward(self, session_id: str, base: int, x: torch.Tensor, keep: int = 1) -> torch.Tensor:
        """Crop the session's cache to `base` positions, run the new positions, return hidden states or logits."""
        cache = self.sessions.get(session_id)
        if cache is None:
            cache = self.sessions[session_id] = DynamicCache(config=self.stage.config)
        held = cache.get_seq_length()
        if base > held:
            raise ValueError(f"stage [{self.stage.start}, {self.stage.end}): asked to keep {base} positions, holds {held}")
        if base < held:
            cache.crop(-(held - base))
        out = self.stage(x.to(self.device), cache, keep)
        return out[0].float().cpu() if self.stage.last else out.cpu()

    def release(self, session_id: str) -> bool:
        return self.sessions.pop(session_id, None) is not None

    def active_sessions(self) -> int:
        return len(self.sessions)

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def layers(self) -> tuple[int, int]:
        return self.stage.start, self.stage.end


class StagedSequence(TokenSequence):
    """A `CachedSequence` whose layers live in stage actors; one pipeline pass per feed."""

    def __init__(self, stages: list):
        self.stages = stages
        self.session_id = uuid.uuid4().hex
        self.tokens: list[int] = []
        self.forward_calls = 0

    def rollback(self, length: int) -> None:
        del self.tokens[length:]  # the stages crop on the next forward (it carries the kept length)

    def feed(self, new_tokens: list[int], keep_logits: int = 1) -> torch.Tensor:
        base = len(self.tokens)
        x: Any = torch.tensor([new_tokens], dtype=torch.long)
        for stage in self.stages:
            x = stage.forward.remote(self.session_id, base, x, keep_logits)  # ObjectRef handed to the next stage
        logits = ray.get(x)
        self.forward_calls += 1
        self.tokens.extend(new_tokens)
        return logits[-keep_logits:]

    def release(self) -> None:
        ray.get([stage.release.remote(self.session_id) for stage in self.stages])
        self.tokens = []


def start_stages(target: Any, dtype: str | None, stage_resources: list, num_layers: int) -> list:
    """One stage actor per entry of `stage_resources` (RoleResources), layers split evenly, in order."""
    from specserve.models.stages import stage_bounds

    actors = []
    for (start, end), resources in zip(stage_bounds(num_layers, len(stage_resources)), stage_resources):
        cls = ray.remote(TargetStageActor).options(**resources.actor_options())
        actors.append(cls.remote(target, dtype, start, end, resources.threads()))
    return actors
