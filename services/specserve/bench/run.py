"""`specserve bench`: every decoding method on one prompt suite, side by side, in one process.

Runs per prompt (greedy, the same weights, interleaved so drift hits all alike):
target-only (HF `generate` and specserve γ=0), HF's own speculative decoding
with the same draft (`prompt_lookup_num_tokens` for n-gram, `assistant_model`
for a model draft: its defaults and fixed `num_assistant_tokens`), specserve
at fixed γ, `heuristic` and `auto`. Reports tokens/s, speedup over the faster
target-only run, acceptance α, mean accepted length, and the Theorem-8
prediction from the measured α, c and verify cost; writes bench.json + bench.png.
"""

from __future__ import annotations

import json
import pathlib
import platform
import sys
import time
from dataclasses import dataclass, field

import torch

from specserve import SamplingParams, SpeculativeDecoder
from specserve.bench.prompts import SUITE
from specserve.engine.profile import verify_profile
from specserve.models import load_model, resolve_draft
from specserve.models.families.lean import unsupported_reason
from specserve.models.kernels import cpu
from specserve.models.memory.pool import KVPool
from specserve.speculation.controllers import theorem8_speedup

GREEDY = SamplingParams(temperature=0.0)


@dataclass
class Run:
    """One method, summed over the prompts of a workload."""

    name: str
    family: str  # "target", "hf-spec", "specserve"
    gamma: int | str | None = None
    tokens: int = 0
    seconds: float = 0.0
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0
    emitted: int = 0
    gammas: list[int] = field(default_factory=list)
    matches_target: bool = True
    draft: str | None = None  # label of the draft a speculative method used
    # every repeat, summed over the prompts: [tokens, seconds] per repeat (the spread the plot shows)
    repeats: list[list[float]] = field(default_factory=list)

    def add_repeat(self, repeat: int, tokens: int, seconds: float) -> None:
        while len(self.repeats) <= repeat:
            self.repeats.append([0, 0.0])
        self.repeats[repeat][0] += tokens
        self.repeats[repeat][1] += seconds

    @property
    def repeat_tokens_per_s(self) -> list[float]:
        return [t / s for t, s in self.repeats if s]

    def add(self, tokens: list[int], seconds: float, stats, matches_target: bool) -> None:
        self.tokens += len(tokens)
        self.seconds += seconds
        self.matches_target &= matches_target
        if stats is not None:
            self.drafted += stats.drafted
            self.accepted += stats.accepted
            self.rounds += stats.rounds
            self.emitted += stats.emitted
            self.gammas += stats.gamma_history

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def alpha(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def mean_accepted_length(self) -> float | None:
        return self.emitted / self.rounds if self.rounds else None


def _hf_generate(model, ids: list[int], max_new: int, **kwargs) -> tuple[list[int], float]:
    inputs = torch.tensor([ids], device=model.device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=max_new, do_sample=False, **kwargs)
    return out[0, len(ids) :].tolist(), time.perf_counter() - t0


def draft_label(spec: str) -> str:
    if spec in ("ngram", "none"):
        return spec
    if spec == "embedded-draft":
        return "distilled"
    return pathlib.Path(spec).name or spec


def _methods(decoder: SpeculativeDecoder, gammas: list[int], hf_k: list[int], label: str | None = None,
             with_target: bool = True):
    """(name, family, γ, fn(ids, max_new) -> (tokens, seconds, stats|None)); names carry `label` when given."""
    target = decoder.target.model
    prefix = f"[{label}] " if label else ""

    def hf(**kw):
        return lambda ids, n: (*_hf_generate(target, ids, n, **kw), None)

    def ours(gamma, lookup=None):
        def fn(ids, n):
            res = decoder.generate(ids, GREEDY, n, gamma=gamma, draft_lookup=lookup)
            return res.token_ids, res.stats.total_time_s, res.stats

        return fn

    methods = []
    hf_runs = decoder.target.quantization == "none"  # HF has no forward for packed quantized weights
    if with_target:
        methods += [("target-only HF generate", "target", None, hf())] if hf_runs else []
        methods += [("target-only specserve γ=0", "target", 0, ours(0))]
    if hf_runs and decoder.draft_kind == "ngram":
        for k in hf_k:
            methods.append((f"{prefix}HF prompt-lookup k={k}", "hf-spec", k, hf(prompt_lookup_num_tokens=k)))
    elif hf_runs and decoder.draft_kind == "model":
        assistant = decoder.draft.model

        def hf_assisted(k):
            def fn(ids, n):
                cfg = assistant.generation_config
                saved = (cfg.num_assistant_tokens, cfg.num_assistant_tokens_schedule, cfg.assistant_confidence_threshold)
                if k is not None:
                    cfg.num_assistant_tokens, cfg.num_assistant_tokens_schedule = k, "constant"
                    cfg.assistant_confidence_threshold = 0.0
                try:
                    return (*_hf_generate(target, ids, n, assistant_model=assistant), None)
                finally:
                    cfg.num_assistant_tokens, cfg.num_assistant_tokens_schedule, cfg.assistant_confidence_threshold = saved

            return fn

        methods.append((f"{prefix}HF assisted (defaults)", "hf-spec", "default", hf_assisted(None)))
        for k in hf_k:
            methods.append((f"{prefix}HF assisted k={k}", "hf-spec", k, hf_assisted(k)))
    if decoder.draft_kind == "none":
        return methods
    for g in gammas:
        methods.append((f"{prefix}specserve γ={g}", "specserve", g, ours(g)))
    methods.append((f"{prefix}specserve heuristic", "specserve", "heuristic", ours("heuristic")))
    methods.append((f"{prefix}specserve auto", "specserve", "auto", ours("auto")))
    if decoder.draft_kind in ("model", "head") and decoder.draft_lookup:  # the draft alone (as HF assisted runs it)
        methods.append((f"{prefix}specserve auto, no lookup", "specserve", "auto", ours("auto", lookup=False)))
    return methods


def _verify_costs(args, decoder: SpeculativeDecoder) -> dict:
    """Target forward over n positions relative to n=1, per dtype (bounds every CPU speedup), each through a KV
    pool's step as the decoder runs it (a private cache takes other kernels: on CPUs no fused layers)."""
    table = {}
    n_max = max(9, decoder.gamma_max + 1)
    for dtype in ("float32", "bfloat16"):
        if decoder.target.dtype == getattr(torch, dtype):
            loaded = decoder.target
        else:
            loaded = load_model(args.target, dtype=dtype, device=str(decoder.target.device), quantization="none")
        label = dtype if loaded.quantization == "none" else f"{dtype} {loaded.quantization}"
        pool = KVPool(loaded.model, 1024) if unsupported_reason(loaded.model) is None else None
        prof = verify_profile(loaded.model, decoder.target.vocab_size, n_max, context=128, repeats=5,
                              sequence=pool.sequence() if pool is not None else None)
        del pool
        table[label] = {"ms": {n: 1000 * s for n, s in prof.items()}, "ratio": {n: s / prof[1] for n, s in prof.items()}}
        print(
            f"  verify cost {label:8s} " + " ".join(f"n={n}:{r:.2f}" for n, r in table[label]["ratio"].items())
            + f"  (n=1: {prof[1] * 1000:.1f} ms)",
            flush=True,
        )
    return table


def _predict(run: Run, costs: dict[str, tuple[dict[int, float], float]]) -> float | None:
    """Theorem 8 with the measured α, c and verify cost v(γ) = t(γ+1)/t(1), for fixed-γ runs.

    None for auto/heuristic: the theorem assumes one γ and i.i.d. acceptance,
    while those choose γ per round (auto only drafts where it expects to win,
    which inflates its α), so a number would mislead.
    """
    if run.family != "specserve" or run.alpha is None or not isinstance(run.gamma, int):
        return None
    profile, c = costs[run.draft]
    if run.gamma + 1 not in profile:
        return None
    return theorem8_speedup(run.alpha, run.gamma, c, profile[run.gamma + 1] / profile[1])


def run_bench(args) -> int:
    if args.quick:
        args.prompts, args.gammas, args.max_new_tokens = 1, "2,4", 48
    gammas = [int(g) for g in args.gammas.split(",") if g]
    workloads = [w for w in args.workloads.split(",") if w]
    unknown = set(workloads) - set(SUITE)
    if unknown:
        print(f"specserve bench: unknown workload(s) {sorted(unknown)}; choose from {sorted(SUITE)}", file=sys.stderr)
        return 2
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)

    specs = [d.strip() for d in args.draft.split(",") if d.strip()] or ["none"]
    specs = [resolve_draft(args.target, d) for d in specs]
    print(f"specserve bench: loading target={args.target} draft(s)={','.join(specs)} ...", flush=True)
    decoders: dict[str, SpeculativeDecoder] = {}
    for spec in specs:
        target = next(iter(decoders.values())).target if decoders else args.target  # load the target once
        decoders[draft_label(spec)] = SpeculativeDecoder(target, None if spec == "none" else spec, gamma="auto",
                                                         dtype=args.dtype, gamma_max=args.gamma_max,
                                                         draft_stop_below=args.draft_stop_below,
                                                         quantization=args.quantization,
                                                         draft_quantization=args.draft_quantization,
                                                         prefix_caching=False)  # every config prefills alike
    decoder = next(iter(decoders.values()))
    print(f"  target {decoder.target.name} ({decoder.target.dtype}, {decoder.target.device}), "
          f"drafts {', '.join(f'{k} ({d.draft_kind})' for k, d in decoders.items())}")
    verify_costs = _verify_costs(args, decoder)
    costs: dict[str, tuple[dict[int, float], float]] = {}
    for label, dec in decoders.items():
        profile, draft_step = dec.cost_profile()
        costs[label] = (profile, draft_step / profile[1])
        print(f"  {label}: draft step {draft_step * 1000:.2f} ms, target step {profile[1] * 1000:.1f} ms "
              f"→ c = {costs[label][1]:.3f}", flush=True)

    methods, owner = [], {}
    for i, (label, dec) in enumerate(decoders.items()):
        hf_k = sorted({2, 4, 10} if dec.draft_kind == "ngram" else {2, 4, 6})
        for method in _methods(dec, gammas, hf_k, label if len(decoders) > 1 else None, with_target=i == 0):
            methods.append(method)
            owner[method[0]] = label if method[1] != "target" else None
    runs = {w: {name: Run(name, fam, g, draft=owner[name]) for name, fam, g, _ in methods} for w in workloads}
    total = len(workloads) * args.prompts * len(methods) * args.repeats
    step = 0
    for workload in workloads:
        for prompt in SUITE[workload][: args.prompts]:
            ids = decoder.encode([{"role": "user", "content": prompt}])
            decoder.generate(ids, GREEDY, 8, gamma=2)  # warm caches and allocator
            best: dict[str, tuple] = {}
            for repeat in range(args.repeats):  # round-robin over methods; keep each method's fastest repeat
                for name, _family, _gamma, fn in methods:
                    tokens, seconds, stats = fn(ids, args.max_new_tokens)
                    runs[workload][name].add_repeat(repeat, len(tokens), seconds)
                    if name not in best or len(tokens) / seconds > len(best[name][0]) / best[name][1]:
                        best[name] = (tokens, seconds, stats)
                    step += 1
                    print(f"  [{step}/{total}] {workload:8s} {name:28s} {len(tokens) / seconds:6.1f} tok/s", flush=True)
            reference = best[methods[0][0]][0]
            for name, (tokens, seconds, stats) in best.items():
                runs[workload][name].add(tokens, seconds, stats, tokens == reference)

    report = _report(args, decoder, workloads, runs, verify_costs, costs, specs)
    (out / "bench.json").write_text(json.dumps(report, indent=2))
    from specserve.bench.plot import plot_report

    plot_report(report, out / "bench.png")
    print(f"\nwrote {out / 'bench.json'} and {out / 'bench.png'}")
    return 0


def _summary(table: list[dict]) -> dict | None:
    ours = [t for t in table if t["family"] == "specserve"]
    if not ours:
        return None
    fixed = [t for t in ours if isinstance(t["gamma"], int)]
    auto = next(t for t in ours if t["gamma"] == "auto")
    plain = next((t for t in ours if t["method"].endswith("auto, no lookup")), None)
    best_ours = max(fixed + [auto], key=lambda t: t["tokens_per_s"])
    best_fixed = max(fixed, key=lambda t: t["tokens_per_s"]) if fixed else None
    hf_spec = [t for t in table if t["family"] == "hf-spec"]
    best_hf = max(hf_spec, key=lambda t: t["tokens_per_s"]) if hf_spec else None
    return {
        "best_specserve": best_ours["method"],
        "best_specserve_speedup": best_ours["speedup"],
        "auto_speedup": auto["speedup"],
        "best_hf_speculative": best_hf["method"] if best_hf else None,
        "best_hf_speculative_speedup": best_hf["speedup"] if best_hf else None,
        "specserve_vs_hf_speculative": best_ours["tokens_per_s"] / best_hf["tokens_per_s"] if best_hf else None,
        "auto_vs_best_fixed": auto["tokens_per_s"] / best_fixed["tokens_per_s"] if best_fixed else None,
        # the same draft without prompt lookup: what HF assisted generation runs
        "auto_no_lookup_vs_hf_speculative": plain["tokens_per_s"] / best_hf["tokens_per_s"] if plain and best_hf
        else None,
    }


def _report(args, decoder, workloads, runs, verify_costs, costs, specs) -> dict:
    first = next(iter(costs))
    report = {
        "config": {
            "target": decoder.target.name, "draft": ",".join(specs), "dtype": str(decoder.target.dtype).removeprefix("torch."),
            "quantization": decoder.target.quantization,
            "device": str(decoder.target.device), "max_new_tokens": args.max_new_tokens, "prompts": args.prompts,
            "repeats": args.repeats, "draft_stop_below": args.draft_stop_below, "threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
            # which kernels a bf16 CPU step takes, with the environment's choices (ISA, activations, dense copy)
            "bf16_cpu_steps": cpu.describe() if decoder.target.device.type == "cpu" else None,
        },
        "verify_cost": verify_costs,
        "c": costs[first][1],
        "drafts": {label: {"c": c, "target_step_ms": profile[1] * 1000, "draft_step_ms": c * profile[1] * 1000}
                   for label, (profile, c) in costs.items()},
        "workloads": {},
    }
    for workload in workloads:
        rows = list(runs[workload].values())
        base = max(r.tokens_per_s for r in rows if r.family == "target")
        table = []
        print(f"\n== {workload} == (speedup vs the faster target-only run, {base:.1f} tok/s)")
        print(f"{'method':28s} {'tok/s':>7s} {'speedup':>8s} {'alpha':>6s} {'tok/rnd':>7s} {'pred':>6s} {'meas/pred':>9s}")
        for r in rows:
            pred = _predict(r, costs)
            speedup = r.tokens_per_s / base
            table.append({
                "method": r.name, "family": r.family, "gamma": r.gamma, "tokens": r.tokens, "seconds": r.seconds,
                "tokens_per_s": r.tokens_per_s, "speedup": speedup, "alpha": r.alpha,
                # each repeat's speedup (all prompts of that repeat): the spread around the best-of figure
                "repeat_speedups": [v / base for v in r.repeat_tokens_per_s],
                "mean_accepted_length": r.mean_accepted_length, "theorem8_prediction": pred,
                "fraction_of_prediction": speedup / pred if pred else None,
                "mean_gamma": sum(r.gammas) / len(r.gammas) if r.gammas else None,
                "same_tokens_as_target_only": r.matches_target, "draft": r.draft,
            })
            fmt = lambda v, f: format(v, f) if v is not None else "-"  # noqa: E731
            print(
                f"{r.name:28s} {r.tokens_per_s:7.1f} {speedup:7.2f}x {fmt(r.alpha, '6.2f')} "
                f"{fmt(r.mean_accepted_length, '7.2f')} {fmt(pred, '6.2f')} {fmt(speedup / pred if pred else None, '9.2f')}"
            )
        summary = _summary(table) or {}
        if len(costs) > 1:
            summary["per_draft"] = {label: _summary([t for t in table if t["draft"] == label]) for label in costs}
        report["workloads"][workload] = {"runs": table, "summary": summary}
        for label, part in ([(None, summary)] + list(summary.get("per_draft", {}).items())):
            if not part:
                continue
            print(
                (f"-> [{label}] " if label else "-> ")
                + f"best specserve: {part['best_specserve']} {part['best_specserve_speedup']:.2f}x; "
                + f"auto {part['auto_speedup']:.2f}x; "
                + (f"vs best HF speculative ({part['best_hf_speculative']}): {part['specserve_vs_hf_speculative']:.2f}x; "
                   if part["best_hf_speculative"] else "")
                + (f"auto / best fixed γ: {part['auto_vs_best_fixed']:.2f}" if part["auto_vs_best_fixed"] else "")
                + (f"; auto without lookup vs best HF: {part['auto_no_lookup_vs_hf_speculative']:.2f}x"
                   if part["auto_no_lookup_vs_hf_speculative"] else "")
            )
    return report
