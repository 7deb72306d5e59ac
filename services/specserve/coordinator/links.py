"""gRPC stubs that follow worker actors through Ray restarts.

A worker is a restartable Ray actor: when its process dies, Ray starts a
replacement that loads the model again and listens on a new port. A
`WorkerLink` holds the stub the coordinator's sessions call and, when a call
finds the worker gone, asks Ray (not gRPC) for the worker's address: Ray
answers once the replacement is up. The sessions then start again on it
from the tokens they had committed (`Coordinator`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import grpc

from specserve.rpc.auth import worker_channel

log = logging.getLogger("specserve.coordinator")

# A worker that is gone (connection refused or reset) or that no longer knows the session (it restarted
# between two calls, or dropped the session as idle): the session can go on from its committed tokens.
RESUMABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND)


class WorkerLost(RuntimeError):
    """A worker did not come back within the restart timeout (HTTP 503 / gRPC UNAVAILABLE)."""


def resumable(exc: BaseException) -> bool:
    return isinstance(exc, grpc.RpcError) and exc.code() in RESUMABLE


class WorkerLink:
    """One worker's stub. actor: its Ray handle (None: a fixed address, e.g. in-process tests; no recovery)."""

    def __init__(self, role: str, stub_class, address: str, actor: Any = None, token: str | None = None):
        self.role = role
        self.token = token
        self.stub_class = stub_class
        self.actor = actor
        self._lock = threading.Lock()
        self.recovering = False  # /health reports the worker as down meanwhile
        self._connect(address)

    def _connect(self, address: str) -> None:
        self.address = address
        self.stub = self.stub_class(worker_channel(address, self.token))

    def reconnect(self, deadline: float, cancelled=lambda: False) -> None:
        """Wait until the worker answers Ray again (its replacement, after a crash), then point the stub at its
        address. Raises WorkerLost past `deadline` (time.monotonic()) or once `cancelled()` (the session's consumer
        is gone). Sessions that lose the worker together wait for one reconnect."""
        if self.actor is None:
            raise WorkerLost(f"the {self.role} worker is unreachable")
        import ray

        with self._lock:
            self.recovering = True
            try:
                while True:
                    left = deadline - time.monotonic()
                    if left <= 0 or cancelled():
                        raise WorkerLost(f"the {self.role} worker did not come back in time")
                    try:
                        # a future, not ray.get: this runs on a session thread of an asyncio actor
                        address = self.actor.address.remote().future().result(timeout=min(left, 10.0))
                        break
                    except (ray.exceptions.RayActorError, TimeoutError) as exc:
                        # not restarted yet (Ray may still be noticing the death); calls queue once it restarts
                        log.debug("waiting for the %s worker: %s", self.role, type(exc).__name__)
                        time.sleep(0.2)
                if address != self.address:
                    log.warning("the %s worker is back at a new address; sessions continue there", self.role)
                    # the old channel is left to the garbage collector: a session may still hold its stub (a call
                    # on it fails UNAVAILABLE and resumes; on a closed channel it would raise ValueError)
                    self._connect(address)
            finally:
                self.recovering = False
