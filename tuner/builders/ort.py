"""The ONNX Runtime builder: graph transforms on the ONNX (fusion, fp16, int8) plus session options.

Knobs:
  opt      session graph optimization level            disable|basic|extended|all
  fusion   onnxruntime.transformers optimizer          none|bert
  quant    precision / quantisation of the graph        fp32|fp16|int8-tensor|int8-channel|
                                                        int8-channel-keepffn|int8-matmul|int8-static
  threads  intra-op threads                             1|2|4|8
  exec     execution mode (parallel: inter-op = threads) sequential|parallel

`int8-channel-keepffn` keeps the nodes matching `[search.options].keep_fp32_nodes` in fp32 (by
default the BERT FFN down-projections `layer.N/output/dense`, measured as the sensitive ones on
MiniLM); `int8-matmul` quantises MatMul only; `int8-static` calibrates QDQ int8 on the spec's inputs.

For a model served by Triton's native onnxruntime backend (BuildContext.form "onnxruntime") the version is one
`model.onnx` and nothing else: the graph rewrites are baked into it (ONNX Runtime's own optimizations saved
offline, at the portable level only: see `bake_level`), and `opt`, `threads` and `exec` are session settings
that the backend takes from config.pbtxt, per model (tunegate.repository.onnxruntime_backend_settings).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from tunegate.repository import DEFAULT_RUNTIME, onnx_version_files
from tuner.builders.base import Artifact, BuildContext, Builder, BuildError, Runner
from tuner.routes import Knob

DEFAULT_KEEP_FP32 = (r"layer\.\d+/output/dense",)
INT8 = ("int8-tensor", "int8-channel", "int8-channel-keepffn", "int8-matmul", "int8-static")


def _level(name: str) -> Any:
    import onnxruntime as ort

    return {
        "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }[name]


def session_options(runtime: Mapping[str, Any]) -> Any:
    """ORT session options from a runtime dict, as tunegate/templates/onnx_model.py reads it in Triton."""
    import onnxruntime as ort

    sess = runtime.get("session", {})
    so = ort.SessionOptions()
    so.graph_optimization_level = _level(sess.get("graph_optimization_level", "all"))
    so.intra_op_num_threads = int(sess.get("intra_op_num_threads", 1))
    so.inter_op_num_threads = int(sess.get("inter_op_num_threads", 1))
    parallel = sess.get("execution_mode") == "parallel"
    so.execution_mode = ort.ExecutionMode.ORT_PARALLEL if parallel else ort.ExecutionMode.ORT_SEQUENTIAL
    for key, value in runtime.get("config_entries", {}).items():
        so.add_session_config_entry(key, str(value))
    return so


def ort_runner(model_path: Path, runtime: Mapping[str, Any]) -> Runner:
    import onnxruntime as ort

    session = ort.InferenceSession(
        str(model_path),
        sess_options=session_options(runtime),
        providers=list(runtime.get("providers", ["CPUExecutionProvider"])),
    )
    names = [o.name for o in session.get_outputs()]
    wanted = {i.name for i in session.get_inputs()}

    def run(feeds: Mapping[str, npt.NDArray[Any]]) -> dict[str, npt.NDArray[Any]]:
        outs = session.run(names, {k: v for k, v in feeds.items() if k in wanted})
        return dict(zip(names, (np.asarray(o) for o in outs), strict=True))

    run.concurrent = True  # type: ignore[attr-defined]  # InferenceSession.run is thread-safe (tuner.gate.run_all)
    return run


def runtime_for(route: Mapping[str, str]) -> dict[str, Any]:
    rt = {
        **DEFAULT_RUNTIME,
        "session": dict(DEFAULT_RUNTIME["session"]),
        "config_entries": dict(DEFAULT_RUNTIME["config_entries"]),
    }
    threads = int(route.get("threads", "1"))
    rt["session"].update(
        graph_optimization_level=route.get("opt", "all"),
        intra_op_num_threads=threads,
        inter_op_num_threads=threads if route.get("exec") == "parallel" else 1,
        execution_mode=route.get("exec", "sequential"),
    )
    return rt


def native_runtime_for(route: Mapping[str, str]) -> dict[str, Any]:
    """The session Triton's onnxruntime backend runs the route's version with once config.pbtxt has the release's
    serving settings (tunegate.repository.onnxruntime_backend_runtime reads them back to this dict). Unlike the
    python backend's runtime.json it has no `session.intra_op.allow_spinning` entry: the backend sets none, so
    intra-op threads spin as ONNX Runtime's default has them."""
    rt = runtime_for(route)
    rt["config_entries"] = {}
    if rt["session"]["execution_mode"] != "parallel":
        rt["session"]["inter_op_num_threads"] = 0  # unused in sequential mode; the backend leaves it unset
    return rt


# What of ONNX Runtime's graph optimizations is baked into a native version's model.onnx. ONNX Runtime's docs
# (Graph Optimizations, online/offline mode): basic rewrites run before graph partitioning and hold for every
# execution provider; extended ones run after it, for the nodes the saving session put on its provider (the
# saved graph has CPU-only contrib ops such as FusedGemm, DynamicQuantizeMatMul); layout ones (level all) need a
# CPU like the one that saved them (e.g. AVX2). Baking at basic keeps model.onnx portable across CPUs and
# providers; the backend applies the rest online, at the level config.pbtxt gives it.
BAKE_LEVEL = "basic"


def bake_level(route: Mapping[str, str]) -> tuple[str | None, str]:
    """The level baked into a native version's model.onnx for `route`, or None; and why."""
    if route.get("opt", "all") == "disable":
        return None, "the route asks for no graph optimization"
    if route.get("quant", "fp32") == "fp16":
        # ONNX Runtime saves the Cast nodes it inserts around fp16 nodes the CPU provider has no kernel for:
        # baked, they would pin fp32 arithmetic on a GPU too.
        return None, "fp16: a graph optimized on the CPU provider keeps its fp32 casts"
    return BAKE_LEVEL, "portable across CPUs and execution providers (basic rewrites only)"


def bake(source: Path, dest: Path, level: str) -> None:
    """Save ONNX Runtime's graph optimizations up to `level` into `dest` (SessionOptions.optimized_model_filepath)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = _level(level)
    so.optimized_model_filepath = str(dest)
    ort.InferenceSession(str(source), sess_options=so, providers=["CPUExecutionProvider"])
    if not dest.is_file():
        raise BuildError(f"ONNX Runtime did not save the optimized model to {dest}")


class OrtBuilder(Builder):
    name = "onnxruntime"
    knobs = (
        Knob("opt", ("disable", "basic", "extended", "all"), "all", "ORT session graph optimization level"),
        Knob(
            "fusion",
            ("none", "bert"),
            "none",
            "transformer fusion with onnxruntime.transformers (Attention, LayerNorm, Gelu)",
        ),
        Knob(
            "quant",
            ("fp32", "fp16", *INT8),
            "fp32",
            "graph precision: fp16, dynamic int8 (per tensor/channel, "
            "keepffn: FFN down-projections fp32, matmul: MatMul only), static int8 (calibrated)",
        ),
        Knob("threads", ("1", "2", "4", "8"), "1", "intra-op threads"),
        Knob(
            "exec",
            ("sequential", "parallel"),
            "sequential",
            "execution mode (parallel runs independent nodes on inter-op threads)",
        ),
    )

    def available(self) -> tuple[bool, str]:
        try:
            import onnxruntime
        except ImportError as exc:  # pragma: no cover - a dependency of the package
            return False, f"onnxruntime is not installed ({exc})"
        return True, f"onnxruntime {onnxruntime.__version__}"

    def tool_versions(self) -> dict[str, str]:
        import onnx
        import onnxruntime

        return {"onnxruntime": onnxruntime.__version__, "onnx": onnx.__version__}

    def build(self, source: Path, route: Mapping[str, str], out: Path, ctx: BuildContext) -> Artifact:
        import onnx

        meta: dict[str, Any] = {}
        work = out / "stage"
        work.mkdir()
        current = source
        if route.get("fusion", "none") == "bert":
            current = self._fuse(current, work / "fused.onnx", ctx, meta)
        quant = route.get("quant", "fp32")
        if quant == "fp16":
            from onnxruntime.transformers.onnx_model import OnnxModel

            model = OnnxModel(onnx.load(str(current)))
            model.convert_float_to_float16(keep_io_types=True)
            model.save_model_to_file(str(work / "fp16.onnx"))
            current = work / "fp16.onnx"
        elif quant in INT8:
            current = self._quantize(current, quant, work, ctx, meta)
        final = out / "model.onnx"
        native = ctx.form == "onnxruntime"
        level, why = bake_level(route) if native else (None, "")
        if native:
            meta["baked"] = {"level": level, "why": why}
        if level is not None:
            bake(current, final, level)
        else:
            onnx.save(onnx.load(str(current)), str(final))
        for p in work.iterdir():
            p.unlink()
        work.rmdir()
        runtime = native_runtime_for(route) if native else runtime_for(route)
        return Artifact(out, "onnx", "model.onnx", runtime, meta)

    def _fuse(self, source: Path, dest: Path, ctx: BuildContext, meta: dict[str, Any]) -> Path:
        from onnxruntime.transformers import optimizer

        heads = int(ctx.options.get("num_heads", 0))
        hidden = int(ctx.options.get("hidden_size", 0))
        # opt_level=0: only the python fusions; the session's own level is the `opt` knob.
        model = optimizer.optimize_model(
            str(source), model_type="bert", num_heads=heads, hidden_size=hidden, opt_level=0
        )
        meta["fused"] = {k: int(v) for k, v in model.get_fused_operator_statistics().items() if v}
        model.save_model_to_file(str(dest))
        return dest

    def _quantize(
        self, source: Path, quant: str, work: Path, ctx: BuildContext, meta: dict[str, Any]
    ) -> Path:
        import onnx
        from onnxruntime.quantization import (
            QuantFormat,
            QuantType,
            quant_pre_process,
            quantize_dynamic,
            quantize_static,
        )

        pre = work / "pre.onnx"
        # A fused graph must not be re-optimised here (it would undo or break the fusion); auto_merge
        # lets symbolic shape inference merge the exported graph's Min(512, sequence) with sequence.
        try:
            quant_pre_process(str(source), str(pre), skip_optimization=True, auto_merge=True)
        except Exception as exc:  # noqa: BLE001 - symbolic inference gives up on some graphs; ONNX shapes suffice
            meta["pre_process"] = f"symbolic shape inference skipped: {exc}"
            quant_pre_process(str(source), str(pre), skip_optimization=True, skip_symbolic_shape=True)
        dest = work / "int8.onnx"
        exclude: list[str] = []
        if quant == "int8-channel-keepffn":
            patterns = [re.compile(p) for p in ctx.options.get("keep_fp32_nodes", DEFAULT_KEEP_FP32)]
            graph = onnx.load(str(pre), load_external_data=False).graph
            exclude = [
                n.name
                for n in graph.node
                if n.op_type in ("MatMul", "Gemm") and any(p.search(n.name) for p in patterns)
            ]
            if not exclude:
                raise BuildError(
                    f"int8-channel-keepffn: keep_fp32_nodes {[p.pattern for p in patterns]} matched no MatMul node"
                )
            meta["kept_fp32"] = exclude
        if quant == "int8-static":
            quantize_static(
                str(pre),
                str(dest),
                _Calibration(ctx.calibration_batches()),
                quant_format=QuantFormat.QDQ,
                per_channel=True,
                activation_type=QuantType.QInt8,
                weight_type=QuantType.QInt8,
            )
        else:
            quantize_dynamic(
                str(pre),
                str(dest),
                per_channel=quant != "int8-tensor",
                weight_type=QuantType.QInt8,
                nodes_to_exclude=exclude or None,
                op_types_to_quantize=["MatMul"] if quant == "int8-matmul" else None,
            )
        return dest

    def load(self, artifact: Artifact) -> Runner:
        return ort_runner(artifact.path, artifact.runtime)

    def version_files(self, artifact: Artifact) -> dict[str, Path | bytes | str]:
        return onnx_version_files(artifact.path, artifact.runtime)


class _Calibration:
    """onnxruntime.quantization's CalibrationDataReader over the spec's input batches."""

    def __init__(self, batches: list[dict[str, npt.NDArray[Any]]]) -> None:
        self._it = iter(batches)

    def get_next(self) -> dict[str, npt.NDArray[Any]] | None:
        return next(self._it, None)
