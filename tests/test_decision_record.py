"""The canary decision record: one typed definition, written and read back the same; a layout it does not know
is refused with a clear error."""

from __future__ import annotations

import json

import pytest

from sidecar.decision import SCHEMA, Decision
from sidecar.judge import PIN, PROMOTE
from sidecar.state import StateError


def record(**over: object) -> Decision:
    fields: dict[str, object] = {
        "canary_id": "c1",
        "model": "m",
        "candidate": 2,
        "baseline": 1,
        "outcome": PROMOTE,
        "reasons": ["300 samples: ..."],
        "evidence": {"compared": 300, "out_of_tolerance": 0},
        "decided_by": "judge",
        "exemplars": [],
        "started": 1.0,
        "at": 2.0,
        "params": {"min_samples": 300},
        "tolerance": {"y": {"metric": "linf", "threshold": 1e-3}},
        "gate_vs_canary": {"gate": None, "canary": {"n": 300, "k": 0}},
        "tolerance_source": "release.json",
    }
    fields.update(over)
    return Decision(**fields)  # type: ignore[arg-type]


def test_a_record_reads_back_as_written_through_json() -> None:
    rec = record(live_after=2)
    line = json.dumps(rec.to_dict())
    raw = json.loads(line)
    assert raw["schema"] == SCHEMA and raw["outcome"] == "promote"
    back = Decision.from_dict(raw)
    assert back == rec and back.outcome is PROMOTE


def test_a_record_without_schema_reads_as_the_first_layout() -> None:
    raw = record(outcome=PIN).to_dict()
    del raw["schema"]
    assert Decision.from_dict(raw).outcome is PIN


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"schema": 99}, "has schema 99; this sidecar reads schema 1"),
        ({"outcome": "continue"}, "not a canary decision record"),
        ({"outcome": "rollback"}, "not a canary decision record"),
        ({"reasons": None}, "not a canary decision record"),
    ],
)
def test_what_it_cannot_read_is_refused(change: dict[str, object], match: str) -> None:
    raw = {**record().to_dict(), **change}
    with pytest.raises(StateError, match=match):
        Decision.from_dict(raw)
    raw = record().to_dict()
    del raw["model"]
    with pytest.raises(StateError, match="not a canary decision record"):
        Decision.from_dict(raw)


def test_a_record_with_only_its_identity_and_outcome_reads_with_the_rest_empty() -> None:
    # An operator's pin written by hand, or a pending record from before a field existed, carries no evidence.
    raw = {"canary_id": "c1", "model": "m", "candidate": 2, "baseline": 1, "outcome": "pin",
           "reasons": ["manual pin by an operator"], "decided_by": "operator", "at": 1.0}  # fmt: skip
    rec = Decision.from_dict(raw)
    assert rec.outcome is PIN and rec.started is None
    empty = (rec.evidence, rec.exemplars, rec.params, rec.tolerance, rec.gate_vs_canary)
    assert empty == ({}, [], {}, {}, {})
    assert Decision.from_dict(rec.to_dict()) == rec
    del raw["at"]
    with pytest.raises(StateError, match="not a canary decision record"):
        Decision.from_dict(raw)
