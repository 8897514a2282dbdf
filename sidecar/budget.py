"""The mirror budget: what mirroring costs the live version's clients, and the sample rate that keeps it bounded.

Mirrored copies run on the same machine as the client's requests (the candidate, and with shadow latency
pairing a second instance of the baseline); where the device or the CPU is saturated they slow the clients
down. The client path already times each proxied request; `CanaryManager.offer` adds that latency to the
current window's histogram (one bisect and one increment, no allocation). Windows alternate on a schedule:
every `budget_period_s` the mirror pauses for `budget_pause_s` (sample rate 0; counting starts once the
last mirrored copy has come back), which gives the client p50 without mirroring on the same load, fresh;
the rest of the period mirrors and gives the p50 with it. From the judge tick, at most once per
`DECIDE_EVERY_S` and only on windows of at least `MIN_WINDOW_REQUESTS` requests, the added fraction
`p50_mirroring / p50_paused - 1` drives an AIMD-like controller of the effective sample rate within
[min_rate, sample_rate]: above `max_client_slowdown` it halves, below it grows by an eighth (at least
min_rate). "Above" is shown, not guessed: more than half of the window's requests must be slower than
`p50_paused * (1 + max_client_slowdown)` by two standard errors (a sign test), so a short window's noise
on a fast model does not halve the rate; between that and "at most half", the rate holds.

Fewer samples never bias the judge (a sampled request is judged the same way at any rate); they only
make the evidence arrive later. Budget state is not persisted: a restarted sidecar starts with a pause.
"""

from __future__ import annotations

import bisect
import math
from typing import Any

# Client latency histogram: buckets 1% wide from 50 us to about 56 s (bisect_left: the first bound >= value).
BOUNDS: tuple[float, ...] = tuple(5e-5 * 1.01**k for k in range(1400))
MIN_RATE = 0.01  # the effective rate never goes below this (or sample_rate, if lower): evidence keeps coming
MIN_WINDOW_REQUESTS = 30  # a window with fewer client requests gives no p50 (it is extended, or dropped)
DECIDE_EVERY_S = 1.0
INCREASE_FRACTION = 0.125  # growth per decision under the budget, as a fraction of the rate (>= min_rate)
Z = 2.0  # standard errors by which the share of requests above the limit must exceed one half to halve the rate


def new_counts() -> list[int]:
    return [0] * (len(BOUNDS) + 1)


def p50(counts: list[int]) -> float | None:
    """The median of a histogram (the bucket's geometric middle), or None with fewer than MIN_WINDOW_REQUESTS."""
    n = sum(counts)
    if n < MIN_WINDOW_REQUESTS:
        return None
    half, seen = (n + 1) / 2, 0
    for i, c in enumerate(counts):
        seen += c
        if seen >= half:
            if i == 0:
                return BOUNDS[0]
            if i == len(BOUNDS):
                return BOUNDS[-1]
            return math.sqrt(BOUNDS[i - 1] * BOUNDS[i])
    return BOUNDS[-1]  # pragma: no cover - seen reaches n


def share_above(counts: list[int], limit: float) -> tuple[float, int]:
    """The share of the histogram's requests slower than `limit` (whole buckets above it), and their number."""
    n = sum(counts)
    return (sum(counts[bisect.bisect_right(BOUNDS, limit) + 1 :]) / n if n else 0.0), n


def _merge(total: list[int], window: list[int]) -> None:
    for i, c in enumerate(window):
        if c:
            total[i] += c


def _added(on: float | None, off: float | None) -> float | None:
    return None if on is None or off is None or off <= 0 else on / off - 1.0


class MirrorBudget:
    """One canary's mirror budget. `rate` and `counts` are read and written by `offer` (the client path);
    everything else happens in `tick` (the judge tick), on the same event loop."""

    __slots__ = (
        "added",
        "budget",
        "counts",
        "decreases",
        "effective",
        "enabled",
        "increases",
        "max_rate",
        "min_rate",
        "min_seen",
        "off_total",
        "on_total",
        "p50_off",
        "p50_on",
        "pause_s",
        "paused",
        "pauses",
        "period_s",
        "phase_since",
        "rate",
        "window",
        "window_since",
    )  # fmt: skip

    def __init__(self, sample_rate: float, max_client_slowdown: float | None, period_s: float, pause_s: float,
                 now: float) -> None:  # fmt: skip
        self.max_rate = sample_rate
        self.min_rate = min(MIN_RATE, sample_rate)
        self.budget = float(max_client_slowdown or 0.0)
        self.enabled = self.budget > 0.0
        self.period_s, self.pause_s = period_s, pause_s
        self.effective = sample_rate  # the controller's rate
        self.min_seen = sample_rate
        self.rate = sample_rate  # what offer() samples at: the effective rate, 0 while paused
        self.counts: list[int] | None = None  # the current window's histogram; None: not counting
        # which window `counts` is: counted elsewhere (the compiled gRPC front) a latency is added only to the
        # window it was measured in, never to the next one it arrives in
        self.window = 0
        self.on_total, self.off_total = new_counts(), new_counts()
        self.p50_on: float | None = None  # the last mirroring window's client p50 (seconds)
        self.p50_off: float | None = None  # the last pause's
        self.added: float | None = None  # the last decision's added fraction
        self.decreases = self.increases = self.pauses = 0
        self.paused = False
        self.phase_since = self.window_since = now
        if self.enabled:
            self._pause(now)  # the first figure is the baseline, before any mirroring

    # -- the schedule ----------------------------------------------------------------------------
    def _pause(self, now: float) -> None:
        self.paused, self.rate = True, 0.0
        self._window(None)
        self.phase_since = now
        self.pauses += 1

    def _mirror(self, now: float) -> None:
        self.paused, self.rate = False, self.effective
        self._window(new_counts())
        self.phase_since = self.window_since = now

    def _window(self, counts: list[int] | None) -> None:
        self.counts = counts
        self.window += 1

    def tick(self, now: float, in_flight: int) -> None:
        """Advance the schedule and, on a full window, adjust the effective rate. `in_flight`: mirror copies out."""
        if not self.enabled:
            return
        if self.paused:
            if self.counts is None and in_flight == 0:
                self._window(new_counts())  # the last copy is back: from now on, clients meet no mirror load
            if now - self.phase_since >= self.pause_s:
                if self.counts is not None:
                    off = p50(self.counts)
                    _merge(self.off_total, self.counts)
                    if off is not None:
                        self.p50_off = off
                self._mirror(now)
            return
        counts = self.counts
        assert counts is not None
        if now - self.window_since >= DECIDE_EVERY_S:
            on = p50(counts)
            if on is not None:
                self._decide(on, counts)
                _merge(self.on_total, counts)
                self._window(new_counts())
                self.window_since = now
        if now - self.phase_since >= self.period_s - self.pause_s:
            if self.counts is counts:  # a short last window: its requests count in the overall figures
                _merge(self.on_total, counts)
            self._pause(now)

    def _decide(self, on: float, counts: list[int]) -> None:
        self.p50_on = on
        added = _added(on, self.p50_off)
        if added is None or self.p50_off is None:
            return  # no baseline yet (too little traffic in the pauses): the rate holds
        self.added = added
        share, n = share_above(counts, self.p50_off * (1.0 + self.budget))
        if share > 0.5 + Z * 0.5 / math.sqrt(n):
            new = max(self.min_rate, self.effective / 2)
            self.decreases += new < self.effective
        elif share <= 0.5:
            new = min(self.max_rate, self.effective + max(self.min_rate, self.effective * INCREASE_FRACTION))
            self.increases += new > self.effective
        else:
            return
        self.effective = new
        self.min_seen = min(self.min_seen, new)
        self.rate = new

    # -- reporting -------------------------------------------------------------------------------
    def overall(self) -> tuple[float | None, float | None, float | None]:
        """Client p50 over every mirroring window and over every pause so far, and the added fraction."""
        on, off = p50(self.on_total), p50(self.off_total)
        return on, off, _added(on, off)

    def status(self) -> dict[str, Any]:
        on, off, added = self.overall()
        return {
            "enabled": self.enabled,
            "max_client_slowdown": self.budget if self.enabled else None,
            "sample_rate": self.effective,
            "max_sample_rate": self.max_rate,
            "min_sample_rate_seen": self.min_seen,
            "phase": "off" if not self.enabled else ("paused" if self.paused else "mirroring"),
            "client_p50_mirroring_s": self.p50_on,
            "client_p50_paused_s": self.p50_off,
            "added": self.added,
            "overall": {"client_p50_mirroring_s": on, "client_p50_paused_s": off, "added": added},
            "decreases": self.decreases,
            "increases": self.increases,
            "pauses": self.pauses,
        }

    def record(self) -> dict[str, Any]:
        """Flat figures for a decision record's evidence (over the whole canary)."""
        on, off, added = self.overall()
        return {
            "max_client_slowdown": self.budget if self.enabled else None,
            "mirror_sample_rate": self.effective,
            "mirror_sample_rate_min": self.min_seen,
            "client_p50_mirroring_s": on,
            "client_p50_paused_s": off,
            "client_slowdown": added,
        }
