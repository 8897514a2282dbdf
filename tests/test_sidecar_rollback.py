"""Rollback through the sidecar against a real Triton: no downtime under load, refusals, crashes, retention.

One Triton serves every model of this module (each test owns its model names). Sidecars run in this
test's event loop (`sidecar.app.start`, the production server) or, for the SIGKILL test, as processes.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from sidecar.app import RunningSidecar, start
from sidecar.client import AdminClient, AdminError, SidecarProcess, write_token_file
from sidecar.config import CanaryParams, ConfigError, SidecarConfig
from sidecar.rollback import KILL_AT_ENV, retained
from tests.conftest import http
from tests.sidecar_models import FAST_PARAMS, TOKEN, add_model, canary_cli, infer_body
from tunegate import codec
from tunegate.repository import parse_version_policy
from tunegate.triton import EmbeddedTriton, TritonOptions

pytestmark = pytest.mark.triton
AUTH = {"Authorization": f"Bearer {TOKEN}"}
NEVER: dict[str, Any] = {
    **FAST_PARAMS,
    "min_samples": 10**6,
    "deadline_s": 600,
}  # a canary the judge leaves to the operator
MODELS: dict[str, dict[int, dict[str, Any]]] = {
    # Slow to load and to unload (a big engine): each phase of the swap takes seconds under traffic.
    "rbload": {2: {"delay_ms": 2, "load_s": 1.0, "unload_s": 1.0}},
    "rbrefuse": {2: {}},
    "rbkill": {2: {}},
    "rbfail": {2: {}},
    "rbret": {v: {} for v in range(2, 7)},
    "rbserve": {2: {"delay_ms": 2}},  # version 1's model, released with another serving configuration
}
BASELINES = {"rbload": {"delay_ms": 2, "load_s": 1.0, "unload_s": 1.0}}


SERVING = {"instances": 2}


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("rollback-repo")
    for name, cands in MODELS.items():
        add_model(repo, name, cands, baseline=BASELINES.get(name))
    release = repo / "rbserve" / "2" / "release.json"
    release.write_text(json.dumps({**json.loads(release.read_text()), "serving": SERVING}))
    return repo


@pytest.fixture(scope="module")
def triton(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedTriton]:
    server = EmbeddedTriton(
        TritonOptions(repository=repo, models=tuple(MODELS)), workdir=tmp_path_factory.mktemp("t")
    )
    server.start()
    yield server
    server.stop()


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def start_sidecar(
    triton: EmbeddedTriton, repo: Path, state_dir: Path, **kw: Any
) -> tuple[RunningSidecar, str]:
    cfg = SidecarConfig(
        upstream=triton.http_url,
        state_dir=state_dir,
        repository=repo,
        listen_port=0,
        admin_token=TOKEN,
        judge_interval_s=0.2,
        canary=CanaryParams(),
        **kw,
    )
    running = await start(cfg, CollectorRegistry())
    return running, f"http://127.0.0.1:{running.port}"


async def admin(
    client: aiohttp.ClientSession, method: str, url: str, body: Any = None, raw: bytes | None = None
) -> tuple[int, Any]:
    kw: dict[str, Any] = {"data": raw} if raw is not None else {"json": body} if body is not None else {}
    async with client.request(method, url, headers=AUTH, **kw) as r:
        return r.status, await r.json()


async def promote(client: aiohttp.ClientSession, url: str, model: str, candidate: int = 2) -> None:
    code, st = await admin(client, "POST", f"{url}/canary/{model}", {"candidate": candidate, **NEVER})
    assert code == 201, st
    code, st = await admin(client, "POST", f"{url}/canary/{model}/promote")
    assert code == 200 and st["state"] == "promoted" and st["live"] == candidate, st


def records(state_dir: Path) -> list[dict[str, Any]]:
    path = state_dir / "decisions.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def policy(repo: Path, model: str) -> tuple[int, ...] | None:
    return parse_version_policy((repo / model / "config.pbtxt").read_text())


async def direct_version(client: aiohttp.ClientSession, triton: EmbeddedTriton, model: str) -> str:
    body, headers = infer_body(np.random.default_rng(1))
    async with client.post(f"{triton.http_url}/v2/models/{model}/infer", data=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        return str((await r.json())["model_version"])


class Load:
    """Clients sending unversioned infers until stopped; answers kept as (sent, answered, status, version)."""

    def __init__(
        self, client: aiohttp.ClientSession, url: str, model: str, concurrency: int, rows: int
    ) -> None:
        self.client, self.url, self.model, self.rows = client, url, model, rows
        self.seen: list[tuple[float, float, int, str]] = []
        self.stop = asyncio.Event()
        self.tasks = [asyncio.ensure_future(self._worker(i)) for i in range(concurrency)]

    async def _worker(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        while not self.stop.is_set():
            body, headers = infer_body(rng, binary=True, rows=self.rows)
            t0 = time.monotonic()
            async with self.client.post(
                f"{self.url}/v2/models/{self.model}/infer", data=body, headers=headers
            ) as r:
                raw = await r.read()
            version = ""
            if r.status == 200:
                hl = r.headers.get(codec.HEADER)
                version = str(json.loads(raw[: int(hl)] if hl else raw)["model_version"])
            self.seen.append((t0, time.monotonic(), r.status, version))

    async def finish(self) -> None:
        self.stop.set()
        await asyncio.gather(*self.tasks)


async def test_rollback_under_load_loses_no_client_request(
    triton: EmbeddedTriton, repo: Path, tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    """Promote, then roll back while 6 clients send 256 KiB unversioned infers the whole time: none fails."""
    state_dir = tmp_path / "state"
    running, url = await start_sidecar(triton, repo, state_dir)
    try:
        await promote(client, url, "rbload")
        assert policy(repo, "rbload") == (2,) and await direct_version(client, triton, "rbload") == "2"
        load = Load(client, url, "rbload", concurrency=6, rows=1 << 14)
        await asyncio.sleep(1.0)
        t0 = time.monotonic()
        code, st = await admin(client, "POST", f"{url}/canary/rbload/rollback", {"reason": "p99 regression"})
        t1 = time.monotonic()
        await asyncio.sleep(1.0)
        await load.finish()
        assert code == 200, st
        statuses = [s for _, _, s, _ in load.seen]
        assert set(statuses) == {200}, {c: statuses.count(c) for c in set(statuses)}
        during = [v for sent, done, _, v in load.seen if done > t0 and sent < t1]
        before = {v for sent, _, _, v in load.seen if sent < t0}
        after = [v for sent, _, _, v in load.seen if sent > t1]
        # Clients were served all through the swap (it takes seconds: v1 loads slowly, v2 unloads slowly).
        assert t1 - t0 > 1.0 and len(during) >= 6, (t1 - t0, len(during))
        assert before == {"2"} and len(after) > 10 and set(after) == {"1"}, (before, set(after))

        assert st["state"] == "rolled_back" and st["live"] == 1 and st["canary"] is None, st
        assert st["last"]["outcome"] == "rollback" and (
            st["last"]["from_version"],
            st["last"]["to_version"],
        ) == (2, 1)
        [rec] = [r for r in records(state_dir) if r["outcome"] == "rollback"]
        assert (rec["from_version"], rec["to_version"], rec["live_after"]) == (2, 1, 1)
        assert rec["reasons"] == ["p99 regression"] and rec["decided_by"] == "operator" and rec["at"] > 0
        assert [r["outcome"] for r in records(state_dir)] == ["promote", "rollback"]
        assert policy(repo, "rbload") == (1,) and await direct_version(client, triton, "rbload") == "1"
        assert not triton.model_ready("rbload", "2")  # the version rolled back from is unloaded
        assert (repo / "rbload" / "2" / "model.py").is_file()  # ... and its files kept (retention keeps 3)
        async with client.get(f"{url}/metrics") as r:
            text = await r.text()
        assert 'tunegate_live_version{model="rbload"} 1.0' in text
        assert 'tunegate_decisions_total{model="rbload",outcome="rollback"} 1.0' in text
        # Nothing left to roll back to: the baseline of the last promotion is live.
        code, err = await admin(client, "POST", f"{url}/canary/rbload/rollback")
        assert code == 404 and "already live" in err["error"], err
    finally:
        await running.close()


async def test_rollback_refusals_and_bad_input(
    triton: EmbeddedTriton, repo: Path, tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    running, url = await start_sidecar(triton, repo, tmp_path / "state")
    rb = f"{url}/canary/rbrefuse/rollback"
    try:
        async with client.post(rb) as r:
            assert r.status == 401
        async with client.post(rb, headers={"Authorization": "Bearer wrong-token-0123456789"}) as r:
            assert r.status == 403
        code, err = await admin(client, "POST", rb)
        assert code == 404 and "no promotion" in err["error"], err  # nothing recorded to roll back to
        code, err = await admin(client, "POST", f"{url}/canary/nosuchmodel/rollback", {"to": 1})
        assert code == 404 and "not in the repository" in err["error"], err
        code, err = await admin(client, "POST", rb, {"to": 9})
        assert code == 404 and "no version 9" in err["error"], err
        code, err = await admin(client, "POST", rb, {"to": 1})
        assert code == 400 and "already live" in err["error"], err
        bad: list[bytes] = [
            b"{not json",
            b"[1]",
            b'"x"',
            b"\xff\xfe",
            b"[" * 100_000 + b"]" * 100_000,
            b"9" * 5000,
            *(
                json.dumps(x).encode()
                for x in (
                    {"to": "1"},
                    {"to": 0},
                    {"to": -3},
                    {"to": True},
                    {"to": 1.5},
                    {"to": 1 << 70},
                    {"reason": 5},
                    {"reason": "x" * 5000},
                    {"candidate": 2},
                    {"to": 1, "force": True},
                )
            ),
        ]
        for body in bad:
            code, err = await admin(client, "POST", rb, raw=body)
            assert code == 400 and err["error"], (body[:40], code, err)
        code, err = await admin(client, "POST", f"{url}/canary/rbrefuse__canary/rollback", {"to": 1})
        assert code == 400, err
        # While a canary runs for the model: 409, and the canary is untouched.
        code, st = await admin(client, "POST", f"{url}/canary/rbrefuse", {"candidate": 2, **NEVER})
        assert code == 201, st
        code, err = await admin(client, "POST", rb, {"to": 2})
        assert code == 409 and "running canary" in err["error"], err
        code, st = await admin(client, "GET", f"{url}/canary/rbrefuse")
        assert st["state"] == "running" and st["live"] == 1
        code, st = await admin(client, "POST", f"{url}/canary/rbrefuse/pin")
        assert code == 200 and st["state"] == "pinned"
        assert [r["outcome"] for r in records(tmp_path / "state")] == ["pin"]
        async with client.get(f"{url}/healthz") as r:
            assert r.status == 200
    finally:
        await running.close()


async def test_failed_rollback_restores_the_config_and_keeps_serving(
    triton: EmbeddedTriton, repo: Path, tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    running, url = await start_sidecar(triton, repo, tmp_path / "state")
    try:
        await promote(client, url, "rbfail")
        (repo / "rbfail" / "1" / "behaviour.json").unlink()  # version 1 no longer loads
        code, err = await admin(client, "POST", f"{url}/canary/rbfail/rollback")
        assert code == 502 and "version 2 keeps serving" in err["error"], err
        code, st = await admin(client, "GET", f"{url}/canary/rbfail")
        assert st["state"] == "rollback_failed" and st["live"] == 2, st
        rec = records(tmp_path / "state")[-1]
        assert rec["outcome"] == "rollback_failed" and rec["live_after"] == 2 and len(rec["reasons"]) == 2, (
            rec
        )
        assert policy(repo, "rbfail") == (2,) and await direct_version(client, triton, "rbfail") == "2"
        async with client.post(
            f"{url}/v2/models/rbfail/infer", data=infer_body(np.random.default_rng(2))[0]
        ) as r:
            assert r.status == 200 and (await r.json())["model_version"] == "2"
    finally:
        await running.close()


def test_sigkill_with_a_pending_rollback_finishes_it_once(
    triton: EmbeddedTriton, repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    token_file = write_token_file(tmp_path / "token", TOKEN)
    st_dir = tmp_path / "state"

    def sidecar(kill_at: str | None = None) -> SidecarProcess:
        if kill_at is None:
            monkeypatch.delenv(KILL_AT_ENV, raising=False)
        else:
            monkeypatch.setenv(KILL_AT_ENV, kill_at)
        return SidecarProcess(
            upstream=triton.http_url, state_dir=st_dir, repository=repo, token_file=token_file
        )

    def state() -> dict[str, Any]:
        return dict(json.loads((st_dir / "state.json").read_text())["models"]["rbkill"])

    def versions_via(sc: SidecarProcess, n: int = 5) -> set[str]:
        rng = np.random.default_rng(0)
        seen = set()
        for _ in range(n):
            body, headers = infer_body(rng)
            code, _h, raw = http("POST", f"{sc.url}/v2/models/rbkill/infer", body, headers)
            assert code == 200, raw
            seen.add(str(json.loads(raw)["model_version"]))
        return seen

    for kill_at in (
        "pending",
        "staged",
    ):  # right after the pending write; after phase 1 and the routing switch
        sc = sidecar(kill_at).start()
        api = AdminClient(sc.url, TOKEN)
        api.start("rbkill", 2, **NEVER)
        assert api.promote("rbkill")["live"] == 2
        with pytest.raises(AdminError) as exc:
            api.rollback("rbkill", reason=f"killed at {kill_at}")
        assert exc.value.status == 0  # the process died under the request
        assert sc.proc is not None and sc.proc.wait(timeout=10) == -9
        sc.proc = None
        s = state()
        assert s["rollback"]["to_version"] == 1 and s["live"] == 2, s
        assert records(st_dir)[-1]["outcome"] == "promote"  # no rollback record yet
        assert policy(repo, "rbkill") == ((2,) if kill_at == "pending" else (1, 2))
        pending_state = (st_dir / "state.json").read_text()

        with sidecar() as sc:  # resumes: finishes the same rollback
            st = AdminClient(sc.url, TOKEN).status("rbkill")
            assert st["state"] == "rolled_back" and st["live"] == 1, st
            assert versions_via(sc) == {"1"}
            if kill_at == "staged":  # the CLI reads the same records and refuses what is left
                cli = canary_cli(sc.url, token_file)
                out = subprocess.run(
                    [*cli, "decisions", "rbkill"], check=False, capture_output=True, text=True, timeout=60
                )
                assert out.returncode == 0 and out.stdout.count("rollback") >= 2 and "2 -> 1" in out.stdout, (
                    out
                )
                out = subprocess.run(
                    [*cli, "rollback", "rbkill"], check=False, capture_output=True, text=True, timeout=60
                )
                assert out.returncode == 2 and "already live" in out.stderr, out.stderr
        rb = [r for r in records(st_dir) if r["outcome"] == "rollback"]
        assert [r["reasons"] for r in rb][-1] == [f"killed at {kill_at}"]
        assert policy(repo, "rbkill") == (1,) and not triton.model_ready("rbkill", "2")

        if kill_at == "pending":
            # Killed after the record was appended, before the state was cleared: finished, not written twice.
            (st_dir / "state.json").write_text(pending_state)
            n = len(records(st_dir))
            with sidecar() as sc:
                assert AdminClient(sc.url, TOKEN).status("rbkill")["state"] == "rolled_back"
                assert len(records(st_dir)) == n and state()["rollback"] is None
                assert versions_via(sc) == {"1"}
    rb = [r for r in records(st_dir) if r["outcome"] == "rollback"]
    assert len(rb) == 2 and len({r["rollback_id"] for r in rb}) == 2  # one record per rollback


async def test_retention_removes_only_old_versions_nobody_needs(
    triton: EmbeddedTriton, repo: Path, tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    def present() -> list[str]:
        return sorted(p.name for p in (repo / "rbret").iterdir() if p.is_dir())

    assert present() == ["1", "2", "3", "4", "5", "6"]
    running, url = await start_sidecar(triton, repo, tmp_path / "state", retain_versions=2)
    try:
        await promote(client, url, "rbret", candidate=3)
        # The newest two (5, 6), the live one (3) and the one a rollback brings back (1) stay; 2 and 4 go.
        assert present() == ["1", "3", "5", "6"]  # and no trash left behind
        code, st = await admin(client, "POST", f"{url}/canary/rbret/rollback")
        assert code == 200 and st["live"] == 1, st
        assert present() == ["1", "3", "5", "6"]  # 3 is now the version a rollback would want back
        assert await direct_version(client, triton, "rbret") == "1"
        code, st = await admin(client, "POST", f"{url}/canary/rbret/rollback", {"to": 5, "reason": "forward"})
        assert code == 200 and st["live"] == 5, st
        assert present() == ["1", "5", "6"]  # 3: old, not live, not the previous live, not the last baseline
        assert await direct_version(client, triton, "rbret") == "5"
    finally:
        await running.close()


def test_retention_rule_and_setting() -> None:
    assert retained(range(1, 7), 2, {1}) == {1, 5, 6}
    assert retained([3, 1, 2], 0, set()) == {1, 2, 3}  # 0 keeps all
    assert retained([1, 2], 5, {9}) == {1, 2, 9}
    where: dict[str, Any] = {
        "upstream": "http://127.0.0.1:1",
        "state_dir": Path("/tmp"),
        "repository": Path("/tmp"),
    }
    bad: Any
    for bad in (-1, True, "3", 1.0):
        with pytest.raises(ConfigError, match="retain_versions"):
            SidecarConfig(**where, retain_versions=bad)
    assert SidecarConfig(**where).retain_versions == 3


async def instances(client: aiohttp.ClientSession, triton: EmbeddedTriton, model: str) -> int:
    """The instance count of `model` as Triton serves it now (its loaded config, not the file)."""
    async with client.get(f"{triton.http_url}/v2/models/{model}/config") as r:
        assert r.status == 200, await r.text()
        return int(sum(g["count"] for g in (await r.json())["instance_group"]))


async def test_a_serving_release_is_canaried_promoted_and_rolled_back_with_its_configuration(
    triton: EmbeddedTriton, repo: Path, tmp_path: Path, client: aiohttp.ClientSession
) -> None:
    """A version released with two instances: the shadow serves it so, promotion applies it to the model and
    rollback restores the baseline's one instance, while 6 clients send infers the whole time: none fails."""
    state_dir = tmp_path / "state"
    running, url = await start_sidecar(triton, repo, state_dir)
    try:
        assert await instances(client, triton, "rbserve") == 1
        code, st = await admin(client, "POST", f"{url}/canary/rbserve", {"candidate": 2, **NEVER})
        assert code == 201, st
        # Shadow pairing would replay the baseline on the shadow, which serves the candidate's configuration.
        assert st["canary"]["params"]["latency_pairing"] == "primary", st["canary"]["params"]
        assert await instances(client, triton, "rbserve__canary") == 2
        assert await instances(client, triton, "rbserve") == 1  # clients' model untouched before promotion

        load = Load(client, url, "rbserve", concurrency=6, rows=64)
        await asyncio.sleep(0.5)
        code, st = await admin(client, "POST", f"{url}/canary/rbserve/promote")
        assert code == 200 and st["live"] == 2, (
            st,
            [(r["outcome"], r["reasons"]) for r in records(state_dir)],
        )
        await asyncio.sleep(0.5)
        assert await instances(client, triton, "rbserve") == 2 and policy(repo, "rbserve") == (2,)
        saved = (repo / "rbserve" / ".config-v1.pbtxt").read_text()  # what served v1, for the rollback
        assert parse_version_policy(saved) == (1,) and "count: 1" in saved

        code, st = await admin(client, "POST", f"{url}/canary/rbserve/rollback", {"reason": "serving test"})
        assert code == 200 and st["live"] == 1, st
        await asyncio.sleep(0.5)
        await load.finish()
        statuses = [s for _, _, s, _ in load.seen]
        assert set(statuses) == {200} and len(statuses) > 50, {c: statuses.count(c) for c in set(statuses)}
        assert await instances(client, triton, "rbserve") == 1 and policy(repo, "rbserve") == (1,)
        assert {v for sent, _, _, v in load.seen if sent > load.seen[-1][0] - 0.3} == {"1"}
        assert [r["outcome"] for r in records(state_dir)] == ["promote", "rollback"]
    finally:
        await running.close()
