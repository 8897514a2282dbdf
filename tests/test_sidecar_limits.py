"""The client path's limits against slow, oversized and too many clients, on raw sockets in front of a real Triton.

Each test runs its own sidecar (in this event loop) with short timeouts so the limits show within seconds;
the defaults (sidecar.config.SidecarConfig) are those of a production proxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
import time
import weakref
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from sidecar.app import RunningSidecar, start
from sidecar.config import SidecarConfig
from tests.sidecar_models import TOKEN, add_model, infer_body
from tunegate.triton import EmbeddedTriton, TritonOptions

pytestmark = pytest.mark.triton
FAST = {"header_timeout_s": 1.0, "body_timeout_s": 1.0, "keepalive_timeout_s": 1.5}


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("limits-repo")
    add_model(repo, "plain", {})
    return repo


@pytest.fixture(scope="module")
def triton(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedTriton]:
    server = EmbeddedTriton(
        TritonOptions(repository=repo, models=("plain",)), workdir=tmp_path_factory.mktemp("t")
    )
    server.start()
    yield server
    server.stop()


@contextlib.asynccontextmanager
async def sidecar(
    triton: EmbeddedTriton, repo: Path, state: Path, **kw: Any
) -> AsyncIterator[RunningSidecar]:
    cfg = SidecarConfig(upstream=triton.http_url, state_dir=state, repository=repo, listen_port=0, admin_token=TOKEN,
                        **{**FAST, **kw})  # fmt: skip
    running = await start(cfg, CollectorRegistry())
    try:
        yield running
    finally:
        await running.close()


async def exchange(
    port: int, data: bytes, *, pause_s: float = 0.0, chunk: int = 0, wait_s: float = 5.0
) -> tuple[bytes, float]:
    """Send `data` (in `chunk`-byte pieces `pause_s` apart when set), read until the server closes; (answer, seconds)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    t0 = time.monotonic()
    try:
        if chunk:
            for i in range(0, len(data), chunk):
                if reader.at_eof() or len(reader._buffer):  # the server answered: stop sending
                    break
                try:
                    writer.write(data[i : i + chunk])
                    await writer.drain()
                except ConnectionError:
                    break
                await asyncio.sleep(pause_s)
        else:
            writer.write(data)
        out = await asyncio.wait_for(reader.read(1 << 20), wait_s)
        while out and not out.endswith(b"}") and b"408" not in out[:20]:  # the rest of a split answer
            more = await asyncio.wait_for(reader.read(1 << 20), wait_s)
            if not more:
                break
            out += more
        return out, time.monotonic() - t0
    finally:
        writer.close()


async def closed_by_server(reader: asyncio.StreamReader, within_s: float) -> bool:
    try:
        return await asyncio.wait_for(reader.read(1), within_s) == b""
    except (TimeoutError, ConnectionError):
        return False


def infer_request(close: bool = True) -> bytes:
    body, _ = infer_body(np.random.default_rng(0))
    return (b"POST /v2/models/plain/versions/1/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + (b"Connection: close\r\n" if close else b"") + b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip


async def test_slow_and_silent_clients_get_408_or_are_closed(
    triton: EmbeddedTriton, repo: Path, tmp_path: Path
) -> None:
    async with sidecar(triton, repo, tmp_path / "s") as sc:
        # A header trickled one byte every 0.2 s: 408 at the header timeout, not 90 s later.
        out, took = await exchange(sc.port, infer_request(), chunk=1, pause_s=0.2, wait_s=0.05)
        assert out.startswith(b"HTTP/1.1 408") and b"headers did not arrive" in out, out[:200]
        assert took < 4.0, took
        # Headers complete, the body stops halfway (or a chunk of 2^64-1 bytes announced, then silence): 408.
        half = infer_request()[:-20]
        out, took = await exchange(sc.port, half, wait_s=4.0)
        assert out.startswith(b"HTTP/1.1 408") and b"body did not arrive" in out, out[:200]
        huge = b"POST /v2/models/plain/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffff\r\nab"
        out, _ = await exchange(sc.port, huge, wait_s=4.0)
        assert out.startswith(b"HTTP/1.1 408"), out[:200]
        # A connection that sends nothing is closed; one idle after its answer is closed after the keep-alive timeout.
        reader, writer = await asyncio.open_connection("127.0.0.1", sc.port)
        assert await closed_by_server(reader, 4.0)
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", sc.port)
        writer.write(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        t0 = time.monotonic()
        assert await closed_by_server(reader, 5.0)
        assert 1.0 < time.monotonic() - t0 < 4.0
        writer.close()
        # Meanwhile the client path serves as usual.
        out, _ = await exchange(sc.port, infer_request())
        assert out.startswith(b"HTTP/1.1 200"), out[:200]


async def test_oversized_heads_get_414_and_431_without_stalling_others(triton: EmbeddedTriton, repo: Path,
                                                                        tmp_path: Path) -> None:  # fmt: skip
    async with sidecar(triton, repo, tmp_path / "s") as sc:
        out, _ = await exchange(sc.port, b"GET /v2/models/" + b"m" * 10_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 414"), out[:200]
        many = b"".join(b"X-H%d: v\r\n" % i for i in range(150))
        out, _ = await exchange(sc.port, b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n" + many + b"\r\n")
        assert out.startswith(b"HTTP/1.1 431") and b"more than 100" in out, out[:200]
        # One 8 MB header: refused once the head passes its limit, long before it ends, while others are served.
        big = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (8 << 20) + b"\r\n\r\n"
        slow = asyncio.ensure_future(exchange(sc.port, big, chunk=64 << 10, pause_s=0.0, wait_s=5.0))
        ok, took = await exchange(sc.port, infer_request())
        assert ok.startswith(b"HTTP/1.1 200") and took < 1.0, (ok[:100], took)
        with contextlib.suppress(ConnectionError):
            out, _ = await slow
            assert out.startswith(b"HTTP/1.1 431"), out[:200]
        # Triton resets a head over about 8 KiB (a 502 for the client): refused with a 431 that says why instead,
        # and a request with big but allowed headers is served.
        over = infer_request().replace(b"Host: x\r\n", b"Host: x\r\nX-Over: " + b"b" * 9_000 + b"\r\n")
        out, _ = await exchange(sc.port, over)
        assert out.startswith(b"HTTP/1.1 431"), out[:200]
        fine = infer_request().replace(b"Host: x\r\n", b"Host: x\r\nX-Fine: " + b"b" * 3_000 + b"\r\n")
        out, _ = await exchange(sc.port, fine)
        assert out.startswith(b"HTTP/1.1 200"), out[:200]
        # Pipelined requests with big bodies, the last head split across reads: the head limit counts only the
        # head's own bytes.
        body, headers = infer_body(np.random.default_rng(1), binary=True, rows=20_000)
        head = (b"POST /v2/models/plain/versions/1/infer HTTP/1.1\r\nHost: x\r\n"
                + b"".join(b"%s: %s\r\n" % (k.encode(), v.encode()) for k, v in headers.items()))  # fmt: skip
        one = head + b"Content-Length: %d\r\n\r\n" % len(body) + body
        last = one.replace(b"Host: x\r\n", b"Host: x\r\nConnection: close\r\n")
        reader, writer = await asyncio.open_connection("127.0.0.1", sc.port)
        writer.write(one * 2 + last[:30])
        await writer.drain()
        await asyncio.sleep(0.3)
        writer.write(last[30:])
        got = b""
        while chunk := await asyncio.wait_for(reader.read(1 << 20), 10):
            got += chunk
        writer.close()
        assert got.count(b"HTTP/1.1 200 OK") == 3 and b"HTTP/1.1 431" not in got, got[:300]
        long_url = (
            b"GET /v2/health/live?" + b"q" * 4_000 + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        out, _ = await exchange(sc.port, long_url)
        assert out.startswith(b"HTTP/1.1 200"), out[:200]


async def test_connections_beyond_the_cap_get_503_and_health_checks_still_answer(triton: EmbeddedTriton, repo: Path,
                                                                                 tmp_path: Path) -> None:  # fmt: skip
    async with sidecar(triton, repo, tmp_path / "s", max_connections=10, header_timeout_s=30.0) as sc:
        idle = [await asyncio.open_connection("127.0.0.1", sc.port) for _ in range(10)]
        await asyncio.sleep(0.1)
        out, _ = await exchange(sc.port, infer_request())
        assert out.startswith(b"HTTP/1.1 503") and b"10 client connections" in out, out[:200]
        out, _ = await exchange(sc.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 200"), out[:200]
        for _, w in idle:
            w.close()
        await asyncio.sleep(0.2)
        out, _ = await exchange(sc.port, infer_request())
        assert out.startswith(b"HTTP/1.1 200"), out[:200]


async def test_closed_connections_are_freed_without_the_garbage_collector(triton: EmbeddedTriton, repo: Path,
                                                                          tmp_path: Path) -> None:  # fmt: skip
    async with sidecar(triton, repo, tmp_path / "s") as sc:
        gc.collect()
        gc.disable()
        try:
            refs = []
            refused = [
                b"GET /" + b"u" * 5000 + b" HTTP/1.1\r\n",
                b"GET /v2 HTTP/1.1\r\nX: " + b"h" * 9000,
                b"\x16\x03\x01 garbage\r\n\r\n",
            ]  # 414, 431, 400: refused from inside the parser
            for i in range(30):
                _reader, writer = await asyncio.open_connection("127.0.0.1", sc.port)
                writer.write(refused[i % 3] if i % 2 else infer_request(close=False)[: 40 + i])  # then gone
                await writer.drain()
                await asyncio.sleep(0.01)
                refs += [weakref.ref(c) for c in sc.front.connections if all(r() is not c for r in refs)]
                writer.close()
                await writer.wait_closed()
            await asyncio.sleep(0.3)
            assert len(refs) >= 30
            alive = sum(r() is not None for r in refs)
            assert alive == 0, f"{alive} of {len(refs)} closed connections still held"
        finally:
            gc.enable()


async def test_readyz_follows_triton_and_healthz_the_process(repo: Path, tmp_path: Path) -> None:
    own = EmbeddedTriton(TritonOptions(repository=repo, models=("plain",)), workdir=tmp_path / "t")
    own.start()
    try:
        async with sidecar(own, repo, tmp_path / "s") as sc:
            out, _ = await exchange(sc.port, b"GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert out.startswith(b"HTTP/1.1 200") and b'"ready": true' in out, out
            own.stop()
            # Answered from the last probe (one a second; a refused connection fails it at once), never waited on.
            deadline = time.monotonic() + 5.0
            while True:
                t0 = time.monotonic()
                out, _ = await exchange(
                    sc.port, b"GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
                )
                assert time.monotonic() - t0 < 1.0
                if out.startswith(b"HTTP/1.1 503") or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.1)
            assert out.startswith(b"HTTP/1.1 503") and b"health/live" in out, out
            out, _ = await exchange(sc.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert out.startswith(b"HTTP/1.1 200"), out
    finally:
        own.stop()


async def test_metric_series_stay_bounded_whatever_the_urls(
    triton: EmbeddedTriton, repo: Path, tmp_path: Path
) -> None:
    """Any URL can name a model or version: only those the repository holds get series of their own."""
    async with sidecar(triton, repo, tmp_path / "s") as sc:
        reader, writer = await asyncio.open_connection("127.0.0.1", sc.port)
        body, _ = infer_body(np.random.default_rng(0))
        names = [b"/v2/models/nosuch%d/infer" % i for i in range(300)]
        names += [b"/v2/models/plain/versions/%d/infer" % (100 + i) for i in range(200)]
        names += [b"/v2/models/plain/versions/1/infer"] * 5
        for path in names:
            writer.write(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                         % (path, len(body), body))  # fmt: skip
            await writer.drain()
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
        writer.close()
        out, _ = await exchange(
            sc.port, b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", wait_s=10
        )
    text = out.decode(errors="replace")
    series = [ln for ln in text.splitlines() if ln.startswith("tunegate_requests_total{")]
    assert len(series) <= 8, series[:20]
    assert any('model="other"' in ln for ln in series) and any('version="other"' in ln for ln in series), (
        series
    )
    assert any('model="plain"' in ln and 'version="1"' in ln and 'code="200"' in ln for ln in series), series
    assert len(out) < 1 << 20


def blocking_exchange(port: int, data: bytes) -> tuple[bytes, float]:
    """One request on a blocking socket, read until the server closes; (answer, seconds)."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(1 << 16):
            out += chunk
    return out, time.monotonic() - t0


class SlowCollector:
    """Test double at the registry seam: a collector that takes `seconds` to collect, as a huge registry would."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.calls = seconds, 0

    def collect(self) -> Iterator[Any]:
        self.calls += 1
        time.sleep(self.seconds)
        yield from ()


async def test_a_slow_scrape_never_holds_the_client_path(
    triton: EmbeddedTriton, repo: Path, tmp_path: Path
) -> None:
    """/metrics renders off the event loop, and scrapes during a rendering share it."""
    registry = CollectorRegistry()
    slow = SlowCollector(1.5)
    cfg = SidecarConfig(upstream=triton.http_url, state_dir=tmp_path / "s", repository=repo, listen_port=0,
                        admin_token=TOKEN, **FAST)  # fmt: skip
    sc = await start(cfg, registry)
    try:
        registry.register(slow)
        scrape = b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"

        def paced_infers() -> list[tuple[bytes, float]]:  # from a thread: this test shares the sidecar's loop
            time.sleep(0.3)  # the rendering has begun
            out = []
            for _ in range(5):
                out.append(blocking_exchange(sc.port, infer_request()))
                time.sleep(0.1)
            return out

        infers = asyncio.ensure_future(asyncio.to_thread(paced_infers))
        scrapes = [asyncio.ensure_future(exchange(sc.port, scrape, wait_s=10)) for _ in range(4)]
        for out, took in await infers:
            assert out.startswith(b"HTTP/1.1 200") and took < 0.5, (out[:100], took)
        answers = await asyncio.gather(*scrapes)
        assert all(a.startswith(b"HTTP/1.1 200") and b"tunegate_requests_total" in a for a, _ in answers)
        assert min(t for _, t in answers) > 1.0 and slow.calls == 1, ([t for _, t in answers], slow.calls)
    finally:
        await sc.close()


async def test_the_client_path_forwards_an_allowlist_of_tritons_api(triton: EmbeddedTriton, repo: Path,
                                                                    tmp_path: Path) -> None:  # fmt: skip
    """Inference, metadata, config, health, statistics and the repository index pass; what changes Triton's state
    (model control, logging, trace settings, shared memory) and the canary's shadow model get a 403."""
    async with sidecar(triton, repo, tmp_path / "s") as sc:

        async def status(method: bytes, path: bytes, body: bytes = b"") -> int:
            out, _ = await exchange(sc.port, b"%s %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: %d\r\n"
                                    b"Content-Type: application/json\r\n\r\n%s" % (method, path, len(body), body))  # fmt: skip
            return int(out.split(b" ", 2)[1])

        allowed = [(b"GET", b"/v2"), (b"GET", b"/v2/health/live"), (b"GET", b"/v2/health/ready"),
                   (b"GET", b"/v2/models/plain"), (b"GET", b"/v2/models/plain/versions/1"),
                   (b"GET", b"/v2/models/plain/config"), (b"GET", b"/v2/models/plain/ready"),
                   (b"GET", b"/v2/models/plain/versions/1/stats"), (b"GET", b"/v2/models/stats"),
                   (b"POST", b"/v2/repository/index")]  # fmt: skip
        for method, path in allowed:
            assert await status(method, path) == 200, path
        body, _ = infer_body(np.random.default_rng(0))
        assert await status(b"POST", b"/v2/models/plain/versions/1/infer", body) == 200
        refused = [(b"POST", b"/v2/repository/models/plain/unload"), (b"POST", b"/v2/repository/models/plain/load/"),
                   (b"POST", b"//v2/repository/models/plain/load"), (b"POST", b"/v2/logging"),
                   (b"GET", b"/v2/logging"), (b"POST", b"/v2/trace/setting"), (b"POST", b"/v2/models/plain/trace/setting"),
                   (b"POST", b"/v2/systemsharedmemory/region/r/register"), (b"GET", b"/v2/cudasharedmemory/status"),
                   (b"POST", b"/v2/models/plain__canary/versions/1/infer"), (b"GET", b"/v2/models/plain__canary"),
                   (b"POST", b"/v2/models/plain%5F%5Fcanary/infer"), (b"DELETE", b"/v2/models/plain")]  # fmt: skip
        for method, path in refused:
            got = await status(method, path, body if path.endswith(b"infer") else b"")
            assert got == 403 or (path.startswith(b"//") and got in (400, 404)), (method, path, got)


async def test_a_shape_the_body_cannot_hold_is_refused_before_triton(triton: EmbeddedTriton, repo: Path,
                                                                     tmp_path: Path) -> None:  # fmt: skip
    """A JSON shape of [2**40, 4] aborts Triton (it allocates first); the sidecar answers 400 and Triton keeps serving."""
    async with sidecar(triton, repo, tmp_path / "s") as sc:

        def infer(body: bytes, extra: bytes = b"") -> bytes:
            return (b"POST /v2/models/plain/versions/1/infer HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + extra
                    + b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip

        bomb = b'{"inputs":[{"name":"x","shape":[1099511627776,4],"datatype":"FP32","data":[1,2,3,4]}]}'
        out, _ = await exchange(sc.port, infer(bomb))
        assert out.startswith(b"HTTP/1.1 400") and b"4398046511104 elements" in out, out[:300]
        header = b'{"inputs":[{"name":"x","shape":[1073741824,4],"datatype":"FP32","parameters":{"binary_data_size":16}}]}'
        out, _ = await exchange(
            sc.port, infer(header + b"\0" * 16, b"Inference-Header-Content-Length: %d\r\n" % len(header))
        )
        assert out.startswith(b"HTTP/1.1 400") and b"elements" in out, out[:300]
        out, _ = await exchange(
            sc.port, infer(b'{"inputs":[{"name":"x","shape":[-3,4],"datatype":"FP32","data":[1]}]}')
        )
        assert out.startswith(b"HTTP/1.1 400") and b"negative" in out, out[:300]
        out, _ = await exchange(sc.port, infer_request())  # Triton is still up
        assert out.startswith(b"HTTP/1.1 200"), out[:300]


async def test_admin_api_gives_4xx_throttles_failed_tokens_and_can_listen_apart(triton: EmbeddedTriton, repo: Path,
                                                                                tmp_path: Path) -> None:  # fmt: skip
    def get(path: bytes, auth: bytes, extra: bytes = b"") -> bytes:
        return b"GET %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: %s\r\n%s\r\n" % (
            path,
            auth,
            extra,
        )

    def post(path: bytes, body: bytes) -> bytes:
        return (b"POST %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: Bearer %s\r\nContent-Length: %d\r\n\r\n%s"
                % (path, TOKEN.encode(), len(body), body))  # fmt: skip

    async with sidecar(triton, repo, tmp_path / "s") as sc:
        out, _ = await exchange(
            sc.port, get(b"/canary", b"Bearer \xff\xfe")
        )  # not UTF-8: a wrong token, not a 500
        assert out.startswith(b"HTTP/1.1 403"), out[:200]
        for body in (
            b"[" * 100_000,
            b"{",
            b"\xff",
            b'{"candidate": 2, "deadline_s": 1e308}',
            b'{"candidate": "2"}',
        ):
            out, _ = await exchange(sc.port, post(b"/canary/plain", body))
            assert out.startswith(b"HTTP/1.1 400") and b'"error"' in out, (body[:40], out[:300])
        # Wrong tokens from one address: 429 after ten, whatever X-Tunegate-Peer the client claims.
        codes = []
        for i in range(12):
            out, _ = await exchange(
                sc.port, get(b"/canary", b"Bearer wrong", b"X-Tunegate-Peer: 10.0.0.%d\r\n" % i)
            )
            codes.append(int(out.split(b" ", 2)[1]))
        assert codes[:9] == [403] * 9 and codes[-1] == 429, codes
        out, _ = await exchange(sc.port, get(b"/canary", b"Bearer " + TOKEN.encode()))
        assert out.startswith(b"HTTP/1.1 429") and b"Retry-After" in out, out[:300]  # the right one waits too
    # A separate admin listener: the client port never reaches the token check.
    with contextlib.closing(socket.socket()) as probe:
        probe.bind(("127.0.0.1", 0))
        admin_port = probe.getsockname()[1]
    async with sidecar(triton, repo, tmp_path / "s2", admin_listen=("127.0.0.1", admin_port)) as sc:
        out, _ = await exchange(sc.port, get(b"/canary", b"Bearer " + TOKEN.encode()))
        assert out.startswith(b"HTTP/1.1 404"), out[:200]
        out, _ = await exchange(admin_port, get(b"/canary", b"Bearer " + TOKEN.encode()))
        assert out.startswith(b"HTTP/1.1 200") and b"models" in out, out[:300]
        out, _ = await exchange(sc.port, get(b"/healthz", b"x"))
        assert out.startswith(b"HTTP/1.1 200"), out[:200]
