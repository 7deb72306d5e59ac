"""Parts `steps` and `hf` of the data-plane bench (`python -m specserve.bench.dataplane`).

steps  one pooled target step (`KVPool.forward`) at each --concurrency level × 1 and γ+1 new tokens per
       sequence, eager and through the static-shape step runner (`models.memory.runner`; CUDA graphs on a GPU),
       against its bandwidth floor: the bytes a step must read (the weights once, and every sequence's
       keys and values) over the device's measured copy bandwidth. Run for each target shape and the
       draft's shape.
hf     the same synthetic pair through Hugging Face transformers, the user's alternative: `generate`
       target-only and assisted generation with the same draft (alpha = --load-alpha), one stream, greedy.
accept the acceptance of one target step's verify blocks (γ drafted tokens each, T=1) at each --concurrency
       level: all blocks at once (`judge_many`, what the scheduler runs) against one block at a time.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from specserve.models.kernels.quant import nbytes

WARMUP_STEPS = 3
BLOCK_GAMMA = 4  # the verify block of these parts when --gamma is a policy (auto, heuristic)


def block_gamma(args) -> int:
    return args.gamma if isinstance(args.gamma, int) else BLOCK_GAMMA


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def copy_bandwidth(device: str, megabytes: int = 1024) -> float:
    """Bytes per second a device copy moves, reads and writes counted (the floor's denominator)."""
    n = megabytes * 2**20 // 4
    src = torch.empty(n, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    times = []
    for _ in range(5):
        synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return 2 * src.numel() * src.element_size() / min(times)


def weight_bytes(w) -> int:
    """Bytes of the weights one step reads: every layer's matrices and norms, the final norm and the head."""
    tensors = [t for layer in w.layers for t in layer.weights()] + [w.norm, w.head]
    return sum(nbytes(t) for t in tensors)


def bench_steps(args, shape: str, log) -> list[dict[str, Any]]:
    from specserve.bench.dataplane import prompts, synthetic_llama
    from specserve.models.memory.pool import KVPool

    model = synthetic_llama(shape, args.vocab, None, args.device, args.dtype, quantization=args.quantization)
    bandwidth = copy_bandwidth(args.device)
    widths = sorted({1, block_gamma(args) + 1})
    per_sequence = max(32, 1 << (args.prompt_len + max(widths)).bit_length())  # its buddy block
    rows = []
    for mode in args.step_modes:
        pool = KVPool(model, tokens=2 * max(args.concurrency) * per_sequence, runner=mode != "eager",
                      max_width=args.gamma_max + 1, features=args.draft_kind == "head",  # as beside a head
                      compile_steps={"compiled": True, "compiled-dynamic": "dynamic"}.get(mode, False))
        weights = weight_bytes(pool.w)
        for batch in args.concurrency:
            seqs = [pool.sequence() for _ in range(batch)]
            pool.forward(seqs, prompts(batch, args.prompt_len, args.vocab), [1] * batch)
            for width in widths:
                chunks = [[(7 * j + i) % args.vocab for i in range(width)] for j in range(batch)]
                times = []
                for step in range(WARMUP_STEPS + args.step_repeats):
                    synchronize(args.device)
                    t0 = time.perf_counter()
                    pool.forward(seqs, chunks, [width] * batch, host=False)  # as the scheduler's verify keeps them
                    synchronize(args.device)
                    if step >= WARMUP_STEPS:
                        times.append(time.perf_counter() - t0)
                    for seq in seqs:
                        seq.rollback(args.prompt_len)  # the same context every step
                step_s = statistics.median(times)
                floor_s = (weights + batch * (args.prompt_len + width) * pool.bytes_per_token) / bandwidth
                row = {"shape": shape, "mode": mode, "runner": mode != "eager", "sequences": batch, "width": width,
                       "step_ms": 1000 * step_s, "floor_ms": 1000 * floor_s, "of_floor": step_s / floor_s,
                       "weight_bytes": weights, "bandwidth_gb_s": bandwidth / 1e9}
                rows.append(row)
                log(f"  {shape:>5} {mode:>8} {batch:>3} seq × {width} tok  "
                    f"{row['step_ms']:8.3f} ms  floor {row['floor_ms']:7.3f} ms  ({row['of_floor']:.2f}x floor)")
            for seq in seqs:
                seq.release()
        del pool
    return rows


def bench_hf(args, shape: str, log) -> list[dict[str, Any]]:
    from specserve.bench.dataplane import prompts, synthetic_llama, wrong_tokens

    target = synthetic_llama(shape, args.vocab, None, args.device, args.dtype)
    draft = synthetic_llama(args.draft_shape, args.vocab, args.load_alpha, args.device, args.dtype)
    prompt = prompts(1, args.prompt_len, args.vocab)[0]
    ids = torch.tensor([prompt], device=args.device)
    rows = []
    for config, extra in (("hf target-only", {}), ("hf assisted", {"assistant_model": draft})):
        def generate(n: int) -> list[int]:
            with torch.inference_mode():
                out = target.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                      pad_token_id=0, attention_mask=torch.ones_like(ids), **extra)
            return out[0, len(prompt):].tolist()

        generate(8)  # warm-up
        synchronize(args.device)
        t0 = time.perf_counter()
        tokens = generate(args.max_tokens)
        synchronize(args.device)
        wall = time.perf_counter() - t0
        row = {"target": shape, "draft": args.draft_shape, "config": config, "alpha": args.load_alpha,
               "tokens": len(tokens), "tok_s": len(tokens) / wall,
               "wrong_tokens": wrong_tokens(prompt, tokens, args.vocab)}
        rows.append(row)
        log(f"  {config:<16} alpha={args.load_alpha}  {row['tok_s']:8.1f} tok/s"
            + (f"  WRONG {row['wrong_tokens']}" if row["wrong_tokens"] else ""))
    return rows


def bench_accept(args, log) -> list[dict[str, Any]]:
    from specserve.bench.dataplane import synthetic_llama
    from specserve.engine.proposers import Proposal, TargetVerifier, judge_many
    from specserve.models.memory.pool import KVPool
    from specserve.speculation import PositionRNG, SamplingParams

    model = synthetic_llama("tiny", args.vocab, None, args.device, args.dtype)  # the verifiers need its vocabulary only
    pool = KVPool(model, tokens=64)
    params = SamplingParams(temperature=1.0)
    gen = torch.Generator(device=args.device).manual_seed(0)
    gamma = block_gamma(args)
    rows = []
    for batch in args.concurrency:
        logits = torch.randn(batch, gamma + 1, args.vocab, generator=gen, device=args.device)
        q = torch.softmax(torch.randn(batch, gamma, args.vocab, generator=gen, device=args.device), -1)
        tokens = q.argmax(-1).tolist()
        verifiers = [TargetVerifier(model, args.vocab, pool.sequence()) for _ in range(batch)]
        blocks = [(verifiers[b], logits[b], 0, Proposal(tokens[b], q[b]), params, PositionRNG(b)) for b in range(batch)]
        timed = {}
        for how, judge in (("together", lambda: judge_many(blocks)),
                           ("one by one", lambda: [v.judge(*rest) for v, *rest in blocks])):
            times = []
            for step in range(WARMUP_STEPS + args.step_repeats):
                synchronize(args.device)
                t0 = time.perf_counter()
                judge()
                synchronize(args.device)
                if step >= WARMUP_STEPS:
                    times.append(time.perf_counter() - t0)
            timed[how] = 1000 * statistics.median(times)
        rows.append({"sequences": batch, "gamma": gamma, "vocab": args.vocab, "together_ms": timed["together"],
                     "one_by_one_ms": timed["one by one"]})
        log(f"  {batch:>3} blocks of γ={gamma}  together {timed['together']:8.3f} ms  "
            f"one by one {timed['one by one']:8.3f} ms")
    return rows

