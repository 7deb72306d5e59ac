"""speculation/ maths against plain references: distributions, sampling, acceptance, randomness."""

import numpy as np
import pytest
import torch
from scipy import stats

from specserve.engine.proposers import Proposal, TargetVerifier, _rows, judge_many, one_hot_on
from specserve.speculation import (
    PositionRNG,
    Purpose,
    SamplingParams,
    accept_batch,
    accept_greedy,
    accept_prefix,
    probs_from_logits,
    sample_from_probs,
)
from specserve.speculation.sampling import sparse_to_dense, truncate_top_k
from tests.reference import reference_accept, reference_probs

MODES = [
    dict(temperature=0.0),
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=5),
    dict(temperature=1.5, top_p=0.8),
    dict(temperature=0.9, top_k=10, top_p=0.6),
    dict(temperature=1.0, top_p=1e-6),  # only the argmax survives
]


@pytest.mark.parametrize("mode", MODES)
def test_probs_from_logits_matches_reference(mode):
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(3)) * 3
    got = probs_from_logits(logits, SamplingParams(**mode)).numpy()
    for row, lg in zip(got, logits.numpy()):
        want = reference_probs(lg, mode.get("temperature", 1.0), mode.get("top_k", 0), mode.get("top_p", 1.0))
        np.testing.assert_allclose(row, want, atol=1e-6)


def test_top_p_keeps_smallest_set_reaching_mass():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    kept = probs_from_logits(logits, SamplingParams(top_p=0.8)) > 0
    assert kept.tolist() == [[True, True, False, False]]  # 0.5 + 0.3 reaches 0.8
    kept = probs_from_logits(logits, SamplingParams(top_p=0.81)) > 0
    assert kept.tolist() == [[True, True, True, False]]


def test_sample_from_probs_follows_distribution_and_skips_zeros():
    probs = torch.tensor([0.0, 0.2, 0.0, 0.5, 0.3, 0.0])
    rng = PositionRNG(11)
    u = rng.uniforms(0, 20000, Purpose.FINAL)
    ids = sample_from_probs(probs.expand(len(u), -1), u)
    counts = np.bincount(ids.numpy(), minlength=6)
    assert counts[[0, 2, 5]].sum() == 0
    assert stats.chisquare(counts[[1, 3, 4]], 20000 * np.array([0.2, 0.5, 0.3])).pvalue > 1e-3
    edge = sample_from_probs(probs.unsqueeze(0), torch.tensor([1.0 - 2**-53]))
    assert edge.item() == 4  # u·total rounding up to total never selects a zero-probability tail


def test_sparse_q_roundtrip():
    q = torch.softmax(torch.randn(3, 20, generator=torch.Generator().manual_seed(0)), -1)
    ids, probs = truncate_top_k(q, 4)
    dense = sparse_to_dense(ids, probs, 20)
    assert torch.allclose(dense.sum(-1), torch.ones(3))
    assert ((dense > 0).sum(-1) == 4).all()
    assert torch.equal(dense.argmax(-1), q.argmax(-1))


def test_accept_prefix_matches_loop_reference():
    gen = torch.Generator().manual_seed(5)
    rng = PositionRNG(5)
    vocab, outcomes = 7, set()
    for trial in range(400):
        gamma = trial % 5
        q = torch.softmax(torch.randn(gamma, vocab, generator=gen) * 2, -1)
        p = torch.softmax(torch.randn(gamma + 1, vocab, generator=gen) * 2, -1)
        x = sample_from_probs(q, rng.uniforms(trial * 10, gamma, Purpose.DRAFT)) if gamma else torch.zeros(0, dtype=torch.long)
        u_a = rng.uniforms(trial * 10, gamma, Purpose.ACCEPT)
        u_f = rng.uniforms(trial * 10, gamma + 1, Purpose.FINAL)
        verdict = accept_prefix(x, q, p, u_a, u_f)
        want = reference_accept(x.tolist(), q.double().numpy(), p.double().numpy(), u_a.numpy(), u_f.numpy())
        assert (verdict.n_accepted, verdict.next_token) == want
        outcomes.add(verdict.n_accepted)
    assert outcomes == {0, 1, 2, 3, 4}  # every prefix length was exercised


def test_accept_batch_is_accept_prefix_per_row():
    """Blocks of every length 0..γ in one batch, padded: each row's verdict, acceptance probabilities and betas
    are accept_prefix's on that block alone (padding never accepts, never leaks into the draw)."""
    gen = torch.Generator().manual_seed(11)
    rng, vocab, outcomes = PositionRNG(11), 9, set()
    for trial in range(60):
        lengths = [(trial + b) % 6 for b in range(7)]
        blocks, want = [], []
        for b, k in enumerate(lengths):
            draft_logits = torch.randn(k + 1, vocab, generator=gen) * 2
            q = torch.softmax(draft_logits[:k], -1)
            p = torch.softmax(draft_logits + torch.randn(k + 1, vocab, generator=gen) * trial / 60, -1)  # q ≈ p early
            start = trial * 100 + b * 10
            x = sample_from_probs(q, rng.uniforms(start, k, Purpose.DRAFT)) if k else torch.zeros(0, dtype=torch.long)
            u_a, u_f = rng.uniforms(start, k, Purpose.ACCEPT), rng.uniforms(start, k + 1, Purpose.FINAL)
            blocks.append((x, q, p, u_a, u_f))
            want.append(accept_prefix(x, q, p, u_a, u_f))
        def pad(i, value=0.0):
            return torch.nn.utils.rnn.pad_sequence([blk[i] for blk in blocks], batch_first=True, padding_value=value)

        # padding that would pass the test if it were looked at: q of 1 everywhere, uniforms of 0
        got = accept_batch(pad(0), lengths, pad(1, 1.0), pad(2), pad(3), pad(4, 0.5))
        for g, w in zip(got, want):
            assert (g.n_accepted, g.next_token) == (w.n_accepted, w.next_token)
            np.testing.assert_allclose(g.accept_probs, w.accept_probs, rtol=1e-12)
            np.testing.assert_allclose(g.betas, w.betas, rtol=1e-6)
            outcomes.add((len(g.accept_probs), g.n_accepted))
    assert {n for _, n in outcomes} == {0, 1, 2, 3, 4, 5}


@pytest.mark.parametrize("mode", MODES + [dict(temperature=0.8, logprobs=2)])
def test_judge_many_is_judge_per_block(tiny_pair, mode):
    """A step's blocks judged together (mixed lengths, sampled and one-hot drafts, other params beside them)
    get the verdicts, logprobs and cache lengths each gets judged alone."""
    target = tiny_pair[0]
    vocab = target.config.vocab_size
    gen = torch.Generator().manual_seed(7)
    params, other = SamplingParams(**mode, seed=1), SamplingParams(temperature=1.3, top_k=3)
    for trial in range(25):
        specs = []
        for b in range(6):
            k = (trial + b) % 5
            q = torch.softmax(torch.randn(k, vocab, generator=gen) * 3, -1)
            tokens = sample_from_probs(q, torch.rand(k, generator=gen, dtype=torch.float64)).tolist() if k else []
            one_hot = torch.nn.functional.one_hot(torch.tensor(tokens, dtype=torch.long), vocab).float()
            dist = (vocab, one_hot, q)[b % 3]  # a lookup's implicit one-hot, a greedy draft's, a sampled q
            logits = torch.randn(k + 1, vocab + 3, generator=gen) * 2  # a head wider than the vocabulary
            specs.append((3 + b, tokens, dist, logits, other if b == 5 else params, PositionRNG(trial * 10 + b)))
        context = [1, 2, 3, 4, 5, 6, 7, 1, 2]

        def blocks():
            out = []
            for start, tokens, dist, logits, p, rng in specs:
                verifier = TargetVerifier(target, vocab)
                verifier.seq.logits_after(context[:start] + tokens)
                out.append((verifier, logits, start, Proposal(tokens, dist), p, rng))
            return out

        alone = [b[0].judge(*b[1:]) for b in blocks()]
        batch = blocks()
        together = judge_many(batch)
        for a, t, b in zip(alone, together, batch):
            assert (t.n_accepted, t.next_token, t.logprobs) == (a.n_accepted, a.next_token, a.logprobs)
            np.testing.assert_allclose(t.accept_probs, a.accept_probs, rtol=1e-6)
            assert len(b[0].seq.tokens) == b[2] + t.n_accepted


def test_greedy_blocks_of_one_step_are_judged_in_place(tiny_pair):
    """The scheduler hands a step's blocks consecutive rows of one logits tensor (a head wider than the
    vocabulary): greedy blocks are judged from a view of it, not a copy, and tied maxima (and a NaN) go to the
    first index as argmax sends them; blocks out of order are copied, with the same verdicts."""
    target = tiny_pair[0]
    vocab = target.config.vocab_size
    gen = torch.Generator().manual_seed(3)
    lengths = [1, 3, 2, 1, 4]
    step = torch.randn(sum(lengths), vocab + 5, generator=gen)
    step[:, vocab:] = 100.0  # beyond the vocabulary: never chosen
    step[1, [7, 2, 9]] = 50.0  # a tie: the first index wins
    step[4, 5] = float("nan")  # NaN counts as the maximum
    firsts = [int(np.argmax(np.where(np.isnan(r), np.inf, r))) for r in step[:, :vocab].numpy()]
    assert firsts[1] == 2 and firsts[4] == 5
    rows, at = [], 0
    for n in lengths:
        rows.append(step[at : at + n])
        at += n
    view = _rows(rows, [vocab] * len(rows))
    assert view.data_ptr() == step.data_ptr() and view.shape == (sum(lengths), vocab)
    copied = _rows(rows[::-1], [vocab] * len(rows))
    assert copied.data_ptr() != step.data_ptr()
    torch.testing.assert_close(copied, torch.cat([r[:, :vocab] for r in rows[::-1]]), rtol=0, atol=0, equal_nan=True)
    context = [1, 2, 3, 4, 5, 6]
    params = SamplingParams(temperature=0.0, seed=1)
    for order in (list(range(len(rows))), list(range(len(rows)))[::-1]):
        blocks, expected, at = [], {}, 0
        for i, n in enumerate(lengths):
            want = firsts[at : at + n]
            tokens = want[:-1] if i % 2 == 0 else [(t + 1) % vocab for t in want[:-1]]  # all kept, or none
            expected[i] = (len(tokens) if i % 2 == 0 else 0, want[len(tokens) if i % 2 == 0 else 0])
            at += n
            verifier = TargetVerifier(target, vocab)
            verifier.seq.logits_after(context + tokens)
            blocks.append((i, (verifier, rows[i], len(context), Proposal(tokens, vocab), params, PositionRNG(i))))
        chosen = [blocks[i] for i in order]
        for (i, _), verdict in zip(chosen, judge_many([b for _, b in chosen])):
            assert (verdict.n_accepted, verdict.next_token) == expected[i]


def test_greedy_accept_is_argmax_equality():
    p = torch.nn.functional.one_hot(torch.tensor([3, 1, 4, 2]), 6).float()
    q = torch.nn.functional.one_hot(torch.tensor([3, 1, 0]), 6).float()
    zeros = torch.zeros(4, dtype=torch.float64)
    verdict = accept_prefix(torch.tensor([3, 1, 0]), q, p, zeros[:3], zeros)
    assert (verdict.n_accepted, verdict.next_token) == (2, 4)


def test_accept_greedy_is_accept_prefix_at_temperature_zero():
    """Same verdict, acceptance probabilities and betas as the vocabulary-wide path, ties in the logits included."""
    gen = torch.Generator().manual_seed(3)
    rng, greedy, lengths = PositionRNG(3), SamplingParams(temperature=0), set()
    for trial in range(300):
        gamma, vocab = trial % 6, 5
        logits = torch.randint(0, 3, (gamma + 1, vocab), generator=gen).float()  # many ties: argmax takes the first
        p = probs_from_logits(logits, greedy)
        draft = torch.randint(0, vocab, (gamma,), generator=gen)
        hit = torch.rand(gamma, generator=gen) < 0.7  # mostly the target's argmax, so long prefixes occur
        draft = torch.where(hit, logits[:gamma].argmax(-1), draft)
        q = torch.nn.functional.one_hot(draft, vocab).float()
        want = accept_prefix(draft, q, p, rng.uniforms(trial, gamma, Purpose.ACCEPT),
                             rng.uniforms(trial, gamma + 1, Purpose.FINAL))
        got = accept_greedy(draft.tolist(), logits.argmax(-1).tolist())
        assert (got.n_accepted, got.next_token, got.accept_probs, got.betas) == (
            want.n_accepted, want.next_token, want.accept_probs, want.betas)
        lengths.add(got.n_accepted)
    assert lengths == {0, 1, 2, 3, 4, 5}


def test_verifier_takes_the_greedy_path_only_for_one_hot_drafts(tiny_pair, monkeypatch):
    target = tiny_pair[0]
    vocab = target.config.vocab_size
    tokens = torch.tensor([5, 6, 2])
    one_hot = torch.nn.functional.one_hot(tokens, vocab).float()
    assert one_hot_on(one_hot, tokens) and one_hot_on(torch.zeros(0, vocab), tokens[:0])
    smooth = 0.5 * one_hot + 0.5 / vocab
    assert not one_hot_on(smooth, tokens) and not one_hot_on(one_hot, torch.tensor([5, 6, 3]))
    calls = []
    monkeypatch.setattr("specserve.engine.proposers.accept_batch",
                        lambda *a: calls.append("prefix") or accept_batch(*a))
    monkeypatch.setattr("specserve.engine.proposers.accept_greedy",
                        lambda *a: calls.append("greedy") or accept_greedy(*a))
    context, greedy = [1, 4, 7, 3], SamplingParams(temperature=0)
    verdicts = []
    for q in (one_hot, smooth):  # the same target argmaxes decide both at T=0
        verifier = TargetVerifier(target, vocab)
        verdicts.append(verifier.verify(context, Proposal(tokens.tolist(), q), greedy, PositionRNG(0)))
        assert len(verifier.seq.tokens) == len(context) + verdicts[-1].n_accepted  # rejected positions dropped
    assert calls == ["greedy", "prefix"]
    assert (verdicts[0].n_accepted, verdicts[0].next_token) == (verdicts[1].n_accepted, verdicts[1].next_token)


def test_position_rng_is_keyed_not_streamed():
    a, b = PositionRNG(42), PositionRNG(42)
    forward = [a.uniform(i, Purpose.ACCEPT) for i in range(50)]
    backward = [b.uniform(i, Purpose.ACCEPT) for i in reversed(range(50))][::-1]
    assert forward == backward
    assert a.uniform(7, Purpose.DRAFT) != a.uniform(7, Purpose.ACCEPT) != a.uniform(7, Purpose.FINAL)
    assert PositionRNG(43).uniform(7, Purpose.DRAFT) != a.uniform(7, Purpose.DRAFT)
    u = PositionRNG(0).uniforms(0, 50000, Purpose.DRAFT).numpy()
    assert stats.kstest(u, "uniform").pvalue > 1e-3
    assert 0.0 <= u.min() and u.max() < 1.0


def test_sampling_params_errors_name_the_field():
    from pydantic import ValidationError

    for field, value in [("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1), ("seed", -3)]:
        with pytest.raises(ValidationError, match=field):
            SamplingParams(**{field: value})
    assert SamplingParams(stop="END").stop == ["END"]


@pytest.mark.parametrize("temperature", [1e-45, 1e-39, 1e-20, 9e-6])
def test_a_tiny_temperature_samples_greedily(temperature):
    """logits / 1e-40 overflowed to inf and NaN (served: invalid tokens, HTTP 500). Below 1e-5 a temperature is
    greedy, as in vLLM: the same one-hot as temperature 0, and a valid token."""
    from specserve.speculation import SamplingParams as Params
    from specserve.speculation.sampling import probs_from_logits

    logits = torch.tensor([[0.5, 2.0, 1.999, -3.0]])
    params = Params(temperature=temperature)
    assert params.greedy
    assert torch.equal(probs_from_logits(logits, params), probs_from_logits(logits, Params(temperature=0.0)))
    assert not Params(temperature=1e-4).greedy


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), -1.0])
def test_a_temperature_that_is_not_a_number_names_the_field(temperature):
    from pydantic import ValidationError

    from specserve.speculation import SamplingParams as Params

    with pytest.raises(ValidationError, match="temperature"):
        Params(temperature=temperature)
