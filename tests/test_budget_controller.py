"""The mirror budget's controller (sidecar.budget) on simulated client latencies: no server, no clock.

The real-server tests (test_sidecar_budget.py) show the budget holding a saturated host's p50; these drive
`MirrorBudget.tick` on a simulated clock with latencies drawn from known distributions, so what each quantile's
controller may and may not do is asserted exactly and over many seeds: the seam is the histogram the client path
fills (`budget.counts`, what `CanaryManager.admit` and the compiled gRPC front add to).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from sidecar.budget import BOUNDS, MirrorBudget, min_requests, quantile, share_above, slower
from sidecar.config import CanaryParams, ConfigError

EDGES = np.asarray(BOUNDS)
MEDIAN_S = 1e-3


def latencies(rng: np.random.Generator, n: int, tail_share: float = 0.0, tail_factor: float = 1.0) -> Any:
    """Client latencies around 1 ms (log-normal, sigma 0.3); `tail_share` of them `tail_factor` times slower."""
    x = rng.lognormal(math.log(MEDIAN_S), 0.3, n)
    if tail_share:
        x[rng.random(n) < tail_share] *= tail_factor
    return x


def feed(budget: MirrorBudget, x: np.ndarray) -> None:
    """What the client path does for each answered request: one count in the current window, if any."""
    counts = budget.counts
    if counts is None:
        return
    hist = np.bincount(np.searchsorted(EDGES, x, side="left"), minlength=len(BOUNDS) + 1)
    for i in np.flatnonzero(hist):
        counts[i] += int(hist[i])


def run(budget: MirrorBudget, rng: np.random.Generator, seconds: float, calls_per_s: int,
        tail_share: float = 0.0, tail_factor: float = 1.0) -> None:  # fmt: skip
    """`seconds` of traffic in 0.25 s steps; mirroring windows meet the tail, pauses do not."""
    step, now = 0.25, budget.phase_since
    for _ in range(round(seconds / step)):
        mirroring = not budget.paused
        feed(budget, latencies(rng, round(calls_per_s * step), tail_share if mirroring else 0.0, tail_factor))
        now += step
        budget.tick(now, in_flight=0)


def test_quantiles_of_a_histogram_and_the_requests_each_needs() -> None:
    assert min_requests(0.5) == 30 and min_requests(0.99) == 1500 and min_requests(0.9) == 150
    rng = np.random.default_rng(1)
    x = latencies(rng, 20_000)
    counts = [0] * (len(BOUNDS) + 1)
    for i, c in enumerate(np.bincount(np.searchsorted(EDGES, x, side="left"), minlength=len(BOUNDS) + 1)):
        counts[i] = int(c)
    for q in (0.5, 0.9, 0.99):
        got = quantile(counts, q)
        assert got is not None and abs(got / np.quantile(x, q) - 1) < 0.015, q  # a 1% bucket and a half
    assert quantile(counts[:], 0.99) is not None and quantile([0] * len(counts), 0.5) is None
    few = [0] * len(counts)
    few[100] = 1499
    assert quantile(few, 0.99) is None and quantile(few, 0.5) is not None
    share, n = share_above(counts, float(np.quantile(x, 0.99)) * 1.05)
    assert n == 20_000 and 0.001 < share < 0.01


def test_the_sign_test_needs_the_share_beyond_both_samples_noise() -> None:
    # 1,500 requests with 2% above the limit against a p99 from 3,000: 2 standard errors is 0.63 points.
    assert slower(0.02, 1500, 0.99, 3000) is True
    assert slower(0.0105, 1500, 0.99, 3000) is None  # above 1% but within the noise: the rate holds
    assert slower(0.01, 1500, 0.99, 3000) is False
    # The paused quantile's own estimate counts: from only 300 requests the same 1.6% is not shown.
    assert slower(0.016, 1500, 0.99, 300_000) is True and slower(0.016, 1500, 0.99, 300) is None
    # The median's test is the one the p50 budget always had: half plus two standard errors of the window alone.
    assert slower(0.5 + 2 * 0.5 / math.sqrt(100) + 1e-6, 100, 0.5, 0) is True


def test_a_p99_budget_halves_on_a_slower_tail_that_a_p50_budget_does_not_see() -> None:
    # Mirroring slows 5% of the clients' requests 2x (whatever the rate: the worst case for the controller):
    # their median moves under 2%, their p99 far more.
    for q, expect_decreases in ((0.99, True), (0.5, False)):
        b = MirrorBudget(1.0, 0.05, 30.0, 3.0, 0.0, quantile=q)
        run(b, np.random.default_rng(2), 60.0, 1500, tail_share=0.05, tail_factor=2.0)
        s = b.status()
        assert s["quantile"] == q and s["pauses"] >= 2 and s["client_latency_paused_s"] is not None
        if expect_decreases:
            assert b.decreases >= 5 and b.effective < 0.05 and s["added"] > 0.05, s
        else:
            assert b.decreases == 0 and b.effective == 1.0, s


def test_the_floor_is_samples_per_second_at_the_traffic_measured() -> None:
    # 1,400 calls a second and a tail far beyond the budget: the rate goes to 1 sample a second, 1/1400 of the
    # calls (a floor of 1% of calls would keep 14 samples a second going), and never below it.
    b = MirrorBudget(1.0, 0.05, 30.0, 3.0, 0.0, quantile=0.99, min_samples_per_s=1.0)
    run(b, np.random.default_rng(3), 90.0, 1400, tail_share=0.2, tail_factor=3.0)
    assert b.floor is not None and b.floor == pytest.approx(1 / 1400, rel=0.1)
    assert b.min_seen == pytest.approx(b.floor, rel=0.1) and b.effective < 2 * b.floor
    # At 40 calls a second the same floor is 2.5% of calls: evidence keeps coming at low traffic.
    low = MirrorBudget(1.0, 0.05, 30.0, 3.0, 0.0, quantile=0.5, min_samples_per_s=1.0)
    run(low, np.random.default_rng(4), 120.0, 40, tail_share=0.8, tail_factor=3.0)
    assert low.floor == pytest.approx(1 / 40, rel=0.1) and low.min_seen >= low.floor * 0.9
    assert low.decreases >= 3 and low.effective < 0.1
    # The floor is never above the configured rate.
    capped = MirrorBudget(0.001, 0.05, 30.0, 3.0, 0.0, quantile=0.5, min_samples_per_s=5.0)
    run(capped, np.random.default_rng(5), 40.0, 40, tail_share=0.8, tail_factor=3.0)
    assert capped.floor == 0.001 and capped.effective == 0.001


def test_pauses_too_short_for_the_quantile_are_merged() -> None:
    # A 1 s pause at 1,000 calls a second counts 1,000 requests (from the tick that finds the copies back); a
    # p99 needs 1,500: the second pause completes it.
    b = MirrorBudget(1.0, 0.05, 4.0, 1.0, 0.0, quantile=0.99)
    rng = np.random.default_rng(6)
    run(b, rng, 1.25, 1000)
    assert b.q_off is None and not b.paused
    run(b, rng, 3.0, 1000)
    assert b.paused and b.q_off is None
    run(b, rng, 1.25, 1000)
    assert b.q_off is not None and b.off_m == 2000


def test_a_pause_counts_from_the_last_copy_back_and_gives_up_after_a_period() -> None:
    b = MirrorBudget(1.0, 0.05, 10.0, 1.0, 0.0)
    b.tick(5.0, in_flight=1)  # a copy still out: nothing counted, still paused
    assert b.paused and b.counts is None
    b.tick(5.5, in_flight=0)  # back: a full `pause_s` of clients from here
    assert b.paused and b.counts is not None
    b.tick(6.0, in_flight=0)
    assert b.paused
    b.tick(6.5, in_flight=0)
    assert not b.paused and b.rate == 1.0
    stuck = MirrorBudget(1.0, 0.05, 10.0, 1.0, 0.0)
    stuck.tick(9.9, in_flight=1)
    assert stuck.paused
    # A whole period without the copies back: mirroring again, and this pause measured nothing.
    stuck.tick(10.0, in_flight=1)
    assert not stuck.paused and stuck.q_off is None and stuck.rate == 1.0


class CountingBudget(MirrorBudget):
    """A budget that counts its decisions (holds included)."""

    decisions = 0

    def _decide(self, on: float, counts: list[int], seconds: float) -> None:
        self.decisions += 1
        super()._decide(on, counts, seconds)


def test_an_identical_load_seldom_halves_the_rate_over_1000_seeds() -> None:
    # No slowdown at all: a halving is a false alarm. Over 1,000 seeds of one pause and 27 one-second windows each
    # (1,500 calls a second), with a budget narrower than a histogram bucket (0.1%) the share of decisions that
    # halve stays near what a one-sided 2-sigma test allows (2.3%; 2.1% measured); with a 5% budget it is 2 in
    # 27,000 decisions.
    for budget, at_most in ((0.001, 0.03), (0.05, 0.001)):
        decisions = decreases = 0
        for seed in range(1000):
            b = CountingBudget(1.0, budget, 30.0, 3.0, 0.0, quantile=0.99)
            run(b, np.random.default_rng(1000 + seed), 30.0, 1500)
            decisions += b.decisions
            decreases += b.decreases
        assert decisions >= 1000 * 26, decisions
        assert decreases / decisions <= at_most, (budget, decreases, decisions)


def test_the_canary_parameters_validate_the_budget_quantile_and_floor() -> None:
    assert CanaryParams(budget_quantile=0.99, budget_min_samples_per_s=0.5).budget_quantile == 0.99
    for bad in ({"budget_quantile": 0.4}, {"budget_quantile": 1.0}, {"budget_quantile": 0.9999},
                {"budget_quantile": "0.99"}, {"budget_min_samples_per_s": 0.0},
                {"budget_min_samples_per_s": float("nan")}):  # fmt: skip
        with pytest.raises(ConfigError, match=next(iter(bad))):
            CanaryParams(**bad)  # type: ignore[arg-type]
