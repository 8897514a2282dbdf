"""The mirror's comparison: the identical-outputs fast path gives exactly the verdict of the full decode + compare.

No servers: bodies are encoded with the shared codec as Triton would send them (JSON or the binary
extension), and `compare_responses` is run with and without its fast path.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar import mirror
from sidecar.mirror import compare_responses
from sidecar.upstream import UpstreamResponse
from tunegate import codec
from tunegate.tolerance import ToleranceSpec, identical_passes

DTYPES = {"FP32": np.float32, "FP16": np.float16, "FP64": np.float64, "INT32": np.int32, "BOOL": np.bool_}


def answer(
    outputs: dict[str, np.ndarray], *, binary: bool, version: str = "1", extra: dict | None = None
) -> UpstreamResponse:
    """As Triton writes it ({"model_name":..,"model_version":..,"outputs":..}); `extra` members go first."""
    body, hl = codec.encode_response(outputs, model_name="m", model_version=version, binary=binary)
    if extra:
        js = json.loads(body[:hl] if hl is not None else body)
        head = json.dumps({**extra, **js}, separators=(",", ":")).encode()
        body, hl = head + (body[hl:] if hl is not None else b""), (len(head) if hl is not None else None)
    headers = [(b"Content-Type", b"application/json")]
    if hl is not None:
        headers.append((b"Inference-Header-Content-Length", str(hl).encode()))
    return UpstreamResponse(200, b"OK", headers, body)


def both(primary: UpstreamResponse, other: UpstreamResponse, spec: ToleranceSpec) -> mirror.Comparison:
    fast = compare_responses(primary, other, spec)
    full = compare_responses(primary, other, spec, fast=False)
    assert fast == full
    return fast


def spec_for(metric: str, threshold: float, statistic: str = "max") -> ToleranceSpec:
    return ToleranceSpec.from_dict({"*": {"metric": metric, "threshold": threshold, "statistic": statistic}})


@pytest.mark.parametrize("binary", [False, True])
@pytest.mark.parametrize("head", ["triton", "other"])
def test_identical_outputs_skip_decoding_and_metrics(
    binary: bool, head: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Triton's own head is checked on raw bytes; any other head (here a "parameters" member first, with an
    escaped quote) through the parsed JSON. Either way the candidate is not decoded and no metric computed."""
    out = {"y": np.linspace(-3, 3, 32, dtype=np.float32).reshape(2, 16), "k": np.arange(6, dtype=np.int32)}
    extra = {"parameters": {"note": 'a "quoted" word'}} if head == "other" else None
    primary = answer(out, binary=binary, extra=extra)
    cand = answer(out, binary=binary, version="2", extra=extra)
    assert mirror._same_from_outputs(*mirror.payload(primary), *mirror.payload(cand)) is (head == "triton")

    def no_compare(*_a: object, **_k: object) -> None:
        raise AssertionError("the fast path must not compute metrics for identical outputs")

    monkeypatch.setattr(mirror, "compare", no_compare)
    cmp = compare_responses(primary, cand, spec_for("linf", 1e-6))
    assert cmp.passed and cmp.outputs == {"y": True, "k": True} and cmp.reference_ok


@pytest.mark.parametrize("binary", [False, True])
def test_a_changed_value_is_compared_in_full(binary: bool) -> None:
    y = np.linspace(0, 1, 16, dtype=np.float32)
    bad = y.copy()
    bad[3] += 0.5
    cmp = both(
        answer({"y": y}, binary=binary),
        answer({"y": bad}, binary=binary, version="2"),
        spec_for("linf", 1e-3),
    )
    assert not cmp.passed and cmp.outputs == {"y": False}
    assert "linf" in cmp.reasons[0]


def test_identical_nan_and_inf_are_left_to_the_full_compare() -> None:
    y = np.array([1.0, np.nan, np.inf, 2.0], dtype=np.float32)
    for metric in ("linf", "l0"):
        cmp = both(
            answer({"y": y}, binary=True), answer({"y": y}, binary=True, version="2"), spec_for(metric, 0.5)
        )
        # linf of inf - inf is NaN: identical outputs still fail; l0 treats them as matching
        assert cmp.passed is (metric == "l0")


def test_a_head_json_would_reject_is_not_identical() -> None:
    """A control byte in a head value: the byte check must not call it identical (json.loads rejects it)."""
    primary = answer({"y": np.ones(4, dtype=np.float32)}, binary=False)
    i = primary.body.index(b'"outputs":')
    other = UpstreamResponse(
        200, b"OK", primary.headers, b'{"model_name":"m","model_version":"2\x01",' + primary.body[i:]
    )
    assert not mirror._same_from_outputs(primary.body, None, other.body, None)
    cmp = both(primary, other, spec_for("linf", 0.1))
    assert not cmp.passed and "not decodable" in cmp.reasons[0]


def test_json_numbers_of_another_type_are_not_identical() -> None:
    """1 and 1.0 are equal in Python, but INT32 data written as 1.0 does not decode: the verdicts must agree."""
    primary = answer({"k": np.array([1, 2, 3], dtype=np.int32)}, binary=False)
    doc = json.loads(primary.body)
    doc["outputs"][0]["data"] = [1.0, 2.0, 3.0]
    other = UpstreamResponse(200, b"OK", primary.headers, json.dumps(doc).encode())
    cmp = both(primary, other, spec_for("linf", 0.1))
    assert not cmp.passed and "not decodable" in cmp.reasons[0]


# As Triton 2.51 answers for a python-backend model that hands the stub a numpy 2 array: the output's shape, and
# no data (binary outputs requested; JSON ones get a 500).
NO_DATA = (
    b'{"model_name":"m","model_version":"1","outputs":[{"name":"y","datatype":"FP32","shape":[2,4],'
    b'"parameters":{"binary_data_size":0}}]}'
)


@pytest.mark.parametrize(
    ("primary", "why"),
    [
        (UpstreamResponse(200, b"OK", [(b"Content-Type", b"application/json")], NO_DATA), "not decodable"),
        (answer({}, binary=False), "has no output"),
        (answer({"k": np.arange(3, dtype=np.int32)}, binary=True), "holds no output the tolerance names"),
    ],
    ids=["no-data", "no-output", "lacks-y"],
)
def test_a_primary_answer_that_cannot_be_compared_with_judges_nothing(
    primary: UpstreamResponse, why: str
) -> None:
    """Whatever the candidate answers, nothing is judged: no pass on nothing, no failure blamed on the candidate."""
    spec = ToleranceSpec.from_dict({"y": {"metric": "linf", "threshold": 1e-3}})
    for cand in (answer({"y": np.ones((2, 4), dtype=np.float32)}, binary=True, version="2"), primary):
        cmp = both(primary, cand, spec)
        assert not cmp.reference_ok and not cmp.passed and cmp.outputs == {}, cmp
        assert why in cmp.reasons[0], cmp.reasons


def test_a_client_that_asks_for_some_outputs_is_judged_on_those() -> None:
    """A client that asks for one of two outputs gets that one alone, from both versions: the comparison judges
    it and does not hold the output nobody asked for against the candidate (or count a pass on nothing)."""
    spec = ToleranceSpec.from_dict({"y": {"metric": "linf", "threshold": 1e-3},
                                    "k": {"metric": "linf", "threshold": 0.0}})  # fmt: skip
    k = np.arange(6, dtype=np.int32).reshape(2, 3)
    primary = answer({"k": k}, binary=True)
    for fast in (True, False):
        same = compare_responses(primary, answer({"k": k}, binary=True, version="2"), spec, fast=fast)
        assert same.reference_ok and same.passed and same.outputs == {"k": True}, same
        other = compare_responses(primary, answer({"k": k + 1}, binary=True, version="2"), spec, fast=fast)
        assert other.reference_ok and not other.passed and other.outputs == {"k": False}, other
        none = compare_responses(primary, answer({"y": np.ones((2, 4), np.float32)}, binary=True, version="2"),
                                 spec, fast=fast)  # fmt: skip
        assert none.reference_ok and not none.passed, none  # the candidate lacks the output asked for


def test_identical_passes_declines_what_it_cannot_be_sure_of() -> None:
    y = {"y": np.ones((2, 4), dtype=np.float32)}
    assert identical_passes(spec_for("linf", 0.0), y)
    assert identical_passes(spec_for("cosine", 0.999), y)
    assert not identical_passes(spec_for("cosine", 1.0), y)  # rounding could put it just under
    assert not identical_passes(spec_for("linf", -1.0), y)  # 0 does not meet a negative threshold
    assert not identical_passes(ToleranceSpec.from_dict({"z": {"metric": "linf", "threshold": 1}}), y)
    assert not identical_passes(spec_for("l1", 1.0), {"y": np.zeros((0, 4), dtype=np.float32)})
    assert not identical_passes(spec_for("cosine", 0.9), {"y": np.ones(4, dtype=np.float64)})


METRICS = st.sampled_from(["l0", "l1", "l2", "linf", "cosine", "topk"])


@st.composite
def cases(draw: st.DrawFn) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], bool, ToleranceSpec]:
    dt = draw(st.sampled_from(sorted(DTYPES)))
    shape = draw(st.sampled_from([(4,), (2, 3), (1, 5), (3, 1), (0, 2)]))
    n = int(np.prod(shape))
    special = [0.0, -0.0, 1.0, 1e30, -1e30, np.nan, np.inf, -np.inf] if dt.startswith("FP") else [0, 1, 2, 7]
    vals = draw(st.lists(st.sampled_from(special) | st.floats(-100, 100, width=16), min_size=n, max_size=n))
    with np.errstate(over="ignore", invalid="ignore"):
        y = np.array(vals, dtype=np.float64).astype(DTYPES[dt]).reshape(shape)
    cand = y.copy()
    if n and draw(st.booleans()):  # a changed candidate half the time
        flat = cand.reshape(-1)
        i = draw(st.integers(0, n - 1))
        flat[i] = (not flat[i]) if dt == "BOOL" else flat[i] + 1
    metric = draw(METRICS)
    hi = metric in ("cosine", "topk")
    threshold = draw(
        st.sampled_from([0.0, 0.5, 0.999, 1.0] if hi or metric == "l0" else [-1.0, 0.0, 1e-6, 2.0])
    )
    statistic = draw(st.sampled_from(["max", "mean", "quantile"]))
    return {"y": y}, {"y": cand}, draw(st.booleans()), spec_for(metric, threshold, statistic)


@settings(max_examples=300, deadline=None)
@given(cases())
def test_fast_and_full_paths_agree(
    case: tuple[dict[str, np.ndarray], dict[str, np.ndarray], bool, ToleranceSpec],
) -> None:
    ref, cand, binary, spec = case
    with np.errstate(all="ignore"):
        both(answer(ref, binary=binary), answer(cand, binary=binary, version="2"), spec)
