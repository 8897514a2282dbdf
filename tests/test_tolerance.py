"""Tolerance metrics and statistics on data (the code the tuner's gate and the sidecar share)."""

from __future__ import annotations

import numpy as np
import pytest

from tunegate.tolerance import Tolerance, ToleranceError, ToleranceSpec, compare, compare_many, sample_values


def spec(**kw: object) -> ToleranceSpec:
    return ToleranceSpec((Tolerance(output="y", **kw),))  # type: ignore[arg-type]


def test_identical_outputs_pass_every_metric() -> None:
    y = np.random.default_rng(0).standard_normal((4, 10)).astype(np.float32)
    for metric, thr in (
        ("l0", 0.0),
        ("l1", 0.0),
        ("l2", 0.0),
        ("linf", 0.0),
        ("cosine", 1 - 1e-12),
        ("topk", 1.0),
    ):
        v = compare({"y": y}, {"y": y.copy()}, spec(metric=metric, threshold=thr))
        assert v.passed, (metric, v.summary())


def test_metric_values() -> None:
    r = np.array([[1.0, 0.0, 0.0, 0.0], [0.0, 2.0, 0.0, 0.0]])
    c = np.array([[1.0, 0.5, 0.0, 0.0], [0.0, 2.0, 0.0, 0.0]])
    assert sample_values(Tolerance("y", "l1", 1.0), r, c).tolist() == [0.125, 0.0]
    assert sample_values(Tolerance("y", "linf", 1.0), r, c).tolist() == [0.5, 0.0]
    np.testing.assert_allclose(sample_values(Tolerance("y", "l2", 1.0), r, c), [np.sqrt(0.25 / 4), 0.0])
    np.testing.assert_allclose(sample_values(Tolerance("y", "cosine", 0.5), r, c), [1 / np.sqrt(1.25), 1.0])
    assert sample_values(Tolerance("y", "l0", 0.5, atol=0.1, rtol=0.0), r, c).tolist() == [0.25, 0.0]
    # top-2 of row 0 in ref is {0, one of the zeros}; candidate's is {0, 1}
    t = Tolerance("y", "topk", 0.5, k=1)
    assert sample_values(t, r, c).tolist() == [1.0, 1.0]


def test_statistics_take_the_worse_end() -> None:
    rng = np.random.default_rng(1)
    r = rng.standard_normal((100, 8))
    c = r.copy()
    c[7] = -c[7]  # one sample flipped: cosine -1
    tol_max = Tolerance("y", "cosine", 0.99, statistic="max")
    tol_mean = Tolerance("y", "cosine", 0.95, statistic="mean")
    tol_q = Tolerance("y", "cosine", 0.99, statistic="quantile", quantile=0.95)
    v = compare({"y": r}, {"y": c}, ToleranceSpec((tol_max,)))
    assert not v.passed and v.outputs["y"].worst_sample == 7 and v.outputs["y"].value == pytest.approx(-1)
    assert compare({"y": r}, {"y": c}, ToleranceSpec((tol_mean,))).outputs["y"].value == pytest.approx(0.98)
    assert compare({"y": r}, {"y": c}, ToleranceSpec((tol_q,))).passed  # 1% bad < 5% allowed


def test_nan_where_reference_is_finite_fails_whatever_the_metric() -> None:
    r = np.ones((3, 4), np.float32)
    c = r.copy()
    c[1, 2] = np.nan
    v = compare({"y": r}, {"y": c}, spec(metric="l1", threshold=1e9, statistic="mean"))
    assert not v.passed and "non-finite" in v.summary() and "sample 1" in v.summary()
    # NaN in both is not a candidate regression
    r2 = r.copy()
    r2[1, 2] = np.nan
    assert "non-finite" not in compare({"y": r2}, {"y": c}, spec(metric="l0", threshold=1.0)).summary()


def test_shape_mismatch_and_missing_output_fail() -> None:
    r = np.ones((2, 4))
    assert not compare({"y": r}, {"y": np.ones((2, 5))}, spec(metric="l1", threshold=1)).passed
    v = compare({"y": r}, {}, spec(metric="l1", threshold=1))
    assert not v.passed and "missing" in v.summary()


def test_compare_many_pools_samples_and_reports_worst_across_batches() -> None:
    r = [{"y": np.ones((2, 3))}, {"y": np.ones((3, 3))}]
    c = [{"y": np.ones((2, 3))}, {"y": np.ones((3, 3))}]
    c[1]["y"][2, 0] = 5.0
    v = compare_many(r, c, spec(metric="linf", threshold=0.1))
    assert not v.passed and v.outputs["y"].worst_sample == 4 and len(v.outputs["y"].values) == 5


def test_wildcard_and_per_output() -> None:
    s = ToleranceSpec.from_dict(
        {"*": {"metric": "linf", "threshold": 0.1}, "z": {"metric": "l1", "threshold": 5}}
    )
    v = compare(
        {"y": np.zeros((1, 2)), "z": np.zeros((1, 2))}, {"y": np.ones((1, 2)), "z": np.ones((1, 2))}, s
    )
    assert not v.outputs["y"].passed and v.outputs["z"].passed
    assert ToleranceSpec.from_dict(s.to_dict()) == s


@pytest.mark.parametrize(
    "raw,match",
    [
        ({"y": {"metric": "l9", "threshold": 1}}, "metric"),
        ({"y": {"metric": "cosine", "threshold": 2}}, r"\[0, 1\]"),
        ({"y": {"metric": "l1"}}, "needs 'metric' and 'threshold'"),
        ({"y": {"metric": "l1", "threshold": 1, "statistic": "median"}}, "statistic"),
        ({"y": {"metric": "l1", "threshold": 1, "bogus": 1}}, "unknown keys"),
        ({}, "table"),
    ],
)
def test_bad_tolerance_specs_are_clear(raw: dict[str, object], match: str) -> None:
    with pytest.raises(ToleranceError, match=match):
        ToleranceSpec.from_dict(raw)


@pytest.mark.parametrize("metric", ["l0", "l1", "l2", "linf", "cosine", "topk"])
@pytest.mark.parametrize("shape", [(2, 0), (0,), (2, 3, 0)])
def test_identical_tensors_without_elements_pass(metric: str, shape: tuple[int, ...]) -> None:
    """A detector that finds nothing answers an empty tensor: identical empty outputs are within any tolerance."""
    empty = np.zeros(shape, dtype=np.float32)
    threshold = 0.99 if metric in ("cosine", "topk") else 0.0
    spec = ToleranceSpec.from_dict({"boxes": {"metric": metric, "threshold": threshold}})
    assert compare({"boxes": empty}, {"boxes": empty.copy()}, spec).passed
