"""One sequence's KV cache with rollback.

`CachedSequence` remembers which tokens its cache holds. `logits_after`
brings the cache to a requested token sequence by keeping the longest common
prefix, cropping the rest and feeding only the new tail in ONE forward — so a
rejection costs a crop, and the prompt is prefilled once. Because the cache
is always derivable from the token list, a worker can rebuild it from the
committed tokens at any time.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


class TokenSequence:
    """The token bookkeeping every cache shares: which tokens it holds, prefix reuse, one forward per call."""

    tokens: list[int]
    token_subset: torch.Tensor | None = None  # a head over a token subset: its tokens, sorted (see `feed_subset`)
    hit_tokens: int = 0  # of its first tokens, how many came from a prefix computed before (a KV pool's cache)

    def common_prefix(self, tokens: list[int]) -> int:
        n = min(len(self.tokens), len(tokens))
        if self.tokens[:n] == tokens[:n]:
            return n
        i = 0
        while i < n and self.tokens[i] == tokens[i]:
            i += 1
        return i

    def rollback(self, length: int) -> None:
        raise NotImplementedError

    def feed(self, new_tokens: list[int], keep_logits: int = 1) -> torch.Tensor:
        raise NotImplementedError

    def feed_subset(self, new_tokens: list[int], keep_logits: int = 1) -> torch.Tensor:
        """`feed`, with logits over `token_subset` only when there is one (no widening to the vocabulary)."""
        return self.feed(new_tokens, keep_logits)

    def release(self) -> None:
        raise NotImplementedError

    def unfed(self, tokens: list[int], keep_logits: int) -> list[int]:
        """Roll back to the longest cached prefix of `tokens` that leaves `keep_logits` to feed; the rest."""
        if not tokens:
            raise ValueError("cannot compute logits after an empty sequence")
        keep = min(self.common_prefix(tokens), len(tokens) - keep_logits)
        self.rollback(keep)
        return tokens[keep:]

    def logits_after(self, tokens: list[int], keep_logits: int = 1) -> torch.Tensor:
        """Logits predicting the tokens after each of the last `keep_logits` prefixes of `tokens`.

        Feeds at least the last token (logits come only from a forward), and
        at least `keep_logits` tokens. Returns [keep_logits, vocab].
        """
        return self.feed(self.unfed(tokens, keep_logits), keep_logits)

    def subset_logits_after(self, tokens: list[int]) -> torch.Tensor:
        """`logits_after(tokens)` through `feed_subset`: [1, subset or vocabulary]."""
        return self.feed_subset(self.unfed(tokens, 1))


def full_cache() -> DynamicCache:
    """An HF cache that keeps every past token: given a sliding-window model's config, transformers keeps only the
    last window of a sliding layer, which a rollback past it cannot undo (its crop raises); the model's masks
    still apply the window."""
    return DynamicCache()


class CachedSequence(TokenSequence):
    def __init__(self, model):
        self.model = model
        self.cache = full_cache()
        self.tokens: list[int] = []  # tokens whose keys/values the cache holds, in order
        self.forward_calls = 0
        self.device = next(model.parameters()).device

    def rollback(self, length: int) -> None:
        """Keep the first `length` cached tokens."""
        drop = len(self.tokens) - length
        if drop > 0:
            self.cache.crop(-drop)  # transformers 5: a negative count drops from the end
            del self.tokens[length:]

    @torch.inference_mode()
    def feed(self, new_tokens: list[int], keep_logits: int = 1) -> torch.Tensor:
        """Append tokens; return float32 CPU logits of the last `keep_logits` of them: [keep_logits, vocab]."""
        ids = torch.tensor([new_tokens], dtype=torch.long, device=self.device)
        out = self.model(input_ids=ids, past_key_values=self.cache, use_cache=True, logits_to_keep=keep_logits)
        self.forward_calls += 1
        self.tokens.extend(new_tokens)
        return out.logits[0, -keep_logits:].float().cpu()

    def release(self) -> None:
        self.cache = full_cache()
        self.tokens = []
