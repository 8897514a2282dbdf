"""Triton Model Analyzer's quick search against tunegate's serving search, on MiniLM (python backend) on this host.

Both search Triton's serving configuration of the demo model over the same space: instance count 1..2, and
Triton's batching off (the model as it is: max_batch_size 0, whole [batch, sequence] tensors) or on
(max_batch_size 2..16 with the dynamic batcher, queue delay 0).

- Model Analyzer (`model-analyzer profile`, quick search, local launch mode) starts the pytriton wheel's
  tritonserver itself and loads each configuration it generates. It only searches max_batch_size on a model
  whose config already batches and never rewrites the inputs' dims, so it profiles two forms of the model:
  `minilm` (the model as it is: instance count only) and `minilm_batched` (the same files with tunegate's
  `-max_batch=16 -queue_us=0` config: instance count and max_batch_size 2..16, dynamic batching on). Its load is
  perf_analyzer's: fixed-shape requests of one sentence padded to 32 tokens (`input_ids:1,32` and
  `attention_mask:1,32`; `:32` with Triton's batch dimension), real token ids, concurrency 1..4. Its pick is the
  configuration with the highest throughput over both forms (with `--latency-ms`, p99 within it).
- tunegate (`tunegate tune-serving`'s search, tuner.serving) measures the routes
  `-instances=[same|2] -max_batch=[same|2|4|8|16] -queue_us=[same|0]` on the demo's captured traffic (a synthetic
  capture of its batch mix, batch 1 to 16): each configuration gated for accuracy, then replayed closed-loop at
  the spec's concurrency levels, in alternating rounds. Its best is the passing route with the highest median
  throughput at the objective (p95 within `--latency-ms`; 0: any latency, as specs/minilm.toml).
- Model Analyzer's pick is then looked up in tunegate's search: its gate verdict, and its throughput under the
  captured traffic. A pick whose max_batch_size is below the largest captured request (16) cannot serve that
  traffic: Triton refuses those requests, so it fails the gate.

Throughputs are requests per second, each tool under its own load: perf_analyzer's one-sentence requests
are not the captured mix (1 to 16 sentences, up to 128 tokens), so only the rows after tunegate's (Model
Analyzer's configurations replayed by tunegate) compare configurations under the same traffic.

    .venv/bin/python benchmarks/model_analyzer_compare.py --help
    .venv/bin/python benchmarks/model_analyzer_compare.py \\
        --model-analyzer /opt/ma-venv/bin/model-analyzer --json out.json

Model Analyzer goes in its own virtual environment (its pins clash with the project's):
`python3.11 -m venv /opt/ma-venv && /opt/ma-venv/bin/pip install triton-model-analyzer`. perf_analyzer is the
tritonclient wheel's (tunegate.perf says what it needs); Model Analyzer gets a wrapper that sets its library path
(`perf_analyzer_path`). Each search takes a lock file while it runs (`--lock`, default /tmp/tunegate-cpu.lock;
`flock PATH CMD` takes the same lock, so measurements started that way do not overlap it). About 7 minutes on two cores, besides any wait for the lock. Exit 0 when both searches ran,
1 when one failed, 2 when Model Analyzer or perf_analyzer is missing.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import fcntl
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from loadtest.synth import DEFAULT_BATCH_MIX, SynthSpec, write_synthetic
from tunegate import models, pbtxt, perf
from tunegate.app.demo import STRICT, capture_spec, spec_path
from tunegate.serving import Serving
from tunegate.textdata import Tokenizer, sentences
from tunegate.triton import TritonDistribution, free_port, layout_backends, server_env
from tuner.routes import parse_route
from tuner.serving import KNOBS, ServingResult, serving_of, tune_serving

LOCK = "/tmp/tunegate-cpu.lock"
SEQUENCE = 32  # perf_analyzer's fixed shape: one sentence padded (or cut) to 32 tokens
BATCHED = "minilm_batched"
LARGEST = max(b for b, _ in DEFAULT_BATCH_MIX)  # the capture's largest request (batch 16)
ROUTES = "-instances=[same|2] -max_batch=[same|2|4|8|16] -queue_us=[same|0]"


class CompareError(RuntimeError):
    """A search could not run; the message says which and why."""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@contextlib.contextmanager
def cpu_lock(path: str) -> Iterator[None]:
    """An exclusive lock on `path` (flock(1)'s `flock PATH cmd` takes the same one), so measurements do not overlap."""
    if not path:
        yield
        return
    with open(path, "a") as f:
        t0 = time.monotonic()
        fcntl.flock(f, fcntl.LOCK_EX)
        if time.monotonic() - t0 > 1:
            log(f"waited {time.monotonic() - t0:.0f} s for {path}")
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def find_model_analyzer(name: str) -> str:
    path = shutil.which(name) or (name if Path(name).is_file() else None)
    if path is None:
        raise CompareError(
            f"Model Analyzer not found ({name!r} is not an executable on PATH nor a file). Install it in its own "
            "environment: python3.11 -m venv /opt/ma-venv && /opt/ma-venv/bin/pip install triton-model-analyzer, "
            "then pass --model-analyzer /opt/ma-venv/bin/model-analyzer"
        )
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=120, check=False)
    except OSError as exc:
        raise CompareError(f"{path} cannot run: {exc}") from exc
    if out.returncode != 0:
        raise CompareError(
            f"{path} --version failed (exit {out.returncode}): {(out.stderr or out.stdout)[-2000:]}"
        )
    return path


# -- the model, the traffic and the spec ---------------------------------------------------------------


def effective(config_text: str) -> tuple[int, int, int | None]:
    """(instances, max_batch_size, queue delay in us or None without the dynamic batcher) of a config."""
    cfg = pbtxt.parse(config_text)
    instances = sum(g.count or 1 for g in cfg.instance_group) or 1
    queue = cfg.dynamic_batching.max_queue_delay_microseconds if cfg.HasField("dynamic_batching") else None
    return instances, int(cfg.max_batch_size), queue


def write_input_data(path: Path, batched: bool, count: int = 64) -> Path:
    """perf_analyzer's --input-data: `count` real sentences, each padded or cut to SEQUENCE tokens."""
    tok = Tokenizer(max_length=SEQUENCE)
    pool = sentences()
    data = []
    for text in pool[:count]:
        feeds = tok([text], pad_to=SEQUENCE)
        shape = [SEQUENCE] if batched else [1, SEQUENCE]
        data.append({k: {"content": v.reshape(-1).tolist(), "shape": shape} for k, v in feeds.items()})
    path.write_text(json.dumps({"data": data}))
    return path


def ma_repository(dest: Path) -> Path:
    """Model Analyzer's input: `minilm` as it is, and `minilm_batched` (Triton batches, dynamic batcher on)."""
    models.copy_repository(dest, [models.MINILM], models.minilm_onnx())
    own = (dest / models.MINILM / "config.pbtxt").read_text()
    shutil.copytree(dest / models.MINILM, dest / BATCHED, symlinks=True)
    batched = pbtxt.with_name(Serving(max_batch_size=16, queue_delay_us=0).apply(own), BATCHED)
    (dest / BATCHED / "config.pbtxt").write_text(batched)
    return dest


# -- Model Analyzer ------------------------------------------------------------------------------------


def perf_analyzer_wrapper(dest: Path) -> Path:
    """A `perf_analyzer` that finds its libraries (libcudart from the nvidia-cuda-runtime wheel)."""
    ok, why = perf.available()
    if not ok:
        raise CompareError(why)
    dest.mkdir(parents=True, exist_ok=True)
    wrapper = dest / "perf_analyzer"
    lib = perf.cudart_dir() or ""
    wrapper.write_text(
        f'#!/bin/sh\nLD_LIBRARY_PATH="{lib}:$LD_LIBRARY_PATH" exec "{perf.executable()}" "$@"\n'
    )
    wrapper.chmod(0o755)
    return wrapper


def ma_config(work: Path, repo: Path, latency_ms: float) -> dict[str, Any]:
    dist = TritonDistribution.locate()
    backends = layout_backends(work / "backends", dist)
    env = server_env(dist, [str(ROOT)])
    http, grpc, metrics = free_port(), free_port(), free_port()
    flags = {"shape": [f"input_ids:1,{SEQUENCE}", f"attention_mask:1,{SEQUENCE}"],
             "input-data": str(write_input_data(work / "input-minilm.json", batched=False))}  # fmt: skip
    batched_flags = {"shape": [f"input_ids:{SEQUENCE}", f"attention_mask:{SEQUENCE}"],
                     "input-data": str(write_input_data(work / "input-batched.json", batched=True))}  # fmt: skip
    config: dict[str, Any] = {
        "model_repository": str(repo),
        "output_model_repository_path": str(work / "output_models"),
        "override_output_model_repository": True,
        "export_path": str(work / "export"),
        "checkpoint_directory": str(work / "checkpoints"),
        "triton_launch_mode": "local",
        "triton_server_path": str(dist.server),
        "triton_output_path": str(work / "tritonserver.log"),
        "triton_http_endpoint": f"localhost:{http}",
        "triton_grpc_endpoint": f"localhost:{grpc}",
        "triton_metrics_url": f"http://localhost:{metrics}/metrics",
        "triton_server_flags": {
            "backend-directory": str(backends),
            "backend-config": f"python,shm-region-prefix-name=ma{os.getpid()}x{http}",
            "allow-gpu-metrics": "false",
        },
        "triton_server_environment": {k: env[k] for k in ("LD_LIBRARY_PATH", "PYTHONPATH", "PATH")},
        "perf_analyzer_path": str(perf_analyzer_wrapper(work / "bin")),
        "perf_output": True,
        "perf_output_path": str(work / "perf_analyzer.log"),
        "client_protocol": "grpc",
        "run_config_search_mode": "quick",
        "run_config_search_min_instance_count": 1,
        "run_config_search_max_instance_count": 2,
        "run_config_search_min_model_batch_size": 2,
        "run_config_search_max_model_batch_size": 16,
        "run_config_search_min_concurrency": 1,
        "run_config_search_max_concurrency": 4,
        "num_configs_per_model": 2,
        "profile_models": {
            models.MINILM: {"perf_analyzer_flags": flags},
            BATCHED: {"perf_analyzer_flags": batched_flags},
        },
    }
    if latency_ms > 0:
        config["constraints"] = {"perf_latency_p99": {"max": latency_ms}}
    return config


def run_model_analyzer(exe: str, work: Path, latency_ms: float, timeout_s: float) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    repo = ma_repository(work / "models")
    config = ma_config(work, repo, latency_ms)
    (work / "config.json").write_text(json.dumps(config, indent=1))
    # A YAML file is what Model Analyzer reads; JSON is YAML.
    (work / "config.yaml").write_text(json.dumps(config, indent=1))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    cmd = [exe, "profile", "-f", str(work / "config.yaml")]
    log(f"Model Analyzer: {' '.join(cmd)}")
    t0 = time.monotonic()
    with open(work / "model-analyzer.log", "w") as out:
        try:
            proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=work, timeout=timeout_s,
                                  check=False)  # fmt: skip
            code: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            code = None
    wall = time.monotonic() - t0
    text = (work / "model-analyzer.log").read_text(errors="replace")
    if code != 0:
        why = "timed out" if code is None else f"exited with {code}"
        tail = "\n".join(text.splitlines()[-25:])
        raise CompareError(f"Model Analyzer {why} after {wall:.0f} s; last lines of {work / 'model-analyzer.log'}:\n"
                           f"{tail}")  # fmt: skip
    return {"wall_s": round(wall, 1), **read_ma_results(work, latency_ms)}


def read_ma_results(work: Path, latency_ms: float) -> dict[str, Any]:
    table = work / "export" / "results" / "metrics-model-inference.csv"
    if not table.is_file():
        raise CompareError(f"Model Analyzer wrote no {table}; see {work / 'model-analyzer.log'}")
    with open(table, newline="") as f:
        rows = list(csv.DictReader(f))
    measurements = []
    for row in rows:
        variant = row["Model Config Path"]
        cfg = work / "output_models" / variant / "config.pbtxt"
        instances, max_batch, queue = effective(cfg.read_text())
        p99 = float(row["p99 Latency (ms)"])
        measurements.append({
            "model": row["Model"], "variant": variant, "concurrency": int(row["Concurrency"]),
            "batch": int(row["Batch"]), "throughput": float(row["Throughput (infer/sec)"]), "p99_ms": p99,
            "instances": instances, "max_batch_size": max_batch, "queue_delay_us": queue,
            "within_objective": latency_ms <= 0 or p99 <= latency_ms,
        })  # fmt: skip
    ok = [m for m in measurements if m["within_objective"]]
    if not ok:
        raise CompareError(f"no Model Analyzer measurement is within the objective ({table})")
    # What serves the captured traffic at all: no batching, or a max_batch_size that takes its largest request.
    servable = [m for m in ok if m["max_batch_size"] in (0, *range(LARGEST, 4097))]
    return {
        "configurations": len({m["variant"] for m in measurements}),
        "measurements": len(measurements),
        "pick": max(ok, key=lambda m: m["throughput"]),
        "best_servable": max(servable, key=lambda m: m["throughput"], default=None),
        "table": measurements,
    }


# -- tunegate ------------------------------------------------------------------------------------------


def run_tunegate(work: Path, latency_ms: float) -> tuple[dict[str, Any], ServingResult, str]:
    repo = models.copy_repository(work / "repo", [models.MINILM], models.minilm_onnx())
    capture = work / "capture"
    write_synthetic(capture / "capture-traffic.jsonl", SynthSpec(model=models.MINILM, requests=600, seed=5))
    spec = capture_spec(spec_path(STRICT), capture, repo, models.minilm_onnx(), work / "tune")
    spec = dataclasses.replace(
        spec, serving=dataclasses.replace(spec.serving, routes=ROUTES, latency_ms=latency_ms)
    )
    config_text = (repo / models.MINILM / "config.pbtxt").read_text()
    log(f"tunegate: {spec.serving.routes} at concurrency {list(spec.serving.concurrency)}, "
        f"{spec.serving.rounds} rounds of {spec.serving.window_ms} ms")  # fmt: skip
    t0 = time.monotonic()
    result, _version, _path = tune_serving(spec, write=False, note=log)
    wall = time.monotonic() - t0
    return {"wall_s": round(wall, 1), "serving": dataclasses.asdict(spec.serving)}, result, config_text


def route_config(route: str, config_text: str) -> tuple[int, int, int | None] | None:
    try:
        return effective(serving_of(dict(parse_route(KNOBS, route))).apply(config_text))
    except Exception:  # noqa: BLE001 - a route that cannot apply matches no configuration
        return None


def summarize_tunegate(result: ServingResult, config_text: str) -> dict[str, Any]:
    rows = []
    for r in result.routes:
        med = statistics.median(r.throughput) if r.throughput else None
        rows.append({"route": r.route, "config": route_config(r.route, config_text), "status": r.status,
                     "error": r.error, "median_throughput": med, "ratios": r.ratios,
                     "gate": None if r.gate is None else {"passed": r.gate["passed"], "k": r.gate["rate"]["k"],
                                                          "n": r.gate["rate"]["n"]}})  # fmt: skip
    measured = [r for r in rows if r["median_throughput"] is not None]
    passed = [r for r in measured if r["status"] == "passed"]
    best = max(passed, key=lambda r: r["median_throughput"], default=None)
    return {
        "configurations": len(measured),
        "measurements": sum(len(r.levels) * len(r.levels[0]) for r in result.routes if r.levels),
        "skipped": len(rows) - len(measured),
        "winner": result.winner.route if result.winner else None,
        "reason": result.reason,
        "best": best,
        "routes": rows,
    }


def in_tunegate(pick: dict[str, Any] | None, tg: dict[str, Any]) -> dict[str, Any] | None:
    """tunegate's row for a Model Analyzer configuration (None when its search had no such route)."""
    if pick is None:
        return None
    key = [pick["instances"], pick["max_batch_size"], pick["queue_delay_us"]]
    for r in tg["routes"]:
        if r["config"] is not None and list(r["config"]) == key:
            return r
    return None


# -- the table -----------------------------------------------------------------------------------------


def config_words(instances: int, max_batch: int, queue: int | None) -> str:
    batching = "no batching" if max_batch == 0 else f"max_batch {max_batch}"
    if max_batch and queue is not None:
        batching += f", dynamic batcher {queue} us"
    elif max_batch:
        batching += ", no dynamic batcher"
    return f"{instances} instance{'s' if instances > 1 else ''}, {batching}"


def gate_words(row: dict[str, Any] | None) -> str:
    if row is None:
        return "not in tunegate's space"
    if row["status"] == "skipped" and row["config"] and 0 < row["config"][1] < LARGEST:
        return (
            f"fails: Triton refuses the captured batch-{LARGEST} requests (max_batch_size {row['config'][1]})"
        )
    if row["status"] == "skipped":
        return f"fails: {row['error']}"
    if row["gate"] is None:
        return f"{row['status']}: {row['error']}"
    verdict = "passes" if row["gate"]["passed"] else "fails"
    return f"{verdict} ({row['gate']['k']} of {row['gate']['n']} out of tolerance)"


def table(out: dict[str, Any], latency_ms: float) -> str:
    objective = f"p95/p99 <= {latency_ms:g} ms" if latency_ms > 0 else "any latency"
    head = f"| search | configurations measured | wall time | best configuration | best throughput ({objective}) "
    lines = [
        head + "| tunegate's gate |",
        "|---|---:|---:|---|---:|---|",
    ]
    ma = out.get("model_analyzer")
    tg = out.get("tunegate")
    if ma and "pick" in ma:
        p = ma["pick"]
        lines.append(
            f"| Model Analyzer quick search | {ma['configurations']} ({ma['measurements']} measurements) | "
            f"{ma['wall_s']:.0f} s | {config_words(p['instances'], p['max_batch_size'], p['queue_delay_us'])} | "
            f"{p['throughput']:.1f} req/s (perf_analyzer, [1,{SEQUENCE}] requests, concurrency {p['concurrency']}) | "
            f"{gate_words(out.get('ma_pick_in_tunegate'))} |"
        )
    elif ma:
        lines.append(
            f"| Model Analyzer quick search | - | - | did not run: {ma['error'].splitlines()[0]} | - | - |"
        )
    if tg and "configurations" in tg:
        b = tg["best"]
        best = config_words(*b["config"]) if b else "none passed"
        tput = f"{b['median_throughput']:.1f} req/s (captured replay, median of rounds)" if b else "-"
        lines.append(
            f"| tunegate tune-serving | {tg['configurations']} ({tg['measurements']} measurements, "
            f"{tg['skipped']} refused before measuring) | {tg['wall_s']:.0f} s | {best} | {tput} | "
            f"{gate_words(b) if b else '-'} |"
        )
    elif tg:
        lines.append(
            f"| tunegate tune-serving | - | - | did not run: {tg['error'].splitlines()[0]} | - | - |"
        )
    for label, key in (("Model Analyzer's pick", "ma_pick_in_tunegate"),
                       (f"Model Analyzer's best that takes batch {LARGEST}", "ma_servable_in_tunegate")):  # fmt: skip
        row = out.get(key)
        if row is not None and row.get("median_throughput") is not None:
            lines.append(
                f"| {label}, replayed by tunegate | - | - | {config_words(*row['config'])} | "
                f"{row['median_throughput']:.1f} req/s (captured replay, median of rounds) | {gate_words(row)} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-analyzer", default="model-analyzer",
                    help="Model Analyzer's executable (default: model-analyzer on PATH)")  # fmt: skip
    ap.add_argument("--json", type=Path, default=None, help="write every measurement here")
    ap.add_argument("--latency-ms", type=float, default=0.0,
                    help="the objective: throughput with p95 (tunegate) / p99 (Model Analyzer) within this; "
                         "0 (default, as specs/minilm.toml): best throughput at any latency")  # fmt: skip
    ap.add_argument("--lock", default=LOCK, help="CPU lock taken around each search ('' for none)")
    ap.add_argument("--ma-timeout-s", type=float, default=1800.0, help="stop Model Analyzer after this long")
    ap.add_argument(
        "--workdir", type=Path, default=None, help="keep everything here (default: a temporary folder)"
    )
    args = ap.parse_args(argv)
    try:
        exe = find_model_analyzer(args.model_analyzer)
        perf_analyzer_ok, why = perf.available()
        if not perf_analyzer_ok:
            raise CompareError(why)
    except CompareError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out: dict[str, Any] = {"model_analyzer_executable": exe, "latency_ms": args.latency_ms, "routes": ROUTES}
    ok = True
    with contextlib.ExitStack() as stack:
        if args.workdir is None:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tunegate-ma-compare-")))
        else:
            work = args.workdir.resolve()
            work.mkdir(parents=True, exist_ok=True)
        try:
            with cpu_lock(args.lock):
                out["model_analyzer"] = run_model_analyzer(
                    exe, work / "ma", args.latency_ms, args.ma_timeout_s
                )
            p = out["model_analyzer"]["pick"]
            log(f"Model Analyzer's pick: {p['variant']} ({config_words(p['instances'], p['max_batch_size'], p['queue_delay_us'])}), "
                f"{p['throughput']:.1f} infer/s at concurrency {p['concurrency']}")  # fmt: skip
        except CompareError as exc:
            log(f"Model Analyzer: {exc}")
            out["model_analyzer"] = {"error": str(exc)}
            ok = False
        try:
            with cpu_lock(args.lock):
                summary, result, config_text = run_tunegate(work / "tunegate", args.latency_ms)
            out["tunegate"] = {**summary, **summarize_tunegate(result, config_text)}
        except Exception as exc:  # noqa: BLE001 - reported with Model Analyzer's result
            log(f"tunegate: {type(exc).__name__}: {exc}")
            out["tunegate"] = {"error": f"{type(exc).__name__}: {exc}", "reason": "the search failed"}
            ok = False
        ma = out["model_analyzer"]
        if "pick" in ma and "routes" in out["tunegate"]:
            out["ma_pick_in_tunegate"] = in_tunegate(ma["pick"], out["tunegate"])
            if ma["best_servable"] != ma["pick"]:
                out["ma_servable_in_tunegate"] = in_tunegate(ma["best_servable"], out["tunegate"])
    text = table(out, args.latency_ms)
    out["table"] = text
    print(text)
    print(f"\ntunegate: {out['tunegate']['reason']}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, default=str) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
