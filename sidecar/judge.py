"""The canary judge: a pure function from paired evidence to PROMOTE / PIN / INCONCLUSIVE / CONTINUE with reasons.

Same evidence, same decision: no clock (the caller passes `now`), no global randomness (the tail's
bootstrap is seeded from the evidence itself). The judge is asked once a second, so every bound is
valid however often it is looked at: rates and paired differences use the anytime-valid confidence
sequences of `tunegate.stats`; the recent-window checks spend their error over their windows
(alpha_j = alpha * 6 / (pi^2 j^2)).

Pin checks run at every look, each family with a sixth of `1 - confidence` (so an identical candidate
is pinned at most that often in all), first hit wins:

1. errors: candidate error rate minus the baseline's own (its A/A replays), lower bound above the budget;
2. outputs: out-of-tolerance rate minus the A/A rate, lower bound above the budget; clustered
   mismatches widen the bound by their design effect (variance between blocks of BLOCK comparisons
   over the binomial's);
3. request classes: one class (batch and sequence bucket) out of tolerance beyond the budget on its own;
4. latency p50: the share of pairs whose candidate/baseline ratio exceeds the allowed ratio, lower bound
   above one half (an anytime sign test: the median ratio is above the limit), overall and per class;
5. tail: pairs whose ratio is beyond the limit times TAIL_FACTOR outnumber those below the limit over
   TAIL_FACTOR (a sign test over the extreme pairs: a slow tail shows up as outliers on one side);
6. recent window: the p50 sign test and the out-of-tolerance rate over the most recent pairs and
   comparisons only, so a regression that starts late is not diluted by the early evidence.

Placements: a process's placement (its cores, caches, memory) can make one version's instance lastingly
faster or slower than the other's for a whole canary, which no number of pairs from those instances averages
out. Each pair carries the index of the set of instances that served it; the canary loads fresh instances of
both versions once a set served `placement_pairs` pairs, until `placements` sets have, and again (up to
MAX_PLACEMENTS) while the latency verdict is open or the sets do not bear it out (sidecar.canary). With
`placements` > 1, every latency verdict (the p50 pin and promotion, a class's pin, the tail's pin), shown at its
confidence by all the pairs together, must also be what the sets of instances' own pairs say: at least
`placements` sets with MIN_PLACEMENT_PAIRS pairs on its side of one half (their share of pairs beyond the
limit), under half of them shown on the other at AGAINST_CONFIDENCE (for the p50, each set's own most recent
pairs, `placement_ratios`). A set's pairs are a few hundred at most, too few for a bound of their own on a small
effect: the sets vote, the pooled test carries the confidence, and an outlying placement is outvoted. The recent window's pin
holds on each set of instances in the window, and where those are fewer than `placements`, only for a slowdown
they did not show before it (a late regression, not their placement). The capacity pin (Triton's compute time
per inference) counts each set's own window the same way, and needs one set more below the limit
(`_Look.throughput`).

Promotion needs `min_samples` comparisons over at least `min_duration_s`, every expected request class
covered, and the upper bounds within their limits: out-of-tolerance and error rates (differences with
the A/A rates, both uncertainties counted) and the p50 sign test below one half; it waits while a request
class's or the recent window's p50, the tail's sign test, or (a bootstrap, checked last) the p95 ratio, is
shown beyond the limit at 90% (HOLD_CONFIDENCE: sized to the measured noise rather than to a point estimate). Past the deadline without an answer: INCONCLUSIVE (the
baseline stays).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from sidecar.throughput import figures_over_sets, judged_windows
from tunegate.stats import difference_lower, difference_upper, rate_lower, rate_upper


class Outcome(enum.StrEnum):
    CONTINUE = "continue"
    PROMOTE = "promote"
    PIN = "pin"
    INCONCLUSIVE = "inconclusive"


CONTINUE, PROMOTE, PIN, INCONCLUSIVE = Outcome.CONTINUE, Outcome.PROMOTE, Outcome.PIN, Outcome.INCONCLUSIVE
FINAL = (PROMOTE, PIN, INCONCLUSIVE)

PIN_FAMILIES = 6  # errors, outputs, classes, p50, tail, recent window: each gets 1/6 of the pin error
MIN_FAIL_FAST_EVENTS = 3  # never pin on one or two unlucky events
MIN_LATENCY_PAIRS = 50
# A latency pin needs this many pairs, and the slowdown seen again in the newer half of them: a model's first
# seconds after loading (cold caches, the load's own CPU) are slow for reasons that pass.
MIN_PIN_PAIRS = 200
BLOCK = 50  # comparisons per block for the design effect (sidecar.state keeps per-block counts)
BOOTSTRAP_RESAMPLES = 200
BOOTSTRAP_MAX_PAIRS = 2000  # the most recent pairs of a look; bounds the judge's CPU cost
TAIL_FACTOR = 1.5  # a tail pair is beyond the limit times (or divided by) this
# A promotion waits while an estimate that is not a pin test (a class's or the recent window's p50, the p95
# ratio) shows the candidate beyond the limit at this confidence: sized to the noise, not to the point estimate.
HOLD_CONFIDENCE = 0.9
# A set of instances counts against a latency verdict when its own pairs show the other side at this confidence.
AGAINST_CONFIDENCE = 0.75
MIN_PLACEMENT_PAIRS = MIN_LATENCY_PAIRS  # pairs a set of instances needs for its verdict to count
MAX_PLACEMENTS = 4  # sets of instances a canary loads at most (more when they contradict each other)
# sets of instances below the capacity limit a capacity pin needs beyond `placements` (_Look.throughput)
CAPACITY_EXTRA_SETS = 1
MAX_SET_PAIRS = 1000  # ratios kept per set of instances for its own verdict


@dataclasses.dataclass(frozen=True)
class JudgeParams:
    """What the judge needs from a canary's parameters (see sidecar.config.CanaryParams)."""

    min_samples: int = 300
    oot_budget: float = 0.005
    error_budget: float = 0.01
    required_speedup: float = 1.0
    latency_slack: float = 0.05
    confidence: float = 0.99
    min_duration_s: float = 30.0  # wall-clock coverage before a promotion
    min_class_samples: int = 10  # comparisons each expected request class needs before a promotion
    recent_window: int = 400  # pairs (and comparisons) in the recent-window checks
    max_memory_ratio: float = 1.5  # largest candidate/baseline memory ratio (both measured) before a pin
    min_throughput_ratio: float = (
        0.8  # smallest candidate/baseline capacity ratio (both measured) before a pin
    )
    placements: int = 1  # sets of instances each latency verdict must hold on (1: the pairs are not split)
    placement_pairs: int = MIN_PIN_PAIRS  # pairs a set of instances serves before the canary loads fresh ones

    @property
    def max_ratio(self) -> float:
        """Largest candidate/baseline latency ratio that is still acceptable."""
        return (1.0 + self.latency_slack) / self.required_speedup

    @property
    def alpha(self) -> float:
        return 1.0 - self.confidence

    @property
    def pin_confidence(self) -> float:
        return 1.0 - self.alpha / PIN_FAMILIES


@dataclasses.dataclass(frozen=True)
class Evidence:
    compared: int = 0  # candidate responses compared with the primary's
    out_of_tolerance: int = 0
    aa_compared: int = 0  # baseline replays compared with the primary's (noise floor)
    aa_out_of_tolerance: int = 0
    sent: int = 0  # candidate mirror requests finished (ok, error or timeout)
    errors: int = 0
    timeouts: int = 0
    aa_sent: int = 0  # baseline replays finished, and how many failed: the baseline's own error rate
    aa_errors: int = 0
    # Requests replayed to both versions (shadow pairing replays every sampled request to the baseline too):
    # the discordant ones carry the difference between the two rates, without the noise both share.
    paired_sent: int = 0  # both answered (or failed)
    cand_only_errors: int = 0
    aa_only_errors: int = 0
    paired_compared: int = 0  # both compared with the primary
    cand_only_oot: int = 0
    aa_only_oot: int = 0
    primary_s: Sequence[
        float
    ] = ()  # paired latencies (the most recent ones held), same request on both versions
    candidate_s: Sequence[float] = ()
    pair_class: Sequence[str] = ()  # request class of each held pair ("" unknown)
    pair_placement: Sequence[int] = ()  # the set of instances (0, 1, ...) each held pair ran on
    # set of instances -> candidate/baseline latency ratios of its most recent pairs (MAX_SET_PAIRS)
    placement_ratios: Mapping[int, Sequence[float]] = dataclasses.field(default_factory=dict)
    pairs_total: int = 0  # pairs ever recorded; 0 means len(primary_s)
    blocks: Sequence[int] = ()  # out-of-tolerance count of each completed block of BLOCK comparisons
    classes: Mapping[str, Sequence[int]] = dataclasses.field(default_factory=dict)  # class -> [compared, oot]
    expected_classes: Mapping[str, float] = dataclasses.field(default_factory=dict)  # class -> traffic share
    started: float | None = None  # when evidence began (None: duration not checked)
    memory: Mapping[str, float] = dataclasses.field(default_factory=dict)  # role -> peak bytes seen
    # role -> [inferences, executions, compute_ns, instances] since the warm-up, from Triton (sidecar.throughput)
    throughput: Mapping[str, Sequence[int]] = dataclasses.field(default_factory=dict)
    # set of instances (str index) -> its own window, as `throughput`: each set's capacity votes, as for latency
    throughput_sets: Mapping[str, Mapping[str, Sequence[int]]] = dataclasses.field(default_factory=dict)
    placement: int = 0  # the set of instances serving now (its window appears at its second reading)


@dataclasses.dataclass(frozen=True)
class Judgement:
    outcome: Outcome
    reasons: tuple[str, ...]
    stats: dict[str, Any]

    @property
    def final(self) -> bool:
        return self.outcome in FINAL

    def to_dict(self) -> dict[str, Any]:
        return {"outcome": str(self.outcome), "reasons": list(self.reasons), "stats": self.stats}


# -- statistics -------------------------------------------------------------------------------
def design_effect(blocks: Sequence[int], block: int = BLOCK) -> float:
    """Variance of per-block counts over the binomial's (>= 1): how much clustered mismatches shrink the evidence."""
    b = np.asarray(blocks, dtype=np.float64)
    if b.size < 2 or b.sum() < MIN_FAIL_FAST_EVENTS:
        return 1.0
    p = b.sum() / (b.size * block)
    if p >= 1.0:
        return 1.0
    var_binomial: float = block * p * (1.0 - p)
    var_observed = float(((b - block * p) ** 2).mean())
    return max(1.0, var_observed / var_binomial)


def _q95_rows(a: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    # Nearest-rank p95 along the last axis with one partition: several times cheaper than np.quantile.
    k = round(0.95 * (a.shape[-1] - 1))
    return np.partition(a, k, axis=-1)[..., k]


@functools.lru_cache(maxsize=256)
def _p95_bootstrap(primary: bytes, candidate: bytes, alpha: float) -> tuple[float, float, float]:
    p = np.frombuffer(primary, dtype=np.float64)
    c = np.frombuffer(candidate, dtype=np.float64)
    return p95_ratio(p, c, alpha)


def p95_ratio(primary: npt.NDArray[np.float64], candidate: npt.NDArray[np.float64],
              alpha: float) -> tuple[float, float, float]:  # fmt: skip
    """Ratio of p95s with a paired percentile bootstrap seeded from the data: (point, lower, upper) at 1 - alpha each."""
    n = primary.size
    point = float(_q95_rows(candidate) / _q95_rows(primary))
    rng = np.random.default_rng([n, int(primary.sum() * 1e6) & 0xFFFFFFFF])
    idx = rng.integers(0, n, size=(BOOTSTRAP_RESAMPLES, n))
    ratios = np.sort(_q95_rows(candidate[idx]) / _q95_rows(primary[idx]))
    # The extreme resamples stand for bounds beyond 1/RESAMPLES: never tighter than the sample allows.
    lo = ratios[max(0, math.floor(alpha * (BOOTSTRAP_RESAMPLES - 1)))]
    hi = ratios[min(BOOTSTRAP_RESAMPLES - 1, math.ceil((1.0 - alpha) * (BOOTSTRAP_RESAMPLES - 1)))]
    return point, float(lo), float(hi)


def _spent(alpha: float, look: int) -> float:
    """The share of `alpha` spent at look 1, 2, ...: 6/(pi^2 j^2) sums to 1."""
    return alpha * 6.0 / (math.pi**2 * look * look)


def difference_bounds(k: float, n: float, aa_k: float, aa_n: float, plus: float, minus: float, paired: float,
                      params: JudgeParams) -> tuple[float, float]:  # fmt: skip
    """(lower at the pin's confidence, upper at the promotion's) of rate(candidate) - rate(baseline).

    Upper: the smaller of the candidate's own upper bound (the baseline's rate is >= 0) and the paired
    difference's (requests sent to both versions: only the discordant ones count), half the error each.
    Lower: the paired difference's where most requests went to both, else the candidate's lower bound less
    the baseline's upper bound; without any replay to the baseline it is taken as clean.
    """
    a, a_pin = params.alpha, params.alpha / PIN_FAMILIES
    upper = rate_upper(k, n, 1 - a / 2)
    if paired > 0:
        upper = min(upper, difference_upper(plus, minus, paired, 1 - a / 2))
    if paired >= n / 2 and paired > 0:
        lower = difference_lower(plus, minus, paired, 1 - a_pin)
    else:
        aa_hi = rate_upper(aa_k, aa_n, 1 - a_pin / 2) if aa_n > 0 else 0.0
        lower = (rate_lower(k, n, 1 - a_pin / 2) if k >= MIN_FAIL_FAST_EVENTS else 0.0) - aa_hi
    return lower, upper


def wants_placement(params: JudgeParams, current: int, pairs: int, disagree: bool) -> bool:
    """Whether a canary loads fresh instances now: the current set (index `current`) served `placement_pairs`
    `pairs`, and fewer than `placements` sets have, or (up to MAX_PLACEMENTS) the judge's last look found the
    latency verdict open or not borne out by the sets (`disagree`)."""
    if params.placements <= 1 or pairs < params.placement_pairs:
        return False
    sets = current + 1
    return sets < params.placements or (disagree and sets < MAX_PLACEMENTS)


def disagree(judgement: Mapping[str, Any] | None) -> bool:
    """The `placements_disagree` flag of a judgement's latency or capacity figures (Judgement.to_dict())."""
    stats = (judgement or {}).get("stats") or {}
    return any(bool((stats.get(k) or {}).get("placements_disagree")) for k in ("latency", "throughput"))


# -- the judge --------------------------------------------------------------------------------
class _Look:
    """One look at the evidence: the checks, each adding to stats and to the pin or missing lists."""

    def __init__(self, ev: Evidence, params: JudgeParams, now: float) -> None:
        self.ev, self.params, self.now = ev, params, now
        self.limit = params.max_ratio
        self.pin: list[str] = []
        self.missing: list[str] = []
        self.stats: dict[str, Any] = {
            "confidence": params.confidence,
            "min_samples": params.min_samples,
            "max_latency_ratio": self.limit,
            "compared": ev.compared,
            "sent": ev.sent,
            "errors": ev.errors,
            "timeouts": ev.timeouts,
        }
        self.aa_oot_bounds = self._aa_bounds(ev.aa_out_of_tolerance, ev.aa_compared)
        self._tail_arrays: tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]] | None = None
        self.blocked = False  # the latency verdict is open, or held back by the sets of instances

    def tail_within(self) -> None:
        """The last promotion check (a bootstrap, the judge's costly step): a p95 ratio shown above the limit at
        HOLD_CONFIDENCE holds the promotion back; a noisy tail that is only as wide as its noise does not."""
        if self._tail_arrays is None or self.stats.get("latency") is None:
            return
        _, lo, hi = _p95_bootstrap(
            self._tail_arrays[0].tobytes(), self._tail_arrays[1].tobytes(), 1 - HOLD_CONFIDENCE
        )
        self.stats["latency"].update(p95_ratio_lower=lo, p95_ratio_upper=hi)
        if lo > self.limit:
            self.missing.append(f"p95 ratio {self.stats['latency']['p95_ratio']:.3f} above {self.limit:.3f} "
                                f"(lower bound {lo:.3f})")  # fmt: skip

    def _aa_bounds(self, k: int, n: int) -> tuple[float, float, float]:
        """Baseline rate bounds for the difference tests: (lower at promotion's share, upper at the pin's)."""
        if n <= 0:
            return 0.0, 0.0, 0.0  # no replays: the baseline is taken as clean, which only makes pins harder
        a = self.params.alpha
        return k / n, rate_lower(k, n, 1 - a / 2), rate_upper(k, n, 1 - a / PIN_FAMILIES / 2)

    def errors(self) -> None:
        ev, p = self.ev, self.params
        failures = ev.errors + ev.timeouts
        base = ev.aa_errors / ev.aa_sent if ev.aa_sent else 0.0
        lo = (
            rate_lower(failures, ev.sent, 1 - p.alpha / PIN_FAMILIES / 2)
            if failures >= MIN_FAIL_FAST_EVENTS
            else 0.0
        )
        hi = rate_upper(failures, ev.sent, 1 - p.alpha / 2)
        diff_lo, diff_hi = difference_bounds(failures, ev.sent, ev.aa_errors, ev.aa_sent, ev.cand_only_errors,
                                             ev.aa_only_errors, ev.paired_sent, p)  # fmt: skip
        self.stats.update(error_rate=failures / ev.sent if ev.sent else 0.0, error_rate_lower=lo,
                          error_rate_upper=hi, baseline_error_rate=base, error_budget=p.error_budget,
                          error_difference_lower=diff_lo, error_difference_upper=diff_hi)  # fmt: skip
        if failures >= MIN_FAIL_FAST_EVENTS and diff_lo > p.error_budget:
            self.pin.append(f"candidate failed {failures} of {ev.sent} requests (error rate above the baseline's "
                            f"by >= {diff_lo:.3%}, budget {p.error_budget:.3%})")  # fmt: skip
        elif diff_hi > p.error_budget:
            self.missing.append(
                f"error rate not shown within budget over the baseline's (difference <= {diff_hi:.3%})"
            )

    def outputs(self) -> None:
        ev, p = self.ev, self.params
        aa, aa_lo, aa_hi = self.aa_oot_bounds
        deff = design_effect(ev.blocks)
        k, n = ev.out_of_tolerance / deff, ev.compared / deff
        lo = (
            rate_lower(k, n, 1 - p.alpha / PIN_FAMILIES / 2)
            if ev.out_of_tolerance >= MIN_FAIL_FAST_EVENTS
            else 0.0
        )
        hi = rate_upper(k, n, 1 - p.alpha / 2)
        diff_lo, diff_hi = difference_bounds(k, n, ev.aa_out_of_tolerance, ev.aa_compared, ev.cand_only_oot / deff,
                                             ev.aa_only_oot / deff, ev.paired_compared / deff, p)  # fmt: skip
        self.stats.update(oot_difference_lower=diff_lo, oot_difference_upper=diff_hi)
        self.stats.update(out_of_tolerance=ev.out_of_tolerance, oot_rate=ev.out_of_tolerance / ev.compared
                          if ev.compared else 0.0, oot_rate_lower=lo, oot_rate_upper=hi, oot_budget=p.oot_budget,
                          aa_compared=ev.aa_compared, aa_out_of_tolerance=ev.aa_out_of_tolerance, aa_rate=aa,
                          aa_rate_lower=aa_lo, aa_rate_upper=aa_hi, design_effect=deff)  # fmt: skip
        if ev.out_of_tolerance >= MIN_FAIL_FAST_EVENTS and diff_lo > p.oot_budget:
            self.pin.append(f"{ev.out_of_tolerance} of {ev.compared} responses out of tolerance (rate above the "
                            f"A/A rate by >= {diff_lo:.3%} > budget {p.oot_budget:.3%}"
                            + (f"; clustered, design effect {deff:.1f})" if deff > 1 else ")"))  # fmt: skip
        elif diff_hi > p.oot_budget:
            self.missing.append(f"out-of-tolerance rate not shown within budget over the A/A rate "
                                f"(difference <= {diff_hi:.3%}, budget {p.oot_budget:.3%})")  # fmt: skip

    def classes(self) -> None:
        ev, p = self.ev, self.params
        aa_hi = self.aa_oot_bounds[2]
        seen = {c: (int(v[0]), int(v[1])) for c, v in ev.classes.items() if v and v[0] > 0}
        conf = 1 - p.alpha / PIN_FAMILIES / max(1, len(seen))
        per: dict[str, Any] = {}
        for cls, (n, k) in sorted(seen.items()):
            lo = rate_lower(k, n, conf)
            per[cls] = {"compared": n, "out_of_tolerance": k, "oot_rate_lower": lo}
            if k >= MIN_FAIL_FAST_EVENTS and lo - aa_hi > p.oot_budget:
                self.pin.append(f"request class {cls}: {k} of {n} responses out of tolerance "
                                f"(rate >= {lo:.3%} > budget {p.oot_budget:.3%})")  # fmt: skip
        uncovered = sorted(c for c, share in ev.expected_classes.items()
                           if share > 0 and seen.get(c, (0, 0))[0] < p.min_class_samples)  # fmt: skip
        if uncovered:
            self.missing.append(f"request classes not yet covered ({p.min_class_samples} comparisons each): "
                                + ", ".join(uncovered[:8]) + (" ..." if len(uncovered) > 8 else ""))  # fmt: skip
        self.stats["classes"] = per

    def latency(self) -> None:
        ev, p = self.ev, self.params
        n = min(len(ev.primary_s), len(ev.candidate_s))
        if n < MIN_LATENCY_PAIRS:
            self.stats["latency"] = None
            self.missing.append(f"too few latency pairs ({n} of {MIN_LATENCY_PAIRS})")
            return
        prim = np.maximum(np.asarray(ev.primary_s[-n:], dtype=np.float64), 1e-9)
        cand = np.maximum(np.asarray(ev.candidate_s[-n:], dtype=np.float64), 1e-9)
        ratio = cand / prim
        above = ratio > self.limit
        s = int(above.sum())
        # A lower bound never exceeds its estimate: skip it where it cannot reach one half.
        lo = rate_lower(s, n, p.pin_confidence) if s / n > 0.5 else 0.0
        hi = rate_upper(s, n, p.confidence)
        lat: dict[str, Any] = {
            "pairs": n,
            "primary_p50_ms": float(np.median(prim) * 1e3),
            "candidate_p50_ms": float(np.median(cand) * 1e3),
            "primary_p95_ms": float(_q95_rows(prim) * 1e3),
            "candidate_p95_ms": float(_q95_rows(cand) * 1e3),
            "p50_ratio": float(np.median(ratio)),
            "share_above_limit": s / n,
            "share_above_limit_lower": lo,
            "share_above_limit_upper": hi,
        }
        self.stats["latency"] = lat
        places = self._places(n)
        groups = self._set_groups()
        if groups is not None:
            lat["placements"] = {str(q): {"pairs": int(f.size), "share_above_limit": float(f.mean())}
                                 for q, f in groups if f.size}  # fmt: skip
        if lo > 0.5 and self._persists(above):
            why = self._disagree(groups, True, MIN_PLACEMENT_PAIRS)
            if why is None:
                self.pin.append(f"candidate is slower: p50 ratio {lat['p50_ratio']:.3f} > allowed {self.limit:.3f} "
                                f"({s} of {n} pairs above it, share >= {lo:.1%})")  # fmt: skip
            else:
                self.blocked = True
                self.missing.append(f"p50 ratio {lat['p50_ratio']:.3f} above {self.limit:.3f}, not yet on enough "
                                    f"sets of instances ({why})")  # fmt: skip
        elif hi >= 0.5:
            self.blocked = True  # not decided either way: another set of instances helps as well
            self.missing.append(f"p50 ratio {lat['p50_ratio']:.3f} not shown within {self.limit:.3f} "
                                f"({s} of {n} pairs above it, share <= {hi:.1%})")  # fmt: skip
        else:
            why = self._disagree(groups, False, MIN_PLACEMENT_PAIRS)
            if why is not None:
                self.blocked = True
                self.missing.append(f"p50 ratio {lat['p50_ratio']:.3f} within {self.limit:.3f}, not yet on enough "
                                    f"sets of instances ({why})")  # fmt: skip
        self._latency_by_class(ratio, n, places)
        self._tail(prim, cand, lat)
        self._recent(ratio, n, places)
        if groups is not None:
            # The latency verdict is open, or the sets of instances do not bear out what all the pairs show: the
            # canary loads another set once the current one served `placement_pairs` (its placement may be
            # what holds the verdict; a fresh one is independent of it).
            lat["placements_disagree"] = self.blocked

    def _places(self, n: int) -> npt.NDArray[np.int64] | None:
        """The set of instances of each of the last `n` pairs, or None where verdicts are not split by them."""
        if self.params.placements <= 1:
            return None
        pl = self.ev.pair_placement
        if len(pl) < n:
            return np.zeros(n, dtype=np.int64)
        return np.asarray(pl[len(pl) - n :], dtype=np.int64)

    def _set_groups(self) -> list[tuple[int, npt.NDArray[np.bool_]]] | None:
        """Per set of instances, its most recent pairs above the limit (`placement_ratios`, kept per set so that
        the first sets outlive the held pairs' window), or None where verdicts are not split by them."""
        if self.params.placements <= 1:
            return None
        return [(int(q), np.asarray(r, dtype=np.float64) > self.limit)
                for q, r in sorted(self.ev.placement_ratios.items())]  # fmt: skip

    @staticmethod
    def _split(flags: npt.NDArray[np.bool_],
               places: npt.NDArray[np.int64] | None) -> list[tuple[int, npt.NDArray[np.bool_]]] | None:  # fmt: skip
        return None if places is None else [(int(q), flags[places == q]) for q in np.unique(places)]

    def _disagree(self, groups: list[tuple[int, npt.NDArray[np.bool_]]] | None, slower: bool, least: int,
                  need: int | None = None) -> str | None:  # fmt: skip
        """None where a latency verdict holds across the sets of instances with `least` pairs each (`groups`: per
        set, its pairs beyond the limit): at least `need` (`placements`) of them on the verdict's side of one half
        (`slower`: more than half of their pairs beyond the limit; else at most half), and under half of them
        shown on the other side at AGAINST_CONFIDENCE. Otherwise, why not."""
        if groups is None:
            return None
        sets = n_agree = n_against = 0
        for _, f in groups:
            if f.size < least:
                continue
            k = int(f.sum())
            sets += 1
            if slower:
                n_agree += 2 * k > f.size
                n_against += rate_upper(k, f.size, AGAINST_CONFIDENCE) < 0.5
            else:
                n_agree += 2 * k <= f.size
                n_against += rate_lower(k, f.size, AGAINST_CONFIDENCE) > 0.5
        agree, against = n_agree, n_against
        need = self.params.placements if need is None else need
        if agree >= need and 2 * against < sets:
            return None
        return (f"{agree} of {sets} sets with {least} pairs {'slower' if slower else 'not slower'}, "
                f"{against} shown otherwise; {need} needed and under half otherwise")  # fmt: skip

    def _far_groups(self) -> list[tuple[int, npt.NDArray[np.bool_]]] | None:
        """Per set of instances, its far pairs (beyond the limit times or over TAIL_FACTOR): whether above."""
        if self.params.placements <= 1:
            return None
        out = []
        for q, r in sorted(self.ev.placement_ratios.items()):
            a = np.asarray(r, dtype=np.float64)
            far = (a > self.limit * TAIL_FACTOR) | (a < self.limit / TAIL_FACTOR)
            out.append((int(q), a[far] > self.limit))
        return out

    @staticmethod
    def _persists_tail(far_above: npt.NDArray[np.bool_]) -> bool:
        """The newer half of the far pairs (in arrival order) leans above the limit too."""
        newer = far_above[far_above.size // 2 :]
        return newer.size > 0 and rate_lower(int(newer.sum()), newer.size, HOLD_CONFIDENCE) > 0.5

    @staticmethod
    def _persists(flags: npt.NDArray[np.bool_], least: int = MIN_PIN_PAIRS) -> bool:
        """Enough pairs for a latency pin, and the newer half shows the slowdown too (at HOLD_CONFIDENCE)."""
        if flags.size < least:
            return False
        newer = flags[flags.size // 2 :]
        return rate_lower(int(newer.sum()), newer.size, HOLD_CONFIDENCE) > 0.5

    def _latency_by_class(
        self, ratio: npt.NDArray[np.float64], n: int, places: npt.NDArray[np.int64] | None
    ) -> None:
        labels = list(self.ev.pair_class[-n:]) if len(self.ev.pair_class) >= n else []
        if not labels:
            return
        arr = np.asarray(labels)
        names = [c for c in sorted(set(labels)) if c]
        if len(names) < 2:
            return
        conf = 1 - self.params.alpha / PIN_FAMILIES / len(names)
        per = self.stats.setdefault("classes", {})
        for cls in names:
            r = ratio[arr == cls]
            if r.size < MIN_LATENCY_PAIRS // 2:
                continue
            s = int((r > self.limit).sum())
            lo = rate_lower(s, r.size, conf) if s / r.size > 0.5 else 0.0
            per.setdefault(cls, {}).update(
                pairs=int(r.size), p50_ratio=float(np.median(r)), share_above_lower=lo
            )
            pinned = lo > 0.5 and self._persists(r > self.limit, MIN_PIN_PAIRS // 4)
            if pinned and places is not None:
                # Held pairs only: where older sets of instances left the window, the ones still in it.
                split = self._split(r > self.limit, places[arr == cls])
                least = MIN_PLACEMENT_PAIRS // 2
                need = self.params.placements
                if len(np.unique(places)) < len(self.ev.placement_ratios):
                    need = max(1, min(need, sum(1 for _, f in split or () if f.size >= least)))
                if self._disagree(split, True, least, need) is not None:
                    pinned, self.blocked = False, True
            if pinned:
                self.pin.append(f"candidate is slower on request class {cls}: p50 ratio {np.median(r):.3f} > "
                                f"allowed {self.limit:.3f} ({s} of {r.size} pairs above it)")  # fmt: skip
            elif s / r.size > 0.5 and rate_lower(s, r.size, HOLD_CONFIDENCE) > 0.5:
                self.missing.append(
                    f"request class {cls}: p50 ratio {np.median(r):.3f} above {self.limit:.3f}"
                )

    def _tail(
        self, prim: npt.NDArray[np.float64], cand: npt.NDArray[np.float64], lat: dict[str, Any]
    ) -> None:
        """Pairs far above the limit against pairs as far below it: a tail regression shows up as outliers.

        Centred on the limit, a candidate within it (and noise that hits both versions alike) has no more pairs
        beyond limit * TAIL_FACTOR than below limit / TAIL_FACTOR; a slow tail (a few per cent of requests several
        times slower) piles up on one side, and the anytime sign test over those pairs pins it long before a
        p95 estimate settles.
        """
        recent = min(prim.size, BOOTSTRAP_MAX_PAIRS)
        point = float(_q95_rows(cand[-recent:]) / _q95_rows(prim[-recent:]))
        ratio = cand / prim
        up = int((ratio > self.limit * TAIL_FACTOR).sum())
        down = int((ratio < self.limit / TAIL_FACTOR).sum())
        lo = rate_lower(up, up + down, self.params.pin_confidence) if up > down else 0.0
        lat.update(p95_ratio=point, tail_pairs_above=up, tail_pairs_below=down, tail_share_lower=lo)
        far = ratio[(ratio > self.limit * TAIL_FACTOR) | (ratio < self.limit / TAIL_FACTOR)] > self.limit
        pinned = (
            up >= MIN_FAIL_FAST_EVENTS
            and lo > 0.5
            and ratio.size >= MIN_PIN_PAIRS
            and self._persists_tail(far)
        )
        if pinned and self._disagree(self._far_groups(), True, MIN_FAIL_FAST_EVENTS) is not None:
            pinned, self.blocked = False, True
        if pinned:
            self.pin.append(f"candidate is slower in the tail: {up} pairs above {self.limit * TAIL_FACTOR:.2f}x "
                            f"against {down} below {self.limit / TAIL_FACTOR:.2f}x (p95 ratio {point:.3f})"
                            + self._tail_class(ratio))  # fmt: skip
            return
        if up > down and up >= MIN_FAIL_FAST_EVENTS and rate_lower(up, up + down, HOLD_CONFIDENCE) > 0.5:
            self.missing.append(f"tail: {up} pairs above {self.limit * TAIL_FACTOR:.2f}x against {down} below "
                                f"{self.limit / TAIL_FACTOR:.2f}x (p95 ratio {point:.3f})")  # fmt: skip
        self._tail_arrays = (prim[-recent:], cand[-recent:])

    def _tail_class(self, ratio: npt.NDArray[np.float64]) -> str:
        """Names the request class that holds most of the excess of far-above pairs, where one does: a slow shape."""
        n = ratio.size
        labels = np.asarray(list(self.ev.pair_class[-n:])) if len(self.ev.pair_class) >= n else None
        if labels is None:
            return ""
        up = ratio > self.limit * TAIL_FACTOR
        down = ratio < self.limit / TAIL_FACTOR
        excess = {
            str(c): int(up[labels == c].sum()) - int(down[labels == c].sum())
            for c in set(labels.tolist())
            if c
        }
        total = int(up.sum()) - int(down.sum())
        if not excess or total <= 0:
            return ""
        cls, most = max(excess.items(), key=lambda kv: kv[1])
        share = float(
            (labels == cls).mean()
        )  # a class holds its share of any excess by chance: name it well above
        if most / total <= share + (1.0 - share) / 2:
            return ""
        return f"; most of the excess in request class {cls} ({most} of {total})"

    def _recent(self, ratio: npt.NDArray[np.float64], n: int, places: npt.NDArray[np.int64] | None) -> None:
        w = self.params.recent_window
        total = self.ev.pairs_total or n
        step = max(1, w // 2)
        j = total // step
        end = n - (total - j * step)
        if total < w or end - w < 0:
            return
        window = ratio[end - w : end]
        s = int((window > self.limit).sum())
        lo = (
            0.0
            if s / w <= 0.5
            else rate_lower(s, w, 1 - _spent(self.params.alpha / PIN_FAMILIES / 2, max(1, j - 1)))
        )
        self.stats["latency"]["recent"] = {
            "pairs": w,
            "p50_ratio": float(np.median(window)),
            "share_above_lower": lo,
        }
        held = self._recent_holds(ratio > self.limit, places, end - w, end)
        if lo > 0.5 and self._persists(window > self.limit) and held:
            self.pin.append(f"candidate became slower: p50 ratio {np.median(window):.3f} over the last {w} pairs "
                            f"> allowed {self.limit:.3f}")  # fmt: skip
        elif s / w > 0.5 and rate_lower(s, w, HOLD_CONFIDENCE) > 0.5:
            self.missing.append(
                f"the last {w} pairs' p50 ratio {np.median(window):.3f} is above {self.limit:.3f}"
            )

    def _recent_holds(self, above: npt.NDArray[np.bool_], places: npt.NDArray[np.int64] | None, start: int,
                      end: int) -> bool:  # fmt: skip
        """The recent window's slowdown on its sets of instances: on each with MIN_PLACEMENT_PAIRS pairs, and on
        `placements` of them; where fewer are in the window, on instances that were shown not slower before it
        (a regression that began there, not their placement)."""
        if places is None:
            return True
        w, wp = above[start:end], places[start:end]
        present = [int(q) for q in np.unique(wp) if (wp == q).sum() >= MIN_PLACEMENT_PAIRS]
        if not present:
            return False
        for q in present:
            f = w[wp == q]
            if rate_lower(int(f.sum()), f.size, HOLD_CONFIDENCE) <= 0.5:
                return False
        if len(present) >= self.params.placements:
            return True
        before, bp = above[:start], places[:start]
        for q in present:
            b = before[bp == q]
            if b.size < MIN_PLACEMENT_PAIRS or rate_upper(int(b.sum()), b.size, HOLD_CONFIDENCE) >= 0.5:
                return False
        return True

    def recent_outputs(self) -> None:
        ev, p = self.ev, self.params
        per = max(1, p.recent_window // BLOCK)
        step = max(1, per // 2)
        nb = len(ev.blocks)
        if nb < per:
            return
        j = nb // step
        window = ev.blocks[j * step - per : j * step]
        if len(window) < per:
            return
        k, n = int(sum(window)), per * BLOCK
        lo = rate_lower(k / design_effect(window), n / design_effect(window),
                        1 - _spent(p.alpha / PIN_FAMILIES / 2, max(1, j - 1)))  # fmt: skip
        if k >= MIN_FAIL_FAST_EVENTS and lo - self.aa_oot_bounds[2] > p.oot_budget:
            self.pin.append(f"{k} of the last {n} responses out of tolerance (rate >= {lo:.3%} "
                            f"> budget {p.oot_budget:.3%})")  # fmt: skip

    def memory(self) -> None:
        """Pin a candidate whose instances take more than `max_memory_ratio` times the baseline's memory (both known)."""
        cand, base = self.ev.memory.get("candidate", 0.0), self.ev.memory.get("baseline", 0.0)
        limit = self.params.max_memory_ratio
        ratio = cand / base if cand > 0 and base > 0 else None
        self.stats["memory"] = {"candidate_bytes": cand or None, "baseline_bytes": base or None, "ratio": ratio,
                                "max_ratio": limit}  # fmt: skip
        if ratio is not None and ratio > limit:
            self.pin.append(f"candidate takes more memory per instance: {cand / 2**20:.1f} MiB against the baseline's "
                            f"{base / 2**20:.1f} MiB (ratio {ratio:.2f} > allowed {limit:.2f})")  # fmt: skip

    def throughput(self) -> None:
        """Pin a candidate whose instances sustain less than `min_throughput_ratio` times the baseline's rate on the
        same mirrored mix (Triton's compute time per inference; sidecar.throughput), once both ran enough.

        With `placements` > 1 the capacity must hold on the sets of instances, and more firmly than a latency
        verdict: one process's compute time is open to its placement and to a busy neighbour on its cores, which
        held one set of an identical candidate at 0.68-0.78 of the baseline's capacity in real canaries. The pin
        needs the windows of all sets together below the limit and `placements` + 1 sets' own windows below it
        (MAX_PLACEMENTS at most), more of them than not (CAPACITY_EXTRA_SETS: two sets below on an identical
        candidate come from neighbours alone at p² where a set meets one with p, three at p³). Sets at or above
        the limit, at least `placements` and as many as those below, clear it. Until one or the other, the
        promotion waits and the canary loads another set (`placements_disagree`). Once the last set it loads
        (MAX_PLACEMENTS) is measured, the sets measured decide by majority, a tie clearing; where fewer than
        `placements` were (windows too short to hold MIN_INFERENCES), the newest decides alone."""
        ev, limit = self.ev, self.params.min_throughput_ratio
        # Each set's window under its own index; with one set asked for, the newest window alone decides (latency's
        # pairs are not split either).
        sets = judged_windows(ev.throughput_sets, ev.throughput, ev.placement, self.params.placements)
        fig = figures_over_sets(sets)
        fig["min_ratio"] = limit
        self.stats["throughput"] = fig
        ratio = fig["ratio"]
        per_set = fig.get("sets") or {q: fig["ratio"] for q in sets}
        judged = [r for r in per_set.values() if r is not None]
        below = sum(r < limit for r in judged)
        above = len(judged) - below
        clear = max(1, self.params.placements)
        need = min(clear + CAPACITY_EXTRA_SETS, MAX_PLACEMENTS) if clear > 1 else 1

        def pin(held: str) -> None:
            self.pin.append(f"candidate sustains less throughput: {fig['candidate_capacity_rps']:.1f} inferences/s "
                            f"against the baseline's {fig['baseline_capacity_rps']:.1f} (ratio {ratio:.2f} < allowed "
                            f"{limit:.2f}{held}; Triton's compute time over {fig['candidate_inferences']} "
                            "inferences)")  # fmt: skip

        newest = per_set.get(str(ev.placement))
        if clear > 1 and ev.placement + 1 >= MAX_PLACEMENTS and newest is not None:
            # The last set the canary loads, measured: no other comes. The sets measured decide by majority (a
            # tie clears), or, where fewer than `placements` were (their windows too short), the newest alone.
            if len(judged) >= clear:
                if ratio is not None and ratio < limit and below > above:
                    pin(f" on {below} of {len(judged)} sets of instances")
            elif newest < limit:
                ratio = newest
                pin(f" on the newest set of instances, the only one of {ev.placement + 1} measured")
            return
        if ratio is None or not below or (above >= clear and above >= below):
            return
        if ratio < limit and below >= need and below > above:
            pin(f" on {below} of {len(judged)} sets of instances" if clear > 1 else "")
            return
        # Another set only once the newest one's own capacity is known: the canary may load one before that
        # (its latency pairs come sooner than Triton's two readings), and the newest set would go unmeasured.
        fig["placements_disagree"] = newest is not None
        self.missing.append(f"capacity below {limit:.2f} on {below} of {len(judged)} sets of instances (ratio "
                            f"{ratio:.2f} over all): waiting for {need} below or {clear} at or above it")  # fmt: skip

    def coverage(self) -> None:
        ev, p = self.ev, self.params
        if ev.compared < p.min_samples:
            self.missing.insert(0, f"only {ev.compared} of {p.min_samples} samples compared")
        if ev.started is not None and self.now - ev.started < p.min_duration_s:
            self.missing.insert(
                0, f"only {self.now - ev.started:.0f} s of {p.min_duration_s:g} s of traffic seen"
            )


def judge(ev: Evidence, params: JudgeParams, *, now: float, deadline: float) -> Judgement:
    look = _Look(ev, params, now)
    look.errors()
    look.outputs()
    look.classes()
    look.latency()
    look.recent_outputs()
    look.memory()
    look.throughput()
    look.coverage()
    if look.pin:
        return Judgement(PIN, tuple(look.pin), look.stats)
    if not look.missing:
        look.tail_within()
    if not look.missing:
        s, lat = look.stats, look.stats["latency"]
        return Judgement(PROMOTE, (
            (f"{ev.compared} samples: out-of-tolerance rate above the A/A rate by <= {s['oot_difference_upper']:.3%} "
             f"(budget {params.oot_budget:.3%})"),
            f"error rate above the baseline's by <= {s['error_difference_upper']:.3%} (budget {params.error_budget:.3%})",
            (f"latency ratio p50 {lat['p50_ratio']:.3f} (share of pairs above {look.limit:.3f} <= "
             f"{lat['share_above_limit_upper']:.1%}), p95 {lat['p95_ratio']:.3f}"),
        ), look.stats)  # fmt: skip
    if now >= deadline:
        return Judgement(INCONCLUSIVE, ("deadline reached without a clear answer; the baseline stays", *look.missing),
                         look.stats)  # fmt: skip
    return Judgement(CONTINUE, tuple(look.missing), look.stats)
