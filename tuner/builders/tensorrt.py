"""The TensorRT 11 builder, written against the real TensorRT Python API (`import tensorrt as trt`).

Where `tensorrt` cannot be imported, `available()` says why and the builder contributes no route: either
there is no module named tensorrt (a CPU-only machine; PyPI's `tensorrt-*-libs` wheels are placeholders that
download the libraries from NVIDIA's index at install time), or the package is there but broken (a library it
loads, libnvinfer or CUDA, is missing or of the wrong version), and the message says which. There is no fake
`tensorrt` module anywhere. On a GPU host with TensorRT 11 it builds `model.plan` for Triton's
`platform: "tensorrt_plan"`.

Knobs:
  opt_level    IBuilderConfig.builder_optimization_level   0..5 (trtexec --builderOptimizationLevel)
  tiling       IBuilderConfig.tiling_optimization_level    none|fast|moderate|full = TilingOptimizationLevel
               NONE..FULL, 0..3 (trtexec --tilingOptimizationLevel)
  -<knob>      any knob of TensorRT's Global Performance Tuning database (`IBuilderConfig.all_build_routes`,
               `trtexec --helpBuildRoute`), named as TensorRT names it: `-kgen:codegen:cuda_tile=[0|1|2|3]`.
               The database is read where TensorRT runs, so these knobs exist only there; the ones a
               route names go, in the order named, into `IBuilderConfig.build_route`.
  timing_cache [search.options].timing_cache: a file shared by all builds (loaded, extended, saved back)

A trtexec route (`--setBuildRoute="-match_ragged_mha=off"`) or sweep (`--tuneBuildRoutes="-copy_ppg=[on|off]"`)
is a tunegate route expression as it stands. The route tunegate writes to release.json is `-opt_level=N
-tiling=L` and then the build route itself; `builder_notes` keeps `build_route` (the string given to
`IBuilderConfig.build_route`, which `trtexec --setBuildRoute` takes) and `trtexec` (the flags that build the
same route: the two levels are trtexec flags of their own, not build-route knobs). Unlike trtexec's `fast`, which starts from each knob's
database default, tunegate's starts from each sweep's first value: write the default first to get trtexec's
routes. The property and method names, the formats and the trtexec flags are in
`tuner.builders.trt_routes`, with where each was read; `builder_optimization_level` and
`tiling_optimization_level` are properties of IBuilderConfig in python/src/infer/pyCore.cpp of TensorRT 11.1
OSS. The builder is tested up to the TensorRT boundary (route parsing, the knob database, the config calls on
a stand-in with the documented attributes); no engine was built with it here.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from tunegate.records import atomic_write_bytes
from tuner.builders.base import Artifact, BuildContext, Builder, BuildError, Runner
from tuner.builders.trt_routes import KnobDatabase, parse_build_route
from tuner.routes import Knob, RouteError, read_expression

UNAVAILABLE = (
    "the tensorrt Python package is not installed (no module named tensorrt; TensorRT 11 needs an NVIDIA GPU "
    "host; the PyPI -libs wheels are placeholders that download the libraries from NVIDIA's index)"
)
STATIC_KNOBS = ("opt_level", "tiling")
TILING_LEVELS = {"none": 0, "fast": 1, "moderate": 2, "full": 3}  # TilingOptimizationLevel (NvInfer.h)


def _trt() -> Any:
    import tensorrt as trt

    return trt


def import_failure(exc: BaseException) -> str:
    """Why `import tensorrt` failed: not installed, or installed and broken (and how)."""
    if isinstance(exc, ModuleNotFoundError) and exc.name == "tensorrt":
        return UNAVAILABLE
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        how = f"the module {exc.name} it imports is missing"
    elif isinstance(exc, OSError) or ".so" in str(exc) or ".dll" in str(exc):
        how = "a library it loads (libnvinfer, CUDA) is missing or of the wrong version"
    else:
        how = "its import failed"
    return f"the tensorrt package is installed but cannot be imported: {how} ({type(exc).__name__}: {exc})"


def _all_build_routes(config: Any) -> str:
    routes = getattr(config, "all_build_routes", None)
    if not isinstance(routes, str):
        raise BuildError(
            "this TensorRT has no IBuilderConfig.all_build_routes (Global Performance Tuning came with 11.1)"
        )
    return routes


def configure(config: Any, route: Mapping[str, str], tiling_levels: Any) -> dict[str, str]:
    """Apply `route` to an IBuilderConfig; returns the builder notes (the build route it set, trtexec's flags).

    `tiling_levels` is `trt.TilingOptimizationLevel`. Database knobs are checked against the config's own
    `all_build_routes`, set as one `build_route` string and read back.
    """
    opt_level, tiling = route.get("opt_level", "3"), route.get("tiling", "none")
    config.builder_optimization_level = int(opt_level)
    config.tiling_optimization_level = getattr(tiling_levels, tiling.upper())
    named = {k: v for k, v in route.items() if k not in STATIC_KNOBS}
    notes = {"build_route": ""}
    if named:
        database = KnobDatabase.from_json(_all_build_routes(config))
        try:
            text = database.build_route(named)
            config.build_route = text
            back = str(config.build_route)
            taken = parse_build_route(back) == parse_build_route(text)
        except RouteError as exc:
            raise BuildError(str(exc)) from exc
        if not taken:
            raise BuildError(f"TensorRT did not take the build route {text!r}: build_route reads {back!r}")
        notes.update(build_route=text, tuner_version=database.tuner_version)
    flags = [f"--builderOptimizationLevel={opt_level}", f"--tilingOptimizationLevel={TILING_LEVELS[tiling]}"]
    if notes["build_route"]:
        flags.append(f"--setBuildRoute={notes['build_route']}")
    notes["trtexec"] = shlex.join(flags)
    return notes


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
    )

    def __init__(self, database: KnobDatabase | None = None) -> None:
        self._database = database

    def available(self) -> tuple[bool, str]:
        try:
            trt = _trt()
        except (ImportError, OSError) as exc:
            return False, import_failure(exc)
        major = int(str(trt.__version__).split(".")[0])
        if major < 11:
            return False, f"TensorRT {trt.__version__} is installed; this builder needs TensorRT 11"
        return True, f"tensorrt {trt.__version__}"

    def knob_database(self) -> KnobDatabase:
        """TensorRT's knob database, from a fresh IBuilderConfig (read once); BuildError where there is none."""
        if self._database is None:
            ok, why = self.available()
            if not ok:
                raise BuildError(why)
            trt = _trt()
            config = trt.Builder(trt.Logger(trt.Logger.WARNING)).create_builder_config()
            self._database = KnobDatabase.from_json(_all_build_routes(config))
        return self._database

    def route_knobs(self, expression: str) -> tuple[Knob, ...]:
        """opt_level and tiling, then the database knobs the expression names (in the order named)."""
        named = {k: v for k, v in read_expression(expression).items() if k not in STATIC_KNOBS}
        if not named:
            return self.knobs
        try:
            database = self.knob_database()
        except BuildError as exc:
            first = next(iter(named))
            raise RouteError(
                f"-{first} is a TensorRT knob and TensorRT's knob database is not here: {exc}"
            ) from exc
        return self.knobs + database.knobs_for(named)

    def tool_versions(self) -> dict[str, str]:
        try:
            trt = _trt()
        except (ImportError, OSError):
            return {}
        versions = {"tensorrt": str(trt.__version__)}
        if self._database is not None:
            versions["tensorrt_tuner"] = self._database.tuner_version
        return versions

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
        notes = configure(config, route, trt.TilingOptimizationLevel)
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
        meta = {**notes, "layers": network.num_layers}
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
