"""γ controllers: the rules they promise, on synthetic observations."""

import copy

import pytest

from specserve.speculation import AutoGamma, FixedGamma, HeuristicGamma, RoundObservation, expected_tokens_per_round
from specserve.speculation.controllers import make_controller, theorem8_speedup
from specserve.models import propose_ngram

FLAT = {n: 0.040 for n in range(1, 10)}  # verify cost independent of γ
STEEP = {n: 0.040 * (1 + 0.5 * (n - 1)) for n in range(1, 10)}  # CPU fp32-like growth
MID = {n: 0.040 * (1 + 0.1 * (n - 1)) for n in range(1, 10)}  # CPU bf16-like growth


def feed(controller, acceptance: float, rounds: int = 60):
    for _ in range(rounds):
        g = controller.choose()
        controller.update(RoundObservation(g, g, 0, [acceptance] * g, 0.001 * g, FLAT[g + 1], 0.001 * g + FLAT[g + 1]))
    return controller.choose()


def test_expected_tokens_formula():
    assert expected_tokens_per_round(0.0, 5) == 1.0
    assert expected_tokens_per_round(1.0, 4) == 5.0
    assert expected_tokens_per_round(0.8, 5) == pytest.approx(sum(0.8**i for i in range(6)))
    assert theorem8_speedup(0.8, 5, 0.0) == pytest.approx(3.69, abs=0.01)  # Leviathan Table 1


def test_fixed_and_cap():
    assert FixedGamma(4).choose() == 4
    assert FixedGamma(4).choose(remaining=3) == 2  # never draft past the last wanted token
    assert FixedGamma(4).choose(remaining=1) == 0


def test_heuristic_rule():
    h = HeuristicGamma(initial=5, gamma_max=16)
    h.update(RoundObservation(5, 5, 5))
    assert h.choose() == 7
    h.update(RoundObservation(7, 7, 3))
    assert h.choose() == 6
    for _ in range(10):
        h.update(RoundObservation(h.gamma, h.gamma, 0))
    assert h.choose() == 1


def test_auto_speculates_deep_with_cheap_draft_and_high_acceptance():
    auto = AutoGamma(gamma_max=8, verify_profile=FLAT, draft_step_s=0.001)
    assert feed(auto, 0.9) >= 6


def test_auto_turns_speculation_off_when_it_does_not_pay():
    auto = AutoGamma(gamma_max=8, verify_profile=STEEP, draft_step_s=0.030)
    assert feed(auto, 0.05) == 0


def test_auto_prefers_shallow_when_verify_grows_with_gamma():
    flat = feed(AutoGamma(gamma_max=8, verify_profile=FLAT, draft_step_s=0.002), 0.7)
    steep = feed(AutoGamma(gamma_max=8, verify_profile=dict(STEEP), draft_step_s=0.002), 0.7)
    assert 1 <= steep < flat


def test_auto_probes_while_off():
    """At γ=0 auto drafts one token every probe_every rounds to keep its acceptance estimate alive, where a
    better draft could pay; where even a draft accepted every time could not (its steps cost too much against
    the target's), it never drafts."""
    auto = AutoGamma(gamma_max=8, verify_profile=FLAT, draft_step_s=0.030, probe_every=4)  # α=1 would pay
    chosen = [auto.choose() for _ in range(12)]
    assert chosen.count(1) == 3 and set(chosen) == {0, 1}
    hopeless = AutoGamma(gamma_max=8, verify_profile=STEEP, draft_step_s=0.030, probe_every=4)
    assert [hopeless.choose(open_ended=True) for _ in range(64)] == [0] * 64


def test_a_draft_s_catch_up_does_not_teach_auto_the_cost_of_a_draft_step():
    """A round after rounds the model draft did not run drafts only once the draft has fed every token since (on
    a GPU an eager multi-token forward: ~13 ms for the 135M-shape draft, against 1.8 ms for a captured step).
    Taken for the cost of its one drafted token, a few such probes priced the draft out for good (no draft could
    pay at that cost, so auto stopped probing) where γ=3 ran 1.54x faster than γ=0 (H100, docs/benchmarks-log.md).
    Rounds whose draft fed more than its usual 1-2 tokens do not teach that cost."""
    verify = {n: 0.0070 for n in range(1, 10)}

    def run(reports_catch_up: bool) -> tuple[AutoGamma, list[int]]:
        auto = AutoGamma(gamma_max=8, verify_profile=verify, draft_step_s=0.0018, prior_acceptance=0.2,
                         probe_every=4)
        fed, chosen = 1, []
        for _ in range(120):
            g = auto.choose()
            chosen.append(g)
            draft_s = g * 0.0018 + (0.013 if g and fed > 2 else 0.0)
            auto.update(RoundObservation(g, g, g, [0.8] * g, draft_s, 0.007, draft_s + 0.007,
                                         draft_fed=fed if reports_catch_up else 0))
            fed = 2 if g else fed + 1  # every token accepted: the last drafted one and the bonus to feed
        return auto, chosen

    auto, chosen = run(True)
    assert auto.draft_step_s == pytest.approx(0.0018)
    assert min(chosen[-40:]) >= 2
    misled, chosen = run(False)  # as before rounds reported their draft's catch-up: priced out, probes alone
    assert misled.draft_step_s > 0.005 and set(chosen[-100:]) <= {0, 1} and chosen[-100:].count(1) <= 10


def test_one_held_up_draft_step_does_not_price_the_draft_out_and_a_slowdown_passes():
    """One draft step held up 40 ms (a thread descheduled on a shared machine) moved the draft's cost estimate
    from 0.5 to 6.4 ms: then no draft could pay, auto stopped probing, and it never drafted again in that process
    (warm starts hand the estimate on). A round now moves the estimate at most to DRAFT_OUTLIER times its value;
    and a slowdown long enough to price the draft out passes: rounds that give no draft cost bring the estimate
    back toward the profile, until auto drafts again."""
    verify = {1: 0.0050, 2: 0.0054, 3: 0.0059, 4: 0.0067, 5: 0.0074}
    auto = AutoGamma(gamma_max=4, verify_profile=verify, draft_step_s=0.0005, prior_acceptance=0.6)
    auto.update(RoundObservation(1, 1, 1, [1.0], 0.040, 0.0054, 0.046, draft_fed=1))
    assert auto.draft_step_s < 0.001 and all(auto.choose() > 0 for _ in range(50))

    for _ in range(30):  # the draft really slow for a while (20 ms a token): auto follows it and stops
        g = max(1, auto.choose())
        auto.update(RoundObservation(g, g, g, [0.6] * g, 0.020 * g, verify[g + 1], 0.020 * g + verify[g + 1],
                                     draft_fed=1))
    assert auto.draft_step_s > 0.010 and auto.choose() == 0
    chosen = []
    for _ in range(400):  # the slowdown over: rounds at γ=0 (nothing drafted) until auto drafts again
        g = auto.choose()
        chosen.append(g)
        auto.update(RoundObservation(g, g, 0, [], 0.0, verify[g + 1], verify[g + 1]))
    assert chosen[0] == 0 and any(chosen)
    assert auto.draft_step_s < 0.005

    slow = AutoGamma(gamma_max=4, verify_profile=verify, draft_step_s=0.030)  # slow in its profile too: stays out
    for _ in range(400):
        slow.update(RoundObservation(0, 0, 0, [], 0.0, verify[1], verify[1]))
    assert slow.draft_step_s == pytest.approx(0.030) and slow.choose(open_ended=True) == 0


def test_make_controller_specs():
    assert make_controller(3).name == "fixed:3"
    assert make_controller("fixed:2").name == "fixed:2"
    assert make_controller("auto").name == "auto"
    assert make_controller("heuristic").name == "heuristic"
    with pytest.raises(ValueError, match="gamma"):
        make_controller("sometimes")


def test_ngram_proposals():
    ctx = [5, 6, 7, 8, 9, 1, 5, 6, 7]
    assert propose_ngram(ctx, 3) == [8, 9, 1]  # 3-gram match
    assert propose_ngram([1, 2, 3, 4, 2], 2) == [3, 4]  # falls back to a 1-gram
    assert propose_ngram([1, 2, 3], 4) == []
    assert propose_ngram([4, 4, 4, 4], 5) == [4]  # continuation stops at the context end


def test_auto_keeps_acceptance_per_proposal_key():
    auto = AutoGamma(gamma_max=8, verify_profile=MID, draft_step_s=0.0)
    for _ in range(40):
        for key, beta in (("ngram-3", 0.95), ("ngram-1", 0.05)):
            g = auto.choose(key=key, available=8) or 1
            auto.update(RoundObservation(g, g, 0, [beta] * g, 0.0, MID[g + 1], MID[g + 1], key))
    assert auto.choose(key="ngram-3", available=8) >= 4
    assert auto.choose(key="ngram-1", available=8) == 0
    assert auto.choose(key="ngram-3", available=2) == 2  # never deeper than the proposal


def test_auto_warm_start_carries_learning():
    first = AutoGamma(gamma_max=8, verify_profile=FLAT, draft_step_s=0.001)
    feed(first, 0.95)
    fresh, warm = AutoGamma(gamma_max=8, verify_profile=FLAT), AutoGamma(gamma_max=8, verify_profile=FLAT)
    warm.warm_start(first)
    assert warm.expected_tokens(6) > fresh.expected_tokens(6) + 1


def calibrated(acceptance_by_confidence, rounds: int = 80, verify=MID, step: float = 0.002) -> AutoGamma:
    """An AutoGamma that has seen drafted tokens accepted at the given rate in each confidence bin."""
    auto = AutoGamma(gamma_max=8, verify_profile=verify, draft_step_s=step)
    for _ in range(rounds):
        for confidence, beta in acceptance_by_confidence.items():
            auto.update(RoundObservation(1, 1, 0, [beta], step, verify[2], step + verify[2], None, [confidence]))
    return auto


def test_open_ended_drafting_goes_on_while_the_draft_is_sure_and_stops_where_it_is_not():
    auto = calibrated({0.95: 0.95, 0.15: 0.05, 0.55: 0.5})
    assert auto.choose(open_ended=True) == 8 and auto.choose(remaining=4, open_ended=True) == 3  # γ is a ceiling
    assert auto.keep_drafting([0.95, 0.95, 0.95])
    assert not auto.keep_drafting([0.95, 0.15])  # the block is very likely rejected here: more is waste
    assert not auto.keep_drafting([0.95] * 8)  # never past γ_max
    # what goes to the target: the confident prefix, not the unsure tail the draft already paid for
    assert auto.worth_verifying([0.95, 0.95, 0.15, 0.95]) == 2
    assert auto.worth_verifying([0.15]) == 0
    assert auto.worth_verifying([0.95, 0.55]) == 2


def test_open_ended_drafting_is_shorter_when_each_verified_position_costs_more():
    confidences = [0.95, 0.75, 0.75, 0.75, 0.75]
    cheap = calibrated({0.95: 0.9, 0.75: 0.7}, verify=FLAT)
    dear = calibrated({0.95: 0.9, 0.75: 0.7}, verify=STEEP)
    assert dear.worth_verifying(confidences) < cheap.worth_verifying(confidences) == 5


def test_open_ended_speculation_is_not_started_when_even_a_sure_token_would_not_pay():
    auto = calibrated({c / 10 + 0.05: 0.02 for c in range(10)}, verify=STEEP, step=0.030)
    assert auto.choose(open_ended=True) == 0


def _starting(sure_every: int, blocks: int = 60) -> AutoGamma:
    """An AutoGamma alone whose draft was sure of its block's first token (0.95, accepted 0.95 of the time) in one
    block of every `sure_every`, unsure (0.15, accepted 0.05 of the time) in the others."""
    auto = AutoGamma(gamma_max=8, verify_profile=MID, draft_step_s=0.004)
    for i in range(blocks):
        confidence, beta = (0.95, 0.95) if i % sure_every == 0 else (0.15, 0.05)
        auto.update(RoundObservation(1, 1, int(beta > 0.5), [beta], 0.004, MID[2], 0.004 + MID[2], None, [confidence]))
    return auto


def test_open_ended_drafting_starts_where_the_draft_is_often_sure_of_its_first_token_not_just_sometimes():
    """A block whose first token is unsure is dropped with its draft step paid: a draft seldom sure at its start
    costs more in those steps than its sure blocks return (auto once started every block where a sure first token
    would pay, and ran below γ=0 on prompts the draft could not follow)."""
    seldom, often = _starting(20), _starting(2)
    assert seldom.choose(open_ended=True) == 0 and often.choose(open_ended=True) == 8
    assert max(seldom.calibration().acceptance) == max(often.calibration().acceptance)  # the same sure bin
    few = _starting(20, blocks=AutoGamma.FIRST_BLOCKS - 1)  # until then: as if sure, as before
    assert few.choose(open_ended=True) == 8


def test_fixed_gamma_ignores_the_draft_s_confidence():
    fixed = FixedGamma(3)
    assert fixed.choose(open_ended=True) == 3
    assert fixed.keep_drafting([0.01, 0.01]) and fixed.worth_verifying([0.01, 0.01, 0.01]) == 3


def test_auto_weighs_a_shared_step_for_everyone_and_stops_speculating_under_load():
    """Alone, an extra verify position costs 5% of a step, so speculating at α=0.25 pays. In a step shared by
    32 sessions the same position slows all of them: only a draft that is usually right is worth it."""
    from specserve.speculation import AutoGamma, RoundObservation

    profile = {n: 0.040 + 0.002 * (n - 1) for n in range(1, 10)}
    for alpha, pays_under_load in ((0.25, False), (0.95, True)):
        auto = AutoGamma(8, profile, 0.0)
        for _ in range(40):
            auto.update(RoundObservation(1, 1, int(alpha > 0.5), [alpha], 0.0, 0.042, 0.042, key="k",
                                         step_tokens=2, step_sessions=1, step_time_s=0.042))
        assert not auto.loaded and auto.choose(100, key="k", available=8) >= 1
        for _ in range(40):  # 32 sessions, 2 positions each: a 64-token step of 0.16 s
            auto.update(RoundObservation(1, 1, int(alpha > 0.5), [alpha], 0.0, 0.2, 0.2, key="k",
                                         step_tokens=64, step_sessions=32, step_time_s=0.16))
        assert auto.loaded and auto.load_sessions > 30
        assert (auto.choose(100, key="k", available=8) >= 1) == pays_under_load, alpha


def test_auto_probes_less_often_per_shared_step_than_alone():
    """At γ=0 auto drafts one token now and then to keep its acceptance estimate alive. In a step shared by
    S sessions each probe (and the draft's catch-up before it) delays all of them: each session probes S²
    times less often, so the shared step sees S times fewer probes than a session alone."""
    from specserve.speculation import AutoGamma, RoundObservation

    profile = {n: 0.040 + 0.002 * (n - 1) for n in range(1, 10)}

    def probes(sessions: int, rounds: int) -> int:
        auto = AutoGamma(8, profile, 0.0)
        for _ in range(40):  # a useless draft: speculation never pays
            auto.update(RoundObservation(1, 1, 0, [0.0], 0.0, 0.042, 0.042, key="k", step_tokens=2 * sessions,
                                         step_sessions=sessions, step_time_s=0.04 * sessions ** 0.5))
        return sum(auto.choose(100, key="k") for _ in range(rounds))

    assert probes(1, 512) == 512 // 16 and probes(4, 1024) == 1024 // 256 and probes(16, 8192) == 2


def _loaded_auto(alpha: float, sessions: int) -> AutoGamma:
    profile = {n: 0.040 + 0.002 * (n - 1) for n in range(1, 10)}
    auto = AutoGamma(8, profile, 0.004)
    for _ in range(40):
        auto.update(RoundObservation(1, 1, int(alpha > 0.5), [alpha], 0.004, 0.05, 0.054, key="k",
                                     step_tokens=2 * sessions, step_sessions=sessions,
                                     step_time_s=0.040 + 0.004 * sessions))
    return auto


def test_under_load_a_marginal_gain_does_not_start_speculation(monkeypatch):
    """Shared steps: a round speculates only where its extra tokens come LOADED_MARGIN faster than the step's own
    tokens per second (what the cost model leaves out costs every session of the step); alone, any gain does."""

    def efficiency(auto: AutoGamma, g: int) -> float:  # extra tokens per extra second, over the step's own rate
        base_tokens, base_s = 1.0 + auto.others_tokens(), auto.round_time(0)
        extra = auto.expected_tokens(g, "k") + auto.others_tokens() - base_tokens
        return extra / (auto.round_time(g) - base_s) / (base_tokens / base_s)

    marginal = []
    for alpha in [a / 100 for a in range(5, 100, 5)]:
        auto = _loaded_auto(alpha, 4)
        if 1.0 < max(efficiency(auto, g) for g in range(1, 9)) < 1.0 + AutoGamma.LOADED_MARGIN:
            marginal.append(alpha)
            assert auto.loaded and auto.choose(100, key="k", available=8) == 0, alpha
            monkeypatch.setattr(AutoGamma, "LOADED_MARGIN", 0.0)
            assert _loaded_auto(alpha, 4).choose(100, key="k", available=8) >= 1, alpha
            monkeypatch.undo()
    assert marginal, "no acceptance in the sweep gives a marginal gain: the test checks nothing"
    clear = _loaded_auto(0.95, 4)
    assert max(efficiency(clear, g) for g in range(1, 9)) > 1.0 + AutoGamma.LOADED_MARGIN
    assert clear.choose(100, key="k", available=8) >= 1  # a gain well above the margin still speculates


def test_under_load_a_draft_that_must_first_catch_up_is_not_started():
    """A draft that skipped rounds feeds their tokens before its first drafted one. Under load that catch-up holds
    back the step every session shares, so it is priced (a draft step a token): a draft that pays while it drafts
    every round is not started 40 tokens behind. Alone, the rounds after it share the cost: lag does not count."""
    for open_ended in (False, True):
        loaded = _loaded_auto(0.95, 4)
        assert loaded.loaded and loaded.choose(100, key="k", open_ended=open_ended, lag=1) >= 1
        assert loaded.choose(100, key="k", open_ended=open_ended, lag=2) >= 1
        assert loaded.choose(100, key="k", open_ended=open_ended, lag=40) == 0
        alone = _loaded_auto(0.95, 1)
        assert not alone.loaded and alone.choose(100, key="k", open_ended=open_ended, lag=40) >= 1


def test_under_load_a_verify_position_costs_what_the_observed_steps_say_not_the_two_core_calibration(monkeypatch):
    """Steps that run side by side on one core each take ~2x the calibration (two cores, one session): a verified
    position costs that much more too. The slope auto prices a position at under load follows the observed steps'
    time over the calibration's for as many tokens, so a draft that pays only at the calibration's slope is not
    started."""
    from specserve.speculation.controllers import _StepCost

    profile = {n: 0.040 + 0.010 * (n - 1) for n in range(1, 10)}  # 10 ms a position on two cores

    def loaded(step_s: float) -> AutoGamma:
        auto = AutoGamma(8, profile, 0.008)
        for _ in range(40):  # 8 sessions of one position each
            auto.update(RoundObservation(0, 0, 0, [], 0.0, step_s, step_s, key="k", step_tokens=8,
                                         step_sessions=8, step_time_s=step_s))
        for _ in range(40):
            auto.table("k").update([0.9], 0.15)
        return auto

    as_calibrated = loaded(profile[8])
    assert as_calibrated.loaded and as_calibrated.step_cost.slope() == pytest.approx(0.010, rel=0.05)
    side_by_side = loaded(0.252)  # 2.3x the calibration's 0.110 s for 8 positions
    assert side_by_side.step_cost.slope() == pytest.approx(0.010 * 0.252 / profile[8], rel=0.05)
    assert side_by_side.choose(100, key="k", lag=1) == 0
    monkeypatch.setattr(_StepCost, "rescale", lambda self, ratio: None)
    assert loaded(0.252).choose(100, key="k", lag=1) >= 1, "the test cannot tell the calibration's slope apart"


def test_load_is_followed_at_once_when_it_arrives_and_gradually_when_it_leaves():
    auto = _loaded_auto(0.5, 1)
    assert not auto.loaded
    auto.update(RoundObservation(1, 1, 0, [0.5], 0.004, 0.05, 0.054, key="k", step_tokens=16, step_sessions=8,
                                 step_time_s=0.08))
    assert auto.loaded and auto.load_sessions == 8 and auto.load_tokens == 16
    auto.update(RoundObservation(1, 1, 0, [0.5], 0.004, 0.05, 0.054, key="k", step_tokens=2, step_sessions=1,
                                 step_time_s=0.044))
    assert 1 < auto.load_sessions < 8 and auto.loaded


def test_a_session_starting_beside_others_takes_them_as_its_load_before_its_first_step():
    """A new session warm-starts from the last one, which may have run alone; the worker tells it how many
    sessions are open, so its first round does not draft deep into a shared step."""
    alone = _loaded_auto(0.5, 1)
    new = AutoGamma(8, {n: 0.040 + 0.002 * (n - 1) for n in range(1, 10)}, 0.004)
    new.warm_start(alone)
    assert not new.loaded
    new.expect_load(1)
    assert not new.loaded
    new.expect_load(4)
    assert new.loaded and new.load_sessions == 4 and new.others_tokens() > 2
    assert AutoGamma(8, None, 0.004).expect_load(4) is None  # nothing learned about steps yet: nothing to scale


def test_under_load_open_ended_drafting_starts_on_the_average_first_token_not_the_best_bin(monkeypatch):
    """Alone, a model draft starts a block if a confident first token would pay (it stops early otherwise).
    In a shared step the start itself holds every session back: it must pay at the first position's average
    acceptance (here 0.3, while the draft's most confident bin is accepted 0.95 of the time)."""
    alone, loaded = _loaded_auto(0.3, 1), _loaded_auto(0.3, 4)
    assert loaded.choose(100, key="k") == 0  # under load no fixed depth pays at α=0.3
    assert max(loaded.calibration("k").acceptance) == 0.95
    assert alone.choose(100, key="k", open_ended=True) == 8
    assert loaded.choose(100, key="k", open_ended=True) == 0
    monkeypatch.setattr(loaded.table("k"), "at", lambda i: 0.95)  # a first position that is usually right
    assert loaded.choose(100, key="k", open_ended=True) == 8


def test_warm_starts_hand_each_new_auto_what_the_last_learned():
    from specserve.speculation import WarmStarts

    starts = WarmStarts()
    first = starts(AutoGamma(8, FLAT, 0.001))
    feed(first, 0.9)
    second = starts(AutoGamma(8, FLAT, 0.001))
    assert second.table().at(1) == pytest.approx(first.table().at(1)) and second.table().at(1) > 0.8
    fixed = FixedGamma(3)
    assert starts(fixed) is fixed
    assert starts(AutoGamma(8, FLAT, 0.001)).table().at(1) == pytest.approx(second.table().at(1))


def test_a_served_gamma_is_no_deeper_than_gamma_max():
    """A request's fixed γ beyond the server's gamma_max is refused (gamma=5000 made 202-position verifies that
    slowed every session sharing the steps); auto, heuristic and γ up to gamma_max pass, and so does a server
    whose default is deeper only when its gamma_max allows it."""
    from specserve.serve.config import AppConfig
    from specserve.speculation import parse_gamma

    assert parse_gamma(8, 8) == 8 and parse_gamma("auto", 8) == "auto" and parse_gamma(" Heuristic ", 8) == "heuristic"
    assert parse_gamma("3", 8) == 3 and parse_gamma("fixed:2", 8) == 2 and parse_gamma(5000) == 5000
    for bad in (9, "5000", "fixed:12"):
        with pytest.raises(ValueError, match=r"gamma_max \(8\)"):
            parse_gamma(bad, 8)
    for bad in (-1, True, 2.0, "", "fast", "-3", None):
        with pytest.raises(ValueError, match="must be an int >= 0, 'auto' or 'heuristic'"):
            parse_gamma(bad)
    with pytest.raises(ValueError, match="gamma_max"):
        AppConfig(gamma=12)
    assert AppConfig(gamma=12, gamma_max=16).gamma == 12 and AppConfig(gamma="4").gamma == 4


def test_under_load_others_prompts_in_a_shared_step_do_not_make_drafting_look_cheap():
    """A step that also carried other sessions' prompt chunks (the worker reports their tokens and sessions) is
    a transient: their sessions count at this session's block size and the step's cost is not fitted. Before, a
    session whose step took in 8 newly arrived sessions' prompts took the load for ~1,000 tokens a step, found a
    drafted token nearly free beside it, and drafted under load where it does not pay (served auto with a feature
    head on a 2-core CPU: 0.80x γ=0 at 16 streams)."""
    profile = {n: 0.040 + 0.010 * (n - 1) for n in range(1, 10)}  # a CPU: each position costs a quarter step
    step = lambda tokens: 0.040 + 0.0006 * tokens  # noqa: E731 - the worker's step: a + b·tokens
    auto = AutoGamma(8, profile, 0.012)
    for _ in range(40):  # 8 sessions decoding, one token each a step; α=0.7 known from earlier rounds
        auto.update(RoundObservation(1, 1, 1, [0.7], 0.012, step(9), step(9) + 0.013, key="k", step_tokens=9,
                                     step_sessions=8, step_time_s=step(9)))
    assert auto.loaded and auto.choose(100, key="k", open_ended=True) == 0  # under load, at these costs: no
    tokens = 8 + 8 * 128  # 8 more sessions arrive: their prompts share this session's step
    cost = copy.deepcopy(auto.step_cost)
    auto.update(RoundObservation(0, 0, 0, [], 0.0, step(tokens), step(tokens) + 0.001, key="k", step_tokens=tokens,
                                 step_sessions=16, step_time_s=step(tokens), step_prompt_tokens=8 * 128,
                                 step_prompt_sessions=8))
    assert auto.load_sessions == 16 and auto.others_tokens() > 15  # the load is followed at once
    assert auto.load_tokens < 2 * 16 and vars(auto.step_cost) == vars(cost)  # not the prompts' tokens or cost
    small = copy.deepcopy(auto)  # a short prompt's last chunk: fewer tokens than the blocks could hold, a prompt
    small.update(RoundObservation(0, 0, 0, [], 0.0, step(24), step(24) + 0.001, key="k", step_tokens=24,
                                  step_sessions=16, step_time_s=step(24), step_prompt_tokens=9, step_prompt_sessions=1))
    assert vars(small.step_cost) == vars(cost) and small.load_tokens < auto.load_tokens + 1
    assert auto.choose(100, key="k", open_ended=True) == 0 and auto.choose(100, key="k") == 0  # not the prompts
