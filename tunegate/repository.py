"""Triton model-repository writer: versions staged in a temp dir and renamed into place, config last.

Three forms of a version:
  python-onnx   python backend + ONNX Runtime (what the embedded CPU Triton serves here)
  onnxruntime   Triton's native onnxruntime backend (`model.onnx`, production / compose)
  tensorrt      `platform: "tensorrt_plan"` (`model.plan`, production on GPU)
Existing versions are never touched; a killed writer leaves only a `.staging-*` directory,
which Triton ignores (not a number) and `clean_staging()` removes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tunegate import pbtxt
from tunegate.errors import ServiceError
from tunegate.procs import TUNE_KILL_AT_ENV, kill_point
from tunegate.records import atomic_write_text, fsync_dir

TEMPLATES = Path(__file__).parent / "templates"
ONNX_MODEL_PY = TEMPLATES / "onnx_model.py"

DEFAULT_RUNTIME: dict[str, Any] = {
    "format": "onnx",
    "artifact": "model.onnx",
    "providers": ["CPUExecutionProvider"],
    "session": {
        "graph_optimization_level": "all",
        "intra_op_num_threads": 1,
        "inter_op_num_threads": 1,
        "execution_mode": "sequential",
    },
    # Spinning intra-op threads steal the other version's core during a canary on 2 cores.
    "config_entries": {"session.intra_op.allow_spinning": "0"},
}


class RepositoryError(ServiceError):
    """The model repository is not in the shape the writer needs."""


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str  # KServe datatype, e.g. FP32
    dims: tuple[int, ...]

    def pbtxt(self) -> str:
        dims = ", ".join(str(d) for d in self.dims)
        return f'  {{\n    name: "{self.name}"\n    data_type: TYPE_{_pb_type(self.datatype)}\n    dims: [ {dims} ]\n  }}'


def _pb_type(datatype: str) -> str:
    return "STRING" if datatype == "BYTES" else datatype


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    form: str = "python-onnx"  # python-onnx | onnxruntime | tensorrt
    max_batch_size: int = 0
    versions: tuple[int, ...] | None = None  # None: Triton's default (latest)
    instance_count: int = 1
    kind: str | None = "KIND_CPU"  # None: no instance_group, Triton places it (GPU where there is one)
    parameters: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def pbtxt(self) -> str:
        lines = [f'name: "{self.name}"']
        if self.form == "python-onnx":
            lines.append('backend: "python"')
        elif self.form == "onnxruntime":
            lines.append('backend: "onnxruntime"')
        elif self.form == "tensorrt":
            lines.append('platform: "tensorrt_plan"')
        else:
            raise RepositoryError(f"unknown model form {self.form!r}")
        lines.append(f"max_batch_size: {self.max_batch_size}")
        if self.versions is not None:
            vs = ", ".join(str(v) for v in self.versions)
            lines.append(f"version_policy: {{ specific: {{ versions: [ {vs} ] }} }}")
        lines.append("input [\n" + ",\n".join(t.pbtxt() for t in self.inputs) + "\n]")
        lines.append("output [\n" + ",\n".join(t.pbtxt() for t in self.outputs) + "\n]")
        if self.kind is not None:
            lines.append(f"instance_group [ {{ count: {self.instance_count} kind: {self.kind} }} ]")
        for k, v in self.parameters.items():
            lines.append(f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}')
        return "\n".join(lines) + "\n"

    def to_json(self) -> dict[str, Any]:
        """The JSON form Triton's load API accepts as a config override."""
        cfg: dict[str, Any] = {
            "name": self.name,
            "max_batch_size": self.max_batch_size,
            "input": [
                {"name": t.name, "data_type": f"TYPE_{_pb_type(t.datatype)}", "dims": list(t.dims)}
                for t in self.inputs
            ],
            "output": [
                {"name": t.name, "data_type": f"TYPE_{_pb_type(t.datatype)}", "dims": list(t.dims)}
                for t in self.outputs
            ],
        }
        if self.kind is not None:
            cfg["instance_group"] = [{"count": self.instance_count, "kind": self.kind}]
        if self.form == "python-onnx":
            cfg["backend"] = "python"
        elif self.form == "onnxruntime":
            cfg["backend"] = "onnxruntime"
        else:
            cfg["platform"] = "tensorrt_plan"
        if self.versions is not None:
            cfg["version_policy"] = {"specific": {"versions": list(self.versions)}}
        if self.parameters:
            cfg["parameters"] = {k: {"string_value": v} for k, v in self.parameters.items()}
        return cfg


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def versions(model_dir: Path) -> list[int]:
    if not model_dir.is_dir():
        return []
    return sorted(int(p.name) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit())


def next_version(model_dir: Path) -> int:
    vs = versions(model_dir)
    return (vs[-1] + 1) if vs else 1


def clean_staging(model_dir: Path) -> int:
    n = 0
    for p in model_dir.glob(".staging-*"):
        shutil.rmtree(p, ignore_errors=True)
        n += 1
    return n


def _fsync_tree(root: Path) -> None:
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def write_version(
    repository: Path,
    model: str,
    files: Mapping[str, Path | bytes | str],
    *,
    version: int | None = None,
    release: Mapping[str, Any] | None = None,
) -> int:
    """Stage `files` (name -> source path, bytes or text) plus release.json; rename to the next free version.

    Returns the version number. Never overwrites an existing version: if another writer takes
    the number first, the next one is tried.
    """
    model_dir = Path(repository) / model
    model_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=model_dir))
    try:
        for name, src in files.items():
            dest = staging / name
            dest.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(src, Path):
                shutil.copyfile(src, dest)
            elif isinstance(src, bytes):
                dest.write_bytes(src)
            else:
                dest.write_text(src)
        if release is not None:
            (staging / "release.json").write_text(
                json.dumps(release, indent=2, sort_keys=True, default=str) + "\n"
            )
        os.chmod(staging, 0o755)
        _fsync_tree(staging)
        if release is not None:  # a release's write (the tuner's e2e serving copies have no release.json)
            kill_point(TUNE_KILL_AT_ENV, "writing")
        for _ in range(100):
            n = version if version is not None else next_version(model_dir)
            target = model_dir / str(n)
            try:
                # rename(2) onto an existing non-empty directory fails: versions are never replaced.
                os.rename(staging, target)
            except OSError:
                if version is not None or not target.exists():
                    raise
                continue
            fsync_dir(model_dir)
            return n
        raise RepositoryError(f"could not find a free version under {model_dir}")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def onnx_version_files(
    onnx_path: Path, runtime: Mapping[str, Any] | None = None
) -> dict[str, Path | bytes | str]:
    """Files of a python-onnx version: the model, its runtime options and the python backend model."""
    rt = dict(DEFAULT_RUNTIME if runtime is None else runtime)
    return {
        "model.onnx": Path(onnx_path),
        "runtime.json": json.dumps(rt, indent=2, sort_keys=True) + "\n",
        "model.py": ONNX_MODEL_PY.read_text(),
    }


def write_config(repository: Path, config: ModelConfig) -> Path:
    path = Path(repository) / config.name / "config.pbtxt"
    atomic_write_text(path, config.pbtxt())
    return path


def write_native(
    dest_repository: Path,
    config: ModelConfig,
    artifact: Path,
    *,
    version: int = 1,
) -> Path:
    """Emit the production form of a version (native onnxruntime or TensorRT plan): artifact first, config last."""
    if config.form == "onnxruntime":
        name = "model.onnx"
    elif config.form == "tensorrt":
        name = "model.plan"
    else:
        raise RepositoryError("write_native writes the onnxruntime or tensorrt form")
    write_version(dest_repository, config.name, {name: Path(artifact)}, version=version)
    return write_config(dest_repository, config)


def parse_version_policy(config_text: str) -> tuple[int, ...] | None:
    """The `specific` versions in a config.pbtxt, or None when it has no specific policy (read by Triton's
    protobuf: tunegate.pbtxt). A config the protobuf cannot parse raises ConfigTextError (a ValueError)."""
    return pbtxt.specific_versions(config_text)


def set_version_policy(config_text: str, versions_: Sequence[int]) -> str:
    """Rewrite (or add) `version_policy: { specific: { versions: [...] } }` in config.pbtxt text."""
    return pbtxt.with_version_policy(config_text, versions_)
