"""Replay plans built from captures: payloads (exact or synthesized), request names and the arrival profile.

Pure Python and numpy, no Locust import: the Locust users (locustfile.py) and the tests share it.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import numpy as np
import numpy.typing as npt

from tunegate import codec, grpc_codec
from tunegate.capture import CaptureError, CaptureRecord, load_capture

MODES = ("exact", "synth")
NAME_BY = ("model", "batch", "shape")


@dataclasses.dataclass(frozen=True)
class Payload:
    path: str
    body: bytes
    headers: dict[str, str]
    name: str
    shape_key: str


_INFER_PATH = re.compile(r"^/v2/models/([^/]+)(?:/versions/([^/]+))?/infer$")


def grpc_request(p: Payload) -> bytes:
    """The payload as a serialized gRPC ModelInferRequest (Triton's GRPCInferenceService), for the same model
    and version; the tensors' bytes are the same in both protocols."""
    m = _INFER_PATH.match(p.path)
    if m is None:
        raise CaptureError(f"{p.path}: not an inference path")
    raw_hl = p.headers.get(codec.HEADER)
    req = grpc_codec.http_to_request(p.body, None if raw_hl is None else int(raw_hl), unquote(m.group(1)),
                                     m.group(2) or "")  # fmt: skip
    return bytes(req.SerializeToString())


def shape_key(shapes: Mapping[str, Sequence[int]]) -> str:
    """A stable label for a request's input shapes, e.g. 'attention_mask=2x17,input_ids=2x17'."""
    return ",".join(f"{n}={'x'.join(str(d) for d in s)}" for n, s in sorted(shapes.items()))


def _headers(header_length: int | None) -> dict[str, str]:
    h = {"Content-Type": "application/octet-stream" if header_length is not None else "application/json"}
    if header_length is not None:
        h[codec.HEADER] = str(header_length)
    return h


def batch_of(shapes: Mapping[str, Sequence[int]]) -> int:
    """The batch size of a request: the first dimension of its inputs (1 for scalars)."""
    dims = [s[0] for s in shapes.values() if len(s)]
    return int(dims[0]) if dims else 1


def _name(model: str, shapes: Mapping[str, Sequence[int]], name_by: str) -> str:
    if name_by == "model":
        return model
    if name_by == "batch":
        return f"{model} b={batch_of(shapes)}"
    return f"{model} {shape_key(shapes)}"


def exact_payloads(records: Sequence[CaptureRecord], name_by: str = "model") -> list[Payload]:
    out = []
    for i, r in enumerate(records):
        try:
            msg = r.decode()
        except codec.CodecError as exc:
            raise CaptureError(
                f"capture record {i} ({r.request_id or 'no id'}): body does not decode: {exc}"
            ) from exc
        shapes = {n: t.shape for n, t in msg.tensors.items()}
        out.append(
            Payload(
                r.path, r.body, _headers(r.header_length), _name(r.model, shapes, name_by), shape_key(shapes)
            )
        )
    return out


class Synthesizer:
    """New payloads with each record's exact shapes and datatypes, values drawn from the capture's own values.

    Drawing from the empirical value pool of each input keeps token ids real token ids and masks 0/1
    without knowing the model.
    """

    def __init__(self, records: Sequence[CaptureRecord], seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.records = list(records)
        pools: dict[str, list[npt.NDArray[Any]]] = {}
        self.decoded: list[codec.InferMessage] = []
        for i, r in enumerate(self.records):
            try:
                msg = r.decode()
            except codec.CodecError as exc:
                raise CaptureError(f"capture record {i}: body does not decode: {exc}") from exc
            self.decoded.append(msg)
            for n, t in msg.tensors.items():
                pools.setdefault(n, []).append(t.array.reshape(-1))
        self.pools = {n: np.concatenate(v) for n, v in pools.items()}

    def payload(self, i: int, name_by: str = "model", binary: bool = True) -> Payload:
        rec, msg = self.records[i], self.decoded[i]
        tensors = []
        for n, t in msg.tensors.items():
            pool = self.pools[n]
            size = int(np.prod(t.shape)) if t.shape else 1
            values = (
                pool[self.rng.integers(0, pool.size, size=size)]
                if pool.size
                else np.zeros(size, t.array.dtype)
            )
            tensors.append(codec.Tensor(n, t.datatype, values.reshape(t.shape).astype(t.array.dtype)))
        body, hl = codec.encode_request(tensors, binary=binary)
        shapes = {n: t.shape for n, t in msg.tensors.items()}
        return Payload(rec.path, body, _headers(hl), _name(rec.model, shapes, name_by), shape_key(shapes))


@dataclasses.dataclass(frozen=True)
class ArrivalProfile:
    """Request rate per `step_s` window of the capture, time-scaled (scale 2 = replay twice as fast)."""

    step_s: float
    rates: tuple[float, ...]  # requests per second of replay time, one per window

    @property
    def duration_s(self) -> float:
        return self.step_s * len(self.rates)

    def rate_at(self, t: float) -> float | None:
        i = int(t // self.step_s)
        return self.rates[i] if 0 <= i < len(self.rates) else None

    @classmethod
    def from_timestamps(
        cls, ts: Sequence[float], time_scale: float = 1.0, step_s: float = 1.0
    ) -> ArrivalProfile:
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        if not ts:
            raise CaptureError("the capture has no records to build an arrival profile from")
        t0 = min(ts)
        span = (max(ts) - t0) / time_scale
        n = max(1, math.ceil(span / step_s + 1e-9))
        counts = [0] * n
        for t in ts:
            counts[min(n - 1, int(((t - t0) / time_scale) // step_s))] += 1
        return cls(step_s, tuple(c / step_s for c in counts))


@dataclasses.dataclass(frozen=True)
class ReplayPlan:
    records: tuple[CaptureRecord, ...]
    mode: str
    name_by: str

    @classmethod
    def load(cls, path: Path, mode: str = "exact", name_by: str = "model") -> ReplayPlan:
        if mode not in MODES:
            raise ValueError(f"replay mode {mode!r} is not one of {', '.join(MODES)}")
        if name_by not in NAME_BY:
            raise ValueError(f"name-by {name_by!r} is not one of {', '.join(NAME_BY)}")
        return cls(tuple(load_capture(path)), mode, name_by)

    def shape_mix(self) -> dict[str, float]:
        return mix(record_shape_key(r) for r in self.records)


def record_shape_key(r: CaptureRecord) -> str:
    if r.inputs:
        return shape_key({n: v["shape"] for n, v in r.inputs.items()})
    return shape_key({n: t.shape for n, t in r.decode().tensors.items()})


def mix(keys: Iterable[str]) -> dict[str, float]:
    counts = Counter(keys)
    total = sum(counts.values())
    return {k: v / total for k, v in sorted(counts.items())} if total else {}


def total_variation(p: dict[str, float], q: dict[str, float]) -> float:
    """Half the L1 distance between two distributions (0 = identical, 1 = disjoint)."""
    keys = set(p) | set(q)
    return 0.5 * sum(abs(p.get(k, 0.0) - q.get(k, 0.0)) for k in keys)
