"""Triton python-backend model: runs the AOTInductor package (`model.pt2`) of this version with torch.

Written by tunegate into each version directory built by the Inductor builder. `runtime.json`
beside it says which device, whether TF32 matmuls are allowed (cuBLAS reads that flag at run time,
not at build time) and whether calls are replayed from CUDA graphs. `Pt2Runner` is also what the
tuner runs in process (tuner/builders/inductor.py loads this file), so the gate and the benchmark
measure the same code that Triton serves. It imports only numpy and torch (Triton's utils lazily).
"""

import json
import os

import numpy as np

MAX_GRAPHS = 16  # distinct input shapes captured as CUDA graphs; further shapes run without one


class Pt2Runner:
    """Feeds (name -> numpy) in, outputs (name -> numpy) out, through the loaded AOTInductor package."""

    def __init__(self, directory, runtime):
        import torch

        self.torch = torch
        self.device = torch.device(runtime.get("device", "cpu"))
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = bool(runtime.get("tf32", False))
            torch.backends.cudnn.allow_tf32 = bool(runtime.get("tf32", False))
        elif runtime.get("threads"):
            torch.set_num_threads(int(runtime["threads"]))
        self.use_graphs = bool(runtime.get("cudagraphs", False)) and self.device.type == "cuda"
        path = os.path.join(directory, runtime.get("artifact", "model.pt2"))
        # run_single_threaded drops the container's cross-thread event waits, which a graph capture forbids.
        self.model = torch._inductor.aoti_load_package(path, run_single_threaded=self.use_graphs)
        self.input_names = [i["name"] for i in runtime["inputs"]]
        self.output_names = list(runtime["outputs"])
        self.graphs = {}

    def __call__(self, feeds):
        """numpy in, numpy out: the tuner's gate and benchmark."""
        torch = self.torch
        outs = self.run_tensors(
            {n: torch.from_numpy(np.ascontiguousarray(feeds[n])) for n in self.input_names}
        )
        return {n: o.numpy() for n, o in outs.items()}

    def run_tensors(self, feeds):
        """CPU torch tensors in, CPU torch tensors out: what Triton's execute() passes through DLPack."""
        torch = self.torch
        with torch.inference_mode():
            args = [feeds[n].to(self.device) for n in self.input_names]
            outs = self._replay(args) if self.use_graphs else self.model(*args)
            if isinstance(outs, torch.Tensor):
                outs = [outs]
            return {n: o.detach().cpu().contiguous() for n, o in zip(self.output_names, outs)}

    def _replay(self, args):
        torch = self.torch
        key = tuple((tuple(a.shape), a.dtype) for a in args)
        entry = self.graphs.get(key)
        if entry is None:
            if len(self.graphs) >= MAX_GRAPHS:
                return self.model(*args)
            static_in = [a.clone() for a in args]
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up outside the capture: lazy init, constant folding
                for _ in range(2):
                    self.model(*static_in)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = self.model(*static_in)
            entry = self.graphs[key] = (graph, static_in, static_out)
        graph, static_in, static_out = entry
        for dst, src in zip(static_in, args):
            dst.copy_(src)
        graph.replay()
        # Clones: the next replay overwrites the static outputs.
        if isinstance(static_out, torch.Tensor):
            return [static_out.clone()]
        return [o.clone() for o in static_out]


class TritonPythonModel:
    def initialize(self, args):
        global pb_utils
        import triton_python_backend_utils as pb_utils

        here = os.path.join(args["model_repository"], args["model_version"])
        with open(os.path.join(here, "runtime.json")) as f:
            runtime = json.load(f)
        self.runner = Pt2Runner(here, runtime)
        config = json.loads(args["model_config"])
        self.config_outputs = [o["name"] for o in config["output"]]

    def execute(self, requests):
        # Tensors cross the stub through DLPack, never as numpy: the stub's pybind11 (Triton 2.51) predates
        # numpy 2 and misreads numpy 2 arrays. On the H200 image (numpy 2.5) every output went out with
        # binary_data_size 0 until this path avoided numpy.
        from torch.utils.dlpack import to_dlpack

        torch = self.runner.torch
        responses = []
        for request in requests:
            try:
                feeds = {}
                for name in self.runner.input_names:
                    t = pb_utils.get_input_tensor_by_name(request, name)
                    if t is None:
                        raise pb_utils.TritonModelException(f"missing input {name!r}")
                    feeds[name] = torch.from_dlpack(t.to_dlpack())
                outs = self.runner.run_tensors(feeds)
                tensors = [pb_utils.Tensor.from_dlpack(n, to_dlpack(outs[n])) for n in self.config_outputs]
                responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
            except Exception as exc:  # noqa: BLE001 - one bad request must not take the batch down
                responses.append(
                    pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(exc)))
                )
        return responses
