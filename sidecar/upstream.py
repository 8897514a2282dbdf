"""A keep-alive HTTP/1.1 connection pool to one upstream (Triton, or the sidecar's own admin app), bytes in and out.

The client path and the mirror send every request through this pool. It is an asyncio Protocol with
llhttp (httptools) parsing the response: a proxied request costs a few tens of microseconds of Python,
where aiohttp's client took several hundred (py-spy profiles; `benchmarks/sidecar_vs_nginx.py`).
Nothing is decoded: the response comes back as status, raw header pairs and the body bytes.

`send()` is callback-based (no task, future or semaphore per request: the client path's cost at c=1
is mostly such machinery); `request()` is the awaitable form for the mirror and the admin calls.
Requests beyond `limit` connections wait in a FIFO queue for the next connection that frees up.

A request that fails on a reused connection before any response byte arrived (the upstream closed an
idle keep-alive connection) is retried once on a fresh one; every other failure is an UpstreamError.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
from collections.abc import Callable, Sequence

import httptools

from tunegate.errors import TunegateError

LOG = logging.getLogger(__name__)
Headers = Sequence[tuple[bytes, bytes]]
COALESCE_BYTES = 256 << 10  # bodies up to this size are sent in one write with the head (copying is cheaper)


def find_header(headers: Headers, name: bytes) -> bytes | None:
    """The first header called `name` (lower-case), or None: raw pairs are searched, not converted."""
    for k, v in headers:
        if k.lower() == name:
            return v
    return None


class UpstreamError(TunegateError):
    """The upstream could not be reached, broke the connection or sent something that is not HTTP."""


class UpstreamTimeout(UpstreamError):
    """The upstream did not answer within the request's timeout."""


@dataclasses.dataclass(slots=True)
class UpstreamResponse:
    status: int
    reason: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes


Done = Callable[["UpstreamResponse | None", "BaseException | None"], None]


def _deliver(ex: _Exchange, resp: UpstreamResponse | None, exc: BaseException | None) -> None:
    try:
        ex.done(resp, exc)
    except Exception:  # a bug in a callback must not break a connection's parser or the pool
        LOG.exception("an upstream callback failed")


@dataclasses.dataclass(slots=True)
class _Exchange:
    """One request on its way: the bytes to send, where the answer goes, and how it has fared so far."""

    head: bytes
    body: bytes | None
    done: Done
    timeout_s: float
    retried: bool = False
    timer: asyncio.TimerHandle | None = None  # the deadline, from send(): queueing and connecting count too
    conn: _Connection | None = None  # the connection it is on, once sent
    connecting: asyncio.Task[None] | None = None
    finished: bool = False


class _Connection(asyncio.Protocol):
    def __init__(self, pool: UpstreamPool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.exchange: _Exchange | None = None
        self.reused = False
        self.lost = False
        self.got_data = False
        self._reason = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []

    # -- asyncio.Protocol -------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.pool._conns.add(self)

    def eof_received(self) -> bool:
        self.lost = True  # closed by the upstream: never handed out again, even before connection_lost
        return False

    def data_received(self, data: bytes) -> None:
        self.got_data = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.close()
            self.fail(UpstreamError(f"the upstream sent a malformed response: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.pool._conns.discard(self)
        ex = self.exchange
        if ex is None:
            return
        if self.reused and not self.got_data and not ex.retried:
            # An idle keep-alive connection the upstream had closed: once more, on a new connection.
            self.exchange, ex.conn = None, None
            self.pool._release(self, None)
            ex.retried = True
            self.pool._dispatch(ex)
            return
        self.fail(UpstreamError("unreachable: the upstream closed the connection"))

    # -- httptools callbacks ----------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._reason, self._headers, self._body = b"", [], []

    def on_status(self, status: bytes) -> None:
        self._reason += status

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        resp = UpstreamResponse(self.parser.get_status_code(), self._reason, self._headers, body)
        if not self.parser.should_keep_alive():
            self.close()
        self._finish(resp, None)

    # -- pool side --------------------------------------------------------------------------------
    def start(self, ex: _Exchange, reused: bool) -> None:
        self.exchange, self.reused, self.got_data = ex, reused, False
        ex.conn = self
        assert self.transport is not None
        if ex.body and len(ex.body) <= COALESCE_BYTES:
            self.transport.write(ex.head + ex.body)  # one send, one segment for Triton to read
        else:
            self.transport.write(ex.head)
            if ex.body:
                self.transport.write(ex.body)

    def timed_out(self) -> None:
        self.close()
        self.fail(UpstreamTimeout("timeout"))

    def fail(self, exc: BaseException) -> None:
        self.close()
        self._finish(None, exc)

    def _finish(self, resp: UpstreamResponse | None, exc: BaseException | None) -> None:
        ex, self.exchange = self.exchange, None
        if ex is None:
            return
        ex.conn, ex.finished = None, True
        if ex.timer is not None:
            ex.timer.cancel()
        self.pool._release(self, ex)
        _deliver(ex, resp, exc)

    def close(self) -> None:
        self.lost = True
        if self.transport is not None:
            self.transport.abort()


class UpstreamPool:
    """Up to `limit` keep-alive connections to host:port (or a unix socket); requests beyond wait in order."""

    def __init__(self, host: str, port: int, *, limit: int = 256, timeout_s: float = 60.0,
                 unix_path: str | None = None) -> None:  # fmt: skip
        self.host, self.port, self.unix_path = host, port, unix_path
        self.host_header = b"localhost" if unix_path else f"{host}:{port}".encode()
        self.timeout_s = timeout_s
        self.limit = limit
        self._idle: list[_Connection] = []
        self._conns: set[_Connection] = set()  # every open connection, to abort at close()
        self._open = 0  # connections busy or being opened
        self._waiting: collections.deque[_Exchange] = collections.deque()
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    def send(self, method: bytes, target: bytes, headers: Headers, body: bytes | None, done: Done,
             timeout_s: float | None = None) -> None:  # fmt: skip
        """Send one request; `done(response, None)` or `done(None, UpstreamError)` is called once, later.

        `headers` must not hold Host, Content-Length or hop-by-hop headers.
        """
        parts = [method, b" ", target, b" HTTP/1.1\r\nHost: ", self.host_header, b"\r\n"]
        for name, value in headers:
            parts += (name, b": ", value, b"\r\n")
        if body is not None or method in (b"POST", b"PUT", b"PATCH"):
            parts += (b"Content-Length: ", str(len(body or b"")).encode(), b"\r\n")
        parts.append(b"\r\n")
        ex = _Exchange(b"".join(parts), body, done, timeout_s or self.timeout_s)
        ex.timer = self.loop.call_later(ex.timeout_s, self._expire, ex)
        self._dispatch(ex)

    async def request(self, method: bytes, target: bytes, headers: Headers, body: bytes | None,
                      timeout_s: float | None = None) -> UpstreamResponse:  # fmt: skip
        """`send()` as a coroutine: the response, or UpstreamTimeout / UpstreamError raised."""
        fut: asyncio.Future[UpstreamResponse] = self.loop.create_future()

        def done(resp: UpstreamResponse | None, exc: BaseException | None) -> None:
            if fut.done():
                return
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(resp)  # type: ignore[arg-type]

        self.send(method, target, headers, body, done, timeout_s)
        return await fut

    def _dispatch(self, ex: _Exchange) -> None:
        if self._closed:
            self.loop.call_soon(self._end, ex, UpstreamError("the sidecar is shutting down"))
            return
        while self._idle and not ex.retried:  # a retry goes out on a new connection
            conn = self._idle.pop()
            if not conn.lost:
                self._open += 1
                conn.start(ex, reused=True)
                return
        if self._open >= self.limit:
            self._waiting.append(ex)
            return
        self._open += 1
        ex.connecting = self.loop.create_task(self._connect_and_start(ex))

    async def _connect_and_start(self, ex: _Exchange) -> None:
        try:
            if self.unix_path is not None:
                _, conn = await self.loop.create_unix_connection(lambda: _Connection(self), self.unix_path)
            else:
                _, conn = await self.loop.create_connection(lambda: _Connection(self), self.host, self.port)
        except asyncio.CancelledError:  # its deadline passed while connecting (already answered)
            self._open -= 1
            self._next_waiting()
            return
        except OSError as exc:
            ex.connecting = None
            self._open -= 1
            self._next_waiting()
            self._end(ex, UpstreamError(f"unreachable: {exc.__class__.__name__}: {exc.strerror or exc}"))
            return
        ex.connecting = None
        if self._closed:
            conn.close()
            self._open -= 1
            self._end(ex, UpstreamError("the sidecar is shutting down"))
            return
        if ex.finished:  # expired as the connection came up: the connection serves the next request instead
            self._release(conn, None)
            return
        conn.start(ex, reused=False)

    def _expire(self, ex: _Exchange) -> None:
        """The exchange's deadline: fail it wherever it is (on a connection, connecting or queued)."""
        if ex.finished:
            return
        if ex.conn is not None:
            ex.conn.timed_out()
            return
        if ex.connecting is not None:
            ex.connecting.cancel()
        with contextlib.suppress(ValueError):
            self._waiting.remove(ex)
        self._end(ex, UpstreamTimeout("timeout"))

    @staticmethod
    def _end(ex: _Exchange, exc: BaseException) -> None:
        """Fail an exchange that is not on a connection (queued, connecting, or refused), once."""
        if ex.finished:
            return
        ex.finished = True
        if ex.timer is not None:
            ex.timer.cancel()
        _deliver(ex, None, exc)

    def _release(self, conn: _Connection, ex: _Exchange | None) -> None:
        """`conn` finished its exchange: reuse it for the next waiting request, keep it idle, or drop it."""
        self._open -= 1
        if self._closed:
            conn.close()
            return
        if not conn.lost:
            if self._waiting:
                self._open += 1
                conn.start(self._waiting.popleft(), reused=True)
                return
            self._idle.append(conn)
            return
        self._next_waiting()

    def _next_waiting(self) -> None:
        if self._waiting and self._open < self.limit:
            self._dispatch(self._waiting.popleft())

    def close(self) -> None:
        """Abort every connection; requests in flight or waiting fail with UpstreamError."""
        self._closed = True
        for conn in list(self._conns):
            with contextlib.suppress(Exception):
                conn.close()
        self._idle.clear()
        while self._waiting:
            self.loop.call_soon(
                self._end, self._waiting.popleft(), UpstreamError("the sidecar is shutting down")
            )
