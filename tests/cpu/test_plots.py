"""The bench PNGs are drawn from their reports: configuration in the title, values and spread on the marks."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from specserve.bench import load, pair, plot, served  # noqa: E402


@pytest.fixture
def drawn(monkeypatch, tmp_path):
    """Every figure a plot function saves, kept open for inspection."""
    figures, close = [], plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: figures.append(fig))
    yield figures, tmp_path
    for fig in figures:
        close(fig)


def texts(fig) -> list[str]:
    return [t.get_text() for t in fig.findobj(matplotlib.text.Text)]


def test_bench_plot_shows_its_configuration_values_and_spread(drawn):
    figures, out = drawn
    runs = [{"method": "target-only", "family": "target", "speedup": 1.0, "theorem8_prediction": None,
             "repeat_speedups": [0.95, 1.0]},
            {"method": "specserve γ=3", "family": "specserve", "speedup": 1.8, "theorem8_prediction": 2.0,
             "repeat_speedups": [1.6, 1.8]}]
    report = {"config": {"target": "SmolLM2-135M-Instruct", "draft": "embedded-draft", "dtype": "bfloat16",
                         "device": "cpu", "threads": 2, "max_new_tokens": 48, "prompts": 1, "repeats": 2},
              "workloads": {"chat": {"runs": runs}}, "verify_cost": {"bfloat16": {"ratio": {"1": 1.0, "4": 1.3}}}}
    plot.plot_report(report, out / "bench.png")
    assert (out / "bench.png").stat().st_size > 10_000
    words = " ".join(texts(figures[0]))
    for expected in ("SmolLM2-135M-Instruct", "embedded-draft", "bfloat16", "best of 2 repeat(s)", "1.80×",
                     "speedup (× target-only tok/s)", "Theorem-8 prediction", "range over repeats", "1.30"):
        assert expected in words, expected
    whiskers = [c for c in figures[0].axes[0].containers if hasattr(c, "errorbar") and c.errorbar is not None]
    assert whiskers  # the spread over repeats is drawn


def test_load_and_served_plots_show_their_configuration_and_values(drawn):
    figures, out = drawn
    level = lambda v: {"aggregate_tokens_per_s": v, "ttft_p95_s": v / 100,  # noqa: E731
                       "runs_aggregate_tokens_per_s": [v - 1, v, v + 2]}
    report = {"config": {"target": "embedded", "draft": "default", "max_new_tokens": 64, "requests_per_stream": 2,
                         "sampling": "greedy, eos ignored", "url": None, "concurrency": [1, 4], "rounds": 3},
              "levels": {"gamma0": [level(20), level(61)], "auto": [level(33), level(70)]}}
    load._plot(report, out / "load.png")
    words = " ".join(texts(figures[-1]))
    for expected in ("gamma0 (γ=0, plain decoding, batched)", "auto (γ auto, batched)", "aggregate tokens/s",
                     "median of 3 rounds", "61", "0.70", "64 new tokens"):
        assert expected in words, expected
    row = lambda a: {"in_process_tokens_per_s": a, "in_process_before_ray_tokens_per_s": a - 1,  # noqa: E731
                     "in_process_after_ray_tokens_per_s": a, "in_process_ray_up_tokens_per_s": a - 4,
                     "colocated": {"tokens_per_s": a - 5, "repeat_tokens_per_s": [a - 6, a - 5],
                                   "served_over_in_process": (a - 5) / a, "served_over_in_process_paired": 0.93,
                                   "paired_mean_ci95": [0.84, 0.97],
                                   "paired_served_over_ray_up": served._pairs([0.95, 1.01, 0.98]),
                                   "paired_ray_up_over_in_process": served._pairs([0.93, 0.95])}}
    report = {"config": {"target": "embedded", "draft": "default", "gamma": 3, "max_new_tokens": 48, "prompts": 1,
                         "repeats": 2}, "workloads": {"chat": row(30.0), "code": row(45.0)}}
    served._plot(report, out / "served.png")
    words = " ".join(texts(figures[-1]))
    for expected in ("γ=3", "best of 2 repeat(s)", "served: colocated", "40.0", "tokens/s (greedy, one stream)",
                     "served / in-process 0.89", "(paired, median 0.93, mean's 95% CI 0.84-0.97)",
                     "served path 0.98 (0.91-1.05) x Ray idle 0.94 (0.81-1.07)"):
        assert expected in words, expected


def test_the_paired_ratios_confidence_interval_is_students():
    low, high = served.mean_ci95([0.8, 0.9, 1.0])  # mean 0.9, sd 0.1, t(2 df) = 4.30
    assert (low, high) == pytest.approx((0.9 - 4.30 * 0.1 / 3**0.5, 0.9 + 4.30 * 0.1 / 3**0.5))
    assert served.mean_ci95([0.9]) is None
    wide, narrow = served.mean_ci95([0.8, 1.0] * 2), served.mean_ci95([0.8, 1.0] * 20)
    assert narrow[0] > wide[0] and narrow[1] < wide[1]  # more pairs, a tighter interval around the same mean


def test_the_pair_plot_and_table_show_each_configuration(drawn, capsys):
    figures, out = drawn
    level = lambda n, v: {"concurrency": n, "aggregate_tokens_per_s": v}  # noqa: E731
    report = {"date": "2026-12-06", "cpu": "AMD EPYC, 2 cores, avx512_bf16", "levels": [1, 16], "max_tokens": 128,
              "runs": [{"name": "specserve (cold start)", "start_s": 97.8, "levels": []},
                       {"name": "specserve (warm start)", "start_s": 48.8, "levels": [level(1, 21.5), level(16, 60.25)]},
                       {"name": "llama-server", "start_s": 2.1, "levels": [level(1, 11.0), level(16, 37.4)]}]}
    pair._plot(report, out / "pair.png")
    words = " ".join(texts(figures[-1]))
    for expected in ("AMD EPYC, 2 cores, avx512_bf16", "128 tokens", "16 streams: tok/s", "llama-server", "21.5",
                     "37.4", "98", "start to healthy: s"):
        assert expected in words, expected
    pair._table(report)
    table = capsys.readouterr().out
    assert "specserve (cold start)" in table and "60.2" in table and "97.8" in table
