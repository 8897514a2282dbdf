"""The H200 run: tune Inductor routes of real-architecture models, write the winner, serve both from Triton on the GPU.

    python -m benchmarks.gpu.run --out $OUT --models bert_base --budget-s 480

Per model: export the source ONNX from the seeded factory (benchmarks/gpu/models.py), run the
reference (ONNX Runtime, fp32, CPU) on the gate inputs, build every route in child processes
(tuner.builders.worker: a crash or hang fails that route only), gate each against the reference
(tunegate.tolerance, the sidecar's comparison), benchmark it on the GPU, pick the fastest passing
route, write the baseline route (fp32, mode default: the untuned compile) as version 1 and the
winner as version 2, serve both from the pytriton Triton's python backend and drive each with
requests (paired blocks baseline/candidate, Triton directly). With --canary, the sidecar then runs the
canary of version 2 in front of the same Triton under load and decides. Results go to OUT/<model>.json and
OUT/results.txt after every model.
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import importlib.util
import json
import logging
import os
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.gpu.models import INTERFACES, export_onnx
from tunegate.records import atomic_write_json, atomic_write_text
from tunegate.repository import ModelConfig, TensorSpec, write_config, write_version
from tunegate.tolerance import ToleranceSpec
from tuner.bench import bench_runner, objective, stats
from tuner.builders.base import Artifact, BuildContext, BuildError
from tuner.builders.inductor import InductorBuilder
from tuner.builders.ort import ort_runner
from tuner.builders.worker import run_build
from tuner.gate import evidence, judge, run_all
from tuner.inputs import Batch, BenchShape, InputSet
from tuner.routes import parse_route, route_string
from tuner.spec import ObjectiveSection

LOG = logging.getLogger("gpu-run")

BASELINE = "-dtype=fp32"
ROUTES = {
    "default": [
        "-dtype=tf32",
        "-dtype=bf16",
        "-dtype=fp16",
        "-dtype=bf16 -cudagraphs=on",
        "-dtype=fp16 -cudagraphs=on",
        "-dtype=fp16 -cudagraphs=on -epilogue=off",
        "-dtype=fp16 -cudagraphs=on -coord=on",
        "-dtype=fp16 -cudagraphs=on -freezing=on",
    ],
    # GEMM autotuning times kernels on the GPU: these build one at a time, after the others.
    "autotune": ["-dtype=fp16 -mode=max-autotune-no-cudagraphs", "-dtype=fp16 -mode=max-autotune"],
}
TOLERANCE = {  # fixed before any result: worst sample's cosine against the fp32 ONNX Runtime reference
    "bert": {
        "last_hidden_state": {"metric": "cosine", "threshold": 0.999},
        "pooler_output": {"metric": "cosine", "threshold": 0.999},
    },
    "tiny": {"*": {"metric": "cosine", "threshold": 0.999}},
    "resnet": {"pooled": {"metric": "cosine", "threshold": 0.999}},
}
DTYPES = {"int64": ("INT64", np.int64), "float32": ("FP32", np.float32)}


def grpc_client() -> bool:
    """Whether tritonclient's gRPC client imports here: then the sidecar loads models over Triton's gRPC API
    (an image without grpcio gets HTTP loads, which hold the HTTP clients of the load's server thread)."""
    try:
        return (
            importlib.util.find_spec("grpc") is not None
            and importlib.util.find_spec("tritonclient.grpc") is not None
        )
    except ModuleNotFoundError:
        return False


def make_inputs(name: str, rng: np.random.Generator) -> InputSet:
    """Gate batches (distribution + edge cases) and bench shapes; BERT ids over the whole vocabulary, padded tails."""

    def bert(batch: int, seq: int) -> dict[str, np.ndarray]:
        ids = rng.integers(0, 30522 if name == "bert_base" else 1000, (batch, seq)).astype(np.int64)
        lengths = rng.integers(max(1, seq // 4), seq + 1, batch)
        mask = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.int64)
        mask[0] = 1  # one full row: the batch's sequence length is used
        return {"input_ids": ids, "attention_mask": mask}

    def image(batch: int) -> dict[str, np.ndarray]:
        return {"pixel_values": rng.standard_normal((batch, 3, 224, 224)).astype(np.float32)}

    if name == "tiny":
        gate = [Batch(f"dist-{i}", {"x": rng.standard_normal((8, 16)).astype(np.float32)}) for i in range(4)]
        bench = [BenchShape("b8", 8, 1.0, {"x": rng.standard_normal((8, 16)).astype(np.float32)})]
    elif name in ("bert_base", "tiny_bert"):
        gate = [Batch(f"dist-{i}", bert(8, 128)) for i in range(4)]
        gate += [Batch("edge:smallest", bert(1, 8)), Batch("edge:largest", bert(16, 256))]
        bench = [BenchShape("b1xs128", 1, 1.0, bert(1, 128)), BenchShape("b8xs128", 8, 1.0, bert(8, 128))]
    else:
        gate = [Batch(f"dist-{i}", image(8)) for i in range(4)] + [
            Batch("edge:smallest", image(1)),
            Batch("edge:largest", image(32)),
        ]
        bench = [BenchShape("b1", 1, 1.0, image(1)), BenchShape("b16", 16, 1.0, image(16))]
    return InputSet(tuple(gate), tuple(bench), "gpu-run-seed0")


# -- KServe v2 binary requests (tritonclient is not on the device image) ------------------------------
def encode(feeds: dict[str, np.ndarray], outputs: list[str]) -> tuple[bytes, int]:
    entries, blobs = [], []
    for n, a in feeds.items():
        dt = DTYPES[str(a.dtype)][0]
        blob = np.ascontiguousarray(a).tobytes()
        entries.append(
            {"name": n, "datatype": dt, "shape": list(a.shape), "parameters": {"binary_data_size": len(blob)}}
        )
        blobs.append(blob)
    head = json.dumps(
        {"inputs": entries, "outputs": [{"name": o, "parameters": {"binary_data": True}} for o in outputs]}
    ).encode()
    return head + b"".join(blobs), len(head)


def decode(body: bytes, header_len: int | None) -> dict[str, np.ndarray]:
    """Outputs of a response: binary blobs after the JSON header, or JSON `data` where the server sent those."""
    doc = json.loads(body if header_len is None else body[:header_len])
    out, pos = {}, header_len or 0
    for o in doc["outputs"]:
        if "data" in o:
            out[o["name"]] = np.asarray(o["data"], dtype=np.float32).reshape(o["shape"])
            continue
        size = o["parameters"]["binary_data_size"]
        out[o["name"]] = np.frombuffer(body[pos : pos + size], dtype=np.float32).reshape(o["shape"])
        pos += size
    return out


class Client:
    def __init__(self, port: int) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)

    def infer(
        self, model: str, version: int | None, feeds: dict[str, np.ndarray], outputs: list[str]
    ) -> dict[str, np.ndarray]:
        body, hl = encode(feeds, outputs)
        path = f"/v2/models/{model}" + (f"/versions/{version}" if version is not None else "") + "/infer"
        self.conn.request(
            "POST",
            path,
            body,
            {"Inference-Header-Content-Length": str(hl), "Content-Type": "application/octet-stream"},
        )
        resp = self.conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"infer {model}/{version}: HTTP {resp.status}: {data[:300]!r}")
        # The H200 run (2026-12-02) got a 200 without this header on its first BERT request, and kept no
        # body to say why: a JSON body is decoded, anything else is reported with its first bytes.
        header = resp.headers.get("Inference-Header-Content-Length")
        try:
            return decode(data, int(header) if header is not None else None)
        except (ValueError, KeyError) as exc:
            raise RuntimeError(
                f"infer {model}/{version}: unreadable response ({exc}); headers "
                f"{dict(resp.headers)}; body starts {data[:300]!r}"
            ) from exc

    def close(self) -> None:
        self.conn.close()


# -- the search ----------------------------------------------------------------------------------------
@dataclasses.dataclass
class RouteRun:
    route: str
    status: str = "pending"
    error: str | None = None
    build_s: float | None = None
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    latency: dict[str, Any] | None = None
    objective_ms: float | None = None
    accuracy: dict[str, Any] | None = None
    artifact: str | None = None


def build_routes(
    builder: InductorBuilder,
    source: Path,
    routes: list[str],
    work: Path,
    options: dict[str, Any],
    deadline: float,
    parallel: int,
    timeout_s: float,
    autotune_parallel: bool = False,
) -> dict[str, RouteRun]:
    runs = {r: RouteRun(r) for r in routes}

    def one(route: str) -> None:
        run = runs[route]
        knobs = dict(parse_route(builder.knobs, route))
        problem = builder.route_problem(knobs)
        if problem:
            run.status, run.error = "skipped", problem
            return
        left = deadline - time.monotonic()
        if left < 30:
            run.status, run.error = "skipped", "the time budget was spent before this build"
            return
        try:
            art, secs = run_build(
                "inductor",
                source,
                knobs,
                work / f"r{routes.index(route)}",
                BuildContext(options),
                timeout_s=min(timeout_s, left),
            )
            run.status, run.build_s, run.meta, run.artifact = (
                "built",
                secs,
                dict(art.meta),
                str(art.directory),
            )
        except BuildError as exc:
            run.status, run.error = "failed", str(exc)[-1500:]
        LOG.info("built %s: %s %.0fs %s", route, run.status, run.build_s or 0, run.error or "")

    auto = [] if autotune_parallel else [r for r in routes if "max-autotune" in r]
    with ThreadPoolExecutor(max_workers=parallel) as pool:
        list(pool.map(one, [r for r in routes if r not in auto]))
    for r in auto:
        one(r)
    return runs


def evaluate(
    builder: InductorBuilder,
    run: RouteRun,
    inputs: InputSet,
    reference: list[dict[str, np.ndarray]],
    tolerance: ToleranceSpec,
    repeats: int,
) -> None:
    import torch

    try:
        runner = builder.load(Artifact.load(Path(str(run.artifact))))
        outs = run_all(runner, inputs)
        run.accuracy = evidence(judge(reference, outs, tolerance), inputs)
        run.latency = bench_runner(runner, inputs.bench, warmup=10, repeats=repeats, bootstrap=1000)
        run.objective_ms = objective(run.latency, inputs.bench, ObjectiveSection(metric="p50"))
        run.status = "passed" if run.accuracy["passed"] else "rejected"
    except Exception as exc:  # noqa: BLE001 - a route whose artifact will not run fails alone
        run.status, run.error = "failed", f"run failed: {type(exc).__name__}: {exc}"[-1500:]
    finally:
        runner = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    LOG.info("evaluated %s: %s %s", run.route, run.status, run.objective_ms)


def locate_triton() -> None:
    """Find the carried pytriton's server without importing pytriton, whose client needs gevent (absent there).

    tunegate.triton.TritonDistribution.locate imports the package; where that import fails for want
    of pytriton's client dependencies, the same paths are found from the package's location instead.
    """
    import importlib.util

    from tunegate import triton as tg_triton

    try:
        tg_triton.TritonDistribution.locate()
        return
    except tg_triton.TritonError:
        spec = importlib.util.find_spec("pytriton")
        if spec is None or spec.origin is None:
            raise
    root = Path(spec.origin).resolve().parent
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    dist = tg_triton.TritonDistribution(
        server=root / "tritonserver" / "bin" / "tritonserver",
        python_backend=root / "tritonserver" / "backends" / "python",
        stub=root / "tritonserver" / "python_backend_stubs" / ver / "triton_python_backend_stub",
        libs=root.parent / "nvidia_pytriton.libs",
    )
    LOG.info("pytriton does not import here (its client needs gevent); using its server at %s", dist.server)
    tg_triton.TritonDistribution.locate = classmethod(lambda cls: dist)  # type: ignore[method-assign]


def write_versions(name: str, repo: Path, base: RouteRun, winner: RouteRun, builder: InductorBuilder) -> None:
    """Version 1 = the baseline route, 2 = the winner, each with its release record; the config serves both."""
    io = INTERFACES[name]
    for version, run in ((1, base), (2, winner)):
        art = Artifact.load(Path(str(run.artifact)))
        write_version(
            repo,
            name,
            builder.version_files(art),
            version=version,
            release={
                "route": run.route,
                "build_seconds": run.build_s,
                "latency": run.latency,
                "accuracy": run.accuracy,
                "baseline_version": 1,
            },
        )
    config = ModelConfig(
        name,
        tuple(
            TensorSpec(n, DTYPES[dt][0], tuple(-1 if isinstance(d, str) else d for d in dims))
            for n, dt, dims in io.inputs
        ),
        tuple(
            TensorSpec(n, "FP32", tuple(-1 if isinstance(d, str) else d for d in dims))
            for n, dims in io.outputs
        ),
        form="python-onnx",
        versions=(1, 2),
    )
    write_config(repo, config)


def serve(
    name: str,
    repo: Path,
    base: RouteRun,
    winner: RouteRun,
    builder: InductorBuilder,
    inputs: InputSet,
    tolerance: ToleranceSpec,
    requests: int,
    concurrency: int,
) -> dict[str, Any]:
    """Write versions 1 (baseline) and 2 (winner), serve both from Triton, check outputs, drive paired load."""
    from tunegate.triton import EmbeddedTriton, TritonOptions

    io = INTERFACES[name]
    write_versions(name, repo, base, winner, builder)
    outputs = [n for n, _ in io.outputs]
    locate_triton()
    result: dict[str, Any] = {
        "through": "Triton directly, versions addressed explicitly",
        "versions": {"1": base.route, "2": winner.route},
    }
    t0 = time.perf_counter()
    with EmbeddedTriton(TritonOptions(repository=repo, models=(name,), startup_timeout_s=300)) as server:
        result["load_s"] = time.perf_counter() - t0
        client = Client(server.http_port)
        served = {v: [client.infer(name, v, b.feeds, outputs) for b in inputs.gate] for v in (1, 2)}
        for v, run in ((1, base), (2, winner)):
            inproc = run_all(builder.load(Artifact.load(Path(str(run.artifact)))), inputs)
            result[f"v{v}_served_matches_in_process"] = judge(inproc, served[v], tolerance).passed
        client.close()
        for shape in inputs.bench:
            per: dict[str, Any] = {}
            for conc in (1, concurrency):
                times: dict[int, list[float]] = {1: [], 2: []}
                lock = threading.Lock()

                def drive(
                    version: int,
                    n: int,
                    conc: int = conc,
                    shape: BenchShape = shape,
                    times: dict[int, list[float]] = times,
                    lock: threading.Lock = lock,
                ) -> None:
                    def worker(k: int) -> None:
                        c = Client(server.http_port)
                        try:
                            for _ in range(k):
                                t = time.perf_counter()
                                c.infer(name, version, shape.feeds, outputs)
                                with lock:
                                    times[version].append(time.perf_counter() - t)
                        finally:
                            c.close()

                    with ThreadPoolExecutor(conc) as pool:
                        list(pool.map(worker, [max(1, n // conc)] * conc))

                for v in (1, 2):
                    drive(v, 4 * conc)  # warm-up: graph capture, allocator
                for kept in times.values():  # the warm-up is not measured
                    kept.clear()
                block = max(conc, requests // 8)
                w0 = time.perf_counter()
                for _ in range(4):  # paired blocks A B B A: drift hits both versions alike
                    for v in (1, 2, 2, 1):
                        drive(v, block // 2)
                wall = time.perf_counter() - w0
                per[f"c{conc}"] = {
                    "baseline": stats(times[1], bootstrap=1000, rows=shape.batch),
                    "candidate": stats(times[2], bootstrap=1000, rows=shape.batch),
                    "wall_s": wall,
                }
                per[f"c{conc}"]["speedup_p50"] = (
                    per[f"c{conc}"]["baseline"]["p50_ms"] / per[f"c{conc}"]["candidate"]["p50_ms"]
                )
            result[shape.key] = per
    return result


def canary(
    name: str,
    repo: Path,
    inputs: InputSet,
    tolerance: ToleranceSpec,
    concurrency: int,
    work: Path,
    out: Path,
    pairing: str = "shadow",
    before_s: float = 15.0,
    params: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The sidecar canary under load, default canary parameters: Triton serves version 1, the sidecar mirrors to
    2 and decides. The same load runs `before_s` through the sidecar without a canary first: the clients'
    latency with the baseline alone, against which the canary's cost to clients is read.

    Needs tritonclient's utils (tunegate.codec imports them); the device image has no tritonclient.
    """
    import secrets

    from sidecar.client import AdminClient, SidecarProcess, write_token_file
    from sidecar.config import CanaryParams
    from tunegate.repository import set_version_policy
    from tunegate.triton import EmbeddedTriton, TritonOptions

    locate_triton()
    config = repo / name / "config.pbtxt"
    atomic_write_text(
        config, set_version_policy(config.read_text(), [1])
    )  # 2 is served by the sidecar's shadow
    outputs = [n for n, _ in INTERFACES[name].outputs]
    shape = max(inputs.bench, key=lambda b: b.batch)
    token = secrets.token_hex(16)
    token_file = write_token_file(work / "admin-token", token)
    client_times: list[float] = []
    errors: list[str] = []
    stop = threading.Event()
    lock = threading.Lock()
    with (
        EmbeddedTriton(TritonOptions(repository=repo, models=(name,), startup_timeout_s=300)) as server,
        SidecarProcess(
            upstream=server.http_url,
            upstream_grpc=server.grpc_address if grpc_client() else None,
            state_dir=work / "sidecar",
            repository=repo,
            token_file=token_file,
            log_path=out / f"{name}-sidecar.log",
        ) as sidecar,
    ):
        admin = AdminClient(sidecar.url, token)
        deadline_s = CanaryParams().deadline_s  # the sidecar's default, which this canary runs with

        def load() -> None:
            c = Client(sidecar.port)
            try:
                while not stop.is_set():
                    t = time.perf_counter()
                    try:
                        c.infer(name, None, shape.feeds, outputs)
                    except Exception as exc:  # noqa: BLE001 - counted, and the load goes on
                        with lock:  # when, from the start of the load: set beside the decision's time
                            errors.append(f"t+{time.perf_counter() - t0:.2f}s {str(exc)[:200]}")
                        c.close()
                        c = Client(sidecar.port)
                        continue
                    with lock:
                        client_times.append(time.perf_counter() - t)
            finally:
                c.close()

        t0, t0_wall = time.perf_counter(), time.time()
        threads = [threading.Thread(target=load, daemon=True) for _ in range(concurrency)]
        for t in threads:
            t.start()
        try:
            time.sleep(before_s)
            with lock:
                alone = list(client_times)
                client_times.clear()
            t0, t0_wall = time.perf_counter(), time.time()
            admin.start(name, 2, tolerance=tolerance.to_dict(), latency_pairing=pairing, **(params or {}))
            status = admin.wait_decision(name, timeout_s=deadline_s + 60)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=60)
        decisions = admin.decisions(name)
    return {
        "through": "tunegate sidecar (KServe v2 proxy) in front of the embedded Triton",
        "shape": shape.key,
        "concurrency": concurrency,
        "wall_s": time.perf_counter() - t0,
        "client_latency": stats(client_times, bootstrap=1000, rows=shape.batch) if client_times else None,
        "client_latency_baseline_alone": stats(alone[len(alone) // 5 :], bootstrap=1000, rows=shape.batch)
        if alone
        else None,
        "client_errors": len(errors),
        "first_errors": errors[:3],
        "load_started_at": t0_wall,
        "latency_pairing": pairing,
        "state": status.get("state"),
        "status": status,
        "decisions": decisions,
    }


def run_model(
    name: str,
    out: Path,
    work: Path,
    budget_s: float,
    parallel: int,
    repeats: int,
    requests: int,
    device: str = "cuda",
    routes: list[str] | None = None,
    min_speedup: float = 1.05,
    autotune_parallel: bool = False,
    do_canary: bool = False,
    do_serve: bool = True,
    pairing: str = "shadow",
    canary_params: dict[str, Any] | None = None,
) -> dict[str, Any]:
    t_model = time.monotonic()
    builder = InductorBuilder()
    model_work = work / name
    shutil.rmtree(model_work, ignore_errors=True)
    model_work.mkdir(parents=True)
    t0 = time.perf_counter()
    source = export_onnx(name, model_work / "source.onnx")
    export_s = time.perf_counter() - t0
    inputs = make_inputs(name, np.random.default_rng(0))
    tolerance = ToleranceSpec.from_dict(
        TOLERANCE["bert" if "bert" in name else name if name == "tiny" else "resnet"]
    )
    t0 = time.perf_counter()
    ref_runtime = {
        "session": {"graph_optimization_level": "disable", "intra_op_num_threads": os.cpu_count() or 1},
        "config_entries": {},
    }
    reference = run_all(ort_runner(source, ref_runtime), inputs)
    ref_s = time.perf_counter() - t0
    routes = routes or [BASELINE, *ROUTES["default"], *ROUTES["autotune"]]
    routes = [route_string(parse_route(builder.knobs, r)) for r in routes]
    options = {"torch_model": f"benchmarks.gpu.models:{name}", "device": device}
    t_search = time.monotonic()
    deadline = t_model + budget_s
    runs = build_routes(
        builder,
        source,
        routes,
        model_work / "builds",
        options,
        deadline,
        parallel,
        timeout_s=300,
        autotune_parallel=autotune_parallel,
    )
    for r in routes:
        if runs[r].status == "built":
            evaluate(builder, runs[r], inputs, reference, tolerance, repeats)
    search_s = time.monotonic() - t_search
    base = runs[routes[0]]
    passing = sorted(
        (r for r in runs.values() if r.status == "passed" and r.route != base.route),
        key=lambda r: r.objective_ms or 1e9,
    )
    winner = (
        passing[0]
        if passing and base.objective_ms and passing[0].objective_ms < base.objective_ms / min_speedup
        else None
    )
    result: dict[str, Any] = {
        "model": name,
        "versions": InductorBuilder().tool_versions(),
        "export_onnx_s": export_s,
        "reference_s": ref_s,
        "reference": "onnxruntime fp32 CPU, graph optimizations disabled",
        "tolerance": tolerance.to_dict(),
        "search_wall_s": search_s,
        "build_seconds_total": sum(r.build_s or 0 for r in runs.values()),
        "baseline_route": base.route,
        "winner": winner.route if winner else None,
        "speedup_in_process": (base.objective_ms / winner.objective_ms)
        if winner and base.objective_ms
        else None,
        "routes": [dataclasses.asdict(r) for r in runs.values()],
    }
    atomic_write_json(out / f"{name}.json", result)
    if winner is not None and base.status == "passed":
        if do_serve:
            try:
                result["triton"] = serve(name, model_work / "repo", base, winner, builder, inputs, tolerance, requests,
                                         concurrency=4)  # fmt: skip
            except Exception as exc:
                LOG.exception("serving failed")
                result["triton"] = {"error": f"{type(exc).__name__}: {exc}"[-3000:]}
        else:
            write_versions(name, model_work / "repo", base, winner, builder)
        if do_canary:
            try:
                result["canary"] = canary(
                    name,
                    model_work / "repo",
                    inputs,
                    tolerance,
                    4,
                    model_work,
                    out,
                    pairing=pairing,
                    params=canary_params,
                )
            except Exception as exc:
                LOG.exception("the canary failed")
                result["canary"] = {"error": f"{type(exc).__name__}: {exc}"[-3000:]}
    result["model_wall_s"] = time.monotonic() - t_model
    atomic_write_json(out / f"{name}.json", result)
    return result


def table(results: list[dict[str, Any]]) -> str:
    lines = []
    for res in results:
        lines.append(
            f"== {res['model']}  ({res['versions'].get('gpu', '?')}, torch {res['versions'].get('torch')})"
        )
        lines.append(
            f"search wall {res['search_wall_s']:.0f}s, builds {res['build_seconds_total']:.0f}s summed; "
            f"baseline {res['baseline_route']}; winner {res['winner']}"
        )
        lines.append(
            f"{'route':72} {'status':8} {'build_s':>7} {'obj_ms':>8}  per-shape p50/p95 ms; worst cosine"
        )
        for r in res["routes"]:
            lat = " ".join(
                f"{k}:{v['p50_ms']:.3f}/{v['p95_ms']:.3f}" for k, v in (r["latency"] or {}).items()
            )
            acc = " ".join(
                f"{k}:{v['value']:.6f}" for k, v in ((r["accuracy"] or {}).get("outputs") or {}).items()
            )
            obj = f"{r['objective_ms']:.3f}" if r["objective_ms"] else "-"
            lines.append(
                f"{r['route']:72} {r['status']:8} {r['build_s'] or 0:7.1f} {obj:>8}  {lat}  {acc}"
                + (f"  [{(r['error'] or '')[:160]}]" if r["error"] else "")
            )
        tri = res.get("triton")
        if tri and "error" not in tri:
            lines.append(
                f"Triton (direct): served==in-process v1 {tri['v1_served_matches_in_process']} v2 {tri['v2_served_matches_in_process']}"
            )
            for key, per in tri.items():
                if isinstance(per, dict) and "c1" in per:
                    for c, d in per.items():
                        lines.append(
                            f"  {key} {c}: baseline p50 {d['baseline']['p50_ms']:.3f} p95 {d['baseline']['p95_ms']:.3f} | "
                            f"winner p50 {d['candidate']['p50_ms']:.3f} p95 {d['candidate']['p95_ms']:.3f} ms | "
                            f"x{d['speedup_p50']:.2f} (n={d['candidate']['n']})"
                        )
        elif tri:
            lines.append(f"Triton: {tri['error'][:500]}")
        can = res.get("canary")
        if can and "error" not in can:
            lat = can["client_latency"] or {}
            lines.append(
                f"sidecar canary ({can.get('latency_pairing', 'primary')} latency pairing): {can['state']} after {can['wall_s']:.0f}s, client p50 {lat.get('p50_ms', 0):.3f} "
                f"p95 {lat.get('p95_ms', 0):.3f} ms (n={lat.get('n', 0)}), {can['client_errors']} client errors"
            )
            alone = can.get("client_latency_baseline_alone") or {}
            if alone:
                lines.append(
                    f"  client p50 {alone.get('p50_ms', 0):.3f} p95 {alone.get('p95_ms', 0):.3f} ms through the sidecar "
                    "before the canary (baseline alone)"
                )
            for rec in can.get("decisions") or []:
                ev = rec.get("evidence") or {}
                thr, mem, lat = ev.get("throughput") or {}, ev.get("memory") or {}, ev.get("latency") or {}
                lines.append(f"  decision {rec.get('outcome')}: {'; '.join(rec.get('reasons', []))}")
                lines.append(
                    f"  evidence: {ev.get('compared')} compared, p50 ratio {lat.get('p50_ratio')}, p95 ratio "
                    f"{lat.get('p95_ratio')}, capacity c/b {thr.get('candidate_capacity_rps')}/"
                    f"{thr.get('baseline_capacity_rps')} (ratio {thr.get('ratio')}), memory c/b "
                    f"{mem.get('candidate_bytes')}/{mem.get('baseline_bytes')} (ratio {mem.get('ratio')})"
                )
                if ev.get("max_client_slowdown"):
                    lines.append(
                        f"  mirror budget {ev.get('max_client_slowdown')}: sample rate {ev.get('mirror_sample_rate')} "
                        f"(lowest {ev.get('mirror_sample_rate_min')}), client p50 mirroring "
                        f"{ev.get('client_p50_mirroring_s')} s against paused {ev.get('client_p50_paused_s')} s, "
                        f"slowdown {ev.get('client_slowdown')}"
                    )
            decided = ((can.get("status") or {}).get("last") or {}).get("at")
            if decided and can.get("load_started_at"):
                lines.append(f"  decided at t+{decided - can['load_started_at']:.2f}s of the load")
            lines.extend(f"  client error: {e}" for e in can.get("first_errors") or [])
        elif can:
            lines.append(f"sidecar canary: {can['error'][:500]}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "benchmarks/gpu/out")))
    ap.add_argument("--work", type=Path, default=Path("/tmp/tunegate-gpu"))
    ap.add_argument(
        "--models", default="bert_base", help="comma-separated; name:seconds sets that model's budget"
    )
    ap.add_argument(
        "--budget-s", type=float, default=480.0, help="per model: builds stop being started after this"
    )
    ap.add_argument("--parallel", type=int, default=4, help="concurrent non-autotuning builds")
    ap.add_argument("--repeats", type=int, default=100)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--no-autotune", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument(
        "--canary", action="store_true", help="after serving: the sidecar canary of version 2 under load"
    )
    ap.add_argument(
        "--canary-pairing",
        default="shadow",
        choices=("primary", "shadow"),
        help="the canary's latency_pairing (shadow: the candidate's copy paired with a baseline replay)",
    )
    ap.add_argument(
        "--canary-param",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="a canary parameter beside the defaults, e.g. max_client_slowdown=0.05 (repeatable)",
    )
    ap.add_argument(
        "--no-serve",
        action="store_true",
        help="skip the paired Triton measurement (versions are still written)",
    )
    ap.add_argument(
        "--autotune-parallel",
        action="store_true",
        help="build autotuning routes alongside the others (faster; their GEMM timings share the GPU)",
    )
    ap.add_argument("--min-speedup", type=float, default=1.05)
    ap.add_argument(
        "--routes",
        default="",
        help="comma-separated route strings instead of the built-in set (first = baseline)",
    )
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stdout)
    if args.no_autotune:
        ROUTES["autotune"] = []
    ok, why = InductorBuilder().available()
    LOG.info("inductor builder: %s %s", ok, why)
    if not ok:
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for item in args.models.split(","):
        name, _, budget = item.partition(":")  # bert_base:300 = this model's own budget
        routes = [r.strip() for r in args.routes.split(",") if r.strip()] or None
        results.append(
            run_model(
                name,
                args.out,
                args.work,
                float(budget or args.budget_s),
                args.parallel,
                args.repeats,
                args.requests,
                args.device,
                routes,
                args.min_speedup,
                args.autotune_parallel,
                args.canary,
                not args.no_serve,
                args.canary_pairing,
                {k: json.loads(v) for k, v in (p.split("=", 1) for p in args.canary_param)},
            )
        )
        atomic_write_text(args.out / "results.txt", table(results))
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
