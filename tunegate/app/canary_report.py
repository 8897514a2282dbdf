"""HTML canary report: latency distributions of baseline vs candidate, out-of-tolerance rate over time against
the budget and the noise floor, and the decision timeline.

Inputs are what an operator can see: the sidecar's /metrics text (latency histograms per role) and
the canary status polled during the run (evidence counters over time) plus the decision record.
"""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tunegate.records import atomic_write_text

HIST = "tunegate_request_duration_seconds"
ROLE_COLORS = {"primary": "#1d3557", "candidate": "#e76f51", "aa": "#8d99ae"}


def latency_histograms(metrics_text: str, model: str) -> dict[str, list[tuple[float, float]]]:
    """Per role, the (upper bound, count in bucket) pairs of the latency histogram (non-cumulative)."""
    cumulative: dict[str, dict[float, float]] = {}
    for fam in text_string_to_metric_families(metrics_text):
        if fam.name != HIST:
            continue
        for s in fam.samples:
            if not s.name.endswith("_bucket") or s.labels.get("model", "").split("__")[0] != model:
                continue
            role = s.labels.get("role", "?")
            le = float(s.labels["le"])
            per_role = cumulative.setdefault(role, {})
            per_role[le] = per_role.get(le, 0.0) + s.value
    out: dict[str, list[tuple[float, float]]] = {}
    for role, buckets in cumulative.items():
        prev = 0.0
        rows = []
        for le in sorted(buckets):
            rows.append((le, buckets[le] - prev))
            prev = buckets[le]
        out[role] = rows
    return out


def oot_series(
    timeline: Sequence[Mapping[str, Any]],
) -> tuple[list[float], list[float | None], list[float | None]]:
    ts, cand, aa = [], [], []
    for p in timeline:
        ts.append(float(p["t"]))
        c, o = p.get("compared") or 0, p.get("out_of_tolerance") or 0
        ac, ao = p.get("aa_compared") or 0, p.get("aa_out_of_tolerance") or 0
        cand.append(o / c if c else None)
        aa.append(ao / ac if ac else None)
    return ts, cand, aa


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _finish(plt: Any, fig: Any, ax: Any, xlabel: str, ylabel: str, title: str) -> str:
    """Label, legend and grid an axis, then render the figure to base64 PNG and free it."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    png = _png(fig)
    plt.close(fig)
    return png


def _figures(summary: Mapping[str, Any], metrics_text: str) -> list[tuple[str, str]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figs: list[tuple[str, str]] = []
    model = str(summary.get("tune", {}).get("model", "minilm"))
    hists = latency_histograms(metrics_text, model)
    if hists:
        fig, ax = plt.subplots(figsize=(7, 3.8))
        for role in ("primary", "candidate", "aa"):
            rows = [(le, n) for le, n in hists.get(role, []) if le != float("inf")]
            total = sum(n for _, n in hists.get(role, []))
            if not rows or not total:
                continue
            ax.step([le * 1000 for le, _ in rows], [n / total for _, n in rows], where="pre",
                    label=f"{role} ({int(total)} requests)", color=ROLE_COLORS.get(role))  # fmt: skip
        ax.set_xscale("log")
        figs.append(("Latency distributions", _finish(plt, fig, ax, "latency upper bound (ms, histogram buckets)",
                                                      "fraction of requests",
                                                      "latency: baseline (primary, aa) vs candidate")))  # fmt: skip
    timeline = summary.get("timeline") or []
    if timeline:
        ts, cand, aa = oot_series(timeline)
        budget = (summary.get("evidence") or {}).get("oot_budget")
        fig, ax = plt.subplots(figsize=(7, 3.8))
        ax.plot(ts, [c if c is not None else float("nan") for c in cand], label="candidate out-of-tolerance rate",
                color=ROLE_COLORS["candidate"])  # fmt: skip
        ax.plot(ts, [a if a is not None else float("nan") for a in aa], label="noise floor (A/A rate)",
                color=ROLE_COLORS["aa"], linestyle="--")  # fmt: skip
        if isinstance(budget, (int, float)):
            ax.axhline(
                budget, color="#d62828", linestyle=":", label=f"budget {budget:g} (above the noise floor)"
            )
        figs.append(("Out-of-tolerance rate", _finish(plt, fig, ax, "seconds since the load started", "rate",
                                                      "out-of-tolerance rate over time")))  # fmt: skip

        fig, ax = plt.subplots(figsize=(7, 3.2))
        ax.plot(
            ts, [p.get("compared") or 0 for p in timeline], label="comparisons", color=ROLE_COLORS["primary"]
        )
        ax.plot(ts, [p.get("errors") or 0 for p in timeline], label="candidate errors", color="#d62828")
        decided = next((p for p in timeline if p.get("state") in ("promoted", "pinned")), None)
        if decided is not None:
            ax.axvline(float(decided["t"]), color="black", linestyle="--",
                       label=f"decision: {summary.get('decision')} at {decided['t']}s")  # fmt: skip
        figs.append(("Decision timeline", _finish(plt, fig, ax, "seconds since the load started", "count",
                                                  "decision timeline")))  # fmt: skip
    return figs


def _pct(v: Any) -> str:
    return f"{100 * float(v):.2f}%" if isinstance(v, (int, float)) and not isinstance(v, bool) else "—"


def gate_vs_canary(summary: Mapping[str, Any]) -> str:
    """The tuner's gate (captured requests) and the canary (live requests) in the same terms, side by side."""
    g = summary.get("gate") or {}
    ev = summary.get("evidence") or {}
    canary = summary.get("canary") or {}
    if not g and not ev:
        return ""
    compared, oot = ev.get("compared"), ev.get("out_of_tolerance")
    live_rate = oot / compared if isinstance(compared, int) and compared and isinstance(oot, int) else None
    rows = [
        ("requests judged", g.get("n"), compared),
        ("out of tolerance", g.get("k"), oot),
        ("rate", _pct(g.get("rate")), _pct(live_rate)),
        ("upper bound", _pct(g.get("upper")), _pct(ev.get("oot_rate_upper", ev.get("oot_upper")))),
        ("budget", _pct(g.get("budget")), _pct(canary.get("oot_budget", ev.get("oot_budget")))),
        ("confidence", g.get("confidence"), canary.get("confidence")),
        ("verdict", "passed" if g.get("passed") else ("rejected" if g else "—"), summary.get("decision")),
    ]
    body = "".join(
        f"<tr><td>{html.escape(str(name))}</td><td>{html.escape(str(a if a is not None else '—'))}</td>"
        f"<td>{html.escape(str(b if b is not None else '—'))}</td></tr>"
        for name, a, b in rows
    )
    return (
        "<h2>Gate vs canary</h2><p>The same per-request tolerance and rate bound: the tuner's gate on the "
        "captured requests, the canary on live ones.</p>"
        f"<table><tr><td></td><td><b>gate (tuner)</b></td><td><b>canary (live)</b></td></tr>{body}</table>"
    )


def _num(v: Any, fmt: str) -> str:
    return format(v, fmt) if isinstance(v, (int, float)) and not isinstance(v, bool) else "—"


def candidate_vs_baseline(summary: Mapping[str, Any]) -> str:
    """The canary's evidence per measure, candidate beside baseline: latency, throughput, memory, errors, and the
    latency of each request class (the long-tail shapes an average hides)."""
    ev = summary.get("evidence") or {}
    lat, thr, mem = ev.get("latency") or {}, ev.get("throughput") or {}, ev.get("memory") or {}
    mib = 1 << 20
    rows = [
        (
            "latency p50 (ms, paired)",
            _num(lat.get("candidate_p50_ms"), ".3f"),
            _num(lat.get("primary_p50_ms"), ".3f"),
            _num(lat.get("p50_ratio"), ".3f"),
        ),
        (
            "latency p95 (ms, paired)",
            _num(lat.get("candidate_p95_ms"), ".3f"),
            _num(lat.get("primary_p95_ms"), ".3f"),
            _num(lat.get("p95_ratio"), ".3f"),
        ),
        (
            "capacity (inferences/s, Triton compute time)",
            _num(thr.get("candidate_capacity_rps"), ".1f"),
            _num(thr.get("baseline_capacity_rps"), ".1f"),
            _num(thr.get("ratio"), ".3f"),
        ),
        (
            "memory (MiB)",
            _num((mem.get("candidate_bytes") or 0) / mib or None, ".1f"),
            _num((mem.get("baseline_bytes") or 0) / mib or None, ".1f"),
            _num(mem.get("ratio"), ".3f"),
        ),
        ("error rate", _pct(ev.get("error_rate")), _pct(ev.get("baseline_error_rate")), ""),
    ]
    for cls, c in sorted((ev.get("classes") or {}).items()):
        if isinstance(c, Mapping) and "p50_ratio" in c:
            rows.append(
                (f"class {cls}: p50 ratio over {c.get('pairs')} pairs", "", "", _num(c["p50_ratio"], ".3f"))
            )
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(x))}</td>" for x in r) + "</tr>" for r in rows)
    return ("<h2>Candidate against baseline</h2>"
            "<table><tr><td></td><td><b>candidate</b></td><td><b>baseline</b></td><td><b>ratio</b></td></tr>"
            f"{body}</table>")  # fmt: skip


def write_canary_report(path: Path, summary: Mapping[str, Any], metrics_text: str) -> Path:
    figs = _figures(summary, metrics_text)
    reasons = "".join(f"<li>{html.escape(str(r))}</li>" for r in summary.get("reasons", []))
    ev = summary.get("evidence") or {}
    ev_rows = "".join(
        f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(str(v))[:200]}</td></tr>"
        for k, v in sorted(ev.items())
        if not isinstance(v, (list, dict))
    )
    imgs = "".join(f"<h2>{html.escape(t)}</h2><img src='data:image/png;base64,{b}'>" for t, b in figs)
    doc = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>tunegate canary: {html.escape(str(summary.get("decision")))}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}td{{border:1px solid #ccc;padding:3px 8px;font-size:13px}}</style>
</head><body>
<h1>tunegate canary — decision: {html.escape(str(summary.get("decision")).upper())}</h1>
<p>scenario <b>{html.escape(str(summary.get("scenario")))}</b>, candidate version {html.escape(str(summary.get("candidate")))},
live version now {html.escape(str(summary.get("live_version")))}, decided by {html.escape(str(summary.get("decided_by")))}</p>
<ul>{reasons}</ul>
{gate_vs_canary(summary)}
{candidate_vs_baseline(summary)}
{imgs}
<h2>Evidence</h2><table>{ev_rows}</table>
<p>decision records: <code>{html.escape(str(summary.get("records")))}</code></p>
</body></html>
"""
    atomic_write_text(path, doc)
    return path
