"""The sidecar's gRPC front vs nginx `grpc_pass` in front of the same Triton: throughput, latency and CPU per
request, with and without mirroring, and the p99 of gRPC clients while a 100 ms slower candidate is mirrored.

Load: Triton's own perf_analyzer (`-i grpc`, the tritonclient wheel's) at each concurrency, against python-backend
identity models FP32[16] on the embedded Triton. Every setup is up at once and the runs interleave (round after
round, each concurrency, every setup in turn); figures are medians over the rounds, ratios the medians of each
round's own ratios.

  direct            perf_analyzer -> Triton's gRPC port
  nginx             perf_analyzer -> nginx (http2 listener, grpc_pass, upstream keepalive) -> Triton
  nginx+mirror      ... plus `mirror` + `mirror_request_body on` (100%) to a location with grpc_pass: see below
  sidecar           perf_analyzer -> the sidecar's compiled gRPC front (tunegate-grpc-front, no canary) -> Triton
  sidecar(python)   ... the same through the Python front (grpcio asyncio; the fallback where the compiled one
                    is not installed)
  sidecar+mirror    ... with a canary mirroring 100% to an identical candidate
  sidecar+slow      ... mirroring (sample 100%, bounded) to a candidate 100 ms slower: clients' p99

nginx mirroring gRPC: nginx's mirror subrequest through grpc_pass is tried at start-up and its outcome reported
(Triton's inference statistics show whether the copies arrived). A gRPC request names its model inside the
protobuf body, which nginx cannot rewrite, so its copies can only go to the same model name (here: the same
Triton and model, twice the work, as nginx+mirror does for HTTP), never to a candidate version beside it.

    .venv/bin/python benchmarks/sidecar_grpc.py --duration 5 --repeats 3     # the real run (quiet machine)
    .venv/bin/python benchmarks/sidecar_grpc.py --duration 2 --repeats 1 -c 1 # smoke

Needs `nginx` on PATH, the compiled front (`make native`), and for perf_analyzer `libb64.so.0d` (Debian
libb64-0d) and `libcudart.so.12` (PyPI nvidia-cuda-runtime-cu12; found in the venv and put on LD_LIBRARY_PATH
here).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
from rich.console import Console
from rich.table import Table
from sidecar_vs_nginx import NGINX_HEAD, build_repository, cpu_seconds, median_run, nginx_with, record
from tritonclient.utils import InferenceServerException

from sidecar.client import AdminClient, SidecarProcess, write_token_file
from tunegate import perf
from tunegate.triton import EmbeddedTriton, TritonOptions

TOKEN = "benchmark-admin-token-0123456789"
NGINX_CONF = (
    NGINX_HEAD
    + """
  server {{
    listen 127.0.0.1:{port} http2;
    location / {{
      grpc_pass grpc://triton;
      {mirror}
    }}
    location = /mirror {{
      internal;
      grpc_pass grpc://triton$request_uri;
    }}
  }}
}}
"""
)
FAST_SETUPS = ("direct", "nginx", "sidecar", "sidecar(python)", "nginx+mirror", "sidecar+mirror")
SLOW_SETUPS = ("sidecar+slow",)
SIDECAR_MODELS = {"sidecar": "plain", "sidecar+mirror": "ident", "sidecar+slow": "idents"}
RATIOS = {
    "passthrough": ("sidecar", "nginx"),
    "passthrough, Python front": ("sidecar(python)", "nginx"),
    "mirrored": ("sidecar+mirror", "nginx+mirror"),
}


@contextlib.contextmanager
def nginx(workdir: Path, triton_grpc_port: int, mirror: bool) -> Iterator[tuple[str, int]]:
    mirror_lines = "mirror /mirror;\n      mirror_request_body on;" if mirror else ""
    with nginx_with(workdir, NGINX_CONF, triton_port=triton_grpc_port, mirror=mirror_lines) as (port, pid):
        yield f"127.0.0.1:{port}", pid


def perf_env() -> dict[str, str]:
    ok, why = perf.available()
    if not ok:
        raise SystemExit(why)
    return perf.env()


PERF_ANALYZER = perf.executable()


def perf_analyzer(address: str, model: str, concurrency: int, duration_s: float, work: Path,
                  env: dict[str, str], latencies: list[np.ndarray] | None = None,
                  _retry: int = 0) -> dict[str, float]:  # fmt: skip
    """One perf_analyzer measurement: 3 windows of `duration_s`/3 at a fixed concurrency (stability not required).
    With `latencies`, every request's latency (ms) in those windows is appended to it as one array (perf_analyzer's
    profile export), so that rounds can be pooled."""
    out = work / f"pa-{model}-{concurrency}.csv"
    export = work / f"pa-{model}-{concurrency}.json"
    window_ms = max(500, int(duration_s * 1000 / 3))
    export.unlink(missing_ok=True)  # perf_analyzer refuses to write over an earlier export
    proc = subprocess.run(
        [PERF_ANALYZER, "-m", model, "-i", "grpc", "-u", address, "--shape", "x:16",
         "--concurrency-range", str(concurrency), "--measurement-interval", str(window_ms),
         "--stability-percentage", "1000", "--max-trials", "3", "-f", str(out),
         *(["--profile-export-file", str(export)] if latencies is not None else [])],
        capture_output=True, text=True, timeout=duration_s * 4 + 120, env=env, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(
            f"perf_analyzer failed against {address} ({model}):\n{proc.stdout[-1500:]}{proc.stderr[-1500:]}"
        )
    with open(out, newline="") as f:
        row = next(csv.DictReader(f))
    if latencies is not None:
        # Seen on a 16-core host (3 times in about 90 runs): an export empty, or cut off at 64 KiB, after a clean
        # exit (perf_analyzer's stream not flushed). Measured again, twice at most.
        text = export.read_text() if export.exists() else ""
        try:
            parsed = json.loads(text)
        except ValueError:
            if _retry >= 2:
                raise RuntimeError(f"perf_analyzer wrote an incomplete profile export 3 times ({model}, "
                                   f"c={concurrency}, {len(text)} bytes):\n{proc.stdout[-800:]}"
                                   f"{proc.stderr[-800:]}")  # fmt: skip
            print(f"perf_analyzer wrote an incomplete profile export ({model}, c={concurrency}, {len(text)} bytes); "
                  "measuring again", file=sys.stderr)  # fmt: skip
            return perf_analyzer(
                address, model, concurrency, duration_s, work, env, latencies, _retry=_retry + 1
            )
        latencies.append(window_latencies_ms(parsed))
    return {"rps": float(row["Inferences/Second"]), "p50_ms": float(row["p50 latency"]) / 1000,
            "p99_ms": float(row["p99 latency"]) / 1000, "seconds": window_ms * 3 / 1000}  # fmt: skip


def window_latencies_ms(profile: dict[str, Any]) -> np.ndarray:
    """The latencies (ms) of the requests sent within the measurement windows of perf_analyzer's profile export
    (its last experiment: the one concurrency run; requests of the ramp before and the drain after are left out)."""
    exp = profile["experiments"][-1]
    bounds = exp.get("window_boundaries") or []
    lo, hi = (bounds[0], bounds[-1]) if len(bounds) >= 2 else (-np.inf, np.inf)
    out = [(r["response_timestamps"][-1] - r["timestamp"]) / 1e6 for r in exp["requests"]
           if r.get("response_timestamps") and lo <= r["timestamp"] < hi]  # fmt: skip
    return np.asarray(out, dtype=np.float64)


def measure(raw: dict[str, dict[int, list[dict[str, float]]]], name: str, address: str, model: str, concurrency: int,
            duration_s: float, work: Path, env: dict[str, str], pids: tuple[int | None, int | None],
            console: Console, latencies: list[np.ndarray] | None = None) -> dict[str, float]:  # fmt: skip
    """One perf_analyzer run recorded under `name` with the CPU per request of `pids` (the proxy, Triton) over the
    whole run (its windows and the ramp between: requests estimated from the measured rate over the wall time)."""
    before = cpu_seconds(pids[0]), cpu_seconds(pids[1])
    t0 = time.monotonic()
    r = perf_analyzer(address, model, concurrency, duration_s, work, env, latencies)
    r["wall_s"] = time.monotonic() - t0
    after = cpu_seconds(pids[0]), cpu_seconds(pids[1])
    record(raw, name, concurrency, r, before, after, max(1.0, r["rps"] * r["wall_s"]), console)
    return r


def concurrency_table(title: str, results: dict[str, dict[int, dict[str, float]]],
                      columns: list[tuple[str, Callable[[str, int, dict[str, float]], str]]]) -> Table:  # fmt: skip
    """A row per setup, for each concurrency one column per (header, cell of setup, concurrency, medians)."""
    conc = list(next(iter(results.values())))
    t = Table(title=title)
    t.add_column("setup")
    for c in conc:
        for header, _ in columns:
            t.add_column(f"c={c} {header}", justify="right")
    for name, per in results.items():
        t.add_row(name, *(cell(name, c, per[c]) for c in conc for _, cell in columns))
    return t


def inference_count(triton: EmbeddedTriton, model: str) -> int:
    with grpcclient.InferenceServerClient(triton.grpc_address) as c:
        stats = c.get_inference_statistics(model).model_stats
    return sum(s.inference_count for s in stats)


def nginx_mirrors_grpc(address: str, triton: EmbeddedTriton) -> dict[str, Any]:
    """Does nginx's mirror reach Triton through grpc_pass? Counted in Triton's statistics for 20 requests."""
    before = inference_count(triton, "nginx_cand")
    x = np.arange(16, dtype=np.float32)
    inp = grpcclient.InferInput("x", [16], "FP32")
    inp.set_data_from_numpy(x)
    errors = 0
    with grpcclient.InferenceServerClient(address) as c:
        for _ in range(20):
            try:
                c.infer("nginx_cand", [inp])
            except InferenceServerException:  # what nginx answers is the finding
                errors += 1
    time.sleep(0.5)
    arrived = inference_count(triton, "nginx_cand") - before
    return {"client_requests": 20, "client_errors": errors, "triton_inferences": arrived,
            "mirrors": arrived - (20 - errors)}  # fmt: skip


def run(args: argparse.Namespace) -> dict[str, Any]:
    if shutil.which("nginx") is None:
        raise SystemExit("nginx is not on PATH (Debian: apt-get install nginx)")
    env = perf_env()
    work = Path(tempfile.mkdtemp(prefix="bench-grpc-"))
    repo = build_repository(work / "repo")
    token = write_token_file(work / "token", TOKEN)
    raw: dict[str, dict[int, list[dict[str, float]]]] = {}
    console = Console(stderr=True)
    models = ("plain", "ident", "idents", "nginx_cand")
    with contextlib.ExitStack() as stack:
        triton = stack.enter_context(
            EmbeddedTriton(TritonOptions(repository=repo, models=models), workdir=work / "t")
        )
        triton_pid = triton.proc.pid if triton.proc is not None else None
        targets: dict[str, tuple[str, str, int | None]] = {"direct": (triton.grpc_address, "plain", None)}
        for name, mirror in (("nginx", False), ("nginx+mirror", True)):
            addr, pid = stack.enter_context(nginx(work, triton.grpc_port or 0, mirror))
            targets[name] = (addr, "nginx_cand" if mirror else "plain", pid)
        mirror_probe = nginx_mirrors_grpc(targets["nginx+mirror"][0], triton)
        console.print(f"nginx mirror through grpc_pass: {mirror_probe}")
        sc = stack.enter_context(SidecarProcess(upstream=triton.http_url, upstream_grpc=triton.grpc_address,
                                                grpc_listen="127.0.0.1:0", state_dir=work / "state",
                                                repository=repo, token_file=token,
                                                extra_args=("--grpc-front", "native")))  # fmt: skip
        sc_pid = sc.proc.pid if sc.proc is not None else None
        for name, model in SIDECAR_MODELS.items():
            targets[name] = (sc.grpc_address, model, sc_pid)
        py = stack.enter_context(SidecarProcess(upstream=triton.http_url, upstream_grpc=triton.grpc_address,
                                                grpc_listen="127.0.0.1:0", state_dir=work / "state-python",
                                                repository=repo, extra_args=("--grpc-front", "python")))  # fmt: skip
        targets["sidecar(python)"] = (py.grpc_address, "plain", py.proc.pid if py.proc is not None else None)
        admin = AdminClient(sc.url, TOKEN)
        # As in sidecar_vs_nginx.py: every response compared, no judge decision ends a run.
        unjudged = {"min_samples": 10**9, "deadline_s": 86400.0, "aa_rate": 0.0, "sample_rate": 1.0,
                    "warmup_samples": 10**9}  # fmt: skip
        tol = {"y": {"metric": "linf", "threshold": 1e-6}}
        admin.start("ident", 2, tol, max_in_flight=64, **unjudged)
        admin.start("idents", 2, tol, **unjudged)
        for name in (*FAST_SETUPS, *SLOW_SETUPS):  # warm each path (first requests take tens of ms)
            addr, model, _ = targets[name]
            perf_analyzer(addr, model, 1, 1.5, work, env)
        for rnd in range(args.repeats):
            console.print(f"[bold]round {rnd + 1} of {args.repeats}")
            for c in args.concurrency:
                fast = FAST_SETUPS if rnd % 2 == 0 else FAST_SETUPS[::-1]
                for name in (*fast, *SLOW_SETUPS):
                    addr, model, pid = targets[name]
                    measure(raw, name, addr, model, c, args.duration, work, env, (pid, triton_pid), console)
        evidence = {m: admin.status(m)["canary"] for m in ("ident", "idents")}
    results = {name: {c: median_run(runs) for c, runs in per.items()} for name, per in raw.items()}
    ratios: dict[str, dict[int, dict[str, float]]] = {}
    for label, (ours, peer) in RATIOS.items():
        for c, runs in raw[ours].items():
            rs = [a["rps"] / b["rps"] for a, b in zip(runs, raw[peer][c], strict=True) if b["rps"] > 0]
            cpu = [a["proxy_cpu_us"] / b["proxy_cpu_us"] for a, b in zip(runs, raw[peer][c], strict=True)
                   if b["proxy_cpu_us"] > 0]  # fmt: skip
            ratios.setdefault(label, {})[c] = {"rps": statistics.median(rs), "rps_min": min(rs), "rps_max": max(rs),
                                               "cpu": statistics.median(cpu) if cpu else float("nan")}  # fmt: skip
    slow = slow_ratios(raw, args.concurrency)
    return {"results": results, "ratios": ratios, "slow_candidate": slow, "nginx_mirror": mirror_probe,
            "runs": raw, "duration_s": args.duration, "repeats": args.repeats,
            "mirror_evidence": {m: {k: (e or {}).get("evidence", {}).get(k) for k in ("compared", "errors", "aa_errors")}
                                for m, e in evidence.items()}}  # fmt: skip


def slow_ratios(
    raw: dict[str, dict[int, list[dict[str, float]]]], concurrency: list[int]
) -> dict[int, dict[str, float]]:
    """Clients' p99 with the 100 ms slower candidate mirrored, per round: against the same mirroring of an identical
    candidate (what the candidate's slowness adds) and against passthrough (what mirroring adds at all)."""

    def ratio(ours: str, peer: str, c: int) -> float:
        return statistics.median(
            a["p99_ms"] / b["p99_ms"] for a, b in zip(raw[ours][c], raw[peer][c], strict=True)
        )

    return {c: {"p99_vs_identical": ratio("sidecar+slow", "sidecar+mirror", c),
                "p99_vs_passthrough": ratio("sidecar+slow", "sidecar", c)} for c in concurrency}  # fmt: skip


def report(data: dict[str, Any]) -> None:
    t = concurrency_table(
        f"gRPC through the sidecar vs nginx grpc_pass (perf_analyzer, medians of {data['repeats']} rounds)",
        data["results"],
        [("req/s", lambda _n, _c, r: f"{r['rps']:.0f}"), ("p99 ms", lambda _n, _c, r: f"{r['p99_ms']:.2f}"),
         ("cpu/req us", lambda _n, _c, r: f"{r['proxy_cpu_us']:.0f}")],
    )  # fmt: skip
    console = Console()
    console.print(t)
    for label, per in data["ratios"].items():
        console.print(f"{label}: " + ", ".join(
            f"c={c} {r['rps']:.2f}x throughput ({r['rps_min']:.2f}-{r['rps_max']:.2f}), {r['cpu']:.2f}x CPU/request"
            for c, r in per.items()))  # fmt: skip
    console.print("100 ms slower candidate, gRPC clients' p99 against an identical one mirrored the same way / "
                  "against passthrough: " + ", ".join(f"c={c} {r['p99_vs_identical']:.2f}x / {r['p99_vs_passthrough']:.2f}x"
                                                      for c, r in data["slow_candidate"].items()))  # fmt: skip
    for m, ev in data["mirror_evidence"].items():
        # A mirrored row whose copies were not compared (or failed) measured something other than mirroring.
        style = "red" if not ev["compared"] or ev["errors"] or ev["aa_errors"] else "green"
        console.print(f"[{style}]canary of {m}: {ev['compared']} copies compared, {ev['errors']} candidate and "
                      f"{ev['aa_errors']} baseline replay errors")  # fmt: skip
    probe = data["nginx_mirror"]
    console.print(
        f"nginx mirror through grpc_pass: {probe['client_requests']} client requests, "
        f"{probe['triton_inferences']} inferences at Triton ({probe['mirrors']} mirrored copies arrived)"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=5.0, help="seconds per measurement")
    p.add_argument("--repeats", type=int, default=3, help="rounds")
    p.add_argument("-c", "--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--json", type=Path, help="write the figures here")
    args = p.parse_args(argv)
    data = run(args)
    report(data)
    if args.json:
        args.json.write_text(json.dumps(data, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
