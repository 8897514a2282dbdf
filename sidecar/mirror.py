"""The mirror path: bounded background replays of client requests to the candidate (and to the baseline for A/A).

`BoundedTasks` is tracked, bounded work: a task set with a capacity; a job offered when it is full
is dropped and counted, and `drain()` cancels and awaits what is left at shutdown. The comparison
(decoding, numpy) runs in an executor via `compare_responses`, a pure function.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import zlib
from collections.abc import Coroutine, Iterable, Mapping
from typing import Any

from multidict import CIMultiDict

from tunegate import codec
from tunegate.tolerance import ToleranceSpec, compare


class BoundedTasks:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._tasks: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def offer(self, coro: Coroutine[Any, Any, None]) -> bool:
        """Start `coro` if there is room; otherwise close it unstarted and return False."""
        if len(self._tasks) >= self.capacity:
            coro.close()
            return False
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    async def drain(self, timeout_s: float = 0.0) -> int:
        """Let running work finish for up to `timeout_s`, then cancel the rest; returns how many were cancelled."""
        if timeout_s > 0 and self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)
        left = list(self._tasks)
        for t in left:
            t.cancel()
        for t in left:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        return len(left)


@dataclasses.dataclass(frozen=True)
class Response:
    status: int
    body: bytes
    headers: Mapping[str, str]

    @property
    def header_length(self) -> int | None:
        return codec.parse_header_length(self.headers.get(codec.HEADER))

    @classmethod
    def from_raw(cls, status: int, body: bytes, headers: Iterable[tuple[bytes, bytes]]) -> Response:
        """From an upstream answer's raw header pairs (made only for responses the mirror compares)."""
        return cls(status, body, CIMultiDict((k.decode("latin-1"), v.decode("latin-1")) for k, v in headers))


@dataclasses.dataclass(frozen=True)
class Comparison:
    passed: bool
    outputs: dict[str, bool]  # output name -> within tolerance
    reasons: tuple[str, ...]
    reference_ok: bool = True  # False: the primary's own response could not be decoded (nothing judged)


def _plain_body(resp: Response) -> bytes:
    enc = resp.headers.get("Content-Encoding", "").lower()
    if enc == "gzip":
        return zlib.decompress(resp.body, 16 + zlib.MAX_WBITS)
    if enc == "deflate":
        return zlib.decompress(resp.body)
    return resp.body


def compare_responses(primary: Response, other: Response, spec: ToleranceSpec) -> Comparison:
    """Decode both responses with the shared codec and compare them with the tuner's gate code."""
    try:
        ref = codec.decode_response(_plain_body(primary), primary.header_length).arrays()
    except (codec.CodecError, zlib.error) as exc:
        return Comparison(False, {}, (f"primary response not decodable: {exc}",), reference_ok=False)
    try:
        cand = codec.decode_response(_plain_body(other), other.header_length).arrays()
    except (codec.CodecError, zlib.error) as exc:
        return Comparison(False, {n: False for n in ref}, (f"response not decodable: {exc}",))
    verdict = compare(ref, cand, spec)
    outputs = {name: v.passed for name, v in verdict.outputs.items()}
    return Comparison(verdict.passed, outputs, tuple(f.reason for f in verdict.failures))
