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


NATIVE_ARTIFACTS = {"onnxruntime": "model.onnx", "tensorrt": "model.plan"}


def native_version_files(form: str, artifact: Path, name: str | None = None) -> dict[str, Path | bytes | str]:
    """Files of a native version (`form` onnxruntime or tensorrt): the artifact alone, under `name` (the config's
    `default_model_filename`) or the backend's default name. Its session settings are the model's config.pbtxt's."""
    if form not in NATIVE_ARTIFACTS:
        raise RepositoryError(f"a native version is of form onnxruntime or tensorrt, not {form!r}")
    return {name or NATIVE_ARTIFACTS[form]: Path(artifact)}


def write_native(
    dest_repository: Path,
    config: ModelConfig,
    artifact: Path,
    *,
    version: int = 1,
) -> Path:
    """Emit the production form of a version (native onnxruntime or TensorRT plan): artifact first, config last."""
    write_version(dest_repository, config.name, native_version_files(config.form, artifact), version=version)
    return write_config(dest_repository, config)


def version_form(config_text: str) -> str:
    """What serves a model's versions, from its config.pbtxt (Triton's protobuf): `python`, `onnxruntime`,
    `tensorrt`, else the backend or platform named there."""
    cfg = pbtxt.parse(config_text)
    if cfg.backend == "onnxruntime" or cfg.platform == "onnxruntime_onnx":
        return "onnxruntime"
    if cfg.backend == "tensorrt" or cfg.platform == "tensorrt_plan":
        return "tensorrt"
    return str(cfg.backend or cfg.platform or "unknown")


def native_artifact_name(config_text: str) -> str:
    """The file Triton's onnxruntime or TensorRT backend loads from a version directory."""
    cfg = pbtxt.parse(config_text)
    return str(cfg.default_model_filename) or NATIVE_ARTIFACTS.get(version_form(config_text), "model.onnx")


# `optimization { graph { level } }` as Triton's onnxruntime backend reads it (src/onnxruntime.cc): -1 basic,
# 1 extended, 2 disable (recent backends; older ones read 2 as all), anything else (or none) all.
ORT_BACKEND_GRAPH_LEVELS = {-1: "basic", 1: "extended", 2: "disable"}
ORT_BACKEND_LEVEL_VALUES = {"basic": -1, "extended": 1, "disable": 2, "all": 0}


def onnxruntime_backend_runtime(config_text: str) -> dict[str, Any]:
    """The session settings Triton's onnxruntime backend gives every version of the model, read from its
    config.pbtxt as the backend reads it, in the runtime-dict form ONNX Runtime in process takes
    (tuner.builders.ort.session_options).

    Not modelled (the backend on the serving host may differ here):
      - the ONNX Runtime release: Triton links its own; in process it is the installed package;
      - the execution provider: an instance of kind GPU (or with no instance_group on a host with a GPU) runs
        CUDA, plus any `optimization { execution_accelerators }` (TensorRT, OpenVINO); in process it is CPU;
      - thread counts left unset (or 0) are ONNX Runtime's defaults on the host that runs the session; with the
        backend's global thread pool on (a backend option, not in config.pbtxt) the model's counts are ignored;
      - memory options (enable_mem_arena, enable_mem_pattern, ...) are not applied: they do not change outputs.
    The backend sets no `session.intra_op.allow_spinning` entry: intra-op threads spin (ONNX Runtime's default).
    """
    cfg = pbtxt.parse(config_text)
    level = ORT_BACKEND_GRAPH_LEVELS.get(cfg.optimization.graph.level, "all")
    params = {str(k): str(v.string_value) for k, v in cfg.parameters.items()}

    def number(key: str) -> int:
        value = params.get(key, "0").strip()
        if not value.lstrip("-").isdigit():
            raise RepositoryError(f"config.pbtxt parameter {key}: {value!r} is not a number")
        return max(int(value), 0)

    mode = number("execution_mode")
    if mode not in (0, 1):
        raise RepositoryError(f"config.pbtxt parameter execution_mode: {mode} is neither 0 nor 1")
    return {
        "format": "onnx",
        "artifact": native_artifact_name(config_text),
        "providers": ["CPUExecutionProvider"],
        "session": {
            "graph_optimization_level": level,
            "intra_op_num_threads": number("intra_op_thread_count"),
            "inter_op_num_threads": number("inter_op_thread_count"),
            "execution_mode": "parallel" if mode == 1 else "sequential",
        },
        "config_entries": {},
    }


def onnxruntime_backend_settings(session: Mapping[str, Any]) -> dict[str, Any]:
    """The config.pbtxt settings (in Triton's JSON config form) under which the onnxruntime backend runs a session
    with these settings: the inverse of onnxruntime_backend_runtime for what it reads."""
    parallel = session.get("execution_mode") == "parallel"
    params = {
        "execution_mode": "1" if parallel else "0",
        "intra_op_thread_count": str(int(session.get("intra_op_num_threads", 0))),
    }
    if parallel:
        params["inter_op_thread_count"] = str(int(session.get("inter_op_num_threads", 0)))
    level = ORT_BACKEND_LEVEL_VALUES[str(session.get("graph_optimization_level", "all"))]
    return {
        "parameters": {k: {"string_value": v} for k, v in params.items()},
        "optimization": {"graph": {"level": level}},
    }


def parse_version_policy(config_text: str) -> tuple[int, ...] | None:
    """The `specific` versions in a config.pbtxt, or None when it has no specific policy (read by Triton's
    protobuf: tunegate.pbtxt). A config the protobuf cannot parse raises ConfigTextError (a ValueError)."""
    return pbtxt.specific_versions(config_text)


def set_version_policy(config_text: str, versions_: Sequence[int]) -> str:
    """Rewrite (or add) `version_policy: { specific: { versions: [...] } }` in config.pbtxt text."""
    return pbtxt.with_version_policy(config_text, versions_)
