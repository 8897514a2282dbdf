"""Builds for a model served by Triton's native onnxruntime backend: one model.onnx with the portable graph
optimizations baked in, run with the session the backend opens."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from tunegate import models
from tuner.builders import get_builder
from tuner.builders.base import BuildContext
from tuner.builders.ort import ort_runner
from tuner.builders.worker import run_build

X = np.random.default_rng(2).standard_normal((8, 16)).astype(np.float32)


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
