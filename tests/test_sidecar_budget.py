"""The mirror budget against a real Triton: mirroring's cost to clients is measured and held near the budget.

"burn": the candidate burns about 15 times the baseline's CPU per request; 8 clients without think time
saturate the machine, so mirrored copies slow the clients down. The same test measures the client p50
without a canary, with the budget off and with it on. "calm": a model that waits 5 ms (as on a device) and
one client with think time: the machine has headroom, mirroring costs clients nothing measurable, and the
effective rate stays at its maximum.
"""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest

from sidecar.client import SidecarProcess, write_token_file
from tests.sidecar_models import FAST_PARAMS, TOKEN, add_model, infer_body

pytestmark = pytest.mark.triton
AUTH = {"Authorization": f"Bearer {TOKEN}"}
# The judge must not end these canaries: they run to be measured (pinned by hand at the end).
UNDECIDED = {
    **FAST_PARAMS,
    "min_samples": 10**6,
    "deadline_s": 300,
    "required_speedup": 0.01,
    "latency_slack": 5.0,
    # The candidates here do several times the baseline's work per request, by design: the capacity check would
    # pin them once both versions ran 200 inferences, which depends on how fast this host is.
    "min_throughput_ratio": 0.0,
}
Samples = list[tuple[float, float]]  # (monotonic time answered, client latency in seconds)


async def load(client: aiohttp.ClientSession, url: str, model: str, stop: asyncio.Event, out: Samples,
               concurrency: int, think_s: float = 0.0) -> None:  # fmt: skip
    rng = np.random.default_rng(0)

    async def worker() -> None:
        while not stop.is_set():
            body, headers = infer_body(rng)
            t0 = time.perf_counter()
            async with client.post(f"{url}/v2/models/{model}/infer", data=body, headers=headers) as r:
                await r.read()
            assert r.status == 200
            out.append((time.monotonic(), time.perf_counter() - t0))
            if think_s:
                await asyncio.sleep(think_s)

    await asyncio.gather(*(worker() for _ in range(concurrency)))


def p50(samples: Samples, start: float, end: float) -> float:
    window = [s for t, s in samples if start <= t < end]
    assert len(window) >= 50, (start, end, len(window))
    return float(np.median(window))


async def admin(client: aiohttp.ClientSession, method: str, url: str, body: Any = None) -> Any:
    async with client.request(method, url, json=body, headers=AUTH) as r:
        assert r.status in (200, 201), await r.text()
        return await r.json()


def gauge(text: str, name: str, model: str) -> float | None:
    m = re.search(rf'^{name}{{model="{model}"}} (\S+)$', text, re.MULTILINE)
    return None if m is None else float(m.group(1))


@pytest.fixture
def sidecar_for(triton_factory: Any, tmp_path: Path) -> Any:
    procs: list[SidecarProcess] = []

    def make(models: dict[str, tuple[dict[str, Any], dict[str, Any]]]) -> SidecarProcess:
        repo = tmp_path / "repo"
        for name, (baseline, candidate) in models.items():
            add_model(repo, name, {2: candidate}, baseline=baseline)
        triton = triton_factory(repo, list(models))
        token = write_token_file(tmp_path / "token", TOKEN)
        sc = SidecarProcess(
            upstream=triton.http_url, state_dir=tmp_path / "state", repository=repo, token_file=token
        )
        procs.append(sc.start())
        return sc

    yield make
    for sc in procs:
        sc.stop()


async def test_budget_holds_client_slowdown_under_saturation(sidecar_for: Any) -> None:
    # A candidate 6x the baseline's work: unbounded, the mirror keeps about a core busy. Even at a floor of 1% of
    # calls a candidate's copies cost clients CPU on a saturated 2-core host: at 15x the work that floor alone was
    # 27% of client p50 on an AVX-512 CPU (0.66 of the unbounded cost), at 6x it is a few per cent. The budget's
    # floor is 1 sample a second (sidecar.budget), a share of calls that depends on this host's speed.
    sc = sidecar_for({"burn": ({"work": 20_000}, {"work": 120_000})})
    url, samples, stop = sc.url, [], asyncio.Event()
    async with aiohttp.ClientSession() as client:
        clients = asyncio.ensure_future(load(client, url, "burn", stop, samples, concurrency=8))
        try:
            await asyncio.sleep(5)
            t_base = time.monotonic()
            base = p50(samples, t_base - 4, t_base)

            # The budget off: every request mirrored (one pair at a time), what clients pay for it.
            await admin(
                client,
                "POST",
                f"{url}/canary/burn",
                {"candidate": 2, **UNDECIDED, "max_client_slowdown": None},
            )
            t = time.monotonic()
            await asyncio.sleep(6)
            off = p50(samples, t + 1, t + 6)
            st = await admin(client, "GET", f"{url}/canary/burn")
            assert (
                st["canary"]["mirror_budget"]["sample_rate"] == 1.0
                and not st["canary"]["mirror_budget"]["enabled"]
            )
            assert st["canary"]["evidence"]["compared"] > 50
            await admin(client, "POST", f"{url}/canary/burn/pin", {})

            # The budget on (5%), with a short schedule: a 1.5 s pause every 6 s.
            budget = {"max_client_slowdown": 0.05, "budget_period_s": 6.0, "budget_pause_s": 1.5}
            await admin(client, "POST", f"{url}/canary/burn", {"candidate": 2, **UNDECIDED, **budget})
            t = time.monotonic()
            rates: list[float] = []
            while time.monotonic() < t + 20:
                await asyncio.sleep(0.5)
                rates.append(
                    (await admin(client, "GET", f"{url}/canary/burn"))["canary"]["mirror_budget"][
                        "sample_rate"
                    ]
                )
            on = p50(samples, t + 11, t + 20)  # once the controller has found its rate, pauses included
            st = await admin(client, "GET", f"{url}/canary/burn")
            async with client.get(f"{url}/metrics") as r:
                metrics = await r.text()
            await admin(client, "POST", f"{url}/canary/burn/pin", {})
            rec = (await admin(client, "GET", f"{url}/decisions"))["decisions"][-1]
            # No canary again: the reference for the budget's phase is read beside it, not 40 s before it (on 2
            # shared cores the clients' p50 with no canary moved by a third between the two).
            t = time.monotonic()
            await asyncio.sleep(6)
            base_after = p50(samples, t + 2, t + 6)
        finally:
            stop.set()
            await clients

    b = st["canary"]["mirror_budget"]
    # Both phases against the no-canary p50 read before and after them (on 2 shared cores it moved by a fifth
    # between the two readings, either way): one reference for both, not the nearer reading for each.
    ref = (base + base_after) / 2
    slowdown_off, slowdown_on = off / ref - 1, on / ref - 1
    print(f"\nclient p50: no canary {1000 * base:.2f} ms then {1000 * base_after:.2f} ms, budget off {1000 * off:.2f} ms ({slowdown_off:+.1%}), "
          f"budget on {1000 * on:.2f} ms ({slowdown_on:+.1%}); rates {[round(r, 3) for r in rates]}; "
          f"sidecar's view {b}; record {[(k, rec['evidence'][k]) for k in ('mirror_sample_rate', 'mirror_sample_rate_min', 'client_latency_mirroring_s', 'client_latency_paused_s', 'client_slowdown')]}")  # fmt: skip
    assert slowdown_off > 0.15  # the scenario: unbounded mirroring costs clients dearly
    assert min(rates) < 0.5 and b["decreases"] >= 2 and b["min_sample_rate_seen"] < 0.5
    # Held towards the budget: a fraction of the unbounded cost (0.3-0.45 of it measured on 2 shared cores, where
    # other load moves a 1 s window's p50 by tens of per cent; the budget itself is not asserted on so few seconds).
    assert slowdown_on < 0.6 * slowdown_off
    assert b["added"] is not None and b["client_latency_paused_s"] is not None
    assert gauge(metrics, "tunegate_mirror_sample_rate", "burn") == b["sample_rate"] < 1.0
    assert gauge(metrics, "tunegate_client_slowdown", "burn") == b["added"]
    ev = rec["evidence"]
    assert ev["max_client_slowdown"] == 0.05 and ev["mirror_sample_rate_min"] < 0.5
    assert ev["client_latency_paused_s"] > 0 and ev["client_slowdown"] is not None


async def test_budget_keeps_full_rate_on_an_idle_machine(sidecar_for: Any) -> None:
    sc = sidecar_for({"calm": ({"delay_ms": 5}, {"delay_ms": 5})})
    url, samples, stop = sc.url, [], asyncio.Event()
    async with aiohttp.ClientSession() as client:
        clients = asyncio.ensure_future(load(client, url, "calm", stop, samples, concurrency=1, think_s=0.01))
        try:
            budget = {"max_client_slowdown": 0.05, "budget_period_s": 4.0, "budget_pause_s": 1.0}
            await admin(client, "POST", f"{url}/canary/calm", {"candidate": 2, **UNDECIDED, **budget})
            t = time.monotonic()
            rates = []
            while time.monotonic() < t + 10:
                await asyncio.sleep(0.5)
                rates.append(
                    (await admin(client, "GET", f"{url}/canary/calm"))["canary"]["mirror_budget"][
                        "sample_rate"
                    ]
                )
            st = await admin(client, "GET", f"{url}/canary/calm")
            async with client.get(f"{url}/metrics") as r:
                metrics = await r.text()
        finally:
            stop.set()
            await clients
    b = st["canary"]["mirror_budget"]
    print(f"\nidle: rates {set(rates)}; sidecar's view {b}")
    # At no cost at all a 5% budget is halved on about 1 decision in 10,000 (tests/test_budget_controller.py).
    # The copies do cost these clients a little (about 1% at the median overall, more in a second where a copy
    # meets the client's next request on a small machine), so one halving may come. Full rate is what the
    # controller keeps: at most that one halving, the rate at 1.0 most of the time, the overall slowdown within
    # the budget.
    assert b["decreases"] <= 1 and b["pauses"] >= 2, b
    assert rates.count(1.0) >= 0.75 * len(rates) and min(rates) >= 0.5, rates
    assert b["client_latency_paused_s"] is not None and b["added"] is not None  # measured
    assert b["overall"]["added"] is not None and b["overall"]["added"] < 0.05, b["overall"]
    assert st["canary"]["evidence"]["compared"] > 100
    assert gauge(metrics, "tunegate_mirror_sample_rate", "calm") >= 0.5
