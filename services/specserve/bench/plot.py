"""bench.json → bench.png: speedup per method and workload, with Theorem-8 predictions.

Every panel says what was measured (target, draft, dtype, device, prompts, tokens, repeats) and carries its
values on the bars; a bar is the fastest repeat, its whisker the range over all repeats.
"""

from __future__ import annotations

import pathlib

COLORS = {"target": "#999999", "hf-spec": "#e07b39", "specserve": "#3a7bd5"}
FAMILIES = {"target": "target only (no speculation)", "hf-spec": "HF assisted generation",
            "specserve": "specserve (γ fixed, auto, heuristic)"}


def caption(config: dict) -> str:
    """One line naming what a report measured."""
    return (f"target {config['target']}, draft {config['draft']}, {config['dtype']} on {config['device']}"
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
