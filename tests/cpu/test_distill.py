"""`specserve distill` on a tiny target: data, KD training with resume, held-out α/c, a loadable draft."""

from __future__ import annotations

import json

import pytest
import torch

from specserve import SamplingParams, SpeculativeDecoder
from specserve.cli import main
from specserve.distill import prompt_set
from specserve.distill.core import kd_loss
from tests.conftest import save_tokenized_pair


def test_kd_loss_is_zero_only_for_the_teacher_itself():
    teacher = torch.randn(5, 11) * 3
    assert float(kd_loss(teacher.clone(), teacher, 1.0)) == pytest.approx(0.0, abs=1e-6)
    assert float(kd_loss(teacher + torch.randn(5, 11), teacher, 2.0)) > 0.01


def test_held_out_prompts_share_no_subject_with_training_prompts():
    train, held = set(prompt_set(300)), set(prompt_set(50, held_out=True))
    assert len(train) > 150 and not train & held
    assert any("```python" in p for p in train) and any(p.startswith("Rewrite") for p in train)


@pytest.mark.slow
def test_distill_trains_resumes_and_writes_a_usable_draft(tmp_path):
    root = save_tokenized_pair(tmp_path / "models")
    out = tmp_path / "draft"
    common = ["distill", "--target", str(root / "target"), "--out", str(out), "--layers", "1", "--prompts", "4",
              "--gen-tokens", "12", "--batch", "2", "--seq-len", "32", "--checkpoint-every", "5",
              "--eval-prompts", "2"]
    assert main(common + ["--steps", "10"]) == 0
    assert main(common + ["--steps", "14"]) == 0  # picks up the checkpoint and the corpus
    report = json.loads((out / "distill.json").read_text())["metrics"]
    assert report["resumed_from"] == 10 and report["steps"] == 14 and report["corpus_sequences"] == 4
    assert 0 <= report["alpha_t0"] <= 1 and 0 <= report["alpha_t1"] <= 1 and report["c"] > 0
    assert report["frozen"] == ["lm_head.weight", "model.embed_tokens.weight"]  # the target's own, shared

    target = str(root / "target")
    spec = SpeculativeDecoder(target, str(out), gamma=3, dtype="float32")
    plain = SpeculativeDecoder(target, None, dtype="float32")
    greedy = SamplingParams(temperature=0.0, ignore_eos=True)
    assert spec.generate("Hello there", greedy, 20).token_ids == plain.generate("Hello there", greedy, 20).token_ids
    draft = spec.draft.model
    assert draft.config.num_hidden_layers == 1
    assert torch.equal(draft.model.embed_tokens.weight, plain.target.model.model.embed_tokens.weight)


def test_distill_rejects_bad_sizes(tmp_path, capsys):
    assert main(["distill", "--out", str(tmp_path / "x"), "--layers", "0"]) == 2
    assert "--layers" in capsys.readouterr().err


def test_acceptance_counts_answer_positions_only():
    from specserve.distill.core import acceptance
    from tests.conftest import perturbed_copy, tiny_llama

    target = tiny_llama(0, vocab=16, layers=1, hidden=16, scale=8, dtype=torch.float32)
    same = acceptance(target, target, [([1, 2, 3, 4, 5, 6], 3)])
    assert same["alpha_t0"] == 1.0 and same["alpha_t1"] == pytest.approx(1.0)
    other = perturbed_copy(target, 3.0)
    full = acceptance(target, other, [([1, 2, 3, 4, 5, 6], 1)])
    answer = acceptance(target, other, [([1, 2, 3, 4, 5, 6], 4)])
    assert 0 <= answer["alpha_t1"] < 1 and answer != full
