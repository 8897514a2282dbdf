"""What a search returns: one RouteResult per route and stage, and the TuneResult of the whole search."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tunegate.errors import ServiceError


class TuneError(ServiceError):
    """The search cannot run (backend missing, no baseline, bad repository); nothing was written."""


@dataclasses.dataclass(frozen=True)
class RouteResult:
    route: str
    knobs: dict[str, str]
    stage: str
    status: str  # passed | rejected | failed | skipped
    error: str | None = None
    build_seconds: float | None = None
    objective_ms: float | None = None
    baseline_objective_ms: float | None = None  # the paired baseline runs'
    speedup: float | None = None
    speedup_lower: float | None = None  # paired bootstrap bound at [objective].confidence
    latency: dict[str, Any] | None = None
    accuracy: dict[str, Any] | None = None
    artifact: str | None = None
    reused: bool = False

    def record(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("reused")
        return {"kind": "route", **d}

    @classmethod
    def from_record(cls, rec: Mapping[str, Any]) -> RouteResult:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in rec.items() if k in names}, reused=True)


@dataclasses.dataclass(frozen=True)
class TuneResult:
    model: str
    strategy: str
    winner: RouteResult | None
    version: int | None
    version_path: Path | None
    report_path: Path
    cache_path: Path
    routes: list[RouteResult]
    baseline: dict[str, Any]
    e2e: dict[str, Any]
    reason: str
    stopped_by_budget: bool
    release: dict[str, Any] | None

    def summary(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "strategy": self.strategy,
            "winner": self.winner.route if self.winner else None,
            "version": self.version,
            "version_path": str(self.version_path) if self.version_path else None,
            "speedup": self.winner.speedup if self.winner else None,
            "speedup_lower": self.winner.speedup_lower if self.winner else None,
            "reason": self.reason,
            "stopped_by_budget": self.stopped_by_budget,
            "report": str(self.report_path),
            "cache": str(self.cache_path),
            "baseline": self.baseline,
            "e2e": self.e2e,
            "routes": [dataclasses.asdict(r) for r in self.routes],
            "counts": {
                s: sum(r.status == s for r in self.routes)
                for s in ("passed", "rejected", "failed", "skipped")
            },
        }


def route_id(route: str) -> str:
    return hashlib.sha256(route.encode()).hexdigest()[:12]
