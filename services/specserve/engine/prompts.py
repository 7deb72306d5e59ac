"""Prompts in, text out: tokenizing requests and detokenizing streams.

Shared by the in-process decoder and the serving ingress, so a prompt gives
the same token ids (and a token stream the same text) on every path.
"""

from __future__ import annotations

from typing import Any

Prompt = str | list[int] | list[dict[str, str]]


class PromptError(ValueError):
    """A request field is invalid; `field` names it (HTTP 400 `param`, gRPC INVALID_ARGUMENT)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def __reduce__(self):  # picklable across Ray processes
        return PromptError, (self.field, self.message)


class PromptCodec:
    """Encode prompts (text, chat messages or token ids) and decode tokens for one model."""

    def __init__(self, tokenizer: Any | None, vocab: int, max_positions: int | None = None):
        self.tokenizer = tokenizer
        self.vocab = vocab
        self.max_positions = max_positions

    def encode(self, prompt: Prompt, field: str = "prompt") -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise PromptError(field, "must not be empty")
            return self._require_tokenizer(field, "a text prompt").encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            tok = self._require_tokenizer(field, "chat messages")
            for i, message in enumerate(prompt):
                if not {"role", "content"} <= set(message):
                    raise PromptError(f"{field}[{i}]", "must have 'role' and 'content'")
            text = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
            return tok.encode(text, add_special_tokens=False)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < self.vocab]
            if bad:
                raise PromptError(field, f"token ids must be in [0, {self.vocab}), got {bad[:5]}")
            return list(prompt)
        if isinstance(prompt, list) and not prompt:
            raise PromptError(field, "must not be empty")
        raise PromptError(field, "must be a non-empty string, a list of token ids, or a list of chat messages")

    def check_length(self, prompt_ids: list[int], field: str = "prompt") -> int | None:
        """Raise when the prompt leaves no room in the context; return the room left (None = unbounded)."""
        if self.max_positions is None:
            return None
        if len(prompt_ids) >= self.max_positions:
            raise PromptError(
                field, f"has {len(prompt_ids)} tokens; the model's context is {self.max_positions} tokens"
            )
        return self.max_positions - len(prompt_ids)

    def _require_tokenizer(self, field: str, what: str):
        if self.tokenizer is None:
            raise PromptError(field, f"{what} needs a tokenizer; pass token ids, or load the target by name/path")
        return self.tokenizer

    def decode(self, token_ids: list[int]) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def stream(self, stop: list[str] | None = None) -> TextStream:
        return TextStream(self, stop or [])


def cut_at_stop(text: str, stop: list[str]) -> tuple[str, bool]:
    """(text up to the first stop string, whether one occurred)."""
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


class TextStream:
    """Turns token chunks into text deltas: holds back incomplete UTF-8 and any tail that may start a stop string."""

    def __init__(self, codec: PromptCodec, stop: list[str]):
        self.codec = codec
        self.stop = stop
        self.tokens: list[int] = []
        self.sent = ""  # text already emitted
        self.stopped = False

    def push(self, tokens: list[int], final: bool = False) -> str:
        """Add tokens; return the new text that is safe to emit. After a stop string, `stopped` is True."""
        self.tokens.extend(tokens)
        text = self.codec.decode(self.tokens) or ""
        text, self.stopped = cut_at_stop(text, self.stop)
        if not (final or self.stopped):
            if text.endswith("\ufffd"):  # a multi-byte character split across tokens
                text = text.rstrip("\ufffd")
            hold = max((len(s) - 1 for s in self.stop), default=0)
            text = text[: max(len(self.sent), len(text) - hold)]
        delta = text[len(self.sent) :] if text.startswith(self.sent) else ""
        self.sent += delta
        return delta
