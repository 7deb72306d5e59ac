"""SpeculativeDecoder on tiny random models: greedy identity, seeds, KV cache use, errors."""

from __future__ import annotations

import pytest
import torch
from specserve import SamplingParams, SpeculativeDecoder
from specserve.models.families.lean import LeanSequence
from specserve.models.memory.pool import KVPool

from tests.conftest import perturbed_copy, tiny_llama

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)


def hf_greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def models():
    target = tiny_llama(0, vocab=64, layers=2, hidden=32, scale=8)
    return {
        "target": target,
        "random draft": tiny_llama(1, vocab=64, layers=1, hidden=32, scale=8),
        "close draft": perturbed_copy(target, 0.3),
    }


@pytest.mark.parametrize("draft", ["random draft", "close draft", "target", "ngram", "close draft + lookup"])
@pytest.mark.parametrize("gamma", [1, 3, 8, "heuristic", "auto"])
def test_greedy_equals_target_only(models, draft, gamma):
    target = models["target"]
    reference = SpeculativeDecoder(target, None, gamma=0).generate(PROMPT, GREEDY, 40)
    assert reference.token_ids == hf_greedy(target, PROMPT, 40)
    lookup = draft.endswith(" + lookup")  # prompt lookup first, the model elsewhere (the default for model drafts)
    draft = draft.removesuffix(" + lookup")
    spec = SpeculativeDecoder(target, models.get(draft, draft), gamma=gamma, draft_lookup=lookup).generate(
        PROMPT, GREEDY, 40)
    assert spec.token_ids == reference.token_ids
    if draft == "target" and isinstance(gamma, int):
        assert spec.stats.acceptance_rate == 1.0  # the same model accepts everything
    if draft == "close draft" and isinstance(gamma, int) and not lookup:
        assert 0.0 < spec.stats.acceptance_rate < 1.0  # partial acceptance exercised rollback


def test_greedy_random_draft_accepts_almost_nothing_but_still_matches(models):
    decoder = SpeculativeDecoder(models["target"], models["random draft"], gamma=4, draft_lookup=False)
    spec = decoder.generate(PROMPT, GREEDY, 30)
    assert spec.stats.acceptance_rate < 0.3
    assert spec.stats.rounds >= 20


@pytest.mark.parametrize("draft", ["close draft", "ngram"])
@pytest.mark.parametrize("mode", [dict(temperature=1.0), dict(temperature=0.8, top_k=10), dict(temperature=1.2, top_p=0.9)])
def test_seeded_runs_are_reproducible(models, draft, mode):
    decoder = SpeculativeDecoder(models["target"], models.get(draft, draft), gamma=3, draft_lookup=False)
    params = SamplingParams(**mode, seed=1234, ignore_eos=True)
    first = decoder.generate(PROMPT, params, 40).token_ids
    again = SpeculativeDecoder(models["target"], models.get(draft, draft), gamma=3, draft_lookup=False).generate(
        PROMPT, params, 40)
    assert first == again.token_ids
    other = decoder.generate(PROMPT, params.model_copy(update={"seed": 99}), 40).token_ids
    assert other != first
    unseeded = {tuple(decoder.generate(PROMPT, SamplingParams(**mode, ignore_eos=True), 40).token_ids) for _ in range(3)}
    assert len(unseeded) > 1  # seed=None draws a fresh seed per request


def _record_pool_forwards(monkeypatch):
    """A Llama target runs on the KV pool's forward (a batch of one in process): record (new, cached) per sequence."""
    calls = []
    forward = KVPool.forward

    def recording(self, seqs, new_tokens, keeps):
        calls.extend((len(t), len(s.tokens)) for s, t in zip(seqs, new_tokens))
        return forward(self, seqs, new_tokens, keeps)

    monkeypatch.setattr(KVPool, "forward", recording)
    return calls


def _record_lean_feeds(monkeypatch):
    """A Llama draft runs on `LeanSequence`, not through the HF forward: record its feeds instead."""
    calls = []
    feed = LeanSequence.feed_subset

    def recording(self, new_tokens, keep_logits=1):
        calls.append((len(new_tokens), len(self.tokens)))
        return feed(self, new_tokens, keep_logits)

    monkeypatch.setattr(LeanSequence, "feed_subset", recording)
    return calls


def test_target_runs_one_forward_per_round_over_new_positions_only(models, monkeypatch):
    target, draft = models["target"], models["close draft"]
    target_calls = _record_pool_forwards(monkeypatch)
    draft_calls = _record_lean_feeds(monkeypatch)
    decoder = SpeculativeDecoder(target, draft, gamma=4, draft_stop_below=0.0, draft_lookup=False)
    res = decoder.generate(PROMPT, GREEDY, 50)
    stats = res.stats
    assert 0 < stats.acceptance_rate < 1  # rejections happened, so caches were cropped
    # The prompt is prefilled once: all of it but the last token, on an empty cache. The draft's prefill waits for
    # its first block (`Proposer.lazy_prefill`), whose first forward takes the whole prompt.
    assert target_calls[0] == (len(PROMPT) - 1, 0)
    assert draft_calls[0] == (len(PROMPT), 0)
    # Then exactly one target forward per round, over γ+1 new positions, on top of the committed prefix.
    assert len(target_calls) == 1 + stats.rounds
    context = len(PROMPT)
    for (positions, cached), gamma, accepted in zip(target_calls[1:], stats.gamma_history, stats.accepted_history):
        assert (positions, cached) == (gamma + 1, context - 1)
        context += accepted + 1
    assert len(draft_calls) == sum(stats.gamma_history)  # γ draft forwards per round


def test_a_session_that_never_drafts_never_runs_its_prompt_through_the_draft(models, monkeypatch):
    """A model draft's prefill waits for its first block (`Proposer.lazy_prefill`): at γ=0 (what `auto` picks under
    load where the draft does not pay) the draft runs no forward at all; drafting later, it catches up first."""
    target, draft = models["target"], models["close draft"]
    draft_calls = _record_lean_feeds(monkeypatch)
    plain = SpeculativeDecoder(target, draft, gamma=0, draft_lookup=False).generate(PROMPT, GREEDY, 12)
    assert draft_calls == [] and plain.stats.rounds == 12
    drafted = SpeculativeDecoder(target, draft, gamma=2, draft_lookup=False).generate(PROMPT, GREEDY, 12)
    assert drafted.token_ids == plain.token_ids and draft_calls[0] == (len(PROMPT), 0)


def test_a_draft_that_stops_where_unsure_drafts_less_and_changes_no_token(models):
    target, draft = models["target"], models["random draft"]
    plain = SpeculativeDecoder(target, None).generate(PROMPT, GREEDY, 40).token_ids

    def run(stop_below):
        decoder = SpeculativeDecoder(target, draft, gamma=4, draft_stop_below=stop_below, draft_lookup=False)
        return decoder.generate(PROMPT, GREEDY, 40)

    full, always_stop = run(0.0), run(1.01)
    assert full.token_ids == always_stop.token_ids == plain
    assert full.stats.drafted == sum(full.stats.gamma_history)  # every block as long as γ allowed
    # one token a block: never confident enough
    assert always_stop.stats.drafted == sum(min(g, 1) for g in always_stop.stats.gamma_history)


def test_vocab_mismatch_is_a_clear_error(models):
    other = tiny_llama(2, vocab=65, layers=1, hidden=32)
    with pytest.raises(ValueError, match=r"65.*64|64.*65"):
        SpeculativeDecoder(models["target"], other)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(prompt=[]), "prompt"),
        (dict(prompt=[1, 2, 999]), r"prompt.*token ids"),
        (dict(prompt="text"), "tokenizer"),
        (dict(prompt=[1, 2], max_new_tokens=0), "max_new_tokens"),
        (dict(prompt=list(range(60)) * 9), "context"),
    ],
)
def test_bad_generate_input(models, kwargs, message):
    decoder = SpeculativeDecoder(models["target"], "ngram", gamma=2)
    with pytest.raises(ValueError, match=message):
        decoder.generate(**kwargs)


def test_bad_gamma_spec(models):
    for gamma in (-1, "fast", 2.5, True):
        with pytest.raises(ValueError, match="gamma"):
            SpeculativeDecoder(models["target"], "ngram", gamma=gamma)


def test_max_new_tokens_and_eos(models):
    target = models["target"]
    decoder = SpeculativeDecoder(target, models["close draft"], gamma=5, draft_lookup=False)
    res = decoder.generate(PROMPT, GREEDY, 7)
    assert len(res.token_ids) == 7 and res.finish_reason == "length"
    eos = res.token_ids[3]
    decoder.eos_ids = {eos}
    stopped = decoder.generate(PROMPT, SamplingParams(temperature=0.0), 7)
    first = res.token_ids.index(eos)
    assert stopped.token_ids == res.token_ids[: first + 1] and stopped.finish_reason == "stop"


@pytest.mark.parametrize("mode", [dict(temperature=0.0), dict(temperature=0.7, top_k=3, seed=4),
                                  dict(temperature=1.0, top_p=0.8, seed=5)], ids=["greedy", "top-k", "top-p"])
def test_logprobs_are_the_targets_raw_log_probabilities_of_the_emitted_tokens(models, mode):
    target = models["target"]
    dec = SpeculativeDecoder(target, models["close draft"], gamma=3)
    result = dec.generate(PROMPT, SamplingParams(**mode, ignore_eos=True, logprobs=2), 20)
    assert result.stats.accepted > 0 and len(result.logprobs) == len(result.token_ids) == 20
    with torch.inference_mode():  # the target alone over the whole output, raw logits (no temperature, top-k, top-p)
        logits = target(torch.tensor([PROMPT + result.token_ids])).logits[0, len(PROMPT) - 1 : -1]
    reference = torch.log_softmax(logits.double(), -1)
    for i, (token, logprob, top) in enumerate(result.logprobs):
        assert token == result.token_ids[i]
        assert logprob == pytest.approx(reference[i, token].item(), abs=1e-6)
        assert [t for t, _ in top] == reference[i].topk(2).indices.tolist()
        assert [v for _, v in top] == pytest.approx(reference[i].topk(2).values.tolist(), abs=1e-6)
    # asking for them changes nothing else: the same tokens with and without
    plain = dec.generate(PROMPT, SamplingParams(**mode, ignore_eos=True), 20)
    assert plain.token_ids == result.token_ids and plain.logprobs is None
    assert [len(top) for _, _, top in dec.generate(PROMPT, SamplingParams(**mode, logprobs=0), 5).logprobs] == [0] * 5


def test_each_round_reports_how_many_tokens_its_model_draft_fed_before_drafting():
    """What the controller needs to tell a draft step's cost from a catch-up: the context tokens the model draft
    fed before its first drafted token, as the draft's own cache says (1-2 while it drafts every round, one more
    for each token of rounds it skipped), and 0 for rounds it did not draft; the controller is told it as `lag`
    before it chooses."""
    import itertools

    from specserve.engine.loop import speculate
    from specserve.engine.proposers import ModelProposer, TargetVerifier
    from specserve.speculation import FixedGamma, PositionRNG

    target = tiny_llama(0)
    draft = perturbed_copy(target, 0.3)
    vocab = target.config.vocab_size

    class Scripted(FixedGamma):
        def __init__(self, gammas: list[int]):
            super().__init__(max(gammas))
            self.gammas, self.seen, self.lags = list(gammas), [], []

        def choose(self, remaining=None, key=None, available=None, open_ended=False, lag=0) -> int:
            self.lags.append(lag)
            return self.gammas.pop(0) if self.gammas else 0

        def update(self, obs) -> None:
            self.seen.append(obs)

    proposer = ModelProposer(draft, vocab)
    fed, propose = [], proposer.propose

    def counted(context, *args, **kwargs):
        fed.append(len(context) - min(proposer.seq.common_prefix(context), len(context) - 1))
        return propose(context, *args, **kwargs)

    proposer.propose = counted
    script = Scripted([2, 3, 0, 0, 3, 1, 4, 0, 2, 2])
    rounds = speculate([1, 2, 3, 4, 5], proposer, TargetVerifier(target, vocab), script,
                       SamplingParams(temperature=1.0, seed=3, ignore_eos=True), PositionRNG(3), 100, vocab, set())
    list(itertools.islice(rounds, 10))
    assert len(script.seen) == 10
    assert [o.draft_fed for o in script.seen if o.gamma] == fed
    assert [lag for lag, o in zip(script.lags, script.seen) if o.gamma] == fed  # the controller knew it beforehand
    assert [o.draft_fed for o in script.seen if not o.gamma] == [0, 0, 0]
    assert max(fed) > 2  # a catch-up was among them
    assert {o.accepted == o.drafted for o in script.seen if o.gamma} == {True, False}  # blocks kept whole and cut
