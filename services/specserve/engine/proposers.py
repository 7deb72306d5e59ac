"""Drafts (proposers) and the target verifier, each owning one session's KV cache.

These are the seams the distributed workers reuse: a proposer turns the
committed tokens into a `Proposal` (tokens and the q they were sampled
from); the verifier scores context + proposal in one target forward and
applies the acceptance rule (`speculation.accept_batch`; `speculation.accept_greedy` at T=0, the same
verdict); `judge_many` does so for every block of a batched target step at once.
Both are told the full committed token list every round and bring their
caches to it themselves (crop + feed), so they need no separate
commit/rollback message and can be rebuilt from scratch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specserve.models.drafts.ngram import match_ngram
from specserve.speculation import (
    PositionRNG,
    Purpose,
    SamplingParams,
    Verdict,
    accept_batch,
    accept_greedy,
    probs_from_logits,
)
from specserve.speculation.sampling import sample_from_probs, sparse_to_dense, token_logprobs, truncate_top_k


@dataclass
class Proposal:
    tokens: list[int]  # [k] drafted tokens, k ≤ γ
    # [k, vocab] float32: the distribution each token was sampled from. A one-hot q (a greedy draft's argmax,
    # a lookup's copy) may be given as its vocabulary size instead and is built only where asked for (`q`):
    # a greedy verdict or a lookup trimmed to γ=0 never needs the vocabulary-wide rows
    dist: torch.Tensor | int
    key: str | None = None  # quality class the γ controller keeps separate statistics for (e.g. "ngram-3")
    # a model draft's top probability at each token it drafted, tokens dropped by `truncate` included
    confidences: list[float] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def one_hot(self) -> bool:
        """Whether q is one-hot on each token (known without building it)."""
        return isinstance(self.dist, int)

    @property
    def q(self) -> torch.Tensor:
        if not isinstance(self.dist, int):
            return self.dist
        if "_q" not in self.__dict__:
            self.__dict__["_q"] = one_hot(self.tokens, self.dist)
        return self.__dict__["_q"]

    def truncate(self, k: int) -> Proposal:
        """The first k tokens. Exact: each kept token was sampled from its own q regardless of later ones."""
        if k >= len(self.tokens):
            return self
        return Proposal(self.tokens[:k], self.dist if self.one_hot else self.dist[:k], self.key, self.confidences)


def one_hot(tokens: list[int], vocab: int) -> torch.Tensor:
    """[k, vocab] float32 rows, each one-hot on its token: the q of a greedy draft or a lookup copy."""
    return torch.nn.functional.one_hot(torch.tensor(tokens, dtype=torch.long), vocab).float()


def empty_proposal(vocab: int) -> Proposal:
    return Proposal([], vocab)


class Proposer(ABC):
    """Drafts up to γ tokens for one session."""

    name: str = "draft"
    free: bool = False  # True when drafting costs ~nothing: draft γ_max first, let the controller trim
    # True when `propose` takes keep_going(confidences) -> bool and asks it after each token (a local model
    # draft): γ is then a ceiling and the controller decides token by token
    stops_early: bool = False
    lookup: Proposer | None = None  # prompt lookup tried before `propose` (a free block where the context repeats)
    # True when `prefill` may be skipped: `propose` feeds whatever the draft's cache lacks first (a local model
    # draft), so a session that never drafts (γ=0 under load) never runs its prompt through the draft
    lazy_prefill: bool = False

    @abstractmethod
    def propose(self, context: list[int], gamma: int, params: SamplingParams, rng: PositionRNG) -> Proposal: ...

    def prefill(self, prompt: list[int]) -> None:  # noqa: B027 - optional
        """Warm the cache with the prompt (all but its last token)."""

    @property
    def looks_up(self) -> bool:
        return self.lookup is not None

    def lookup_proposal(self, context: list[int], gamma: int, params: SamplingParams, rng: PositionRNG) -> Proposal:
        """A free proposal from the context itself (only where `looks_up`)."""
        return self.lookup.propose(context, gamma, params, rng)

    def prefetch(self, context: list[int], proposal: Proposal, gamma: int, params: SamplingParams, rng: PositionRNG) -> None:  # noqa: B027
        """Start drafting the next block on the all-accepted branch while the target verifies `proposal`.

        Only a proposer that runs elsewhere (a remote worker) can overlap; local ones ignore it.
        """

    def release(self) -> None:  # noqa: B027 - optional
        """Free per-session state."""


class ModelProposer(Proposer):
    """A causal LM draft sharing the target's vocabulary.

    top_k_q > 0 makes the draft sample from its own top-k-truncated,
    renormalised q — the sparse q a remote draft ships over the wire.
    stop_below > 0 ends a block early once the draft's own top probability
    (softmax of its raw logits) falls below it: drafting on where the draft is
    unsure mostly buys rejected positions. keep_going, passed to `propose`,
    does the same with a rule of the caller's (the γ controller's). The block
    length then depends only on the draft's side and on earlier rounds, so the
    output stays exactly the target's.
    """

    def __init__(self, model, vocab: int, top_k_q: int = 0, name: str = "model", stop_below: float = 0.0,
                 sequence=None, lazy_prefill: bool = False):
        if sequence is None:
            from specserve.models.families.lean import draft_sequence

            sequence = draft_sequence(model)
        self.seq = sequence  # or a colocated worker's
        self.vocab = vocab
        self.top_k_q = top_k_q
        self.name = name
        self.stop_below = stop_below
        self.lazy_prefill = lazy_prefill
        # a head over a token subset: draft over it, widen q to the vocabulary once per block
        self.subset = self.seq.token_subset

    @property
    def stops_early(self) -> bool:
        """Whether stopping mid-block saves draft steps: not where the device drafts the whole block anyway
        (`fused`), so there the controller picks the block's depth up front."""
        return not getattr(self.seq, "fused", False)

    def prefill(self, prompt: list[int]) -> None:
        if len(prompt) > 1:
            self.seq.logits_after(prompt[:-1])

    def _head(self, logits: torch.Tensor) -> torch.Tensor:
        """[1, n] logits over the subset when there is one, else over the shared vocabulary."""
        return logits if self.subset is not None else logits[:, : self.vocab]

    def _draft_distribution(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        q = probs_from_logits(logits, params)  # [1, n]
        if self.top_k_q and not params.greedy:
            ids, probs = truncate_top_k(q, self.top_k_q)
            q = sparse_to_dense(ids, probs, q.shape[-1])
        return q

    def propose(self, context: list[int], gamma: int, params: SamplingParams, rng: PositionRNG,
                keep_going: Callable[[list[float]], bool] | None = None) -> Proposal:
        if gamma <= 0:
            return empty_proposal(self.vocab)
        fused = getattr(self.seq, "fused", False) and gamma > 1
        confident = keep_going is not None or bool(self.stop_below)  # whether the stopping rules need confidences
        steps = (self._block(context, gamma, params, rng) if fused
                 else self._steps(context, gamma, params, rng, confident))
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        confidences: list[float] = []
        for i, (token, q, confidence) in enumerate(steps):
            tokens.append(token if self.subset is None else int(self.subset[token]))
            if q is not None:
                qs.append(q)
            if confident:
                confidences.append(confidence)
            if i + 1 < gamma:
                if self.stop_below and confidences[-1] < self.stop_below:
                    break
                if keep_going is not None and not keep_going(confidences):
                    break
        if params.greedy:
            q = self.vocab  # one-hot on each token, built where needed
        else:
            q = torch.cat(qs)
            if self.subset is not None:  # sorted subset: the same inverse-CDF draw as over the full vocabulary
                q = sparse_to_dense(self.subset.expand(len(tokens), -1).to(q.device), q, self.vocab)
        return Proposal(tokens, q, confidences=confidences)

    def _steps(self, context: list[int], gamma: int, params: SamplingParams, rng: PositionRNG, confident: bool):
        """(token in the head, its q row or None when greedy, confidence or None) per drafted token, each read back
        to the host; the next token's forward runs only if the caller asks for it."""
        start = len(context)
        logits = self._head(self.seq.subset_logits_after(context))
        for i in range(gamma):
            if params.greedy:  # q is the one-hot of the argmax: any uniform's inverse-CDF draw lands on it
                token, q = int(logits[0].argmax()), None
            else:
                q = self._draft_distribution(logits, params)
                token = int(sample_from_probs(q, torch.tensor([rng.uniform(start + i, Purpose.DRAFT)])))
            yield token, q, float(torch.softmax(logits[0], -1).max()) if confident else None
            if i + 1 < gamma:
                logits = self._head(self.seq.feed_subset([token if self.subset is None else int(self.subset[token])]))

    def _block(self, context: list[int], gamma: int, params: SamplingParams, rng: PositionRNG):
        """The same, drafted as one block on the device (`scheduler.drafting`), read back once."""
        block = self.seq.draft_block(context, gamma, params, rng, self.top_k_q)
        for i, (token, confidence) in enumerate(zip(block.tokens, block.confidences)):
            yield token, None if block.q is None else block.q[i : i + 1], confidence

    def release(self) -> None:
        self.seq.release()


class NgramProposer(Proposer):
    """Prompt lookup; q is one-hot on each proposed token; the key is the match length."""

    name = "ngram"
    free = True

    def __init__(self, vocab: int, max_n: int = 3, min_n: int = 1):
        self.vocab = vocab
        self.max_n = max_n
        self.min_n = min_n

    def propose(self, context: list[int], gamma: int, params: SamplingParams, rng: PositionRNG) -> Proposal:
        n, tokens = match_ngram(context, gamma, self.max_n, self.min_n)
        if not tokens:
            return empty_proposal(self.vocab)
        return Proposal(tokens, self.vocab, key=f"ngram-{n}")


def prompt_lookup(vocab: int) -> NgramProposer:
    """Prompt lookup in front of a model draft: an earlier occurrence of the context's last 2-3 tokens (a 1-gram
    match's first token is accepted ~25% of the time on the bench prompts; 2- and 3-gram matches pay)."""
    return NgramProposer(vocab, max_n=3, min_n=2)


class LookupOrModelProposer(Proposer):
    """Prompt lookup where the context repeats itself (an earlier match of at least `min_n` tokens), the
    model draft elsewhere: lookup is free and wins on rewriting and code, the model on new text.

    Which of the two drafts depends on the context only, so the output stays exact. A lookup proposal has
    no confidences: the controller trims it by its match length's acceptance (`draft_block`).
    """

    def __init__(self, model: ModelProposer):
        self.model = model
        self.vocab = model.vocab
        self.name = f"{model.name}+lookup"
        self.lookup = prompt_lookup(model.vocab)

    def prefill(self, prompt: list[int]) -> None:
        self.model.prefill(prompt)

    @property
    def stops_early(self) -> bool:
        return self.model.stops_early

    @property
    def lazy_prefill(self) -> bool:
        return self.model.lazy_prefill

    def propose(self, context: list[int], gamma: int, params: SamplingParams, rng: PositionRNG,
                keep_going: Callable[[list[float]], bool] | None = None) -> Proposal:
        return self.model.propose(context, gamma, params, rng, keep_going)

    def release(self) -> None:
        self.model.release()


def one_hot_on(q: torch.Tensor, tokens: torch.Tensor) -> bool:
    """Whether each row of q ([k, vocab], non-negative) is one-hot on its token: what every draft samples from
    at temperature 0 (a draft's argmax, a lookup's copy)."""
    if not len(tokens):
        return True
    return bool((q[torch.arange(len(tokens)), tokens] == 1.0).all() and (q.sum(-1) == 1.0).all())


class TargetVerifier:
    """Scores context + proposal with ONE target forward over k+1 new positions and accepts a prefix."""

    last_step = None  # a verifier whose blocks join shared steps reports the latest one here (a `StepInfo`)

    def __init__(self, model, vocab: int, sequence=None):
        if sequence is None:
            from specserve.models.families.lean import model_sequence

            sequence = model_sequence(model)
        self.seq = sequence  # or a pool's sequence
        self.vocab = vocab

    def prefill(self, prompt: list[int]) -> None:
        if len(prompt) > 1:
            self.seq.logits_after(prompt[:-1])

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the prefill found computed (a KV pool's prefix cache; 0 elsewhere)."""
        return self.seq.hit_tokens

    def verify(self, context: list[int], proposal: Proposal, params: SamplingParams, rng: PositionRNG) -> Verdict:
        k = len(proposal)
        logits = self.seq.logits_after(context + proposal.tokens, keep_logits=k + 1)  # [k+1, vocab]
        return self.judge(logits, len(context), proposal, params, rng)

    def judge(self, logits: torch.Tensor, start: int, proposal: Proposal, params: SamplingParams,
              rng: PositionRNG) -> Verdict:
        """Accept a prefix of `proposal` given the target's logits after context + each drafted token
        ([k+1, ≥ vocab]; the context is `start` tokens long), and drop the rejected positions from the cache."""
        return judge_many([(self, logits, start, proposal, params, rng)])[0]

    def release(self) -> None:
        self.seq.release()


# one verify block of a target step: (its verifier, its logits [k+1, ≥ vocab], context length, proposal, params, rng)
Block = tuple[TargetVerifier, torch.Tensor, int, Proposal, SamplingParams, PositionRNG]


def judge_many(blocks: list[Block]) -> list[Verdict]:
    """`TargetVerifier.judge` for every block of one target step, batched: the greedy blocks' argmaxes in one
    op, the sampled blocks' acceptance in one `accept_batch` per distinct (temperature, top-k, top-p) (per 4
    blocks of it on a CPU: `_chunk`), each with one transfer to the host. Each verdict is the one its block
    would get alone."""
    verdicts: list[Verdict | None] = [None] * len(blocks)
    greedy: list[int] = []
    sampled: dict[tuple, list[int]] = {}
    for i, (engine, _, _, proposal, params, _) in enumerate(blocks):
        if params.greedy and (proposal.one_hot or one_hot_on(proposal.q, torch.tensor(proposal.tokens))):
            greedy.append(i)  # the same verdict, cheaply
        else:
            sampled.setdefault((params.temperature, params.top_k, params.top_p, engine.vocab), []).append(i)
    if greedy:
        # max's indices are argmax's (the first maximum; NaN counts as one) and cost a third on a CPU
        argmax = _rows([blocks[i][1] for i in greedy], [blocks[i][0].vocab for i in greedy]).max(-1).indices.tolist()
        row = 0
        for i in greedy:
            k = len(blocks[i][3])
            verdicts[i] = accept_greedy(blocks[i][3].tokens, argmax[row : row + k + 1])
            row += k + 1
    pad = torch.nn.utils.rnn.pad_sequence
    chunk = _chunk(blocks[0][1])
    groups = [members[i : i + chunk] for members in sampled.values() for i in range(0, len(members), chunk)]
    for members in groups:
        engine, logits, _, _, params, _ = blocks[members[0]]
        dev, vocab = logits.device, engine.vocab
        chosen = [blocks[i] for i in members]
        p = probs_from_logits(pad([b[1][:, :vocab] for b in chosen], batch_first=True), params)
        q = pad([b[3].q.to(dev) for b in chosen], batch_first=True)
        tokens = pad([torch.tensor(b[3].tokens, dtype=torch.long) for b in chosen], batch_first=True)
        u_accept = pad([b[5].uniforms(b[2], len(b[3]), Purpose.ACCEPT) for b in chosen], batch_first=True)
        u_final = pad([b[5].uniforms(b[2], len(b[3]) + 1, Purpose.FINAL) for b in chosen], batch_first=True)
        got = accept_batch(tokens.to(dev), [len(b[3]) for b in chosen], q, p, u_accept.to(dev), u_final.to(dev))
        for i, verdict in zip(members, got):
            verdicts[i] = verdict
    for (engine, logits, start, proposal, params, _), verdict in zip(blocks, verdicts):
        if params.logprobs is not None:  # of the emitted tokens, from the logits this verify computed anyway
            emitted = proposal.tokens[: verdict.n_accepted] + [verdict.next_token]
            verdict.logprobs = token_logprobs(logits[:, : engine.vocab], emitted, params.logprobs)
        engine.seq.rollback(start + verdict.n_accepted)  # drop rejected positions now
    return verdicts


def _rows(logits: list[torch.Tensor], vocabs: list[int]) -> torch.Tensor:
    """The blocks' logits as one [rows, vocab] tensor: a view where they are consecutive rows of one tensor (as
    the scheduler hands out a step's), else a copy."""
    first, vocab = logits[0], vocabs[0]
    if first.dim() == 2 and first.stride(1) == 1 and all(v == vocab for v in vocabs):
        storage, step = first.untyped_storage().data_ptr(), first.stride(0) * first.element_size()
        at, rows = first.data_ptr(), 0
        for t in logits:
            if (t.dim() != 2 or t.stride() != first.stride() or t.dtype != first.dtype or t.shape[1] < vocab
                    or t.data_ptr() != at or t.untyped_storage().data_ptr() != storage):
                break
            at += t.shape[0] * step
            rows += t.shape[0]
        else:
            return first.as_strided((rows, vocab), first.stride())
    return torch.cat([t[:, :v] for t, v in zip(logits, vocabs)])


def _chunk(logits: torch.Tensor) -> int:
    """Blocks accepted in one `accept_batch`: all of a step's on a GPU (one launch sequence, one read back); a
    few at a time on a CPU, where [blocks, γ+1, vocab] temporaries of a whole step fall out of cache and measured
    slower than block by block (docs/benchmarks.md)."""
    return 1 << 30 if logits.device.type == "cuda" else 4
