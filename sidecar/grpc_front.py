"""The gRPC client path: Triton's `inference.GRPCInferenceService` in front of Triton's gRPC port, feeding the
same canary as the HTTP path (grpcio's asyncio server and channel, the protos tritonclient ships).

Calls pass through as bytes (no decode) except where the sidecar must look: ModelInfer (an unversioned call is
routed to the live version; a sampled one is mirrored), ModelStreamInfer (routed, counted, never mirrored: its
models are often decoupled), and the per-model calls (the shadow model is refused). What the HTTP path refuses
is refused here with PERMISSION_DENIED: model control, shared-memory registration, trace and log settings.

Deadlines, metadata and status codes pass through: Triton's answer, or its error's code and details, go back as
Triton sent them. A call waits no longer than the client's deadline, nor than `upstream_timeout_s`.

The mirror: after the client's answer, a sampled ModelInfer is written as the HTTP request Triton reads the
same way (tunegate.grpc_codec) and offered to the canary with its answer, so one canary takes evidence from
both protocols (counted per protocol). Requests with shared-memory tensors cannot be replayed: passed through,
not mirrored, counted (`tunegate_mirror_skipped{reason="shared_memory"}`).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2 as pb

from sidecar.canary import CanaryManager
from sidecar.config import SidecarConfig
from sidecar.control import SHADOW_SUFFIX
from sidecar.metrics import SidecarMetrics
from sidecar.upstream import UpstreamResponse
from tunegate import grpc_codec
from tunegate.capture import CaptureRecord, CaptureWriter

LOG = logging.getLogger(__name__)
SERVICE = "inference.GRPCInferenceService"
# Passed through as bytes; the per-model ones are read for the model's name first.
PASSED = ("ServerLive", "ServerReady", "ServerMetadata", "RepositoryIndex")
NAMED: dict[str, Any] = {
    "ModelReady": pb.ModelReadyRequest,
    "ModelMetadata": pb.ModelMetadataRequest,
    "ModelConfig": pb.ModelConfigRequest,
    "ModelStatistics": pb.ModelStatisticsRequest,
}
REFUSED = {
    "RepositoryModelLoad": "model control goes through the sidecar's admin API (/canary), not through the proxy",
    "RepositoryModelUnload": "model control goes through the sidecar's admin API (/canary), not through the proxy",
}
REFUSED_OTHER = (
    "is not part of what the sidecar forwards (inference, metadata, config, readiness, statistics, health, "
    "repository index)"
)
METHODS = frozenset(m.name for m in pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods)
SHADOW_REFUSAL = "a canary's shadow model is the sidecar's own: it serves no client"
# Metadata the channel sets itself: not forwarded.
_OWN_METADATA = ("grpc-", ":")
_OWN_KEYS = frozenset({"user-agent", "te", "content-type", "host"})
MIRROR_HEADERS = "inference-header-content-length"
# gRPC status -> the HTTP status Triton answers for the same failure (the per-model request metrics).
HTTP_OF = {
    grpc.StatusCode.OK: 200,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 502,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.CANCELLED: 499,
}


class GrpcFront:
    """The gRPC server and its channel to Triton; `start()` listens, `close()` stops both."""

    def __init__(self, config: SidecarConfig, manager: CanaryManager, metrics: SidecarMetrics,
                 capture: CaptureWriter | None = None) -> None:  # fmt: skip
        if config.upstream_grpc is None or config.grpc_listen is None:
            raise ValueError("the gRPC front needs grpc_listen and upstream_grpc")
        self.config, self.manager, self.metrics, self.capture = config, manager, metrics, capture
        size = config.grpc_max_message_bytes
        options = [("grpc.max_receive_message_length", size), ("grpc.max_send_message_length", size)]
        self.channel = grpc.aio.insecure_channel(config.upstream_grpc, options=options)
        self._calls: dict[str, Any] = {}
        for method in (*PASSED, *NAMED, "ModelInfer"):
            self._calls[method] = self.channel.unary_unary(f"/{SERVICE}/{method}")
        self._stream = self.channel.stream_stream(f"/{SERVICE}/ModelStreamInfer")
        self.server = grpc.aio.server(
            options=options, maximum_concurrent_rpcs=config.grpc_max_concurrent_rpcs
        )
        self.server.add_generic_rpc_handlers((_Handler(self),))
        host, port = config.grpc_listen
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"cannot listen for gRPC on {host}:{port}")
        self._ids = random.Random()

    async def start(self) -> None:
        await self.server.start()

    async def close(self) -> None:
        await self.server.stop(grace=1.0)
        await self.channel.close()

    # -- helpers -----------------------------------------------------------------------------
    def _timeout(self, ctx: grpc.aio.ServicerContext) -> float:
        remaining = ctx.time_remaining()
        limit = self.config.upstream_timeout_s
        return limit if remaining is None else max(0.0, min(remaining, limit))

    @staticmethod
    def _metadata(ctx: grpc.aio.ServicerContext) -> tuple[tuple[str, str | bytes], ...]:
        return tuple(
            (k, v)
            for k, v in (ctx.invocation_metadata() or ())
            if not k.startswith(_OWN_METADATA) and k not in _OWN_KEYS
        )

    def _count(self, method: str, code: grpc.StatusCode) -> None:
        """One call's outcome; a method the service does not define counts as "other" (labels stay bounded)."""
        self.metrics.inc(self.metrics.grpc_requests, method if method in METHODS else "other", code.name)

    async def _forward(self, method: str, raw: bytes, ctx: grpc.aio.ServicerContext) -> bytes:
        """Triton's answer to `raw`, or its error passed on to the client with Triton's code and details."""
        try:
            resp: bytes = await self._calls[method](
                raw, timeout=self._timeout(ctx), metadata=self._metadata(ctx)
            )
        except grpc.aio.AioRpcError as exc:
            self._count(method, exc.code())
            await ctx.abort(exc.code(), exc.details() or "")
        self._count(method, grpc.StatusCode.OK)
        return resp

    async def _refuse(
        self, ctx: grpc.aio.ServicerContext, method: str, code: grpc.StatusCode, why: str
    ) -> None:
        self._count(method, code)
        await ctx.abort(code, why)

    # -- handlers ----------------------------------------------------------------------------
    async def passed(self, method: str, raw: bytes, ctx: grpc.aio.ServicerContext) -> bytes:
        return await self._forward(method, raw, ctx)

    async def named(self, method: str, raw: bytes, ctx: grpc.aio.ServicerContext) -> bytes:
        try:
            name = NAMED[method].FromString(raw).name
        except DecodeError as exc:
            await self._refuse(
                ctx, method, grpc.StatusCode.INVALID_ARGUMENT, f"malformed {method} request: {exc}"
            )
        if name.endswith(SHADOW_SUFFIX):
            await self._refuse(ctx, method, grpc.StatusCode.PERMISSION_DENIED, SHADOW_REFUSAL)
        return await self._forward(method, raw, ctx)

    async def refused(self, method: str, raw: bytes, ctx: grpc.aio.ServicerContext) -> bytes:
        why = REFUSED.get(method, f"{method} {REFUSED_OTHER}")
        if method not in METHODS:
            why = f"{SERVICE} defines no such method"
        await self._refuse(ctx, method, grpc.StatusCode.PERMISSION_DENIED, why)
        raise AssertionError("unreachable")  # ctx.abort raises

    def _route(self, req: pb.ModelInferRequest) -> tuple[str, bool]:
        """Pin an unversioned request to the live version; returns (the version routed to, whether pinned)."""
        if req.model_version:
            return req.model_version, False
        live = self.manager.live_version(req.model_name)
        if live is None:
            return "", False
        req.model_version = str(live)
        return req.model_version, True

    async def infer(self, method: str, raw: bytes, ctx: grpc.aio.ServicerContext) -> bytes:
        try:
            req = pb.ModelInferRequest.FromString(raw)
        except DecodeError as exc:
            await self._refuse(
                ctx, method, grpc.StatusCode.INVALID_ARGUMENT, f"malformed ModelInfer request: {exc}"
            )
        model = req.model_name
        if model.endswith(SHADOW_SUFFIX):
            await self._refuse(ctx, method, grpc.StatusCode.PERMISSION_DENIED, SHADOW_REFUSAL)
        refused = shape_refusal(req, len(raw))
        if refused:
            await self._refuse(ctx, method, grpc.StatusCode.INVALID_ARGUMENT, refused)
        unversioned = not req.model_version
        routed, pinned = self._route(req)
        fwd = req.SerializeToString() if pinned else raw
        key = (model, routed)
        in_flight = self.manager.in_flight
        in_flight[key] += 1  # a promotion waits for these before it unloads the version
        t0 = time.perf_counter()
        try:
            resp: bytes = await self._calls[method](
                fwd, timeout=self._timeout(ctx), metadata=self._metadata(ctx)
            )
        except grpc.aio.AioRpcError as exc:
            self._count(method, exc.code())
            self.metrics.observe_request(model, routed, "primary", HTTP_OF.get(exc.code(), 500), None)
            await ctx.abort(exc.code(), exc.details() or "")
        finally:
            left = in_flight[key] - 1
            if left:
                in_flight[key] = left
            else:
                del in_flight[key]
        seconds = time.perf_counter() - t0
        self._count(method, grpc.StatusCode.OK)
        self.metrics.observe_request(model, routed, "primary", 200, seconds)
        mirror = unversioned and model in self.manager.canaries
        capture = self.capture is not None and self.manager.sample(self.config.capture_rate)
        if mirror or capture:
            # After the answer is on its way: the mirror offer and the capture run on the loop's next turn.
            asyncio.get_running_loop().call_soon(
                self._after, req, resp, seconds, mirror, capture, unversioned
            )
        return resp

    def _after(self, req: pb.ModelInferRequest, raw_resp: bytes, seconds: float, mirror: bool, capture: bool,
               unversioned: bool) -> None:  # fmt: skip
        answered(self.manager, self.capture, self._ids, req, raw_resp, seconds, mirror, capture, unversioned)

    async def stream(
        self, requests: AsyncIterator[bytes], ctx: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        """ModelStreamInfer: each request routed as ModelInfer is, the stream passed through, nothing mirrored."""
        method = "ModelStreamInfer"
        call = self._stream(timeout=ctx.time_remaining(), metadata=self._metadata(ctx))
        refused: list[str] = []

        async def pump() -> None:
            try:
                async for raw in requests:
                    try:
                        req = pb.ModelInferRequest.FromString(raw)
                    except DecodeError as exc:
                        refused.append(f"malformed ModelInfer request in the stream: {exc}")
                        break
                    if req.model_name.endswith(SHADOW_SUFFIX):
                        refused.append(SHADOW_REFUSAL)
                        break
                    _, pinned = self._route(req)
                    self._count(method, grpc.StatusCode.OK)
                    await call.write(req.SerializeToString() if pinned else raw)
            finally:
                if refused:
                    call.cancel()
                else:
                    await call.done_writing()

        writer = asyncio.ensure_future(pump())
        try:
            async for resp in call:
                yield resp
        except grpc.aio.AioRpcError as exc:
            if not refused:
                self._count(method, exc.code())
                await ctx.abort(exc.code(), exc.details() or "")
        except asyncio.CancelledError:
            if not refused:
                raise
        finally:
            writer.cancel()
        if refused:
            await self._refuse(ctx, method, grpc.StatusCode.PERMISSION_DENIED if refused[0] == SHADOW_REFUSAL
                               else grpc.StatusCode.INVALID_ARGUMENT, refused[0])  # fmt: skip


def answered(manager: CanaryManager, capture_writer: CaptureWriter | None, ids: random.Random,
             req: pb.ModelInferRequest, raw_resp: bytes, seconds: float, mirror: bool, capture: bool,
             unversioned: bool, presampled: bool = False) -> None:  # fmt: skip
    """What follows an answered ModelInfer, off the client path: offer it to the canary (`mirror`) and capture it
    (`capture`). `presampled`: the compiled front has already counted its latency and sampled it."""
    request_id = f"{ids.getrandbits(128):032x}"  # names it in exemplars and captures
    if mirror:
        _offer(manager, req, raw_resp, seconds, request_id, presampled)
    if capture and capture_writer is not None and not grpc_codec.uses_shared_memory(req):
        try:
            body, hl = grpc_codec.request_to_http(req)
        except grpc_codec.GrpcCodecError:
            return
        version = None if unversioned else req.model_version
        capture_writer.write(CaptureRecord(ts=time.time(), model=req.model_name, version=version, body=body,
                                           header_length=hl, request_id=request_id, protocol="grpc"))  # fmt: skip


def _offer(manager: CanaryManager, req: pb.ModelInferRequest, raw_resp: bytes, seconds: float, request_id: str,
           presampled: bool) -> None:  # fmt: skip
    """Offer one answered gRPC inference to the canary, written as its HTTP equivalent: only once the canary has
    admitted it (sampled, the pair free), since writing that form costs more than the call's own pass-through."""
    canary = None
    try:
        model = req.model_name
        canary = manager.admit(model, seconds, presampled)
        if canary is None:
            return
        if grpc_codec.uses_shared_memory(req):
            manager.skipped(canary, "shared_memory")
            return
        body, hl = grpc_codec.request_to_http(req)
        answer, answer_hl = grpc_codec.response_to_http(pb.ModelInferResponse.FromString(raw_resp))
        primary = UpstreamResponse(200, b"OK", [(MIRROR_HEADERS.encode(), b"%d" % answer_hl)], answer)
        headers = [(b"content-type", b"application/octet-stream"), (MIRROR_HEADERS.encode(), b"%d" % hl)]
        manager.offer(model, body, headers, primary, seconds, request_id, protocol="grpc", admitted=True)
    except (grpc_codec.GrpcCodecError, DecodeError) as exc:
        if canary is not None:
            manager.skipped(canary, "untranslatable")
        LOG.debug("gRPC request not mirrored: %s", exc)
    except Exception:  # a bug here must never reach the client path
        LOG.exception("gRPC mirror offer failed")
        if canary is not None:
            manager.skipped(canary, "internal")


def shape_refusal(req: pb.ModelInferRequest, size: int) -> str:
    """Why an inference request cannot be what it says ("" when it can): an input whose shape holds more
    elements than the message's bytes could carry (each element takes at least one byte). Triton aborts on
    some of them, allocating first. Inputs in shared memory are not checked."""
    for t in req.inputs:
        if grpc_codec.SHARED_MEMORY_KEYS.intersection(t.parameters):
            continue
        n = 1
        for d in t.shape:
            if d < 0:
                return f"input {t.name!r}: shape {list(t.shape)} has a negative dimension"
            n *= d
        if n > size:
            return (
                f"input {t.name!r} of shape {list(t.shape)} has {n} elements, more than the {size} bytes of the "
                "request can hold"
            )
    return ""


Unary = Callable[[str, bytes, grpc.aio.ServicerContext], Awaitable[bytes]]


class _Handler(grpc.GenericRpcHandler):  # type: ignore[misc]  # grpc ships no type hints
    """Every method of the inference service, by name: passed, read first, or refused; other services unknown."""

    def __init__(self, front: GrpcFront) -> None:
        self.front = front
        self.handlers = {m: self._make(m) for m in METHODS}  # made once: service() runs for every call
        self.other = self._make("other")

    def _make(self, method: str) -> grpc.RpcMethodHandler:
        f = self.front
        if method == "ModelStreamInfer":
            return grpc.stream_stream_rpc_method_handler(f.stream)
        fn: Unary = (
            f.infer if method == "ModelInfer" else f.named if method in NAMED else f.passed if method in PASSED
            else f.refused
        )  # fmt: skip

        async def call(raw: bytes, ctx: grpc.aio.ServicerContext) -> bytes:
            return await fn(method, raw, ctx)

        return grpc.unary_unary_rpc_method_handler(call)

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        service, _, method = details.method.lstrip("/").partition("/")
        if service != SERVICE:
            return None  # UNIMPLEMENTED
        return self.handlers.get(method, self.other)
