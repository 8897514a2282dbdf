"""The Inductor builder's route space and refusals, without compiling (the compiled path: test_inductor_triton.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tuner.builders import get_builder
from tuner.builders.base import Artifact, BuildContext, BuildError
from tuner.builders.inductor import (
    PT2_MODEL_PY,
    InductorBuilder,
    inductor_configs,
    load_factory,
    wants_cudagraphs,
)
from tuner.routes import full_routes, parse_route, parse_space

torch = pytest.importorskip("torch", reason="the Inductor builder needs torch (pip install -e '.[model]')")
CUDA = torch.cuda.is_available()


def test_registered_under_its_name() -> None:
    assert isinstance(get_builder("inductor"), InductorBuilder)


def test_mode_maps_onto_inductor_options_and_knobs_override_it() -> None:
    assert inductor_configs({"mode": "default"}) == {"epilogue_fusion": True}
    auto = inductor_configs({"mode": "max-autotune", "gemm": "triton"})
    assert (
        auto["max_autotune"]
        and auto["coordinate_descent_tuning"]
        and auto["max_autotune_gemm_backends"] == "TRITON"
    )
    assert (
        inductor_configs({"mode": "max-autotune-no-cudagraphs", "coord": "off"})["coordinate_descent_tuning"]
        is False
    )
    assert inductor_configs({"epilogue": "off", "freezing": "on"}) == {
        "epilogue_fusion": False,
        "freezing": True,
    }


def test_cudagraphs_follow_the_mode_unless_pinned() -> None:
    assert wants_cudagraphs({"mode": "max-autotune"})
    assert not wants_cudagraphs({"mode": "max-autotune-no-cudagraphs"})
    assert not wants_cudagraphs({"mode": "default"})
    assert wants_cudagraphs({"mode": "default", "cudagraphs": "on"})


def test_contradictory_routes_are_skipped_with_a_reason() -> None:
    b = InductorBuilder()
    assert "max-autotune-no-cudagraphs" in (
        b.route_problem({"mode": "max-autotune", "cudagraphs": "off"}) or ""
    )
    assert b.route_problem({"mode": "max-autotune-no-cudagraphs", "cudagraphs": "on"})
    assert "max-autotune" in (b.route_problem({"mode": "default", "gemm": "aten"}) or "")
    assert b.route_problem({"dtype": "bf16", "mode": "default"}) is None


@pytest.mark.skipif(CUDA, reason="checks the CPU-only refusals; this machine has CUDA")
def test_cpu_mode_refuses_what_needs_cuda_and_keeps_the_rest() -> None:
    b = InductorBuilder()
    ok, why = b.available()
    assert ok and "CPU only" in why
    space = parse_space(
        b.knobs, "-dtype=[fp32|tf32|bf16|fp16] -mode=[default|max-autotune] -freezing=[off|on]"
    )
    runnable = [dict(r) for r in full_routes(b.knobs, space) if b.route_problem(dict(r)) is None]
    assert {(r["dtype"], r["mode"]) for r in runnable} == {("fp32", "default"), ("bf16", "default")}
    assert "CUDA" in (b.route_problem(dict(parse_route(b.knobs, "-dtype=fp16"))) or "")
    assert "CUDA" in (b.route_problem({"cudagraphs": "on"}) or "")


def test_build_needs_a_torch_model_and_names_a_bad_one(tmp_path: Path) -> None:
    b = InductorBuilder()
    with pytest.raises(BuildError, match="torch_model"):
        b.build(tmp_path / "missing.onnx", {"dtype": "fp32"}, tmp_path, BuildContext(options={}))
    with pytest.raises(BuildError, match="cannot import"):
        load_factory("benchmarks.gpu.no_such_module:model")
    with pytest.raises(BuildError, match="module:function"):
        load_factory("no_colon")


def test_version_files_are_the_package_the_runtime_and_the_template(tmp_path: Path) -> None:
    (tmp_path / "model.pt2").write_bytes(b"pt2")
    art = Artifact(
        tmp_path,
        "pt2",
        "model.pt2",
        {"device": "cpu", "inputs": [{"name": "x", "dtype": "float32"}], "outputs": ["y"]},
    )
    files = InductorBuilder().version_files(art)
    assert files["model.pt2"] == tmp_path / "model.pt2"
    assert '"device": "cpu"' in str(files["runtime.json"])
    assert files["model.py"] == PT2_MODEL_PY.read_text() and "aoti_load_package" in str(files["model.py"])


def test_a_tuning_spec_names_the_torch_model_with_no_new_keys(tmp_path: Path) -> None:
    from benchmarks.gpu.models import export_onnx
    from tuner.search import plan
    from tuner.spec import parse_spec

    export_onnx("tiny", tmp_path / "tiny.onnx")
    raw = {
        "model": {"name": "tiny", "source": "tiny.onnx", "repository": "repo"},
        "tolerance": {"*": {"metric": "cosine", "threshold": 0.999}},
        "search": {
            "backend": "inductor",
            "routes": "-dtype=[fp32|bf16|fp16] -freezing=[off|on]",
            "options": {"torch_model": "benchmarks.gpu.models:tiny"},
        },
    }
    spec = parse_spec(raw, tmp_path / "spec.toml")
    assert spec.search.options["torch_model"] == "benchmarks.gpu.models:tiny"
    p = plan(spec, "fast")
    assert p["backend"] == "inductor" and p["available"]
    assert len(p["routes"]) == 4 and p["routes"][0].startswith("-dtype=fp32 -mode=default")
