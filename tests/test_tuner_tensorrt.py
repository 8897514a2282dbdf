"""The TensorRT 11 builder: real TensorRT API only, tested up to TensorRT's boundary.

TensorRT is not installed here. What is tested without it: the knob database (`IBuilderConfig.all_build_routes`)
and route strings in the formats NvInfer.h and trtexec document, tunegate reading routes written for trtexec,
and the config calls, made on `FakeConfig`, a stand-in exposing exactly the documented IBuilderConfig
attributes. The build test runs where TensorRT 11 and a GPU exist and is skipped otherwise, never against a
fake module.
"""

from __future__ import annotations

import enum
import importlib.util
import json
import re
import shlex
from pathlib import Path

import numpy as np
import pytest

from tunegate import models
from tuner.builders import get_builder
from tuner.builders.base import BuildContext, BuildError, save_batches
from tuner.builders.tensorrt import UNAVAILABLE, TensorRTBuilder, configure, import_failure
from tuner.builders.trt_routes import KnobDatabase, allowed_values, parse_build_route
from tuner.routes import RouteError, fast_routes, full_routes, parse_route, parse_space, route_string
from tuner.search import TuneError, plan, tune
from tuner.spec import load_spec

HAVE_TENSORRT = importlib.util.find_spec("tensorrt") is not None
NO_TENSORRT = "TensorRT is not installed here"

# The knob database as IBuilderConfig::getAllBuildRoutes documents it (include/NvInfer.h, TensorRT 11.1), plus
# the knobs of trtexec's README examples and an open knob (allowed_values without a closed list).
DATABASE = json.dumps(
    {
        "tuner_version": "2.19.15",
        "tuner_options": [
            {
                "option": "-conv_use_long_w",
                "allowed_values": "-conv_use_long_w=[on|off]",
                "default_value": "on",
                "help": "Convert Conv [N, C, X, 1] to [N, C, 1, X] in CASK params for perf.",
            },
            {
                "option": "-kgen:codegen:cuda_tile",
                "allowed_values": "-kgen:codegen:cuda_tile=[0|1|2|3]",
                "default_value": "1",
                "help": "CUDA Tile codegen. 0: disable, 1: where profitable, 2: supported kdags, 3: force all.",
            },
            {
                "option": "-match_ragged_mha",
                "allowed_values": "-match_ragged_mha=[on|off]",
                "default_value": "on",
            },
            {"option": "-copy_ppg", "allowed_values": "-copy_ppg=[on|off]", "default_value": "on"},
            {"option": "-peep:max", "allowed_values": "-peep:max=int32_t", "default_value": "2"},
        ],
    }
)


class FakeTiling(enum.Enum):
    """A fake of trt.TilingOptimizationLevel: the members NvInfer.h documents, with their values."""

    NONE = 0
    FAST = 1
    MODERATE = 2
    FULL = 3


class FakeConfig:
    """A fake IBuilderConfig with only the attributes the builder may touch, typed as the Python bindings are.

    `build_route` is a str property (std::string in pyCore.cpp: anything else is a TypeError);
    `all_build_routes` is read-only; any other attribute is an AttributeError. `takes_routes=False` stands for
    a TensorRT that refuses the route (setBuildRoute returns false, which the Python setter does not return).
    """

    __slots__ = ("_all", "_route", "_takes", "builder_optimization_level", "tiling_optimization_level")

    def __init__(self, all_build_routes: str = DATABASE, takes_routes: bool = True) -> None:
        self._all, self._route, self._takes = all_build_routes, "", takes_routes

    @property
    def all_build_routes(self) -> str:
        return self._all

    @property
    def build_route(self) -> str:
        return self._route

    @build_route.setter
    def build_route(self, value: str) -> None:
        if not isinstance(value, str):
            raise TypeError(f"build_route takes a str, not {type(value).__name__}")
        if self._takes:
            self._route = value


class FakeConfigBefore111:
    """A fake IBuilderConfig of a TensorRT without Global Performance Tuning (no build_route properties)."""

    __slots__ = ("builder_optimization_level", "tiling_optimization_level")


def trt_builder() -> TensorRTBuilder:
    return TensorRTBuilder(database=KnobDatabase.from_json(DATABASE))


def test_the_knob_database_reads_as_get_all_build_routes_documents_it() -> None:
    db = KnobDatabase.from_json(DATABASE)
    assert db.tuner_version == "2.19.15" and len(db) == 5
    knob = db.get("-kgen:codegen:cuda_tile")
    assert knob is not None and knob is db.get("kgen:codegen:cuda_tile")  # with or without the dash
    assert (knob.name, knob.values, knob.default) == ("kgen:codegen:cuda_tile", ("0", "1", "2", "3"), "1")
    assert db.default_route() == (
        "-conv_use_long_w=on -kgen:codegen:cuda_tile=1 -match_ragged_mha=on -copy_ppg=on -peep:max=2"
    )


@pytest.mark.parametrize(
    ("allowed", "values"),
    [("-k=[on|off]", ("on", "off")), ("-k=[ 0 | 1 ]", ("0", "1")), ("-k=[0|1|...]", ()), ("-k=int32_t", ())],
)
def test_allowed_values_are_a_closed_list_or_open(allowed: str, values: tuple[str, ...]) -> None:
    assert allowed_values(allowed) == values


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "Global Performance Tuning disabled"),
        ("{not json", "is not JSON"),
        ('{"tuner_version": "2.19.15"}', "no tuner_options list"),
    ],
)
def test_a_database_that_is_empty_or_malformed_is_a_build_error(text: str, message: str) -> None:
    with pytest.raises(BuildError, match=re.escape(message)):
        KnobDatabase.from_json(text)


def test_routes_in_trtexec_syntax_parse() -> None:
    # --setBuildRoute (trtexec README 7.2, NvInfer.h setBuildRoute)
    assert parse_build_route("-match_ragged_mha=on -copy_ppg=off") == {
        "match_ragged_mha": "on",
        "copy_ppg": "off",
    }
    assert parse_build_route("-conv_use_long_w=off -kgen:codegen:cuda_tile=2") == {
        "conv_use_long_w": "off",
        "kgen:codegen:cuda_tile": "2",
    }
    with pytest.raises(RouteError, match="sweeps -copy_ppg"):
        parse_build_route("-copy_ppg=[on|off]")
    # --tuneBuildRoutes (7.3), a --tuneBuildRouteFile (a token a line) and blanks inside brackets
    builder = trt_builder()
    for expression in (
        "-match_ragged_mha=[on|off] -copy_ppg=[on|off]",
        "-match_ragged_mha=[on|off]\n-copy_ppg=[on|off]\n",
        "-match_ragged_mha=[on | off]  -copy_ppg=[ on|off ]",
    ):
        space = parse_space(builder.route_knobs(expression), expression)
        assert space == {
            "opt_level": ("3",),
            "tiling": ("none",),
            "match_ragged_mha": ("on", "off"),
            "copy_ppg": ("on", "off"),
        }


def test_the_tensorrt_knobs_are_the_config_levels_then_the_database_knobs_a_route_names() -> None:
    builder = get_builder("tensorrt")
    assert isinstance(builder, TensorRTBuilder)
    assert [k.name for k in builder.knobs] == ["opt_level", "tiling"]
    assert builder.route_knobs("-opt_level=[3|5] -tiling=full") == builder.knobs  # no database needed
    builder = trt_builder()
    expression = "-opt_level=[3|5] -kgen:codegen:cuda_tile=[1|2] -tiling=[none|full]"
    knobs = builder.route_knobs(expression)
    assert [k.name for k in knobs] == ["opt_level", "tiling", "kgen:codegen:cuda_tile"]
    assert (knobs[2].values, knobs[2].default) == (("0", "1", "2", "3"), "1")
    assert [route_string(r) for r in fast_routes(knobs, parse_space(knobs, expression))] == [
        "-opt_level=3 -tiling=none -kgen:codegen:cuda_tile=1",
        "-opt_level=5 -tiling=none -kgen:codegen:cuda_tile=1",
        "-opt_level=3 -tiling=full -kgen:codegen:cuda_tile=1",
        "-opt_level=3 -tiling=none -kgen:codegen:cuda_tile=2",
    ]


def test_sweeps_listing_the_default_first_enumerate_trtexecs_routes() -> None:
    # trtexec README 7.4: three binary knobs at default "on"; full is 8 routes, fast the baseline and the three
    # one-off flips. tunegate's fast starts from each sweep's first value, here the database default.
    db = KnobDatabase.from_json(
        json.dumps(
            {
                "tuner_options": [
                    {"option": f"-{k}", "allowed_values": f"-{k}=[on|off]", "default_value": "on"}
                    for k in "ABC"
                ]
            }
        )
    )
    expression = "-A=[on|off] -B=[on|off] -C=[on|off]"
    knobs = TensorRTBuilder(database=db).route_knobs(expression)
    space = parse_space(knobs, expression)
    assert len(full_routes(knobs, space)) == 8
    prefix = "-opt_level=3 -tiling=none "
    assert [route_string(r).removeprefix(prefix) for r in fast_routes(knobs, space)] == [
        "-A=on -B=on -C=on",
        "-A=off -B=on -C=on",
        "-A=on -B=off -C=on",
        "-A=on -B=on -C=off",
    ]


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("-nope=on", "unknown knob -nope: not in TensorRT's knob database (tuner 2.19.15, 5 knobs"),
        ("-copy_ppg=maybe", "-copy_ppg=maybe: not an allowed value (allowed: on|off)"),
        ("-peep:max=[1|2]", "-peep:max is an open knob (-peep:max=int32_t): pin it"),
        ("-peep:max=int32_t", "give a value, not its type"),
        ("-opt_level=9", "-opt_level=9: not an allowed value"),
    ],
)
def test_routes_trtexec_would_refuse_are_refused(expression: str, message: str) -> None:
    builder = trt_builder()
    with pytest.raises(RouteError, match=re.escape(message)):
        parse_space(builder.route_knobs(expression), expression)


def test_an_open_knob_can_be_pinned() -> None:
    builder = trt_builder()
    knobs = builder.route_knobs("-peep:max=1")
    assert route_string(parse_route(knobs, "-peep:max=1")) == "-opt_level=3 -tiling=none -peep:max=1"


def test_a_trtexec_route_given_to_tunegate_sets_the_same_build_route_and_flags() -> None:
    trtexec_route = "-conv_use_long_w=off -kgen:codegen:cuda_tile=2"
    builder = trt_builder()
    route = parse_route(builder.route_knobs(trtexec_route), trtexec_route)
    assert route_string(route) == f"-opt_level=3 -tiling=none {trtexec_route}"
    config = FakeConfig()
    notes = configure(config, dict(route), FakeTiling)
    assert config.builder_optimization_level == 3 and config.tiling_optimization_level is FakeTiling.NONE
    assert config.build_route == trtexec_route == notes["build_route"]
    assert notes["tuner_version"] == "2.19.15"
    assert shlex.split(notes["trtexec"]) == [
        "--builderOptimizationLevel=3",
        "--tilingOptimizationLevel=0",
        f"--setBuildRoute={trtexec_route}",
    ]
    # and the route tunegate writes reads back as the same route
    assert parse_build_route(notes["build_route"]) == {
        k: v for k, v in route if k not in ("opt_level", "tiling")
    }


def test_the_config_levels_alone_leave_the_default_build_route() -> None:
    config = FakeConfig()
    notes = configure(config, {"opt_level": "5", "tiling": "full"}, FakeTiling)
    assert config.builder_optimization_level == 5 and config.tiling_optimization_level is FakeTiling.FULL
    assert config.build_route == "" and notes["build_route"] == ""
    assert notes["trtexec"] == "--builderOptimizationLevel=5 --tilingOptimizationLevel=3"
    before = FakeConfigBefore111()
    configure(before, {"opt_level": "1", "tiling": "fast"}, FakeTiling)  # no GPT attribute is touched
    assert before.tiling_optimization_level is FakeTiling.FAST


@pytest.mark.parametrize(
    ("config", "route", "message"),
    [
        (
            FakeConfig(takes_routes=False),
            {"copy_ppg": "off"},
            "TensorRT did not take the build route '-copy_ppg=off'",
        ),
        (FakeConfig(), {"copy_ppg": "maybe"}, "-copy_ppg=maybe: not an allowed value"),
        (FakeConfig(), {"nope": "on"}, "unknown knob -nope"),
        (FakeConfig(all_build_routes=""), {"copy_ppg": "off"}, "Global Performance Tuning disabled"),
        (FakeConfigBefore111(), {"copy_ppg": "off"}, "no IBuilderConfig.all_build_routes"),
    ],
)
def test_a_route_this_tensorrt_cannot_take_fails_the_build(
    config: object, route: dict[str, str], message: str
) -> None:
    with pytest.raises(BuildError, match=re.escape(message)):
        configure(config, {"opt_level": "3", "tiling": "none", **route}, FakeTiling)


def test_an_import_failure_says_whether_tensorrt_is_missing_or_broken() -> None:
    assert import_failure(ModuleNotFoundError("No module named 'tensorrt'", name="tensorrt")) == UNAVAILABLE
    lib = import_failure(
        ImportError("libnvinfer.so.11: cannot open shared object file: No such file or directory")
    )
    assert lib.startswith("the tensorrt package is installed but cannot be imported: a library it loads")
    assert "libnvinfer.so.11: cannot open shared object file" in lib
    part = import_failure(
        ModuleNotFoundError("No module named 'tensorrt.tensorrt'", name="tensorrt.tensorrt")
    )
    assert "installed but cannot be imported: the module tensorrt.tensorrt it imports is missing" in part
    dll = import_failure(FileNotFoundError("Could not find: nvinfer_11.dll. Is it on your PATH?"))
    assert "a library it loads" in dll and "FileNotFoundError" in dll


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
    assert plan(spec)["available"] is False  # the config levels plan without TensorRT
    (tmp_path / "gpt").mkdir()
    spec = load_spec(
        tiny_project(tmp_path / "gpt", search={"backend": "tensorrt", "routes": "-copy_ppg=[on|off]"})
    )
    with pytest.raises(
        RouteError, match="-copy_ppg is a TensorRT knob and TensorRT's knob database is not here"
    ):
        plan(spec)
    with pytest.raises(TuneError, match="cannot run here"):
        tune(spec, progress=False)


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_TENSORRT, reason=NO_TENSORRT)
def test_tensorrt_builds_a_plan_that_matches_onnx_runtime(tmp_path: Path) -> None:
    from tuner.builders.ort import ort_runner
    from tuner.builders.worker import run_build

    src = models.build_tiny(tmp_path / "tiny.onnx")
    x = np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32)
    save_batches(tmp_path / "calib.npz", [{"x": x[:1]}, {"x": x}])
    ctx = BuildContext(
        options={"timing_cache": str(tmp_path / "timing.cache")}, calibration=tmp_path / "calib.npz"
    )
    route = {"opt_level": "3", "tiling": "none"}
    artifact, seconds = run_build("tensorrt", src, route, tmp_path / "plan", ctx, timeout_s=600)
    assert artifact.path.name == "model.plan" and seconds > 0
    assert (tmp_path / "timing.cache").stat().st_size > 0
    assert artifact.meta["trtexec"] == "--builderOptimizationLevel=3 --tilingOptimizationLevel=0"
    got = TensorRTBuilder().load(artifact)({"x": x})
    want = ort_runner(src, {"session": {"graph_optimization_level": "disable"}})({"x": x})
    np.testing.assert_allclose(got["y"], want["y"], rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_TENSORRT, reason=NO_TENSORRT)
def test_tensorrt_takes_a_route_of_its_own_knob_database(tmp_path: Path) -> None:
    from tuner.builders.worker import run_build

    knob = TensorRTBuilder().knob_database().get("conv_use_long_w")  # NvInfer.h's example knob
    if knob is None or "off" not in knob.values:
        pytest.skip("this TensorRT's knob database has no -conv_use_long_w=[on|off]")
    src = models.build_tiny(tmp_path / "tiny.onnx")
    route = {"opt_level": "3", "tiling": "none", "conv_use_long_w": "off"}
    artifact, _ = run_build(
        "tensorrt", src, route, tmp_path / "plan", BuildContext(options={}), timeout_s=600
    )
    assert artifact.meta["build_route"] == "-conv_use_long_w=off"
