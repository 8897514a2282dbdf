"""The tuner on a model served by Triton's native onnxruntime backend (a repository laid out like compose's).

The embedded Triton here has the python backend only, so the native version is checked structurally: its
config.pbtxt through Triton's protobuf, its files, release.json's form and serving settings; and ONNX Runtime,
run as the backend would run it under those settings, serves the written model.onnx with the gate's outputs.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

from tests.test_tuner_search import tiny_project, tree_digest
from tunegate import models, pbtxt
from tunegate.repository import onnxruntime_backend_runtime, sha256_file, write_native
from tunegate.serving import Serving
from tuner import gate
from tuner.builders import Artifact, get_builder
from tuner.builders.base import BuildContext
from tuner.builders.ort import ort_runner
from tuner.builders.worker import run_build
from tuner.form import Form
from tuner.inputs import make_inputs
from tuner.release import RELEASE_KEYS
from tuner.result import TuneError
from tuner.search import find_baseline, tune
from tuner.spec import TuneSpec, load_spec

X = np.random.default_rng(2).standard_normal((8, 16)).astype(np.float32)


def native_spec(tmp_path: Path, **sections: dict[str, object]) -> TuneSpec:
    """tiny_project's spec, its repository laid out like compose's: config.pbtxt with `backend: "onnxruntime"`
    (no instance_group: Triton places it) and version 1 = the tiny model.onnx alone."""
    spec = load_spec(tiny_project(tmp_path, **sections))
    shutil.rmtree(spec.model.repository / "tiny")
    config = dataclasses.replace(models.tiny_config(), form="onnxruntime", kind=None)
    write_native(spec.model.repository, config, spec.model.source)
    return spec


@pytest.mark.parametrize(
    ("route", "baked"), [("all/fp32", "basic"), ("disable/fp32", None), ("all/fp16", None)]
)
def test_a_native_build_bakes_the_portable_optimizations_only(
    tmp_path: Path, route: str, baked: str | None
) -> None:
    src = models.build_tiny(tmp_path / "tiny.onnx")
    opt, quant = route.split("/")
    knobs = {"opt": opt, "fusion": "none", "quant": quant, "threads": "1", "exec": "sequential"}
    art, _ = run_build(
        "onnxruntime", src, knobs, tmp_path / "b", BuildContext({}, form="onnxruntime"), timeout_s=120
    )
    assert art.meta["baked"]["level"] == baked
    ops = [n.op_type for n in onnx.load(str(art.path)).graph.node]
    if baked:  # basic folds MatMul + Add into Gemm; nothing of a provider (FusedGemm) or a CPU layout
        assert "Gemm" in ops and "MatMul" not in ops and "FusedGemm" not in ops, ops
    else:
        assert "MatMul" in ops, ops
    # the session Triton's onnxruntime backend opens: no allow_spinning entry, inter-op unset when sequential
    assert art.runtime["config_entries"] == {} and art.runtime["session"]["inter_op_num_threads"] == 0
    python, _ = run_build("onnxruntime", src, knobs, tmp_path / "p", BuildContext({}), timeout_s=120)
    assert "baked" not in python.meta and python.runtime["config_entries"] == {
        "session.intra_op.allow_spinning": "0"
    }
    want = ort_runner(python.path, python.runtime)({"x": X})
    got = get_builder("onnxruntime").load(art)({"x": X})
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=1e-5)


def test_tune_writes_a_native_version_that_onnx_runtime_serves_with_the_gates_outputs(tmp_path: Path) -> None:
    spec = native_spec(tmp_path, objective={"min_speedup": 0.01}, bench={"repeats": 3})
    model_dir = spec.model.repository / "tiny"
    config_text = (model_dir / "config.pbtxt").read_text()
    before = tree_digest(model_dir)

    result = tune(spec, progress=False)

    assert result.winner is not None and result.version == 2 and result.version_path == model_dir / "2"
    assert {k: v for k, v in tree_digest(model_dir).items() if not k.startswith("2/")} == before
    cfg = pbtxt.parse((model_dir / "config.pbtxt").read_text())  # untouched, and still Triton's
    assert cfg.backend == "onnxruntime" and list(cfg.version_policy.specific.versions) == [1]
    assert not cfg.parameters and not cfg.HasField("optimization")
    assert sorted(p.name for p in result.version_path.iterdir()) == ["model.onnx", "release.json"]

    release = json.loads((result.version_path / "release.json").read_text())
    assert set(RELEASE_KEYS) <= set(release) and release["form"] == "onnxruntime"
    assert release["route"] == result.winner.route and release["knobs"] == result.winner.knobs
    assert release["artifact_sha256"] == sha256_file(result.version_path / "model.onnx")
    assert release["rebuild_identical"] is True and release["gate"]["passed"] is True
    opt = result.winner.knobs["opt"]
    assert release["builder_notes"]["baked"]["level"] == (None if opt == "disable" else "basic")
    assert "python backend" in release["latency"]["triton"]["skipped"] and result.e2e == {}
    serving = release[
        "serving"
    ]  # tunegate.serving's form: the canary serves and promotes the version with it
    level = {"all": 0, "extended": 1, "basic": -1, "disable": 2}[opt]
    assert serving == {
        "parameters": {"execution_mode": "0", "intra_op_thread_count": "1"},
        "graph_level": level,
    }
    changes = release["serving_changes"]["changes"]
    # the config sets no thread count (ONNX Runtime's default, "0"); the winner was timed with one thread
    assert changes["parameters.intra_op_thread_count"] == {"now": "0", "wanted": "1"}
    assert ("optimization.graph.level" in changes) == (opt != "all")

    # What the gate ran: the winner's artifact in process, on the gate's requests.
    inputs = make_inputs(spec.inputs, spec.model.source, spec.model.name, spec.gate.samples, spec.gate.needed)
    artifact = Artifact.load(Path(result.winner.artifact or ""))
    assert sha256_file(artifact.path) == release["artifact_sha256"]
    gated = gate.run_all(get_builder("onnxruntime").load(artifact), inputs)

    # Triton's onnxruntime backend once config.pbtxt has the release's settings: the same session, same outputs.
    applied = onnxruntime_backend_runtime(Serving.from_dict(serving).apply(config_text))
    assert applied["session"] == release["runtime"]["session"] == artifact.runtime["session"]
    served = gate.run_all(ort_runner(result.version_path / "model.onnx", applied), inputs)
    for s, g in zip(served, gated, strict=True):
        for name in g:
            np.testing.assert_array_equal(s[name], g[name])

    # ... and under the config as it is now (ONNX Runtime's default threads, level all): float rounding at most.
    now = gate.run_all(
        ort_runner(result.version_path / "model.onnx", onnxruntime_backend_runtime(config_text)), inputs
    )
    worst = max(float(np.max(np.abs(s[n] - g[n]))) for s, g in zip(now, gated, strict=True) for n in g)
    assert worst <= 1e-5, worst


def test_a_native_baseline_is_its_model_file_run_with_the_session_its_config_gives_it(tmp_path: Path) -> None:
    spec = native_spec(tmp_path)
    config = spec.model.repository / "tiny" / "config.pbtxt"
    config.write_text(
        config.read_text()
        + 'parameters { key: "intra_op_thread_count" value: { string_value: "3" } }\n'
        + "optimization { graph { level: -1 } }\n"
    )
    version, version_dir = find_baseline(spec)
    assert version == 1 and sorted(p.name for p in version_dir.iterdir()) == ["model.onnx"]
    runtime = Form.read(config).baseline_runtime(version_dir)
    assert runtime["artifact"] == "model.onnx" and runtime["config_entries"] == {}
    assert runtime["session"] == {
        "graph_optimization_level": "basic",
        "intra_op_num_threads": 3,
        "inter_op_num_threads": 0,
        "execution_mode": "sequential",
    }
    (version_dir / "model.onnx").unlink()
    with pytest.raises(TuneError, match="model.onnx does not exist"):
        find_baseline(spec)
