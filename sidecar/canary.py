"""The canary manager: start, mirror offers, periodic judging, and the durable promote/pin sequence.

The canary's record is sidecar/canary_record.py; one mirrored request's comparison is sidecar/mirror_job.py.

A decision is committed in three steps, each durable before the next: the pending decision goes
into state.json, then the action runs on Triton (idempotent), then the record is appended to
decisions.jsonl (once per canary id) and the canary is cleared from the state. A sidecar killed
anywhere in between finishes the same decision on restart: none lost, none doubled.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import contextlib
import dataclasses
import functools
import logging
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

from sidecar.budget import BOUNDS
from sidecar.canary_record import GATE_FIGURES, Canary, CanaryError, gate_vs_canary
from sidecar.config import CanaryParams, ConfigError, SidecarConfig
from sidecar.control import SHADOW_SUFFIX, ControlError, PromotionError, TritonControl, shadow_name
from sidecar.decision import Decision
from sidecar.faults import TRITON_PROBE_S, Blame, classify_answer, classify_exception
from sidecar.judge import INCONCLUSIVE, PIN, PROMOTE, Judgement, Outcome, disagree, judge, wants_placement
from sidecar.memory import SAMPLE_INTERVAL_S, MemoryProbe, Reading
from sidecar.metrics import SidecarMetrics, repository_models
from sidecar.mirror import Comparison
from sidecar.mirror_job import FORWARD_MIRROR_HEADERS, MirrorJob, Replayed
from sidecar.rollback import apply_retention, finish_pending, pending_rollback
from sidecar.semantics import SEQUENCE, ModelSemantics, parse_model_config, sequence_request
from sidecar.state import StateStore
from sidecar.throughput import (
    MIN_INFERENCES,
    ComputeReading,
    StatsError,
    capacity,
    instance_count,
    parse_statistics,
)
from sidecar.throughput import evidence as throughput_evidence
from sidecar.upstream import Headers, UpstreamPool, UpstreamResponse
from tunegate.tolerance import ToleranceError, ToleranceSpec

LOG = logging.getLogger(__name__)
KNOWN_MODELS_S = 10.0  # the repository's models are listed again this often (a new model's series: within it)
READY_POLL_S = 1.0  # how often `/readyz`'s answer is probed afresh (a refused connection shows within it)
SHADOW_RELOAD_RETRY_S = 5.0  # a paused canary's shadow that failed to reload is tried again this much later


class CanaryManager:
    def __init__(
        self,
        config: SidecarConfig,
        store: StateStore,
        session: aiohttp.ClientSession,
        metrics: SidecarMetrics,
        upstream: UpstreamPool,
    ) -> None:
        self.config = config
        self.upstream = upstream  # the mirror's requests go through the client path's pool
        self.store = store
        self.session = session
        self.metrics = metrics
        self.control = TritonControl(
            session, config.upstream, config.repository, grpc_address=config.upstream_grpc
        )
        self.canaries: dict[str, Canary] = {}
        self._locks: collections.defaultdict[str, asyncio.Lock] = collections.defaultdict(asyncio.Lock)
        # Sampling, and which copy of a shadow pair leads; a decision depends on it only through what is sampled.
        self._random = random.Random()
        self._dirty = False
        self._reload_after: dict[str, float] = {}  # canary id -> when its shadow may be reloaded again
        # Client requests now at Triton, per (model, version the sidecar routed them to): a promotion
        # unloads the baseline only once none of its requests are left.
        self.in_flight: collections.Counter[tuple[str, str]] = collections.Counter()
        # the same count held by another process (the compiled gRPC front): (model, version) -> calls in flight
        self.routed_elsewhere: Callable[[str, str], Awaitable[int]] | None = None
        # told (model, busy) when a shadow-paired canary's pair leaves and when it is back: the compiled gRPC
        # front offers no call while the pair is out (admit would refuse it); a hint, admit decides
        self.pair_busy: Callable[[str, bool], None] | None = None
        self._memory_due: dict[str, float] = {}  # canary id -> when its memory is sampled next
        self._memory_series: dict[str, list[tuple[str, str, str]]] = {}  # model -> memory gauge labels set
        self._throughput_due: dict[str, float] = {}  # canary id -> when Triton's statistics are read next
        self._known_due = 0.0  # when the repository's models are listed again for the metric labels
        # why the client path cannot serve ("" when it can), as `watch_readiness` last found it
        self.readiness = "Triton not probed yet"
        self._readiness_known = asyncio.Event()

    # -- client path hooks (must stay cheap: they run per request on the event loop) ----------
    def live_version(self, model: str) -> int | None:
        ms = self.store.models().get(model)
        return None if ms is None else ms.get("live")

    async def _drain_routed(self, model: str, version: int, timeout_s: float) -> int:
        """Wait until no client request routed to `version` is in flight; returns how many were left at the timeout.
        Counts the compiled gRPC front's calls too (`routed_elsewhere`), after it has the new routing table."""
        key = (model, str(version))
        deadline = time.monotonic() + timeout_s
        while True:
            left = self.in_flight[key]
            if self.routed_elsewhere is not None:
                left += await self.routed_elsewhere(*key)
            if left == 0 or time.monotonic() >= deadline:
                return left
            await asyncio.sleep(0.01)

    async def not_ready(self, timeout_s: float = TRITON_PROBE_S) -> str:
        """Why the client path cannot serve now ("" when it can): Triton not ready, or not serving a live version.

        Triton's own readiness is strict (one model that failed to load, say a broken candidate, turns it 400
        for good), so a server that is live and serves every live version the sidecar routes to is ready too.
        Every probe is asked at once and waits `timeout_s`: a Triton busy with clients answers late and serves.
        """
        c = self.control
        routed = [
            (m, v) for m, ms in sorted(self.store.models().items()) if (v := ms.get("live")) is not None
        ]
        server, live, *versions = await asyncio.gather(
            c.server_ready(timeout_s), c.live(timeout_s), *(c.ready(m, v, timeout_s) for m, v in routed)
        )
        if server:
            return ""
        if not live:
            return f"Triton at {c.base} does not answer /v2/health/live"
        for (model, version), ok in zip(routed, versions, strict=True):
            if not ok:
                return f"Triton does not serve {model} version {version}"
        return ""

    async def watch_readiness(self) -> None:
        """Keep `readiness` current for `/readyz`: Triton probed every READY_POLL_S (`not_ready`), so the readiness
        probe answers at once from the last result: it never waits on a busy Triton, and what Triton is asked does not
        grow with how often the sidecar is."""
        while True:
            try:
                self.readiness = await self.not_ready()
            except Exception:  # a bug in one probe must not freeze readiness: say so, and probe again
                LOG.exception("readiness probe failed")
                self.readiness = "the readiness probe of Triton failed (see the sidecar's log)"
            self._readiness_known.set()
            await asyncio.sleep(READY_POLL_S)

    async def ready_reason(self) -> str:
        """The last readiness probe's answer ("" when ready); the first one is awaited (TRITON_PROBE_S at most)."""
        await self._readiness_known.wait()
        return self.readiness

    def sample(self, rate: float) -> bool:
        return rate >= 1.0 or self._random.random() < rate

    def _register(self, canary: Canary) -> None:
        self.canaries[canary.model] = canary
        if canary.params.latency_pairing == "shadow":
            canary.slots.listener = functools.partial(self._pair_busy, canary.model)

    def _pair_busy(self, model: str, busy: bool) -> None:
        if self.pair_busy is not None:
            try:
                self.pair_busy(model, busy)
            except Exception:  # a hint: never let it stop a mirror
                LOG.exception("pair state of %s not passed on", model)

    def admit(self, model: str, primary_s: float, presampled: bool = False) -> Canary | None:
        """The canary an answered (200) client request of `model` is sampled for, or None: no canary taking
        evidence, not sampled at the mirror budget's rate, or (shadow pairing) the pair in flight. Counts the
        request's latency in the budget's window. Cheap, so a front can ask before it writes the request's
        HTTP form (sidecar.grpc_front). `presampled`: the compiled gRPC front (sidecar.grpc_native) has counted
        its latency and sampled it at the budget's rate already."""
        canary = self.canaries.get(model)
        if canary is None or canary.pending is not None or canary.paused is not None or canary.replacing:
            return None
        if not presampled:
            budget = canary.budget
            counts = budget.counts  # the client latency window of the mirror budget (None: not counting now)
            if counts is not None:
                counts[bisect.bisect_left(BOUNDS, primary_s)] += 1
            if not self.sample(budget.rate):
                return None
        if canary.params.latency_pairing == "shadow" and canary.slots.full():
            return None  # one pair at a time: a request that finds the pair in flight is not sampled (not a drop)
        return canary

    def offer(self, model: str, body: bytes, headers: Headers, primary: UpstreamResponse, primary_s: float,
              request_id: str, protocol: str = "http", presampled: bool = False, admitted: bool = False) -> None:  # fmt: skip
        """Mirror one answered client request (its raw header pairs; a gRPC one written as its HTTP equivalent,
        sidecar.grpc_front); returns at once. `admitted`: `admit` has said yes to it just now. Only answered (200)
        requests are sampled: Triton's errors go back to the client and are counted there
        (`tunegate_requests_total{role="primary"}` by code), not as the canary's."""
        if primary.status != 200:
            return
        canary = self.canaries.get(model) if admitted else self.admit(model, primary_s, presampled)
        if canary is None:
            return
        p = canary.params
        # Stateful sequences and decoupled models are not replayed (sidecar.semantics); counted, never mirrored.
        skip = canary.semantics.skip if canary.semantics is not None else None
        if skip is not None or sequence_request(body, headers):
            self.skipped(canary, skip or SEQUENCE)
            return
        acquired = canary.slots.acquire()
        if not acquired and p.latency_pairing == "shadow":
            return  # the pair went out since `admit` (not a drop)
        self.metrics.inc(self.metrics.mirror_sampled, model, "candidate")
        if not acquired:
            self.metrics.inc(self.metrics.mirror_dropped, model, "candidate", "full")
            return
        fwd = [(k, v) for k, v in headers if k.lower() in FORWARD_MIRROR_HEADERS]
        aa = p.aa_rate > 0 and self._random.random() < p.aa_rate
        job = MirrorJob(self, canary, body, fwd, primary, primary_s, request_id, aa, protocol)
        job._step(job.start)

    async def _check_tolerance_names(self, model: str, live: int, spec: ToleranceSpec) -> None:
        """A tolerance that names an output the live version does not have is refused (400): the comparison
        judges the outputs a client's answer holds, and a misspelt name would leave its output unjudged. Where
        Triton's metadata cannot be read, nothing is refused (the start goes on; logged)."""
        try:
            meta = await self.control.get_json(f"/v2/models/{model}/versions/{live}")
        except ControlError as exc:
            LOG.warning("%s v%d: outputs not read (%s); the tolerance's output names are not checked", model, live,
                        exc)  # fmt: skip
            return
        outputs = [o.get("name") for o in (meta or {}).get("outputs") or [] if isinstance(o, dict)]
        unknown = [t.output for t in spec.tolerances if t.output != "*" and t.output not in outputs]
        if outputs and unknown:
            raise CanaryError(f"the tolerance names outputs {model} v{live} does not have: {', '.join(unknown)} "
                              f"(its outputs: {', '.join(map(str, outputs))})")  # fmt: skip

    def skipped(self, canary: Canary, reason: str) -> None:
        """A sampled request of a running canary that cannot be mirrored (sidecar.metrics.SKIP_REASONS)."""
        self.metrics.inc(self.metrics.mirror_skipped, canary.model, reason)
        canary.evidence.skipped[reason] = canary.evidence.skipped.get(reason, 0) + 1
        self._dirty = True

    def replayed(self, canary: Canary, version: int, role: str, resp: UpstreamResponse | None,
                 exc: BaseException | None, seconds: float) -> Replayed:  # fmt: skip
        """Account for one mirror answer: a 200 and its latency, or the fault and whose it is (`faults`).

        A model's own failure is counted in `tunegate_mirror_errors`; Triton's (unreachable, or the shadow
        model missing) is not, and pauses the canary until the judge tick finds Triton and the shadow ready.
        """
        if resp is not None:
            self.metrics.observe_request(canary.model, str(version), role, resp.status, seconds)
            answered = classify_answer(resp.status, resp.body)
            if answered is None:
                return resp, seconds
            fault = answered
        else:
            fault = classify_exception(exc)
            LOG.debug("%s replay failed: %r", role, exc)
        if fault.is_candidate_evidence:
            self.metrics.inc(self.metrics.mirror_errors, canary.model, str(version), role, fault.kind)
        else:
            self._pause(canary, fault.blame, f"{role} copy: {fault.detail}")
        return fault

    def _pause(self, canary: Canary, blame: Blame, reason: str) -> None:
        """Stop mirroring and judging `canary` (cheap: the mirror path calls it); logged per transition."""
        if self.canaries.get(canary.model) is not canary or canary.pending is not None:
            return
        shadow = shadow_name(canary.model)
        what = "Triton is unavailable" if blame is Blame.TRITON else f"the shadow model {shadow} is not ready"
        text = f"{what} ({reason})"
        if canary.paused is None:
            canary.paused = {"since": time.time(), "reason": text, "blame": blame.value}
            self.metrics.canary_paused.labels(canary.model).set(1)
            LOG.warning("canary %s of %s paused, nothing is counted: %s", canary.id, canary.model, text)
        elif canary.paused["blame"] != blame.value:
            canary.paused.update(reason=text, blame=blame.value)
            LOG.warning("canary %s of %s still paused: %s", canary.id, canary.model, text)

    def _unpause(self, canary: Canary) -> None:
        if canary.paused is not None:
            LOG.info("canary %s of %s resumes after %.1fs paused (%s)", canary.id, canary.model,
                     time.time() - canary.paused["since"], canary.paused["reason"])  # fmt: skip
            canary.paused = None
            self.metrics.canary_paused.labels(canary.model).set(0)

    async def _check_triton(self, canary: Canary) -> bool:
        """From the judge tick: whether `canary` can be judged now. Pauses it while Triton does not serve the
        baseline, reloads the shadow (as `resume` does) when Triton is back without it, and unpauses it."""
        model = canary.model
        if not await self.control.serving(model, canary.baseline, timeout_s=TRITON_PROBE_S):
            self._pause(canary, Blame.TRITON, f"no answer from {self.control.base}/v2/health/ready")
            return False
        shadow = shadow_name(model)
        versions = canary.shadow_versions()
        if all(await asyncio.gather(*(self.control.ready(shadow, v, TRITON_PROBE_S) for v in versions))):
            self._unpause(canary)
            return True
        self._pause(canary, Blame.SHADOW, "Triton serves, the shadow is not loaded")
        if time.monotonic() < self._reload_after.get(canary.id, 0.0):
            return False
        async with self._locks[model]:
            if self.canaries.get(model) is not canary or canary.pending is not None:
                return False
            LOG.info("reloading %s (versions %s) for canary %s", shadow, canary.shadow_versions(), canary.id)
            try:
                await self.control.start_shadow(model, canary.candidate, canary.shadow_baseline())
            except ControlError as exc:  # retried, not judged (it loaded before); else the deadline ends it
                self._reload_after[canary.id] = time.monotonic() + SHADOW_RELOAD_RETRY_S
                if canary.paused is not None:
                    canary.paused["reason"] = f"the shadow model {shadow} could not be reloaded: {exc}"
                LOG.warning("reloading %s failed (retry in %gs): %s", shadow, SHADOW_RELOAD_RETRY_S, exc)
                return False
        self._reload_after.pop(canary.id, None)
        self._fresh_instances(canary)  # Triton's restart placed them anew
        self._unpause(canary)
        return True

    async def _new_placement(self, canary: Canary) -> bool:
        """From the judge tick: once the shadow's instances served `placement_pairs` pairs, load fresh ones (unload
        and load the shadow) until `placements` sets of instances have, and again, up to MAX_PLACEMENTS, while the
        judge finds the latency verdict open or not borne out by the sets, so that it is seen on other placements
        (sidecar.judge). Sampling stops first and the pair out comes back; true while that is under way (the
        canary is not judged on this tick)."""
        p, ev, model = canary.params, canary.evidence, canary.model
        if not canary.replacing:
            if not wants_placement(
                p.judge_params(), ev.placement, ev.placement_pairs(), disagree(canary.judgement)
            ):
                return False
            if await self._capacity_unread(canary):
                return False  # this set serves on until Triton's counters hold a capacity of it
            canary.replacing = True  # admit() samples nothing from here
        if len(canary.slots):
            return True  # the pair out comes back first: its two copies ran on the same instances
        async with self._locks[model]:
            if self.canaries.get(model) is not canary or canary.pending is not None:
                canary.replacing = False
                return True
            LOG.info("loading fresh instances of %s (versions %s) for canary %s after %d pairs on set %d",
                     shadow_name(model), canary.shadow_versions(), canary.id, ev.placement_pairs(), ev.placement)  # fmt: skip
            # The set's capacity is read before its instances go: its pairs often outrun the reading interval.
            await self._read_throughput(canary)
            try:
                await self.control.stop_shadow(model)
                await self.control.start_shadow(model, canary.candidate, canary.shadow_baseline())
            except ControlError as exc:
                # The next tick finds the shadow missing: paused and reloaded, as after any loss of it.
                LOG.warning("loading fresh instances of %s failed: %s", shadow_name(model), exc)
            finally:
                canary.replacing = False
        self._fresh_instances(canary)
        return True

    async def _capacity_unread(self, canary: Canary) -> bool:
        """Whether the set serving now lacks a capacity window of MIN_INFERENCES a version (read now, off the
        sampling interval): its pairs are counted from the warm-up and its first reading comes a tick or more
        later, so its window can end short. The set then serves on, for at most half its `placement_pairs` again
        (a set keeps up to 2 * MAX_SET_PAIRS - 1 ratios: the count reaches that); a capacity the judge is not asked
        for (`min_throughput_ratio` 0) is not waited for, nor where so many pairs hold too few inferences (a set's
        baseline runs about one per pair)."""
        p, ev = canary.params, canary.evidence
        most = p.placement_pairs + p.placement_pairs // 2
        if p.min_throughput_ratio <= 0 or most < MIN_INFERENCES or ev.placement_pairs() >= most:
            return False
        await self._read_throughput(canary)
        window = ev.throughput_sets.get(str(ev.placement)) or {}
        return len(window) < 2 or any(v[0] < MIN_INFERENCES for v in window.values())

    def _fresh_instances(self, canary: Canary) -> None:
        """New instances serve the shadow: the pairs that follow are a new placement's, after their own warm-up,
        and Triton's compute counters start a new window."""
        canary.evidence.new_placement(time.time())
        canary.throughput_first = {}
        self._throughput_due[canary.id] = 0.0  # the first reading as soon as the new set is warm
        self._dirty = True

    async def _semantics(self, model: str) -> ModelSemantics:
        """Sequence batching, decoupled policy and backend from the model's config.pbtxt (read once per canary)."""
        try:
            return await asyncio.to_thread(lambda: parse_model_config(self.control.read_config(model)))
        except ControlError:
            return ModelSemantics()

    async def _sample_memory(self, canary: Canary) -> None:
        """From the judge tick, at most every SAMPLE_INTERVAL_S: each version's memory (sidecar.memory), its peak
        into the evidence, the figures into `tunegate_model_memory_bytes` and the details into the status."""
        now = time.monotonic()
        if now < self._memory_due.get(canary.id, 0.0):
            return
        self._memory_due[canary.id] = now + SAMPLE_INTERVAL_S
        if canary.memory_probe is None:
            targets = canary.targets()
            backend = canary.semantics.backend if canary.semantics is not None else ""
            canary.memory_probe = MemoryProbe(self.config.repository, self.config.upstream, targets, backend)
        try:
            r: Reading = await asyncio.to_thread(canary.memory_probe.read)
        except (OSError, ValueError) as exc:  # measuring must never stop judging
            LOG.warning("measuring the memory of %s's versions failed: %r", canary.model, exc)
            return
        if self.canaries.get(canary.model) is not canary:
            return
        ev = canary.evidence
        if canary.memory.get("kind") not in (None, r.kind):
            ev.memory = {}  # the figure judged changed (GPU memory appeared or went): peaks of one kind only
        ev.memory = {**ev.memory, **{role: max(v, ev.memory.get(role, 0.0)) for role, v in r.bytes.items()}}
        canary.memory = {"kind": r.kind, "unknown": r.unknown, "at": time.time(), **r.detail}
        series = self._memory_series.setdefault(canary.model, [])
        for role, d in r.detail.items():
            labels = (canary.model, str(d["version"]), role)
            if role in r.bytes:
                self.metrics.model_memory.labels(*labels).set(r.bytes[role])
                if labels not in series:
                    series.append(labels)
        self._dirty = True

    async def _sample_throughput(self, canary: Canary) -> None:
        """From the judge tick, at most every SAMPLE_INTERVAL_S once the current set of instances is warm:
        Triton's compute counters of each version (sidecar.throughput); the window since the set's first such
        reading goes into the evidence, as the set's own."""
        if time.monotonic() >= self._throughput_due.get(canary.id, 0.0):
            await self._read_throughput(canary)

    async def _read_throughput(self, canary: Canary) -> None:
        """One reading of Triton's compute counters for the current set of instances (its first, or its window's
        end), unless the set is still warming up (cold inferences are slow for reasons that pass; asked again on
        the next tick). Any reading puts the next scheduled one SAMPLE_INTERVAL_S off."""
        p = canary.params
        if not canary.evidence.warm(canary.started, p.warmup_samples, p.warmup_s, time.time()):
            return
        self._throughput_due[canary.id] = time.monotonic() + SAMPLE_INTERVAL_S
        readings: dict[str, ComputeReading] = {}
        placement = canary.evidence.placement
        try:
            for role, (name, version) in canary.targets().items():
                raw = await self.control.get_json(f"/v2/models/{name}/versions/{version}/stats")
                readings[role] = parse_statistics(raw, name, version)
                if role not in canary.instances:
                    canary.instances[role] = instance_count(
                        await self.control.get_json(f"/v2/models/{name}/config")
                    )
        except (ControlError, StatsError) as exc:  # measuring must never stop judging
            LOG.warning("reading Triton's statistics for %s's versions failed: %s", canary.model, exc)
            return
        if self.canaries.get(canary.model) is not canary or canary.evidence.placement != placement:
            return  # ended, or fresh instances came while reading: the next reading is the new set's first
        if not canary.throughput_first:
            canary.throughput_first = readings
            return
        windows = {role: r.since(canary.throughput_first[role]) for role, r in readings.items()}
        canary.evidence.throughput = throughput_evidence(windows, canary.instances)
        canary.evidence.throughput_sets[str(placement)] = canary.evidence.throughput
        series = self._memory_series.setdefault(canary.model, [])  # removed with the memory gauges at the end
        for role, w in windows.items():
            cap = capacity(w, canary.instances.get(role, 1))
            labels = (canary.model, str(canary.targets()[role][1]), role)
            if cap is not None:
                self.metrics.model_capacity.labels(*labels).set(cap)
                if labels not in series:
                    series.append(labels)
        self._dirty = True

    def _budget_tick(self, canary: Canary) -> None:
        """The mirror budget's schedule and controller (sidecar.budget), and its gauges."""
        b = canary.budget
        b.tick(time.monotonic(), len(canary.slots))
        self.metrics.mirror_sample_rate.labels(canary.model).set(b.effective)
        if b.added is not None:
            self.metrics.client_slowdown.labels(canary.model).set(b.added)

    def _clear_memory_series(self) -> None:
        """Memory gauges of canaries that ended leave the exposition (a stale figure would read as current)."""
        live_ids = {c.id for c in self.canaries.values()}
        for due in (self._memory_due, self._throughput_due):
            for cid in [c for c in due if c not in live_ids]:
                del due[cid]
        for model in [m for m in self._memory_series if m not in self.canaries]:
            for labels in self._memory_series.pop(model):
                for gauge in (self.metrics.model_memory, self.metrics.model_capacity):
                    with contextlib.suppress(KeyError):
                        gauge.remove(*labels)

    def _count(self, canary: Canary, cmp: Comparison, role: str) -> None:
        for out, ok in cmp.outputs.items():
            self.metrics.inc(self.metrics.comparisons, canary.model, out, role)
            if not ok:
                self.metrics.inc(self.metrics.out_of_tolerance, canary.model, out, role)

    # -- admin ---------------------------------------------------------------------------------
    async def start(self, model: str, body: dict[str, Any]) -> dict[str, Any]:
        async with self._locks[model]:
            if model in self.canaries:
                raise CanaryError(f"model {model!r} already has a canary (candidate "
                                  f"{self.canaries[model].candidate}); promote or pin it first", 409)  # fmt: skip
            if pending_rollback(self.store, model) is not None:
                raise CanaryError(f"a rollback of {model!r} is pending; finish it first (rollback)", 409)
            body = dict(body)
            candidate = body.pop("candidate", None)
            if not isinstance(candidate, int) or isinstance(candidate, bool) or candidate < 1:
                raise CanaryError("'candidate' must be a positive integer version")
            tol_raw = body.pop("tolerance", None)
            try:
                params = CanaryParams.from_dict(body, self.config.canary)
                policy = await asyncio.to_thread(self.control.policy, model)
                live = self.live_version(model)
                if live is None:
                    if policy is None or len(policy) != 1:
                        raise CanaryError(f"{model}/config.pbtxt needs version_policy specific [ <live> ] "
                                          f"(found {policy}); the sidecar will not guess the baseline")  # fmt: skip
                    live = policy[0]
                if candidate == live:
                    raise CanaryError(f"version {candidate} is already live")
                if not self.control.version_dir(model, candidate).is_dir():
                    raise CanaryError(f"{model} has no version {candidate} in the repository", 404)
                release = await asyncio.to_thread(self.control.release, model, candidate)
                source = "request"
                if tol_raw is None and release is not None and "tolerance" in release:
                    tol_raw, source = release["tolerance"], "release.json"
                if tol_raw is None:
                    raise CanaryError(f"{model} version {candidate} has no release.json with a tolerance; "
                                      "pass an explicit 'tolerance' in the start request")  # fmt: skip
                spec = ToleranceSpec.from_dict(tol_raw)
                serving = await asyncio.to_thread(self.control.serving_config, model, candidate)
                if params.latency_pairing == "shadow" and serving is not None:
                    # The shadow serves its baseline replays with the candidate's serving configuration too:
                    # shadow pairing would compare that configuration with itself. Paired with the client's
                    # own request instead, on the live model as it serves now.
                    params = dataclasses.replace(params, latency_pairing="primary")
                    LOG.info("%s v%d changes the serving configuration: latency paired with the client's request",
                             model, candidate)  # fmt: skip
            except (ConfigError, ToleranceError) as exc:
                raise CanaryError(str(exc)) from exc
            except ControlError as exc:
                raise CanaryError(str(exc), 404) from exc
            await self._check_tolerance_names(model, live, spec)
            try:
                await self.control.start_shadow(
                    model, candidate, live if params.latency_pairing == "shadow" else None
                )
            except ControlError as exc:
                raise CanaryError(f"cannot load the candidate: {exc}", 502) from exc
            await self.refresh_known()  # the candidate's version gets series of its own from its first copy
            now = time.time()
            canary = Canary(
                uuid.uuid4().hex, model, candidate, live, now, now + params.deadline_s, params, spec, source
            )
            canary.semantics = await self._semantics(model)
            canary.evidence.started = now
            if (
                release is not None
            ):  # the request classes of the traffic the gate judged: each must be covered
                canary.evidence.expected_classes = dict(release.get("gate", {}).get("classes", {}) or {})
                g = release.get("gate") or {}
                canary.gate = {k: g.get(k) for k in GATE_FIGURES} if isinstance(g, dict) and g else None
            self._register(canary)
            ms = self.store.model(model)
            ms["live"], ms["canary"] = live, canary.to_dict()
            await self._save()
            self._publish(model)
            LOG.info("canary %s started: %s v%d against v%d", canary.id, model, candidate, live)
            return self.status(model)

    async def decide_manually(self, model: str, outcome: Outcome) -> dict[str, Any]:
        canary = self.canaries.get(model)
        if canary is None:
            raise CanaryError(f"model {model!r} has no running canary", 404)
        stats = judge(canary.evidence.snapshot(), canary.params.judge_params(), now=time.time(),
                      deadline=canary.deadline).stats  # fmt: skip
        verb = "promotion" if outcome == PROMOTE else "pin"
        await self.decide(model, Judgement(outcome, (f"manual {verb} by an operator",), stats), "operator")
        return self.status(model)

    def status(self, model: str) -> dict[str, Any]:
        ms = self.store.models().get(model)
        canary = self.canaries.get(model)
        if ms is None and canary is None:
            return {"model": model, "state": "idle", "live": None, "canary": None, "last": None}
        last = (ms or {}).get("last")
        state = "running" if canary else (last["state"] if last else "idle")
        return {"model": model, "state": state, "live": self.live_version(model),
                "canary": canary.status() if canary else None, "last": last}  # fmt: skip

    def all_status(self) -> dict[str, Any]:
        return {"models": {m: self.status(m) for m in sorted(set(self.store.models()) | set(self.canaries))}}

    async def decisions(self, model: str | None = None) -> list[dict[str, Any]]:
        recs = await asyncio.to_thread(self.store.decisions.read)
        return [r for r in recs if model is None or r.get("model") == model]

    # -- judging and deciding ------------------------------------------------------------------
    async def refresh_known(self) -> None:
        """The repository's models and versions for the metric labels (sidecar.metrics: others share one label)."""
        self._known_due = time.monotonic() + KNOWN_MODELS_S
        self.metrics.set_known(await asyncio.to_thread(repository_models, self.config.repository))

    async def tick(self) -> None:
        loop = asyncio.get_running_loop()
        if time.monotonic() >= self._known_due:
            await self.refresh_known()
        self._clear_memory_series()
        for model, canary in list(self.canaries.items()):
            if canary.pending is not None:
                await self._retry(canary)
                continue
            if not await self._check_triton(canary):  # paused: not judged; the deadline ends it inconclusive
                at_deadline = time.time() >= canary.deadline
                if canary.paused is not None and at_deadline and self.canaries.get(model) is canary:
                    # The judge gives the record's statistics only; the outcome is not its to choose.
                    call = functools.partial(judge, canary.evidence.snapshot(), canary.params.judge_params(),
                                             now=time.time(), deadline=canary.deadline)  # fmt: skip
                    stats = (await loop.run_in_executor(None, call)).stats
                    await self.decide(model, self._paused_at_deadline(canary, stats), "sidecar")
                continue
            if await self._new_placement(canary):
                continue
            self._budget_tick(canary)
            await self._sample_memory(canary)
            await self._sample_throughput(canary)
            snap = canary.evidence.snapshot()
            call = functools.partial(
                judge, snap, canary.params.judge_params(), now=time.time(), deadline=canary.deadline
            )
            j = await loop.run_in_executor(None, call)
            canary.judgement = j.to_dict()
            self.metrics.candidate_oot_rate.labels(model).set(j.stats["oot_rate"])
            if j.final and self.canaries.get(model) is canary:
                await self.decide(model, j, "judge")
        if self._dirty:
            for model, canary in self.canaries.items():
                self.store.model(model)["canary"] = canary.to_dict()
            await self._save()

    @staticmethod
    def _paused_at_deadline(canary: Canary, stats: dict[str, Any]) -> Judgement:
        """The deadline passed while paused: inconclusive (the baseline keeps serving), not a pin."""
        paused = canary.paused or {}
        since = time.time() - float(paused.get("since", time.time()))
        triton = paused.get("blame") == Blame.TRITON.value
        what = "Triton was unavailable" if triton else "the shadow model was lost"
        reason = (f"{what} at the deadline (paused {since:.0f}s: {paused.get('reason', 'unknown')}); "
                  "the candidate was not judged on it")  # fmt: skip
        return Judgement(INCONCLUSIVE, (reason,), stats)

    async def decide(self, model: str, j: Judgement, by: str) -> None:
        async with self._locks[model]:
            canary = self.canaries.get(model)
            if canary is None or canary.pending is not None:
                return
            canary.pending = Decision(
                canary_id=canary.id, model=model, candidate=canary.candidate, baseline=canary.baseline,
                outcome=j.outcome, reasons=list(j.reasons), evidence={**j.stats, **canary.budget.record(), "protocols": dict(canary.evidence.protocols)},
                decided_by=by, exemplars=list(canary.evidence.exemplars), started=canary.started, at=time.time(),
                params=canary.params.to_dict(), tolerance=canary.tolerance.to_dict(),
                gate_vs_canary=gate_vs_canary(canary.gate, j.stats, canary.params),
                tolerance_source=canary.tolerance_source,
            ).to_dict()  # fmt: skip
            self.store.model(model)["canary"] = canary.to_dict()
            await self._save()
            try:
                await self._complete(canary)
            except Exception:  # the decision is durable as pending; the ticker retries the action
                LOG.exception("acting on the %s decision for %s failed; will retry", j.outcome, model)

    async def _retry(self, canary: Canary) -> None:
        """A decision whose action failed unexpectedly (say, the repository was not writable) is retried each tick."""
        lock = self._locks[canary.model]
        if lock.locked():
            return  # being completed right now
        async with lock:
            if self.canaries.get(canary.model) is canary and canary.pending is not None:
                await self._complete(canary)

    async def _complete(self, canary: Canary) -> None:
        """Act on a pending decision (idempotent), append its record once, clear the canary."""
        model, rec = canary.model, Decision.from_dict(canary.pending or {})
        await canary.slots.drain()
        existing = await asyncio.to_thread(self.store.decision_for, canary.id)
        if existing is not None:
            rec = Decision.from_dict(existing)
        live = canary.baseline
        if rec.outcome == PROMOTE:
            try:
                await self.control.stage_promotion(model, canary.candidate, canary.baseline)
            except (PromotionError, ControlError) as exc:
                rec.outcome = PIN
                rec.reasons = [*rec.reasons, f"promotion failed, the baseline keeps serving: {exc}"]
            else:
                live = canary.candidate
                self.store.model(model)["live"] = live  # from here every unversioned request goes to C
                left = await self._drain_routed(model, canary.baseline, self.config.upstream_timeout_s)
                if left:
                    LOG.warning("%d requests to %s v%d still in flight after %gs; unloading it anyway",
                                left, model, canary.baseline, self.config.upstream_timeout_s)  # fmt: skip
                try:
                    await self.control.finish_promotion(model, canary.candidate)
                except ControlError as exc:  # C serves; B stays loaded beside it until the next reload
                    LOG.error(
                        "promoted %s v%d, but unloading v%d failed: %s", model, live, canary.baseline, exc
                    )
                    rec.reasons = [*rec.reasons, f"the baseline could not be unloaded: {exc}"]
        try:
            await self.control.stop_shadow(model)
        except ControlError as exc:
            LOG.warning("could not unload %s: %s", shadow_name(model), exc)
        rec.live_after = live
        if existing is None:
            await asyncio.to_thread(self.store.decisions.append, rec.to_dict())
            outcome = rec.outcome
            self.metrics.decisions.labels(model, outcome).inc()
            self.metrics.last_decision.labels(model, outcome).set(time.time())
        state = "promoted" if rec.outcome == PROMOTE else "pinned"
        ms = self.store.model(model)
        ms["live"], ms["canary"] = live, None
        ms["last"] = {"canary_id": canary.id, "state": state, "outcome": rec.outcome, "candidate": canary.candidate,
                      "baseline": canary.baseline, "reasons": rec.reasons, "at": rec.at}  # fmt: skip
        self.canaries.pop(model, None)
        await self._save()
        self._publish(model)
        LOG.info("canary %s of %s: %s (%s)", canary.id, model, rec.outcome, "; ".join(rec.reasons))
        if rec.outcome == PROMOTE:
            await apply_retention(self, model)  # sidecar/rollback.py: old versions beyond retain_versions

    # -- lifecycle -----------------------------------------------------------------------------
    async def resume(self) -> None:
        """After a restart: republish state, finish pending decisions, reload shadows Triton lost.

        Models the sidecar holds no state for publish the live version their config's policy names, so
        dashboards show what serves from the first scrape, not only after a first canary.
        """
        await self.refresh_known()
        known = set(self.store.models())
        for model, version in await asyncio.to_thread(self._configured_live, known):
            self.metrics.init_model(model)
            self.metrics.set_state(model, "idle")
            self.metrics.live_version.labels(model).set(version)
        for model, ms in list(self.store.models().items()):
            if ms.get("canary"):
                canary = Canary.from_dict(model, ms["canary"])
                if (
                    canary.semantics is None
                ):  # a state file written before the config was kept with the canary
                    canary.semantics = await self._semantics(model)
                self._register(canary)
                if canary.pending is not None:
                    await self._complete(canary)
                elif not await self.control.serving(model, canary.baseline, timeout_s=TRITON_PROBE_S):
                    # Triton is down too: not the candidate's fault. Paused; the judge tick reloads the shadow
                    self._pause(canary, Blame.TRITON, f"no answer from {self.control.base}/v2/health/ready")
                elif not all(
                    [await self.control.ready(shadow_name(model), v) for v in canary.shadow_versions()]
                ):
                    try:
                        await self.control.start_shadow(model, canary.candidate, canary.shadow_baseline())
                        self._fresh_instances(canary)  # loaded again: a new placement
                    except ControlError as exc:
                        await self.decide(model, Judgement(PIN, (f"candidate could not be reloaded: {exc}",), {}),
                                          "sidecar")  # fmt: skip
            self._publish(model)
        await finish_pending(self)  # rollbacks a killed sidecar left pending (sidecar/rollback.py)

    def _configured_live(self, skip: set[str]) -> list[tuple[str, int]]:
        """(model, version) for each repository model whose config pins one version (`specific [v]`)."""
        out = []
        for entry in sorted(Path(self.config.repository).iterdir()):
            model = entry.name
            if model in skip or model.startswith(".") or model.endswith(SHADOW_SUFFIX) or not entry.is_dir():
                continue
            try:
                policy = self.control.policy(model)
            except (ControlError, ValueError):
                continue
            if policy is not None and len(policy) == 1:
                out.append((model, policy[0]))
        return out

    async def close(self) -> None:
        await self.control.close()
        for canary in self.canaries.values():
            n = await canary.slots.drain(timeout_s=1.0)
            if n:
                self.metrics.mirror_dropped.labels(canary.model, "candidate", "shutdown").inc(n)
        if self._dirty:
            for model, canary in self.canaries.items():
                self.store.model(model)["canary"] = canary.to_dict()
            await self._save()

    async def _save(self) -> None:
        self._dirty = False
        await asyncio.to_thread(self.store.save, self.store.snapshot())

    def _publish(self, model: str) -> None:
        canary = self.canaries.get(model)
        st = self.status(model)
        outputs = tuple(t.output for t in canary.tolerance.tolerances if t.output != "*") if canary else ()
        self.metrics.init_model(model, outputs)
        self.metrics.set_state(model, st["state"])
        self.metrics.live_version.labels(model).set(st["live"] or 0)
        self.metrics.candidate_version.labels(model).set(canary.candidate if canary else 0)
        self.metrics.canary_started.labels(model).set(canary.started if canary else 0)
        self.metrics.canary_deadline.labels(model).set(canary.deadline if canary else 0)
        self.metrics.canary_paused.labels(model).set(0 if canary is None or canary.paused is None else 1)
        if canary:
            self.metrics.oot_budget.labels(model).set(canary.params.oot_budget)
            self.metrics.mirror_sample_rate.labels(model).set(canary.budget.effective)
        else:  # a figure of a canary that ended would read as current
            for gauge in (self.metrics.mirror_sample_rate, self.metrics.client_slowdown):
                with contextlib.suppress(KeyError):
                    gauge.remove(model)


__all__ = ["INCONCLUSIVE", "PIN", "PROMOTE", "Canary", "CanaryError", "CanaryManager"]
