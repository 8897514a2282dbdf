"""Writing the winner: the next free version of the model, staged then renamed, with its release.json.

release.json's top-level keys are a contract (the sidecar and the demo read them): model,
version, route, knobs, form, spec, spec_digest, reference, tolerance (ToleranceSpec.to_dict()),
inputs_digest, accuracy, gate (the out-of-tolerance rate over the gate's requests: k, n, rate,
its lower and upper bounds, budget, confidence, and the pooled checks), latency, baseline_version,
artifact_sha256, rebuild_identical, versions, build_seconds, created_at. config.pbtxt and existing versions are never touched: the
new version stays unserved until the sidecar's canary.
"""

from __future__ import annotations

import datetime
import os
import platform
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tunegate import __version__
from tunegate.repository import next_version, sha256_file, write_version
from tuner.builders.base import Artifact, Builder
from tuner.spec import ReferenceSection, TuneSpec

RELEASE_KEYS = (
    "model", "version", "route", "knobs", "form", "spec", "spec_digest", "reference", "tolerance", "inputs_digest",
    "accuracy", "gate", "latency", "baseline_version", "artifact_sha256", "rebuild_identical", "versions",
    "build_seconds", "created_at",
)  # fmt: skip


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_info() -> dict[str, str]:
    """GPU SKU, driver and CUDA version from nvidia-smi where there is one (nothing on CPU hosts)."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return {}
    try:
        query = [smi, "--query-gpu=name,driver_version", "--format=csv,noheader"]
        out = (
            subprocess.run(query, capture_output=True, text=True, timeout=10, check=False)
            .stdout.strip()
            .splitlines()
        )
        head = subprocess.run([smi], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    info: dict[str, str] = {}
    if out:
        name, _, driver = out[0].partition(",")
        info.update(gpu=name.strip(), driver=driver.strip())
    for token in head.split("|"):
        if "CUDA Version" in token:
            info["cuda"] = token.split(":", 1)[1].strip()
    return info


def tool_versions(builder: Builder) -> dict[str, Any]:
    import numpy

    versions: dict[str, Any] = {
        "tunegate": _tunegate_version(),
        "python": platform.python_version(),
        "numpy": numpy.__version__,
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "backend": builder.name,
    }
    versions.update(builder.tool_versions())
    versions.update(gpu_info())
    return versions


def _tunegate_version() -> str:

    return __version__


def build_release(
    *,
    spec: TuneSpec,
    route: str,
    knobs: Mapping[str, str],
    artifact: Artifact,
    accuracy: Mapping[str, Any],
    latency: Mapping[str, Any],
    baseline_version: int,
    rebuild_identical: bool,
    versions: Mapping[str, Any],
    build_seconds: float,
    inputs_digest: str,
    gate: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """release.json's content; `gate` is the winner's gate evidence (tuner.gate.gate_evidence)."""

    ref: ReferenceSection = spec.reference
    return {
        "model": spec.model.name,
        "version": None,  # filled in once the version number is taken
        "route": route,
        "knobs": dict(knobs),
        "format": artifact.format,
        "runtime": dict(artifact.runtime),
        "builder_notes": dict(artifact.meta),
        "spec": dict(spec.raw),
        "spec_path": str(spec.path),
        "spec_digest": spec.digest,
        "reference": {
            "implementation": ref.implementation,
            "precision": ref.precision,
            "graph_optimization_level": ref.graph_optimization_level,
            "intra_op_num_threads": ref.intra_op_num_threads,
            "source": str(spec.model.source),
            "source_sha256": sha256_file(spec.model.source),
        },
        "tolerance": spec.tolerance.to_dict(),
        "inputs_digest": inputs_digest,
        "accuracy": dict(accuracy),
        "gate": gate_record(spec, gate or {}),
        "latency": dict(latency),
        "baseline_version": baseline_version,
        "artifact_sha256": sha256_file(artifact.path),
        "rebuild_identical": rebuild_identical,
        "versions": dict(versions),
        "build_seconds": round(build_seconds, 3),
        "created_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


# The request classes the canary must see before it promotes: the traffic's main shapes, as the gate saw them
# (at least this share of the gate's requests, and at least this many of them).
MIN_CLASS_SHARE = 0.05
MIN_CLASS_REQUESTS = 10


def gate_record(spec: TuneSpec, evidence: Mapping[str, Any]) -> dict[str, Any]:
    """The gate as release.json keeps it: the rate in the canary's terms, next to the spec's budget.

    `classes` maps each main request class (tunegate.classes.request_class; at least MIN_CLASS_SHARE of the
    gate's requests and MIN_CLASS_REQUESTS of them) to its share: the sidecar's canary expects live
    evidence on each before it promotes. `class_counts` has every class the gate saw.
    """
    g = spec.gate
    rate = dict(evidence.get("rate") or {})
    counts = {str(k): int(v) for k, v in (evidence.get("classes") or {}).items()}
    total = sum(counts.values())
    return {
        "oot_rate": rate.get("rate"),
        "k": rate.get("k"),
        "n": rate.get("n"),
        "lower": rate.get("lower"),
        "upper": rate.get("upper"),
        "budget": g.oot_budget,
        "confidence": g.confidence,
        "passed": evidence.get("passed"),
        "oot_inputs": rate.get("oot_inputs", []),
        "samples": g.samples,
        "source": spec.inputs.source,
        "checks": g.checks.to_dict() if g.checks is not None else {},
        "checks_passed": evidence.get("checks_passed"),
        "classes": {
            c: round(n / total, 4)
            for c, n in counts.items()
            if c and n >= MIN_CLASS_REQUESTS and n >= MIN_CLASS_SHARE * total
        },
        "class_counts": counts,
    }


def write_release(
    spec: TuneSpec, files: Mapping[str, Path | bytes | str], release: dict[str, Any]
) -> tuple[int, Path]:
    """Stage the winner's version files plus release.json and rename them to the next free version."""
    model_dir = spec.model.repository / spec.model.name

    # The version number goes into release.json before staging; write_version retries the next
    # number if another writer takes this one, so it is re-checked afterwards.
    for _ in range(10):
        guess = next_version(model_dir)
        release["version"] = guess
        try:
            version = write_version(
                spec.model.repository,
                spec.model.name,
                files,
                version=guess,
                release=release,
            )
        except OSError:
            if (model_dir / str(guess)).exists():
                continue
            raise
        return version, model_dir / str(version)
    raise RuntimeError(f"could not take a free version under {model_dir}")
