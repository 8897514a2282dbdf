"""Sidecar vs nginx in front of the same Triton: throughput and added latency, with and without mirroring.

One run prints the table issue 4 asks for. Every setup is up at once and the runs interleave (round after round,
each concurrency, every setup in turn); figures are medians over the rounds, ratios the medians of each round's own
ratios. Load: wrk (POST, keep-alive, --latency) at each concurrency, against python-backend identity models
FP32[16] on the embedded Triton:

  direct            wrk -> Triton
  nginx             wrk -> nginx (proxy_pass, upstream keepalive) -> Triton
  nginx+mirror      ... plus `mirror` + `mirror_request_body on` (100%) to an identical candidate
  sidecar           wrk -> tunegate sidecar (no canary) -> Triton
  sidecar+mirror    ... with a canary mirroring 100% to an identical candidate (the compare's fast path)
  sidecar+mirror~   ... to a candidate whose outputs differ within the tolerance (full decode + compare)
  nginx+slow        nginx mirroring 100% to a candidate 100 ms slower
  sidecar+slow      the sidecar mirroring (sample 100%, bounded) to a candidate 100 ms slower

    .venv/bin/python benchmarks/sidecar_vs_nginx.py --duration 10            # the real run (quiet machine)
    .venv/bin/python benchmarks/sidecar_vs_nginx.py --duration 1 -c 1 4      # smoke

Needs `nginx` and `wrk` on PATH (Debian: apt-get install nginx wrk).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
from rich.console import Console
from rich.table import Table

from sidecar.client import AdminClient, SidecarProcess, write_token_file
from tunegate.repository import ModelConfig, TensorSpec, write_config, write_version
from tunegate.triton import EmbeddedTriton, TritonOptions, free_port

TOKEN = "benchmark-admin-token-0123456789"
IDENTITY_PY = """
import json, os, time
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        here = os.path.join(args["model_repository"], args["model_version"])
        behaviour = json.load(open(os.path.join(here, "behaviour.json")))
        self.delay = behaviour.get("delay_ms", 0) / 1000.0
        self.offset = behaviour.get("offset", 0.0)

    def execute(self, requests):
        if self.delay:
            time.sleep(self.delay)
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "x").as_numpy()
            y = (x + self.offset).astype(x.dtype) if self.offset else x
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("y", y)]))
        return out
"""
BODY = json.dumps(
    {"inputs": [{"name": "x", "datatype": "FP32", "shape": [16], "data": [float(i) for i in range(16)]}]}
)
NGINX_HEAD = """
worker_processes 1;
daemon off;
user root;
error_log {prefix}/error.log warn;
pid {prefix}/nginx.pid;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {prefix}/body;
  proxy_temp_path {prefix}/proxy;
  fastcgi_temp_path {prefix}/fastcgi;
  uwsgi_temp_path {prefix}/uwsgi;
  scgi_temp_path {prefix}/scgi;
  client_body_buffer_size 1m;
  upstream triton {{ server 127.0.0.1:{triton_port}; keepalive 64; }}
"""
NGINX_CONF = (
    NGINX_HEAD
    + """
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://triton;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      {mirror}
    }}
    location = /mirror {{
      internal;
      proxy_pass http://triton/v2/models/{mirror_model}/infer;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
    }}
  }}
}}
"""
)


def build_repository(root: Path) -> Path:
    def model(name: str, versions: dict[int, dict[str, float]]) -> None:
        for v, behaviour in versions.items():
            write_version(
                root, name, {"model.py": IDENTITY_PY, "behaviour.json": json.dumps(behaviour)}, version=v
            )
        cfg = ModelConfig(name, (TensorSpec("x", "FP32", (16,)),), (TensorSpec("y", "FP32", (16,)),),
                          versions=(min(versions),))  # fmt: skip
        write_config(root, cfg)

    # Each sidecar setup has a model of its own, v1 the baseline: no candidate; an identical one; one whose outputs
    # differ within the tolerance (every comparison takes the full decode + compare path, none the
    # identical-outputs fast path); one 100 ms slower.
    model("plain", {1: {}})
    model("ident", {1: {}, 2: {}})
    model("identd", {1: {}, 2: {"offset": 5e-7}})
    model("idents", {1: {}, 2: {"delay_ms": 100}})
    model("nginx_cand", {1: {}})  # nginx's mirror targets (nginx has no notion of versions under canary)
    model("nginx_slow", {1: {"delay_ms": 100}})
    return root


@contextlib.contextmanager
def nginx_with(workdir: Path, conf_template: str, **fields: Any) -> Iterator[tuple[int, int]]:
    """nginx in the foreground on a free port with `conf_template` filled in; yields (port, pid)."""
    prefix = Path(tempfile.mkdtemp(prefix="nginx-", dir=workdir))
    port = free_port()
    conf = prefix / "nginx.conf"
    conf.write_text(conf_template.format(prefix=prefix, port=port, **fields))
    proc = subprocess.Popen(["nginx", "-p", str(prefix), "-c", str(conf)], stderr=subprocess.PIPE)
    try:
        wait_port(port, proc)
        yield port, proc.pid
    finally:
        proc.send_signal(signal.SIGQUIT)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


@contextlib.contextmanager
def nginx(workdir: Path, triton_port: int, mirror_model: str | None) -> Iterator[tuple[str, int]]:
    mirror = "mirror /mirror;\n      mirror_request_body on;" if mirror_model else ""
    with nginx_with(workdir, NGINX_CONF, triton_port=triton_port, mirror=mirror,
                    mirror_model=mirror_model or "none") as (port, pid):  # fmt: skip
        yield f"http://127.0.0.1:{port}", pid


def wait_port(port: int, proc: subprocess.Popen[bytes], timeout_s: float = 10) -> None:
    import socket

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"nginx exited: {proc.stderr.read().decode() if proc.stderr else ''}")
        with socket.socket() as s, contextlib.suppress(OSError):
            s.connect(("127.0.0.1", port))
            return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port}")


_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 6e4}


def _ms(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text)
    if not m:
        raise ValueError(f"cannot read wrk latency {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


def wrk(url: str, concurrency: int, duration_s: float, lua: Path) -> dict[str, float]:
    out = subprocess.run(
        ["wrk", "-t1", f"-c{concurrency}", f"-d{max(1, round(duration_s))}s", "--latency", "-s", str(lua),
         f"{url}/v2/models/ident/infer" if "/v2/" not in url else url],
        capture_output=True, text=True, timeout=duration_s + 60, check=True,
    ).stdout  # fmt: skip
    dist = dict(re.findall(r"^\s+(50|75|90|99)%\s+(\S+)$", out, re.MULTILINE))
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    timeouts = re.search(r"Socket errors:.*timeout (\d+)", out)
    # When every request timed out (wrk's 2 s) there is no latency distribution: report NaN, not a crash.
    nan = float("nan")
    return {"rps": rps, "p50_ms": _ms(dist["50"]) if "50" in dist else nan,
            "p99_ms": _ms(dist["99"]) if "99" in dist else nan,
            "errors": float(non2xx.group(1)) if non2xx else 0.0,
            "timeouts": float(timeouts.group(1)) if timeouts else 0.0}  # fmt: skip


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds of a process and its children (nginx's workers), 0 for none."""
    if pid is None:
        return 0.0
    try:
        procs = [psutil.Process(pid)]
        procs += procs[0].children(recursive=True)
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for pr in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            t = pr.cpu_times()
            total += t.user + t.system
    return total


FAST_SETUPS = ("direct", "nginx", "sidecar", "nginx+mirror", "sidecar+mirror", "sidecar+mirror~")
SLOW_SETUPS = ("nginx+slow", "sidecar+slow")
# The sidecar's setups each have their own model (and canary), so all of them run at once.
SIDECAR_MODELS = {
    "sidecar": "plain",
    "sidecar+mirror": "ident",
    "sidecar+mirror~": "identd",
    "sidecar+slow": "idents",
}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every setup is up at once and their runs interleave: per round and concurrency, the fast setups one after
    another (in reverse order every other round), then the slow ones. Each setup's figure is the median over the
    rounds, and each ratio the median of the ratios within a round (runs seconds apart), so that drift on a
    shared 2-core machine, which moved whole rounds by 10-20% in one run, cancels out."""
    for tool in ("nginx", "wrk"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} is not on PATH (Debian: apt-get install nginx wrk)")
    work = Path(tempfile.mkdtemp(prefix="bench-sidecar-"))
    lua = work / "post.lua"
    lua.write_text(
        f'wrk.method = "POST"\nwrk.body = {json.dumps(BODY)}\nwrk.headers["Content-Type"] = "application/json"\n'
    )
    repo = build_repository(work / "repo")
    token = write_token_file(work / "token", TOKEN)
    raw: dict[str, dict[int, list[dict[str, float]]]] = {}
    console = Console(stderr=True)
    models = ("plain", "ident", "identd", "idents", "nginx_cand", "nginx_slow")
    with contextlib.ExitStack() as stack:
        triton = stack.enter_context(
            EmbeddedTriton(TritonOptions(repository=repo, models=models), workdir=work / "t")
        )
        triton_pid = triton.proc.pid if triton.proc is not None else None
        targets: dict[str, tuple[str, int | None]] = {
            "direct": (f"{triton.http_url}/v2/models/plain/infer", None)
        }
        for name, mirror_model in (
            ("nginx", None),
            ("nginx+mirror", "nginx_cand"),
            ("nginx+slow", "nginx_slow"),
        ):
            url, pid = stack.enter_context(nginx(work, triton.http_port, mirror_model))
            targets[name] = (f"{url}/v2/models/plain/infer", pid)
        sc = stack.enter_context(SidecarProcess(upstream=triton.http_url, upstream_grpc=triton.grpc_address, state_dir=work / "state", repository=repo,
                                                token_file=token))  # fmt: skip
        sc_pid = sc.proc.pid if sc.proc is not None else None
        for name, model in SIDECAR_MODELS.items():
            targets[name] = (f"{sc.url}/v2/models/{model}/infer", sc_pid)
        admin = AdminClient(sc.url, TOKEN)
        # The mirrored runs measure throughput with every response compared, so the judge must not end them (a
        # run would go on as passthrough). Saturated, the candidate's copies queue up to max_in_flight deep at
        # its single instance while the primary sees the clients' few: paired p50 ratios of 16-23 were seen,
        # past any slack. So no latency pairs are kept (every response is a warm-up one: outputs compared,
        # latency not paired); a canary decided anyway is reported.
        unjudged = {"min_samples": 10**9, "deadline_s": 86400.0, "aa_rate": 0.0, "sample_rate": 1.0,
                    "warmup_samples": 10**9}  # fmt: skip
        tol = {"y": {"metric": "linf", "threshold": 1e-6}}
        admin.start(
            "ident", 2, tol, max_in_flight=64, **unjudged
        )  # identical outputs: the compare's fast path
        admin.start(
            "identd", 2, tol, max_in_flight=64, **unjudged
        )  # within tolerance, not identical: full compares
        admin.start("idents", 2, tol, **unjudged)  # 100 ms slower; the default bound of 8 in flight
        # The first requests to each model (and candidate) take tens of ms (a 1 s run's p99 went from 0.8 to
        # 28 ms): one discarded second per setup first.
        for name in (*FAST_SETUPS, *SLOW_SETUPS):
            wrk(targets[name][0], 1, 1, lua)
        for rnd in range(args.repeats):
            console.print(f"[bold]round {rnd + 1} of {args.repeats}")
            for c in args.concurrency:
                fast = FAST_SETUPS if rnd % 2 == 0 else FAST_SETUPS[::-1]
                for name in (*fast, *SLOW_SETUPS):
                    url, pid = targets[name]
                    before = cpu_seconds(pid), cpu_seconds(triton_pid)
                    r = wrk(url, c, args.duration, lua)
                    after = cpu_seconds(pid), cpu_seconds(triton_pid)
                    n = max(1.0, r["rps"] * max(1, round(args.duration)))
                    # CPU per client request: the proxy's own (nginx master + worker, or the sidecar) and
                    # Triton's (server + python stubs), which mirroring doubles.
                    record(raw, name, c, r, before, after, n, console)
        evidence = {}
        for model in ("ident", "identd", "idents"):
            st = admin.status(model)
            if st["canary"] is None:  # its runs were partly passthrough: kept, but flagged in the output
                console.print(f"[red]the canary of {model} was decided during the benchmark: {st['last']}")
                evidence[model] = {"decided": st["last"]}
            else:
                evidence[model] = st["canary"]["evidence"]
    results = {name: {c: median_run(runs) for c, runs in per.items()} for name, per in raw.items()}
    return {"results": results, "ratios": paired_ratios(raw), "runs": raw, "mirror_evidence": evidence,
            "duration_s": args.duration, "repeats": args.repeats}  # fmt: skip


RATIOS = {"passthrough": ("sidecar", "nginx"), "mirrored": ("sidecar+mirror", "nginx+mirror"),
          "mirrored, full compares": ("sidecar+mirror~", "nginx+mirror")}  # fmt: skip


def record(raw: dict[str, dict[int, list[dict[str, float]]]], name: str, c: int, r: dict[str, float],
           before: tuple[float, float], after: tuple[float, float], n: float, console: Console) -> None:  # fmt: skip
    """Add one measurement with its CPU per request (the proxy's and Triton's, from CPU seconds before and after
    over `n` requests) and print it."""
    r["proxy_cpu_us"] = (after[0] - before[0]) / n * 1e6
    r["triton_cpu_us"] = (after[1] - before[1]) / n * 1e6
    raw.setdefault(name, {}).setdefault(c, []).append(r)
    console.print(f"{name:15s} c={c:<3d} {r['rps']:8.0f} req/s  p50 {r['p50_ms']:.3f} ms  p99 "
                  f"{r['p99_ms']:.3f} ms  cpu/req proxy {r['proxy_cpu_us']:.0f} us, triton "
                  f"{r['triton_cpu_us']:.0f} us")  # fmt: skip


def paired_ratios(
    raw: dict[str, dict[int, list[dict[str, float]]]],
) -> dict[str, dict[int, dict[str, float]]]:
    """Throughput ratios within each round (runs seconds apart): their median, min and max over the rounds."""
    out: dict[str, dict[int, dict[str, float]]] = {}
    for label, (ours, peer) in RATIOS.items():
        for c, runs in raw[ours].items():
            ratios = [a["rps"] / b["rps"] for a, b in zip(runs, raw[peer][c], strict=True) if b["rps"] > 0]
            nan = float("nan")
            out.setdefault(label, {})[c] = ({"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
                                            if ratios else {"median": nan, "min": nan, "max": nan})  # fmt: skip
    return out


def median_run(runs: list[dict[str, float]]) -> dict[str, float]:
    """Per key, the median over the rounds (NaN where no round had a value, e.g. all requests timed out)."""
    out = {}
    for key in runs[0]:
        vals = [r[key] for r in runs if not math.isnan(r[key])]
        out[key] = statistics.median(vals) if vals else float("nan")
    return out


def report(data: dict[str, Any]) -> None:
    res = data["results"]
    conc = list(next(iter(res.values())))
    t = Table(
        title="tunegate sidecar vs nginx (identity FP32[16], python backend, wrk POST keep-alive; "
        f"medians of {data.get('repeats', 1)} rounds)"
    )
    t.add_column("setup")
    for c in conc:
        t.add_column(f"c={c} req/s", justify="right")
        t.add_column(f"c={c} +p50/+p99 ms", justify="right")
    for name, per in res.items():
        row = [name]
        for c in conc:
            r, d = per[c], res["direct"][c]
            err = f" ({r['errors']:.0f} err)" if r["errors"] else ""
            err += f" ({r['timeouts']:.0f} timeouts)" if r.get("timeouts") else ""
            row += [
                f"{r['rps']:.0f}{err}",
                f"{r['p50_ms'] - d['p50_ms']:+.3f} / {r['p99_ms'] - d['p99_ms']:+.3f}",
            ]
        t.add_row(*row)
    Console().print(t)
    cpu = Table(
        title="CPU per client request, us (proxy: nginx master+worker or the sidecar; triton: server + stubs)"
    )
    cpu.add_column("setup")
    for c in conc:
        cpu.add_column(f"c={c} proxy", justify="right")
        cpu.add_column(f"c={c} triton", justify="right")
    for name, per in res.items():
        cpu.add_row(
            name,
            *[f"{per[c].get(k, float('nan')):.0f}" for c in conc for k in ("proxy_cpu_us", "triton_cpu_us")],
        )
    Console().print(cpu)
    lines = []
    rat = data["ratios"]

    def ratio(label: str, c: Any) -> str:
        r = rat[label][c]
        return f"{r['median']:.2f}x ({r['min']:.2f}-{r['max']:.2f})"

    for c in conc:
        lines.append(
            f"c={c}: passthrough {ratio('passthrough', c)} nginx (target >= 0.8); mirrored {ratio('mirrored', c)} "
            f"nginx+mirror (target >= 1.0; {ratio('mirrored, full compares', c)} when every comparison is a full "
            f"one); client p99 with a 100 ms slower candidate: sidecar "
            f"{res['sidecar+slow'][c]['p99_ms']:.2f} ms (vs {res['sidecar+mirror'][c]['p99_ms']:.2f} mirrored, "
            f"{res['sidecar'][c]['p99_ms']:.2f} passthrough), nginx {res['nginx+slow'][c]['p99_ms']:.2f} ms"
        )
    Console().print(
        f"Throughput ratios: the median of the {data.get('repeats', 1)} rounds' own ratios (their range)"
    )
    Console().print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=10.0, help="seconds per measurement")
    p.add_argument("-c", "--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument(
        "--repeats", type=int, default=3, help="rounds of every setup; figures are medians over them"
    )
    p.add_argument("--json", action="store_true", help="print the raw results as JSON too")
    args = p.parse_args(argv)
    data = run(args)
    report(data)
    if args.json:
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
