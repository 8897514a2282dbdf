"""The serving search on the real embedded Triton (tiny model): every configuration gated on its served answers
and measured with perf_analyzer in alternating rounds; the winner, if any, written as a version with its
serving configuration. Which configuration is faster is measured by the search, not asserted here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.test_tuner_search import run_cli, tiny_project
from tunegate.repository import sha256_file
from tunegate.serving import Serving
from tuner.serving import ServingRoute, _pick, tune_serving
from tuner.spec import load_spec

ROUTES = "-instances=[same|2] -max_batch=[same|16|8] -queue_us=[same|100]"


@pytest.mark.triton
def test_every_serving_route_is_gated_and_measured_against_the_models_own_each_round(tmp_path: Path) -> None:
    spec = load_spec(
        tiny_project(
            tmp_path,
            gate={"samples": 256},
            serving={"routes": ROUTES, "concurrency": [4], "window_ms": 800, "rounds": 2, "min_gain": 1.05},
        )
    )
    result, version, path = tune_serving(spec)
    by = {r.route: r for r in result.routes}
    assert len(by) == 12 and result.routes[0].route == "-instances=same -max_batch=same -queue_us=same"
    skipped = [r for r in result.routes if r.status == "skipped"]
    # a queue delay without a batch dimension: the dynamic batcher cannot apply to the tiny model's config
    assert sum("max_batch_size > 0" in (r.error or "") for r in skipped) == 2, skipped
    # a batch limit below the captured requests' (b16) would refuse clients' requests
    small = [r for r in result.routes if "-max_batch=8" in r.route]
    assert len(small) == 4 and all(r.status == "skipped" and "batch 16" in (r.error or "") for r in small), (
        small
    )
    measured = [r for r in result.routes if r.status != "skipped"]
    n = spec.gate.samples + 2  # the drawn requests and the tiny model's two edge cases
    for r in measured:
        assert r.status == "passed", (
            r.route,
            r.error,
            r.gate,
        )  # batching and instances change no answer here
        assert r.gate is not None and r.gate["rate"]["n"] == n and r.gate["rate"]["k"] == 0
        assert len(r.levels) == len(r.throughput) == len(r.ratios) == 2, r
        assert all(t > 0 for t in r.throughput) and all(lv[0]["concurrency"] == 4 for lv in r.levels)
    assert result.routes[0].ratios == [1.0, 1.0]
    batched = by["-instances=2 -max_batch=16 -queue_us=100"]
    assert batched.serving == {"instances": 2, "max_batch_size": 16, "queue_delay_us": 100}

    expected, _ = _pick(result.routes, spec.serving.min_gain, spec.serving.latency_ms)
    assert (result.winner.route if result.winner else None) == (expected.route if expected else None)
    if result.winner is None:
        assert version is None and path is None and "no serving route beats" in result.reason, result.reason
        return
    assert version == 2 and path is not None
    release = json.loads((path / "release.json").read_text())
    assert release["kind"] == "serving" and release["serving"] == result.winner.serving
    assert release["source_version"] == 1 and release["gate"]["n"] == n
    assert Serving.from_dict(release["serving"]).apply(
        (spec.model.repository / "tiny" / "config.pbtxt").read_text()
    )
    v1 = spec.model.repository / "tiny" / "1"
    assert {p.name: sha256_file(p) for p in path.iterdir() if p.name != "release.json"} == {
        p.name: sha256_file(p) for p in v1.iterdir()
    }


def row(route: str, ratios: list[float], status: str = "passed") -> ServingRoute:
    return ServingRoute(route, {}, status, gate={"rate": {"k": 0, "n": 10}}, throughput=[1.0] * len(ratios),
                        ratios=ratios)  # fmt: skip


@pytest.mark.parametrize(
    ("ratios", "status", "wins"),
    [
        ([1.3, 1.2, 1.25], "passed", True),
        ([1.3, 0.98, 1.25], "passed", False),  # one round slower: noise, not a gain
        ([1.05, 1.06, 1.04], "passed", False),  # every round faster, but short of min_gain
        ([1.5, 1.5, 1.5], "rejected", False),  # faster and wrong
    ],
)
def test_a_route_wins_when_every_round_is_faster_and_the_median_reaches_the_gain(
    ratios: list[float], status: str, wins: bool
) -> None:
    rows: list[Any] = [row("own", [1.0, 1.0, 1.0]), row("cand", ratios, status)]
    winner, reason = _pick(rows, 1.1, 0.0)
    assert (winner is not None) == wins, reason


@pytest.mark.triton
def test_tune_with_serving_searches_the_written_winners_configuration(tmp_path: Path) -> None:
    """`tunegate tune --serving`: the engine winner is written, then its serving configuration is searched on it."""
    spec_path = tiny_project(
        tmp_path,
        objective={"min_speedup": 0.01},
        bench={"repeats": 3, "e2e": False},
        gate={"samples": 256},
        search={"routes": "-opt=basic -quant=fp32"},  # not the baseline's own build (that is never released)
        serving={"routes": "-instances=[same|2]", "concurrency": [2], "window_ms": 400, "rounds": 1},
    )
    proc = run_cli("tune", str(spec_path), "--serving", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["version"] == 2 and out["serving"]["version"] == 2  # the serving search ran on the new version
    routes = out["serving"]["routes"]
    assert [r["route"].split()[0] for r in routes] == ["-instances=same", "-instances=2"]
    assert all(r["status"] == "passed" and len(r["throughput"]) == 1 for r in routes), routes
    written = out["serving"]["written_version"]
    if written is not None:  # a configuration won: the next version, the winner's files served so
        release = json.loads((Path(out["serving"]["written_path"]) / "release.json").read_text())
        assert written == 3 and release["source_version"] == 2 and release["serving"] == {"instances": 2}
    proc = run_cli("tune", str(spec_path), "--serving", "--routes", "-opt=all", "--dry-run")
    assert proc.returncode == 0, proc.stderr
