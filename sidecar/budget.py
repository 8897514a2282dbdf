"""The mirror budget: what mirroring costs the live version's clients, and the sample rate that keeps it bounded.

Mirrored copies run on the same machine as the client's requests (the candidate, and with shadow latency
pairing a second instance of the baseline); where the device or the CPU is saturated they slow the clients
down. The client path already times each proxied request; `CanaryManager.offer` adds that latency to the
current window's histogram (one bisect and one increment, no allocation). Windows alternate on a schedule:
every `budget_period_s` the mirror pauses (sample rate 0) and, once the last mirrored copy has come back, counts
`budget_pause_s` of client traffic without it, which gives the clients' latency quantile `budget_quantile` (the median by
default, 0.99 for their p99) without mirroring on the same load, fresh; the rest of the period mirrors and
gives the quantile with it. From the judge tick, at most once per `DECIDE_EVERY_S` and only on windows with
enough requests for the quantile (`min_requests`), the added fraction `q_mirroring / q_paused - 1` drives an
AIMD-like controller of the effective sample rate: above `max_client_slowdown` it halves, below it grows by
an eighth.

"Above" is shown, not guessed: the share of the window's requests slower than `q_paused * (1 +
max_client_slowdown)` must exceed the share a quantile leaves above it (1 - q) by `Z` standard errors, those
of the window's share and of the paused quantile's own estimate (a two-sample sign test), so neither a short
window's noise nor a pause that happened to run fast halves the rate; between that and "at most 1 - q", the
rate holds. A pause with fewer requests than the quantile needs is merged with the next ones.

The rate's floor is counted in samples per second at the traffic measured (`budget_min_samples_per_s`), not as
a share of calls: a share would keep a copy out all the time at high traffic (1% of 1,400 calls a second is 14
samples a second, more than one shadow pair of a 100 ms slower candidate can take), and starve the evidence at
low traffic. The floor is never above `sample_rate`.

Fewer samples never bias the judge (a sampled request is judged the same way at any rate); they only
make the evidence arrive later. Budget state is not persisted: a restarted sidecar starts with a pause.
"""

from __future__ import annotations

import bisect
import math
from typing import Any

# Client latency histogram: buckets 1% wide from 50 us to about 56 s (bisect_left: the first bound >= value).
BOUNDS: tuple[float, ...] = tuple(5e-5 * 1.01**k for k in range(1400))
MIN_WINDOW_REQUESTS = 30  # a median's window needs this many requests (15 on each side); see min_requests
DECIDE_EVERY_S = 1.0
INCREASE_FRACTION = 0.125  # growth per decision under the budget, as a fraction of the rate (>= the floor)
Z = 2.0  # standard errors by which the share above the limit must exceed 1 - q to halve the rate


def new_counts() -> list[int]:
    return [0] * (len(BOUNDS) + 1)


def min_requests(q: float) -> int:
    """Requests a window needs for quantile `q`: 15 expected on the quantile's far side (30 for the median,
    1,500 for the 99th percentile)."""
    return math.ceil(MIN_WINDOW_REQUESTS * 0.5 / (1.0 - q) - 1e-9)


def quantile(counts: list[int], q: float = 0.5) -> float | None:
    """Quantile `q` of a histogram (the bucket's geometric middle), or None with fewer than `min_requests(q)`."""
    n = sum(counts)
    if n < min_requests(q):
        return None
    rank, seen = min(n, q * (n + 1)), 0
    for i, c in enumerate(counts):
        seen += c
        if seen >= rank:
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


def slower(share: float, n: int, q: float, m: int) -> bool | None:
    """The sign test: True when a window's `share` of `n` requests above the limit shows it slower than a
    baseline quantile `q` estimated from `m` requests; False when the share is at most 1 - q; None between."""
    expected = 1.0 - q
    if share <= expected:
        return False
    se = math.sqrt(q * expected * (1.0 / n + (1.0 / m if m else 0.0)))
    return True if share > expected + Z * se else None


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
        "floor",
        "increases",
        "max_rate",
        "min_per_s",
        "min_seen",
        "off_m",
        "off_pending",
        "off_total",
        "on_total",
        "pause_s",
        "paused",
        "pauses",
        "period_s",
        "phase_since",
        "q",
        "q_off",
        "q_on",
        "rate",
        "window",
        "window_since",
    )  # fmt: skip

    def __init__(self, sample_rate: float, max_client_slowdown: float | None, period_s: float, pause_s: float,
                 now: float, quantile: float = 0.5, min_samples_per_s: float = 1.0) -> None:  # fmt: skip
        self.max_rate = sample_rate
        self.q = quantile
        self.min_per_s = min_samples_per_s
        self.floor: float | None = None  # the last decision's lowest rate: min_per_s at the traffic measured
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
        self.off_pending = new_counts()  # pauses too short for the quantile, merged until they are not
        self.q_on: float | None = None  # the last mirroring window's client quantile (seconds)
        self.q_off: float | None = None  # the last pauses'
        self.off_m = 0  # requests the paused quantile was estimated from
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
                self.phase_since = now  # the pause measures `pause_s` from here, whatever the tick's period
            elif self.counts is None and now - self.phase_since >= self.period_s:
                self._mirror(now)  # copies still out after a whole period: this pause measures nothing
                return
            if self.counts is not None and now - self.phase_since >= self.pause_s:
                _merge(self.off_total, self.counts)
                _merge(self.off_pending, self.counts)
                off = quantile(self.off_pending, self.q)
                if off is not None:
                    self.q_off, self.off_m = off, sum(self.off_pending)
                    self.off_pending = new_counts()
                self._mirror(now)
            return
        counts = self.counts
        assert counts is not None
        if now - self.window_since >= DECIDE_EVERY_S:
            on = quantile(counts, self.q)
            if on is not None:
                self._decide(on, counts, now - self.window_since)
                _merge(self.on_total, counts)
                self._window(new_counts())
                self.window_since = now
        if now - self.phase_since >= self.period_s - self.pause_s:
            if self.counts is counts:  # a short last window: its requests count in the overall figures
                _merge(self.on_total, counts)
            self._pause(now)

    def _decide(self, on: float, counts: list[int], seconds: float) -> None:
        self.q_on = on
        added = _added(on, self.q_off)
        if added is None or self.q_off is None:
            return  # no baseline yet (too little traffic in the pauses): the rate holds
        self.added = added
        share, n = share_above(counts, self.q_off * (1.0 + self.budget))
        floor = self.floor = min(self.max_rate, self.min_per_s * seconds / n)  # n >= min_requests: never 0
        verdict = slower(share, n, self.q, self.off_m)
        if verdict:
            new = max(floor, self.effective / 2)
            self.decreases += new < self.effective
        elif verdict is False:
            new = min(self.max_rate, self.effective + max(floor, self.effective * INCREASE_FRACTION))
            self.increases += new > self.effective
        else:
            new = max(floor, self.effective)  # holds, but never under the floor the traffic now sets
        self.effective = new
        self.min_seen = min(self.min_seen, new)
        self.rate = new

    # -- reporting -------------------------------------------------------------------------------
    def overall(self) -> tuple[float | None, float | None, float | None]:
        """The client quantile over every mirroring window and over every pause so far, and the added fraction."""
        on, off = quantile(self.on_total, self.q), quantile(self.off_total, self.q)
        return on, off, _added(on, off)

    def status(self) -> dict[str, Any]:
        on, off, added = self.overall()
        return {
            "enabled": self.enabled,
            "max_client_slowdown": self.budget if self.enabled else None,
            "quantile": self.q,
            "sample_rate": self.effective,
            "max_sample_rate": self.max_rate,
            "min_sample_rate_seen": self.min_seen,
            "floor_sample_rate": self.floor,
            "min_samples_per_s": self.min_per_s,
            "phase": "off" if not self.enabled else ("paused" if self.paused else "mirroring"),
            "client_latency_mirroring_s": self.q_on,
            "client_latency_paused_s": self.q_off,
            "added": self.added,
            "overall": {"client_latency_mirroring_s": on, "client_latency_paused_s": off, "added": added},
            "decreases": self.decreases,
            "increases": self.increases,
            "pauses": self.pauses,
        }

    def record(self) -> dict[str, Any]:
        """Flat figures for a decision record's evidence (over the whole canary)."""
        on, off, added = self.overall()
        return {
            "max_client_slowdown": self.budget if self.enabled else None,
            "client_latency_quantile": self.q,
            "mirror_sample_rate": self.effective,
            "mirror_sample_rate_min": self.min_seen,
            "client_latency_mirroring_s": on,
            "client_latency_paused_s": off,
            "client_slowdown": added,
        }
