"""`specserve serve --config FILE` as a user runs it: a subprocess, real ports, Ctrl-C to stop."""

from __future__ import annotations

import ipaddress
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import grpc
import pytest
import requests
import yaml
from ray.autoscaler._private.constants import AUTOSCALER_METRIC_PORT
from ray.dashboard.consts import DASHBOARD_METRIC_PORT

from specserve.coordinator.metrics import scrape_until, total
from specserve.serve.listen import RAY_DEFAULT_PORTS, free_port
from specserve.v1 import generator_pb2, generator_pb2_grpc
from tests.conftest import save_tokenized_pair

pytestmark = pytest.mark.slow



def _listening(port: int) -> set[str]:
    """The local addresses TCP `port` listens on (Linux /proc/net/tcp{,6}; "::" / "0.0.0.0" = every interface)."""
    found = set()
    for name, width in (("tcp", 8), ("tcp6", 32)):
        path = pathlib.Path("/proc/net") / name
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state != "0A" or int(hex_port, 16) != port:  # 0A: LISTEN
                continue
            raw = bytes.fromhex(address)
            words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # each 32-bit word little-endian
            address = ipaddress.ip_address(words)
            found.add(str(getattr(address, "ipv4_mapped", None) or address))  # ::ffff:127.0.0.1 is 127.0.0.1
    return found


def _descendants(pid: int) -> set[int]:
    """pid and every process under it (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        found.add(p)
        todo.extend(children.get(p, []))
    return found


def _listening_pids(pids: set[int]) -> dict[int, int]:
    """The TCP ports `pids` listen on, each with the process whose file descriptors hold its socket."""
    inodes = {}
    for pid in pids:
        for fd in pathlib.Path(f"/proc/{pid}/fd").glob("*"):
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes[target[8:-1]] = pid
    found: dict[int, int] = {}
    for name in ("tcp", "tcp6"):
        path = pathlib.Path("/proc/net") / name
        for line in path.read_text().splitlines()[1:] if path.exists() else []:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                found[int(fields[1].split(":")[1], 16)] = inodes[fields[9]]
    return found


def _listeners(pids: set[int]) -> dict[int, set[str]]:
    """The TCP ports `pids` listen on, with their local addresses."""
    return {port: _listening(port) for port in _listening_pids(pids)}


def _cmdline(pid: int) -> str:
    return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")


def _wait_healthy(base: str, proc: subprocess.Popen, seconds: float = 180) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            if requests.get(base + "/health", timeout=2).status_code == 200:
                return
        except requests.RequestException:  # not listening yet, or still starting
            pass
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(1)
    raise AssertionError(f"{base}/health did not answer 200 within {seconds} s")


def test_serve_command_serves_and_stops_cleanly(tmp_path):
    root = save_tokenized_pair(tmp_path / "models")
    http_port, grpc_port, metrics_port, file_port = free_port(), free_port(), free_port(), free_port()
    config = {
        "http_options": {"host": "127.0.0.1", "port": file_port},
        "grpc_options": {"port": grpc_port},  # the Generator servicer function is added by specserve serve
        "applications": [{
            "name": "specserve", "route_prefix": "/", "import_path": "specserve.serve:build_app",
            "args": {"target": str(root / "target"), "draft": "ngram", "dtype": "float32", "model_name": "small",
                     "target_resources": {"torch_threads": 1}},
        }],
    }
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    # flags beside the file replace its values: the HTTP port and the model's name
    proc = subprocess.Popen([sys.executable, "-m", "specserve", "serve", "--config", str(path),
                             "--metrics-port", str(metrics_port), "--http-port", str(http_port),
                             "--model-name", "tiny", "--api-key", "open-sesame"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={k: v for k, v in os.environ.items() if k != "SPECSERVE_API_KEY"})
    base = f"http://127.0.0.1:{http_port}"
    key = {"Authorization": "Bearer open-sesame"}
    try:
        _wait_healthy(base, proc)
        body = {"prompt": "Hello", "max_tokens": 5, "temperature": 0}
        reply = requests.post(base + "/v1/completions", json=body, headers=key, timeout=60).json()
        assert reply["model"] == "tiny" and reply["usage"]["completion_tokens"] == 5
        # the API key (--api-key beside the file): 401 without it or with another, before the body is even read
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "open-sesame"}):
            for path_, sent in (("/v1/completions", body), ("/v1/completions", {"max_tokens": -1})):
                denied = requests.post(base + path_, json=sent, headers=headers, timeout=60)
                assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
            assert requests.get(base + "/v1/models", headers=headers, timeout=60).status_code == 401
        assert requests.get(base + "/v1/models", headers=key, timeout=60).json()["data"][0]["id"] == "tiny"
        stub = generator_pb2_grpc.GeneratorStub(grpc.insecure_channel(f"127.0.0.1:{grpc_port}"))
        request = generator_pb2.GenerateRequest(prompt="Hello", max_tokens=3)
        for call in (stub.Generate, lambda r, **kw: list(stub.GenerateStream(r, **kw))):
            with pytest.raises(grpc.RpcError) as err:
                call(request, metadata=(("authorization", "Bearer nope"),), timeout=60)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert stub.Generate(request, metadata=(("authorization", "Bearer open-sesame"),), timeout=60).completion_tokens == 3
        # HTTP and gRPC listen on the configured host only (Serve binds its gRPC proxy to [::] on its own)
        for port in (http_port, grpc_port):
            assert _listening(port) == {"127.0.0.1"}, (port, _listening(port))
        # so do Ray's plain-HTTP metrics servers: its exporter, the autoscaler's and the dashboard's
        assert _listening(metrics_port) == {"127.0.0.1"}, _listening(metrics_port)
        for port in (AUTOSCALER_METRIC_PORT, DASHBOARD_METRIC_PORT):
            assert _listening(port) <= {"127.0.0.1"}, (port, _listening(port))
        # and nothing the server started listens beyond loopback (Ray's gRPC services, Serve's replicas, ours)
        wide = {port: hosts for port, hosts in _listeners(_descendants(proc.pid)).items() if hosts - {"127.0.0.1"}}
        assert not wide, wide
        # the application's replica holds both ports itself (Serve's direct ingress), not Serve's proxy
        owners = _listening_pids(_descendants(proc.pid))
        replica = owners[http_port]
        # the target worker `specserve serve` started beside Serve's start is the one the replica uses: no second
        targets = [pid for pid in _descendants(proc.pid) if "TargetWorkerActor" in _cmdline(pid)]
        assert len(targets) == 1, [_cmdline(pid) for pid in targets]
        assert owners[grpc_port] == replica and "ServeReplica:specserve" in _cmdline(replica), _cmdline(replica)
        # the Prometheus endpoint of the Ray it started (Ray exports every 10 s by default)
        # (the completion and the keyed gRPC call: refused requests never reached the coordinator)
        metrics = scrape_until(f"http://127.0.0.1:{metrics_port}/metrics", "ray_specserve_requests_total", 2)
        assert total(metrics, "ray_specserve_requests_total", model="tiny") == 2
        assert total(metrics, "ray_specserve_generation_tokens_total") == 5 + 3
        # a replica that dies is replaced on the same ports
        os.kill(replica, signal.SIGKILL)
        _wait_healthy(base, proc)
        reply = requests.post(base + "/v1/completions", json=body, headers=key, timeout=60).json()
        assert reply["usage"]["completion_tokens"] == 5
        assert stub.Generate(request, metadata=(("authorization", "Bearer open-sesame"),), timeout=60).completion_tokens == 3
        owners = _listening_pids(_descendants(proc.pid))
        assert owners[http_port] == owners[grpc_port] != replica, (owners, replica)
        # the new replica took the same target worker over (it lives on, its models loaded)
        assert [pid for pid in _descendants(proc.pid) if "TargetWorkerActor" in _cmdline(pid)] == targets
        assert not _listening(file_port)
    finally:
        started = _descendants(proc.pid) - {proc.pid}
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output
    # returned = stopped: its processes have ended and its ports are free for the next start
    left = {pid for pid in started if pathlib.Path(f"/proc/{pid}").exists()
            and pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"}
    assert not left, [_cmdline(pid) for pid in left]
    assert not _listening(http_port) and not _listening(grpc_port)
    assert f"--http-port {http_port} replaces the config's http_options.port ({file_port})" in output
    assert "/v1/completions" in output and "shutting down" in output  # it told the user how to call it
    assert "ingress: the application's replica answers" in output
    assert "the target worker starts beside Serve's controller and proxy" in output
    assert f"127.0.0.1:{metrics_port}/metrics" in output


def test_serve_command_rejects_a_bad_config(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("applications:\n  - name: x\n    import_path: specserve.serve:build_app\n    args: {gamma: -3}\n")
    result = subprocess.run([sys.executable, "-m", "specserve", "serve", "--config", str(path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "gamma" in result.stderr


def test_serve_command_wants_a_key_beyond_loopback():
    result = subprocess.run([sys.executable, "-m", "specserve", "serve", "--host", "0.0.0.0",
                             "--http-port", str(free_port())], capture_output=True, text=True, timeout=120,
                            env={k: v for k, v in os.environ.items() if k != "SPECSERVE_API_KEY"})
    assert result.returncode == 2 and "no API key" in result.stderr and "--insecure" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and "Started a local Ray" not in result.stderr


def test_serve_command_says_a_port_is_taken():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "specserve", "serve", "--http-port", str(port)],
                                check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert f"HTTP port 127.0.0.1:{port} is in use" in result.stderr and "Traceback" not in result.stderr


def test_free_ports_leave_out_the_ports_a_local_ray_takes(monkeypatch):
    """A port the OS hands out now but a local Ray binds by default once it starts (the dashboard agent's 52365 is
    in the ephemeral range) is passed over: a test once got it for the metrics port and Ray refused to start."""
    from ray._private import ray_constants

    assert {ray_constants.DEFAULT_DASHBOARD_AGENT_LISTEN_PORT, ray_constants.DEFAULT_DASHBOARD_PORT,
            ray_constants.DEFAULT_PORT, AUTOSCALER_METRIC_PORT, DASHBOARD_METRIC_PORT} <= RAY_DEFAULT_PORTS
    handed = iter([52365, 44217, 40001])

    class Socket(socket.socket):
        def getsockname(self):
            return ("127.0.0.1", next(handed))

    monkeypatch.setattr(socket, "socket", Socket)
    assert free_port() == 40001
