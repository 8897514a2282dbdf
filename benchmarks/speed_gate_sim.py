"""How often a route wins the tuner's speed gate, by its true speedup: the point estimate against the paired
lower bound (tuner.bench.speedup_lower), over simulated alternating runs on a busy machine.

    python benchmarks/speed_gate_sim.py --seeds 1000 [--repeats 10] [--json]

Each seed times a candidate and the baseline alternately, `repeats` runs per shape (b1 and b4, the demo's
objective), under a shared load drift (a random walk, 3% per run), 6% run-to-run noise and a 10% chance
of a heavy-tailed stall per run. A route wins when its speed claim reaches [objective].min_speedup (1.05).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.test_tuner_speed import SHAPES, paired_runs  # the simulated timings, as the tests use them
from tuner.bench import objective, speedup, speedup_lower
from tuner.spec import ObjectiveSection


def one(
    rng: np.random.Generator, true_speedup: float, repeats: int, obj: ObjectiveSection
) -> tuple[float, float]:
    cand, base = paired_runs(rng, true_speedup, repeats)
    point = speedup(objective(base, SHAPES, obj), objective(cand, SHAPES, obj))
    lower = speedup_lower(cand, base, SHAPES, obj, confidence=obj.confidence, bootstrap=1000)
    return point, float(lower or 0.0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--min-speedup", type=float, default=1.05)
    ap.add_argument("--confidence", type=float, default=0.95)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    obj = ObjectiveSection(
        metric="p50", batch_sizes=(1, 4), min_speedup=args.min_speedup, confidence=args.confidence
    )
    rows = []
    for true in (0.95, 1.0, 1.03, 1.05, 1.1, 1.2, 1.35):
        res = [one(np.random.default_rng(seed), true, args.repeats, obj) for seed in range(args.seeds)]
        point = np.array([p for p, _ in res])
        lower = np.array([lo for _, lo in res])
        rows.append({
            "true_speedup": true,
            "wins_by_point": float(np.mean(point >= args.min_speedup)),
            "wins_by_lower_bound": float(np.mean(lower >= args.min_speedup)),
            "median_lower_bound": float(np.median(lower)),
        })  # fmt: skip
    if args.json:
        json.dump({"seeds": args.seeds, "repeats": args.repeats, "min_speedup": args.min_speedup,
                   "confidence": args.confidence, "rows": rows}, sys.stdout, indent=2)  # fmt: skip
        print()
        return 0
    print(f"{args.seeds} seeds, {args.repeats} paired runs per shape, min_speedup {args.min_speedup}, "
          f"confidence {args.confidence}")  # fmt: skip
    print(f"{'true speedup':>12} {'wins (point)':>13} {'wins (bound)':>13} {'median bound':>13}")
    for r in rows:
        print(f"{r['true_speedup']:>12.2f} {100 * r['wins_by_point']:>12.1f}% {100 * r['wins_by_lower_bound']:>12.1f}% "
              f"{r['median_lower_bound']:>13.3f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
