"""The builder interface: knobs, availability, a build in a child process, artifacts and an in-process runner.

A builder turns the source ONNX plus one route into artifact files (`build`, run in a child
process by `tuner.builders.worker` so a crash or hang fails that route only), says how to run
them in this process for the gate and the benchmark (`load`), and which files a Triton version
of them needs (`version_files`). It is generic over formats: ONNX Runtime writes `model.onnx`,
TensorRT `model.plan`, an Inductor builder `model.pt2`, each with its own runtime dict.
"""

from __future__ import annotations

import abc
import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Protocol

import numpy as np
import numpy.typing as npt

from tunegate.errors import ServiceError
from tunegate.records import atomic_write_bytes
from tuner.routes import Knob

ARTIFACT_JSON = "artifact.json"


class BuildError(ServiceError):
    """A route that could not be built; the message is what the cache and the report record."""


@dataclasses.dataclass(frozen=True)
class Artifact:
    """What a build produced: files in `directory`, their format and the runtime options to run them with."""

    directory: Path
    format: str  # onnx | tensorrt-plan | pt2 | ...
    primary: str  # the engine file (its sha256 goes into release.json)
    runtime: Mapping[str, Any]
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # builder notes (fused nodes, ...)

    @property
    def path(self) -> Path:
        return self.directory / self.primary

    def save(self) -> None:
        doc = {"format": self.format, "primary": self.primary, "runtime": self.runtime, "meta": self.meta}
        (self.directory / ARTIFACT_JSON).write_text(
            json.dumps(doc, indent=2, sort_keys=True, default=str) + "\n"
        )

    @classmethod
    def load(cls, directory: Path) -> Artifact:
        try:
            doc = json.loads((directory / ARTIFACT_JSON).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise BuildError(f"{directory}: no readable {ARTIFACT_JSON} ({exc})") from exc
        art = cls(Path(directory), doc["format"], doc["primary"], doc["runtime"], doc.get("meta", {}))
        if not art.path.is_file():
            raise BuildError(f"{directory}: artifact {art.primary} is missing")
        return art


@dataclasses.dataclass(frozen=True)
class BuildContext:
    """What a build may use beyond the source and the route (passed to the child as JSON)."""

    options: Mapping[str, Any]  # [search.options] of the spec
    calibration: Path | None = None  # npz of input batches (static quantisation)
    form: str = "python"  # what serves the version: `python` (backend) or a native backend (`onnxruntime`)

    def calibration_batches(self) -> list[dict[str, npt.NDArray[Any]]]:
        if self.calibration is None:
            raise BuildError("this route needs calibration inputs and none were given")
        return load_batches(self.calibration)


class Runner(Protocol):
    def __call__(self, feeds: Mapping[str, npt.NDArray[Any]]) -> dict[str, npt.NDArray[Any]]: ...


def save_batches(path: Path, batches: list[dict[str, npt.NDArray[Any]]]) -> None:
    """Input batches as one npz (written atomically: a build may read it after a kill)."""
    import io

    arrays = {f"{i:05d}/{name}": arr for i, feeds in enumerate(batches) for name, arr in feeds.items()}
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    atomic_write_bytes(path, buf.getvalue())


def load_batches(path: Path) -> list[dict[str, npt.NDArray[Any]]]:
    out: dict[int, dict[str, npt.NDArray[Any]]] = {}
    with np.load(path) as data:
        for key in data.files:
            idx, name = key.split("/", 1)
            out.setdefault(int(idx), {})[name] = data[key]
    return [out[i] for i in sorted(out)]


class Builder(abc.ABC):
    """One compiler's route space. Subclasses set `name` and `knobs` and implement the four methods."""

    name: ClassVar[str]
    knobs: ClassVar[tuple[Knob, ...]]

    def available(self) -> tuple[bool, str]:
        """(True, versions) when the toolchain can run here, else (False, why)."""
        return True, ""

    def route_knobs(self, expression: str) -> tuple[Knob, ...]:
        """The knobs a route expression is read against: `knobs`, unless the builder learns more from its tool."""
        return self.knobs

    def route_problem(self, route: Mapping[str, str]) -> str | None:
        """Why a route makes no sense for this builder (it is then skipped), or None."""
        return None

    @abc.abstractmethod
    def build(self, source: Path, route: Mapping[str, str], out: Path, ctx: BuildContext) -> Artifact:
        """Write the artifact files into `out` (runs in a child process)."""

    @abc.abstractmethod
    def load(self, artifact: Artifact) -> Runner:
        """A callable that runs the artifact in this process (the gate and the benchmark use it)."""

    @abc.abstractmethod
    def version_files(self, artifact: Artifact) -> dict[str, Path | bytes | str]:
        """The files of a Triton model version serving this artifact (for tunegate.repository.write_version)."""

    def tool_versions(self) -> dict[str, str]:
        return {}
