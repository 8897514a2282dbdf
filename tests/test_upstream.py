"""The upstream pool on its own, against small in-process fake upstreams (a seam: a server that closes idle
connections, stalls, answers garbage or counts its concurrent requests). Real Triton is in test_sidecar.py."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from sidecar.upstream import UpstreamError, UpstreamPool, UpstreamTimeout

pytestmark = pytest.mark.asyncio

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def fake_upstream(handler: Handler) -> AsyncIterator[int]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await handler(reader, writer)
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 2)


async def read_request(reader: asyncio.StreamReader) -> bytes | None:
    """One request's head and body (Content-Length framing only), or None at EOF."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head + await reader.readexactly(length)


def ok(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


async def test_a_closed_idle_connection_is_retried_once_on_a_new_one() -> None:
    """Keep-alive servers close idle connections, possibly just as a request goes out on one: that request is
    sent again on a new connection instead of failing the client."""
    connections = 0

    async def closes_after_one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        n = connections
        if await read_request(reader) is not None:
            writer.write(ok(b"conn%d" % n))
            await writer.drain()
        if n == 1:
            await read_request(reader)  # the next request arrives... and the connection closes unanswered

    async with fake_upstream(closes_after_one) as port:
        pool = UpstreamPool("127.0.0.1", port, timeout_s=5)
        first = await pool.request(b"GET", b"/a", [], None)
        second = await pool.request(b"POST", b"/b", [], b"x")
        pool.close()
    assert (first.body, second.body, connections) == (b"conn1", b"conn2", 2)


async def test_a_silent_upstream_times_out_and_the_next_request_still_works() -> None:
    calls = 0

    async def first_stalls(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal calls
        while await read_request(reader) is not None:
            calls += 1
            if calls == 1:
                await asyncio.sleep(5)
            writer.write(ok(b"late" if calls == 1 else b"fine"))
            await writer.drain()

    async with fake_upstream(first_stalls) as port:
        pool = UpstreamPool("127.0.0.1", port, timeout_s=5)
        with pytest.raises(UpstreamTimeout):
            await pool.request(b"GET", b"/", [], None, timeout_s=0.2)
        assert (await pool.request(b"GET", b"/", [], None)).body == b"fine"  # on a fresh connection
        pool.close()


async def test_garbage_from_upstream_is_an_upstream_error() -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"SPDY/9 what\r\n\r\n")
        await writer.drain()

    async with fake_upstream(garbage) as port:
        pool = UpstreamPool("127.0.0.1", port, timeout_s=5)
        with pytest.raises(UpstreamError, match="malformed"):
            await pool.request(b"GET", b"/", [], None)
        pool.close()


async def test_requests_over_the_limit_wait_and_all_complete() -> None:
    active = peak = 0

    async def slow_echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal active, peak
        while (req := await read_request(reader)) is not None:
            active += 1
            peak = max(peak, active)
            await asyncio.sleep(0.02)
            active -= 1
            writer.write(ok(req.split(b" ", 2)[1]))
            await writer.drain()

    async with fake_upstream(slow_echo) as port:
        pool = UpstreamPool("127.0.0.1", port, limit=3, timeout_s=5)
        got = await asyncio.gather(*(pool.request(b"GET", b"/%d" % i, [], None) for i in range(20)))
        pool.close()
    assert [r.body for r in got] == [b"/%d" % i for i in range(20)]
    assert peak == 3


async def test_an_unreachable_upstream_and_a_closed_pool_are_errors() -> None:
    async def never(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(10)

    async with fake_upstream(never) as port:
        pass  # closed again: nothing listens on `port` now
    pool = UpstreamPool("127.0.0.1", port, timeout_s=5)
    with pytest.raises(UpstreamError, match="unreachable"):
        await pool.request(b"GET", b"/", [], None)
    async with fake_upstream(never) as port:
        pool = UpstreamPool("127.0.0.1", port, timeout_s=5)
        pending = asyncio.ensure_future(pool.request(b"GET", b"/", [], None))
        await asyncio.sleep(0.1)
        pool.close()  # the request in flight fails now, not at its timeout
        with pytest.raises(UpstreamError):
            await asyncio.wait_for(pending, 2)
        with pytest.raises(UpstreamError, match="shutting down"):
            await pool.request(b"GET", b"/", [], None)


async def test_the_deadline_counts_from_send_even_while_queued() -> None:
    """With every connection busy, a request waits in the queue: its timeout runs there too (a 504, not a hang)."""

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await read_request(reader) is not None:
            await asyncio.sleep(0.6)
            writer.write(ok(b"slow"))
            await writer.drain()

    async with fake_upstream(slow) as port:
        pool = UpstreamPool("127.0.0.1", port, limit=1, timeout_s=5)
        first = asyncio.ensure_future(pool.request(b"GET", b"/1", [], None))
        await asyncio.sleep(0.05)
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(UpstreamTimeout):
            await pool.request(b"GET", b"/2", [], None, timeout_s=0.2)
        assert asyncio.get_running_loop().time() - t0 < 0.5  # not after the first request's 0.6 s
        assert (await first).body == b"slow"
        assert (await pool.request(b"GET", b"/3", [], None)).body == b"slow"  # the queue is not stuck
        pool.close()
