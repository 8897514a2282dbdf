"""The tuner end to end on the tiny model: real ONNX Runtime builds in child processes, the real gate,
the winner written as a new version that the real embedded Triton serves with the in-process outputs."""

from __future__ import annotations

import copy
import dataclasses
import json
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tunegate import models
from tunegate.repository import onnx_version_files, sha256_file, write_config, write_version
from tunegate.tolerance import ToleranceSpec
from tuner.builders.ort import ort_runner
from tuner.release import RELEASE_KEYS
from tuner.search import tune
from tuner.spec import load_spec

ROOT = Path(__file__).resolve().parent.parent


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + " }"
    return repr(value)


def dump_toml(doc: dict[str, Any], prefix: str = "") -> str:
    """Enough TOML for these specs (tables of scalars, arrays and inline tables)."""
    lines, tables = [], []
    for k, v in doc.items():
        if isinstance(v, dict) and not (prefix == "inputs" or k == "shapes"):
            tables.append((k, v))
        else:
            lines.append(f"{k} = {_toml(v)}")
    for k, v in tables:
        name = f"{prefix}.{k}" if prefix else k
        lines.append(f"\n[{name}]\n" + dump_toml(v, name))
    return "\n".join(lines)


def tiny_project(tmp_path: Path, **sections: dict[str, Any]) -> Path:
    """A repository with tiny version 1 (the baseline) and a spec from specs/tiny.toml with `sections` merged in."""
    src = models.build_tiny(tmp_path / "tiny.onnx")
    repo = tmp_path / "repo"
    write_version(repo, "tiny", onnx_version_files(src), version=1)
    write_config(repo, models.tiny_config())
    doc = copy.deepcopy(tomllib.loads((ROOT / "specs" / "tiny.toml").read_text()))
    doc["model"].update(source=str(src), repository=str(repo))
    doc["output"] = {"workdir": str(tmp_path / "work")}
    for name, values in sections.items():
        doc.setdefault(name, {}).update(values)
    path = tmp_path / "tiny.toml"
    path.write_text(dump_toml(doc) + "\n")
    return path


def run_cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """`tunegate ARGS` in a child process, from the project root."""
    cmd = [sys.executable, "-m", "tunegate.app.cli", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False)


def tree_digest(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): sha256_file(p) for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.triton
def test_the_gate_rejects_int8_keeps_fp32_and_the_written_version_serves_the_in_process_outputs(
    tmp_path: Path, triton_factory: Any
) -> None:
    spec = load_spec(
        tiny_project(tmp_path, objective={"min_speedup": 0.01}, bench={"repeats": 5, "e2e_requests": 8})
    )
    repo = spec.model.repository
    before = tree_digest(repo / "tiny")

    result = tune(spec, progress=False)

    by_route = {r.knobs["quant"] + "/" + r.knobs["opt"]: r for r in result.routes}
    int8 = by_route["int8-channel/all"]
    assert int8.status == "rejected"
    # every gate request is one sample of the out-of-tolerance rate: int8 breaks linf 1e-4 on (nearly) all of them
    rate = int8.accuracy["rate"]
    assert rate["n"] == spec.gate.samples + 2 and rate["k"] > rate["n"] // 2  # + the two edge cases
    assert rate["upper"] > rate["budget"] == spec.gate.oot_budget and rate["passed"] is False
    assert by_route["fp32/disable"].accuracy["rate"]["k"] == 0
    worst = int8.accuracy["outputs"]["y"]
    assert worst["passed"] is False and worst["value"] > worst["threshold"] == 1e-4
    assert worst["worst_input"].startswith(("dist-", "edge:"))
    assert by_route["fp32/disable"].status == "passed"
    assert by_route["fp32/disable"].accuracy["outputs"]["y"]["value"] < 1e-4

    # The winner: the fastest passing route, written as version 2; version 1 and config.pbtxt untouched.
    assert result.winner is not None and result.winner.status == "passed"
    assert result.version == 2 and result.version_path == repo / "tiny" / "2"
    after = tree_digest(repo / "tiny")
    assert {k: v for k, v in after.items() if not k.startswith("2/")} == before
    assert not list((repo / "tiny").glob(".staging-*"))

    release = json.loads((result.version_path / "release.json").read_text())
    assert set(RELEASE_KEYS) <= set(release)
    assert release["form"] == "python" and "serving" not in release
    assert sorted(p.name for p in result.version_path.iterdir()) == [
        "model.onnx", "model.py", "release.json", "runtime.json"
    ]  # fmt: skip
    assert release["version"] == 2 and release["baseline_version"] == 1
    assert release["route"] == result.winner.route
    assert release["search"] == {
        "backend": "onnxruntime",
        "strategy": "fast",
        "budget_s": 120.0,
        "routes": "-opt=[all|disable|basic] -quant=[fp32|int8-channel]",
    }
    assert release["knobs"] == result.winner.knobs
    assert release["spec_digest"] == spec.digest and release["spec"]["model"]["name"] == "tiny"
    assert ToleranceSpec.from_dict(release["tolerance"]).to_dict() == spec.tolerance.to_dict()
    assert release["artifact_sha256"] == sha256_file(result.version_path / "model.onnx")
    assert release["rebuild_identical"] is True
    assert release["accuracy"]["y"]["passed"] is True
    g = release["gate"]  # the gate in the canary's terms, next to its budget
    assert (g["k"], g["n"], g["oot_rate"]) == (0, spec.gate.samples + 2, 0.0) and g["passed"] is True
    assert g["upper"] <= g["budget"] == 0.02 and g["confidence"] == 0.99 and g["lower"] == 0.0
    assert release["latency"]["speedup"] == pytest.approx(
        release["latency"]["baseline"]["objective_ms"] / release["latency"]["candidate"]["objective_ms"]
    )
    assert release["latency"]["triton"]["candidate"]["max_abs_diff_vs_in_process"] == 0.0
    assert {"onnxruntime", "onnx", "numpy", "python", "cpu"} <= set(release["versions"])
    assert release["build_seconds"] > 0 and len(release["inputs_digest"]) == 64
    report = result.report_path.read_text()
    assert report.count("<tr>") == 1 + len(result.routes)
    assert f"0/{spec.gate.samples + 2}</td>" in report and "<th>out of tolerance</th>" in report

    # The real Triton loads version 2 (config override only; config.pbtxt stays) and serves what ran in process.
    server = triton_factory(repo)
    cfg = dataclasses.replace(models.tiny_config(), versions=(2,))
    server.load("tiny", config=cfg.to_json())
    runtime = json.loads((result.version_path / "runtime.json").read_text())
    assert runtime["config_entries"]["session.intra_op.allow_spinning"] == "0"
    expected = ort_runner(result.version_path / "model.onnx", runtime)({"x": np.ones((3, 16), np.float32)})
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(server.http_address)
    try:
        inp = httpclient.InferInput("x", [3, 16], "FP32")
        inp.set_data_from_numpy(np.ones((3, 16), np.float32))
        served = client.infer("tiny", [inp], model_version="2")
    finally:
        client.close()
    np.testing.assert_array_equal(served.as_numpy("y"), expected["y"])
    np.testing.assert_array_equal(served.as_numpy("score"), expected["score"])


def test_no_route_beating_the_baseline_is_a_clean_result_with_nothing_written(tmp_path: Path) -> None:
    spec_path = tiny_project(
        tmp_path,
        objective={"min_speedup": 1000.0},
        bench={"repeats": 3, "e2e": False},
        search={"routes": "-opt=[all|disable]"},
    )
    proc = run_cli("tune", str(spec_path), "--json")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["winner"] is None and summary["version"] is None
    assert "no route beats the baseline within tolerance" in summary["reason"]
    assert summary["counts"]["passed"] == 2
    assert sorted(p.name for p in (tmp_path / "repo" / "tiny").iterdir()) == ["1", "config.pbtxt"]
    assert Path(summary["report"]).is_file()


def test_a_route_that_builds_the_baseline_itself_is_not_released(tmp_path: Path) -> None:
    spec = load_spec(
        tiny_project(
            tmp_path,
            objective={"min_speedup": 0.01},
            bench={"repeats": 3, "e2e": False},
            search={"routes": "-opt=all -quant=fp32"},
        )
    )
    result = tune(spec, progress=False)
    assert [r.status for r in result.routes] == ["passed"]
    assert result.winner is None and "build exactly the baseline" in result.reason
    assert sorted(p.name for p in (tmp_path / "repo" / "tiny").iterdir()) == ["1", "config.pbtxt"]


def test_routes_and_dry_run_list_knobs_and_routes_without_building(tmp_path: Path) -> None:
    spec_path = tiny_project(tmp_path)
    for args in (
        ["routes", str(spec_path), "--json"],
        ["tune", str(spec_path), "--dry-run", "--strategy", "full", "--json"],
    ):
        proc = run_cli(*args)
        assert proc.returncode == 0, proc.stderr
        plan = json.loads(proc.stdout)
        assert {k["name"] for k in plan["knobs"]} == {"opt", "fusion", "quant", "threads", "exec"}
        assert plan["space"]["opt"] == ["all", "disable", "basic"]
    assert len(plan["routes"]) == 6 and plan["strategy"] == "full"
    assert not (tmp_path / "work").exists()


def test_bad_input_exits_2_with_a_clear_message(tmp_path: Path) -> None:
    spec_path = tiny_project(tmp_path, search={"routes": "-quant=int4"})
    proc = run_cli("tune", str(spec_path))
    assert proc.returncode == 2
    assert "-quant=int4: not an allowed value" in proc.stderr
    proc = run_cli("tune", str(spec_path), "--budget-s", "0")
    assert proc.returncode == 2 and "--budget-s must be a number of seconds > 0" in proc.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text("[model]\nname = 'x'\n")
    proc = run_cli("routes", str(bad))
    assert proc.returncode == 2 and "[model].source is required" in proc.stderr


def test_a_baseline_without_its_model_file_is_a_clear_error_not_a_traceback(tmp_path: Path) -> None:
    """As on a fresh clone before `tunegate model prepare`: the version directory is there, its model file not."""
    spec_path = tiny_project(tmp_path, bench={"repeats": 3, "e2e": False})
    (tmp_path / "repo" / "tiny" / "1" / "model.onnx").unlink()
    proc = run_cli("tune", str(spec_path))
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    assert "model.onnx does not exist" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
