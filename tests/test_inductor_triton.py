"""Real AOTInductor builds on the CPU (a small model, in child processes) served by the real embedded Triton.

Two builds of `benchmarks.gpu.models:tiny` run concurrently, once per module (about a minute of
compiling on two cores): fp32 and bf16. CUDA routes (tf32, fp16, autotuning, CUDA graphs) cannot
run here (no GPU) and are covered by the H200 run in benchmarks/gpu/.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the Inductor builder needs torch (pip install -e '.[model]')")

from benchmarks.gpu.models import export_onnx
from tunegate.repository import ModelConfig, TensorSpec, write_config, write_version
from tunegate.triton import EmbeddedTriton
from tuner.builders.base import Artifact, BuildContext
from tuner.builders.inductor import InductorBuilder
from tuner.builders.ort import ort_runner
from tuner.builders.worker import run_build

# Faster test builds: an unoptimised C++ wrapper (the kernels keep their optimisation level).
OPTIONS = {
    "torch_model": "benchmarks.gpu.models:tiny",
    "device": "cpu",
    "inductor_extra": {"aot_inductor.compile_wrapper_opt_level": "O0"},
}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Artifact]]:
    ok, why = InductorBuilder().available()
    if not ok:
        pytest.skip(f"the Inductor builder cannot run here: {why}")
    root = tmp_path_factory.mktemp("inductor")
    source = export_onnx("tiny", root / "tiny.onnx")

    def build(dtype: str) -> Artifact:
        art, _ = run_build(
            "inductor", source, {"dtype": dtype}, root / dtype, BuildContext(OPTIONS), timeout_s=600
        )
        return art

    with ThreadPoolExecutor(2) as pool:
        arts = dict(zip(("fp32", "bf16"), pool.map(build, ("fp32", "bf16")), strict=True))
    return source, arts


def feeds(rows: int, seed: int) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal((rows, 16)).astype(np.float32)}


def test_fp32_package_computes_what_the_reference_onnx_computes(
    built: tuple[Path, dict[str, Artifact]],
) -> None:
    source, arts = built
    art = arts["fp32"]
    assert art.format == "pt2" and art.path.stat().st_size > 0
    assert art.runtime["device"] == "cpu" and art.runtime["cudagraphs"] is False
    assert [i["name"] for i in art.runtime["inputs"]] == ["x"] and art.runtime["outputs"] == ["y", "score"]
    runner = InductorBuilder().load(art)
    reference = ort_runner(source, {})
    for rows, seed in ((1, 1), (3, 2), (64, 3)):  # dynamic batch: sizes the export never saw
        out, ref = runner(feeds(rows, seed)), reference(feeds(rows, seed))
        for name in ("y", "score"):
            assert out[name].shape == ref[name].shape
            np.testing.assert_allclose(out[name], ref[name], rtol=1e-4, atol=1e-5)


def test_bf16_route_really_computes_in_bf16(built: tuple[Path, dict[str, Artifact]]) -> None:
    source, arts = built
    x = feeds(32, 4)
    ref = ort_runner(source, {})(x)["y"]
    fp32 = InductorBuilder().load(arts["fp32"])(x)["y"]
    bf16 = InductorBuilder().load(arts["bf16"])(x)["y"]
    assert bf16.dtype == np.float32  # I/O stays fp32
    err32, err16 = np.abs(fp32 - ref).max(), np.abs(bf16 - ref).max()
    # bf16 keeps 8 mantissa bits: its error is orders above fp32's, yet the outputs stay close.
    assert err16 > 100 * err32
    cos = (bf16 * ref).sum(1) / np.linalg.norm(bf16, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() > 0.99


def test_triton_serves_the_pt2_version_as_in_process(
    built: tuple[Path, dict[str, Artifact]], tmp_path: Path, triton_factory: Callable[..., EmbeddedTriton]
) -> None:
    import tritonclient.http as httpclient

    _, arts = built
    builder = InductorBuilder()
    repo = tmp_path / "repo"
    version = write_version(repo, "tinypt2", builder.version_files(arts["fp32"]))
    assert sorted(p.name for p in (repo / "tinypt2" / str(version)).iterdir()) == [
        "model.pt2",
        "model.py",
        "runtime.json",
    ]
    assert json.loads((repo / "tinypt2" / str(version) / "runtime.json").read_text())["format"] == "pt2"
    write_config(
        repo,
        ModelConfig(
            "tinypt2",
            (TensorSpec("x", "FP32", (-1, 16)),),
            (TensorSpec("y", "FP32", (-1, 8)), TensorSpec("score", "FP32", (-1, 1))),
        ),
    )
    server = triton_factory(repo, models=["tinypt2"])
    in_process = builder.load(arts["fp32"])
    client = httpclient.InferenceServerClient(server.http_address)
    try:
        for rows, seed in ((1, 5), (7, 6)):
            x = feeds(rows, seed)["x"]
            inp = httpclient.InferInput("x", list(x.shape), "FP32")
            inp.set_data_from_numpy(x, binary_data=True)
            result = client.infer("tinypt2", [inp])
            expected = in_process({"x": x})
            for name in ("y", "score"):
                np.testing.assert_allclose(result.as_numpy(name), expected[name], rtol=1e-6, atol=1e-7)
    finally:
        client.close()


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="CUDA graph replay needs a CUDA device; covered by benchmarks/gpu/ on the H200",
)
def test_cuda_graph_replay_matches_plain_calls(tmp_path: Path) -> None:
    source = export_onnx("tiny", tmp_path / "tiny.onnx")
    art, _ = run_build(
        "inductor",
        source,
        {"dtype": "fp16", "cudagraphs": "on"},
        tmp_path / "cg",
        BuildContext({"torch_model": "benchmarks.gpu.models:tiny", "device": "cuda"}),
        timeout_s=600,
    )
    assert art.runtime["cudagraphs"] is True
    graphs = InductorBuilder().load(art)
    plain = InductorBuilder().load(
        Artifact(art.directory, art.format, art.primary, {**art.runtime, "cudagraphs": False})
    )
    for seed in (1, 2, 1):  # a replay must see new inputs, not the captured ones
        x = feeds(8, seed)
        np.testing.assert_array_equal(graphs(x)["y"], plain(x)["y"])
