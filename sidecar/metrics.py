"""The sidecar's Prometheus metrics (prefix `tunegate_`), on an injected registry.

These names are a contract: the Grafana dashboard and the alert rules in compose/ query exactly
these (and Triton's own `nv_*`). Change one here and there together.

Roles: `primary` (the client path), `candidate` (the mirror), `aa` (the baseline replayed for the
noise floor).

A scrape renders in a worker thread (`SidecarMetrics.render`), never on the event loop, and concurrent
scrapes share one rendering: the client path does not wait for a scrape, however many come. The loop
families are read there without a lock: copying a dict's items or a list of counts is one step under the
interpreter's lock, and a histogram's count and buckets come from the same copy.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

ROLES = ("primary", "candidate", "aa")
# Why a sampled request gives the canary no evidence: its semantics (as sidecar.semantics); a gRPC request with
# shared-memory tensors, or one the HTTP protocol cannot carry; a primary answer (200) the comparison cannot use
# (not decodable, no output, or none the tolerance names: sidecar.mirror.judged_spec); a failure of
# the mirror's own code (logged).
SKIP_REASONS = ("sequence", "decoupled", "shared_memory", "untranslatable", "primary_unusable", "internal")
PROTOCOLS = ("http", "grpc")
CANARY_STATES = ("idle", "running", "promoted", "pinned", "rolled_back")
OUTCOMES = ("promote", "pin", "inconclusive", "rollback", "rollback_failed")

# 1 ms .. 10 s, roughly 1-2-5 per decade: resolves both the tiny model and MiniLM's batches.
LATENCY_BUCKETS = (
    0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1,
    0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0,
)  # fmt: skip


class _Count:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class _Observations:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds, self.counts, self.sum = bounds, [0] * (len(bounds) + 1), 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # the first bucket whose bound is >= value
        self.sum += value


class _LoopFamily:
    """Labelled children for the client and mirror paths, exposed as prometheus_client's types are (no
    `_created` series). Children are plain floats without a lock: only the event loop's thread changes
    them, and a scrape reads whole floats. prometheus_client's lock, observability checks and call layers
    cost ~12 us per mirrored request (py-spy), a twentieth of the sidecar's CPU for it.
    """

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry
    ) -> None:
        self.name, self.documentation, self.labelnames = name, documentation, tuple(labelnames)
        self._children: dict[tuple[str, ...], Any] = {}
        registry.register(self)

    def _child(self) -> Any:
        raise NotImplementedError

    def _family(self) -> Metric:
        raise NotImplementedError

    def labels(self, *values: str) -> Any:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name} takes labels {self.labelnames}, got {values}")
            if not all(
                type(v) is str for v in values
            ):  # as prometheus_client does; strings are looked up as they are
                return self.labels(*map(str, values))
            child = self._children[values] = self._child()
        return child

    def describe(self) -> Iterator[Metric]:
        yield self._family()

    def collect(self) -> Iterator[Metric]:
        raise NotImplementedError


class LoopCounter(_LoopFamily):
    """A counter (`<name>_total`)."""

    def _child(self) -> _Count:
        return _Count()

    def _family(self) -> CounterMetricFamily:
        return CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        for values, child in list(self._children.items()):
            family.add_metric(values, child.value)
        yield family


class LoopHistogram(_LoopFamily):
    """A histogram (`_bucket`, `_count`, `_sum`)."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], buckets: Sequence[float],
                 registry: CollectorRegistry) -> None:  # fmt: skip
        self.bounds = tuple(float(b) for b in buckets)
        super().__init__(name, documentation, labelnames, registry)

    def _child(self) -> _Observations:
        return _Observations(self.bounds)

    def _family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        for values, child in list(self._children.items()):
            counts, total, cumulative = list(child.counts), 0, []
            for bound, n in zip((*self.bounds, float("inf")), counts, strict=True):
                total += n
                cumulative.append((floatToGoString(bound), total))  # type: ignore[no-untyped-call]  # unannotated in prometheus_client
            family.add_metric(values, cumulative, child.sum)
        yield family


OTHER = "other"  # the label of models and versions the repository does not hold


def repository_models(repository: Path) -> dict[str, frozenset[str]]:
    """model -> its numeric version directories, for every model directory in `repository` (shadows included)."""
    out: dict[str, frozenset[str]] = {}
    with contextlib.suppress(OSError):
        for entry in os.scandir(repository):
            if entry.is_dir() and not entry.name.startswith("."):
                with contextlib.suppress(OSError):
                    out[entry.name] = frozenset(v.name for v in os.scandir(entry.path) if v.name.isdigit())
    return out


class SidecarMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._rendering: asyncio.Future[bytes] | None = None
        self._children: dict[tuple[str, str, str, int], tuple[_Count, _Observations]] = {}
        self.known: dict[str, frozenset[str]] = {}  # model -> version directories (set_known)
        # The client and mirror paths' metrics (per request): loop-only, lock-free.
        self.requests = LoopCounter(
            "tunegate_requests", "Inference requests by model, version, role and HTTP status code.",
            ["model", "version", "role", "code"], registry=registry,
        )  # fmt: skip
        self.latency = LoopHistogram(
            "tunegate_request_duration_seconds", "Upstream latency by model, version and role.",
            ["model", "version", "role"], buckets=LATENCY_BUCKETS, registry=registry,
        )  # fmt: skip
        self.mirror_sampled = LoopCounter(
            "tunegate_mirror_sampled", "Requests sampled for mirroring (candidate or A/A).",
            ["model", "role"], registry=registry,
        )  # fmt: skip
        self.mirror_dropped = LoopCounter(
            "tunegate_mirror_dropped", "Sampled mirror requests dropped (reason: full, shutdown).",
            ["model", "role", "reason"], registry=registry,
        )  # fmt: skip
        self.client_refused = LoopCounter(
            "tunegate_client_refused",
            "Client connections and requests refused by the client path's limits (reason: connections, timeout).",
            ["reason"], registry=registry,
        )  # fmt: skip
        for reason in ("connections", "timeout"):  # zeros from the start: a dashboard shows no gap
            self.client_refused.labels(reason)
        self.mirror_skipped = LoopCounter(
            "tunegate_mirror_skipped",
            f"Sampled requests that give the canary no evidence (reason: {', '.join(SKIP_REASONS)}).",
            ["model", "reason"], registry=registry,
        )  # fmt: skip
        self.mirror_protocol = LoopCounter(
            "tunegate_mirror_compared_by_protocol",
            "Candidate comparisons by the protocol the mirrored client request came in (http, grpc).",
            ["model", "protocol"], registry=registry,
        )  # fmt: skip
        self.grpc_requests = LoopCounter(
            "tunegate_grpc_requests",
            "Calls on the gRPC front by method (Triton's GRPCInferenceService; 'other' for unknown ones) and status "
            "code; each message of a ModelStreamInfer stream counts once.",
            ["method", "code"], registry=registry,
        )  # fmt: skip
        self.mirror_errors = LoopCounter(
            "tunegate_mirror_errors", "Mirror requests that failed (kind: error, timeout).",
            ["model", "version", "role", "kind"], registry=registry,
        )  # fmt: skip
        self.comparisons = LoopCounter(
            "tunegate_comparisons", "Output comparisons against the primary's response.",
            ["model", "output", "role"], registry=registry,
        )  # fmt: skip
        self.out_of_tolerance = LoopCounter(
            "tunegate_out_of_tolerance", "Comparisons outside the tolerance.",
            ["model", "output", "role"], registry=registry,
        )  # fmt: skip
        self.noise_floor_rate = Gauge(
            "tunegate_noise_floor_rate", "Out-of-tolerance rate of the baseline against itself (A/A).",
            ["model"], registry=registry,
        )  # fmt: skip
        self.candidate_oot_rate = Gauge(
            "tunegate_out_of_tolerance_rate", "Out-of-tolerance rate of the candidate in the current canary.",
            ["model"], registry=registry,
        )  # fmt: skip
        self.oot_budget = Gauge(
            "tunegate_out_of_tolerance_budget", "Out-of-tolerance rate the judge allows.",
            ["model"], registry=registry,
        )  # fmt: skip
        self.canary_state = Gauge(
            "tunegate_canary_state", "1 for the canary's current state, 0 for the others.",
            ["model", "state"], registry=registry,
        )  # fmt: skip
        self.live_version = Gauge(
            "tunegate_live_version",
            "Version serving unversioned client requests.",
            ["model"],
            registry=registry,
        )
        self.candidate_version = Gauge(
            "tunegate_candidate_version", "Version under canary (0 when none).", ["model"], registry=registry
        )
        self.canary_started = Gauge(
            "tunegate_canary_started_timestamp_seconds", "When the current canary started (unix seconds).",
            ["model"], registry=registry,
        )  # fmt: skip
        self.canary_deadline = Gauge(
            "tunegate_canary_deadline_timestamp_seconds", "When the current canary must have decided (unix seconds).",
            ["model"], registry=registry,
        )  # fmt: skip
        self.mirror_sample_rate = Gauge(
            "tunegate_mirror_sample_rate",
            "Effective mirror sample rate of the running canary (the mirror budget's controller; sample_rate at most).",
            ["model"], registry=registry,
        )  # fmt: skip
        self.client_slowdown = Gauge(
            "tunegate_client_slowdown",
            "Fraction by which mirroring raises the live version's client p50 (last window against the last pause).",
            ["model"], registry=registry,
        )  # fmt: skip
        self.canary_paused = Gauge(
            "tunegate_canary_paused", "1 while the canary is paused: Triton unavailable or the shadow model lost.",
            ["model"], registry=registry,
        )  # fmt: skip
        self.model_memory = Gauge(
            "tunegate_model_memory_bytes",
            "Memory per instance of a canary's candidate and baseline on Triton's host (resident, or GPU where one serves).",
            ["model", "version", "role"], registry=registry,
        )  # fmt: skip
        self.model_capacity = Gauge(
            "tunegate_model_capacity_inferences_per_second",
            "Inferences per second a canary's candidate and baseline instances sustain when busy, from Triton's "
            "compute time on the mirrored mix since the warm-up (sidecar.throughput).",
            ["model", "version", "role"], registry=registry,
        )  # fmt: skip
        self.decisions = Counter(
            "tunegate_decisions", "Canary decisions by outcome.", ["model", "outcome"], registry=registry
        )
        self.last_decision = Gauge(
            "tunegate_last_decision_timestamp_seconds", "When the last decision of each outcome was made.",
            ["model", "outcome"], registry=registry,
        )  # fmt: skip

    async def render(self) -> bytes:
        """The text exposition, rendered off the event loop; a scrape that comes during a rendering shares it."""
        if self._rendering is None:
            self._rendering = asyncio.ensure_future(asyncio.to_thread(generate_latest, self.registry))
            self._rendering.add_done_callback(self._rendered)
        return await asyncio.shield(self._rendering)

    def _rendered(self, _: asyncio.Future[bytes]) -> None:
        self._rendering = None

    def set_known(self, known: dict[str, frozenset[str]]) -> None:
        """The models the repository holds and their version directories: only these get series of their own."""
        self.known = known

    def observe_request(self, model: str, version: str, role: str, code: int, seconds: float | None) -> None:
        """Count one request (and its latency); label children are cached, the client path calls this per request.

        A model or version the repository does not hold (any URL can name one) is counted under OTHER, so the
        series stay as many as the repository's versions however many names clients send.
        """
        children = self._children.get((model, version, role, code)) or self._request_children(model, version, role,
                                                                                               code)  # fmt: skip
        children[0].value += 1.0
        if seconds is not None:
            children[1].observe(seconds)

    def add_requests(self, model: str, version: str, role: str, code: int, count: int, seconds_sum: float,
                     buckets: Sequence[int]) -> None:  # fmt: skip
        """Count requests observed elsewhere (the compiled gRPC front): `buckets` per LATENCY_BUCKETS bound and one
        above, empty for requests without a latency."""
        children = self._children.get((model, version, role, code)) or self._request_children(model, version, role,
                                                                                               code)  # fmt: skip
        children[0].value += count
        if buckets:
            obs = children[1]
            for i, n in enumerate(buckets[: len(obs.counts)]):
                obs.counts[i] += n
            obs.sum += seconds_sum

    def _request_children(
        self, model: str, version: str, role: str, code: int
    ) -> tuple[_Count, _Observations]:
        versions = self.known.get(model)
        if versions is None:
            model = version = OTHER
        elif version not in versions and version != "":
            version = OTHER
        key = (model, version, role, code)
        children = self._children.get(key)
        if children is None:
            children = self._children[key] = (
                self.requests.labels(model, version, role, str(code)),
                self.latency.labels(model, version, role),
            )
        return children

    @staticmethod
    def inc(counter: LoopCounter, *labels: str) -> None:
        counter.labels(*labels).value += 1.0

    def init_model(self, model: str, outputs: tuple[str, ...] = ()) -> None:
        """Pre-initialise label values so dashboards show zeros, not gaps, before the first event."""
        for role in ROLES:
            self.mirror_sampled.labels(model, role)
            self.mirror_dropped.labels(model, role, "full")
        for protocol in PROTOCOLS:
            self.mirror_protocol.labels(model, protocol)
        for reason in SKIP_REASONS:
            self.mirror_skipped.labels(model, reason)
            for out in outputs:
                self.comparisons.labels(model, out, role)
                self.out_of_tolerance.labels(model, out, role)
        for outcome in OUTCOMES:
            self.decisions.labels(model, outcome)
        for state in CANARY_STATES:
            self.canary_state.labels(model, state)

    def set_state(self, model: str, state: str) -> None:
        for s in CANARY_STATES:
            self.canary_state.labels(model, s).set(1.0 if s == state else 0.0)
