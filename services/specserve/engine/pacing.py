"""When a streamed session's rounds go out: each at once, or, with an interval, the rounds that come within it of
the last message as one (as SGLang's and vLLM's `stream_interval` do in tokens). The target worker paces a
colocated session's messages to the coordinator with it, the coordinator its chunks to the ingress: on a small
CPU each message costs its relay (serializing, the wire, the next hop's thread and event loop, the client's
parsing) a fraction of a step. Under load the replica stretches each stream's interval so that its streams'
messages together stay under a rate (`stream_interval`)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

# load never stretches a stream's interval past this: a token still reaches its reader within about a quarter second
MAX_LOADED_INTERVAL_S = 0.25
CHUNKS_PER_CORE = 50.0  # the default rate: per core of the machine that relays the chunks (docs/benchmarks.md)


def default_chunk_rate() -> float:
    """Chunks a second all of a replica's streams may send together before their intervals stretch: 50 a core."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return CHUNKS_PER_CORE * cores


def stream_interval(base: float, streams: int, rate: float) -> float:
    """A stream's interval with `streams` open and at most `rate` chunks a second for all of them (0: no limit):
    `base`, or longer so that the streams' chunks stay within the rate, but not past MAX_LOADED_INTERVAL_S (nor
    below `base`); a base of 0 (a chunk per round) stays 0."""
    if not base or not rate:
        return base
    return max(base, min(MAX_LOADED_INTERVAL_S, streams / rate))


class Pacer:
    """`hold()` after each round: whether it waits for the next. A round is held while the next one, due as long
    after it as it came after the one before, still falls within `interval` seconds of the last that went, so a
    token waits at most about that long unless the rounds slow down. The first round goes at once (the first
    token's latency); 0: every round goes at once. The caller sends a finishing round whatever this says.
    interval: seconds, or a function that gives them now, asked at every round (a replica's, stretched by its load)."""

    def __init__(self, interval: float | Callable[[], float] = 0.0):
        self._interval = interval
        self.sent = self.arrived = None  # when the last message went, when the last round came

    @property
    def interval(self) -> float:
        return self._interval() if callable(self._interval) else self._interval

    def hold(self) -> bool:
        interval = self.interval
        if not interval:
            return False
        now = time.perf_counter()
        gap, self.arrived = (0.0 if self.arrived is None else now - self.arrived), now
        if self.sent is not None and now + gap - self.sent < interval:
            return True
        self.sent = now
        return False
