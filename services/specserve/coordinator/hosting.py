"""Where the ingress's coordinator runs, and the one interface the ingress uses for either place.

A coordinator that drives the speculation loop itself (an n-gram or a
remote model draft, or plain decoding) is a Ray actor of its own: its
per-round Python work stays off the ingress's event loop, and Ray restarts
it on its own when its process dies. With a colocated draft the target
worker runs whole sessions and the coordinator only relays one gRPC stream
per session (one message per round). That relay runs inside the ingress
replica (`InReplicaCoordinator`): one process fewer on the request path and
on the machine (every idle Python Ray worker wakes often), and one Ray
streaming hop fewer per round (docs/benchmarks.md, served against in-process).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from typing import Any

from specserve.coordinator.core import Chunk, Coordinator, SessionRequest
from specserve.coordinator.drivers import ColocatedRelay, SplitDriver


class ActorCoordinator:
    """A coordinator Ray actor seen from the ingress. Its sessions' failures are raised as their causes
    (`Overloaded`, `ValueError`, `grpc.RpcError`, `WorkerLost`); a dead or restarting actor raises
    `ray.exceptions.RayActorError` (`restartable`: the ingress resumes the request on its replacement)."""

    restartable = True

    def __init__(self, actor: Any):
        self.actor = actor

    async def chunks(self, request: SessionRequest) -> AsyncIterator[Chunk]:
        import ray

        async for ref in self.actor.generate.options(num_returns="streaming").remote(request):
            try:
                chunk = await ref
            except ray.exceptions.RayTaskError as exc:
                raise (exc.cause if exc.cause is not None else exc) from None
            yield chunk

    def cancel(self, request_id: str, reason: str = "cancelled") -> None:
        self.actor.cancel.remote(request_id, reason)

    async def describe(self) -> dict[str, Any]:
        return await self.actor.describe.remote()

    async def active_sessions(self) -> int:
        return await self.actor.active_sessions.remote()

    async def pid(self) -> int:
        return await self.actor.pid.remote()


class InReplicaCoordinator:
    """A `Coordinator` in the ingress's own process (the colocated relay). It lives and dies with the replica, as
    the workers the replica starts do: there is nothing of its own to restart (`restartable` False)."""

    restartable = False

    def __init__(self, coordinator: Coordinator):
        self.coordinator = coordinator

    def chunks(self, request: SessionRequest) -> AsyncIterator[Chunk]:
        return self.coordinator.generate(request)

    def cancel(self, request_id: str, reason: str = "cancelled") -> None:
        self.coordinator.cancel(request_id, reason)

    async def describe(self) -> dict[str, Any]:
        return self.coordinator.describe()

    async def active_sessions(self) -> int:
        return self.coordinator.active_sessions()

    async def pid(self) -> int:
        return os.getpid()


class CoordinatorActor(Coordinator):
    """A `Coordinator` as a Ray actor, its driver built in the actor's own process (gRPC channels do not
    travel): `driver_args` and `driver_kwargs` are `SplitDriver`'s."""

    def __init__(self, driver_args: tuple, driver_kwargs: dict[str, Any], **options):
        super().__init__(SplitDriver(*driver_args, **driver_kwargs), **options)


def start_coordinator(config, target_actor, draft_actor=None, *, gamma="auto", gamma_max: int = 8, pipelined=True,
                      max_sessions: int = 64, draft_lookup: bool = True, worker_token: str | None = None):
    """The coordinator for started workers, calibrating the γ cost model on them: an `InReplicaCoordinator` in
    this process for a colocated draft, else an `ActorCoordinator` (Ray restarts that actor too,
    `config.max_restarts`). Either follows the workers through restarts. worker_token: the workers' shared
    secret (`start_workers`)."""
    import ray

    info = ray.get(target_actor.info.remote())
    target_address = ray.get(target_actor.address.remote())
    options = dict(max_sessions=max_sessions, model_name=getattr(config, "model_name", None) or info["name"],
                   export_metrics=True, restart_timeout_s=getattr(config, "restart_timeout_s", 120.0),
                   max_queued=getattr(config, "max_queued", 256), queue_timeout_s=getattr(config, "queue_timeout_s", 300.0),
                   stream_interval_s=config.stream_interval_ms / 1000,
                   stream_chunks_per_s=getattr(config, "stream_chunks_per_s", None))
    if info.get("colocated_draft"):  # the worker runs whole sessions and calibrates itself
        relay = ColocatedRelay(target_address, gamma=gamma, gamma_max=gamma_max, lookup=draft_lookup,
                               target_actor=target_actor, worker_token=worker_token)
        return InReplicaCoordinator(Coordinator(relay, **options))
    draft_mode, draft_address, free, step = "none", None, False, None
    if draft_actor is not None:
        draft_mode = "remote"
        draft_address, free, step = ray.get(
            [draft_actor.address.remote(), draft_actor.is_free.remote(), draft_actor.step_time.remote()]
        )
    elif config.draft == "ngram":
        draft_mode, free = "ngram", True
    profile = None
    if gamma == "auto" and draft_mode != "none":
        profile = ray.get(target_actor.verify_profile.remote(gamma_max + 1))
    driver_kwargs = dict(
        draft=draft_mode, draft_address=draft_address, draft_free=free, draft_lookup=draft_lookup, gamma=gamma,
        gamma_max=gamma_max, pipelined=pipelined, verify_profile=profile, draft_step_s=step,
        target_actor=target_actor, draft_actor=draft_actor if draft_mode == "remote" else None,
        worker_token=worker_token,
    )
    concurrency = max(1000, 4 * (max_sessions + options["max_queued"]))  # waiting requests hold a call each
    actor = ray.remote(CoordinatorActor).options(num_cpus=0, max_concurrency=concurrency,
                                                 max_restarts=getattr(config, "max_restarts", 0))
    return ActorCoordinator(actor.remote((target_address, info["vocab"], info["eos_ids"]), driver_kwargs, **options))
