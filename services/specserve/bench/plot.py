"""bench.json → bench.png: speedup per method and workload, with Theorem-8 predictions.

Every panel says what was measured (target, draft, dtype, device, prompts, tokens, repeats) and carries its
values on the bars; a bar is the fastest repeat, its whisker the range over all repeats.
"""

from __future__ import annotations

import pathlib

COLORS = {"target": "#999999", "hf-spec": "#e07b39", "specserve": "#3a7bd5"}
STEP_MODES = {"eager": "eager", "runner": "step runner", "compiled": "step runner, compiled",
              "compiled-dynamic": "step runner, compiled, the batch a symbol"}
FAMILIES = {"target": "target only (no speculation)", "hf-spec": "HF assisted generation",
            "specserve": "specserve (γ fixed, auto, heuristic)"}


def caption(config: dict) -> str:
    """One line naming what a report measured."""
    quant = config.get("quantization", "none")
    weights = f"{config['dtype']}" + (f" ({quant} weights)" if quant != "none" else "")
    return (f"target {config['target']}, draft {config['draft']}, {weights} on {config['device']}"
            f" ({config.get('threads', '?')} threads), greedy, {config['max_new_tokens']} new tokens,"
            f" {config['prompts']} prompt(s) per workload, best of {config['repeats']} repeat(s)")


def plot_report(report: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    workloads = list(report["workloads"])
    fig, axes = plt.subplots(len(workloads) + 1, 1, figsize=(12, 3.6 * (len(workloads) + 1)), squeeze=False)
    for ax, workload in zip(axes[:, 0], workloads):
        runs = report["workloads"][workload]["runs"]
        x = list(range(len(runs)))
        speedups = [r["speedup"] for r in runs]
        spreads = [r.get("repeat_speedups") or [r["speedup"]] for r in runs]
        below = [max(0.0, s - min(v)) for s, v in zip(speedups, spreads)]
        above = [max(0.0, max(v) - s) for s, v in zip(speedups, spreads)]
        ax.bar(x, speedups, color=[COLORS[r["family"]] for r in runs], yerr=[below, above], capsize=3,
               error_kw={"elinewidth": 0.8, "ecolor": "#333333"})
        for i, value in enumerate(speedups):
            ax.annotate(f"{value:.2f}×", (i, value + above[i]), textcoords="offset points", xytext=(0, 2),
                        ha="center", fontsize=7)
        handles = [Patch(color=COLORS[f], label=FAMILIES[f]) for f in FAMILIES if any(r["family"] == f for r in runs)]
        preds = [(i, r["theorem8_prediction"]) for i, r in enumerate(runs) if r["theorem8_prediction"]]
        if preds:
            handles.append(ax.scatter(*zip(*preds), marker="_", s=300, color="black", zorder=3,
                                      label="Theorem-8 prediction (measured α, c, verify cost)"))
        ax.legend(handles=handles, loc="upper center", ncol=len(handles), fontsize=7)  # one row, above the bars
        ax.axhline(1.0, color="black", linewidth=0.6)
        ax.set_xticks(x, [r["method"] for r in runs], rotation=35, ha="right", fontsize=7)
        ax.set_ylabel("speedup (× target-only tok/s)")
        ax.set_ylim(0, max(s + a for s, a in zip(speedups, above)) * 1.35)
        ax.set_title(f"{workload}: speedup over target-only decoding (whiskers: range over repeats)", fontsize=10)
    ax = axes[-1, 0]
    for dtype, costs in report["verify_cost"].items():
        ns = sorted(int(n) for n in costs["ratio"])
        values = [costs["ratio"][n] if n in costs["ratio"] else costs["ratio"][str(n)] for n in ns]
        ax.plot(ns, values, marker="o", label=dtype)
        for n, value in zip(ns, values):
            ax.annotate(f"{value:.2f}", (n, value), textcoords="offset points", xytext=(0, 5), ha="center", fontsize=7)
    ax.set_xlabel("positions scored in one target forward (γ+1)")
    ax.set_ylabel("time (× one-token forward)")
    ax.set_title("verify cost: a target forward over γ+1 positions against one over 1", fontsize=10)
    ax.legend(title="dtype", fontsize=8)
    fig.suptitle(caption(report["config"]), fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_dataplane(report: dict, path: pathlib.Path) -> None:
    """dataplane.json → one PNG: per shape, step time against sequences (eager, step runner, compiled, floor;
    1 and γ+1 tokens each); acceptance time, batched and block by block; one stream's tok/s per configuration,
    Hugging Face beside it; aggregate tok/s under load per γ. Panels of parts not run are left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(r["shape"] for r in report["steps"]))
    panels = [("steps", s) for s in shapes]
    one_stream = report["rounds"] or report["hf"] or report.get("gammas")
    panels += [(part, None) for part, ran in (("accept", report.get("accept")), ("one stream", one_stream),
                                              ("load", report["load"])) if ran]
    if not panels:
        return
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 3.8 * len(panels)), squeeze=False)
    for ax, (kind, shape) in zip(axes[:, 0], panels):
        if kind == "steps":
            rows = [r for r in report["steps"] if r["shape"] == shape]
            for width in sorted({r["width"] for r in rows}):
                for mode, style in zip(STEP_MODES, ("o-", "s-", "^-", "v-")):
                    line = [r for r in rows if r["width"] == width and r["mode"] == mode]
                    if line:
                        ax.plot([r["sequences"] for r in line], [r["step_ms"] for r in line], style,
                                label=f"{STEP_MODES[mode]}, {width} token(s) per sequence")
                floor = [r for r in rows if r["width"] == width and r["mode"] == rows[0]["mode"]]
                ax.plot([r["sequences"] for r in floor], [r["floor_ms"] for r in floor], "k--", linewidth=0.8,
                        label=f"bandwidth floor, {width} token(s)")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("sequences in the step")
            ax.set_ylabel("step time (ms)")
            ax.set_title(f"{shape} shape: one pooled step against its floor "
                         f"({rows[0]['bandwidth_gb_s']:.0f} GB/s copy bandwidth)", fontsize=10)
        elif kind == "accept":
            rows = report["accept"]
            for key, label in (("together_ms", "all blocks at once (judge_many)"), ("one_by_one_ms", "block by block")):
                ax.plot([r["sequences"] for r in rows], [r[key] for r in rows], "o-", label=label)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("verify blocks in the step")
            ax.set_ylabel("acceptance time (ms)")
            ax.set_title(f"accepting one step's blocks (γ={rows[0]['gamma']}, vocabulary {rows[0]['vocab']}, T=1)",
                         fontsize=10)
        elif kind == "one stream":
            bars = [(f"{r['target']} {r['config']} γ={r['gamma']} α={r['alpha']}", r["tok_s"]) for r in report["rounds"]]
            bars += [(f"{r['target']} in-process γ={r['gamma']} α={r['alpha']}", r["tok_s"])
                     for r in report.get("gammas", [])]
            bars += [(f"{r['target']} {r['config']} α={r['alpha']}", r["tok_s"]) for r in report["hf"]]
            ax.bar(range(len(bars)), [v for _, v in bars],
                   color=["#e07b39" if label.split()[1] == "hf" else "#3a7bd5" for label, _ in bars])
            for i, (_, value) in enumerate(bars):
                ax.annotate(f"{value:.0f}", (i, value), textcoords="offset points", xytext=(0, 2), ha="center",
                            fontsize=7)
            ax.set_xticks(range(len(bars)), [label for label, _ in bars], rotation=35, ha="right", fontsize=7)
            ax.set_ylabel("tok/s, one stream")
            ax.set_title("one stream: specserve configurations (blue) and Hugging Face generate (orange)", fontsize=10)
            continue  # the colours are the legend
        else:
            rows = report["load"]
            for target in dict.fromkeys(r["target"] for r in rows):
                for gamma in dict.fromkeys(r["gamma"] for r in rows):
                    line = [r for r in rows if r["target"] == target and r["gamma"] == gamma]
                    ax.plot([r["streams"] for r in line], [r["tok_s"] for r in line], "o-", label=f"{target}, γ={gamma}")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent streams")
            ax.set_ylabel("aggregate tok/s")
            ax.set_title("under load: colocated sessions, γ=0 against auto", fontsize=10)
        levels = sorted({x for line in ax.get_lines() for x in line.get_xdata()})
        ax.set_xticks(levels, [str(int(x)) for x in levels])
        ax.legend(fontsize=7)
    quant = report["args"].get("quantization", "none")
    fig.suptitle(f"specserve data plane on {report['device']} (torch {report['torch']}); random-weight shapes"
                 + (f", target weights {quant}" if quant != "none" else ""), fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(path, dpi=110)
    plt.close(fig)
