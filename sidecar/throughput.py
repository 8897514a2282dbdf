"""Capacity per model version from Triton's own statistics, for the canary's throughput evidence.

Triton counts, per model version, the inferences it ran and the time its instances spent computing them
(`GET /v2/models/<m>/versions/<v>/stats`: compute_input + compute_infer + compute_output, queueing
excluded). Over a window, `instances * inferences / compute seconds` is the rate the version's instance
group sustains when every instance is busy: its capacity on the traffic it was sent in that window.

The canary reads both the candidate and the version it is compared with at every memory sample and keeps
the difference from a first reading taken once the warm-up is over (a cold model's first inferences are
slow for reasons that pass). Fresh instances (the judge's placements) start a new window, and each set of
instances keeps its own: a process's placement can make one instance lastingly slower, and the judge's
capacity pin, like its latency pins, must hold on the sets of instances (sidecar.judge). With shadow latency
pairing both are versions of the shadow model and get the very same requests, one pair at a time; with
primary pairing the baseline is the live version, which serves the clients' traffic of the same mix. The ratio of the two capacities is the candidate's
throughput against the baseline's on the captured request mix; the judge pins a candidate whose ratio
is below `min_throughput_ratio` once both versions ran MIN_INFERENCES inferences in the window.

What it is not: a load sweep. Where a backend batches dynamically, a version's capacity depends on the
batch sizes the offered load forms, and the mirrored copies of a canary arrive one at a time; the tuner's
benchmark measures throughput at a latency objective under concurrency (tuner/).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from tunegate.errors import InputError

MIN_INFERENCES = 200  # per version in the window before a capacity is judged


class StatsError(InputError):
    """Triton's statistics or config answer lacks what a capacity needs."""


@dataclasses.dataclass(frozen=True)
class ComputeReading:
    """Cumulative counters of one version, as Triton reports them."""

    inferences: int
    executions: int
    compute_ns: int  # compute_input + compute_infer + compute_output

    def since(self, first: ComputeReading) -> ComputeReading:
        """The window from `first` to this reading; a counter that went back (a reloaded model) restarts it."""
        if self.inferences < first.inferences or self.compute_ns < first.compute_ns:
            return self
        return ComputeReading(self.inferences - first.inferences, self.executions - first.executions,
                              self.compute_ns - first.compute_ns)  # fmt: skip


def parse_statistics(raw: Mapping[str, Any], name: str, version: int) -> ComputeReading:
    """The counters of `name` `version` from a `/v2/models/.../stats` answer."""
    try:
        for entry in raw["model_stats"]:
            if entry.get("name") == name and str(entry.get("version")) == str(version):
                st = entry["inference_stats"]
                ns = sum(int(st[k]["ns"]) for k in ("compute_input", "compute_infer", "compute_output"))
                return ComputeReading(int(entry["inference_count"]), int(entry["execution_count"]), ns)
    except (KeyError, TypeError, ValueError) as exc:
        raise StatsError(f"statistics of {name} v{version} are malformed: {exc!r}") from exc
    raise StatsError(f"Triton reports no statistics for {name} v{version}")


def instance_count(config: Mapping[str, Any]) -> int:
    """Instances of a version from the model's config as Triton serves it (`/v2/models/<m>/config`): the sum of
    its instance groups' counts, 1 where Triton reports none."""
    groups = config.get("instance_group") or []
    try:
        n = sum(max(1, int(g.get("count", 1))) * max(1, len(g.get("gpus") or [None])) for g in groups)
    except (AttributeError, TypeError, ValueError) as exc:
        raise StatsError(f"instance_group is malformed: {exc!r}") from exc
    return max(1, n)


def capacity(window: ComputeReading, instances: int) -> float | None:
    """Inferences per second the instance group sustains when busy, None before MIN_INFERENCES or without time."""
    if window.inferences < MIN_INFERENCES or window.compute_ns <= 0:
        return None
    return instances * window.inferences * 1e9 / window.compute_ns


def evidence(windows: Mapping[str, ComputeReading], instances: Mapping[str, int]) -> dict[str, list[int]]:
    """role -> [inferences, executions, compute_ns, instances]: what the canary's evidence keeps (JSON-able)."""
    return {
        role: [w.inferences, w.executions, w.compute_ns, instances.get(role, 1)]
        for role, w in windows.items()
    }


def pooled(sets: Mapping[Any, Mapping[str, Any]]) -> dict[str, list[int]]:
    """The windows of several sets of instances as one (role -> [inferences, executions, compute_ns, instances]):
    counts and compute time summed. Where a role's sets differ in instance count, each set's compute time is
    taken per instance and the role reported as one instance (its capacity is the same either way)."""
    out: dict[str, list[int]] = {}
    per_instance: dict[str, int] = {}
    counts: dict[str, set[int]] = {}
    for held in sets.values():
        for role, v in held.items():
            if not v or len(v) < 4:
                continue
            inst = max(1, int(v[3]))
            acc = out.setdefault(role, [0, 0, 0, inst])
            acc[0] += int(v[0])
            acc[1] += int(v[1])
            acc[2] += int(v[2])
            per_instance[role] = per_instance.get(role, 0) + int(v[2]) // inst
            counts.setdefault(role, set()).add(inst)
    for role, acc in out.items():
        if len(counts[role]) > 1:
            acc[2], acc[3] = per_instance[role], 1
    return out


def figures(held: Mapping[str, Any]) -> dict[str, Any]:
    """Capacities and their ratio from the evidence's [inferences, executions, compute_ns, instances] per role."""
    out: dict[str, Any] = {"min_inferences": MIN_INFERENCES}
    caps: dict[str, float | None] = {}
    for role in ("candidate", "baseline"):
        v = held.get(role)
        if not v or len(v) < 4:
            caps[role] = None
            continue
        w = ComputeReading(int(v[0]), int(v[1]), int(v[2]))
        caps[role] = capacity(w, int(v[3]))
        out[f"{role}_inferences"] = w.inferences
        out[f"{role}_instances"] = int(v[3])
        out[f"{role}_compute_ms_per_inference"] = w.compute_ns / w.inferences / 1e6 if w.inferences else None
        out[f"{role}_capacity_rps"] = caps[role]
    c, b = caps.get("candidate"), caps.get("baseline")
    out["ratio"] = c / b if c and b else None
    return out


def judged_windows(sets: Mapping[str, Mapping[str, Any]], newest: Mapping[str, Any], placement: int,
                   placements: int) -> dict[str, Mapping[str, Any]]:  # fmt: skip
    """The windows the judge reads a capacity from, by set of instances: each set's own where `placements` > 1
    are asked for, else the newest window alone (under the set serving now)."""
    if placements > 1 and sets:
        return dict(sets)
    return {str(placement): newest} if newest else {}


def figures_over_sets(windows: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """`figures` of the windows together (pooled where there are several, with each set's own ratio under
    "sets"): the capacity the judge weighs, as the status and the decision record show it."""
    if len(windows) <= 1:
        return figures(next(iter(windows.values()), {}))
    fig = figures(pooled(windows))
    fig["sets"] = {q: figures(w)["ratio"] for q, w in sorted(windows.items())}
    return fig
