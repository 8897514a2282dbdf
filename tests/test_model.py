"""The demo model through the real Triton matches ONNX Runtime in process; the tiny model serves too."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.http as httpclient

from tunegate import models
from tunegate.textdata import Tokenizer, sentences
from tunegate.triton import EmbeddedTriton

pytestmark = pytest.mark.triton


def infer(server: EmbeddedTriton, model: str, feeds: dict[str, np.ndarray], output: str) -> np.ndarray:
    client = httpclient.InferenceServerClient(server.http_address)
    try:
        inputs = []
        for name, arr in feeds.items():
            i = httpclient.InferInput(name, list(arr.shape), "INT64" if arr.dtype == np.int64 else "FP32")
            i.set_data_from_numpy(arr)
            inputs.append(i)
        out = client.infer(model, inputs).as_numpy(output)
        assert out is not None
        return out
    finally:
        client.close()


def test_demo_output_through_triton_matches_onnxruntime(
    demo_triton: EmbeddedTriton, minilm_onnx_path: Path
) -> None:
    feeds = Tokenizer()(list(sentences()[:16]))
    got = infer(demo_triton, "minilm", feeds, "embedding")
    ref = ort.InferenceSession(str(minilm_onnx_path), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    cos = (got * ref).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(ref, axis=1))
    assert got.shape == (16, 384)
    assert cos.min() >= 0.99999


def test_tiny_model_serves(tmp_path: Path, triton_factory) -> None:  # type: ignore[no-untyped-def]
    from tunegate.app.cli import main

    assert main(["model", "tiny", "--repository", str(tmp_path)]) == 0
    server = triton_factory(tmp_path, models=["tiny"])
    x = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)
    got = infer(server, "tiny", {"x": x}, "y")
    onnx = next(tmp_path.glob("tiny/1/model.onnx"))
    ref = ort.InferenceSession(str(onnx), providers=["CPUExecutionProvider"]).run(["y"], {"x": x})[0]
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


def test_committed_baseline_model_py_is_the_template() -> None:
    root = Path(__file__).resolve().parent.parent
    from tunegate.repository import ONNX_MODEL_PY

    assert (root / "model_repository/minilm/1/model.py").read_text() == ONNX_MODEL_PY.read_text()
    assert (root / "model_repository/minilm/config.pbtxt").read_text() == models.minilm_config().pbtxt()
