"""The search's HTML report (next to the cache): the route table and latency-vs-accuracy scatters.

The first scatter is the gate's own verdict: each route's objective latency against the upper bound of
its out-of-tolerance rate over the gate's requests, with the budget as a line (the canary judges live
traffic by the same rate and bound). One more scatter per output shows its pooled statistic (the worst
request's value for `max`) against the per-request threshold, so a rejected-but-fast route sits
visibly on the wrong side.
"""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tunegate.records import atomic_write_text
from tunegate.tolerance import ToleranceSpec
from tuner.spec import GateSection

COLORS = {"passed": "#2a9d3f", "rejected": "#d62828", "failed": "#777777", "skipped": "#bbbbbb"}


def _rate_panel(
    ax: Any, routes: Sequence[Mapping[str, Any]], gate: GateSection, baseline_ms: float | None, metric: str
) -> None:
    for status, color in COLORS.items():
        pts = [(r["objective_ms"], 100 * r["accuracy"]["rate"]["upper"]) for r in routes
               if r.get("status") == status and r.get("objective_ms") is not None
               and (r.get("accuracy") or {}).get("rate")]  # fmt: skip
        if pts:
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], c=color, label=status, s=36, edgecolors="black",
                       linewidths=0.4)  # fmt: skip
    ax.axhline(100 * gate.oot_budget, color="#d62828", linestyle="--", linewidth=1,
               label=f"budget {100 * gate.oot_budget:g}% (upper bound at {gate.confidence:g})")  # fmt: skip
    if baseline_ms is not None:
        ax.axvline(
            baseline_ms, color="#1d3557", linestyle=":", linewidth=1, label="baseline latency (paired median)"
        )
    ax.set_xlabel(f"objective latency ({metric}, ms)")
    ax.set_ylabel("out-of-tolerance requests, upper bound (%)")
    ax.set_title("gate: out-of-tolerance rate")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)


def _scatter(
    routes: Sequence[Mapping[str, Any]],
    tolerance: ToleranceSpec,
    baseline_ms: float | None,
    metric: str,
    gate: GateSection | None = None,
) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    outputs = sorted({o for r in routes for o in (r.get("accuracy") or {}).get("outputs", {})})
    outputs = [o for o in outputs if tolerance.for_output(o) is not None] or outputs[:1]
    if not outputs:
        return ""
    panels = len(outputs) + (gate is not None)
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.5), squeeze=False)
    if gate is not None:
        _rate_panel(axes[0][0], routes, gate, baseline_ms, metric)
    for ax, out in zip(axes[0][panels - len(outputs) :], outputs, strict=True):
        tol = tolerance.for_output(out)
        for status, color in COLORS.items():
            pts = [
                (r["objective_ms"], r["accuracy"]["outputs"][out]["value"])
                for r in routes
                if r.get("status") == status
                and r.get("objective_ms") is not None
                and out in (r.get("accuracy") or {}).get("outputs", {})
            ]
            if pts:
                ax.scatter(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    c=color,
                    label=status,
                    s=36,
                    edgecolors="black",
                    linewidths=0.4,
                )
        if tol is not None:
            ax.axhline(tol.threshold, color="#d62828", linestyle="--", linewidth=1,
                       label=f"per request: {tol.describe()}")  # fmt: skip
        if baseline_ms is not None:
            ax.axvline(
                baseline_ms,
                color="#1d3557",
                linestyle=":",
                linewidth=1,
                label="baseline latency (paired median)",
            )
        ax.set_xlabel(f"objective latency ({metric}, ms)")
        stat = (
            {"max": "worst sample", "mean": "mean", "quantile": "quantile"}.get(tol.statistic, "")
            if tol
            else ""
        )
        ax.set_ylabel(f"{tol.metric if tol else 'value'} of {out} ({stat})")
        ax.set_title(out)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return html.escape(str(v))


def _rate_cells(r: Mapping[str, Any]) -> str:
    rate = (r.get("accuracy") or {}).get("rate")
    if not rate:
        return "<td>—</td><td>—</td><td>—</td>"
    return (
        f"<td>{rate['k']}/{rate['n']}</td><td>{100 * rate['rate']:.2f}%</td>"
        f"<td>{100 * rate['upper']:.2f}%</td>"
    )


def write_report(
    path: Path,
    summary: Mapping[str, Any],
    routes: Sequence[Mapping[str, Any]],
    tolerance: ToleranceSpec,
    gate: GateSection | None = None,
) -> Path:
    baseline = summary.get("baseline") or {}
    # The baseline line: the median of the baseline runs paired with each route (timed in the same
    # minutes as the routes), falling back to the baseline timed alone at the start.
    paired = sorted(r["baseline_objective_ms"] for r in routes if r.get("baseline_objective_ms"))
    base_ms = paired[len(paired) // 2] if paired else baseline.get("objective_ms")
    png = _scatter(routes, tolerance, base_ms, str(summary.get("objective", "")), gate)
    rows = []
    for r in sorted(routes, key=lambda r: (r.get("status") != "passed", r.get("objective_ms") or 1e18)):
        acc = (r.get("accuracy") or {}).get("summary") or r.get("error") or ""
        rows.append(
            "<tr>"
            f"<td><code>{html.escape(r['route'])}</code></td><td>{html.escape(r.get('stage', ''))}</td>"
            f"<td style='color:{COLORS.get(r.get('status', ''), '#000')}'>{html.escape(r.get('status', ''))}</td>"
            f"<td>{_fmt(r.get('objective_ms'))}</td><td>{_fmt(r.get('speedup'))}</td><td>{_fmt(r.get('speedup_lower'))}</td>"
            f"<td>{_fmt(r.get('build_seconds'), 1)}</td>{_rate_cells(r)}<td>{html.escape(str(acc))[:400]}</td>"
            "</tr>"
        )
    winner = summary.get("winner")
    verdict = (
        f"<p><b>Winner:</b> <code>{html.escape(winner)}</code> written as version {summary.get('version')}</p>"
        if winner
        else f"<p><b>No winner:</b> {html.escape(str(summary.get('reason', '')))}</p>"
    )
    gate_text = ""
    if gate is not None:
        gate_text = (
            f"; gate: the upper bound ({gate.confidence:g} confidence) of the share of gate requests "
            f"out of that tolerance &lt;= {100 * gate.oot_budget:g}%"
        )
        if gate.checks is not None:
            gate_text += ", and over all of them " + html.escape(
                "; ".join(t.describe() for t in gate.checks.tolerances)
            )
    doc = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>tunegate tune: {html.escape(str(summary.get("model")))}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:4px 8px;font-size:13px}}</style>
</head><body>
<h1>tunegate tune — {html.escape(str(summary.get("model")))}</h1>
<p>spec <code>{html.escape(str(summary.get("spec")))}</code> (digest {html.escape(str(summary.get("spec_digest", ""))[:12])}),
strategy <b>{html.escape(str(summary.get("strategy")))}</b>, objective {html.escape(str(summary.get("objective")))},
baseline version {_fmt(baseline.get("version"))} at {_fmt(baseline.get("objective_ms"))} ms,
per-request tolerance: {html.escape("; ".join(t.describe() for t in tolerance.tolerances))}{gate_text}</p>
{verdict}
{'<img alt="latency vs accuracy" src="data:image/png;base64,' + png + '">' if png else ""}
<table><tr><th>route</th><th>stage</th><th>status</th><th>objective ms</th><th>speedup</th><th>speedup, lower bound</th><th>build s</th>
<th>out of tolerance</th><th>rate</th><th>upper bound</th><th>accuracy / error</th></tr>
{"".join(rows)}
</table></body></html>
"""
    atomic_write_text(path, doc)
    return path
