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

from sidecar.judge import BLOCK, MAX_SET_PAIRS, Evidence
from tunegate.errors import ServiceError
from tunegate.records import JsonlLog, atomic_write_bytes, atomic_write_json

# orjson: json.dumps with an indent runs the pure-Python encoder, ~9 ms per save with 4000 latency pairs,
# every judge tick, in a thread that holds the GIL the event loop needs; orjson takes ~0.4 ms.
_STATE_JSON = orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS | orjson.OPT_APPEND_NEWLINE

STATE_VERSION = 1
MAX_LATENCY_PAIRS = 4000  # the judge looks at the most recent pairs; older ones add little
MAX_EXEMPLARS = 10
MAX_BLOCKS = 20_000  # a million comparisons of history for the design effect
MAX_CLASSES = 64  # request classes with their own counts; the rest share "other"


class StateError(ServiceError):
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
    aa_sent: int = 0
    aa_errors: int = 0
    paired_sent: int = 0
    cand_only_errors: int = 0
    aa_only_errors: int = 0
    paired_compared: int = 0
    cand_only_oot: int = 0
    aa_only_oot: int = 0
    primary_s: list[float] = dataclasses.field(default_factory=list)
    candidate_s: list[float] = dataclasses.field(default_factory=list)
    pair_class: list[str] = dataclasses.field(default_factory=list)
    pair_placement: list[int] = dataclasses.field(default_factory=list)  # the set of instances of each pair
    # per set of instances (by index), the latency ratios of its most recent pairs (sidecar.judge.MAX_SET_PAIRS)
    placement_ratios: list[list[float]] = dataclasses.field(default_factory=list)
    pairs_total: int = 0
    # The set of instances the shadow serves now (0, 1, ...: sidecar.judge, placements), since when (wall
    # clock) and how many comparisons there were then: its warm-up counts from there.
    placement: int = 0
    placement_since: float | None = None
    placement_compared: int = 0
    blocks: list[int] = dataclasses.field(
        default_factory=list
    )  # out-of-tolerance count per BLOCK comparisons
    block_compared: int = 0  # comparisons in the block being filled
    block_oot: int = 0
    classes: dict[str, list[int]] = dataclasses.field(default_factory=dict)  # class -> [compared, oot]
    expected_classes: dict[str, float] = dataclasses.field(default_factory=dict)
    started: float | None = None
    exemplars: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    memory: dict[str, float] = dataclasses.field(
        default_factory=dict
    )  # role -> peak bytes seen (sidecar.memory)
    throughput: dict[str, list[int]] = dataclasses.field(
        default_factory=dict
    )  # sidecar.throughput, since warm-up
    # set of instances (str(placement)) -> its own window, as `throughput` (sidecar.judge's capacity pin)
    throughput_sets: dict[str, dict[str, list[int]]] = dataclasses.field(default_factory=dict)
    skipped: dict[str, int] = dataclasses.field(
        default_factory=dict
    )  # reason -> sampled requests not mirrored
    # client protocol ("http", "grpc") -> candidate comparisons of requests that came in over it
    protocols: dict[str, int] = dataclasses.field(default_factory=dict)

    def add_pair(self, primary_s: float, candidate_s: float, request_class: str = "") -> None:
        """Keep the most recent MAX_LATENCY_PAIRS pairs (the lists run up to twice that between trims: a trim per
        pair moved the whole list every time)."""
        self.primary_s.append(primary_s)
        self.candidate_s.append(candidate_s)
        self.pair_class.append(request_class)
        self.pair_placement.append(self.placement)
        while len(self.placement_ratios) <= self.placement:
            self.placement_ratios.append([])
        ratios = self.placement_ratios[self.placement]
        ratios.append(candidate_s / primary_s if primary_s > 0 else 1.0)
        if len(ratios) >= 2 * MAX_SET_PAIRS:
            del ratios[:-MAX_SET_PAIRS]
        self.pairs_total += 1
        if len(self.primary_s) >= 2 * MAX_LATENCY_PAIRS:
            self._trim()

    def add_comparison(self, passed: bool, request_class: str = "") -> None:
        """One candidate response compared with the primary's: totals, the current block and its class."""
        self.compared += 1
        self.block_compared += 1
        if not passed:
            self.out_of_tolerance += 1
            self.block_oot += 1
        if self.block_compared >= BLOCK:
            self.blocks.append(self.block_oot)
            self.block_compared = self.block_oot = 0
            if len(self.blocks) > MAX_BLOCKS:
                del self.blocks[: len(self.blocks) - MAX_BLOCKS]
        if request_class:
            counts = self.classes.get(request_class)
            if counts is None:
                if len(self.classes) >= MAX_CLASSES:
                    request_class = "other"
                counts = self.classes.setdefault(request_class, [0, 0])
            counts[0] += 1
            counts[1] += 0 if passed else 1

    def _trim(self) -> None:
        excess = len(self.primary_s) - MAX_LATENCY_PAIRS
        if excess > 0:  # (a negative slice start would keep only the last -excess pairs)
            del self.primary_s[:excess]
            del self.candidate_s[:excess]
            del self.pair_class[: max(0, len(self.pair_class) - MAX_LATENCY_PAIRS)]
            del self.pair_placement[: max(0, len(self.pair_placement) - MAX_LATENCY_PAIRS)]

    def new_placement(self, now: float) -> None:
        """Fresh instances serve from now on: the pairs that follow are theirs, after their own warm-up."""
        self.placement += 1
        self.placement_since, self.placement_compared = now, self.compared

    def placement_pairs(self) -> int:
        """Pairs of the current set of instances (up to MAX_SET_PAIRS: `placement_pairs` is at most that)."""
        return (
            len(self.placement_ratios[self.placement]) if self.placement < len(self.placement_ratios) else 0
        )

    def warm(self, started: float, warmup_samples: int, warmup_s: float, now: float) -> bool:
        """Past the warm-up of the current instances, by count and by time: latency pairs count from here."""
        since = max(started, self.placement_since or started)
        return self.compared - self.placement_compared > warmup_samples and now - since >= warmup_s

    def add_exemplar(self, exemplar: dict[str, Any]) -> None:
        if len(self.exemplars) < MAX_EXEMPLARS:
            self.exemplars.append(exemplar)

    def snapshot(self) -> Evidence:
        self._trim()
        values: dict[str, Any] = {}
        for f in dataclasses.fields(Evidence):
            v = getattr(self, f.name)
            values[f.name] = tuple(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v
        values["classes"] = {k: tuple(v) for k, v in self.classes.items()}
        values["placement_ratios"] = {
            q: tuple(r[-MAX_SET_PAIRS:]) for q, r in enumerate(self.placement_ratios) if r
        }
        return Evidence(**values)

    def to_dict(self) -> dict[str, Any]:
        """Fresh lists (C-speed copies): called on the event loop every judge tick, serialised in a thread."""
        self._trim()
        d: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            d[f.name] = list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v
        d["classes"] = {k: list(v) for k, v in self.classes.items()}
        d["placement_ratios"] = [list(r[-MAX_SET_PAIRS:]) for r in self.placement_ratios]
        return d

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> EvidenceCounter:
        known = {f.name for f in dataclasses.fields(cls)}
        ev = cls(**{k: v for k, v in raw.items() if k in known})
        if len(ev.pair_class) != len(ev.primary_s):  # a state file written before classes were kept
            ev.pair_class = [""] * len(ev.primary_s)
        if len(ev.pair_placement) != len(ev.primary_s):  # or placements
            ev.pair_placement = [0] * len(ev.primary_s)
        return ev


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
        if (
            not isinstance(data, dict)
            or data.get("version") != STATE_VERSION
            or not isinstance(data.get("models"), dict)
        ):
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
        models = {
            m: {k: dict(v) if isinstance(v, dict) else v for k, v in ms.items()}
            for m, ms in self.models().items()
        }
        return {**self.data, "models": models}

    def decision_for(self, canary_id: str) -> dict[str, Any] | None:
        for rec in self.decisions.read():
            if rec.get("canary_id") == canary_id:
                return rec
        return None
