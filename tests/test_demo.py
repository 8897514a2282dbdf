"""The whole loop, end to end, in both scenarios: real tuning, real Triton, real sidecar, real Locust."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.triton, pytest.mark.timeout(900)]


def run_demo(scenario: str, run_dir: Path) -> dict:  # type: ignore[type-arg]
    proc = subprocess.run(
        [sys.executable, "-m", "tunegate.cli", "demo", "--scenario", scenario, "--run-dir", str(run_dir), "--json"],
        capture_output=True, text=True, timeout=840,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)  # type: ignore[no-any-return]


def test_good_scenario_promotes_a_faster_route_within_tolerance(tmp_path: Path, minilm_onnx_path: Path) -> None:
    s = run_demo("good", tmp_path / "run")
    assert s["tune"]["winner"] and s["tune"]["speedup"] > 1.0
    assert s["decision"] == "promote", s["reasons"]
    assert s["live_version"] == s["candidate"] == s["tune"]["version"]
    assert s["load"]["failures"] == 0 and s["load"]["requests"] > 0
    ev = s["evidence"]
    assert ev["compared"] >= 300 and ev["oot_rate_upper"] <= ev["oot_budget"] + ev["aa_rate"] + 1e-9
    # the promotion is on disk: Triton restarted from this repository serves the candidate
    cfg = (tmp_path / "run" / "model_repository" / "minilm" / "config.pbtxt").read_text()
    assert f"versions: [ {s['candidate']} ]" in cfg
    recs = [json.loads(x) for x in Path(s["records"]).read_text().splitlines() if x.strip()]
    assert [r["outcome"] for r in recs] == ["promote"]
    assert Path(s["canary_report"]).stat().st_size > 10_000 and Path(s["tune_report"]).exists()


def test_bad_scenario_pins_the_baseline(tmp_path: Path, minilm_onnx_path: Path) -> None:
    s = run_demo("bad", tmp_path / "run")
    assert "int8-channel" in s["tune"]["winner"] and "keepffn" not in s["tune"]["winner"]
    assert s["decision"] == "pin", s["reasons"]
    assert s["live_version"] == 1 and s["load"]["failures"] == 0
    assert s["evidence"]["out_of_tolerance"] > 0
    cfg = (tmp_path / "run" / "model_repository" / "minilm" / "config.pbtxt").read_text()
    assert "versions: [ 1 ]" in cfg
