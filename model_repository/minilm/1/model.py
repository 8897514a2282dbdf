"""Triton python-backend model: runs the ONNX file of this version with ONNX Runtime.

Written by tunegate into each version directory. Session options come from `runtime.json` beside
this file, so the route a version was built with is the route it serves with. It imports only
numpy and onnxruntime (and Triton's utils), nothing from tunegate.

Inputs cross the python-backend stub through DLPack, not as numpy arrays. Outputs go as numpy arrays
with numpy 1.x; with numpy 2 through torch's DLPack: the stub's pybind11 (Triton 2.51) misreads numpy 2
arrays (on the H200 image, numpy 2.5, every numpy output fails with "output tensor shape does not
match size of output"; a numpy round trip inside the stub looks fine, so no load-time probe can tell).
A numpy array itself cannot go to `Tensor.from_dlpack`: the stub renames a consumed capsule
"used_dlpack", not the spec's "used_dltensor", and numpy's capsule destructor then kills the stub.
With numpy 2 and no torch, outputs go as numpy with a warning at load (right on stubs built for numpy 2;
on Triton 2.51 every request then fails loudly, never silently). BYTES tensors go as numpy.
`python -m benchmarks.gpu.stub_interop` shows what a given image gets right.
"""

import json
import os
import time

import numpy as np
import onnxruntime as ort
import triton_python_backend_utils as pb_utils

_LEVELS = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


def to_numpy(tensor, is_bytes):
    return tensor.as_numpy() if is_bytes else np.from_dlpack(tensor)


def numpy_output(name, array, is_bytes):
    return pb_utils.Tensor(name, np.ascontiguousarray(array))


def output_maker():
    """How outputs are handed to the stub: numpy with numpy 1.x, torch's DLPack with numpy 2 (see the docstring)."""
    if int(np.__version__.split(".")[0]) < 2:
        return numpy_output
    try:
        import torch
        from torch.utils.dlpack import to_dlpack

        to_dlpack(
            torch.from_numpy(np.zeros(1, dtype=np.float32))
        )  # usable with this numpy, not just importable
    except Exception as exc:  # ImportError, or a torch built for another numpy  # noqa: BLE001
        pb_utils.Logger.log_warn(
            f"numpy {np.__version__} without a usable torch ({exc!r}): outputs go to the stub as numpy arrays, "
            "which Triton 2.51's python backend misreads (install torch beside the model, or numpy<2)"
        )
        return numpy_output

    def torch_output(name, array, is_bytes):
        if is_bytes:
            return numpy_output(name, array, is_bytes)
        return pb_utils.Tensor.from_dlpack(name, to_dlpack(torch.from_numpy(np.ascontiguousarray(array))))

    return torch_output


def session_options(runtime):
    so = ort.SessionOptions()
    sess = runtime.get("session", {})
    so.graph_optimization_level = _LEVELS[sess.get("graph_optimization_level", "all")]
    so.intra_op_num_threads = int(sess.get("intra_op_num_threads", 1))
    so.inter_op_num_threads = int(sess.get("inter_op_num_threads", 1))
    so.execution_mode = (
        ort.ExecutionMode.ORT_PARALLEL
        if sess.get("execution_mode") == "parallel"
        else ort.ExecutionMode.ORT_SEQUENTIAL
    )
    for key, value in runtime.get("config_entries", {}).items():
        so.add_session_config_entry(key, str(value))
    return so


class TritonPythonModel:
    def initialize(self, args):
        here = os.path.join(args["model_repository"], args["model_version"])
        with open(os.path.join(here, "runtime.json")) as f:
            runtime = json.load(f)
        self.config = json.loads(args["model_config"])
        self.session = ort.InferenceSession(
            os.path.join(here, runtime.get("artifact", "model.onnx")),
            sess_options=session_options(runtime),
            providers=runtime.get("providers", ["CPUExecutionProvider"]),
        )
        self.to_triton = output_maker()
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.input_types = {i.name: i.type for i in self.session.get_inputs()}
        self.output_names = [o["name"] for o in self.config["output"]]
        self.bytes_tensors = {
            t["name"]
            for t in self.config.get("input", []) + self.config["output"]
            if t["data_type"] == "TYPE_STRING"
        }
        # Test hook for deliberately slow candidates (see tests); 0 in every real version.
        self.delay_s = float(runtime.get("debug_delay_ms", 0)) / 1000.0

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                feeds = {}
                for name in self.input_names:
                    t = pb_utils.get_input_tensor_by_name(request, name)
                    if t is None:
                        raise pb_utils.TritonModelException(f"missing input {name!r}")
                    feeds[name] = to_numpy(t, name in self.bytes_tensors)
                outs = self.session.run(self.output_names, feeds)
                if self.delay_s:
                    time.sleep(self.delay_s)
                tensors = [
                    self.to_triton(n, o, n in self.bytes_tensors) for n, o in zip(self.output_names, outs)
                ]
                responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
            except Exception as exc:  # noqa: BLE001 - one bad request must not take the batch down
                responses.append(
                    pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(exc)))
                )
        return responses
