"""Prompts in, text out: tokenizing requests and detokenizing streams.

Shared by the in-process decoder and the serving ingress, so a prompt gives
the same token ids (and a token stream the same text) on every path.
"""

from __future__ import annotations

from typing import Any

from specserve.speculation.params import check_unicode

Prompt = str | list[int] | list[dict[str, str]]


class PromptError(ValueError):
    """A request field is invalid; `field` names it (HTTP 400 `param`, gRPC INVALID_ARGUMENT)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def __reduce__(self):  # picklable across Ray processes
        return PromptError, (self.field, self.message)


def _unicode(text: str, field: str) -> None:
    try:
        check_unicode(text)
    except ValueError as exc:
        raise PromptError(field, str(exc)) from None


class PromptCodec:
    """Encode prompts (text, chat messages or token ids) and decode tokens for one model."""

    def __init__(self, tokenizer: Any | None, vocab: int, max_positions: int | None = None,
                 special_tokens_in_messages: bool = False):
        """special_tokens_in_messages: chat message content that spells a special token (`<|im_start|>`) becomes
        that control token, as the template's own do. Off by default: a user could open a system turn of their
        own; the content is then tokenized as the plain text it is."""
        self.tokenizer = tokenizer
        self.vocab = vocab
        self.max_positions = max_positions
        self.special_tokens_in_messages = special_tokens_in_messages
        self._specials: list[str] | None = None
        self._longest_token: int | None = None

    def encode(self, prompt: Prompt, field: str = "prompt") -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise PromptError(field, "must not be empty")
            _unicode(prompt, field)
            self._too_long_to_tokenize(len(prompt), self._require_tokenizer(field, "a text prompt"), field)
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            tok = self._require_tokenizer(field, "chat messages")
            for i, message in enumerate(prompt):
                if not {"role", "content"} <= set(message):
                    raise PromptError(f"{field}[{i}]", "must have 'role' and 'content'")
                _unicode(str(message["content"]), f"{field}[{i}].content")
            self._too_long_to_tokenize(sum(len(str(m["content"])) for m in prompt), tok, field)
            if not self.special_tokens_in_messages and any(
                    special in str(m["content"]) for m in prompt for special in self.special_texts()):
                return self._encode_chat_as_text(prompt, field)
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

    def _too_long_to_tokenize(self, chars: int, tok, field: str) -> None:
        """Refuse text that must exceed the context before tokenizing it (tokenizing 4 MB took 4 s of the ingress'
        event loop): no token is longer than the vocabulary's longest, so chars / that is a floor on the tokens."""
        if self.max_positions is None:
            return
        if self._longest_token is None:
            pieces = tok.convert_ids_to_tokens(list(range(len(tok))))
            self._longest_token = max((len(tok.convert_tokens_to_string([p])) for p in pieces if p), default=1)
        if chars > self.max_positions * max(self._longest_token, 1):
            raise PromptError(field, f"has {chars} characters, more than the model's context of {self.max_positions} "
                              "tokens can hold")

    def special_texts(self) -> list[str]:
        """The strings the tokenizer turns into special (control) tokens."""
        if self._specials is None:
            tok = self.tokenizer
            added = getattr(tok, "added_tokens_decoder", {}) or {}
            specials = {t.content for t in added.values() if getattr(t, "special", False)}
            self._specials = sorted(specials | set(getattr(tok, "all_special_tokens", []) or []))
        return self._specials

    def _encode_chat_as_text(self, messages: list[dict[str, Any]], field: str) -> list[int]:
        """The chat template's tokens, with each message's content tokenized as plain text (special-token
        spellings in it stay text). The template is rendered around placeholders; the pieces between them are
        its own text, tokenized as usual."""
        tok = self.tokenizer
        marks = [f"\ue000{i}\ue001" for i in range(len(messages))]
        shell = [{**m, "content": mark} for m, mark in zip(messages, marks)]
        text = tok.apply_chat_template(shell, add_generation_prompt=True, tokenize=False)
        ids: list[int] = []
        for message, mark in zip(messages, marks):
            before, found, text = text.partition(mark)
            if not found:  # a template that drops or rewrites content: refuse rather than guess
                raise PromptError(field, "contains special-token text this model's chat template cannot keep as text")
            ids += tok.encode(before, add_special_tokens=False) if before else []
            ids += tok.encode(str(message["content"]), add_special_tokens=False, split_special_tokens=True)
        return ids + (tok.encode(text, add_special_tokens=False) if text else [])

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
