"""Whole sessions inside the target's process: the draft colocated with the target (one device, one process).

Each session is the engine's own loop (`engine.loop.speculate`) with a model draft whose forwards are the
step scheduler's batched draft steps (`ScheduledSequence`: every session's next draft token in one
forward) and a verifier whose blocks join the batched target steps (`ScheduledVerifier`). A round is one
message to the coordinator instead of a Propose and a Verify call, and no second process competes with the
target for the same cores. The γ controller runs here too, so `auto` decides token by token as in process.
`ScheduledDraft` is the draft half; a split DraftWorker batches its sessions' draft steps with it too. A
feature head (`models.drafts.head`) is a draft of this kind whose pool reads the target pool's features: its
sessions' head steps are batched the same way.
The draft samples from its top-k q where `draft_top_k` says so, as a split draft worker does, so a
session's tokens are the same in either placement.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from specserve.engine import calibration
from specserve.engine.loop import Round
from specserve.engine.profile import draft_step_time, profile_context, verify_profile
from specserve.engine.proposers import LookupOrModelProposer, ModelProposer, Proposer, TargetVerifier
from specserve.engine.session import SessionFactory
from specserve.models.drafts.eagle3 import Eagle3Head, Eagle3Sequence
from specserve.models.drafts.head import HeadPool, is_head
from specserve.models.families.lean import draft_dtype, model_sequence, unsupported_reason
from specserve.models.memory.pool import KVPool
from specserve.scheduler.steps import ScheduledSequence, ScheduledVerifier, StepScheduler
from specserve.speculation import PositionRNG, SamplingParams


class ScheduledDraft:
    """A draft model whose forwards run as a scheduler's batched draft steps, over a KV pool of its own (a
    draft of `models.families.arch`'s families; others keep their HF cache, fed one session at a time on the same
    thread). Its proposers are called from the sessions' own threads; only their forwards cross to the compute thread."""

    def __init__(self, scheduler: StepScheduler, model, vocab: int, top_k_q: int = 0, name: str = "draft",
                 kv_cache_tokens: int = 65536, fused: bool | None = None, prefix_caching: bool = True,
                 target_pool: KVPool | None = None):
        """target_pool: the pool whose features a feature head reads (the scheduler's)."""
        self.scheduler, self.model, self.vocab, self.top_k_q, self.name = scheduler, model, vocab, top_k_q, name
        self.pool: KVPool | None = None
        self.head = is_head(model)
        self.eagle3 = isinstance(model, Eagle3Head)
        self.reads_target = self.head or self.eagle3  # drafts from the features of the session's target sequence
        if self.eagle3:
            if target_pool is None or target_pool.aux_layers != model.aux:
                raise ValueError("an EAGLE-3 head drafts beside a batched target whose pool keeps its layers' states")
            self.fused = False
            return
        if self.head:
            if target_pool is None or target_pool.features is None:
                raise ValueError("a feature head drafts beside a batched target whose pool keeps features")
            self.pool = scheduler.call(HeadPool, model, target_pool, kv_cache_tokens).result()
            # whole blocks on the device where a step is launch-bound (GPUs), as a draft LM's replayed steps
            self.fused = target_pool.w.device.type == "cuda" if fused is None else fused
            return
        if unsupported_reason(model) is None:
            self.pool = scheduler.call(lambda: KVPool(model, kv_cache_tokens, draft_dtype(model),
                                                      prefix_caching=prefix_caching)).result()
        # whole blocks on the device (`scheduler.drafting`) where steps replay CUDA graphs; token by token
        # elsewhere, where stopping at the first unsure token saves real compute
        runner = self.pool.runner if self.pool is not None else None
        self.fused = bool(runner is not None and runner.capture) if fused is None else fused

    def proposer(self, target_sequence=None) -> ModelProposer:
        """A session's draft; a head's reads `target_sequence`, the session's sequence in the target pool."""
        if self.eagle3:
            sequence = ScheduledEagle3Sequence(self.scheduler, Eagle3Sequence(self.model, target_sequence))
        elif self.head:
            sequence = ScheduledHeadSequence(self.scheduler, self.pool.sequence(target_sequence), self.pool, self.fused)
        else:
            seq = self.pool.sequence() if self.pool is not None else model_sequence(self.model)
            sequence = ScheduledSequence(self.scheduler, seq, self.pool, self.fused)
        return ModelProposer(self.model, self.vocab, self.top_k_q, name=self.name, sequence=sequence,
                             lazy_prefill=not (self.eagle3 or self.head))


class ScheduledHeadSequence(ScheduledSequence):
    """A head's `PooledHeadSequence` on the scheduler: before the target holds a feature of the context there is
    nothing to feed, and the head drafts from a zero feature after equal logits (as `HeadSequence`)."""

    def feed_subset(self, new_tokens: list[int], keep_logits: int = 1) -> torch.Tensor:
        return super().feed_subset(new_tokens, keep_logits) if new_tokens else self.inner.equal_logits()


class ScheduledEagle3Sequence:
    """An EAGLE-3 session's cache (`Eagle3Sequence`) with its steps on the compute thread, where the target's pool
    and its kept hidden states are consistent; a session's steps one at a time (not batched with others')."""

    fused = False

    def __init__(self, scheduler: StepScheduler, seq: Eagle3Sequence):
        self.scheduler, self.inner = scheduler, seq
        self.token_subset, self.vocab = seq.token_subset, seq.vocab

    def subset_logits_after(self, tokens: list[int]) -> torch.Tensor:
        return self.scheduler.call(self.inner.subset_logits_after, tokens).result()

    def feed_subset(self, new_tokens: list[int], keep_logits: int = 1) -> torch.Tensor:
        return self.scheduler.call(self.inner.feed_subset, new_tokens, keep_logits).result()

    def logits_after(self, tokens: list[int], keep_logits: int = 1) -> torch.Tensor:
        return self.scheduler.call(self.inner.logits_after, tokens, keep_logits).result()

    def release(self) -> None:
        self.scheduler.call(self.inner.release).result()


class ColocatedSessions:
    """The draft half of a target worker that holds both models (see the module docstring)."""

    def __init__(self, scheduler: StepScheduler, target, draft, vocab: int, eos_ids: set[int], *,
                 gamma_max: int = 8, kv_cache_tokens: int = 65536, name: str = "draft", top_k_q: int = 0,
                 prefix_caching: bool = True):
        self.scheduler, self.target, self.vocab, self.gamma_max = scheduler, target, vocab, gamma_max
        self.draft = ScheduledDraft(scheduler, draft, vocab, top_k_q, name, kv_cache_tokens,
                                    prefix_caching=prefix_caching, target_pool=scheduler.pool)
        self.sessions = SessionFactory(vocab, eos_ids, gamma_max=gamma_max, cost_profile=self._measure_costs)
        self.calibration: dict | None = None  # what the costs depend on (`engine.calibration.identity`): cached

    def proposer(self, lookup: bool = True, target_sequence=None) -> Proposer:
        model = self.draft.proposer(target_sequence)
        return LookupOrModelProposer(model) if lookup else model

    def cost_profile(self) -> tuple[dict[int, float], float]:
        """(seconds per target step over n positions, per draft token), measured once, alone on the worker."""
        return self.sessions.cost_profile()

    def _measure_costs(self) -> tuple[dict[int, float], float]:
        return calibration.cached(self.calibration, self._measure_now)

    def _measure_now(self) -> tuple[dict[int, float], float]:
        pool = self.scheduler.pool
        sequence = pool.sequence() if pool is not None else model_sequence(self.target)
        verify = self.scheduler.call(verify_profile, self.target, self.vocab, self.gamma_max + 1, 64, 3,
                                     sequence).result()
        target = None
        if self.draft.reads_target:  # the head reads the features of a target sequence that has seen the context
            target = pool.sequence()
            self.scheduler.call(target.feed, profile_context(self.vocab)[:-1]).result()
        seconds = draft_step_time(self.proposer(lookup=False, target_sequence=target), self.vocab)
        if target is not None:
            self.scheduler.call(target.release).result()
        return verify, seconds

    def rounds(self, engine: TargetVerifier, prompt: list[int], params: SamplingParams, rng: PositionRNG,
               max_tokens: int, gamma: int | str, lookup: bool, open_sessions: int = 1) -> Iterator[Round]:
        """The session's rounds over the scheduler. open_sessions: sessions open on the worker, this one
        included (auto's first guess at the load)."""
        controller = self.sessions.controller(gamma, open_sessions)
        return self.sessions.rounds(prompt, self.proposer(lookup, engine.seq), ScheduledVerifier(self.scheduler, engine),
                                    controller, params, rng, max_tokens)
