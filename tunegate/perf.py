"""Triton's own load generator, perf_analyzer (the tritonclient wheel's), as a library call.

It needs `libcudart.so.12` even on CPU (the PyPI wheel `nvidia-cuda-runtime-cu12` carries it; it goes on
LD_LIBRARY_PATH here) and `libb64.so.0d` (Debian `libb64-0d`). `available()` says which is missing.
Requests replay real inputs (`--input-data`: one entry per request, each with its own shape), so a measured
mix is the captured one, not a synthetic shape.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from tunegate.errors import ServiceError

LIBB64_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib")


class PerfError(ServiceError):
    """perf_analyzer is missing, cannot start, or failed a measurement (the message says which)."""


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


def write_input_data(path: Path, requests: Sequence[Mapping[str, npt.NDArray[Any]]]) -> Path:
    """perf_analyzer's --input-data file: one entry per request, in order, each with its shape."""
    entries = [
        {name: {"content": np.asarray(arr).reshape(-1).tolist(), "shape": list(np.asarray(arr).shape)}
         for name, arr in req.items()}
        for req in requests
    ]  # fmt: skip
    path.write_text(json.dumps({"data": entries}))
    return path


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


def sweep(
    address: str,
    model: str,
    concurrency: Sequence[int],
    work: Path,
    *,
    input_data: Path | None = None,
    protocol: str = "grpc",
    window_ms: int = 2000,
    timeout_s: float = 300.0,
) -> list[Level]:
    """perf_analyzer at each concurrency level (three windows each, stability not required)."""
    ok, why = available()
    if not ok:
        raise PerfError(why)
    work.mkdir(parents=True, exist_ok=True)
    levels = []
    for c in concurrency:
        out = work / f"pa-{model}-c{c}.csv"
        cmd = [executable(), "-m", model, "-i", protocol, "-u", address, "--concurrency-range", str(c),
               "--measurement-interval", str(int(window_ms)), "--stability-percentage", "1000",
               "--max-trials", "3", "--percentile", "95", "-f", str(out)]  # fmt: skip
        if input_data is not None:
            cmd += ["--input-data", str(input_data)]
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=timeout_s, env=env(), check=False
            )
        except subprocess.TimeoutExpired as exc:
            raise PerfError(
                f"perf_analyzer ran past {timeout_s:.0f}s against {model} at concurrency {c}"
            ) from exc
        if proc.returncode != 0 or not out.exists():
            raise PerfError(f"perf_analyzer failed against {model} at concurrency {c}:\n"
                            f"{proc.stdout[-1500:]}{proc.stderr[-1500:]}")  # fmt: skip
        with open(out, newline="") as f:
            row = next(csv.DictReader(f))
        levels.append(Level(c, float(row["Inferences/Second"]), float(row["p50 latency"]) / 1000,
                            float(row["p95 latency"]) / 1000, float(row["p99 latency"]) / 1000))  # fmt: skip
    return levels


def throughput_at(levels: Sequence[Level], latency_ms: float) -> float:
    """The best throughput among levels whose p95 is within `latency_ms` (any level when it is 0); 0 if none."""
    ok = [lv.throughput for lv in levels if latency_ms <= 0 or lv.p95_ms <= latency_ms]
    return max(ok, default=0.0)
