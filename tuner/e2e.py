"""Finalists end to end through the real embedded Triton: each served from a temporary model repository.

The baseline and every finalist become models `<model>__baseline` and `<model>__route<k>` (version 1)
in a temp repository beside the cache, never in the real repository. Each is checked to serve the
same outputs as in process, then driven with concurrent requests of the benchmark shapes.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from tunegate import pbtxt
from tunegate.procs import TUNE_KILL_AT_ENV, kill_point
from tunegate.records import atomic_write_text
from tunegate.repository import set_version_policy, write_version
from tunegate.triton import EmbeddedTriton, TritonOptions
from tuner.bench import stats
from tuner.inputs import InputSet


def baseline_files(version_dir: Path) -> dict[str, Path | bytes | str]:
    return {
        p.name: p
        for p in sorted(version_dir.iterdir())
        if p.is_file() and p.name != "release.json" and not p.name.startswith(".")
    }


def _config_for(config_text: str, name: str) -> str:
    return set_version_policy(pbtxt.with_name(config_text, name), [1])


def _infer(
    client: Any, model: str, feeds: Mapping[str, npt.NDArray[Any]], outputs: Sequence[str]
) -> dict[str, npt.NDArray[Any]]:
    import tritonclient.http as httpclient
    from tritonclient.utils import np_to_triton_dtype

    inputs = []
    for name, arr in feeds.items():
        inp = httpclient.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
        inp.set_data_from_numpy(np.ascontiguousarray(arr), binary_data=True)
        inputs.append(inp)
    wanted = [httpclient.InferRequestedOutput(o, binary_data=True) for o in outputs]
    result = client.infer(model, inputs, outputs=wanted)
    return {o: result.as_numpy(o) for o in outputs}


def _drive(
    address: str,
    model: str,
    inputs: InputSet,
    outputs: Sequence[str],
    concurrency: int,
    requests: int,
    bootstrap: int,
) -> dict[str, Any]:
    import tritonclient.http as httpclient

    shapes = list(inputs.bench)
    weights = np.array([s.weight for s in shapes])
    order = np.random.default_rng(0).choice(len(shapes), size=requests, p=weights / weights.sum())
    local = threading.local()
    clients: list[Any] = []
    lock = threading.Lock()

    def one(i: int) -> float:
        if not hasattr(local, "client"):
            local.client = httpclient.InferenceServerClient(address, concurrency=1, network_timeout=300)
            with lock:
                clients.append(local.client)
        t0 = time.perf_counter()
        _infer(local.client, model, shapes[int(order[i])].feeds, outputs)
        return time.perf_counter() - t0

    t0 = time.perf_counter()
    try:
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            times = list(pool.map(one, range(requests)))
    finally:
        for c in clients:
            c.close()
    wall = time.perf_counter() - t0
    s = stats(times, bootstrap=bootstrap)
    s.update(concurrency=concurrency, requests=requests, requests_per_s=requests / wall)
    return s


def run_e2e(
    *,
    model: str,
    repository: Path,
    baseline_dir: Path,
    finalists: Sequence[tuple[str, Mapping[str, Path | bytes | str]]],
    in_process: Mapping[str, list[dict[str, npt.NDArray[Any]]]],
    inputs: InputSet,
    workdir: Path,
    concurrency: int,
    requests: int,
    bootstrap: int,
) -> dict[str, dict[str, Any]]:
    """Serve baseline + finalists ((route string, version files), ...); per route: outputs and latency.

    `in_process` maps "baseline" and each route string to its in-process gate outputs; each result
    has the served gate outputs ("served"), their largest difference from in-process, and latency.
    """
    config_text = (repository / model / "config.pbtxt").read_text()
    workdir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="e2e-", dir=workdir))
    names: dict[str, str] = {}
    try:
        entries = [("baseline", baseline_files(baseline_dir))] + [(r, f) for r, f in finalists]
        for k, (route, files) in enumerate(entries):
            name = f"{model}__baseline" if route == "baseline" else f"{model}__route{k}"
            write_version(tmp, name, files, version=1)
            atomic_write_text(tmp / name / "config.pbtxt", _config_for(config_text, name))
            names[route] = name
        results: dict[str, dict[str, Any]] = {}
        with EmbeddedTriton(
            TritonOptions(repository=tmp, models=tuple(names.values())), workdir=tmp / "triton"
        ) as server:
            import tritonclient.http as httpclient

            kill_point(TUNE_KILL_AT_ENV, "serving")
            client = httpclient.InferenceServerClient(server.http_address, network_timeout=300)
            try:
                for route, name in names.items():
                    expected = in_process[route]
                    outs = list(expected[0])
                    served = [_infer(client, name, b.feeds, outs) for b in inputs.gate]
                    diff = max(
                        float(np.max(np.abs(s[o].astype(np.float64) - e[o].astype(np.float64)), initial=0.0))
                        for s, e in zip(served, expected, strict=True)
                        for o in outs
                    )
                    results[route] = {
                        "triton_model": name,
                        "max_abs_diff_vs_in_process": diff,
                        "served": served,
                    }
            finally:
                client.close()
            for route, name in names.items():
                results[route]["latency"] = _drive(
                    server.http_address,
                    name,
                    inputs,
                    list(in_process[route][0]),
                    concurrency,
                    requests,
                    bootstrap,
                )
        return results
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
