"""Headless Locust runs as a child process (Locust is gevent: it never runs inside our asyncio or pytest process)."""

from __future__ import annotations

import csv
import dataclasses
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tunegate.errors import ServiceError

LOCUSTFILE = Path(__file__).resolve().parent / "locustfile.py"
STOP_TIMEOUT_S = 10  # Locust's --stop-timeout: how long users get to finish a request in flight at the end


class LoadTestError(ServiceError):
    """Locust could not run the replay (bad capture, bad options, crashed)."""


@dataclasses.dataclass(frozen=True)
class LoadOptions:
    capture: Path
    host: str
    users: int = 4
    spawn_rate: float = 4.0
    duration_s: float = 30.0
    mode: str = "exact"
    profile: str = "fixed"
    time_scale: float = 1.0
    rate: float = 0.0
    per_user_rate: float = 2.0
    name_by: str = "model"
    csv_prefix: Path | None = None
    seed: int = 0
    protocol: str = "http"  # or "grpc": host is then HOST:PORT of a gRPC front (the sidecar's or Triton's)

    def __post_init__(self) -> None:
        if self.users < 1 or self.spawn_rate <= 0 or self.duration_s < 0:
            raise ValueError("users >= 1, spawn rate > 0 and duration >= 0 are required")
        if self.protocol == "grpc":
            host, sep, port = self.host.removeprefix("grpc://").rpartition(":")
            if not sep or not port.isdigit() or "/" in host:
                raise ValueError(f"a gRPC host must be HOST:PORT (or grpc://HOST:PORT), got {self.host!r}")
        elif self.protocol != "http":
            raise ValueError(f"protocol must be http or grpc, got {self.protocol!r}")
        elif not self.host.startswith(("http://", "https://")):
            raise ValueError(f"host must be an http(s) URL, got {self.host!r}")


@dataclasses.dataclass(frozen=True)
class NameStats:
    name: str
    requests: int
    failures: int
    median_ms: float
    p95_ms: float
    p99_ms: float
    rps: float


@dataclasses.dataclass(frozen=True)
class LoadResult:
    total: NameStats
    by_name: dict[str, NameStats]
    csv_prefix: Path
    log: Path
    wall_s: float

    @property
    def failure_ratio(self) -> float:
        return self.total.failures / self.total.requests if self.total.requests else 1.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "requests": self.total.requests,
            "failures": self.total.failures,
            "failure_ratio": self.failure_ratio,
            "rps": self.total.rps,
            "median_ms": self.total.median_ms,
            "p95_ms": self.total.p95_ms,
            "p99_ms": self.total.p99_ms,
            "by_name": {k: dataclasses.asdict(v) for k, v in self.by_name.items()},
            "csv_prefix": str(self.csv_prefix),
            "log": str(self.log),
            "wall_s": round(self.wall_s, 2),
        }


def command(opts: LoadOptions, csv_prefix: Path, stop_file: Path | None = None) -> list[str]:
    return [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--only-summary",
        "--host", opts.host, "--users", str(opts.users), "--spawn-rate", str(opts.spawn_rate),
        "--capture", str(opts.capture), "--replay-mode", opts.mode, "--profile", opts.profile,
        "--time-scale", str(opts.time_scale), "--rate", str(opts.rate), "--per-user-rate", str(opts.per_user_rate),
        "--name-by", opts.name_by, "--replay-duration", str(opts.duration_s), "--replay-seed", str(opts.seed),
        "--csv", str(csv_prefix), "--exit-code-on-error", "0", "--loglevel", "WARNING", "--stop-timeout",
        str(STOP_TIMEOUT_S), *(["--stop-file", str(stop_file)] if stop_file is not None else []),
    ]  # fmt: skip


def _f(row: dict[str, str], key: str) -> float:
    v = row.get(key, "") or "0"
    return float(v) if v != "N/A" else 0.0


def read_stats(csv_prefix: Path) -> tuple[NameStats, dict[str, NameStats]]:
    path = Path(f"{csv_prefix}_stats.csv")
    if not path.exists():
        raise LoadTestError(f"Locust wrote no stats ({path} missing)")
    by_name: dict[str, NameStats] = {}
    total = None
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            s = NameStats(
                name=row["Name"],
                requests=int(_f(row, "Request Count")),
                failures=int(_f(row, "Failure Count")),
                median_ms=_f(row, "Median Response Time"),
                p95_ms=_f(row, "95%"),
                p99_ms=_f(row, "99%"),
                rps=_f(row, "Requests/s"),
            )
            if row["Name"] == "Aggregated":
                total = s
            else:
                by_name[row["Name"]] = s
    if total is None:
        raise LoadTestError(f"{path} has no Aggregated row")
    return total, by_name


def run(opts: LoadOptions, progress: Any = None) -> LoadResult:
    """Run Locust headless; `progress(elapsed_s)` is called about twice a second.

    When `progress` returns True (e.g. once a canary has decided) the replay is asked to end now: a stop file
    the replay's load shape reads each second ends it as its duration would, so Locust stops its users and
    writes its stats. No signal is sent: Ctrl-C's KeyboardInterrupt lands in whichever greenlet (or import)
    runs at that moment, and Locust then exits with 1 or 2, or dies, and the run looks failed.
    """
    workdir = Path(tempfile.mkdtemp(prefix="tunegate-locust-"))
    prefix = opts.csv_prefix or workdir / "locust"
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    log = workdir / "locust.log"
    stop_file = workdir / "stop"
    t0 = time.monotonic()
    with open(log, "wb") as logf:
        proc = subprocess.Popen(
            command(opts, Path(prefix), stop_file), stdout=logf, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, env={**os.environ, "TUNEGATE_PROTOCOL": opts.protocol},
        )  # fmt: skip
        limit = opts.duration_s + 60
        try:
            while proc.poll() is None:
                now = time.monotonic() - t0
                if now > limit:
                    proc.kill()
                    raise LoadTestError(f"Locust did not finish within {limit:.0f}s; log: {log}")
                if progress is not None and not stop_file.exists() and progress(now):
                    stop_file.touch()
                    # It ends within a shape tick (1 s) plus the users' stop timeout; allow for a slow start.
                    limit = min(limit, now + STOP_TIMEOUT_S + 30)
                time.sleep(0.5)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    text = log.read_text(errors="replace")
    if "tunegate replay:" in text:
        msg = next(line for line in text.splitlines() if "tunegate replay:" in line)
        raise LoadTestError(msg.split("tunegate replay:", 1)[1].strip())
    if proc.returncode not in (0, None):
        tail = "\n".join(text.splitlines()[-15:])
        raise LoadTestError(f"Locust exited with {proc.returncode}:\n{tail}")
    total, by_name = read_stats(Path(prefix))
    return LoadResult(total, by_name, Path(prefix), log, time.monotonic() - t0)
