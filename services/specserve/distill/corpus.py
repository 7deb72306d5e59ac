"""Training data for a draft: the target answers a varied prompt set, and we keep its distributions.

The target writes the answers itself (batched: on a CPU through the pooled
forward it serves with, `write_batch_pooled`; else the float32 model with
left padding, `write_batch`), at a cycle of temperatures (greedy text and
sampled text differ in style, and a draft serves both). At every answer
position we keep the target's top-k log-probabilities, so training needs no
teacher forward: distillation becomes cheap enough to run on a CPU. Records go to numbered shards
(`OUT/corpus/shard-00000.pt`, ...) written atomically, so an interrupted run
resumes at the first missing shard.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import random
from dataclasses import dataclass

import torch
from tqdm import tqdm

SUBJECTS = [
    "photosynthesis", "compound interest", "the French Revolution", "black holes", "vaccines", "recursion",
    "climate change", "the stock market", "machine learning", "volcanoes", "the immune system", "democracy",
    "electric cars", "coffee", "sleep", "the internet", "honeybees", "inflation", "the moon landing", "DNA",
    "renewable energy", "the Roman Empire", "blockchains", "earthquakes", "meditation", "rainforests",
    "supply and demand", "the water cycle", "jazz", "chess", "nutrition", "plate tectonics", "encryption",
    "the printing press", "antibiotics", "gravity", "solar panels", "the Silk Road", "origami", "marathons",
    "hash tables", "linked lists", "sorting algorithms", "databases", "operating systems", "compilers",
    "version control", "unit testing", "remote work", "time management", "public speaking", "job interviews",
    "personal budgeting", "gardening", "baking bread", "dogs", "cats", "birds", "the ocean", "deserts",
    "mountains", "rivers", "the solar system", "Mars", "the human heart", "the brain", "muscles", "vitamins",
    "exercise", "yoga", "football", "tennis", "the Olympics", "ancient Egypt", "the Renaissance", "World War II",
    "the industrial revolution", "the cold war", "elections", "taxes", "banks", "credit cards", "startups",
    "marketing", "social media", "smartphones", "batteries", "3D printing", "robots", "artificial intelligence",
    "cloud computing", "cybersecurity", "passwords", "email etiquette", "learning a language", "reading habits",
    "poetry", "painting", "photography", "movies", "classical music", "video games", "board games", "travel",
    "camping", "recycling", "air pollution", "wind power", "nuclear energy", "electricity", "magnets", "light",
    "sound", "atoms", "chemical reactions", "evolution", "dinosaurs", "fungi", "trees", "friendship",
    "happiness", "stress", "habits", "negotiation", "leadership", "teamwork", "customer service",
    "spreadsheets", "regular expressions", "APIs", "web browsers", "search engines", "open source software",
    "code reviews", "debugging", "binary numbers", "neural networks", "data privacy", "spam filters",
    "GPS", "satellites", "airplanes", "trains", "bridges", "skyscrapers", "architecture", "city planning",
    "public transport", "traffic jams", "insurance", "mortgages", "retirement savings", "investing",
    "cryptocurrency", "small businesses", "freelancing", "resumes", "productivity apps", "note taking",
    "studying for exams", "online courses", "homeschooling", "libraries", "museums", "newspapers",
    "podcasts", "television", "advertising", "fashion", "cooking pasta", "vegetarian diets", "spices",
    "chocolate", "wine making", "cheese", "fermentation", "food safety", "allergies", "the common cold",
    "hand washing", "first aid", "dentists", "running shoes", "swimming", "hiking", "skiing",
    "basketball", "baseball", "cricket", "the Tour de France", "mountaineering", "sailing", "fishing",
    "horses", "elephants", "whales", "sharks", "ants", "butterflies", "penguins", "wolves", "coral reefs",
    "wetlands", "the Arctic", "the Amazon river", "the Sahara", "hurricanes", "tornadoes", "lightning",
    "rainbows", "clouds", "snow", "seasons", "weather forecasts", "telescopes", "stars", "galaxies",
    "the Big Bang", "comets", "the International Space Station", "rockets", "quantum computers",
    "semiconductors", "the periodic table", "acids and bases", "water", "plastics", "glass", "steel",
    "paper", "cotton", "ancient Greece", "the Vikings", "medieval castles", "samurai", "the Aztecs",
    "the American Revolution", "the Great Wall of China", "the Industrial Age factories", "human rights",
    "the United Nations", "courts", "laws", "voting", "city councils", "volunteering", "charities",
    "parenting", "siblings", "grandparents", "moving to a new city", "buying a car", "renting an apartment",
    "house plants", "composting", "beekeeping", "bird watching", "knitting", "woodworking", "pottery",
    "guitars", "pianos", "dance", "comic books", "novels", "science fiction",
    "mythology", "folk tales", "proverbs", "riddles", "mathematics", "prime numbers", "probability",
    "statistics", "geometry", "fractions", "maps", "time zones", "calendars", "clocks", "money",
]
HELD_OUT_SUBJECTS = ["tides", "glaciers", "opera", "bicycles", "tea ceremonies", "lighthouses", "octopuses",
                     "the metric system"]
CHAT = [
    "Explain {s} to a ten-year-old.", "What are three surprising facts about {s}?", "Give a short summary of {s}.",
    "What are the pros and cons of {s}? Answer briefly.", "Write a haiku about {s}.",
    "How would you teach {s} in one lesson?", "What are common misconceptions about {s}?",
    "List five key terms related to {s}, each with a one-line definition.",
    "Write a short, friendly email recommending that a colleague learn about {s}.",
    "What are three practical tips related to {s}? Answer briefly.", "Explain {s} in a short paragraph.",
    "Why does {s} matter? Give two reasons.", "Write the opening paragraph of a short story about {s}.",
    "What is {s}? Answer in two sentences.", "Describe how {s} works, step by step.",
    "Give me a beginner's guide to {s} in a few bullet points.", "What is the history of {s}, in brief?",
    "Compare {s} with something similar and explain the main difference.",
    "What questions should I ask an expert about {s}?", "Write a short motivational message about {s}.",
    "I'm new to {s}. Where should I start?",
]
REWRITE = [
    "Rewrite this sentence in formal English: so basically {s} is kinda cool and everyone should know it.",
    "Fix the grammar: {s} are a topic that many peoples finds very interesting, but few understands it.",
    "Turn this into a bullet list: {s} matters because it affects daily life, the economy and the future.",
    "Rewrite the following paragraph in formal English, keeping all facts:\n\nok so i been reading about {s} "
    "and honestly its way more complicated than i thought. theres like a ton of history and people still "
    "argue about it. gonna bring some notes to class tmrw.",
    "Fix the spelling and grammar mistakes in this text and return the corrected text:\n\nMany student thinks "
    "that {s} is to hard to learn, but with practise and patiense anyone can understands the basics in a few "
    "week.",
    "Summarize in one sentence: {s} has been studied for many years, and researchers keep finding new and "
    "surprising details about how it works and why it matters to ordinary people.",
]
CODE = [
    "Write a Python function that returns a short description of {s} given a level of detail (1-3).",
    "Write a Python class named Note that stores a title about {s} and a body, with a __repr__.",
    "Add type hints to this code:\n\n```python\ndef describe(topic, n):\n    return [topic] * n  # {s}\n```",
    "Rename the variable `x` to `count` in this Python function and return the full code:\n\n```python\n"
    "def tally(items):\n    # counts notes about {s}\n    x = 0\n    for item in items:\n        if item:\n"
    "            x += 1\n    return x\n```",
    "Add a docstring to this Python function and return the full code:\n\n```python\ndef search(notes, "
    "word):\n    # notes about {s}\n    return [n for n in notes if word.lower() in n.lower()]\n```",
    "Write a Python function that counts how often each word appears in a paragraph about {s}.",
]


def prompt_set(n: int, seed: int = 0, held_out: bool = False) -> list[str]:
    """n varied prompts (chat / rewrite / code) from templates; held_out uses subjects training never sees."""
    subjects = HELD_OUT_SUBJECTS if held_out else SUBJECTS
    pool = [t.format(s=s) for s in subjects for t in CHAT + REWRITE + CODE]
    random.Random(seed).shuffle(pool)
    return (pool * (n // len(pool) + 1))[:n]


def encode_chat(tokenizer, prompt: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             tokenize=False)
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(prompt)


def pad_id(tokenizer, eos_ids: set[int]) -> int:
    """Padding for batched prompts (never attended to): the tokenizer's pad token, else an eos id."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos_ids)


@dataclass
class Record:
    """One target-written sequence: prompt + answer ids, and the target's top-k at each answer position.

    top_ids[i], top_logprobs[i] describe the distribution that predicted ids[prompt_len + i].
    """

    ids: list[int]
    prompt_len: int
    top_ids: torch.Tensor  # [answer_len, k] int32
    top_logprobs: torch.Tensor  # [answer_len, k] float16, log-softmax at T=1 over the full vocabulary
    # [len(ids), hidden] bfloat16: the target's features (normed final hidden states) where the writer kept them
    features: torch.Tensor | None = None

    def as_dict(self) -> dict:
        return {"ids": self.ids, "prompt_len": self.prompt_len, "top_ids": self.top_ids,
                "top_logprobs": self.top_logprobs} | ({"features": self.features} if self.features is not None else {})


@torch.inference_mode()
def write_batch(model, prompts: list[list[int]], temperatures: list[float], max_new: int, eos_ids: set[int],
                pad_id: int, top_k: int, generator: torch.Generator) -> list[Record]:
    """The target answers a batch of prompts (left-padded), one forward per step for the whole batch."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    temps = torch.tensor(temperatures, device=device).unsqueeze(1)
    if generator.device != device:  # sample where the logits are; the seed carries over
        generator = torch.Generator(device=device).manual_seed(generator.initial_seed())
    cache = DynamicCache(config=model.config)
    answers: list[list[int]] = [[] for _ in prompts]
    tops: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in prompts]
    alive = list(range(len(prompts)))  # rows still writing; finished rows leave the batch (and the cache)
    step_ids, positions = ids, (mask.cumsum(-1) - 1).clamp_min(0)
    for _ in range(max_new):
        out = model(input_ids=step_ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                    use_cache=True, logits_to_keep=1)
        logits = out.logits[:, -1].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        top_v, top_i = logprobs.topk(top_k, dim=-1)
        sampled = torch.multinomial(torch.softmax(logits / temps.clamp_min(1e-5), dim=-1), 1,
                                    generator=generator).squeeze(1)
        chosen = torch.where(temps.squeeze(1) > 0, sampled, logits.argmax(-1)).cpu()
        top_i, top_v = top_i.to(torch.int32).cpu(), top_v.to(torch.float16).cpu()  # one copy per step, not per row
        keep = []
        for j, row in enumerate(alive):
            token = int(chosen[j])
            answers[row].append(token)
            tops[row].append((top_i[j], top_v[j]))
            if token not in eos_ids:
                keep.append(j)
        if not keep:
            break
        if len(keep) < len(alive):
            index = torch.tensor(keep, device=device)
            cache.batch_select_indices(index)
            mask, positions, temps, chosen = mask[index], positions[index], temps[index], chosen[keep]
            alive = [alive[j] for j in keep]
        step_ids = chosen.unsqueeze(1).to(device)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        positions = positions[:, -1:] + 1
    return [
        Record(prompt + answer, len(prompt), torch.stack([t[0] for t in top]), torch.stack([t[1] for t in top]))
        for prompt, answer, top in zip(prompts, answers, tops)
        if answer
    ]


@torch.inference_mode()
def write_batch_pooled(pool, prompts: list[list[int]], temperatures: list[float], max_new: int, eos_ids: set[int],
                       top_k: int, generator: torch.Generator, concurrency: int | None = None,
                       finished=None) -> list[Record]:
    """`write_batch` on specserve's own pooled forward (`models.memory.pool.KVPool`): the target as it serves, its CPU
    kernels and all. At most `concurrency` answers are written at once (default: all); each one that ends makes
    room for the next prompt, whose prompt rides in the same forward as the others' next tokens. A pool with
    features (`KVPool(features=True)`) also gives each record the target's features at every position: an
    answer's last token is fed once more for its own. finished(): called as each answer ends (progress)."""
    # no more at once than the arena holds at the longest (a block a sequence, of a power of two positions)
    longest = pool.allocator.size_for(max(map(len, prompts)) + max_new + 1)
    concurrency = max(1, min(concurrency or len(prompts), pool.capacity // longest))
    seqs = [pool.sequence() for _ in prompts]
    keep_features = pool.features is not None
    features: list[torch.Tensor | None] = [None] * len(prompts)
    try:
        answers: list[list[int]] = [[] for _ in prompts]
        tops: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in prompts]
        alive = list(range(min(concurrency, len(prompts))))
        step = [list(prompts[r]) for r in alive]
        admitted, ending = len(alive), set()  # ending: fed their last token for its feature; nothing to sample
        while alive:
            logits = pool.forward([seqs[r] for r in alive], step, [1] * len(alive)).float()
            writing = [j for j, row in enumerate(alive) if row not in ending]
            logits = logits[writing]
            top_v, top_i = torch.log_softmax(logits, dim=-1).topk(top_k, dim=-1)
            t = torch.tensor([temperatures[alive[j]] for j in writing], dtype=torch.float32)
            # inverse CDF: torch.multinomial takes ~30x as long over a 49k vocabulary on a CPU
            cdf = torch.softmax(logits / t.clamp_min(1e-5)[:, None], dim=-1).cumsum(-1)
            u = torch.rand(len(writing), 1, generator=generator) * cdf[:, -1:]
            sampled = torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_max(cdf.shape[1] - 1)
            chosen = torch.where(t > 0, sampled, logits.argmax(-1)).tolist()
            top_i, top_v = top_i.to(torch.int32), top_v.to(torch.float16)
            still, step = [], []
            for row in (alive[j] for j in range(len(alive)) if alive[j] in ending):
                seq = seqs[row]
                features[row] = pool.features[seq.block[0] : seq.block[0] + len(seq.tokens)].clone()
                seq.release()
            for i, j in enumerate(writing):
                row = alive[j]
                answers[row].append(chosen[i])
                tops[row].append((top_i[i], top_v[i]))
                ends = chosen[i] in eos_ids or len(answers[row]) == max_new
                if ends and finished is not None:
                    finished()
                if ends and not keep_features:
                    seqs[row].release()
                    continue
                if ends:
                    ending.add(row)
                still.append(row)
                step.append([chosen[i]])
            while len(still) < concurrency and admitted < len(prompts):
                still.append(admitted)
                step.append(list(prompts[admitted]))
                admitted += 1
            alive = still
    finally:
        for seq in seqs:
            seq.release()
    return [
        Record(prompt + answer, len(prompt), torch.stack([t[0] for t in top]), torch.stack([t[1] for t in top]),
               feature)
        for prompt, answer, top, feature in zip(prompts, answers, tops, features)
        if answer
    ]


def _write(model, prompts, temperatures, max_new, eos_ids, pad, top_k, generator, batch=None,
           finished=None) -> list[Record]:
    """model: the target's Hugging Face model, or a `KVPool` over it (then the pool's forward writes, `batch`
    answers at a time, calling finished() as each ends)."""
    if _pooled(model):
        return write_batch_pooled(model, prompts, temperatures, max_new, eos_ids, top_k, generator, batch, finished)
    return write_batch(model, prompts, temperatures, max_new, eos_ids, pad, top_k, generator)


def _pooled(model) -> bool:
    from specserve.models.memory.pool import KVPool

    return isinstance(model, KVPool)


# a pool keeps `batch` answers going across a shard: shards of this many batches (fewer batches' tails)
POOLED_SHARD = 8


def build_corpus(model, tokenizer, eos_ids: set[int], out: pathlib.Path, prompts: list[str],
                 temperatures: list[float], max_new: int, batch: int = 32, top_k: int = 32, seed: int = 0,
                 ) -> list[Record]:
    """All records for `prompts` (prompt i sampled at temperatures[i % len]); resumes from existing shards."""
    out.mkdir(parents=True, exist_ok=True)
    pad = pad_id(tokenizer, eos_ids)
    # sort by length so a batch pads little; shards follow that order
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    encoded = {i: encode_chat(tokenizer, prompts[i]) for i in order}
    size = batch * POOLED_SHARD if _pooled(model) else batch
    shards = [order[k : k + size] for k in range(0, len(order), size)]
    records: list[Record] = []
    bar = tqdm(total=len(prompts), desc="target writes training data", unit="answer")
    for n, shard in enumerate(shards):
        path, before = out / f"shard-{n:05d}.pt", bar.n
        if path.is_file():
            records += [Record(**r) for r in torch.load(path)]
        else:
            gen = torch.Generator().manual_seed(seed * 1_000_003 + n)
            new = _write(model, [encoded[i] for i in shard], [temperatures[i % len(temperatures)] for i in shard],
                         max_new, eos_ids, pad, top_k, gen, batch, lambda: bar.update(1))
            tmp = path.with_suffix(".tmp")
            torch.save([r.as_dict() for r in new], tmp)
            tmp.replace(path)
            records += new
        bar.update(before + len(shard) - bar.n)  # the pool's writer counted its answers as they ended
        bar.set_postfix(tokens=sum(len(r.top_ids) for r in records))
    bar.close()
    return records


@torch.inference_mode()
def score_texts(model, tokenizer, out: pathlib.Path, files: list[str], chunk: int, top_k: int = 32) -> list[Record]:
    """The user's plain-text files, cut into chunks, with the target's top-k at every position after the first.

    Cached per file content under `out/text-<digest>.pt`.
    """
    records: list[Record] = []
    for name in files:
        text = pathlib.Path(name).read_text()
        path = out / f"text-{hashlib.sha256(f'{chunk}:{top_k}:{text}'.encode()).hexdigest()[:12]}.pt"
        if path.is_file():
            records += [Record(**r) for r in torch.load(path)]
            continue
        ids = tokenizer.encode(text, add_special_tokens=False)
        pieces = [ids[k : k + chunk] for k in range(0, len(ids), chunk) if len(ids[k : k + chunk]) > 8]
        new: list[Record] = []
        device = next(model.parameters()).device
        for piece in tqdm(pieces, desc=f"target scores {pathlib.Path(name).name}", unit="chunk"):
            logprobs = torch.log_softmax(model(torch.tensor([piece], device=device)).logits[0, :-1].float(), -1)
            top_v, top_i = logprobs.topk(top_k, dim=-1)
            new.append(Record(piece, 1, top_i.to(torch.int32).cpu(), top_v.to(torch.float16).cpu()))
        tmp = path.with_suffix(".tmp")
        torch.save([r.as_dict() for r in new], tmp)
        tmp.replace(path)
        records += new
    return records


ASK = [
    "Write one question that a curious student might ask about {s}. Reply with the question only.",
    "Write a short request that someone could send to an AI assistant for help with {s}. Reply with the request "
    "only.",
    "Write one practical question an adult might ask about {s}. Reply with only the question.",
    "Write a short task about {s} that a user might give a helpful assistant (for example: explain, compare, list, "
    "rewrite or write code). Reply with the task only.",
    "Write a one-line request that quotes a sentence about {s} and asks an assistant to rewrite it more formally. "
    "Reply with the request only.",
    "Write a request asking an assistant to write a small Python function related to {s}. Reply with the request "
    "only.",
    "Write a question about {s} that asks for a step-by-step explanation. Reply with the question only.",
    "Write a request asking for a short list of tips about {s}. Reply with the request only.",
    "Write a question comparing two things related to {s}. Reply with the question only.",
    "Write a request asking an assistant to summarize what {s} are or how they work for a child. Reply with the "
    "request only.",
]


def self_prompt_seeds(n: int, seed: int = 0, held_out: bool = False) -> list[str]:
    """Instructions that make the target write user requests itself (more varied than fixed templates)."""
    subjects = HELD_OUT_SUBJECTS if held_out else SUBJECTS
    pool = [t.format(s=s) for s in subjects for t in ASK]
    random.Random(seed + 17).shuffle(pool)
    return (pool * (n // len(pool) + 1))[:n]


def clean_request(text: str) -> str | None:
    """The first non-empty line of what the target wrote, without quotes or a 'Question:' label."""
    for line in text.splitlines():
        line = line.strip().strip('"').strip()
        for label in ("Question:", "Request:", "Task:", "Q:"):
            if line.lower().startswith(label.lower()):
                line = line[len(label):].strip()
        if len(line) >= 12:
            return line
    return None


def write_requests(model, tokenizer, eos_ids: set[int], out: pathlib.Path, n: int, batch: int, seed: int,
                   held_out: bool = False) -> list[str]:
    """The target writes n user requests (T=1, cached in `out/requests.json`); unusable ones are dropped."""
    path = out / "requests.json"
    if path.is_file():
        return json.loads(path.read_text())
    out.mkdir(parents=True, exist_ok=True)
    seeds = [encode_chat(tokenizer, s) for s in self_prompt_seeds(n, seed, held_out)]
    pad = pad_id(tokenizer, eos_ids)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + 99)
    requests: list[str] = []
    for k in tqdm(range(0, n, batch), desc="target writes requests", unit="batch"):
        group = seeds[k : k + batch]
        for record in _write(model, group, [1.0] * len(group), 48, eos_ids, pad, 1, gen, batch):
            text = clean_request(tokenizer.decode(record.ids[record.prompt_len :], skip_special_tokens=True))
            if text:
                requests.append(text)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(requests, indent=1))
    tmp.replace(path)
    return requests
