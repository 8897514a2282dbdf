"""Canary control on Triton over HTTP (explicit model control) and the shared model repository.

The candidate is never loaded under the model's own name before promotion (Triton answers an
unversioned request from the highest *loaded* version). It is served as a shadow model
`<m>__canary`: a directory beside `<m>` with a copy of its config (name rewritten, policy [C]) and
a symlink `C -> ../<m>/C`. Promotion goes in two phases: policy [B, C] and reload (if that fails the
old config is restored and reloaded, so the baseline serves); the sidecar switches its routing to C
and waits for its requests to B; then policy [C] and reload, which unloads B.

A candidate whose release.json carries a serving configuration (tunegate.serving: instances, batching) is
served with it by the shadow, and promotion writes it into the model's config. Every promotion and rollback keeps
the config the version it replaces served with beside it (`.config-v<B>.pbtxt`); a rollback to B restores it.

Loads and unloads go through Triton's gRPC repository API when `upstream_grpc` is set. Triton's HTTP server
answers a repository load inside an HTTP worker thread (the load call blocks until the model is ready), and
HTTP clients wait for the whole load: on a CPU Triton, during a 2 s load every one of 16 keep-alive clients
waited 3.4 s (benchmarks/model_load_stall.py). A gRPC load runs on the gRPC server's threads, and HTTP
clients see only the CPU the load itself takes (at most 20 ms of wait in the same measurement).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import aiohttp

from tunegate import pbtxt
from tunegate.errors import ServiceError
from tunegate.records import atomic_write_text, fsync_dir
from tunegate.repository import parse_version_policy, set_version_policy
from tunegate.serving import Serving, ServingError, saved_config_name

LOG = logging.getLogger(__name__)
SHADOW_SUFFIX = "__canary"
TRASH_PREFIX = ".trash-"  # a version directory being deleted (retention)


class ControlError(ServiceError):
    """Triton or the repository refused a control step; the message says which and why."""


class PromotionError(ControlError):
    """Promotion failed; the baseline was restored and keeps serving."""


class RollbackFailed(ControlError):
    """A rollback's first phase failed; the version that served before was restored and keeps serving."""


def shadow_name(model: str) -> str:
    return f"{model}{SHADOW_SUFFIX}"


def _rename_model(config_text: str, name: str) -> str:
    return pbtxt.with_name(config_text, name)


class TritonControl:
    """Repository edits plus Triton's repository API, over an injected aiohttp session (and gRPC for loads
    and unloads when `grpc_address`, Triton's gRPC host:port, is given)."""

    def __init__(self, session: aiohttp.ClientSession, upstream: str, repository: Path, timeout_s: float = 300.0,
                 grpc_address: str | None = None) -> None:  # fmt: skip
        self.session = session
        self.base = upstream.rstrip("/")
        self.repository = Path(repository)
        self.timeout_s = timeout_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.grpc_address = grpc_address
        self._grpc: Any = None  # tritonclient.grpc.aio client, made on first use (inside the event loop)

    async def close(self) -> None:
        if self._grpc is not None:
            await self._grpc.close()
            self._grpc = None

    # -- repository ----------------------------------------------------------------------------
    def config_path(self, model: str) -> Path:
        return self.repository / model / "config.pbtxt"

    def read_config(self, model: str) -> str:
        path = self.config_path(model)
        try:
            return path.read_text()
        except OSError as exc:
            raise ControlError(f"model {model!r} has no readable config.pbtxt in {self.repository}") from exc

    def policy(self, model: str) -> tuple[int, ...] | None:
        return parse_version_policy(self.read_config(model))

    def version_dir(self, model: str, version: int) -> Path:
        return self.repository / model / str(version)

    def release(self, model: str, version: int) -> dict[str, Any] | None:
        path = self.version_dir(model, version) / "release.json"
        if not path.exists():
            return None
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ControlError(f"{path} is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ControlError(f"{path} must hold a JSON object")
        return data

    def serving_config(self, model: str, version: int) -> Serving | None:
        """The serving configuration a version's release.json asks for (`"serving"`), or None."""
        release = self.release(model, version)
        raw = (release or {}).get("serving")
        if not raw:
            return None
        try:
            serving = Serving.from_dict(raw)
        except ServingError as exc:
            raise ControlError(
                f"{model} version {version}: release.json's serving configuration: {exc}"
            ) from exc
        return None if serving.empty else serving

    def _with_serving(self, model: str, text: str, serving: Serving | None) -> str:
        if serving is None:
            return text
        try:
            return serving.apply(text)
        except ServingError as exc:
            raise ControlError(
                f"{model}: the candidate's serving configuration does not apply: {exc}"
            ) from exc

    def saved_config(self, model: str, version: int) -> Path:
        """The config that served `version` before a release changed the model's serving configuration."""
        return self.repository / model / saved_config_name(version)

    def _served_before(self, model: str, version: int, text: str) -> str:
        """The config `version` serves with now, kept as its saved config for a rollback to it, and returned as
        what a failed swap restores. A redo (policy no longer [version]: the swap's config is on disk) reads the
        saved one instead, so a failed redo restores what served, not the candidate's configuration."""
        path = self.saved_config(model, version)
        if parse_version_policy(text) == (version,):
            atomic_write_text(path, text)
            return text
        if path.exists():
            return set_version_policy(path.read_text(), [version])
        return set_version_policy(text, [version])

    def write_shadow(self, model: str, candidate: int, baseline: int | None = None) -> Path:
        """Lay out `<m>__canary/` (staged, then renamed into place); replaces a stale one.

        With `baseline`, the shadow serves that version too: baseline replays then run on an instance that,
        like the candidate's, takes no client traffic (shadow latency pairing). A candidate whose release
        changes the serving configuration is served with it (instances, batching): the shadow carries it.
        """
        versions = sorted({candidate} | ({baseline} if baseline is not None else set()))
        text = self._with_serving(model, self.read_config(model), self.serving_config(model, candidate))
        config = set_version_policy(_rename_model(text, shadow_name(model)), versions)
        dest = self.repository / shadow_name(model)
        staging = Path(tempfile.mkdtemp(prefix=f".{shadow_name(model)}.", dir=self.repository))
        try:
            for v in versions:
                os.symlink(f"../{model}/{v}", staging / str(v))
            atomic_write_text(staging / "config.pbtxt", config)
            os.chmod(staging, 0o755)
            self.remove_shadow(model)
            os.rename(staging, dest)
            fsync_dir(self.repository)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return dest

    def remove_shadow(self, model: str) -> None:
        path = self.repository / shadow_name(model)
        if path.exists() or path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
            fsync_dir(self.repository)

    # -- Triton --------------------------------------------------------------------------------
    async def _post(self, path: str, body: dict[str, Any] | None = None) -> tuple[int, str]:
        try:
            async with self.session.post(f"{self.base}{path}", json=body or {}, timeout=self.timeout) as resp:
                return resp.status, await resp.text()
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise ControlError(f"POST {path}: Triton unreachable: {exc!r}") from exc

    async def load(self, name: str) -> None:
        if self.grpc_address is not None:
            await self._grpc_call("load", name)
            return
        status, text = await self._post(f"/v2/repository/models/{name}/load")
        if status != 200:
            raise ControlError(f"Triton refused to load {name!r} ({status}): {_error_text(text)}")

    async def unload(self, name: str) -> None:
        if self.grpc_address is not None:
            await self._grpc_call("unload", name)
            return
        status, text = await self._post(f"/v2/repository/models/{name}/unload")
        if status not in (200, 400):  # 400: not loaded, which is what we want anyway
            raise ControlError(f"Triton refused to unload {name!r} ({status}): {_error_text(text)}")

    async def _grpc_call(self, action: str, name: str) -> None:
        from tritonclient.grpc.aio import (
            InferenceServerClient,  # grpc.aio's channel binds to the running loop
        )
        from tritonclient.utils import InferenceServerException

        if self._grpc is None:
            self._grpc = InferenceServerClient(self.grpc_address)
        call = self._grpc.load_model if action == "load" else self._grpc.unload_model
        try:
            await call(name, client_timeout=self.timeout_s)
        except InferenceServerException as exc:
            status, text = exc.status() or "", exc.message() or str(exc)
            if action == "unload" and "not found" in text.lower():  # not loaded, which is what we want anyway
                return
            if status in ("StatusCode.UNAVAILABLE", "StatusCode.DEADLINE_EXCEEDED"):
                raise ControlError(
                    f"gRPC {action} {name!r}: Triton unreachable at {self.grpc_address}: {text}"
                ) from exc
            raise ControlError(f"Triton refused to {action} {name!r} (gRPC {status}): {text}") from exc

    async def _get_ok(self, path: str, timeout_s: float) -> bool:
        try:
            async with self.session.get(
                f"{self.base}{path}", timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as resp:
                await resp.read()
                return resp.status == 200
        except (TimeoutError, aiohttp.ClientError):
            return False

    async def ready(self, name: str, version: int | None = None, timeout_s: float = 10.0) -> bool:
        path = f"/v2/models/{name}" + (f"/versions/{version}" if version is not None else "") + "/ready"
        return await self._get_ok(path, timeout_s)

    async def get_json(self, path: str, timeout_s: float = 5.0) -> Any:
        """A GET of Triton's API answered 200 with JSON; ControlError otherwise (unreachable, refused, not JSON)."""
        try:
            async with self.session.get(
                f"{self.base}{path}", timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as resp:
                text = await resp.text()
                if resp.status != 200:
                    raise ControlError(f"GET {path}: Triton answered {resp.status}: {_error_text(text)}")
                return json.loads(text)
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise ControlError(f"GET {path}: Triton unreachable: {exc!r}") from exc
        except ValueError as exc:
            raise ControlError(f"GET {path}: not JSON: {exc}") from exc

    async def live(self, timeout_s: float = 2.0) -> bool:
        return await self._get_ok("/v2/health/live", timeout_s)

    async def server_ready(self, timeout_s: float = 2.0) -> bool:
        """Triton's `/v2/health/ready`: reachable, and (strict readiness, the default) every model it tracks ready."""
        return await self._get_ok("/v2/health/ready", timeout_s)

    async def serving(self, model: str, version: int, timeout_s: float = 2.0) -> bool:
        """Whether Triton is up and serving `model` `version`.

        `/v2/health/ready`, or the version's own readiness: under strict readiness one model that failed to load
        (say, a broken candidate) turns the first 400 for good, so a server that says not ready but has the
        version ready serves. Both are asked at once: a server slow to answer costs `timeout_s` once, not twice.
        """
        server, version_ready = await asyncio.gather(
            self.server_ready(timeout_s), self.ready(model, version, timeout_s)
        )
        return server or version_ready

    # -- canary lifecycle ----------------------------------------------------------------------
    async def start_shadow(self, model: str, candidate: int, baseline: int | None = None) -> None:
        await asyncio.to_thread(self.write_shadow, model, candidate, baseline)
        try:
            await self.load(shadow_name(model))
            for v in (candidate,) if baseline is None else (candidate, baseline):
                if not await self.ready(shadow_name(model), v):
                    raise ControlError(f"{shadow_name(model)} version {v} is not ready after loading")
        except BaseException:
            with contextlib.suppress(ControlError):
                await self.unload(shadow_name(model))
            await asyncio.to_thread(self.remove_shadow, model)
            raise

    async def stop_shadow(self, model: str) -> None:
        await self.unload(shadow_name(model))
        await asyncio.to_thread(self.remove_shadow, model)

    async def stage_promotion(self, model: str, candidate: int, baseline: int) -> None:
        """Phase 1 of a promotion: serve both versions as `<m>` (policy [B, C]) so the swap never races a request.

        Triton resolves an unversioned request to a version before it runs it, so unloading the baseline
        while requests are in flight fails some of them (503 "version B is not at ready state": seen on the
        H200 with 9.6 MB ResNet-50 batches). With both loaded, the sidecar switches its explicit routing to
        C, waits for the requests it sent to B, and only then `finish_promotion` unloads B.
        On any failure policy [B] is restored and reloaded, and PromotionError says so. Idempotent, so a
        restarted sidecar can redo it; a promotion already finished (policy [C], C ready) is left alone.
        """
        text = await asyncio.to_thread(self.read_config, model)
        if parse_version_policy(text) == (candidate,) and await self.ready(model, candidate):
            return
        serving = await asyncio.to_thread(self.serving_config, model, candidate)
        old = await asyncio.to_thread(self._served_before, model, baseline, text)
        both = set_version_policy(self._with_serving(model, text, serving), sorted({baseline, candidate}))
        await asyncio.to_thread(atomic_write_text, self.config_path(model), both)
        try:
            await self.load(model)
            if not await self.ready(model, candidate):
                raise ControlError(f"{model} version {candidate} is not ready after the reload")
        except ControlError as exc:
            LOG.error("promotion of %s v%s failed (%s); restoring the baseline", model, candidate, exc)
            await asyncio.to_thread(atomic_write_text, self.config_path(model), old)
            try:
                await self.load(model)
            except ControlError as again:
                raise PromotionError(f"{exc}; restoring the baseline also failed: {again}") from exc
            raise PromotionError(f"{exc}; the baseline was restored") from exc

    async def finish_promotion(self, model: str, candidate: int) -> None:
        """Phase 2: policy [C] and reload, which unloads the baseline. Raises ControlError if Triton refuses."""
        text = await asyncio.to_thread(self.read_config, model)
        if parse_version_policy(text) != (candidate,):
            await asyncio.to_thread(
                atomic_write_text, self.config_path(model), set_version_policy(text, [candidate])
            )
        await self.load(model)

    # -- rollback and retention ------------------------------------------------------------------
    async def stage_rollback(self, model: str, target: int, current: int) -> None:
        """Phase 1 of a rollback: policy [target, current] and reload, so both serve while routing switches.

        The same two phases as a promotion, the other way round. If the reload fails or `target` is not ready
        after it, policy [current] is restored and reloaded, and RollbackFailed says so (`current` keeps
        serving). Idempotent; a rollback already finished (policy [target], target ready) is left alone.
        """
        text = await asyncio.to_thread(self.read_config, model)
        if parse_version_policy(text) == (target,) and await self.ready(model, target):
            return
        old = await asyncio.to_thread(self._served_before, model, current, text)
        base = text
        saved = self.saved_config(model, target)
        if saved.exists():  # the configuration the target served with comes back with it
            base = await asyncio.to_thread(saved.read_text)
        both = set_version_policy(base, sorted({target, current}))
        await asyncio.to_thread(atomic_write_text, self.config_path(model), both)
        try:
            await self.load(model)
            if not await self.ready(model, target):
                raise ControlError(f"{model} version {target} is not ready after the reload")
        except ControlError as exc:
            LOG.error("rollback of %s to v%s failed (%s); restoring v%s", model, target, exc, current)
            await asyncio.to_thread(atomic_write_text, self.config_path(model), old)
            try:
                await self.load(model)
            except ControlError as again:
                raise RollbackFailed(f"{exc}; restoring version {current} also failed: {again}") from exc
            raise RollbackFailed(f"{exc}; version {current} was restored and keeps serving") from exc

    async def finish_rollback(self, model: str, target: int) -> None:
        """Phase 2 of a rollback: policy [target] and reload, which unloads the version rolled back from."""
        await self.finish_promotion(model, target)

    def remove_version(self, model: str, version: int) -> None:
        """Delete a version directory atomically: renamed to a hidden trash directory beside it, then deleted.

        Triton ignores hidden directories, so a process killed half-way leaves the version either in place or
        gone from the repository's view; `clean_trash` finishes the deletion.
        """
        src = self.version_dir(model, version)
        trash = self.repository / model / f"{TRASH_PREFIX}{version}-{os.urandom(4).hex()}"
        os.rename(src, trash)
        with contextlib.suppress(FileNotFoundError):  # the config it served with: nothing to roll back to now
            self.saved_config(model, version).unlink()
        fsync_dir(self.repository / model)
        _delete(trash)

    def clean_trash(self, model: str) -> None:
        """Finish deletions a killed process left behind (and the saved configs of versions no longer there)."""
        for p in (self.repository / model).glob(f"{TRASH_PREFIX}*"):
            _delete(p)
        for p in (self.repository / model).glob(".config-v*.pbtxt"):
            version = p.name.removeprefix(".config-v").removesuffix(".pbtxt")
            if version.isdigit() and not self.version_dir(model, int(version)).is_dir():
                p.unlink(missing_ok=True)


def _delete(path: Path) -> None:
    """A directory tree, or only the link where a version directory was a symlink (its target is not ours)."""
    if path.is_symlink():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def _error_text(text: str) -> str:
    with contextlib.suppress(ValueError):
        doc = json.loads(text)
        if isinstance(doc, dict) and "error" in doc:
            return str(doc["error"])
    return text[:500]
