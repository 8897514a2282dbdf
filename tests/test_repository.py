"""Model-repository writer: staged versions, never overwriting, config last, version policies."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tunegate import models
from tunegate.records import JsonlLog, atomic_write_json
from tunegate.repository import (
    ModelConfig,
    RepositoryError,
    TensorSpec,
    clean_staging,
    native_artifact_name,
    onnxruntime_backend_runtime,
    onnxruntime_backend_settings,
    parse_version_policy,
    set_version_policy,
    version_form,
    versions,
    write_config,
    write_native,
    write_version,
)


def test_versions_are_staged_numbered_and_never_replaced(tmp_path: Path) -> None:
    assert write_version(tmp_path, "m", {"a.txt": "one"}) == 1
    assert write_version(tmp_path, "m", {"a.txt": "two"}, release={"k": 1}) == 2
    assert (tmp_path / "m" / "1" / "a.txt").read_text() == "one"
    assert json.loads((tmp_path / "m" / "2" / "release.json").read_text()) == {"k": 1}
    with pytest.raises(OSError):
        write_version(tmp_path, "m", {"a.txt": "three"}, version=1)
    assert (tmp_path / "m" / "1" / "a.txt").read_text() == "one"
    assert versions(tmp_path / "m") == [1, 2]
    assert not list((tmp_path / "m").glob(".staging-*"))


def test_failed_write_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        write_version(tmp_path, "m", {"ok": "x", "bad": tmp_path / "missing"})
    assert versions(tmp_path / "m") == [] and not list((tmp_path / "m").glob(".staging-*"))


def test_killed_writer_leaves_no_half_version(tmp_path: Path) -> None:
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(64 << 20))
    code = (
        "import sys; from pathlib import Path; from tunegate.repository import write_version;"
        f"write_version(Path({str(tmp_path)!r}), 'm', {{'model.bin': Path({str(big)!r})}})"
    )
    proc = subprocess.Popen([sys.executable, "-c", code])
    time.sleep(0.15)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    vs = versions(tmp_path / "m")
    # either the kill came before the rename (no version) or after (a complete one)
    for v in vs:
        assert (tmp_path / "m" / str(v) / "model.bin").stat().st_size == big.stat().st_size
    clean_staging(tmp_path / "m")
    assert not list((tmp_path / "m").glob(".staging-*"))


def test_config_pbtxt_and_policy_rewrite(tmp_path: Path) -> None:
    cfg = models.minilm_config()
    path = write_config(tmp_path, cfg)
    text = path.read_text()
    assert parse_version_policy(text) == (1,)
    assert 'backend: "python"' in text and "TYPE_INT64" in text
    new = set_version_policy(text, [2])
    assert parse_version_policy(new) == (2,) and new.count("version_policy") == 1
    assert parse_version_policy(set_version_policy('name: "x"\n', [3])) == (3,)


def test_native_forms(tmp_path: Path) -> None:
    art = tmp_path / "m.onnx"
    models.build_tiny(art)
    cfg = ModelConfig(
        "t", (TensorSpec("x", "FP32", (-1, 16)),), (TensorSpec("y", "FP32", (-1, 8)),), form="onnxruntime"
    )
    path = write_native(tmp_path / "repo", cfg, art)
    assert 'backend: "onnxruntime"' in path.read_text() and (tmp_path / "repo/t/1/model.onnx").exists()
    trt = ModelConfig("p", cfg.inputs, cfg.outputs, form="tensorrt")
    path = write_native(tmp_path / "repo", trt, art)
    assert 'platform: "tensorrt_plan"' in path.read_text() and (tmp_path / "repo/p/1/model.plan").exists()


def test_the_onnxruntime_backends_form_file_and_session_from_config_pbtxt() -> None:
    assert version_form(models.tiny_config().pbtxt()) == "python"
    assert (
        version_form('platform: "onnxruntime_onnx"')
        == version_form('backend: "onnxruntime"')
        == "onnxruntime"
    )
    assert version_form('platform: "tensorrt_plan"') == "tensorrt"
    text = 'backend: "onnxruntime"\ndefault_model_filename: "m.onnx"\noptimization { graph { level: 1 } }\n'
    params = 'parameters { key: "%s" value: { string_value: "%s" } }\n'
    text += params % ("execution_mode", "1") + params % ("inter_op_thread_count", "2")
    runtime = onnxruntime_backend_runtime(text)
    assert native_artifact_name(text) == runtime["artifact"] == "m.onnx" and runtime["config_entries"] == {}
    assert runtime["session"] == {
        "graph_optimization_level": "extended",
        "intra_op_num_threads": 0,  # unset: ONNX Runtime's default
        "inter_op_num_threads": 2,
        "execution_mode": "parallel",
    }
    settings = onnxruntime_backend_settings(runtime["session"])
    assert settings["optimization"] == {"graph": {"level": 1}}
    assert settings["parameters"]["inter_op_thread_count"] == {"string_value": "2"}
    with pytest.raises(RepositoryError, match="intra_op_thread_count"):
        onnxruntime_backend_runtime(params % ("intra_op_thread_count", "four"))


def test_jsonl_survives_a_torn_last_line(tmp_path: Path) -> None:
    log = JsonlLog(tmp_path / "d.jsonl")
    log.append({"n": 1})
    with open(log.path, "a") as f:
        f.write('{"n": 2, "trunc')  # a kill mid-write
    log.append({"n": 3})
    assert [r["n"] for r in log.read()] == [1, 3]


def test_atomic_write_replaces_whole_file(tmp_path: Path) -> None:
    p = tmp_path / "s.json"
    atomic_write_json(p, {"a": 1})
    atomic_write_json(p, {"a": 2})
    assert json.loads(p.read_text()) == {"a": 2}
    assert [x.name for x in tmp_path.iterdir()] == ["s.json"]
