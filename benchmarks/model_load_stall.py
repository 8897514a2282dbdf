"""Model-load stall: how long clients of one model wait while Triton loads another, by how the load is asked for.

A real tritonserver (explicit model control) serves `plain` (python backend, y = 2x) to `--connections`
keep-alive HTTP clients, each sending a request every few milliseconds. In turn, round after round, the
benchmark then
- `none`: leaves Triton alone for as long as a load takes (the clients' own spread),
- `http`: loads (and afterwards unloads) `slow`, a model whose initialize() takes `--load-s` seconds as a
  big engine's does, through Triton's HTTP repository API (POST /v2/repository/models/slow/load),
- `grpc`: loads and unloads `slow` through Triton's gRPC repository API,
and prints, for the client requests sent while the load ran, the largest wait, the p99 and how many waited
more than `--stall-ms`, with the medians over rounds.

Why they differ: Triton's HTTP server answers a repository load inside an HTTP worker thread
(`HTTPAPIServer::HandleRepositoryControl` calls the blocking TRITONSERVER_ServerLoadModelWithParameters); in
this measurement every keep-alive connection, not only those of that thread, waited for the whole load.
A gRPC load runs on the gRPC server's own threads.

    .venv/bin/python benchmarks/model_load_stall.py                    # 5 rounds, load_s 2
    .venv/bin/python benchmarks/model_load_stall.py --rounds 3 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
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

from tests.sidecar_models import add_model, infer_body
from tunegate.triton import EmbeddedTriton, TritonOptions

METHODS = ("none", "http", "grpc")


async def _control_http(client: aiohttp.ClientSession, base: str, action: str, model: str) -> None:
    async with client.post(f"{base}/v2/repository/models/{model}/{action}") as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {action} {model}: {r.status} {await r.text()}")


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import tritonclient.grpc.aio as grpcclient

    with tempfile.TemporaryDirectory(prefix="load-stall-") as tmp:
        repo = Path(tmp) / "repo"
        add_model(repo, "plain", {})
        add_model(repo, "slow", {}, baseline={"load_s": args.load_s})
        opts = TritonOptions(repository=repo, models=("plain",))
        with EmbeddedTriton(opts, workdir=Path(tmp) / "triton") as triton:
            base = triton.http_url
            grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{triton.grpc_port}")
            body, headers = infer_body(np.random.default_rng(0))
            url = f"{base}/v2/models/plain/versions/1/infer"
            lat: list[tuple[float, float]] = []
            stop = asyncio.Event()

            async def client() -> None:
                async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as s:
                    while not stop.is_set():
                        t0 = time.monotonic()
                        async with s.post(url, data=body, headers=headers) as r:
                            await r.read()
                        lat.append((t0, time.monotonic() - t0))
                        await asyncio.sleep(args.pause_ms / 1e3)

            tasks = [asyncio.ensure_future(client()) for _ in range(args.connections)]
            rows: dict[str, list[dict[str, float]]] = {m: [] for m in METHODS}
            async with aiohttp.ClientSession() as ctl:
                await asyncio.sleep(2.0)  # every connection open and warm
                for rnd in range(args.rounds):
                    order = METHODS if rnd % 2 == 0 else METHODS[::-1]
                    for method in order:
                        t0 = time.monotonic()
                        if method == "http":
                            await _control_http(ctl, base, "load", "slow")
                        elif method == "grpc":
                            await grpc.load_model("slow")
                        else:
                            await asyncio.sleep(args.load_s + 0.3)
                        t1 = time.monotonic()
                        await asyncio.sleep(0.5)  # the requests sent during the load come back
                        waits = [s for t, s in lat if t0 <= t <= t1]
                        row = {"load_s": t1 - t0, "requests": len(waits),
                               "max_ms": 1e3 * max(waits, default=0.0),
                               "p99_ms": 1e3 * float(np.quantile(waits, 0.99)) if waits else 0.0,
                               "stalled": sum(1 for s in waits if s * 1e3 > args.stall_ms)}  # fmt: skip
                        rows[method].append(row)
                        print(f"round {rnd + 1} {method:>4}: load {row['load_s']:.2f} s, {row['requests']} requests,"
                              f" max {row['max_ms']:.0f} ms, p99 {row['p99_ms']:.0f} ms,"
                              f" {row['stalled']} over {args.stall_ms:g} ms", flush=True)  # fmt: skip
                        if method == "http":
                            await _control_http(ctl, base, "unload", "slow")
                        elif method == "grpc":
                            await grpc.unload_model("slow")
                        await asyncio.sleep(1.0)
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
            await grpc.close()
    summary = {m: {k: float(np.median([r[k] for r in rs])) for k in ("load_s", "max_ms", "p99_ms", "stalled")}
               for m, rs in rows.items()}  # fmt: skip
    return {
        "rounds": rows,
        "median": summary,
        "params": {k: getattr(args, k) for k in ("rounds", "connections", "load_s", "pause_ms", "stall_ms")},
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--connections", type=int, default=16, help="keep-alive client connections (default 16)")
    ap.add_argument("--load-s", type=float, default=2.0, help="seconds the loaded model's initialize() takes")
    ap.add_argument("--pause-ms", type=float, default=10.0, help="each client's pause between requests")
    ap.add_argument("--stall-ms", type=float, default=250.0, help="a wait longer than this counts as stalled")
    ap.add_argument("--json", metavar="PATH", help="also write every round as JSON")
    args = ap.parse_args(argv)
    res = asyncio.run(run(args))
    print("\nmedian over rounds (requests sent while the load ran):")
    print(f"{'method':>6} {'load s':>7} {'max ms':>8} {'p99 ms':>8} {'stalled':>8}")
    for m, s in res["median"].items():
        print(f"{m:>6} {s['load_s']:7.2f} {s['max_ms']:8.0f} {s['p99_ms']:8.0f} {s['stalled']:8.0f}")
    n, h, g = (res["median"][m]["max_ms"] for m in METHODS)
    print(f"largest wait against the quiet window: http {h / n:.1f}x, grpc {g / n:.1f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
