"""The PyTorch/Inductor builder: a torch model exported with torch.export, compiled and packaged by AOTInductor.

The source ONNX fixes the interface (input names, dtypes, symbolic axes; output names) and is
what the reference runs; the implementation comes from a torch model factory named in
`[search.options].torch_model = "package.module:function"` (called with no arguments, seeded,
returning a module whose forward takes the ONNX inputs in order). The ONNX is exported from the
same factory, so a factory that disagrees with it fails the accuracy gate, not silently.

Knobs (GPU; on CPU, routes that need CUDA are skipped with the reason):
  dtype        fp32 | tf32 (fp32 weights, TF32 matmuls) | bf16 | fp16 (weights and compute; I/O stays fp32)
  mode         torch.compile mode mapped onto Inductor options: default | max-autotune |
               max-autotune-no-cudagraphs (GEMM autotuning + coordinate-descent tuning)
  cudagraphs   auto (the mode says) | on | off: AOTInductor has no CUDA graphs of its own, so the
               runtime captures one per input shape (tunegate/templates/pt2_model.py)
  epilogue     Inductor epilogue_fusion on | off
  coord        coordinate_descent_tuning auto (the mode says) | on | off
  gemm         max_autotune_gemm_backends default | aten | triton | aten-triton (max-autotune only)
  freezing     Inductor freezing (weights as constants, constant folding) off | on

The artifact is `model.pt2` (aoti_compile_and_package) plus a runtime dict (device, tf32,
cudagraphs, input and output names) that the Triton model and the in-process runner share.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tuner.builders.base import Artifact, BuildContext, Builder, BuildError, Runner
from tuner.inputs import describe_inputs
from tuner.routes import Knob

PT2_MODEL_PY = Path(__file__).resolve().parents[2] / "tunegate" / "templates" / "pt2_model.py"
CUDA_ONLY_DTYPES = ("tf32", "fp16")
GEMM_BACKENDS = {"aten": "ATEN", "triton": "TRITON", "aten-triton": "ATEN,TRITON"}
EXAMPLE_BATCH = 2  # export example sizes for symbolic axes: not 0 or 1, which torch.export specialises
EXAMPLE_SEQUENCE = 16


def _on(value: str) -> bool:
    return value == "on"


def inductor_configs(route: Mapping[str, str]) -> dict[str, Any]:
    """Inductor options for a route (the mode's options, then the knobs that override them)."""
    mode = route.get("mode", "default")
    cfg: dict[str, Any] = {}
    if mode != "default":
        cfg["max_autotune"] = True
        cfg["coordinate_descent_tuning"] = True
    if route.get("coord", "auto") != "auto":
        cfg["coordinate_descent_tuning"] = _on(route["coord"])
    cfg["epilogue_fusion"] = _on(route.get("epilogue", "on"))
    if route.get("gemm", "default") != "default":
        cfg["max_autotune_gemm_backends"] = GEMM_BACKENDS[route["gemm"]]
    if _on(route.get("freezing", "off")):
        cfg["freezing"] = True
    return cfg


def wants_cudagraphs(route: Mapping[str, str]) -> bool:
    value = route.get("cudagraphs", "auto")
    if value == "auto":
        return route.get("mode", "default") == "max-autotune"  # as torch.compile's list_mode_options says
    return value == "on"


def load_factory(ref: str) -> Any:
    """The callable named `module:function` (the project root is on the child's path)."""
    module, _, attr = ref.partition(":")
    if not module or not attr:
        raise BuildError(f"[search.options].torch_model {ref!r}: expected 'package.module:function'")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise BuildError(f"[search.options].torch_model {ref!r}: cannot import ({exc})") from exc


def onnx_interface(source: Path) -> tuple[list[Any], list[str]]:
    """The source ONNX's inputs (tuner.inputs.InputDesc) and output names."""
    import onnx

    try:
        outputs = [o.name for o in onnx.load(str(source), load_external_data=False).graph.output]
        return describe_inputs(source), outputs
    except Exception as exc:
        raise BuildError(f"{source}: cannot read the source ONNX's interface ({exc})") from exc


def _load_template() -> Any:
    spec = importlib.util.spec_from_file_location("tunegate_pt2_model", PT2_MODEL_PY)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


class InductorBuilder(Builder):
    name = "inductor"
    knobs = (
        Knob(
            "dtype",
            ("fp32", "tf32", "bf16", "fp16"),
            "fp32",
            "precision of weights and compute (I/O stays fp32)",
        ),
        Knob(
            "mode",
            ("default", "max-autotune", "max-autotune-no-cudagraphs"),
            "default",
            "torch.compile mode as Inductor options (GEMM autotuning, coordinate-descent tuning)",
        ),
        Knob(
            "cudagraphs",
            ("auto", "on", "off"),
            "auto",
            "replay each input shape from a CUDA graph (auto: the mode says)",
        ),
        Knob(
            "epilogue",
            ("on", "off"),
            "on",
            "Inductor epilogue_fusion (fuse pointwise ops into GEMM epilogues)",
        ),
        Knob(
            "coord",
            ("auto", "on", "off"),
            "auto",
            "coordinate_descent_tuning of Triton kernel configs (auto: the mode says)",
        ),
        Knob(
            "gemm",
            ("default", *GEMM_BACKENDS),
            "default",
            "max_autotune_gemm_backends (with max-autotune only)",
        ),
        Knob("freezing", ("off", "on"), "off", "Inductor freezing: weights as constants, constant folding"),
    )

    def available(self) -> tuple[bool, str]:
        try:
            import torch
            import torch._inductor
        except ImportError as exc:
            return False, f"torch is not installed ({exc})"
        if not hasattr(torch._inductor, "aoti_compile_and_package"):
            return False, f"torch {torch.__version__} has no AOTInductor packaging (needs torch >= 2.6)"
        if shutil.which(os.environ.get("CXX", "g++")) is None and shutil.which("c++") is None:
            return False, "AOTInductor needs a C++ compiler (g++) and none is on PATH"
        if torch.cuda.is_available():
            return (
                True,
                f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}",
            )
        return (
            True,
            f"torch {torch.__version__} on CPU only (no CUDA device): dtype fp32|bf16, mode default, no CUDA graphs",
        )

    def tool_versions(self) -> dict[str, str]:
        import torch

        versions = {"torch": str(torch.__version__)}
        if torch.cuda.is_available():
            versions["cuda"] = str(torch.version.cuda)
            versions["gpu"] = torch.cuda.get_device_name(0)
        with contextlib.suppress(ImportError):
            import triton

            versions["triton"] = str(triton.__version__)
        return versions

    def route_problem(self, route: Mapping[str, str]) -> str | None:
        mode, graphs = route.get("mode", "default"), route.get("cudagraphs", "auto")
        if mode == "max-autotune-no-cudagraphs" and graphs == "on":
            return "mode max-autotune-no-cudagraphs with cudagraphs=on is mode max-autotune"
        if mode == "max-autotune" and graphs == "off":
            return "mode max-autotune with cudagraphs=off is mode max-autotune-no-cudagraphs"
        if route.get("gemm", "default") != "default" and mode == "default":
            return "gemm backends are chosen by max-autotune only; with mode=default the knob does nothing"
        if not _cuda():
            if route.get("dtype", "fp32") in CUDA_ONLY_DTYPES:
                return f"dtype {route['dtype']} needs a CUDA device (this machine has none)"
            if mode != "default":
                return f"mode {mode} autotunes GPU kernels: needs a CUDA device (this machine has none)"
            if wants_cudagraphs(route):
                return "CUDA graphs need a CUDA device (this machine has none)"
        return None

    def build(self, source: Path, route: Mapping[str, str], out: Path, ctx: BuildContext) -> Artifact:
        problem = self.route_problem(route)
        if problem:
            raise BuildError(problem)
        ref = ctx.options.get("torch_model")
        if not ref:
            raise BuildError(
                "the inductor backend needs [search.options].torch_model = 'package.module:function'"
            )
        inputs, outputs = onnx_interface(source)
        # By default a private compile cache: the build cost is a cold build's and routes share no
        # kernels. `inductor_cache = "shared"` keeps Inductor's own cache (faster repeated builds, tests).
        fresh = ctx.options.get("inductor_cache", "fresh") != "shared"
        cache = out / ".inductor-cache"
        if fresh:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
            os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "0"
        import torch

        device = str(ctx.options.get("device", "cuda" if torch.cuda.is_available() else "cpu"))
        dtype = route.get("dtype", "fp32")
        tf32 = dtype == "tf32"
        if device.startswith("cuda"):
            torch.backends.cuda.matmul.allow_tf32 = tf32  # Inductor's Triton GEMMs read this at compile time
            torch.backends.cudnn.allow_tf32 = tf32
        compute = {
            "fp32": torch.float32,
            "tf32": torch.float32,
            "bf16": torch.bfloat16,
            "fp16": torch.float16,
        }[dtype]
        torch.manual_seed(0)
        t0 = time.perf_counter()
        try:
            model = load_factory(str(ref))()
        except BuildError:
            raise
        except Exception as exc:
            raise BuildError(f"torch_model {ref}: the factory raised {type(exc).__name__}: {exc}") from exc
        wrapped = _Precision(model, compute).to(device).eval()
        args, dynamic = _examples(inputs, device)
        try:
            with torch.inference_mode(False), torch.no_grad():
                # forward(*args): one varargs entry holding every input's dynamic axes
                program = torch.export.export(wrapped, args, dynamic_shapes=(dynamic,), strict=False)
        except Exception as exc:
            raise BuildError(f"torch.export failed: {type(exc).__name__}: {exc}") from exc
        export_s = time.perf_counter() - t0
        configs = inductor_configs(route)
        # A cold cache has no precompiled header to reuse: building one costs more than it saves.
        configs.setdefault("aot_inductor.precompile_headers", not fresh)
        configs.update(ctx.options.get("inductor_extra", {}))
        t1 = time.perf_counter()
        try:
            torch._inductor.aoti_compile_and_package(
                program, package_path=str(out / "model.pt2"), inductor_configs=dict(configs)
            )
        except Exception as exc:
            raise BuildError(f"AOTInductor compile failed: {type(exc).__name__}: {exc}") from exc
        compile_s = time.perf_counter() - t1
        shutil.rmtree(cache, ignore_errors=True)
        runtime = {
            "format": "pt2",
            "artifact": "model.pt2",
            "device": device,
            "dtype": dtype,
            "tf32": tf32,
            "cudagraphs": wants_cudagraphs(route) and device.startswith("cuda"),
            "inputs": [{"name": d.name, "dtype": str(d.dtype)} for d in inputs],
            "outputs": outputs,
        }
        if not device.startswith("cuda"):
            runtime["threads"] = int(ctx.options.get("threads", 1))
        meta = {
            "torch_model": ref,
            "inductor_configs": configs,
            "export_seconds": round(export_s, 3),
            "compile_seconds": round(compile_s, 3),
            "torch": str(torch.__version__),
        }
        return Artifact(out, "pt2", "model.pt2", runtime, meta)

    def load(self, artifact: Artifact) -> Runner:
        runner: Runner = _load_template().Pt2Runner(str(artifact.directory), dict(artifact.runtime))
        return runner

    def version_files(self, artifact: Artifact) -> dict[str, Path | bytes | str]:
        import json

        return {
            "model.pt2": artifact.path,
            "runtime.json": json.dumps(dict(artifact.runtime), indent=2, sort_keys=True) + "\n",
            "model.py": PT2_MODEL_PY.read_text(),
        }


def _examples(inputs: list[Any], device: str) -> tuple[tuple[Any, ...], tuple[dict[int, Any], ...]]:
    """Example tensors for torch.export and the dynamic axes: the ONNX's symbolic axes."""
    import numpy as np
    import torch

    gen = torch.Generator().manual_seed(0)
    args, dynamic = [], []
    for d in inputs:
        shape, dyn = [], {}
        for axis, dim in enumerate(d.dims):
            if isinstance(dim, int) and dim > 0:
                shape.append(dim)
            else:
                shape.append(EXAMPLE_BATCH if axis == 0 else EXAMPLE_SEQUENCE)
                dyn[axis] = torch.export.Dim.DYNAMIC
        dt = torch.from_numpy(np.zeros(0, dtype=d.dtype)).dtype
        if dt.is_floating_point:
            t = torch.randn(shape, generator=gen).to(dt)
        else:
            t = torch.ones(shape, dtype=dt)  # ids and masks: valid for any vocabulary, no padding
        args.append(t.to(device))
        dynamic.append(dyn)
    return tuple(args), tuple(dynamic)


def _precision_module() -> Any:
    import torch

    class Precision(torch.nn.Module):
        """Casts float inputs to the compute dtype and float outputs back to fp32, inside the exported graph."""

        def __init__(self, inner: torch.nn.Module, dtype: torch.dtype) -> None:
            super().__init__()
            self.inner = inner.to(dtype)
            self.dtype = dtype

        def forward(self, *args: torch.Tensor) -> Any:
            cast = [a.to(self.dtype) if a.is_floating_point() else a for a in args]
            out = self.inner(*cast)
            if isinstance(out, torch.Tensor):
                return out.float()
            return tuple(o.float() if o.is_floating_point() else o for o in out)

    return Precision


def _Precision(inner: Any, dtype: Any) -> Any:
    return _precision_module()(inner, dtype)
