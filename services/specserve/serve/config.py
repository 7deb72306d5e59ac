"""The serving application's arguments (Serve YAML `args:` / `specserve serve` flags), validated."""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from specserve.speculation import parse_gamma
from specserve.workers.config import WorkersConfig


API_KEY_ENV = "SPECSERVE_API_KEY"


class AppConfig(WorkersConfig):
    """Models, placement and speculation settings of one specserve application."""

    model_name: str | None = Field(None, description="Model id clients pass as `model` (default: the target's name).")
    gamma: int | str = Field("auto", description="Default speculation depth: an int, 'auto' or 'heuristic'.")
    gamma_max: int = Field(8, ge=1, le=32, description="Deepest speculation auto/heuristic may choose.")
    pipelined: bool | Literal["auto"] = Field(
        "auto",
        description="Draft block k+1 while the target verifies block k (model drafts). 'auto': only when draft "
        "and target both have GPUs; on shared CPU cores the two forwards fight over the cores.",
    )
    draft_lookup: bool = Field(
        True,
        description="A model draft first looks the context up (prompt lookup, in the coordinator: no worker call) "
        "and is asked only where that finds nothing worth verifying; false: the model drafts every block.",
    )
    default_max_tokens: int = Field(256, ge=1, description="max_tokens when a request does not say.")
    max_tokens_limit: int = Field(
        16384, ge=1, le=2**31 - 1,
        description="The largest max_tokens a request may ask for (more: HTTP 400 / INVALID_ARGUMENT naming the "
        "field); the model's context bounds it further.",
    )
    max_prompt_tokens: int | None = Field(
        None, ge=1, description="The longest prompt in tokens a request may send (None: the model's context).")
    max_body_bytes: int = Field(
        4 * 1024 * 1024, ge=1024,
        description="The largest HTTP request body (HTTP 413, checked before it is parsed). gRPC messages are "
        "bounded by gRPC's own 4 MiB default (RESOURCE_EXHAUSTED).",
    )
    max_sessions: int = Field(
        64, ge=1, description="Concurrent sessions the coordinator runs; requests beyond it wait in a queue.")
    max_queued: int = Field(
        256, ge=0,
        description="Requests that may wait for a session slot, in arrival order (each takes the next slot that "
        "frees). One more is refused at once with HTTP 503 + Retry-After / gRPC RESOURCE_EXHAUSTED; 0: no queue.",
    )
    queue_timeout_s: float = Field(
        300.0, gt=0,
        description="How long a request waits for a slot before it is refused (HTTP 503 + Retry-After / gRPC "
        "RESOURCE_EXHAUSTED). A client that disconnects while it waits leaves the queue at once.",
    )
    stream_interval_ms: float = Field(
        40.0, ge=0, le=1000,
        description="A stream sends the tokens of rounds that come within this many milliseconds of its last chunk "
        "as one chunk (one SSE event / gRPC message), so a token waits at most about this long; 0: a chunk per "
        "round. A target worker that runs whole sessions (colocated draft) holds its messages to the replica the "
        "same way. Each chunk costs the relay and the client CPU that a small machine takes from the model.",
    )
    stream_chunks_per_s: float | None = Field(
        None, ge=0,
        description="The chunks a second all of a replica's streams send together before each stream's interval "
        "grows past stream_interval_ms: with N streams open it is N / this, at most 250 ms. Default: 50 per core of "
        "the replica's machine (100 on 2 cores: 16 streams send every 160 ms); 0: stream_interval_ms whatever the "
        "load.",
    )
    api_key: str | None = Field(
        None, repr=False, min_length=1, validate_default=True,
        description="Clients must send it (HTTP `Authorization: Bearer KEY`, gRPC metadata `authorization: Bearer "
        "KEY`); otherwise HTTP 401 / UNAUTHENTICATED. Default: the SPECSERVE_API_KEY environment variable where the "
        "config is validated, else no key (open, as on localhost). /health stays open for probes.",
    )
    num_replicas: int = Field(
        1, ge=1,
        description="Serve replicas of the application. Each starts workers of its own (the target, a draft, the "
        "coordinator) and serves the requests Serve routes to it: N replicas hold the models N times (on GPUs, "
        "N x the GPUs a target asks for). Several replicas answer through Serve's proxy.",
    )
    autoscaling_config: dict[str, Any] | None = Field(
        None,
        description="Serve's autoscaling_config for the application's replicas (min_replicas, max_replicas, "
        "target_ongoing_requests, upscale_delay_s, ...), instead of a fixed num_replicas; a replica added takes as "
        "long to start as the first (its models load).",
    )
    prestarted_target: str | None = Field(
        None,
        description="Set by `specserve serve`, not in configs: the target worker it started beside Serve's own "
        "start (a named Ray actor), which the replica adopts instead of starting one.",
    )
    insecure: bool = Field(
        False,
        description="Serve without an API key although the server listens beyond loopback (http_options.host "
        "0.0.0.0, a LAN address): without it `specserve serve` refuses to start so.",
    )
    special_tokens_in_messages: bool = Field(
        False,
        description="Chat message text that spells a special token (e.g. <|im_start|>) becomes that control token. "
        "Off: it is tokenized as the text it is, so a user cannot open a system turn of their own.",
    )
    restart_timeout_s: float = Field(
        120.0, gt=0,
        description="How long a session that lost a worker waits for Ray to restart it (model load included) before "
        "it fails with HTTP 503 / gRPC UNAVAILABLE.",
    )

    @field_validator("api_key", mode="before")
    @classmethod
    def _api_key_from_env(cls, value):
        return value if value is not None else os.environ.get(API_KEY_ENV) or None

    def pipelining(self) -> bool:
        if self.pipelined == "auto":
            return self.draft_resources.num_gpus > 0 and self.target_resources.num_gpus > 0
        return bool(self.pipelined)

    @model_validator(mode="after")
    def _autoscaling(self):
        if self.autoscaling_config is not None:
            from ray.serve.config import AutoscalingConfig

            try:
                AutoscalingConfig(**self.autoscaling_config)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"autoscaling_config: {exc}") from None
        return self

    @model_validator(mode="after")
    def _max_tokens(self):
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError(f"default_max_tokens: {self.default_max_tokens} exceeds max_tokens_limit "
                             f"{self.max_tokens_limit}")
        return self

    @model_validator(mode="after")
    def _gamma(self):
        try:
            self.gamma = parse_gamma(self.gamma, self.gamma_max)  # a fixed default no deeper than gamma_max
        except ValueError as exc:
            raise ValueError(f"gamma: {exc}") from None
        return self
