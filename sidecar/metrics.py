"""The sidecar's Prometheus metrics (prefix `tunegate_`), on an injected registry.

These names are a contract: the Grafana dashboard and the alert rules in compose/ query exactly
these (and Triton's own `nv_*`). Change one here and there together.

Roles: `primary` (the client path), `candidate` (the mirror), `aa` (the baseline replayed for the
noise floor).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

ROLES = ("primary", "candidate", "aa")
CANARY_STATES = ("idle", "running", "promoted", "pinned")
OUTCOMES = ("promote", "pin", "inconclusive")

# 1 ms .. 10 s, roughly 1-2-5 per decade: resolves both the tiny model and MiniLM's batches.
LATENCY_BUCKETS = (
    0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1,
    0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0,
)  # fmt: skip


class SidecarMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._children: dict[tuple[str, str, str, int], tuple[Any, Any]] = {}
        self._counters: dict[tuple[int, tuple[str, ...]], Any] = {}
        self.requests = Counter(
            "tunegate_requests", "Inference requests by model, version, role and HTTP status code.",
            ["model", "version", "role", "code"], registry=registry,
        )  # fmt: skip
        self.latency = Histogram(
            "tunegate_request_duration_seconds", "Upstream latency by model, version and role.",
            ["model", "version", "role"], buckets=LATENCY_BUCKETS, registry=registry,
        )  # fmt: skip
        self.mirror_sampled = Counter(
            "tunegate_mirror_sampled", "Requests sampled for mirroring (candidate or A/A).",
            ["model", "role"], registry=registry,
        )  # fmt: skip
        self.mirror_dropped = Counter(
            "tunegate_mirror_dropped", "Sampled mirror requests dropped (reason: full, shutdown).",
            ["model", "role", "reason"], registry=registry,
        )  # fmt: skip
        self.mirror_errors = Counter(
            "tunegate_mirror_errors", "Mirror requests that failed (kind: error, timeout).",
            ["model", "version", "role", "kind"], registry=registry,
        )  # fmt: skip
        self.comparisons = Counter(
            "tunegate_comparisons", "Output comparisons against the primary's response.",
            ["model", "output", "role"], registry=registry,
        )  # fmt: skip
        self.out_of_tolerance = Counter(
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
            "tunegate_live_version", "Version serving unversioned client requests.", ["model"], registry=registry
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
        self.decisions = Counter(
            "tunegate_decisions", "Canary decisions by outcome.", ["model", "outcome"], registry=registry
        )
        self.last_decision = Gauge(
            "tunegate_last_decision_timestamp_seconds", "When the last decision of each outcome was made.",
            ["model", "outcome"], registry=registry,
        )  # fmt: skip

    def observe_request(self, model: str, version: str, role: str, code: int, seconds: float | None) -> None:
        """Count one request (and its latency); label children are cached, the client path calls this per request."""
        key = (model, version, role, code)
        children = self._children.get(key)
        if children is None:
            children = self._children[key] = (
                self.requests.labels(model, version, role, str(code)),
                self.latency.labels(model, version, role),
            )
        children[0].inc()
        if seconds is not None:
            children[1].observe(seconds)

    def inc(self, counter: Counter, *labels: str) -> None:
        """`counter.labels(*labels).inc()` with the child cached: the mirror path counts per request."""
        key = (id(counter), labels)
        child = self._counters.get(key)
        if child is None:
            child = self._counters[key] = counter.labels(*labels)
        child.inc()

    def init_model(self, model: str, outputs: tuple[str, ...] = ()) -> None:
        """Pre-initialise label values so dashboards show zeros, not gaps, before the first event."""
        for role in ROLES:
            self.mirror_sampled.labels(model, role)
            self.mirror_dropped.labels(model, role, "full")
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
