"""Speculation-depth (γ) controllers behind one small interface.

- `FixedGamma`: the same γ every round (γ=0 is plain target decoding).
- `HeuristicGamma`: Hugging Face's schedule, +2 after a fully accepted block,
  −1 otherwise; the baseline to beat.
- `AutoGamma`: a cost model. It keeps an EWMA of the acceptance at each draft
  position (per proposal quality class) and of the measured draft-step, verify and per-round overhead
  times — verify time as a function of the number of positions scored, since
  on a CPU it grows with γ — and picks the γ in 0..γ_max that maximises
  expected tokens per second. γ=0 wins when speculation does not pay.
  With a draft that can stop mid-block (a local model draft) it also decides
  token by token: acceptance is calibrated against the draft's confidence
  (its top probability); the draft goes on while a deeper block would raise
  the round's expected tokens per second, and drafted tokens not worth a
  verify position are dropped.
  Under load (a batched target step shared with other sessions) it learns the step's time as a function of
  the step's total tokens and maximises the batch's goodput instead of its own speed: a deeper block for one
  session makes every session's step slower, so the extra expected tokens must pay for that (`_StepCost`).
"""

from __future__ import annotations

import copy
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field


@dataclass
class RoundObservation:
    """What one speculation round showed a controller."""

    gamma: int  # depth requested
    drafted: int  # tokens the draft actually proposed (≤ gamma; n-gram drafts may propose fewer)
    accepted: int  # drafted tokens kept
    betas: list[float] = field(default_factory=list)  # expected acceptance Σmin(p,q) at positions 1..accepted+1
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    round_time_s: float = 0.0
    key: str | None = None  # the proposal's quality class (see `choose`)
    confidences: list[float] = field(default_factory=list)  # the draft's top probability at each token it drafted
    # the batched target step that verified the block (0 where unknown, e.g. in process): its new tokens, all
    # sessions, how many sessions shared it and its compute seconds
    step_tokens: int = 0
    step_sessions: int = 0
    step_time_s: float = 0.0
    step_prompt_tokens: int = 0  # of step_tokens and step_sessions, other sessions' prompt chunks
    step_prompt_sessions: int = 0
    # context tokens the model draft fed before its first drafted token: 1-2 while it drafts every round, more
    # after rounds it did not draft (a catch-up, timed with the draft); 0 where it did not draft or nobody counted
    draft_fed: int = 0


def expected_tokens_per_round(alpha: float, gamma: int) -> float:
    """(1 − α^(γ+1)) / (1 − α): tokens one round emits, bonus included (Leviathan Eq. 1)."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


class GammaController(ABC):
    name: str = "controller"
    max_gamma: int = 0  # the deepest γ this controller can ever choose

    @abstractmethod
    def choose(self, remaining: int | None = None, key: str | None = None, available: int | None = None,
               open_ended: bool = False, lag: int = 0) -> int:
        """γ for the next round.

        remaining: tokens still wanted (caps useless depth). For free drafts
        (n-gram) the proposal exists before γ is chosen: `key` is its quality
        class and `available` its length, and γ only trims it. open_ended: the
        draft will ask `keep_drafting` after each token, so γ is a ceiling.
        lag: context tokens a model draft's cache lacks, which it feeds before
        its first drafted token (1-2 while it drafts every round).
        """

    def keep_drafting(self, confidences: list[float], key: str | None = None) -> bool:
        """Whether a draft that has proposed len(confidences) tokens should propose one more."""
        return True

    def worth_verifying(self, confidences: list[float], key: str | None = None) -> int:
        """How many of an open-ended block's tokens to send to the target (the rest are dropped)."""
        return len(confidences)

    def update(self, obs: RoundObservation) -> None:  # noqa: B027 - optional hook
        """Feed back what the round showed."""

    @staticmethod
    def _cap(gamma: int, remaining: int | None, available: int | None = None) -> int:
        if remaining is not None:
            gamma = min(gamma, remaining - 1)
        if available is not None:
            gamma = min(gamma, available)
        return max(0, gamma)


class FixedGamma(GammaController):
    def __init__(self, gamma: int):
        if gamma < 0:
            raise ValueError(f"gamma must be >= 0, got {gamma}")
        self.gamma = self.max_gamma = gamma
        self.name = f"fixed:{gamma}"

    def choose(self, remaining: int | None = None, key: str | None = None, available: int | None = None,
               open_ended: bool = False, lag: int = 0) -> int:
        return self._cap(self.gamma, remaining, available)


class HeuristicGamma(GammaController):
    """+2 when every drafted token was accepted, −1 otherwise (never below 1)."""

    name = "heuristic"

    def __init__(self, initial: int = 5, gamma_max: int = 16):
        self.gamma = max(1, min(initial, gamma_max))
        self.gamma_max = self.max_gamma = gamma_max

    def choose(self, remaining: int | None = None, key: str | None = None, available: int | None = None,
               open_ended: bool = False, lag: int = 0) -> int:
        return self._cap(self.gamma, remaining, available)

    def update(self, obs: RoundObservation) -> None:
        if obs.gamma == 0:
            return
        if obs.drafted > 0 and obs.accepted == obs.drafted:
            self.gamma = min(self.gamma + 2, self.gamma_max)
        else:
            self.gamma = max(1, self.gamma - 1)


class _AcceptanceTable:
    """EWMA of the acceptance at each draft position, given the earlier positions were accepted."""

    def __init__(self, gamma_max: int, prior: float):
        self.acceptance = [prior] * (gamma_max + 1)  # index i = position i (1-based)
        self.observations = [0] * (gamma_max + 1)
        self.overall = prior

    def at(self, i: int) -> float:
        """Shrunk toward the table's overall EWMA until position i has a few observations."""
        n = self.observations[i]
        return (n * self.acceptance[i] + 3.0 * self.overall) / (n + 3.0)

    def update(self, betas: list[float], weight: float) -> None:
        for i, beta in enumerate(betas[: len(self.acceptance) - 1], start=1):
            self.acceptance[i] += weight * (beta - self.acceptance[i])
            self.observations[i] += 1
            self.overall += (weight / 2) * (beta - self.overall)


class _ConfidenceTable:
    """EWMA of the acceptance of a drafted token by the draft's confidence in it (ten bins of its top
    probability). The prior is the confidence itself: what a calibrated draft's greedy acceptance would be."""

    BINS = 10

    def __init__(self):
        self.acceptance = [(b + 0.5) / self.BINS for b in range(self.BINS)]
        self.first = [1.0 / self.BINS] * self.BINS  # EWMA of the share of blocks whose first token is in each bin
        self.firsts = 0  # blocks seen

    def _bin(self, confidence: float) -> int:
        return min(self.BINS - 1, max(0, int(confidence * self.BINS)))

    def at(self, confidence: float) -> float:
        return self.acceptance[self._bin(confidence)]

    def update(self, confidences: list[float], betas: list[float], weight: float) -> None:
        for confidence, beta in zip(confidences, betas):
            b = self._bin(confidence)
            self.acceptance[b] += weight * (beta - self.acceptance[b])
        first = self._bin(confidences[0])
        for b in range(self.BINS):
            self.first[b] += weight * ((b == first) - self.first[b])
        self.firsts += 1


class _StepCost:
    """Seconds of a batched target step as a function of its new tokens, t(N) = a + b·N: a least-squares
    fit over an EWMA of observed steps, its slope shrunk toward the single-session calibration's (steady load
    varies N little, so the data alone rarely pins the slope down)."""

    PRIOR = 4.0  # strength of the prior slope, in tokens² of spread

    def __init__(self, prior_slope: float, decay: float):
        self.prior_slope = max(0.0, prior_slope)
        self.decay = decay
        self.n = self.t = self.nn = self.nt = 0.0
        self.seen = 0
        # observed steps over the calibration's time for as many tokens: the prior slope is the calibration's
        # times this (concurrent steps on one core each run ~2x the two-core calibration, and so does a token)
        self.scale: float | None = None

    def rescale(self, ratio: float) -> None:
        self.scale = ratio if self.scale is None else self.scale + self.decay * (ratio - self.scale)

    def update(self, tokens: int, seconds: float) -> None:
        w = self.decay if self.seen else 1.0
        self.n += w * (tokens - self.n)
        self.t += w * (seconds - self.t)
        self.nn += w * (tokens * tokens - self.nn)
        self.nt += w * (tokens * seconds - self.nt)
        self.seen += 1

    def slope(self) -> float:
        var = max(0.0, self.nn - self.n * self.n)
        cov = self.nt - self.n * self.t
        prior = self.prior_slope * (self.scale or 1.0)
        return max(0.0, (cov + self.PRIOR * prior) / (var + self.PRIOR))

    def at(self, tokens: float) -> float:
        return max(1e-6, self.t + self.slope() * (tokens - self.n))


class AutoGamma(GammaController):
    """Maximise expected tokens per second from measured acceptance and costs.

    verify_profile: seconds for one target forward over n new positions,
    n = 1..γ_max+1 (a calibration; refined online). draft_step_s: seconds per
    draft token. pipelined: the draft of the next block overlaps the verify
    of this one, so a round costs max(γ·t_draft, t_verify) instead of the sum.
    Acceptance is kept per proposal key: an n-gram draft's 3-gram matches
    and 1-gram matches behave like different drafts.
    """

    name = "auto"
    # Under load a round speculates only where its extra tokens come this much faster than the shared step's
    # own tokens per second. What the model leaves out costs every session of the step there: the draft's
    # catch-up over the tokens of rounds that did not draft, and a draft step holding the target step back.
    # Without the margin auto fell below γ=0 at 4 streams (docs/benchmarks.md, batched serving under load).
    LOADED_MARGIN = 0.1
    # One round moves the draft's cost estimate at most to this many times its value: one step held up (a thread
    # descheduled on a shared machine) priced the draft out for good, as no draft could pay and auto stopped probing
    DRAFT_OUTLIER = 4.0
    # A round that gives no draft cost brings the estimate back toward the measured profile (the prior) by this
    # share, so a slowdown that priced the draft out passes; a draft that is slow in its profile stays out
    DRAFT_RELAX = 0.01
    # Blocks a draft that stops early starts before auto weighs how sure it usually is of a block's first token
    FIRST_BLOCKS = 8

    def __init__(
        self,
        gamma_max: int = 8,
        verify_profile: dict[int, float] | None = None,
        draft_step_s: float | None = None,
        prior_acceptance: float = 0.6,
        decay: float = 0.15,
        pipelined: bool = False,
        probe_every: int = 16,
    ):
        self.gamma_max = self.max_gamma = gamma_max
        self.decay = decay
        self.pipelined = pipelined
        self.probe_every = probe_every
        self.prior_acceptance = prior_acceptance
        self.tables: dict[str | None, _AcceptanceTable] = {}
        self.by_confidence: dict[str | None, _ConfidenceTable] = {}
        self.verify_s: dict[int, float] = dict(verify_profile or {})
        self.draft_step_s = self.profile_draft_step_s = draft_step_s
        self.overhead_s = 0.0
        self._rounds_at_zero = 0
        self.step_cost: _StepCost | None = None  # learned once batched steps report themselves
        self.load_sessions = 1.0  # EWMA of the sessions sharing this session's steps
        self.load_tokens = 0.0  # EWMA of the tokens of those steps
        self.own_positions = 1.0  # EWMA of the positions this session put into them
        self.tokens_per_round = 1.0  # EWMA of the tokens this session's rounds emitted

    # -- estimates -------------------------------------------------------
    def table(self, key: str | None = None) -> _AcceptanceTable:
        if key not in self.tables:
            self.tables[key] = _AcceptanceTable(self.gamma_max, self.prior_acceptance)
        return self.tables[key]

    def calibration(self, key: str | None = None) -> _ConfidenceTable:
        if key not in self.by_confidence:
            self.by_confidence[key] = _ConfidenceTable()
        return self.by_confidence[key]

    def _drafted_so_far(self, confidences: list[float], key: str | None) -> list[tuple[float, float]]:
        """(expected tokens of the round, chance all are accepted) with the first k drafted tokens verified,
        k = 0..len(confidences), each at its confidence-calibrated acceptance."""
        calibrated = self.calibration(key)
        tokens, survive = 1.0, 1.0
        out = [(tokens, survive)]
        for confidence in confidences:
            survive *= calibrated.at(confidence)
            tokens += survive
            out.append((tokens, survive))
        return out

    def expected_tokens(self, gamma: int, key: str | None = None) -> float:
        table = self.table(key)
        total, survive = 1.0, 1.0
        for i in range(1, gamma + 1):
            survive *= table.at(i)
            total += survive
        return total

    @property
    def loaded(self) -> bool:
        """Whether this session's steps are shared with others (then `_StepCost` prices its verify)."""
        return self.step_cost is not None and self.load_sessions > 1.25

    def others_tokens(self) -> float:
        """Tokens the other sessions of a step emit per round (credited to every choice alike: goodput)."""
        return (self.load_sessions - 1.0) * self.tokens_per_round if self.loaded else 0.0

    def verify_time(self, positions: int) -> float:
        if self.loaded:  # the step with the others' tokens and these positions
            return self.step_cost.at(max(0.0, self.load_tokens - self.own_positions) + positions)
        return self._profile_time(positions)

    def _profile_time(self, positions: float) -> float:
        """A lone session's verify of `positions` (the calibration, refined by its own rounds), interpolated."""
        if positions in self.verify_s:
            return self.verify_s[positions]
        known = sorted(self.verify_s)
        if not known:
            return 1.0 + 0.05 * (positions - 1)  # unitless guess until the first measurement
        if len(known) == 1:
            return self.verify_s[known[0]] * (1.0 + 0.05 * (positions - known[0]))
        lo = max([k for k in known if k < positions], default=known[0])
        hi = min([k for k in known if k > positions], default=known[-1])
        if lo == hi:  # extrapolate with the slope of the two nearest points
            lo, hi = (known[-2], known[-1]) if positions > known[-1] else (known[0], known[1])
        slope = (self.verify_s[hi] - self.verify_s[lo]) / (hi - lo)
        return max(1e-6, self.verify_s[lo] + slope * (positions - lo))

    def catch_up_time(self, lag: int) -> float:
        """What feeding a draft that lags `lag` tokens adds to a round's start under load (one draft step a token
        past the 1-2 of a draft that drafts every round): there it holds the shared step back, and a session
        rarely drafts the rounds after it that would share the cost (drafts resumed after rounds at γ=0 fed 20-48
        tokens and cost 16 streams ~10% against γ=0, docs/benchmarks-log.md). Alone, the rounds after it do."""
        return max(0, lag - 2) * (self.draft_step_s or 0.0) if self.loaded else 0.0

    def round_time(self, gamma: int) -> float:
        draft = gamma * (self.draft_step_s or 0.0)
        verify = self.verify_time(gamma + 1)
        core = max(draft, verify) if self.pipelined and gamma > 0 else draft + verify
        return core + self.overhead_s

    def warm_start(self, previous: AutoGamma) -> None:
        """Carry learned acceptance and costs over from an earlier request's controller."""
        self.tables = copy.deepcopy(previous.tables)
        self.by_confidence = copy.deepcopy(previous.by_confidence)
        self.verify_s = dict(previous.verify_s)
        self.draft_step_s = previous.draft_step_s
        self.profile_draft_step_s = previous.profile_draft_step_s
        self.overhead_s = previous.overhead_s
        self.step_cost = copy.deepcopy(previous.step_cost)
        self.load_sessions, self.load_tokens = previous.load_sessions, previous.load_tokens
        self.own_positions, self.tokens_per_round = previous.own_positions, previous.tokens_per_round

    def _beats_zero(self, tokens: float, seconds: float, others: float | None = None,
                    base_s: float | None = None) -> bool:
        """Whether a round expected to emit `tokens` of its own in `seconds` beats one without a draft (the
        other sessions' tokens of a shared step counted for both; under load by LOADED_MARGIN). others /
        base_s: `others_tokens()` and `round_time(0)` where the caller has them."""
        others = self.others_tokens() if others is None else others
        base_tokens, base_s = 1.0 + others, self.round_time(0) if base_s is None else base_s
        extra_s = seconds - base_s
        if extra_s <= 0:
            return tokens + others > base_tokens
        margin = self.LOADED_MARGIN if self.loaded else 0.0
        return (tokens + others - base_tokens) / extra_s > (1.0 + margin) * base_tokens / base_s

    def _could_pay(self, round_times: list[float], others: float, base_s: float) -> bool:
        """Whether a draft accepted every time would beat γ=0 at some γ (round_times[g - 1]: γ=g's round) at the
        costs known now. If not, no acceptance estimate can change the choice, and a probe (with the draft's
        catch-up over every token since it last ran) is pure cost: auto ran at 0.92-0.95x γ=0 with a draft as
        slow as its target."""
        return any(self._beats_zero(g + 1.0, s, others, base_s) for g, s in enumerate(round_times, 1))

    def expect_load(self, sessions: int) -> None:
        """`sessions` are open (this one included) as this controller starts: its first rounds take them as
        the load, before its own steps report it (a new session warm-started from one that ran alone would
        otherwise draft deep into a shared step)."""
        if sessions > self.load_sessions and self.step_cost is not None:
            self.load_tokens = max(self.load_tokens, sessions * self.own_positions)
            self.load_sessions = float(sessions)

    # -- interface ---------------------------------------------------------
    def choose(self, remaining: int | None = None, key: str | None = None, available: int | None = None,
               open_ended: bool = False, lag: int = 0) -> int:
        limit = self._cap(self.gamma_max, remaining, available)
        catch_up = self.catch_up_time(lag)
        # the γ worth drafting (beats γ=0) with the most tokens per second; one pass, every session every round
        # (under load a worker's sessions choose between its steps, so this is kept cheap)
        table, others, base_s = self.table(key), self.others_tokens(), self.round_time(0)
        best, best_rate = 0, (1.0 + others) / base_s
        tokens, survive, round_times = 1.0, 1.0, []
        for g in range(1, limit + 1):
            survive *= table.at(g)
            tokens += survive
            seconds = self.round_time(g) + catch_up
            round_times.append(seconds)
            rate = (tokens + others) / seconds
            if rate > best_rate and self._beats_zero(tokens, seconds, others, base_s):
                best, best_rate = g, rate
        if best == 0 and limit > 0 and self._could_pay(round_times, others, base_s):
            self._rounds_at_zero += 1
            # keep the acceptance estimate alive while not speculating. Under load a probe's draft step, and the
            # draft's catch-up over every token since it last drafted, hold back the step all S sessions share:
            # each session probes S² times less often, so the shared step sees a probe S times less often than
            # a session alone (probes as often as alone cost auto ~5% of γ=0's throughput at 4 streams)
            every = self.probe_every * (max(1, round(self.load_sessions)) ** 2 if self.loaded else 1)
            if self._rounds_at_zero % every == 0:
                return 1
        if open_ended and limit > 0 and self._start_pays(key, round_times, base_s):
            return limit
        return best

    def _start_pays(self, key: str | None, round_times: list[float], base_s: float) -> bool:
        """Whether to start a block that the draft ends where it is unsure. Alone: if the blocks' expected tokens
        per second beat γ=0's over how sure the draft has been of its first tokens (each bin's block verified as
        far as pays, or dropped with its first draft step paid), or, before FIRST_BLOCKS blocks, if a sure first
        token would pay. Under load, if the first token pays at its average acceptance: the start of every
        session's block holds the shared step back, and the best confidence bin is the exception there.
        round_times[g - 1]: γ=g's round, g = 1..the ceiling (as `choose` has them)."""
        table = self.table(key)
        if self.loaded:
            return self._beats_zero(1.0 + table.at(1), round_times[0])
        calibrated = self.calibration(key)
        if calibrated.firsts < self.FIRST_BLOCKS:
            return self._beats_zero(1.0 + max(calibrated.acceptance), round_times[0], base_s=base_s)
        later = [table.at(g) for g in range(2, len(round_times) + 1)]  # given the first accepted
        dropped_s, tokens, seconds = base_s + (self.draft_step_s or 0.0), 0.0, 0.0
        for share, accepted in zip(calibrated.first, calibrated.acceptance):
            best_tokens, best_s = 1.0, dropped_s
            expected, survive = 1.0 + accepted, accepted
            for g, s in enumerate(round_times, 1):
                if g > 1:
                    survive *= later[g - 2]
                    expected += survive
                if expected * best_s > best_tokens * s:
                    best_tokens, best_s = expected, s
            tokens += share * best_tokens
            seconds += share * best_s
        return self._beats_zero(tokens, seconds, base_s=base_s)

    def keep_drafting(self, confidences: list[float], key: str | None = None) -> bool:
        """Go on if drafting some more tokens raises the round's expected tokens per second.

        The tokens drafted so far survive with the product of their confidence-calibrated acceptances;
        tokens not yet drafted are credited with the position table's acceptances, as `choose` does.
        """
        drafted = len(confidences)
        if drafted >= self.gamma_max:
            return False
        tokens, survive = self._drafted_so_far(confidences, key)[-1]
        others = self.others_tokens()
        now = (tokens + others) / self.round_time(drafted)
        table = self.table(key)
        for more in range(drafted + 1, self.gamma_max + 1):
            survive *= table.at(more)
            tokens += survive
            if (tokens + others) / self.round_time(more) > now:
                return True
        return False

    def worth_verifying(self, confidences: list[float], key: str | None = None) -> int:
        """The count with the best expected tokens per second, the drafting of all of them already paid."""
        sunk = len(confidences) * (self.draft_step_s or 0.0) + self.overhead_s
        expected, others = self._drafted_so_far(confidences, key), self.others_tokens()
        return max(range(len(expected)), key=lambda k: (expected[k][0] + others) / (sunk + self.verify_time(k + 1)))

    def update(self, obs: RoundObservation) -> None:
        w = self.decay
        self.table(obs.key).update(obs.betas[: obs.drafted], w)
        if obs.confidences:
            self.calibration(obs.key).update(obs.confidences, obs.betas, w)
        positions = obs.drafted + 1
        self.tokens_per_round += w * (obs.accepted + 1 - self.tokens_per_round)
        if obs.step_sessions > 0:  # a batched step: learn its cost per token and the load around this session
            # prompt chunks in the step are a transient (taken as load, they made a drafted token look free): their
            # sessions count at this one's block size, and the step's cost is not fitted (attention over a prompt)
            prompts = obs.step_prompt_tokens > 0
            step_tokens = float(obs.step_tokens - obs.step_prompt_tokens
                                + obs.step_prompt_sessions * max(1.0, self.own_positions))
            if not prompts:
                if self.step_cost is None:
                    ns = sorted(self.verify_s)
                    slope = (self.verify_s[ns[-1]] - self.verify_s[ns[0]]) / (ns[-1] - ns[0]) if len(ns) > 1 else 0.0
                    self.step_cost = _StepCost(slope, w)
                self.step_cost.update(obs.step_tokens, obs.step_time_s)
                if self.verify_s:
                    self.step_cost.rescale(obs.step_time_s / self._profile_time(obs.step_tokens))
            if obs.step_sessions > self.load_sessions:  # load arrives at once (sessions start together): follow it
                self.load_sessions, self.load_tokens = float(obs.step_sessions), step_tokens
            else:  # and leaves gradually
                self.load_sessions += w * (obs.step_sessions - self.load_sessions)
                self.load_tokens += w * (step_tokens - self.load_tokens)
            self.own_positions += w * (positions - self.own_positions)
        if obs.verify_time_s > 0 and (obs.step_sessions <= 1 or not self.loaded):
            old = self.verify_s.get(positions)
            self.verify_s[positions] = obs.verify_time_s if old is None else old + w * (obs.verify_time_s - old)
        # Prompt-lookup blocks in front of a model draft (near-zero draft time) count here too: the lower step
        # makes auto draft deeper with the model, which measured faster on code (docs/benchmarks.md).
        steps = max(obs.drafted, len(obs.confidences))  # tokens drafted, verified or not
        # not from a catch-up: on a GPU its multi-token forward took ~5x a captured draft step, and learned as
        # the step's cost it kept auto at γ=0 where γ=3 paid 1.54x (docs/benchmarks.md)
        if steps > 0 and obs.draft_time_s > 0 and obs.draft_fed <= 2:
            step = obs.draft_time_s / steps
            self.draft_step_s = step if self.draft_step_s is None else \
                self.draft_step_s + w * (min(step, self.DRAFT_OUTLIER * self.draft_step_s) - self.draft_step_s)
        elif steps == 0 and None not in (self.draft_step_s, self.profile_draft_step_s):
            self.draft_step_s += self.DRAFT_RELAX * (self.profile_draft_step_s - self.draft_step_s)
        if obs.round_time_s > 0:
            # under load the step's compute is priced by `_StepCost`; waiting for a step is overhead
            verify = obs.step_time_s if self.loaded and obs.step_time_s > 0 else obs.verify_time_s
            core = max(obs.draft_time_s, verify) if self.pipelined else obs.draft_time_s + verify
            extra = max(0.0, obs.round_time_s - core)
            self.overhead_s += w * (extra - self.overhead_s)


class WarmStarts:
    """Hands each new `AutoGamma` what the previous one learned (acceptance, costs, load): one per engine or
    worker, whose requests then start where the last one left off. Other controllers pass through."""

    def __init__(self):
        self._last: AutoGamma | None = None
        self._lock = threading.Lock()

    def __call__(self, controller: GammaController) -> GammaController:
        if isinstance(controller, AutoGamma):
            with self._lock:
                if self._last is not None:
                    controller.warm_start(self._last)
                self._last = controller
        return controller


def parse_gamma(value: int | str, gamma_max: int | None = None) -> int | str:
    """A γ spec as users write it (flag, config, request): an int >= 0 or its digits (fixed; "fixed:N" too),
    "auto" or "heuristic", normalised to an int or the lower-case name. With `gamma_max` (a server's), a fixed
    γ deeper than it is refused: a γ of thousands made verifies of hundreds of positions, slowing every session
    sharing them. Raises ValueError with a message that a caller prefixes with the field's name."""
    if isinstance(value, str):
        spec = value.strip().lower()
        if spec in ("auto", "heuristic"):
            return spec
        if not spec.removeprefix("fixed:").isdigit():
            raise ValueError(f"must be an int >= 0, 'auto' or 'heuristic', got {value!r}")
        value = int(spec.removeprefix("fixed:"))
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"must be an int >= 0, 'auto' or 'heuristic', got {value!r}")
    if gamma_max is not None and value > gamma_max:
        raise ValueError(f"must be <= gamma_max ({gamma_max}) of this server, got {value}")
    return value


def make_controller(
    gamma: int | str,
    gamma_max: int = 8,
    verify_profile: dict[int, float] | None = None,
    draft_step_s: float | None = None,
    pipelined: bool = False,
) -> GammaController:
    """Controller from a user-facing spec (see `parse_gamma`)."""
    try:
        spec = parse_gamma(gamma)
    except ValueError as exc:
        raise ValueError(f"gamma: {exc}") from None
    if spec == "auto":
        return AutoGamma(gamma_max, verify_profile, draft_step_s, pipelined=pipelined)
    if spec == "heuristic":
        return HeuristicGamma(gamma_max=max(gamma_max, 1))
    return FixedGamma(spec)


def theorem8_speedup(alpha: float, gamma: int, c: float, verify_cost: float = 1.0) -> float:
    """Predicted walltime improvement: E[tokens]/(γc + v), v = verify(γ+1)/verify(1) (1 in the paper)."""
    if gamma == 0:
        return 1.0
    return expected_tokens_per_round(alpha, gamma) / (gamma * c + verify_cost)


__all__ = [
    "AutoGamma",
    "FixedGamma",
    "GammaController",
    "HeuristicGamma",
    "RoundObservation",
    "expected_tokens_per_round",
    "make_controller",
    "parse_gamma",
    "theorem8_speedup",
]
