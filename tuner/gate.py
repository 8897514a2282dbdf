"""The accuracy gate: a candidate's outputs against the reference's on the spec's inputs and edge cases.

The comparison itself is tunegate.tolerance.compare_many (the sidecar runs the same code live);
this module runs both sides over the gate batches and turns the verdict into the evidence the
cache, the report and release.json keep (which output, metric, value, threshold, worst sample).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tunegate.tolerance import ToleranceSpec, Verdict, compare_many
from tuner.builders.base import Runner
from tuner.inputs import InputSet

Outputs = list[dict[str, np.ndarray]]


def run_all(runner: Runner, inputs: InputSet) -> Outputs:
    return [runner(b.feeds) for b in inputs.gate]


def judge(reference: Outputs, candidate: Outputs, tolerance: ToleranceSpec) -> Verdict:
    return compare_many(reference, candidate, tolerance)


def evidence(verdict: Verdict, inputs: InputSet) -> dict[str, Any]:
    """Per-output verdict dicts, each naming where its worst sample came from."""
    outs = {}
    for name, ov in verdict.outputs.items():
        d = ov.to_dict()
        d["worst_input"] = inputs.locate(ov.worst_sample) if ov.worst_sample >= 0 else None
        outs[name] = d
    return {"passed": verdict.passed, "outputs": outs, "summary": verdict.summary()}


def error_value(accuracy: dict[str, Any]) -> float:
    """How far a route is from failing its tightest output, for the report's error axis (0 = at threshold)."""
    worst = -np.inf
    for d in accuracy.get("outputs", {}).values():
        if d.get("threshold") is None:
            continue
        value, thr = float(d["value"]), float(d["threshold"])
        higher = d["metric"] in ("cosine", "topk")
        worst = max(worst, (thr - value) if higher else (value - thr))
    return float(worst) if np.isfinite(worst) else 0.0


def identical(a: Sequence[dict[str, np.ndarray]], b: Sequence[dict[str, np.ndarray]]) -> bool:
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
