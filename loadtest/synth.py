"""Synthetic captures for the demo model when no live capture exists: real sentences, a long-tailed batch mix,
Poisson arrivals. Written in the capture format of tunegate.capture, so replay and tuning read it like a live one.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from tunegate import codec
from tunegate.capture import CaptureRecord, summarize_inputs, write_capture_file
from tunegate.textdata import Tokenizer, sample_batch

# Most requests carry one sentence; a long tail carries many (and so longer padded sequences).
DEFAULT_BATCH_MIX: tuple[tuple[int, float], ...] = ((1, 0.55), (2, 0.2), (4, 0.13), (8, 0.08), (16, 0.04))


@dataclasses.dataclass(frozen=True)
class SynthSpec:
    model: str = "minilm"
    requests: int = 400
    rate: float = 20.0  # mean requests per second of the recorded timeline
    batch_mix: tuple[tuple[int, float], ...] = DEFAULT_BATCH_MIX
    binary: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.requests < 1:
            raise ValueError("requests must be >= 1")
        if self.rate <= 0:
            raise ValueError("rate must be > 0")
        if (
            not self.batch_mix
            or any(b < 1 or w < 0 for b, w in self.batch_mix)
            or sum(w for _, w in self.batch_mix) <= 0
        ):
            raise ValueError("batch_mix needs positive batch sizes and non-negative weights that sum above 0")


def parse_batch_mix(text: str) -> tuple[tuple[int, float], ...]:
    """'1:0.6,4:0.3,16:0.1' -> ((1, 0.6), (4, 0.3), (16, 0.1))."""
    out = []
    for part in text.split(","):
        try:
            b, w = part.split(":")
            out.append((int(b), float(w)))
        except ValueError as exc:
            raise ValueError(f"bad batch mix entry {part!r}; expected BATCH:WEIGHT") from exc
    return tuple(out)


def synthesize(spec: SynthSpec, tokenizer: Tokenizer | None = None, t0: float = 1.7e9) -> list[CaptureRecord]:
    tok = tokenizer or Tokenizer()
    rng = np.random.default_rng(spec.seed)
    sizes: Sequence[int] = [b for b, _ in spec.batch_mix]
    weights = np.array([w for _, w in spec.batch_mix], dtype=float)
    weights /= weights.sum()
    gaps = rng.exponential(1.0 / spec.rate, size=spec.requests)
    ts = t0 + np.cumsum(gaps) - gaps[0]
    records = []
    for i in range(spec.requests):
        batch = int(rng.choice(sizes, p=weights))
        feeds = sample_batch(tok, batch, rng)
        body, hl = codec.encode_request(feeds, binary=spec.binary)
        msg = codec.decode_request(body, hl)
        records.append(
            CaptureRecord(
                ts=float(ts[i]),
                model=spec.model,
                version=None,
                body=body,
                header_length=hl,
                request_id=str(uuid.UUID(int=int(rng.integers(0, 2**63)) << 64 | i)),
                inputs=summarize_inputs(msg),
            )
        )
    return records


def write_synthetic(path: Path, spec: SynthSpec) -> list[CaptureRecord]:
    records = synthesize(spec)
    write_capture_file(path, records)
    return records
