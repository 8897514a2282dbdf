"""What serves the model's versions, as its config.pbtxt says (its form): the python backend or Triton's onnxruntime backend.

  python       a version is model.onnx, runtime.json (its session settings) and model.py, which runs ONNX
               Runtime inside Triton's python backend; every knob of a route travels with the version.
  onnxruntime  a version is model.onnx alone, served by Triton's native onnxruntime backend. The route's graph
               transforms (fusion, quantization) and ONNX Runtime's portable graph optimizations are baked into
               it (tuner.builders.ort.bake_level); its session settings (optimization level, threads, execution
               mode) are config.pbtxt's, per model and not per version. The tuner never edits config.pbtxt: the
               settings a winner was gated and timed with go into release.json's `serving`, with what they change,
               for the canary to release as a serving-configuration change.

For the onnxruntime form the gate and the benchmark run the baked model.onnx in ONNX Runtime in process with the
session the backend gives it under those settings (tunegate.repository.onnxruntime_backend_runtime says what is
not modelled: the ONNX Runtime release Triton links, a GPU provider, default thread counts on another host).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from tunegate.repository import (
    RepositoryError,
    native_artifact_name,
    native_version_files,
    onnxruntime_backend_runtime,
    onnxruntime_backend_settings,
    version_form,
)
from tunegate.serving import Serving
from tuner.builders import Artifact, Builder
from tuner.result import TuneError

# The embedded Triton here has the python backend only; serving a native version through it would time the
# python backend, not the native one.
NATIVE_E2E_SKIPPED = (
    "not served end to end: the embedded Triton has only the python backend, and a native onnxruntime version "
    "is served by Triton's onnxruntime backend"
)


@dataclasses.dataclass(frozen=True)
class Form:
    form: str  # release.json's `form`: python | onnxruntime (or the backend/platform config.pbtxt names)
    config_text: str

    @classmethod
    def read(cls, config: Path) -> Form:
        text = config.read_text()
        return cls(version_form(text), text)

    @property
    def native(self) -> bool:
        return self.form == "onnxruntime"

    def check(self, builder: Builder) -> None:
        if self.native and builder.name != "onnxruntime":
            raise TuneError(
                f"the model's config.pbtxt serves it with Triton's onnxruntime backend: its versions are ONNX "
                f'models, which the {builder.name} builder does not build (use backend = "onnxruntime")'
            )

    def baseline_runtime(self, version_dir: Path) -> dict[str, Any]:
        """The baseline's session settings: config.pbtxt's (onnxruntime) or the version's runtime.json (python)."""
        if self.native:
            try:
                return onnxruntime_backend_runtime(self.config_text)
            except RepositoryError as exc:
                raise TuneError(f"{version_dir.parent / 'config.pbtxt'}: {exc}") from exc
        path = version_dir / "runtime.json"
        if not path.is_file():
            raise TuneError(
                f"{version_dir}: no runtime.json; the tuner measures python-onnx baselines in process"
            )
        try:
            runtime = json.loads(path.read_text())
        except ValueError as exc:
            raise TuneError(f"{path} is not a JSON object: {exc}") from exc
        if not isinstance(runtime, dict):
            raise TuneError(f"{path} is not a JSON object")
        return runtime

    def version_files(self, builder: Builder, artifact: Artifact) -> dict[str, Path | bytes | str]:
        if self.native:
            return native_version_files(self.form, artifact.path, native_artifact_name(self.config_text))
        return builder.version_files(artifact)

    def release_fields(self, artifact: Artifact) -> dict[str, Any]:
        """release.json's `form` and, for the onnxruntime form, `serving`: the config.pbtxt settings the version was
        gated and timed with (Triton's JSON config form) and those that differ from the config now."""
        if not self.native:
            return {"form": self.form}
        wanted = onnxruntime_backend_settings(artifact.runtime.get("session", {}))
        now = onnxruntime_backend_settings(onnxruntime_backend_runtime(self.config_text)["session"])
        changes = {
            f"parameters.{k}": {
                "now": now["parameters"].get(k, {}).get("string_value"),
                "wanted": v["string_value"],
            }
            for k, v in wanted["parameters"].items()
            if now["parameters"].get(k) != v
        }
        level_now, level_wanted = (
            now["optimization"]["graph"]["level"],
            wanted["optimization"]["graph"]["level"],
        )
        if level_now != level_wanted:
            changes["optimization.graph.level"] = {"now": level_now, "wanted": level_wanted}
        serving = Serving(
            parameters={k: v["string_value"] for k, v in wanted["parameters"].items()},
            graph_level=int(level_wanted),
        )
        return {
            "form": "onnxruntime",
            # What the canary serves the candidate with and promotion writes into config.pbtxt (tunegate.serving).
            "serving": serving.to_dict(),
            "serving_changes": {
                "changes": changes,
                "note": (
                    "per-model settings of config.pbtxt (every version runs under them), not written by the tuner: "
                    "the gate and the benchmark ran this model.onnx under them, in ONNX Runtime in process; the "
                    "canary's shadow serves the version under them and promotion writes them into config.pbtxt; "
                    "'now' is the config's value read as the backend reads it (thread count 0: ONNX Runtime's default)"
                ),
            },
        }
