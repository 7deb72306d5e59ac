"""Who answers a local `specserve serve`'s ports: the ingress replica itself, or Serve's proxy in front of it.

Through the proxy every request and every streamed chunk crosses one more
process (the proxy parses HTTP, then relays to the replica), which on a
small CPU box takes cores from the target's forward (docs/benchmarks.md,
"Serve's direct ingress"). With Serve's direct ingress the ingress replica
serves HTTP and gRPC on the configured ports itself; Serve still starts its
proxy on the head node, idle, on ports the OS picks on the same host.

It applies to a local Ray serving one application at `/` (`plan`): other
layouts share a port among applications, which only the proxy can do, and a
cluster joined with `--address` keeps its own proxies. Ray reads the
settings from the environment of the processes it starts (`use_direct`,
before `ray.init`): ports from a one-port range, so a restarted replica gets
the same one back at once (no quarantine), and no draining delay at
shutdown (nothing to deregister from on one machine).
"""

from __future__ import annotations

import copy
import os
import socket
import time
from typing import Any

from specserve.serve.listen import free_port


def plan(config: dict[str, Any], mode: str, address: str | None) -> str | None:
    """None where the ingress replica can answer the ports itself, else why the proxy stays (`mode`: direct|proxy)."""
    if mode == "proxy":
        return "--ingress proxy"
    if address:
        return "a Ray cluster joined with --address keeps its own proxies"
    if not ray_has_direct_ingress():
        return "this Ray Serve has no direct ingress settings"
    apps = config.get("applications") or []
    if len(apps) != 1:
        return f"{len(apps)} applications share the port through Serve's proxy"
    prefix = apps[0].get("route_prefix", "/")
    if prefix not in ("/", None):
        return f"route_prefix {prefix!r}: the proxy routes prefixes"
    args = apps[0].get("args") or {}
    if args.get("autoscaling_config") is not None or int(args.get("num_replicas", 1)) > 1:
        return "several replicas share the ports through Serve's proxy"
    return None


def ray_has_direct_ingress() -> bool:
    """Whether the installed Ray Serve reads the settings `direct_env` writes (Ray 2.60 does; they are internal)."""
    try:
        from ray.serve._private import constants
    except ImportError:
        return False
    return all(hasattr(constants, name) for name in direct_env(0, 0))


def port_in_use(host: str, port: int) -> bool:
    """Whether `host:port` cannot be bound now, as Serve's direct-ingress replica binds it (without SO_REUSEADDR):
    something listens there, or the connections a server just closed linger (TCP's TIME_WAIT, `listening` tells)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind(("" if host == "0.0.0.0" else host, port))
        except OSError:
            return True
    return False


def listening(host: str, port: int) -> bool:
    """Whether something accepts connections on `host:port`."""
    target = "127.0.0.1" if host in ("0.0.0.0", "") else "::1" if host == "::" else host
    try:
        with socket.create_connection((target, port), timeout=1.0):
            return True
    except OSError:
        return False


def wait_for_port(host: str, port: int, timeout_s: float = 75.0) -> bool:
    """Wait while only closed connections hold `host:port` (TIME_WAIT lasts 60 s on Linux); True once it is free,
    False at once where something listens there or still after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while port_in_use(host, port):
        if listening(host, port) or time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def direct_env(http_port: int, grpc_port: int) -> dict[str, str]:
    """Ray Serve's settings for an ingress replica on these two ports."""
    return {
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(http_port),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(http_port + 1),  # a range [min, max): this port alone
        "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": str(grpc_port),
        "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT": str(grpc_port + 1),
        "RAY_SERVE_PORT_QUARANTINE_S": "0",
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
    }


def use_direct(config: dict[str, Any], host: str, http_port: int, grpc_port: int) -> dict[str, Any]:
    """The config with Serve's (idle) proxy moved to free ports, and the environment that puts the ingress replica
    on `http_port` and `grpc_port`. Call before `ray.init`: the controller and replicas read it when they start."""
    os.environ.update(direct_env(http_port, grpc_port))
    moved = copy.deepcopy(config)
    pick = host if host and host != "0.0.0.0" and ":" not in host else "127.0.0.1"  # an IPv4 address to probe
    moved.setdefault("http_options", {})["port"] = free_port(pick)
    moved.setdefault("grpc_options", {})["port"] = free_port(pick)
    return moved
