"""Benchmark of the tuner's strategies on MiniLM: default route vs winner, and what each strategy costs.

For each strategy (fast, mixed, halving, full) it runs a search of the same space in its own work
directory (nothing is written to the repository) and prints:
  - routes benchmarked, wall seconds and build seconds;
  - the winner, its p50/p95 against the baseline (default route) and its accuracy;
  - how far each winner's objective is from full's (full is the exhaustive answer).

    .venv/bin/python benchmarks/tuner_strategies.py                       # MiniLM, the figures
    .venv/bin/python benchmarks/tuner_strategies.py --spec specs/tiny.toml --strategies fast full \\
        --repeats 3 --routes '-opt=[all|disable] -quant=[fp32|int8-channel]'  # smoke run

Run it on a quiet machine: on a shared one the latencies are noise.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tuner.search import tune
from tuner.spec import load_spec

DEFAULT_ROUTES = (
    "-opt=[all|extended] -fusion=[bert|none] "
    "-quant=[fp32|int8-channel|int8-channel-keepffn|int8-matmul] -threads=1"
)


def _shape_stats(per_shape: dict[str, Any] | None) -> dict[str, Any]:
    return {
        k: {"p50_ms": round(v["p50_ms"], 3), "p95_ms": round(v["p95_ms"], 3)}
        for k, v in (per_shape or {}).items()
    }


def run(
    spec_path: Path,
    strategies: list[str],
    routes: str | None,
    repeats: int | None,
    budget_s: float,
    e2e: bool,
) -> dict[str, Any]:
    base = load_spec(spec_path)
    bench = dataclasses.replace(base.bench, e2e=e2e, **({"repeats": repeats} if repeats else {}))
    out: dict[str, Any] = {"spec": str(spec_path), "routes": routes or base.search.routes, "strategies": {}}
    with tempfile.TemporaryDirectory(prefix="tuner-bench-") as tmp:
        for strategy in strategies:
            spec = dataclasses.replace(
                base,
                bench=bench,
                workdir=Path(tmp) / strategy,
                search=dataclasses.replace(base.search, routes=routes or base.search.routes),
            )
            t0 = time.perf_counter()
            res = tune(spec, strategy=strategy, budget_s=budget_s, progress=False, write=False)
            wall = time.perf_counter() - t0
            w = res.winner
            out["strategies"][strategy] = {
                "routes_benchmarked": len({r.route for r in res.routes if r.objective_ms is not None}),
                "routes_tried": len({r.route for r in res.routes}),
                "wall_s": round(wall, 1),
                "build_s": round(sum(r.build_seconds or 0.0 for r in res.routes if not r.reused), 1),
                "stopped_by_budget": res.stopped_by_budget,
                "winner": w.route if w else None,
                "winner_objective_ms": w.objective_ms if w else None,
                "speedup_vs_default": w.speedup if w else None,
                "winner_latency": _shape_stats(w.latency if w else None),
                "default_latency": _shape_stats(res.baseline["latency"]),
                "winner_accuracy": {
                    k: v["value"] for k, v in ((w.accuracy or {}).get("outputs", {}) if w else {}).items()
                },
                "rejected": [r.route for r in res.routes if r.status == "rejected"],
                "reason": res.reason,
            }
    full = out["strategies"].get("full", {}).get("winner_objective_ms")
    for s in out["strategies"].values():
        obj = s["winner_objective_ms"]
        s["objective_vs_full"] = round(obj / full, 3) if obj and full else None
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--spec", type=Path, default=ROOT / "specs" / "minilm.toml")
    p.add_argument("--strategies", nargs="+", default=["fast", "mixed", "halving", "full"])
    p.add_argument(
        "--routes", default=None, help=f"route expression (default for MiniLM: {DEFAULT_ROUTES!r})"
    )
    p.add_argument("--repeats", type=int, default=None, help="timed runs per shape (default: the spec's)")
    p.add_argument("--budget-s", type=float, default=3600.0)
    p.add_argument("--e2e", action="store_true", help="also serve finalists through the embedded Triton")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    routes = args.routes or (DEFAULT_ROUTES if args.spec.name == "minilm.toml" else None)
    result = run(args.spec, args.strategies, routes, args.repeats, args.budget_s, args.e2e)
    if args.json:
        print(json.dumps(result, indent=2, default=str))
        return 0
    print(f"space: {result['routes']}")
    print(f"{'strategy':9} {'routes':>6} {'wall s':>7} {'build s':>7} {'speedup':>8} {'vs full':>8}  winner")
    for name, s in result["strategies"].items():
        spd = f"{s['speedup_vs_default']:.2f}x" if s["speedup_vs_default"] else "-"
        print(
            f"{name:9} {s['routes_benchmarked']:>6} {s['wall_s']:>7} {s['build_s']:>7} {spd:>8} "
            f"{s['objective_vs_full'] or '-':>8}  {s['winner'] or s['reason']}"
        )
    for name, s in result["strategies"].items():
        if s["winner"]:
            print(
                f"{name}: default {s['default_latency']} -> winner {s['winner_latency']}, accuracy {s['winner_accuracy']}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
