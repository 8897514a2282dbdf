"""After the search: finalists served through the embedded Triton, the winner rebuilt once and written.

A route that builds exactly the baseline (same artifact and runtime) is never released.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tunegate.repository import sha256_file
from tuner import gate
from tuner.builders import Artifact, BuildContext, Builder, BuildError
from tuner.builders.worker import run_build
from tuner.e2e import run_e2e
from tuner.form import NATIVE_E2E_SKIPPED, Form
from tuner.inputs import InputSet
from tuner.release import build_release, write_release
from tuner.result import RouteResult, TuneError, route_id
from tuner.spec import TuneSpec

LOG = logging.getLogger(__name__)


def same_as_baseline(baseline_dir: Path, runtime: Mapping[str, Any]) -> Any:
    """A predicate: does this route's artifact and runtime equal the baseline's (nothing to release)?"""
    base_sha = sha256_file(baseline_dir / runtime.get("artifact", "model.onnx"))

    def same(r: RouteResult) -> bool:
        if not r.artifact:
            return False
        art = Artifact.load(Path(r.artifact))
        return dict(art.runtime) == dict(runtime) and sha256_file(art.path) == base_sha

    return same


def load_artifact(route: RouteResult) -> Artifact:
    if not route.artifact:
        raise TuneError(f"{route.route}: no artifact recorded")
    return Artifact.load(Path(route.artifact))


def serve_finalists(
    spec: TuneSpec,
    builder: Builder,
    baseline_dir: Path,
    finalists: list[RouteResult],
    base_outputs: gate.Outputs,
    inputs: InputSet,
) -> dict[str, Any]:

    in_process = {"baseline": base_outputs}
    files = []
    for f in finalists:
        art = load_artifact(f)
        in_process[f.route] = gate.run_all(builder.load(art), inputs)
        files.append((f.route, builder.version_files(art)))
    results = run_e2e(
        model=spec.model.name,
        repository=spec.model.repository,
        baseline_dir=baseline_dir,
        finalists=files,
        in_process=in_process,
        inputs=inputs,
        workdir=spec.workdir,
        concurrency=spec.bench.e2e_concurrency,
        requests=spec.bench.e2e_requests,
        bootstrap=spec.bench.bootstrap,
    )
    base_p50 = results["baseline"]["latency"]["p50_ms"]
    for route, r in results.items():
        served = r.pop("served")
        r["served_passed"] = gate.judge(in_process[route], served, spec.tolerance).passed
        r["speedup_p50"] = base_p50 / r["latency"]["p50_ms"] if r["latency"]["p50_ms"] > 0 else 0.0
    return results


def write_winner(
    spec: TuneSpec,
    serving: Form,
    builder: Builder,
    winner: RouteResult,
    baseline: dict[str, Any],
    e2e: dict[str, Any],
    inputs: InputSet,
    versions_info: dict[str, Any],
    search: Mapping[str, Any],
) -> tuple[int, Path, dict[str, Any]]:
    artifact = load_artifact(winner)
    outputs = gate.run_all(builder.load(artifact), inputs)
    rebuild_dir = spec.workdir / "rebuild" / route_id(winner.route)
    try:
        again, _ = run_build(
            spec.search.backend,
            spec.model.source,
            winner.knobs,
            rebuild_dir,
            BuildContext(spec.search.options, spec.workdir / "calibration.npz", form=serving.form),
            timeout_s=spec.search.build_timeout_s,
        )
        identical: bool | None = gate.identical(outputs, gate.run_all(builder.load(again), inputs))
    except BuildError as exc:
        LOG.warning("rebuilding the winner failed: %s", exc)
        identical = None
    finally:
        shutil.rmtree(rebuild_dir, ignore_errors=True)  # only its outputs matter
    latency = {
        "objective": spec.objective.metric,
        "batch_sizes": list(spec.objective.batch_sizes),
        "candidate": {"objective_ms": winner.objective_ms, "per_shape": winner.latency},
        # timed alternately with the candidate (the speedup's denominator) ...
        "baseline": {"version": baseline["version"], "objective_ms": winner.baseline_objective_ms},
        # ... and alone, once, at the start of the search
        "baseline_alone": {"objective_ms": baseline["objective_ms"], "per_shape": baseline["latency"]},
        "speedup": winner.speedup,
        "speedup_lower": winner.speedup_lower,  # paired bootstrap bound at objective.confidence
        "confidence": spec.objective.confidence,
    }
    if winner.route in e2e:
        latency["triton"] = {
            "candidate": e2e[winner.route],
            "baseline": e2e.get("baseline"),
            "speedup_p50": e2e[winner.route].get("speedup_p50"),
        }
    elif serving.native and spec.bench.e2e:
        latency["triton"] = {"skipped": NATIVE_E2E_SKIPPED}
    accuracy = dict((winner.accuracy or {}).get("outputs", {}))
    release = build_release(
        spec=spec,
        route=winner.route,
        knobs=winner.knobs,
        artifact=artifact,
        accuracy=accuracy,
        latency=latency,
        baseline_version=int(baseline["version"]),
        rebuild_identical=bool(identical) if identical is not None else False,
        versions=versions_info,
        build_seconds=float(winner.build_seconds or 0.0),
        inputs_digest=inputs.digest,
        gate=winner.accuracy,
    )
    release["search"] = dict(
        search
    )  # as run: strategy, budget, and the route expression (--routes may override)
    release["inputs"] = {
        "gate_batches": [b.label for b in inputs.gate],
        "bench_shapes": [s.key for s in inputs.bench],
    }
    release.update(serving.release_fields(artifact))
    if identical is None:
        release["rebuild_error"] = "the rebuild failed; see the log"
    version, path = write_release(spec, serving.version_files(builder, artifact), release)
    return version, path, release
