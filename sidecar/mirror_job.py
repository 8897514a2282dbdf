"""One mirrored request's comparison, as callbacks: the candidate's copy (and, with shadow pairing, the
baseline's replay sent with it), the A/A replay, the comparisons and the evidence they add to the canary.
No task or future per request; each step runs when its answer comes."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sidecar.canary_record import Canary
from sidecar.faults import MirrorFault, TritonSilent
from sidecar.mirror import Comparison, Reference, compare_responses, reference
from sidecar.upstream import Headers, UpstreamResponse, UpstreamTimeout
from tunegate.classes import request_class

if TYPE_CHECKING:  # the manager makes the jobs: a type-only import
    from sidecar.canary import CanaryManager

LOG = logging.getLogger(__name__)
INLINE_COMPARE_BYTES = 8 << 10
Replayed = tuple[UpstreamResponse, float] | MirrorFault  # a mirror copy's 200 and its latency, or its fault
FORWARD_MIRROR_HEADERS = frozenset({b"content-type", b"content-encoding", b"inference-header-content-length"})


class MirrorJob:
    """One sampled request's mirror as a chain of pool callbacks (no task): send, compare, record, release.

    The candidate's copy goes out (with `latency_pairing="shadow"`, a baseline replay goes with it: one after
    the other, a coin choosing which leads). Comparisons of small responses run inline, larger ones in the
    executor. A canary decided meanwhile (slots closed) takes nothing more. Whatever happens, the slot is
    released once: an exception in a step is logged and ends the job, it never leaks the slot or reaches the client;
    a request that gave no evidence by then is counted as skipped (`internal`), as is one whose primary answer
    the comparison cannot use (`primary_unusable`, sidecar.mirror.compare_responses).
    """

    __slots__ = (
        "aa",
        "base",
        "body",
        "canary",
        "cand",
        "cand_passed",
        "cls",
        "counted",
        "done",
        "headers",
        "mgr",
        "primary",
        "primary_s",
        "protocol",
        "ref",
        "request_id",
        "waiting",
    )  # fmt: skip

    def __init__(self, mgr: CanaryManager, canary: Canary, body: bytes, headers: Headers, primary: UpstreamResponse,
                 primary_s: float, request_id: str, aa: bool, protocol: str = "http") -> None:  # fmt: skip
        self.mgr, self.canary, self.body, self.headers = mgr, canary, body, headers
        self.protocol = protocol  # the client's: "http" or "grpc" (written as HTTP for the mirror)
        self.primary, self.primary_s, self.request_id, self.aa = primary, primary_s, request_id, aa
        self.cand: Replayed | None = None
        self.base: Replayed | None = None
        self.ref: Reference | Comparison | None = None  # the primary, decoded once
        self.waiting = 0
        self.done = False
        # this request is accounted for: the candidate's evidence taken, the request skipped, or Triton's fault
        self.counted = False
        self.cls = request_class(body, headers)
        self.cand_passed: bool | None = None  # the candidate's verdict, for the paired (discordant) counts

    # -- steps ---------------------------------------------------------------------------------
    def start(self) -> None:
        c = self.canary
        if c.params.latency_pairing == "shadow":
            # One copy after the other (the second when the first answers), a coin choosing which leads. Sent
            # together onto a saturated device they raced, and a pair measured which won; taking turns fell in
            # step with traffic whose classes take turns, and the order's own effect then read as a slowdown.
            # Why, with figures: docs/design.md, latency pairing.
            self.mgr.metrics.inc(self.mgr.metrics.mirror_sampled, c.model, "aa")
            self.waiting = 2
            self._send("candidate" if self.mgr._random.random() < 0.5 else "aa", self._paired)
        else:
            self.waiting = 1
            self._send("candidate", self._paired)

    def _send(
        self, role: str, then: Callable[[str, UpstreamResponse | None, BaseException | None, float], None]
    ) -> None:
        c = self.canary
        t0 = time.perf_counter()

        def answered(resp: UpstreamResponse | None, exc: BaseException | None) -> None:
            seconds = time.perf_counter() - t0
            if isinstance(exc, UpstreamTimeout):
                self._slow_or_stalled(then, role, exc, seconds)
                return
            self._step(then, role, resp, exc, seconds)

        self.mgr.upstream.send(
            b"POST", c.mirror_paths[role], self.headers, self.body, answered, c.params.timeout_s
        )

    def _slow_or_stalled(self, then: Callable[[str, UpstreamResponse | None, BaseException | None, float], None],
                         role: str, exc: BaseException, seconds: float) -> None:  # fmt: skip
        """A copy timed out: its model was slow, or Triton stalled (a hung backend or device, a stopped process:
        connections accepted, nothing answered)? The same request goes to the baseline with the same timeout. Any
        answer within it and the timeout stands: the candidate's (or, for the baseline's own copy, the baseline's).
        None, and the baseline was no faster: the timeout is Triton's (`TritonSilent`), not counted, and the canary
        pauses until the judge tick's probes find Triton serving. The probe's answer is neither compared nor counted.
        """

        def probed(resp: UpstreamResponse | None, _exc: BaseException | None) -> None:
            if resp is not None:  # Triton answered the baseline (whatever it said) while the copy got nothing
                self._step(then, role, None, exc, seconds)
            else:
                why = TritonSilent(f"timed out after {seconds:.1f}s, and the baseline did not answer the same request "
                                   f"within {self.canary.params.timeout_s:g}s either")  # fmt: skip
                self._step(then, role, None, why, seconds)

        c = self.canary
        self.mgr.upstream.send(
            b"POST", c.mirror_paths["aa"], self.headers, self.body, probed, c.params.timeout_s
        )

    def _paired(
        self, role: str, resp: UpstreamResponse | None, exc: BaseException | None, seconds: float
    ) -> None:
        c = self.canary
        version = c.candidate if role == "candidate" else c.baseline
        got = self.mgr.replayed(c, version, role, resp, exc, seconds)
        if role == "candidate":
            self.cand = got
        else:
            self.base = got
        self.waiting -= 1
        if self.waiting:
            if not self._closed():
                self._send("aa" if role == "candidate" else "candidate", self._paired)
            return
        if self._closed():
            return
        cand, ev = self.cand, c.evidence
        if not isinstance(cand, tuple):
            self.counted = True
            if cand is None or not cand.is_candidate_evidence:
                self._finish()  # Triton's fault, not the candidate's: nothing is counted (the canary pauses)
                return
            ev.sent += 1
            if cand.kind == "timeout":
                ev.timeouts += 1
            else:
                ev.errors += 1
                exemplar = {"request_id": self.request_id, "kind": "candidate_error", "detail": cand.detail}
                ev.add_exemplar(exemplar)
            base = self.base
            if base is not None and (isinstance(base, tuple) or base.is_candidate_evidence):
                base_failed = not isinstance(base, tuple) or base[0].status != 200
                ev.aa_sent += 1
                ev.aa_errors += base_failed
                ev.paired_sent += 1
                ev.cand_only_errors += not base_failed
            self.mgr._dirty = True
            self._finish()
            return
        self._compare(cand[0], self._candidate_compared)

    def _candidate_compared(self, cmp: Comparison) -> None:
        if self._closed():
            return
        c, ev = self.canary, self.canary.evidence
        if not cmp.reference_ok:
            # The client's answer (200) is nothing to compare with: outputs skipped, with the reason. The copies'
            # outcomes still count toward the error rates, as a failed copy's do without a look at the primary:
            # the candidate answered, and so did the baseline (or not).
            self.counted = True
            self.mgr.skipped(c, "primary_unusable")
            ev.sent += 1
            self.cand_passed = True  # answered: the paired error counts take it as the candidate's success
            self._count_baseline_answer(self.base)
            self.mgr._dirty = True
            if ev.skipped["primary_unusable"] == 1:
                LOG.warning("canary %s of %s: a primary answer the comparison cannot use (%s); such requests are "
                            "counted as skipped (primary_unusable)", c.id, c.model, "; ".join(cmp.reasons))  # fmt: skip
            self._finish()
            return
        assert isinstance(self.cand, tuple)
        ev.sent += 1
        self.counted = True
        ev.add_comparison(cmp.passed, self.cls)
        ev.protocols[self.protocol] = ev.protocols.get(self.protocol, 0) + 1
        self.mgr.metrics.inc(self.mgr.metrics.mirror_protocol, c.model, self.protocol)
        self.cand_passed = cmp.passed
        base = self.base
        base_ok = (
            isinstance(base, tuple) and base[0].status == 200
        )  # the baseline's failures are not evidence
        # Warm-up by count and by time: a freshly loaded model's first answers are slow for reasons of its own.
        if ev.warm(c.started, c.params.warmup_samples, c.params.warmup_s, time.time()):
            if c.params.latency_pairing != "shadow":
                # A gRPC client's latency and the candidate's HTTP replay are not a pair: outputs only.
                if self.protocol == "http":
                    ev.add_pair(self.primary_s, self.cand[1], self.cls)
            elif base_ok:
                ev.add_pair(base[1], self.cand[1], self.cls)  # type: ignore[index]
        self.mgr._count(c, cmp, "candidate")
        if not cmp.passed:
            ev.add_exemplar(
                {"request_id": self.request_id, "kind": "out_of_tolerance", "reasons": list(cmp.reasons)}
            )
        self.mgr._dirty = True
        if base is None and self.aa:  # primary pairing: a sampled A/A replay goes out after the candidate's
            self.mgr.metrics.inc(self.mgr.metrics.mirror_sampled, c.model, "aa")
            self._send("aa", self._aa_answered)
        else:
            self._compare_base()

    def _aa_answered(
        self, role: str, resp: UpstreamResponse | None, exc: BaseException | None, seconds: float
    ) -> None:
        self.base = self.mgr.replayed(self.canary, self.canary.baseline, role, resp, exc, seconds)
        self._compare_base()

    def _compare_base(self) -> None:
        """The baseline's replay against the primary (the noise floor), when there is a good one."""
        if self._closed():
            return
        base = self.base
        self._count_baseline_answer(base)
        if isinstance(base, tuple) and base[0].status == 200:
            self._compare(base[0], self._aa_compared)
        else:
            self._finish()

    def _count_baseline_answer(self, base: Replayed | None) -> None:
        """The baseline replay's own outcome: its error rate, and errors on one side only of a request sent to both."""
        if base is None or not (isinstance(base, tuple) or base.is_candidate_evidence):
            return  # not replayed, or Triton's fault: nothing is known about the baseline
        ev = self.canary.evidence
        base_failed = not isinstance(base, tuple) or base[0].status != 200
        ev.aa_sent += 1
        ev.aa_errors += base_failed
        if self.cand_passed is not None:  # the candidate answered: both sides' outcomes are known
            ev.paired_sent += 1
            ev.aa_only_errors += base_failed

    def _aa_compared(self, cmp: Comparison) -> None:
        if self._closed():
            return
        ev = self.canary.evidence
        if cmp.reference_ok:
            ev.aa_compared += 1
            ev.aa_out_of_tolerance += 0 if cmp.passed else 1
            if self.cand_passed is not None:
                ev.paired_compared += 1
                ev.cand_only_oot += self.cand_passed is False and cmp.passed
                ev.aa_only_oot += self.cand_passed and not cmp.passed
            self.mgr._count(self.canary, cmp, "aa")
            self.mgr.metrics.noise_floor_rate.labels(self.canary.model).set(
                ev.aa_out_of_tolerance / ev.aa_compared
            )
        self._finish()

    # -- plumbing ------------------------------------------------------------------------------
    def _compare(self, other: UpstreamResponse, then: Callable[[Comparison], None]) -> None:
        """Small responses inline (a thread handoff would cost more than the work), larger ones in the executor.

        The primary is decoded at the first comparison and kept for the second (the A/A one).
        """
        spec = self.canary.tolerance
        if len(self.primary.body) + len(other.body) <= INLINE_COMPARE_BYTES:
            if self.ref is None:
                self.ref = reference(self.primary)
            then(compare_responses(self.ref, other, spec))
            return

        def work() -> tuple[Reference | Comparison, Comparison]:
            ref = self.ref if self.ref is not None else reference(self.primary)
            return ref, compare_responses(ref, other, spec)

        def done(f: asyncio.Future[tuple[Reference | Comparison, Comparison]]) -> None:
            self.ref, cmp = f.result()
            then(cmp)

        fut = asyncio.get_running_loop().run_in_executor(None, work)
        fut.add_done_callback(lambda f: self._finish() if f.cancelled() else self._step(done, f))

    def _step(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except Exception:  # a bug ends this job (and frees its slot); it never reaches the client path
            LOG.exception("mirror step failed for %s", self.canary.model)
            if not self.counted and not self.done and not self.canary.slots.closed:
                self.counted = True
                self.mgr.skipped(self.canary, "internal")  # sampled, and no evidence taken: said why
            self._finish()

    def _closed(self) -> bool:
        if self.canary.slots.closed:
            self._finish()
            return True
        return False

    def _finish(self) -> None:
        if not self.done:
            self.done = True
            self.canary.slots.release()
