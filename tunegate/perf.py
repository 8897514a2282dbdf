"""Load on Triton: a closed-loop replay of real requests (`replay`), and Triton's own perf_analyzer.

`replay` sends captured requests as they are, each with its own batch and shape, from `concurrency` clients
(tritonclient.grpc.aio, one event loop): perf_analyzer cannot vary the batch size across the requests of one
run against a model that Triton batches (its `-b` is fixed and its input data must leave the batch out), so a
mix of batch sizes is only replayed faithfully here. The client's own cost per request (about 0.2 ms) is the
same for every configuration it compares.

perf_analyzer (the tritonclient wheel's) is where tests and benchmarks find it (`executable`, `env`): it needs `libcudart.so.12` even on CPU (the PyPI wheel `nvidia-cuda-runtime-cu12` carries it; it goes on
LD_LIBRARY_PATH by `env()`) and `libb64.so.0d` (Debian `libb64-0d`); `available()` says which is missing.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from tunegate.errors import ServiceError

LIBB64_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib")


class PerfError(ServiceError):
    """A replayed request failed, or nothing was measured (the message says which)."""


def executable() -> str:
    return shutil.which("perf_analyzer") or str(Path(sys.executable).with_name("perf_analyzer"))


def cudart_dir() -> str | None:
    try:
        import nvidia.cuda_runtime as cr  # the wheel that carries libcudart.so.12
    except ImportError:
        return None
    for p in cr.__path__:
        if (Path(p) / "lib" / "libcudart.so.12").exists():
            return str(Path(p) / "lib")
    return None


def available() -> tuple[bool, str]:
    if not Path(executable()).exists():
        return False, "perf_analyzer is not installed (it comes with the tritonclient wheel)"
    if cudart_dir() is None:
        return False, "perf_analyzer needs libcudart.so.12: pip install nvidia-cuda-runtime-cu12"
    if not any(Path(d, "libb64.so.0d").exists() for d in LIBB64_DIRS):
        return False, "perf_analyzer needs libb64.so.0d: apt-get install libb64-0d"
    return True, ""


def env() -> dict[str, str]:
    lib = cudart_dir() or ""
    return {**os.environ, "LD_LIBRARY_PATH": lib + ":" + os.environ.get("LD_LIBRARY_PATH", "")}


@dataclasses.dataclass(frozen=True)
class Level:
    """One concurrency level's measurement."""

    concurrency: int
    throughput: float  # inferences (requests) per second
    p50_ms: float
    p95_ms: float
    p99_ms: float

    def to_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


def throughput_at(levels: Sequence[Level], latency_ms: float) -> float:
    """The best throughput among levels whose p95 is within `latency_ms` (any level when it is 0); 0 if none."""
    ok = [lv.throughput for lv in levels if latency_ms <= 0 or lv.p95_ms <= latency_ms]
    return max(ok, default=0.0)


def replay(
    address: str,
    model: str,
    requests: Sequence[Mapping[str, npt.NDArray[Any]]],
    concurrency: Sequence[int],
    *,
    window_s: float = 3.0,
    warmup_s: float = 0.5,
) -> list[Level]:
    """Closed-loop load at each concurrency level: each client sends the next captured request as soon as its
    last one is answered, for `window_s` after `warmup_s`; a failed request raises PerfError."""
    import asyncio

    return [asyncio.run(_replay_level(address, model, requests, c, window_s, warmup_s)) for c in concurrency]


async def _replay_level(address: str, model: str, requests: Sequence[Mapping[str, npt.NDArray[Any]]],
                        concurrency: int, window_s: float, warmup_s: float) -> Level:  # fmt: skip
    import asyncio
    import time

    import tritonclient.grpc.aio as grpcaio
    from tritonclient.utils import np_to_triton_dtype

    if not requests:
        raise PerfError("no requests to replay")
    prepared = []
    for feeds in requests:
        ins = []
        for name, arr in feeds.items():
            inp = grpcaio.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
            inp.set_data_from_numpy(np.ascontiguousarray(arr))
            ins.append(inp)
        prepared.append(ins)
    latencies: list[float] = []
    start = time.perf_counter()
    measure_from, stop_at = start + warmup_s, start + warmup_s + window_s
    client = grpcaio.InferenceServerClient(address)

    async def worker(k: int) -> None:
        i = k * len(prepared) // concurrency
        while True:
            t0 = time.perf_counter()
            if t0 >= stop_at:
                return
            try:
                await client.infer(model, prepared[i % len(prepared)])
            except Exception as exc:
                raise PerfError(f"a replayed request to {model} failed: {exc}") from exc
            if t0 >= measure_from:
                latencies.append(time.perf_counter() - t0)
            i += 1

    try:
        await asyncio.gather(*(worker(k) for k in range(concurrency)))
    finally:
        await client.close()
    elapsed = time.perf_counter() - measure_from
    if not latencies:
        raise PerfError(f"no request to {model} finished within {window_s:g}s")
    ms = np.asarray(latencies) * 1000.0
    return Level(concurrency, len(latencies) / elapsed, float(np.percentile(ms, 50)),
                 float(np.percentile(ms, 95)), float(np.percentile(ms, 99)))  # fmt: skip
