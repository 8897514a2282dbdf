"""`tunegate demo`: the main job on the embedded default, in production's order — live traffic through the
sidecar (captured), tune on that capture, canary of the winner under Locust load, decide.

`--quick` only serves the baseline and prints one embedding (a smoke check of the install).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.markup import escape

from tunegate import models, project
from tunegate.app.demo import DemoError, DemoOptions, run_demo
from tunegate.console import CliError, emit_json, err, out
from tunegate.textdata import Tokenizer
from tunegate.triton import EmbeddedTriton, TritonError, TritonOptions


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "demo",
        help="the whole loop on the embedded Triton: live traffic -> capture -> tune -> "
        "canary under load -> decision",
    )
    p.add_argument("--scenario", choices=["good", "bad"], default="good",
                   help="good: a faster route far within the out-of-tolerance budget (PROMOTE expected); "
                        "bad: a route admitted by a loose tuner spec, judged strictly live (PIN expected)")  # fmt: skip
    p.add_argument(
        "--run-dir", type=Path, default=None, help="work directory (default .tunegate/runs/<stamp>)"
    )
    p.add_argument(
        "--cache", type=Path, default=None, help="model cache (default $TUNEGATE_CACHE or ~/.cache/tunegate)"
    )
    p.add_argument("--budget-s", type=float, default=None, help="tuning time budget (default: the spec's)")
    p.add_argument(
        "--capture-s",
        type=float,
        default=120.0,
        help="longest live replay before tuning; it stops once the capture holds the gate's requests",
    )
    p.add_argument(
        "--load-s",
        type=float,
        default=150.0,
        help="longest canary load replay; it stops once the canary decides",
    )
    p.add_argument("--users", type=int, default=6, help="Locust users")
    p.add_argument(
        "--canary-rate",
        type=float,
        default=10.0,
        help="requests per second during the canary (a saturated mirror drops copies, biased to large ones)",
    )
    p.add_argument("--min-samples", type=int, default=300, help="comparisons before the judge may decide")
    p.add_argument(
        "--oot-budget",
        type=float,
        default=None,
        help="share of requests allowed outside the live tolerance, above the A/A noise floor "
        "(default: the strict spec's [gate].oot_budget, the gate's own budget)",
    )
    p.add_argument("--deadline-s", type=float, default=140.0, help="canary deadline (no clear answer: pin)")
    p.add_argument("--quick", action="store_true", help="only serve the baseline and print one embedding")
    p.add_argument("--text", default="Triton serves the baseline while tunegate judges the candidate.")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    if args.quick:
        return quick(args)

    try:
        opts = DemoOptions(
            scenario=args.scenario, run_dir=args.run_dir, cache=args.cache, tune_budget_s=args.budget_s,
            capture_s=args.capture_s, load_s=args.load_s, users=args.users, canary_rate=args.canary_rate, min_samples=args.min_samples, deadline_s=args.deadline_s,
            oot_budget=args.oot_budget,
            progress=not args.json,
        )  # fmt: skip
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    try:
        summary = run_demo(opts, step=lambda msg: err.print(f"[bold cyan]>>[/] {escape(msg)}"))
    except (DemoError, TritonError, models.ModelError) as exc:
        raise CliError(str(exc), code=1) from exc
    if args.json:
        emit_json({k: v for k, v in summary.items() if k != "timeline"})
    else:
        _print_summary(summary)
    return 0


def _pct(v: Any) -> str:
    return f"{100 * float(v):.2f}%" if isinstance(v, int | float) else "—"


def _print_summary(s: dict[str, Any]) -> None:
    cap = s.get("capture", {})
    out.print(
        f"[bold]capture[/]: {cap.get('requests')} live requests captured by the sidecar in {cap.get('dir')}"
    )
    tune = s.get("tune", {})
    out.print(f"[bold]tune[/]: winner {tune.get('winner')} (x{tune.get('speedup') or 0:.2f}) -> version "
              f"{tune.get('version')}; report {s.get('tune_report')}")  # fmt: skip
    g = s.get("gate") or {}
    if g:
        out.print(f"[bold]gate[/]: {g.get('k')}/{g.get('n')} captured requests out of tolerance ({_pct(g.get('rate'))}), "
                  f"upper bound {_pct(g.get('upper'))} <= budget {_pct(g.get('budget'))} at {g.get('confidence')}")  # fmt: skip
    if s.get("decision") is None:
        out.print(f"[bold]decision[/]: none — {s.get('reason')}")
        return
    color = "green" if s["decision"] == "promote" else "red"
    out.print(f"[bold]decision[/]: [{color}]{str(s['decision']).upper()}[/] (by {s.get('decided_by')}); "
              f"live version now {s.get('live_version')}")  # fmt: skip
    for r in s.get("reasons", []):
        out.print(f"  - {r}")
    load = s.get("load", {})
    secs = s.get("seconds", {})
    out.print(f"[bold]load[/]: {load.get('requests')} requests replayed through the sidecar, "
              f"{load.get('failures')} client failures, p50 {load.get('median_ms')} ms, p95 {load.get('p95_ms')} ms")  # fmt: skip
    ev = s.get("evidence", {})
    compared, oot = ev.get("compared"), ev.get("out_of_tolerance")
    if isinstance(compared, int) and compared and isinstance(oot, int):
        out.print(f"[bold]canary[/]: {oot}/{compared} live requests out of tolerance ({_pct(oot / compared)}), "
                  f"budget {_pct((s.get('canary') or {}).get('oot_budget'))}")  # fmt: skip
    if ev:
        keys = [k for k in ("compared", "out_of_tolerance", "aa_compared", "aa_out_of_tolerance", "errors", "timeouts",
                            "p50_ratio", "p95_ratio") if k in ev]  # fmt: skip
        out.print("[bold]evidence[/]: " + ", ".join(f"{k} {ev[k]}" for k in keys))
    out.print(
        f"[bold]time[/]: canary to decision {secs.get('canary_to_decision')} s, total {secs.get('total')} s"
    )
    out.print(f"[bold]files[/]: canary report {s.get('canary_report')}; decision records {s.get('records')}")


def quick(args: argparse.Namespace) -> int:
    import tritonclient.http as httpclient

    t0 = time.perf_counter()
    with err.status("preparing the demo model (first run exports MiniLM to ONNX)"):
        try:
            onnx_path = models.minilm_onnx(args.cache)
            models.install_baseline(project.repository(), onnx_path)
        except models.ModelError as exc:
            raise CliError(str(exc)) from exc
    t_prepared = time.perf_counter()
    server = EmbeddedTriton(TritonOptions(repository=project.repository(), models=(models.MINILM,)))
    with err.status("starting the embedded Triton"):
        try:
            server.start()
        except TritonError as exc:
            raise CliError(str(exc), code=1) from exc
    try:
        t_ready = time.perf_counter()
        feeds = Tokenizer()([args.text])
        client = httpclient.InferenceServerClient(server.http_address)
        try:
            inputs = []
            for name, arr in feeds.items():
                inp = httpclient.InferInput(name, list(arr.shape), "INT64")
                inp.set_data_from_numpy(arr, binary_data=True)
                inputs.append(inp)
            result = client.infer(models.MINILM, inputs)
        finally:
            client.close()
        emb = result.as_numpy("embedding")
        t_first = time.perf_counter()
    finally:
        server.stop()
    if emb is None:
        raise CliError("Triton returned no 'embedding' output", code=1)
    summary = {
        "model": models.MINILM,
        "version": result.get_response().get("model_version"),
        "text": args.text,
        "embedding_shape": list(emb.shape),
        "embedding_norm": float(np.linalg.norm(emb[0])),
        "embedding_head": [round(float(x), 6) for x in emb[0, :8]],
        "seconds": {
            "prepare": round(t_prepared - t0, 2),
            "triton_ready": round(t_ready - t_prepared, 2),
            "to_first_inference": round(t_first - t0, 2),
        },
    }
    if args.json:
        emit_json(summary)
    else:
        out.print(f"[bold]{models.MINILM}[/] v{summary['version']} embedding of {args.text!r}")
        out.print(f"  shape {summary['embedding_shape']}, L2 norm {summary['embedding_norm']:.6f}")
        out.print(f"  first values {summary['embedding_head']}")
        sec = summary["seconds"]
        out.print(f"  time to first inference {sec['to_first_inference']}s (prepare {sec['prepare']}s, "
                  f"Triton ready {sec['triton_ready']}s)")  # fmt: skip
    return 0
