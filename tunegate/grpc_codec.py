"""KServe v2 over gRPC and over HTTP, one in terms of the other: Triton's `ModelInferRequest` and
`ModelInferResponse` (the protos tritonclient ships) to and from the HTTP binary-extension body.

The sidecar's gRPC front hands a mirrored gRPC request to the same canary as HTTP traffic by writing it as the
HTTP request Triton would read the same way (the tensors' bytes unchanged, request and tensor parameters
carried), and the gRPC answer as the HTTP answer: one comparison code, one tolerance, one judge. The load
tester goes the other way, replaying an HTTP capture as gRPC calls.

Tensor bytes are the same in both protocols (little-endian, row-major; a BYTES element is a 4-byte length and
its bytes), so raw contents pass unchanged. Typed contents (`fp32_contents`, ...) are written as raw bytes.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from tritonclient.grpc import service_pb2 as pb

from tunegate import codec
from tunegate.errors import InputError

SHARED_MEMORY_KEYS = frozenset({"shared_memory_region", "shared_memory_byte_size", "shared_memory_offset"})
GRPC_DIRECTIVE_PREFIX = "triton_"

# datatype -> (InferTensorContents field, numpy dtype of its elements as the protocol sends them)
_TYPED = {
    "BOOL": ("bool_contents", np.bool_),
    "INT8": ("int_contents", np.int8),
    "INT16": ("int_contents", np.int16),
    "INT32": ("int_contents", np.int32),
    "INT64": ("int64_contents", np.int64),
    "UINT8": ("uint_contents", np.uint8),
    "UINT16": ("uint_contents", np.uint16),
    "UINT32": ("uint_contents", np.uint32),
    "UINT64": ("uint64_contents", np.uint64),
    "FP32": ("fp32_contents", np.float32),
    "FP64": ("fp64_contents", np.float64),
}


class GrpcCodecError(InputError):
    """A gRPC inference message that has no HTTP equivalent (or the other way round)."""


def parameters(params: Any) -> dict[str, Any]:
    """A protobuf map<string, InferParameter> as the JSON `parameters` object."""
    out: dict[str, Any] = {}
    for key, p in params.items():
        choice = p.WhichOneof("parameter_choice")
        if choice is not None:
            out[key] = getattr(p, choice)
    return out


def set_parameters(target: Any, values: dict[str, Any]) -> None:
    """JSON `parameters` into a protobuf map<string, InferParameter> (bool, integer, float or string)."""
    for key, v in values.items():
        p = target[key]
        if isinstance(v, bool):
            p.bool_param = v
        elif isinstance(v, int):
            if v >= 1 << 63:
                p.uint64_param = v
            else:
                p.int64_param = v
        elif isinstance(v, float):
            p.double_param = v
        elif isinstance(v, str):
            p.string_param = v
        else:
            raise GrpcCodecError(f"parameter {key!r}: {type(v).__name__} has no gRPC form")


def uses_shared_memory(req: pb.ModelInferRequest) -> bool:
    """Does any input or requested output live in a shared-memory region (which a replay cannot reach)?"""
    return any(SHARED_MEMORY_KEYS.intersection(t.parameters) for t in req.inputs) or any(
        SHARED_MEMORY_KEYS.intersection(t.parameters) for t in req.outputs
    )


def _typed_bytes(contents: pb.InferTensorContents, datatype: str, where: str) -> bytes:
    if datatype == "BYTES":
        return b"".join(len(b).to_bytes(4, "little") + b for b in contents.bytes_contents)
    typed = _TYPED.get(datatype)
    if typed is None:
        raise GrpcCodecError(f"{where}: {datatype} tensors travel only as raw contents")
    field, dtype = typed
    return np.asarray(getattr(contents, field), dtype=dtype).tobytes()


def _tensor_blobs(tensors: Any, raw: Any, where: str) -> list[bytes]:
    if raw:
        if len(raw) != len(tensors):
            raise GrpcCodecError(f"{len(raw)} raw contents for {len(tensors)} {where}s")
        return [bytes(b) for b in raw]
    return [_typed_bytes(t.contents, t.datatype, f"{where} {t.name!r}") for t in tensors]


def _entries(tensors: Any, blobs: list[bytes]) -> list[dict[str, Any]]:
    out = []
    for t, blob in zip(tensors, blobs, strict=True):
        entry: dict[str, Any] = {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
        entry["parameters"] = {**parameters(t.parameters), "binary_data_size": len(blob)}
        out.append(entry)
    return out


def _body(doc: dict[str, Any], blobs: list[bytes]) -> tuple[bytes, int]:
    head = json.dumps(doc, separators=(",", ":")).encode()
    return head + b"".join(blobs), len(head)


def request_to_http(req: pb.ModelInferRequest) -> tuple[bytes, int]:
    """The HTTP binary-extension request body (and its JSON header's length) Triton reads as `req`.

    Outputs come back binary: the requested ones with `binary_data`, all of them through
    `binary_data_output` when none is named. GrpcCodecError for inputs in shared memory.
    """
    if uses_shared_memory(req):
        raise GrpcCodecError("inputs or outputs in shared memory cannot be written as an HTTP body")
    blobs = _tensor_blobs(req.inputs, req.raw_input_contents, "input")
    doc: dict[str, Any] = {}
    if req.id:
        doc["id"] = req.id
    # `triton_`-prefixed keys are directives to Triton's gRPC server (perf_analyzer sends
    # triton_enable_empty_final_response on every call), which its HTTP server refuses as reserved.
    params = {k: v for k, v in parameters(req.parameters).items() if not k.startswith(GRPC_DIRECTIVE_PREFIX)}
    if req.outputs:
        doc["outputs"] = [
            {"name": o.name, "parameters": {**parameters(o.parameters), "binary_data": True}}
            for o in req.outputs
        ]
    else:
        params["binary_data_output"] = True
    doc["parameters"] = params
    doc["inputs"] = _entries(req.inputs, blobs)
    return _body(doc, blobs)


def response_to_http(resp: pb.ModelInferResponse) -> tuple[bytes, int]:
    """The HTTP binary-extension response body (and its header length) carrying `resp`'s outputs, its head
    written as Triton writes one (model_name, model_version, then outputs)."""
    blobs = _tensor_blobs(resp.outputs, resp.raw_output_contents, "output")
    doc: dict[str, Any] = {}
    if resp.id:
        doc["id"] = resp.id
    doc["model_name"] = resp.model_name
    doc["model_version"] = resp.model_version
    params = parameters(resp.parameters)
    if params:
        doc["parameters"] = params
    doc["outputs"] = _entries(resp.outputs, blobs)
    return _body(doc, blobs)


def http_to_request(
    body: bytes, header_length: int | None, model: str, version: str = ""
) -> pb.ModelInferRequest:
    """A KServe v2 HTTP request body (JSON or binary) as the gRPC request for `model` (raw input contents)."""
    msg = codec.decode_request(body, header_length)
    req = pb.ModelInferRequest(model_name=model, model_version=version)
    header = msg.header
    if isinstance(header.get("id"), str):
        req.id = header["id"]
    params = {k: v for k, v in (header.get("parameters") or {}).items() if k != "binary_data_output"}
    set_parameters(req.parameters, params)
    raw_inputs = {e.get("name"): e for e in header.get("inputs", []) if isinstance(e, dict)}
    for t in msg.tensors.values():
        tensor = req.inputs.add(name=t.name, datatype=t.datatype, shape=list(t.array.shape))
        extra = {
            k: v
            for k, v in (raw_inputs.get(t.name, {}).get("parameters") or {}).items()
            if k != "binary_data_size"
        }
        set_parameters(tensor.parameters, extra)
        req.raw_input_contents.append(codec.tensor_bytes(t.array, t.datatype))
    for out in header.get("outputs") or []:
        if isinstance(out, dict) and isinstance(out.get("name"), str):
            o = req.outputs.add(name=out["name"])
            extra = {k: v for k, v in (out.get("parameters") or {}).items() if k != "binary_data"}
            set_parameters(o.parameters, extra)
    return req


def response_arrays(resp: pb.ModelInferResponse) -> dict[str, Any]:
    """The outputs of a gRPC answer as numpy arrays, decoded by the shared codec."""
    body, hl = response_to_http(resp)
    return codec.decode_response(body, hl).arrays()
