"""Latency benchmark in this process: warm-up, repeated timed runs per shape, median with a bootstrap CI, p95.

Candidates are timed paired with the baseline (alternating runs), and the speedup is taken
within the pair. `speedup_lower` bounds it from below: a route wins on a speedup it shows with
confidence, not on a point estimate that noise can lift over the bar.

Build seconds are never mixed in here (the search records them apart). `objective` reduces the
per-shape stats to the one number routes are ranked by (lower is better for every metric: the
throughput objective is stored as seconds per sample).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from tuner.builders.base import Runner
from tuner.inputs import BenchShape
from tuner.spec import ObjectiveSection


def stats(times_s: Sequence[float], *, bootstrap: int, seed: int = 0, rows: int = 1) -> dict[str, Any]:
    """Summary of one shape's timed runs, in milliseconds (plus samples/s for throughput)."""
    t = np.asarray(times_s, dtype=np.float64) * 1000.0
    rng = np.random.default_rng(seed)
    medians = np.median(rng.choice(t, size=(bootstrap, t.size), replace=True), axis=1)
    lo, hi = np.percentile(medians, [2.5, 97.5])
    return {
        "n": int(t.size),
        "p50_ms": float(np.median(t)),
        "p50_ci95_ms": [float(lo), float(hi)],
        "p95_ms": float(np.percentile(t, 95)),
        "mean_ms": float(t.mean()),
        "min_ms": float(t.min()),
        "rows": rows,
        "samples_per_s": float(rows * 1000.0 / t.mean()),
        "times_ms": [round(float(x), 4) for x in t],  # kept for the paired bound (`speedup_lower`)
    }


def bench_runner(
    runner: Runner, shapes: Sequence[BenchShape], *, warmup: int, repeats: int, bootstrap: int
) -> dict[str, dict[str, Any]]:
    out = {}
    for shape in shapes:
        for _ in range(warmup):
            runner(shape.feeds)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            runner(shape.feeds)
            times.append(time.perf_counter() - t0)
        out[shape.key] = stats(times, bootstrap=bootstrap, rows=shape.batch)
    return out


def bench_paired(
    candidate: Runner,
    baseline: Runner,
    shapes: Sequence[BenchShape],
    *,
    warmup: int,
    repeats: int,
    bootstrap: int,
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """Candidate and baseline timed alternately, run by run, so drift in machine load hits both alike.

    On a shared machine a baseline measured minutes earlier is not comparable; the speedup is
    taken between these two.
    """
    cand: dict[str, dict[str, Any]] = {}
    base: dict[str, dict[str, Any]] = {}
    for shape in shapes:
        for _ in range(warmup):
            baseline(shape.feeds)
            candidate(shape.feeds)
        tc: list[float] = []
        tb: list[float] = []
        for _ in range(repeats):
            for runner, times in ((baseline, tb), (candidate, tc)):
                t0 = time.perf_counter()
                runner(shape.feeds)
                times.append(time.perf_counter() - t0)
        cand[shape.key] = stats(tc, bootstrap=bootstrap, rows=shape.batch)
        base[shape.key] = stats(tb, bootstrap=bootstrap, rows=shape.batch)
    return cand, base


def objective(
    per_shape: Mapping[str, Mapping[str, Any]], shapes: Sequence[BenchShape], obj: ObjectiveSection
) -> float:
    """The ranking number (lower is better): weighted mean p50/p95 in ms, or ms per sample for throughput."""
    chosen = [s for s in shapes if not obj.batch_sizes or s.batch in obj.batch_sizes] or list(shapes)
    weights = np.array([s.weight for s in chosen], dtype=np.float64)
    if obj.metric == "throughput":
        values = np.array([1000.0 / per_shape[s.key]["samples_per_s"] for s in chosen])
    else:
        values = np.array([per_shape[s.key][f"{obj.metric}_ms"] for s in chosen])
    return float((values * weights).sum() / weights.sum())


def speedup(baseline_objective: float, candidate_objective: float) -> float:
    return baseline_objective / candidate_objective if candidate_objective > 0 else 0.0


def _shape_statistic(times_ms: npt.NDArray[np.float64], metric: str, rows: int) -> npt.NDArray[np.float64]:
    """The objective's per-shape number over the last axis (resampled runs): what `objective` reads."""
    if metric == "throughput":
        return np.asarray(times_ms.mean(axis=-1) / rows)  # ms per sample = 1000 / samples_per_s
    q = 95.0 if metric == "p95" else 50.0
    return np.asarray(np.percentile(times_ms, q, axis=-1))


def speedup_lower(
    candidate: Mapping[str, Mapping[str, Any]],
    baseline: Mapping[str, Mapping[str, Any]],
    shapes: Sequence[BenchShape],
    obj: ObjectiveSection,
    *,
    confidence: float,
    bootstrap: int,
    seed: int = 0,
) -> float | None:
    """One-sided lower confidence bound of the speedup, from runs timed alternately (`bench_paired`).

    Each resample draws run indices per shape and keeps a candidate run with the baseline run timed beside
    it, so load drift that slows both cancels in the ratio, as it does in the point estimate. None when the
    runs were not kept (a record from before they were).
    """
    chosen = [s for s in shapes if not obj.batch_sizes or s.batch in obj.batch_sizes] or list(shapes)
    rng = np.random.default_rng(seed)
    num = np.zeros(bootstrap)
    den = np.zeros(bootstrap)
    for s in chosen:
        tc = candidate.get(s.key, {}).get("times_ms")
        tb = baseline.get(s.key, {}).get("times_ms")
        if not tc or not tb or len(tc) != len(tb):
            return None
        c, b = np.asarray(tc, dtype=np.float64), np.asarray(tb, dtype=np.float64)
        idx = rng.integers(0, c.size, size=(bootstrap, c.size))
        num += s.weight * _shape_statistic(b[idx], obj.metric, s.batch)
        den += s.weight * _shape_statistic(c[idx], obj.metric, s.batch)
    ratios = np.where(den > 0, num / np.where(den > 0, den, 1.0), 0.0)
    return float(np.quantile(ratios, 1.0 - confidence))
