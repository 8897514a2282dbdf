"""Serving-configuration routes: Triton's own knobs, measured on the real Triton and gated like an engine.

A serving route sets instance count, max_batch_size and the dynamic batcher's queue delay in the same route
syntax as engine knobs (`-instances=[1|2] -max_batch=[same|16] -queue_us=[off|500]`; `same` keeps the
model's own value). Each route serves one version's files (the baseline's, or a tuned version's) from a
temporary repository on the embedded Triton:

1. the gate: every gate request (the captured mix) sent with the highest concurrency of the sweep, so the
   batcher does batch them, and the answers judged against the reference by the engine routes' gate;
2. the load: the captured requests replayed as they are (tunegate.perf.replay: closed loop, each request with
   its own batch and shape) at each concurrency level; the route's figure is its throughput at the objective
   (the best level whose p95 is within `latency_ms`).

Every configuration stays loaded from its gate to the end (idle ones take memory, not CPU), and rounds
alternate: each measures every route, the model's own configuration first, and a route's ratio is
taken against that round's own configuration, so drift in machine load hits both alike. A route wins when it
passes the gate, every round's ratio is above 1 and their median reaches `min_gain`.

The winner is released as a new version with the measured version's files and `"serving"` in release.json:
the canary's shadow model serves it with that configuration and promotion writes it into the model's config
(sidecar.control). This measures throughput under closed-loop concurrency on this host, not a fleet.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import math
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from tunegate import pbtxt, perf
from tunegate.records import atomic_write_text
from tunegate.repository import set_version_policy, versions, write_version
from tunegate.serving import Serving, ServingError, describe
from tunegate.triton import EmbeddedTriton, TritonOptions
from tuner import gate
from tuner.form import Form
from tuner.inputs import InputSet, make_inputs
from tuner.release import gate_record
from tuner.result import TuneError
from tuner.routes import Knob, fast_routes, full_routes, parse_route, parse_space, route_string
from tuner.search import exclusive, find_baseline, reference_outputs
from tuner.spec import TuneSpec

SAME = "same"
KNOBS = (
    Knob("instances", (SAME, "1", "2", "3", "4", "6", "8"), SAME, "instance_group count"),
    Knob(
        "max_batch",
        (SAME, "0", "2", "4", "8", "16", "32", "64"),
        SAME,
        "max_batch_size (0: the model takes whole shapes; > 0: Triton batches requests)",
    ),
    Knob(
        "queue_us",
        (SAME, "off", "0", "100", "500", "1000", "2000", "5000"),
        SAME,
        "dynamic batcher's max_queue_delay_microseconds (off: no dynamic batcher)",
    ),
)


def serving_of(route: Mapping[str, str]) -> Serving:
    """The Serving a route sets (`same` leaves the model's value)."""

    def num(key: str) -> int | None:
        v = route.get(key, SAME)
        return None if v == SAME else int(v)

    q = route.get("queue_us", SAME)
    return Serving(
        instances=num("instances"),
        max_batch_size=num("max_batch"),
        queue_delay_us=None if q == SAME else (-1 if q == "off" else int(q)),
    )


@dataclasses.dataclass
class ServingRoute:
    route: str
    serving: dict[str, Any]
    status: str = "pending"  # passed | rejected | skipped | failed
    error: str | None = None
    gate: dict[str, Any] | None = None
    levels: list[list[dict[str, float]]] = dataclasses.field(default_factory=list)  # per round
    throughput: list[float] = dataclasses.field(default_factory=list)  # at the objective, per round
    ratios: list[float] = dataclasses.field(default_factory=list)  # against the model's own, per round

    @property
    def median_ratio(self) -> float | None:
        return statistics.median(self.ratios) if self.ratios else None

    def to_dict(self) -> dict[str, Any]:
        d = {**dataclasses.asdict(self), "median_ratio": self.median_ratio}
        d["ratios"] = [
            None if math.isinf(x) else x for x in self.ratios
        ]  # JSON: None where the own met no level
        if d["median_ratio"] is not None and math.isinf(d["median_ratio"]):
            d["median_ratio"] = None
        return d


@dataclasses.dataclass(frozen=True)
class ServingResult:
    version: int  # the version whose files were served
    routes: list[ServingRoute]
    winner: ServingRoute | None
    reason: str
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "winner": self.winner.route if self.winner else None,
                "reason": self.reason, "seconds": round(self.seconds, 1),
                "routes": [r.to_dict() for r in self.routes]}  # fmt: skip


def plan(spec: TuneSpec) -> list[str]:
    """The serving routes a search measures, the model's own configuration first."""
    space = parse_space(KNOBS, spec.serving.routes)
    routes = fast_routes(KNOBS, space) if spec.serving.strategy == "fast" else full_routes(KNOBS, space)
    own = tuple((k.name, SAME) for k in KNOBS)
    strings = [route_string(r) for r in routes if r != own]
    return [route_string(own), *strings]


def _files(version_dir: Path) -> dict[str, Path | bytes | str]:
    return {p.name: p for p in sorted(version_dir.iterdir())
            if p.is_file() and p.name != "release.json" and not p.name.startswith(".")}  # fmt: skip


def _served_outputs(address: str, model: str, inputs: InputSet, outputs: Sequence[str],
                    concurrency: int) -> list[dict[str, npt.NDArray[Any]]]:  # fmt: skip
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    local = threading.local()
    clients: list[Any] = []

    def one(feeds: Mapping[str, npt.NDArray[Any]]) -> dict[str, npt.NDArray[Any]]:
        if not hasattr(local, "client"):
            local.client = grpcclient.InferenceServerClient(address)
            clients.append(local.client)
        ins = []
        for name, arr in feeds.items():
            inp = grpcclient.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
            inp.set_data_from_numpy(np.ascontiguousarray(arr))
            ins.append(inp)
        res = local.client.infer(model, ins, outputs=[grpcclient.InferRequestedOutput(o) for o in outputs])
        return {o: res.as_numpy(o) for o in outputs}

    try:
        with ThreadPoolExecutor(max_workers=concurrency) as pool:  # concurrent, so a dynamic batcher batches
            return list(pool.map(one, [b.feeds for b in inputs.gate]))
    finally:
        for c in clients:
            c.close()


def search_serving(
    spec: TuneSpec,
    version: int,
    version_dir: Path,
    inputs: InputSet,
    reference: gate.Outputs,
    note: Callable[[str], None] = lambda _m: None,
    base: Serving | None = None,
) -> ServingResult:
    """Measure every serving route of `spec.serving` on `version_dir`'s files; see the module docstring.

    `base`: the serving configuration the version itself carries (its release.json's), under every route.
    """
    t0 = time.monotonic()
    s = spec.serving
    model = spec.model.name
    config_text = (spec.model.repository / model / "config.pbtxt").read_text()
    if base is not None:
        config_text = base.apply(config_text)
    outputs = list(reference[0])
    rows = [ServingRoute(r, {}) for r in plan(spec)]
    largest = max((int(np.asarray(next(iter(b.feeds.values()))).shape[0]) for b in inputs.gate), default=1)
    work = Path(tempfile.mkdtemp(prefix="serving-", dir=spec.workdir))
    try:
        repo = work / "repo"
        names: dict[str, str] = {}
        for k, row in enumerate(rows):
            knobs = dict(parse_route(KNOBS, row.route))
            serving = serving_of(knobs)
            row.serving = serving.to_dict()
            try:
                text = serving.apply(config_text)
            except ServingError as exc:
                row.status, row.error = "skipped", str(exc)
                continue
            if serving.max_batch_size and serving.max_batch_size < largest:
                row.status = "skipped"
                row.error = (f"max_batch_size {serving.max_batch_size} is below the largest captured request "
                             f"(batch {largest}): Triton would refuse those requests")  # fmt: skip
                continue
            name = f"{model}__serving{k}"
            write_version(repo, name, _files(version_dir), version=1)
            atomic_write_text(
                repo / name / "config.pbtxt", set_version_policy(pbtxt.with_name(text, name), [1])
            )
            names[row.route] = name
        requests = [b.feeds for b in inputs.gate[: s.requests]]
        live = [r for r in rows if r.route in names]
        with EmbeddedTriton(TritonOptions(repository=repo), workdir=work / "triton") as server:
            for row in live:
                name = names[row.route]
                note(f"serving route {row.route} ({describe(row.serving)}): gate")
                try:
                    server.load(name)
                    served = _served_outputs(server.grpc_address, name, inputs, outputs, max(s.concurrency))
                except Exception as exc:  # noqa: BLE001 - a configuration Triton refuses fails alone
                    row.status, row.error = "failed", f"{type(exc).__name__}: {exc}"
                    _unload(server, name)
                    continue
                row.gate = gate.gate_evidence(reference, served, spec.tolerance, spec.gate, inputs)
                row.status = "passed" if row.gate["passed"] else "rejected"
            measured = [r for r in live if r.status in ("passed", "rejected")]
            for rnd in range(s.rounds):
                for row in [r for r in measured if r.status != "failed"]:
                    note(f"round {rnd + 1}/{s.rounds}: {row.route} at concurrency {list(s.concurrency)}")
                    name = names[row.route]
                    try:
                        levels = perf.replay(server.grpc_address, name, requests, s.concurrency,
                                             window_s=s.window_ms / 1000)  # fmt: skip
                    except Exception as exc:  # noqa: BLE001
                        row.status, row.error = "failed", f"{type(exc).__name__}: {exc}"
                        _unload(server, name)
                        continue
                    row.levels.append([lv.to_dict() for lv in levels])
                    row.throughput.append(perf.throughput_at(levels, s.latency_ms))
                own_row = rows[0]
                if own_row not in measured or len(own_row.throughput) != rnd + 1:
                    continue  # the model's own configuration was not measured this round: no ratio
                own = own_row.throughput[-1]
                for row in measured:
                    if len(row.throughput) == rnd + 1:
                        t = row.throughput[-1]
                        # the own configuration meets the objective at no level: any route that does is ahead
                        row.ratios.append(t / own if own > 0 else (math.inf if t > 0 else 1.0))
        winner, reason = _pick(rows, s.min_gain, s.latency_ms)
        return ServingResult(version, rows, winner, reason, time.monotonic() - t0)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _unload(server: EmbeddedTriton, name: str) -> None:
    with contextlib.suppress(Exception):  # never loaded, or already gone
        server.unload(name)


def _pick(rows: list[ServingRoute], min_gain: float, latency_ms: float) -> tuple[ServingRoute | None, str]:
    if not rows or rows[0].status not in ("passed", "rejected") or not rows[0].throughput:
        return None, "the model's own configuration could not be measured"
    objective = f"p95 <= {latency_ms:g} ms" if latency_ms > 0 else "any latency"
    ok = [r for r in rows[1:] if r.status == "passed" and r.ratios and min(r.ratios) > 1.0
          and (r.median_ratio or 0.0) >= min_gain]  # fmt: skip
    if not ok:
        best = max((r for r in rows[1:] if r.ratios), key=lambda r: r.median_ratio or 0.0, default=None)
        if best is None:
            return None, "no serving route other than the model's own could be measured"
        return None, (f"no serving route beats the model's own configuration by {min_gain:g}x at {objective} in "
                      f"every round: best {best.route} at {best.median_ratio or 0:.2f}x (rounds "
                      f"{', '.join(f'{x:.2f}' for x in best.ratios)}, gate {best.status})")  # fmt: skip
    win = max(ok, key=lambda r: r.median_ratio or 0.0)
    return win, (f"{win.route} ({describe(win.serving)}) serves {win.median_ratio or 0:.2f}x the model's own "
                 f"configuration's throughput at {objective} (rounds {', '.join(f'{x:.2f}' for x in win.ratios)}); "
                 f"gate {win.gate['rate']['k'] if win.gate else '?'}/{win.gate['rate']['n'] if win.gate else '?'} "
                 "out of tolerance")  # fmt: skip


def tune_serving(
    spec: TuneSpec,
    version: int | None = None,
    *,
    write: bool = True,
    note: Callable[[str], None] = lambda _m: None,
) -> tuple[ServingResult, int | None, Path | None]:
    """Search `spec.serving`'s routes on `version` (default: the live one) and write the winner as a new version.

    Returns the result, and the version written with its path (None when nothing won or `write` is off).
    """
    model_dir = spec.model.repository / spec.model.name
    if not (model_dir / "config.pbtxt").is_file():
        raise TuneError(f"{model_dir / 'config.pbtxt'} does not exist")
    if not spec.serving.routes:
        raise TuneError(f"{spec.path}: [serving].routes is empty: no serving route to search")
    if Form.read(model_dir / "config.pbtxt").native:
        raise TuneError(
            f"{spec.model.name} is served by Triton's {Form.read(model_dir / 'config.pbtxt').form} backend, which the "
            "embedded Triton does not have: its serving routes cannot be measured here"
        )
    if version is None:
        version, version_dir = find_baseline(spec)
    else:
        version_dir = model_dir / str(version)
        if not version_dir.is_dir():
            raise TuneError(f"{model_dir} has no version {version}")
    source_release = _release(version_dir)
    base = Serving.from_dict(source_release["serving"]) if source_release.get("serving") else None
    spec.workdir.mkdir(parents=True, exist_ok=True)
    with exclusive(spec.workdir):
        for stale in spec.workdir.glob("serving-*"):  # what a killed search left
            shutil.rmtree(stale, ignore_errors=True)
        note(f"preparing the captured requests and the reference ({spec.gate.samples} gate samples)")
        inputs = make_inputs(
            spec.inputs, spec.model.source, spec.model.name, spec.gate.samples, spec.gate.needed
        )
        reference = reference_outputs(spec, inputs)
        result = search_serving(spec, version, version_dir, inputs, reference, note, base)
        if result.winner is None or not write:
            return result, None, None
        return (result, *_write(spec, result, version, version_dir, inputs.digest, base, note))


def _release(version_dir: Path) -> dict[str, Any]:
    path = version_dir / "release.json"
    try:
        data = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError) as exc:
        raise TuneError(f"{path} is not valid JSON: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _write(spec: TuneSpec, result: ServingResult, version: int, version_dir: Path, inputs_digest: str,
           base: Serving | None, note: Callable[[str], None]) -> tuple[int, Path]:  # fmt: skip
    win = result.winner
    assert win is not None
    model_dir = spec.model.repository / spec.model.name
    serving = (base or Serving()).merged(Serving.from_dict(win.serving))
    for v in sorted(versions(model_dir)):  # a rerun (or --continue) after the write: not written twice
        r = _release(model_dir / str(v))
        if (r.get("kind"), r.get("source_version"), r.get("route"), r.get("spec_digest")) == (
            "serving",
            version,
            win.route,
            spec.digest,
        ):
            note(f"version {v} already holds this configuration of version {version}; not written again")
            return v, model_dir / str(v)
    release = {
        "model": spec.model.name,
        "kind": "serving",
        "route": win.route,
        "serving": serving.to_dict(),
        "source_version": version,
        "baseline_version": version,
        "tolerance": spec.tolerance.to_dict(),
        "gate": gate_record(spec, win.gate or {}),
        "serving_evidence": result.to_dict(),
        "spec": dict(spec.raw),
        "spec_path": str(spec.path),
        "spec_digest": spec.digest,
        "inputs_digest": inputs_digest,
        "created_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    written = write_version(spec.model.repository, spec.model.name, _files(version_dir), release=release)
    note(f"written as version {written}: version {version}'s files, served with {describe(serving)}")
    return written, model_dir / str(written)
