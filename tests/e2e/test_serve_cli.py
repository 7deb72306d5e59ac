"""`specserve serve --config FILE` as a user runs it: a subprocess, real ports, Ctrl-C to stop."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import pytest
import requests
import yaml

from specserve.coordinator.metrics import scrape_until, total
from tests.conftest import save_tokenized_pair

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_command_serves_and_stops_cleanly(tmp_path):
    root = save_tokenized_pair(tmp_path / "models")
    http_port, grpc_port, metrics_port = _free_port(), _free_port(), _free_port()
    config = {
        "http_options": {"host": "127.0.0.1", "port": http_port},
        "grpc_options": {"port": grpc_port},  # the Generator servicer function is added by specserve serve
        "applications": [{
            "name": "specserve", "route_prefix": "/", "import_path": "specserve.serve:build_app",
            "args": {"target": str(root / "target"), "draft": "ngram", "dtype": "float32", "model_name": "tiny",
                     "target_resources": {"torch_threads": 1}},
        }],
    }
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = subprocess.Popen([sys.executable, "-m", "specserve", "serve", "--config", str(path),
                             "--metrics-port", str(metrics_port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{http_port}"
    try:
        deadline = time.time() + 180
        while time.time() < deadline:
            try:
                if requests.get(base + "/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:  # not listening yet, or still starting
                pass
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(1)
        reply = requests.post(base + "/v1/completions", json={"prompt": "Hello", "max_tokens": 5, "temperature": 0},
                              timeout=60).json()
        assert reply["model"] == "tiny" and reply["usage"]["completion_tokens"] == 5
        # the Prometheus endpoint of the Ray it started (Ray exports every 10 s by default)
        metrics = scrape_until(f"http://127.0.0.1:{metrics_port}/metrics", "ray_specserve_requests_total", 1)
        assert total(metrics, "ray_specserve_requests_total", model="tiny") == 1
        assert total(metrics, "ray_specserve_generation_tokens_total") == 5
    finally:
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output
    assert "/v1/completions" in output and "shutting down" in output  # it told the user how to call it
    assert f"127.0.0.1:{metrics_port}/metrics" in output


def test_serve_command_rejects_a_bad_config(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("applications:\n  - name: x\n    import_path: specserve.serve:build_app\n    args: {gamma: -3}\n")
    result = subprocess.run([sys.executable, "-m", "specserve", "serve", "--config", str(path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "gamma" in result.stderr
