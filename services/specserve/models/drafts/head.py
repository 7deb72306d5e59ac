"""A draft head on the target's own features (EAGLE's design: Li et al. 2024).

A separate small LM drafts from the tokens alone and, on a GPU, costs dozens of kernel launches a token. The
head reads what the target computed already: at each position j, the target's feature f_j (its normed final
hidden state, the input of its LM head, which the pool keeps per position: `KVPool(features=True)`) and the
embedding of the token after it, x_{j+1}. One Llama decoder layer at the target's hidden size runs over
fc([f_j, e(x_{j+1})]) with its own KV cache; its normed output predicts f_{j+1}, and its head, over a token
subset, the token after that. Drafting goes on on its own predictions: (f̂_{j+1}, x_{j+2}) -> f̂_{j+2}, ...

The head's q goes through the same rejection sampler as any draft, so the target's distribution is kept
whatever the head predicts. The embedding is the target's, frozen and not stored (`SubsetDraftForCausalLM`'s
`shared_from`), and a head is saved and loaded like that draft.

`HeadSequence` is one session's head cache with the `TokenSequence` methods `engine.proposers.ModelProposer`
drafts through: each block it first feeds the target features of the positions committed since the last one
(replacing what it had predicted there), then drafts on its own. `HeadPool` keeps many sessions' head caches
in one arena beside the target's pool (a served target worker's), so one forward runs every session's next
head step, as `KVPool` does for a draft LM.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from specserve.models.drafts.configs import FeatureHeadConfig
from specserve.models.drafts.subset import SubsetDraftForCausalLM, embedding_digest
from specserve.models.families.lean import LeanSequence, head_logits, lean_forward, norm, widen
from specserve.models.formats.loading import draft_quantization
from specserve.models.kernels.quant import QuantizedLinear, QuantSpec, dense_from, linear, quantize
from specserve.models.memory.pool import UNKNOWN, KVPool, PooledSequence
from specserve.models.memory.runner import StepRunner
from specserve.quantization import parse


class FeatureHeadForCausalLM(SubsetDraftForCausalLM):
    """One Llama decoder layer over fc([target feature, next token's embedding]); a head over a token subset."""

    config_class = FeatureHeadConfig

    def __init__(self, config: FeatureHeadConfig):
        super().__init__(config)
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.post_init()

    def forward(self, features: torch.Tensor, input_ids: torch.Tensor, **kwargs):
        """features [B, T, hidden] (the target's f_j) and input_ids [B, T] (x_{j+1}) -> (predicted features
        f̂_{j+1} [B, T, hidden], logits over the subset [B, T, subset]): the whole sequence at once (training)."""
        inputs = self.fc(torch.cat([features, self.model.embed_tokens(input_ids)], -1))
        hidden = self.model(inputs_embeds=inputs, **kwargs).last_hidden_state
        return hidden, self.lm_head(hidden)

    @classmethod
    def for_target(cls, target, token_subset: torch.Tensor | None = None, seed: int = 0,
                   shared_from: str | None = None, layers: int = 1) -> FeatureHeadForCausalLM:
        """A randomly initialised head of `layers` decoder layers for `target` (a loaded HF model): its hidden
        size, heads and rope, its embedding (frozen), its head rows over `token_subset` (default: the whole
        vocabulary) to start from."""
        vocab = target.config.vocab_size
        subset = torch.arange(vocab) if token_subset is None else torch.as_tensor(token_subset)
        config = head_config(target.config, len(subset), layers, shared_from=shared_from,
                             shared_embedding_digest=embedding_digest(target.get_input_embeddings().weight))
        torch.manual_seed(seed)
        param = next(target.parameters())
        head = cls(config).to(dtype=param.dtype, device=param.device).eval()
        with torch.no_grad():
            head.model.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
            head.lm_head.weight.copy_(target.get_output_embeddings().weight[subset.to(param.device)])
            head.token_subset.copy_(subset)
        return head


def fc_weight(head: FeatureHeadForCausalLM, w):
    """The head's fc as its lean steps multiply it (`w`: its `LeanWeights`): quantized as its layers are; made
    once per dtype, as the layers' weights are (a session's cache is made per session)."""
    cache = head.__dict__.setdefault("_specserve_fc", {})
    if w.dtype not in cache:
        weight = head.fc.weight.detach()
        spec = getattr(head, "specserve_quant", None)
        cache[w.dtype] = weight.to(w.device, w.dtype).contiguous() if spec is None else \
            QuantizedLinear(quantize(weight, spec.method, spec.group), w.dtype, w.device, spec.dense_from)
    return cache[w.dtype]


def drafts_on_zeros(head: FeatureHeadForCausalLM) -> bool:
    """Whether a head drafts on a zero feature where the target's is not known yet (trained so: `distill
    --feature-dropout`), rather than on its own predicted one (EAGLE's way, the default)."""
    return getattr(head.config, "drafted_feature", "predicted") == "zero"


def head_config(tc, subset_size: int, layers: int = 1, **extra) -> FeatureHeadConfig:
    """A head's config for a target of config `tc`: `layers` layers at its hidden size, its heads, rope and norm
    eps."""
    heads = tc.num_attention_heads
    return FeatureHeadConfig(
        token_subset_size=subset_size, vocab_size=tc.vocab_size, hidden_size=tc.hidden_size,
        intermediate_size=tc.intermediate_size, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=tc.num_key_value_heads, head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // heads,
        max_position_embeddings=tc.max_position_embeddings, rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
        rope_parameters=getattr(tc, "rope_parameters", None), bos_token_id=None, eos_token_id=None,
        pad_token_id=None, **extra)


class _FeaturePositions:
    """What both head caches keep of their session's target sequence (`target`): position j holds (f_j, x_{j+1});
    the first `true` positions were fed (or are to be fed, at the next step) the target's features, later ones
    the head's own predictions (`last`: the latest, [1, hidden]), replaced at the next block."""

    target: PooledSequence
    true: int = 0
    last: torch.Tensor | None = None

    def true_tail(self, tokens: list[int]) -> list[int]:
        """For the committed context `tokens`: roll back to the positions still right and return the tokens of
        those to feed with the target's features, (f_j, tokens[j+1]) for every j the target holds since; [] where
        it holds none yet: then the head drafts on from a zero feature (after `equal_logits`)."""
        m = len(tokens) - 1  # positions with a known feature: the target holds tokens[:m]
        if m < 1 or self.target.block is None or len(self.target.tokens) < m:
            self.rollback(0)
            features = self.target.pool.features
            self.last = features.new_zeros(1, features.shape[1])
            return []
        keep = min(self.true, self.common_prefix(tokens[1 : m + 1]), m - 1)
        self.rollback(keep)
        self.true = m
        return tokens[keep + 1 : m + 1]

    def equal_logits(self) -> torch.Tensor:
        """The head's logits where there is no target feature to read (`true_tail` returned []): all equal."""
        return torch.zeros(1, len(self.token_subset) if self.token_subset is not None else self.target.pool.vocab)

    def rollback(self, length: int) -> None:
        super().rollback(length)
        self.true = min(self.true, length)

    def release(self) -> None:
        super().release()
        self.true, self.last = 0, None


class HeadSequence(_FeaturePositions, LeanSequence):
    """One session's head cache over a target sequence of a pool that keeps features (`TokenSequence` methods
    as `ModelProposer` calls them: `subset_logits_after`, `feed_subset`, `logits_after`, `release`); its `tokens`
    are the x_{j+1} of its positions (`_FeaturePositions`)."""

    def __init__(self, head: FeatureHeadForCausalLM, target_sequence, dtype: torch.dtype | None = None):
        super().__init__(head, dtype or next(head.parameters()).dtype)
        self.target = target_sequence
        self.fc = fc_weight(head, self.w)
        self.embedding = head.model.embed_tokens.weight
        self.zero_drafted = drafts_on_zeros(head)

    def _target_features(self, start: int, stop: int) -> torch.Tensor:
        pool, block = self.target.pool, self.target.block
        return pool.features[block[0] + start : block[0] + stop]

    @torch.inference_mode()
    def _feed(self, features: torch.Tensor, tokens: list[int]) -> torch.Tensor:
        """Feed (features[i], tokens[i]) at the next positions; the logits over the subset after the last."""
        x = torch.cat([features.to(self.w.dtype), self.embedding[tokens].to(self.w.device, self.w.dtype)], -1)
        self._reserve(len(self.tokens) + len(tokens))
        hidden = lean_forward(self.w, [self], [tokens], [len(tokens)], hidden=linear(x, self.fc), head=False)
        self.tokens.extend(tokens)
        self.forward_calls += 1
        last = norm(self.w, hidden[-1:], self.w.norm)
        self.last = torch.zeros_like(last) if self.zero_drafted else last
        return head_logits(self.w, last, normed=True).cpu()

    def subset_logits_after(self, tokens: list[int]) -> torch.Tensor:
        """Logits over the subset for the token after `tokens` (the committed context): the target's features of
        every position it holds of them fed first."""
        tail = self.true_tail(tokens)
        if not tail:
            return self.equal_logits()
        return self._feed(self._target_features(len(self.tokens), self.true), tail)

    def feed_subset(self, new_tokens: list[int], keep_logits: int = 1) -> torch.Tensor:
        """Draft on: the head's own last predicted feature with the token drafted from it."""
        if len(new_tokens) != 1 or keep_logits != 1:
            raise ValueError("a feature head drafts one token at a time")
        return self._feed(self.last, new_tokens)

    def logits_after(self, tokens: list[int], keep_logits: int = 1) -> torch.Tensor:
        return widen(self.subset_logits_after(tokens), self.token_subset, self.vocab)


# HeadStepRunner.whole_blocks for new runners: None, where its steps are captured as CUDA graphs (tests set it)
WHOLE_BLOCKS: bool | None = None


class HeadStepRunner(StepRunner):
    """A head's drafted steps (one token per sequence, `HeadPool.feed_ids`) as static-shape steps, captured (and
    compiled) as the target's runner's are: each sequence's input is fc([its last predicted feature, the embedding
    of its token]) in place of an embedding, and each output row is [its next predicted feature | its subset
    logits], float32."""

    # block shapes kept (each a graph and its buffers; a sampled one's q rows are batch x steps x head floats):
    # past this, new shapes (e.g. many distinct temperatures) draft step by step
    MAX_BLOCKS = 64

    def __init__(self, w, arena, max_length: int, fc: torch.Tensor, embedding: torch.Tensor, **kwargs):
        super().__init__(w, arena, max_length, max_width=1, **kwargs)
        self.fc, self.embedding = fc, embedding
        # a draft block's drafted steps and their sampling as one graph (`drafted_block`): where steps are captured
        self.whole_blocks = self.capture if WHOLE_BLOCKS is None else WHOLE_BLOCKS
        self.blocks: dict[tuple, _BlockGraph] = {}
        self.block_replays = 0

    def drafted_block(self, key: tuple[int, int, int], blocks: list[int], starts: list[int], ids: torch.Tensor,
                      feature: torch.Tensor, steps: int, head: int, mode: tuple, sample, uniforms: torch.Tensor,
                      subset: torch.Tensor | None, zero_drafted: bool) -> _BlockGraph:
        """`steps` drafted steps of every sequence in bucket `key` with no trip to the host: step s feeds the token
        sampled after step s - 1 (the first: `ids`, with `feature`) and samples the next with `sample(logits,
        uniforms[:, s])` over the first `head` logits columns (-> token in the head, q row or None, confidence),
        all on the device; on CUDA one graph per (bucket, steps, sampling `mode`), captured at its first use and
        replayed. Returns the block's static buffers (tokens, confidences, q, last: valid until its next call)."""
        n = len(blocks)
        b = self.buckets.get(key)
        if b is None:
            b = self.buckets[key] = self._new_bucket(key)
        blk = self.blocks.get((key, steps, mode))
        if blk is None:
            blk = self.blocks[(key, steps, mode)] = _BlockGraph(b, steps, mode != ("greedy",), head)
        self._fill(b, blocks, starts, ids[:, None])
        b.feature[:n].copy_(feature)
        blk.uniforms[:n].copy_(uniforms)

        def body():
            self._block_body(b, blk, steps, sample, subset, zero_drafted)

        if not self.capture or blk.graph is False:
            body()
        elif blk.graph is None:  # (False where capture fails: the same kernels then run uncaptured)
            blk.graph = self._capture(body, fallback=True)
        else:
            blk.graph.replay()
            self.block_replays += 1
        return blk

    def _block_body(self, b, blk: _BlockGraph, steps: int, sample, subset, zero_drafted: bool) -> None:
        """The block's steps on the bucket's static tensors (capturable: nothing read on the host)."""
        size = b.feature.shape[1]
        inputs = b.inputs[:, :, 0]  # [3, batch]: ids, positions, arena rows
        real = (inputs[2] != self.scratch).long()  # padding rows stay at position 0 and the scratch row
        for step in range(steps):
            out = self._step_into(b)  # [batch, size + head rows]
            token, q, confidence = sample(out[:, size : size + blk.head], blk.uniforms[:, step])
            blk.tokens[:, step] = token
            blk.confidences[:, step] = confidence
            if q is not None:
                blk.q[:, step] = q
            if step + 1 < steps:
                inputs[0].copy_(token if subset is None else subset[token])
                inputs[1:] += real
                if zero_drafted:
                    b.feature.zero_()
                else:
                    b.feature.copy_(out[:, :size])
        blk.last.copy_(out[:, :size])

    def _new_bucket(self, key):
        bucket = super()._new_bucket(key)
        bucket.feature = torch.zeros(bucket.batch, self.fc.shape[0], dtype=self.w.dtype, device=self.w.device)
        if self._compiled and self._dynamic_batch and bucket.batch > 1:
            torch._dynamo.mark_dynamic(bucket.feature, 0)
        return bucket

    def _inputs(self, b, ids: torch.Tensor) -> torch.Tensor:
        x = torch.cat([b.feature, self.embedding[ids].to(self.w.device, self.w.dtype)], -1)
        return linear(x, self.fc)

    def _outputs(self, x: torch.Tensor, new_slots: torch.Tensor) -> torch.Tensor:
        last = norm(self.w, x, self.w.norm)
        return torch.cat([last.float(), head_logits(self.w, last, normed=True).float()], -1)


class _BlockGraph:
    """The static buffers (and on CUDA the graph) of one drafted block shape: (bucket, steps, sampling mode)."""

    def __init__(self, bucket, steps: int, sampled: bool, head: int):
        batch, dev = bucket.batch, bucket.inputs.device
        self.head = head  # the logits columns sampled over
        self.uniforms = torch.zeros(batch, steps, dtype=torch.float64, device=dev)
        self.tokens = torch.zeros(batch, steps, dtype=torch.long, device=dev)
        self.confidences = torch.zeros(batch, steps, dtype=torch.float64, device=dev)
        self.q = torch.zeros(batch, steps, head, dtype=torch.float32, device=dev) if sampled else None
        self.last = torch.zeros(batch, bucket.feature.shape[1], dtype=torch.float32, device=dev)
        self.graph = None  # None: not captured yet; False: capture failed, run uncaptured


class HeadPool(KVPool):
    """Feature heads' caches for the sequences of one target pool (`KVPool(features=True)`): one forward over
    every session's new head positions, each fed fc([feature, embedding]) in place of its token's embedding.
    A position below a sequence's `true` count takes the target's feature there, read at the step from the
    target's arena (where its block is then); a drafted one the head's own prediction (`last`)."""

    concurrent_forwards = False  # one compute lane only (`StepScheduler.lanes`)

    def __init__(self, head: FeatureHeadForCausalLM, target: KVPool, tokens: int, dtype: torch.dtype | None = None,
                 runner: bool | None = None):
        if target.features is None:
            raise ValueError("a feature head's pool reads a target pool that keeps features (KVPool(features=True))")
        super().__init__(head, tokens, dtype or target.w.dtype, max_length=target.max_length, runner=False)
        self.target = target
        self.fc = fc_weight(head, self.w)
        self.embedding = head.model.embed_tokens.weight
        self.zero_drafted = drafts_on_zeros(head)
        if target.runner is not None if runner is None else runner:  # drafted steps run as the target's steps do
            self.runner = HeadStepRunner(self.w, (self.k, self.v), self.max_length, self.fc, self.embedding,
                                         compile=None if target.runner is None else target.runner.compile_mode)

    def sequence(self, target_sequence: PooledSequence | None = None) -> PooledHeadSequence:
        if target_sequence is None:
            raise ValueError("a head's sequence reads a target sequence of the pool it was made for")
        return PooledHeadSequence(self, target_sequence)

    def _compute(self, seqs: list, new_tokens: list[list[int]], keeps: list[int]) -> torch.Tensor:
        if self.runner is not None and all(len(t) == 1 and seq.true <= len(seq.tokens) and seq.last is not None
                                           and keep <= 1 for seq, t, keep in zip(seqs, new_tokens, keeps)):
            # every sequence drafts on its own prediction (the in-process per-token path): the runner's step
            logits = self._drafted(seqs, torch.tensor([t[0] for t in new_tokens], device=self.w.device))
            kept = [j for j, keep in enumerate(keeps) if keep]
            return logits[kept] if kept else logits.new_zeros(0, 0)
        rows, offsets, total = [], [], 0
        for seq, tokens in zip(seqs, new_tokens):
            start = len(seq.tokens)
            true = max(0, min(seq.true - start, len(tokens)))  # the first `true` new positions have target features
            if true:
                first = seq.target.block[0] + start
                rows.append(self.target.features[first : first + true])
            if true < len(tokens):
                if len(tokens) - true != 1 or seq.last is None:
                    raise ValueError("a feature head drafts one token at a time, after the target's features")
                rows.append(seq.last)
            total += len(tokens)
            offsets.append(total)
        ids = torch.tensor([t for tokens in new_tokens for t in tokens], device=self.embedding.device)
        x = torch.cat([torch.cat(rows).to(self.w.dtype), self.embedding[ids].to(self.w.device, self.w.dtype)], -1)
        hidden = lean_forward(self.w, seqs, new_tokens, [len(t) for t in new_tokens],
                              (self.k, self.v, [seq.block[0] for seq in seqs]), hidden=linear(x, self.fc), head=False)
        last = norm(self.w, hidden[torch.tensor(offsets, device=hidden.device) - 1], self.w.norm)
        fed_back = torch.zeros_like(last) if self.zero_drafted else last
        for j, seq in enumerate(seqs):
            seq.last = fed_back[j : j + 1]
            if keeps[j] > 1:
                raise ValueError("a feature head keeps the logits after its last position only")
        kept = [j for j, keep in enumerate(keeps) if keep]
        return head_logits(self.w, last[kept], normed=True) if kept else last.new_zeros(0, 0)

    def _drafted(self, seqs: list, ids: torch.Tensor) -> torch.Tensor:
        """A drafted step: each sequence's last prediction with its token (ids: on the device), through the runner
        where the step fits a bucket. Sets each sequence's next prediction (`last`); returns the subset logits
        [n, head rows] (through the runner: a view of its output, valid until its next step)."""
        feature = torch.cat([seq.last for seq in seqs]).to(self.w.dtype)
        blocks, starts = [seq.block[0] for seq in seqs], [len(seq.tokens) for seq in seqs]
        key = self.runner.bucket_for(len(seqs), 1, max(starts) + 1) if self.runner is not None else None
        if key is not None:
            out = self.runner.forward(key, blocks, starts, ids[:, None], feature)
            size = feature.shape[1]
            last, logits = out[:, :size].to(self.w.dtype, copy=True), out[:, size:]
        else:
            x = torch.cat([feature, self.embedding[ids.to(self.embedding.device)].to(self.w.device, self.w.dtype)], -1)
            hidden = lean_forward(self.w, seqs, [[UNKNOWN]] * len(seqs), [1] * len(seqs), (self.k, self.v, blocks),
                                  hidden=linear(x, self.fc), head=False)
            last = norm(self.w, hidden, self.w.norm)
            logits = head_logits(self.w, last, normed=True)
        if self.zero_drafted:
            last = torch.zeros_like(feature)
        for j, seq in enumerate(seqs):
            seq.last = last[j : j + 1]
        return logits

    @torch.inference_mode()
    def feed_ids(self, seqs: list, ids: torch.Tensor) -> torch.Tensor:
        """A drafted step whose tokens are still on the device (`KVPool.feed_ids`; `scheduler.drafting`): each
        sequence's own last prediction with its token; the logits over the subset [len(seqs), n] on the device."""
        for seq in seqs:
            self.reserve(seq, len(seq.tokens) + 1)
        logits = self._drafted(seqs, ids)
        for seq in seqs:
            seq.tokens.append(UNKNOWN)
            seq.forward_calls += 1
        return logits

    @torch.inference_mode()
    def drafted_block(self, seqs: list, ids: torch.Tensor, steps: int, head: int, mode: tuple, sample,
                      uniforms: torch.Tensor, subset: torch.Tensor | None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """`steps` drafted steps of every sequence at once (`HeadStepRunner.drafted_block`), the first feeding
        `ids` (on the device) after each sequence's last prediction: what `steps` calls of `feed_ids` with
        on-device sampling between them do (subset: the head's token ids on the device, or None). Returns (tokens in the head [n, steps], confidences [n, steps],
        q rows [n, steps, head] or None), on the device; None (nothing done) where no bucket holds the block."""
        runner = self.runner
        if runner is None or not getattr(runner, "whole_blocks", False):
            return None
        key = runner.bucket_for(len(seqs), 1, max(len(seq.tokens) for seq in seqs) + steps)
        if key is None or ((key, steps, mode) not in runner.blocks and len(runner.blocks) >= runner.MAX_BLOCKS):
            return None
        for seq in seqs:
            self.reserve(seq, len(seq.tokens) + steps)
        feature = torch.cat([seq.last for seq in seqs]).to(self.w.dtype)
        blocks, starts = [seq.block[0] for seq in seqs], [len(seq.tokens) for seq in seqs]
        blk = runner.drafted_block(key, blocks, starts, ids, feature, steps, head, mode, sample, uniforms, subset,
                                   self.zero_drafted)
        n = len(seqs)
        last = torch.zeros_like(feature) if self.zero_drafted else blk.last[:n].to(self.w.dtype)
        for j, seq in enumerate(seqs):
            seq.last = last[j : j + 1]
            seq.tokens.extend([UNKNOWN] * steps)
            seq.forward_calls += steps
        return blk.tokens[:n], blk.confidences[:n], None if blk.q is None else blk.q[:n]


class PooledHeadSequence(_FeaturePositions, PooledSequence):
    """One session's head cache in a `HeadPool` (what `HeadSequence` is on a cache of its own); `target` is the
    session's sequence in the target pool, whose features it reads."""

    def __init__(self, pool: HeadPool, target: PooledSequence):
        super().__init__(pool)
        self.target = target

    def unfed(self, tokens: list[int], keep_logits: int) -> list[int]:
        if keep_logits != 1:
            raise ValueError("a feature head keeps the logits after its last position only")
        return self.true_tail(tokens)

    def feed_subset(self, new_tokens: list[int], keep_logits: int = 1) -> torch.Tensor:
        return self.pool.forward([self], [new_tokens], [keep_logits]) if new_tokens else self.equal_logits()

    @property
    def fused(self) -> bool:
        """Whether a block is drafted whole on the device (in process: where the pool's runner drafts whole blocks,
        `HeadPool.drafted_block`), which `ModelProposer` then asks for through `draft_block`."""
        runner = self.pool.runner
        return runner is not None and getattr(runner, "whole_blocks", False)

    def draft_block(self, context: list[int], gamma: int, params, rng, top_k_q: int = 0):
        """Bring the cache to `context` and draft `gamma` tokens after it as one block (`drafting.draft_blocks`)."""
        from specserve.scheduler.drafting import DraftBlock, draft_blocks, room

        head = len(self.token_subset) if self.token_subset is not None else self.pool.vocab
        block = DraftBlock(self, self.unfed(context, 1), gamma, params, rng, len(context), top_k_q, head)
        self.pool.reserve(self, room(block))
        return draft_blocks(self.pool, [block])[0]


AutoModelForCausalLM.register(FeatureHeadConfig, FeatureHeadForCausalLM)


HEAD_PREFIX = "head:"


def is_head(spec) -> bool:
    """Whether a draft spec names a feature head: a loaded one, or "head:PATH"."""
    return isinstance(spec, FeatureHeadForCausalLM) or (isinstance(spec, str) and spec.startswith(HEAD_PREFIX))


def load_head(spec, target, quantization: str | None = None) -> FeatureHeadForCausalLM:
    """The head a spec names, on the target's (a `LoadedModel`) device and in its dtype, checked against it;
    `quantization` as a model draft's (`loading.draft_quantization`: "auto" is int8 for a bfloat16 head named by
    its path on a CPU that runs specserve's kernels; a head passed loaded stays as it is unless a method is
    named), applied to its layers, fc and head when its steps first run."""
    if isinstance(spec, FeatureHeadForCausalLM):
        head = spec
    else:
        path = spec[len(HEAD_PREFIX):]
        try:
            head = FeatureHeadForCausalLM.from_pretrained(path)
        except OSError as exc:
            raise ValueError(f"draft {spec!r}: no feature head at {path!r} ({exc})") from exc
    tc, hc = target.model.config, head.config
    if (hc.hidden_size, hc.vocab_size) != (tc.hidden_size, tc.vocab_size):
        raise ValueError(f"draft {spec if isinstance(spec, str) else 'head'}: a head of hidden size "
                         f"{hc.hidden_size} and vocabulary {hc.vocab_size} does not fit a target of "
                         f"{tc.hidden_size} and {tc.vocab_size}")
    head = head.to(device=target.device, dtype=target.dtype).eval()
    method, group = parse(draft_quantization(quantization, spec, target.dtype, target.device))
    if method in ("int8", "int4") and getattr(head, "specserve_quant", None) is None:
        head.specserve_quant = QuantSpec(method, group, None, dense_from(target.device))
    return head
