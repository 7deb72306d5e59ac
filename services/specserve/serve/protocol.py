"""Request validation shared by the HTTP (OpenAI-compatible) and gRPC ingress.

Both front ends turn their request into a `GenerationInput`; `prepare`
checks it against the served model and tokenizes it into the coordinator's
`SessionRequest`. Every rejection is a `PromptError` naming the field, which
the front ends map to HTTP 400 (OpenAI error shape, `param` = field) or gRPC
INVALID_ARGUMENT.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, ValidationError

from specserve.coordinator import SessionRequest
from specserve.engine.prompts import PromptCodec, PromptError
from specserve.spec import SamplingParams, served_gamma


@dataclass
class GenerationInput:
    prompt: Any  # str, list[int] or chat messages
    prompt_field: str
    model: str | None = None
    max_tokens: int | None = None
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams fields the client set
    gamma: int | str | None = None


class RequestLimits(Protocol):
    """What `prepare` checks a request against (AppConfig has these fields)."""

    default_max_tokens: int
    max_tokens_limit: int
    max_prompt_tokens: int | None
    gamma_max: int


def sampling_params(values: dict[str, Any], prefix: str = "") -> SamplingParams:
    try:
        return SamplingParams(**values)
    except ValidationError as exc:
        first = exc.errors()[0]
        name = ".".join(str(part) for part in first["loc"])
        raise PromptError(prefix + name, first["msg"]) from None


def prepare(inp: GenerationInput, codec: PromptCodec, served_model: str, limits: RequestLimits,
            field_prefix: str = "") -> SessionRequest:
    """Validate and tokenize; raises PromptError naming the offending field."""
    if inp.model and inp.model != served_model:
        raise PromptError("model", f"unknown model {inp.model!r}; this server serves {served_model!r}")
    if inp.max_tokens is not None and inp.max_tokens < 1:
        raise PromptError("max_tokens", f"must be >= 1, got {inp.max_tokens}")
    if inp.max_tokens is not None and inp.max_tokens > limits.max_tokens_limit:
        raise PromptError("max_tokens", f"must be <= {limits.max_tokens_limit} on this server, got {inp.max_tokens}")
    gamma = inp.gamma
    if gamma not in (None, ""):
        try:
            served_gamma(gamma, limits.gamma_max)
        except ValueError as exc:
            raise PromptError("gamma", str(exc)) from None
    else:
        gamma = None
    params = sampling_params(inp.sampling, field_prefix)
    prompt_ids = codec.encode(inp.prompt, inp.prompt_field)
    if limits.max_prompt_tokens is not None and len(prompt_ids) > limits.max_prompt_tokens:
        raise PromptError(inp.prompt_field, f"has {len(prompt_ids)} tokens; this server accepts at most "
                          f"{limits.max_prompt_tokens} (max_prompt_tokens)")
    room = codec.check_length(prompt_ids, inp.prompt_field)
    max_tokens = inp.max_tokens or limits.default_max_tokens
    if room is not None:
        max_tokens = min(max_tokens, room)
    return SessionRequest(prompt_ids, params, max_tokens, gamma)


def stats_summary(stats: dict[str, Any] | None) -> dict[str, Any]:
    """The per-request speculation statistics clients see (the `specserve` object / SpeculationStats)."""
    stats = stats or {}
    keys = ("rounds", "drafted", "accepted", "acceptance_rate", "mean_accepted_length", "gamma_history",
            "draft_time_s", "verify_time_s", "worker_verify_time_s", "tokens_per_s", "controller")
    return {k: stats[k] for k in keys if k in stats}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


# -- OpenAI HTTP bodies ------------------------------------------------------------
class _OpenAIRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # clients send fields we do not use (user, n=1, ...)

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension (extra_body)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    ignore_eos: bool = False  # extension
    gamma: int | str | None = None  # extension: speculation depth for this request
    n: int = 1

    def sampling(self) -> dict[str, Any]:
        values: dict[str, Any] = {"ignore_eos": self.ignore_eos}
        for name in ("temperature", "top_p", "top_k", "seed"):
            if getattr(self, name) is not None:
                values[name] = getattr(self, name)
        if self.stop:
            values["stop"] = [self.stop] if isinstance(self.stop, str) else self.stop
        return values

    def check(self) -> None:
        if self.n != 1:
            raise PromptError("n", "only n=1 is supported")


class CompletionRequest(_OpenAIRequest):
    prompt: str | list[int]

    def to_input(self) -> GenerationInput:
        self.check()
        return GenerationInput(self.prompt, "prompt", self.model, self.max_tokens, self.sampling(), self.gamma)


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatCompletionRequest(_OpenAIRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None

    def to_input(self) -> GenerationInput:
        self.check()
        if not self.messages:
            raise PromptError("messages", "must not be empty")
        messages = [m.model_dump() for m in self.messages]
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        field_name = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        if max_tokens is not None and max_tokens < 1:
            raise PromptError(field_name, f"must be >= 1, got {max_tokens}")
        return GenerationInput(messages, "messages", self.model, max_tokens, self.sampling(), self.gamma)


def openai_error(message: str, param: str | None, code: str | None = None, kind: str = "invalid_request_error"):
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
