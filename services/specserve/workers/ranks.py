"""A tensor-parallel target as a group of Ray actors: rank 0 is the TargetWorker, ranks 1.. follow its steps.

`start_workers` asks Ray for a placement group of one bundle per rank, packed on one node (STRICT_PACK), and
puts the TargetWorker in bundle 0. The TargetWorker starts the other ranks in the other bundles (so they die
with it), serves a TCP store for them to meet at, and loads its own shard meanwhile. Each follower loads its
shard of the same model (`models.kernels.tp`), joins the group and runs `KVPool.follow` on its compute thread: every
step rank 0 takes, it takes too. Only rank 0 has a gRPC face, sessions and a scheduler.

A lost rank takes the group down: rank 0 exits as soon as it sees a follower gone (a collective fails, or the
watch below finds the actor dead), Ray restarts it as it restarts any worker, it starts a fresh group, and
the coordinator's sessions go on from their committed tokens (`coordinator.links`).

A pipeline stage (`workers.stages`) with `tensor_parallel` is such a group over its layers: the stage actor is
rank 0, and each step it passes on carries the stage before's hidden states too.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from specserve.models import load_model
from specserve.models.kernels.tp import Collective, Shard, check, connect
from specserve.models.memory.pool import KVPool
from specserve.scheduler.threads import torch_threads
from specserve.workers.quiet import data_plane_priority

log = logging.getLogger("specserve.workers")

WATCH_S = 2.0  # how often rank 0 checks that its followers live


class TargetRankActor:
    """Rank `shard.rank` > 0 of a tensor-parallel target (see the module docstring)."""

    def __init__(self, target: Any, dtype: str | None, quantization: str, shard: Shard, store_host: str,
                 store_port: int, kv_cache_tokens: int, threads: int, layers: tuple[int, int] | None = None):
        data_plane_priority()
        self.shard = shard
        self._failed: BaseException | None = None
        self._loaded = threading.Event()
        self._thread = threading.Thread(target=self._run, name="specserve-rank", daemon=True, args=(
            target, dtype, quantization, store_host, store_port, kv_cache_tokens, threads, layers))
        self._thread.start()

    def _run(self, target, dtype, quantization, host, port, kv_cache_tokens, threads, layers) -> None:
        import torch.distributed as dist

        torch_threads(threads)  # this thread is the rank's compute thread: its forwards use these cores
        try:
            model = load_model(target, dtype, None, None, quantization, self.shard, layers).model
        except BaseException as exc:  # noqa: BLE001 - reported through `ready`
            self._failed = exc
            return
        finally:
            self._loaded.set()
        store = dist.TCPStore(host, port, self.shard.world, is_master=False)
        pool = KVPool(model, kv_cache_tokens, tp=connect(self.shard, store, next(model.parameters()).device),
                      layers=layers)
        try:
            pool.follow()
        except BaseException as exc:  # noqa: BLE001 - rank 0 is gone or failed: this rank is done
            log.warning("tensor-parallel rank %d stops: %s", self.shard.rank, exc)
            os._exit(1)
        os._exit(0)  # rank 0 closed the group

    def ready(self) -> int:
        """Block until this rank's model is loaded; raises what loading raised. Returns its rank."""
        self._loaded.wait()
        if self._failed is not None:
            raise self._failed
        return self.shard.rank

    def ping(self) -> int:
        return self.shard.rank

    def gpu_ids(self) -> list:
        """The GPUs Ray reserved for this rank (none on the CPU)."""
        import ray

        return list(ray.get_runtime_context().get_accelerator_ids().get("GPU", []))

    def pid(self) -> int:
        return os.getpid()


def start_followers(target: Any, dtype: str | None, quantization: str, world: int, kv_cache_tokens: int,
                    threads: int, rank_options: dict[str, Any], layers: tuple[int, int] | None = None
                    ) -> tuple[list, Any]:
    """From rank 0, inside its placement group: the store the ranks meet at and actors for ranks 1..world-1,
    each in its own bundle, loading their shards (call `join` next). layers: a pipeline stage's (start, end)."""
    import ray
    import torch.distributed as dist
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from specserve.workers.launch import _node_ip

    host = _node_ip()
    store = dist.TCPStore(host, 0, world, is_master=True, wait_for_workers=False)
    group = ray.util.get_current_placement_group()
    followers = []
    for rank in range(1, world):
        options = dict(rank_options)
        if group is not None:
            options.pop("accelerator_type", None)  # the bundle carries it
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(group, rank)
        followers.append(ray.remote(TargetRankActor).options(max_restarts=0, **options).remote(
            target, dtype, quantization, Shard(rank, world), host, store.port, kv_cache_tokens, threads, layers))
    return followers, store


def start_group(target: Any, dtype: str | None, quantization: str, world: int, kv_cache_tokens: int, threads: int,
                rank_options: dict[str, Any], on_lost, layers: tuple[int, int] | None = None, run=None
                ) -> tuple[Any, Collective, list, Any]:
    """From rank 0, inside its placement group: ranks 1.. started, rank 0's own shard loaded meanwhile (through
    `run(load_model, ...)`: on its compute thread), the group formed and watched (on_lost(error) once a rank is
    gone). Returns (rank 0's LoadedModel, its Collective, the follower actors, the store: keep it while the group
    lives)."""
    followers, store = start_followers(target, dtype, quantization, world, kv_cache_tokens, threads, rank_options,
                                       layers)
    run = run or (lambda f, *args: f(*args))
    loaded = run(load_model, target, dtype, None, None, quantization, Shard(0, world), layers)
    tp = join(followers, store, world, loaded.device)
    tp.lost = on_lost
    watch(followers, on_lost)
    return loaded, tp, followers, store


def join(followers: list, store, world: int, device) -> Collective:
    """Rank 0: wait for the followers' models (their load errors raise here), then form the group."""
    import ray

    ray.get([f.ready.remote() for f in followers])
    return connect(Shard(0, world), store, device)


def watch(followers: list, on_lost) -> threading.Thread:
    """Call on_lost(error) once a follower is found dead (checked every WATCH_S seconds); a daemon thread."""
    import ray

    def loop() -> None:
        while True:
            try:
                ray.get([f.ping.remote() for f in followers], timeout=max(30.0, 10 * WATCH_S))
            except Exception as exc:  # noqa: BLE001 - any failure to answer is a lost rank
                on_lost(exc)
                return
            time.sleep(WATCH_S)

    thread = threading.Thread(target=loop, name="specserve-rank-watch", daemon=True)
    thread.start()
    return thread


def check_model(spec: Any, world: int, field: str = "tensor_parallel") -> None:
    """The model `spec` names can be split over `world` ranks (ValueError naming `field` otherwise)."""
    from specserve.models.formats.loading import model_config

    try:
        check(model_config(spec), world)
    except ValueError as exc:
        raise ValueError(str(exc).replace("tensor_parallel", field, 1)) from None
