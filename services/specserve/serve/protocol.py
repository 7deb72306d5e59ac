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

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from specserve.coordinator import SessionRequest
from specserve.engine.loop import Round
from specserve.engine.prompts import PromptCodec, PromptError
from specserve.speculation import SamplingParams, parse_gamma
from specserve.speculation.params import MAX_TOP_LOGPROBS


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
    gamma = None
    if inp.gamma not in (None, ""):
        try:
            gamma = parse_gamma(inp.gamma, limits.gamma_max)
        except ValueError as exc:
            raise PromptError("gamma", str(exc)) from None
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


def choices(request: SessionRequest, n: int) -> list[SessionRequest]:
    """The sessions of a request for n independent samples (OpenAI's and gRPC's `n`): each with a seed of its own
    (`SessionRequest.choice`). The request's seed must be set."""
    if not 1 <= n <= MAX_N:
        raise PromptError("n", f"must be between 1 and {MAX_N}, got {n}")
    return [request.choice(i) for i in range(n)]


def stats_summary(stats: dict[str, Any] | None) -> dict[str, Any]:
    """The per-request speculation statistics clients see (the `specserve` object / SpeculationStats)."""
    stats = stats or {}
    keys = ("rounds", "drafted", "accepted", "acceptance_rate", "mean_accepted_length", "gamma_history",
            "draft_time_s", "verify_time_s", "worker_verify_time_s", "tokens_per_s", "controller", "queue_time_s",
            "cached_tokens")
    return {k: stats[k] for k in keys if k in stats}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; cached_tokens: prompt tokens the prefix cache supplied (for n > 1 choices, the
    first choice's, as the prompt is counted once)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": min(cached_tokens, prompt_tokens)}}


# -- OpenAI HTTP bodies ------------------------------------------------------------
MAX_N = 16  # choices per request (each is a session of its own)

# OpenAI parameters this server does not implement, with the value that means "not used": a request that sets one
# to anything else is refused (400 naming it), never served as if the parameter had been honoured.
UNSUPPORTED: dict[str, Any] = {
    "frequency_penalty": 0, "presence_penalty": 0, "repetition_penalty": 1, "logit_bias": {}, "best_of": 1,
    "echo": False, "suffix": "", "tools": [], "tool_choice": "none", "functions": [], "function_call": "none",
    "parallel_tool_calls": None, "response_format": {"type": "text"},
    "store": False, "metadata": {}, "modalities": ["text"], "audio": None, "prediction": None,
    "reasoning_effort": None, "service_tier": "auto", "web_search_options": None, "min_p": 0, "min_tokens": 0,
    "stop_token_ids": [], "guided_json": None, "guided_regex": None, "guided_choice": None, "guided_grammar": None,
}
# OpenAI parameters accepted and not used, because they cannot change the output
IGNORED = {"user"}
NULL_IS_DEFAULT = {"stream", "ignore_eos", "speculation_detail", "n", "logprobs"}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's; not implemented, refused when true

    def check(self) -> None:
        if self.continuous_usage_stats:
            raise PromptError("stream_options.continuous_usage_stats", "is not supported by this server")


class _OpenAIRequest(BaseModel):
    # Unknown and unimplemented fields are collected here and refused in check() with their name (an
    # OpenAI-shaped 400), so a client never gets output that silently ignored what it asked for.
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension (extra_body)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # extension
    gamma: int | str | None = None  # extension: speculation depth for this request
    # extension: each streamed chunk lists its rounds (`specserve_rounds`: drafted, accepted, rejected, γ)
    speculation_detail: bool = False
    n: int = 1

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """`null` for a flag or `n` means what leaving it out means (OpenAI's clients send that)."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k not in NULL_IS_DEFAULT}
        return data

    def sampling(self) -> dict[str, Any]:
        values: dict[str, Any] = {"ignore_eos": self.ignore_eos}
        for name in ("temperature", "top_p", "top_k", "seed"):
            if getattr(self, name) is not None:
                values[name] = getattr(self, name)
        if self.stop:
            values["stop"] = [self.stop] if isinstance(self.stop, str) else self.stop
        return values

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def check(self) -> None:
        if self.stream_options is not None:
            if not self.stream:
                raise PromptError("stream_options", "is only allowed when stream is true")
            self.stream_options.check()
        if self.speculation_detail and not self.stream:
            raise PromptError("speculation_detail", "is only allowed when stream is true")
        for name, value in (self.model_extra or {}).items():
            if name in IGNORED or value is None:
                continue
            if name not in UNSUPPORTED:
                raise PromptError(name, "is not a parameter this server knows")
            if not _neutral(value, UNSUPPORTED[name]):
                raise PromptError(name, "is not supported by this server")


def _neutral(value: Any, default: Any) -> bool:
    """Whether `value` means what leaving the parameter out means (True is not 1, 0 is not False)."""
    if isinstance(value, bool) or isinstance(default, bool):
        return value is default
    return value == default


class CompletionRequest(_OpenAIRequest):
    prompt: str | list[int]
    logprobs: int | None = None  # the emitted tokens' log-probabilities and this many alternatives each

    def to_input(self) -> GenerationInput:
        self.check()
        sampling = self.sampling()
        if self.logprobs is not None:
            sampling["logprobs"] = self.logprobs
        return GenerationInput(self.prompt, "prompt", self.model, self.max_tokens, sampling, self.gamma)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")  # tool_calls, audio, ...: refused with their name, not dropped

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[Any]  # a string, or OpenAI's content parts (only text parts are served)
    name: str | None = None  # OpenAI's participant name: accepted, not shown to the model

    def text(self, field_name: str) -> str:
        """The content as one string: text parts joined by newlines (as vLLM joins them). Other parts (images,
        audio, files) are refused naming the part."""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for j, part in enumerate(self.content):
            where = f"{field_name}.content.{j}"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise PromptError(f"{where}.type", f"content parts of type {kind!r} are not supported; only 'text'")
            if not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
                raise PromptError(where, "a text part is {'type': 'text', 'text': <string>}")
            texts.append(part["text"])
        return "\n".join(texts)


class ChatCompletionRequest(_OpenAIRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def to_input(self) -> GenerationInput:
        self.check()
        sampling = self.sampling()
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise PromptError("top_logprobs", "needs logprobs: true")
            if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
                raise PromptError("top_logprobs", f"must be between 0 and {MAX_TOP_LOGPROBS}, got {self.top_logprobs}")
        if self.logprobs:
            sampling["logprobs"] = self.top_logprobs or 0
        if not self.messages:
            raise PromptError("messages", "must not be empty")
        messages = [{"role": m.role, "content": m.text(f"messages.{i}")} for i, m in enumerate(self.messages)]
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        field_name = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        if max_tokens is not None and max_tokens < 1:
            raise PromptError(field_name, f"must be >= 1, got {max_tokens}")
        return GenerationInput(messages, "messages", self.model, max_tokens, sampling, self.gamma)


def openai_logprobs(entries: list, token_text, chat: bool, offset: int = 0) -> dict[str, Any]:
    """OpenAI's `logprobs` object for the tokens of `entries` ((token, log-probability, top alternatives), as
    `speculation.sampling.token_logprobs` makes them); token_text(id) -> its text. Chat: {"content": [...]};
    completions: tokens / token_logprobs / top_logprobs / text_offset (offsets from `offset` in the completion)."""
    if chat:
        def item(token: int, logprob: float) -> dict[str, Any]:
            text = token_text(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return {"content": [{**item(t, lp), "top_logprobs": [item(i, v) for i, v in top]} for t, lp, top in entries],
                "refusal": None}
    texts = [token_text(t) for t, _, _ in entries]
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": texts, "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [{token_text(i): v for i, v in top} for _, _, top in entries],
            "text_offset": offsets}


def round_view(rnd: Round, token_text) -> dict[str, Any]:
    """One round as the `specserve_rounds` extension shows it, texts per token: `accepted` (draft tokens the
    target kept), `rejected` (the draft tokens after the first rejection, not emitted), `next` (the target's own
    token: `next_kind` "correction" after a rejection, "bonus" after a fully accepted block, "target" when
    nothing was drafted), `lookup` (prompt lookup drafted the block), `gamma` and the emitted `token_ids`.
    A round cut short (eos, max_tokens) shows only what it emitted."""
    new, drafted, n = rnd.tokens, rnd.drafted, rnd.accepted
    view = {"token_ids": new, "accepted": [token_text(t) for t in new[:n]],
            "rejected": [token_text(t) for t in drafted[n:]], "gamma": rnd.gamma, "lookup": rnd.looked_up}
    if len(new) > n:
        view["next"] = token_text(new[n])
        view["next_kind"] = "correction" if n < len(drafted) else "bonus" if drafted else "target"
    return view


def openai_error(message: str, param: str | None, code: str | None = None, kind: str = "invalid_request_error"):
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
