"""The data plane without Ray: worker processes serving gRPC and a coordinator, timed on synthetic Llama pairs.

    python -m specserve.bench.dataplane --targets 1b,7b --out dataplane-out
    python -m specserve.bench.dataplane --targets llama3-8b --draft-shape llama3-1b --out dataplane-out

This is what a GPU machine with no Ray (and too little room to carry real
weights) can measure of the served path: the same `TargetWorkerActor` /
`DraftWorkerActor` classes the Ray deployment runs, each in a process of
its own serving gRPC on 127.0.0.1, and the same `Coordinator` driving
sessions over them, against the in-process `SpeculativeDecoder`.

The models are random-weight Llamas (and Qwen2s) of realistic shapes
(`SHAPES`: Llama-2-7B, Llama-3.1-8B with a Llama-3.2-1B draft, Qwen2.5-7B with
a Qwen2.5-0.5B draft, ...; every matmul of a real model runs) built so that greedy decoding has a known
acceptance rate. Each layer's attention and MLP output projections are
zero, so a model's next token depends on the last token alone: token t is
embedded as a random unit vector e_t, and lm_head row u is the sum of the
e_t whose successor is u. The target's successor of t is t+1; the draft's
is t+1 for a fraction `alpha` of the vocabulary (a fixed random subset) and
t+2 elsewhere. Greedy output is then t+1, t+2, ... whatever the path, which
the bench checks, and each drafted token is accepted with probability
alpha, independently: alpha=1 is a draft that copies the target, alpha=0
one that never matches. Timings are of these random weights, not of a
real pair's acceptance: take alpha from real pairs (`specserve bench`).

Parts (`--parts`; `steps`, `accept` and `hf` are in `bench.steps`):
  steps   one target step at each --concurrency × 1 and γ+1 tokens in each
          --step-modes (eager, through the step runner, the runner's
          compiled steps, and compiled-dynamic: the batch a symbol),
          against its bandwidth floor (targets and the draft's shape).
  accept  one step's verify blocks accepted all at once against one by one.
  hf      the pair through Hugging Face `generate`, target-only and assisted.
  gammas  one stream in process at each γ of --sweep-gammas, alpha =
          --load-alpha (where speculation starts to pay); --draft-kind head
          drafts with a synthetic feature head instead of a draft LM
          (also in load, where the target worker holds it).
  rounds  one stream per configuration, fixed γ, alpha ∈ --alphas: in-process,
          colocated (one worker holds both models), split sequential and split
          pipelined (a draft worker of its own on each --draft-devices), plus
          γ=0; per round: draft call, verify call, the target worker's
          compute, and the rest (gRPC, scheduling).
  load    the colocated worker under --concurrency streams, γ=0 against
          auto, alpha = --load-alpha: aggregate and per-stream tok/s, TTFT.
Writes dataplane.json and dataplane.png (and prints a table per part) to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing as mp
import os
import pathlib
import statistics
import sys
import time
from typing import Any

import torch

from specserve.bench.plot import STEP_MODES, plot_dataplane
from specserve.bench.steps import bench_accept, bench_hf, bench_steps
from specserve.speculation import parse_gamma

# Layer shapes of public models (random weights here). vocab is the bench's (--vocab, by default the first
# target's own where its entry names one) for every model, so any draft shape pairs with any target. An entry
# may name its family (`model_type`, default llama), rope and tied head, as the public config does.
_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
    "135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3),  # SmolLM2-135M, the embedded target and its distilled draft's family
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8),  # Llama-3.2-1B's layers (default rope, untied head)
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=32),  # Llama-2-7B
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                      rope_parameters={**_LLAMA3_ROPE, "factor": 8.0}),  # Llama-3.1-8B
    "llama3-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True,
                      max_position_embeddings=131072, rope_parameters={**_LLAMA3_ROPE, "factor": 32.0}),  # Llama-3.2-1B, its usual draft
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                       max_position_embeddings=32768, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),  # Qwen2.5-7B
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                         max_position_embeddings=32768, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),  # Qwen2.5-0.5B
}


def shape_config(shape: str, vocab: int | None = None):
    """The HF config of a `SHAPES` entry (vocab: in place of its own, or of SmolLM2's 49152 where it has none)."""
    from transformers import AutoConfig

    entry = dict(SHAPES[shape])
    model_type = entry.pop("model_type", "llama")
    entry["vocab_size"] = vocab or entry.get("vocab_size", DEFAULT_VOCAB)
    entry.setdefault("tie_word_embeddings", False)
    entry.setdefault("max_position_embeddings", 4096)
    return AutoConfig.for_model(model_type, bos_token_id=None, eos_token_id=None, pad_token_id=None, **entry)


DEFAULT_VOCAB = 49152  # SmolLM2's


def synthetic_llama(shape: str, vocab: int, alpha: float | None, device: str, dtype: str | None = None,
                    seed: int = 0, quantization: str | None = None):
    """A random-weight Llama of `shape` whose greedy next token after t is t+1 (alpha None: the target), or a
    draft's: t+1 on a random `alpha` share of the vocabulary, t+2 elsewhere (see the module docstring).
    quantization: "int8" / "int4[-gN]" packs its linear layers (`models.kernels.quant`)."""
    from transformers import AutoModelForCausalLM

    from specserve.models.formats.loading import default_dtype, resolve_dtype

    torch_dtype = resolve_dtype(dtype) or default_dtype(device)
    config = shape_config(shape, vocab)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(previous)
    gen = torch.Generator().manual_seed(seed + 1000 * (alpha is not None))
    unit = torch.randn(vocab, config.hidden_size, generator=gen)
    unit /= unit.norm(dim=1, keepdim=True)
    ids = torch.arange(vocab)
    successor = (ids + 1) % vocab
    if alpha is not None:
        agree = torch.rand(vocab, generator=torch.Generator().manual_seed(seed + 1)) < alpha
        successor = torch.where(agree, successor, (ids + 2) % vocab)
    head = torch.zeros(vocab, config.hidden_size).index_add_(0, successor, unit)
    if config.tie_word_embeddings:  # one matrix for both: untie it (the construction needs two)
        model.lm_head.weight = torch.nn.Parameter(torch.empty_like(model.lm_head.weight))
        model.config.tie_word_embeddings = False
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(unit)
        model.lm_head.weight.copy_(head)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    if quantization in (None, "none", "auto"):
        return model.eval()
    from specserve.models.formats.loading import load_model

    return load_model(model, quantization=quantization).model


def synthetic_head(shape: str, vocab: int, alpha: float, device: str, dtype: str | None = None, seed: int = 0):
    """A feature head (`models.drafts.head`) for `synthetic_llama(shape, vocab, None, ...)` that drafts as the synthetic
    draft does: t+1 after t on an `alpha` share of the vocabulary, t+2 elsewhere. The target's feature at t is
    its embedding e_t scaled (its layers add nothing); the head's fc passes the next token's embedding on, its
    layer adds nothing, so its predicted feature is the target's own and each drafted token is accepted with
    probability alpha, independently, as with the synthetic draft (one layer at the target's width)."""
    from specserve.models.drafts.head import FeatureHeadForCausalLM, head_config
    from specserve.models.formats.loading import default_dtype, resolve_dtype

    torch_dtype = resolve_dtype(dtype) or default_dtype(device)
    tc = shape_config(shape, vocab)
    config = head_config(tc, vocab)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype)
    try:
        with torch.device(device):
            head = FeatureHeadForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    unit = torch.randn(vocab, tc.hidden_size, generator=torch.Generator().manual_seed(seed))  # the target's
    unit /= unit.norm(dim=1, keepdim=True)
    ids = torch.arange(vocab)
    agree = torch.rand(vocab, generator=torch.Generator().manual_seed(seed + 1)) < alpha
    successor = torch.where(agree, (ids + 1) % vocab, (ids + 2) % vocab)
    with torch.no_grad():
        head.model.embed_tokens.weight.copy_(unit)
        head.lm_head.weight.copy_(torch.zeros(vocab, tc.hidden_size).index_add_(0, successor, unit))
        head.fc.weight.zero_()
        head.fc.weight[:, tc.hidden_size :].copy_(torch.eye(tc.hidden_size))
        layer = head.model.layers[0]
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    return head.eval()


# -- worker processes -----------------------------------------------------------------------------------------
def _worker(role: str, spec: dict, conn) -> None:
    """A worker process: build the model(s), serve gRPC, send what the coordinator needs, wait for 'stop'."""
    try:
        from specserve.workers.actors import DraftWorkerActor, TargetWorkerActor

        vocab = spec["vocab"]
        if role == "target":
            target = synthetic_llama(spec["shape"], vocab, None, spec["device"], spec["dtype"],
                                     quantization=spec.get("quantization"))
            draft = None
            if spec.get("draft_kind") == "head":  # a feature head beside the target, reading its pool's features
                draft = synthetic_head(spec["shape"], vocab, spec["alpha"], spec["device"], spec["dtype"])
            elif spec.get("draft_shape"):
                draft = synthetic_llama(spec["draft_shape"], vocab, spec["alpha"], spec["device"], spec["dtype"])
            actor = TargetWorkerActor(target, threads=spec["threads"], draft=draft, gamma_max=spec["gamma_max"],
                                      scheduling={"kv_cache_tokens": spec["kv_cache_tokens"],
                                                  "max_step_tokens": spec["max_step_tokens"],
                                                  "prefix_caching": False})  # one prompt, many runs
            reply = {"address": actor.address(), "info": actor.info(),
                     "profile": actor.verify_profile(spec["gamma_max"] + 1)}
        else:
            draft = synthetic_llama(spec["shape"], vocab, spec["alpha"], spec["device"], spec["dtype"])
            actor = DraftWorkerActor(draft, vocab, threads=spec["threads"], kv_cache_tokens=spec["kv_cache_tokens"],
                                     prefix_caching=False)
            reply = {"address": actor.address(), "step_s": actor.step_time()}
        conn.send(reply)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send({"error": f"{type(exc).__name__}: {exc}"})
        raise
    conn.recv()
    actor.stop(0)


class Worker:
    """A worker process; `reply` holds what it sent once serving."""

    def __init__(self, role: str, spec: dict):
        self.role = role
        self.conn, child = mp.get_context("spawn").Pipe()
        self.process = mp.get_context("spawn").Process(target=_worker, args=(role, spec, child), daemon=True)
        self.process.start()
        started = time.perf_counter()
        if not self.conn.poll(900):
            self.stop()
            raise TimeoutError(f"the {role} worker did not start within 900 s")
        self.reply = self.conn.recv()
        if "error" in self.reply:
            self.stop()
            raise RuntimeError(f"the {role} worker failed: {self.reply['error']}")
        self.start_s = time.perf_counter() - started  # process start to serving: load, warm-up, calibration

    def stop(self) -> None:
        try:
            self.conn.send("stop")
        except (BrokenPipeError, OSError):
            pass
        self.process.join(30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


# -- measurements ---------------------------------------------------------------------------------------------
def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=gen).tolist() for _ in range(n)]


def wrong_tokens(prompt: list[int], tokens: list[int], vocab: int) -> int:
    """Tokens that are not the target's greedy output t+1, t+2, ... (0 for an exact path)."""
    start = prompt[-1]
    return sum(t != (start + 1 + i) % vocab for i, t in enumerate(tokens))


def summarize(stats: list[dict], wall_s: float, ttft: list[float], wrong: int) -> dict[str, Any]:
    """Aggregate figures of sessions that ran together for wall_s seconds."""
    rounds = sum(s["rounds"] for s in stats) or 1
    tokens = sum(s["new_tokens"] for s in stats)
    drafted = sum(s["drafted"] for s in stats)
    gammas = [g for s in stats for g in s["gamma_history"]]

    def per_round_ms(key: str) -> float:
        return 1000 * sum(s.get(key, 0.0) for s in stats) / rounds

    out = {
        "streams": len(stats), "tokens": tokens, "wall_s": wall_s,
        "tok_s": tokens / wall_s if wall_s else 0.0,
        "per_stream_tok_s": statistics.median(s["new_tokens"] / s["total_time_s"] for s in stats if s["total_time_s"]),
        "acceptance": sum(s["accepted"] for s in stats) / drafted if drafted else 0.0,
        "tokens_per_round": sum(s["emitted"] for s in stats) / rounds,
        "mean_gamma": statistics.fmean(gammas) if gammas else 0.0,
        "draft_ms_per_round": per_round_ms("draft_time_s"),
        "verify_ms_per_round": per_round_ms("verify_time_s"),
        "worker_verify_ms_per_round": per_round_ms("worker_verify_time_s"),
        "wrong_tokens": wrong,
    }
    if any(s.get("worker_verify_time_s") for s in stats):
        out["overhead_ms_per_round"] = out["verify_ms_per_round"] - out["worker_verify_ms_per_round"]
    if ttft:
        ttft = sorted(ttft)
        out["ttft_p50_s"] = ttft[len(ttft) // 2]
        out["ttft_p95_s"] = ttft[min(len(ttft) - 1, int(0.95 * len(ttft)))]
    return out


def warm_tokens(args) -> int:
    """Tokens of a configuration's warm-up run: on a GPU its whole length, so that every step shape the timed
    run meets (a width in a longer context bucket is a new CUDA graph, captured at its first use) is captured
    before it is timed; elsewhere a few."""
    return args.max_tokens if args.device.startswith("cuda") else 8


def run_in_process(decoder, prompt_ids: list[int], gamma, max_tokens: int, vocab: int, warm: int = 8
                   ) -> dict[str, Any]:
    from specserve import SamplingParams

    params = SamplingParams(temperature=0.0, ignore_eos=True)
    decoder.generate(prompt_ids, params, warm, gamma=gamma)  # warm-up
    t0 = time.perf_counter()
    result = decoder.generate(prompt_ids, params, max_tokens, gamma=gamma)
    wall = time.perf_counter() - t0
    return summarize([result.stats.to_dict()], wall, [], wrong_tokens(prompt_ids, result.token_ids, vocab))


def run_served(coordinator, batch: list[list[int]], gamma, max_tokens: int, vocab: int, warm: int = 8
               ) -> dict[str, Any]:
    """All prompts of `batch` as concurrent streams through the coordinator, after a warm-up run of the same
    streams of `warm` tokens (the batch shapes' first steps are slower on a GPU)."""
    from specserve import SamplingParams
    from specserve.coordinator import SessionRequest

    async def one(prompt_ids: list[int], t0: float, tokens_wanted: int = max_tokens):
        request = SessionRequest(prompt_ids, SamplingParams(temperature=0.0, ignore_eos=True), tokens_wanted, gamma)
        tokens, first, stats = [], None, None
        async for chunk in coordinator.generate(request):
            first = first if first is not None else time.perf_counter() - t0
            tokens.extend(chunk.tokens)
            stats = chunk.stats or stats
        return stats, first, wrong_tokens(prompt_ids, tokens, vocab)

    async def all_of():
        warm_t0 = time.perf_counter()
        await asyncio.gather(*(one(p, warm_t0, min(warm, max_tokens)) for p in batch))
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(p, t0) for p in batch))
        return results, time.perf_counter() - t0

    results, wall = asyncio.run(all_of())
    return summarize([r[0] for r in results], wall, [r[1] for r in results], sum(r[2] for r in results))


def coordinator_for(target: Worker, draft: Worker | None, *, colocated: bool, gamma, gamma_max: int,
                    pipelined: bool, vocab: int, max_sessions: int = 128):
    from specserve.coordinator import ColocatedRelay, Coordinator, SplitDriver

    if colocated:
        driver = ColocatedRelay(target.reply["address"], gamma=gamma, gamma_max=gamma_max, lookup=False)
    else:
        driver = SplitDriver(
            target.reply["address"], vocab, [], draft="remote" if draft is not None else "none",
            draft_address=draft.reply["address"] if draft else None, draft_lookup=False, gamma=gamma,
            gamma_max=gamma_max, pipelined=pipelined, verify_profile=target.reply["profile"],
            draft_step_s=draft.reply["step_s"] if draft else None,
        )
    return Coordinator(driver, max_sessions=max_sessions)


def _free_cuda() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def bench_gammas(args, shape: str, log) -> list[dict[str, Any]]:
    """One stream in process at each γ of --sweep-gammas, alpha = --load-alpha: where speculation pays."""
    from specserve import SpeculativeDecoder

    prompt_ids = prompts(1, args.prompt_len, args.vocab)[0]
    target = synthetic_llama(shape, args.vocab, None, args.device, args.dtype, quantization=args.quantization)
    if args.draft_kind == "head":
        draft, label = synthetic_head(shape, args.vocab, args.load_alpha, args.device, args.dtype), "head"
    else:
        draft = synthetic_llama(args.draft_shape, args.vocab, args.load_alpha, args.device, args.dtype)
        label = args.draft_shape
    decoder = SpeculativeDecoder(target, draft, gamma=1, gamma_max=args.gamma_max, draft_lookup=False,
                                 kv_cache_tokens=4 * (args.prompt_len + args.max_tokens + 64), prefix_caching=False)
    rows = []
    for gamma in args.sweep_gammas:
        figures = run_in_process(decoder, prompt_ids, gamma, args.max_tokens, args.vocab, warm_tokens(args))
        rows.append({"target": shape, "draft": label, "alpha": args.load_alpha, "gamma": gamma, **figures})
        log(f"  γ={gamma!s:<4} {figures['tok_s']:8.1f} tok/s  {figures['tokens_per_round']:.2f} tok/round  "
            f"draft {figures['draft_ms_per_round']:.2f} ms  verify {figures['verify_ms_per_round']:.2f} ms"
            + (f"  WRONG {figures['wrong_tokens']}" if figures["wrong_tokens"] else ""))
    del decoder, target, draft
    _free_cuda()
    return rows


def bench_rounds(args, shape: str, log) -> list[dict[str, Any]]:
    from specserve import SpeculativeDecoder

    rows = []
    prompt_ids = prompts(1, args.prompt_len, args.vocab)[0]
    kv_one = 4 * (args.prompt_len + args.max_tokens + 64)
    base = {"vocab": args.vocab, "dtype": args.dtype, "gamma_max": args.gamma_max, "threads": None,
            "kv_cache_tokens": kv_one, "max_step_tokens": args.max_step_tokens, "quantization": args.quantization}

    def row(config: str, alpha, draft_device, gamma, figures):
        rows.append({"target": shape, "draft": args.draft_shape, "config": config, "alpha": alpha,
                     "draft_device": draft_device, "gamma": gamma, **figures})
        log(f"  {config:<22} alpha={alpha!s:<4} draft on {draft_device or '-':<4} γ={gamma!s:<4} "
            f"{figures['tok_s']:8.1f} tok/s  {figures['tokens_per_round']:.2f} tok/round  "
            f"draft {figures['draft_ms_per_round']:.2f} ms  verify {figures['verify_ms_per_round']:.2f} ms"
            + (f" (worker {figures['worker_verify_ms_per_round']:.2f})" if "overhead_ms_per_round" in figures
               else "") + (f"  WRONG {figures['wrong_tokens']}" if figures["wrong_tokens"] else ""))

    target_model = synthetic_llama(shape, args.vocab, None, args.device, args.dtype, quantization=args.quantization)
    for alpha in args.alphas:
        draft_model = synthetic_llama(args.draft_shape, args.vocab, alpha, args.device, args.dtype)
        decoder = SpeculativeDecoder(target_model, draft_model, gamma=args.gamma, gamma_max=args.gamma_max,
                                     draft_lookup=False, kv_cache_tokens=kv_one, prefix_caching=False)
        row("in-process", alpha, args.device, args.gamma,
            run_in_process(decoder, prompt_ids, args.gamma, args.max_tokens, args.vocab,
                           warm_tokens(args)))
        if alpha == args.alphas[0]:
            row("in-process", None, None, 0, run_in_process(decoder, prompt_ids, 0, args.max_tokens, args.vocab,
                                                           warm_tokens(args)))
        del decoder, draft_model
        _free_cuda()
        target = Worker("target", {**base, "shape": shape, "device": args.device, "draft_shape": args.draft_shape,
                                   "alpha": alpha})
        try:
            coord = coordinator_for(target, None, colocated=True, gamma=args.gamma, gamma_max=args.gamma_max,
                                    pipelined=False, vocab=args.vocab)
            row("colocated", alpha, args.device, args.gamma,
                run_served(coord, [prompt_ids], args.gamma, args.max_tokens, args.vocab, warm_tokens(args)))
            if alpha == args.alphas[0]:
                coord = coordinator_for(target, None, colocated=False, gamma=0, gamma_max=args.gamma_max,
                                        pipelined=False, vocab=args.vocab)
                row("served target only", None, None, 0,
                    run_served(coord, [prompt_ids], 0, args.max_tokens, args.vocab, warm_tokens(args)))
            for draft_device in args.draft_devices:
                draft = Worker("draft", {**base, "shape": args.draft_shape, "device": draft_device, "alpha": alpha,
                                         "dtype": args.dtype if draft_device != "cpu" else None})
                try:
                    for pipelined in (False, True):
                        coord = coordinator_for(target, draft, colocated=False, gamma=args.gamma,
                                                gamma_max=args.gamma_max, pipelined=pipelined, vocab=args.vocab)
                        row("split pipelined" if pipelined else "split sequential", alpha, draft_device, args.gamma,
                            run_served(coord, [prompt_ids], args.gamma, args.max_tokens, args.vocab, warm_tokens(args)))
                finally:
                    draft.stop()
        finally:
            target.stop()
        _free_cuda()
    del target_model
    _free_cuda()
    return rows


def bench_load(args, shape: str, log, startup: list) -> list[dict[str, Any]]:
    """The load part's rows; the target worker's start-up (seconds to serving, its step warm-up) to `startup`."""
    rows = []
    top = max(args.concurrency)
    # a session's buddy block, twice over: a block that outgrows itself may move to a bigger one
    per_session = 1 << (args.prompt_len + args.max_tokens + 2 * args.gamma_max + 8).bit_length()
    spec = {"vocab": args.vocab, "dtype": args.dtype, "gamma_max": args.gamma_max, "threads": None,
            "kv_cache_tokens": 2 * (top + 2) * per_session, "max_step_tokens": args.max_step_tokens,
            "shape": shape, "device": args.device, "draft_shape": args.draft_shape, "alpha": args.load_alpha,
            "quantization": args.quantization, "draft_kind": args.draft_kind}
    target = Worker("target", spec)
    warm = target.reply["info"].get("warm_up") or {}
    log(f"  target worker serving {target.start_s:.1f} s after its start (step warm-up {warm.get('seconds', 0):.1f} s"
        f" over {warm.get('steps', 0)} shapes{', compile cache loaded' if warm.get('cache_loaded') else ''}"
        + (f"; graphs from the cache {warm['graphs_from_cache']}, compiled {warm['graphs_compiled']}"
           if "graphs_compiled" in warm else "") + ")")
    costs = target.reply["info"].get("auto_costs")
    if costs and costs.get("verify_ms"):
        verify = costs["verify_ms"]
        log("  auto's calibration: verify " + " / ".join(f"{verify[n]:.2f}" for n in verify) + " ms over 1.. positions"
            + (f", a draft token {costs['draft_token_ms']:.3f} ms (c = {costs['draft_token_ms'] / verify['1']:.3f})"
               if costs.get("draft_token_ms") is not None and "1" in verify else ""))
    startup.append({"target": shape, "start_s": target.start_s, "warm_up": warm or None, "auto_costs": costs})
    try:
        coords = {gamma: coordinator_for(target, None, colocated=True, gamma=gamma, gamma_max=args.gamma_max,
                                         pipelined=False, vocab=args.vocab) for gamma in args.load_gammas}
        for k, n in enumerate(args.concurrency):
            # the configurations side by side at each level, in alternating order (drift hits both alike)
            for gamma in args.load_gammas if k % 2 == 0 else args.load_gammas[::-1]:
                coord = coords[gamma]
                figures = run_served(coord, prompts(n, args.prompt_len, args.vocab, seed=n), gamma, args.max_tokens,
                                     args.vocab, warm_tokens(args))
                rows.append({"target": shape, "draft": "head" if args.draft_kind == "head" else args.draft_shape,
                             "config": "colocated", "alpha": args.load_alpha,
                             "gamma": gamma, **figures})
                log(f"  γ={gamma!s:<4} {n:>3} streams  {figures['tok_s']:8.1f} tok/s aggregate  "
                    f"{figures['per_stream_tok_s']:7.1f} per stream  TTFT p50 {figures['ttft_p50_s']:.3f} s "
                    f"p95 {figures['ttft_p95_s']:.3f} s  mean γ {figures['mean_gamma']:.2f}"
                    + (f"  WRONG {figures['wrong_tokens']}" if figures["wrong_tokens"] else ""))
    finally:
        target.stop()
    return rows


def _csv(kind):
    return lambda text: [kind(x) for x in text.split(",") if x]


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m specserve.bench.dataplane", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--targets", type=_csv(str), default=["1b", "7b"], help=f"target shapes, of {sorted(SHAPES)}")
    p.add_argument("--draft-shape", default="135m", choices=sorted(SHAPES))
    p.add_argument("--draft-kind", default="model", choices=["model", "head"],
                   help="gammas and load parts: a synthetic draft LM of --draft-shape, or a synthetic feature head (one layer at "
                        "the target's width, the same acceptance alpha)")
    p.add_argument("--vocab", type=int, default=None,
                   help="vocabulary of every model (default: the first target shape's own, else SmolLM2's 49152)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--draft-devices", type=_csv(str), default=None,
                   help="devices of the split draft worker (default: the target's, and cpu beside a GPU)")
    p.add_argument("--dtype", default=None, help="default: bf16 on a GPU (see specserve.models.formats.loading)")
    p.add_argument("--quantization", default="none",
                   help="the target's linear layers: none, int8, int4, int4-g64, int4-g128 (not the hf part)")
    p.add_argument("--parts", type=_csv(str), default=["steps", "accept", "hf", "rounds", "load"])
    p.add_argument("--step-repeats", type=int, default=20, help="timed steps per steps-part level (median)")
    p.add_argument("--step-modes", type=_csv(str), default=["eager", "runner"],
                   help=f"how the steps part runs a step, of {list(STEP_MODES)} (compiled: tens of seconds of "
                        "compiling per level on a GPU)")
    p.add_argument("--sweep-gammas", type=_csv(str), default=["0", "1", "2", "3", "4", "auto"],
                   help="the gammas part's γ values")
    p.add_argument("--alphas", type=_csv(float), default=[1.0, 0.0])
    p.add_argument("--gamma", default="4", help="fixed γ of the rounds part")
    p.add_argument("--gamma-max", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-step-tokens", type=int, default=2048)
    p.add_argument("--concurrency", type=_csv(int), default=[1, 4, 16, 32, 64])
    p.add_argument("--load-alpha", type=float, default=0.7)
    p.add_argument("--load-gammas", type=_csv(str), default=["0", "auto"])
    p.add_argument("--out", default="dataplane-out")
    args = p.parse_args(argv)
    for flag, attr in (("--gamma", "gamma"), ("--load-gammas", "load_gammas"), ("--sweep-gammas", "sweep_gammas")):
        try:
            value = getattr(args, attr)
            setattr(args, attr, [parse_gamma(g) for g in value] if isinstance(value, list) else parse_gamma(value))
        except ValueError as exc:
            p.error(f"{flag}: {exc}")
    if set(args.step_modes) - set(STEP_MODES):
        p.error(f"--step-modes: unknown mode(s) {sorted(set(args.step_modes) - set(STEP_MODES))}; choose from "
                f"{list(STEP_MODES)}")
    unknown = [s for s in args.targets if s not in SHAPES]
    if unknown:
        p.error(f"--targets: unknown shape(s) {unknown}; choose from {sorted(SHAPES)}")
    if args.vocab is None:
        args.vocab = SHAPES[args.targets[0]].get("vocab_size", DEFAULT_VOCAB) if args.targets else DEFAULT_VOCAB
    if args.draft_kind == "head" and set(args.parts) - {"gammas", "steps", "accept", "load"}:
        p.error("--draft-kind head: the gammas (in process) and load (a target worker holding the head) parts; "
                "the rounds part compares draft placements a head does not have")
    if args.draft_devices is None:
        args.draft_devices = [args.device] + (["cpu"] if args.device != "cpu" else [])
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    def log(line: str) -> None:
        print(f"[{time.perf_counter() - started:7.1f} s] {line}", flush=True)

    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"cpu x{os.cpu_count()}"
    report = {"device": device_name, "torch": torch.__version__, "args": vars(args), "steps": [], "accept": [],
              "hf": [], "gammas": [], "rounds": [], "load": [], "startup": []}
    if "steps" in args.parts:
        for shape in dict.fromkeys(args.targets + ([args.draft_shape] if args.draft_kind == "model" else [])):
            log(f"{shape}: one pooled step, eager and through the step runner, against the bandwidth floor")
            report["steps"] += bench_steps(args, shape, log)
            _free_cuda()
    if "accept" in args.parts:
        log(f"acceptance of one step's verify blocks, vocabulary {args.vocab}")
        report["accept"] = bench_accept(args, log)
    for shape in args.targets:
        if "hf" in args.parts:
            log(f"{shape} target, {args.draft_shape} draft: Hugging Face generate")
            report["hf"] += bench_hf(args, shape, log)
            _free_cuda()
        if "gammas" in args.parts:
            log(f"{shape} target, {'a feature head' if args.draft_kind == 'head' else args.draft_shape + ' draft'}: "
                f"one stream in process at each γ, alpha={args.load_alpha}")
            report["gammas"] += bench_gammas(args, shape, log)
        if "rounds" in args.parts:
            log(f"{shape} target, {args.draft_shape} draft: one stream per configuration, γ={args.gamma}")
            report["rounds"] += bench_rounds(args, shape, log)
        if "load" in args.parts:
            log(f"{shape} target: colocated under load, alpha={args.load_alpha}")
            report["load"] += bench_load(args, shape, log, report["startup"])
        (out / "dataplane.json").write_text(json.dumps(report, indent=1))
    plot_dataplane(report, out / "dataplane.png")
    log(f"wrote {out / 'dataplane.json'} and {out / 'dataplane.png'}")
    wrong = sum(r["wrong_tokens"] for part in ("hf", "gammas", "rounds", "load") for r in report[part])
    if wrong:
        print(f"ERROR: {wrong} token(s) differ from the target's greedy output", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
