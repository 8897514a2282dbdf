"""The sidecar's aiohttp application: client path, admin API, /metrics, and the resources behind them.

Every long-lived resource lives in `cleanup_ctx`: the upstream session, the canary manager (which
resumes state on start), the judge ticker and the capture writer are created, yielded and closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from sidecar.canary import CanaryError, CanaryManager
from sidecar.config import SidecarConfig
from sidecar.judge import PIN, PROMOTE
from sidecar.metrics import SidecarMetrics
from sidecar.proxy import CAPTURE, CONFIG, MANAGER, METRICS, SESSION, add_routes
from sidecar.state import StateStore
from tunegate.capture import CaptureWriter

LOG = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _authorized(handler: Handler) -> Handler:
    async def wrapped(request: web.Request) -> web.StreamResponse:
        token = request.app[CONFIG].admin_token
        if token is None:
            return web.json_response({"error": "the admin API is disabled (no admin token configured)"}, status=403)
        auth = request.headers.get("Authorization", "")
        if not auth.startswith("Bearer "):
            return web.json_response({"error": "missing bearer token"}, status=401,
                                     headers={"WWW-Authenticate": "Bearer"})  # fmt: skip
        if not hmac.compare_digest(auth[7:].strip().encode(), token.encode()):
            return web.json_response({"error": "wrong token"}, status=403)
        try:
            return await handler(request)
        except CanaryError as exc:
            return web.json_response({"error": str(exc)}, status=exc.status)

    return wrapped


@_authorized
async def canary_list(request: web.Request) -> web.StreamResponse:
    return web.json_response(request.app[MANAGER].all_status())


@_authorized
async def canary_get(request: web.Request) -> web.StreamResponse:
    return web.json_response(request.app[MANAGER].status(request.match_info["model"]))


@_authorized
async def canary_start(request: web.Request) -> web.StreamResponse:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return web.json_response({"error": "the body must be a JSON object"}, status=400)
    if not isinstance(body, dict):
        return web.json_response({"error": "the body must be a JSON object"}, status=400)
    status = await request.app[MANAGER].start(request.match_info["model"], body)
    return web.json_response(status, status=201)


@_authorized
async def canary_promote(request: web.Request) -> web.StreamResponse:
    return web.json_response(await request.app[MANAGER].decide_manually(request.match_info["model"], PROMOTE))


@_authorized
async def canary_pin(request: web.Request) -> web.StreamResponse:
    return web.json_response(await request.app[MANAGER].decide_manually(request.match_info["model"], PIN))


@_authorized
async def decisions(request: web.Request) -> web.StreamResponse:
    model = request.match_info.get("model") or request.query.get("model")
    return web.json_response({"decisions": await request.app[MANAGER].decisions(model)})


async def metrics_handler(request: web.Request) -> web.StreamResponse:
    body = generate_latest(request.app[METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def healthz(request: web.Request) -> web.StreamResponse:
    return web.json_response({"ok": True})


async def _resources(app: web.Application) -> AsyncIterator[None]:
    cfg = app[CONFIG]
    # Proxy-correct: bodies pass through compressed as they came, no cookies, no redirects.
    connector = aiohttp.TCPConnector(limit=cfg.upstream_connections, ttl_dns_cache=300)
    session = aiohttp.ClientSession(
        connector=connector,
        auto_decompress=False,
        cookie_jar=aiohttp.DummyCookieJar(),
        timeout=aiohttp.ClientTimeout(total=cfg.upstream_timeout_s),
        skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"),
    )
    app[SESSION] = session
    store = StateStore(cfg.state_dir)
    manager = CanaryManager(cfg, store, session, app[METRICS])
    app[MANAGER] = manager
    if cfg.capture_dir is not None and cfg.capture_rate > 0:
        app[CAPTURE] = CaptureWriter(
            cfg.capture_dir, max_file_bytes=cfg.capture_max_file_bytes, max_files=cfg.capture_max_files,
            max_per_second=cfg.capture_max_per_second, max_body_bytes=cfg.max_body_bytes,
        )  # fmt: skip
    try:
        await manager.resume()
        yield
    finally:
        await manager.close()
        await session.close()
        capture = app.get(CAPTURE)
        if capture is not None:
            capture.close()


async def _ticker(app: web.Application) -> AsyncIterator[None]:
    async def loop() -> None:
        while True:
            await asyncio.sleep(app[CONFIG].judge_interval_s)
            try:
                await app[MANAGER].tick()
            except Exception:  # one bad tick must not stop judging
                LOG.exception("judge tick failed")

    task = asyncio.get_running_loop().create_task(loop())
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def build_app(config: SidecarConfig, registry: CollectorRegistry | None = None) -> web.Application:
    app = web.Application(client_max_size=config.max_body_bytes)
    app[CONFIG] = config
    app[METRICS] = SidecarMetrics(registry if registry is not None else CollectorRegistry())
    app.cleanup_ctx.append(_resources)
    app.cleanup_ctx.append(_ticker)
    add_routes(app)
    app.router.add_get("/canary", canary_list)
    app.router.add_get("/canary/{model}", canary_get)
    app.router.add_post("/canary/{model}", canary_start)
    app.router.add_post("/canary/{model}/promote", canary_promote)
    app.router.add_post("/canary/{model}/pin", canary_pin)
    app.router.add_get("/decisions", decisions)
    app.router.add_get("/canary/{model}/decisions", decisions)
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/healthz", healthz)
    return app


async def serve(config: SidecarConfig, ready: Callable[[int], Any] | None = None) -> None:
    """Run until cancelled; `ready(port)` is called once listening (port 0 picks a free one)."""
    runner = web.AppRunner(build_app(config), access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, config.listen_host, config.listen_port, backlog=1024)
        await site.start()
        sockets = getattr(site._server, "sockets", None) or []
        port = sockets[0].getsockname()[1] if sockets else config.listen_port
        if ready is not None:
            ready(port)
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
