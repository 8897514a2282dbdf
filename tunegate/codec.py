"""KServe v2 tensor codec: infer requests and responses, JSON and binary tensor extension, to and from numpy.

Errors are raised as `CodecError` with a message fit to return in a 400 body. Datatype conversion
uses tritonclient's own utilities (BYTES serialisation, dtype maps).

BF16 has no numpy dtype: like tritonclient, tensors of datatype BF16 are carried as float32 arrays
(truncated to bfloat16 on the wire). The decoded `Tensor` keeps the wire datatype next to the array.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson
from tritonclient.utils import (
    deserialize_bytes_tensor,
    np_to_triton_dtype,
    serialize_byte_tensor,
    triton_to_np_dtype,
)

from tunegate.errors import InputError

HEADER = "Inference-Header-Content-Length"

DATATYPES = (
    "BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
    "FP16", "FP32", "FP64", "BF16", "BYTES",
)  # fmt: skip
_ITEMSIZE = {
    "BOOL": 1, "UINT8": 1, "UINT16": 2, "UINT32": 4, "UINT64": 8, "INT8": 1, "INT16": 2,
    "INT32": 4, "INT64": 8, "FP16": 2, "FP32": 4, "FP64": 8, "BF16": 2,
}  # fmt: skip


class CodecError(InputError):
    """A request or response body that does not follow the KServe v2 protocol."""


@dataclasses.dataclass(frozen=True)
class Tensor:
    name: str
    datatype: str
    array: npt.NDArray[Any]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self.array.shape)


@dataclasses.dataclass(frozen=True)
class InferMessage:
    """A decoded infer request or response: tensors by name plus the JSON header's other fields."""

    tensors: dict[str, Tensor]
    header: dict[str, Any]

    @property
    def id(self) -> str | None:
        v = self.header.get("id")
        return str(v) if v is not None else None

    def arrays(self) -> dict[str, npt.NDArray[Any]]:
        return {k: t.array for k, t in self.tensors.items()}


def datatype_of(array: npt.NDArray[Any]) -> str:
    if array.dtype == np.object_ or array.dtype.kind in "SU":
        return "BYTES"
    dt = np_to_triton_dtype(array.dtype)
    if dt is None:
        raise CodecError(f"numpy dtype {array.dtype} has no KServe v2 datatype")
    return str(dt)


_NP_DTYPES = {dt: np.float32 if dt == "BF16" else triton_to_np_dtype(dt) for dt in DATATYPES}


def _np_dtype(datatype: str) -> Any:
    try:
        return _NP_DTYPES[datatype]
    except KeyError:
        raise CodecError(f"unknown datatype {datatype!r}; expected one of {', '.join(DATATYPES)}") from None


_INT = frozenset({int})  # type sets are checked in C loops (this runs for every mirrored JSON response)
_NUMBER = frozenset({int, float})
_BOOL = frozenset({bool})


def _shape(raw: Any, where: str) -> tuple[int, ...]:
    if type(raw) is not list or not set(map(type, raw)) <= _INT:  # JSON's true/false are bools, not ints here
        raise CodecError(f"{where}: 'shape' must be a list of integers, got {raw!r}")
    if raw and min(raw) < 0:
        raise CodecError(f"{where}: 'shape' has a negative dimension: {raw}")
    return tuple(raw)


def _count(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _flatten(data: Any) -> tuple[list[Any], set[type]]:
    """The scalars of nested lists, in order, and their types."""
    if not isinstance(data, list):
        return [data], {type(data)}
    types = set(map(type, data))
    if list not in types:
        return data, types  # already flat, as Triton writes its outputs: no per-element Python loop
    out: list[Any] = []
    stack = [iter(data)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                stack.append(iter(item))
                break
            out.append(item)
        else:
            stack.pop()
    return out, set(map(type, out))


def _from_json_data(data: Any, datatype: str, shape: tuple[int, ...], where: str) -> npt.NDArray[Any]:
    flat, types = _flatten(data)
    if len(flat) != _count(shape):
        raise CodecError(
            f"{where}: shape {list(shape)} needs {_count(shape)} elements, 'data' has {len(flat)}"
        )
    if datatype == "BYTES":
        items = []
        for v in flat:
            if isinstance(v, str):
                items.append(v.encode("utf-8"))
            elif isinstance(v, (bytes, bytearray)):
                items.append(bytes(v))
            else:
                raise CodecError(f"{where}: BYTES data must be strings, got {type(v).__name__}")
        return np.array(items, dtype=np.object_).reshape(shape)
    if datatype == "BOOL":
        if not types <= _BOOL:
            raise CodecError(f"{where}: BOOL data must be true/false")
    elif datatype.startswith(("INT", "UINT")):
        if not types <= _INT:
            raise CodecError(f"{where}: {datatype} data must be integers")
        info = np.iinfo(_np_dtype(datatype))
        if flat and (min(flat) < info.min or max(flat) > info.max):
            raise CodecError(f"{where}: data does not fit {datatype} (range {info.min}..{info.max})")
    elif not types <= _NUMBER:
        raise CodecError(f"{where}: {datatype} data must be numbers")
    try:
        arr = np.array(flat, dtype=_np_dtype(datatype))
    except (OverflowError, ValueError) as exc:
        raise CodecError(f"{where}: data does not fit {datatype}: {exc}") from exc
    if datatype == "BF16":
        arr = _round_bf16(arr)
    return arr.reshape(shape)


# BF16 is done in numpy rather than with tritonclient's serialize_bf16_tensor, which packs one
# element at a time in Python; the bits are the same (the high half of the float32, truncated).
def _bf16_bytes(arr: npt.NDArray[Any]) -> bytes:
    bits = np.ascontiguousarray(arr, dtype="<f4").view("<u4") >> 16
    return bits.astype("<u2").tobytes()


def _bf16_array(raw: bytes) -> npt.NDArray[np.float32]:
    return (np.frombuffer(raw, dtype="<u2").astype("<u4") << 16).view("<f4").astype(np.float32)


def _round_bf16(arr: npt.NDArray[Any]) -> npt.NDArray[np.float32]:
    return _bf16_array(_bf16_bytes(arr)).reshape(arr.shape)


def _from_bytes(raw: bytes, datatype: str, shape: tuple[int, ...], where: str) -> npt.NDArray[Any]:
    n = _count(shape)
    if datatype == "BYTES":
        try:
            arr = deserialize_bytes_tensor(raw) if raw else np.array([], dtype=np.object_)
        except Exception as exc:  # tritonclient raises struct.error/IndexError on truncation
            raise CodecError(f"{where}: malformed BYTES payload: {exc}") from exc
        if arr.size != n:
            raise CodecError(f"{where}: shape {list(shape)} needs {n} BYTES elements, payload has {arr.size}")
        return arr.reshape(shape)
    size = _ITEMSIZE[datatype]
    if len(raw) != n * size:
        raise CodecError(f"{where}: shape {list(shape)} of {datatype} needs {n * size} bytes, got {len(raw)}")
    if datatype == "BF16":
        return _bf16_array(raw).reshape(shape)
    return np.frombuffer(raw, dtype=_np_dtype(datatype)).reshape(shape).copy()


def _to_bytes(array: npt.NDArray[Any], datatype: str) -> bytes:
    if datatype == "BYTES":
        if array.size == 0:
            return b""
        ser = serialize_byte_tensor(array)
        return bytes(ser.item() if ser.size == 1 else ser.tobytes())
    if datatype == "BF16":
        return _bf16_bytes(array)
    return np.ascontiguousarray(array, dtype=_np_dtype(datatype)).tobytes()


def tensor_bytes(array: npt.NDArray[Any], datatype: str) -> bytes:
    """A tensor's bytes as the binary extension (and gRPC's raw contents) carry them."""
    return _to_bytes(array, datatype)


def _to_json_data(array: npt.NDArray[Any], datatype: str) -> list[Any]:
    if datatype == "BYTES":
        out = []
        for v in array.reshape(-1):
            b = v if isinstance(v, bytes) else str(v).encode()
            try:
                out.append(b.decode("utf-8"))
            except UnicodeDecodeError as exc:
                raise CodecError("BYTES element is not UTF-8; use the binary extension") from exc
        return out
    flat: list[Any] = array.reshape(-1).tolist()
    return flat


# orjson turns integers beyond 64 bits into floats (json keeps them exact). Such an integer (or exponent) is a
# run of 19 digits or more that does not follow a '.'; a fraction's digits may run long (0.0012000000569969416).
# The body is mapped to '0' for digits, '.' for itself and 'x' for anything else, then searched in C.
_DIGIT_CLASSES = bytes(0x30 if 0x30 <= i <= 0x39 else 0x2E if i == 0x2E else 0x78 for i in range(256))
_RUN = b"0" * 19


def _long_integer(raw: bytes) -> bool:
    classes = raw.translate(_DIGIT_CLASSES)
    return classes.startswith(_RUN) or b"x" + _RUN in classes


def loads(raw: bytes) -> Any:
    """`json.loads`, five to eight times faster on Triton's bodies: orjson where it is bound to give the same value.

    orjson rejects what json accepts beyond RFC 8259 (NaN, Infinity, numbers that overflow to inf, lone
    surrogates, a BOM, UTF-16/32): then json parses it. Integers beyond 64 bits, which orjson would turn into
    floats, need a run of 19 digits not after a '.', and any such run sends the body to json too
    (tests/test_codec.py checks both against each other).
    """
    if not _long_integer(raw):
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
    return json.loads(raw)


def split_body(body: bytes, header_length: int | None) -> tuple[dict[str, Any], bytes]:
    """The parsed JSON header and the binary tail (empty for pure JSON); CodecError when the JSON is not an object."""
    if header_length is None:
        json_part, rest = body, b""
    else:
        if header_length < 0 or header_length > len(body):
            raise CodecError(f"{HEADER} is {header_length} but the body has {len(body)} bytes")
        json_part, rest = body[:header_length], body[header_length:]
    try:
        header = loads(json_part)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CodecError(f"body is not valid JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise CodecError("body must be a JSON object")
    return header, rest


def parse_header_length(value: str | None) -> int | None:
    if value is None or value == "":
        return None
    try:
        n = int(value)
    except ValueError as exc:
        raise CodecError(f"{HEADER} must be an integer, got {value!r}") from exc
    if n < 0:
        raise CodecError(f"{HEADER} must not be negative")
    return n


def decode(body: bytes, header_length: int | None, key: str = "inputs") -> InferMessage:
    """Decode a request (`key='inputs'`) or a response (`key='outputs'`)."""
    header, rest = split_body(body, header_length)
    entries = header.get(key)
    if key == "inputs" and entries is None:
        raise CodecError("request has no 'inputs'")
    entries = entries if entries is not None else []
    if not isinstance(entries, list):
        raise CodecError(f"'{key}' must be a list")
    tensors: dict[str, Tensor] = {}
    offset = 0
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise CodecError(f"{key}[{i}] must be an object")
        name = entry.get("name")
        if not isinstance(name, str) or not name:
            raise CodecError(f"{key}[{i}]: 'name' must be a non-empty string")
        where = f"{key[:-1]} {name!r}"
        if name in tensors:
            raise CodecError(f"{where} appears twice")
        datatype = entry.get("datatype")
        if not isinstance(datatype, str):
            raise CodecError(f"{where}: 'datatype' must be a string")
        _np_dtype(datatype)
        shape = _shape(entry.get("shape"), where)
        params = entry.get("parameters") or {}
        if not isinstance(params, dict):
            raise CodecError(f"{where}: 'parameters' must be an object")
        size = params.get("binary_data_size")
        if size is not None:
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise CodecError(f"{where}: binary_data_size must be a non-negative integer")
            if offset + size > len(rest):
                raise CodecError(
                    f"{where}: binary_data_size {size} runs past the end of the body "
                    f"({len(rest) - offset} bytes left)"
                )
            array = _from_bytes(rest[offset : offset + size], datatype, shape, where)
            offset += size
        elif "data" in entry:
            array = _from_json_data(entry["data"], datatype, shape, where)
        elif key == "outputs":
            continue  # e.g. shared-memory outputs: nothing to decode here
        else:
            raise CodecError(f"{where} has neither 'data' nor binary_data_size")
        tensors[name] = Tensor(name, datatype, array)
    if offset != len(rest):
        raise CodecError(f"{len(rest) - offset} bytes after the binary tensors are not claimed by any tensor")
    return InferMessage(tensors=tensors, header=header)


def same_json(a: Any, b: Any) -> bool:
    """Parsed JSON values that decode to the same tensors: equal, and of the same Python type at every level.

    Plain `==` is not enough (1 == 1.0 == True, and the codec accepts each for different datatypes).
    Scalar lists, as Triton writes tensor data, are compared by C loops, not element by element in Python.
    NaN never equals NaN here, so data holding one is reported as different (and gets fully compared).
    """
    t = type(a)
    if t is not type(b):
        return False
    if t is dict:
        return a.keys() == b.keys() and all(same_json(v, b[k]) for k, v in a.items())
    if t is list:
        if len(a) != len(b):
            return False
        types = set(map(type, a))
        if dict in types or list in types:
            return all(same_json(x, y) for x, y in zip(a, b, strict=True))
        return bool(a == b) and list(map(type, a)) == list(map(type, b))
    return bool(a == b)


def decode_request(body: bytes, header_length: int | None = None) -> InferMessage:
    return decode(body, header_length, "inputs")


def decode_response(body: bytes, header_length: int | None = None) -> InferMessage:
    return decode(body, header_length, "outputs")


def _as_tensors(tensors: Mapping[str, npt.NDArray[Any] | Tensor] | Iterable[Tensor]) -> list[Tensor]:
    if isinstance(tensors, Mapping):
        out = []
        for name, v in tensors.items():
            out.append(
                v if isinstance(v, Tensor) else Tensor(name, datatype_of(np.asarray(v)), np.asarray(v))
            )
        return out
    return list(tensors)


def encode(
    tensors: Mapping[str, npt.NDArray[Any] | Tensor] | Iterable[Tensor],
    *,
    key: str = "inputs",
    binary: bool = True,
    header: Mapping[str, Any] | None = None,
) -> tuple[bytes, int | None]:
    """Encode tensors into a body; returns (body, header_length) where header_length is None for pure JSON."""
    doc: dict[str, Any] = dict(header or {})
    entries = []
    blobs: list[bytes] = []
    for t in _as_tensors(tensors):
        arr = t.array
        if t.datatype == "BYTES" and arr.dtype != np.object_:
            arr = arr.astype(np.object_)
        entry: dict[str, Any] = {"name": t.name, "datatype": t.datatype, "shape": list(arr.shape)}
        if binary:
            blob = _to_bytes(arr, t.datatype)
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            entry["data"] = _to_json_data(arr, t.datatype)
        entries.append(entry)
    doc[key] = entries
    js = json.dumps(doc, separators=(",", ":")).encode()
    if not binary:
        return js, None
    return js + b"".join(blobs), len(js)


def encode_request(
    inputs: Mapping[str, npt.NDArray[Any] | Tensor] | Iterable[Tensor],
    *,
    binary: bool = True,
    outputs: Iterable[str] = (),
    binary_outputs: bool | None = None,
    request_id: str | None = None,
) -> tuple[bytes, int | None]:
    header: dict[str, Any] = {}
    if request_id is not None:
        header["id"] = request_id
    outs = list(outputs)
    want_binary = binary if binary_outputs is None else binary_outputs
    if outs:
        header["outputs"] = [{"name": o, "parameters": {"binary_data": want_binary}} for o in outs]
    elif want_binary:
        header["parameters"] = {"binary_data_output": True}
    return encode(inputs, key="inputs", binary=binary, header=header)


def encode_response(
    outputs: Mapping[str, npt.NDArray[Any] | Tensor] | Iterable[Tensor],
    *,
    model_name: str,
    model_version: str = "1",
    binary: bool = True,
    request_id: str | None = None,
) -> tuple[bytes, int | None]:
    header: dict[str, Any] = {"model_name": model_name, "model_version": model_version}
    if request_id is not None:
        header["id"] = request_id
    return encode(outputs, key="outputs", binary=binary, header=header)
