"""The CLI on tiny local model directories: generate --json, and bench's JSON + PNG (model-draft path)."""

from __future__ import annotations

import json
import socket
import time

import pytest

from specserve.cli import main
from specserve.serve import ingress
from tests.conftest import save_tokenized_pair

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return save_tokenized_pair(tmp_path_factory.mktemp("models"))


def test_generate_json(model_dirs, capsys):
    args = ["generate", "Hello there", "--target", str(model_dirs / "target"), "--draft", str(model_dirs / "draft"),
            "--gamma", "3", "--temperature", "0", "--max-new-tokens", "12", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["token_ids"]) <= 12 and out["stats"]["rounds"] >= 1
    assert set(out["stats"]) >= {"acceptance_rate", "mean_accepted_length", "tokens_per_s", "gamma_history",
                                 "draft_time_s", "verify_time_s", "drafted", "accepted", "rounds"}
    assert main(args + ["--no-lookup"]) == 0  # the model draft alone: greedy, so the same tokens
    assert json.loads(capsys.readouterr().out)["token_ids"] == out["token_ids"]
    assert main(args + ["--dtype", "float64"]) == 0  # for checking exactness up to rounding (serve takes it too)
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) <= 12


def test_generate_bad_input_is_a_message_not_a_traceback(model_dirs, tmp_path, capsys):
    assert main(["generate", "x", "--target", str(model_dirs / "target"), "--top-p", "1.5"]) == 2
    assert "top_p" in capsys.readouterr().err
    assert main(["generate", "  ", "--target", str(model_dirs / "target")]) == 2
    assert "prompt" in capsys.readouterr().err
    assert main(["generate", "x", "--target", str(model_dirs / "target"), "--draft", str(tmp_path / "nope")]) == 2
    assert "not found" in capsys.readouterr().err


def test_bench_model_draft_writes_json_and_png(model_dirs, tmp_path, capsys):
    out = tmp_path / "bench"
    args = ["bench", "--quick", "--workloads", "code", "--target", str(model_dirs / "target"),
            "--draft", str(model_dirs / "draft"), "--dtype", "float32", "--out", str(out)]
    assert main(args) == 0
    report = json.loads((out / "bench.json").read_text())
    assert (out / "bench.png").stat().st_size > 10_000
    runs = {r["method"]: r for r in report["workloads"]["code"]["runs"]}
    assert {"target-only HF generate", "HF assisted (defaults)", "HF assisted k=4", "specserve auto"} <= set(runs)
    assert set(report["verify_cost"]) == {"float32", "bfloat16"}
    assert report["config"]["bf16_cpu_steps"].startswith(("specserve's CPU kernels", "torch's CPU kernels"))
    for run in runs.values():
        assert run["tokens"] > 0 and run["tokens_per_s"] > 0
        assert run["same_tokens_as_target_only"]  # fp32 greedy: every method emits the same tokens
    assert runs["specserve γ=4"]["alpha"] is not None and runs["specserve γ=4"]["theorem8_prediction"] > 0
    assert "auto_vs_best_fixed" in report["workloads"]["code"]["summary"]
    assert "[1/" in capsys.readouterr().out  # progress lines


def test_bench_rejects_more_prompts_than_the_suite_has(capsys):
    assert main(["bench", "--prompts", "7"]) == 2
    assert "--prompts must be 1-6" in capsys.readouterr().err
    assert main(["bench", "--served", "--prompts", "0"]) == 2
    assert "--prompts" in capsys.readouterr().err


def test_bench_served_compares_the_served_path_with_in_process(model_dirs, tmp_path):
    """Starts a local Ray + Serve and deploys three applications one after another (colocated; split sequential,
    pipelined): same text as in-process, and each one's metrics count its own requests only."""
    out = tmp_path / "served"
    # two repeats: the second runs its pair of in-process runs before the served request (mirrored order)
    args = ["bench", "--served", "--quick", "--repeats", "2", "--workloads", "code",
            "--target", str(model_dirs / "target"), "--draft", str(model_dirs / "draft"), "--dtype", "float32",
            "--out", str(out)]
    assert main(args) == 0
    row = json.loads((out / "served.json").read_text())["workloads"]["code"]
    assert (out / "served.png").stat().st_size > 5_000
    for name in ("colocated", "sequential", "pipelined"):
        assert row[name]["same_text_as_in_process"]
        assert row[name]["tokens_per_s"] > 0 and row[name]["rounds"] > 0
        assert row[name]["per_round_ms"]["worker_verify"] > 0
        # the paired gap and its two parts come from the same runs: served/frozen = served/beside x beside/frozen
        path, idle = row[name]["paired_served_over_ray_up"], row[name]["paired_ray_up_over_in_process"]
        assert len(row[name]["paired_ratios"]) == len(path["ratios"]) == len(idle["ratios"]) == 2
        for k in range(2):
            assert row[name]["paired_ratios"][k] == pytest.approx(path["ratios"][k] * idle["ratios"][k])
            # one prompt: the paired served rate is the repeat's own
            assert row[name]["paired_tokens_per_s"][k]["served"] == pytest.approx(row[name]["repeat_tokens_per_s"][k])
    assert row["pipelined_over_sequential"] > 0 and row["in_process_ray_up_tokens_per_s"] > 0
    metrics = json.loads((out / "served.json").read_text())["metrics"]
    for name in ("colocated", "sequential", "pipelined"):
        # one prompt: a warm-up request and two measured (--repeats 2), not the other applications' too
        assert metrics[name]["requests"] == metrics[name]["requests_sent"] == 3
        assert metrics[name]["rounds"] >= row[name]["rounds"]


def test_load_bench_in_process_drives_the_target_worker_from_threads(model_dirs, tmp_path, capsys):
    """--url inprocess: the load with nothing served (the target worker and its draft in this process, one thread a
    stream): every request answered in full, γ=0 drafting nothing; what it cannot run is refused with a message."""
    pair = ["--target", str(model_dirs / "target"), "--draft", str(model_dirs / "draft"), "--dtype", "float32"]
    args = ["bench", "--load", "--url", "inprocess", "--concurrency", "1,3", "--max-new-tokens", "6",
            "--load-requests", "2", "--load-configs", "gamma0,auto", "--out", str(tmp_path), *pair]
    assert main(args) == 0 and (tmp_path / "load.png").stat().st_size > 0
    report = json.loads((tmp_path / "load.json").read_text())
    assert report["config"]["url"] == "inprocess"
    for name in ("gamma0", "auto"):
        one, three = report["levels"][name]
        assert (one["requests"], three["requests"], one["errors"], three["errors"]) == (2, 6, 0, 0)
        assert (one["tokens"], three["tokens"]) == (2 * 6, 6 * 6)  # eos ignored: every answer max_tokens long
        assert three["aggregate_tokens_per_s"] > 0 and 0 < three["ttft_p50_s"] <= three["wall_s"]
    assert [level["mean_gamma"] for level in report["levels"]["gamma0"]] == [0, 0]
    capsys.readouterr()
    assert main([*args[:-len(pair) - 6], "--load-configs", "unbatched", "--out", str(tmp_path), *pair]) == 2
    assert "gamma0 and auto" in capsys.readouterr().err
    assert main([*args[:-len(pair)], "--target", str(model_dirs / "target"), "--draft", "ngram"]) == 2
    assert "needs a model draft" in capsys.readouterr().err


def test_ingress_plan_puts_the_replica_on_the_ports_where_one_application_serves_them(monkeypatch):
    import os

    from specserve.cli import build_parser
    from specserve.serve.run import config_from_flags, ports

    args = build_parser().parse_args(["serve", "--http-port", "8123", "--grpc-port", "9123"])
    config = config_from_flags(args)
    assert ingress.plan(config, "direct", None) is None
    assert ingress.plan(config, "proxy", None) == "--ingress proxy"
    assert "--address" in ingress.plan(config, "direct", "auto")
    two = {**config, "applications": config["applications"] * 2}
    assert "2 applications" in ingress.plan(two, "direct", None)
    prefixed = {**config, "applications": [{**config["applications"][0], "route_prefix": "/a"}]}
    assert "route_prefix '/a'" in ingress.plan(prefixed, "direct", None)
    assert ingress.ray_has_direct_ingress()  # this Ray: the settings exist (another falls back to the proxy)
    monkeypatch.setattr(ingress, "ray_has_direct_ingress", lambda: False)
    assert "no direct ingress" in ingress.plan(config, "direct", None)

    for name in ingress.direct_env(0, 0):
        monkeypatch.setenv(name, "")  # restored after the test: use_direct writes os.environ
    moved = ingress.use_direct(config, *ports(config))
    assert os.environ["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
    assert (os.environ["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"], os.environ["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"],
            os.environ["RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT"], os.environ["RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT"]) \
        == ("8123", "8124", "9123", "9124")
    host, http_port, grpc_port = ports(moved)
    assert host == "127.0.0.1" and {http_port, grpc_port}.isdisjoint({8123, 9123}) and http_port != grpc_port
    assert ports(config) == ("127.0.0.1", 8123, 9123)  # the config given is left as it was

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert ingress.port_in_use("127.0.0.1", port) and ingress.listening("127.0.0.1", port)
        started = time.monotonic()
        assert not ingress.wait_for_port("127.0.0.1", port, timeout_s=30)  # a listener: no waiting
        assert time.monotonic() - started < 5
    assert not ingress.port_in_use("127.0.0.1", port) and ingress.wait_for_port("127.0.0.1", port)


def test_a_port_held_by_a_closed_servers_connections_is_told_from_one_in_use():
    """A server that closed its connections first (as the replica's HTTP server does with urllib's requests) leaves
    them in TIME_WAIT on its port for a minute: the replica cannot bind it yet (no SO_REUSEADDR), nothing listens;
    `specserve serve` waits for such a port rather than refusing it."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = server.accept()
        accepted.close()  # the server's side closes first
        client.recv(1)
        client.close()
    assert ingress.port_in_use("127.0.0.1", port) and not ingress.listening("127.0.0.1", port)
    started = time.monotonic()
    assert not ingress.wait_for_port("127.0.0.1", port, timeout_s=1.5)  # still held after the time given
    assert time.monotonic() - started >= 1.5
