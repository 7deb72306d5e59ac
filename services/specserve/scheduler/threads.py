"""The torch (OpenMP) threads of a worker's or coordinator's threads: one compute thread with the cores, every
other thread on one (importing this costs only torch: the coordinator in a Serve replica uses it)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def torch_threads(n: int) -> None:
    """Give the calling thread `n` torch (OpenMP) threads, for good.

    torch.set_num_threads alone does not hold: a thread's first parallel op (or get_num_threads) runs torch's
    lazy per-thread init, which re-applies the count most recently set by ANY thread. A gRPC thread that set
    1 and then ran its first op after the compute thread had set 2 started a second OpenMP team in the
    process; with more OpenMP threads than cores libgomp stops spinning at barriers and the compute thread's
    forwards slow down (docs/benchmarks.md, served against in-process)."""
    torch.get_num_threads()  # the lazy init, now, so the count below is not overwritten later
    torch.set_num_threads(n)


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """torch ops on one thread meanwhile: ATen splits a long reduction (a sum over the vocabulary) among its
    threads, rounding with their number, and a session's tokens must not depend on the lane that judged it."""
    n = torch.get_num_threads()
    if n > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if n > 1:
            torch.set_num_threads(n)


def one_thread_torch() -> None:
    """Initializer for every thread of a worker or coordinator other than the compute thread: torch ops there
    (converting q, building a one-hot) run inline instead of starting an OpenMP team of their own: a second
    team in the process slows the compute thread's forwards (docs/benchmarks.md)."""
    torch_threads(1)
