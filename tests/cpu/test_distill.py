"""`specserve distill` on a tiny target: data, KD training with resume, held-out α/c, a loadable draft."""

from __future__ import annotations

import copy
import json
import random
from types import SimpleNamespace

import pytest
import torch
from specserve import SamplingParams, SpeculativeDecoder
from specserve.cli import main
from specserve.distill import prompt_set
from specserve.distill.core import PackedCorpus, acceptance, choose_subset, kd_loss
from specserve.distill.corpus import Record, write_batch

from tests.conftest import perturbed_copy, save_tokenized_pair, tiny_llama


def test_kd_loss_is_zero_only_for_the_teacher_restricted_to_the_draft_tokens():
    teacher = torch.log_softmax(torch.randn(5, 11) * 3, -1)
    top_v, top_i = teacher.topk(6, dim=-1)
    everything = torch.arange(11)
    assert float(kd_loss(teacher.clone(), top_i, top_v, 1.0)) == pytest.approx(0.0, abs=1e-5)
    assert float(kd_loss(teacher + torch.randn(5, 11), top_i, top_v, 2.0)) > 0.01
    # a draft over tokens 0..5 only: the teacher (all 11 kept) mapped into those indices, -1 for the rest
    top_v, top_i = teacher.topk(11, dim=-1)
    lookup = torch.where(everything < 6, everything, torch.full_like(everything, -1))
    index = lookup[top_i]
    restricted = teacher[:, :6]  # same logits on the draft's tokens: optimal up to normalisation
    assert float(kd_loss(restricted, index, top_v, 1.0)) == pytest.approx(0.0, abs=1e-5)
    assert float(kd_loss(restricted.flip(-1), index, top_v, 1.0)) > 0.01


def test_choose_subset_keeps_the_most_probable_tokens_and_the_special_ones():
    logprobs = torch.log(torch.tensor([[0.6, 0.3, 0.1], [0.5, 0.4, 0.1]], dtype=torch.float16))
    records = [Record([0, 1, 2], 1, torch.tensor([[7, 3, 5], [3, 7, 9]], dtype=torch.int32), logprobs)]
    assert choose_subset(records, 12, 2, set()).tolist() == [3, 7]
    assert choose_subset(records, 12, 3, {11}).tolist() == [3, 7, 11]


def test_packed_corpus_batches_line_every_teacher_up_with_the_token_it_predicts():
    """Windows (long prompts keep their tail, long answers are cut), padding, and each answer position's
    (row, column) and teacher rows, checked against the records one by one."""
    gen = torch.Generator().manual_seed(0)
    records = []
    for prompt_len, answer_len in [(3, 5), (30, 4), (2, 40), (25, 25), (1, 1)]:
        ids = torch.randint(0, 50, (prompt_len + answer_len,), generator=gen).tolist()
        top = torch.randint(0, 50, (answer_len, 4), generator=gen, dtype=torch.int32)
        top[:, 0] = torch.tensor(ids[prompt_len:])  # the written token is the teacher's top-1 here
        records.append(Record(ids, prompt_len, top, torch.randn(answer_len, 4).to(torch.float16)))
    lookup = torch.where(torch.arange(50) % 7 == 3, -1, torch.arange(50) // 2)  # some tokens outside the draft
    corpus = PackedCorpus(records, 16, 99, lookup)
    for chosen in ([0, 1, 2, 3, 4], [3, 0], [2], [4, 4, 1]):
        x, rows, cols, index, logprobs = corpus.batch(chosen)
        seen = {}
        for row, col, teacher, values in zip(rows.tolist(), cols.tolist(), index, logprobs):
            record = records[chosen[row]]
            window = x[row][x[row] != 99].tolist()
            start = next(s for s in range(len(record.ids)) if record.ids[s : s + len(window)] == window)
            answer = start + col + 1 - record.prompt_len  # which answer token column `col` predicts
            assert 0 <= answer < len(record.top_ids) and x[row, col + 1] == record.ids[record.prompt_len + answer]
            assert teacher.tolist() == lookup[record.top_ids[answer].long()].tolist()
            assert torch.equal(values, record.top_logprobs[answer])
            seen.setdefault(row, []).append(col)
        # answer positions per window: a long prompt keeps its last 8 tokens (half the window), a long answer is cut
        expected = [5, 4, 14, 8, 1]
        for row, r in enumerate(chosen):
            window = (x[row] != 99).sum().item()
            assert len(seen[row]) == expected[r] and sorted(set(seen[row])) == seen[row]
            assert window == min(16, len(records[r].ids))
        assert x.shape == (len(chosen), max(min(16, len(records[r].ids)) for r in chosen))


def test_write_batch_matches_one_sequence_at_a_time_greedy_decoding():
    """Left padding, explicit positions and dropping finished rows from the cache change nothing."""
    target = tiny_llama(0, vocab=64, layers=2, hidden=32, scale=8, dtype=torch.float32)
    prompts = [[5, 9, 2], [1, 2, 3, 4, 5, 6, 7, 8], [40], [11, 12, 13, 14, 15]]
    plain = SpeculativeDecoder(target, None, dtype="float32")
    reference = [plain.generate(p, SamplingParams(temperature=0.0, ignore_eos=True), 12).token_ids for p in prompts]
    eos = reference[1][4]  # a token that ends one row early; rows that write it stop there
    records = write_batch(target, prompts, [0.0] * 4, 12, {eos}, 0, 5, torch.Generator().manual_seed(0))
    for prompt, ref, record in zip(prompts, reference, records):
        expected = ref[: ref.index(eos) + 1] if eos in ref else ref
        assert record.ids == prompt + expected and record.prompt_len == len(prompt)
        assert record.top_ids[:, 0].tolist() == expected  # greedy: the top-1 is the written token
        assert record.top_ids.shape == (len(expected), 5)
    assert len(records[1].ids) < len(prompts[1]) + 12


def test_the_pooled_writer_writes_what_write_batch_writes_and_keeps_every_position_s_features():
    """The pool's writer (`distill` on a CPU): two answers at a time, each ending one admitting the next prompt,
    greedy answers and teachers equal write_batch's, and each record carries the target's features at every
    position (its last token's too) as a teacher-forced pass computes them."""
    from specserve.distill.corpus import write_batch_pooled
    from specserve.models.memory.pool import KVPool

    target = tiny_llama(0, vocab=64, layers=2, hidden=32, scale=8, dtype=torch.float32)
    prompts = [[5, 9, 2], [1, 2, 3, 4, 5, 6, 7, 8], [40], [11, 12, 13, 14, 15], [7, 7]]
    eos = write_batch(target, prompts[1:2], [0.0], 12, set(), 0, 1, torch.Generator())[0].ids[8 + 4]
    reference = write_batch(target, prompts, [0.0] * 5, 12, {eos}, 0, 5, torch.Generator().manual_seed(0))
    pool = KVPool(target, 512, dtype=torch.float32, runner=False, features=True)
    records = write_batch_pooled(pool, prompts, [0.0] * 5, 12, {eos}, 5, torch.Generator().manual_seed(0), 2)
    assert len(records) == 5 and pool.used_tokens == 0  # every sequence given back
    # a corpus whose records lack them (e.g. --text): the pool's pass over the packed windows gives the same
    from specserve.distill.core import pooled_features, window_features

    corpus = PackedCorpus(records, 32, 0, torch.arange(64))
    kept, computed = window_features(records, corpus), pooled_features(pool, corpus, 2)
    for row, record in enumerate(records):
        torch.testing.assert_close(computed[row, : len(record.ids)].float(), kept[row, : len(record.ids)].float(),
                                   atol=0.05, rtol=0.02)
    assert pool.used_tokens == 0
    small = KVPool(target, 64, dtype=torch.float32, runner=False)  # two sequences of up to 32 positions at once
    assert [r.ids for r in write_batch_pooled(small, prompts, [0.0] * 5, 12, {eos}, 5, torch.Generator())] == \
        [r.ids for r in reference]  # as many at once as the arena holds, not all five
    assert len(records[1].ids) < len(prompts[1]) + 12  # one row stopped at eos
    with torch.inference_mode():
        for ref, record in zip(reference, records):
            assert record.ids == ref.ids and record.prompt_len == ref.prompt_len
            assert torch.equal(record.top_ids, ref.top_ids)
            torch.testing.assert_close(record.top_logprobs, ref.top_logprobs, atol=2e-3, rtol=0)
            hidden = target.model(input_ids=torch.tensor([record.ids])).last_hidden_state[0]
            assert record.features.shape == hidden.shape
            torch.testing.assert_close(record.features.float(), hidden.to(torch.bfloat16).float(), atol=0.05,
                                       rtol=0.02)


def test_the_pooled_writer_samples_the_target_s_distribution_at_its_temperature():
    """The writer's inverse-CDF sampler: 6,000 first tokens of one prompt at T=0.7 against softmax(logits / 0.7)."""
    from scipy import stats
    from specserve.distill.corpus import write_batch_pooled
    from specserve.models.memory.pool import KVPool

    target = tiny_llama(1, vocab=64, layers=1, hidden=32, scale=8, dtype=torch.float32)
    prompt = [3, 1, 4]
    with torch.inference_mode():
        logits = target(input_ids=torch.tensor([prompt])).logits[0, -1].double()
    p = torch.softmax(logits / 0.7, -1).numpy()
    pool = KVPool(target, 1000 * 64, dtype=torch.float32, runner=False)
    records = write_batch_pooled(pool, [prompt] * 6000, [0.7] * 6000, 1, set(), 3, torch.Generator().manual_seed(3),
                                 1000)
    counts = torch.bincount(torch.tensor([r.ids[-1] for r in records]), minlength=64).numpy()
    keep = p * 6000 >= 5
    expected = p[keep] * 6000
    assert stats.chisquare(counts[keep], expected * counts[keep].sum() / expected.sum()).pvalue > 1e-3
    assert counts[~keep].sum() <= max(20, 3 * p[~keep].sum() * 6000)
    assert p.max() < 0.5  # the test means something: the distribution is spread out


def test_held_out_prompts_share_no_subject_with_training_prompts():
    train, held = set(prompt_set(3000)), set(prompt_set(50, held_out=True))
    assert len(train) > 2500 and not train & held
    assert any("```python" in p for p in train) and any(p.startswith("Rewrite") for p in train)


def test_bench_prompts_are_not_prompts_distill_trains_on():
    from specserve.bench.prompts import PER_WORKLOAD, SUITE
    from specserve.distill.corpus import CHAT, CODE, REWRITE, SUBJECTS

    assert PER_WORKLOAD == 6 and all(len(prompts) == PER_WORKLOAD for prompts in SUITE.values())
    bench = {p for prompts in SUITE.values() for p in prompts}
    training = {t.format(s=s) for t in CHAT + REWRITE + CODE for s in SUBJECTS}
    assert len(bench) == 3 * PER_WORKLOAD and len(training) > 5000
    assert not bench & training
    assert set(prompt_set(len(training))) <= training  # what prompt_set draws from is what was checked


@pytest.mark.slow
def test_distill_trains_resumes_and_writes_a_usable_subset_draft(tmp_path, capsys):
    root = save_tokenized_pair(tmp_path / "models")
    target = str(root / "target")
    out = tmp_path / "draft"
    common = ["distill", "--target", target, "--out", str(out), "--layers", "1", "--subset", "300", "--prompts", "4",
              "--self-prompts", "3",
              "--gen-tokens", "12", "--gen-batch", "3", "--batch", "2", "--seq-len", "64", "--checkpoint-every", "5",
              "--warmup", "2", "--eval-prompts", "2", "--eval-tokens", "8"]
    assert main(common + ["--steps", "10"]) == 0
    assert main(common + ["--steps", "14"]) == 0  # picks up the checkpoint and the corpus
    report = json.loads((out / "distill.json").read_text())["metrics"]
    assert report["resumed_from"] == 10 and report["steps"] == 14
    assert 4 <= report["corpus_sequences"] <= 7  # 4 templated answers + up to 3 self-written requests' answers
    assert set(report["held_out"]) == {"templates", "self_written", "bench_suite"}
    assert 0 <= report["alpha_t0"] <= 1 and 0 <= report["alpha_t1"] <= 1 and report["c"] > 0
    assert 0 < report["subset_mass"] <= 1 and 0 <= report["subset_argmax"] <= 1 and report["head_tokens"] == 300
    assert report["frozen"] == ["model.embed_tokens.weight"]  # the target's own, shared and not shipped

    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        stored = set(f.keys())
    assert "model.embed_tokens.weight" not in stored and "token_subset" in stored
    assert f.get_tensor is not None and len([k for k in stored if k.startswith("model.layers.")]) > 0

    spec = SpeculativeDecoder(target, str(out), gamma=3, dtype="float32")
    plain = SpeculativeDecoder(target, None, dtype="float32")
    greedy = SamplingParams(temperature=0.0, ignore_eos=True)
    assert spec.generate("Hello there", greedy, 20).token_ids == plain.generate("Hello there", greedy, 20).token_ids
    draft = spec.draft.model
    assert draft.config.num_hidden_layers == 1 and draft.lm_head.weight.shape[0] == 300
    assert torch.equal(draft.model.embed_tokens.weight, plain.target.model.model.embed_tokens.weight)
    logits = draft(torch.tensor([[1, 2, 3]])).logits[0, -1]
    outside = torch.ones_like(logits, dtype=torch.bool)
    outside[draft.token_subset] = False
    assert torch.isinf(logits[outside]).all() and torch.isfinite(logits[~outside]).all()
    # HF's assisted generation takes it as an ordinary assistant model (what `specserve bench` compares with)
    hf_target = spec.target.model
    ids = torch.tensor([[1, 20, 300, 4000]])
    with torch.inference_mode():
        alone = hf_target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
        assisted = hf_target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                                      assistant_model=draft)
    assert torch.equal(alone, assisted)

    # the stored corpus belongs to its settings: changing one is refused by name
    assert main(common + ["--steps", "14", "--gen-tokens", "20"]) == 2
    assert "gen_tokens" in capsys.readouterr().err


@pytest.mark.slow
def test_a_subset_draft_refuses_a_target_with_another_embedding(tmp_path):
    root = save_tokenized_pair(tmp_path / "models")
    out = tmp_path / "draft"
    assert main(["distill", "--target", str(root / "target"), "--out", str(out), "--layers", "1", "--subset", "100",
                 "--prompts", "2", "--self-prompts", "0", "--gen-tokens", "6", "--steps", "2", "--warmup", "1",
                 "--batch", "1",
                 "--eval-prompts", "1", "--eval-tokens", "4"]) == 0
    config = json.loads((out / "config.json").read_text())
    config["shared_from"] = str(root / "draft")  # a model whose embedding differs (perturbed copy)
    (out / "config.json").write_text(json.dumps(config))
    from specserve.models import load_model

    with pytest.raises(ValueError, match="not the one this draft was distilled with"):
        load_model(str(out), "float32")


@pytest.mark.slow
def test_init_goes_on_training_a_draft_on_text_alone(tmp_path, capsys):
    root = save_tokenized_pair(tmp_path / "models")
    target, first, second = str(root / "target"), tmp_path / "first", tmp_path / "second"
    small = ["--gen-tokens", "6", "--warmup", "1", "--batch", "2", "--seq-len", "64", "--eval-prompts", "1",
             "--eval-tokens", "4"]
    assert main(["distill", "--target", target, "--out", str(first), "--layers", "1", "--subset", "100",
                 "--prompts", "2", "--self-prompts", "0", "--steps", "2"] + small) == 0
    text = tmp_path / "notes.txt"
    text.write_text(" ".join(f"Note {i}: the library opens at nine and closes at five on weekdays." for i in range(40)))
    adapt = ["distill", "--target", target, "--init", str(first), "--out", str(second), "--prompts", "0",
             "--self-prompts", "0", "--text", str(text), "--steps", "3", "--lr", "1e-2"] + small
    assert main(adapt) == 0
    report = json.loads((second / "distill.json").read_text())
    assert report["config"]["init"] == str(first)
    assert (report["config"]["layers"], report["config"]["subset"]) == (1, 100)  # the init draft's shape, recorded
    assert report["metrics"]["head_tokens"] == 100 and report["metrics"]["corpus_sequences"] >= 3  # text chunks only
    from specserve.models import load_model

    before, after = load_model(str(first), "float32").model, load_model(str(second), "float32").model
    assert torch.equal(before.token_subset, after.token_subset)
    assert not torch.equal(before.model.layers[0].mlp.up_proj.weight, after.model.layers[0].mlp.up_proj.weight)
    assert torch.equal(before.model.embed_tokens.weight, after.model.embed_tokens.weight)  # the target's, frozen
    capsys.readouterr()

    # what --init refuses, each with the reason named
    assert main(adapt[:-len(small)] + ["--layers", "2"]) == 2
    assert "--layers cannot be changed with --init" in capsys.readouterr().err
    assert main(["distill", "--target", target, "--init", str(root / "draft"), "--out", str(tmp_path / "x"),
                 "--prompts", "1"] + small) == 2
    assert "not a subset-head draft" in capsys.readouterr().err
    assert main(["distill", "--target", str(root / "draft"), "--init", str(first), "--out", str(tmp_path / "y"),
                 "--prompts", "1"] + small) == 2
    assert "distilled for another target" in capsys.readouterr().err
    assert main(["distill", "--target", target, "--init", str(first), "--out", str(tmp_path / "z"), "--prompts", "0",
                 "--self-prompts", "0"] + small) == 2
    assert "the corpus is empty" in capsys.readouterr().err


def test_distill_rejects_bad_sizes(tmp_path, capsys):
    assert main(["distill", "--out", str(tmp_path / "x"), "--layers", "0"]) == 2
    assert "--layers" in capsys.readouterr().err
    assert main(["distill", "--out", str(tmp_path / "x"), "--subset", "-1", "--lr", "0"]) == 2
    err = capsys.readouterr().err
    assert "--subset" in err and "--lr" in err
    with pytest.raises(SystemExit):
        main(["distill", "--out", str(tmp_path / "x"), "--gen-temperatures", "0,-1"])


def test_acceptance_counts_answer_positions_only():
    target = tiny_llama(0, vocab=16, layers=1, hidden=16, scale=8, dtype=torch.float32)
    same = acceptance(target, target, [([1, 2, 3, 4, 5, 6], 3)])
    assert same["alpha_t0"] == 1.0 and same["alpha_t1"] == pytest.approx(1.0) and same["covered"] == pytest.approx(1.0)
    other = perturbed_copy(target, 3.0)
    full = acceptance(target, other, [([1, 2, 3, 4, 5, 6], 1)])
    answer = acceptance(target, other, [([1, 2, 3, 4, 5, 6], 4)])
    assert 0 <= answer["alpha_t1"] < 1 and answer != full
    # a draft that cannot propose tokens 8-15: α at T=0 counts only the target argmaxes it can reach
    masked = MaskedDraft(target, blocked=range(8, 16))
    ids = [3, 9, 1, 14, 2, 7, 11, 5, 0, 6]
    report = acceptance(target, masked, [(ids, 2)])
    with torch.inference_mode():
        argmax = target(torch.tensor([ids])).logits[0, 1:-1].argmax(-1)
    reachable = float((argmax < 8).float().mean())
    assert 0 < reachable < 1 and report["argmax_covered"] == pytest.approx(reachable)
    assert report["alpha_t0"] == pytest.approx(reachable) and same["argmax_covered"] == 1.0


class MaskedDraft(torch.nn.Module):
    """A model's logits with some tokens at -inf: a draft whose head cannot propose them."""

    def __init__(self, model, blocked):
        super().__init__()
        self.model, self.blocked = model, list(blocked)

    def forward(self, x):
        logits = self.model(x).logits.clone()
        logits[..., self.blocked] = float("-inf")
        return SimpleNamespace(logits=logits)


def test_distill_head_trains_a_feature_head_the_decoder_drafts_with(tmp_path, capsys):
    """`distill --head`: one layer on the target's features, KD + feature regression; it saves without the
    target's embedding, reports held-out α and c, and drafts through the decoder (greedy equals target-only)."""
    root = save_tokenized_pair(tmp_path / "models")
    target = str(root / "target")
    out = tmp_path / "head"
    args = ["distill", "--head", "--target", target, "--out", str(out), "--subset", "300", "--prompts", "4",
            "--self-prompts", "0", "--gen-tokens", "12", "--gen-batch", "4", "--batch", "2", "--seq-len", "48",
            "--steps", "12", "--checkpoint-every", "6", "--warmup", "2", "--eval-prompts", "2", "--eval-tokens", "8"]
    assert main(args) == 0
    report = json.loads((out / "distill.json").read_text())
    metrics = report["metrics"]
    assert report["config"]["head"] and metrics["head_tokens"] == 300 and metrics["c"] > 0
    assert 0 <= metrics["alpha_t0"] <= 1 and 0 < metrics["alpha_t1"] <= 1
    assert metrics["final_kl"] < metrics["first_kl"]  # the loss (KD + feature regression) went down

    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        stored = set(f.keys())
    assert "fc.weight" in stored and "model.embed_tokens.weight" not in stored
    assert {k.split(".")[2] for k in stored if k.startswith("model.layers.")} == {"0"}  # one layer

    spec = SpeculativeDecoder(target, f"head:{out}", gamma=3, dtype="float32", draft_lookup=False)
    plain = SpeculativeDecoder(target, None, dtype="float32")
    greedy = SamplingParams(temperature=0.0, ignore_eos=True)
    got = spec.generate("Hello there", greedy, 20)
    assert got.token_ids == plain.generate("Hello there", greedy, 20).token_ids and got.stats.drafted > 0
    # on a CPU the pooled forward wrote the corpus and kept its features with it (no second pass over it)
    assert json.loads((out / "corpus" / "manifest.json").read_text())["writer"] == "pool"
    shard = torch.load(next((out / "corpus").glob("shard-*.pt")))
    assert all(r["features"].shape == (len(r["ids"]), 32) for r in shard)
    assert not list((out / "corpus").glob("features-*"))
    live = tmp_path / "live"  # the features of each batch at its step instead (a 7B's corpus outgrows memory)
    assert main(args[:5] + [str(live)] + args[6:] + ["--live-features", "--steps", "3", "--checkpoint-every", "3"]) == 0
    assert not list((live / "corpus").glob("features-*")) and (live / "model.safetensors").is_file()
    assert main(["distill", "--head", "--layers", "2", "--out", str(tmp_path / "x")]) == 2
    assert "--layers and --hidden do not apply" in capsys.readouterr().err
    assert main(["distill", "--head", "--feature-dropout", "1", "--out", str(tmp_path / "x")]) == 2
    assert "--feature-dropout" in capsys.readouterr().err


def test_a_head_from_a_draft_starts_as_that_draft_one_position_later():
    """`distill --head --init DRAFT`: the head takes the draft's layers, norm and subset head, fc reads only the
    next token's embedding, so at first it predicts what the draft predicts (head position j reads x_{j+1}: the
    draft over x[1:]), whatever the features; with --feature-dropout it drafts on zeros."""
    from specserve.distill.core import DistillConfig, feature_scale, fold_fc, head_losses, make_draft, make_head

    target = tiny_llama(3, vocab=64, layers=3, hidden=32, dtype=torch.float32)
    subset = torch.tensor(sorted(random.Random(0).sample(range(64), 20)))
    draft, _ = make_draft(target, DistillConfig(layers=2, subset=20), subset)
    with torch.no_grad():  # a draft trained away from the target's layers
        for param in draft.model.layers.parameters():
            param.add_(0.05 * torch.randn_like(param))
    head, frozen = make_head(target, DistillConfig(head=True, feature_dropout=0.3), subset, draft)
    assert head.config.num_hidden_layers == 2 and head.config.drafted_feature == "zero"
    assert frozen == {"model.embed_tokens.weight"} and torch.equal(head.token_subset, draft.token_subset)
    x = torch.randint(0, 64, (2, 12))
    features = torch.randn(2, 11, 32)
    with torch.no_grad():
        _, logits = head(features, x[:, 1:])
        expected = draft.lm_head(draft.model(input_ids=x[:, 1:]).last_hidden_state)
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
        rows, cols = torch.tensor([0, 1, 1]), torch.tensor([3, 5, 11])
        torch.manual_seed(0)
        dropped, _ = head_losses(head, torch.randn(2, 12, 32), x, rows, cols, dropout=0.999999)
        _, blind = head(torch.zeros(2, 11, 32), x[:, 1:])
        torch.testing.assert_close(dropped, blind[rows, cols - 1])  # every feature it read was zeroed
    frozen_head, frozen = make_head(target, DistillConfig(head=True, freeze_init=True), subset, draft)
    assert [n for n, p in frozen_head.named_parameters() if p.requires_grad] == ["fc.features"]
    before = frozen_head.fc.weight.detach().clone()
    optimizer = torch.optim.AdamW([frozen_head.fc.features], lr=1e-2, weight_decay=0.0)  # as distill trains
    logits, _ = head_losses(frozen_head, torch.randn(2, 12, 32), x, rows, cols)
    logits.logsumexp(-1).sum().backward()
    optimizer.step()
    moved = frozen_head.fc.weight.detach() - before
    assert moved[:, :32].any() and not moved[:, 32:].any()  # the features' half learns, the embedding's stays I
    # Adam's step (~lr an entry) lands on fc's features' half scaled to the embedding's size over the features'
    scale = feature_scale(target)
    assert 0 < scale < 1 and moved[:, :32].abs().max() <= 1.01e-2 * scale
    saved = fold_fc(copy.deepcopy(frozen_head))
    assert type(saved.fc) is torch.nn.Linear and torch.equal(saved.fc.weight, frozen_head.fc.weight)
    with torch.no_grad():
        torch.testing.assert_close(saved(features, x[:, 1:])[1], frozen_head(features, x[:, 1:])[1])
    wide = tiny_llama(3, vocab=64, layers=2, hidden=48, dtype=torch.float32)
    with pytest.raises(ValueError, match="hidden size"):
        make_head(wide, DistillConfig(head=True), subset, draft)
