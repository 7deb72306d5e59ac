"""bench.json → bench.png: speedup per method and workload, with Theorem-8 predictions."""

from __future__ import annotations

import pathlib


def plot_report(report: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(report["workloads"])
    fig, axes = plt.subplots(len(workloads) + 1, 1, figsize=(11, 3.2 * (len(workloads) + 1)), squeeze=False)
    colors = {"target": "#999999", "hf-spec": "#e07b39", "specserve": "#3a7bd5"}
    for ax, workload in zip(axes[:, 0], workloads):
        runs = report["workloads"][workload]["runs"]
        x = range(len(runs))
        ax.bar(x, [r["speedup"] for r in runs], color=[colors[r["family"]] for r in runs])
        preds = [(i, r["theorem8_prediction"]) for i, r in enumerate(runs) if r["theorem8_prediction"]]
        if preds:
            ax.scatter(*zip(*preds), marker="_", s=300, color="black", label="Theorem-8 prediction", zorder=3)
            ax.legend(loc="upper left", fontsize=8)
        ax.axhline(1.0, color="black", linewidth=0.6)
        ax.set_xticks(list(x), [r["method"] for r in runs], rotation=35, ha="right", fontsize=7)
        ax.set_ylabel("speedup")
        ax.set_title(f"{workload}: speedup over target-only ({report['config']['target']}, {report['config']['dtype']})")
    ax = axes[-1, 0]
    for dtype, costs in report["verify_cost"].items():
        ns = sorted(int(n) for n in costs["ratio"])
        ax.plot(ns, [costs["ratio"][n] if n in costs["ratio"] else costs["ratio"][str(n)] for n in ns], marker="o", label=dtype)
    ax.set_xlabel("positions scored in one target forward (γ+1)")
    ax.set_ylabel("time / 1-token step")
    ax.set_title("verify cost")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
