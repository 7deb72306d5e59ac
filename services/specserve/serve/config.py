"""The serving application's arguments (Serve YAML `args:` / `specserve serve` flags), validated."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from specserve.spec import served_gamma
from specserve.workers.config import WorkersConfig


class AppConfig(WorkersConfig):
    """Models, placement and speculation settings of one specserve application."""

    model_name: str | None = Field(None, description="Model id clients pass as `model` (default: the target's name).")
    gamma: int | str = Field("auto", description="Default speculation depth: an int, 'auto' or 'heuristic'.")
    gamma_max: int = Field(8, ge=1, le=32, description="Deepest speculation auto/heuristic may choose.")
    pipelined: bool | Literal["auto"] = Field(
        "auto",
        description="Draft block k+1 while the target verifies block k (model drafts). 'auto': only when draft "
        "and target both have GPUs; on shared CPU cores the two forwards fight over the cores (measured 0.25-0.4x "
        "of sequential on 2 cores).",
    )
    draft_lookup: bool = Field(
        True,
        description="A model draft first looks the context up (prompt lookup, in the coordinator: no worker call) "
        "and is asked only where that finds nothing worth verifying; false: the model drafts every block.",
    )
    default_max_tokens: int = Field(256, ge=1, description="max_tokens when a request does not say.")
    max_sessions: int = Field(64, ge=1, description="Concurrent sessions the coordinator runs.")

    def pipelining(self) -> bool:
        if self.pipelined == "auto":
            return self.draft_resources.num_gpus > 0 and self.target_resources.num_gpus > 0
        return bool(self.pipelined)

    @model_validator(mode="after")
    def _gamma(self):
        try:
            served_gamma(self.gamma, self.gamma_max)  # a valid spec, and a fixed default no deeper than gamma_max
        except ValueError as exc:
            raise ValueError(f"gamma: {exc}") from None
        return self
