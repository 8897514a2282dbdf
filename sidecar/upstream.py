"""A keep-alive HTTP/1.1 connection pool to one upstream (Triton, or the sidecar's own admin app), bytes in and out.

The client path and the mirror send every request through this pool. It is an asyncio Protocol with
llhttp (httptools) parsing the response: a proxied request costs a few tens of microseconds of Python,
where aiohttp's client took several hundred (profiled in session 1; `benchmarks/sidecar_vs_nginx.py`).
Nothing is decoded: the response comes back as status, raw header pairs and the body bytes.

A request that fails on a reused connection before any response byte arrived (the upstream closed an
idle keep-alive connection) is retried once on a fresh one; every other failure is an UpstreamError.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Sequence

import httptools

Headers = Sequence[tuple[bytes, bytes]]
COALESCE_BYTES = 256 << 10  # bodies up to this size are sent in one write with the head (copying is cheaper)


def find_header(headers: Headers, name: bytes) -> bytes | None:
    """The first header called `name` (lower-case), or None: raw pairs are searched, not converted."""
    for k, v in headers:
        if k.lower() == name:
            return v
    return None


class UpstreamError(Exception):
    """The upstream could not be reached, broke the connection or sent something that is not HTTP."""


class UpstreamTimeout(UpstreamError):
    """The upstream did not answer within the request's timeout."""


@dataclasses.dataclass(slots=True)
class UpstreamResponse:
    status: int
    reason: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes


class _Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[tuple[UpstreamResponse, bool]] | None = None
        self.lost = False
        self.got_data = False
        self._reason = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []

    # -- asyncio.Protocol -------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.got_data = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.fail(UpstreamError(f"the upstream sent a malformed response: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.fail(ConnectionResetError("the upstream closed the connection"))

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
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result((resp, self.parser.should_keep_alive()))

    # -- pool side --------------------------------------------------------------------------------
    def fail(self, exc: Exception) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)

    def close(self) -> None:
        self.lost = True
        if self.transport is not None:
            self.transport.abort()


class UpstreamPool:
    """Up to `limit` keep-alive connections to host:port (or a unix socket); requests wait for a free one."""

    def __init__(self, host: str, port: int, *, limit: int = 256, timeout_s: float = 60.0,
                 unix_path: str | None = None) -> None:  # fmt: skip
        self.host, self.port, self.unix_path = host, port, unix_path
        self.host_header = b"localhost" if unix_path else f"{host}:{port}".encode()
        self.timeout_s = timeout_s
        self._idle: list[_Connection] = []
        self._slots = asyncio.Semaphore(limit)
        self._closed = False

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            if self.unix_path is not None:
                _, conn = await loop.create_unix_connection(_Connection, self.unix_path)
            else:
                _, conn = await loop.create_connection(_Connection, self.host, self.port)
        except OSError as exc:
            raise UpstreamError(f"unreachable: {exc.__class__.__name__}: {exc.strerror or exc}") from exc
        return conn

    async def request(self, method: bytes, target: bytes, headers: Headers, body: bytes | None,
                      timeout_s: float | None = None) -> UpstreamResponse:  # fmt: skip
        """Send one request; `headers` must not hold Host, Content-Length or hop-by-hop headers."""
        if self._closed:
            raise UpstreamError("the sidecar is shutting down")
        parts = [method, b" ", target, b" HTTP/1.1\r\nHost: ", self.host_header, b"\r\n"]
        for name, value in headers:
            parts += (name, b": ", value, b"\r\n")
        if body is not None or method in (b"POST", b"PUT", b"PATCH"):
            parts += (b"Content-Length: ", str(len(body or b"")).encode(), b"\r\n")
        parts.append(b"\r\n")
        head = b"".join(parts)
        loop = asyncio.get_running_loop()
        async with self._slots:
            for attempt in (0, 1):
                conn = None
                while self._idle:
                    conn = self._idle.pop()
                    if not conn.lost:
                        break
                    conn = None
                reused = conn is not None
                if conn is None:
                    conn = await self._connect()
                waiter: asyncio.Future[tuple[UpstreamResponse, bool]] = loop.create_future()
                conn.waiter, conn.got_data = waiter, False
                assert conn.transport is not None
                if body and len(body) <= COALESCE_BYTES:
                    conn.transport.write(head + body)  # one send, one segment for Triton to read
                else:
                    conn.transport.write(head)
                    if body:
                        conn.transport.write(body)
                timer = loop.call_later(timeout_s or self.timeout_s, conn.fail, UpstreamTimeout("timeout"))
                try:
                    resp, keep_alive = await waiter
                except UpstreamTimeout:
                    conn.close()
                    raise
                except ConnectionResetError as exc:
                    conn.close()
                    if reused and not conn.got_data and attempt == 0:
                        continue  # an idle connection the upstream had closed: once more, on a new one
                    raise UpstreamError(f"unreachable: {exc}") from exc
                except BaseException:  # cancelled, or a malformed response: the connection is not reusable
                    conn.close()
                    raise
                finally:
                    timer.cancel()
                if keep_alive and not conn.lost and not self._closed:
                    self._idle.append(conn)
                else:
                    conn.close()
                return resp
        raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises

    def close(self) -> None:
        self._closed = True
        for conn in self._idle:
            with contextlib.suppress(Exception):
                conn.close()
        self._idle.clear()
