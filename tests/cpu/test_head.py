"""The draft head on the target's features (`models.head`): the pool keeps the features HF computes, the head's
lean steps are its HF forward, and speculation through it is exact."""

from __future__ import annotations

import random

import pytest
import torch
from specserve import SamplingParams, SpeculativeDecoder
from specserve.models.head import FeatureHeadForCausalLM, HeadSequence, is_head, load_head
from specserve.models.loading import load_model
from specserve.models.pool import KVPool
from specserve.speculation import rejection

from tests.conftest import tiny_llama
from tests.cpu.test_exactness import chi_square_pvalue, sampled_joint, target_joint

VOCAB = 40


@pytest.fixture(scope="module")
def target():
    return tiny_llama(5, vocab=VOCAB, layers=2, hidden=32, scale=8)


def hf_features(model, tokens: list[int]) -> torch.Tensor:
    """The target's normed final hidden states (its LM head's input) at every position: [len, hidden]."""
    with torch.inference_mode():
        return model.model(torch.tensor([tokens])).last_hidden_state[0]


@pytest.mark.parametrize("runner", [False, True], ids=["eager", "runner"])
def test_the_pool_keeps_every_positions_features_through_steps_moves_and_copies(target, runner):
    pool = KVPool(target, tokens=1024, max_length=256, min_block=4, runner=runner, features=True,
                  prefix_caching=True)
    rng = random.Random(0)
    histories = [[rng.randrange(VOCAB) for _ in range(n)] for n in (3, 9, 1)]
    seqs = [pool.sequence() for _ in histories]
    pool.forward(seqs, histories, [1, 1, 1])
    for step in range(6):  # equal widths (the runner's steps), blocks outgrowing their place (moved)
        new = [[rng.randrange(VOCAB) for _ in range(3 if step % 2 else 1)] for _ in seqs]
        pool.forward(seqs, new, [1] * 3)
        for h, t in zip(histories, new):
            h += t
    for seq, h in zip(seqs, histories):
        got = pool.features[seq.block[0] : seq.block[0] + len(h)]
        torch.testing.assert_close(got, hf_features(target, h), atol=1e-10, rtol=0)
    held = list(seqs[1].tokens)
    seqs[1].release()  # into the prefix cache; a new sequence copies its rows
    other = pool.sequence()
    other.logits_after(held + [4, 5])
    torch.testing.assert_close(pool.features[other.block[0] : other.block[0] + len(held) + 1],
                               hf_features(target, held + [4]), atol=1e-10, rtol=0)
    assert other.hit_tokens > 0
    if runner:
        assert pool.runner.buckets


def test_the_heads_lean_steps_are_its_hf_forward(target):
    """On true features the head's logits are its HF forward's; drafting on, each step feeds its own
    prediction, as the HF forward does given that feature."""
    head = FeatureHeadForCausalLM.for_target(target, token_subset=torch.tensor([9, 3, 30, 1, 17, 22, 5, 38]), seed=2)
    pool = KVPool(target, tokens=512, features=True)
    context = [3, 1, 4, 1, 5, 9, 2, 6, 5]
    tseq = pool.sequence()
    tseq.logits_after(context[:-1])  # the target holds all but the last token, as after a verify
    seq = HeadSequence(head, tseq)
    f = hf_features(target, context[:-1])
    with torch.inference_mode():
        pred, logits = head(f[None], torch.tensor([context[1:]]))
    order = torch.argsort(head.token_subset)
    torch.testing.assert_close(seq.subset_logits_after(context)[0], logits[0, -1, order].float(), atol=1e-10, rtol=0)
    token = 17
    with torch.inference_mode():
        _, more = head(torch.cat([f, pred[0, -1:]])[None], torch.tensor([context[1:] + [token]]))
    torch.testing.assert_close(seq.feed_subset([token])[0], more[0, -1, order].float(), atol=1e-10, rtol=0)
    # the next block: the target verified two more positions; the head replaces its predicted one with them
    tseq.logits_after(context + [token])
    again = context + [token, 8]
    f2 = hf_features(target, again[:-1])
    with torch.inference_mode():
        _, third = head(f2[None], torch.tensor([again[1:]]))
    torch.testing.assert_close(seq.subset_logits_after(again)[0], third[0, -1, order].float(), atol=1e-10, rtol=0)
    assert seq.true == len(again) - 1


GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("gamma", [1, 3, "auto"])
def test_greedy_through_a_head_equals_target_only(target, gamma):
    head = FeatureHeadForCausalLM.for_target(target, seed=1)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    reference = SpeculativeDecoder(target, None, gamma=0).generate(prompt, GREEDY, 40)
    decoder = SpeculativeDecoder(target, head, gamma=gamma, draft_lookup=False)
    assert decoder.draft_kind == "head" and decoder.kv_pool.features is not None
    got = decoder.generate(prompt, GREEDY, 40)
    assert got.token_ids == reference.token_ids
    assert got.stats.drafted > 0 or gamma == "auto"


def test_seeded_runs_through_a_head_repeat_and_one_token_prompts_draft_nothing_wrong(target):
    head = FeatureHeadForCausalLM.for_target(target, seed=1)
    decoder = SpeculativeDecoder(target, head, gamma=3, draft_lookup=False)
    params = SamplingParams(temperature=1.0, seed=11, ignore_eos=True)
    first = decoder.generate([3, 1, 4, 1], params, 30).token_ids
    assert decoder.generate([3, 1, 4, 1], params, 30).token_ids == first
    assert len(decoder.generate([7], params, 10).token_ids) == 10  # no feature yet: the head drafts blind, exactly


MODES = [{"temperature": 1.0}, {"temperature": 0.8, "top_k": 5}, {"temperature": 1.2, "top_p": 0.8}]


@pytest.mark.parametrize("mode", MODES, ids=["T=1", "top-k", "top-p"])
def test_first_two_tokens_through_a_head_follow_the_target(mode, monkeypatch):
    """Chi-square against the target's joint distribution of the first two tokens; a missing residual step
    is caught by the same harness."""
    target = tiny_llama(0)  # vocabulary 8, as test_exactness
    head = FeatureHeadForCausalLM.for_target(target, seed=4)
    decoder = SpeculativeDecoder(target, head, gamma=2, draft_lookup=False)
    expected = target_joint(target, mode)
    assert chi_square_pvalue(sampled_joint(decoder, mode, 2), expected) > 1e-3
    if mode == MODES[0]:
        monkeypatch.setattr(rejection, "residual_distribution", lambda p, q: p)
        assert chi_square_pvalue(sampled_joint(decoder, mode, 2), expected) < 1e-3


def test_heads_save_load_by_spec_and_refuse_a_target_they_do_not_fit(tmp_path, target):
    head = FeatureHeadForCausalLM.for_target(target, seed=3, shared_from=None)
    head.config.shared_from = str(tmp_path / "target")
    target.save_pretrained(str(tmp_path / "target"))
    head.save_pretrained(str(tmp_path / "head"))
    spec = f"head:{tmp_path / 'head'}"
    assert is_head(spec) and not is_head("ngram")
    loaded = load_head(spec, load_model(target))
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), head.state_dict().values()))
    other = tiny_llama(1, vocab=VOCAB, layers=1, hidden=16)
    with pytest.raises(ValueError, match="does not fit a target"):
        load_head(spec, load_model(other))
    with pytest.raises(ValueError, match="no feature head"):
        load_head(f"head:{tmp_path / 'missing'}", load_model(target))
