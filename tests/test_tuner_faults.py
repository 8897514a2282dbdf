"""Crash, hang, budget and kill -9 isolation of the search, on the tiny model.

`FaultyOrtBuilder` is a test double at the builder seam: the real ONNX Runtime builder plus a
`-fault` knob that makes the child process crash, hang, fail or dawdle. The tuner runs it in a
child process exactly like the real one (it is named `module:Class` in the spec's [search].backend).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from tests.test_tuner_search import ROOT, run_cli, tiny_project
from tunegate.procs import TUNE_KILL_AT_ENV
from tuner.builders.base import Artifact, BuildContext, BuildError
from tuner.builders.ort import OrtBuilder
from tuner.cache import CacheError
from tuner.routes import Knob
from tuner.search import tune
from tuner.spec import load_spec

BACKEND = "tests.test_tuner_faults:FaultyOrtBuilder"


class FaultyOrtBuilder(OrtBuilder):
    """Test double: the real ORT builder with a fault injected into the child process per route."""

    name = "faulty-onnxruntime"
    knobs = (
        *OrtBuilder.knobs,
        Knob("fault", ("none", "crash", "hang", "error", "slow"), "none", "test fault"),
    )

    def build(self, source: Path, route: Mapping[str, str], out: Path, ctx: BuildContext) -> Artifact:
        fault = route.get("fault", "none")
        if fault == "crash":
            os.abort()
        if fault == "hang":
            time.sleep(3600)
        if fault == "error":
            raise BuildError("this route cannot be built: injected error")
        if fault == "slow":
            time.sleep(1.5)
        return super().build(source, route, out, ctx)


def _no_temp_builds(workdir: Path) -> bool:
    return not list((workdir / "builds").glob(".tmp-*"))


def test_a_crash_a_hang_and_an_error_fail_only_their_route(tmp_path: Path) -> None:
    spec = load_spec(
        tiny_project(
            tmp_path,
            # -opt=disable: the healthy route must differ from the baseline to be a winner
            search={
                "backend": BACKEND,
                "routes": "-fault=[none|crash|hang|error] -opt=disable",
                "build_timeout_s": 4.0,
            },
            bench={"repeats": 3, "e2e": False},
            objective={"min_speedup": 0.01},
        )
    )
    t0 = time.monotonic()
    result = tune(spec, progress=False, write=False)
    by_fault = {r.knobs["fault"]: r for r in result.routes}
    assert by_fault["none"].status == "passed"
    assert by_fault["crash"].status == "failed" and "killed by signal 6" in (by_fault["crash"].error or "")
    assert by_fault["hang"].status == "failed" and "timed out after 4s" in (by_fault["hang"].error or "")
    assert by_fault["error"].status == "failed" and "injected error" in (by_fault["error"].error or "")
    assert time.monotonic() - t0 < 60
    assert result.winner is not None and result.winner.knobs["fault"] == "none"
    assert _no_temp_builds(spec.workdir)
    errors = {
        json.loads(line).get("error")
        for line in spec.workdir.joinpath("cache.jsonl").read_text().splitlines()
    }
    assert any(e and "killed by signal 6" in e for e in errors)


def test_the_budget_stops_the_search_cleanly_and_keeps_what_finished(tmp_path: Path) -> None:
    spec = load_spec(
        tiny_project(
            tmp_path,
            search={"backend": BACKEND, "routes": "-fault=[none|hang|error]", "build_timeout_s": 120.0},
            bench={"repeats": 3, "e2e": False},
            objective={"min_speedup": 0.01},
        )
    )
    t0 = time.monotonic()
    result = tune(spec, budget_s=8.0, progress=False, write=False)
    assert time.monotonic() - t0 < 40
    assert result.stopped_by_budget
    assert [r.knobs["fault"] for r in result.routes] == ["none"]  # the hang was cut by the budget, not judged
    assert "time budget" in result.reason
    recorded = [json.loads(x) for x in spec.workdir.joinpath("cache.jsonl").read_text().splitlines()]
    assert [r["knobs"]["fault"] for r in recorded if r["kind"] == "route"] == ["none"]
    assert _no_temp_builds(spec.workdir)


def _route_lines(cache: Path) -> list[dict[str, Any]]:
    return [r for r in map(json.loads, cache.read_text().splitlines()) if r.get("kind") == "route"]


def test_continue_after_kill_9_resumes_without_redoing_finished_routes(tmp_path: Path) -> None:
    spec_path = tiny_project(
        tmp_path,
        search={"backend": BACKEND, "routes": "-fault=[slow|none] -opt=[all|disable|basic|extended]"},
        bench={"repeats": 3, "e2e": False},
        objective={"min_speedup": 0.01},
    )
    cache = tmp_path / "work" / "cache.jsonl"
    cmd = [sys.executable, "-m", "tunegate.app.cli", "tune", str(spec_path), "--json", "--no-write"]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (not cache.exists() or len(_route_lines(cache)) < 2):
            time.sleep(0.05)
        assert proc.poll() is None, "the search finished before it could be killed"
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    finished = [r["route"] for r in _route_lines(cache)]
    assert 2 <= len(finished) < 5

    done = run_cli(*cmd[3:], "--continue")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert len(summary["routes"]) == 5
    assert {r["route"] for r in summary["routes"] if r["reused"]} == set(finished)
    lines = _route_lines(cache)
    assert len(lines) == 5 and len({r["route"] for r in lines}) == 5  # nothing done twice
    assert sum(1 for x in cache.read_text().splitlines() if json.loads(x).get("kind") == "header") == 1


def test_a_changed_spec_refuses_to_resume(tmp_path: Path) -> None:
    spec_path = tiny_project(tmp_path, search={"routes": "-opt=all"}, bench={"repeats": 3, "e2e": False})
    tune(load_spec(spec_path), progress=False, write=False)
    spec_path.write_text(spec_path.read_text().replace("threshold = 0.0001", "threshold = 0.001", 1))
    with pytest.raises(CacheError, match="the spec changed since this search started"):
        tune(load_spec(spec_path), resume=True, progress=False, write=False)
    proc = run_cli("tune", str(spec_path), "--continue")
    assert proc.returncode == 2 and "the spec changed" in proc.stderr


def test_a_changed_source_or_baseline_refuses_to_resume_and_says_which(tmp_path: Path) -> None:
    spec_path = tiny_project(tmp_path, search={"routes": "-opt=all"}, bench={"repeats": 3, "e2e": False})
    tune(load_spec(spec_path), progress=False, write=False)
    tune(load_spec(spec_path), resume=True, progress=False, write=False)  # nothing changed: resumes
    runtime = tmp_path / "repo" / "tiny" / "1" / "runtime.json"
    runtime.write_text(runtime.read_text().replace("{", '{"note": "edited", ', 1))
    with pytest.raises(CacheError, match="the baseline version's files changed since this search started"):
        tune(load_spec(spec_path), resume=True, progress=False, write=False)
    with (tmp_path / "tiny.onnx").open("ab") as f:
        f.write(b"\0")
    with pytest.raises(CacheError, match="the source model and the baseline version's files changed"):
        tune(load_spec(spec_path), resume=True, progress=False, write=False)


def test_a_second_search_in_the_same_workdir_is_refused_and_stale_builds_are_cleared(tmp_path: Path) -> None:
    import fcntl

    from tuner.search import TuneError

    spec = load_spec(
        tiny_project(tmp_path, search={"routes": "-opt=disable"}, bench={"repeats": 3, "e2e": False})
    )
    spec.workdir.mkdir(parents=True)
    with open(spec.workdir / ".lock", "a+") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        with pytest.raises(TuneError, match="another search is running"):
            tune(spec, progress=False, write=False)
    stale = spec.workdir / "builds" / ".tmp-abc-123"
    stale.mkdir(parents=True)
    tune(spec, progress=False, write=False)
    assert not stale.exists()


def _workers(tag: str) -> list[int]:
    """PIDs of build workers whose command line mentions `tag` (this test's directory)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if b"tuner.builders.worker" in cmd and tag.encode() in cmd:
                out.append(int(entry.name))
    return out


@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's")
def test_a_tuner_killed_mid_build_leaves_no_build_worker(tmp_path: Path) -> None:
    spec_path = tiny_project(tmp_path, search={"backend": BACKEND, "routes": "-fault=hang -opt=all"},
                             bench={"repeats": 3, "e2e": False})  # fmt: skip
    cmd = [sys.executable, "-m", "tunegate.app.cli", "tune", str(spec_path), "--json", "--no-write"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not _workers(str(tmp_path)):
            time.sleep(0.1)
        assert _workers(str(tmp_path)), "no build worker started"
        proc.kill()  # the tuner alone: its worker runs in a process group of its own
    finally:
        proc.wait(timeout=30)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _workers(str(tmp_path)):
        time.sleep(0.1)
    left = _workers(str(tmp_path))
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"build workers outlived the tuner: {left}"


def test_continue_never_writes_a_version_twice_and_clears_stale_staging(tmp_path: Path) -> None:
    """A run killed right after writing its version (or any rerun of a finished search) with --continue: the
    version is found by its release record (spec digest, route, baseline), not written again."""
    spec_path = tiny_project(tmp_path, search={"routes": "-opt=[all|disable]"}, bench={"repeats": 3, "e2e": False},
                             objective={"min_speedup": 0.01})  # fmt: skip
    first = run_cli("tune", str(spec_path), "--json")
    assert first.returncode == 0, first.stderr
    written = json.loads(first.stdout)["version"]
    assert written == 2
    model_dir = tmp_path / "repo" / "tiny"
    (model_dir / ".staging-killed").mkdir()  # what a writer killed mid-write leaves
    again = run_cli("tune", str(spec_path), "--json", "--continue")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["version"] == written
    assert sorted(p.name for p in model_dir.iterdir()) == ["1", "2", "config.pbtxt"]


def _processes_under(tag: str) -> list[tuple[int, str]]:
    """(PID, command) of every process whose command line mentions `tag` (this test's directory)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmd = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if tag.encode() in cmd:
                out.append((int(entry.name), cmd.replace(b"\0", b" ").decode(errors="replace")[:200]))
    return out


def _wait_gone(tag: str, timeout_s: float = 15.0) -> list[tuple[int, str]]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and _processes_under(tag):
        time.sleep(0.1)
    left = _processes_under(tag)
    for pid, _ in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return left


@pytest.mark.triton
@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's")
@pytest.mark.parametrize("phase", ["search", "serving", "writing", "written"])
def test_a_tuner_killed_at_each_phase_then_continued_leaves_nothing_behind_and_one_new_version(
    tmp_path: Path, phase: str
) -> None:
    """kill -9 of the tuner alone (not its process group) at each phase, then `--continue`: no process of the
    run is left, no e2e or staging directory, and the repository holds exactly one new version."""
    spec_path = tiny_project(tmp_path, search={"routes": "-opt=[all|disable]"},
                             bench={"repeats": 3, "e2e_requests": 8}, objective={"min_speedup": 0.01})  # fmt: skip
    cmd = [sys.executable, "-m", "tunegate.app.cli", "tune", str(spec_path), "--json"]
    env = {**os.environ, TUNE_KILL_AT_ENV: phase}
    killed = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stderr[-2000:])
    assert not _wait_gone(str(tmp_path)), f"processes outlived the tuner killed at {phase!r}"
    model_dir = tmp_path / "repo" / "tiny"
    if phase == "writing":
        assert list(model_dir.glob(".staging-*")), "the kill point did not fall inside the write"
    if phase == "written":
        assert (model_dir / "2" / "release.json").exists()

    done = run_cli("tune", str(spec_path), "--json", "--continue")
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["version"] == 2
    assert not _wait_gone(str(tmp_path))
    assert sorted(p.name for p in model_dir.iterdir()) == ["1", "2", "config.pbtxt"]
    assert not list((tmp_path / "work").glob("e2e-*")) and _no_temp_builds(tmp_path / "work")
    written = [json.loads(x) for x in (tmp_path / "work" / "cache.jsonl").read_text().splitlines()]
    assert [r["version"] for r in written if r.get("kind") == "written"] == [2]
