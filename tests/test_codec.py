"""KServe v2 codec: round trips for every datatype in both encodings, agreement with tritonclient, clear errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tritonclient.http as httpclient
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tunegate import codec

NUMERIC = {
    "BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
    "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64,
    "FP16": np.float16, "FP32": np.float32, "FP64": np.float64,
}  # fmt: skip
shapes = hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=4)


def finite(dtype: type) -> st.SearchStrategy[np.ndarray]:
    kw = {"allow_nan": False, "allow_infinity": False} if np.dtype(dtype).kind == "f" else {}
    return hnp.arrays(dtype, shapes, elements=hnp.from_dtype(np.dtype(dtype), **kw))


@pytest.mark.parametrize("datatype", sorted(NUMERIC))
@pytest.mark.parametrize("binary", [True, False])
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_numeric_round_trip(datatype: str, binary: bool, data: st.DataObject) -> None:
    arr = data.draw(finite(NUMERIC[datatype]))
    for key in ("inputs", "outputs"):
        body, hl = codec.encode({"t": arr}, key=key, binary=binary)
        msg = codec.decode(body, hl, key)
        got = msg.tensors["t"]
        assert got.datatype == datatype
        assert got.array.dtype == arr.dtype and got.array.shape == arr.shape
        np.testing.assert_array_equal(got.array, arr)


@pytest.mark.parametrize("binary", [True, False])
@settings(max_examples=40, deadline=None)
@given(
    arr=hnp.arrays(
        np.float32,
        shapes,
        elements=st.floats(-1e6, 1e6, width=32, allow_subnormal=False).filter(
            lambda v: v == 0 or abs(v) > 1e-30
        ),
    )
)
def test_bf16_round_trip_truncates_like_triton(binary: bool, arr: np.ndarray) -> None:
    body, hl = codec.encode([codec.Tensor("t", "BF16", arr)], binary=binary)
    got = codec.decode_request(body, hl).tensors["t"]
    assert got.datatype == "BF16" and got.array.shape == arr.shape
    expect = (arr.view(np.uint32) & 0xFFFF0000).view(np.float32) if binary else got.array
    np.testing.assert_array_equal(got.array, expect)
    # bfloat16 keeps ~3 significant digits
    np.testing.assert_allclose(got.array, arr, rtol=1e-2, atol=1e-38)


text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)


@pytest.mark.parametrize("binary", [True, False])
@settings(max_examples=40, deadline=None)
@given(items=st.lists(text, min_size=0, max_size=6))
def test_bytes_round_trip(binary: bool, items: list[str]) -> None:
    arr = np.array([s.encode() for s in items], dtype=np.object_).reshape(len(items), 1)
    body, hl = codec.encode({"s": arr}, binary=binary)
    got = codec.decode_request(body, hl).tensors["s"]
    assert got.datatype == "BYTES" and got.array.shape == arr.shape
    assert [bytes(x) for x in got.array.reshape(-1)] == [s.encode() for s in items]


def test_binary_bytes_may_be_arbitrary_octets() -> None:
    arr = np.array([b"\x00\xff\xfe", b""], dtype=np.object_)
    body, hl = codec.encode({"s": arr}, binary=True)
    assert list(codec.decode_request(body, hl).tensors["s"].array) == [b"\x00\xff\xfe", b""]
    with pytest.raises(codec.CodecError, match="not UTF-8"):
        codec.encode({"s": arr}, binary=False)


@pytest.mark.parametrize("binary", [True, False])
def test_decodes_what_tritonclient_encodes(binary: bool) -> None:
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.array([[b"x"], [b"yz"]], dtype=np.object_)
    h = np.array([1.5, -2.25], dtype=np.float16)
    inputs = []
    for name, arr, dt in (("a", a, "FP32"), ("b", b, "BYTES"), ("h", h, "FP16")):
        i = httpclient.InferInput(name, list(arr.shape), dt)
        i.set_data_from_numpy(arr, binary_data=binary)
        inputs.append(i)
    body, json_size = httpclient.InferenceServerClient.generate_request_body(inputs)
    msg = codec.decode_request(body, json_size)
    np.testing.assert_array_equal(msg.tensors["a"].array, a)
    assert list(msg.tensors["b"].array.reshape(-1)) == [b"x", b"yz"]
    np.testing.assert_array_equal(msg.tensors["h"].array, h)


def test_tritonclient_decodes_what_we_encode() -> None:
    y = np.linspace(0, 1, 6, dtype=np.float32).reshape(2, 3)
    body, hl = codec.encode_response({"y": y}, model_name="m", binary=True)
    result = httpclient.InferResult.from_response_body(body, header_length=hl)
    np.testing.assert_array_equal(result.as_numpy("y"), y)


@pytest.mark.parametrize(
    "body,hl,match",
    [
        (b"{not json", None, "not valid JSON"),
        (b"[1, 2]", None, "JSON object"),
        (b"{}", None, "no 'inputs'"),
        (b'{"inputs": {}}', None, "must be a list"),
        (b'{"inputs": [{"datatype": "FP32", "shape": [1], "data": [1]}]}', None, "'name'"),
        (
            b'{"inputs": [{"name": "x", "datatype": "FP99", "shape": [1], "data": [1]}]}',
            None,
            "unknown datatype",
        ),
        (
            b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [2], "data": [1]}]}',
            None,
            "needs 2 elements",
        ),
        (b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [-1], "data": [1]}]}', None, "negative"),
        (
            b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": "1", "data": [1]}]}',
            None,
            "list of integers",
        ),
        (b'{"inputs": [{"name": "x", "datatype": "INT32", "shape": [1], "data": ["a"]}]}', None, "integers"),
        (
            b'{"inputs": [{"name": "x", "datatype": "INT8", "shape": [1], "data": [300]}]}',
            None,
            "does not fit",
        ),
        (b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1]}]}', None, "neither 'data'"),
        (
            (
                b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]},'
                b'{"name": "x", "datatype": "FP32", "shape": [1], "data": [1]}]}'
            ),
            None,
            "twice",
        ),
        (b'{"inputs": []}', 99, "body has"),
    ],
)
def test_malformed_requests_give_clear_errors(body: bytes, hl: int | None, match: str) -> None:
    with pytest.raises(codec.CodecError, match=match):
        codec.decode_request(body, hl)


def test_binary_size_mismatches_are_errors() -> None:
    header = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [2], "parameters": {"binary_data_size": 8}}]
    }
    js = json.dumps(header).encode()
    with pytest.raises(codec.CodecError, match="runs past the end"):
        codec.decode_request(js + b"\0" * 4, len(js))
    with pytest.raises(codec.CodecError, match="not claimed"):
        codec.decode_request(js + b"\0" * 12, len(js))
    header["inputs"][0]["parameters"]["binary_data_size"] = 4
    js = json.dumps(header).encode()
    with pytest.raises(codec.CodecError, match="needs 8 bytes"):
        codec.decode_request(js + b"\0" * 4, len(js))
    with pytest.raises(codec.CodecError, match="must be an integer"):
        codec.parse_header_length("abc")


@settings(max_examples=300, deadline=None)
@given(body=st.binary(max_size=200), hl=st.one_of(st.none(), st.integers(-5, 250)))
def test_garbage_only_ever_raises_codec_error(body: bytes, hl: int | None) -> None:
    try:
        codec.decode_request(body, hl)
    except codec.CodecError:
        pass


@settings(max_examples=200, deadline=None)
@given(
    doc=st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
        lambda c: (
            st.lists(c, max_size=3)
            | st.dictionaries(
                st.sampled_from(
                    ["inputs", "name", "datatype", "shape", "data", "parameters", "binary_data_size"]
                ),
                c,
                max_size=4,
            )
        ),
        max_leaves=12,
    )
)
def test_structured_garbage_only_ever_raises_codec_error(doc: object) -> None:
    try:
        codec.decode_request(json.dumps({"inputs": doc}).encode(), None)
    except codec.CodecError:
        pass


def _parsed(raw: bytes, fn: object) -> str:
    """repr of what a JSON parser gives (type-strict: 1, 1.0 and -0.0 differ), or that it failed."""
    try:
        return repr(fn(raw))  # type: ignore[operator]
    except (ValueError, RecursionError) as exc:
        return f"error {type(exc).__name__}"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.floats(width=32) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=4), inner, max_size=5),
    max_leaves=30,
)
number_text = st.from_regex(rb"\A-?(0|[1-9][0-9]{0,24})(\.[0-9]{1,24})?([eE][+-]?[0-9]{1,22})?\Z")


@settings(max_examples=400, deadline=None)
@given(value=json_values)
def test_fast_loads_gives_what_json_loads_gives(value: object) -> None:
    """codec.loads (orjson where it is bound to agree) is json.loads: same values, same types, same failures.
    Big integers (orjson would give floats), NaN and overflowing numbers (orjson refuses them) included."""
    raw = json.dumps(value).encode()
    assert _parsed(raw, codec.loads) == _parsed(raw, json.loads)


@settings(max_examples=400, deadline=None)
@given(number=number_text, wrap=st.sampled_from([b"%s", b"[%s]", b'{"data":[1.5,%s]}', b"[%s,-0]"]))
def test_fast_loads_reads_every_number_literal_like_json(number: bytes, wrap: bytes) -> None:
    raw = wrap % number
    assert _parsed(raw, codec.loads) == _parsed(raw, json.loads)


@pytest.mark.parametrize("raw", [b"18446744073709551616", b"[-9223372036854775809]", b"1e400", b"[NaN]",
                                 b'"\\ud800"', b"\xef\xbb\xbf{}", b"[0.0012000000569969416, 1e-400]"])  # fmt: skip
def test_fast_loads_edge_cases(raw: bytes) -> None:
    assert _parsed(raw, codec.loads) == _parsed(raw, json.loads)
