"""Python API for the sidecar: the admin client behind `tunegate canary`, and running the sidecar as a subprocess.

with SidecarProcess(upstream=triton.http_url, state_dir=..., repository=..., token_file=...) as sc:
    admin = AdminClient(sc.url, token)
    admin.start("minilm", candidate=2, min_samples=200, deadline_s=120)
    ...
    admin.wait_decision("minilm", timeout_s=150)
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from tunegate.errors import ServiceError


class AdminError(ServiceError):
    """The admin API answered with an error (or not at all); `status` is the HTTP status (0: unreachable)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class AdminClient:
    def __init__(self, url: str, token: str, timeout_s: float = 330.0) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s  # starting a canary loads a model: allow Triton its time

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(f"{self.url}{path}", data=data, method=method)
        req.add_header("Authorization", f"Bearer {self.token}")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            raw = exc.read().decode(errors="replace")
            try:
                msg = json.loads(raw).get("error", raw)
            except (ValueError, AttributeError):
                msg = raw
            raise AdminError(f"{method} {path} -> {exc.code}: {msg}", exc.code) from exc
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            why = getattr(exc, "reason", exc)
            raise AdminError(
                f"{method} {path}: sidecar unreachable at {self.url} ({why}); is `tunegate sidecar`"
                " running there? Give its address with --url or TUNEGATE_SIDECAR_URL"
            ) from exc

    def start(
        self, model: str, candidate: int, tolerance: dict[str, Any] | None = None, **params: Any
    ) -> Any:
        body: dict[str, Any] = {"candidate": candidate, **params}
        if tolerance is not None:
            body["tolerance"] = tolerance
        return self._call("POST", f"/canary/{model}", body)

    def status(self, model: str | None = None) -> Any:
        return self._call("GET", f"/canary/{model}" if model else "/canary")

    def promote(self, model: str) -> Any:
        return self._call("POST", f"/canary/{model}/promote", {})

    def pin(self, model: str) -> Any:
        return self._call("POST", f"/canary/{model}/pin", {})

    def rollback(self, model: str, to: int | None = None, reason: str | None = None) -> Any:
        """Bring back the previous live version (or `to`); returns the model's status."""
        body: dict[str, Any] = {}
        if to is not None:
            body["to"] = to
        if reason is not None:
            body["reason"] = reason
        return self._call("POST", f"/canary/{model}/rollback", body)

    def decisions(self, model: str | None = None) -> list[dict[str, Any]]:
        out = self._call("GET", f"/canary/{model}/decisions" if model else "/decisions")
        return list(out["decisions"])

    def wait_decision(self, model: str, timeout_s: float, poll_s: float = 0.5) -> dict[str, Any]:
        """Poll until the model's canary has ended; returns its status."""
        deadline = time.monotonic() + timeout_s
        while True:
            st = self.status(model)
            if st["state"] in ("promoted", "pinned"):
                return dict(st)
            if time.monotonic() > deadline:
                raise AdminError(f"no decision for {model} within {timeout_s:.0f}s (state {st['state']})")
            time.sleep(poll_s)


class SidecarProcess:
    """`tunegate sidecar` in a child process; the listening port is read from a ready file."""

    def __init__(self, *, upstream: str, state_dir: Path, repository: Path, token_file: Path | None = None,
                 listen: str = "127.0.0.1:0", extra_args: tuple[str, ...] = (), log_path: Path | None = None,
                 start_timeout_s: float = 60.0, upstream_grpc: str | None = None,
                 grpc_listen: str | None = None) -> None:  # fmt: skip
        self.args = [
            sys.executable, "-m", "tunegate.app.cli", "sidecar", "--upstream", upstream, "--state-dir", str(state_dir),
            "--repository", str(repository), "--listen", listen, *extra_args,
        ]  # fmt: skip
        if token_file is not None:
            self.args += ["--admin-token-file", str(token_file)]
        if upstream_grpc is not None:
            self.args += ["--upstream-grpc", upstream_grpc]
        if grpc_listen is not None:
            self.args += ["--grpc-listen", grpc_listen]
        self.state_dir = Path(state_dir)
        self.log_path = log_path or self.state_dir / "sidecar.log"
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.grpc_port: int | None = None  # the gRPC front's, when it listens

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Self:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        ready = Path(tempfile.mkdtemp(prefix="sidecar-ready-")) / "port"
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child owns it; closed below
        try:
            self.proc = subprocess.Popen([*self.args, "--ready-file", str(ready)], stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)  # fmt: skip
        finally:
            log.close()
        deadline = time.monotonic() + self.start_timeout_s
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = self.log_path.read_text(errors="replace")[-3000:]
                raise AdminError(f"the sidecar did not start:\n{tail}")
            time.sleep(0.05)
        ports = ready.read_text().split()  # "HTTP_PORT [GRPC_PORT]"
        self.port = int(ports[0])
        self.grpc_port = int(ports[1]) if len(ports) > 1 else None
        ready.unlink()
        ready.parent.rmdir()
        return self

    def kill(self) -> None:
        """SIGKILL: no cleanup runs (what a crash looks like)."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
            self.proc = None

    def stop(self, timeout_s: float = 15.0) -> int | None:
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                return proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            return proc.wait(timeout=5)
        return None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def write_token_file(path: Path, token: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return path
