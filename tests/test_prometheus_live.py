"""Live observability: a real Prometheus (with compose's scrape config and alert rules) scrapes a real sidecar
and a real embedded Triton through short canaries of the tiny model:

  A. a good candidate (same weights as the baseline) under canary, then promoted through the admin API;
  B. a wrong candidate (other weights) that the judge pins: the scripted bad scenario;
  B'. a candidate that fails every request, pinned by the operator;
  C. the sidecar stopped: Prometheus loses its target.

Then every dashboard panel's PromQL returns data over the run, every alert rule evaluates without error,
`TunegateCanaryPinned` fires after B (and nothing is pending before), `TunegateCandidateErrorBurst` is
pending during B', `TunegateSidecarDown` is pending after C.
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Self

import grpc
import numpy as np
import pytest
import yaml

from sidecar.client import AdminClient, SidecarProcess, write_token_file
from tests.conftest import http, http_json
from tests.prometheus_support import (
    COMPOSE,
    PROM_DIR,
    PrometheusServer,
    finite_points,
    load_yaml,
    prometheus_binaries,
    running_prometheus,
)
from tunegate import grpc_codec, models
from tunegate.repository import onnx_version_files, write_config, write_version
from tunegate.triton import EmbeddedTriton, TritonOptions

pytestmark = pytest.mark.triton

MODEL = "tiny"
TOKEN = "live-test-admin-token"
# Same weights agree to float rounding; other weights are far outside.
PINNED, DOWN, BURST = "TunegateCanaryPinned", "TunegateSidecarDown", "TunegateCandidateErrorBurst"
TOLERANCE = {"y": {"metric": "linf", "threshold": 1e-4}, "score": {"metric": "linf", "threshold": 1e-4}}
DASHBOARD = json.loads(
    (COMPOSE / "grafana" / "dashboards" / "tunegate-canary.json").read_text(encoding="utf-8")
)
PANEL_TARGETS = [
    pytest.param(t["expr"], id=f"{p['title']}[{t['refId']}]")
    for p in DASHBOARD["panels"]
    for t in p["targets"]
]


def wait_for(what: str, check: Callable[[], bool], timeout_s: float, interval_s: float = 0.5) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


class Traffic:
    """Client requests through the sidecar from a background thread, at a steady rate: HTTP, and every other
    one over the sidecar's gRPC front when `grpc_address` is given (codes: HTTP's, 200 for a gRPC OK)."""

    def __init__(self, url: str, rate_hz: float = 25, grpc_address: str | None = None) -> None:
        rng = np.random.default_rng(0)
        self.bodies = [
            json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [n, 16],
                                    "data": rng.standard_normal(n * 16).round(4).tolist()}]}).encode()
            for n in (1, 2, 4, 8)
        ]  # fmt: skip
        self.url, self.period = f"{url}/v2/models/{MODEL}/infer", 1.0 / rate_hz
        self.grpc_address = grpc_address
        self.grpc_bodies = [
            grpc_codec.http_to_request(b, None, MODEL).SerializeToString() for b in self.bodies
        ]
        self.codes: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="traffic", daemon=True)

    def _run(self) -> None:
        i = 0
        channel = grpc.insecure_channel(self.grpc_address) if self.grpc_address else None
        infer = None if channel is None else channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        while not self._stop.is_set():
            if infer is not None and i % 2:
                try:
                    infer(self.grpc_bodies[i % len(self.grpc_bodies)], timeout=30)
                    code = 200
                except grpc.RpcError as exc:
                    code = 1000 + exc.code().value[0]  # no HTTP status: shows which gRPC code in the assert
            else:
                code, _h, _b = http(
                    "POST", self.url, self.bodies[i % len(self.bodies)], {"Content-Type": "application/json"}
                )
            self.codes[code] = self.codes.get(code, 0) + 1
            i += 1
            self._stop.wait(self.period)
        if channel is not None:
            channel.close()

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


# -- the run -----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class LiveRun:
    prometheus: PrometheusServer
    triton: EmbeddedTriton
    start: float
    end: float = 0.0
    alerts_before_bad: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    alerts_after_bad: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    alerts_after_down: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    alerts_during_errors: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    client_codes: dict[int, int] = dataclasses.field(default_factory=dict)
    bad_status: dict[str, Any] = dataclasses.field(default_factory=dict)

    def substitute(self, expr: str) -> str:
        """Grafana's variables as Grafana would expand them for this run (1 s scrapes)."""
        span = max(10, math.ceil(self.end - self.start) + 5)
        return expr.replace("$__rate_interval", "5s").replace("$__range", f"{span}s").replace("$model", MODEL)

    def query_range(self, expr: str) -> list[dict[str, Any]]:
        return self.prometheus.query_range(self.substitute(expr), self.start, self.end, step=1.0)

    def value(self, expr: str) -> float:
        result = self.prometheus.api("query", query=expr)["result"]
        return max((float(s["value"][1]) for s in result), default=float("nan"))


def failing_tiny(dest: Path) -> Path:
    """The tiny model expecting its input under another name: it loads, and fails every request."""
    import onnx

    model = onnx.load(models.build_tiny(dest))
    model.graph.input[0].name = "x_other"
    for node in model.graph.node:
        node.input[:] = ["x_other" if name == "x" else name for name in node.input]
    onnx.save(model, dest)
    return dest


def tiny_repository(root: Path) -> Path:
    """tiny v1 (baseline), v2 (same weights: a good candidate), v3 (other weights: a wrong one),
    v4 (fails every request)."""
    repo = root / "repo"
    for version, seed in ((1, 0), (2, 0), (3, 7)):
        onnx = models.build_tiny(root / f"tiny-{seed}.onnx", seed=seed)
        write_version(repo, MODEL, onnx_version_files(onnx), version=version)
    write_version(repo, MODEL, onnx_version_files(failing_tiny(root / "tiny-failing.onnx")), version=4)
    write_config(repo, dataclasses.replace(models.tiny_config(MODEL), versions=(1,)))
    return repo


def live_prometheus_config(dest: Path, sidecar: str, triton_metrics: str) -> Path:
    """compose's prometheus.yml with the live targets and 1 s intervals; the same jobs and rules."""
    cfg = load_yaml(PROM_DIR / "prometheus.yml")
    cfg["global"].update(scrape_interval="1s", scrape_timeout="900ms", evaluation_interval="1s")
    cfg["rule_files"] = [str(PROM_DIR / pattern) for pattern in cfg["rule_files"]]
    targets = {"tunegate-sidecar": sidecar, "triton": triton_metrics}
    for job in cfg["scrape_configs"]:
        job["static_configs"] = [{"targets": [targets.pop(job["job_name"])]}]
    assert not targets, f"compose's prometheus.yml lacks jobs {sorted(targets)}"
    dest.write_text(yaml.safe_dump(cfg))
    return dest


def alerts(prom: PrometheusServer) -> list[dict[str, Any]]:
    result: list[dict[str, Any]] = prom.api("alerts")["alerts"]
    return result


def alert_state(found: list[dict[str, Any]], name: str) -> str:
    states = [a["state"] for a in found if a["labels"]["alertname"] == name]
    return states[0] if states else "inactive"


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveRun]:
    prom_bin, _tool = prometheus_binaries()
    root = tmp_path_factory.mktemp("live")
    repo = tiny_repository(root)
    triton = EmbeddedTriton(TritonOptions(repository=repo, models=(MODEL,)), workdir=root / "triton")
    triton.start()
    sidecar = SidecarProcess(
        upstream=triton.http_url, state_dir=root / "state", repository=repo,
        token_file=write_token_file(root / "token", TOKEN), log_path=root / "sidecar.log",
        upstream_grpc=triton.grpc_address, grpc_listen="127.0.0.1:0",
    )  # fmt: skip
    try:
        sidecar.start()
        admin = AdminClient(sidecar.url, TOKEN)
        config = live_prometheus_config(
            root / "prometheus.yml", f"127.0.0.1:{sidecar.port}", f"127.0.0.1:{triton.metrics_port}"
        )
        with running_prometheus(prom_bin, config, root) as prom:
            run = LiveRun(prometheus=prom, triton=triton, start=time.time())
            with Traffic(sidecar.url, grpc_address=sidecar.grpc_address) as traffic:
                # A: a good candidate under canary (no judge decision in this phase), promoted by an operator.
                # One set of instances: a shadow loaded afresh restarts the capacity window this phase waits for.
                admin.start(
                    MODEL, 2, TOLERANCE, min_samples=100000, deadline_s=600, aa_rate=0.5, placements=1
                )
                compared = f'sum(tunegate_comparisons_total{{model="{MODEL}", role="candidate"}})'
                wait_for("candidate comparisons in Prometheus", lambda: run.value(compared) >= 100, 90)
                # The latency panel's rate needs candidate requests over two scrapes: since the fast client
                # path, 100 comparisons can land within one (a CI run saw no candidate series).
                cand_p50 = ('histogram_quantile(0.5, sum by (le) (rate(tunegate_request_duration_seconds_bucket'
                            f'{{model="{MODEL}", version="2", role="candidate"}}[5s])))')  # fmt: skip
                wait_for("candidate latency in Prometheus", lambda: math.isfinite(run.value(cand_p50)), 60)
                # Capacity needs the warm-up (10 s) and two readings of Triton's statistics 5 s apart.
                capacity = f'count(tunegate_model_capacity_inferences_per_second{{model="{MODEL}"}})'
                wait_for("capacity per version in Prometheus", lambda: run.value(capacity) == 2, 60)
                run.alerts_before_bad = alerts(prom)
                admin.promote(MODEL)
                live_version = f'tunegate_live_version{{model="{MODEL}"}}'
                wait_for("live version 2 in Prometheus", lambda: run.value(live_version) == 2, 30)
                # B: a bad candidate; the judge pins it on out-of-tolerance outputs after ~10 mirrors.
                # A lower sample rate spreads those over a few scrapes, so rates over them exist.
                bad = {"min_samples": 50, "deadline_s": 600, "aa_rate": 0.5, "sample_rate": 0.15}
                admin.start(MODEL, 3, TOLERANCE, **bad)
                run.bad_status = admin.wait_decision(MODEL, timeout_s=120)
                wait_for(
                    "TunegateCanaryPinned firing", lambda: alert_state(alerts(prom), PINNED) == "firing", 30
                )
                run.alerts_after_bad = alerts(prom)
                # B': a candidate failing every request, with an error budget so wide the judge waits:
                # the error-burst alert must see it; an operator pins it.
                admin.start(MODEL, 4, TOLERANCE, error_budget=1.0, deadline_s=600, sample_rate=0.3)
                wait_for(
                    "TunegateCandidateErrorBurst pending",
                    lambda: alert_state(alerts(prom), BURST) != "inactive",
                    60,
                )
                run.alerts_during_errors = alerts(prom)
                admin.pin(MODEL)
                time.sleep(3)  # a few more scrapes of the client path after the decision
            run.client_codes = dict(traffic.codes)
            # C: the sidecar goes away.
            sidecar.stop()
            wait_for("TunegateSidecarDown pending", lambda: alert_state(alerts(prom), DOWN) == "pending", 30)
            run.alerts_after_down = alerts(prom)
            run.end = time.time()
            yield run
        assert prom.proc is None, "Prometheus left running"
    finally:
        sidecar.stop()
        triton.stop()


# -- the checks --------------------------------------------------------------------------------------------


def test_prometheus_scraped_the_sidecar_and_triton(live: LiveRun) -> None:
    jobs = {"tunegate-sidecar", "triton"}
    for job in jobs:
        assert live.prometheus.query_range(f'up{{job="{job}"}} == 1', live.start, live.end), job
    # Clients were served throughout both canaries.
    assert live.client_codes and set(live.client_codes) == {200}, live.client_codes


@pytest.mark.parametrize("expr", PANEL_TARGETS)
def test_every_panel_query_returns_data(live: LiveRun, expr: str) -> None:
    result = live.query_range(expr)
    assert finite_points(result) > 0, f"no data for {live.substitute(expr)}"


def test_the_model_variable_and_the_decision_annotations(live: LiveRun) -> None:
    (var,) = DASHBOARD["templating"]["list"]
    metric = var["definition"].removeprefix("label_values(").split(",")[0]
    assert MODEL in live.prometheus.api("label/model/values", **{"match[]": metric})
    (annotation,) = DASHBOARD["annotations"]["list"]
    outcomes = {s["metric"]["outcome"] for s in live.query_range(annotation["expr"]) if finite_points([s])}
    assert outcomes == {"promote", "pin"}


def test_latency_is_split_by_version_and_role(live: LiveRun) -> None:
    (p50, _p95) = next(p for p in DASHBOARD["panels"] if p["title"].startswith("Latency"))["targets"]
    seen = {
        (s["metric"].get("version", ""), s["metric"]["role"])
        for s in live.query_range(p50["expr"])
        if finite_points([s])
    }
    assert {("1", "primary"), ("2", "candidate"), ("2", "primary"), ("3", "candidate")} <= seen


def test_triton_panels_see_the_shadow_model(live: LiveRun) -> None:
    (queue,) = next(p for p in DASHBOARD["panels"] if p["title"] == "Triton queue time per request")[
        "targets"
    ]
    models_seen = {s["metric"]["model"] for s in live.query_range(queue["expr"]) if finite_points([s])}
    assert models_seen == {MODEL, f"{MODEL}__canary"}


def test_triton_is_the_release_compose_pins(live: LiveRun) -> None:
    code, meta = http_json("GET", f"{live.triton.http_url}/v2")
    tag = load_yaml(COMPOSE / "docker-compose.yml")["services"]["triton"]["image"].rsplit(":", 1)[1]
    yy, mm = (int(x) for x in tag.removesuffix("-py3").split("."))
    assert code == 200 and meta["version"].startswith(f"2.{12 * (yy - 24) + mm + 41}.")


def test_every_alert_rule_evaluates(live: LiveRun) -> None:
    rules = [r for g in live.prometheus.api("rules")["groups"] for r in g["rules"]]
    names = {str(r["alert"]) for path in sorted((PROM_DIR / "rules").glob("*.yml"))
             for g in load_yaml(path)["groups"] for r in g["rules"]}  # fmt: skip
    assert {r["name"] for r in rules} == names
    for rule in rules:
        assert rule["health"] == "ok" and not rule.get("lastError"), rule
        assert not rule["lastEvaluation"].startswith("0001"), f"{rule['name']} never evaluated"


def test_the_bad_canary_fires_the_pinned_alert(live: LiveRun) -> None:
    assert live.bad_status["state"] == "pinned" and live.bad_status["last"]["outcome"] == "pin"
    # During the good canary nothing was pending or firing.
    assert live.alerts_before_bad == []
    (fired,) = [a for a in live.alerts_after_bad if a["labels"]["alertname"] == PINNED]
    assert fired["state"] == "firing" and fired["labels"]["model"] == MODEL
    # Nothing else even pending: the mirror kept up, the candidate answered, the judge decided in time.
    assert {a["labels"]["alertname"] for a in live.alerts_after_bad} == {PINNED}


def test_a_failing_candidate_raises_the_error_burst_alert(live: LiveRun) -> None:
    assert alert_state(live.alerts_after_bad, BURST) == "inactive"
    # `for: 1m` keeps it pending within this short run; firing is covered by the promtool unit tests.
    assert alert_state(live.alerts_during_errors, BURST) == "pending"
    (burst,) = [a for a in live.alerts_during_errors if a["labels"]["alertname"] == BURST]
    assert burst["labels"]["model"] == MODEL
    # The dashboard's error panel shows the failures (not only its zero fill).
    (errors, _timeouts) = next(p for p in DASHBOARD["panels"] if p["title"].startswith("Candidate errors"))[
        "targets"
    ]
    peak = max(float(v) for s in live.query_range(errors["expr"]) for _t, v in s["values"])
    assert peak > 0.5, peak  # ~0.3 x 25 req/s mirrored, all failing


def test_losing_the_sidecar_raises_the_down_alert(live: LiveRun) -> None:
    assert alert_state(live.alerts_after_bad, DOWN) == "inactive"
    assert alert_state(live.alerts_after_down, DOWN) == "pending"
