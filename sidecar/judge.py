"""The canary judge: a pure function from paired evidence to PROMOTE / PIN / INCONCLUSIVE / CONTINUE with reasons.

Same evidence, same decision: no clock (the caller passes `now`), no global randomness (the
bootstrap for p95 is seeded from the evidence itself). Checked in this order, first hit wins:

1. candidate errors + timeouts: lower confidence bound of the rate above the error budget -> PIN
2. outputs: lower bound of the out-of-tolerance rate above budget + the A/A upper bound -> PIN
3. latency (paired, same request on both versions): lower bound of the p50 ratio
   candidate/baseline above the allowed ratio -> PIN (fail fast on clear regressions)
4. fewer than `min_samples` comparisons -> CONTINUE (or INCONCLUSIVE at the deadline)
5. error, out-of-tolerance and p50 upper bounds within their limits: then the p95 ratio
   (bootstrap, the costly step) -> PIN if clearly above, PROMOTE if clearly within
6. past the deadline -> INCONCLUSIVE (the baseline is pinned); otherwise CONTINUE

Rates use one-sided Wilson score bounds; the p50 ratio is the median of per-request ratios with a
sign-test interval; the p95 ratio uses a paired bootstrap (pairs resampled together, so CPU
contention that hit both versions cancels).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from statistics import NormalDist
from typing import Any

import numpy as np
import numpy.typing as npt

CONTINUE = "continue"
PROMOTE = "promote"
PIN = "pin"
INCONCLUSIVE = "inconclusive"
FINAL = (PROMOTE, PIN, INCONCLUSIVE)

MIN_FAIL_FAST_EVENTS = 3  # never fail fast on one or two unlucky events
MIN_LATENCY_PAIRS = 30
BOOTSTRAP_RESAMPLES = 200
BOOTSTRAP_MAX_PAIRS = 2000  # the most recent pairs; bounds the judge's CPU cost per look


@dataclasses.dataclass(frozen=True)
class JudgeParams:
    """What the judge needs from a canary's parameters (see sidecar.config.CanaryParams)."""

    min_samples: int = 300
    oot_budget: float = 0.005
    error_budget: float = 0.01
    required_speedup: float = 1.0
    latency_slack: float = 0.05
    confidence: float = 0.99

    @property
    def z(self) -> float:
        return NormalDist().inv_cdf(self.confidence)

    @property
    def max_ratio(self) -> float:
        """Largest candidate/baseline latency ratio that is still acceptable."""
        return (1.0 + self.latency_slack) / self.required_speedup


@dataclasses.dataclass(frozen=True)
class Evidence:
    compared: int = 0  # candidate responses compared with the primary's
    out_of_tolerance: int = 0
    aa_compared: int = 0  # baseline replays compared with the primary's (noise floor)
    aa_out_of_tolerance: int = 0
    sent: int = 0  # candidate mirror requests finished (ok, error or timeout)
    errors: int = 0
    timeouts: int = 0
    primary_s: Sequence[float] = ()  # paired latencies, same request on both versions
    candidate_s: Sequence[float] = ()


@dataclasses.dataclass(frozen=True)
class Judgement:
    outcome: str
    reasons: tuple[str, ...]
    stats: dict[str, Any]

    @property
    def final(self) -> bool:
        return self.outcome in FINAL

    def to_dict(self) -> dict[str, Any]:
        return {"outcome": self.outcome, "reasons": list(self.reasons), "stats": self.stats}


def wilson_bounds(k: int, n: int, z: float) -> tuple[float, float]:
    """One-sided Wilson score bounds (lower, upper) of a binomial rate at quantile z."""
    if n <= 0:
        return 0.0, 1.0
    p = k / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def median_ratio(primary: npt.NDArray[np.float64], candidate: npt.NDArray[np.float64], z: float) -> tuple[float, float, float]:
    """Median of per-request ratios candidate/primary with a sign-test (order statistic) interval."""
    d = np.sort(np.log(candidate) - np.log(primary))
    n = d.size
    half = z * math.sqrt(n) / 2.0
    lo = max(0, math.floor(n / 2.0 - half))
    hi = min(n - 1, math.ceil(n / 2.0 + half))
    return float(np.exp(np.median(d))), float(np.exp(d[lo])), float(np.exp(d[hi]))


def _q95_rows(a: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    # Nearest-rank p95 along the last axis with one partition: several times cheaper than np.quantile.
    k = round(0.95 * (a.shape[-1] - 1))
    return np.partition(a, k, axis=-1)[..., k]


def p95_ratio(primary: npt.NDArray[np.float64], candidate: npt.NDArray[np.float64], confidence: float) -> tuple[float, float, float]:
    """Ratio of p95s with a paired percentile bootstrap, seeded from the data (deterministic)."""
    primary, candidate = primary[-BOOTSTRAP_MAX_PAIRS:], candidate[-BOOTSTRAP_MAX_PAIRS:]
    n = primary.size
    point = float(_q95_rows(candidate) / _q95_rows(primary))
    rng = np.random.default_rng([n, int(primary.sum() * 1e6) & 0xFFFFFFFF])
    idx = rng.integers(0, n, size=(BOOTSTRAP_RESAMPLES, n))
    ratios = np.sort(_q95_rows(candidate[idx]) / _q95_rows(primary[idx]))
    alpha = 1.0 - confidence
    lo = ratios[math.floor(alpha * (BOOTSTRAP_RESAMPLES - 1))]
    hi = ratios[math.ceil((1.0 - alpha) * (BOOTSTRAP_RESAMPLES - 1))]
    return point, float(lo), float(hi)


def _latency(ev: Evidence, z: float) -> dict[str, Any] | None:
    p = np.asarray(ev.primary_s, dtype=np.float64)
    c = np.asarray(ev.candidate_s, dtype=np.float64)
    n = min(p.size, c.size)
    if n < MIN_LATENCY_PAIRS:
        return None
    p, c = np.maximum(p[-n:], 1e-6), np.maximum(c[-n:], 1e-6)
    m, m_lo, m_hi = median_ratio(p, c, z)
    return {
        "pairs": n,
        "primary_p50_ms": float(np.median(p) * 1e3),
        "candidate_p50_ms": float(np.median(c) * 1e3),
        "primary_p95_ms": float(_q95_rows(p) * 1e3),
        "candidate_p95_ms": float(_q95_rows(c) * 1e3),
        "p50_ratio": m,
        "p50_ratio_lower": m_lo,
        "p50_ratio_upper": m_hi,
        "_arrays": (p, c),
    }


def _add_p95(lat: dict[str, Any], confidence: float) -> None:
    # The bootstrap is the judge's only costly step: it runs once everything cheaper is settled.
    p, c = lat["_arrays"]
    q, q_lo, q_hi = p95_ratio(p, c, confidence)
    lat.update(p95_ratio=q, p95_ratio_lower=q_lo, p95_ratio_upper=q_hi)


def judge(ev: Evidence, params: JudgeParams, *, now: float, deadline: float) -> Judgement:
    z = params.z
    failures = ev.errors + ev.timeouts
    err_lo, err_hi = wilson_bounds(failures, ev.sent, z)
    oot_lo = wilson_bounds(ev.out_of_tolerance, ev.compared, z)[0]
    # The promotion bound is checked at every look; spending half the error rate on it keeps a
    # candidate exactly at the budget below the target false-promotion rate despite the peeking.
    oot_hi = wilson_bounds(ev.out_of_tolerance, ev.compared, NormalDist().inv_cdf(1 - (1 - params.confidence) / 2))[1]
    aa_rate = ev.aa_out_of_tolerance / ev.aa_compared if ev.aa_compared else 0.0
    lat = _latency(ev, z)
    limit = params.max_ratio
    allowed_oot = params.oot_budget + aa_rate  # the baseline's own non-determinism is no regression
    stats: dict[str, Any] = {
        "compared": ev.compared,
        "out_of_tolerance": ev.out_of_tolerance,
        "oot_rate": ev.out_of_tolerance / ev.compared if ev.compared else 0.0,
        "oot_rate_lower": oot_lo,
        "oot_rate_upper": oot_hi,
        "oot_budget": params.oot_budget,
        "aa_compared": ev.aa_compared,
        "aa_out_of_tolerance": ev.aa_out_of_tolerance,
        "aa_rate": aa_rate,
        "sent": ev.sent,
        "errors": ev.errors,
        "timeouts": ev.timeouts,
        "error_rate_lower": err_lo,
        "error_rate_upper": err_hi,
        "error_budget": params.error_budget,
        "max_latency_ratio": limit,
        "latency": lat,
        "confidence": params.confidence,
        "min_samples": params.min_samples,
    }

    def done(outcome: str, *reasons: str) -> Judgement:
        if lat is not None:
            lat.pop("_arrays", None)
        return Judgement(outcome, tuple(reasons), stats)

    if failures >= MIN_FAIL_FAST_EVENTS and err_lo > params.error_budget:
        return done(PIN, f"candidate failed {failures} of {ev.sent} requests "
                         f"(error rate >= {err_lo:.3%} > budget {params.error_budget:.3%})")  # fmt: skip
    # Failing fast needs the candidate clearly above the noise floor's upper bound, not its estimate.
    aa_hi = wilson_bounds(ev.aa_out_of_tolerance, ev.aa_compared, z)[1] if ev.aa_compared else 0.0
    if ev.out_of_tolerance >= MIN_FAIL_FAST_EVENTS and oot_lo > params.oot_budget + aa_hi:
        return done(PIN, f"{ev.out_of_tolerance} of {ev.compared} responses out of tolerance "
                         f"(rate >= {oot_lo:.3%} > budget {params.oot_budget:.3%} + A/A {aa_hi:.3%})")  # fmt: skip
    if lat is not None and lat["p50_ratio_lower"] > limit:
        return done(PIN, f"candidate is slower: p50 ratio {lat['p50_ratio']:.3f} "
                         f"(>= {lat['p50_ratio_lower']:.3f}) > allowed {limit:.3f}")  # fmt: skip

    missing: list[str] = []
    if ev.compared < params.min_samples:
        missing.append(f"only {ev.compared} of {params.min_samples} samples compared")
    else:
        if oot_hi > allowed_oot:
            missing.append(f"out-of-tolerance rate not shown below budget (upper bound {oot_hi:.3%} > "
                           f"{params.oot_budget:.3%} + A/A {aa_rate:.3%})")  # fmt: skip
        if err_hi > params.error_budget:
            missing.append(f"error rate not shown below budget (upper bound {err_hi:.3%})")
        if lat is None:
            missing.append("too few latency pairs")
        elif lat["p50_ratio_upper"] > limit:
            missing.append(f"p50 ratio not shown within {limit:.3f} (upper bound {lat['p50_ratio_upper']:.3f})")
        if not missing:
            assert lat is not None
            _add_p95(lat, params.confidence)
            if lat["p95_ratio_lower"] > limit:
                return done(PIN, f"candidate is slower in the tail: p95 ratio {lat['p95_ratio']:.3f} "
                                 f"(>= {lat['p95_ratio_lower']:.3f}) > allowed {limit:.3f}")  # fmt: skip
            if lat["p95_ratio_upper"] > limit:
                missing.append(f"p95 ratio not shown within {limit:.3f} (upper bound {lat['p95_ratio_upper']:.3f})")
        if not missing:
            assert lat is not None
            return done(
                PROMOTE,
                f"{ev.compared} samples: out-of-tolerance rate <= {oot_hi:.3%} (allowed {allowed_oot:.3%})",
                f"error rate <= {err_hi:.3%} (budget {params.error_budget:.3%})",
                f"latency ratio p50 {lat['p50_ratio']:.3f} (<= {lat['p50_ratio_upper']:.3f}), "
                f"p95 {lat['p95_ratio']:.3f} (<= {lat['p95_ratio_upper']:.3f}), allowed {limit:.3f}",
            )
    if now >= deadline:
        return done(INCONCLUSIVE, "deadline reached without a clear answer; the baseline stays", *missing)
    return done(CONTINUE, *missing)
