"""Tuning specs: the shipped examples load, and bad specs fail with a message naming the key."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest

from tunegate import models
from tuner.spec import SpecError, load_spec, parse_spec

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def tiny_onnx(tmp_path: Path) -> Path:
    return models.build_tiny(tmp_path / "tiny.onnx")


def base_doc(source: Path, repo: Path) -> dict[str, Any]:
    return {
        "model": {"name": "tiny", "source": str(source), "repository": str(repo)},
        "inputs": {"shapes": [{"batch": 1}, {"batch": 4, "weight": 2}]},
        "tolerance": {"y": {"metric": "linf", "threshold": 1e-3}},
        "search": {"routes": "-quant=[fp32|int8-channel]"},
    }


def test_the_shipped_tiny_spec_loads_with_its_values() -> None:
    spec = load_spec(ROOT / "specs" / "tiny.toml")
    assert spec.model.name == "tiny"
    assert spec.model.repository == (ROOT / "model_repository").resolve()
    assert [s.batch for s in spec.inputs.shapes] == [1, 16]
    assert spec.tolerance.for_output("y").threshold == 1e-4
    assert spec.search.strategy == "fast"
    assert len(spec.digest) == 64


def test_the_minilm_specs_parse(tmp_path: Path, tiny_onnx: Path) -> None:
    # The MiniLM specs name the demo model's cached export; swap in a small file so this stays fast.
    for name in ("minilm.toml", "minilm-loose.toml"):
        raw = tomllib.loads((ROOT / "specs" / name).read_text())
        raw["model"]["source"] = str(tiny_onnx)
        spec = parse_spec(raw, ROOT / "specs" / name)
        assert spec.model.name == "minilm"
        assert spec.tolerance.for_output("embedding").metric == "cosine"
    strict = tomllib.loads((ROOT / "specs" / "minilm.toml").read_text())["tolerance"]["embedding"][
        "threshold"
    ]
    loose = tomllib.loads((ROOT / "specs" / "minilm-loose.toml").read_text())["tolerance"]["embedding"][
        "threshold"
    ]
    assert loose < strict


def test_relative_paths_resolve_against_the_spec_file(tmp_path: Path, tiny_onnx: Path) -> None:
    (tmp_path / "specs").mkdir()
    doc = base_doc(tiny_onnx, tmp_path)
    doc["model"].update(source="../tiny.onnx", repository="../repo")
    spec = parse_spec(doc, tmp_path / "specs" / "s.toml")
    assert spec.model.source == tiny_onnx.resolve()
    assert spec.model.repository == (tmp_path / "repo").resolve()
    assert spec.workdir == (tmp_path / ".tunegate" / "tune" / "s").resolve()


def test_the_digest_changes_with_the_gate(tiny_onnx: Path, tmp_path: Path) -> None:
    a = parse_spec(base_doc(tiny_onnx, tmp_path), tmp_path / "s.toml")
    doc = base_doc(tiny_onnx, tmp_path)
    doc["tolerance"]["y"]["threshold"] = 1e-2
    b = parse_spec(doc, tmp_path / "s.toml")
    assert a.digest != b.digest
    assert parse_spec(base_doc(tiny_onnx, tmp_path), tmp_path / "s.toml").digest == a.digest


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.pop("tolerance"), "missing table [tolerance]"),
        (lambda d: d["model"].pop("name"), "[model].name is required"),
        (lambda d: d["model"].update(source="/nonexistent/m.onnx"), "/nonexistent/m.onnx does not exist"),
        (lambda d: d.update(extra={}), "unknown tables ['extra']"),
        (lambda d: d["tolerance"]["y"].update(metric="l3"), "metric 'l3' is not one of"),
        (lambda d: d["tolerance"]["y"].update(metric="cosine", threshold=2.0), "within [0, 1]"),
        (lambda d: d.update(search={"strategy": "greedy"}), "[search].strategy is 'greedy'"),
        (lambda d: d.update(search={"budget_s": -1}), "[search].budget_s must be > 0"),
        (lambda d: d.update(search={"budget_s": "soon"}), "budget_s: expected a number"),
        (lambda d: d.update(bench={"repeats": 2.5}), "repeats: expected an integer"),
        (lambda d: d.update(bench={"e2e": "yes"}), "e2e: expected true or false"),
        (
            lambda d: d["inputs"].update(shapes=[{"batch": 0}]),
            "[inputs].shapes[0].batch must be an integer >= 1",
        ),
        (lambda d: d["inputs"].update(values="zipf"), "[inputs].values is 'zipf'"),
        (lambda d: d["inputs"].update(source="capture"), "needs [inputs].capture"),
        (lambda d: d["inputs"].update(colour="red"), "unknown keys ['colour']"),
        (
            lambda d: d.update(objective={"batch_sizes": [8]}),
            "[objective].batch_sizes [8] are not batch sizes",
        ),
        (lambda d: d.update(objective={"metric": "p99"}), "[objective].metric is 'p99'"),
        (lambda d: d.update(reference={"precision": "fp16"}), "[reference].precision is 'fp16'"),
    ],
)
def test_bad_specs_give_clear_errors(tiny_onnx: Path, tmp_path: Path, change: Any, message: str) -> None:
    doc = base_doc(tiny_onnx, tmp_path)
    change(doc)
    with pytest.raises(SpecError) as info:
        parse_spec(doc, tmp_path / "s.toml")
    assert message in str(info.value)


def test_a_file_that_is_not_toml_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.toml"
    path.write_text("[model\nname = ")
    with pytest.raises(SpecError, match="broken.toml: not valid TOML"):
        load_spec(path)
    with pytest.raises(SpecError, match="no such spec file"):
        load_spec(tmp_path / "absent.toml")
