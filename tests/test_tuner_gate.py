"""The gate in the canary's terms: each gate request is one sample, judged by the per-request `compare`; a route
passes exactly when the upper bound of its out-of-tolerance rate (tunegate.stats.rate_bounds) is within the budget
and the pooled checks hold. Fast: no builds, no Triton."""

from __future__ import annotations

import tomllib
from pathlib import Path

import numpy as np
import pytest

from tunegate.stats import rate_bounds
from tunegate.tolerance import ToleranceSpec
from tuner import gate
from tuner.inputs import Batch, InputSet
from tuner.spec import GateSection, SpecError, parse_spec, samples_needed

ROOT = Path(__file__).resolve().parent.parent
TOL = ToleranceSpec.from_dict({"embedding": {"metric": "cosine", "threshold": 0.99}})


def requests(n: int, bad: set[int], seed: int = 0) -> tuple[gate.Outputs, gate.Outputs, InputSet]:
    """n requests of 1-4 rows; the rows of request i in `bad` are bent to cosine ~0.98, the others to ~0.9999."""
    rng = np.random.default_rng(seed)
    ref, cand, batches = [], [], []
    for i in range(n):
        rows = int(rng.integers(1, 5))
        r = rng.normal(size=(rows, 32)).astype(np.float32)
        noise = rng.normal(size=r.shape).astype(np.float32)
        noise -= (
            (noise * r).sum(axis=1, keepdims=True) / (r * r).sum(axis=1, keepdims=True) * r
        )  # orthogonal to r
        noise *= np.linalg.norm(r, axis=1, keepdims=True) / np.linalg.norm(noise, axis=1, keepdims=True)
        c = r + noise * np.float32(0.2 if i in bad else 0.01)  # cosine 1/sqrt(1+s^2): 0.981 or 0.99995
        if i in bad and rows > 1:
            c[1:] = r[1:]  # one bad row is enough: the request's worst row decides, as in the sidecar
        ref.append({"embedding": r})
        cand.append({"embedding": c})
        batches.append(Batch(f"capture-{i}", {"x": np.zeros((rows, 1), np.float32)}))
    return ref, cand, InputSet(tuple(batches), (), "test")


@pytest.mark.parametrize("n,k", [(300, 0), (600, 1), (600, 2), (1000, 7), (200, 40)])
def test_a_route_with_k_of_n_requests_out_of_tolerance_passes_exactly_when_the_bound_is_within_budget(
    n: int, k: int
) -> None:
    bad = set(np.random.default_rng(n + k).choice(n, size=k, replace=False).tolist())
    ref, cand, inputs = requests(n, bad)
    conf = 0.99
    lower, upper = rate_bounds(k, n, conf)
    assert 0.0 <= lower <= k / n <= upper <= 1.0
    for budget, expected in ((upper, True), (upper * 0.999, False), (min(0.99, upper * 1.5), True)):
        ev = gate.gate_evidence(
            ref, cand, TOL, GateSection(oot_budget=budget, confidence=conf, samples=n), inputs
        )
        rate = ev["rate"]
        assert (rate["k"], rate["n"]) == (k, n)
        assert rate["rate"] == pytest.approx(k / n) and rate["upper"] == upper and rate["lower"] == lower
        assert ev["passed"] is expected and rate["passed"] is expected, (budget, rate)
        assert rate["oot_inputs"] == [f"capture-{i}" for i in sorted(bad)][: gate.MAX_OOT_LISTED]
        assert ("<= budget" in ev["summary"]) is expected
    # the pooled statistic under the per-request tolerance is the worst request's: failing iff some request failed
    assert ev["outputs"]["embedding"]["passed"] is (k == 0)


def test_a_route_within_budget_still_fails_a_pooled_check_and_an_empty_gate_never_passes() -> None:
    ref, cand, inputs = requests(600, {7})
    floor = ToleranceSpec.from_dict({"embedding": {"metric": "cosine", "threshold": 0.985}})
    ok = gate.gate_evidence(ref, cand, TOL, GateSection(0.02, 0.99, 600), inputs)
    assert ok["passed"] and ok["rate"]["k"] == 1 and ok["checks"] == {}
    vetoed = gate.gate_evidence(ref, cand, TOL, GateSection(0.02, 0.99, 600, checks=floor), inputs)
    assert vetoed["rate"]["passed"] and not vetoed["checks_passed"] and not vetoed["passed"]
    assert vetoed["checks"]["embedding"]["worst_input"].startswith("capture-7 ")
    assert gate.error_value(vetoed) > 0 > gate.error_value(ok)
    empty = gate.oot_rate([], [], TOL, 0.5, 0.99)
    assert empty.n == 0 and not empty.passed


def _raw() -> dict:  # type: ignore[type-arg]
    raw = tomllib.loads((ROOT / "specs" / "tiny.toml").read_text())
    raw["model"]["source"] = str(ROOT / "pyproject.toml")  # any existing file: the spec is only parsed
    return raw


def test_the_spec_must_let_the_gate_see_enough_samples_for_its_budget() -> None:
    need = samples_needed(0.02, 0.99)
    assert rate_bounds(0, need, 0.99)[1] <= 0.02 < rate_bounds(0, need - 1, 0.99)[1]
    raw = _raw()
    raw["gate"] = {"oot_budget": 0.02, "confidence": 0.99, "samples": need - 1}
    with pytest.raises(SpecError, match=rf"\[gate\]\.samples = {need - 1} cannot pass.*samples >= {need}"):
        parse_spec(raw, ROOT / "specs" / "tiny.toml")
    raw["gate"]["samples"] = need
    assert parse_spec(raw, ROOT / "specs" / "tiny.toml").gate.samples == need
    del raw["gate"]["samples"]  # omitted: the fewest that can pass
    assert parse_spec(raw, ROOT / "specs" / "tiny.toml").gate.samples == need
    raw["gate"] = {"oot_budget": 0.0}
    with pytest.raises(SpecError, match=r"oot_budget must be within \(0, 1\)"):
        parse_spec(raw, ROOT / "specs" / "tiny.toml")
    raw["gate"] = {"confidence": 1.0}
    with pytest.raises(SpecError, match=r"confidence must be within"):
        parse_spec(raw, ROOT / "specs" / "tiny.toml")
    raw["gate"] = {"checks": {"y": {"metric": "linf"}}}
    with pytest.raises(SpecError, match=r"\[gate.checks\].*needs 'metric' and 'threshold'"):
        parse_spec(raw, ROOT / "specs" / "tiny.toml")
    raw = _raw()
    raw["inputs"]["batches"] = 8
    with pytest.raises(SpecError, match=r"\[inputs\]\.batches is now \[gate\]\.samples"):
        parse_spec(raw, ROOT / "specs" / "tiny.toml")


def test_an_onnxruntime_session_runs_the_gate_requests_at_once_with_the_outputs_of_one_at_a_time(
    tmp_path: Path,
) -> None:
    from tunegate import models
    from tuner.builders.ort import ort_runner

    runner = ort_runner(models.build_tiny(tmp_path / "tiny.onnx"), {"session": {"intra_op_num_threads": 1}})
    assert getattr(runner, "concurrent", False)
    rng = np.random.default_rng(3)
    inputs = InputSet(tuple(Batch(f"r{i}", {"x": rng.normal(size=(1 + i % 7, 16)).astype(np.float32)})
                            for i in range(200)), (), "test")  # fmt: skip
    one = gate.run_all(runner, inputs, workers=1)
    many = gate.run_all(runner, inputs, workers=4)
    assert len(many) == len(one) == 200
    for a, b, batch in zip(one, many, inputs.gate, strict=True):
        assert a.keys() == b.keys() and a["y"].shape[0] == batch.feeds["x"].shape[0]
        assert all(np.array_equal(a[k], b[k]) for k in a)  # in order, bit for bit

    calls: list[int] = []

    def plain(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:  # no `concurrent`: one at a time
        calls.append(feeds["x"].shape[0])
        return {"y": feeds["x"]}

    assert (
        [o["y"].shape[0] for o in gate.run_all(plain, inputs, workers=4)]
        == calls
        == [1 + i % 7 for i in range(200)]
    )
