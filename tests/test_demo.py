"""The whole loop, end to end, in both scenarios and in production's order: live traffic through the sidecar
(captured), tuning on that capture, the canary of the winner under load. Real Triton, sidecar, Locust, tuner."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tuner.release import RELEASE_KEYS

pytestmark = [pytest.mark.slow, pytest.mark.triton, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parent.parent


def run_demo(scenario: str, run_dir: Path) -> dict:  # type: ignore[type-arg]
    proc = subprocess.run(
        [sys.executable, "-m", "tunegate.app.cli", "demo", "--scenario", scenario, "--run-dir", str(run_dir), "--json"],
        capture_output=True, text=True, timeout=840, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)  # type: ignore[no-any-return]


def strict_gate() -> dict:  # type: ignore[type-arg]
    return tomllib.loads((ROOT / "specs" / "minilm.toml").read_text())["gate"]  # type: ignore[no-any-return]


def check_tuned_on_the_sidecars_capture(s: dict, run: Path) -> dict:  # type: ignore[type-arg]
    """The tuner's gate judged the requests the sidecar captured (not the traffic file Locust replayed)."""
    release = json.loads(
        (run / "model_repository" / "minilm" / str(s["candidate"]) / "release.json").read_text()
    )
    assert release["spec"]["inputs"] == {
        "source": "capture",
        "capture": str(run / "capture"),
        "max_length": 128,
    }
    written = sorted(p.name for p in (run / "capture").iterdir())
    assert written and all(n.startswith("capture-") and n.endswith("-0001.jsonl") for n in written), written
    g = release["gate"]
    assert g["source"] == "capture" and g["n"] == g["samples"] <= s["capture"]["requests"]
    assert (g["k"], g["n"], g["upper"], g["budget"]) == (s["gate"]["k"], s["gate"]["n"], s["gate"]["upper"],
                                                       s["gate"]["budget"])  # fmt: skip
    return release  # type: ignore[no-any-return]


def test_good_scenario_promotes_a_faster_route_within_tolerance(
    tmp_path: Path, minilm_onnx_path: Path
) -> None:
    run = tmp_path / "run"
    s = run_demo("good", run)
    budget = strict_gate()["oot_budget"]
    assert s["tune"]["winner"] and s["tune"]["speedup"] >= 1.05
    g = s["gate"]  # the gate, in the canary's terms: far within the budget
    assert g["passed"] and g["upper"] <= g["budget"] == budget and g["rate"] < budget / 3, g
    rejected = [r for r in s["gate_routes"] if r["status"] == "rejected"]
    assert rejected and all(r["rate"]["lower"] > budget for r in rejected), s["gate_routes"]
    assert s["decision"] == "promote", s["reasons"]
    assert s["live_version"] == s["candidate"] == s["tune"]["version"]
    assert s["load"]["failures"] == 0 and s["load"]["requests"] > 0
    ev = s["evidence"]
    assert ev["compared"] >= 300 and ev["oot_budget"] == budget
    assert (
        ev["out_of_tolerance"] / ev["compared"] < budget / 2
    )  # live, as in the gate: well within the budget
    release = check_tuned_on_the_sidecars_capture(s, run)
    # the written version: the route as built (six fused attention blocks, each layer's two projections kept
    # fp32), faster than the baseline by at least min_speedup at the speed bound's confidence. (That a written
    # version serves its in-process outputs is test_tuner_search's, on the tiny model: the same template.)
    assert set(RELEASE_KEYS) <= set(release)
    assert "keepffn" in release["route"] and release["builder_notes"]["fused"]["Attention"] == 6
    kept = release["builder_notes"]["kept_fp32"]
    assert len(kept) == 12, kept  # layer.0..5: output/dense, attention/output/dense
    assert release["latency"]["speedup_lower"] >= release["spec"]["objective"]["min_speedup"]
    # the promotion is on disk: Triton restarted from this repository serves the candidate
    cfg = (run / "model_repository" / "minilm" / "config.pbtxt").read_text()
    assert f"versions: [ {s['candidate']} ]" in cfg
    recs = [json.loads(x) for x in Path(s["records"]).read_text().splitlines() if x.strip()]
    assert [r["outcome"] for r in recs] == ["promote"]
    side = recs[0]["gate_vs_canary"]  # the gate's figures and the canary's, side by side in the record
    assert (side["gate"]["n"], side["gate"]["k"]) == (s["gate"]["n"], s["gate"]["k"]), side
    assert (
        side["canary"]["n"] == ev["compared"] and side["canary"]["budget"] == side["gate"]["budget"] == budget
    )
    report = Path(s["canary_report"]).read_text()
    assert len(report) > 10_000 and "Gate vs canary" in report and Path(s["tune_report"]).exists()
    assert "Candidate against baseline" in report and "capacity" in report


def test_bad_scenario_pins_the_baseline(tmp_path: Path, minilm_onnx_path: Path) -> None:
    run = tmp_path / "run"
    s = run_demo("bad", run)
    budget = strict_gate()["oot_budget"]
    assert "int8-channel" in s["tune"]["winner"] and "keepffn" not in s["tune"]["winner"]
    assert s["gate"]["passed"] and s["gate"]["k"] == 0  # the loose tolerance let it through
    assert s["decision"] == "pin", s["reasons"]
    # pinned for the stated reason: far more responses out of the strict tolerance than the budget allows
    assert any("out of tolerance" in r for r in s["reasons"]), s["reasons"]
    ev = s["evidence"]
    assert ev["oot_budget"] == budget and ev["out_of_tolerance"] >= 3
    assert ev["out_of_tolerance"] / ev["compared"] > 2 * budget and ev["oot_rate_lower"] > budget, ev
    release = check_tuned_on_the_sidecars_capture(s, run)
    assert release["tolerance"]["embedding"]["threshold"] < s["canary"]["tolerance"]["embedding"]["threshold"]
    assert s["live_version"] == 1 and s["load"]["failures"] == 0
    cfg = (run / "model_repository" / "minilm" / "config.pbtxt").read_text()
    assert "versions: [ 1 ]" in cfg
