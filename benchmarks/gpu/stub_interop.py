"""Which tensor hand-offs does the python-backend stub get right with this image's numpy? (a diagnostic, any machine)

    python -m benchmarks.gpu.stub_interop        # prints one line per hand-off, exit 1 if the current templates' fail

On an H200 image with numpy 2.5 every output of the pt2 template came back empty: the stub's pybind11 in
Triton 2.51 misreads numpy 2 arrays. With numpy 2.5.2 every numpy output fails with "output tensor shape
does not match size of output", and only torch's DLPack gets outputs through. This serves one tiny python-backend model per way of getting a
tensor in and out, from the embedded Triton, and checks what comes back. With numpy 1.26 it also shows
that `pb_utils.Tensor.from_dlpack` of a numpy array kills the stub: the stub renames a consumed capsule
"used_dlpack" (the DLPack spec says "used_dltensor"), so numpy's capsule destructor fails.
"""

from __future__ import annotations

import json
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

from tunegate.repository import ModelConfig, TensorSpec, onnx_version_files, write_config, write_version
from tunegate.triton import EmbeddedTriton, TritonOptions

HANDOFFS = {
    "in_as_numpy__out_numpy": "x = t.as_numpy()\n            y = pb_utils.Tensor('y', np.ascontiguousarray(x))",
    "in_dlpack__out_numpy": "x = np.from_dlpack(t)\n            y = pb_utils.Tensor('y', np.ascontiguousarray(x))",
    "in_dlpack__out_torch_dlpack": (
        "x = np.from_dlpack(t)\n            import torch\n            from torch.utils.dlpack import to_dlpack\n"
        "            y = pb_utils.Tensor.from_dlpack('y', to_dlpack(torch.from_numpy(np.ascontiguousarray(x))))"
    ),
}
# What the templates in tunegate/templates/ do now (onnx_model.py: DLPack in; numpy out with numpy 1.x, torch's
# DLPack with numpy 2; pt2_model.py: torch DLPack both ways).
CURRENT = ("in_dlpack__out_torch_dlpack", "onnx_template")
MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            t = pb_utils.get_input_tensor_by_name(r, "x")
            {body}
            out.append(pb_utils.InferenceResponse([y]))
        return out
"""


def onnx_template(root: Path) -> None:
    """The tuner's real ONNX python-backend template serving y = x (an Identity graph) through ONNX Runtime."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "identity",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])  # fmt: skip
    path = root / "identity.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)
    write_version(root, "onnx_template", onnx_version_files(path), version=1)
    write_config(root, ModelConfig("onnx_template", (TensorSpec("x", "FP32", (4,)),), (TensorSpec("y", "FP32", (4,)),),
                                   versions=(1,)))  # fmt: skip


def main() -> int:
    root = Path(tempfile.mkdtemp(prefix="stub-interop-"))
    for name, body in HANDOFFS.items():
        write_version(root, name, {"model.py": MODEL.format(body=body)}, version=1)
        write_config(root, ModelConfig(name, (TensorSpec("x", "FP32", (4,)),), (TensorSpec("y", "FP32", (4,)),),
                                       versions=(1,)))  # fmt: skip
    onnx_template(root)
    x = [0.5, 1.5, 2.5, 3.5]
    body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [4], "data": x}]}).encode()
    print(f"numpy {np.__version__}, python {sys.version.split()[0]}")
    failed = []
    names = (*HANDOFFS, "onnx_template")
    with EmbeddedTriton(TritonOptions(repository=root, models=names), workdir=root / "triton") as triton:
        for name in names:
            req = urllib.request.Request(f"{triton.http_url}/v2/models/{name}/infer", data=body)
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    got = json.loads(r.read())["outputs"][0].get("data")
            except urllib.error.HTTPError as exc:
                got = f"HTTP {exc.code}: {exc.read()[:120]!r}"
            except OSError as exc:
                got = f"{exc.__class__.__name__}: {exc}"
            ok = got == x
            if not ok and name in CURRENT:
                failed.append(name)
            print(f"{'ok  ' if ok else 'FAIL'} {name:30s} {got}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
