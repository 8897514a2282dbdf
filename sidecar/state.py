"""The sidecar's durable state: live version and canary per model, evidence counters, pending decisions.

`state.json` in the state directory is rewritten whole with an atomic write (temp, fsync, rename),
so a killed sidecar leaves either the old state or the new one. Decision records go to
`decisions.jsonl` (append-only, fsynced); a decision is keyed by its canary's id, so a restart
that finds the record already written completes the action without writing it twice.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path
from typing import Any

import orjson

from sidecar.judge import Evidence
from tunegate.records import JsonlLog, atomic_write_bytes, atomic_write_json

# orjson: json.dumps with an indent runs the pure-Python encoder, ~9 ms per save with 4000 latency pairs,
# every judge tick, in a thread that holds the GIL the event loop needs; orjson takes ~0.4 ms.
_STATE_JSON = orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS | orjson.OPT_APPEND_NEWLINE

STATE_VERSION = 1
MAX_LATENCY_PAIRS = 4000  # the judge looks at the most recent pairs; older ones add little
MAX_EXEMPLARS = 10


class StateError(RuntimeError):
    """The state file exists but cannot be used (the message says how to recover)."""


@dataclasses.dataclass
class EvidenceCounter:
    """Mutable evidence of one canary, updated on the event loop and snapshotted for the judge."""

    compared: int = 0
    out_of_tolerance: int = 0
    aa_compared: int = 0
    aa_out_of_tolerance: int = 0
    sent: int = 0
    errors: int = 0
    timeouts: int = 0
    primary_s: list[float] = dataclasses.field(default_factory=list)
    candidate_s: list[float] = dataclasses.field(default_factory=list)
    exemplars: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def add_pair(self, primary_s: float, candidate_s: float) -> None:
        """Keep the most recent MAX_LATENCY_PAIRS pairs (the lists run up to twice that between trims: a trim per
        pair moved the whole list every time)."""
        self.primary_s.append(primary_s)
        self.candidate_s.append(candidate_s)
        if len(self.primary_s) >= 2 * MAX_LATENCY_PAIRS:
            self._trim()

    def _trim(self) -> None:
        del self.primary_s[: len(self.primary_s) - MAX_LATENCY_PAIRS]
        del self.candidate_s[: len(self.candidate_s) - MAX_LATENCY_PAIRS]

    def add_exemplar(self, exemplar: dict[str, Any]) -> None:
        if len(self.exemplars) < MAX_EXEMPLARS:
            self.exemplars.append(exemplar)

    def snapshot(self) -> Evidence:
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(Evidence)}
        self._trim()
        values["primary_s"], values["candidate_s"] = tuple(self.primary_s), tuple(self.candidate_s)
        return Evidence(**values)

    def to_dict(self) -> dict[str, Any]:
        """Fresh lists (C-speed copies): called on the event loop every judge tick, serialised in a thread."""
        self._trim()
        d: dict[str, Any] = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["primary_s"], d["candidate_s"] = list(self.primary_s), list(self.candidate_s)
        d["exemplars"] = list(self.exemplars)
        return d

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> EvidenceCounter:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in known})


class StateStore:
    """`state.json` (whole-file atomic rewrites) and `decisions.jsonl` (fsynced appends)."""

    def __init__(self, state_dir: Path) -> None:
        self.dir = Path(state_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "state.json"
        self.decisions = JsonlLog(self.dir / "decisions.jsonl")
        self._lock = threading.Lock()  # saves run in worker threads; keep them ordered
        self.data: dict[str, Any] = self._load()

    def _load(self) -> dict[str, Any]:
        if not self.path.exists():
            return {"version": STATE_VERSION, "models": {}}
        try:
            data: dict[str, Any] = json.loads(self.path.read_bytes())  # UTF-8, as orjson writes it
        except (OSError, json.JSONDecodeError) as exc:
            raise StateError(
                f"{self.path} cannot be read ({exc}); it is written atomically, so this is not a torn write: "
                "inspect it, or move it away to start with no live versions and no canary"
            ) from exc
        if not isinstance(data, dict) or data.get("version") != STATE_VERSION or not isinstance(data.get("models"), dict):
            raise StateError(f"{self.path} is not a tunegate sidecar state file (version {STATE_VERSION})")
        return data

    def model(self, name: str) -> dict[str, Any]:
        models: dict[str, dict[str, Any]] = self.data["models"]
        return models.setdefault(name, {"live": None, "canary": None, "last": None})

    def models(self) -> dict[str, dict[str, Any]]:
        models: dict[str, dict[str, Any]] = self.data["models"]
        return models

    def save(self, snapshot: dict[str, Any]) -> None:
        """Write a snapshot taken on the event loop (call from a worker thread)."""
        with self._lock:
            try:
                data = orjson.dumps(snapshot, option=_STATE_JSON, default=str)
            except TypeError:  # what json writes and orjson cannot: integers beyond 64 bits, lone surrogates
                atomic_write_json(self.path, snapshot)
                return
            atomic_write_bytes(self.path, data)

    def snapshot(self) -> dict[str, Any]:
        """A copy the saving thread can serialise while the loop goes on (taken on the loop, cheaply).

        Two levels are copied; deeper values (a canary's dict, its evidence lists) are replaced whole by
        the loop, never mutated in place, once put here. A JSON round trip here cost ~10 ms per judge tick on
        the event loop with 4000 latency pairs: the client path's p99 showed it.
        """
        models = {m: {k: dict(v) if isinstance(v, dict) else v for k, v in ms.items()} for m, ms in self.models().items()}
        return {**self.data, "models": models}

    def decision_for(self, canary_id: str) -> dict[str, Any] | None:
        for rec in self.decisions.read():
            if rec.get("canary_id") == canary_id:
                return rec
        return None
