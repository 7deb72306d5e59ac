"""When a streamed session's rounds go out: each at once, or, with an interval, the rounds that come within it of
the last message as one (as SGLang's and vLLM's `stream_interval` do in tokens). The target worker paces a
colocated session's messages to the coordinator with it, the coordinator its chunks to the ingress: on a small
CPU each message costs its relay (serializing, the wire, the next hop's thread and event loop, the client's
parsing) a fraction of a step."""

from __future__ import annotations

import time


class Pacer:
    """`hold()` after each round: whether it waits for the next. A round is held while the next one, due as long
    after it as it came after the one before, still falls within `interval` seconds of the last that went, so a
    token waits at most about that long unless the rounds slow down. The first round goes at once (the first
    token's latency); 0: every round goes at once. The caller sends a finishing round whatever this says."""

    def __init__(self, interval: float = 0.0):
        self.interval = interval
        self.sent = self.arrived = None  # when the last message went, when the last round came

    def hold(self) -> bool:
        if not self.interval:
            return False
        now = time.perf_counter()
        gap, self.arrived = (0.0 if self.arrived is None else now - self.arrived), now
        if self.sent is not None and now + gap - self.sent < self.interval:
            return True
        self.sent = now
        return False
