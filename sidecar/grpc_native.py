"""The compiled gRPC front (`tunegate-grpc-front`, native/grpc_front/front.cc): the gRPC client path outside Python.

The Python front (sidecar.grpc_front) carries every call through grpcio's asyncio server and channel, which costs
several times the CPU of a proxy per call. The compiled front serves the same service with the same rules (calls
passed as bytes, the shadow model and model control refused, shape refusals, unversioned ModelInfer pinned to the
live version, deadlines, metadata, status codes, message and concurrency limits) on libgrpc++, and the sidecar
keeps the canary: this object starts the front as its child and, over a Unix socket,

- sends it the routing table whenever it changes: each model's live version, whether a canary takes evidence
  and at which sample rate (the mirror budget's), and the capture rate;
- takes from it the sampled, answered ModelInfer calls (request and answer bytes, client latency) and offers them
  to the canary and the capture exactly as the Python front does (sidecar.grpc_front.answered);
- applies its counts every 200 ms: `tunegate_grpc_requests_total`, the request counts and latency histogram, the
  canary budgets' client-latency windows, offers dropped because the sidecar fell behind (`mirror_dropped` full);
- asks it, while a promotion drains, how many calls it has in flight on the version being replaced;
- tells it when a shadow-paired canary's pair is out and back, so that it offers no call the canary would not
  admit (a hint: the canary admits or refuses every offer itself).

The front never waits for the sidecar: offers queue in the front (bounded) and a full queue drops them. It dies
with the sidecar (parent-death signal, and it exits when the socket closes); if it exits on its own it is started
again on the same port.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import random
import shutil
import signal
import struct
import sys
import tempfile
from pathlib import Path

from tritonclient.grpc import service_pb2 as pb

from sidecar.canary import CanaryManager
from sidecar.config import SidecarConfig
from sidecar.control import SHADOW_SUFFIX
from sidecar.grpc_front import METHODS, answered
from sidecar.metrics import LATENCY_BUCKETS, SidecarMetrics
from tunegate.capture import CaptureWriter

LOG = logging.getLogger(__name__)
BINARY = "tunegate-grpc-front"
TABLE_INTERVAL_S = 0.05  # how often the routing table is compared with what the front has
MAX_FRAME = 256 << 20
_MIRROR, _CAPTURE, _UNVERSIONED = 1, 2, 4


def find_binary() -> Path | None:
    """The compiled front: $TUNEGATE_GRPC_FRONT, beside the running Python (a venv's bin/), or on PATH."""
    env = os.environ.get("TUNEGATE_GRPC_FRONT")
    if env:
        return Path(env) if os.access(env, os.X_OK) else None
    beside = Path(sys.executable).parent / BINARY
    if os.access(beside, os.X_OK):
        return beside
    found = shutil.which(BINARY)
    return Path(found) if found else None


class NativeGrpcFront:
    """`start()` runs the compiled front and feeds the canary from it; `close()` stops it. `port` once started."""

    def __init__(self, config: SidecarConfig, manager: CanaryManager, metrics: SidecarMetrics,
                 capture: CaptureWriter | None, binary: Path) -> None:  # fmt: skip
        if config.upstream_grpc is None or config.grpc_listen is None:
            raise ValueError("the gRPC front needs grpc_listen and upstream_grpc")
        self.config, self.manager, self.metrics, self.capture, self.binary = (
            config,
            manager,
            metrics,
            capture,
            binary,
        )
        self.port = 0
        self._dir = tempfile.mkdtemp(prefix="tunegate-grpc-")
        self._path = os.path.join(self._dir, "control.sock")
        self._server: asyncio.Server | None = None
        self._proc: asyncio.subprocess.Process | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._connected: asyncio.Future[None] | None = None
        self._table = b""
        self._answers: dict[str, asyncio.Future[dict[tuple[str, str], int]]] = {}
        self._seq = itertools.count(1)
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False
        self._ids = random.Random()

    # -- lifecycle ---------------------------------------------------------------------------------------------------
    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._connect, path=self._path, limit=MAX_FRAME)
        host, port = self.config.grpc_listen or ("127.0.0.1", 0)
        await self._spawn(f"{host}:{port}")
        self.manager.routed_elsewhere = self.in_flight
        self.manager.pair_busy = self._pair_busy
        self._tasks = [asyncio.ensure_future(self._push_tables()), asyncio.ensure_future(self._watch())]

    async def _spawn(self, listen: str) -> None:
        self._connected = asyncio.get_running_loop().create_future()
        self._table = b""  # a new front has no table yet
        c = self.config
        args = [
            str(self.binary), "--listen", listen, "--upstream", c.upstream_grpc or "", "--control", self._path,
            "--max-message-bytes", str(c.grpc_max_message_bytes),
            "--max-concurrent", str(c.grpc_max_concurrent_rpcs),
            "--upstream-timeout-s", repr(c.upstream_timeout_s),
            "--latency-buckets", ",".join(repr(b) for b in LATENCY_BUCKETS),
            "--methods", ",".join(sorted(METHODS)), "--shadow-suffix", SHADOW_SUFFIX,
        ]  # fmt: skip
        self._proc = await asyncio.create_subprocess_exec(*args, stdout=asyncio.subprocess.PIPE)
        try:
            assert self._proc.stdout is not None
            line = await asyncio.wait_for(self._proc.stdout.readline(), 15.0)
            if not line.startswith(b"listening "):
                raise OSError(f"cannot listen for gRPC on {listen} ({self.binary.name} exited)")
            self.port = int(line.split()[1])
            await asyncio.wait_for(self._connected, 15.0)
        except BaseException:
            await self._stop_process()
            raise
        await self._send_table(force=True)

    async def close(self) -> None:
        self._closing = True
        if self.manager.routed_elsewhere == self.in_flight:
            self.manager.routed_elsewhere = None
        if self.manager.pair_busy == self._pair_busy:
            self.manager.pair_busy = None
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        await self._stop_process()
        if self._writer is not None:
            self._writer.close()
        if self._server is not None:
            self._server.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    async def _stop_process(self) -> None:
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 3.0)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()

    async def _watch(self) -> None:
        """Start the front again (same port) if it exits while the sidecar runs."""
        while not self._closing:
            proc = self._proc
            assert proc is not None
            rc = await proc.wait()
            if self._closing:
                return
            LOG.error("%s exited with %s; starting it again on port %d", BINARY, rc, self.port)
            await asyncio.sleep(0.5)
            host = (self.config.grpc_listen or ("127.0.0.1", 0))[0]
            try:
                await self._spawn(f"{host}:{self.port}")
            except (TimeoutError, OSError) as exc:
                LOG.error("%s could not be started again: %s", BINARY, exc)
                await asyncio.sleep(2.0)

    # -- the control socket --------------------------------------------------------------------------------------
    async def _connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._writer is not None:
            self._writer.close()
        self._writer = writer
        if self._connected is not None and not self._connected.done():
            self._connected.set_result(None)
        try:
            while True:
                head = await reader.readexactly(4)
                (n,) = struct.unpack("<I", head)
                if n == 0 or n > MAX_FRAME:
                    LOG.error("%s sent a frame of %d bytes; closing its socket", BINARY, n)
                    break
                body = await reader.readexactly(n)
                try:
                    self._frame(body[:1], body[1:])
                except Exception:  # a bug here must never stop the feed
                    LOG.exception("frame from %s not applied", BINARY)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            if self._writer is writer:
                self._writer = None
            writer.close()

    def _frame(self, kind: bytes, payload: bytes) -> None:
        if kind == b"O":
            self._offer(payload)
        elif kind == b"S":
            self._stats(payload.decode())
        elif kind == b"A":
            seq, _, rest = payload.decode().partition("\n")
            counts: dict[tuple[str, str], int] = {}
            for line in rest.splitlines():
                with contextlib.suppress(ValueError):  # one bad line costs that line only
                    model, version, n = line.split("\t")
                    counts[(model, version)] = int(n)
            fut = self._answers.pop(seq, None)
            if fut is not None and not fut.done():
                fut.set_result(counts)

    def _offer(self, payload: bytes) -> None:
        flags = payload[0]
        (seconds,) = struct.unpack_from("<d", payload, 1)
        (n,) = struct.unpack_from("<I", payload, 9)
        raw, raw_resp = payload[13 : 13 + n], payload[13 + n :]
        req = pb.ModelInferRequest.FromString(raw)
        answered(self.manager, self.capture, self._ids, req, raw_resp, seconds, bool(flags & _MIRROR),
                 bool(flags & _CAPTURE), bool(flags & _UNVERSIONED), presampled=True)  # fmt: skip

    def _stats(self, text: str) -> None:
        for line in text.splitlines():
            try:
                self._stat(line)
            except (ValueError, IndexError, KeyError):  # one bad line costs that line only
                LOG.warning("%s sent a counts line not applied: %r", BINARY, line[:200])

    def _stat(self, line: str) -> None:
        m = self.metrics
        kind, *f = line.split("\t")
        if kind == "c":
            m.grpc_requests.labels(f[0], f[1]).value += int(f[2])
        elif kind == "r":
            buckets = [int(b) for b in f[5].split(",")] if f[5] else []
            m.add_requests(f[0], f[1], "primary", int(f[2]), int(f[3]), float(f[4]), buckets)
        elif kind == "b":  # model, the budget window the latencies were measured in, bins
            canary = self.manager.canaries.get(f[0])
            counts = None if canary is None or canary.budget.window != int(f[1]) else canary.budget.counts
            if counts is not None:
                for item in f[2].split(","):
                    i, n = item.split(":")
                    counts[int(i)] += int(n)
        elif kind == "d":
            m.mirror_dropped.labels(f[0], "candidate", "full").value += int(f[1])

    def _send(self, kind: bytes, payload: bytes) -> bool:
        w = self._writer
        if w is None or w.is_closing():
            return False
        w.write(struct.pack("<I", len(payload) + 1) + kind + payload)
        return True

    def _pair_busy(self, model: str, busy: bool) -> None:
        """A shadow-paired canary's pair is out (busy) or back: the front offers nothing for `model` while it is
        out, as the canary would not admit it (the table clears the flags; a stale False costs frames only)."""
        self._send(b"B", f"{model}\t{int(busy)}".encode())

    # -- the routing table -------------------------------------------------------------------------------------
    def table(self) -> bytes:
        """Capture rate, then per model: live version, whether a canary takes evidence, its sample rate, its
        budget's latency window."""
        mgr = self.manager
        rate = self.config.capture_rate if self.capture is not None else 0.0
        lines = [repr(rate)]
        models = set(mgr.store.models()) | set(mgr.canaries)
        for model in sorted(models):
            live = mgr.live_version(model)
            canary = mgr.canaries.get(model)
            sampled: float | None = None
            window = 0
            if canary is not None and canary.pending is None and canary.paused is None:
                sampled, window = canary.budget.rate, canary.budget.window
            lines.append(
                f"{model}\t{'' if live is None else live}\t{int(sampled is not None)}\t{sampled or 0.0!r}\t{window}"
            )
        return "\n".join(lines).encode()

    async def _send_table(self, force: bool = False) -> None:
        table = self.table()
        if (force or table != self._table) and self._send(b"T", table):
            self._table = table
            # A table clears the front's pair flags: pairs still out are told again.
            for model, canary in self.manager.canaries.items():
                if (
                    canary.params.latency_pairing == "shadow"
                    and canary.slots.full()
                    and not canary.slots.closed
                ):
                    self._pair_busy(model, True)

    async def _push_tables(self) -> None:
        while True:
            await asyncio.sleep(TABLE_INTERVAL_S)
            try:
                await self._send_table()
            except Exception:  # never let the table's updates stop
                LOG.exception("routing table not sent to %s", BINARY)

    async def in_flight(self, model: str, version: str) -> int:
        """Calls the front has in flight on (model, version), asked after it has the current routing table (the
        socket is ordered: the table goes first). 0 if the front does not answer within 2 s."""
        await self._send_table()
        seq = str(next(self._seq))
        fut: asyncio.Future[dict[tuple[str, str], int]] = asyncio.get_running_loop().create_future()
        self._answers[seq] = fut
        if not self._send(b"Q", seq.encode()):
            self._answers.pop(seq, None)
            return 0
        try:
            counts = await asyncio.wait_for(fut, 2.0)
        except TimeoutError:
            self._answers.pop(seq, None)
            LOG.warning("%s did not say what it has in flight within 2 s", BINARY)
            return 0
        return counts.get((model, version), 0)
