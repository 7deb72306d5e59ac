"""LeanSequence: the draft's own incremental forward agrees with the HF forward it replaces."""

from __future__ import annotations

import pytest
import torch
from specserve.engine.proposers import ModelProposer
from specserve.models import CachedSequence, SubsetDraftConfig, SubsetDraftForCausalLM
from specserve.models.families.lean import LeanSequence, draft_sequence, unsupported_reason
from specserve.speculation import PositionRNG, Purpose, SamplingParams, probs_from_logits
from specserve.speculation.sampling import sample_from_probs

from tests.conftest import tiny_llama

VOCAB = 40
SUBSET = [31, 2, 17, 5, 0, 38, 11, 23]  # deliberately unsorted


def subset_draft(seed: int = 3) -> SubsetDraftForCausalLM:
    torch.manual_seed(seed)
    config = SubsetDraftConfig(
        token_subset_size=len(SUBSET), vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.3,
    )
    model = SubsetDraftForCausalLM(config).to(torch.float64).eval()
    model.token_subset.copy_(torch.tensor(SUBSET))
    return model


def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([tokens], device=model.device)).logits[0].float().cpu()


# CUDA runs only where there is a GPU (a device session: `pytest tests/cpu/test_lean.py`); CI has none
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("make", [lambda: tiny_llama(5, vocab=VOCAB, layers=2, hidden=32, scale=8), subset_draft],
                         ids=["llama", "subset-draft"])
def test_feeds_rollbacks_and_growth_match_the_hf_forward(make, device):
    model = make().to(device)
    seq = LeanSequence(model, capacity=4)  # small, so the cache grows several times
    assert draft_sequence(model).__class__ is LeanSequence
    tokens = [1, 7, 3, 9, 2, 30, 4, 4, 8, 12, 6]
    got = [seq.feed(tokens[:6], keep_logits=6)]
    got += [seq.feed([t]) for t in tokens[6:9]]
    got.append(seq.feed(tokens[9:], keep_logits=2))
    reference = hf_logits(model, tokens)
    torch.testing.assert_close(torch.cat(got), reference, atol=1e-5, rtol=0)  # -inf outside a subset compares equal
    # a rejection: keep 7 tokens, continue differently; and logits_after reuses the common prefix
    seq.rollback(7)
    branch = tokens[:7] + [13, 21, 1]
    torch.testing.assert_close(seq.feed(branch[7:], keep_logits=3), hf_logits(model, branch)[-3:], atol=1e-5, rtol=0)
    calls = seq.forward_calls
    torch.testing.assert_close(seq.logits_after(branch[:5] + [3]), hf_logits(model, branch[:5] + [3])[-1:],
                               atol=1e-5, rtol=0)
    assert seq.forward_calls == calls + 1 and seq.tokens == branch[:5] + [3]


def test_a_subset_head_gives_sorted_subset_logits_and_minus_inf_elsewhere():
    model = subset_draft()
    seq = LeanSequence(model)
    assert seq.token_subset.tolist() == sorted(SUBSET)
    sub = seq.subset_logits_after([4, 9, 1])
    full = hf_logits(model, [4, 9, 1])[-1]
    torch.testing.assert_close(sub[0], full[sorted(SUBSET)], atol=1e-5, rtol=0)
    assert torch.isinf(full[[t for t in range(VOCAB) if t not in SUBSET]]).all()


MODES = [dict(temperature=0.0), dict(temperature=1.0, seed=3), dict(temperature=0.7, top_k=3, seed=4),
         dict(temperature=1.3, top_p=0.8, seed=5)]


@pytest.mark.parametrize("mode", MODES, ids=["greedy", "t1", "top-k", "top-p"])
@pytest.mark.parametrize("top_k_q", [0, 4])
def test_drafting_over_the_subset_proposes_what_the_full_vocabulary_would(mode, top_k_q):
    """The subset path samples over the subset and widens q once; the HF path samples over all 40 tokens."""
    model = subset_draft()
    lean = ModelProposer(model, VOCAB, top_k_q=top_k_q)
    assert lean.subset is not None
    full = ModelProposer(model, VOCAB, top_k_q=top_k_q)
    full.seq, full.subset = CachedSequence(model), None
    params = SamplingParams(**mode)
    context = [3, 14, 15, 9, 2, 6]
    for step in range(6):
        a = lean.propose(context, 4, params, PositionRNG(params.seed))
        b = full.propose(context, 4, params, PositionRNG(params.seed))
        assert a.tokens == b.tokens and set(a.tokens) <= set(SUBSET)
        torch.testing.assert_close(a.q, b.q, atol=1e-6, rtol=0)
        assert a.q.shape == (4, VOCAB) and (a.q[:, [t for t in range(VOCAB) if t not in SUBSET]] == 0).all()
        context = context + a.tokens[: step % 4] + [step]  # accept a prefix, then a correction


@pytest.mark.parametrize("make", [lambda: tiny_llama(5, vocab=VOCAB, layers=2, hidden=32, scale=8), subset_draft],
                         ids=["llama", "subset-draft"])
def test_greedy_drafting_is_the_sampling_rule_at_temperature_zero(make):
    """At T=0 a draft takes its argmax and writes the one-hot q itself: the same tokens and q as drawing from
    `probs_from_logits`' one-hot with the position's uniform, ties included (every head row has a twin)."""
    model = make()
    with torch.no_grad():
        model.lm_head.weight[1::2] = model.lm_head.weight[0::2]  # token 2j+1 ties with token 2j (rows in order)
    proposer, greedy = ModelProposer(model, VOCAB), SamplingParams(temperature=0)
    ties = 0
    for seed, context in [(0, [3, 14, 15, 9, 2, 6]), (1, [7, 1]), (2, [30, 30, 30, 4, 11, 0, 5, 2])]:
        rng = PositionRNG(seed)
        got = proposer.propose(context, 5, greedy, rng)
        expected, rows = [], []
        for i in range(5):
            logits = hf_logits(model, context + expected)[-1:]
            ties += int((logits == logits.max()).sum() > 1)
            rows.append(probs_from_logits(logits, greedy))
            uniform = torch.tensor([rng.uniform(len(context) + i, Purpose.DRAFT)])
            expected.append(int(sample_from_probs(rows[-1], uniform)))
        assert got.tokens == expected
        assert torch.equal(got.q, torch.cat(rows)) and got.q.dtype == torch.float32
    assert ties == 15  # every step's argmax was tied, and the first of the tie won on both paths


def test_half_precision_drafts_compute_in_float32_on_a_cpu():
    model = tiny_llama(5, vocab=VOCAB, layers=1, hidden=32, scale=8).to(torch.bfloat16)
    seq = LeanSequence(model)
    assert seq.w.dtype == torch.float32
    assert LeanSequence(model.double()).w.dtype == torch.float64


def test_models_it_does_not_cover_fall_back_to_the_hf_cache():
    model = tiny_llama(5, vocab=VOCAB, layers=1, hidden=32)
    model.config.rope_parameters = {"rope_type": "proportional", "rope_theta": 10000.0, "factor": 8.0}
    assert "rope type" in unsupported_reason(model)
    assert isinstance(draft_sequence(model), CachedSequence)
    model.config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    model.config.model_type = "gpt2"
    assert isinstance(draft_sequence(model), CachedSequence)
