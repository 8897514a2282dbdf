"""The TensorRT 11 builder, written against the real TensorRT Python API (`import tensorrt as trt`).

Where `tensorrt` cannot be imported (a CPU-only machine, or the PyPI `tensorrt-*-libs` wheels, which
are placeholders that download the libraries from NVIDIA's index at install time), `available()` says
so and the builder contributes no route; there is no fake `tensorrt` module anywhere. On a GPU host with TensorRT 11 it builds
`model.plan` for Triton's `platform: "tensorrt_plan"`.

Knobs:
  opt_level    IBuilderConfig.builder_optimization_level        0..5
  tiling       IBuilderConfig.tiling_optimization_level         none|fast|moderate|full
  build_route  IBuilderConfig.build_route                       default | rN = the N-th of
               config.all_build_routes (the routes exist only at build time, so knob values index them)
  timing_cache [search.options].timing_cache: a file shared by all builds (loaded, extended, saved back)

API names confirmed against the TensorRT 11.4 C++ reference (IBuilderConfig::getAllBuildRoutes,
getBuildRoute, setBuilderOptimizationLevel, setTilingOptimizationLevel, createTimingCache). The
Python spellings `config.build_route` and `config.all_build_routes` follow the bindings' usual
property naming and could not be confirmed here from a Python reference page.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from tunegate.records import atomic_write_bytes
from tuner.builders.base import Artifact, BuildContext, Builder, BuildError, Runner
from tuner.routes import Knob

UNAVAILABLE = (
    "the tensorrt Python package is not installed (TensorRT 11 needs an NVIDIA GPU host; the PyPI -libs "
    "wheels are placeholders that download the libraries from NVIDIA's index)"
)


def _trt() -> Any:
    import tensorrt as trt

    return trt


class TensorRTBuilder(Builder):
    name = "tensorrt"
    knobs = (
        Knob(
            "opt_level",
            ("0", "1", "2", "3", "4", "5"),
            "3",
            "builder_optimization_level (higher: longer build, faster kernels)",
        ),
        Knob(
            "tiling",
            ("none", "fast", "moderate", "full"),
            "none",
            "tiling_optimization_level (L2 cache tiling search)",
        ),
        Knob(
            "build_route",
            ("default", *(f"r{i}" for i in range(8))),
            "default",
            "config.build_route: default, or rN = the N-th entry of config.all_build_routes",
        ),
    )

    def available(self) -> tuple[bool, str]:
        try:
            trt = _trt()
        except ModuleNotFoundError as exc:
            if exc.name != "tensorrt":  # tensorrt is there, something it needs is not
                return False, f"tensorrt cannot be imported: {exc}"
            return False, UNAVAILABLE
        except ImportError as exc:  # a library it loads (libnvinfer, CUDA) is missing or the wrong version
            return False, f"tensorrt cannot be imported: {exc}"
        major = int(str(trt.__version__).split(".")[0])
        if major < 11:
            return (
                False,
                f"TensorRT {trt.__version__} is installed; this builder needs TensorRT 11 (build routes)",
            )
        return True, f"tensorrt {trt.__version__}"

    def tool_versions(self) -> dict[str, str]:
        with contextlib.suppress(ImportError):
            return {"tensorrt": str(_trt().__version__)}
        return {}

    def build(self, source: Path, route: Mapping[str, str], out: Path, ctx: BuildContext) -> Artifact:
        trt = _trt()
        logger = trt.Logger(trt.Logger.WARNING)
        builder = trt.Builder(logger)
        # TensorRT 11 networks are strongly typed (precision comes from the ONNX graph); 0 = no extra flags.
        network = builder.create_network(0)
        parser = trt.OnnxParser(network, logger)
        if not parser.parse_from_file(str(source)):
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise BuildError(f"ONNX parser: {errors}")
        config = builder.create_builder_config()
        config.builder_optimization_level = int(route.get("opt_level", "3"))
        config.tiling_optimization_level = {
            "none": trt.TilingOptimizationLevel.NONE,
            "fast": trt.TilingOptimizationLevel.FAST,
            "moderate": trt.TilingOptimizationLevel.MODERATE,
            "full": trt.TilingOptimizationLevel.FULL,
        }[route.get("tiling", "none")]
        chosen = route.get("build_route", "default")
        if chosen != "default":
            routes = list(config.all_build_routes)
            idx = int(chosen[1:])
            if idx >= len(routes):
                raise BuildError(f"build_route {chosen}: this TensorRT offers {len(routes)} routes: {routes}")
            config.build_route = routes[idx]
        self._profile(builder, network, config, ctx)
        cache_path = ctx.options.get("timing_cache")
        cache = config.create_timing_cache(
            Path(cache_path).read_bytes() if cache_path and Path(cache_path).exists() else b""
        )
        config.set_timing_cache(cache, ignore_mismatch=False)
        plan = builder.build_serialized_network(network, config)
        if plan is None:
            raise BuildError("builder.build_serialized_network returned None (see the build log)")
        (out / "model.plan").write_bytes(bytes(plan))
        if cache_path:
            atomic_write_bytes(Path(cache_path), bytes(config.get_timing_cache().serialize()))
        meta = {"build_route": chosen, "layers": network.num_layers}
        return Artifact(
            out, "tensorrt-plan", "model.plan", {"format": "tensorrt-plan", "artifact": "model.plan"}, meta
        )

    def _profile(self, builder: Any, network: Any, config: Any, ctx: BuildContext) -> None:
        """One optimisation profile spanning the spec's smallest and largest input shapes."""
        batches = ctx.calibration_batches() if ctx.calibration else []
        if not batches:
            return
        profile = builder.create_optimization_profile()
        for i in range(network.num_inputs):
            name = network.get_input(i).name
            shapes = [b[name].shape for b in batches if name in b]
            lo = tuple(int(min(s[d] for s in shapes)) for d in range(len(shapes[0])))
            hi = tuple(int(max(s[d] for s in shapes)) for d in range(len(shapes[0])))
            profile.set_shape(name, lo, hi, hi)
        config.add_optimization_profile(profile)

    def load(self, artifact: Artifact) -> Runner:
        import torch  # CUDA buffers; TensorRT has no host-side runner

        trt = _trt()
        engine = trt.Runtime(trt.Logger(trt.Logger.WARNING)).deserialize_cuda_engine(
            artifact.path.read_bytes()
        )
        context = engine.create_execution_context()
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        outputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]

        def run(feeds: Mapping[str, npt.NDArray[Any]]) -> dict[str, npt.NDArray[Any]]:
            keep = []
            for name in names:
                if name in feeds:
                    t = torch.from_numpy(np.ascontiguousarray(feeds[name])).cuda()
                    context.set_input_shape(name, tuple(t.shape))
                    context.set_tensor_address(name, t.data_ptr())
                    keep.append(t)
            result = {}
            for name in outputs:
                dtype = torch.from_numpy(np.zeros(1, dtype=trt.nptype(engine.get_tensor_dtype(name)))).dtype
                t = torch.empty(tuple(context.get_tensor_shape(name)), dtype=dtype, device="cuda")
                context.set_tensor_address(name, t.data_ptr())
                result[name] = t
            stream = torch.cuda.current_stream()
            if not context.execute_async_v3(stream.cuda_stream):
                raise RuntimeError("TensorRT execute_async_v3 failed")
            stream.synchronize()
            return {n: t.cpu().numpy() for n, t in result.items()}

        return run

    def version_files(self, artifact: Artifact) -> dict[str, Path | bytes | str]:
        # Served by platform "tensorrt_plan": the model's config.pbtxt must be of that form.
        return {"model.plan": artifact.path}
