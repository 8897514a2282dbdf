"""The embedded Triton: the real `tritonserver` shipped in the nvidia-pytriton wheel, run on this machine.

`EmbeddedTriton` lays out a backend directory (python backend + the stub matching the running
Python), picks free ports, starts the server with explicit model control, waits for readiness and
stops it without leaving stub processes behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import logging
import os
import shutil
import signal
import site
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Self

from tunegate.errors import ServiceError
from tunegate.procs import die_with_parent

LOG = logging.getLogger(__name__)


class TritonError(ServiceError):
    """The embedded server could not be laid out, started or driven."""


class TritonStartError(TritonError):
    """The server did not become ready; the message carries the tail of its log."""


@dataclasses.dataclass(frozen=True)
class TritonDistribution:
    """Where the pytriton wheel keeps the server, the python backend and its libraries."""

    server: Path
    python_backend: Path
    stub: Path
    libs: Path

    @classmethod
    def locate(cls) -> TritonDistribution:
        # find_spec, not import: pytriton's own client imports gevent and friends, which a host that only
        # needs the server binary (the GPU run) may lack.
        spec = importlib.util.find_spec("pytriton")
        if spec is None or not spec.submodule_search_locations:
            raise TritonError("nvidia-pytriton is not installed: pip install nvidia-pytriton==0.7.0")
        root = Path(next(iter(spec.submodule_search_locations))).resolve()
        site_root = root.parent
        ver = f"{sys.version_info.major}.{sys.version_info.minor}"
        dist = cls(
            server=root / "tritonserver" / "bin" / "tritonserver",
            python_backend=root / "tritonserver" / "backends" / "python",
            stub=root / "tritonserver" / "python_backend_stubs" / ver / "triton_python_backend_stub",
            libs=site_root / "nvidia_pytriton.libs",
        )
        for p in (dist.server, dist.python_backend / "libtriton_python.so", dist.stub, dist.libs):
            if not p.exists():
                raise TritonError(f"pytriton installation is incomplete, missing {p} (Python {ver})")
        return dist


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def layout_backends(dest: Path, dist: TritonDistribution) -> Path:
    """Build `dest/python/` with the backend library and the stub for this Python side by side."""
    py = dest / "python"
    py.mkdir(parents=True, exist_ok=True)
    for item in dist.python_backend.iterdir():
        if item.name == "__pycache__":
            continue
        target = py / item.name
        if not target.exists():
            target.symlink_to(item)
    stub = py / "triton_python_backend_stub"
    if not stub.exists():
        # A copy, not a link: the backend resolves the stub relative to libtriton_python.so's directory.
        shutil.copy2(dist.stub, stub)
    return dest


def server_env(dist: TritonDistribution, extra_pythonpath: Sequence[str] = ()) -> dict[str, str]:
    env = os.environ.copy()
    # The running Python's LIBDIR must come first, or the stub loads the system libpython
    # (a different patch release) and crashes or imports the wrong stdlib.
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    parts = [p for p in (libdir, str(dist.libs), env.get("LD_LIBRARY_PATH", "")) if p]
    env["LD_LIBRARY_PATH"] = ":".join(parts)
    # The stub is a separate Python process: give it this environment's packages, in this process's order (its
    # PYTHONPATH before its site-packages). Behind the site-packages, a PYTHONPATH that brings numpy<2 beside a
    # system numpy 2 lost to it in the stub alone, and the python backend's outputs came back empty.
    # Absolute: the stub runs in another working directory, where a relative entry would name another folder.
    inherited = [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    py_paths = [*extra_pythonpath, *inherited, *site.getsitepackages()]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(py_paths))
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    return env


@dataclasses.dataclass(frozen=True)
class TritonOptions:
    repository: Path
    models: tuple[str, ...] = ()
    http_port: int | None = None
    grpc_port: int | None = None
    metrics_port: int | None = None
    startup_timeout_s: float = 120.0
    log_verbose: int = 0
    extra_args: tuple[str, ...] = ()


class EmbeddedTriton:
    """A running tritonserver. Use as a context manager or call start()/stop()."""

    def __init__(self, options: TritonOptions, workdir: Path | None = None) -> None:
        self.options = options
        self._own_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="tunegate-triton-"))
        self.proc: subprocess.Popen[bytes] | None = None
        self.http_port = options.http_port or 0
        self.grpc_port = options.grpc_port or 0
        self.metrics_port = options.metrics_port or 0
        self.log_path = self.workdir / "tritonserver.log"

    # -- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def http_address(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def start(self) -> None:
        opts = self.options
        repo = Path(opts.repository).resolve()
        if not repo.is_dir():
            raise TritonStartError(f"model repository {repo} does not exist or is not a directory")
        for name, port in (
            ("HTTP", opts.http_port),
            ("gRPC", opts.grpc_port),
            ("metrics", opts.metrics_port),
        ):
            if port and port_in_use(port):
                raise TritonStartError(
                    f"{name} port {port} is already in use; pick another or leave it unset"
                )
        self.http_port = opts.http_port or free_port()
        self.grpc_port = opts.grpc_port or free_port()
        self.metrics_port = opts.metrics_port or free_port()
        dist = TritonDistribution.locate()
        backends = layout_backends(self.workdir / "backends", dist)
        project_root = str(Path(__file__).resolve().parent.parent)
        cmd = [
            str(dist.server),
            f"--model-repository={repo}",
            f"--backend-directory={backends}",
            "--model-control-mode=explicit",
            f"--http-port={self.http_port}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-port={self.metrics_port}",
            "--allow-metrics=true",
            "--exit-timeout-secs=10",
            "--allow-gpu-metrics=false",
            "--allow-cpu-metrics=true",
            "--metrics-interval-ms=1000",
            f"--log-verbose={opts.log_verbose}",
            # Unique shared-memory names, so several servers (tests, CI) never collide.
            f"--backend-config=python,shm-region-prefix-name=tunegate{os.getpid()}x{self.http_port}",
            *[f"--load-model={m}" for m in opts.models],
            *opts.extra_args,
        ]
        LOG.info("starting tritonserver: %s", " ".join(cmd))
        self._log_file: IO[bytes] | None = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=server_env(dist, [project_root]),
            start_new_session=True,  # its own process group: stop() reaps the stubs too
            preexec_fn=die_with_parent,  # noqa: PLW1509 - one prepared prctl call; dies with this process
        )
        try:
            self._wait_ready(opts.startup_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        url = f"{self.http_url}/v2/health/ready"
        while time.monotonic() < deadline:
            code = self.proc.poll()
            if code is not None:
                raise TritonStartError(
                    f"tritonserver exited with code {code} before it was ready.\n"
                    f"--- last lines of {self.log_path} ---\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(url, timeout=1.0) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.1)
        raise TritonStartError(
            f"tritonserver was not ready after {timeout_s:.0f}s.\n"
            f"--- last lines of {self.log_path} ---\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout_s: float = 20.0) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            pgid = proc.pid
            if proc.poll() is None:
                # SIGTERM to the server alone: it shuts its stubs down itself; signalling the
                # stubs too makes it wait for stubs that are already gone.
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    LOG.warning("tritonserver did not stop in %.0fs; killing it", timeout_s)
            # Stubs are in the same process group; anything left is killed.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
            self.pgid = pgid
        log_file = getattr(self, "_log_file", None)
        if log_file is not None:
            log_file.close()
            self._log_file = None
        if self._own_workdir and os.environ.get("TUNEGATE_KEEP_TRITON_WORKDIR") is None:
            shutil.rmtree(self.workdir / "backends", ignore_errors=True)

    # -- control -----------------------------------------------------------------------------
    def _request(
        self, method: str, path: str, body: dict[str, Any] | None = None, timeout: float = 120
    ) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(f"{self.http_url}{path}", data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")
            raise TritonError(f"{method} {path} -> {exc.code}: {detail}") from exc
        return json.loads(raw) if raw else None

    def load(self, model: str, config: dict[str, Any] | None = None) -> None:
        body = {"parameters": {"config": json.dumps(config)}} if config is not None else None
        self._request("POST", f"/v2/repository/models/{model}/load", body or {})

    def unload(self, model: str) -> None:
        self._request("POST", f"/v2/repository/models/{model}/unload", {})

    def index(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self._request("POST", "/v2/repository/index", {})
        return result

    def model_ready(self, model: str, version: str = "") -> bool:
        path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "") + "/ready"
        try:
            self._request("GET", path)
        except TritonError:
            return False
        return True


def process_group_alive(pgid: int) -> list[int]:
    """PIDs still in process group `pgid` (used by tests to prove nothing was left behind)."""
    alive = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Fields after the parenthesised comm: state ppid pgrp ...
        fields = stat.rsplit(")", 1)[1].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
            alive.append(int(entry.name))
    return alive


@contextlib.contextmanager
def embedded_triton(repository: Path, models: Sequence[str] = (), **kwargs: Any) -> Iterator[EmbeddedTriton]:
    server = EmbeddedTriton(TritonOptions(repository=Path(repository), models=tuple(models), **kwargs))
    with server:
        yield server
