"""`specserve bench --served`: the served path (HTTP → Serve ingress → coordinator → gRPC workers on Ray)
against the in-process engine, same prompts, same model, same fixed γ, greedy.

In-process runs happen before Ray starts, while it runs (idle, in this
driver) and again after it stops:
a driver that hosts Ray's own threads decodes slower, and the served path
should be compared with the engine at its best. Reports tokens/s of both,
their ratio, the overhead per round in ms, and — for a model draft — the
pipelined vs sequential ratio of the split served path, beside the draft
colocated in the target worker (one application deployed at a time, as a user runs it). Writes served.json
and served.png.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import statistics
import sys
import time
import urllib.request

from specserve import SamplingParams, SpeculativeDecoder
from specserve.bench.prompts import SUITE
from specserve.coordinator.metrics import metrics_summary, scrape_until, since
from specserve.models import resolve_draft
from specserve.serve.listen import free_port
from specserve.workers.quiet import descendants, quiet_env, yield_control_plane

GREEDY = SamplingParams(temperature=0.0)
RAY_SETTLE_S = 2.0


def _post(url: str, body: dict) -> tuple[dict, float]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        payload = json.loads(response.read())
    return payload, time.perf_counter() - t0


def _in_process(decoder, prompts, args, gamma, index: int = 0) -> dict[int, tuple[float, int, str]]:
    """prompt index -> (best seconds, tokens, text)."""
    best: dict[int, tuple[float, int, str]] = {}
    for i, (_workload, ids) in enumerate(prompts, start=index):
        decoder.generate(ids, GREEDY, 8, gamma=gamma)  # warm
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            result = decoder.generate(ids, GREEDY, args.max_new_tokens, gamma=gamma)
            seconds = time.perf_counter() - t0
            if i not in best or seconds < best[i][0]:
                best[i] = (seconds, len(result.token_ids), result.text, result.stats)
    return best


@contextlib.contextmanager
def _ray_frozen():
    """Ray's processes (this driver's descendants) stopped (SIGSTOP) for the block, continued after it."""
    stopped = []
    try:
        for pid in descendants(os.getpid()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
        yield
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


# Student's t, two-sided 95%, by degrees of freedom (1-30; beyond, the normal's 1.96 is within 4%)
_T95 = (12.71, 4.30, 3.18, 2.78, 2.57, 2.45, 2.36, 2.31, 2.26, 2.23, 2.20, 2.18, 2.16, 2.14, 2.13, 2.12, 2.11,
        2.10, 2.09, 2.09, 2.08, 2.07, 2.07, 2.06, 2.06, 2.06, 2.05, 2.05, 2.05, 2.04)


def mean_ci95(values: list[float]) -> list[float] | None:
    """[low, high] of the 95% confidence interval of the mean (Student's t), None below two values: whether the
    paired ratios clear a bar, or only their median does."""
    if len(values) < 2:
        return None
    mean, n = statistics.fmean(values), len(values)
    half = (_T95[n - 2] if n - 1 <= len(_T95) else 1.96) * statistics.stdev(values) / n**0.5
    return [mean - half, mean + half]


def _interval(ci: list[float] | None) -> str:
    return "{:.2f}-{:.2f}".format(*ci) if ci else ""


def _tokens_per_s(decoder, ids, args, gamma) -> float:
    t0 = time.perf_counter()
    result = decoder.generate(ids, GREEDY, args.max_new_tokens, gamma=gamma)
    return len(result.token_ids) / (time.perf_counter() - t0)


def _frozen_tokens_per_s(decoder, ids, args, gamma) -> float:
    """tok/s of the in-process engine with Ray's processes stopped, as without Ray; then a pause for them to
    catch up (continued, they run every periodic task they owe at once)."""
    with _ray_frozen():
        rate = _tokens_per_s(decoder, ids, args, gamma)
    time.sleep(RAY_SETTLE_S)
    return rate


def _pairs(ratios: list[float]) -> dict:
    return {"ratios": ratios, "median": statistics.median(ratios) if ratios else None,
            "mean": statistics.fmean(ratios) if ratios else None, "mean_ci95": mean_ci95(ratios)}


def _mean_interval(pairs: dict) -> str:
    if pairs["mean"] is None:
        return ""
    return f"{pairs['mean']:.2f} ({_interval(pairs['mean_ci95'])})" if pairs["mean_ci95"] else f"{pairs['mean']:.2f}"


def run_served_bench(args) -> int:
    import ray
    from ray import serve
    from ray.serve.config import HTTPOptions

    from specserve.serve import build_app

    if args.quick:
        args.prompts, args.max_new_tokens = 1, 48
    workloads = [w for w in args.workloads.split(",") if w]
    unknown = set(workloads) - set(SUITE)
    if unknown:
        print(f"specserve bench: unknown workload(s) {sorted(unknown)}; choose from {sorted(SUITE)}", file=sys.stderr)
        return 2
    gamma = args.served_gamma
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.draft = resolve_draft(args.target, args.draft)
    if "," in args.draft:
        print("specserve bench --served: one draft at a time (got a list)", file=sys.stderr)
        return 2
    draft = None if args.draft == "none" else args.draft
    model_draft = draft not in (None, "ngram")
    top_k = 64 if model_draft else 0  # the served draft worker ships its top-64 q
    print(f"specserve bench --served: loading target={args.target} draft={args.draft} γ={gamma} ...", flush=True)
    decoder = SpeculativeDecoder(args.target, draft, gamma=gamma, dtype=args.dtype, gamma_max=args.gamma_max,
                                 draft_top_k=top_k, quantization=args.quantization,
                                 draft_quantization=args.draft_quantization, prefix_caching=False)
    prompts = [(w, decoder.encode([{"role": "user", "content": p}])) for w in workloads
               for p in SUITE[w][: args.prompts]]

    print("  in-process (before Ray) ...", flush=True)
    before = _in_process(decoder, prompts, args, gamma)

    # the n-gram draft runs inside the coordinator: nothing to overlap, one application
    # a model draft: colocated in the target worker (the default), and split into its own worker, sequential and
    # pipelined
    names = ["served"] if not model_draft else ["colocated", "sequential", "pipelined"]
    if args.placements:
        wanted = [n for n in args.placements.split(",") if n]
        if not model_draft or not wanted or set(wanted) - set(names):
            print("specserve bench --served: --placements is a comma-separated subset of colocated,sequential,"
                  f"pipelined, for a model draft (got {args.placements!r} with draft {args.draft})", file=sys.stderr)
            return 2
        names = wanted
    port = free_port()
    served: dict[str, dict[int, tuple[float, int, str, int]]] = {name: {} for name in names}
    repeats: dict[str, dict[str, list[list[float]]]] = {}  # application -> workload -> [tokens, seconds] per repeat
    # application -> workload -> per repeat: tok/s of the served request, then of the in-process engine right
    # next to it beside idle Ray + Serve and with Ray frozen (`_frozen_tokens_per_s`)
    paired: dict[str, dict[str, list[tuple[float, float, float]]]] = {}
    during: dict[int, tuple[float, int, str]] = {}  # in-process while Ray + Serve are up and idle
    metrics_port = free_port()
    metrics: dict[str, dict] = {}  # per application: what its requests added to the scraped series
    # Ray's default metrics export interval (10 s; the scrapes wait for it): a 1 s one made every Ray process
    # wake up ten times as often, 0.18 cores of idle load instead of 0.13, which the served forwards paid.
    # Logical CPU slots for a split application's actors (half a slot each by default) while the last one's are
    # still being released. The local Ray runs as `specserve serve` runs it (`workers.quiet`), except that this
    # driver, which runs the in-process engine, keeps its own priority.
    quiet_env()
    ray.init(address="local", include_dashboard=False, log_to_driver=False, num_cpus=8,
             _metrics_export_port=metrics_port)
    try:
        serve.start(http_options=HTTPOptions(host="127.0.0.1", port=port))
        from specserve.serve.run import model_args

        app_args = model_args(args, gamma)
        url = f"http://127.0.0.1:{port}/v1/completions"
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        # one application at a time, as a user deploys it: side by side, the idle ones' actors (each with its
        # own models and thread pools) shared the two cores with the one measured and cost it up to 40%
        for name in names:
            print(f"  deploying the {name} application ...", flush=True)
            placement = "colocated" if name == "colocated" else "split"
            serve.run(build_app({**app_args, "pipelined": name == "pipelined", "draft_placement": placement}),
                      name=name, route_prefix="/")
            yield_control_plane(include_root=False)
            baseline = scrape_until(metrics_url, "ray_specserve_requests_total", 0, timeout=0)
            requests_sent = 0
            for i, (workload, ids) in enumerate(prompts):
                body = {"prompt": ids, "max_tokens": args.max_new_tokens, "temperature": 0}
                _post(url, {**body, "max_tokens": 8})  # warm
                requests_sent += 1 + args.repeats
                for repeat in range(args.repeats):
                    # the served request next to the in-process engine beside idle Ray + Serve and with Ray frozen,
                    # in the same minute: this machine's speed drifts by 10-20% over minutes, more than the
                    # difference measured, and a ratio of neighbours cancels that. Mirrored order on alternate
                    # repeats (served, beside, frozen; then frozen, beside, served): a fixed order lets whatever
                    # follows one run (Ray catching up after being frozen, say) always land on the same one
                    runs = {"served": lambda: _post(url, body),
                            "beside": lambda: _tokens_per_s(decoder, ids, args, gamma),
                            "frozen": lambda: _frozen_tokens_per_s(decoder, ids, args, gamma)}
                    order = list(runs) if repeat % 2 == 0 else list(reversed(runs))
                    got = {run: runs[run]() for run in order}
                    (payload, seconds), beside, alone = got["served"], got["beside"], got["frozen"]
                    tokens = payload["usage"]["completion_tokens"]
                    paired.setdefault(name, {}).setdefault(workload, []).append((tokens / seconds, beside, alone))
                    totals = repeats.setdefault(name, {}).setdefault(workload, [[0, 0.0] for _ in range(args.repeats)])
                    totals[repeat][0] += tokens
                    totals[repeat][1] += seconds
                    rounds = payload["specserve"]["rounds"]
                    if i not in served[name] or seconds < served[name][i][0]:
                        served[name][i] = (seconds, tokens, payload["choices"][0]["text"], rounds, payload["specserve"])
                    print(f"  {workload:8s} prompt {i} {name:10s} {tokens / seconds:6.1f} tok/s "
                          f"(in-process {before[i][1] / before[i][0]:6.1f} before Ray; next to it: "
                          f"{beside:6.1f} beside idle Ray, {alone:6.1f} Ray frozen)", flush=True)
            if not during:
                print("  in-process beside the idle application ...", flush=True)
                during = _in_process(decoder, prompts, args, gamma)
            # this application's share: the scrape minus the one before it was deployed
            scraped = scrape_until(metrics_url, "ray_specserve_requests_total", requests_sent, baseline=baseline)
            metrics[name] = metrics_summary(since(scraped, baseline), requests_sent)
            serve.delete(name)
    finally:
        serve.shutdown()
        ray.shutdown()

    print("  in-process (after Ray) ...", flush=True)
    after = _in_process(decoder, prompts, args, gamma)
    report = _report(args, gamma, workloads, prompts, before, after, during, served, repeats, paired)
    report["metrics"] = metrics
    for name, summary in metrics.items():
        print(f"  {name}: metrics scraped (Prometheus, summed over its workers): "
              + ", ".join(f"{k} {'-' if v is None else format(v, 'g')}" for k, v in summary.items()
                          if not isinstance(v, dict)))
    (out / "served.json").write_text(json.dumps(report, indent=2))
    _plot(report, out / "served.png")
    print(f"\nwrote {out / 'served.json'} and {out / 'served.png'}")
    return 0


def _report(args, gamma, workloads, prompts, before, after, during, served, repeats=None, paired=None) -> dict:
    report = {
        "config": {"target": args.target, "draft": args.draft, "gamma": gamma, "max_new_tokens": args.max_new_tokens,
                   "prompts": args.prompts, "repeats": args.repeats, "sampling": "greedy",
                   "quantization": getattr(args, "quantization", "auto")},
        "workloads": {},
    }
    print("\npaired: each served request over the in-process engine next to it (after it, then before it, in turn),"
          " Ray frozen (median, and the mean with its 95% CI);\nthat gap split in two, the served path over the engine "
          "beside idle Ray + Serve (path) and that engine over the one with Ray frozen (Ray idle); means and 95% CIs")
    print(f"{'workload':9s} {'in-proc':>8s} {'(ray up)':>8s} {'served':>8s} {'ratio':>6s} {'paired':>6s} "
          f"{'(95% CI of mean)':>16s} {'path':>17s} {'Ray idle':>17s} "
          f"{'ms/round':>9s} {'same text':>9s}"
          + ("  pipelined/sequential" if "pipelined" in served else ""))
    for workload in workloads:
        idx = [i for i, (w, _) in enumerate(prompts) if w == workload]
        best_local = {i: min(before[i], after[i], key=lambda r: r[0]) for i in idx}
        local_s = sum(best_local[i][0] for i in idx)
        local_tokens = sum(best_local[i][1] for i in idx)
        local_rounds = sum(best_local[i][3].rounds for i in idx)
        row_local_ms = {"round": 1000 * local_s / local_rounds,
                        "verify": 1000 * sum(best_local[i][3].verify_time_s for i in idx) / local_rounds,
                        "draft": 1000 * sum(best_local[i][3].draft_time_s for i in idx) / local_rounds}
        row = {"in_process_tokens_per_s": local_tokens / local_s,
               "in_process_before_ray_tokens_per_s": sum(before[i][1] for i in idx) / sum(before[i][0] for i in idx),
               "in_process_after_ray_tokens_per_s": sum(after[i][1] for i in idx) / sum(after[i][0] for i in idx),
               # the same engine in this (driver) process while Ray and Serve idle beside it: what Ray's
               # background processes alone cost a CPU forward
               "in_process_ray_up_tokens_per_s": sum(during[i][1] for i in idx) / sum(during[i][0] for i in idx),
               "in_process_per_round_ms": row_local_ms}
        for name, results in served.items():
            rates = (paired or {}).get(name, {}).get(workload, [])
            frozen = _pairs([served_rate / alone for served_rate, _, alone in rates])
            s = sum(results[i][0] for i in idx)
            tokens = sum(results[i][1] for i in idx)
            rounds = sum(results[i][3] for i in idx)
            row[name] = {
                "tokens_per_s": tokens / s,
                # each repeat's figure over the workload's prompts (the bar is the best per prompt)
                "repeat_tokens_per_s": [t / sec for t, sec in (repeats or {}).get(name, {}).get(workload, []) if sec],
                "served_over_in_process": (tokens / s) / (local_tokens / local_s),
                # each served request over the in-process run next to it (Ray frozen), and their median
                # (`_frozen_tokens_per_s`)
                "paired_tokens_per_s": [{"served": a, "in_process_ray_up": b, "in_process": c} for a, b, c in rates],
                "paired_ratios": frozen["ratios"],
                "served_over_in_process_paired": frozen["median"],
                "paired_mean_ci95": frozen["mean_ci95"],
                # the same gap in two parts, from the same pairs: the served path over the engine beside idle Ray +
                # Serve (what serving adds), and that engine over the one with Ray frozen (what Ray's idle
                # processes alone cost a CPU forward)
                "paired_served_over_ray_up": _pairs([a / b for a, b, _ in rates]),
                "paired_ray_up_over_in_process": _pairs([b / c for _, b, c in rates]),
                "rounds": rounds,
                "overhead_ms_per_round": 1000 * (s - local_s * tokens / local_tokens) / rounds,
                "same_text_as_in_process": all(results[i][2] == best_local[i][2] for i in idx),
                "served_over_in_process_ray_up": (tokens / s) / row["in_process_ray_up_tokens_per_s"],
                # where a served round's time goes (ms): the whole round as the client saw it, the verify call
                # as the coordinator saw it, and the forward + acceptance as the target worker measured it
                "per_round_ms": {
                    "round": 1000 * s / rounds,
                    "verify_call": 1000 * sum(results[i][4]["verify_time_s"] for i in idx) / rounds,
                    "worker_verify": 1000 * sum(results[i][4]["worker_verify_time_s"] for i in idx) / rounds,
                    "draft": 1000 * sum(results[i][4]["draft_time_s"] for i in idx) / rounds,
                },
            }
        if "pipelined" in served:
            row["pipelined_over_sequential"] = row["pipelined"]["tokens_per_s"] / row["sequential"]["tokens_per_s"]
        report["workloads"][workload] = row
        p = row[next(iter(served))]
        print(f"{workload:9s} {row['in_process_tokens_per_s']:8.1f} {row['in_process_ray_up_tokens_per_s']:8.1f} "
              f"{p['tokens_per_s']:8.1f} "
              f"{p['served_over_in_process']:6.2f} {p['served_over_in_process_paired'] or float('nan'):6.2f} "
              f"{_interval(p['paired_mean_ci95']):>16s} {_mean_interval(p['paired_served_over_ray_up']):>17s} "
              f"{_mean_interval(p['paired_ray_up_over_in_process']):>17s} "
              f"{p['overhead_ms_per_round']:9.1f} {str(p['same_text_as_in_process']):>9s}"
              + (f"  {row['pipelined_over_sequential']:.2f}" if "pipelined" in served else ""))
    return report


def _plot(report: dict, path: pathlib.Path) -> None:
    """Tokens/s per workload: in-process (whisker: before to after Ray ran) and each served application (whisker:
    range over repeats), values on the bars, the configuration in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(report["workloads"])
    rows = [report["workloads"][w] for w in workloads]
    series = {"in-process (best of before / after Ray)": (
        [r["in_process_tokens_per_s"] for r in rows],
        [[r["in_process_before_ray_tokens_per_s"], r["in_process_after_ray_tokens_per_s"],
          r["in_process_tokens_per_s"]] for r in rows])}
    series["in-process beside idle Ray + Serve"] = ([r["in_process_ray_up_tokens_per_s"] for r in rows],
                                                   [[r["in_process_ray_up_tokens_per_s"]] for r in rows])
    for name in ("served", "colocated", "sequential", "pipelined"):
        if name in rows[0]:
            series[f"served: {name}"] = ([r[name]["tokens_per_s"] for r in rows],
                                         [r[name].get("repeat_tokens_per_s") or [r[name]["tokens_per_s"]]
                                          for r in rows])
    fig, ax = plt.subplots(figsize=(10, 4.8))
    width = 0.8 / len(series)
    top = 0.0
    for k, (label, (values, spreads)) in enumerate(series.items()):
        xs = [i + k * width for i in range(len(workloads))]
        below = [max(0.0, v - min(sp)) for v, sp in zip(values, spreads)]
        above = [max(0.0, max(sp) - v) for v, sp in zip(values, spreads)]
        ax.bar(xs, values, width, label=label, yerr=[below, above], capsize=2, error_kw={"elinewidth": 0.8})
        for x, v, a in zip(xs, values, above):
            ax.annotate(f"{v:.1f}", (x, v + a), textcoords="offset points", xytext=(0, 2), ha="center", fontsize=7)
            top = max(top, v + a)
    for i, w in enumerate(workloads):
        ratio = rows[i][next(n for n in ("served", "colocated", "sequential", "pipelined") if n in rows[i])]
        text = f"served / in-process {ratio['served_over_in_process']:.2f}"
        if ratio.get("served_over_in_process_paired") is not None:
            text += f"\n(paired, median {ratio['served_over_in_process_paired']:.2f}"
            if ratio.get("paired_mean_ci95"):
                text += f", mean's 95% CI {_interval(ratio['paired_mean_ci95'])}"
            text += ")"
        serving, idle = ratio.get("paired_served_over_ray_up"), ratio.get("paired_ray_up_over_in_process")
        if serving and idle and serving["mean"] is not None:
            text += f"\nserved path {_mean_interval(serving)} x Ray idle {_mean_interval(idle)}"
        ax.annotate(text, (i + 0.4 - width / 2, top * 1.12), ha="center", fontsize=7)
    ax.set_xticks([i + width * (len(series) - 1) / 2 for i in range(len(workloads))], workloads)
    ax.set_ylabel("tokens/s (greedy, one stream)")
    ax.set_ylim(0, top * 1.3)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=len(series))
    c = report["config"]
    ax.set_title(f"served vs in-process: target {c['target']} ({c.get('quantization', 'auto')} weights), "
                 f"draft {c['draft']}, γ={c['gamma']}\n"
                 f"{c['max_new_tokens']} new tokens, {c['prompts']} prompt(s) per workload, best of {c['repeats']} "
                 "repeat(s); whiskers: range", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
