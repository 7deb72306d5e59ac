"""Knowledge distillation of a draft model from the target.

1. Data: the target itself answers a varied prompt set (chat questions,
   rewriting, code), sampled at `gen_temperature`, plus any text files the
   user adds; kept in `OUT/corpus.pt`, extended on resume.
2. Draft: a causal LM with the target's vocabulary. With the target's hidden
   size it starts from the target's embedding, first `layers` layers, norm
   and LM head (the shared embedding/head stay frozen: they are the
   target's); otherwise it is a fresh, smaller Llama.
3. Training: forward KL(p_target ‖ q_draft) at `kd_temperature` on every
   position, AdamW; `OUT/checkpoint.pt` every `checkpoint_every` steps and at
   the end, so a rerun resumes.
4. Evaluation on held-out prompts (subjects never used for training), over
   the answer positions only: α at T=0 (the draft's argmax equals the
   target's: a greedy draft token is then accepted) and at T=1 (E Σ min(p, q),
   the expected acceptance of a draft token), and c = draft step time /
   target step time.
5. `OUT/` is a model directory (`save_pretrained` + tokenizer) usable as
   `draft=OUT`, plus `distill.json` with the settings and metrics.
"""

from __future__ import annotations

import copy
import json
import pathlib
import random
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from tqdm import tqdm

from specserve.models import LoadedModel, load_model

SUBJECTS = [
    "photosynthesis", "compound interest", "the French Revolution", "black holes", "vaccines", "recursion",
    "climate change", "the stock market", "machine learning", "volcanoes", "the immune system", "democracy",
    "electric cars", "coffee", "sleep", "the internet", "honeybees", "inflation", "the moon landing", "DNA",
    "renewable energy", "the Roman Empire", "blockchains", "earthquakes", "meditation", "rainforests",
    "supply and demand", "the water cycle", "jazz", "chess", "nutrition", "plate tectonics", "encryption",
    "the printing press", "antibiotics", "gravity", "solar panels", "the Silk Road", "origami", "marathons",
]
HELD_OUT_SUBJECTS = ["tides", "glaciers", "opera", "bicycles", "tea ceremonies", "lighthouses", "octopuses",
                     "the metric system"]
CHAT = ["Explain {s} to a ten-year-old.", "What are three surprising facts about {s}?",
        "Give a short summary of {s}.", "What are the pros and cons of {s}? Answer briefly.",
        "Write a haiku about {s}.", "How would you teach {s} in one lesson?"]
REWRITE = ["Rewrite this sentence in formal English: so basically {s} is kinda cool and everyone should know it.",
           "Fix the grammar: {s} are a topic that many peoples finds very interesting, but few understands it.",
           "Turn this into a bullet list: {s} matters because it affects daily life, the economy and the future."]
CODE = ["Write a Python function that returns a short description of {s} given a level of detail (1-3).",
        "Write a Python class named Note that stores a title about {s} and a body, with a __repr__.",
        "Add type hints to this code:\n\n```python\ndef describe(topic, n):\n    return [topic] * n  # {s}\n```"]


def prompt_set(n: int, seed: int = 0, held_out: bool = False) -> list[str]:
    """n varied prompts (chat / rewrite / code) from templates; held_out uses subjects training never sees."""
    subjects = HELD_OUT_SUBJECTS if held_out else SUBJECTS
    pool = [t.format(s=s) for s in subjects for t in CHAT + REWRITE + CODE]
    random.Random(seed).shuffle(pool)
    return (pool * (n // len(pool) + 1))[:n]


@dataclass
class DistillConfig:
    target: str = "embedded"
    out: str = "draft-out"
    layers: int = 2
    hidden: int | None = None  # None: the target's hidden size (start from its layers, share embedding + head)
    prompts: int = 200
    gen_tokens: int = 128
    gen_temperature: float = 1.0
    texts: list[str] = field(default_factory=list)  # extra plain-text files
    steps: int = 2000
    batch: int = 4
    seq_len: int = 256
    lr: float = 5e-4
    kd_temperature: float = 1.0
    checkpoint_every: int = 200
    eval_prompts: int = 16
    seed: int = 0


def _encode_chat(tokenizer, prompt: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def build_corpus(target: LoadedModel, cfg: DistillConfig, path: pathlib.Path) -> list[list[int]]:
    """Target-written answers to the training prompts (resumable), plus the user's text files in chunks."""
    from specserve import SamplingParams, SpeculativeDecoder

    corpus: list[list[int]] = torch.load(path) if path.is_file() else []
    prompts = prompt_set(cfg.prompts, cfg.seed)
    if len(corpus) < len(prompts):
        decoder = SpeculativeDecoder(target.model, None, dtype=None)
        for i in tqdm(range(len(corpus), len(prompts)), desc="target writes training data", initial=len(corpus),
                      total=len(prompts)):
            ids = _encode_chat(target.tokenizer, prompts[i])
            params = SamplingParams(temperature=cfg.gen_temperature, seed=cfg.seed * 100_003 + i)
            corpus.append(ids + decoder.generate(ids, params, cfg.gen_tokens).token_ids)
            if (i + 1) % 20 == 0 or i + 1 == len(prompts):
                torch.save(corpus, path)
    extra = []
    for name in cfg.texts:
        ids = target.tokenizer.encode(pathlib.Path(name).read_text())
        extra += [ids[k : k + cfg.seq_len] for k in range(0, len(ids), cfg.seq_len) if len(ids[k : k + cfg.seq_len]) > 8]
    return corpus + extra


def make_draft(target_model, cfg: DistillConfig):
    """(draft model, names of parameters frozen because they are the target's own)."""
    tcfg = target_model.config
    hidden = cfg.hidden or tcfg.hidden_size
    if hidden == tcfg.hidden_size:
        draft = copy.deepcopy(target_model).float()
        draft.model.layers = draft.model.layers[: cfg.layers]
        draft.config.num_hidden_layers = cfg.layers
        if getattr(draft.config, "layer_types", None):
            draft.config.layer_types = list(draft.config.layer_types)[: cfg.layers]
        frozen = {"model.embed_tokens.weight", "lm_head.weight"}
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        heads = max(1, hidden // 64)
        config = LlamaConfig(
            vocab_size=tcfg.vocab_size, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
            num_hidden_layers=cfg.layers, num_attention_heads=heads, num_key_value_heads=heads,
            max_position_embeddings=tcfg.max_position_embeddings, rope_theta=getattr(tcfg, "rope_theta", 10000.0),
            tie_word_embeddings=True, bos_token_id=tcfg.bos_token_id, eos_token_id=tcfg.eos_token_id,
        )
        torch.manual_seed(cfg.seed)
        draft = LlamaForCausalLM(config)
        frozen = set()
    for name, param in draft.named_parameters():
        param.requires_grad_(name not in frozen)
    return draft, frozen


def kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Forward KL(p ‖ q) per position at temperature T, times T² (Hinton et al.), averaged over positions."""
    p_log = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    q_log = F.log_softmax(student_logits.float() / temperature, dim=-1)
    return (p_log.exp() * (p_log - q_log)).sum(-1).mean() * temperature**2


@torch.inference_mode()
def acceptance(target_model, draft_model, sequences: list[tuple[list[int], int]]) -> dict[str, float]:
    """α at T=0 (argmax agreement) and T=1 (mean Σ min(p, q)) over the answer positions only.

    sequences: (token ids, prompt length). Only the distributions that predict answer tokens count: those
    are the positions a draft proposes for (a chat template's boilerplate is easy and would inflate α).
    """
    agree = total = 0
    overlap = 0.0
    for ids, prompt_len in sequences:
        x = torch.tensor([ids])
        answer = slice(prompt_len - 1, len(ids) - 1)  # logits at i predict token i+1
        p = target_model(x).logits[0, answer].float()
        q = draft_model(x).logits[0, answer].float()
        agree += int((p.argmax(-1) == q.argmax(-1)).sum())
        overlap += float(torch.minimum(p.softmax(-1), q.softmax(-1)).sum(-1).sum())
        total += p.shape[0]
    return {"alpha_t0": agree / max(total, 1), "alpha_t1": overlap / max(total, 1)}


def step_time(model, vocab: int) -> float:
    from specserve.engine.profile import verify_profile

    return verify_profile(model, vocab, 1)[1]


def distill(cfg: DistillConfig, log=print) -> dict:
    out = pathlib.Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    target = load_model(cfg.target, "float32")  # the teacher in fp32: KD targets should not be rounded
    if target.tokenizer is None:
        raise ValueError("the target needs a tokenizer (its prompts are chat-templated)")
    corpus = build_corpus(target, cfg, out / "corpus.pt")
    log(f"corpus: {len(corpus)} sequences, {sum(map(len, corpus))} tokens")
    draft, frozen = make_draft(target.model, cfg)
    trainable = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=0.0)
    checkpoint, start = out / "checkpoint.pt", 0
    if checkpoint.is_file():
        state = torch.load(checkpoint)
        draft.load_state_dict(state["draft"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
        log(f"resuming from step {start}")
    rng = random.Random(cfg.seed + start)
    losses: list[float] = []
    draft.train()
    bar = tqdm(range(start, cfg.steps), desc="distilling", initial=start, total=cfg.steps)
    for step in bar:
        optimizer.zero_grad()
        total = 0.0
        for _ in range(cfg.batch):
            seq = rng.choice(corpus)
            lo = rng.randrange(0, max(1, len(seq) - cfg.seq_len + 1))
            x = torch.tensor([seq[lo : lo + cfg.seq_len]])
            with torch.no_grad():
                teacher = target.model(x).logits[0]
            loss = kd_loss(draft(x).logits[0], teacher, cfg.kd_temperature) / cfg.batch
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        losses.append(total)
        bar.set_postfix(kd=f"{total:.3f}")
        if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
            tmp = checkpoint.with_suffix(".tmp")
            torch.save({"step": step + 1, "draft": draft.state_dict(), "optimizer": optimizer.state_dict()}, tmp)
            tmp.replace(checkpoint)
    draft.eval()

    held_out = prompt_set(cfg.eval_prompts, cfg.seed + 1, held_out=True)
    from specserve import SamplingParams, SpeculativeDecoder

    teacher = SpeculativeDecoder(target.model, None)
    evals = {}
    for name, temperature in (("t0", 0.0), ("t1", 1.0)):
        seqs = []
        for i, prompt in enumerate(held_out):
            ids = _encode_chat(target.tokenizer, prompt)
            answer = teacher.generate(ids, SamplingParams(temperature=temperature, seed=i), 64).token_ids
            seqs.append((ids + answer, len(ids)))
        evals[name] = acceptance(target.model, draft, seqs)
    metrics = {"alpha_t0": evals["t0"]["alpha_t0"], "alpha_t1": evals["t1"]["alpha_t1"]}
    draft.save_pretrained(str(out))
    target.tokenizer.save_pretrained(str(out))
    # c on the speed path: the target in its default dtype against the draft in the same dtype
    fast_target = load_model(cfg.target)
    fast_draft = load_model(str(out), str(fast_target.dtype).removeprefix("torch."))
    metrics["c"] = step_time(fast_draft.model, fast_draft.vocab_size) / step_time(fast_target.model,
                                                                                  fast_target.vocab_size)
    metrics.update(steps=cfg.steps, resumed_from=start, final_kd_loss=(sum(losses[-20:]) / len(losses[-20:]))
                   if losses else None, first_kd_loss=losses[0] if losses else None,
                   frozen=sorted(frozen), corpus_sequences=len(corpus), dtype=str(fast_target.dtype))
    (out / "distill.json").write_text(json.dumps({"config": asdict(cfg), "metrics": metrics}, indent=2))
    log(f"held-out α at T=0: {metrics['alpha_t0']:.3f}, at T=1: {metrics['alpha_t1']:.3f}; c = {metrics['c']:.3f}")
    return metrics
