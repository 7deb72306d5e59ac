"""Public EAGLE-3 heads as drafts (`models.drafts.eagle3`), on random heads the tests write in the engines' layout:
the target keeps the hidden states entering the layers the head reads, greedy output equals target-only decoding,
sampled output follows the target's distribution (chi-square at T=1) although the head scores a reduced vocabulary,
and a checkpoint that does not fit is refused by name."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from specserve import SamplingParams, SpeculativeDecoder
from specserve.models.drafts.eagle3 import aux_layers, is_eagle3
from specserve.models.memory.pool import KVPool
from specserve.speculation import rejection
from tests.conftest import tiny_llama
from tests.cpu.test_exactness import chi_square_pvalue
from tests.eagle3_files import write_eagle3
from tests.reference import reference_probs

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def target():
    return tiny_llama(0, vocab=64, layers=6, hidden=32, scale=8, heads=4, kv_heads=2)


def test_the_pool_keeps_the_hidden_states_entering_the_heads_layers(target):
    layers = aux_layers({}, target.config.num_hidden_layers)
    assert layers == (2, 3, 3)  # the engines' default for 6 layers: 2, L // 2, L - 3
    tokens = [random.Random(1).randrange(64) for _ in range(13)]
    pool = KVPool(target, 256, features=layers)
    seq = pool.sequence()
    seq.feed(tokens[:9], keep_logits=9)
    seq.feed(tokens[9:], keep_logits=4)
    with torch.inference_mode():
        states = target(torch.tensor([tokens]), output_hidden_states=True).hidden_states  # [i]: entering layer i
    kept = pool.features[seq.block[0] : seq.block[0] + len(tokens)]
    torch.testing.assert_close(kept, torch.cat([states[i][0] for i in layers], -1), rtol=0, atol=1e-10)
    assert aux_layers({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 4]}}, 6) == (2, 3, 5)
    with pytest.raises(ValueError, match="layers"):
        aux_layers({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 5]}}, 6)


def test_greedy_with_an_eagle3_head_is_target_only_decoding(target, tmp_path):
    path = write_eagle3(tmp_path / "head", target, draft_vocab=48)
    assert is_eagle3(str(path)) and is_eagle3(f"eagle3:{path}") and not is_eagle3(str(tmp_path))
    prompt = [random.Random(2).randrange(64) for _ in range(12)]
    alone = SpeculativeDecoder(target, None, gamma=0).generate(prompt, GREEDY, 32).token_ids
    for spec in (f"eagle3:{path}", str(path)):  # named, or found by its config's architectures
        decoder = SpeculativeDecoder(target, spec, gamma=3, draft_lookup=False)
        result = decoder.generate(prompt, GREEDY, 32)
        assert result.token_ids == alone
        assert result.stats.drafted > 0  # it drafted (the sampled test below sees its tokens kept too)
    # a second generation on the same decoder (the head's cache and the target's prefix cache reused)
    assert decoder.generate(prompt, GREEDY, 32).token_ids == alone


CHI_VOCAB, CHI_RUNS = 12, 1200


def test_sampled_tokens_follow_the_target_distribution(tmp_path, monkeypatch):
    """The first two sampled tokens at temperature 1 against the target's joint distribution computed from its
    forward; the head scores 8 of the 12 tokens only (q is zero elsewhere). A sampler without the residual step
    is rejected by the same test."""
    target = tiny_llama(3, vocab=CHI_VOCAB, layers=6, hidden=32, scale=2, heads=4, kv_heads=2)
    path = write_eagle3(tmp_path / "head", target, draft_vocab=8, seed=4, spread=0.5)
    prompt = [1, 5, 2, 7, 3, 3, 8, 0, 4]
    with torch.inference_mode():
        first = target(torch.tensor([prompt])).logits[0, -1].double().numpy()
        seconds = target(torch.tensor([prompt + [a] for a in range(CHI_VOCAB)])).logits[:, -1].double().numpy()
    p1 = reference_probs(first, 1.0, 0, 1.0)
    joint = np.stack([p1[a] * reference_probs(seconds[a], 1.0, 0, 1.0) for a in range(CHI_VOCAB)])
    decoder = SpeculativeDecoder(target, f"eagle3:{path}", gamma=2, draft_lookup=False)

    def counts():
        found, drafted, accepted = np.zeros((CHI_VOCAB, CHI_VOCAB)), 0, 0
        for seed in range(CHI_RUNS):
            res = decoder.generate(prompt, SamplingParams(temperature=1.0, seed=seed, ignore_eos=True), 2)
            found[res.token_ids[0], res.token_ids[1]] += 1
            drafted, accepted = drafted + res.stats.drafted, accepted + res.stats.accepted
        return found, drafted, accepted

    found, drafted, accepted = counts()
    assert chi_square_pvalue(found, joint) > 1e-3
    assert drafted and 0 < accepted < drafted  # the head's tokens were both kept and rejected
    monkeypatch.setattr(rejection, "residual_distribution", lambda p, q: p)
    assert chi_square_pvalue(counts()[0], joint) < 1e-3, "the test cannot tell a missing residual step"


def test_a_checkpoint_that_does_not_fit_is_refused_by_name(target, tmp_path):
    good = write_eagle3(tmp_path / "good", target, draft_vocab=48)
    tensors = load_file(str(good / "model.safetensors"))
    config = json.loads((good / "config.json").read_text())

    def written(name, tensors, config):
        path = tmp_path / name
        path.mkdir()
        save_file(tensors, str(path / "model.safetensors"))
        (path / "config.json").write_text(json.dumps(config))
        return f"eagle3:{path}"

    missing = written("missing", {k: v for k, v in tensors.items() if k != "midlayer.hidden_norm.weight"}, config)
    with pytest.raises(ValueError, match="midlayer.hidden_norm.weight"):
        SpeculativeDecoder(target, missing)
    narrow = written("narrow", {**tensors, "fc.weight": tensors["fc.weight"][:, :64].contiguous()}, config)
    with pytest.raises(ValueError, match=r"fc.weight is \(32, 64\)"):
        SpeculativeDecoder(target, narrow)
    other = written("other", tensors, {**config, "vocab_size": 128})
    with pytest.raises(ValueError, match="vocabulary of 128"):
        SpeculativeDecoder(target, other)
    with pytest.raises(ValueError, match="no EAGLE-3 config.json"):
        SpeculativeDecoder(target, f"eagle3:{tmp_path / 'nowhere'}")


def test_a_served_eagle3_head_runs_in_the_target_worker(target, tmp_path):
    from specserve.workers import WorkersConfig

    path = write_eagle3(tmp_path / "head", target, draft_vocab=48)
    for spec in (f"eagle3:{path}", str(path)):
        config = WorkersConfig(draft=spec)
        assert config.colocated() and not config.has_draft_worker()
