"""The client path: an HTTP/1.1 server that forwards KServe v2 requests to Triton, unversioned infers pinned to the live version.

Clients connect here. Each request is parsed by llhttp (httptools) and its body forwarded, unchanged,
over a pooled keep-alive connection (sidecar/upstream.py). Triton's answer goes back as Triton sent it
(status, body, headers; only hop-by-hop headers are rewritten): nothing is decoded. The mirror is
offered the request only after the client's answer is written, and never delays or fails it.

Everything on this path is callbacks, not coroutines: no task, future or semaphore per request.
The client connection hands a parsed request to `Front.dispatch`, the pool calls back with Triton's
answer, and `_ClientConnection.answered` writes it and moves on to the next pipelined request.

Routing: `POST /v2/models/{m}/infer` goes to `/versions/{live}` while the sidecar holds state for `m`
(explicitly versioned requests pass untouched); every other `/v2` path passes through, except model
control (403); all else (`/canary`, `/decisions`, `/metrics`, `/healthz`) goes to the aiohttp admin
application (sidecar/app.py) over a private unix socket.

Why not aiohttp here: aiohttp's server and client together cost about 1 ms of CPU per proxied request
on the 2-core development machine, which held the sidecar to 0.29x nginx's throughput at c=1. With
coroutines per request this module reached about 0.75x; a bare uvloop + httptools proxy (nothing but
forwarding) matched nginx at c=1, which is what the callback style recovers most of.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import http
import json
import logging
import math
import random
import re
import resource
import time
from collections.abc import Callable
from urllib.parse import unquote

import httptools
from aiohttp import web

from sidecar.canary import CanaryManager
from sidecar.config import SidecarConfig
from sidecar.control import SHADOW_SUFFIX
from sidecar.metrics import SidecarMetrics
from sidecar.upstream import UpstreamError, UpstreamPool, UpstreamResponse, UpstreamTimeout, find_header
from tunegate import codec
from tunegate.capture import CaptureRecord, CaptureWriter

LOG = logging.getLogger(__name__)

CONFIG = web.AppKey("config", SidecarConfig)
UPSTREAM = web.AppKey("upstream", UpstreamPool)
MANAGER = web.AppKey("manager", CanaryManager)
METRICS = web.AppKey("metrics", SidecarMetrics)
CAPTURE = web.AppKey("capture", CaptureWriter)

HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te", b"trailers",
    b"transfer-encoding", b"upgrade", b"host", b"content-length", b"expect",
})  # fmt: skip
INFER_PATH = re.compile(rb"^/v2/models/([^/]+)(?:/versions/([^/]+))?/infer$")
# What clients may ask Triton for: inference, metadata, config, readiness, statistics, health and the repository
# index. The rest of Triton's API changes server state (model control, logging and trace settings, shared
# memory registration) and stays with operators: model control with the sidecar, since a client loading the
# candidate under the model's own name would hand it to every unversioned caller before promotion.
_MODEL = rb"/v2/models/(?P<model>[^/]+)(?:/versions/[0-9]+)?"
SHADOW_SUFFIX_BYTES = SHADOW_SUFFIX.encode()
HEADER_LENGTH = codec.HEADER.lower().encode()
# Triton answers 500 to an infer body it cannot parse as JSON, or whose JSON lacks or misspells a field of the
# request format ("Unable to parse 'inputs'", 'data', 'binary_data_size', ...: HTTPAPIServer's request parsing);
# the sidecar answers it as the 400 it is, Triton's message kept.
TRITON_PARSE_ERRORS = (b'{"error":"failed to parse the request JSON buffer', b'{"error":"Unable to parse ')
CLIENT_READ = re.compile(
    rb"^(?:/v2|/v2/health/(?:live|ready)|/v2/models/stats|" + _MODEL + rb"(?:/ready|/config|/stats)?)$"
)
CLIENT_POST = re.compile(rb"^(?:/v2/repository/index|" + _MODEL + rb"/(?:infer|generate|generate_stream))$")
LINGER_S = 2.0  # after answering a request the connection cannot go on from, input is discarded this long
SMALL_BODY = 64 << 10  # response bodies up to this size are joined with the head
MAX_PIPELINED = 16  # requests parsed ahead on one connection before reading pauses
HEALTH_RESERVE = 16  # connections above max_connections that may still ask /healthz and /readyz
HEALTH_PATHS = frozenset({b"/healthz", b"/readyz"})
ADMIN_PREFIXES = (b"/canary", b"/decisions")  # with a separate admin listener, the client port refuses these
PEER_HEADER = "X-Tunegate-Peer"  # the client's address, as the front tells the admin application
_PEER = PEER_HEADER.lower().encode()
SWEEP_S = 0.5  # how often client connections' timeouts are checked (one timer for all of them)
# What a connection waits for: the start of a request (idle), the rest of its head, its body, or our answer.
IDLE, HEAD, BODY, ANSWERING = range(4)


def _reason(status: int) -> bytes:
    try:
        return http.HTTPStatus(status).phrase.encode()
    except ValueError:
        return b"Unknown"


def render(status: int, reason: bytes, headers: list[tuple[bytes, bytes]], body: bytes, keep_alive: bool,
           head_only: bool = False) -> list[bytes]:  # fmt: skip
    """Response bytes for the client: headers as given, less hop-by-hop ones, with our own framing."""
    parts = [b"HTTP/1.1 %d %s\r\n" % (status, reason or _reason(status))]
    for name, value in headers:
        if name.lower() not in HOP_BY_HOP:
            parts += (name, b": ", value, b"\r\n")
    parts.append(b"Content-Length: %d\r\n" % len(body))
    if not keep_alive:
        parts.append(b"Connection: close\r\n")
    parts.append(b"\r\n")
    if head_only or not body:
        return [b"".join(parts)]
    if len(body) <= SMALL_BODY:  # one buffer, one send: copying a small body costs less than a writev
        parts.append(body)
        return [b"".join(parts)]
    return [b"".join(parts), body]


def error(status: int, message: str, keep_alive: bool = True) -> list[bytes]:
    body = json.dumps({"error": message}).encode()
    return render(status, b"", [(b"Content-Type", b"application/json")], body, keep_alive)


@dataclasses.dataclass(slots=True)
class Request:
    method: bytes
    url: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    keep_alive: bool

    def forward_headers(self) -> list[tuple[bytes, bytes]]:
        return [(k, v) for k, v in self.headers if k.lower() not in HOP_BY_HOP]


class _Reject(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _ClientConnection(asyncio.Protocol):
    """One client connection: parse requests, answer them in order (pipelining included)."""

    def __init__(self, front: Front) -> None:
        self.front = front
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.queue: collections.deque[Request | list[bytes]] = collections.deque()
        self.busy = False
        self.current: Request | None = None
        self.closing = False
        self.eof_sent = False
        self.paused = False
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []
        self._size = 0
        self._head_size = 0  # bytes received while the current request's head is incomplete
        self._began = False  # a request began in the read being parsed
        self._header_bytes = 0
        self.phase = IDLE
        self.deadline: float | None = (
            time.monotonic() + front.config.header_timeout_s
        )  # the first request must begin by then
        self.over_cap = False  # accepted beyond max_connections: health checks only
        self.half_closed = False  # the client sent EOF: close once the answers owed are written

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        front = self.front
        n = len(front.connections)
        if n >= front.max_connections + HEALTH_RESERVE:
            front.metrics.inc(front.metrics.client_refused, "connections")
            self.closing = True
            transport.close()
            return
        self.over_cap = n >= front.max_connections
        front.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        self.queue.clear()  # nobody is left to answer; a request at Triton finishes and is dropped
        self.front.connections.discard(self)
        # The parser calls back into this object: without this the pair is a cycle that only a full garbage
        # collection frees (the sidecar freezes and raises the collector's thresholds), with its buffers.
        self.parser = None  # type: ignore[assignment]
        self._headers, self._body, self.current = [], [], None

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return
        try:
            self._began = False
            self.parser.feed_data(data)
            # Bytes of a head that began in an earlier read (a read that began it may hold earlier requests too,
            # and is bounded by the read size): a huge header is refused as it grows, not once it is whole.
            if self.phase == HEAD and not self._began:
                self._head_size += len(data)
                limit = self.front.config.max_url_bytes + self.front.config.max_header_bytes
                if self._head_size > limit and not self.closing:
                    self._fail(431, f"request head is over {limit} bytes")
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__cause__ or exc.__context__
            if isinstance(cause, _Reject):
                status, message = cause.status, str(cause)
            else:
                LOG.exception("request parsing failed")
                status, message = 500, "internal error"
            # The callback's exception holds its traceback, whose frames lead back here: a local naming it would
            # make a cycle through this connection that only a full garbage collection frees.
            del cause
            self._fail(status, message)
        except httptools.HttpParserUpgrade:
            self._fail(400, "protocol upgrades are not supported")
        except httptools.HttpParserError as exc:
            self._fail(400, f"malformed HTTP request: {exc}")

    def eof_received(self) -> bool:
        """The client half-closed: it still gets the answers it is owed, then the connection closes."""
        if self.busy or self.queue:
            self.half_closed = True
            return True  # keep the transport open for writing
        return False  # nothing owed: close

    def _fail(self, status: int, message: str) -> None:
        """Answer with an error after the responses already owed, then close: the stream cannot be trusted."""
        self.queue.append(error(status, message, keep_alive=False))
        self.closing = True
        assert self.transport is not None
        self.transport.pause_reading()
        self._next()

    # -- httptools callbacks ----------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._url, self._headers, self._body, self._size = b"", [], [], 0
        self._head_size = self._header_bytes = 0
        self._began = True
        self.phase = HEAD
        self.deadline = time.monotonic() + self.front.config.header_timeout_s

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > self.front.config.max_url_bytes:
            raise _Reject(414, f"URL is over the limit of {self.front.config.max_url_bytes} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))
        self._header_bytes += len(name) + len(value)
        cfg = self.front.config
        if len(self._headers) > cfg.max_header_count:
            raise _Reject(431, f"more than {cfg.max_header_count} request headers")
        if self._header_bytes > cfg.max_header_bytes:
            raise _Reject(431, f"request headers are over the limit of {cfg.max_header_bytes} bytes")

    def on_headers_complete(self) -> None:
        self.phase = BODY
        self.deadline = time.monotonic() + self.front.config.body_timeout_s
        limit = self.front.config.max_body_bytes
        expect = False
        for name, value in self._headers:
            low = name.lower()
            if low == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    raise _Reject(400, "Content-Length is not a number") from None
                if length > limit:
                    raise _Reject(413, f"request body of {length} bytes is over the limit of {limit}")
            elif low == b"expect" and value.lower() == b"100-continue":
                expect = True
        if expect and self.transport is not None:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self.deadline = time.monotonic() + self.front.config.body_timeout_s
        self._size += len(body)
        if self._size > self.front.config.max_body_bytes:  # chunked bodies have no Content-Length
            raise _Reject(413, f"request body is over the limit of {self.front.config.max_body_bytes} bytes")
        self._body.append(body)

    def on_message_complete(self) -> None:
        self.phase, self.deadline = ANSWERING, None
        if self.closing:  # parsed after an answer that closes the connection: never sent on
            return
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        method = self.parser.get_method()
        self.queue.append(Request(method, self._url, self._headers, body, self.parser.should_keep_alive()))
        if len(self.queue) >= MAX_PIPELINED and self.transport is not None and not self.paused:
            self.paused = True
            self.transport.pause_reading()
        self._next()

    # -- answering --------------------------------------------------------------------------------
    def _next(self) -> None:
        if self.busy or not self.queue:
            return
        item = self.queue.popleft()
        if isinstance(item, list):  # an error answer, then close
            self._write(item, close=True)
            return
        self.busy = True
        self.current = item
        try:
            self.front.dispatch(item, self)
        except Exception:  # a bug must cost this request, not the connection's others or the process
            LOG.exception("handling %s %r failed", item.method, item.url)
            self.answered(item, error(500, "internal sidecar error", keep_alive=False), close=True)

    def answered(self, req: Request, out: list[bytes], close: bool = False) -> None:
        """The answer to `req` (the request being handled): write it, then go on with the next one.

        `close`: the answer says "Connection: close" (an internal error), whatever the request asked for.
        """
        if self.current is not req:
            return  # answered already (a failure path answered first): never twice
        self.current = None
        self.busy = False
        self._write(out, close=close or not req.keep_alive)
        if self.half_closed and not self.queue and self.transport is not None:
            self.closing = True
            self.transport.close()  # after the buffered answer is written
            return
        if self.phase == ANSWERING and not self.queue:
            self.phase, self.deadline = IDLE, time.monotonic() + self.front.config.keepalive_timeout_s
        if (
            self.paused
            and len(self.queue) < MAX_PIPELINED // 2
            and not self.closing
            and self.transport is not None
        ):
            self.paused = False
            self.transport.resume_reading()
        self._next()

    def expire(self, now: float) -> None:
        """From the sweep: a client that is too slow with its request gets a 408, an idle one is closed."""
        if self.deadline is None or now < self.deadline or self.busy or self.queue or self.closing:
            return
        self.deadline = None
        if self.phase == IDLE:
            if self.transport is not None:
                self.transport.close()
            return
        what = "headers" if self.phase == HEAD else "body"
        limit = self.front.config.header_timeout_s if self.phase == HEAD else self.front.config.body_timeout_s
        self.front.metrics.inc(self.front.metrics.client_refused, "timeout")
        self._fail(408, f"request {what} did not arrive within {limit:g}s")

    def _write(self, parts: list[bytes], close: bool) -> None:
        transport = self.transport
        if transport is None or transport.is_closing() or self.eof_sent:
            return
        transport.writelines(parts) if len(parts) > 1 else transport.write(parts[0])
        if close:
            self.closing = True
            self.queue.clear()
            if not transport.can_write_eof():
                transport.close()
                return
            # Lingering close: closing with unread request bytes makes the kernel send a reset, which can
            # destroy the answer (a 413) before the client reads it. Send FIN, discard input, close later.
            transport.write_eof()
            self.eof_sent = True
            transport.resume_reading()
            asyncio.get_running_loop().call_later(LINGER_S, transport.close)


class Front:
    """The client-facing server: holds the pools and the application whose manager, metrics and capture it uses."""

    def __init__(self, app: web.Application, admin: UpstreamPool) -> None:
        self.app = app
        self.config = app[CONFIG]
        self.triton = app[UPSTREAM]
        self.admin = admin
        self.manager = app[MANAGER]
        self.metrics = app[METRICS]
        self.capture = app.get(CAPTURE)
        self.connections: set[_ClientConnection] = set()
        self._ids = random.Random()  # seeded from the OS once
        self.max_connections = min(
            self.config.max_connections, open_files_room(self.config.upstream_connections)
        )
        self._sweeper: asyncio.TimerHandle | None = None

    def start_sweeping(self) -> None:
        """One timer for every client connection's timeouts (a timer per connection and phase cost more)."""
        loop = asyncio.get_running_loop()

        def sweep() -> None:
            now = time.monotonic()
            for conn in list(self.connections):
                conn.expire(now)
            self._sweeper = loop.call_later(SWEEP_S, sweep)

        self._sweeper = loop.call_later(SWEEP_S, sweep)

    def request_id(self) -> str:
        """32 hex digits naming a mirrored or captured request: unique enough for exemplars, and without the
        getrandom syscall uuid4 makes per call (3% of the sidecar's samples when mirroring everything)."""
        return f"{self._ids.getrandbits(128):032x}"

    def protocol(self) -> Callable[[], asyncio.Protocol]:
        return lambda: _ClientConnection(self)

    def dispatch(self, req: Request, conn: _ClientConnection) -> None:
        """Route one request; `conn.answered(req, ...)` is called exactly once, now or when upstream answers."""
        path, _, _query = req.url.partition(b"?")
        if conn.over_cap and path not in HEALTH_PATHS:
            self.metrics.inc(self.metrics.client_refused, "connections")
            conn.answered(req, error(503, f"the sidecar serves {self.max_connections} client connections at most; "
                                          "try again later", keep_alive=False), close=True)  # fmt: skip
            return
        if req.method == b"POST":
            m = INFER_PATH.match(path)
            if m is not None:
                if (
                    m.group(1).endswith(SHADOW_SUFFIX_BYTES)
                    or b"%" in m.group(1)
                    and client_refusal(req.method, path)
                ):
                    conn.answered(req, error(403, "a canary's shadow model is the sidecar's own: it serves no client",
                                             req.keep_alive))  # fmt: skip
                    return
                self.infer(req, m, conn)
                return
        if path == b"/v2" or path.startswith(b"/v2/"):
            refused = client_refusal(req.method, path)
            if refused:
                conn.answered(req, error(403, refused, req.keep_alive))
                return
            self.passthrough(self.triton, req, conn)
            return
        if self.config.admin_listen is not None and path.startswith(ADMIN_PREFIXES):
            conn.answered(
                req, error(404, "not found: the admin API listens on an address of its own", req.keep_alive)
            )
            return
        peer = (
            b""
            if conn.transport is None
            else str((conn.transport.get_extra_info("peername") or ("",))[0]).encode()
        )
        headers = [(k, v) for k, v in req.forward_headers() if k.lower() != _PEER] + [
            (PEER_HEADER.encode(), peer)
        ]
        self.passthrough(self.admin, req, conn, headers)

    def _upstream_error(self, exc: BaseException, req: Request, conn: _ClientConnection) -> None:
        """Answer `req` for an upstream failure: 504 for a timeout, 502 for the rest (a bug: 500, and close)."""
        if isinstance(exc, UpstreamTimeout):
            conn.answered(req, error(504, f"upstream Triton did not answer within {self.config.upstream_timeout_s:g}s",
                                     req.keep_alive))  # fmt: skip
        elif isinstance(exc, UpstreamError):
            conn.answered(req, error(502, f"upstream Triton {exc}", req.keep_alive))
        else:
            LOG.error("upstream request failed unexpectedly: %r", exc)
            conn.answered(req, error(500, "internal sidecar error", keep_alive=False), close=True)

    def passthrough(self, pool: UpstreamPool, req: Request, conn: _ClientConnection,
                    headers: list[tuple[bytes, bytes]] | None = None) -> None:  # fmt: skip
        head = (
            req.method == b"HEAD"
        )  # asked upstream as GET: the response parser cannot tell a HEAD answer's end

        def done(resp: UpstreamResponse | None, exc: BaseException | None) -> None:
            if resp is None:
                self._upstream_error(exc or UpstreamError("no answer"), req, conn)
                return
            conn.answered(
                req, render(resp.status, resp.reason, resp.headers, resp.body, req.keep_alive, head_only=head)
            )

        body = req.body if req.body or req.method in (b"POST", b"PUT") else None
        pool.send(b"GET" if head else req.method, req.url, req.forward_headers() if headers is None else headers, body,
                  done)  # fmt: skip

    def infer(self, req: Request, m: re.Match[bytes], conn: _ClientConnection) -> None:
        raw_hl = find_header(req.headers, HEADER_LENGTH)
        try:
            hl = None if raw_hl is None else int(raw_hl)
        except ValueError:
            hl = None  # Triton answers what is wrong with it
        refused = shape_refusal(req.body, hl)
        if refused:
            conn.answered(req, error(400, refused, req.keep_alive))
            return
        model = unquote(m.group(1).decode("latin-1"))
        version = m.group(2)
        target = req.url
        routed = version.decode("latin-1") if version is not None else ""
        if version is None:
            live = self.manager.live_version(model)
            if live is not None:
                routed = str(live)
                _, sep, query = req.url.partition(b"?")
                target = b"/v2/models/%s/versions/%d/infer%s%s" % (m.group(1), live, sep, query)
        key = (model, routed)
        in_flight = self.manager.in_flight
        in_flight[key] += 1  # a promotion waits for these before it unloads the version
        t0 = time.perf_counter()

        def done(resp: UpstreamResponse | None, exc: BaseException | None) -> None:
            left = in_flight[key] - 1
            if left:
                in_flight[key] = left
            else:  # any URL names a model and version: keep no key per name once nothing is in flight
                del in_flight[key]
            if resp is None:
                timeout = isinstance(exc, UpstreamTimeout)
                self._upstream_error(exc or UpstreamError("no answer"), req, conn)
                self.metrics.observe_request(model, routed, "primary", 504 if timeout else 502, None)
                return
            seconds = time.perf_counter() - t0
            if resp.status == 500 and resp.body.startswith(TRITON_PARSE_ERRORS):
                # the client's body, not the server, is at fault
                resp.status, resp.reason = 400, b"Bad Request"
            # The client's answer goes out first; bookkeeping and the mirror offer follow it.
            conn.answered(req, render(resp.status, resp.reason, resp.headers, resp.body, req.keep_alive))
            self.metrics.observe_request(model, routed, "primary", resp.status, seconds)
            if resp.status != 200:
                return
            request_id = None
            if version is None and model in self.manager.canaries:
                request_id = self.request_id()  # names this request in exemplars and captures
                self.manager.offer(model, req.body, req.headers, resp, seconds, request_id)
            if self.capture is not None and self.manager.sample(self.config.capture_rate):
                self._capture(
                    req, model, routed if version is not None else None, request_id or self.request_id()
                )

        self.triton.send(b"POST", target, req.forward_headers(), req.body, done)

    def _capture(self, req: Request, model: str, version: str | None, request_id: str) -> None:
        if find_header(req.headers, b"content-encoding"):
            return  # captures hold plain bodies that Locust can replay as they are
        raw_hl = find_header(req.headers, codec.HEADER.lower().encode())
        try:
            hl = codec.parse_header_length(None if raw_hl is None else raw_hl.decode("latin-1"))
        except codec.CodecError:
            return
        rec = CaptureRecord(ts=time.time(), model=model, version=version, body=req.body, header_length=hl,
                            request_id=request_id)  # fmt: skip
        # One buffered line write, rate-capped by the writer (no fsync): cheap enough for the loop.
        assert self.capture is not None
        self.capture.write(rec)

    def close_connections(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.close()


def open_files_room(upstream_connections: int) -> int:
    """Client connections the open-files limit leaves room for, after the upstream pool, the health-check reserve
    and files; the soft limit is raised to the hard one first (as nginx's worker_rlimit_nofile would be set)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        want = 1 << 16 if hard == resource.RLIM_INFINITY else hard
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    return max(1, soft - upstream_connections - HEALTH_RESERVE - 64)


def client_refusal(method: bytes, path: bytes) -> str:
    """Why the client path refuses a /v2 request ("" when it forwards it): see CLIENT_READ and CLIENT_POST."""
    m = CLIENT_POST if method == b"POST" else CLIENT_READ if method in (b"GET", b"HEAD") else None
    found = m.match(path) if m is not None else None
    if found is None:
        if path.startswith(b"/v2/repository/models/"):
            return "model control goes through the sidecar's admin API (/canary), not through the proxy"
        return (
            f"{method.decode('latin-1')} {path.decode('latin-1')[:200]} is not part of what the sidecar forwards "
            "(inference, metadata, config, readiness, statistics, health, repository index)"
        )
    model = found.group("model")
    if model is not None and unquote(model.decode("latin-1")).endswith(SHADOW_SUFFIX):
        return "a canary's shadow model is the sidecar's own: it serves no client"
    return ""


def shape_refusal(body: bytes, header_length: int | None) -> str:
    """Why an infer request cannot be what it says ("" when it can): an input whose shape holds more elements than
    the request's bytes. Every element takes at least one byte (a JSON number and its comma, a BOOL or INT8,
    a BYTES element's 4-byte length), so such a request is malformed; Triton itself aborts on some of them
    (a JSON shape of [2**40, 4] makes it allocate first). Inputs in shared memory are not checked.

    Byte searches only (the JSON header is not parsed): a JSON body is scanned for each `"shape"`; a binary
    one only in its JSON header.
    """
    head = body if header_length is None else body[:header_length]
    if b'"shape"' not in head or b"shared_memory_region" in head:
        return ""
    at = 0
    while (at := head.find(b'"shape"', at)) >= 0:
        at += 7
        lo = head.find(b"[", at)
        hi = head.find(b"]", lo)
        if lo < 0 or hi < 0 or head[at:lo].strip(b" \t\r\n:"):
            continue  # "shape" as some other value; Triton answers what it is
        text = head[lo : hi + 1].decode("latin-1")[:100]
        inner = head[lo + 1 : hi].strip()
        try:
            dims = [int(d) for d in inner.split(b",")] if inner else []
        except ValueError:
            return f"shape {text} is not a list of integers"
        if any(d < 0 for d in dims):
            return f"shape {text} has a negative dimension"
        n = math.prod(dims)
        if n > len(body):
            return f"an input of shape {text} has {n} elements, more than the {len(body)} bytes of the request can hold"
    return ""
