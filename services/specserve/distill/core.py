"""Knowledge distillation of a draft model from the target.

1. Data (`corpus.py`): the target answers a varied prompt set (chat,
   rewriting, code) at a cycle of temperatures, batched; at every answer
   position its top-k log-probabilities are kept, so training needs no
   teacher forward. User text files are scored the same way. Shards under
   `OUT/corpus/` resume.
2. Draft: with the target's hidden size, a `SubsetDraftForCausalLM` that
   starts from the target's first `layers` layers and final norm, borrows
   its (frozen, unshipped) embedding, and has an LM head over the `subset`
   tokens carrying most of the target's probability mass on the corpus
   (initialised from the target's head rows). `subset 0` keeps the full head
   (a truncated copy of the target); `hidden` smaller than the target's
   trains a fresh small Llama with its own tied embedding. `init` starts
   from an existing subset-head draft of the same target instead (e.g. the
   shipped one), to adapt it to new data in minutes rather than train anew.
3. Training: forward KL(p_target ‖ q_draft) at `kd_temperature` over the
   answer positions, p restricted to what the draft can express; AdamW with
   warm-up and cosine decay; `OUT/checkpoint.pt` every `checkpoint_every`
   steps and at the end, so a rerun resumes.
4. Evaluation on held-out prompts (subjects never used for training), over
   the answer positions only: α at T=0 (the draft's argmax equals the
   target's: a greedy draft token is then accepted) and at T=1 (E Σ min(p, q),
   the expected acceptance of a draft token), and c = time per drafted
   token on the decoder's path / target step time in the speed dtype.
5. `OUT/` is a model directory (`save_pretrained` + tokenizer) usable as
   `draft=OUT`, plus `distill.json` with the settings and metrics.
"""

from __future__ import annotations

import copy
import json
import math
import pathlib
import random
from dataclasses import asdict, dataclass, field, replace

import torch
from tqdm import tqdm

from specserve.distill.corpus import (
    Record,
    build_corpus,
    encode_chat,
    pad_id,
    prompt_set,
    score_texts,
    write_batch,
    write_requests,
)
from specserve.models import LoadedModel, load_model
from specserve.models.drafts.head import FeatureHeadForCausalLM
from specserve.models.drafts.subset import EMBEDDING, SubsetDraftConfig, SubsetDraftForCausalLM, embedding_digest


@dataclass
class DistillConfig:
    target: str = "embedded"
    out: str = "draft-out"
    layers: int = 2
    hidden: int | None = None  # None: the target's hidden size (start from its layers, share its embedding)
    subset: int = 8192  # LM-head rows (most probable tokens); 0: the full vocabulary
    prompts: int = 2400
    self_prompts: int = 1200  # requests the target writes itself (then answers), for variety beyond templates
    gen_tokens: int = 128
    gen_temperatures: tuple[float, ...] = (0.0, 0.7, 1.0)
    gen_batch: int = 48
    top_k: int = 32
    texts: list[str] = field(default_factory=list)  # extra plain-text files
    init: str | None = None  # go on training this subset-head draft (its shape replaces layers/hidden/subset)
    steps: int = 1200
    batch: int = 8
    seq_len: int = 384
    lr: float = 1e-3
    warmup: int = 50
    kd_temperature: float = 1.0
    checkpoint_every: int = 100
    eval_prompts: int = 16
    eval_tokens: int = 96
    seed: int = 0
    head: bool = False  # train a feature head (`models.drafts.head`) instead of a draft LM: one layer on the target's features
    feature_weight: float = 1.0  # the head's loss: KD + this × smooth L1 of its predicted next feature
    feature_dropout: float = 0.0  # > 0: zero this share of the features it reads; it drafts on zeros, not its own
    freeze_init: bool = False  # a head from `init`: keep that draft's layers, norm and head; train fc alone
    live_features: bool = False  # a head: the target's features of each batch computed at its step, none kept

    def corpus_settings(self, count: str = "prompts") -> dict:
        """What a stored part of the corpus depends on; a rerun with other values needs a new --out."""
        return {"target": self.target, count: getattr(self, count), "gen_tokens": self.gen_tokens,
                "gen_temperatures": list(self.gen_temperatures), "gen_batch": self.gen_batch,
                "top_k": self.top_k, "seed": self.seed}


def _check_manifest(directory: pathlib.Path, settings: dict) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    manifest = directory / "manifest.json"
    if manifest.is_file():
        stored = json.loads(manifest.read_text())
        if stored != settings:
            changed = sorted(k for k in settings if stored.get(k) != settings[k])
            raise ValueError(f"{directory} was written with other settings ({', '.join(changed)}); "
                             "use a new --out or delete that folder")
    else:
        manifest.write_text(json.dumps(settings, indent=2))


def load_corpus(target: LoadedModel, cfg: DistillConfig, directory: pathlib.Path, pool=None) -> list[Record]:
    """Templated prompts' answers, self-written requests' answers and scored text files (all resumable).
    pool: a `KVPool` over the target as it serves (`writer_pool`): it writes the answers instead of the float32
    model."""
    model, tokenizer, eos = target.model if pool is None else pool, target.tokenizer, target.eos_ids
    temps = list(cfg.gen_temperatures)
    writer = {"writer": "pool"} if pool is not None else {}  # absent: the float32 model (corpora from before)
    _check_manifest(directory, cfg.corpus_settings("prompts") | writer)
    records = build_corpus(model, tokenizer, eos, directory, prompt_set(cfg.prompts, cfg.seed), temps,
                           cfg.gen_tokens, cfg.gen_batch, cfg.top_k, cfg.seed) if cfg.prompts else []
    if cfg.self_prompts:
        own = directory / "self"
        _check_manifest(own, cfg.corpus_settings("self_prompts") | writer)
        requests = write_requests(model, tokenizer, eos, own, cfg.self_prompts, cfg.gen_batch, cfg.seed)
        records += build_corpus(model, tokenizer, eos, own, requests, temps, cfg.gen_tokens, cfg.gen_batch,
                                cfg.top_k, cfg.seed + 1)
    if cfg.texts:
        records += score_texts(target.model, tokenizer, directory, cfg.texts, cfg.seq_len, cfg.top_k)
    return records


WRITER_ARENA_BYTES = 4 << 30  # the writer's keys and values: a GPU run's --gen-batch 1024 would want 24 GiB


def writer_pool(cfg: DistillConfig, target: LoadedModel, log=print):
    """On a CPU, a `KVPool` over the target in its serving dtype (its quantized kernels where it has them) to write
    the corpus (and for a head, keep its features): several times the answers a second of the float32 model's
    batched generate, and the numbers a served head reads. None on a GPU (the float32 teacher is fast there) or
    for a family the pool does not run."""
    from specserve.models.families.arch import Unsupported, arch_of
    from specserve.models.memory.pool import KVPool

    if target.device.type != "cpu":
        return None
    try:
        a = arch_of(target.model.config)
    except Unsupported as exc:
        log(f"corpus: the float32 model writes it (the pooled forward does not run this family: {exc})")
        return None
    fast = load_model(cfg.target)
    width = 1 << (max(cfg.seq_len, 512 + cfg.gen_tokens) - 1).bit_length()  # a prompt and answer, or a window
    c = fast.model.config
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * a.head_dim * 2  # bf16 keys and values
    rows = max(1, min(cfg.gen_batch, WRITER_ARENA_BYTES // (per_token * width)))
    log(f"corpus: written by the pooled forward in {str(fast.dtype).removeprefix('torch.')}, {rows} answers at once")
    return KVPool(fast.model, rows * width, max_length=width, runner=False, features=cfg.head)


def choose_subset(records: list[Record], vocab: int, size: int, always: set[int]) -> torch.Tensor:
    """The `size` tokens with the most target probability mass over the corpus (plus `always`), sorted."""
    mass = torch.zeros(vocab, dtype=torch.float64)
    for r in records:
        mass.index_add_(0, r.top_ids.reshape(-1).long(), r.top_logprobs.reshape(-1).double().exp())
    for token in always:
        mass[token] = math.inf
    return mass.topk(min(size, vocab)).indices.sort().values


def _draft_config(tcfg, cfg: DistillConfig, embedding: torch.Tensor, head_tokens: int) -> SubsetDraftConfig:
    fields = {k: v for k, v in tcfg.to_dict().items()
              if k not in {"model_type", "architectures", "transformers_version", "_name_or_path",
                           "tie_word_embeddings", "quantization_config", "auto_map"}}
    fields["num_hidden_layers"] = cfg.layers
    if fields.get("layer_types"):
        fields["layer_types"] = list(fields["layer_types"])[: cfg.layers]
    target = cfg.target if cfg.target == "embedded" else str(pathlib.Path(cfg.target).expanduser().resolve())
    return SubsetDraftConfig(token_subset_size=head_tokens, shared_from=target,
                             shared_embedding_digest=embedding_digest(embedding), **fields)


def make_draft(target_model, cfg: DistillConfig, subset: torch.Tensor | None = None,
               start_from: SubsetDraftForCausalLM | None = None):
    """(draft model, names of parameters frozen because they are the target's own).

    subset: the head's tokens (needed unless cfg.subset is 0 or a smaller hidden size is asked for).
    start_from: a subset-head draft to go on training (`initial_draft`) instead of a new one.
    """
    tcfg = target_model.config
    hidden = cfg.hidden or tcfg.hidden_size
    if cfg.head:
        return make_head(target_model, cfg, subset, start_from)
    if start_from is not None:
        draft, frozen = start_from, {EMBEDDING}
    elif hidden != tcfg.hidden_size:
        from transformers import LlamaConfig, LlamaForCausalLM

        heads = max(1, hidden // 64)
        config = LlamaConfig(
            vocab_size=tcfg.vocab_size, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
            num_hidden_layers=cfg.layers, num_attention_heads=heads, num_key_value_heads=heads,
            max_position_embeddings=tcfg.max_position_embeddings, rope_theta=getattr(tcfg, "rope_theta", 10000.0),
            tie_word_embeddings=True, bos_token_id=tcfg.bos_token_id, eos_token_id=tcfg.eos_token_id,
        )
        torch.manual_seed(cfg.seed)
        draft, frozen = LlamaForCausalLM(config), set()
    elif not cfg.subset:
        draft = copy.deepcopy(target_model).float()
        draft.model.layers = draft.model.layers[: cfg.layers]
        draft.config.num_hidden_layers = cfg.layers
        if getattr(draft.config, "layer_types", None):
            draft.config.layer_types = list(draft.config.layer_types)[: cfg.layers]
        frozen = {EMBEDDING, "lm_head.weight"}
    else:
        if tcfg.model_type != "llama":
            raise ValueError(f"a subset-head draft starts from a Llama-family target, not {tcfg.model_type!r}; "
                             "pass --subset 0 (truncated copy) or --hidden H (fresh model)")
        source = target_model.state_dict()
        draft = SubsetDraftForCausalLM(_draft_config(tcfg, cfg, source[EMBEDDING], len(subset))).float()
        state = {k: v for k, v in source.items()
                 if k in (EMBEDDING, "model.norm.weight")
                 or (k.startswith("model.layers.") and int(k.split(".")[2]) < cfg.layers)}
        head = source.get("lm_head.weight", source[EMBEDDING])
        state["lm_head.weight"] = head[subset]
        state["token_subset"] = subset
        missing, unexpected = draft.load_state_dict({k: v.float() if v.is_floating_point() else v
                                                     for k, v in state.items()}, strict=False)
        if unexpected or [m for m in missing if "rotary" not in m]:
            raise ValueError(f"could not start the draft from the target: missing {missing}, unexpected {unexpected}")
        frozen = {EMBEDDING}
    for name, param in draft.named_parameters():
        param.requires_grad_(name not in frozen)
    return draft, frozen


class ScaledFc(torch.nn.Module):
    """A head's fc while it trains: the features' columns stored divided by `scale`. AdamW moves every entry by
    about lr whatever its gradient, and a target's features are an order larger than its embedding (SmolLM2:
    RMS 1.9 against 0.12), so fc's first steps from [0, I] swamped the embedding its layers read; stored this
    way, a step moves what the features add as much as what the embedding adds. `fold_fc` makes it the plain
    fc the head is saved and served with."""

    def __init__(self, weight: torch.Tensor, size: int, scale: float):
        super().__init__()
        self.scale = scale
        self.features = torch.nn.Parameter(weight[:, :size] / scale)
        self.tokens = torch.nn.Parameter(weight[:, size:].clone())

    @property
    def weight(self) -> torch.Tensor:
        return torch.cat([self.features * self.scale, self.tokens], 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight)


def feature_scale(target_model) -> float:
    """RMS of the target's embedding / RMS of its features: a feature is its final norm's weight times a
    unit-RMS vector, so its RMS is about the norm weight's."""
    embedding = target_model.get_input_embeddings().weight.detach().float()
    weight = target_model.model.norm.weight.detach().float()
    return float(embedding.pow(2).mean().sqrt() / weight.pow(2).mean().sqrt().clamp_min(1e-6))


def fold_fc(head: FeatureHeadForCausalLM) -> FeatureHeadForCausalLM:
    """The head with `ScaledFc` made the plain linear fc it is saved and served with."""
    if isinstance(head.fc, ScaledFc):
        fc = torch.nn.Linear(head.fc.weight.shape[1], head.fc.weight.shape[0], bias=False)
        with torch.no_grad():
            fc.weight.copy_(head.fc.weight)
        head.fc = fc.to(head.fc.features.device)
    return head


def make_head(target_model, cfg: DistillConfig, subset: torch.Tensor | None,
              start_from: SubsetDraftForCausalLM | None = None):
    """(a feature head for the target, frozen names): its decoder layer starts from the target's last one (the
    features it reads come out of that layer), fc from [0, I] (the next token's embedding), its head from the
    target's rows over `subset`. From `start_from` (`--init`, a subset-head draft of this target): that draft's
    layers, norm and head, so the head starts as the draft (reading x_{j+1} at position j) and learns what the
    features add to it."""
    target = cfg.target if cfg.target == "embedded" else str(pathlib.Path(cfg.target).expanduser().resolve())
    layers = 1 if start_from is None else start_from.config.num_hidden_layers
    head = FeatureHeadForCausalLM.for_target(target_model, subset, cfg.seed, shared_from=target,
                                             layers=layers).float()
    if start_from is None:
        source = {f"model.layers.0.{k}": v for k, v in target_model.model.layers[-1].state_dict().items()}
        source["model.norm.weight"] = target_model.model.norm.weight
    else:
        if start_from.config.hidden_size != target_model.config.hidden_size:
            raise ValueError(f"--init: a feature head is at the target's hidden size "
                             f"({target_model.config.hidden_size}); this draft's is {start_from.config.hidden_size}")
        source = {k: v for k, v in start_from.state_dict().items()
                  if k.startswith(("model.layers.", "model.norm.", "lm_head."))}
    missing, unexpected = head.load_state_dict({k: v.float() for k, v in source.items()}, strict=False)
    missing = [k for k in missing if k.startswith("model.layers.")]
    if unexpected or missing:
        raise ValueError(f"a feature head starts from Llama-shaped layers; its source has {unexpected} and "
                         f"lacks {missing}")
    head.config.drafted_feature = "zero" if cfg.feature_dropout > 0 else "predicted"
    size = target_model.config.hidden_size
    head.fc = ScaledFc(torch.cat([torch.zeros(size, size), torch.eye(size)], 1), size, feature_scale(target_model))
    frozen = {EMBEDDING}
    if start_from is not None and cfg.freeze_init:  # the draft's acceptance cannot be lost on a small corpus
        frozen = {name for name, _ in head.named_parameters() if name != "fc.features"}
    for name, param in head.named_parameters():
        param.requires_grad_(name not in frozen)
    return head, frozen


@torch.inference_mode()
def corpus_features(target_model, corpus: PackedCorpus, batch: int, log=print) -> torch.Tensor:
    """The target's features (normed final hidden states) at every position of every packed record, once:
    [records, seq_len, hidden] in bfloat16 on the corpus's device. A target forward per training step cost ~10x
    the head's own step on a CPU."""
    out = None
    for start in tqdm(range(0, len(corpus), batch), desc="target features", unit="batch"):
        ids = corpus.ids[start : start + batch]
        hidden = target_model.model(input_ids=ids).last_hidden_state.to(torch.bfloat16)
        if out is None:
            out = torch.empty(len(corpus), ids.shape[1], hidden.shape[-1], dtype=torch.bfloat16, device=ids.device)
        out[start : start + batch] = hidden
    log(f"target features: {tuple(out.shape)}, {out.numel() * 2 / 2**20:.0f} MiB")
    return out


@torch.inference_mode()
def pooled_features(pool, corpus: PackedCorpus, batch: int, log=print) -> torch.Tensor:
    """`corpus_features` from a `writer_pool`'s forward: the features as the served target computes them."""
    out = torch.empty(len(corpus), corpus.ids.shape[1], pool.features.shape[-1], dtype=torch.bfloat16)
    for start in tqdm(range(0, len(corpus), batch), desc="target features", unit="batch"):
        rows = corpus.ids[start : start + batch].tolist()
        seqs = [pool.sequence() for _ in rows]
        try:
            pool.forward(seqs, rows, [1] * len(rows))
            for j, seq in enumerate(seqs):
                out[start + j] = pool.features[seq.block[0] : seq.block[0] + len(rows[j])]
        finally:
            for seq in seqs:
                seq.release()
    log(f"target features: {tuple(out.shape)}, {out.numel() * 2 / 2**20:.0f} MiB")
    return out.to(corpus.ids.device)


def window_features(records: list[Record], corpus: PackedCorpus, log=print) -> torch.Tensor:
    """The features the corpus's writer kept with its records, cut to the packed windows (zeros past a record)."""
    out = torch.zeros(len(corpus), corpus.ids.shape[1], records[0].features.shape[-1], dtype=torch.bfloat16)
    for row, (record, start) in enumerate(zip(records, corpus.starts)):
        part = record.features[start : start + corpus.ids.shape[1]]
        out[row, : len(part)] = part
    log(f"target features: kept by the corpus's writer, {tuple(out.shape)}, {out.numel() * 2 / 2**20:.0f} MiB")
    return out.to(corpus.ids.device)


def cached_features(target_model, corpus: PackedCorpus, cfg: DistillConfig, directory: pathlib.Path,
                    log=print, pool=None, records: list[Record] | None = None) -> torch.Tensor:
    """`corpus_features`, kept beside the corpus (`features-<seq_len>.pt`, keyed by the packed ids) so that a
    second run on the same corpus (another head, other steps) skips the target's pass over it."""
    if records and all(r.features is not None for r in records):  # the writer kept them (`write_batch_pooled`)
        return window_features(records, corpus, log)
    path = directory / f"features-{cfg.seq_len}.pt"
    if path.is_file():
        stored = torch.load(path)
        if torch.equal(stored["ids"], corpus.ids.cpu()):
            log(f"target features: from {path}")
            return stored["features"].to(corpus.ids.device)
    features = corpus_features(target_model, corpus, cfg.gen_batch, log) if pool is None else \
        pooled_features(pool, corpus, cfg.gen_batch, log)
    tmp = path.with_suffix(".tmp")
    torch.save({"ids": corpus.ids.cpu(), "features": features.cpu()}, tmp)
    tmp.replace(path)
    return features


def head_losses(head, features: torch.Tensor, x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
                dropout: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(the head's logits over its tokens where the target's at (rows, cols) predict a token, the smooth L1 of its
    predicted feature there). features: the target's at every position of x ([B, T, hidden]). Head position j
    reads (f_j, x_{j+1}) and predicts the token after x_{j+1}: the target's position j + 1; its feature
    prediction is f_{j+1}. dropout: the share of positions that read a zero feature instead (as a head that
    drafts on zeros reads at its drafted positions)."""
    features = features.float()
    read = features[:, :-1]
    if dropout > 0:
        read = read * (torch.rand(read.shape[:2], device=read.device) >= dropout)[..., None]
    predicted, logits = head(read, x[:, 1:])
    at = cols - 1  # cols >= 1: every answer follows at least one prompt token
    regression = torch.nn.functional.smooth_l1_loss(predicted[rows, at], features[rows, cols])
    return logits[rows, at], regression


def initial_draft(spec: str, target: LoadedModel) -> SubsetDraftForCausalLM:
    """The draft `--init` names (a directory `distill` wrote, or 'embedded-draft'), in float32, checked to be a
    subset-head draft distilled for this very target (the same shared embedding)."""
    model = load_model(spec, "float32", str(target.device)).model
    if not isinstance(model, SubsetDraftForCausalLM):
        raise ValueError(f"--init {spec!r} is a {type(model).__name__}, not a subset-head draft (what `specserve "
                         "distill` writes by default); distill a new draft without --init")
    digest = embedding_digest(target.model.state_dict()[EMBEDDING])
    if model.config.shared_embedding_digest != digest:
        raise ValueError(f"--init {spec!r} was distilled for another target (its embedding digest "
                         f"{model.config.shared_embedding_digest} != {digest}); pass that target as --target")
    return model


def kd_loss(student_logits: torch.Tensor, teacher_index: torch.Tensor, teacher_logprobs: torch.Tensor,
            temperature: float) -> torch.Tensor:
    """Forward KL(p ‖ q) at temperature T, times T² (Hinton et al.), averaged over positions.

    student_logits [N, K] over the draft's K tokens. The teacher is its top-k per position: indices into the
    draft's tokens (-1: a token the draft cannot propose) and full-vocabulary log-probabilities at T=1. Both
    distributions are compared on the top-k tokens plus one bucket for the rest of the vocabulary (the
    teacher's tail mass is known: 1 - Σ top-k; at T ≠ 1 it is tempered as one token, an approximation).
    p is restricted to what the draft can express and renormalised: with q = 0 outside, the best q for
    acceptance Σ min(p, q) is proportional to p there.
    """
    valid = teacher_index >= 0
    top = teacher_logprobs.float()
    tail = torch.log((1 - top.exp().sum(-1, keepdim=True)).clamp_min(1e-8))
    p_log = torch.log_softmax(torch.cat([top.masked_fill(~valid, -math.inf), tail], -1) / temperature, dim=-1)
    q_all = torch.log_softmax(student_logits.float() / temperature, dim=-1)
    q_top = q_all.gather(-1, teacher_index.clamp_min(0)).masked_fill(~valid, -math.inf)
    q_rest = torch.log1p(-torch.logsumexp(q_top, -1, keepdim=True).exp().clamp_max(1 - 1e-6))
    q_log = torch.cat([q_top, q_rest], -1)
    p = p_log.exp()
    return (p * (p_log - q_log)).masked_fill(p == 0, 0.0).sum(-1).mean() * temperature**2


class PackedCorpus:
    """The corpus as a few flat tensors on the training device, so a batch is assembled there by indexing.

    Each record's training window is fixed: a long prompt keeps its tail, so at least half the window is answer
    when the answer is long. Its ids are stored right-padded to `seq_len` (causal: padding never reaches a real
    position); its answer positions' teacher top-k (as indices into the draft's tokens, -1 for tokens the draft
    cannot propose) sit in one flat [positions, k] pair of tensors.
    """

    def __init__(self, records: list[Record], seq_len: int, pad_id: int, lookup: torch.Tensor,
                 device: torch.device | str = "cpu"):
        starts = [max(0, min(r.prompt_len - seq_len // 2, len(r.ids) - seq_len)) for r in records]
        self.starts = starts
        windows = [r.ids[s : s + seq_len] for r, s in zip(records, starts)]
        self.width = torch.tensor([len(w) for w in windows])  # CPU: a batch's width and size need no device sync
        self.answers = torch.tensor([len(w) - (r.prompt_len - s) for w, r, s in zip(windows, records, starts)])
        ids = torch.full((len(records), seq_len), pad_id, dtype=torch.long)
        for row, window in enumerate(windows):
            ids[row, : len(window)] = torch.tensor(window)
        index = torch.cat([lookup[r.top_ids[:n].long()] for r, n in zip(records, self.answers.tolist())])
        logprobs = torch.cat([r.top_logprobs[:n] for r, n in zip(records, self.answers.tolist())])
        first = torch.cat([torch.zeros(1, dtype=torch.long), self.answers.cumsum(0)[:-1]])
        self.device = torch.device(device)
        self.ids, self.first_answer = ids.to(self.device), first.to(self.device)
        self.first_col = (self.width - self.answers - 1).to(self.device)  # logits at i predict token i+1
        self.index, self.logprobs = index.to(torch.int32).to(self.device), logprobs.to(self.device)

    def __len__(self) -> int:
        return len(self.width)

    def batch(self, chosen: list[int]):
        """ids [B, T] (T: the widest window chosen), and for every answer position its (row, column), its
        teacher's indices into the draft's tokens and its full-vocabulary log-probabilities at T=1."""
        cpu = torch.tensor(chosen)
        counts = self.answers[cpu]
        total = int(counts.sum())
        rec = cpu.to(self.device)
        rows = torch.repeat_interleave(torch.arange(len(chosen), device=self.device), counts.to(self.device),
                                       output_size=total)
        offset = torch.cumsum(counts, 0).to(self.device) - counts.to(self.device)
        within = torch.arange(total, device=self.device) - offset[rows]
        cols = self.first_col[rec][rows] + within
        flat = self.first_answer[rec][rows] + within
        x = self.ids[rec, : int(self.width[cpu].max())]
        return x, rows, cols, self.index[flat].long(), self.logprobs[flat]


def draft_logits(draft, x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """The draft's logits over its own tokens at the given positions (full vocabulary for plain models)."""
    if isinstance(draft, SubsetDraftForCausalLM):
        hidden = draft.model(input_ids=x).last_hidden_state
        return draft.lm_head(hidden[rows, cols])
    return draft(input_ids=x).logits[rows, cols]


def learning_rate(step: int, cfg: DistillConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


@torch.inference_mode()
def acceptance(target_model, draft_model, sequences: list[tuple[list[int], int]]) -> dict[str, float]:
    """α at T=0 (argmax agreement) and T=1 (mean Σ min(p, q)) over the answer positions only.

    sequences: (token ids, prompt length). Only the distributions that predict answer tokens count: those
    are the positions a draft proposes for (a chat template's boilerplate is easy and would inflate α).
    """
    agree = total = reachable = 0
    overlap = covered = 0.0
    for ids, prompt_len in sequences:
        x = torch.tensor([ids], device=next(target_model.parameters()).device)
        answer = slice(prompt_len - 1, len(ids) - 1)  # logits at i predict token i+1
        p = target_model(x).logits[0, answer].float()
        q = full_draft_logits(target_model, draft_model, x)[answer].float()
        top, probs, proposable = p.argmax(-1, keepdim=True), p.softmax(-1), ~q.isinf()
        agree += int((top.squeeze(-1) == q.argmax(-1)).sum())
        reachable += int(proposable.gather(-1, top).sum())  # target argmaxes the draft can propose at all
        overlap += float(torch.minimum(probs, q.softmax(-1)).sum(-1).sum())
        covered += float(probs.masked_fill(~proposable, 0.0).sum())  # mass on tokens the draft can propose
        total += p.shape[0]
    n = max(total, 1)
    return {"alpha_t0": agree / n, "alpha_t1": overlap / n, "covered": covered / n, "argmax_covered": reachable / n,
            "positions": total}


def full_draft_logits(target_model, draft_model, x: torch.Tensor) -> torch.Tensor:
    """A draft's full-vocabulary logits at every position of x [1, T] (-inf where it cannot propose); a feature
    head's from the target's true features (position i: head position i - 1; position 0 has none: -inf)."""
    if not isinstance(draft_model, FeatureHeadForCausalLM):
        return draft_model(x).logits[0]
    features = target_model.model(input_ids=x).last_hidden_state
    _, logits = draft_model(features[:, :-1].to(next(draft_model.parameters()).dtype), x[:, 1:])
    out = logits.new_full((x.shape[1], draft_model.vocab_size), float("-inf"))
    out[1:] = draft_model.expand(logits[0])
    return out


def step_time(model, vocab: int) -> float:
    """Seconds for one cached one-token target forward."""
    from specserve.engine.profile import verify_profile

    return verify_profile(model, vocab, 1)[1]


def draft_token_time(model, vocab: int) -> float:
    """Seconds per drafted token on the decoder's path (`LeanSequence` where it applies, sampling included)."""
    from specserve.engine.profile import draft_step_time
    from specserve.engine.proposers import ModelProposer

    return draft_step_time(ModelProposer(model, vocab), vocab)


def distill(cfg: DistillConfig, log=print) -> dict:
    out = pathlib.Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    # the teacher in fp32: its distributions should not be rounded (a CPU's corpus: the served target, `writer_pool`)
    target = load_model(cfg.target, "float32")
    if target.tokenizer is None:
        raise ValueError("the target needs a tokenizer (its prompts are chat-templated)")
    start_from = initial_draft(cfg.init, target) if cfg.init else None
    if start_from is not None:  # the draft's own shape, recorded in distill.json
        cfg = replace(cfg, layers=start_from.config.num_hidden_layers, hidden=None,
                      subset=start_from.config.token_subset_size)
    pool = writer_pool(cfg, target, log)
    records = load_corpus(target, cfg, out / "corpus", pool)
    if not records:
        raise ValueError("the corpus is empty: pass --prompts, --self-prompts or --text")
    log(f"corpus: {len(records)} sequences, {sum(len(r.top_ids) for r in records)} answer tokens")

    checkpoint, start = out / "checkpoint.pt", 0
    state = torch.load(checkpoint) if checkpoint.is_file() else None
    subset = None
    if start_from is not None:
        subset = start_from.token_subset.clone().cpu()  # in the head's row order
    elif (cfg.hidden or target.model.config.hidden_size) == target.model.config.hidden_size and cfg.subset:
        subset = state["subset"] if state else choose_subset(
            records, target.vocab_size, cfg.subset, target.eos_ids | set(target.tokenizer.all_special_ids))
    draft, frozen = make_draft(target.model, cfg, subset, start_from)
    draft = draft.to(target.device)  # trains where the target runs (a GPU when there is one)
    lookup = torch.arange(target.vocab_size)  # vocabulary id -> the draft's logit index (-1: none)
    if subset is not None:
        lookup = torch.full_like(lookup, -1).index_copy_(0, subset, torch.arange(len(subset)))
    trainable = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=0.0)
    if state:
        unexpected = draft.load_state_dict(state["draft"], strict=False).unexpected_keys
        if unexpected:  # e.g. a head's checkpoint from before fc was split for training
            raise ValueError(f"{checkpoint} does not fit this model ({unexpected}): remove it to start anew")
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
        log(f"resuming from step {start}")
    corpus = PackedCorpus(records, cfg.seq_len, pad_id(target.tokenizer, target.eos_ids), lookup, target.device)
    features = cached_features(target.model, corpus, cfg, out / "corpus", log, pool, records) \
        if cfg.head and not cfg.live_features else None
    pool = None  # its arena's memory back before training
    rng = random.Random(cfg.seed + start)
    losses: list[float] = []
    pending: list[torch.Tensor] = []  # losses still on the device: read every few steps, not synced every step
    draft.train()
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True  # on a GPU, the draft's updates tolerate TF32 (the teacher was fp32)
    bar = tqdm(range(start, cfg.steps), desc="distilling", initial=start, total=cfg.steps)
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, cfg)
        chosen = rng.sample(range(len(corpus)), min(cfg.batch, len(corpus)))
        x, rows, cols, index, logprobs = corpus.batch(chosen)
        if cfg.head:
            if features is None:  # a 7B corpus's features outgrow memory: the target's pass at every step
                with torch.no_grad():
                    f = target.model.model(input_ids=x).last_hidden_state
            else:
                f = features[torch.tensor(chosen, device=features.device), : x.shape[1]]
            logits, regression = head_losses(draft, f, x, rows, cols, cfg.feature_dropout)
            loss = kd_loss(logits, index, logprobs, cfg.kd_temperature) + cfg.feature_weight * regression
        else:
            loss = kd_loss(draft_logits(draft, x, rows, cols), index, logprobs, cfg.kd_temperature)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        pending.append(loss.detach())
        if len(pending) == 20 or step + 1 == cfg.steps:
            losses += torch.stack(pending).tolist()
            pending.clear()
            bar.set_postfix(kl=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
        if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
            tmp = checkpoint.with_suffix(".tmp")
            trained = {k: v for k, v in draft.state_dict().items() if k != EMBEDDING or subset is None}
            torch.save({"step": step + 1, "draft": trained, "optimizer": optimizer.state_dict(), "subset": subset},
                       tmp)
            tmp.replace(checkpoint)
    torch.backends.cuda.matmul.allow_tf32 = tf32
    draft.eval()

    metrics = evaluate(target, draft, cfg, out)
    if cfg.head:
        fold_fc(draft)
    draft.to(torch.bfloat16).save_pretrained(str(out))  # half the size; a draft loads in any dtype
    target.tokenizer.save_pretrained(str(out))
    # c on the speed path: a drafted token as the decoder drafts it against a target step (default dtype)
    fast_target = load_model(cfg.target)
    if cfg.head:  # drafting as the decoder does it: on a pooled target's features
        from specserve.engine.decoder import SpeculativeDecoder

        verify, per_token = SpeculativeDecoder(fast_target, f"head:{out}").cost_profile()
        metrics["c"] = per_token / verify[1]
    else:
        fast_draft = load_model(str(out), str(fast_target.dtype).removeprefix("torch."))
        metrics["c"] = draft_token_time(fast_draft.model, fast_draft.vocab_size) / step_time(fast_target.model,
                                                                                             fast_target.vocab_size)
    metrics.update(steps=cfg.steps, resumed_from=start, final_kl=(sum(losses[-20:]) / len(losses[-20:]))
                   if losses else None, first_kl=losses[0] if losses else None, frozen=sorted(frozen),
                   corpus_sequences=len(records), corpus_tokens=sum(len(r.top_ids) for r in records),
                   head_tokens=len(subset) if subset is not None else target.vocab_size,
                   dtype=str(fast_target.dtype))
    (out / "distill.json").write_text(json.dumps({"config": asdict(cfg), "metrics": metrics}, indent=2))
    for label, part in metrics["held_out"].items():
        log(f"  held-out {label}: α(T=0) {part['alpha_t0']:.3f}, α(T=1) {part['alpha_t1']:.3f}")
    log(f"held-out α at T=0: {metrics['alpha_t0']:.3f}, at T=1: {metrics['alpha_t1']:.3f}; c = {metrics['c']:.3f}")
    log(f"the draft's head covers {metrics['subset_argmax']:.1%} of the target's greedy tokens and "
        f"{metrics['subset_mass']:.1%} of its probability mass at T=1")
    return metrics


def evaluate(target: LoadedModel, draft, cfg: DistillConfig, out: pathlib.Path) -> dict:
    """Held-out α at T=0 (greedy answers) and T=1 (sampled answers), over answer positions only.

    Three held-out sets, none used in training: templated prompts on held-out subjects, requests the target
    wrote itself about held-out subjects, and the `specserve bench` prompt suite (hand-written, other
    styles). The headline α pools all answer positions.
    """
    from specserve.bench.prompts import SUITE

    tok = target.tokenizer
    requests = write_requests(target.model, tok, target.eos_ids, out / "eval-requests", cfg.eval_prompts,
                              cfg.gen_batch, cfg.seed + 1, held_out=True)
    sets = {
        "templates": prompt_set(cfg.eval_prompts, cfg.seed + 1, held_out=True),
        "self_written": requests,
        "bench_suite": [p for prompts in SUITE.values() for p in prompts],
    }
    pad = pad_id(tok, target.eos_ids)
    metrics: dict = {"held_out": {}}
    for name, temperature in (("t0", 0.0), ("t1", 1.0)):
        pooled = {"alpha_t0": 0.0, "alpha_t1": 0.0, "covered": 0.0, "argmax_covered": 0.0, "positions": 0}
        for label, prompts in sets.items():
            gen = torch.Generator().manual_seed(cfg.seed + 7)
            written = write_batch(target.model, [encode_chat(tok, p) for p in prompts], [temperature] * len(prompts),
                                  cfg.eval_tokens, target.eos_ids, pad, 1, gen)
            result = acceptance(target.model, draft, [(r.ids, r.prompt_len) for r in written])
            metrics["held_out"].setdefault(label, {})[f"alpha_{name}"] = result[f"alpha_{name}"]
            for key in ("alpha_t0", "alpha_t1", "covered", "argmax_covered"):
                pooled[key] += result[key] * result["positions"]
            pooled["positions"] += result["positions"]
        n = max(pooled["positions"], 1)
        metrics[f"alpha_{name}"] = pooled[f"alpha_{name}"] / n
        if name == "t0":  # α at T=0 cannot exceed the share of greedy tokens the draft's head can propose
            metrics["subset_argmax"] = pooled["argmax_covered"] / n
        if name == "t1":
            metrics["subset_mass"] = pooled["covered"] / n
    return metrics
