"""Triton python-backend model: runs the ONNX file of this version with ONNX Runtime.

Written by tunegate into each version directory. Session options come from `runtime.json` beside
this file, so the route a version was built with is the route it serves with. It imports only
numpy and onnxruntime (and Triton's utils), nothing from tunegate.
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


def session_options(runtime):
    so = ort.SessionOptions()
    sess = runtime.get("session", {})
    so.graph_optimization_level = _LEVELS[sess.get("graph_optimization_level", "all")]
    so.intra_op_num_threads = int(sess.get("intra_op_num_threads", 1))
    so.inter_op_num_threads = int(sess.get("inter_op_num_threads", 1))
    so.execution_mode = (
        ort.ExecutionMode.ORT_PARALLEL if sess.get("execution_mode") == "parallel" else ort.ExecutionMode.ORT_SEQUENTIAL
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
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.input_types = {i.name: i.type for i in self.session.get_inputs()}
        self.output_names = [o["name"] for o in self.config["output"]]
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
                    feeds[name] = t.as_numpy()
                outs = self.session.run(self.output_names, feeds)
                if self.delay_s:
                    time.sleep(self.delay_s)
                tensors = [pb_utils.Tensor(n, np.ascontiguousarray(o)) for n, o in zip(self.output_names, outs)]
                responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
            except Exception as exc:  # one bad request must not take the batch down
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(exc))))
        return responses
