"""Sidecar configuration: frozen, validated value classes built once at the edge (TOML file, flags, request bodies).

`SidecarConfig` is the process; `CanaryParams` is one canary (the body of `POST /canary/{model}`),
with defaults sized for the demo's timeline (20-60 req/s for 60-120 s on 2 cores).
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from sidecar.judge import MAX_PLACEMENTS, MAX_SET_PAIRS, MIN_PLACEMENT_PAIRS, JudgeParams
from tunegate import validate
from tunegate.errors import InputError

GRPC_FRONTS = ("auto", "native", "python")

LATENCY_PAIRINGS = ("primary", "shadow")
MAX_DEADLINE_S = 7 * 86400.0
MAX_BUDGET_QUANTILE = 0.999  # the mirror budget's quantile: beyond it a window needs over 15,000 requests


class ConfigError(InputError):
    """A configuration value that cannot be used; the message names the key."""


def _fraction(name: str, v: float, *, open_low: bool = False) -> None:
    validate.fraction(name, v, ConfigError, open_low=open_low)


def _positive(name: str, v: float) -> None:
    validate.positive(name, v, ConfigError)


@dataclasses.dataclass(frozen=True)
class CanaryParams:
    sample_rate: float = 1.0  # fraction of live requests mirrored to the candidate
    aa_rate: float = 0.1  # fraction of mirrored requests also replayed to the baseline (noise floor)
    max_in_flight: int = 8  # mirror requests in flight; beyond this, drop and count
    timeout_s: float = 5.0  # a mirror request slower than this counts as a candidate timeout
    min_samples: int = 300
    deadline_s: float = (
        600.0  # a baseline that disagrees with itself needs thousands of samples (benchmarks/judge_sim.py)
    )
    required_speedup: float = 1.0  # candidate must be this much faster (1.2 = 20% faster)
    latency_slack: float = 0.05  # ... give or take this fraction
    oot_budget: float = 0.005  # out-of-tolerance rate allowed above the A/A noise floor
    error_budget: float = 0.01
    confidence: float = 0.99
    # A freshly loaded model is cold: latency pairs are taken only after the first `warmup_samples`
    # candidate responses AND `warmup_s` seconds after the start (outputs are compared from the first).
    warmup_samples: int = 20
    warmup_s: float = 10.0
    # What the candidate's latency is paired with: "shadow", a replay sent right beside the candidate's
    # copy (the second leaves when the first answers, a coin choosing which leads) to the baseline version
    # loaded in the shadow model beside the candidate (an instance that, like the candidate's, takes no client
    # traffic): both copies meet the same load, saturated or not, without racing each other. It costs a
    # second instance of the baseline and one more inference per sample; every sample is
    # then also an A/A one. "primary": the client's own request (no extra load; sound only while Triton
    # and the CPU have headroom, else the copy, sent after the client's answer, queues where the client's
    # request did not and an identical candidate looks slower).
    latency_pairing: str = "shadow"
    # Sets of instances every latency verdict must hold on (shadow pairing): a process's placement can make one
    # version's instance lastingly faster or slower than the other's. After `placement_pairs` pairs the
    # canary loads fresh instances of both versions in the shadow model (sidecar.judge). 1: never reloaded.
    placements: int = 2
    placement_pairs: int = 200  # pairs a set of instances serves before fresh ones are loaded (50 to 1,000)
    min_duration_s: float = 30.0  # wall-clock coverage of traffic before a promotion
    min_class_samples: int = (
        10  # comparisons each request class of the gate's traffic needs before a promotion
    )
    recent_window: int = 400  # pairs and comparisons in the judge's recent-window checks (late regressions)
    # Pin when the candidate's instances take more than this times the baseline's memory (both measured on
    # Triton's host: resident memory of the python backend's processes, or their GPU memory; sidecar.memory).
    max_memory_ratio: float = 1.5
    # Pin when the candidate's instances sustain less than this times the baseline's inferences per second on
    # the same mirrored mix (Triton's compute time per inference after the warm-up; sidecar.throughput).
    min_throughput_ratio: float = 0.8
    # The mirror budget (sidecar.budget): client p50 of the live version may rise by at most this fraction
    # because of mirroring; above it the effective sample rate halves, below it grows slowly back to
    # `sample_rate`. Measured against short pauses of the mirror (`budget_pause_s` every `budget_period_s`).
    # None or 0 turns the control off: no pauses, the rate stays `sample_rate`.
    max_client_slowdown: float | None = None
    budget_period_s: float = 30.0
    budget_pause_s: float = 3.0
    # Which client latency the budget bounds: 0.5 the median, 0.99 the p99 (a window then needs 1,500 requests,
    # sidecar.budget.min_requests; a pause with fewer is merged with the next ones).
    budget_quantile: float = 0.5
    # The lowest effective rate, in samples a second at the traffic measured (never above `sample_rate`).
    budget_min_samples_per_s: float = 1.0

    def __post_init__(self) -> None:
        _fraction("sample_rate", self.sample_rate, open_low=True)
        _fraction("aa_rate", self.aa_rate)
        _fraction("oot_budget", self.oot_budget)
        _fraction("error_budget", self.error_budget)
        _fraction("min_throughput_ratio", self.min_throughput_ratio)
        for name in ("timeout_s", "deadline_s", "required_speedup", "max_memory_ratio"):
            _positive(name, getattr(self, name))
        if self.deadline_s > MAX_DEADLINE_S:
            raise ConfigError(
                f"deadline_s must be at most {MAX_DEADLINE_S:g} (7 days), got {self.deadline_s!r}"
            )
        w = self.warmup_s
        if not isinstance(w, (int, float)) or isinstance(w, bool) or not math.isfinite(w) or w < 0:
            raise ConfigError(f"warmup_s must be a non-negative number, got {w!r}")
        if not isinstance(self.latency_slack, (int, float)) or not 0.0 <= self.latency_slack < 10:
            raise ConfigError(f"latency_slack must be within [0, 10), got {self.latency_slack!r}")
        if not isinstance(self.confidence, float) or not 0.5 < self.confidence < 1.0:
            raise ConfigError(f"confidence must be within (0.5, 1), got {self.confidence!r}")
        if self.latency_pairing not in LATENCY_PAIRINGS:
            raise ConfigError(
                f"latency_pairing must be one of {', '.join(LATENCY_PAIRINGS)}, got {self.latency_pairing!r}"
            )
        s = self.max_client_slowdown
        if s is not None and (not isinstance(s, (int, float)) or isinstance(s, bool) or not math.isfinite(s)
                              or not 0.0 <= s < 10.0):  # fmt: skip
            raise ConfigError(
                f"max_client_slowdown must be None or within [0, 10) (0 or None: off), got {s!r}"
            )
        for name in ("budget_period_s", "budget_pause_s", "budget_min_samples_per_s"):
            _positive(name, getattr(self, name))
        q = self.budget_quantile
        if not isinstance(q, float) or not 0.5 <= q <= MAX_BUDGET_QUANTILE:
            raise ConfigError(f"budget_quantile must be within [0.5, {MAX_BUDGET_QUANTILE}], got {q!r}")
        if self.budget_pause_s >= self.budget_period_s:
            raise ConfigError(f"budget_pause_s ({self.budget_pause_s}) must be shorter than budget_period_s "
                              f"({self.budget_period_s})")  # fmt: skip
        d = self.min_duration_s
        if not isinstance(d, (int, float)) or isinstance(d, bool) or not math.isfinite(d) or d < 0:
            raise ConfigError(f"min_duration_s must be a non-negative number, got {d!r}")
        pl = self.placements
        if not isinstance(pl, int) or isinstance(pl, bool) or not 1 <= pl <= MAX_PLACEMENTS:
            raise ConfigError(f"placements must be an integer within [1, {MAX_PLACEMENTS}], got {pl!r}")
        pp = self.placement_pairs
        if not isinstance(pp, int) or isinstance(pp, bool) or not MIN_PLACEMENT_PAIRS <= pp <= MAX_SET_PAIRS:
            raise ConfigError(
                f"placement_pairs must be an integer within [{MIN_PLACEMENT_PAIRS}, {MAX_SET_PAIRS}], got {pp!r}"
            )
        non_negative = ("warmup_samples", "min_class_samples")
        for name in ("max_in_flight", "min_samples", "warmup_samples", "min_class_samples", "recent_window"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < (0 if name in non_negative else 1):
                raise ConfigError(f"{name} must be a {'non-negative' if name in non_negative else 'positive'} "
                                  f"integer, got {v!r}")  # fmt: skip

    def judge_params(self) -> JudgeParams:
        return JudgeParams(
            min_samples=self.min_samples,
            oot_budget=self.oot_budget,
            error_budget=self.error_budget,
            required_speedup=self.required_speedup,
            latency_slack=self.latency_slack,
            confidence=self.confidence,
            min_duration_s=self.min_duration_s,
            min_class_samples=self.min_class_samples,
            recent_window=self.recent_window,
            max_memory_ratio=self.max_memory_ratio,
            min_throughput_ratio=self.min_throughput_ratio,
            placements=self.placements if self.latency_pairing == "shadow" else 1,
            placement_pairs=self.placement_pairs,
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], base: CanaryParams | None = None) -> CanaryParams:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(f"unknown canary parameters {unknown}; known: {sorted(known)}")
        values = {**(base or cls()).to_dict(), **raw}
        for k in ("timeout_s", "deadline_s", "required_speedup", "latency_slack", "confidence", "warmup_s", "min_duration_s",
                  "sample_rate", "aa_rate", "oot_budget", "error_budget", "max_memory_ratio", "min_throughput_ratio", "max_client_slowdown",
                  "budget_period_s", "budget_pause_s", "budget_quantile", "budget_min_samples_per_s"):  # fmt: skip
            if isinstance(values[k], int) and not isinstance(values[k], bool):
                values[k] = float(values[k])
        return cls(**values)


@dataclasses.dataclass(frozen=True)
class SidecarConfig:
    upstream: str  # Triton's HTTP URL, e.g. http://triton:8000
    state_dir: Path
    repository: Path  # the model repository Triton serves (shared volume)
    # Triton's gRPC host:port (e.g. triton:8001): model loads and unloads go there. Through Triton's HTTP API
    # a load stalls the HTTP clients for the whole load (sidecar/control.py).
    upstream_grpc: str | None = None
    # (host, port) of the gRPC front (Triton's GRPCInferenceService, sidecar/grpc_front.py); needs upstream_grpc.
    # None: no gRPC front.
    grpc_listen: tuple[str, int] | None = None
    grpc_max_message_bytes: int = 64 << 20  # a larger message is refused with RESOURCE_EXHAUSTED
    grpc_max_concurrent_rpcs: int = 1000  # calls beyond it are refused with RESOURCE_EXHAUSTED
    # Which gRPC front serves: "native" the compiled one (tunegate-grpc-front, sidecar/grpc_native.py; several
    # times less CPU per call), "python" grpcio's asyncio server (sidecar/grpc_front.py), "auto" native where the
    # binary is installed, else python with a warning.
    grpc_front: str = "auto"
    listen_host: str = "127.0.0.1"
    listen_port: int = 8080
    admin_token: str | None = None  # read from the token file at startup; None disables admin
    # (host, port) of a listener for the admin API alone; then the client port answers 404 to /canary and
    # /decisions, and client traffic never reaches the token check. None: the admin API is on the client port.
    admin_listen: tuple[str, int] | None = None
    canary: CanaryParams = CanaryParams()  # defaults for canaries started without a value
    max_body_bytes: int = 64 << 20
    # Client-path limits, with the defaults of a production proxy (nginx's client_header_timeout,
    # client_body_timeout, keepalive_timeout, large_client_header_buffers; Envoy's max_headers_count).
    header_timeout_s: float = 10.0  # request line and headers must have arrived by then: 408
    body_timeout_s: float = 30.0  # the longest pause while a request body arrives: 408
    keepalive_timeout_s: float = 75.0  # an idle keep-alive connection is closed after this
    # Triton's HTTP server resets a connection whose request head passes about 8 KiB (the client would get a
    # 502): the sidecar refuses before that, with a status that says why.
    max_url_bytes: int = 4096  # 414 beyond it
    max_header_bytes: int = 3 << 10  # header names and values together: 431 beyond it
    max_header_count: int = 100  # 431 beyond it
    # Client connections; beyond it requests get 503 and the connection closes, except health checks
    # (/healthz, /readyz) on the HEALTH_RESERVE connections above it. Also bounded by the open-files limit.
    max_connections: int = 1000
    upstream_timeout_s: float = 60.0
    upstream_connections: int = 256
    judge_interval_s: float = 1.0
    capture_dir: Path | None = None
    capture_rate: float = 0.0  # fraction of client requests captured
    capture_max_per_second: float = 50.0
    capture_max_file_bytes: int = 64 << 20
    capture_max_files: int = 8
    # After a promotion or a rollback, a model's version directories beyond the newest `retain_versions`
    # are deleted, except the live version, a running candidate and the version a rollback brings back.
    # 0 keeps every version.
    retain_versions: int = 3

    def __post_init__(self) -> None:
        u = urlparse(self.upstream)
        if u.scheme not in ("http", "https") or not u.netloc:
            raise ConfigError(
                f"upstream must be an http(s) URL like http://127.0.0.1:8000, got {self.upstream!r}"
            )
        if self.upstream_grpc is not None:
            _host_port("upstream_grpc", self.upstream_grpc)
        if self.grpc_listen is not None and self.upstream_grpc is None:
            raise ConfigError(
                "grpc_listen needs upstream_grpc: the gRPC front forwards to Triton's gRPC port"
            )
        if self.grpc_front not in GRPC_FRONTS:
            raise ConfigError(f"grpc_front must be one of {', '.join(GRPC_FRONTS)}, got {self.grpc_front!r}")
        if not 0 <= self.listen_port <= 65535:
            raise ConfigError(f"listen port must be within 0..65535, got {self.listen_port}")
        if not Path(self.repository).is_dir():
            raise ConfigError(f"repository {self.repository} is not a directory")
        for name in ("upstream_timeout_s", "judge_interval_s", "capture_max_per_second", "header_timeout_s",
                     "body_timeout_s", "keepalive_timeout_s"):  # fmt: skip
            _positive(name, getattr(self, name))
        for name in (
            "max_body_bytes",
            "upstream_connections",
            "capture_max_file_bytes",
            "capture_max_files",
            "max_url_bytes",
            "max_header_bytes",
            "max_header_count",
            "max_connections",
            "grpc_max_message_bytes",
            "grpc_max_concurrent_rpcs",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1")
        _fraction("capture_rate", self.capture_rate)
        rv = self.retain_versions
        if not isinstance(rv, int) or isinstance(rv, bool) or rv < 0:
            raise ConfigError(f"retain_versions must be a non-negative integer (0 keeps all), got {rv!r}")
        if self.capture_rate > 0 and self.capture_dir is None:
            raise ConfigError("capture_rate > 0 needs capture_dir")
        if self.admin_token is not None and len(self.admin_token) < 16:
            raise ConfigError("the admin token must be at least 16 characters")

    @property
    def upstream_base(self) -> str:
        return self.upstream.rstrip("/")


def _host_port(name: str, value: Any) -> tuple[str, int]:
    host, sep, port = str(value).rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{name} must be host:port, got {value!r}")
    return host or "127.0.0.1", int(port)


def read_token(path: Path) -> str:
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read the admin token file {path}: {exc.strerror}") from exc
    if not token:
        raise ConfigError(f"the admin token file {path} is empty")
    return token


def load_config(path: Path | None, overrides: Mapping[str, Any]) -> SidecarConfig:
    """Build the config from a TOML file (optional) and flag overrides (None values are ignored).

    TOML keys are SidecarConfig's fields plus `listen = "host:port"`, `admin_token_file` and a
    `[canary]` table of CanaryParams defaults.
    """
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            raw = tomllib.loads(Path(path).read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    raw.update({k: v for k, v in overrides.items() if v is not None})
    canary = raw.pop("canary", {})
    if not isinstance(canary, Mapping):
        raise ConfigError("[canary] must be a table")
    listen = raw.pop("listen", None)
    if listen is not None:
        raw["listen_host"], raw["listen_port"] = _host_port("listen", listen)
    grpc_listen = raw.pop("grpc_listen", None)
    if grpc_listen is not None:
        raw["grpc_listen"] = _host_port("grpc_listen", grpc_listen)
    admin_listen = raw.pop("admin_listen", None)
    if admin_listen is not None:
        raw["admin_listen"] = _host_port("admin_listen", admin_listen)
    token_file = raw.pop("admin_token_file", None)
    if token_file is not None:
        raw["admin_token"] = read_token(Path(token_file))
    for key in ("state_dir", "repository", "capture_dir"):
        if raw.get(key) is not None:
            raw[key] = Path(raw[key])
    missing = [k for k in ("upstream", "state_dir", "repository") if raw.get(k) is None]
    if missing:
        raise ConfigError(f"missing required settings: {', '.join(missing)}")
    known = {f.name for f in dataclasses.fields(SidecarConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"unknown settings {unknown}")
    try:
        return SidecarConfig(canary=CanaryParams.from_dict(canary), **raw)
    except TypeError as exc:
        raise ConfigError(str(exc)) from exc
