"""The single-process speculative decoder: the library API.

    dec = SpeculativeDecoder(target="embedded", draft="default", gamma="auto")
    res = dec.generate("Hello", SamplingParams(temperature=0), max_new_tokens=64)

A generation is a loop of rounds: choose γ → draft proposes → target verifies
in one forward → emit accepted tokens plus one → feed the γ controller with
what the round showed. Caches live in the proposer and the verifier of the
session and are cropped, never rebuilt. Randomness is keyed by position
(`speculation.rng`), so a seed and a fixed γ fix the output.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from specserve.engine.loop import Round
from specserve.engine.profile import draft_step_time, profile_context, verify_profile
from specserve.engine.prompts import Prompt, PromptCodec, cut_at_stop
from specserve.engine.proposers import LookupOrModelProposer, ModelProposer, NgramProposer, Proposer, TargetVerifier
from specserve.engine.session import SessionFactory, gamma_spec
from specserve.engine.stats import GenerationStats
from specserve.models import LoadedModel, load_model, resolve_draft
from specserve.models.drafts.eagle3 import Eagle3Head, Eagle3Sequence, is_eagle3, load_eagle3
from specserve.models.drafts.head import HeadPool, HeadSequence, is_head, load_head
from specserve.models.families.lean import draft_dtype, model_sequence, unsupported_reason
from specserve.models.formats.loading import load_draft
from specserve.models.memory.pool import KVPool, wants_runner
from specserve.speculation import GammaController, PositionRNG, SamplingParams


@dataclass
class GenerationResult:
    token_ids: list[int]  # new tokens only
    text: str | None  # None when no tokenizer is known
    finish_reason: str  # "stop" (eos or a stop string) or "length"
    prompt_tokens: int
    stats: GenerationStats = field(default_factory=GenerationStats)
    # per new token (token, log-probability, top alternatives) when params.logprobs is set
    logprobs: list | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "token_ids": self.token_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "stats": self.stats.to_dict(),
        }


class SpeculativeDecoder:
    """Lossless speculative decoding with a target model and a draft.

    target: HF id or local directory, `.gguf` file, "embedded", or a loaded
      `PreTrainedModel`. draft: the same kinds (sharing the target's
      vocabulary), "embedded-draft" (the distilled draft shipped for the
      embedded target), "ngram" (prompt lookup), "default" (embedded-draft
      for the embedded target, else ngram) or None for plain target decoding. gamma: an int (fixed; 0 = plain target
      decoding), "auto" (cost model, default) or "heuristic". dtype:
      "float32", "bfloat16" or None (keep a passed model's dtype; otherwise
      bf16 where it is fast — GPUs and CPUs with bf16 instructions — else fp32).
    draft_top_k: a model draft samples from its top-k-truncated q (0 = full q).
    draft_stop_below: a model draft ends its block early where its own top
      probability is below this (0, the default: always draft γ); exact in
      distribution either way. Off by default: seeded outputs then depend on
      the draft's numerics at the threshold (pipelined and sequential seeded
      T=1 runs differed in a test), which fixed γ does not.
    draft_lookup: a model draft first looks the context up (prompt lookup, a
      match of 2+ tokens) and proposes what followed there, drafting with the
      model elsewhere; free, and it wins where output copies the prompt
      (rewriting, code). Which one drafts depends on the context only.
    quantization: how the target's linear layers are stored (`models.kernels.quant`): "auto" (None) serves a GGUF
      file (the embedded target included) from its own quantized weights and anything else dense; "none"
      dense; "int8" (per row) or "int4" (groups of 32; int4-g64, int4-g128) quantized at load. Quantized
      targets compute in bfloat16, and are different models from their dense versions: the output is
      exactly the quantized target's distribution. draft_quantization: the same for a model draft.
    kv_cache_tokens: a target of `models.families.arch`'s families runs on the serving workers' lean forward and KV pool (a batch of
      one here); the pool holds this many positions (default: two sequences of the model's full context).
      Other targets run the HF forward with a per-generation cache.
    prefix_caching: that pool keeps finished generations' keys and values, and a generation whose prompt
      starts with tokens already computed prefills only the rest (`models.memory.prefix`); same output either way.
    """

    def __init__(
        self,
        target: Any = "embedded",
        draft: Any = "default",
        gamma: int | str = "auto",
        dtype: str | torch.dtype | None = None,
        *,
        gamma_max: int = 8,
        draft_top_k: int = 0,
        draft_stop_below: float = 0.0,
        draft_lookup: bool = True,
        device: str | None = None,
        kv_cache_tokens: int | None = None,
        quantization: str | None = None,
        draft_quantization: str | None = None,
        prefix_caching: bool = True,
    ):
        gamma = gamma_spec(gamma)  # before any model loads
        self.gamma_max = gamma_max
        self.draft_top_k = draft_top_k
        self.draft_stop_below = draft_stop_below
        self.draft_lookup = draft_lookup
        self.target: LoadedModel = load_model(target, dtype, device, quantization=quantization)
        self.tokenizer = self.target.tokenizer
        self.draft: LoadedModel | None = None
        draft = resolve_draft(target, draft)
        self.draft_kind = "none" if draft is None else "ngram" if draft == "ngram" else "model"
        self.head = None
        if is_head(draft):  # a head on the target's features: beside the target, no model of its own to load
            self.draft_kind = "head"
            self.head = load_head(draft, self.target, draft_quantization)
        elif is_eagle3(draft):  # a public EAGLE-3 head: the same, on hidden states of three of the target's layers
            self.draft_kind = "head"
            self.head = load_eagle3(draft, self.target)
        if self.draft_kind == "model":
            self.draft = load_draft(draft, dtype, str(self.target.device) if device is None else device,
                                    draft_quantization)
            if self.draft.vocab_size != self.target.vocab_size:
                raise ValueError(
                    f"draft and target must share the vocabulary: draft vocab size {self.draft.vocab_size} "
                    f"!= target vocab size {self.target.vocab_size}"
                )
            if self.tokenizer is None:
                self.tokenizer = self.draft.tokenizer
        eos_ids = set(self.target.eos_ids)
        if self.target.tokenizer is None and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos_ids.add(self.tokenizer.eos_token_id)
        self.codec = PromptCodec(self.tokenizer, self.target.vocab_size, self.target.max_positions)
        self.kv_pool: KVPool | None = None
        if unsupported_reason(self.target.model) is None:
            tokens = kv_cache_tokens or 2 * (self.target.max_positions or 4096)
            self.kv_pool = KVPool(self.target.model, tokens, prefix_caching=prefix_caching,
                                  features=self.head.aux if isinstance(self.head, Eagle3Head) else self.head is not None)
        elif self.head is not None:
            raise ValueError(f"a feature head drafts from the pooled forward's features; the target has "
                             f"{unsupported_reason(self.target.model)}")
        # a model draft drafts on a pool of its own where that pool's step runner replays CUDA graphs (its private
        # cache's eager steps are launch-bound there: 13 ms per token of a 135M draft on an H200, 2.6 ms replayed),
        # or where the pool runs each layer as one call of the CPU kernels (the private cache goes op by op)
        self.draft_pool: KVPool | None = None
        if self.draft is not None and unsupported_reason(self.draft.model) is None:
            device = next(self.draft.model.parameters()).device
            tokens = kv_cache_tokens or 2 * (self.draft.max_positions or 4096)
            if wants_runner(device, None):
                self.draft_pool = KVPool(self.draft.model, tokens, draft_dtype(self.draft.model), max_width=gamma_max + 1)
            elif device.type == "cpu" and getattr(self.draft.model, "specserve_quant", None) is not None:
                pool = KVPool(self.draft.model, tokens, draft_dtype(self.draft.model), runner=False)
                self.draft_pool = pool if pool.fuses_layers else None
        # a head drafts through a pool beside the target's where that pool has a step runner (its steps then run
        # as the target's: captured, compiled), else on a cache of its own
        self.head_pool: HeadPool | None = None
        if self.head is not None and self.kv_pool.runner is not None and not isinstance(self.head, Eagle3Head):
            self.head_pool = HeadPool(self.head, self.kv_pool, self.kv_pool.allocator.capacity)
        for role, pool in (("target", self.kv_pool), ("draft", self.draft_pool or self.head_pool)):
            if pool is not None and pool.runner is not None and pool.runner.compile_mode:  # compiled steps (CUDA)
                pool.warm_up(range(1, gamma_max + 2) if role == "target" else None,
                             lambda line, role=role: print(f"[specserve] {role} steps: {line}", file=sys.stderr))
        self.sessions = SessionFactory(self.target.vocab_size, eos_ids, gamma=gamma, gamma_max=gamma_max,
                                       has_draft=self.draft_kind != "none", cost_profile=self._measure_costs)

    def new_proposer(self, lookup: bool | None = None, target_sequence=None) -> Proposer | None:
        """A session's draft; a feature head's reads `target_sequence` (the session's target cache)."""
        vocab = self.target.vocab_size
        if self.draft_kind == "ngram":
            return NgramProposer(vocab)
        if self.draft_kind == "head":
            target_sequence = target_sequence if target_sequence is not None else self.target_sequence()
            if isinstance(self.head, Eagle3Head):
                sequence = Eagle3Sequence(self.head, target_sequence)
            else:
                sequence = self.head_pool.sequence(target_sequence) if self.head_pool is not None \
                    else HeadSequence(self.head, target_sequence)
            model = ModelProposer(self.head, vocab, self.draft_top_k, name="head", sequence=sequence)
            return LookupOrModelProposer(model) if (self.draft_lookup if lookup is None else lookup) else model
        if self.draft_kind == "model":
            model = ModelProposer(self.draft.model, vocab, self.draft_top_k, name=self.draft.name, lazy_prefill=True,
                                  stop_below=self.draft_stop_below,
                                  sequence=self.draft_pool.sequence() if self.draft_pool is not None else None)
            return LookupOrModelProposer(model) if (self.draft_lookup if lookup is None else lookup) else model
        return None

    def target_sequence(self):
        """A fresh cache of the target for one generation."""
        return self.kv_pool.sequence() if self.kv_pool is not None else model_sequence(self.target.model)

    @property
    def gamma(self) -> int | str:
        return self.sessions.gamma

    @property
    def eos_ids(self) -> set[int]:
        """Tokens that end a generation (kept in the output); assignable."""
        return self.sessions.eos_ids

    @eos_ids.setter
    def eos_ids(self, ids) -> None:
        self.sessions.eos_ids = set(ids)

    def cost_profile(self) -> tuple[dict[int, float], float]:
        """(seconds per target forward over n positions, seconds per draft token); measured once."""
        return self.sessions.cost_profile()

    def controller(self, gamma: int | str | None = None) -> GammaController:
        """A generation's γ controller (`auto`: calibrated once, warm-started from the previous generation)."""
        return self.sessions.controller(gamma)

    def _measure_costs(self) -> tuple[dict[int, float], float]:
        vocab = self.target.vocab_size
        verify = verify_profile(self.target.model, vocab, self.gamma_max + 1, sequence=self.target_sequence())
        target = self.target_sequence() if self.draft_kind == "head" else None
        if target is not None:  # the head reads the features of a target that has seen the context
            target.feed(profile_context(vocab)[:-1])
        proposer = self.new_proposer(target_sequence=target)
        seconds = draft_step_time(proposer, vocab) if proposer is not None else 0.0
        if target is not None:
            target.release()
        return verify, seconds

    # -- prompts -------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        return self.codec.encode(prompt)

    def decode(self, token_ids: list[int]) -> str | None:
        return self.codec.decode(token_ids)

    # -- generation ------------------------------------------------------------
    def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        max_new_tokens: int = 128,
        gamma: int | str | None = None,
        draft_lookup: bool | None = None,
    ) -> GenerationResult:
        params = params or SamplingParams()
        stats = GenerationStats()
        tokens: list[int] = []
        finish = "length"
        prompt_ids = self.encode(prompt)
        controller = self.controller(gamma)  # auto calibrates once, here: out of the timed generation
        t_start = time.perf_counter()
        logprobs: list | None = [] if params.logprobs is not None else None
        for rnd in self.rounds(prompt_ids, params, max_new_tokens, controller, stats, draft_lookup):
            stats.record(rnd)
            tokens.extend(rnd.tokens)
            finish = rnd.finish_reason or finish
            if logprobs is not None:
                logprobs.extend(rnd.logprobs)
        stats.total_time_s = time.perf_counter() - t_start
        stats.new_tokens = len(tokens)
        text = self.decode(tokens)
        if text is not None and params.stop:
            text, stopped = cut_at_stop(text, params.stop)
            finish = "stop" if stopped else finish
        return GenerationResult(tokens, text, finish, len(prompt_ids), stats, logprobs)

    def rounds(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        max_new_tokens: int,
        gamma: int | str | GammaController | None = None,
        stats: GenerationStats | None = None,
        draft_lookup: bool | None = None,
    ) -> Iterator[Round]:
        """Yield one `Round` per round (draft_lookup: None = the decoder's). `stats` gets the controller's name;
        the rounds are the caller's to record (`GenerationStats.record`)."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        room = self.codec.check_length(prompt_ids)
        if room is not None:
            max_new_tokens = min(max_new_tokens, room)
        controller = gamma if isinstance(gamma, GammaController) else self.controller(gamma)
        if stats is not None:
            stats.controller = controller.name
        hit_stop = (lambda generated: self._hit_stop(generated, params)) if params.stop else None
        verifier = TargetVerifier(self.target.model, self.target.vocab_size, self.target_sequence())
        return self.sessions.rounds(prompt_ids, self.new_proposer(draft_lookup, verifier.seq), verifier, controller,
                                    params, PositionRNG(params.seed), max_new_tokens, hit_stop)

    def _hit_stop(self, generated: list[int], params: SamplingParams) -> bool:
        text = self.decode(generated)
        return text is not None and any(s in text for s in params.stop)
