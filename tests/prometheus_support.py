"""Test support for the observability tests: a real Prometheus (Debian's `prometheus`) run on a free port in
a temp dir, and the metric-name contract read from sidecar/metrics.py.

Prometheus and promtool are found on PATH; when missing they are installed with apt-get when running as
root (CI installs them in .ci/run), else the tests that need them skip and say why.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

from tunegate.triton import free_port

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "compose"
PROM_DIR = COMPOSE / "prometheus"
RULES = sorted((PROM_DIR / "rules").glob("*.yml"))
DASHBOARD_PY = COMPOSE / "grafana" / "dashboard.py"

_INSTALL_TRIED: list[str] = []


def _apt_install_prometheus() -> str:
    """Install Debian's prometheus; returns why it did not happen ('' when it ran)."""
    if os.geteuid() != 0:
        return "not root"
    if shutil.which("apt-get") is None:
        return "no apt-get"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "prometheus"]
    for cmd in (["apt-get", "update", "-qq"], install):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
        if proc.returncode != 0:
            return f"{' '.join(cmd)} failed: {proc.stderr.strip()[-300:]}"
    return ""


def prometheus_binaries() -> tuple[str, str]:
    """(prometheus, promtool) paths, installing them once if possible; skips the test otherwise."""
    prom, tool = shutil.which("prometheus"), shutil.which("promtool")
    if prom and tool:
        return prom, tool
    if not _INSTALL_TRIED:
        _INSTALL_TRIED.append(_apt_install_prometheus())
    prom, tool = shutil.which("prometheus"), shutil.which("promtool")
    if prom and tool:
        return prom, tool
    pytest.skip(
        "Prometheus is not installed (Debian package `prometheus`: apt-get install prometheus) "
        "and could not be "
        f"installed here: {_INSTALL_TRIED[0] or 'installed but not on PATH'}"
    )


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


# -- the metric contract ----------------------------------------------------------------------


def contract_series() -> dict[str, frozenset[str]]:
    """Exposed series names of the sidecar's metrics -> their label names (from sidecar/metrics.py)."""
    from sidecar.metrics import LoopCounter, LoopHistogram, SidecarMetrics

    metrics = SidecarMetrics(CollectorRegistry())
    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
    out: dict[str, frozenset[str]] = {}
    for metric in vars(metrics).values():
        if isinstance(metric, MetricWrapperBase):
            labels = frozenset(metric._labelnames)
        elif isinstance(metric, (LoopCounter, LoopHistogram)):  # the client and mirror paths' lock-free ones
            labels = frozenset(metric.labelnames)
        else:
            continue
        for family in metric.describe():
            for suffix in suffixes[family.type]:
                out[family.name + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
    return out


_SELECTOR = re.compile(r"\b((?:tunegate|nv)_[a-z0-9_]+)\s*(\{[^}]*\})?")
_MATCHER = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"([^"]*)"')


def selectors(expr: str) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """(metric name, [(label, op, value)]) for every tunegate_/nv_ selector in a PromQL expression."""
    return [(m.group(1), _MATCHER.findall(m.group(2) or "")) for m in _SELECTOR.finditer(expr)]


def contract_violations(expr: str) -> list[str]:
    """What in `expr` does not exist in the metric contract (unknown names, labels or label values)."""
    from sidecar.metrics import CANARY_STATES, OUTCOMES, ROLES

    known = contract_series()
    values = {"role": set(ROLES), "state": set(CANARY_STATES), "outcome": set(OUTCOMES)}
    problems = []
    for name, matchers in selectors(expr):
        if name.startswith("nv_"):
            continue  # Triton's own; checked against a live Triton by the live test
        if name not in known:
            problems.append(f"unknown metric {name}")
            continue
        for label, op, value in matchers:
            if label not in known[name]:
                problems.append(f"{name} has no label {label}")
            elif label in values and op in ("=", "=~") and re.fullmatch(r"[a-z|]+", value):
                for v in value.split("|") if op == "=~" else [value]:
                    if v not in values[label]:
                        problems.append(f"{name}{{{label}={v!r}}}: not one of {sorted(values[label])}")
    return problems


# -- a real Prometheus ------------------------------------------------------------------------


def terminate(proc: subprocess.Popen[bytes], timeout_s: float = 20) -> None:
    """SIGTERM, then SIGKILL if it does not exit in time; always reaped."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


class PrometheusServer:
    """`prometheus` on 127.0.0.1:<free port> with its TSDB in `workdir`; stop() always reaps it."""

    def __init__(self, binary: str, config: Path, workdir: Path) -> None:
        self.binary, self.config, self.workdir = binary, config, workdir
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = workdir / "prometheus.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60) -> None:
        self.port = free_port()
        cmd = [
            self.binary,
            f"--config.file={self.config}",
            f"--storage.tsdb.path={self.workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--web.enable-lifecycle",
            "--log.level=warn",
        ]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}:\n{self.log_tail()}")
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as resp,
            ):
                if resp.status == 200:
                    return
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"prometheus was not ready after {timeout_s:.0f}s:\n{self.log_tail()}")

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            terminate(proc)

    def log_tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return "(no log)"

    def api(self, path: str, **params: Any) -> Any:
        url = f"{self.url}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=30) as resp:
                body = json.load(resp)
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"GET {url} -> {exc.code}: {exc.read().decode(errors='replace')}") from exc
        assert body["status"] == "success", body
        return body["data"]

    def query_range(self, expr: str, start: float, end: float, step: float = 1.0) -> list[dict[str, Any]]:
        data = self.api("query_range", query=expr, start=start, end=end, step=step)
        result: list[dict[str, Any]] = data["result"]
        return result


def finite_points(result: list[dict[str, Any]]) -> int:
    """How many finite samples a range-query result holds (NaN is not data for an on-call reader)."""
    return sum(1 for series in result for _t, v in series["values"] if math.isfinite(float(v)))


@contextlib.contextmanager
def running_prometheus(binary: str, config: Path, workdir: Path) -> Iterator[PrometheusServer]:
    server = PrometheusServer(binary, config, workdir)
    server.start()
    try:
        yield server
    finally:
        server.stop()
