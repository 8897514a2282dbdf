"""The canary judge as a statistical procedure: false promotion, false pin and samples to a decision, per scenario.

Each scenario is a stream of mirrored requests as the sidecar sees them: request classes (batch buckets
with their own base latency), paired latencies (a contention factor common to both versions of a pair,
each version's own jitter, spikes, heavy tails, drift), out-of-tolerance outcomes (independent, clustered
in runs, tied to one request class), errors and timeouts on either side, A/A replays, and a placement per set
of instances (the candidate's process faster or slower than the baseline's for as long as it lives), and in the
capacity scenarios each set's window of Triton's compute counters, as the canary reads it. The judge
(`sidecar.judge.judge`, unchanged) is asked every LOOK samples, as the sidecar asks it once a second, up
to the deadline; after each look, fresh instances are loaded where the canary would load them
(`wants_placement`), their first WARMUP samples unpaired. Each scenario runs over SEEDS seeds.

    python benchmarks/judge_sim.py                      # every scenario, 1000 seeds each
    python benchmarks/judge_sim.py --seeds 200 --only identical-jitter --json

The peer is Kayenta's fixed-horizon Mann-Whitney test (one-sided, alpha 1%): the fewest samples at which it
pins a 10% slower candidate in 99% of seeds, against the judge's median samples to the same decision.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sidecar.config import CanaryParams
from sidecar.judge import (
    BLOCK,
    INCONCLUSIVE,
    MAX_PLACEMENTS,
    MAX_SET_PAIRS,
    PIN,
    PROMOTE,
    Evidence,
    JudgeParams,
    disagree,
    judge,
    wants_placement,
)

CLASSES = (("b1", 0.55, 1.0), ("b2", 0.2, 1.5), ("b4", 0.13, 2.3), ("b8", 0.08, 3.6), ("b16", 0.04, 5.8))
DEFAULTS = CanaryParams()
WARMUP = 20  # first candidate answers: compared, latency not paired (the canary's warmup_samples)
MAX_PAIRS = 4000  # what sidecar.state holds


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    truth: str  # "good" (should promote), "bad" (should not promote), "edge" (at a limit: reported only)
    what: str
    latency_ratio: float = 1.0
    jitter: float = 0.08  # per-side lognormal sigma
    contention: float = 0.35  # common-mode lognormal sigma
    spikes: float = 0.0  # share of samples, per side, 5-10x slower (GC pauses)
    heavy: bool = False  # per-side Pareto tails
    drift: float = 0.0  # candidate's instance alone: slow sinusoid of this amplitude
    oot_rate: float = 0.0
    aa_oot_rate: float = 0.0  # baseline non-determinism: A/A mismatches, and the candidate inherits them
    run_length: int = 1  # mismatches arrive in runs of this many consecutive requests (a bad request class)
    error_rate: float = 0.0
    aa_error_rate: float = 0.0
    tail_share: float = 0.0  # share of candidate requests `tail_factor` slower
    tail_factor: float = 3.0
    late_ratio: float = 1.0  # candidate latency ratio from sample `late_from` on
    late_from: int = 0
    class_ratio: tuple[str, float] | None = None  # one class slower by this ratio
    # Per-process placement: the candidate's instance runs this much faster or slower than the shadow baseline's
    # for the whole canary, whatever the model (lognormal sigma); with probability `placement_out`, sigma
    # `placement_out_sigma` instead. Fitted to the real identical canaries (docs/benchmarks.md).
    placement: float = 0.0
    placement_out: float = 0.0
    placement_out_sigma: float = 0.0
    # Capacity (Triton's compute time per inference, sidecar.throughput): the candidate's true ratio to the
    # baseline's, each set of instances' measured ratio off it by a lognormal `capacity_noise`, and with
    # probability `capacity_out` a set whose candidate process shares its cores with a busy neighbour
    # (`capacity_out_factor` of its true ratio). None: no capacity read (the judge's capacity check idle).
    capacity_ratio: float | None = None
    capacity_noise: float = 0.0
    capacity_out: float = 0.0
    capacity_out_factor: float = 1.0
    # The neighbour slows the same set's candidate process in latency too (its pairs 1/capacity_out_factor slower),
    # as when its compute dominates a request's time.
    capacity_out_latency: bool = False
    rate: float = 20.0  # mirrored requests per second (the judge looks once a second)
    deadline_s: float = DEFAULTS.deadline_s  # the canary's default deadline

    @property
    def deadline(self) -> int:
        """Samples up to the deadline."""
        return int(self.rate * self.deadline_s)


# Per-process placement fitted to the real canaries of benchmarks/canary_identical.py (identical candidates'
# paired p50 ratios, 60 canaries on a 2-core machine): most within a lognormal sigma of 2%, about 1 in 25 far off
# (0.864, 0.928 for a 1.15x slower one, 1.071).
PLACEMENT: dict[str, float] = {"placement": 0.02, "placement_out": 0.04, "placement_out_sigma": 0.12}

# Capacity per set of instances. Quiet: identical candidates on the real Triton read 0.8-1.25 (asserted) and
# mostly within a few per cent; a nice-19 busy loop on each core held one set at 0.68 and 0.78 of the baseline's
# in 2 of 7 canaries (docs/design.md, "Memory and capacity"): here a set meets such a neighbour with p 0.3.
CAPACITY: dict[str, Any] = {"capacity_ratio": 1.0, "capacity_noise": 0.05}
CAPACITY_NEIGHBOUR: dict[str, Any] = {**CAPACITY, "capacity_out": 0.3, "capacity_out_factor": 0.73}

SCENARIOS = (
    Scenario("identical", "good", "identical candidate, common contention, 8% jitter per side"),
    Scenario("identical-jitter", "good", "identical, 30% jitter per side", jitter=0.3),
    Scenario("identical-spikes", "good", "identical, 2% GC-like spikes per side", spikes=0.02),
    Scenario("identical-heavy", "good", "identical, heavy-tailed (Pareto) latencies per side", heavy=True),
    Scenario(
        "identical-drift",
        "good",
        "identical, candidate's instance drifts +-4% (within the 5% slack)",
        drift=0.04,
    ),
    Scenario(
        "identical-nondeterministic",
        "good",
        "baseline non-deterministic: A/A mismatches on 0.5% of requests",
        aa_oot_rate=0.005,
    ),
    Scenario(
        "identical-timeouts", "good", "0.5% timeouts on both sides", error_rate=0.005, aa_error_rate=0.005
    ),
    Scenario(
        "faster", "good", "10% faster, 0.1% out of tolerance (budget 0.5%)", latency_ratio=0.9, oot_rate=0.001
    ),
    Scenario("oot-2x", "bad", "out of tolerance on 1% (2x the budget)", oot_rate=0.01),
    Scenario(
        "oot-2x-nondeterministic",
        "bad",
        "0.5% A/A mismatches, candidate 1% more (2x the budget)",
        aa_oot_rate=0.005,
        oot_rate=0.01,
    ),
    Scenario(
        "oot-clustered",
        "bad",
        "a bad request class: 1% of requests, in runs of 20",
        oot_rate=0.01,
        run_length=20,
    ),
    Scenario("slower-10", "bad", "10% slower at p50", latency_ratio=1.10),
    Scenario(
        "slower-10-jitter", "bad", "10% slower at p50, 30% jitter per side", latency_ratio=1.10, jitter=0.3
    ),
    Scenario("tail", "bad", "2.6% of requests 3x slower (p95 ratio 1.10)", tail_share=0.026),
    Scenario("late-regression", "bad", "+25% latency from sample 800 on", late_ratio=1.25, late_from=800),
    Scenario("errors", "bad", "3% candidate errors, baseline 0.5%", error_rate=0.03, aa_error_rate=0.005),
    Scenario(
        "slow-class",
        "bad",
        "20% slower on the longest requests only (b16, 4% of traffic)",
        class_ratio=("b16", 1.2),
    ),
    Scenario(
        "identical-placement",
        "good",
        "identical; per-process placement as measured (2% sigma, 1 in 25 12%)",
        **PLACEMENT,
    ),
    Scenario(
        "slower-10-placement",
        "bad",
        "10% slower; per-process placement as measured",
        latency_ratio=1.10,
        **PLACEMENT,
    ),
    Scenario(
        "identical-capacity",
        "good",
        "identical; each set's capacity ratio measured with 5% sigma",
        **CAPACITY,
    ),
    Scenario(
        "identical-capacity-neighbour",
        "good",
        "identical; a busy neighbour on 30% of sets (0.73 of the capacity: 0.68, 0.78 measured)",
        **CAPACITY_NEIGHBOUR,
    ),
    Scenario(
        "identical-capacity-neighbour-10",
        "good",
        "identical; a busy neighbour on 10% of sets",
        **{**CAPACITY_NEIGHBOUR, "capacity_out": 0.1},
    ),
    Scenario(
        "identical-neighbour-both-10",
        "good",
        "identical; a busy neighbour on 10% of sets slows that set's capacity (0.73) and latency (1.37x) alike",
        **{**CAPACITY_NEIGHBOUR, "capacity_out": 0.1, "capacity_out_latency": True},
    ),
    Scenario(
        "identical-neighbour-both",
        "good",
        "identical; a busy neighbour on 30% of sets, capacity and latency alike",
        **{**CAPACITY_NEIGHBOUR, "capacity_out_latency": True},
    ),
    Scenario(
        "capacity-0.7",
        "bad",
        "capacity 0.7 of the baseline's (limit 0.8), same latency; 5% sigma",
        **{**CAPACITY, "capacity_ratio": 0.7},
    ),
    Scenario(
        "capacity-0.7-neighbour",
        "bad",
        "capacity 0.7, busy neighbour on 30% of sets",
        **{**CAPACITY_NEIGHBOUR, "capacity_ratio": 0.7},
    ),
    Scenario("oot-at-budget", "edge", "out of tolerance exactly at the 0.5% budget", oot_rate=0.005),
)


@dataclasses.dataclass
class Stream:
    cls: np.ndarray
    primary: np.ndarray
    candidate: np.ndarray
    oot: np.ndarray
    aa_oot: np.ndarray
    err: np.ndarray
    aa_err: np.ndarray
    # each set of instances' placement: the candidate's latency factor against the baseline's on it
    placement: np.ndarray = dataclasses.field(default_factory=lambda: np.ones(MAX_PLACEMENTS))
    # each set's measured capacity ratio (candidate's over baseline's), or None: none read
    capacity: np.ndarray | None = None


def make_stream(sc: Scenario, rng: np.random.Generator) -> Stream:
    """The candidate's latencies are those of its first set of instances' placement; `Prefix` applies the
    placement of the set each pair ran on."""
    n = sc.deadline
    names = np.array([c for c, _, _ in CLASSES])
    shares = np.array([s for _, s, _ in CLASSES])
    base = np.array([b for _, _, b in CLASSES])
    ci = rng.choice(len(CLASSES), size=n, p=shares / shares.sum())
    common = 0.010 * base[ci] * np.exp(rng.normal(0.0, sc.contention, n))

    def side() -> np.ndarray:
        if sc.heavy:
            x = rng.pareto(2.5, n) * 0.25 + 0.8
        else:
            x = np.exp(rng.normal(0.0, sc.jitter, n))
        if sc.spikes:
            x = np.where(rng.random(n) < sc.spikes, x * rng.uniform(5, 10, n), x)
        return x

    primary = common * side()
    ratio = np.full(n, sc.latency_ratio)
    if sc.drift:
        ratio *= 1.0 + sc.drift * np.sin(np.arange(n) / n * 4 * math.pi + rng.uniform(0, 2 * math.pi))
    if sc.late_from:
        ratio[sc.late_from :] *= sc.late_ratio / sc.latency_ratio
    if sc.class_ratio is not None:
        ratio = np.where(names[ci] == sc.class_ratio[0], ratio * sc.class_ratio[1], ratio)
    if sc.tail_share:
        ratio = np.where(rng.random(n) < sc.tail_share, ratio * sc.tail_factor, ratio)
    placement = np.ones(MAX_PLACEMENTS)
    if sc.placement or sc.placement_out:
        for k in range(MAX_PLACEMENTS):  # each set of instances draws its own
            sigma = sc.placement_out_sigma if rng.random() < sc.placement_out else sc.placement
            placement[k] = math.exp(rng.normal(0.0, sigma))
    capacity = None
    if sc.capacity_ratio is not None:
        capacity = sc.capacity_ratio * np.exp(rng.normal(0.0, sc.capacity_noise, MAX_PLACEMENTS))
        busy = rng.random(MAX_PLACEMENTS) < sc.capacity_out
        capacity = np.where(busy, capacity * sc.capacity_out_factor, capacity)
        if sc.capacity_out_latency:
            placement = np.where(busy, placement / sc.capacity_out_factor, placement)
    candidate = common * ratio * side()
    cls = names[ci]
    # Non-determinism: each execution of the baseline (the primary, its A/A replay) and of a candidate that
    # inherits it is odd with probability q; a comparison mismatches when either side is odd.
    q = sc.aa_oot_rate / 2
    odd_primary = rng.random(n) < q
    aa_oot = odd_primary | (rng.random(n) < q)
    if sc.run_length > 1:
        starts = rng.random(n) < sc.oot_rate / sc.run_length
        oot = np.zeros(n, dtype=bool)
        for s in np.flatnonzero(starts):
            oot[s : s + sc.run_length] = True
        # the run is one request class, unknown to the traffic mix only until it shows up
        cls = np.where(oot, "rare", cls)
    else:
        oot = rng.random(n) < sc.oot_rate
    oot |= odd_primary | (rng.random(n) < q)  # the candidate inherits the baseline's own non-determinism
    err = rng.random(n) < sc.error_rate
    aa_err = rng.random(n) < sc.aa_error_rate
    return Stream(cls, primary, candidate, oot, aa_oot, err, aa_err, placement, capacity)


class Prefix:
    """Running counts of a stream, so that the evidence at any look costs O(classes + held pairs), not O(samples)."""

    def __init__(self, st: Stream, aa_every: int, rate: float = 20.0) -> None:
        self.st, self.aa_every = st, aa_every
        self.rate = rate  # mirrored requests a second: the serving set's capacity lags by a reading interval
        ok = ~st.err
        oot_ok = st.oot & ok
        self.c_ok, self.c_oot, self.c_err = (np.cumsum(a, dtype=np.int64) for a in (ok, oot_ok, st.err))
        self.okpos = np.flatnonzero(ok)
        self.split = False  # pairs tagged with their set of instances (placements > 1)
        self.reload(())
        seq = st.oot[self.okpos]
        nb = seq.size // BLOCK
        self.blocks = seq[: nb * BLOCK].reshape(nb, BLOCK).sum(axis=1).astype(int).tolist()
        aa_idx = np.arange(0, st.err.size, aa_every)
        err, aa_err, oot, aa_oot = st.err[aa_idx], st.aa_err[aa_idx], st.oot[aa_idx], st.aa_oot[aa_idx]
        aa_ok = ~aa_err
        both = ~err & aa_ok  # compared on both sides
        self.aa = {name: np.cumsum(a, dtype=np.int64) for name, a in {
            "aa_compared": aa_ok, "aa_out_of_tolerance": aa_oot & aa_ok, "aa_errors": aa_err,
            "cand_only_errors": err & ~aa_err, "aa_only_errors": ~err & aa_err, "paired_compared": both,
            "cand_only_oot": oot & ~aa_oot & both, "aa_only_oot": ~oot & aa_oot & both}.items()}  # fmt: skip
        self.classes = {str(c): (np.cumsum((st.cls == c) & ok, dtype=np.int64),
                                 np.cumsum((st.cls == c) & oot_ok, dtype=np.int64))
                        for c in np.unique(st.cls)}  # fmt: skip

    def reload(self, at: Sequence[int], split: bool = False) -> None:
        """Fresh instances from each sample in `at` on: their first WARMUP samples are not paired (the canary's
        warm-up after a load), and each pair carries its set's index."""
        self.reloads = np.asarray(at, dtype=np.int64)
        self.split = split or bool(len(at))
        pairpos = self.okpos[WARMUP:]  # the samples paired: after the first warm-up
        for r in at:
            pairpos = pairpos[(pairpos < r) | (pairpos >= r + WARMUP)]
        self.pairpos = pairpos
        st = self.st
        self.pair_set = np.searchsorted(self.reloads, pairpos, side="right")
        self.pair_ratio = st.candidate[pairpos] * st.placement[self.pair_set] / st.primary[pairpos]

    def pairs_since(self, i: int) -> int:
        """Pairs among the first `i` samples from the current set of instances."""
        first = int(self.reloads[-1]) if self.reloads.size else 0
        return int(np.searchsorted(self.pairpos, i) - np.searchsorted(self.pairpos, first))

    def evidence(self, i: int, expected: dict[str, float]) -> Evidence:
        st = self.st
        compared = int(self.c_ok[i - 1])
        m = -(-i // self.aa_every)  # replays among the first i samples
        aa = {name: int(c[m - 1]) if m else 0 for name, c in self.aa.items()}
        pairs_total = int(np.searchsorted(self.pairpos, i))
        held = self.pairpos[max(0, pairs_total - MAX_PAIRS) : pairs_total]
        first = max(0, pairs_total - MAX_PAIRS)
        sets = self.pair_set[first:pairs_total]
        per_set = {}
        if self.split:
            done_sets, done_ratios = self.pair_set[:pairs_total], self.pair_ratio[:pairs_total]
            per_set = {int(q): done_ratios[done_sets == q][-MAX_SET_PAIRS:] for q in np.unique(done_sets)}
        classes = {c: [int(n[i - 1]), int(k[i - 1])] for c, (n, k) in self.classes.items() if n[i - 1] > 0}
        current = int(self.reloads.size)
        windows = self.capacity_windows(pairs_total, current)
        return Evidence(
            compared=compared, out_of_tolerance=int(self.c_oot[i - 1]), sent=i, errors=int(self.c_err[i - 1]),
            timeouts=0, aa_sent=m, paired_sent=m, **aa,
            primary_s=st.primary[held], candidate_s=st.candidate[held] * st.placement[sets], pair_class=st.cls[held],
            pair_placement=sets if self.split else (), placement_ratios=per_set,
            pairs_total=pairs_total, blocks=self.blocks[: compared // BLOCK], classes=classes,
            expected_classes=expected, started=0.0,
            throughput=windows.get(str(current), {}), throughput_sets=windows, placement=current,
        )  # fmt: skip

    def capacity_windows(self, pairs_total: int, current: int) -> dict[str, dict[str, list[int]]]:
        """Each set's window of Triton's counters as the canary reads it (sidecar.canary): from its warm-up to its
        last reading, one baseline and one candidate inference a pair, compute times at the set's measured ratio.
        The serving set's window is as of the last 5 s reading (a set's first reading opens it)."""
        cap = self.st.capacity
        if cap is None:
            return {}
        lag = 5 * round(self.rate)  # pairs since the last reading, at most
        out = {}
        sets = self.pair_set[:pairs_total]
        for q in range(current + 1):
            n = int((sets == q).sum())
            if q == current:
                n = max(0, n - lag)
            if n:
                base_ns = n * 2_000_000
                out[str(q)] = {"baseline": [n, n, base_ns, 1], "candidate": [n, n, int(base_ns / cap[q]), 1]}
        return out


def evidence_at(st: Stream, i: int, sc: Scenario, aa_every: int, expected: dict[str, float]) -> Evidence:
    """The evidence after the first i samples (one-off; run_one keeps a Prefix)."""
    return Prefix(st, aa_every, sc.rate).evidence(i, expected)


def run_one(sc: Scenario, seed: int, params: JudgeParams, aa_every: int) -> tuple[str, int, str]:
    rng = np.random.default_rng(seed)
    st = make_stream(sc, rng)
    look = max(1, round(sc.rate))  # once a second
    expected = {c: s for c, s, _ in CLASSES}
    if sc.run_length > 1:
        expected["rare"] = sc.oot_rate  # the bad class is in the traffic the gate saw
    deadline_t = sc.deadline / sc.rate
    prefix = Prefix(st, aa_every, sc.rate)
    prefix.reload((), split=params.placements > 1)
    reloads: list[int] = []
    for i in range(look, sc.deadline + 1, look):
        now = i / sc.rate
        j = judge(prefix.evidence(i, expected), params, now=now, deadline=deadline_t)
        if j.final:
            return str(j.outcome), i, j.reasons[0]
        # As the canary does on its tick: fresh instances for the next samples (sidecar.canary._new_placement).
        if wants_placement(params, len(reloads), prefix.pairs_since(i), disagree(j.to_dict())):
            reloads.append(i)
            prefix.reload(reloads)
    return str(INCONCLUSIVE), sc.deadline, "deadline"


def mann_whitney_fixed_n(ratio: float, seeds: int, power: float = 0.99, alpha: float = 0.01) -> int:
    """Fewest samples at which a one-sided fixed-horizon Mann-Whitney test rejects in `power` of the seeds."""
    z = statistics.NormalDist().inv_cdf(1 - alpha)
    for n in (100, 150, 200, 300, 400, 500, 600, 800, 1000, 1300, 1600, 2000, 2500, 3000, 4000, 6000):
        hits = 0
        for seed in range(seeds):
            rng = np.random.default_rng(10**6 + seed)
            common = np.exp(rng.normal(0, 0.35, n))
            a = 0.01 * common * np.exp(rng.normal(0, 0.08, n))
            b = 0.01 * ratio * common * np.exp(rng.normal(0, 0.08, n))
            ranks = np.argsort(np.argsort(np.concatenate([a, b]))) + 1
            u = ranks[n:].sum() - n * (n + 1) / 2
            mu, sd = n * n / 2, math.sqrt(n * n * (2 * n + 1) / 12)
            hits += (u - mu) / sd > z
        if hits >= power * seeds:
            return n
    return -1


def summarize(sc: Scenario, results: list[tuple[str, int, str]]) -> dict[str, Any]:
    outcomes = [r[0] for r in results]
    n = len(results)
    row: dict[str, Any] = {"scenario": sc.name, "truth": sc.truth, "what": sc.what, "seeds": n}
    for o in (PROMOTE, PIN, INCONCLUSIVE):
        row[str(o)] = outcomes.count(str(o)) / n
    decided = [r[1] for r in results if r[0] != str(INCONCLUSIVE)]
    row["median_samples"] = int(np.median(decided)) if decided else None
    row["p90_samples"] = int(np.quantile(decided, 0.9)) if decided else None
    if sc.truth == "good":
        row["error"] = row[str(PIN)] + row[str(INCONCLUSIVE)]
        row["error_kind"] = "false pin (inconclusive included)"
    elif sc.truth == "bad":
        row["error"] = row[str(PROMOTE)]
        row["error_kind"] = "false promotion"
    pins = [r for r in results if r[0] == str(PIN)]
    if pins:
        row["pinned_within_2000"] = sum(1 for r in pins if r[1] <= 2000) / n
        reasons: dict[str, int] = {}
        for r in pins:
            key = r[2].split(":")[0].split("(")[0].strip()[:60]
            reasons[key] = reasons.get(key, 0) + 1
        row["pin_reasons"] = dict(sorted(reasons.items(), key=lambda kv: -kv[1])[:3])
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=1000)
    ap.add_argument("--only", action="append", help="scenario name (repeatable)")
    ap.add_argument("--aa-every", type=int, default=1,
                    help="every Nth sample also replayed to the baseline (1: shadow pairing, the default; 10: primary "
                         "pairing's default aa_rate)")  # fmt: skip
    ap.add_argument("--placements", type=int, default=DEFAULTS.placements,
                    help="sets of instances each latency verdict must hold on (the canary's `placements`)")  # fmt: skip
    ap.add_argument("--no-peer", action="store_true", help="skip the Mann-Whitney peer")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes (seeds are independent)")
    args = ap.parse_args(argv)
    params = dataclasses.replace(DEFAULTS.judge_params(), placements=args.placements)
    chosen = [s for s in SCENARIOS if not args.only or s.name in args.only]
    if not chosen:
        ap.error(f"no scenario named {args.only}; known: {', '.join(s.name for s in SCENARIOS)}")
    rows = []
    pool = multiprocessing.Pool(args.jobs) if args.jobs > 1 else None
    for sc in chosen:
        t0 = time.monotonic()
        work = [(sc, seed, params, args.aa_every) for seed in range(args.seeds)]
        results = pool.starmap(run_one, work, chunksize=8) if pool else [run_one(*w) for w in work]
        row = summarize(sc, results)
        row["seconds"] = round(time.monotonic() - t0, 1)
        rows.append(row)
        err = f"{row['error_kind']} {row['error']:.1%}" if "error" in row else "reported only"
        print(f"{sc.name:28s} {sc.truth:5s} promote {row['promote']:6.1%} pin {row['pin']:6.1%} "
                  f"inconclusive {row['inconclusive']:6.1%}  median n {row['median_samples']}  {err}  "
                  f"({row['seconds']} s)", flush=True, file=sys.stderr if args.json else sys.stdout)  # fmt: skip
    peer = None
    if not args.no_peer:
        mw = mann_whitney_fixed_n(1.10, min(args.seeds, 300))
        judge_row = next((r for r in rows if r["scenario"] == "slower-10"), None)
        peer = {"mann_whitney_fixed_n_for_10pct_slower_at_99pct": mw,
                "judge_median_samples": judge_row["median_samples"] if judge_row else None}  # fmt: skip
        if not args.json:
            print(f"peer: fixed-horizon Mann-Whitney needs n={mw} per side to pin a 10% slower candidate in 99% of "
                  f"seeds; the judge's median is {peer['judge_median_samples']}")  # fmt: skip
    if args.json:
        print(json.dumps({"params": dataclasses.asdict(params), "rows": rows, "peer": peer}, indent=2))
    bad = [r for r in rows if r.get("error", 0) > 0.01]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
