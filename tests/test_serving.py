"""Serving configurations: edits through Triton's protobuf, serving routes in the tuner's syntax, and the
measurement's reduction to one figure. The real-Triton parts are in test_sidecar_rollback.py (a serving
release canaried, promoted and rolled back under load) and test_tuner_serving.py (the search)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tunegate import pbtxt
from tunegate.perf import Level, throughput_at
from tunegate.serving import Serving, ServingError, describe
from tuner.routes import RouteError, parse_route
from tuner.serving import KNOBS, SAME, plan, serving_of
from tuner.spec import SpecError, parse_spec

ROOT = Path(__file__).resolve().parent.parent
MINILM = (ROOT / "model_repository" / "minilm" / "config.pbtxt").read_text()


def test_instances_and_batching_are_set_through_the_protobuf() -> None:
    text = Serving(instances=2, max_batch_size=16, queue_delay_us=500, preferred_batch_sizes=(4, 8)).apply(
        MINILM
    )
    cfg = pbtxt.parse(text)
    assert [g.count for g in cfg.instance_group] == [2] and cfg.instance_group[0].kind == 2  # KIND_CPU kept
    assert cfg.max_batch_size == 16
    # the batch dimension moves from the dims to Triton: clients send the same [b, s] tensors
    assert [list(t.dims) for t in cfg.input] == [[-1], [-1]] and list(cfg.output[0].dims) == [384]
    assert cfg.dynamic_batching.max_queue_delay_microseconds == 500
    assert list(cfg.dynamic_batching.preferred_batch_size) == [4, 8]
    assert pbtxt.specific_versions(text) == (1,) and cfg.backend == "python"  # the rest is kept
    back = pbtxt.parse(Serving(max_batch_size=0).apply(text))
    assert back.max_batch_size == 0 and not back.HasField("dynamic_batching")
    assert [list(t.dims) for t in back.input] == [[-1, -1], [-1, -1]] and list(back.output[0].dims) == [
        -1,
        384,
    ]


def test_what_cannot_apply_is_refused_with_the_reason() -> None:
    with pytest.raises(ServingError, match="max_batch_size > 0"):
        Serving(queue_delay_us=100).apply(MINILM)  # MiniLM takes whole shapes: nothing to batch
    with pytest.raises(ServingError, match="exceed max_batch_size"):
        Serving(max_batch_size=4, queue_delay_us=0, preferred_batch_sizes=(8,)).apply(MINILM)
    fixed = MINILM.replace("dims: [ -1, 384 ]", "dims: [ 1, 384 ]")
    with pytest.raises(ServingError, match="leading -1"):
        Serving(max_batch_size=8).apply(fixed)
    with pytest.raises(ServingError):
        Serving(instances=0)
    with pytest.raises(ServingError, match="unknown serving keys"):
        Serving.from_dict({"instance": 2})


def test_off_removes_the_dynamic_batcher_and_parameters_are_backend_parameters() -> None:
    batched = Serving(max_batch_size=8, queue_delay_us=100).apply(MINILM)
    cfg = pbtxt.parse(
        Serving(queue_delay_us=-1, parameters={"EXECUTION_ENV_PATH": "/env.tar.gz"}).apply(batched)
    )
    assert not cfg.HasField("dynamic_batching") and cfg.max_batch_size == 8
    assert cfg.parameters["EXECUTION_ENV_PATH"].string_value == "/env.tar.gz"


def test_a_serving_configuration_round_trips_through_release_json() -> None:
    s = Serving(
        instances=3, max_batch_size=8, queue_delay_us=0, preferred_batch_sizes=(8,), parameters={"a": "1"}
    )
    assert Serving.from_dict(s.to_dict()) == s
    assert Serving.from_dict({}).empty and describe({}) == "the model's own configuration"
    assert describe(s).startswith("instances=3, max_batch_size=8")


def test_serving_routes_use_the_tuner_syntax_and_same_keeps_the_models_value() -> None:
    route = dict(parse_route(KNOBS, "-instances=2 -queue_us=off"))
    assert route == {"instances": "2", "max_batch": SAME, "queue_us": "off"}
    assert serving_of(route) == Serving(instances=2, queue_delay_us=-1)
    assert serving_of({k.name: SAME for k in KNOBS}).empty
    with pytest.raises(RouteError):
        parse_route(KNOBS, "-instances=100")


def test_the_plan_measures_the_models_own_configuration_first(tmp_path: Path) -> None:
    raw = {
        "model": {"name": "m", "source": "demo:tiny", "repository": "."},
        "tolerance": {"y": {"metric": "linf", "threshold": 0.1}},
        "serving": {"routes": "-instances=[2|same] -max_batch=[same|8]", "concurrency": [4, 1, 4]},
    }
    spec = parse_spec(raw, tmp_path / "s.toml")
    assert spec.serving.concurrency == (1, 4)
    routes = plan(spec)
    assert routes[0] == "-instances=same -max_batch=same -queue_us=same" and len(routes) == 4
    bad = {**raw, "serving": {"concurrency": []}}
    with pytest.raises(SpecError, match="concurrency"):
        parse_spec(bad, tmp_path / "s.toml")
    with pytest.raises(SpecError, match="unknown keys"):
        parse_spec({**raw, "serving": {"rounds": 2, "window": 3}}, tmp_path / "s.toml")


def test_throughput_at_the_objective_is_the_best_level_within_the_latency() -> None:
    levels = [
        Level(1, 100.0, 9.0, 10.0, 12.0),
        Level(4, 300.0, 20.0, 40.0, 50.0),
        Level(8, 320.0, 50.0, 90.0, 99.0),
    ]
    assert throughput_at(levels, 0) == 320.0
    assert throughput_at(levels, 45.0) == 300.0
    assert throughput_at(levels, 5.0) == 0.0


def test_schedulers_reshapes_and_flat_tensors_are_refused_not_dropped() -> None:
    seq = MINILM + "sequence_batching { max_sequence_idle_microseconds: 5000000 }\n"
    with pytest.raises(ServingError, match="sequence_batching"):
        Serving(max_batch_size=8, queue_delay_us=100).apply(seq)
    reshaped = MINILM.replace("dims: [ -1, 384 ]", "dims: [ -1, 384 ]\n    reshape: { shape: [ 384 ] }")
    with pytest.raises(ServingError, match="reshape"):
        Serving(max_batch_size=8).apply(reshaped)
    flat = MINILM.replace("dims: [ -1, 384 ]", "dims: [ -1 ]")
    with pytest.raises(ServingError, match="only the batch dimension"):
        Serving(max_batch_size=8).apply(flat)
    # lowering max_batch_size under the preferred batch sizes already in the config
    batched = Serving(max_batch_size=16, queue_delay_us=0, preferred_batch_sizes=(16,)).apply(MINILM)
    with pytest.raises(ServingError, match="exceed max_batch_size"):
        Serving(max_batch_size=8).apply(batched)


def test_a_versions_own_serving_configuration_is_kept_under_a_route() -> None:
    base = Serving(parameters={"intra_op_thread_count": "1"}, graph_level=1)
    merged = base.merged(Serving(instances=2))
    assert merged == Serving(instances=2, parameters={"intra_op_thread_count": "1"}, graph_level=1)
    cfg = pbtxt.parse(merged.apply(MINILM))
    assert cfg.optimization.graph.level == 1 and cfg.parameters["intra_op_thread_count"].string_value == "1"


def test_what_a_swap_restores_is_the_config_that_served_even_on_a_redo(tmp_path: Path) -> None:
    """Promotion and rollback keep the replaced version's config; a redo after a restart (the swap's config already
    on disk) restores that saved config, not the candidate's serving configuration."""
    from sidecar.control import TritonControl

    (tmp_path / "minilm").mkdir()
    control = TritonControl(None, "http://127.0.0.1:1", tmp_path)  # type: ignore[arg-type]  # files only here
    served = MINILM
    assert control._served_before("minilm", 1, served) == served
    assert control.saved_config("minilm", 1).read_text() == served
    swapping = pbtxt.with_version_policy(Serving(instances=2).apply(served), [1, 2])  # a redo finds this
    restored = control._served_before("minilm", 1, swapping)
    assert pbtxt.parse(restored) == pbtxt.parse(served)  # one instance, policy [1]: what served
    assert control.saved_config("minilm", 1).read_text() == served  # not overwritten by the redo
    (tmp_path / "minilm" / "1").mkdir()
    control.saved_config("minilm", 7).write_text(served)  # a version deleted by a killed retention
    control.clean_trash("minilm")
    assert control.saved_config("minilm", 1).exists() and not control.saved_config("minilm", 7).exists()
