"""A canary's record: the candidate, its parameters and tolerance, its evidence so far and its state, as
state.json keeps it (`to_dict`/`from_dict`), and the gate's figures beside the canary's."""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

from sidecar.budget import MirrorBudget
from sidecar.config import CanaryParams
from sidecar.control import shadow_name
from sidecar.memory import MemoryProbe
from sidecar.mirror import MirrorSlots
from sidecar.semantics import ModelSemantics
from sidecar.state import EvidenceCounter
from sidecar.throughput import ComputeReading, figures_over_sets, judged_windows
from tunegate.errors import TunegateError
from tunegate.tolerance import ToleranceSpec

GATE_FIGURES = ("n", "k", "oot_rate", "upper", "budget", "confidence", "passed", "source")


def gate_vs_canary(
    gate: dict[str, Any] | None, stats: dict[str, Any], params: CanaryParams
) -> dict[str, Any]:
    """The tuner's gate and the canary in the same terms (per-request out-of-tolerance rate, its one-sided
    anytime bound, the budget, the confidence), side by side in the decision record."""
    compared, oot = stats.get("compared"), stats.get("out_of_tolerance")
    return {
        "gate": gate,
        "canary": {"n": compared, "k": oot, "oot_rate": stats.get("oot_rate"), "upper": stats.get("oot_rate_upper"),
                   "upper_over_aa": stats.get("oot_difference_upper"), "budget": params.oot_budget,
                   "confidence": params.confidence},
    }  # fmt: skip


class CanaryError(TunegateError):
    """A canary request that cannot be served; `status` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclasses.dataclass
class Canary:
    id: str
    model: str
    candidate: int
    baseline: int
    started: float
    deadline: float
    params: CanaryParams
    tolerance: ToleranceSpec
    tolerance_source: str
    evidence: EvidenceCounter = dataclasses.field(default_factory=EvidenceCounter)
    judgement: dict[str, Any] | None = None
    pending: dict[str, Any] | None = None
    slots: MirrorSlots = dataclasses.field(default_factory=lambda: MirrorSlots(1))
    # {"since", "reason", "blame"} while Triton is unavailable or the shadow is lost: nothing is mirrored,
    # counted or judged. Not persisted: a restarted sidecar checks Triton again (CanaryManager.resume).
    paused: dict[str, Any] | None = None
    # True from the tick that decides to load fresh instances (sidecar.judge, placements) until they serve:
    # nothing is sampled meanwhile. Not persisted: a restarted sidecar decides again.
    replacing: bool = False
    # What the model's config says about mirroring (sidecar.semantics), read once at the start.
    semantics: ModelSemantics | None = None
    memory: dict[str, Any] = dataclasses.field(default_factory=dict)  # the last memory sample's details
    memory_probe: MemoryProbe | None = None
    # Triton's compute counters per role at the first reading after the warm-up, and each role's instance
    # count (sidecar.throughput). Not persisted: a restarted sidecar starts a new window.
    throughput_first: dict[str, ComputeReading] = dataclasses.field(default_factory=dict)
    instances: dict[str, int] = dataclasses.field(default_factory=dict)
    # The tuner's gate as the candidate's release.json records it (its rate in the canary's terms), for the
    # decision record's side-by-side figures; None when the version has no release record.
    gate: dict[str, Any] | None = None
    # The mirror budget (sidecar.budget): the effective sample rate and the client latency windows. Not
    # persisted: a restarted sidecar measures afresh, starting with a pause.
    budget: MirrorBudget = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        p = self.params
        self.budget = MirrorBudget(p.sample_rate, p.max_client_slowdown, p.budget_period_s, p.budget_pause_s,
                                   time.monotonic(), p.budget_quantile, p.budget_min_samples_per_s)  # fmt: skip
        # Shadow pairing sends one pair at a time: with several in flight, the slower side's copies queue
        # behind each other at its instance while the faster side's do not, and a 3% slower candidate
        # looked twice as slow (closed-loop queueing). One pair at a time meets two empty queues.
        self.slots = MirrorSlots(1 if self.params.latency_pairing == "shadow" else self.params.max_in_flight)

    def shadow_baseline(self) -> int | None:
        """The baseline version the shadow model serves too (shadow latency pairing), else None."""
        return self.baseline if self.params.latency_pairing == "shadow" else None

    def shadow_versions(self) -> tuple[int, ...]:
        b = self.shadow_baseline()
        return (self.candidate,) if b is None else (self.candidate, b)

    def targets(self) -> dict[str, tuple[str, int]]:
        """role -> (model, version) Triton serves it as: the candidate in the shadow model; the baseline there too
        with shadow pairing (it gets the same copies), else the live model's version."""
        base_model = shadow_name(self.model) if self.shadow_baseline() is not None else self.model
        return {
            "candidate": (shadow_name(self.model), self.candidate),
            "baseline": (base_model, self.baseline),
        }

    @functools.cached_property
    def mirror_paths(self) -> dict[str, bytes]:
        """Where each mirror role's copies go, built once per canary rather than per request."""
        base_model = shadow_name(self.model) if self.shadow_baseline() is not None else self.model
        return {"candidate": f"/v2/models/{shadow_name(self.model)}/versions/{self.candidate}/infer".encode(),
                # with shadow pairing, the shadow's own baseline instance: no client traffic queues there
                "aa": f"/v2/models/{base_model}/versions/{self.baseline}/infer".encode()}  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "candidate": self.candidate,
            "baseline": self.baseline,
            "started": self.started,
            "deadline": self.deadline,
            "params": self.params.to_dict(),
            "tolerance": self.tolerance.to_dict(),
            "tolerance_source": self.tolerance_source,
            "evidence": self.evidence.to_dict(),
            "judgement": self.judgement,
            "pending": self.pending,
            "semantics": None if self.semantics is None else self.semantics.to_dict(),
            "gate": self.gate,
        }

    @classmethod
    def from_dict(cls, model: str, raw: dict[str, Any]) -> Canary:
        return cls(
            id=raw["id"], model=model, candidate=int(raw["candidate"]), baseline=int(raw["baseline"]),
            started=float(raw["started"]), deadline=float(raw["deadline"]),
            params=CanaryParams.from_dict(raw["params"]), tolerance=ToleranceSpec.from_dict(raw["tolerance"]),
            tolerance_source=raw.get("tolerance_source", "request"),
            evidence=EvidenceCounter.from_dict(raw.get("evidence", {})),
            judgement=raw.get("judgement"), pending=raw.get("pending"),
            semantics=ModelSemantics.from_dict(raw.get("semantics")), gate=raw.get("gate"),
        )  # fmt: skip

    def status(self) -> dict[str, Any]:
        d = self.to_dict()
        ev = dict(d["evidence"])
        ev["latency_pairs"] = len(ev.pop("primary_s"))
        ev.pop("candidate_s")
        ev.pop("pair_placement")
        ev["placement_pairs_held"] = [len(r) for r in ev.pop("placement_ratios")]  # per set of instances
        d["evidence"] = ev
        d["in_flight"] = len(self.slots)
        d["paused"] = self.paused
        d["loading_instances"] = self.replacing  # fresh instances of the shadow on the way: nothing sampled
        d["memory"] = self.memory
        # The capacity as the judge weighs it: with several sets of instances, pooled, and each set's ratio.
        c = self.evidence
        windows = judged_windows(c.throughput_sets, c.throughput, c.placement, self.params.placements)
        d["throughput"] = figures_over_sets(windows)
        d["mirror_budget"] = self.budget.status()
        return d
