"""Keep every listener of a local `specserve serve` on the host it was given.

`--host 127.0.0.1` must mean nothing answers on other interfaces. The
HTTP proxy takes the host from `http_options`; the rest need help:

- Ray itself (its services, the Prometheus metrics exporter, the autoscaler's
  and dashboard's metrics servers, and the addresses our workers bind, which
  are the node's): `ray.init` is given the host as the node's address when it
  is a loopback one, and Ray is told it runs on one machine, or it replaces a
  loopback address by the machine's own (`ray_init_options`).
- Serve's gRPC proxy binds `[::]:port` whatever the HTTP host is (Ray Serve
  2.x has no host option for it), and each replica its inter-deployment gRPC
  server on `[::]:0`: a worker-process setup hook rebinds them to the host
  (`bind_grpc_proxy_to_host`, run in every Ray worker process of the job; it
  changes nothing outside Serve's proxy and replicas).
"""

from __future__ import annotations

import ipaddress
import os
import pathlib
import signal
import socket
import time
from typing import Any

GRPC_HOST_ENV = "SPECSERVE_GRPC_HOST"
_HOOK = "specserve.serve.listen.bind_grpc_proxy_to_host"


def loopback(host: str) -> bool:
    """Whether `host` is this machine alone (a host name other than localhost is not known to be)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _wildcard(host: str) -> bool:
    return host in ("", "0.0.0.0", "::", "[::]")


def ray_init_options(host: str) -> dict[str, Any]:
    """Extra `ray.init` arguments for a local Ray serving on `host`."""
    options: dict[str, Any] = {}
    if loopback(host):
        options["_node_ip_address"] = "127.0.0.1"  # Ray's services, metrics and our workers on loopback only
        _single_machine_ray()
    if not _wildcard(host):
        options["runtime_env"] = {"worker_process_setup_hook": _HOOK, "env_vars": {GRPC_HOST_ENV: host}}
    return options


def _single_machine_ray() -> None:
    """Ray resolves a loopback node address to the machine's own (`services.resolve_ip_for_localhost`), and its
    agents then serve metrics on every interface, unless it runs as a one-machine Ray (its Windows/macOS mode):
    set here for this process and, through the environment, for the processes Ray starts."""
    from ray._private import ray_constants

    os.environ[ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


def bind_grpc_proxy_to_host() -> None:
    """Worker-process setup hook: Serve's gRPC proxy listens on $SPECSERVE_GRPC_HOST instead of every interface,
    and on a loopback host so do its replicas' inter-deployment gRPC servers (bound to `[::]:0`)."""
    host = os.environ.get(GRPC_HOST_ENV)
    if not host or _wildcard(host):
        return
    try:
        from ray.serve._private import default_impl, replica
    except ImportError:  # a Ray without Serve's proxy helpers: nothing to rebind
        return
    _rebind(default_impl, "add_grpc_address", host)
    if loopback(host):  # the proxy reaches a replica at the node's address, loopback there (`ray_init_options`)
        _rebind(replica, "add_port_to_grpc_server", host)


def _rebind(module, name: str, host: str) -> None:
    """module.name(server, "HOST:PORT") listens on `host` whatever HOST it is given."""
    original = getattr(module, name, None)
    if original is None or getattr(original, "specserve_host", None) == host:
        return
    bracketed = f"[{host}]" if ":" in host else host

    def bound(server, address: str):
        return original(server, f"{bracketed}:{address.rsplit(':', 1)[1]}")

    bound.specserve_host = host
    setattr(module, name, bound)


# Ports a local Ray takes by default once it starts (the dashboard agent's HTTP, the dashboard, the GCS, the
# autoscaler's and dashboard's metrics): free now, they would clash with it then.
RAY_DEFAULT_PORTS = frozenset({52365, 8265, 6379, 44217, 44227})


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the OS picks it) and a local Ray will not take, for servers started
    next."""
    while True:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in RAY_DEFAULT_PORTS:
            return port


def _running(pid: int) -> bool:
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def stop_processes(pids: set[int], grace_s: float = 10.0) -> list[int]:
    """Wait up to grace_s for pids to end, then SIGTERM the rest (SIGKILL 5 s later). Returns those signalled."""
    deadline = time.monotonic() + grace_s
    while (left := [p for p in pids if _running(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 2.0)):
        for pid in [p for p in left if _running(p)]:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + wait
        while any(_running(p) for p in left) and time.monotonic() < deadline:
            time.sleep(0.1)
    return left
