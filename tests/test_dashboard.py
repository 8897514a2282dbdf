"""The Grafana dashboard "tunegate — canary": generated JSON is current, well-formed, covers what on-call
needs and queries only the metric contract. Its queries run on a real Prometheus in test_prometheus_live.py.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from types import ModuleType
from typing import Any

import pytest

from tests.prometheus_support import COMPOSE, DASHBOARD_PY, contract_violations, load_yaml

DASHBOARD_JSON = COMPOSE / "grafana" / "dashboards" / "tunegate-canary.json"


def load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("tunegate_dashboard", DASHBOARD_PY)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # dataclasses resolve string annotations through sys.modules while the module executes.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD_JSON.read_text(encoding="utf-8"))
    return data


def all_exprs(dash: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [a["expr"] for a in dash["annotations"]["list"]]
    return exprs


def test_committed_json_is_what_the_generator_writes() -> None:
    gen = load_generator()
    assert DASHBOARD_JSON.read_text(encoding="utf-8") == gen.render(), (
        "run python compose/grafana/dashboard.py"
    )
    assert gen.main(["--check"]) == 0


def test_check_mode_detects_a_stale_file(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    gen = load_generator()
    stale = tmp_path / "d.json"
    stale.write_text(gen.render().replace("Live version", "Live versions"), encoding="utf-8")
    monkeypatch.setattr(gen, "OUTPUT", stale)
    assert gen.main(["--check"]) == 1
    assert gen.main([]) == 0
    assert gen.main(["--check"]) == 0


def test_identity_and_provisioning(dashboard: dict[str, Any]) -> None:
    assert dashboard["title"] == "tunegate — canary"
    provider = load_yaml(COMPOSE / "grafana" / "provisioning" / "dashboards" / "tunegate.yml")["providers"][0]
    datasource = load_yaml(COMPOSE / "grafana" / "provisioning" / "datasources" / "prometheus.yml")[
        "datasources"
    ][0]
    assert provider["type"] == "file" and provider["options"]["path"] == "/etc/grafana/dashboards"
    assert datasource["type"] == "prometheus"
    # Every panel, target, annotation and variable points at the provisioned datasource by uid.
    refs = [p["datasource"] for p in dashboard["panels"]]
    refs += [t["datasource"] for p in dashboard["panels"] for t in p["targets"]]
    refs += [a["datasource"] for a in dashboard["annotations"]["list"]]
    refs += [v["datasource"] for v in dashboard["templating"]["list"]]
    assert refs and all(r == {"type": "prometheus", "uid": datasource["uid"]} for r in refs)


def test_panels_are_well_formed_and_do_not_overlap(dashboard: dict[str, Any]) -> None:
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    assert len({p["title"] for p in panels}) == len(panels)
    cells: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        assert p["targets"], p["title"]
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"])
        area = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not area & cells, f"{p['title']} overlaps another panel"
        cells |= area


def test_queries_use_only_the_metric_contract(dashboard: dict[str, Any]) -> None:
    exprs = all_exprs(dashboard)
    assert len(exprs) > 10
    problems = {e: contract_violations(e) for e in exprs}
    assert not {e: p for e, p in problems.items() if p}
    # The variable lists the models the sidecar serves.
    (var,) = dashboard["templating"]["list"]
    assert var["name"] == "model" and not contract_violations(var["definition"])
    assert all("$model" in e for e in exprs), "every query filters by the model variable"


def test_the_contract_check_catches_mistakes() -> None:
    assert contract_violations("rate(tunegate_request_total[5m])") == [
        "unknown metric tunegate_request_total"
    ]
    assert contract_violations('tunegate_live_version{role="primary"}') == [
        "tunegate_live_version has no label role"
    ]
    assert contract_violations('tunegate_decisions_total{outcome=~"pin|revert"}')


def test_covers_what_on_call_reads(dashboard: dict[str, Any]) -> None:
    """The issue's list: live version, canary state and decisions, rate and p50/p95 per version and role,
    out-of-tolerance vs budget and noise floor, candidate errors/timeouts, mirror sampled vs dropped,
    Triton queue and compute time per version."""
    text = "\n".join(all_exprs(dashboard))
    for needle in (
        "tunegate_live_version", "tunegate_canary_state", "tunegate_decisions_total",
        "rate(tunegate_requests_total", "histogram_quantile(0.5,", "histogram_quantile(0.95,",
        "tunegate_out_of_tolerance_rate", "tunegate_out_of_tolerance_budget", "tunegate_noise_floor_rate",
        'kind="error"', 'kind="timeout"', "tunegate_mirror_sampled_total", "tunegate_mirror_dropped_total",
        "nv_inference_queue_duration_us", "nv_inference_compute_infer_duration_us",
    ):  # fmt: skip
        assert needle in text, needle
    by_title = {p["title"]: p for p in dashboard["panels"]}
    latency = by_title["Latency p50 / p95 by version and role"]
    assert all("by (model, version, role, le)" in t["expr"] for t in latency["targets"])
    # Decisions are annotations on every time series, labelled by outcome.
    (annotation,) = dashboard["annotations"]["list"]
    assert "tunegate_decisions_total" in annotation["expr"] and "{{outcome}}" in annotation["titleFormat"]
