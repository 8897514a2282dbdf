"""Per-request out-of-tolerance rates of the MiniLM build routes against the served baseline (version 1).

The canary judges each live request on its own: a request is out of tolerance when its worst row's
cosine to the baseline's embedding is below the threshold. This script measures that rate for every
route the ONNX Runtime builder offers, over synthetic demo traffic (loadtest.synth's batch mix), at
several thresholds, plus each route's paired p50 latency at batch 1 and 4 (sequence 32) against the
baseline. The demo's specs (specs/minilm*.toml) choose their tolerances and budgets from these figures.

    .venv/bin/python benchmarks/minilm_route_oot.py --requests 1200 --json out.json
    .venv/bin/python benchmarks/minilm_route_oot.py --requests 300 --no-build   # reuse the built routes
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

Array = npt.NDArray[Any]

ROOT = Path(__file__).resolve().parent.parent
ROUTES = (
    "fusion=bert quant=fp32",
    "fusion=none quant=fp32",
    "fusion=bert quant=int8-tensor",
    "fusion=bert quant=int8-channel",
    "fusion=bert quant=int8-channel-keepffn",
    "fusion=bert quant=int8-matmul",
    "fusion=bert quant=int8-static",
    "fusion=none quant=int8-channel",
)
THRESHOLDS = (0.999, 0.998, 0.995, 0.99, 0.9875, 0.985, 0.98, 0.975, 0.97, 0.96, 0.95)


def _knobs(route: str) -> dict[str, str]:
    knobs = {"opt": "all", "threads": "1", "exec": "sequential"}
    knobs.update(dict(part.split("=") for part in route.split()))
    return knobs


def worst_cosines(base: list[Array], cand: list[Array]) -> npt.NDArray[np.float64]:
    """Each request's worst row cosine (the per-request statistic `compare` applies with `max`)."""
    out = []
    for b, c in zip(base, cand, strict=True):
        b64, c64 = b.astype(np.float64), c.astype(np.float64)
        cos = (b64 * c64).sum(axis=1) / (np.linalg.norm(b64, axis=1) * np.linalg.norm(c64, axis=1))
        out.append(float(cos.min()))
    return np.array(out)


def paired_p50(run_a: Any, run_b: Any, feeds: dict[str, Array], repeats: int) -> tuple[float, float]:
    ta, tb = [], []
    for _ in range(3):
        run_a(feeds), run_b(feeds)
    for _ in range(repeats):
        t = time.perf_counter()
        run_a(feeds)
        ta.append(time.perf_counter() - t)
        t = time.perf_counter()
        run_b(feeds)
        tb.append(time.perf_counter() - t)
    return statistics.median(ta) * 1e3, statistics.median(tb) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1200)
    ap.add_argument("--seed", type=int, default=1, help="traffic seed (the demo replays seed 0)")
    ap.add_argument("--workdir", type=Path, default=ROOT / ".tunegate" / "route-oot")
    ap.add_argument("--routes", nargs="*", default=list(ROUTES))
    ap.add_argument("--no-build", action="store_true", help="only reuse routes built before")
    ap.add_argument("--no-latency", action="store_true")
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--aa", action="store_true", help="also the reference (graph optimizations off) against v1"
    )
    args = ap.parse_args()

    from loadtest.synth import SynthSpec, synthesize
    from tunegate import models
    from tunegate.textdata import Tokenizer
    from tuner.builders import Artifact, BuildContext, get_builder
    from tuner.builders.base import save_batches
    from tuner.builders.ort import ort_runner
    from tuner.builders.worker import run_build

    source = models.minilm_onnx()
    base_rt = json.loads((ROOT / "model_repository" / "minilm" / "1" / "runtime.json").read_text())
    baseline = ort_runner(source, base_rt)
    reference = ort_runner(
        source, {**base_rt, "session": {**base_rt["session"], "graph_optimization_level": "disable"}}
    )
    records = synthesize(SynthSpec(requests=args.requests, seed=args.seed))
    feeds = [r.decode().arrays() for r in records]
    base_out = [baseline(f)["embedding"] for f in feeds]
    rows = np.array([f["input_ids"].shape[0] for f in feeds])
    seqs = np.array([f["input_ids"].shape[1] for f in feeds])

    calib = args.workdir / "calibration.npz"
    args.workdir.mkdir(parents=True, exist_ok=True)
    save_batches(calib, [r.decode().arrays() for r in synthesize(SynthSpec(requests=16, seed=99))])
    ctx = BuildContext(
        {"num_heads": 12, "hidden_size": 384, "keep_fp32_nodes": [r"layer\.\d+/output/dense"]}, calib
    )
    builder = get_builder("onnxruntime")
    tok = Tokenizer()
    rng = np.random.default_rng(5)
    from tunegate.textdata import sample_batch

    bench = {b: sample_batch(tok, b, rng, pad_to=32) for b in (1, 4)}
    bench = {b: {k: v[:, :32] for k, v in f.items()} for b, f in bench.items()}

    results: dict[str, Any] = {
        "requests": len(feeds),
        "rows": int(rows.sum()),
        "seed": args.seed,
        "seq_p50": float(np.median(seqs)),
        "seq_max": int(seqs.max()),
        "thresholds": list(THRESHOLDS),
        "routes": {},
    }
    named = {"A/A reference (opt=disable)": reference} if args.aa else {}
    for route in args.routes:
        dest = args.workdir / "builds" / route.replace(" ", "_").replace("=", "-")
        if (dest / "artifact.json").exists():
            art = Artifact.load(dest)
        elif args.no_build:
            continue
        else:
            t = time.perf_counter()
            art, _ = run_build("onnxruntime", source, _knobs(route), dest, ctx, timeout_s=900)
            print(f"built {route} in {time.perf_counter() - t:.0f}s", flush=True)
        named[route] = builder.load(art)
    for name, runner in named.items():
        cand = [runner(f)["embedding"] for f in feeds]
        worst = worst_cosines(base_out, cand)
        oot = {f"{thr:g}": float((worst < thr).mean()) for thr in THRESHOLDS}
        entry: dict[str, Any] = {
            "oot": oot,
            "worst_cosine": {
                "min": float(worst.min()),
                "p01": float(np.quantile(worst, 0.01)),
                "p05": float(np.quantile(worst, 0.05)),
                "p50": float(np.median(worst)),
            },
            "oot_by_rows_at_0.99": {
                int(b): float((worst[rows == b] < 0.99).mean()) for b in sorted(set(rows))
            },
            "per_request": {
                "worst_cosine": [round(float(w), 6) for w in worst],
                "rows": rows.tolist(),
                "sequence": seqs.tolist(),
            },
        }
        if not args.no_latency:
            lat = {}
            for b, f in bench.items():
                c_ms, b_ms = paired_p50(runner, baseline, f, args.repeats)
                lat[f"b{b}"] = {
                    "candidate_ms": round(c_ms, 3),
                    "baseline_ms": round(b_ms, 3),
                    "speedup": round(b_ms / c_ms, 3),
                }
            entry["latency"] = lat
        results["routes"][name] = entry
        sp = " ".join(f"{k} x{v['speedup']:.2f}" for k, v in entry.get("latency", {}).items())
        print(
            f"{name:42s} min {worst.min():.4f} p01 {entry['worst_cosine']['p01']:.4f} "
            + " ".join(f"{t}:{100 * v:.1f}%" for t, v in oot.items())
            + f"  {sp}",
            flush=True,
        )
        if args.json:  # after every route: a long run keeps what finished
            args.json.write_text(json.dumps(results) + "\n")


if __name__ == "__main__":
    main()
