"""Tolerance specs and tensor comparison: the one piece of code both the tuner's gate and the sidecar's live check use.

A `Tolerance` says, per output tensor, which metric is computed per sample (a row along axis 0),
which statistic aggregates the samples, and the threshold the statistic must meet.

Metrics (per sample):
  l0      fraction of elements with |c - r| > atol + rtol*|r|     (lower is better)
  l1      mean absolute error                                      (lower is better)
  l2      root-mean-square error                                   (lower is better)
  linf    max absolute error                                       (lower is better)
  cosine  cosine similarity of the flattened sample                (higher is better)
  topk    fraction of the reference's top-k (last axis) found in the candidate's top-k (higher is better)

Statistics aggregate per-sample values toward the *worse* end: `max` is the worst sample (for
cosine/topk that is the smallest value), `mean` is the mean, `quantile` the q-quantile of badness.
A candidate with NaN/Inf where the reference is finite fails outright, whatever the metric says.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from tunegate.errors import InputError

METRICS = ("l0", "l1", "l2", "linf", "cosine", "topk")
STATISTICS = ("max", "mean", "quantile")
HIGHER_IS_BETTER = frozenset({"cosine", "topk"})


class ToleranceError(InputError):
    """A tolerance spec that cannot be used."""


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """Tolerance for one output (`output='*'` applies to every output not named elsewhere)."""

    output: str
    metric: str
    threshold: float
    statistic: str = "max"
    quantile: float = 0.99
    atol: float = 1e-5
    rtol: float = 1e-3
    k: int = 5

    def __post_init__(self) -> None:
        where = f"tolerance for output {self.output!r}"
        if self.metric not in METRICS:
            raise ToleranceError(f"{where}: metric {self.metric!r} is not one of {', '.join(METRICS)}")
        if self.statistic not in STATISTICS:
            raise ToleranceError(
                f"{where}: statistic {self.statistic!r} is not one of {', '.join(STATISTICS)}"
            )
        if not math.isfinite(self.threshold):
            raise ToleranceError(f"{where}: threshold must be a finite number")
        if not 0.0 < self.quantile < 1.0:
            raise ToleranceError(f"{where}: quantile must be in (0, 1), got {self.quantile}")
        if self.atol < 0 or self.rtol < 0:
            raise ToleranceError(f"{where}: atol and rtol must be >= 0")
        if self.k < 1:
            raise ToleranceError(f"{where}: k must be >= 1")
        if self.metric in HIGHER_IS_BETTER and not 0.0 <= self.threshold <= 1.0:
            raise ToleranceError(f"{where}: a {self.metric} threshold must be within [0, 1]")
        if self.metric == "l0" and not 0.0 <= self.threshold <= 1.0:
            raise ToleranceError(f"{where}: an l0 threshold is a fraction within [0, 1]")

    @property
    def higher_is_better(self) -> bool:
        return self.metric in HIGHER_IS_BETTER

    def describe(self) -> str:
        stat = f"q{self.quantile:g}" if self.statistic == "quantile" else self.statistic
        op = ">=" if self.higher_is_better else "<="
        extra = f" (atol={self.atol:g}, rtol={self.rtol:g})" if self.metric == "l0" else ""
        extra = f" (k={self.k})" if self.metric == "topk" else extra
        return f"{self.output}: {stat} {self.metric}{extra} {op} {self.threshold:g}"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, output: str, raw: Mapping[str, Any]) -> Tolerance:
        known = {f.name for f in dataclasses.fields(cls)} - {"output"}
        unknown = set(raw) - known
        if unknown:
            raise ToleranceError(f"tolerance for output {output!r}: unknown keys {sorted(unknown)}")
        if "metric" not in raw or "threshold" not in raw:
            raise ToleranceError(f"tolerance for output {output!r} needs 'metric' and 'threshold'")
        try:
            return cls(output=output, **{k: v for k, v in raw.items() if k != "output"})
        except TypeError as exc:
            raise ToleranceError(f"tolerance for output {output!r}: {exc}") from exc


@dataclasses.dataclass(frozen=True)
class ToleranceSpec:
    tolerances: tuple[Tolerance, ...]

    def __post_init__(self) -> None:
        if not self.tolerances:
            raise ToleranceError("a tolerance spec needs at least one output tolerance")
        names = [t.output for t in self.tolerances]
        if len(set(names)) != len(names):
            raise ToleranceError(f"an output appears twice in the tolerance spec: {names}")

    def for_output(self, name: str) -> Tolerance | None:
        wildcard = None
        for t in self.tolerances:
            if t.output == name:
                return t
            if t.output == "*":
                wildcard = t
        return wildcard

    def to_dict(self) -> dict[str, Any]:
        return {t.output: {k: v for k, v in t.to_dict().items() if k != "output"} for t in self.tolerances}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> ToleranceSpec:
        if not isinstance(raw, Mapping) or not raw:
            raise ToleranceError("tolerance must be a table of output name -> {metric, threshold, ...}")
        tols = []
        for name, body in raw.items():
            if not isinstance(body, Mapping):
                raise ToleranceError(f"tolerance for output {name!r} must be a table")
            tols.append(Tolerance.from_dict(str(name), body))
        return cls(tuple(tols))


def _as_samples(a: npt.NDArray[Any]) -> npt.NDArray[Any]:
    a = np.asarray(a)
    if a.ndim == 0:
        return a.reshape(1, 1)
    if a.ndim == 1:
        return a.reshape(1, -1)
    return a.reshape(a.shape[0], math.prod(a.shape[1:]))  # not -1: a (0, n) tensor has no size to infer from


def sample_values(tol: Tolerance, ref: npt.NDArray[Any], cand: npt.NDArray[Any]) -> npt.NDArray[np.float64]:
    """Per-sample metric values (float64, one per row along axis 0)."""
    r = _as_samples(ref).astype(np.float64)
    c = _as_samples(cand).astype(np.float64)
    if r.shape[1] == 0:  # samples without elements (e.g. zero detections): nothing differs
        return np.ones(r.shape[0]) if tol.higher_is_better else np.zeros(r.shape[0])
    if tol.metric == "l0":
        bad = np.abs(c - r) > tol.atol + tol.rtol * np.abs(r)
        bad |= ~np.isfinite(c) & np.isfinite(r)
        return np.asarray(bad.mean(axis=1))
    if tol.metric == "l1":
        return np.asarray(np.abs(c - r).mean(axis=1))
    if tol.metric == "l2":
        return np.asarray(np.sqrt(((c - r) ** 2).mean(axis=1)))
    if tol.metric == "linf":
        return np.asarray(np.abs(c - r).max(axis=1, initial=0.0))
    if tol.metric == "cosine":
        dot = (r * c).sum(axis=1)
        nr = np.linalg.norm(r, axis=1)
        nc = np.linalg.norm(c, axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            cos = dot / (nr * nc)
        both_zero = (nr == 0) & (nc == 0)
        cos = np.where(both_zero, 1.0, np.where((nr == 0) | (nc == 0), 0.0, cos))
        return np.asarray(np.clip(np.nan_to_num(cos, nan=0.0), -1.0, 1.0))
    # topk along the last axis of the original tensor; samples with several rows average their rows
    rr = np.asarray(ref, dtype=np.float64)
    cc = np.asarray(cand, dtype=np.float64)
    if rr.ndim == 0:
        return np.ones(1)
    k = min(tol.k, rr.shape[-1])
    rtop = np.argsort(-rr, axis=-1, kind="stable")[..., :k]
    ctop = np.argsort(-np.nan_to_num(cc, nan=-np.inf), axis=-1, kind="stable")[..., :k]
    hits = (rtop[..., :, None] == ctop[..., None, :]).any(axis=-1).mean(axis=-1)
    if rr.ndim == 1:
        return np.asarray(hits).reshape(1)
    return np.asarray(hits.reshape(hits.shape[0], math.prod(hits.shape[1:])).mean(axis=1))


def aggregate(tol: Tolerance, values: npt.NDArray[np.float64]) -> tuple[float, int]:
    """Statistic over per-sample values and the index of the worst sample."""
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        return (1.0 if tol.higher_is_better else 0.0), -1
    worst = int(np.argmin(v) if tol.higher_is_better else np.argmax(v))
    if tol.statistic == "max":
        return float(v[worst]), worst
    if tol.statistic == "mean":
        return float(v.mean()), worst
    q = 1.0 - tol.quantile if tol.higher_is_better else tol.quantile
    return float(np.quantile(v, q)), worst


def within(tol: Tolerance, stat: float) -> bool:
    if math.isnan(stat):
        return False
    return stat >= tol.threshold if tol.higher_is_better else stat <= tol.threshold


@dataclasses.dataclass(frozen=True)
class OutputVerdict:
    output: str
    tolerance: Tolerance | None
    passed: bool
    value: float
    worst_sample: int
    values: tuple[float, ...]
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "output": self.output,
            "metric": self.tolerance.metric if self.tolerance else None,
            "statistic": self.tolerance.statistic if self.tolerance else None,
            "threshold": self.tolerance.threshold if self.tolerance else None,
            "value": self.value,
            "worst_sample": self.worst_sample,
            "passed": self.passed,
            "reason": self.reason,
        }


@dataclasses.dataclass(frozen=True)
class Verdict:
    outputs: dict[str, OutputVerdict]

    @property
    def passed(self) -> bool:
        return all(o.passed for o in self.outputs.values())

    @property
    def failures(self) -> list[OutputVerdict]:
        return [o for o in self.outputs.values() if not o.passed]

    def summary(self) -> str:
        return "; ".join(o.reason for o in self.outputs.values())

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "outputs": {k: v.to_dict() for k, v in self.outputs.items()}}


def _structural_failure(name: str, ref: npt.NDArray[Any] | None, cand: npt.NDArray[Any] | None) -> str | None:
    if cand is None:
        return f"{name}: missing from the candidate's outputs"
    if ref is None:
        return None
    if ref.shape != cand.shape:
        return f"{name}: shape {list(cand.shape)} differs from reference {list(ref.shape)}"
    if ref.dtype.kind in "fc" and cand.dtype.kind in "fc":
        rf = np.isfinite(ref)
        bad = ~np.isfinite(cand) & rf
        if bad.any():
            idx = int(np.argwhere(_as_samples(bad).any(axis=1))[0][0])
            return f"{name}: {int(bad.sum())} non-finite values where the reference is finite (first in sample {idx})"
    elif ref.dtype != cand.dtype:
        return f"{name}: dtype {cand.dtype} differs from reference {ref.dtype}"
    return None


def _verdict_for(
    name: str, tol: Tolerance | None, values: npt.NDArray[np.float64], structural: str | None
) -> OutputVerdict:
    if structural is not None:
        bad = 0.0 if tol is None or tol.higher_is_better else math.inf
        return OutputVerdict(name, tol, False, bad, -1, tuple(float(x) for x in values), structural)
    if tol is None:
        return OutputVerdict(name, None, True, 0.0, -1, (), f"{name}: no tolerance, not compared")
    stat, worst = aggregate(tol, values)
    ok = within(tol, stat)
    op = (">=" if ok else "<") if tol.higher_is_better else ("<=" if ok else ">")
    reason = (
        f"{name}: {tol.statistic} {tol.metric} {stat:.6g} {op} {tol.threshold:g}"
        f"{'' if ok else f' (worst sample {worst}: {values[worst]:.6g})' if worst >= 0 else ' (no samples)'}"
    )
    return OutputVerdict(name, tol, ok, stat, worst, tuple(float(x) for x in values), reason)


COSINE_CERTAIN = (
    1.0 - 1e-6
)  # below this threshold, identical finite (non-FP64) samples pass cosine despite rounding


def identical_passes(spec: ToleranceSpec, arrays: Mapping[str, npt.NDArray[Any]]) -> bool:
    """True when `compare(arrays, arrays, spec)` is certain to pass, decided without computing any metric.

    For identical finite, non-empty numeric tensors every lower-is-better metric is exactly 0 and topk is
    exactly 1, whatever the statistic; cosine is 1 up to rounding (hence COSINE_CERTAIN; FP64 is left out,
    where squares can overflow). Anything else (NaN/Inf, empty or BYTES tensors, a named output that is
    missing, a threshold that 0 or 1 does not meet) returns False: the caller then runs `compare`, so
    the verdict is always the one `compare` gives.
    """
    for t in spec.tolerances:
        if t.output != "*" and t.output not in arrays:
            return False
    for name, a in arrays.items():
        tol = spec.for_output(name)
        if tol is None:
            continue
        a = np.asarray(a)
        if a.size == 0 or a.dtype.kind not in "biuf":
            return False
        if a.dtype.kind == "f" and not np.isfinite(a).all():
            return False
        if tol.metric == "cosine" and (a.dtype == np.float64 or tol.threshold > COSINE_CERTAIN):
            return False
        if not within(tol, 1.0 if tol.higher_is_better else 0.0):
            return False
    return True


def compare(
    ref: Mapping[str, npt.NDArray[Any]], cand: Mapping[str, npt.NDArray[Any]], spec: ToleranceSpec
) -> Verdict:
    """Compare one set of outputs (e.g. one request's response) against the reference."""
    return compare_many([ref], [cand], spec)


def compare_many(
    refs: Sequence[Mapping[str, npt.NDArray[Any]]],
    cands: Sequence[Mapping[str, npt.NDArray[Any]]],
    spec: ToleranceSpec,
) -> Verdict:
    """The gate over many batches: per-sample values are pooled across batches before the statistic."""
    if len(refs) != len(cands):
        raise ValueError(f"{len(refs)} reference batches but {len(cands)} candidate batches")
    names: list[str] = []
    for r in refs:
        names.extend(n for n in r if n not in names)
    explicit = [t.output for t in spec.tolerances if t.output != "*"]
    names.extend(n for n in explicit if n not in names)
    verdicts: dict[str, OutputVerdict] = {}
    for name in names:
        tol = spec.for_output(name)
        pooled: list[npt.NDArray[np.float64]] = []
        structural: str | None = None
        offset = 0
        for r, c in zip(refs, cands, strict=True):
            ra, ca = r.get(name), c.get(name)
            if ra is None and ca is None:
                structural = structural or f"{name}: missing from the reference and the candidate"
                continue
            s = _structural_failure(
                name, None if ra is None else np.asarray(ra), None if ca is None else np.asarray(ca)
            )
            if s is not None:
                structural = structural or (s if offset == 0 else f"{s} (batch starting at sample {offset})")
                continue
            if tol is not None and ra is not None and ca is not None:
                with np.errstate(
                    invalid="ignore", over="ignore"
                ):  # NaN/Inf outcomes are judged, not warned about
                    vals = sample_values(tol, np.asarray(ra), np.asarray(ca))
                pooled.append(vals)
                offset += vals.size
        values = np.concatenate(pooled) if pooled else np.zeros(0)
        verdicts[name] = _verdict_for(name, tol, values, structural)
    return Verdict(verdicts)


def tolerances_from(items: Iterable[Tolerance]) -> ToleranceSpec:
    return ToleranceSpec(tuple(items))
