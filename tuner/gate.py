"""The accuracy gate: a candidate's outputs against the reference's on the spec's inputs and edge cases.

The gate speaks the canary's language. Every gate request (a batch of the declared distribution, an
edge case, or one captured request) is one sample; a sample is out of tolerance (OOT) when
tunegate.tolerance.compare fails for it, exactly the per-request check the sidecar runs on live
traffic. A route passes when the one-sided upper bound of its OOT rate (tunegate.stats.rate_bounds,
the anytime-valid bound the sidecar's judge uses) is at most the spec's `[gate].oot_budget`, and
the pooled `[gate.checks]` (worst sample or quantile over every gate row; compare_many) hold too.

This module runs both sides over the gate batches and turns the verdict into the evidence the
cache, the report and release.json keep: k, n, the rate and its bounds, budget and confidence, which
requests broke the tolerance, and per output the pooled statistic and its worst sample.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from tunegate import codec
from tunegate.classes import request_class
from tunegate.stats import rate_bounds
from tunegate.tolerance import ToleranceSpec, Verdict, compare, compare_many
from tuner.builders.base import Runner
from tuner.inputs import InputSet
from tuner.spec import GateSection

Outputs = list[dict[str, npt.NDArray[Any]]]
MAX_OOT_LISTED = 20  # the evidence names at most this many out-of-tolerance requests
MAX_GATE_WORKERS = 8


def request_classes(inputs: InputSet) -> dict[str, int]:
    """Gate requests per request class, named as the sidecar's judge names live ones (batch, sequence bucket)."""
    counts: dict[str, int] = {}
    for b in inputs.gate:
        body, hl = codec.encode_request(b.feeds, binary=True)
        headers = [(b"Inference-Header-Content-Length", str(hl).encode())] if hl is not None else []
        cls = request_class(body, headers)
        counts[cls] = counts.get(cls, 0) + 1
    return dict(sorted(counts.items()))


def gate_workers() -> int:
    """Gate requests run at once by a runner that allows it: one per core, at most MAX_GATE_WORKERS."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(MAX_GATE_WORKERS, cores))


def run_all(runner: Runner, inputs: InputSet, workers: int | None = None) -> Outputs:
    """The runner's outputs for every gate request, in order. A runner that declares itself safe to call from
    several threads at once (`concurrent = True`: an onnxruntime session, which releases the GIL) runs
    `workers` requests at a time (default: gate_workers()); each request's outputs are the same either way
    (one request, one call, the session's own threads). Others run one request at a time."""
    feeds = [b.feeds for b in inputs.gate]
    n = gate_workers() if workers is None else workers
    if n <= 1 or len(feeds) < 2 or not getattr(runner, "concurrent", False):
        return [runner(f) for f in feeds]
    with concurrent.futures.ThreadPoolExecutor(max_workers=n, thread_name_prefix="gate") as pool:
        return list(pool.map(runner, feeds))


def judge(reference: Outputs, candidate: Outputs, tolerance: ToleranceSpec) -> Verdict:
    return compare_many(reference, candidate, tolerance)


def _outputs(verdict: Verdict, inputs: InputSet) -> dict[str, dict[str, Any]]:
    outs = {}
    for name, ov in verdict.outputs.items():
        d = ov.to_dict()
        d["worst_input"] = inputs.locate(ov.worst_sample) if ov.worst_sample >= 0 else None
        outs[name] = d
    return outs


def evidence(verdict: Verdict, inputs: InputSet) -> dict[str, Any]:
    """Per-output verdict dicts of a pooled comparison, each naming where its worst sample came from."""
    return {"passed": verdict.passed, "outputs": _outputs(verdict, inputs), "summary": verdict.summary()}


@dataclasses.dataclass(frozen=True)
class RateVerdict:
    """The out-of-tolerance rate of a route over the gate's samples, with the judge's bounds."""

    k: int  # samples out of tolerance
    n: int  # samples compared
    lower: float
    upper: float
    budget: float
    confidence: float
    oot: tuple[int, ...]  # indices of the samples out of tolerance

    @property
    def rate(self) -> float:
        return self.k / self.n if self.n else 0.0

    @property
    def passed(self) -> bool:
        return self.n > 0 and self.upper <= self.budget

    def describe(self) -> str:
        op = "<=" if self.passed else ">"
        return (
            f"out of tolerance {self.k}/{self.n} = {100 * self.rate:.2f}% (upper bound {100 * self.upper:.2f}% "
            f"at {self.confidence:g}) {op} budget {100 * self.budget:g}%"
        )

    def to_dict(self, inputs: InputSet | None = None) -> dict[str, Any]:
        d: dict[str, Any] = {
            "k": self.k, "n": self.n, "rate": self.rate, "lower": self.lower, "upper": self.upper,
            "budget": self.budget, "confidence": self.confidence, "passed": self.passed,
        }  # fmt: skip
        if inputs is not None:
            d["oot_inputs"] = [inputs.gate[i].label for i in self.oot[:MAX_OOT_LISTED]]
        return d


def oot_rate(
    reference: Outputs, candidate: Outputs, tolerance: ToleranceSpec, budget: float, confidence: float
) -> RateVerdict:
    """Each request judged on its own by `compare` (the sidecar's live check), then the rate's bounds."""
    if len(reference) != len(candidate):
        raise ValueError(f"{len(reference)} reference requests but {len(candidate)} candidate requests")
    oot = tuple(i for i, (r, c) in enumerate(zip(reference, candidate, strict=True))
                if not compare(r, c, tolerance).passed)  # fmt: skip
    n = len(reference)
    lower, upper = rate_bounds(len(oot), n, confidence)
    return RateVerdict(len(oot), n, lower, upper, budget, confidence, oot)


def gate_evidence(
    reference: Outputs, candidate: Outputs, tolerance: ToleranceSpec, gate: GateSection, inputs: InputSet
) -> dict[str, Any]:
    """The gate's verdict and its evidence (what the cache, the report and release.json keep).

    `passed` needs the rate's upper bound within the budget and every `[gate.checks]` tolerance;
    `outputs` is each output's pooled statistic under the per-request tolerance (its worst sample),
    shown for the report's scatter and never a reason on its own.
    """
    rate = oot_rate(reference, candidate, tolerance, gate.oot_budget, gate.confidence)
    pooled = compare_many(reference, candidate, tolerance)
    checks = compare_many(reference, candidate, gate.checks) if gate.checks is not None else None
    passed = rate.passed and (checks is None or checks.passed)
    summary = rate.describe()
    if checks is not None:
        summary += "; checks: " + checks.summary()
    if rate.k:
        worst = "; ".join(o.reason for o in pooled.outputs.values())
        summary += f"; worst request: {worst}"
    return {
        "passed": passed,
        "rate": rate.to_dict(inputs),
        "classes": request_classes(inputs),
        "checks": _outputs(checks, inputs) if checks is not None else {},
        "checks_passed": checks is None or checks.passed,
        "outputs": _outputs(pooled, inputs),
        "summary": summary,
    }


def error_value(accuracy: dict[str, Any]) -> float:
    """How far a route is from failing its tightest check, for the report's error axis (0 = at threshold)."""
    worst = -np.inf
    rate = accuracy.get("rate")
    if rate:  # the gate's verdict: the rate's bound and the pooled checks (the outputs are information)
        worst = float(rate["upper"]) - float(rate["budget"])
    for d in (accuracy.get("checks", {}) if rate else accuracy.get("outputs", {})).values():
        if d.get("threshold") is None:
            continue
        value, thr = float(d["value"]), float(d["threshold"])
        higher = d["metric"] in ("cosine", "topk")
        worst = max(worst, (thr - value) if higher else (value - thr))
    return float(worst) if np.isfinite(worst) else 0.0


def identical(a: Sequence[dict[str, npt.NDArray[Any]]], b: Sequence[dict[str, npt.NDArray[Any]]]) -> bool:
    """Bit-identical outputs (the rebuild check)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if set(x) != set(y):
            return False
        for k in x:
            if x[k].shape != y[k].shape or x[k].tobytes() != y[k].tobytes():
                return False
    return True
