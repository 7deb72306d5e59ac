"""DraftWorker and TargetWorker as Ray actors serving the internal gRPC services.

Each actor loads its model once, starts a gRPC server on a free port of its
node and reports the address to whoever created it. Ray decides placement
(resources from `WorkersConfig`) and restarts; the per-round traffic goes
over gRPC, never through Ray calls. The classes also run as plain objects
without Ray (serving on 127.0.0.1): the data-plane bench (`bench.dataplane`)
times them that way on machines that have no Ray. The model and scheduling code is imported by the actors'
own processes (in their methods), not by the processes that only start them (`workers.launch`).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from concurrent import futures
from typing import TYPE_CHECKING, Any

import grpc

from specserve.engine import calibration
from specserve.rpc.auth import server_interceptors
from specserve.scheduler.threads import one_thread_torch
from specserve.v1 import workers_pb2_grpc
from specserve.workers.config import DEFAULT_KV_TOKENS
from specserve.workers.launch import _node_ip, describe_model
from specserve.workers.quiet import data_plane_priority

if TYPE_CHECKING:
    from specserve.scheduler.steps import StepScheduler

log = logging.getLogger("specserve.workers")


class _GrpcActor:
    def _compute_thread(self, threads: int | None) -> StepScheduler:
        """The actor's one torch thread, started first so the model is loaded on it too (`one_thread_torch`)."""
        from specserve.scheduler.steps import StepScheduler

        data_plane_priority()  # before any thread starts: they inherit it (`workers.quiet`)
        one_thread_torch()  # the actor's own thread
        self.compute = StepScheduler(threads=threads or os.cpu_count() or 1)
        return self.compute

    def _start(self, servicer, add, session_idle_s: float = 300.0, token: str | None = None) -> None:
        """Serve `servicer` on a free port of this node's address (not every interface); with `token`, only to
        callers that send it (`rpc.auth`)."""
        self.servicer = servicer
        # each in-flight call holds a thread while it waits for its step: room for every session
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=512, initializer=one_thread_torch),
                                  interceptors=server_interceptors(token))
        add(servicer, self.server)
        self.host = _node_ip()
        self.port = self.server.add_insecure_port(f"{self.host}:0")
        self.server.start()
        self._stopped = threading.Event()
        threading.Thread(target=self._reap, args=(session_idle_s,), name="specserve-reaper", daemon=True).start()

    def _reap(self, idle_s: float) -> None:
        """Release sessions a dead coordinator left behind (no call for idle_s), checking every idle_s / 4."""
        while not self._stopped.wait(min(30.0, idle_s / 4)):
            try:
                dropped = self.servicer.on_compute_thread(self.servicer.sessions.reap, idle_s)
            except Exception:  # noqa: BLE001 - the compute thread is closing
                return
            if dropped:
                log.warning("released %d session(s) idle for over %.0f s", dropped, idle_s)

    def _export_pools(self, model: str, pools: dict[str, Any]) -> None:
        """Publish the prefix caches' counters to Prometheus every 5 s (`coordinator.metrics.PoolMetrics`; inside
        Ray only: the data-plane bench runs these classes where Ray is not installed)."""
        try:
            import ray
        except ImportError:
            return
        pools = {role: pool for role, pool in pools.items() if pool is not None and pool.prefix is not None}
        if not pools or not ray.is_initialized():
            return
        from specserve.coordinator.metrics import PoolMetrics

        metrics = PoolMetrics(model)

        def publish() -> None:
            while not self._stopped.wait(5.0):
                for role, pool in pools.items():
                    metrics.publish(role, pool.describe())

        threading.Thread(target=publish, name="specserve-pool-metrics", daemon=True).start()

    def _warm_up(self, role: str, pool, widths) -> dict | None:
        """Compile (where steps are compiled) and capture every step shape of `pool` on the compute thread before
        this worker reports ready, so that no request waits for a compile; progress on stdout (the driver's)."""
        if pool is None or pool.runner is None:
            return None

        def say(line: str) -> None:
            print(f"[specserve] {role} steps: {line}", flush=True)

        if pool.runner.compile_mode:
            say(f"compiling every step shape before serving ({pool.runner.compile_mode}; caches in "
                f"{os.environ.get('TORCHINDUCTOR_CACHE_DIR', '?')})")
        done = self.compute.call(pool.warm_up, widths, say).result()
        say(f"{done['steps']} shapes ready in {done['seconds']:.1f} s"
            + (" (compile cache loaded)" if done["cache_loaded"] else ""))
        return done

    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def gpu_ids(self) -> list:
        """The GPUs Ray reserved for this worker (none on the CPU)."""
        import ray

        return list(ray.get_runtime_context().get_accelerator_ids().get("GPU", []))

    def active_sessions(self) -> int:
        return len(self.servicer.sessions)

    def pid(self) -> int:
        return os.getpid()

    def stop(self, grace: float = 1.0) -> None:
        self._stopped.set()
        self.server.stop(grace).wait()


class DraftWorkerActor(_GrpcActor):
    def __init__(self, draft: Any, vocab: int, dtype: str | None = None, top_k_q: int = 64, threads: int | None = None,
                 kv_cache_tokens: int = 65536, session_idle_s: float = 300.0, token: str | None = None,
                 quantization: str = "auto", prefix_caching: bool = True, served_name: str | None = None):
        from specserve.engine.proposers import NgramProposer
        from specserve.models.formats.loading import load_draft
        from specserve.rpc.servicers import DraftWorkerServicer
        from specserve.scheduler.colocated import ScheduledDraft

        compute = self._compute_thread(threads)
        if draft == "ngram":
            new_proposer = lambda: NgramProposer(vocab)  # noqa: E731
            self.free = True
        else:
            loaded = compute.call(load_draft, draft, dtype, None, quantization).result()
            if loaded.vocab_size != vocab:
                raise ValueError(f"draft vocab size {loaded.vocab_size} != target vocab size {vocab}")
            scheduled = ScheduledDraft(compute, loaded.model, vocab, top_k_q, loaded.name, kv_cache_tokens,
                                       prefix_caching=prefix_caching)
            self._warm_up("draft", scheduled.pool, None)
            new_proposer = scheduled.proposer
            self.free = False
        self.vocab = vocab
        self._start(DraftWorkerServicer(new_proposer, vocab, threads, compute, scheduled=not self.free),
                    workers_pb2_grpc.add_DraftWorkerServicer_to_server, session_idle_s, token)
        if not self.free:
            self._export_pools(served_name or loaded.name, {"draft": scheduled.pool})

    def is_free(self) -> bool:
        return self.free

    def step_time(self) -> float:
        """Seconds per drafted token (0 for a free draft), as the worker drafts (its batched draft steps)."""
        from specserve.engine.profile import draft_step_time

        if self.free:
            return 0.0
        return self.servicer.on_compute_thread(draft_step_time, self.servicer.new_engine(), self.vocab)


class TargetWorkerActor(_GrpcActor):
    """The target: loads the model and shards it over its GPUs, or fronts a pipeline of stage actors."""

    def __init__(self, target: Any, dtype: str | None = None, threads: int | None = None, stages: list | None = None,
                 scheduling: dict | None = None, draft: Any = None, gamma_max: int = 8, draft_top_k: int = 0,
                 session_idle_s: float = 300.0, token: str | None = None, quantization: str = "auto",
                 draft_quantization: str = "auto", tensor_parallel: int = 1, rank_options: dict | None = None,
                 served_name: str | None = None):
        """scheduling: TargetWorkerServicer's batching / kv_cache_tokens / kv_wait_s / max_step_tokens /
        prefill_chunk / prefix_caching.
        draft: a model draft to hold here too (colocated: whole sessions run in this worker).
        tensor_parallel: ranks the target is split over, this worker rank 0 (`workers.ranks`; the others are
        actors with rank_options, started here).
        served_name: the model id its metrics carry (default: the target's name)."""
        import torch

        from specserve.models.drafts.eagle3 import is_eagle3, load_eagle3, spec_aux_layers
        from specserve.models.drafts.head import is_head, load_head
        from specserve.models.formats.loading import load_draft, load_model, model_config
        from specserve.rpc.servicers import TargetWorkerServicer

        self._token = token
        self._profile: dict[int, float] = {}
        self._followers: list = []  # tensor-parallel ranks 1.. (`workers.ranks`)
        compute = self._compute_thread(threads)
        tp = None
        if tensor_parallel > 1:
            from specserve.workers.ranks import start_group

            kv_tokens = (scheduling or {}).get("kv_cache_tokens") or DEFAULT_KV_TOKENS
            loaded, tp, self._followers, self._store = start_group(
                target, dtype, quantization, tensor_parallel, kv_tokens, threads or os.cpu_count() or 1,
                rank_options or {}, self._rank_lost, run=lambda f, *args: compute.call(f, *args).result())
        staged = None
        if stages:
            from specserve.workers.stages import StagedPool

            self.stages = stages
            self._info = describe_model(target)
            self._info["stages"] = len(stages)
            sched = scheduling or {}
            # every attach and forward of this pool runs on the compute thread: new sessions may copy running ones
            staged = compute.call(StagedPool, stages, model_config(target),
                                  sched.get("kv_cache_tokens") or DEFAULT_KV_TOKENS,
                                  sched.get("prefix_caching", True), True).result()
            new_sequence = model = None
        else:
            if tp is None:
                # A target that owns several GPUs shards its layers over them (accelerate device_map).
                device_map = "auto" if torch.cuda.device_count() > 1 else None
                loaded = compute.call(load_model, target, dtype, None, device_map, quantization).result()
            self._info = {
                "vocab": loaded.vocab_size, "eos_ids": sorted(loaded.eos_ids), "max_positions": loaded.max_positions,
                "name": loaded.name, "dtype": str(loaded.dtype).removeprefix("torch."), "device": str(loaded.device),
                "stages": 1, "quantization": loaded.quantization, "tensor_parallel": tensor_parallel,
            }
            new_sequence, model = None, loaded.model
        self.model = model
        self.vocab = self._info["vocab"]
        scheduling = dict(scheduling or {})
        fraction = scheduling.pop("kv_memory_fraction", None)
        if scheduling.get("kv_cache_tokens") is None:
            if model is None or tp is not None:
                scheduling["kv_cache_tokens"] = DEFAULT_KV_TOKENS
            else:
                scheduling["kv_cache_tokens"], how = _kv_size(model, draft, fraction)
                self._info["kv_pool"] = how
                print(f"specserve: KV pools: {how}", file=sys.stderr, flush=True)
        self._info["kv_cache_tokens"] = scheduling["kv_cache_tokens"]
        head = draft is not None and is_head(draft)
        eagle = draft is not None and not head and is_eagle3(draft)
        # a head reads the target's final features; an EAGLE-3 head the hidden states entering three of its layers
        features = spec_aux_layers(draft, model.config.num_hidden_layers) if eagle and model is not None else head
        self._start(
            TargetWorkerServicer(model, self.vocab, threads, new_sequence, scheduler=compute, tp=tp, pool=staged,
                                 features=features, **scheduling),
            workers_pb2_grpc.add_TargetWorkerServicer_to_server, session_idle_s, token,
        )
        if model is not None:
            say_path(self._info["name"], model, scheduling.get("batching", True))
        self._info["warm_up"] = self._warm_up("target", self.servicer.pool, range(1, gamma_max + 2))
        if draft is not None:
            if stages:
                raise ValueError("a colocated draft needs the whole target in one worker (not target_stages)")
            if head:  # a feature head: one layer beside the target, reading its pool's features
                model, name = (compute.call(load_head, draft, loaded, draft_quantization).result(),
                               str(draft).removeprefix("head:"))
            elif eagle:  # the same, reading the layers' hidden states the pool keeps for it
                model, name = compute.call(load_eagle3, draft, loaded).result(), str(draft).removeprefix("eagle3:")
            else:
                drafted = compute.call(load_draft, draft, dtype, str(loaded.device), draft_quantization).result()
                if drafted.vocab_size != self.vocab:
                    raise ValueError(f"draft vocab size {drafted.vocab_size} != target vocab size {self.vocab}")
                model, name = drafted.model, drafted.name
            say_path(name, model, True, "eagle3" if eagle else "head" if head else None)
            self.servicer.attach_draft(model, loaded.eos_ids, gamma_max, name, draft_top_k)
            self._info["draft_warm_up"] = self._warm_up("draft", self._draft_pool(), None)
            loaded_as = {"dtype": self._info["dtype"], "device": self._info["device"], "draft": name,
                         "quantization": self._info["quantization"], "draft_quantization": draft_quantization,
                         "gamma_max": gamma_max, "draft_top_k": draft_top_k}
            self.servicer.colocated.calibration = calibration.identity(target, draft, loaded_as, compute.threads)
            verify, step = self.servicer.colocated.cost_profile()  # calibrate `auto` now, not in the first request
            self._info["auto_costs"] = {"verify_ms": {str(n): 1000 * t for n, t in sorted((verify or {}).items())},
                                        "draft_token_ms": 1000 * step if step is not None else None}
            self._info["colocated_draft"] = name
        self._export_pools(served_name or self._info.get("name", "target"),
                           {"target": self.servicer.pool, "draft": self._draft_pool()})

    def worker_token(self) -> str | None:
        """The secret its gRPC service demands (for the replica that adopts a prestarted worker: `adopt_target`)."""
        return self._token

    def _draft_pool(self):
        colocated = self.servicer.colocated
        return colocated.draft.pool if colocated is not None else None

    def rank_gpu_ids(self) -> list[list]:
        """The GPUs Ray reserved for each tensor-parallel rank, this worker's first."""
        import ray

        return [self.gpu_ids(), *ray.get([f.gpu_ids.remote() for f in self._followers])]

    def rank_pids(self) -> list[int]:
        """The process ids of tensor-parallel ranks 1.. (none without tensor parallelism)."""
        import ray

        return ray.get([f.pid.remote() for f in self._followers])

    def _rank_lost(self, error: BaseException) -> None:
        """A follower rank is gone: end this process, so Ray restarts the whole group (`workers.ranks`)."""
        log.error("tensor-parallel rank lost (%s); restarting the target's group", error)
        os._exit(1)

    def info(self) -> dict[str, Any]:
        pool, scheduler = self.servicer.pool, self.servicer.scheduler
        if pool is not None and pool.tp is not None:
            self._info.update(pool.tp.stats())
        steps = {"steps": scheduler.steps, "draft_steps": scheduler.draft_steps,
                 # how many sessions shared each target (draft) step so far: {sessions: steps}
                 "sessions_per_step": dict(sorted(scheduler.sessions_per_step.items())),
                 "lane_steps": dict(sorted(scheduler.lane_steps.items())),  # target steps per compute lane
                 "sessions_per_draft_step": dict(sorted(scheduler.sessions_per_draft_step.items()))}
        draft = self._draft_pool()
        return {**self._info, "batching": pool is not None, **(pool.describe() if pool is not None else {}), **steps,
                **({"draft_kv": draft.describe()} if draft is not None else {})}

    def stop(self, grace: float = 1.0) -> None:
        super().stop(grace)
        pool = self.servicer.pool
        if pool is not None and pool.tp is not None:  # end the other ranks' loops
            self.servicer.on_compute_thread(pool.close)

    def verify_profile(self, max_positions: int) -> dict[int, float]:
        """Seconds per target forward over n = 1..max_positions new tokens (measured once, on the compute thread)."""
        from specserve.engine.profile import verify_profile

        if len(self._profile) < max_positions:
            sequence = self.servicer.new_sequence() if self.servicer.new_sequence is not None else None
            self._profile = self.servicer.on_compute_thread(verify_profile, self.model, self.vocab, max_positions, 64, 3, sequence)
        return {n: t for n, t in self._profile.items() if n <= max_positions}


def say_path(name: str, model, batched: bool, head: str | None = None) -> None:
    """A start-up line (stderr): which forward a loaded model takes in this worker, and why."""
    from specserve.models.families.arch import describe_path

    config = getattr(model, "config", None)
    if head == "head":
        path = (f"a feature head of {config.num_hidden_layers} layer(s) over {config.token_subset_size} tokens, its "
                "steps batched (a pool beside the target's)")
    elif head == "eagle3":
        path = "an EAGLE-3 head on the hidden states of three of the target's layers (its sessions' steps one at a time)"
    else:
        path = describe_path(config) if batched else "one session at a time (batching: false)"
    print(f"specserve: {name}: {path}", file=sys.stderr, flush=True)


def _kv_size(model, draft: Any, fraction: float | None) -> tuple[int, str]:
    """(positions, how sized) for the KV pools of a loaded target and the draft still to load beside it."""
    import torch

    from specserve.models.drafts.eagle3 import is_eagle3
    from specserve.models.drafts.head import is_head
    from specserve.models.formats.loading import model_config
    from specserve.models.memory.sizing import MOST_SESSIONS, bytes_per_position, kv_positions, weights_bytes

    param = next(model.parameters())
    dtype = param.dtype if param.dtype.is_floating_point else torch.bfloat16
    per, reserve = bytes_per_position(model.config, dtype), 0
    if draft is not None and not is_head(draft) and not is_eagle3(draft):  # a model draft: its pool, its weights
        try:
            per += bytes_per_position(model_config(draft), dtype)
        except Exception:  # noqa: BLE001 - a draft config not readable here: the load will say what is wrong
            pass
        reserve = weights_bytes(draft)
    context = getattr(model.config, "max_position_embeddings", None) or 4096
    return kv_positions(per, param.device, fraction, reserve, most=MOST_SESSIONS * context)
