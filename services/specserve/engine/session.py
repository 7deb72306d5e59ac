"""One place that assembles a speculation session: its γ controller and the loop over a proposer and a verifier.

The in-process decoder, a target worker with a colocated draft and the coordinator of a split placement each
bring their own proposer (a local model, one on the worker's step scheduler, a remote worker or n-gram lookup)
and verifier (local, scheduled, remote); `SessionFactory` gives all three the same controller (the γ spec
parsed once, `auto` calibrated once per factory and warm-started from the previous session) and the same
loop (`engine.loop.speculate`), so a seed and a fixed γ give the same tokens wherever a session runs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

from specserve.engine.loop import Round, speculate
from specserve.engine.proposers import Proposer
from specserve.speculation import GammaController, PositionRNG, SamplingParams, WarmStarts, make_controller, parse_gamma

CostProfile = tuple[dict[int, float] | None, float | None]  # (seconds per verify over n positions, per draft token)


class SessionFactory:
    """Sessions of one target and draft pairing.

    gamma: the default γ spec (see `parse_gamma`). has_draft: False runs every session at γ=0. cost_profile:
    what `auto` calibrates against, called once, on the first `auto` session (None: auto starts uncalibrated).
    pipelined: the proposer drafts the next block while the target verifies (a remote draft worker).
    """

    def __init__(self, vocab: int, eos_ids: set[int], *, gamma: int | str = "auto", gamma_max: int = 8,
                 has_draft: bool = True, cost_profile: Callable[[], CostProfile] | None = None,
                 pipelined: bool = False):
        self.vocab, self.eos_ids = vocab, set(eos_ids)
        self.gamma = gamma_spec(gamma)
        self.gamma_max = gamma_max
        self.has_draft = has_draft
        self.pipelined = pipelined
        self._measure = cost_profile
        self._profile: CostProfile | None = None
        self._lock = threading.Lock()
        self._warm_starts = WarmStarts()  # each session's auto starts from what the last one learned

    def cost_profile(self) -> CostProfile:
        """The calibration `auto` uses, measured on the first call (several sessions may ask at once)."""
        with self._lock:
            if self._profile is None:
                self._profile = self._measure() if self._measure is not None else (None, None)
            return self._profile

    def controller(self, gamma: int | str | None = None, open_sessions: int | None = None) -> GammaController:
        """A session's controller. open_sessions: sessions open where its target steps run, this one included
        (auto's first guess at the load; None: unknown)."""
        spec = self.gamma if gamma is None else gamma_spec(gamma)
        if not self.has_draft:
            spec = 0
        if spec != "auto":
            return make_controller(spec, self.gamma_max)
        verify, step = self.cost_profile()
        controller = self._warm_starts(make_controller("auto", self.gamma_max, verify or None, step, self.pipelined))
        if open_sessions is not None:
            controller.expect_load(open_sessions)
        return controller

    def rounds(self, prompt_ids: list[int], proposer: Proposer | None, verifier, controller: GammaController,
               params: SamplingParams, rng: PositionRNG, max_tokens: int,
               hit_stop: Callable[[list[int]], bool] | None = None) -> Iterator[Round]:
        """The session's rounds (see `engine.loop.speculate`); both sides are released when they end. rng: keyed
        by the seed the proposer and the verifier share."""
        return speculate(prompt_ids, proposer if self.has_draft else None, verifier, controller, params, rng,
                         max_tokens, self.vocab, self.eos_ids, hit_stop, pipelined=self.pipelined)


def gamma_spec(value: int | str) -> int | str:
    """`parse_gamma` for a caller's `gamma` argument: its errors name the argument."""
    try:
        return parse_gamma(value)
    except ValueError as exc:
        raise ValueError(f"gamma: {exc}") from None
