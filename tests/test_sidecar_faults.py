"""Fault attribution: Triton's faults (down, restarted, the shadow model lost) are never the candidate's.

The classification is a pure function (`sidecar.faults`), tested on Triton 2.51's own texts; the
behaviour around it runs against a real Triton that is SIGKILLed and restarted on the same ports, with
the production sidecar (`sidecar.app.start`) in the test's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from sidecar.app import RunningSidecar, start
from sidecar.config import CanaryParams, SidecarConfig
from sidecar.control import shadow_name
from sidecar.faults import TRITON_PROBE_S, Blame, TritonSilent, classify_answer, classify_exception
from sidecar.upstream import UpstreamError, UpstreamTimeout
from tests.sidecar_models import FAST_PARAMS, TOKEN, add_model, infer_body
from tunegate.triton import EmbeddedTriton, TritonOptions

AUTH = {"Authorization": f"Bearer {TOKEN}"}


# -- classification (no server) ------------------------------------------------------------------
def _err(text: str) -> bytes:
    return json.dumps({"error": text}).encode()


@pytest.mark.parametrize(
    ("status", "body", "blame", "kind"),
    [
        # Triton 2.51's answers for a shadow model that is not loaded or not ready (seen on the embedded server)
        (404, _err("Request for unknown model: 'm__canary' is not found"), Blame.SHADOW, "error"),
        (404, _err("Request for unknown model: 'm__canary' version 2 is not found"), Blame.SHADOW, "error"),
        (
            404,
            _err("Request for unknown model: 'm__canary' has no available versions"),
            Blame.SHADOW,
            "error",
        ),
        (
            503,
            _err("Request for unknown model: 'm__canary' version 2 is not at ready state"),
            Blame.SHADOW,
            "error",
        ),
        # a proxy between the sidecar and Triton that cannot reach it
        (502, b"<html><body>502 Bad Gateway</body></html>", Blame.TRITON, "error"),
        (503, b"no healthy upstream", Blame.TRITON, "error"),
        (504, b"upstream request timeout", Blame.CANDIDATE, "timeout"),
        # the candidate's own execution: evidence against it
        (500, _err("candidate is broken"), Blame.CANDIDATE, "error"),
        (400, _err("unexpected inference input 'z' for model 'm__canary'"), Blame.CANDIDATE, "error"),
        (503, _err("the engine ran out of memory"), Blame.CANDIDATE, "error"),  # a model's own 503 is its own
        (500, b"not json at all", Blame.CANDIDATE, "error"),
    ],
)
def test_answers_are_attributed(status: int, body: bytes, blame: Blame, kind: str) -> None:
    fault = classify_answer(status, body)
    assert fault is not None and fault.blame is blame and fault.kind == kind
    assert fault.is_candidate_evidence is (blame is Blame.CANDIDATE)


def test_a_200_is_no_fault_and_the_candidate_error_keeps_its_text() -> None:
    assert classify_answer(200, b'{"outputs": []}') is None
    fault = classify_answer(500, _err("candidate is broken"))
    assert fault is not None and "candidate is broken" in fault.detail


@pytest.mark.parametrize(
    ("exc", "blame", "kind"),
    [
        (UpstreamTimeout("timeout"), Blame.CANDIDATE, "timeout"),  # the candidate's request was too slow
        (UpstreamError("unreachable: ConnectionRefusedError: Connection refused"), Blame.TRITON, "error"),
        (UpstreamError("unreachable: the upstream closed the connection"), Blame.TRITON, "error"),
        (UpstreamError("the sidecar is shutting down"), Blame.TRITON, "error"),
        (
            TritonSilent("timed out while Triton answered nothing"),
            Blame.TRITON,
            "timeout",
        ),  # a stalled Triton
        (None, Blame.TRITON, "error"),
    ],
)
def test_transport_failures_are_attributed(exc: BaseException | None, blame: Blame, kind: str) -> None:
    fault = classify_exception(exc)
    assert fault.blame is blame and fault.kind == kind


# -- against a real Triton ---------------------------------------------------------------------------
class Harness:
    """A real Triton that can be SIGKILLed and restarted on the same ports, and the sidecar in front of it."""

    def __init__(self, repo: Path, models: tuple[str, ...], workdir: Path) -> None:
        self.repo, self.models, self.workdir = repo, models, workdir
        self.triton = EmbeddedTriton(TritonOptions(repository=repo, models=models), workdir=workdir / "t0")
        self.triton.start()
        self.running: RunningSidecar | None = None
        self.registry = CollectorRegistry()
        self.url = ""

    async def start_sidecar(self, state_dir: Path, upstream: str | None = None) -> None:
        cfg = SidecarConfig(upstream=upstream or self.triton.http_url, state_dir=state_dir, repository=self.repo, listen_port=0,
                            admin_token=TOKEN, judge_interval_s=1.0, canary=CanaryParams())  # fmt: skip
        self.running = await start(cfg, self.registry)
        self.url = f"http://127.0.0.1:{self.running.port}"

    def kill_triton(self) -> None:
        """SIGKILL to the server and its stubs: no shutdown runs, as in a crash."""
        assert self.triton.proc is not None
        os.killpg(self.triton.proc.pid, signal.SIGKILL)
        self.triton.stop()

    def restart_triton(self) -> None:
        old = self.triton
        opts = TritonOptions(repository=self.repo, models=self.models, http_port=old.http_port,
                             grpc_port=old.grpc_port, metrics_port=old.metrics_port)  # fmt: skip
        self.triton = EmbeddedTriton(opts, workdir=self.workdir / "t1")
        self.triton.start()

    def metric(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0

    async def close(self) -> None:
        if self.running is not None:
            await self.running.close()
        self.triton.stop()


class LateProbes:
    """A fake at the seam between the sidecar and Triton, named as such: an HTTP relay to the real Triton that holds
    back the answers to readiness probes (`.../ready`) by `delay_s`, as a Triton saturated by clients does.
    Everything else (inference, statistics, repository control) is relayed as it comes."""

    HOP = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive"})

    def __init__(self, target: str) -> None:
        self.target, self.delay_s, self.probes = target, 0.0, 0
        self.http: aiohttp.ClientSession | None = None
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        self.http = aiohttp.ClientSession(auto_decompress=False)
        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/{tail:.*}", self.relay)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"

    async def relay(self, request: web.Request) -> web.StreamResponse:
        assert self.http is not None
        if request.path.endswith("/ready"):
            self.probes += 1
            await asyncio.sleep(self.delay_s)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in self.HOP}
        async with self.http.request(request.method, f"{self.target}{request.path_qs}", headers=headers,
                                        data=await request.read()) as r:  # fmt: skip
            body = await r.read()
            out = {k: v for k, v in r.headers.items() if k.lower() not in self.HOP}
            return web.Response(status=r.status, body=body, headers=out)

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
        if self.http is not None:
            await self.http.close()


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def status(client: aiohttp.ClientSession, h: Harness, model: str) -> dict[str, Any]:
    async with client.get(f"{h.url}/canary/{model}", headers=AUTH) as r:
        assert r.status == 200
        return dict(await r.json())


async def readyz(client: aiohttp.ClientSession, h: Harness) -> tuple[int, float]:
    """The sidecar's readiness probe: its status and how long it took to answer."""
    t0 = time.monotonic()
    async with client.get(f"{h.url}/readyz") as r:
        await r.read()
        return r.status, time.monotonic() - t0


async def wait_for(what: str, check: Callable[[], Awaitable[bool]], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


@contextlib.asynccontextmanager
async def load(
    client: aiohttp.ClientSession, url: str, model: str, concurrency: int = 2
) -> AsyncIterator[list[int]]:
    """Clients sending infer requests until the block ends; yields the status codes they saw (0: no answer)."""
    rng = np.random.default_rng(0)
    codes: list[int] = []
    stop = asyncio.Event()

    async def worker() -> None:
        while not stop.is_set():
            body, headers = infer_body(rng)
            try:
                async with client.post(f"{url}/v2/models/{model}/infer", data=body, headers=headers) as r:
                    await r.read()
                    codes.append(r.status)
            except aiohttp.ClientError:
                codes.append(0)
            if codes[-1] != 200:
                await asyncio.sleep(0.02)  # Triton is down: do not spin

    tasks = [asyncio.ensure_future(worker()) for _ in range(concurrency)]
    try:
        yield codes
    finally:
        stop.set()
        await asyncio.gather(*tasks)


async def start_canary(
    client: aiohttp.ClientSession, h: Harness, model: str, **params: Any
) -> dict[str, Any]:
    async with client.post(f"{h.url}/canary/{model}", json={"candidate": 2, **FAST_PARAMS, **params},
                           headers=AUTH) as r:  # fmt: skip
        body = dict(await r.json())
        assert r.status == 201, body
        return body


@pytest.mark.triton
async def test_triton_killed_and_restarted_pauses_reloads_and_resumes(tmp_path: Path,
                                                                      client: aiohttp.ClientSession) -> None:  # fmt: skip
    repo = tmp_path / "repo"
    add_model(repo, "fk", {2: {"noise": 1e-5}})
    h = Harness(repo, ("fk",), tmp_path)
    try:
        await h.start_sidecar(tmp_path / "state")
        # Never decided by the judge here (no promotion, no latency pairs): only the faults could end it.
        await start_canary(client, h, "fk", min_samples=10**6, warmup_samples=10**6, deadline_s=600)
        async with load(client, h.url, "fk") as codes:

            async def evidence(n: int) -> bool:
                return int((await status(client, h, "fk"))["canary"]["evidence"]["compared"]) >= n

            await wait_for("evidence", lambda: evidence(20), 30)

            # The shadow lost while Triton keeps serving (unloaded behind the sidecar's back): the copies that
            # meet it missing are not counted, and the judge tick loads it again.
            # Whichever copy meets it first pauses the canary: a candidate copy (v2) or an A/A copy (the shadow's v1).
            shadow_copies = [{"model": "fk", "version": "2", "role": "candidate"},
                             {"model": "fk", "version": "1", "role": "aa"}]  # fmt: skip
            assert await asyncio.to_thread(h.triton.model_ready, shadow_name("fk"), "2")
            await asyncio.to_thread(h.triton.unload, shadow_name("fk"))

            async def missed_and_reloaded() -> bool:
                st = await status(client, h, "fk")
                assert st["state"] == "running", st["last"]  # never pinned for the missing shadow
                missed = sum(
                    h.metric("tunegate_requests_total", **labels, code=c)
                    for labels in shadow_copies
                    for c in ("404", "503")
                )
                return missed > 0 and await asyncio.to_thread(h.triton.model_ready, shadow_name("fk"), "2")

            await wait_for("copies meeting the missing shadow, then its reload", missed_and_reloaded, 30)
            before = int((await status(client, h, "fk"))["canary"]["evidence"]["compared"])
            await wait_for("evidence after the reload", lambda: evidence(before + 20), 30)
            ev = (await status(client, h, "fk"))["canary"]["evidence"]
            assert ev["errors"] == 0 and ev["timeouts"] == 0, ev

            h.kill_triton()

            async def paused_for_triton() -> bool:
                p = (await status(client, h, "fk"))["canary"]["paused"]
                return p is not None and "Triton is unavailable" in p["reason"]

            await wait_for("the pause", paused_for_triton, 10)
            down = await status(client, h, "fk")
            assert down["state"] == "running"
            assert h.metric("tunegate_canary_paused", model="fk") == 1
            failed_while_down = len(codes)
            await asyncio.sleep(1.0)  # Triton stays down a while: clients fail, the canary counts nothing
            assert any(c != 200 for c in codes[failed_while_down:])
            still = await status(client, h, "fk")
            assert still["state"] == "running" and still["canary"]["paused"] is not None
            assert still["canary"]["evidence"]["sent"] == down["canary"]["evidence"]["sent"]

            await asyncio.to_thread(h.restart_triton)  # same ports and repository; it loads only `fk`

            async def resumed(n: int) -> bool:
                c = (await status(client, h, "fk"))["canary"]
                return c["paused"] is None and int(c["evidence"]["compared"]) >= n

            await wait_for("new evidence after the restart",
                           lambda: resumed(int(down["canary"]["evidence"]["compared"]) + 20), 60)  # fmt: skip
        st = await status(client, h, "fk")
        assert st["state"] == "running", st
        ev = st["canary"]["evidence"]
        assert ev["errors"] == 0 and ev["timeouts"] == 0, ev
        assert not [e for e in ev["exemplars"] if e["kind"] == "candidate_error"]
        assert h.triton.model_ready(shadow_name("fk"), "2")  # reloaded by the sidecar
        assert h.metric("tunegate_canary_paused", model="fk") == 0
        assert (
            h.metric("tunegate_mirror_errors_total", model="fk", version="2", role="candidate", kind="error")
            == 0
        )
        assert not (tmp_path / "state" / "decisions.jsonl").exists()
    finally:
        await h.close()


@pytest.mark.triton
async def test_a_triton_slow_to_answer_its_probes_is_serving_not_down(
    tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    """Readiness probes answered 3 s late (a Triton busy with clients) neither pause the canary nor load its shadow
    anew, and the sidecar's own /readyz stays ready, answered at once; probes that get no answer at all (a hung
    Triton) still pause it and make /readyz say not ready, and both come back when they are answered."""
    repo = tmp_path / "repo"
    add_model(repo, "lp", {2: {}})
    h = Harness(repo, ("lp",), tmp_path)
    relay = LateProbes(h.triton.http_url)
    try:
        await relay.start()
        await h.start_sidecar(tmp_path / "state", upstream=relay.url)
        await start_canary(client, h, "lp", min_samples=10**6, warmup_samples=10**6, deadline_s=600)
        async with load(client, h.url, "lp") as codes:

            async def evidence(n: int) -> bool:
                return int((await status(client, h, "lp"))["canary"]["evidence"]["compared"]) >= n

            await wait_for("evidence", lambda: evidence(20), 30)
            placement = (await status(client, h, "lp"))["canary"]["evidence"]["placement"]
            relay.delay_s, probes = 3.0, relay.probes
            late_until = time.monotonic() + 12.0
            while time.monotonic() < late_until:  # several judge ticks, each probe answered after 3 s
                c = (await status(client, h, "lp"))["canary"]
                assert c["paused"] is None, c["paused"]
                ready, seconds = await readyz(client, h)
                assert ready == 200 and seconds < 1.0, (
                    ready,
                    seconds,
                )  # busy Triton: still ready, answered at once
                await asyncio.sleep(0.2)
            assert relay.probes >= probes + 2  # the tick did probe, late answers and all
            c = (await status(client, h, "lp"))["canary"]
            assert c["evidence"]["placement"] == placement  # the shadow was not loaded anew
            assert h.metric("tunegate_canary_paused", model="lp") == 0

            relay.delay_s = (
                TRITON_PROBE_S + 2.0
            )  # no answer within the probe's wait: Triton is taken for down

            async def paused() -> bool:
                p = (await status(client, h, "lp"))["canary"]["paused"]
                return p is not None and "Triton is unavailable" in p["reason"]

            await wait_for("the pause", paused, 30)

            async def not_ready() -> bool:
                return (await readyz(client, h))[0] == 503

            await wait_for("/readyz to say not ready", not_ready, 30)
            relay.delay_s = 0.0

            async def resumed() -> bool:
                return (await status(client, h, "lp"))["canary"]["paused"] is None and (
                    await readyz(client, h)
                )[0] == 200

            await wait_for("the resumption", resumed, 60)
        assert set(codes) == {200}
        st = await status(client, h, "lp")
        assert st["state"] == "running" and st["canary"]["evidence"]["errors"] == 0, st
    finally:
        await h.close()
        await relay.close()


@pytest.mark.triton
async def test_a_stalled_triton_is_not_the_candidates_timeout(
    tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    """Triton's server stopped (SIGSTOP: connections accepted, nothing answered, as a hung backend or device) while
    copies are in flight: they time out long before the judge tick's probe gives up, and none is counted against the
    candidate. The canary pauses for Triton and resumes once it answers again. (The server process only: its python
    backend stubs stopped and continued with it crash the python backend, and Triton is then down, not stalled.)"""
    repo = tmp_path / "repo"
    add_model(repo, "st", {2: {"delay_ms": 30}})  # copies take a while: some are in flight at the stop
    h = Harness(repo, ("st",), tmp_path)
    stopped = False
    try:
        await h.start_sidecar(tmp_path / "state")
        await start_canary(
            client, h, "st", min_samples=10**6, warmup_samples=10**6, deadline_s=600, timeout_s=1.0
        )
        async with load(client, h.url, "st"):

            async def evidence(n: int) -> bool:
                return int((await status(client, h, "st"))["canary"]["evidence"]["compared"]) >= n

            await wait_for("evidence", lambda: evidence(20), 30)
            assert h.triton.proc is not None
            os.kill(h.triton.proc.pid, signal.SIGSTOP)
            stopped = True

            async def paused() -> bool:
                p = (await status(client, h, "st"))["canary"]["paused"]
                return p is not None and "Triton is unavailable" in p["reason"]

            # the copies and their baseline probes time out after 1 s each; the tick's probes wait TRITON_PROBE_S
            await wait_for("the pause", paused, TRITON_PROBE_S + 10)
            await asyncio.sleep(2.0)  # every copy sent before the stop has timed out and been judged by now
            ev = (await status(client, h, "st"))["canary"]["evidence"]
            assert ev["timeouts"] == 0 and ev["errors"] == 0, ev
            os.kill(h.triton.proc.pid, signal.SIGCONT)
            stopped = False
            sent = int(ev["sent"])

            async def resumed() -> bool:
                c = (await status(client, h, "st"))["canary"]
                return c["paused"] is None and int(c["evidence"]["sent"]) >= sent + 20

            await wait_for("the resumption and new evidence", resumed, 60)
        st = await status(client, h, "st")
        assert st["state"] == "running", st
        ev = st["canary"]["evidence"]
        # The client requests held at the stop answer late, after it: nothing else fails or times out.
        assert ev["timeouts"] == 0 and ev["errors"] == 0, ev
        for kind in ("timeout", "error"):
            assert (
                h.metric("tunegate_mirror_errors_total", model="st", version="2", role="candidate", kind=kind)
                == 0
            )
    finally:
        if stopped and h.triton.proc is not None:
            os.kill(h.triton.proc.pid, signal.SIGCONT)
        await h.close()


@pytest.mark.triton
async def test_a_hung_candidate_on_a_quiet_triton_is_pinned_for_its_timeouts(
    tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    """One request every 0.7 s, nothing else asked of Triton: the candidate's copies time out while Triton answers
    nothing else, the baseline answers the same request, and the timeouts are the candidate's: it is pinned."""
    repo = tmp_path / "repo"
    add_model(repo, "hc", {2: {"delay_ms": 1500}})
    h = Harness(repo, ("hc",), tmp_path)
    try:
        await h.start_sidecar(tmp_path / "state")
        await start_canary(client, h, "hc", deadline_s=120, timeout_s=0.4)
        rng = np.random.default_rng(0)
        deadline = time.monotonic() + 90
        while (await status(client, h, "hc"))["state"] == "running":
            assert time.monotonic() < deadline, await status(client, h, "hc")
            body, headers = infer_body(rng)
            async with client.post(f"{h.url}/v2/models/hc/infer", data=body, headers=headers) as r:
                assert r.status == 200
                await r.read()
            await asyncio.sleep(0.7)
        last = (await status(client, h, "hc"))["last"]
        assert last["outcome"] == "pin" and "candidate failed" in last["reasons"][0], last
        assert (
            h.metric(
                "tunegate_mirror_errors_total", model="hc", version="2", role="candidate", kind="timeout"
            )
            >= 3
        )
    finally:
        await h.close()


@pytest.mark.triton
async def test_triton_down_at_the_deadline_is_inconclusive_and_a_failing_candidate_is_still_pinned(
    tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    repo = tmp_path / "repo"
    add_model(repo, "dl", {2: {}})
    add_model(repo, "broken", {2: {"fail": True}})
    h = Harness(repo, ("dl", "broken"), tmp_path)
    try:
        await h.start_sidecar(tmp_path / "state")
        # A candidate that fails every request is pinned for it: the attribution hides no real failure.
        await start_canary(client, h, "broken")
        async with load(client, h.url, "broken") as codes:

            async def decided() -> bool:
                return (await status(client, h, "broken"))["state"] == "pinned"

            await wait_for("the failing candidate's pin", decided, 60)
        assert codes and set(codes) == {200}
        last = (await status(client, h, "broken"))["last"]
        assert last["outcome"] == "pin" and "candidate failed" in last["reasons"][0], last
        assert h.metric("tunegate_mirror_errors_total", model="broken", version="2", role="candidate",
                        kind="error") > 0  # fmt: skip

        await start_canary(client, h, "dl", min_samples=10**6, warmup_samples=10**6, deadline_s=6)
        async with load(client, h.url, "dl"):

            async def some_evidence() -> bool:
                return int((await status(client, h, "dl"))["canary"]["evidence"]["compared"]) >= 10

            await wait_for("evidence", some_evidence, 30)
            h.kill_triton()

            async def ended() -> bool:
                return (await status(client, h, "dl"))["state"] != "running"

            await wait_for("the deadline", ended, 30)
        st = await status(client, h, "dl")
        assert st["state"] == "pinned" and st["live"] == 1
        assert st["last"]["outcome"] == "inconclusive", st["last"]
        assert st["last"]["reasons"][0].startswith("Triton was unavailable at the deadline"), st["last"][
            "reasons"
        ]
        recs = [json.loads(x) for x in (tmp_path / "state" / "decisions.jsonl").read_text().splitlines()]
        assert [(r["model"], r["outcome"], r["decided_by"]) for r in recs] == [
            ("broken", "pin", "judge"), ("dl", "inconclusive", "sidecar")
        ]  # fmt: skip
        assert recs[1]["evidence"].get("compared", 10) >= 10  # the evidence gathered before Triton went down
        assert h.metric("tunegate_decisions_total", model="dl", outcome="inconclusive") == 1
        assert h.metric("tunegate_canary_paused", model="dl") == 0
    finally:
        await h.close()
