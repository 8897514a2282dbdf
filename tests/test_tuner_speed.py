"""The tuner's speed claim: a route wins on the paired lower bound of its speedup, not on a point estimate.

Pure functions on simulated timings (no servers): runs of a candidate and the baseline timed alternately
under a shared, drifting machine load, as `bench_paired` times them on a busy host.
"""

from __future__ import annotations

import numpy as np
import pytest

from tuner.bench import objective, speedup, speedup_lower, stats
from tuner.inputs import BenchShape
from tuner.result import RouteResult
from tuner.search import fast_enough
from tuner.spec import ObjectiveSection

SHAPES = (BenchShape("b1xs32", 1, 0.6, {}), BenchShape("b4xs32", 4, 0.4, {}))
BASE_MS = {"b1xs32": 4.0, "b4xs32": 11.0}


def paired_runs(rng: np.random.Generator, true_speedup: float, repeats: int = 10) -> tuple[dict, dict]:  # type: ignore[type-arg]
    """Per-shape stats of alternating runs: a load drift both share, and each run's own noise (heavy-tailed)."""
    cand, base = {}, {}
    for s in SHAPES:
        drift = np.exp(np.cumsum(rng.normal(0.0, 0.03, repeats)))  # the machine's load, slowly moving
        own = np.exp(rng.normal(0.0, 0.06, (2, repeats)))
        spikes = 1.0 + (rng.random((2, repeats)) < 0.1) * rng.exponential(0.5, (2, repeats))
        tb = BASE_MS[s.key] * drift * own[0] * spikes[0] / 1000.0
        tc = BASE_MS[s.key] / true_speedup * drift * own[1] * spikes[1] / 1000.0
        cand[s.key] = stats(list(tc), bootstrap=10, rows=s.batch)
        base[s.key] = stats(list(tb), bootstrap=10, rows=s.batch)
    return cand, base


def route(cand: dict, base: dict, obj: ObjectiveSection) -> RouteResult:  # type: ignore[type-arg]
    c, b = objective(cand, SHAPES, obj), objective(base, SHAPES, obj)
    lower = speedup_lower(cand, base, SHAPES, obj, confidence=obj.confidence, bootstrap=400)
    return RouteResult("r", {}, "bench", "passed", objective_ms=c, baseline_objective_ms=b,
                       speedup=speedup(b, c), speedup_lower=lower)  # fmt: skip


@pytest.mark.parametrize("metric", ["p50", "throughput"])
def test_a_route_no_faster_than_the_baseline_rarely_wins_on_its_lower_bound(metric: str) -> None:
    obj = ObjectiveSection(metric=metric, min_speedup=1.05, confidence=0.95)
    by_point = by_bound = 0
    seeds = 300
    for seed in range(seeds):
        r = route(*paired_runs(np.random.default_rng(seed), 1.0), obj)
        by_point += (r.speedup or 0) >= obj.min_speedup
        by_bound += fast_enough(r, obj.min_speedup)
    # The point estimate crosses 1.05 on noise often; the 95% lower bound almost never (a true 1.0 is
    # 5% below the bar, so fewer than 5% of such routes may pass).
    assert by_point / seeds > 0.05, by_point
    assert by_bound / seeds < 0.03, (by_bound, by_point)


def test_a_clearly_faster_route_still_wins() -> None:
    obj = ObjectiveSection(metric="p50", min_speedup=1.05, confidence=0.95)
    wins = sum(
        fast_enough(route(*paired_runs(np.random.default_rng(s), 1.35), obj), 1.05) for s in range(200)
    )
    assert wins / 200 > 0.97, wins


def test_the_bound_pairs_runs_so_shared_drift_cancels() -> None:
    """A large shared drift (the machine got busy half-way) widens unpaired intervals, not the paired ratio."""
    obj = ObjectiveSection(metric="p50", min_speedup=1.2, confidence=0.95)
    load = np.repeat([1.0, 3.0], 5)
    cand, base = {}, {}
    for s in SHAPES:
        tb = BASE_MS[s.key] * load / 1000.0
        cand[s.key] = stats(list(tb / 1.3), bootstrap=10, rows=s.batch)
        base[s.key] = stats(list(tb), bootstrap=10, rows=s.batch)
    lower = speedup_lower(cand, base, SHAPES, obj, confidence=0.95, bootstrap=400)
    assert lower == pytest.approx(1.3, rel=1e-6)


def test_records_without_runs_have_no_bound_and_cannot_win() -> None:
    obj = ObjectiveSection()
    cand, base = paired_runs(np.random.default_rng(0), 2.0)
    for d in (cand, base):
        for v in d.values():
            v.pop("times_ms")
    assert speedup_lower(cand, base, SHAPES, obj, confidence=0.95, bootstrap=100) is None
    r = RouteResult("r", {}, "bench", "passed", speedup=2.0, speedup_lower=None)
    assert not fast_enough(r, 1.05)
