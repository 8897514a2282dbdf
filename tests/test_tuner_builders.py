"""The ONNX Runtime builder's routes really build and run (tiny model, child processes), and the strategies
`mixed` and `halving` run the phases they promise."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from tests.test_tuner_search import tiny_project
from tunegate import models
from tuner.builders import BuildError, get_builder
from tuner.builders.base import BuildContext, save_batches
from tuner.builders.ort import ort_runner
from tuner.builders.worker import run_build
from tuner.search import tune
from tuner.spec import load_spec

X = np.random.default_rng(1).standard_normal((8, 16)).astype(np.float32)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, BuildContext]:
    root = tmp_path_factory.mktemp("tiny")
    src = models.build_tiny(root / "tiny.onnx")
    save_batches(root / "calib.npz", [{"x": X[i : i + 2]} for i in range(0, 8, 2)])
    return src, BuildContext(options={}, calibration=root / "calib.npz")


@pytest.mark.parametrize(
    ("quant", "op"),
    [
        ("fp16", "Cast"),
        ("int8-tensor", "DynamicQuantizeLinear"),
        ("int8-channel", "DynamicQuantizeLinear"),
        ("int8-matmul", "MatMulInteger"),
        ("int8-static", "QuantizeLinear"),
    ],
)
def test_each_precision_builds_a_different_graph_that_runs_close_to_fp32(
    tiny: tuple[Path, BuildContext], tmp_path: Path, quant: str, op: str
) -> None:
    src, ctx = tiny
    route = {"opt": "all", "fusion": "none", "quant": quant, "threads": "1", "exec": "sequential"}
    artifact, seconds = run_build("onnxruntime", src, route, tmp_path / quant, ctx, timeout_s=120)
    assert (
        seconds > 0
        and artifact.format == "onnx"
        and artifact.runtime["session"]["graph_optimization_level"] == "all"
    )
    ops = {n.op_type for n in onnx.load(str(artifact.path)).graph.node}
    assert op in ops, ops
    got = get_builder("onnxruntime").load(artifact)({"x": X})
    want = ort_runner(src, {"session": {"graph_optimization_level": "disable"}})({"x": X})
    assert not np.array_equal(got["y"], want["y"])  # it changed the arithmetic ...
    rel = np.linalg.norm(got["y"] - want["y"]) / np.linalg.norm(want["y"])
    assert rel < 0.2, rel  # ... without breaking the model (8-bit on a random MLP: a few percent)


def test_keepffn_names_what_it_kept_and_fails_clearly_when_nothing_matches(
    tiny: tuple[Path, BuildContext], tmp_path: Path
) -> None:
    src, ctx = tiny
    route = {"quant": "int8-channel-keepffn"}
    with pytest.raises(BuildError, match="matched no MatMul node"):
        run_build("onnxruntime", src, route, tmp_path / "none", ctx, timeout_s=120)
    # The tiny graph's MatMul nodes are unnamed; name-free patterns match nothing, '^$' matches them.
    kept = BuildContext(options={"keep_fp32_nodes": ["^$"]}, calibration=ctx.calibration)
    artifact, _ = run_build("onnxruntime", src, route, tmp_path / "kept", kept, timeout_s=120)
    assert artifact.meta["kept_fp32"] == ["", ""]
    assert "MatMulInteger" not in {n.op_type for n in onnx.load(str(artifact.path)).graph.node}


def test_mixed_crosses_what_helped_and_halving_benchmarks_the_best_again(tmp_path: Path) -> None:
    spec = load_spec(
        tiny_project(
            tmp_path,
            objective={"min_speedup": 0.01},
            bench={"repeats": 3, "cheap_repeats": 2, "e2e": False},
            search={"routes": "-opt=[disable|basic] -exec=[sequential|parallel]", "halving_keep": 0.5},
        )
    )
    mixed = tune(spec, strategy="mixed", progress=False, write=False)
    # fast: 3 routes; all pass with min_speedup 0.01, so mixed adds the one crossed route
    assert len(mixed.routes) == 4 and len({r.route for r in mixed.routes}) == 4

    halving = tune(spec, strategy="halving", progress=False, write=False)
    stages = [r.stage for r in halving.routes]
    assert stages.count("full") == 2 and stages.count("cheap") == 2  # 4 cheap, the best half again
    full = [r for r in halving.routes if r.stage == "full"]
    assert all(r.latency and r.latency["b1"]["n"] == 3 for r in full)
    assert halving.winner in full
