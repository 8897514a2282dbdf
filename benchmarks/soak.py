"""Soak: the sidecar under mixed good, hostile and disconnecting traffic for a set time, watched from outside.

A real sidecar process in front of the embedded Triton (a python-backend test model). A first phase sends
good traffic alone (the client p99 to compare with); the second adds hostile clients (garbage, oversized
URLs and headers, header and body trickles cut off, a chunk announced and never sent, shapes the body cannot
hold, requests to thousands of unknown models and versions, admin calls with wrong tokens) and clients
that disconnect before or while their answer comes. Every `--every` seconds it prints the sidecar's RSS,
its open files, the size and series count of /metrics and the good clients' p99; at the end, once traffic
stops, the open files again.

    .venv/bin/python benchmarks/soak.py --duration 1800            # the 30-minute soak
    .venv/bin/python benchmarks/soak.py --duration 45 --every 5 --hostile-rate 0   # tests/test_soak.py's short one

Exit code 1 when RSS grows more than --max-rss-growth-mb after the warm-up, /metrics passes 1 MB, or the open
files do not come back to their baseline; the p99 ratio (mixed against good alone) is printed, not judged:
the hostile clients run on the same cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from sidecar.client import SidecarProcess, write_token_file
from tests.sidecar_models import add_model, infer_body
from tunegate.triton import EmbeddedTriton, TritonOptions

TOKEN = "soak-benchmark-token-0123456789"
MODEL = "plain"


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def send(port: int, data: bytes, *, read: bool = True, timeout_s: float = 5.0) -> bytes:
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), timeout_s)
    except (OSError, TimeoutError):
        return b""
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(1 << 16), timeout_s) if read else b""
    except (OSError, TimeoutError):
        return b""
    finally:
        writer.close()


def hostile_requests(rng: random.Random, body: bytes) -> bytes:
    """One malformed or abusive request, chosen at random."""
    kind = rng.randrange(9)
    if kind == 0:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 400)))
    if kind == 1:
        return b"GET /v2/models/" + b"m" * rng.randrange(5_000, 50_000) + b" HTTP/1.1\r\nHost: x\r\n\r\n"
    if kind == 2:
        return b"GET /v2 HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * rng.randrange(10_000, 200_000) + b"\r\n\r\n"
    if kind == 3:
        return (b"POST /v2/models/nosuch%d/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                % (rng.randrange(10**6), len(body), body))  # fmt: skip
    if kind == 4:
        return (b"POST /v2/models/plain/versions/%d/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                % (rng.randrange(2, 10**6), len(body), body))  # fmt: skip
    if kind == 5:
        bomb = b'{"inputs":[{"name":"x","shape":[1099511627776,4],"datatype":"FP32","data":[1]}]}'
        return b"POST /v2/models/plain/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (
            len(bomb),
            bomb,
        )
    if kind == 6:
        return b"POST /v2/models/plain/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffff\r\nab"
    if kind == 7:
        return b"GET /canary HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer wrong%d\r\n\r\n" % rng.randrange(
            10**6
        )
    return b"POST /v2/repository/models/plain/unload HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"


async def soak(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    repo = work / "repo"
    add_model(repo, MODEL, {})
    with EmbeddedTriton(TritonOptions(repository=repo, models=(MODEL,)), workdir=work / "triton") as triton, \
            SidecarProcess(upstream=triton.http_url, upstream_grpc=triton.grpc_address, state_dir=work / "state", repository=repo,
                           token_file=write_token_file(work / "token", TOKEN)) as sc:  # fmt: skip
        assert sc.proc is not None
        pid, port = sc.proc.pid, sc.port
        lat: list[tuple[float, float]] = []  # (when, seconds) of good requests
        stop = asyncio.Event()
        hostile_on = asyncio.Event()
        body, _headers = infer_body(np.random.default_rng(0))
        good_req = (b"POST /v2/models/plain/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip

        async def good() -> None:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            while not stop.is_set():
                t0 = time.perf_counter()
                writer.write(good_req)
                head = await reader.readuntil(b"\r\n\r\n")
                n = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                await reader.readexactly(n)
                lat.append((time.monotonic(), time.perf_counter() - t0))
                await asyncio.sleep(0.005)
            writer.close()

        async def hostile(seed: int) -> None:
            rng = random.Random(seed)
            await hostile_on.wait()
            while not stop.is_set():
                kind = rng.random()
                if kind < 0.6:
                    await send(port, hostile_requests(rng, body), timeout_s=3.0)
                elif kind < 0.8:  # a trickle cut off: half a head, then gone
                    await send(port, good_req[: rng.randrange(5, 60)], read=False)
                else:  # disconnect before (or while) the answer comes
                    await send(port, good_req, read=False)
                await asyncio.sleep(args.hostile / args.hostile_rate if args.hostile_rate > 0 else 0.002)

        samples: list[dict[str, Any]] = []
        t_start = time.monotonic()
        phase_good = args.duration * args.good_share

        async def watch() -> None:
            while not stop.is_set():
                await asyncio.sleep(args.every)
                now = time.monotonic()
                window = [s for t, s in lat if t > now - args.every]
                metrics = await send(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
                                     timeout_s=10.0)  # fmt: skip
                text = metrics.split(b"\r\n\r\n", 1)[-1]
                row = {"t": round(now - t_start, 1), "phase": "mixed" if hostile_on.is_set() else "good",
                       "rss_mb": round(rss_mb(pid), 1), "open_files": open_files(pid),
                       "metrics_bytes": len(text), "series": text.count(b"\n") - text.count(b"\n#"),
                       "good_requests": len(window),
                       "p99_ms": round(float(np.quantile(window, 0.99)) * 1e3, 2) if window else None}  # fmt: skip
                samples.append(row)
                print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
                if now - t_start >= phase_good:
                    hostile_on.set()
                if now - t_start >= args.duration:
                    stop.set()

        tasks = [asyncio.ensure_future(good()) for _ in range(args.clients)]
        tasks += [asyncio.ensure_future(hostile(i)) for i in range(args.hostile)]
        await watch()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(2.0)
        end_files = open_files(pid)
    # The baseline: after the first seconds of good traffic, when the upstream pool's connections are open.
    return {"samples": samples, "base_files": samples[0]["open_files"], "end_files": end_files}


def verdict(res: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    s = res["samples"]
    warm = s[max(1, len(s) // 5) :]
    rss = [r["rss_mb"] for r in warm]
    good = [r["p99_ms"] for r in s if r["phase"] == "good" and r["p99_ms"]]
    mixed = [r["p99_ms"] for r in s if r["phase"] == "mixed" and r["p99_ms"]]
    out = {
        "rss_growth_mb": round(max(rss) - rss[0], 1) if rss else None,
        "metrics_max_bytes": max(r["metrics_bytes"] for r in s),
        "open_files_base": res["base_files"], "open_files_end": res["end_files"],
        "p99_good_ms": float(np.median(good)) if good else None,
        "p99_mixed_ms": float(np.median(mixed)) if mixed else None,
    }  # fmt: skip
    out["p99_ratio"] = out["p99_mixed_ms"] / out["p99_good_ms"] if good and mixed else None
    out["ok"] = bool(out["rss_growth_mb"] is not None and out["rss_growth_mb"] <= args.max_rss_growth_mb
                     and out["metrics_max_bytes"] < 1 << 20 and out["open_files_end"] <= out["open_files_base"] + 2)  # fmt: skip
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=1800.0, help="seconds in all (default 1800)")
    ap.add_argument(
        "--good-share", type=float, default=0.25, help="share of the time with good traffic alone"
    )
    ap.add_argument("--every", type=float, default=30.0, help="seconds between samples (default 30)")
    ap.add_argument("--clients", type=int, default=4, help="good clients (default 4)")
    ap.add_argument("--hostile", type=int, default=4, help="hostile and disconnecting clients (default 4)")
    ap.add_argument(
        "--hostile-rate",
        type=float,
        default=100.0,
        help="hostile requests per second, all clients together (default 100; 0: as fast as they go)",
    )
    ap.add_argument("--max-rss-growth-mb", type=float, default=20.0)
    ap.add_argument("--json", metavar="PATH", help="also write every sample and the verdict as JSON")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="soak-") as d:
        res = asyncio.run(soak(args, Path(d)))
    v = verdict(res, args)
    print(json.dumps(v))
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": vars(args), "verdict": v, **res}, indent=1))
    return 0 if v["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
