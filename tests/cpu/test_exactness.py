"""Speculative output is distributed exactly as the target alone would sample.

Chi-square goodness of fit of the first two generated tokens, sampled
through `SpeculativeDecoder.generate` with a random tiny target and a
*different* random draft, against the joint distribution computed
analytically from the target (with the NumPy reference of each sampling
mode). Each test also runs a deliberately broken sampler (no residual step:
resample from p on rejection) through the same harness and requires that
the test rejects it — so the check can fail.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from scipy import stats

from specserve import SamplingParams, SpeculativeDecoder
from specserve.speculation import AutoGamma, RoundObservation, rejection
from tests.conftest import perturbed_copy
from tests.reference import reference_probs

PROMPT = [1, 5, 2, 7]
N = 1500  # runs per distribution; measured: the broken sampler scores p < 1e-11 in every case, the real one > 5e-3


def target_joint(model, mode: dict, prompt: list[int] = PROMPT) -> np.ndarray:
    """P(first token = a, second = b) under the target with the sampling mode: [vocab, vocab]."""
    vocab = model.config.vocab_size
    args = (mode.get("temperature", 1.0), mode.get("top_k", 0), mode.get("top_p", 1.0))
    with torch.no_grad():
        first = model(torch.tensor([prompt])).logits[0, -1].numpy()
        seconds = model(torch.tensor([prompt + [a] for a in range(vocab)])).logits[:, -1].numpy()
    p1 = reference_probs(first, *args)
    return np.stack([p1[a] * reference_probs(seconds[a], *args) for a in range(vocab)])


def sampled_joint(decoder, mode: dict, max_new_tokens: int, prompt: list[int] = PROMPT) -> np.ndarray:
    vocab = decoder.target.vocab_size
    counts = np.zeros((vocab, vocab))
    for seed in range(N):
        res = decoder.generate(prompt, SamplingParams(**mode, seed=seed, ignore_eos=True), max_new_tokens)
        counts[res.token_ids[0], res.token_ids[1]] += 1
    return counts


def chi_square_pvalue(counts: np.ndarray, expected_probs: np.ndarray) -> float:
    counts, expected = counts.ravel(), expected_probs.ravel() * counts.sum()
    assert counts[expected == 0].sum() == 0, "sampled a pair the target gives probability 0"
    big = expected >= 5  # pool sparse cells so the chi-square approximation holds
    obs = np.append(counts[big], counts[~big & (expected > 0)].sum())
    exp = np.append(expected[big], expected[~big & (expected > 0)].sum())
    keep = exp > 0
    return stats.chisquare(obs[keep], exp[keep]).pvalue


CASES = {
    "T=1": (dict(temperature=1.0), 0, 3),
    "T=1 bonus path": (dict(temperature=1.0), 0, 2),
    "T<1 top-k": (dict(temperature=0.7, top_k=4), 0, 3),
    "T>1 top-p": (dict(temperature=1.6, top_p=0.85), 0, 3),
    "truncated q": (dict(temperature=1.0), 2, 3),
    "draft stops where unsure": (dict(temperature=1.0), 0, 3),
    "auto: block length from the draft's confidence": (dict(temperature=1.0), 0, 3),
    "prompt lookup first, the model elsewhere": (dict(temperature=1.0), 0, 3),
}
# a model draft with draft_lookup: this prompt ends with a 2-gram seen before, so the first block is the
# lookup's one-hot [2, 7] and later blocks the model's
LOOKUP = {"prompt lookup first, the model elsewhere": [1, 5, 2, 7, 3, 1, 5]}
# block length from the draft's own confidence: here its first distribution (max 0.86) is below 0.9, so the
# block ends after one token and the second token comes from the bonus path of a γ=2 decoder
STOP_BELOW = {"draft stops where unsure": 0.9}
# γ="auto" with a local draft: the controller decides token by token from the draft's confidence and what it
# learned on earlier requests (here the ones before), and drops unsure tokens before verification
GAMMA = {"auto: block length from the draft's confidence": "auto"}


class PinnedCosts(AutoGamma):
    """AutoGamma with its cost model held at a cheap draft and a flat verify: tiny models' timings are all
    overhead, which would turn speculation off. What it learns about acceptance is real."""

    def __init__(self):
        super().__init__(gamma_max=4, verify_profile={n: 0.04 * (1 + 0.06 * (n - 1)) for n in range(1, 6)},
                         draft_step_s=0.0005)

    def update(self, obs: RoundObservation) -> None:
        super().update(replace(obs, draft_time_s=0.0, verify_time_s=0.0, round_time_s=0.0))


@pytest.mark.parametrize("case", list(CASES))
def test_first_two_tokens_follow_target(case, tiny_pair, monkeypatch):
    mode, draft_top_k, max_new = CASES[case]
    target, draft = tiny_pair
    # γ=2: with 3 new tokens the first round drafts 2 (accept/residual at both positions);
    # with 2 new tokens it drafts 1, so the second token is often the bonus.
    stop = STOP_BELOW.get(case, 0.0)
    decoder = SpeculativeDecoder(target, draft, gamma=GAMMA.get(case, 2), draft_top_k=draft_top_k,
                                 draft_stop_below=stop, draft_lookup=case in LOOKUP)
    prompt = LOOKUP.get(case, PROMPT)
    if case in LOOKUP:  # the lookup proposes the first block
        first = decoder.generate(prompt, SamplingParams(**mode, seed=0, ignore_eos=True), max_new).stats
        assert first.gamma_history[0] == 2 and first.drafted_per_position[0] >= 1 and first.lookup_rounds >= 1
    if case in GAMMA:
        draft = perturbed_copy(target, 0.3)  # often agrees, not always, and is unsure at times
        decoder = SpeculativeDecoder(target, draft, gamma="auto", draft_lookup=False)
        controller = PinnedCosts()  # one for all requests: learning carries over, as the decoder's warm start does
        monkeypatch.setattr(decoder, "controller", lambda gamma=None: controller)
    if stop:  # the early stop really happens: the draft goes to depth 1 of γ=2
        first = decoder.generate(PROMPT, SamplingParams(**mode, seed=0, ignore_eos=True), max_new).stats
        assert first.gamma_history[0] == 1 < decoder.gamma
    expected = target_joint(target, mode, prompt)

    counts = sampled_joint(decoder, mode, max_new, prompt)
    assert chi_square_pvalue(counts, expected) > 1e-3

    drafted = decoder.generate(prompt, SamplingParams(**mode, seed=0, ignore_eos=True), max_new).stats
    assert drafted.drafted > 0 and drafted.rounds >= 1
    if case in GAMMA:  # the draft went on to different depths, and some drafted tokens were not verified
        runs = [decoder.generate(PROMPT, SamplingParams(**mode, seed=s, ignore_eos=True), max_new).stats
                for s in range(40)]
        assert len({tuple(r.gamma_history) for r in runs}) > 1
        assert any(r.drafted < sum(r.gamma_history) for r in runs)

    if case in ("T=1", "truncated q", "T<1 top-k", "draft stops where unsure", *GAMMA, *LOOKUP):
        monkeypatch.setattr(rejection, "residual_distribution", lambda p, q: p)
        broken = sampled_joint(decoder, mode, max_new, prompt)
        assert chi_square_pvalue(broken, expected) < 1e-3, "the test cannot tell a missing residual step"
