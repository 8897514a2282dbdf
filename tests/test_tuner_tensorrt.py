"""The TensorRT 11 builder: real TensorRT API only. Here it reports itself unavailable (and why); its build
test runs where TensorRT 11 and a GPU exist and is skipped otherwise, never against a fake module."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from tunegate import models
from tuner.builders import get_builder
from tuner.builders.base import BuildContext, save_batches
from tuner.builders.tensorrt import UNAVAILABLE, TensorRTBuilder
from tuner.routes import fast_routes, parse_space, route_string
from tuner.search import TuneError, tune
from tuner.spec import load_spec

HAVE_TENSORRT = importlib.util.find_spec("tensorrt") is not None


def test_the_tensorrt_knobs_follow_the_builder_api() -> None:
    builder = get_builder("tensorrt")
    assert isinstance(builder, TensorRTBuilder)
    space = parse_space(builder.knobs, "-opt_level=[3|5] -tiling=[none|full] -build_route=[default|r1]")
    assert [route_string(r) for r in fast_routes(builder.knobs, space)] == [
        "-opt_level=3 -tiling=none -build_route=default",
        "-opt_level=5 -tiling=none -build_route=default",
        "-opt_level=3 -tiling=full -build_route=default",
        "-opt_level=3 -tiling=none -build_route=r1",
    ]


@pytest.mark.skipif(HAVE_TENSORRT, reason="TensorRT is installed here")
def test_without_tensorrt_the_builder_says_why_and_the_search_refuses(tmp_path: Path) -> None:
    from tests.test_tuner_search import tiny_project

    ok, why = TensorRTBuilder().available()
    assert not ok and why == UNAVAILABLE
    spec = load_spec(tiny_project(tmp_path, search={"backend": "tensorrt", "routes": "-opt_level=3"}))
    with pytest.raises(
        TuneError, match="backend tensorrt cannot run here: the tensorrt Python package is not installed"
    ):
        tune(spec, progress=False)
    assert not (tmp_path / "work").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_TENSORRT, reason=UNAVAILABLE)
def test_tensorrt_builds_a_plan_that_matches_onnx_runtime(tmp_path: Path) -> None:
    from tuner.builders.ort import ort_runner
    from tuner.builders.worker import run_build

    src = models.build_tiny(tmp_path / "tiny.onnx")
    x = np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32)
    save_batches(tmp_path / "calib.npz", [{"x": x[:1]}, {"x": x}])
    ctx = BuildContext(
        options={"timing_cache": str(tmp_path / "timing.cache")}, calibration=tmp_path / "calib.npz"
    )
    route = {"opt_level": "3", "tiling": "none", "build_route": "default"}
    artifact, seconds = run_build("tensorrt", src, route, tmp_path / "plan", ctx, timeout_s=600)
    assert artifact.path.name == "model.plan" and seconds > 0
    assert (tmp_path / "timing.cache").stat().st_size > 0
    got = TensorRTBuilder().load(artifact)({"x": x})
    want = ort_runner(src, {"session": {"graph_optimization_level": "disable"}})({"x": x})
    np.testing.assert_allclose(got["y"], want["y"], rtol=1e-3, atol=1e-3)
