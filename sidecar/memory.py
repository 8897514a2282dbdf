"""Memory per model version on Triton's host, for the canary's evidence.

Triton's python backend runs each model instance in a stub process of its own; its command line names
the model file of the version it serves and the instance:

    .../backends/python/triton_python_backend_stub <repository>/<model>/<version>/model.py <shm region>
        <shm size> <shm growth> <tritonserver pid> <backend dir> <ipc size> <model>_<group>_<n> DEFAULT

With shadow latency pairing the shadow model `<m>__canary` serves the candidate and the baseline
versions, each in instances of its own (`<m>__canary/<C>/model.py`, `<m>__canary/<B>/model.py`); with
primary pairing the baseline is `<m>/<B>/model.py`. A version's memory is the sum over its instances:
resident memory (VmRSS in /proc/<pid>/status) on CPU; where nvidia-smi lists the processes, their GPU
memory, which is then the figure judged when both versions have some. The judged figure is per instance
(the sum over the version's stub processes divided by their number), so a release that changes the instance
count is judged on what each instance takes; the totals are in the details.

Backends that run inside the tritonserver process (TensorRT, ONNX Runtime, ...) have no process per
version, and a sidecar on another host or in another PID namespace than Triton sees none: memory is
then unknown, with the reason, and nothing else changes. Reads block (/proc, nvidia-smi): call `read`
from a worker thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlparse

PROC = Path("/proc")
STUB = b"triton_python_backend_stub"
SAMPLE_INTERVAL_S = 5.0  # the judge tick samples memory at most this often per canary
RESCAN_S = 60.0  # the stub processes are looked up again at least this often (a reloaded shadow has new ones)
NVIDIA_SMI_TIMEOUT_S = 5.0
MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Stub:
    """One python-backend stub process: the model directory and version of the model file it serves."""

    pid: int
    ppid: int
    model_dir: str  # <repository>/<model> as Triton names it
    model: str
    version: int


def scan_stubs(proc: Path = PROC) -> list[Stub]:
    """Every python-backend stub process visible in `proc` (processes that vanish meanwhile are skipped)."""
    out = []
    for entry in os.scandir(proc):
        if not entry.name.isdigit():
            continue
        try:
            argv = (Path(entry.path) / "cmdline").read_bytes().split(b"\0")
            if len(argv) < 2 or not argv[0].endswith(STUB):
                continue
            stat = (Path(entry.path) / "stat").read_bytes()
        except OSError:
            continue
        path = PurePosixPath(os.fsdecode(argv[1]))
        if not path.parent.name.isdigit():
            continue
        try:
            ppid = int(
                stat[stat.rindex(b")") + 2 :].split()[1]
            )  # the command name may hold spaces or parentheses
        except (ValueError, IndexError):
            ppid = 0
        out.append(
            Stub(
                int(entry.name), ppid, str(path.parent.parent), path.parent.parent.name, int(path.parent.name)
            )
        )
    return out


def rss_bytes(pid: int, proc: Path = PROC) -> int | None:
    """Resident memory of a process (VmRSS), None when it is gone."""
    try:
        text = (proc / str(pid) / "status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return None


def gpu_memory_by_pid(timeout_s: float = NVIDIA_SMI_TIMEOUT_S) -> dict[int, int] | None:
    """GPU memory per compute process from nvidia-smi (bytes), None where nvidia-smi is absent or fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        res = subprocess.run([exe, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=timeout_s, check=False)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    if res.returncode != 0:
        return None
    out: dict[int, int] = {}
    for line in res.stdout.splitlines():
        pid, _, used = line.partition(",")
        with contextlib.suppress(ValueError):
            out[int(pid)] = out.get(int(pid), 0) + int(float(used)) * MiB
    return out


def is_local_host(host: str) -> bool:
    """Whether `host` names this machine: a loopback address, or one a socket here can bind."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    for family, _, _, _, addr in infos:
        ip = str(addr[0])
        if ipaddress.ip_address(ip.split("%")[0]).is_loopback:
            return True
        with contextlib.suppress(OSError), socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((ip, 0))
            return True
    return False


@dataclasses.dataclass
class Reading:
    """One sample: the judged figure per role that was measured, and the details `canary status` shows."""

    bytes: dict[str, float]
    kind: str  # "rss" or "gpu": what `bytes` holds
    detail: dict[str, Any]
    unknown: str | None  # why a role is not measured, or None


class MemoryProbe:
    """Finds the processes serving each role's version on this host and reads their memory (blocking)."""

    def __init__(self, repository: Path, upstream: str, targets: Mapping[str, tuple[str, int]], backend: str = "",
                 proc: Path = PROC, gpu: bool = True) -> None:  # fmt: skip
        self.repository = Path(repository)
        self.host = urlparse(upstream).hostname or ""
        self.targets = dict(targets)  # role -> (Triton model name, version)
        self.backend = backend
        self.proc = proc
        self.gpu = gpu
        self._stubs: dict[str, list[Stub]] = {}
        self._scanned = 0.0
        self._local: bool | None = None

    def read(self) -> Reading:
        if self.backend not in ("", "python"):
            return self._unknown(f"the {self.backend} backend runs models inside the tritonserver process: "
                                 "memory per version cannot be told apart")  # fmt: skip
        if not self.proc.is_dir():
            return self._unknown(f"{self.proc} is not available on this host")
        stale = any(rss_bytes(s.pid, self.proc) is None for ss in self._stubs.values() for s in ss)
        if (
            stale
            or not all(self._stubs.get(r) for r in self.targets)
            or time.monotonic() - self._scanned > RESCAN_S
        ):
            self._stubs, problem = self._match(scan_stubs(self.proc))
            self._scanned = time.monotonic()
            if problem is not None:
                return self._unknown(problem)
        gpu = gpu_memory_by_pid() if self.gpu else None
        detail: dict[str, Any] = {}
        rss: dict[str, float] = {}
        on_gpu: dict[str, float] = {}
        for role, (model, version) in self.targets.items():
            stubs = self._stubs.get(role, [])
            sizes = [rss_bytes(s.pid, self.proc) for s in stubs]
            d: dict[str, Any] = {"model": model, "version": version, "processes": len(stubs)}
            # Judged per instance: a release that serves with more instances takes more memory in total by
            # design (its release says so); an engine that takes more per instance is what the check is for.
            if stubs and all(v is not None for v in sizes):
                d["rss_bytes"] = float(sum(v for v in sizes if v is not None))
                rss[role] = d["rss_bytes"] / len(stubs)
            if gpu is not None and stubs:
                d["gpu_bytes"] = float(sum(gpu.get(s.pid, 0) for s in stubs))
                on_gpu[role] = d["gpu_bytes"] / len(stubs)
            detail[role] = d
        kind, figures = (
            ("gpu", on_gpu) if on_gpu and all(on_gpu.get(r, 0) > 0 for r in self.targets) else ("rss", rss)
        )
        missing = [r for r in self.targets if r not in figures]
        unknown = None
        if missing:
            self._stubs = {}  # look again next time
            unknown = self._not_found(missing)
        return Reading(dict(figures), kind, detail, unknown)

    # -- plumbing ------------------------------------------------------------------------------
    def _match(self, stubs: list[Stub]) -> tuple[dict[str, list[Stub]], str | None]:
        """Each role's stubs: those whose model file lies in this repository, else (Triton sees the repository
        at another path) those of the one tritonserver whose stubs serve every role's model and version."""
        real = {m: os.path.realpath(self.repository / m) for m, _ in self.targets.values()}
        exact = {r: [s for s in stubs if (s.model, s.version) == t and os.path.realpath(s.model_dir) == real[t[0]]]
                 for r, t in self.targets.items()}  # fmt: skip
        if all(exact.values()):
            return exact, None
        loose = {r: [s for s in stubs if (s.model, s.version) == t and not os.path.isdir(s.model_dir)]
                 for r, t in self.targets.items()}  # fmt: skip
        servers = {s.ppid for ss in loose.values() for s in ss}
        if len(servers) > 1:
            names = ", ".join(sorted({f"{m} v{v}" for m, v in self.targets.values()}))
            return (
                {},
                f"several Triton servers on this host serve {names}: which one is the sidecar's is not known",
            )
        if all(loose.values()):
            return loose, None
        return {r: exact[r] or loose[r] for r in self.targets}, None

    def _not_found(self, roles: list[str]) -> str:
        which = ", ".join(f"{r} ({self.targets[r][0]} v{self.targets[r][1]})" for r in roles)
        if self._local is None:
            self._local = is_local_host(self.host) if self.host else False
        where = ("Triton runs in another container or PID namespace" if self._local
                 else f"Triton at {self.host} runs on another host or in another container")  # fmt: skip
        return (f"no Triton python-backend process is visible here for {which}: {where}; memory is measured only "
                "where the sidecar sees Triton's processes")  # fmt: skip

    def _unknown(self, why: str) -> Reading:
        detail = {r: {"model": m, "version": v} for r, (m, v) in self.targets.items()}
        return Reading({}, "rss", detail, why)


__all__ = [
    "SAMPLE_INTERVAL_S",
    "MemoryProbe",
    "Reading",
    "Stub",
    "gpu_memory_by_pid",
    "rss_bytes",
    "scan_stubs",
]
