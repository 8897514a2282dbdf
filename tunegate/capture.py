"""Request captures: the sidecar writes them, Locust replays them, the tuner reads them as its input distribution.

Format (one JSON object per line, UTF-8, files `capture-<UTC stamp>-<seq>.jsonl` in a directory):

    {"v": 1,                         # format version
     "ts": 1764690000.123,           # arrival time, unix seconds
     "model": "minilm",              # model name in the URL
     "version": null,                # version in the URL, or null for unversioned
     "request_id": "...",            # the sidecar's request id (also in decision exemplars)
     "header_length": 123,           # Inference-Header-Content-Length, or null for pure JSON
     "body_b64": "...",              # the exact request body, base64
     "inputs": {"input_ids": {"datatype": "INT64", "shape": [2, 17]}, ...}}

`inputs` is a summary (filled when the body was decoded); the body is authoritative. A writer
rotates files at `max_file_bytes` and keeps at most `max_files`; it caps its own rate.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tunegate import codec
from tunegate.errors import InputError
from tunegate.records import atomic_write_text

FORMAT_VERSION = 1
PROTOCOLS = ("http", "grpc")


class CaptureError(InputError):
    """A capture file that cannot be read; the message names the file and line."""


@dataclasses.dataclass(frozen=True)
class CaptureRecord:
    ts: float
    model: str
    version: str | None
    body: bytes
    header_length: int | None
    request_id: str | None = None
    inputs: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    # the protocol the client sent it over: "http", or "grpc" (its body then is the HTTP equivalent,
    # tunegate.grpc_codec); a replay may use either
    protocol: str = "http"

    def to_json(self) -> dict[str, Any]:
        return {
            "v": FORMAT_VERSION,
            "ts": self.ts,
            "model": self.model,
            "version": self.version,
            "request_id": self.request_id,
            "header_length": self.header_length,
            "body_b64": base64.b64encode(self.body).decode("ascii"),
            "inputs": self.inputs,
            "protocol": self.protocol,
        }

    def decode(self) -> codec.InferMessage:
        return codec.decode_request(self.body, self.header_length)

    @property
    def path(self) -> str:
        v = f"/versions/{self.version}" if self.version else ""
        return f"/v2/models/{self.model}{v}/infer"


def summarize_inputs(msg: codec.InferMessage) -> dict[str, dict[str, Any]]:
    return {n: {"datatype": t.datatype, "shape": list(t.shape)} for n, t in msg.tensors.items()}


def _parse(line: str, where: str) -> CaptureRecord:
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as exc:
        raise CaptureError(f"{where}: not JSON ({exc.msg})") from exc
    if not isinstance(raw, dict):
        raise CaptureError(f"{where}: a capture line must be a JSON object")
    if raw.get("v") != FORMAT_VERSION:
        raise CaptureError(
            f"{where}: unsupported capture format version {raw.get('v')!r} (expected {FORMAT_VERSION})"
        )
    for key, typ in (("ts", (int, float)), ("model", str), ("body_b64", str)):
        if not isinstance(raw.get(key), typ):
            raise CaptureError(f"{where}: field {key!r} is missing or has the wrong type")
    hl = raw.get("header_length")
    if hl is not None and (not isinstance(hl, int) or hl < 0):
        raise CaptureError(f"{where}: header_length must be a non-negative integer or null")
    try:
        body = base64.b64decode(raw["body_b64"], validate=True)
    except ValueError as exc:
        raise CaptureError(f"{where}: body_b64 is not valid base64") from exc
    version = raw.get("version")
    protocol = raw.get("protocol", "http")
    if protocol not in PROTOCOLS:
        raise CaptureError(f"{where}: protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
    return CaptureRecord(
        ts=float(raw["ts"]),
        model=raw["model"],
        version=None if version is None else str(version),
        body=body,
        header_length=hl,
        request_id=raw.get("request_id"),
        inputs=raw.get("inputs") or {},
        protocol=protocol,
    )


def capture_files(path: Path) -> list[Path]:
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("capture-*.jsonl"))
        if not files:
            raise CaptureError(f"{path}: no capture-*.jsonl files in this directory")
        return files
    if not path.exists():
        raise CaptureError(f"{path}: no such capture file")
    return [path]


def read_capture(path: Path, *, strict: bool = True) -> Iterator[CaptureRecord]:
    """Records of a capture file or directory, in file order. A torn last line is skipped."""
    for f in capture_files(path):
        with open(f, encoding="utf-8", errors="strict") as fh:
            try:
                lines = fh.read().splitlines()
            except UnicodeDecodeError as exc:
                raise CaptureError(f"{f}: not a UTF-8 text file (is it a capture?)") from exc
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                yield _parse(line, f"{f}:{n}")
            except CaptureError:
                if n == len(lines) and not strict:
                    continue  # a writer killed mid-line
                raise


def load_capture(path: Path) -> list[CaptureRecord]:
    records = list(read_capture(path))
    if not records:
        raise CaptureError(f"{path}: the capture has no records")
    return records


class CaptureWriter:
    """Rotating, rate- and size-capped capture files. Thread-safe; `write` is cheap and never raises on I/O."""

    def __init__(
        self,
        directory: Path,
        *,
        max_file_bytes: int = 64 << 20,
        max_files: int = 8,
        max_per_second: float = 50.0,
        max_body_bytes: int = 4 << 20,
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_file_bytes = max_file_bytes
        self.max_files = max_files
        self.max_per_second = max_per_second
        self.max_body_bytes = max_body_bytes
        self._lock = threading.Lock()
        self._fh: Any = None
        self._size = 0
        self._seq = 0
        self._tokens = max_per_second
        self._last = time.monotonic()
        self.written = 0
        self.skipped = 0

    def _allow(self) -> bool:
        now = time.monotonic()
        self._tokens = min(self.max_per_second, self._tokens + (now - self._last) * self.max_per_second)
        self._last = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False

    def _rotate(self) -> None:
        if self._fh is not None:
            self._fh.close()
        self._seq += 1
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        path = self.directory / f"capture-{stamp}-{os.getpid()}-{self._seq:04d}.jsonl"
        self._fh = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed on rotate/close
        self._size = 0
        files = sorted(self.directory.glob("capture-*.jsonl"), key=lambda p: p.stat().st_mtime)
        for old in files[: max(0, len(files) - self.max_files)]:
            old.unlink(missing_ok=True)

    def write(self, record: CaptureRecord) -> bool:
        if len(record.body) > self.max_body_bytes:
            self.skipped += 1
            return False
        line = json.dumps(record.to_json(), separators=(",", ":")) + "\n"
        with self._lock:
            if not self._allow():
                self.skipped += 1
                return False
            try:
                if self._fh is None or self._size + len(line) > self.max_file_bytes:
                    self._rotate()
                self._fh.write(line)
                self._fh.flush()
                self._size += len(line)
            except OSError:
                self.skipped += 1
                return False
            self.written += 1
            return True

    def close(self) -> None:
        with self._lock:
            if self._fh is not None:
                self._fh.close()
                self._fh = None


def write_capture_file(path: Path, records: list[CaptureRecord]) -> None:
    """Write a whole capture file atomically (generators, tests); live capture uses CaptureWriter."""

    atomic_write_text(
        Path(path), "".join(json.dumps(r.to_json(), separators=(",", ":")) + "\n" for r in records)
    )
