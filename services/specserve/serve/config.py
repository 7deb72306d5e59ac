"""The serving application's arguments (Serve YAML `args:` / `specserve serve` flags), validated."""

from __future__ import annotations

from pydantic import Field, field_validator

from specserve.spec import make_controller
from specserve.workers.config import WorkersConfig


class AppConfig(WorkersConfig):
    """Models, placement and speculation settings of one specserve application."""

    model_name: str | None = Field(None, description="Model id clients pass as `model` (default: the target's name).")
    gamma: int | str = Field("auto", description="Default speculation depth: an int, 'auto' or 'heuristic'.")
    gamma_max: int = Field(8, ge=1, le=32, description="Deepest speculation auto/heuristic may choose.")
    pipelined: bool = Field(True, description="Draft block k+1 while the target verifies block k (model drafts).")
    default_max_tokens: int = Field(256, ge=1, description="max_tokens when a request does not say.")
    max_sessions: int = Field(64, ge=1, description="Concurrent sessions the coordinator runs.")

    @field_validator("gamma")
    @classmethod
    def _gamma(cls, value):
        make_controller(value, 8)
        return value
