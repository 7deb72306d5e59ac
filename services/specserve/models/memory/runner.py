"""A step runner with static shapes over a `KVPool`: decode and verify steps without per-step shape changes.

A decode step feeds every sequence 1 new token, a verify step γ+1; each sequence attends over its own block
of the pool's arena. `StepRunner` runs such a step (every sequence feeding the same number of new tokens)
through buffers preallocated per bucket (batch size, width, context length), so nothing about a step's
shapes changes between steps of a bucket:

- token ids, positions and the arena rows the new keys and values go to are copied into one static device
  tensor, in one copy; the step derives from them the arena rows each sequence attends over (its block, up to
  the bucket's context length) and the mask that says which of them it sees (its length and causality), so
  nothing of the context's size crosses from the host;
- padding rows (a batch of 3 in the bucket of 4, say) write their keys and values to a scratch row past the
  arena's blocks and see only that row, so they never touch a real session;
- attention is one padded call for the whole batch, as `lean._PaddedAttention` does for short blocks.

On CUDA each bucket is captured once as a CUDA graph (its first use) and replayed on every later step: an
eager forward there is bound by kernel launches, not by the GPU. On a CPU the same code runs eagerly, and its
results are those of `lean.lean_forward` (tested). Prefill chunks, mixed widths and shapes outside the
buckets run eagerly through `lean.lean_forward`, as before.

Compiled steps: `torch.compile` of each bucket's step before it is captured fuses the norms, rotary and
elementwise ops that a replayed graph still runs as ~20 small kernels per layer (measured on an H200:
docs/benchmarks.md). `SPECSERVE_COMPILE_STEPS=1`: one graph per (batch, width), the context length a symbol
in it; `dynamic`: the batch and the width symbols too, four graphs where there were 81 (a batch or width of 1
keeps its own: compilers specialise a size of 1); `auto` (the default): `dynamic` where steps are captured as
CUDA graphs, else none; `0`: none. A graph compiles for tens of seconds on a GPU, so a serving worker
compiles every shape it can meet before it reports ready (`StepRunner.warm_up`), and the compilers' caches
persist under `$SPECSERVE_CACHE/compile/<cpu isa>` (`compile_caches`): a second start of the same model on the same
machine reads them instead of compiling.
"""

from __future__ import annotations

import bisect
import hashlib
import os
import pathlib
import time
from collections.abc import Callable, Sequence

import torch

from specserve.models.families.lean import (
    LeanWeights,
    embed,
    head_logits,
    layer_output,
    norm,
    rope_tables,
    rotated_qkv,
    sdpa,
)
from specserve.models.kernels.cpu import cache_root

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)
MIN_CONTEXT = 64  # the shortest context bucket; others double up to the pool's longest sequence
# SPECSERVE_COMPILE_STEPS → StepRunner(compile=); "auto": "dynamic" where the runner captures CUDA graphs
COMPILE_MODES = {"0": False, "1": True, "dynamic": "dynamic", "auto": "auto"}
_COMPILE_ENV = os.environ.get("SPECSERVE_COMPILE_STEPS", "auto")
if _COMPILE_ENV not in COMPILE_MODES:
    raise ValueError(f"SPECSERVE_COMPILE_STEPS must be one of {sorted(COMPILE_MODES)}, got {_COMPILE_ENV!r}")
COMPILE_STEPS: bool | str = COMPILE_MODES[_COMPILE_ENV]


def compile_caches() -> pathlib.Path:
    """Where compiled steps persist: `$SPECSERVE_CACHE/compile/<compiled_isa()>` (inductor's graph and autotuning caches, Triton's
    kernels, and the mega-cache artifacts `StepRunner.warm_up` saves), set for this process's compilers unless
    their own variables say otherwise."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    root = cache_root() / "compile" / compiled_isa()
    # (inductor writes its default into the environment at its first use: that is not a user's choice)
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, os.path.abspath(default_cache_dir())):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor")
    os.environ.setdefault("TRITON_CACHE_DIR", str(root / "triton"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def compiled_isa() -> str:
    """The CPU vector ISA Inductor writes this process's kernels for: ATen's level (`ATEN_CPU_CAPABILITY` lowers it),
    AMX, `cpp.simdlen`. Its graph cache does not key them, and a graph written for 8-lane AVX2 vectors rebuilt
    under AVX-512 flags indexes out of bounds (an abort), so each ISA keeps its own caches."""
    import torch._inductor.config as inductor_config

    isa = torch.backends.cpu.get_cpu_capability().lower()
    if isa.startswith("avx512") and torch.cpu._is_amx_tile_supported():
        isa += "-amx"
    simdlen = inductor_config.cpp.simdlen
    return f"cpu-{isa}" + (f"-simd{simdlen}" if simdlen else "")


@torch.library.custom_op("specserve::store_rows", mutates_args=("arena",))
def store_rows(arena: torch.Tensor, layer: int, slots: torch.Tensor, values: torch.Tensor) -> None:
    """arena[layer][:, slots[r]] = values[r] (layer < 0: arena[slots[r]] = values[r]), in place. An opaque op to the
    compiler, so that Inductor neither copies the arena (a write to a view of an input) nor autotunes a kernel that
    writes it (which clones what a kernel mutates: the whole arena, for each config it times)."""
    if layer < 0:
        arena.index_copy_(0, slots, values.to(arena.dtype))
    else:
        arena[layer].index_copy_(1, slots, values.transpose(0, 1).to(arena.dtype))


@store_rows.register_fake
def _(arena, layer, slots, values) -> None:
    return None


def _graph_cache(counters) -> tuple[int, int]:
    """(hits, misses) of Inductor's compiled-graph cache so far in this process."""
    return counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]


class _Bucket:
    """The static inputs, output and (on CUDA) graph of one (batch, width, context) shape."""

    def __init__(self, w: LeanWeights, batch: int, width: int, context: int):
        dev = w.device
        self.batch, self.width, self.context = batch, width, context
        # per new token: its id, its position and the arena row its keys and values go to, filled in one copy
        self.inputs = torch.zeros(3, batch, width, dtype=torch.long, device=dev)
        self.ids = self.inputs[0]  # [batch, width]
        self.keys = torch.arange(context, device=dev)  # the context's key offsets (its length a graph's symbol)
        self.logits: torch.Tensor | None = None  # [batch · width, head rows], written by each run
        self.graph = None


class _Staging:
    """Host buffers for the steps' inputs. On CUDA, pinned buffers taken in turn (a copy from pageable memory
    waits for the stream's earlier work, which would hold the host at every step of a draft block), each reused
    once its last copy has left."""

    def __init__(self, device: torch.device, size: int, count: int = 4):
        pinned = device.type == "cuda"
        self.buffers = [torch.zeros(size, dtype=torch.long, pin_memory=True) for _ in range(count)] if pinned else []
        self.copied: list = [None] * len(self.buffers)  # the event after each buffer's last copy
        self.turn = 0

    def take(self, b: _Bucket) -> torch.Tensor:
        """A zeroed [3, batch, width] host buffer for bucket b's next inputs."""
        if not self.buffers:
            return torch.zeros(3, b.batch, b.width, dtype=torch.long)
        if self.copied[self.turn] is not None:
            self.copied[self.turn].synchronize()
        return self.buffers[self.turn][: 3 * b.batch * b.width].view(3, b.batch, b.width).zero_()

    def sent(self) -> None:
        """The buffer `take` gave is queued for its copy: mark it, and take the next one next time."""
        if self.buffers:
            event = self.copied[self.turn] = self.copied[self.turn] or torch.cuda.Event()
            event.record()
            self.turn = (self.turn + 1) % len(self.buffers)


class StepRunner:
    """Static-shape steps over `arena` (k, v: [layers, kv_heads, positions + 1, head_dim]; the last position is
    the scratch row). capture: record each bucket as a CUDA graph (default: on CUDA devices)."""

    def __init__(self, w: LeanWeights, arena: tuple[torch.Tensor, torch.Tensor], max_length: int, *,
                 max_width: int = 9, batch_buckets: Sequence[int] = BATCH_BUCKETS, capture: bool | None = None,
                 compile: bool | str | None = None, features: torch.Tensor | None = None):
        self.w = w
        self.k, self.v = arena
        self.features = features  # the pool's feature arena (`lean._lean_forward`), or None
        self.scratch = self.k.shape[2] - 1
        self.max_width = max_width
        self.batch_buckets = tuple(sorted(batch_buckets))
        self.contexts = []
        context = MIN_CONTEXT
        while context < max_length:
            self.contexts.append(context)
            context *= 2
        self.contexts.append(context)
        self.capture = w.device.type == "cuda" if capture is None else capture
        self._step = self._run
        compile = COMPILE_STEPS if compile is None else compile
        if compile == "auto":
            compile = "dynamic" if self.capture else False
        self.compile_mode = compile
        self._dynamic_batch = compile == "dynamic"
        if compile:
            import torch._dynamo

            compile_caches()

            # one compiled graph per (batch, width), static but for the context length: allow one per bucket pair
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
            # the pool's size a symbol too: a worker with another KV budget reuses the cached graphs
            for arena, dim in ((self.k, 2), (self.v, 2), (features, 0)):
                if arena is not None:
                    torch._dynamo.mark_dynamic(arena, dim)
            self._step = torch.compile(self._run, dynamic=False)
        self._compiled = self._step is not self._run
        self.buckets: dict[tuple[int, int, int], _Bucket] = {}
        self.replays = 0  # steps served from a captured graph
        self._staging = _Staging(w.device, 3 * self.batch_buckets[-1] * max_width)
        self._pool = None  # the CUDA graphs' shared memory pool

    def bucket_for(self, batch: int, width: int, longest: int) -> tuple[int, int, int] | None:
        """(batch, width, context) of the bucket a step fits, or None (run it eagerly). longest: the longest
        sequence after the step."""
        if width > self.max_width or batch > self.batch_buckets[-1] or longest > self.contexts[-1]:
            return None
        return (self.batch_buckets[bisect.bisect_left(self.batch_buckets, batch)], width,
                self.contexts[bisect.bisect_left(self.contexts, longest)])

    def _new_bucket(self, key: tuple[int, int, int]) -> _Bucket:
        bucket = _Bucket(self.w, *key)
        if self._compiled:  # the context length a symbol of the compiled step; `dynamic`: the batch and the width
            # too (a size of 1 is its own graph: compilers specialise it), so a warm-up compiles 4 graphs, not 81
            torch._dynamo.mark_dynamic(bucket.keys, 0)
            if self._dynamic_batch and bucket.batch > 1:
                torch._dynamo.mark_dynamic(bucket.inputs, 1)
            if self._dynamic_batch and bucket.width > 1:
                torch._dynamo.mark_dynamic(bucket.inputs, 2)
        return bucket

    @torch.inference_mode()
    def forward(self, key: tuple[int, int, int], blocks: list[int], starts: list[int],
                new_tokens: list[list[int]] | torch.Tensor, feature: torch.Tensor | None = None) -> torch.Tensor:
        """One step in bucket `key`: sequence j's new tokens go to arena rows blocks[j] + starts[j] + i. Returns
        the head's float32 logits of every new token, in order: [len(blocks) · width, head rows] (a view of the
        bucket's output, valid until its next step). new_tokens: lists, or a [len(blocks), width] device tensor
        (tokens sampled on the device, never read on the host)."""
        bucket = self.buckets.get(key)
        if bucket is None:
            bucket = self.buckets[key] = self._new_bucket(key)
        self._fill(bucket, blocks, starts, new_tokens)
        if feature is not None:  # a head runner's per-sequence input feature, device to device
            bucket.feature[: len(blocks)].copy_(feature)
        if not self.capture:
            return self._step_into(bucket)[: len(blocks) * bucket.width]
        if bucket.graph is None:
            self._record(bucket)
        else:
            bucket.graph.replay()
            self.replays += 1
        return bucket.logits[: len(blocks) * bucket.width]

    def warm_up(self, widths: Sequence[int] | None = None, progress: Callable[[str], None] | None = None
                ) -> dict:
        """Run one step of every (batch bucket, width) at the shortest context, so that every graph a served step
        can need is compiled (and captured) before the first request: a later context bucket captures without
        compiling (its length is a symbol). The compilers' caches are loaded first from and saved after to
        `compile_caches()`. The steps write only at arena row 0, which no sequence holds yet: call it before
        any. widths: the step widths to cover (default 1 .. max_width). Returns what it did."""
        widths = [w for w in (range(1, self.max_width + 1) if widths is None else widths) if w <= self.max_width]
        keys = [(batch, width, self.contexts[0]) for width in widths for batch in self.batch_buckets]
        artifacts = self._artifacts_path(widths) if self.compile_mode else None
        loaded, load_s = False, 0.0
        if artifacts is not None and artifacts.is_file():
            t0 = time.perf_counter()
            try:
                loaded = torch.compiler.load_cache_artifacts(artifacts.read_bytes()) is not None
            except Exception as exc:  # noqa: BLE001 - a stale or foreign cache only costs the compile it saved
                if progress:
                    progress(f"compile cache {artifacts.name} not loaded ({type(exc).__name__}: {exc})")
            load_s = time.perf_counter() - t0
            if progress:
                progress(f"compile cache {artifacts.name} ({artifacts.stat().st_size / 2**20:.0f} MiB) "
                         f"{'loaded' if loaded else 'not loaded'} in {load_s:.1f} s")
        from torch._dynamo.utils import counters

        started, first = time.perf_counter(), _graph_cache(counters)
        slow = 0
        for i, key in enumerate(keys):
            t0 = time.perf_counter()
            batch, width, _ = key
            before = _graph_cache(counters)
            self.forward(key, [0] * batch, [0] * batch, [[0] * width] * batch)
            seconds = time.perf_counter() - t0
            if seconds > 1.0:  # a compile (or the first capture): worth a line
                slow += 1
                if progress:
                    hits, misses = (now - was for now, was in zip(_graph_cache(counters), before))
                    progress(f"step {i + 1}/{len(keys)} (batch {batch}, width {width}): {seconds:.1f} s"
                             + (f" (compiled graphs from the cache: {hits}, compiled anew: {misses})"
                                if hits or misses else ""))
        if self.w.device.type == "cuda":
            torch.cuda.synchronize(self.w.device)
        total = time.perf_counter() - started
        if artifacts is not None and slow:  # something was compiled: keep it for the next start
            saved = torch.compiler.save_cache_artifacts()
            if saved is not None:
                tmp = artifacts.with_suffix(".tmp")
                tmp.write_bytes(saved[0])
                tmp.replace(artifacts)
        return {"steps": len(keys), "seconds": total, "compiled": bool(self.compile_mode), "slow_steps": slow,
                "cache_loaded": loaded, "cache_load_s": load_s, "cache": str(artifacts) if artifacts is not None else None,
                **dict(zip(("graphs_from_cache", "graphs_compiled"),
                           (now - was for now, was in zip(_graph_cache(counters), first))))}

    def _artifacts_path(self, widths: list[int]) -> pathlib.Path:
        """The mega-cache file of this runner's compiled steps: keyed by torch, the device, the model's shapes and
        dtype, the compile mode and the buckets."""
        w = self.w
        device = torch.cuda.get_device_name(w.device) if w.device.type == "cuda" else w.device.type
        shapes = [(type(t).__name__, tuple(getattr(t, "shape", ()))) for t in w.layers[0].weights()]
        key = repr((torch.__version__, device, str(w.dtype), repr(w.arch), w.heads, w.kv_heads, w.head_dim,
                    len(w.layers), shapes, (type(w.head).__name__, tuple(getattr(w.head, "shape", ()))), self.compile_mode,
                    self.batch_buckets, widths, self.features is not None))
        return compile_caches() / f"steps-{hashlib.sha256(key.encode()).hexdigest()[:16]}.bin"

    def _fill(self, b: _Bucket, blocks: list[int], starts: list[int], new_tokens: list[list[int]] | torch.Tensor
              ) -> None:
        """The step's inputs in one host-to-device copy (padding rows: position 0, the scratch row)."""
        n, width = len(blocks), b.width
        host = self._staging.take(b)
        positions = torch.tensor(starts, dtype=torch.long)[:, None] + torch.arange(width)
        host[1, :n] = positions
        host[2].fill_(self.scratch)
        host[2, :n] = torch.tensor(blocks, dtype=torch.long)[:, None] + positions
        if isinstance(new_tokens, torch.Tensor):  # already on the device: copied there, device to device
            b.inputs[1:].copy_(host[1:], non_blocking=True)
            b.ids[n:].zero_()
            b.ids[:n].copy_(new_tokens)
        else:
            host[0, :n] = torch.tensor(new_tokens, dtype=torch.long)
            b.inputs.copy_(host, non_blocking=True)
        self._staging.sent()

    def _run(self, b: _Bucket) -> torch.Tensor:
        """The step on the bucket's static tensors (no host values read: capturable)."""
        w = self.w
        h, kvh, d = w.heads, w.kv_heads, w.head_dim
        ids, positions, slots = b.inputs  # [batch, width] each (read from the tensor the symbols are marked on)
        batch, width = positions.shape  # from a shape: compiled, symbols where asked (`forward`)
        rows = batch * width
        ids = ids.reshape(rows)
        # sequence j attends over its block: rows base + t up to its last new token's (padding rows: the scratch)
        base = slots[:, :1] - positions[:, :1]
        key_rows = (base + b.keys).minimum(slots[:, -1:])  # [batch, context]
        seen = b.keys <= positions[..., None]  # key t seen by the token at position p iff t <= p
        masks = {}  # per sliding window (None: full attention): [batch, 1, queries per key/value head, context]
        for window in {layer.window for layer in w.layers}:
            sees = seen if window is None else seen & (b.keys > positions[..., None] - window)
            masks[window] = sees.repeat(1, h // kvh, 1)[:, None]
        new_slots = slots.reshape(rows)  # the arena row of each new token's keys and values
        x = self._inputs(b, ids)  # [rows, hidden]
        cs = rope_tables(w, positions.reshape(rows).float())
        for i, layer in enumerate(w.layers):
            q, k, v = rotated_qkv(w, layer, x, cs)
            store_rows(self.k, i, new_slots, k)
            store_rows(self.v, i, new_slots, v)
            k_layer, v_layer = self.k[i], self.v[i]  # [kvh, positions + 1, d]
            keys = k_layer[:, key_rows].transpose(0, 1)  # [B, kvh, L, d]
            values = v_layer[:, key_rows].transpose(0, 1)
            queries = q.view(batch, width, h, d).permute(0, 2, 1, 3).reshape(batch, kvh, h // kvh * width, d)
            att = sdpa(w, queries, keys, values, masks[layer.window])
            att = att.reshape(batch, h, width, d).permute(0, 2, 1, 3).reshape(rows, h * d)
            x = layer_output(w, layer, x, att)
        return self._outputs(x, new_slots)

    def _inputs(self, b: _Bucket, ids: torch.Tensor) -> torch.Tensor:
        """The first layer's input rows for the step's token ids (a head runner's: `models.drafts.head`)."""
        return embed(self.w, ids)

    def _outputs(self, x: torch.Tensor, new_slots: torch.Tensor) -> torch.Tensor:
        """The step's output rows from the last layer's: the head's logits (and each row's feature kept)."""
        w = self.w
        if self.features is None:
            return head_logits(w, x)
        x = norm(w, x, w.norm)
        store_rows(self.features, -1, new_slots, x)  # padding rows: the scratch row
        return head_logits(w, x, normed=True)

    def _step_into(self, b: _Bucket) -> torch.Tensor:
        """The step, its logits in the bucket's static output (set outside the compiled step: a compiled `if`
        on it would compile the step twice)."""
        out = self._step(b)
        if b.logits is None:
            b.logits = out
        else:
            b.logits.copy_(out)
        return b.logits

    def _record(self, b: _Bucket) -> None:
        """The bucket's first step, then its graph (`_capture`)."""
        b.graph = self._capture(lambda: self._step_into(b))  # compiled at its first run, when compiling

    def _capture(self, body: Callable[[], object], fallback: bool = False) -> torch.cuda.CUDAGraph | bool:
        """Run `body` eagerly on a side stream (real work: its writes and outputs stand), then capture it as a graph
        in the runner's memory pool; capturing records the kernels without running them. fallback: where the
        capture fails (an op that syncs with the host), say so and return False instead of raising."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            body()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                body()
        except RuntimeError as exc:
            if not fallback:
                raise
            print(f"[specserve] a step not captured as a CUDA graph ({exc}); it runs uncaptured", flush=True)
            torch.cuda.synchronize()
            return False
        self._pool = graph.pool()
        return graph
