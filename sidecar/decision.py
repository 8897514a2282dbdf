"""A canary's decision record: one typed definition, written by the manager and read back (a restart, a rollback).

Each record is one fsynced line of decisions.jsonl (`to_dict`), with `schema` naming its layout; `from_dict`
reads what `to_dict` wrote and refuses what it cannot read. Rollbacks write records of their own layout
(sidecar/rollback.py) into the same file; readers of the whole file tell them apart by `outcome`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from sidecar.judge import FINAL, Outcome
from sidecar.state import StateError

SCHEMA = 1


@dataclasses.dataclass
class Decision:
    canary_id: str
    model: str
    candidate: int
    baseline: int
    outcome: Outcome  # promote, pin or inconclusive (a failed promotion is recorded as a pin)
    reasons: list[str]
    decided_by: str  # "judge" or "operator"
    at: float  # unix seconds of the decision
    # What the record carries beside its identity and outcome. A record that lacks one (an operator's pin written
    # by hand, a record from before the field existed) reads with it empty: the decision itself stands.
    # the judge's and mirror budget's figures
    evidence: dict[str, Any] = dataclasses.field(default_factory=dict)
    exemplars: list[Any] = dataclasses.field(default_factory=list)  # a few out-of-tolerance requests
    started: float | None = None  # unix seconds the canary started
    params: dict[str, Any] = dataclasses.field(default_factory=dict)  # the canary's CanaryParams
    tolerance: dict[str, Any] = dataclasses.field(default_factory=dict)
    # sidecar.canary_record.gate_vs_canary
    gate_vs_canary: dict[str, Any] = dataclasses.field(default_factory=dict)
    tolerance_source: str | None = None
    live_after: int | None = None  # the version Triton serves once the decision is carried out
    schema: int = SCHEMA

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["outcome"] = str(self.outcome)
        return out

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Decision:
        schema = raw.get("schema", SCHEMA)  # records written before the field existed have this layout
        if schema != SCHEMA:
            raise StateError(f"decision record of canary {raw.get('canary_id')!r} has schema {schema!r}; "
                             f"this sidecar reads schema {SCHEMA}")  # fmt: skip
        names = {f.name for f in dataclasses.fields(cls)}
        try:
            outcome = Outcome(raw["outcome"])
            if outcome not in FINAL:
                raise ValueError(outcome)
            fields = {k: raw[k] for k in names if k in raw}
            fields.update(outcome=outcome, schema=SCHEMA, reasons=list(raw["reasons"]))
            return cls(**fields)
        except (KeyError, TypeError, ValueError) as exc:
            raise StateError(f"not a canary decision record ({exc!r}): {dict(raw)!r:.300}") from exc
