"""Who a failed mirror answer speaks against: the candidate, or Triton (or the shadow model it lost).

A canary judges the candidate on the candidate's own failures only. A copy that fails because Triton is
down or restarting, or because the shadow model `<m>__canary` is not loaded (Triton restarted and only
loaded its startup models), says nothing about the candidate: it is not counted, and it pauses the canary
until Triton and the shadow are ready again.

Triton 2.51's texts for a model that is not there (HTTP API, checked against the server):

- 404 `Request for unknown model: '<m>' is not found` (not loaded at all)
- 404 `Request for unknown model: '<m>' version <v> is not found` (that version not loaded)
- 404 `Request for unknown model: '<m>' has no available versions`
- 503 `Request for unknown model: '<m>' version <v> is not at ready state` (unloading or not yet ready)

A model that fails its own execution answers with its error (the python backend: 500 and the model's
text); a request the candidate rejects (say, an input its config does not name) is a 400 from the
candidate. Both are the candidate's. Triton itself never answers "unavailable" over HTTP: on SIGTERM
it closes its HTTP port at once (connections reset, then refused), so a 502, or a 503 that is not
Triton's `{"error": ...}` JSON, comes from a proxy in between that could not reach it.

A copy that timed out is the candidate's only if the baseline answers. A stalled Triton (a hung backend or
device, a stopped process) accepts connections and answers nothing: every copy in flight then times out, and
that says nothing about the candidate. So the same request goes to the baseline with the same timeout
(`MirrorJob._slow_or_stalled`); a copy whose baseline did not answer either is `TritonSilent`, Triton's.
"""

from __future__ import annotations

import dataclasses
import enum

import orjson

from sidecar.upstream import UpstreamError, UpstreamTimeout

# How long a probe of Triton waits for its answer (the judge tick's readiness probes, `/readyz`'s). A
# Triton saturated by client traffic answers /v2/health/ready late (seconds on two busy cores, behind the inference
# requests on its HTTP threads), and is serving, not down: the canary goes on. A server that is down refuses at
# once and pauses the canary at once.
TRITON_PROBE_S = 8.0
# Substrings of Triton's error for a model (version) that is not loaded or not ready.
MODEL_MISSING_TEXTS = (
    "request for unknown model",
    "is not at ready state",
    "has no available versions",
    "model version not ready",
)


class TritonSilent(UpstreamError):
    """A mirror copy timed out and the baseline did not answer the same request in that time either: Triton stalled."""


class Blame(enum.Enum):
    """Whose fault a failed mirror answer is."""

    CANDIDATE = "candidate"  # the candidate's execution failed or timed out: evidence against it
    TRITON = "triton"  # Triton is unreachable or unavailable: no evidence, the canary pauses
    SHADOW = "shadow"  # Triton answers, but the shadow model is missing or not ready: no evidence, pause and reload


@dataclasses.dataclass(frozen=True, slots=True)
class MirrorFault:
    """A mirror copy that got no usable answer; `kind` is "error" or "timeout", `detail` says what was seen."""

    blame: Blame
    kind: str
    detail: str

    @property
    def is_candidate_evidence(self) -> bool:
        return self.blame is Blame.CANDIDATE


def error_text(body: bytes) -> str:
    """Triton's `{"error": "..."}` message, else the body's start as text."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        doc = None
    if isinstance(doc, dict) and isinstance(doc.get("error"), str):
        return str(doc["error"])
    return body[:300].decode(errors="replace")


def _is_triton_error(body: bytes) -> bool:
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    return isinstance(doc, dict) and "error" in doc


def classify_answer(status: int, body: bytes) -> MirrorFault | None:
    """None for a 200; else the fault a non-200 answer to a mirror copy shows, and whose it is."""
    if status == 200:
        return None
    text = error_text(body)
    low = text.lower()
    if any(t in low for t in MODEL_MISSING_TEXTS):
        return MirrorFault(Blame.SHADOW, "error", f"{status}: {text}")
    # A proxy in between could not reach Triton (Triton's own 503s are JSON errors).
    if status == 502 or (status == 503 and not _is_triton_error(body)):
        return MirrorFault(Blame.TRITON, "error", f"{status}: {text}")
    if status == 504 and not _is_triton_error(body):  # a proxy gave up waiting for the candidate's answer
        return MirrorFault(Blame.CANDIDATE, "timeout", f"{status}: {text}")
    return MirrorFault(Blame.CANDIDATE, "error", body[:300].decode(errors="replace"))


def classify_exception(exc: BaseException | None) -> MirrorFault:
    """A copy that got no answer: a timeout is the candidate's (it was slow); anything else is Triton's.

    The pool raises UpstreamError for a refused or reset connection, one closed before the answer (Triton
    killed mid-request) and a sidecar shutting down: none of them says anything about the candidate. A
    timeout while Triton answered nothing (`TritonSilent`) is Triton's too.
    """
    if isinstance(exc, TritonSilent):
        return MirrorFault(Blame.TRITON, "timeout", str(exc))
    if isinstance(exc, UpstreamTimeout):
        return MirrorFault(Blame.CANDIDATE, "timeout", "timeout")
    if isinstance(exc, UpstreamError):
        return MirrorFault(Blame.TRITON, "error", str(exc))
    return MirrorFault(Blame.TRITON, "error", repr(exc) if exc is not None else "no answer")


__all__ = [
    "TRITON_PROBE_S",
    "Blame",
    "MirrorFault",
    "TritonSilent",
    "classify_answer",
    "classify_exception",
    "error_text",
]
