"""The client path: KServe v2 HTTP routes forwarded to Triton unchanged, with unversioned infers pinned to the live version.

Nothing is decoded here. The response goes back as Triton sent it (status, body, headers); the
mirror is offered the request only after the response is in hand, and never delays or fails it.
"""

from __future__ import annotations

import logging
import re
import time
import uuid

import aiohttp
from aiohttp import web

from sidecar.canary import CanaryManager
from sidecar.config import SidecarConfig
from sidecar.metrics import SidecarMetrics
from sidecar.mirror import Response, payload
from tunegate import codec
from tunegate.capture import CaptureRecord, CaptureWriter

LOG = logging.getLogger(__name__)

CONFIG = web.AppKey("config", SidecarConfig)
SESSION = web.AppKey("session", aiohttp.ClientSession)
MANAGER = web.AppKey("manager", CanaryManager)
METRICS = web.AppKey("metrics", SidecarMetrics)
CAPTURE = web.AppKey("capture", CaptureWriter)

HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
    "transfer-encoding", "upgrade", "host", "content-length",
})  # fmt: skip
# Model control stays with the sidecar: a client loading the candidate under the model's own name
# would hand it to every unversioned caller before promotion.
CONTROL_PATH = re.compile(r"^/v2/repository/models/[^/]+/(load|unload)$")


def _forward_headers(headers: aiohttp.typedefs.LooseHeaders) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in HOP_BY_HOP}  # type: ignore[union-attr]


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


async def _forward(request: web.Request, path: str, body: bytes | None) -> tuple[Response, float] | web.Response:
    cfg, session = request.app[CONFIG], request.app[SESSION]
    url = f"{cfg.upstream_base}{path}"
    t0 = time.perf_counter()
    try:
        if request.query_string:
            url = f"{url}?{request.query_string}"
        async with session.request(request.method, url, data=payload(body),
                                   headers=_forward_headers(request.headers)) as resp:  # fmt: skip
            out = Response(resp.status, await resp.read(), _forward_headers(resp.headers))
    except TimeoutError:
        return _error(504, f"upstream Triton did not answer within {cfg.upstream_timeout_s:g}s")
    except aiohttp.ClientError as exc:
        return _error(502, f"upstream Triton unreachable: {exc.__class__.__name__}")
    return out, time.perf_counter() - t0


async def infer(request: web.Request) -> web.StreamResponse:
    model = request.match_info["model"]
    version = request.match_info.get("version")
    manager, metrics = request.app[MANAGER], request.app[METRICS]
    body = await request.read()
    routed = version
    if version is None:
        live = manager.live_version(model)
        routed = None if live is None else str(live)
    path = f"/v2/models/{model}" + (f"/versions/{routed}" if routed else "") + "/infer"
    key = (model, routed or "")
    manager.in_flight[key] += 1  # a promotion waits for these before it unloads the version
    try:
        got = await _forward(request, path, body)
    finally:
        manager.in_flight[key] -= 1
    if isinstance(got, web.Response):
        metrics.observe_request(model, routed or "", "primary", got.status, None)
        return got
    resp, seconds = got
    metrics.observe_request(model, routed or "", "primary", resp.status, seconds)
    request_id = None
    if version is None and model in manager.canaries:
        request_id = uuid.uuid4().hex  # names this request in exemplars and captures
        manager.offer(model, body, request.headers, resp, seconds, request_id)
    capture = request.app.get(CAPTURE)
    if capture is not None and resp.status == 200 and manager.sample(request.app[CONFIG].capture_rate):
        _capture(request, capture, model, version, body, request_id or uuid.uuid4().hex)
    return web.Response(status=resp.status, body=resp.body, headers=resp.headers)


def _capture(request: web.Request, capture: CaptureWriter, model: str, version: str | None, body: bytes,
             request_id: str) -> None:  # fmt: skip
    try:
        hl = codec.parse_header_length(request.headers.get(codec.HEADER))
    except codec.CodecError:
        return
    if request.headers.get("Content-Encoding"):
        return  # captures hold plain bodies that Locust can replay as they are
    rec = CaptureRecord(ts=time.time(), model=model, version=version, body=body, header_length=hl,
                        request_id=request_id)  # fmt: skip
    # One buffered line write, rate-capped by the writer (no fsync): cheap enough for the loop.
    capture.write(rec)


async def passthrough(request: web.Request) -> web.StreamResponse:
    if CONTROL_PATH.match(request.path):
        return _error(403, "model control goes through the sidecar's admin API (/canary), not through the proxy")
    body = await request.read() if request.can_read_body else None
    got = await _forward(request, request.path, body)
    if isinstance(got, web.Response):
        return got
    resp, _ = got
    return web.Response(status=resp.status, body=resp.body, headers=resp.headers)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v2/models/{model}/infer", infer)
    app.router.add_post("/v2/models/{model}/versions/{version}/infer", infer)
    app.router.add_route("*", "/v2", passthrough)
    app.router.add_route("*", "/v2/{tail:.*}", passthrough)
