"""Route expressions, canonical strings and what each strategy enumerates (pure, no builds)."""

from __future__ import annotations

import re

import pytest

from tuner.builders.ort import OrtBuilder
from tuner.routes import (
    Knob,
    RouteError,
    fast_routes,
    full_routes,
    make_route,
    mixed_routes,
    parse_route,
    parse_space,
    route_string,
)

KNOBS = (
    Knob("opt", ("disable", "basic", "all"), "all", ""),
    Knob("quant", ("fp32", "fp16", "int8"), "fp32", ""),
    Knob("threads", ("1", "2"), "1", ""),
)


def test_unnamed_knobs_keep_their_default_and_the_canonical_string_follows_knob_order() -> None:
    space = parse_space(KNOBS, "-threads=2 -quant=[int8|fp16]")
    assert space == {"opt": ("all",), "quant": ("int8", "fp16"), "threads": ("2",)}
    assert [route_string(r) for r in full_routes(KNOBS, space)] == [
        "-opt=all -quant=int8 -threads=2",
        "-opt=all -quant=fp16 -threads=2",
    ]


def test_a_route_string_round_trips_whatever_the_order_it_was_written_in() -> None:
    route = parse_route(KNOBS, "-threads=2 -opt=basic")
    assert route_string(route) == "-opt=basic -quant=fp32 -threads=2"
    assert parse_route(KNOBS, route_string(route)) == route


@pytest.mark.parametrize(
    ("expr", "message"),
    [
        ("-nope=1", "unknown knob -nope"),
        ("-opt=fastest", "-opt=fastest: not an allowed value (allowed: disable|basic|all)"),
        ("-opt=all -opt=basic", "-opt appears twice"),
        ("opt=all", "expected -knob=value"),
        ("-quant=[fp32|fp32]", "listed twice"),
        ("-quant=[fp32|]", "empty value"),
    ],
)
def test_bad_expressions_say_what_is_wrong(expr: str, message: str) -> None:
    with pytest.raises(RouteError, match=re.escape(message)):
        parse_space(KNOBS, expr)


def test_a_single_route_must_not_sweep() -> None:
    with pytest.raises(RouteError, match="sweeps -quant"):
        parse_route(KNOBS, "-quant=[fp32|int8]")


def test_full_is_the_cartesian_product() -> None:
    space = parse_space(KNOBS, "-opt=[disable|basic|all] -quant=[fp32|int8] -threads=[1|2]")
    routes = full_routes(KNOBS, space)
    assert len(routes) == 12 and len(set(routes)) == 12


def test_fast_is_the_base_route_plus_one_knob_changed_at_a_time() -> None:
    space = parse_space(KNOBS, "-opt=[all|disable] -quant=[fp32|fp16|int8] -threads=[1|2]")
    routes = [route_string(r) for r in fast_routes(KNOBS, space)]
    assert routes == [
        "-opt=all -quant=fp32 -threads=1",
        "-opt=disable -quant=fp32 -threads=1",
        "-opt=all -quant=fp16 -threads=1",
        "-opt=all -quant=int8 -threads=1",
        "-opt=all -quant=fp32 -threads=2",
    ]


def test_fast_starts_from_the_first_listed_value_of_each_sweep() -> None:
    space = parse_space(KNOBS, "-quant=[int8|fp32] -opt=[basic|all]")
    assert [route_string(r) for r in fast_routes(KNOBS, space)] == [
        "-opt=basic -quant=int8 -threads=1",
        "-opt=all -quant=int8 -threads=1",
        "-opt=basic -quant=fp32 -threads=1",
    ]


def test_mixed_crosses_only_the_values_that_helped() -> None:
    space = parse_space(KNOBS, "-opt=[all|disable|basic] -quant=[fp32|fp16|int8] -threads=[1|2]")
    helped = [make_route(KNOBS, {"quant": "int8"}), make_route(KNOBS, {"threads": "2"})]
    routes = {route_string(r) for r in mixed_routes(KNOBS, space, helped)}
    assert routes == {
        "-opt=all -quant=fp32 -threads=1",
        "-opt=all -quant=int8 -threads=1",
        "-opt=all -quant=fp32 -threads=2",
        "-opt=all -quant=int8 -threads=2",
    }


def test_the_onnxruntime_builder_defaults_are_the_baseline_runtime() -> None:
    from tunegate.repository import DEFAULT_RUNTIME
    from tuner.builders.ort import runtime_for

    defaults = {k.name: k.default for k in OrtBuilder.knobs}
    assert runtime_for(defaults) == DEFAULT_RUNTIME
    assert runtime_for({**defaults, "threads": "2", "exec": "parallel"})["session"] == {
        "graph_optimization_level": "all",
        "intra_op_num_threads": 2,
        "inter_op_num_threads": 2,
        "execution_mode": "parallel",
    }


def test_expressions_read_as_trtexec_reads_them() -> None:
    knobs = (
        Knob("kgen:codegen:cuda_tile", ("0", "1", "2", "3"), "1", ""),
        Knob("copy_ppg", ("on", "off"), "on", ""),
    )
    expected = {"kgen:codegen:cuda_tile": ("0", "2"), "copy_ppg": ("off",)}
    for expression in (
        "-kgen:codegen:cuda_tile=[0|2] -copy_ppg=off",  # --tuneBuildRoutes
        "-kgen:codegen:cuda_tile=[0|2]\n-copy_ppg=off\n",  # --tuneBuildRouteFile, a token a line
        "  -kgen:codegen:cuda_tile=[ 0 | 2 ]\t-copy_ppg=off ",  # blanks inside brackets are trimmed
    ):
        assert parse_space(knobs, expression) == expected
    with pytest.raises(RouteError, match=re.escape("cannot read '-copy_ppg=[on|off'")):
        parse_space(knobs, "-copy_ppg=[on|off")
