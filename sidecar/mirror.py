"""The mirror path: bounded background replays of client requests to the candidate (and to the baseline for A/A).

`MirrorSlots` bounds the mirrors in flight (full: drop and count); the mirror itself is a chain of
pool callbacks (sidecar/canary.py `_MirrorJob`), no task per sampled request. The comparison
(decoding, numpy) is `compare_responses`, a pure function over two upstream answers (raw header pairs
and body bytes); the canary runs it inline for small responses and in an executor for large ones.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
import zlib
from collections.abc import Callable, Mapping
from typing import Any

from sidecar.upstream import UpstreamResponse
from tunegate import codec
from tunegate.tolerance import ToleranceSpec, compare, identical_passes


class MirrorSlots:
    """The mirror's bound: at most `capacity` sampled requests in flight; an offer beyond is dropped and counted.

    `close()` ends the canary's mirroring: answers still on their way are ignored when they arrive
    (a decided canary takes no more evidence), and release their slots.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.in_flight = 0
        self.closed = False
        # told True when the slots fill and False when one frees or they close (CanaryManager.pair_busy)
        self.listener: Callable[[bool], None] | None = None

    def __len__(self) -> int:
        return self.in_flight

    def full(self) -> bool:
        """Would `acquire` refuse now?"""
        return self.closed or self.in_flight >= self.capacity

    def acquire(self) -> bool:
        if self.full():
            return False
        self.in_flight += 1
        if self.in_flight == self.capacity and self.listener is not None:
            self.listener(True)
        return True

    def release(self) -> None:
        self.in_flight -= 1
        if self.in_flight == self.capacity - 1 and not self.closed and self.listener is not None:
            self.listener(False)

    async def drain(self, timeout_s: float = 0.0) -> int:
        """Wait up to `timeout_s` for the mirrors in flight, then close; returns how many were left behind."""
        deadline = time.monotonic() + timeout_s
        while self.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        self.closed = True
        if self.listener is not None:
            self.listener(False)  # a closed canary holds no pair for anyone
        return self.in_flight


def payload(resp: UpstreamResponse) -> tuple[bytes, int | None]:
    """The body with its content-encoding undone, and the binary extension's JSON header length, from one scan
    of the raw header pairs (the first of each header counts). CodecError or zlib.error when malformed."""
    enc = raw_hl = None
    for name, value in resp.headers:
        low = name.lower()
        if low == b"inference-header-content-length":
            raw_hl = value if raw_hl is None else raw_hl
        elif low == b"content-encoding":
            enc = value if enc is None else enc
    hl = codec.parse_header_length(None if raw_hl is None else raw_hl.decode("latin-1"))
    if enc is None:
        return resp.body, hl
    enc = enc.lower()
    if enc == b"gzip":
        return zlib.decompress(resp.body, 16 + zlib.MAX_WBITS), hl
    if enc == b"deflate":
        return zlib.decompress(resp.body), hl
    return resp.body, hl


@dataclasses.dataclass(slots=True)
class Comparison:
    passed: bool
    outputs: dict[str, bool]  # output name -> within tolerance
    reasons: tuple[str, ...]
    reference_ok: bool = True  # False: the primary's own answer is unusable (`reference`; nothing judged)


# A JSON header that starts with only simple string members (no escapes) before "outputs", as Triton
# writes it: {"id":"...","model_name":"...","model_version":"...","outputs":[...
# Values: printable ASCII without quote or backslash, which json.loads takes as they are (no control bytes,
# no bytes that are not UTF-8).
_SIMPLE_HEAD = re.compile(rb'\{(?:"(?:id|model_name|model_version)":"[\x20\x21\x23-\x5b\x5d-\x7e]*",)*')
_OUTPUTS_KEY = b'"outputs":'


def _same_from_outputs(plain: bytes, hl: int | None, other: bytes, other_hl: int | None) -> bool:
    """Byte check: both bodies are a simple head followed by the very same bytes from the "outputs" key on.

    The heads hold only complete string members, so parsing is at the same point when "outputs" starts,
    and everything after it (the outputs, later members, the binary tail) is the same bytes: both
    decode to the same tensors, and one is valid JSON exactly when the other is.
    """
    i, j = plain.find(_OUTPUTS_KEY), other.find(_OUTPUTS_KEY)
    if i < 0 or j < 0 or (hl is None) != (other_hl is None) or (hl is not None and hl - i != other_hl - j):  # type: ignore[operator]
        return False
    return (
        _SIMPLE_HEAD.fullmatch(plain, 0, i) is not None
        and _SIMPLE_HEAD.fullmatch(other, 0, j) is not None
        and plain[i:] == other[j:]
    )


def _identical_outputs(
    header: Mapping[str, Any], plain: bytes, hl: int | None, other: UpstreamResponse
) -> bool:
    """Would the other response decode to exactly the primary's outputs? Decided on raw bytes where the heads
    are as Triton writes them, else on the parsed JSON (type for type) and the binary tail."""
    try:
        other_plain, other_hl = payload(other)
        if _same_from_outputs(plain, hl, other_plain, other_hl):
            return True
        other_header, other_tail = codec.split_body(other_plain, other_hl)
    except (codec.CodecError, zlib.error):
        return False
    tail = plain[hl:] if hl is not None else b""
    return other_tail == tail and codec.same_json(header.get("outputs"), other_header.get("outputs"))


@dataclasses.dataclass
class Reference:
    """The primary's answer decoded once, for every comparison against it (the candidate's and the A/A one)."""

    plain: bytes
    header_length: int | None
    header: Mapping[str, Any]
    arrays: dict[str, Any]
    _spec: ToleranceSpec | None = None
    _passes: bool = False
    _judged: ToleranceSpec | None = None

    def _for(self, spec: ToleranceSpec) -> None:
        if self._spec is not spec:
            self._spec, self._judged = spec, judged_spec(spec, self.arrays)
            self._passes = self._judged is not None and identical_passes(self._judged, self.arrays)

    def passes_identical(self, spec: ToleranceSpec) -> bool:
        """`identical_passes` of the outputs this answer holds, computed once per spec."""
        self._for(spec)
        return self._passes

    def judged(self, spec: ToleranceSpec) -> ToleranceSpec | None:
        """`judged_spec(spec, arrays)`, computed once per spec."""
        self._for(spec)
        return self._judged


def judged_spec(spec: ToleranceSpec, arrays: Mapping[str, Any]) -> ToleranceSpec | None:
    """The tolerances a comparison with this primary answer judges: those of the outputs it holds. A client that
    asks for some of a model's outputs gets those alone (Triton answers every output it is asked for, or an
    error), and the candidate's copy of the same request is judged on the same ones; an output the client did
    not ask for is no failure of either. None: the answer holds no output the spec has a tolerance for."""
    held = tuple(t for t in spec.tolerances if t.output == "*" or t.output in arrays)
    if not any(spec.for_output(name) is not None for name in arrays):
        return None
    return spec if len(held) == len(spec.tolerances) else ToleranceSpec(held)


def reference(primary: UpstreamResponse) -> Reference | Comparison:
    """The primary decoded, or the Comparison every comparison against an unusable primary gives: one that
    cannot be decoded (say an output whose shape needs more bytes than it came with), or that has no output."""
    try:
        plain, hl = payload(primary)
        msg = codec.decode_response(plain, hl)
    except (codec.CodecError, zlib.error) as exc:
        return Comparison(False, {}, (f"primary response not decodable: {exc}",), reference_ok=False)
    arrays = msg.arrays()
    if not arrays:
        return Comparison(False, {}, ("primary response has no output",), reference_ok=False)
    return Reference(plain, hl, msg.header, arrays)


def compare_responses(primary: UpstreamResponse | Reference | Comparison, other: UpstreamResponse,
                      spec: ToleranceSpec, fast: bool = True) -> Comparison:  # fmt: skip
    """Decode both responses with the shared codec and compare them with the tuner's gate code.

    `primary` may come decoded already (`reference()`), so that comparing it twice decodes it once.
    Fast path (`fast`): when the candidate's outputs would decode to exactly the primary's (the same
    parsed JSON, type for type, and the same binary tail: A/A replays, deterministic candidates), the
    candidate is not decoded and no metric is computed if `identical_passes` says the gate passes them
    for certain. The verdict is the same either way (tests/test_mirror_compare.py checks both paths).
    """
    ref = reference(primary) if isinstance(primary, UpstreamResponse) else primary
    if isinstance(ref, Comparison):
        return ref
    judged = ref.judged(spec)
    if judged is None:  # nothing in the primary's answer to judge the candidate's on
        what = ", ".join(repr(n) for n in ref.arrays)
        return Comparison(False, {}, (f"primary response holds no output the tolerance names (only {what})",),
                          reference_ok=False)  # fmt: skip
    if (
        fast
        and _identical_outputs(ref.header, ref.plain, ref.header_length, other)
        and ref.passes_identical(spec)
    ):
        return Comparison(True, {name: True for name in ref.arrays}, ())
    try:
        cand = codec.decode_response(*payload(other)).arrays()
    except (codec.CodecError, zlib.error) as exc:
        return Comparison(False, {n: False for n in ref.arrays}, (f"response not decodable: {exc}",))
    verdict = compare(ref.arrays, cand, judged)
    outputs = {name: v.passed for name, v in verdict.outputs.items()}
    return Comparison(verdict.passed, outputs, tuple(f.reason for f in verdict.failures))
