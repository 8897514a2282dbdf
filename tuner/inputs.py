"""The tuner's inputs: gate batches (the declared or captured distribution plus edge cases) and benchmark shapes.

Declared inputs read the source ONNX's input names, types and dims: axis 0 is the batch, a
second symbolic axis the sequence. `values = "text"` feeds tokenised real sentences (BERT-style
`input_ids`/`attention_mask`/`token_type_ids`); `normal`/`uniform` feed seeded random values.
A capture (written by the sidecar) replaces the distribution with recorded requests.
Every gate batch is one *sample* of the gate's out-of-tolerance rate, as every live request is one
for the sidecar's canary: `samples` captured requests, or `samples` batches drawn from the declared
distribution plus the edge cases.
Everything is deterministic for a given spec; `digest` is what release.json records.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from tunegate.capture import CaptureError, read_capture
from tunegate.codec import CodecError
from tunegate.errors import InputError
from tunegate.textdata import Tokenizer, sentences
from tuner.spec import InputsSection, Shape

TEXT_INPUTS = ("input_ids", "attention_mask")
DEFAULT_SEQUENCE = 16


class InputsError(InputError):
    """Inputs that cannot be made for this model (the message says what and why)."""


@dataclasses.dataclass(frozen=True)
class InputDesc:
    name: str
    dtype: np.dtype[Any]
    dims: tuple[int | str, ...]  # ints are fixed, strings symbolic


@dataclasses.dataclass(frozen=True)
class Batch:
    label: str  # "dist-3", "edge:largest", "capture-12"
    feeds: dict[str, npt.NDArray[Any]]

    @property
    def rows(self) -> int:
        return int(next(iter(self.feeds.values())).shape[0])


@dataclasses.dataclass(frozen=True)
class BenchShape:
    key: str  # "b8xs32"
    batch: int
    weight: float
    feeds: dict[str, npt.NDArray[Any]]


@dataclasses.dataclass(frozen=True)
class InputSet:
    gate: tuple[Batch, ...]
    bench: tuple[BenchShape, ...]
    digest: str

    def locate(self, sample: int) -> str:
        """Which batch and row a pooled sample index (a verdict's worst sample) came from."""
        for b in self.gate:
            if sample < b.rows:
                return f"{b.label} row {sample}"
            sample -= b.rows
        return "?"


def describe_inputs(source: Path) -> list[InputDesc]:
    import onnx
    from onnx import helper

    graph = onnx.load(str(source), load_external_data=False).graph
    inits = {i.name for i in graph.initializer}
    out = []
    for inp in graph.input:
        if inp.name in inits:
            continue
        tt = inp.type.tensor_type
        dims = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in tt.shape.dim)
        out.append(InputDesc(inp.name, np.dtype(helper.tensor_dtype_to_np_dtype(tt.elem_type)), dims))
    return out


def _shape_of(desc: InputDesc, batch: int, sequence: int | None) -> tuple[int, ...]:
    shape = []
    for axis, d in enumerate(desc.dims):
        if isinstance(d, int) and d > 0:
            shape.append(d)
        elif axis == 0:
            shape.append(batch)
        else:
            shape.append(sequence or DEFAULT_SEQUENCE)
    return tuple(shape)


def _random_feeds(
    descs: list[InputDesc], spec: InputsSection, shape: Shape, rng: np.random.Generator
) -> dict[str, npt.NDArray[Any]]:
    feeds = {}
    for d in descs:
        dims = _shape_of(d, shape.batch, shape.sequence)
        arr: Any
        if d.dtype.kind == "f":
            if spec.values == "uniform":
                arr = rng.uniform(spec.mean - spec.std, spec.mean + spec.std, dims)
            else:
                arr = rng.normal(spec.mean, spec.std, dims)
        elif d.dtype.kind in "iu":
            arr = rng.integers(0, max(2, int(spec.std)), dims)  # integer inputs: uniform in [0, max(2, std))
        elif d.dtype.kind == "b":
            arr = rng.integers(0, 2, dims).astype(bool)
        else:
            raise InputsError(f"input {d.name!r}: cannot generate values of type {d.dtype}")
        feeds[d.name] = np.asarray(arr).astype(d.dtype)
    return feeds


class _Text:
    """Tokenised real sentences for BERT-style inputs."""

    def __init__(self, descs: list[InputDesc], spec: InputsSection) -> None:

        names = {d.name for d in descs}
        if not set(TEXT_INPUTS) <= names:
            raise InputsError(f"values = 'text' needs inputs {TEXT_INPUTS}; the model has {sorted(names)}")
        self.token_types = "token_type_ids" in names
        self.tok = Tokenizer(max_length=spec.max_length)
        self.pool = sentences()
        lengths = [len(e) for e in self.tok._tok.encode_batch(list(self.pool[:2000]))]
        order = np.argsort(lengths, kind="stable")
        self.shortest = [self.pool[i] for i in order[:64]]
        self.longest = [self.pool[i] for i in order[::-1][:64]]
        self.max_length = spec.max_length

    def feeds(self, texts: list[str], pad_to: int | None) -> dict[str, npt.NDArray[np.int64]]:
        f = self.tok(texts, pad_to=pad_to)
        if pad_to is not None:  # truncate to a fixed sequence too, so bench shapes are exact
            f = {k: v[:, :pad_to] for k, v in f.items()}
        if self.token_types:
            f["token_type_ids"] = np.zeros_like(f["input_ids"])
        return f

    def sample(self, shape: Shape, rng: np.random.Generator) -> dict[str, npt.NDArray[np.int64]]:
        idx = rng.choice(len(self.pool), size=shape.batch, replace=len(self.pool) < shape.batch)
        return self.feeds([self.pool[i] for i in idx], shape.sequence)


def _digest(batches: list[dict[str, npt.NDArray[Any]]]) -> str:
    h = hashlib.sha256()
    for feeds in batches:
        for name in sorted(feeds):
            arr = np.ascontiguousarray(feeds[name])
            h.update(f"{name}|{arr.dtype.str}|{arr.shape}|".encode())
            h.update(arr.tobytes())
    return h.hexdigest()


def _edge_cases(
    descs: list[InputDesc], spec: InputsSection, text: _Text | None, rng: np.random.Generator
) -> list[Batch]:
    small_b = min(s.batch for s in spec.shapes)
    large_b = max(s.batch for s in spec.shapes)
    seqs = [s.sequence for s in spec.shapes if s.sequence]
    large_s = max(seqs) if seqs else DEFAULT_SEQUENCE
    if text is not None:
        mixed = [text.longest[0]] + text.shortest[: large_b - 1]
        return [
            Batch("edge:smallest", text.feeds(text.shortest[:small_b], None)),
            Batch("edge:largest", text.feeds(text.longest[:large_b], text.max_length)),
            Batch("edge:heavy-padding", text.feeds(mixed, text.max_length)),
        ]
    small_s = min(seqs) if seqs else DEFAULT_SEQUENCE
    return [
        Batch("edge:smallest", _random_feeds(descs, spec, Shape(small_b, small_s if seqs else None, 1), rng)),
        Batch("edge:largest", _random_feeds(descs, spec, Shape(large_b, large_s if seqs else None, 1), rng)),
    ]


def _from_capture(
    spec: InputsSection, model: str, descs: list[InputDesc], samples: int, needed: int
) -> InputSet:

    assert spec.capture is not None
    gate: list[Batch] = []
    try:
        # not strict: the sidecar may be writing the capture's last line right now (a torn line is skipped)
        records = [r for r in read_capture(spec.capture, strict=False) if r.model == model]
        if not records:
            raise InputsError(f"{spec.capture}: no captured requests for model {model!r}")
        if len(records) < needed:
            raise InputsError(
                f"{spec.capture}: {len(records)} captured requests for model {model!r}; the gate needs "
                f"at least {needed} to show its out-of-tolerance budget (capture more traffic)"
            )
        for i, rec in enumerate(records[:samples]):
            gate.append(Batch(f"capture-{i}", rec.decode().arrays()))
    except (CaptureError, CodecError) as exc:
        raise InputsError(f"{spec.capture}: {exc}") from exc
    wanted = {d.name for d in descs}
    for b in gate:
        if set(b.feeds) != wanted:
            raise InputsError(
                f"{b.label}: captured inputs {sorted(b.feeds)} are not the model's {sorted(wanted)}"
            )
    counts = Counter(tuple(b.feeds[n].shape for n in sorted(b.feeds)) for b in gate)
    bench = []
    for shapes, n in counts.most_common(4):
        first = next(b for b in gate if tuple(b.feeds[k].shape for k in sorted(b.feeds)) == shapes)
        key = "x".join(str(d) for d in shapes[0])
        bench.append(BenchShape(f"cap{key}", first.rows, float(n), first.feeds))
    return InputSet(tuple(gate), tuple(bench), _digest([b.feeds for b in gate]))


def make_inputs(spec: InputsSection, source: Path, model: str, samples: int, needed: int = 1) -> InputSet:
    """Gate batches (`samples` of them, plus the edge cases of a declared distribution) and bench shapes.

    `needed` is the fewest gate requests the gate can pass on; a capture with fewer is an error.
    Deterministic for a given spec.
    """
    if samples < 1:
        raise InputsError(f"the gate needs at least one sample, got {samples}")
    descs = describe_inputs(source)
    if spec.source == "capture":
        return _from_capture(spec, model, descs, samples, needed)
    rng = np.random.default_rng(spec.seed)
    text = _Text(descs, spec) if spec.values == "text" else None
    weights = np.array([s.weight for s in spec.shapes])
    gate = []
    for i in range(samples):
        shape = spec.shapes[int(rng.choice(len(spec.shapes), p=weights / weights.sum()))]
        if text is not None:
            # Gate batches keep the sentences' natural lengths (up to max_length): truncating them to
            # the benchmark's sequence would hide the long inputs where quantisation errors grow.
            feeds = text.sample(Shape(shape.batch, None, shape.weight), rng)
        else:
            feeds = _random_feeds(descs, spec, shape, rng)
        gate.append(Batch(f"dist-{i}", feeds))
    if spec.edge_cases:
        gate.extend(_edge_cases(descs, spec, text, rng))
    bench = []
    for s in spec.shapes:
        feeds = text.sample(s, rng) if text else _random_feeds(descs, spec, s, rng)
        key = f"b{s.batch}" + (f"xs{s.sequence}" if s.sequence else "")
        bench.append(BenchShape(key, s.batch, s.weight, feeds))
    return InputSet(tuple(gate), tuple(bench), _digest([b.feeds for b in gate] + [b.feeds for b in bench]))
