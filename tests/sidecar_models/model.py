"""Test model for the sidecar (python backend, numpy only): y = 2x, with a behaviour from behaviour.json.

behaviour.json beside this file: {"noise": 0.0, "scale": 2.0, "delay_ms": 0, "work": 0, "fail": false,
"nan": false, "load_s": 0, "unload_s": 0} (the last two: seconds that initialize() and finalize() take, as a big engine's would).
"work_rows": {"16": 300000} sets the work for requests of that many rows (a shape slower than the others).
"alloc_mb": 0 makes an instance hold that many MiB from load on. "no_output": true answers 200 without an output (an
answer the canary cannot compare with). A version without behaviour.json fails to load (used to make a promotion
fail).
"""

import json
import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        here = os.path.join(args["model_repository"], args["model_version"])
        with open(os.path.join(here, "behaviour.json")) as f:
            b = json.load(f)
        self.scale = float(b.get("scale", 2.0))
        self.noise = float(b.get("noise", 0.0))
        self.delay_s = float(b.get("delay_ms", 0)) / 1000.0
        self.work = int(
            b.get("work", 0)
        )  # CPU work per request: iterations of a busy loop (delay_ms only sleeps)
        self.work_rows = {int(k): int(v) for k, v in b.get("work_rows", {}).items()}
        self.fail = bool(b.get("fail", False))
        self.nan = bool(b.get("nan", False))
        self.no_output = bool(b.get("no_output", False))
        self.rng = np.random.default_rng(0)
        self.unload_s = float(b.get("unload_s", 0))
        # "alloc_mb": memory the instance holds from load on (written, so it is resident), as a bigger model's would
        self.ballast = np.ones(int(b.get("alloc_mb", 0)) << 20, dtype=np.uint8)
        time.sleep(float(b.get("load_s", 0)))

    def finalize(self):
        time.sleep(self.unload_s)

    def execute(self, requests):
        responses = []
        for request in requests:
            if self.delay_s:
                time.sleep(self.delay_s)
            x = pb_utils.get_input_tensor_by_name(request, "x").as_numpy()
            for _ in range(self.work_rows.get(x.shape[0], self.work)):
                pass
            if self.fail:
                responses.append(
                    pb_utils.InferenceResponse(error=pb_utils.TritonError("candidate is broken"))
                )
                continue
            if self.no_output:
                responses.append(pb_utils.InferenceResponse(output_tensors=[]))
                continue
            y = (x * self.scale).astype(np.float32)
            if self.noise:
                y = y + self.rng.uniform(-self.noise, self.noise, y.shape).astype(np.float32)
            if self.nan:
                y[..., 0] = np.nan
            responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("y", y)]))
        return responses
