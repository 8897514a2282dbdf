"""Latency evidence under load: how often a canary of an identical candidate is pinned, and a slower one is not.

On the embedded Triton (python backend, CPU) with a busy-loop process running alongside, runs canaries of
an IDENTICAL candidate (the baseline's code and behaviour, a second version directory) and of a candidate
10% slower (more CPU work per request), each with `--clients` clients sending unversioned infers through
a real sidecar process, default canary parameters, once per latency pairing mode.
Every canary has a model of its own (loaded before, unloaded after), so each starts from the same state:
a cold candidate beside a warm baseline.

Per pairing mode it prints promoted / pinned / inconclusive counts, the false pin rate for the identical
candidate (inconclusive counts as a pin: the candidate did not ship), the pin rate for the slower one,
median samples and seconds to a decision, and the clients' p50/p99 latency.

    .venv/bin/python benchmarks/canary_identical.py --quick          # 2 canaries per kind and mode
    .venv/bin/python benchmarks/canary_identical.py --json out.json  # 20 per kind and mode
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from sidecar.client import SidecarProcess, write_token_file
from sidecar.config import LATENCY_PAIRINGS, CanaryParams
from tests.sidecar_models import add_model, config, infer_body
from tunegate.repository import write_config
from tunegate.triton import EmbeddedTriton, TritonOptions

TOKEN = "canary-benchmark-token-0123456789"
KINDS = ("identical", "slower")


def hog(stop: Any) -> None:
    """A busy loop on one core: other work sharing the machine."""
    while not stop.is_set():
        for _ in range(100_000):
            pass


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def pct(values: Sequence[float], q: float) -> float:
    return float(np.quantile(np.asarray(values), q)) if values else float("nan")


async def direct_latency(client: aiohttp.ClientSession, url: str, model: str, n: int) -> dict[str, float]:
    """p50 of each version straight from Triton, one request at a time, versions interleaved."""
    rng = np.random.default_rng(1)
    lat: dict[str, list[float]] = {"1": [], "2": []}
    for i in range(2 * n):
        v = "1" if i % 2 == 0 else "2"
        body, headers = infer_body(rng)
        t0 = time.perf_counter()
        async with client.post(
            f"{url}/v2/models/{model}/versions/{v}/infer", data=body, headers=headers
        ) as r:
            await r.read()
            assert r.status == 200, r.status
        lat[v].append(time.perf_counter() - t0)
    return {f"v{v}_p50_ms": statistics.median(x[n // 5 :]) * 1e3 for v, x in lat.items()}


async def run_canary(client: aiohttp.ClientSession, sidecar_url: str, model: str, mode: str, args: argparse.Namespace,
                     ) -> dict[str, Any]:  # fmt: skip
    auth = {"Authorization": f"Bearer {TOKEN}"}
    params = {"candidate": 2, "deadline_s": args.deadline_s, "latency_pairing": mode}
    async with client.post(f"{sidecar_url}/canary/{model}", json=params, headers=auth) as r:
        st = await r.json()
        if r.status != 201:
            raise RuntimeError(f"canary start for {model}: {r.status} {st}")
    stop = asyncio.Event()
    latencies: list[float] = []
    codes: dict[int, int] = {}
    rng = np.random.default_rng(0)
    interval = args.clients / args.rate if args.rate > 0 else 0.0
    give_up = time.monotonic() + args.deadline_s + 30

    async def one_client() -> None:
        nxt = time.monotonic()
        while not stop.is_set() and time.monotonic() < give_up:
            body, headers = infer_body(rng)
            t0 = time.perf_counter()
            async with client.post(f"{sidecar_url}/v2/models/{model}/infer", data=body, headers=headers) as r:
                await r.read()
            latencies.append(time.perf_counter() - t0)
            codes[r.status] = codes.get(r.status, 0) + 1
            if interval:
                nxt += interval
                await asyncio.sleep(max(0.0, nxt - time.monotonic()))

    async def watch() -> None:
        while not stop.is_set() and time.monotonic() < give_up:
            await asyncio.sleep(0.25)
            async with client.get(f"{sidecar_url}/canary/{model}", headers=auth) as r:
                if (await r.json())["state"] in ("promoted", "pinned"):
                    stop.set()
        stop.set()

    await asyncio.gather(watch(), *(one_client() for _ in range(args.clients)))
    async with client.get(f"{sidecar_url}/canary/{model}/decisions", headers=auth) as r:
        recs = (await r.json())["decisions"]
    if not recs:
        raise RuntimeError(f"{model}: no decision within {args.deadline_s + 30:.0f} s")
    rec = recs[-1]
    ev = rec["evidence"]
    lat = ev.get("latency") or {}
    outcome = rec["outcome"]
    return {
        "model": model,
        "mode": mode,
        "outcome": "pinned" if outcome == "pin" else "promoted" if outcome == "promote" else "inconclusive",
        "on_latency": outcome == "pin" and "slower" in rec["reasons"][0],
        "reason": rec["reasons"][0],
        "samples": ev["compared"],
        "latency_pairs": lat.get("pairs", 0),
        "p50_ratio": lat.get("p50_ratio"),
        # the sets of instances the pairs ran on (placements), each set's pairs and share above the limit
        "sets": {
            q: [f["pairs"], round(f["share_above_limit"], 3)]
            for q, f in (lat.get("placements") or {}).items()
        },
        "throughput_ratio": (ev.get("throughput") or {}).get("ratio"),
        "seconds": rec["at"] - rec["started"],
        "client_requests": len(latencies),
        "client_errors": sum(n for c, n in codes.items() if c != 200),
        "client_p50_ms": pct(latencies, 0.5) * 1e3,
        "client_p99_ms": pct(latencies, 0.99) * 1e3,
        "_latencies": latencies,
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in sorted({r["mode"] for r in runs}):
        per: dict[str, Any] = {}
        for kind in KINDS:
            rs = [r for r in runs if r["mode"] == mode and r["kind"] == kind]
            if not rs:
                continue
            n = len(rs)
            counts = {o: sum(r["outcome"] == o for r in rs) for o in ("promoted", "pinned", "inconclusive")}
            lat = [x for r in rs for x in r["_latencies"]]
            per[kind] = {
                "canaries": n,
                **counts,
                "pinned_on_latency": sum(r["on_latency"] for r in rs),
                # identical: a pin or no decision is a false pin; slower: the pin rate itself
                "pin_rate": (counts["pinned"] + counts["inconclusive"]) / n,
                "median_samples": statistics.median(r["samples"] for r in rs),
                "median_sets": statistics.median(len(r["sets"]) or 1 for r in rs),
                "max_sets": max(len(r["sets"]) or 1 for r in rs),
                "median_seconds": statistics.median(r["seconds"] for r in rs),
                "median_p50_ratio": statistics.median(
                    [r["p50_ratio"] for r in rs if r["p50_ratio"]] or [float("nan")]
                ),
                "median_throughput_ratio": statistics.median(
                    [r["throughput_ratio"] for r in rs if r["throughput_ratio"]] or [float("nan")]
                ),
                "client_p50_ms": pct(lat, 0.5) * 1e3,
                "client_p99_ms": pct(lat, 0.99) * 1e3,
                "client_errors": sum(r["client_errors"] for r in rs),
            }
        out[mode] = per
    return out


def print_table(summary: dict[str, Any], calibration: dict[str, float]) -> None:
    c = calibration
    print(f"direct p50 without load: baseline {c['baseline_p50_ms']:.2f} ms ({c['baseline_work']} iterations of work; "
          f"{c['no_work_p50_ms']:.2f} ms without), slower candidate {c['slower_work']} iterations")  # fmt: skip
    head = ("mode", "candidate", "n", "promoted", "pinned", "inconcl.", "pin rate", "med samples", "sets med/max", "med s",
            "med p50 ratio", "med capacity ratio", "client p50 ms", "client p99 ms")  # fmt: skip
    print(" | ".join(head))
    for mode, per in summary.items():
        for kind, s in per.items():
            label = "false pin" if kind == "identical" else "pin"
            print(" | ".join([mode, kind, str(s["canaries"]), str(s["promoted"]), str(s["pinned"]), str(s["inconclusive"]),
                              f"{label} {s['pin_rate']:.0%}", f"{s['median_samples']:.0f}",
                              f"{s['median_sets']:g}/{s['max_sets']}", f"{s['median_seconds']:.1f}",
                              f"{s['median_p50_ratio']:.3f}", f"{s['median_throughput_ratio']:.3f}",
                              f"{s['client_p50_ms']:.2f}", f"{s['client_p99_ms']:.2f}"]))  # fmt: skip


async def bench(args: argparse.Namespace, repo: Path, work: Path) -> dict[str, Any]:
    names = {
        (kind, mode, i): f"{kind}_{mode}_{i:02d}"
        for kind in KINDS
        for mode in args.modes
        for i in range(args.canaries)
    }
    add_model(repo, "calib", {2: {"work": 0}}, baseline={"work": args.work})
    write_config(
        repo, dataclasses.replace(config("calib"), versions=(1, 2))
    )  # both served, for direct timing
    stop = multiprocessing.Event()
    hogs = [multiprocessing.Process(target=hog, args=(stop,), daemon=True) for _ in range(args.hogs)]
    runs: list[dict[str, Any]] = []
    with EmbeddedTriton(TritonOptions(repository=repo, models=("calib",)), workdir=work / "triton") as triton:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as client:
            calibration = await direct_latency(client, triton.http_url, "calib", 300)
            # v1 does the baseline's work, v2 none: the work's share of the latency sizes the slower candidate's work
            total, bare = calibration.pop("v1_p50_ms"), calibration.pop("v2_p50_ms")
            slow_work = round(args.work * (1 + (args.slowdown - 1) * total / max(total - bare, 1e-3)))
            calibration.update(
                baseline_p50_ms=total, no_work_p50_ms=bare, baseline_work=args.work, slower_work=slow_work
            )
            log(f"calibration: {calibration}")
            triton.unload("calib")
            for (kind, _mode, _i), name in names.items():
                add_model(
                    repo,
                    name,
                    {2: {"work": slow_work if kind == "slower" else args.work}},
                    baseline={"work": args.work},
                )
            token = write_token_file(work / "token", TOKEN)
            for h in hogs:
                h.start()
            t_start = time.monotonic()
            try:
                with SidecarProcess(upstream=triton.http_url, upstream_grpc=triton.grpc_address, state_dir=work / "state", repository=repo,
                                    token_file=token) as sc:  # fmt: skip
                    order = [(k, m, i) for i in range(args.canaries) for m in args.modes for k in KINDS]
                    for n, key in enumerate(order, 1):
                        name = names[key]
                        await asyncio.to_thread(triton.load, name)
                        try:
                            r = await run_canary(client, sc.url, name, key[1], args)
                        except Exception:
                            log((work / "state" / "sidecar.log").read_text(errors="replace")[-4000:])
                            raise
                        r["kind"] = key[0]
                        runs.append(r)
                        await asyncio.to_thread(triton.unload, name)
                        ratio = f"{r['p50_ratio']:.3f}" if r["p50_ratio"] else "-"
                        log(f"[{n}/{len(order)} {time.monotonic() - t_start:.0f}s] {key[1]:7s} {key[0]:9s} "
                            f"{r['outcome']:12s} after {r['samples']} samples, {r['seconds']:.1f} s, p50 ratio {ratio}, "
                            f"client p50/p99 {r['client_p50_ms']:.1f}/{r['client_p99_ms']:.1f} ms: {r['reason'][:90]}")  # fmt: skip
            finally:
                stop.set()
                for h in hogs:
                    h.join(5)
    summary = summarize(runs)
    return {
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "calibration": calibration,
        "wall_s": time.monotonic() - t_start,
        "summary": summary,
        "runs": [{k: v for k, v in r.items() if not k.startswith("_")} for r in runs],
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--canaries", type=int, default=20, help="canaries per candidate kind and pairing mode (default 20)"
    )
    ap.add_argument("--quick", action="store_true", help="2 canaries per kind and mode, to check the setup")
    ap.add_argument("--modes", nargs="+", choices=LATENCY_PAIRINGS, default=list(LATENCY_PAIRINGS),
                    help="latency pairing modes to run (default: all)")  # fmt: skip
    ap.add_argument("--clients", type=int, default=4, help="concurrent clients (default 4)")
    ap.add_argument(
        "--rate", type=float, default=100.0, help="total client req/s; 0: as fast as answered (default 100)"
    )
    ap.add_argument(
        "--deadline-s",
        type=float,
        default=CanaryParams().deadline_s,
        help=f"canary deadline_s (default {CanaryParams().deadline_s:g}, the sidecar's)",
    )
    ap.add_argument("--work", type=int, default=100_000,
                    help="busy-loop iterations per request in the baseline (default 100000, about 1.5 ms)")  # fmt: skip
    ap.add_argument("--slowdown", type=float, default=1.10,
                    help="the slower candidate's direct p50 over the baseline's, without load (default 1.10)")  # fmt: skip
    ap.add_argument("--hogs", type=int, default=1, help="busy-loop processes alongside (default 1)")
    ap.add_argument("--json", metavar="PATH", help="also write settings, every run and the summary as JSON")
    args = ap.parse_args(argv)
    if args.quick:
        args.canaries = 2
    with tempfile.TemporaryDirectory(prefix="canary-identical-") as d:
        repo = Path(d) / "repo"
        repo.mkdir()
        result = asyncio.run(bench(args, repo, Path(d)))
    print_table(result["summary"], result["calibration"])
    print(f"wall time {result['wall_s']:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
