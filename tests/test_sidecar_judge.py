"""The judge as a statistical procedure, on simulated evidence (no servers).

The streams are `benchmarks/judge_sim.py`'s: request classes, paired latencies with common contention and
per-side jitter, mismatches (independent, clustered, tied to a class), errors on either side, A/A replays;
the judge is asked once a simulated second, as the sidecar asks it. The full figures (1,000 seeds per
scenario) come from that script; here fewer seeds bound the same error rates loosely, so a regression in the
judge shows up in CI.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from benchmarks.judge_sim import SCENARIOS, Scenario, run_one
from sidecar.canary_record import Canary
from sidecar.config import CanaryParams
from sidecar.judge import (
    BLOCK,
    CONTINUE,
    INCONCLUSIVE,
    PIN,
    PROMOTE,
    Evidence,
    Judgement,
    JudgeParams,
    design_effect,
    disagree,
    judge,
    wants_placement,
)
from sidecar.state import MAX_LATENCY_PAIRS, EvidenceCounter
from tunegate.stats import (
    difference_lower,
    difference_upper,
    rate_bounds,
    rate_lower,
    rate_upper,
    samples_to_show_below,
)
from tunegate.tolerance import ToleranceSpec

PARAMS = JudgeParams()  # hand-made evidence: the pairs are not split by sets of instances
CANARY = CanaryParams().judge_params()  # simulated canaries: as the sidecar judges them (two placements)
BY_NAME = {s.name: s for s in SCENARIOS}


def outcomes(sc: Scenario, seeds: int) -> list[tuple[str, int, str]]:
    return [run_one(sc, seed, CANARY, 1) for seed in range(seeds)]


# -- the bounds ---------------------------------------------------------------------------------
def test_rate_bounds_hold_at_every_look() -> None:
    """Anytime validity: over 300 streams looked at every 50 samples up to 3,000, the true rate leaves the
    99% bounds in at most a few streams (a fixed-sample bound looked at this often misses far more)."""
    rng = np.random.default_rng(7)
    p, misses = 0.01, 0
    for _ in range(300):
        hits = np.cumsum(rng.random(3000) < p)
        for n in range(50, 3001, 50):
            lo, hi = rate_bounds(int(hits[n - 1]), n, 0.99)
            if not lo <= p <= hi:
                misses += 1
                break
    assert misses <= 9  # 1% per side at most; 3% with sampling error


def test_rate_bounds_shape() -> None:
    assert rate_bounds(0, 0, 0.99) == (0.0, 1.0)
    assert rate_lower(0, 1000, 0.99) == 0.0 and rate_upper(1000, 1000, 0.99) == 1.0
    lo, hi = rate_bounds(50, 100, 0.99)
    assert lo < 0.5 < hi and hi - 0.5 == pytest.approx(0.5 - lo, abs=0.01)
    assert rate_upper(5, 1000, 0.99) > rate_upper(5, 1000, 0.9) > 5 / 1000
    # a clean run shows a rate below 0.5% after about a thousand samples (a fixed horizon needs 919)
    assert 900 < samples_to_show_below(0.005, 0.99) < 1200
    assert rate_upper(0, samples_to_show_below(0.02, 0.99), 0.99) <= 0.02


def test_paired_difference_cancels_shared_failures() -> None:
    # Both versions failed the same 200 requests of 4,000: no difference, shown within 0.5%.
    assert difference_upper(0, 0, 4000, 0.99) < 0.005
    # 40 failures on one side only: the candidate is worse by at least 0.5%.
    assert difference_lower(40, 0, 4000, 0.99) > 0.002
    assert difference_lower(20, 20, 4000, 0.99) < 0 < difference_upper(20, 20, 4000, 0.99)
    assert difference_lower(0, 40, 4000, 0.99) == pytest.approx(-difference_upper(40, 0, 4000, 0.99))


def test_design_effect_sees_clustered_mismatches() -> None:
    spread = [1 if i % 5 == 0 else 0 for i in range(100)]  # 20 mismatches, one every 5 blocks
    clustered = [20] + [0] * 99  # the same 20 in one block
    assert design_effect(spread) == pytest.approx(1.0, abs=0.3)
    assert design_effect(clustered) > 10
    assert design_effect([0] * 50) == 1.0


# -- the judge on simulated canaries ---------------------------------------------------------------
@pytest.mark.parametrize("name", ["identical", "identical-jitter", "identical-heavy"])
def test_identical_candidates_are_promoted(name: str) -> None:
    res = outcomes(BY_NAME[name], 40)
    assert all(r[0] == PROMOTE for r in res), [r for r in res if r[0] != PROMOTE][:3]
    assert np.median([r[1] for r in res]) <= 2500


@pytest.mark.parametrize(("name", "reason"), [("slower-10", "slower"), ("tail", "tail"), ("errors", "failed"),
                                              ("oot-2x", "out of tolerance"), ("late-regression", "slower"),
                                              ("slow-class", "b16")])  # fmt: skip
def test_regressions_are_not_promoted(name: str, reason: str) -> None:
    res = outcomes(BY_NAME[name], 25)
    assert not [r for r in res if r[0] == PROMOTE]
    pinned = [r for r in res if r[0] == PIN]
    assert len(pinned) >= 0.8 * len(res), [r[0] for r in res]
    assert all(reason in r[2] for r in pinned), {r[2] for r in pinned}


def test_simulated_capacity_pins_a_slower_candidate_and_not_an_identical_one() -> None:
    """The capacity stream of the simulation (each set of instances' window as the canary reads it): a candidate
    sustaining 0.7 of the baseline's rate is pinned for it, before any promotion; an identical one measured
    with 5% noise a set is promoted."""
    slow = outcomes(BY_NAME["capacity-0.7"], 25)
    assert all(r[0] == PIN and "sustains less throughput" in r[2] for r in slow), {r[2] for r in slow}
    assert all("on 3 of 3 sets" in r[2] or "of 4 sets" in r[2] for r in slow), {r[2] for r in slow}
    same = outcomes(BY_NAME["identical-capacity"], 25)
    assert all(r[0] == PROMOTE for r in same), [r for r in same if r[0] != PROMOTE][:3]


def test_a_tail_regression_is_pinned_within_2000_samples() -> None:
    res = outcomes(BY_NAME["tail"], 40)
    assert sum(1 for r in res if r[0] == PIN and r[1] <= 2000) >= 38


def test_clustered_mismatches_of_a_known_class_are_pinned() -> None:
    res = outcomes(BY_NAME["oot-clustered"], 25)
    assert not [r for r in res if r[0] == PROMOTE]
    assert all("rare" in r[2] or "out of tolerance" in r[2] for r in res if r[0] == PIN)


def test_a_non_deterministic_baseline_is_not_held_against_the_candidate() -> None:
    res = outcomes(BY_NAME["identical-nondeterministic"], 15)  # the default deadline: 600 s at 20 req/s
    assert not [r for r in res if r[0] == PIN]
    assert sum(1 for r in res if r[0] == PROMOTE) >= 14


def test_placement_scenarios_keep_the_error_rates_of_the_others() -> None:
    # Per-process placement as measured on real canaries (2% sigma, 1 in 25 at 12%): with one set of instances
    # 2.3% of identical candidates were not promoted and 1.4% of 10% slower ones were (1,000 seeds); with two
    # sets, and more while they contradict each other, both fall to the other scenarios' level.
    for name, wrong in (("identical-placement", {PIN, INCONCLUSIVE}), ("slower-10-placement", {PROMOTE})):
        res = outcomes(BY_NAME[name], 150)
        bad = [r for r in res if r[0] in wrong]
        assert len(bad) <= 1, (name, bad)


# -- decisions on hand-made evidence -----------------------------------------------------------------
def test_same_evidence_same_decision_and_deadline() -> None:
    rng = np.random.default_rng(0)
    p = rng.lognormal(-4, 0.3, 400)
    ev = Evidence(compared=50, sent=50, primary_s=p[:60], candidate_s=p[:60] * 1.01)
    a = judge(ev, PARAMS, now=0.0, deadline=10.0)
    b = judge(dataclasses.replace(ev, primary_s=tuple(p[:60])), PARAMS, now=0.0, deadline=10.0)
    assert a == b and a.outcome == CONTINUE
    assert any("only 50 of 300" in r for r in a.reasons)
    late = judge(ev, PARAMS, now=10.0, deadline=10.0)
    assert late.outcome == INCONCLUSIVE and "deadline" in late.reasons[0]
    empty = judge(Evidence(), PARAMS, now=0.0, deadline=1.0)
    assert empty.outcome == CONTINUE and empty.stats["latency"] is None


def test_failing_and_wrong_candidates_pin_at_once() -> None:
    assert judge(Evidence(sent=20, errors=20), PARAMS, now=1, deadline=9).outcome == PIN
    wrong = judge(Evidence(compared=40, out_of_tolerance=40, sent=40), PARAMS, now=1, deadline=9)
    assert wrong.outcome == PIN and "out of tolerance" in wrong.reasons[0]


def test_promotion_waits_for_wall_clock_coverage_and_every_class() -> None:
    p = np.full(1500, 0.01)
    ev = Evidence(compared=1500, sent=1500, primary_s=p, candidate_s=p, started=0.0,
                  classes={"b1": (1495, 0), "b16": (5, 0)}, expected_classes={"b1": 0.9, "b16": 0.1})  # fmt: skip
    early = judge(ev, PARAMS, now=10.0, deadline=100.0)
    assert early.outcome == CONTINUE and any("of 30 s" in r for r in early.reasons)
    uncovered = judge(ev, PARAMS, now=40.0, deadline=100.0)
    assert uncovered.outcome == CONTINUE and any("b16" in r for r in uncovered.reasons)
    covered = dataclasses.replace(ev, classes={"b1": (1490, 0), "b16": (10, 0)})
    assert judge(covered, PARAMS, now=40.0, deadline=100.0).outcome == PROMOTE


def test_faster_candidate_with_required_speedup() -> None:
    rng = np.random.default_rng(4)
    p = 0.01 * np.exp(rng.normal(0, 0.05, 1500))
    fast = JudgeParams(required_speedup=1.2)
    same = Evidence(compared=1500, sent=1500, primary_s=p, candidate_s=p * np.exp(rng.normal(0, 0.05, 1500)))
    assert judge(same, fast, now=100, deadline=200).outcome == PIN  # not the speed-up asked for
    quicker = dataclasses.replace(same, candidate_s=p * 0.7)
    assert judge(quicker, fast, now=100, deadline=200).outcome == PROMOTE


def _pairs(rng: np.random.Generator, sets: list[tuple[int, float]]) -> Evidence:
    """Evidence with pairs from sets of instances in turn: (pairs, the candidate's ratio on that set)."""
    prim, cand, place = [], [], []
    for q, (n, ratio) in enumerate(sets):
        p = 0.01 * np.exp(rng.normal(0, 0.3, n))
        prim += list(p)
        cand += list(p * ratio * np.exp(rng.normal(0, 0.05, n)))
        place += [q] * n
    n = len(prim)
    ratios = np.asarray(cand) / np.asarray(prim)
    per_set = {q: tuple(ratios[np.asarray(place) == q]) for q in range(len(sets))}
    return Evidence(compared=n, sent=n, primary_s=prim, candidate_s=cand, pair_placement=place,
                    placement_ratios=per_set)  # fmt: skip


def test_a_slowdown_on_one_set_of_instances_alone_is_not_a_pin() -> None:
    rng = np.random.default_rng(11)
    two = dataclasses.replace(PARAMS, placements=2)
    # Identical on its first instances, 15% slower on the second: one placement's, not the candidate's.
    ev = _pairs(rng, [(200, 1.0), (400, 1.15)])
    assert judge(ev, PARAMS, now=100, deadline=200).outcome == PIN  # not split: pinned as slower
    j = judge(ev, two, now=100, deadline=200)
    assert j.outcome == CONTINUE and j.stats["latency"]["placements_disagree"], j.reasons
    assert any("not yet on enough sets of instances" in r for r in j.reasons)
    assert j.stats["latency"]["placements"]["1"]["pairs"] == 400
    # Slower on both: pinned.
    both = judge(_pairs(rng, [(200, 1.15), (200, 1.15)]), two, now=100, deadline=200)
    assert both.outcome == PIN and "slower" in both.reasons[0]
    # A third set agrees with the first: most sets are within the limit, and the candidate is promoted.
    three = judge(_pairs(rng, [(600, 1.0), (400, 1.15), (600, 1.0)]), two, now=100, deadline=200)
    assert three.outcome == PROMOTE, three.reasons


def test_a_promotion_waits_for_a_second_set_of_instances() -> None:
    rng = np.random.default_rng(12)
    two = dataclasses.replace(PARAMS, placements=2)
    one = _pairs(rng, [(1500, 1.0)])
    assert judge(one, PARAMS, now=100, deadline=200).outcome == PROMOTE
    waiting = judge(one, two, now=100, deadline=200)
    assert waiting.outcome == CONTINUE and any("1 of 1 sets with 50 pairs" in r for r in waiting.reasons)
    assert judge(_pairs(rng, [(1000, 1.0), (500, 1.0)]), two, now=100, deadline=200).outcome == PROMOTE


def _capacity(ratios: list[float | None]) -> dict[str, dict[str, list[int]]]:
    """Per set of instances, Triton's windows with the candidate's capacity at `ratio` times the baseline's (None:
    too few inferences to judge)."""
    sets = {}
    for q, ratio in enumerate(ratios):
        n = 150 if ratio is None else 1000
        sets[str(q)] = {"baseline": [n, n, n * 200_000, 1],
                        "candidate": [n, n, int(n * 200_000 / (ratio or 1.0)), 1]}  # fmt: skip
    return sets


def test_a_capacity_below_the_limit_on_one_set_of_instances_alone_is_not_a_pin() -> None:
    """A set of instances whose compute is slower (its placement, or a busy neighbour on its cores) holds the
    promotion back and asks for another set; the pin needs `placements` + 1 sets below the limit, most of them."""
    rng = np.random.default_rng(13)
    two = dataclasses.replace(PARAMS, placements=2)

    def look(params: JudgeParams, sets: list[float | None], pairs: list[tuple[int, float]],
             serving: int | None = None) -> Judgement:  # fmt: skip
        caps = _capacity(sets)
        ev = dataclasses.replace(_pairs(rng, pairs), throughput=caps[str(len(sets) - 1)], throughput_sets=caps,
                                 placement=len(sets) - 1 if serving is None else serving)  # fmt: skip
        return judge(ev, params, now=100, deadline=200)

    fine = [(1000, 1.0), (500, 1.0)]  # latency: promotable on two sets
    assert look(two, [1.0, 1.0], fine).outcome == PROMOTE
    # One set at 0.7 of the baseline's capacity, one at 1.0: neither a pin nor a promotion, another set asked for.
    j = look(two, [0.7, 1.0], fine)
    assert j.outcome == CONTINUE and j.stats["throughput"]["placements_disagree"], j.reasons
    assert any("capacity below 0.80 on 1 of 2 sets" in r for r in j.reasons), j.reasons
    assert disagree(j.to_dict())
    assert j.stats["throughput"]["sets"] == pytest.approx({"0": 0.7, "1": 1.0})
    # The first set alone below the limit, the second not yet measured: the same wait (a rule on the newest window
    # alone promoted here), and no third set asked for before the second is measured.
    unmeasured = look(two, [0.7, None], fine)
    assert unmeasured.outcome == CONTINUE, unmeasured.reasons
    assert not disagree(unmeasured.to_dict()), unmeasured.stats["throughput"]
    # The first set replaced before it was read: the second alone below the limit asks for a third.
    only_second = judge(dataclasses.replace(_pairs(rng, fine), throughput=_capacity([0.7])["0"], placement=1,
                                            throughput_sets={"1": _capacity([0.7])["0"]}), two, now=100, deadline=200)  # fmt: skip
    assert only_second.outcome == CONTINUE and disagree(only_second.to_dict()), only_second.stats[
        "throughput"
    ]
    # Nor while fresh instances serve whose window has not appeared yet (Triton's second reading of them).
    fresh = look(two, [0.7], [(1000, 1.0), (500, 1.0)], serving=1)
    assert fresh.outcome == CONTINUE and not disagree(fresh.to_dict()), fresh.stats["throughput"]
    # One set of instances asked for: the newest window decides, whatever sets the evidence holds.
    assert look(PARAMS, [0.7, 1.0], [(1500, 1.0)]).outcome == PROMOTE
    assert look(PARAMS, [1.0, 0.7], [(1500, 1.0)]).outcome == PIN
    assert look(PARAMS, [0.7], [(1500, 1.0)]).outcome == PIN  # one set of instances asked for: pinned on it
    # Below on both sets: not yet a pin (a busy neighbour on each of two sets of an identical candidate reads the
    # same), a third set asked for; below on three, pinned, saying so.
    two_below = look(two, [0.7, 0.72], fine)
    assert two_below.outcome == CONTINUE and disagree(two_below.to_dict()), two_below.reasons
    assert any("waiting for 3 below or 2 at or above" in r for r in two_below.reasons), two_below.reasons
    three = [(600, 1.0), (400, 1.0), (600, 1.0)]
    all_below = look(two, [0.7, 0.72, 0.69], three)
    assert all_below.outcome == PIN and "sustains less throughput" in all_below.reasons[0], all_below.reasons
    assert "on 3 of 3 sets of instances" in all_below.reasons[0]
    # A third set agreeing with the good one outvotes the outlier; one agreeing with the bad one asks for a fourth,
    # which pins below the limit and clears the capacity at or above it (two sets each way).
    assert look(two, [0.7, 1.0, 1.0], three).outcome == PROMOTE
    split = look(two, [0.7, 1.0, 0.7], three)
    assert split.outcome == CONTINUE and disagree(split.to_dict()), split.reasons
    four = [(500, 1.0), (300, 1.0), (500, 1.0), (500, 1.0)]
    assert look(two, [0.7, 1.0, 0.7, 0.7], four).outcome == PIN
    assert look(two, [0.7, 1.0, 0.7, 1.0], four).outcome == PROMOTE
    # The last set loaded (MAX_PLACEMENTS), measured: the majority decides, a tie clears, whatever `placements`
    # asks for (with three or four, more sets would be needed than a canary loads).
    for placements in (3, 4):
        more = dataclasses.replace(PARAMS, placements=placements)
        assert look(more, [0.7, 0.72, 1.0, 0.69], four).outcome == PIN
        assert look(more, [0.7, 1.0, 1.0, 0.69], four).outcome == PROMOTE
    # Windows too short to be read on the earlier sets (small placement_pairs): the newest decides alone.
    short = look(two, [None, None, None, 0.7], four)
    assert short.outcome == PIN and "the only one of 4 measured" in short.reasons[0], short.reasons
    assert look(two, [None, None, None, 1.0], four).outcome == PROMOTE


def test_the_canary_status_shows_the_capacity_the_judge_weighs() -> None:
    """With several sets of instances, the status's capacity is the judge's: all sets pooled, each set's ratio
    beside it (not the newest set's window alone, which may be the one set that disagrees)."""
    caps = _capacity([0.7, 1.0])
    canary = Canary(id="c1", model="m", candidate=2, baseline=1, started=0.0, deadline=300.0,
                    params=CanaryParams(placements=2), tolerance=ToleranceSpec.from_dict({"y": {"metric": "linf", "threshold": 1e-6}}),
                    tolerance_source="request",
                    evidence=EvidenceCounter(throughput=caps["1"], throughput_sets=caps, placement=1))  # fmt: skip
    shown = canary.status()["throughput"]
    weighed = judge(canary.evidence.snapshot(), canary.params.judge_params(), now=100, deadline=300)
    weighed_fig = weighed.stats["throughput"]
    assert shown["sets"] == pytest.approx({"0": 0.7, "1": 1.0}) == weighed_fig["sets"]
    assert shown["ratio"] == pytest.approx(weighed_fig["ratio"]) and 0.7 < shown["ratio"] < 1.0
    assert shown["candidate_inferences"] == 2000
    # One set asked for: the newest window, as the judge reads it.
    one = dataclasses.replace(canary, params=CanaryParams(placements=1))
    assert "sets" not in one.status()["throughput"] and one.status()["throughput"]["ratio"] == pytest.approx(
        1.0
    )


def test_when_a_canary_loads_fresh_instances() -> None:
    two, off = dataclasses.replace(PARAMS, placements=2), PARAMS
    assert two.placement_pairs == 200
    assert not wants_placement(two, 0, 199, False)  # the first set has not served enough pairs
    assert wants_placement(two, 0, 200, False)
    assert not wants_placement(two, 1, 5000, False)  # two sets: enough while they agree
    assert wants_placement(two, 1, 200, True) and wants_placement(two, 2, 200, True)  # more on a dispute
    assert not wants_placement(two, 3, 5000, True)  # never more than MAX_PLACEMENTS
    assert not wants_placement(off, 0, 5000, True)  # placements off
    assert wants_placement(dataclasses.replace(two, placement_pairs=50), 0, 50, False)


# -- the evidence the sidecar keeps ------------------------------------------------------------------
def test_evidence_keeps_the_most_recent_latency_pairs() -> None:
    ev = EvidenceCounter()
    n = 2 * MAX_LATENCY_PAIRS + 123
    for i in range(n):
        ev.add_pair(float(i), float(-i), "b1")
    snap = ev.snapshot()
    assert snap.primary_s == tuple(float(i) for i in range(n - MAX_LATENCY_PAIRS, n))
    assert snap.candidate_s == tuple(-p for p in snap.primary_s)
    assert snap.pairs_total == n and len(snap.pair_class) == MAX_LATENCY_PAIRS
    assert len(ev.to_dict()["primary_s"]) == MAX_LATENCY_PAIRS


@pytest.mark.parametrize("n", [10, 2500, 3990, MAX_LATENCY_PAIRS, MAX_LATENCY_PAIRS + 1])
def test_fewer_pairs_than_the_limit_are_all_kept(n: int) -> None:
    ev = EvidenceCounter()
    for i in range(n):
        ev.add_pair(float(i), 1.0)
    assert len(ev.snapshot().primary_s) == min(n, MAX_LATENCY_PAIRS)
    assert len(ev.to_dict()["candidate_s"]) == min(n, MAX_LATENCY_PAIRS)


def test_comparisons_fill_blocks_and_classes() -> None:
    ev = EvidenceCounter()
    for i in range(2 * BLOCK + 7):
        ev.add_comparison(passed=i % 10 != 0, request_class="b4xs64" if i % 2 else "b1xs32")
    snap = ev.snapshot()
    assert snap.compared == 2 * BLOCK + 7 and snap.out_of_tolerance == 11
    assert list(snap.blocks) == [5, 5]
    assert sum(v[0] for v in snap.classes.values()) == snap.compared
    restored = EvidenceCounter.from_dict(ev.to_dict())
    assert restored.snapshot() == snap


def test_pairs_carry_their_set_of_instances_and_its_warm_up() -> None:
    ev = EvidenceCounter()
    for i in range(30):
        ev.add_comparison(True)
        if ev.warm(started=0.0, warmup_samples=5, warmup_s=1.0, now=10.0):
            ev.add_pair(0.01, 0.01)
    assert ev.placement_pairs() == 25 and set(ev.pair_placement) == {0}
    ev.new_placement(now=20.0)
    assert ev.placement == 1 and ev.placement_pairs() == 0
    assert not ev.warm(started=0.0, warmup_samples=5, warmup_s=1.0, now=20.5)  # by time: its own warm-up
    for _ in range(5):
        ev.add_comparison(True)
    assert not ev.warm(started=0.0, warmup_samples=5, warmup_s=1.0, now=25.0)  # by count
    ev.add_comparison(True)
    assert ev.warm(started=0.0, warmup_samples=5, warmup_s=1.0, now=25.0)
    ev.add_pair(0.01, 0.01)
    assert ev.snapshot().pair_placement[-2:] == (0, 1) and ev.placement_pairs() == 1
    restored = EvidenceCounter.from_dict(ev.to_dict())
    assert restored.placement == 1 and restored.snapshot() == ev.snapshot()
    old = ev.to_dict()
    del old["pair_placement"]  # a state file written before sets of instances were kept
    assert set(EvidenceCounter.from_dict(old).pair_placement) == {0}
