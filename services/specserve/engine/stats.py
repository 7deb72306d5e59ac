"""Per-generation speculation statistics (defined once, used by CLI, bench and serving)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specserve.engine.loop import Round


@dataclass
class GenerationStats:
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0  # tokens the rounds produced (accepted + one per round), before truncation
    # γ each round: the depth asked for, or for a draft that stops early (a local model draft) the depth it went to
    gamma_history: list[int] = field(default_factory=list)
    accepted_history: list[int] = field(default_factory=list)  # draft tokens kept each round
    lookup_rounds: int = 0  # rounds whose block came from prompt lookup in front of a model draft
    accepted_per_position: list[int] = field(default_factory=list)  # [i] = rounds whose draft token i+1 was kept
    drafted_per_position: list[int] = field(default_factory=list)
    prefill_time_s: float = 0.0
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    worker_verify_time_s: float = 0.0  # compute time of the target steps, where a worker reports it
    total_time_s: float = 0.0
    new_tokens: int = 0
    controller: str = ""
    resumes: int = 0  # served: times the session went on on a restarted worker
    queue_time_s: float = 0.0  # served: how long the request waited for a session slot
    cached_tokens: int = 0  # prompt tokens the target's prefix cache supplied (its first prefill's; not a resume's)

    @property
    def acceptance_rate(self) -> float:
        """Fraction of drafted tokens accepted."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per round, the bonus/correction token included (vLLM's definition)."""
        return self.emitted / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_time_s if self.total_time_s > 0 else 0.0

    def record(self, rnd: Round) -> None:
        """Count one `engine.loop.Round` (where the round is consumed, once)."""
        drafted, accepted = len(rnd.drafted), rnd.accepted
        if not self.rounds:
            self.cached_tokens = rnd.cached_tokens
        self.rounds += 1
        self.lookup_rounds += rnd.looked_up
        self.drafted += drafted
        self.accepted += accepted
        self.emitted += accepted + 1
        self.gamma_history.append(rnd.gamma)
        self.accepted_history.append(accepted)
        self.prefill_time_s += rnd.prefill_time_s
        self.draft_time_s += rnd.draft_time_s
        self.verify_time_s += rnd.verify_time_s
        self.worker_verify_time_s += rnd.step_time_s
        grow = drafted - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position.extend([0] * grow)
            self.accepted_per_position.extend([0] * grow)
        for i in range(drafted):
            self.drafted_per_position[i] += 1
            self.accepted_per_position[i] += i < accepted

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(
            acceptance_rate=self.acceptance_rate,
            mean_accepted_length=self.mean_accepted_length,
            tokens_per_s=self.tokens_per_s,
        )
        return d


@dataclass
class StepInfo:
    """What the target step that served a piece of work looked like (for the γ cost model and metrics)."""

    tokens: int = 0  # new tokens in the step's forward, all sessions
    sessions: int = 0
    seconds: float = 0.0  # the step's forward and acceptance
    prompt_tokens: int = 0  # of `tokens` and `sessions`, prompt chunks' (prefills): a transient, not the load of
    prompt_sessions: int = 0  # the steps to come
