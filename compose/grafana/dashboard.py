"""Generates the Grafana dashboard "tunegate — canary" (dashboards/tunegate-canary.json) from code.

    python compose/grafana/dashboard.py           # rewrite the JSON
    python compose/grafana/dashboard.py --check   # exit 1 if the committed JSON is stale

Every query uses only the sidecar's `tunegate_*` metrics (sidecar/metrics.py) and Triton's `nv_*`.
Grafana's template variables in queries: `$model`, `$__rate_interval`, `$__range`; tests substitute
them and run every query on a real Prometheus. Standard library only: the Grafana side needs nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

UID = "tunegate-canary"
TITLE = "tunegate — canary"
DATASOURCE = {"type": "prometheus", "uid": "prometheus"}
OUTPUT = Path(__file__).resolve().parent / "dashboards" / "tunegate-canary.json"

M = 'model=~"$model"'
# The canary runs the candidate as the shadow model `<m>__canary` in Triton.
TRITON_M = 'model=~"$model(__canary)?"'
RI = "$__rate_interval"
# Canary state as one number per model, for a state timeline (value mappings below).
STATE_CODES = {"idle": 0, "running": 1, "promoted": 2, "pinned": 3}
STATE_COLORS = {"idle": "text", "running": "blue", "promoted": "green", "pinned": "red"}


@dataclasses.dataclass(frozen=True)
class Target:
    expr: str
    legend: str


@dataclasses.dataclass(frozen=True)
class Panel:
    title: str
    kind: str  # timeseries | stat | state-timeline
    targets: tuple[Target, ...]
    unit: str = "short"
    width: int = 12
    height: int = 8
    description: str = ""
    thresholds: tuple[tuple[float, str], ...] = ()
    mappings: tuple[dict[str, Any], ...] = ()


def _per_request_ms(counter_us: str) -> str:
    """Average microseconds per successful request from a pair of Triton counters, in ms."""
    return (
        f"sum by (model, version) (rate({counter_us}{{{TRITON_M}}}[{RI}]))"
        f" / sum by (model, version) (rate(nv_inference_request_success{{{TRITON_M}}}[{RI}])) / 1000"
    )


def _quantile(q: float) -> str:
    return (
        f"histogram_quantile({q}, sum by (model, version, role, le) "
        f"(rate(tunegate_request_duration_seconds_bucket{{{M}}}[{RI}])))"
    )


def _candidate_failures(kind: str) -> str:
    """Rate of failed candidate mirrors of one kind per model, an explicit 0 where there were none yet
    (the error counter has no series until the first failure; a gap would read as "no data")."""
    failures = f'rate(tunegate_mirror_errors_total{{{M}, role="candidate", kind="{kind}"}}[{RI}])'
    sampled = f'rate(tunegate_mirror_sampled_total{{{M}, role="candidate"}}[{RI}])'
    return f"sum by (model) ({failures}) or sum by (model) (0 * {sampled})"


_STATE_EXPR = " + ".join(
    f'{code} * max by (model) (tunegate_canary_state{{{M}, state="{state}"}})'
    for state, code in STATE_CODES.items()
    if code
)

PANELS: tuple[Panel, ...] = (
    Panel(
        "Live version", "stat", (Target(f"max by (model) (tunegate_live_version{{{M}}})", "{{model}}"),),
        width=4, height=5, description="Version serving unversioned client requests through the sidecar.",
    ),
    Panel(
        "Candidate version", "stat",
        (Target(f"max by (model) (tunegate_candidate_version{{{M}}})", "{{model}}"),),
        width=4, height=5, description="Version under canary (0: none).",
    ),
    Panel(
        "Canary state", "state-timeline", (Target(_STATE_EXPR, "{{model}}"),), width=8, height=5,
        mappings=tuple(
            {"type": "value",
             "options": {str(code): {"text": state, "color": STATE_COLORS[state], "index": code}}}
            for state, code in STATE_CODES.items()
        ),
    ),
    Panel(
        "Decisions in range", "stat",
        (Target(
            f"sum by (model, outcome) (increase(tunegate_decisions_total{{{M}}}[$__range]))",
            "{{model}} {{outcome}}",
        ),),
        width=4, height=5, description="promote / pin / inconclusive; each decision is also an annotation.",
    ),
    Panel(
        "Decision deadline in", "stat",
        (Target(
            f'(max by (model) (tunegate_canary_deadline_timestamp_seconds{{{M}}}) - time())'
            f' and on (model) max by (model) (tunegate_canary_state{{{M}, state="running"}}) == 1',
            "{{model}}",
        ),),
        unit="s", width=4, height=5, thresholds=((0, "red"), (60, "green")),
        description="Seconds left before a running canary must decide; negative means the decision is stuck.",
    ),
    Panel(
        "Request rate by version and role", "timeseries",
        (Target(
            f"sum by (model, version, role) (rate(tunegate_requests_total{{{M}}}[{RI}]))",
            "{{model}} v{{version}} {{role}}",
        ),),
        unit="reqps",
    ),
    Panel(
        "Latency p50 / p95 by version and role", "timeseries",
        (Target(_quantile(0.5), "p50 {{model}} v{{version}} {{role}}"),
         Target(_quantile(0.95), "p95 {{model}} v{{version}} {{role}}")),
        unit="s",
    ),
    Panel(
        "Out-of-tolerance rate vs budget and noise floor", "timeseries",
        (Target(f"max by (model) (tunegate_out_of_tolerance_rate{{{M}}})", "candidate (judge) {{model}}"),
         Target(
             f'sum by (model) (rate(tunegate_out_of_tolerance_total{{{M}, role="candidate"}}[{RI}]))'
             f' / sum by (model) (rate(tunegate_comparisons_total{{{M}, role="candidate"}}[{RI}]))',
             "candidate (window) {{model}}",
         ),
         Target(f"max by (model) (tunegate_out_of_tolerance_budget{{{M}}})", "budget {{model}}"),
         Target(f"max by (model) (tunegate_noise_floor_rate{{{M}}})", "noise floor (A/A) {{model}}")),
        unit="percentunit",
    ),
    Panel(
        "Candidate errors and timeouts", "timeseries",
        (Target(_candidate_failures("error"), "errors {{model}}"),
         Target(_candidate_failures("timeout"), "timeouts {{model}}")),
        unit="reqps", description="Failed mirror requests to the candidate; they never reach clients.",
    ),
    Panel(
        "Mirror sampled vs dropped", "timeseries",
        (Target(
            f"sum by (model, role) (rate(tunegate_mirror_sampled_total{{{M}}}[{RI}]))",
            "sampled {{model}} {{role}}",
        ),
         Target(
             f"sum by (model, role, reason) (rate(tunegate_mirror_dropped_total{{{M}}}[{RI}]))",
             "dropped {{model}} {{role}} ({{reason}})",
         )),
        unit="reqps", description="Dropped: the mirror was full (bounded concurrency) or shutting down.",
    ),
    Panel(
        "Capacity: inferences/s the instances sustain", "timeseries",
        (Target(f"max by (model, version, role) (tunegate_model_capacity_inferences_per_second{{{M}}})",
                "{{model}} v{{version}} {{role}}"),),
        unit="short",
        description="From Triton's compute time per inference on the mirrored mix since the warm-up; the judge "
                    "pins a candidate below min_throughput_ratio of the baseline's.",
    ),
    Panel(
        "Memory per version", "timeseries",
        (Target(f"max by (model, version, role) (tunegate_model_memory_bytes{{{M}}})",
                "{{model}} v{{version}} {{role}}"),),
        unit="bytes",
        description="Resident memory of the instances' processes, or their GPU memory where a GPU serves; the "
                    "judge pins a candidate above max_memory_ratio of the baseline's.",
    ),
    Panel(
        "Triton queue time per request", "timeseries",
        (Target(_per_request_ms("nv_inference_queue_duration_us"), "{{model}} v{{version}}"),), unit="ms",
    ),
    Panel(
        "Triton compute time per request", "timeseries",
        (Target(_per_request_ms("nv_inference_compute_infer_duration_us"), "{{model}} v{{version}}"),),
        unit="ms",
    ),
    Panel(
        "Canary evidence by client protocol", "timeseries",
        (Target(f"sum by (model, protocol) (rate(tunegate_mirror_compared_by_protocol_total{{{M}}}[{RI}]))",
                "{{model}} {{protocol}}"),
         Target(f"sum by (model, reason) (rate(tunegate_mirror_skipped_total{{{M}}}[{RI}]))",
                "skipped {{model}} ({{reason}})")),
        unit="reqps",
        description="Candidate comparisons by the protocol the mirrored client request came in (HTTP or gRPC): "
                    "one canary takes both. Not mirrored or not compared, by reason: sequences, decoupled models, "
                    "shared-memory tensors, requests HTTP cannot carry, primary answers the comparison cannot use "
                    "(primary_unusable), faults of the mirror itself (internal).",
    ),
)  # fmt: skip

ANNOTATION_EXPR = f"sum by (model, outcome) (increase(tunegate_decisions_total{{{M}}}[2m])) > 0"


def _panel_json(panel: Panel, pid: int, x: int, y: int) -> dict[str, Any]:
    # Grafana's first step has no value (the base colour).
    thresholds = panel.thresholds or ((0, "green"),)
    steps = [{"color": thresholds[0][1], "value": None}] + [
        {"color": c, "value": v} for v, c in thresholds[1:]
    ]
    return {
        "id": pid,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {"h": panel.height, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {
            "defaults": {
                "unit": panel.unit,
                "mappings": list(panel.mappings),
                "thresholds": {"mode": "absolute", "steps": steps},
            },
            "overrides": [],
        },
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True}},
        "targets": [
            {"datasource": DATASOURCE, "expr": t.expr, "legendFormat": t.legend, "refId": chr(ord("A") + i)}
            for i, t in enumerate(panel.targets)
        ],
    }


def _layout(panels: tuple[Panel, ...]) -> list[dict[str, Any]]:
    """Left to right, wrapping at Grafana's 24 columns."""
    out, x, y, row_h = [], 0, 0, 0
    for pid, panel in enumerate(panels, start=1):
        if x + panel.width > 24:
            x, y, row_h = 0, y + row_h, 0
        out.append(_panel_json(panel, pid, x, y))
        x, row_h = x + panel.width, max(row_h, panel.height)
    return out


def dashboard() -> dict[str, Any]:
    return {
        "uid": UID,
        "title": TITLE,
        "tags": ["tunegate", "canary"],
        "timezone": "utc",
        "schemaVersion": 39,
        "version": 1,
        "editable": False,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "annotations": {
            "list": [
                {
                    "name": "Decisions",
                    "datasource": DATASOURCE,
                    "enable": True,
                    "iconColor": "orange",
                    "expr": ANNOTATION_EXPR,
                    "step": "1m",
                    "titleFormat": "{{model}}: {{outcome}}",
                    "tagKeys": "model,outcome",
                    "textFormat": "canary decision",
                }
            ]
        },
        "templating": {
            "list": [
                {
                    "name": "model",
                    "label": "model",
                    "type": "query",
                    "datasource": DATASOURCE,
                    "query": {"query": "label_values(tunegate_live_version, model)", "refId": "model"},
                    "definition": "label_values(tunegate_live_version, model)",
                    "includeAll": True,
                    "allValue": ".+",
                    "multi": True,
                    "current": {"text": "All", "value": "$__all"},
                    "refresh": 2,
                }
            ]
        },
        "panels": _layout(PANELS),
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed JSON differs")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not OUTPUT.exists() or OUTPUT.read_text(encoding="utf-8") != text:
            sys.stderr.write(f"{OUTPUT} is stale: run python compose/grafana/dashboard.py\n")
            return 1
        return 0
    OUTPUT.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
