"""Rollback: bring back the previous live version with the same zero-downtime phases as a promotion.

`POST /canary/{model}/rollback` (`tunegate canary rollback MODEL [--to VERSION]`) runs, under the model's
lock (no canary starts or decides meanwhile):

1. the pending rollback goes into state.json (durable before anything changes);
2. policy [old, current] and a reload (`TritonControl.stage_rollback`), so both versions serve; if the
   reload fails or `old` is not ready, the config is restored, `current` keeps serving, and the outcome is
   `rollback_failed`;
3. unversioned requests are routed to `old`; the sidecar waits until none of those it routed to `current`
   are in flight;
4. policy [old] and a reload, which unloads `current`;
5. the record (outcome `rollback`) is appended to decisions.jsonl, once per rollback id, and the pending
   rollback is cleared; `last` in the status says `rolled_back`.

A sidecar killed anywhere in between finishes the same rollback when it starts again (`finish_pending`).
By default `old` is the baseline of the model's last promotion (decisions.jsonl); `to` picks any version
in the repository. After a successful promotion or rollback, `apply_retention` deletes version
directories beyond the newest `retain_versions`, never the live version, a running candidate, or the
version a rollback would bring back.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from sidecar.control import SHADOW_SUFFIX, ControlError, TritonControl
from sidecar.state import StateStore
from tunegate.errors import TunegateError
from tunegate.procs import kill_point
from tunegate.repository import versions

if TYPE_CHECKING:  # the manager calls the rollback: a type-only import
    from sidecar.canary import CanaryManager

LOG = logging.getLogger(__name__)
ROLLBACK = "rollback"
ROLLBACK_FAILED = "rollback_failed"
MAX_REASON_CHARS = 1000
MAX_VERSION = (1 << 63) - 1  # Triton's versions are int64
# Test seam, used only by the crash tests: the process SIGKILLs itself at the named point ("pending": right
# after the pending rollback is durable; "staged": after phase 1 and the routing switch).
KILL_AT_ENV = "TUNEGATE_TEST_ROLLBACK_KILL_AT"


class RollbackError(TunegateError):
    """A rollback request that cannot be served; `status` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def parse_request(body: Any) -> tuple[int | None, str | None]:
    """`(to, reason)` from the request body (None or a JSON object); RollbackError (400) for anything else."""
    if body is None:
        return None, None
    if not isinstance(body, dict):
        raise RollbackError('the body must be a JSON object like {"to": 1, "reason": "..."}, or empty')
    unknown = sorted(set(body) - {"to", "reason"})
    if unknown:
        raise RollbackError(f"unknown rollback fields {unknown}; known: ['reason', 'to']")
    to, reason = body.get("to"), body.get("reason")
    if to is not None and (not isinstance(to, int) or isinstance(to, bool) or not 1 <= to <= MAX_VERSION):
        raise RollbackError(f"'to' must be a positive integer version, got {to!r}")
    if reason is not None:
        if not isinstance(reason, str):
            raise RollbackError(f"'reason' must be a string, got {type(reason).__name__}")
        reason = reason.strip()
        if len(reason) > MAX_REASON_CHARS:
            raise RollbackError(f"'reason' is longer than {MAX_REASON_CHARS} characters")
    return to, reason or None


def check_model_name(model: str) -> None:
    if (
        not model
        or len(model) > 255
        or model.startswith(".")
        or model.endswith(SHADOW_SUFFIX)
        or any(c in model for c in "/\\\0")
    ):
        raise RollbackError(f"{model[:100]!r} is not a model name the sidecar can roll back")


def pending_rollback(store: StateStore, model: str) -> dict[str, Any] | None:
    ms = store.models().get(model)
    pending = None if ms is None else ms.get("rollback")
    return pending if isinstance(pending, dict) else None


def last_promotion_baseline(records: Sequence[dict[str, Any]], model: str) -> int | None:
    """The baseline of the model's last promotion that took effect (the version a rollback brings back)."""
    found = None
    for r in records:
        if (
            r.get("model") == model
            and r.get("outcome") == "promote"
            and r.get("live_after", r.get("candidate")) == r.get("candidate")
        ):
            found = r.get("baseline")
    return found if isinstance(found, int) else None


def previous_live(records: Sequence[dict[str, Any]], model: str) -> set[int]:
    """Versions a rollback may want: the last promotion's baseline, the one the last live change replaced."""
    last: Any = None
    for r in records:
        if r.get("model") != model:
            continue
        if r.get("outcome") == "promote" and r.get("live_after", r.get("candidate")) == r.get("candidate"):
            last = r.get("baseline")
        elif r.get("outcome") == ROLLBACK:
            last = r.get("from_version")
    baseline = last_promotion_baseline(records, model)
    return {v for v in (last, baseline) if isinstance(v, int)}


def _record_for(store: StateStore, rollback_id: str) -> dict[str, Any] | None:
    for rec in store.decisions.read():
        if rec.get("rollback_id") == rollback_id:
            return rec
    return None


def _test_kill(point: str) -> None:
    kill_point(KILL_AT_ENV, point)


async def rollback(mgr: CanaryManager, model: str, body: Any) -> dict[str, Any]:
    """Roll `model` back (module docstring); returns its status. RollbackError carries the HTTP status.

    A rollback left pending by a failed action is finished first, and the request answers with its outcome.
    """
    to, reason = parse_request(body)
    check_model_name(model)
    control = mgr.control
    async with mgr._locks[model]:
        pending = pending_rollback(mgr.store, model)
        if pending is not None:  # an earlier rollback whose action failed: finish that one first
            await _finish_or_explain(mgr, model, pending)
        else:
            canary = mgr.canaries.get(model)
            if canary is not None:
                raise RollbackError(
                    f"model {model!r} has a running canary (candidate {canary.candidate}); "
                    "promote or pin it first",
                    409,
                )
            if not control.config_path(model).is_file():
                raise RollbackError(f"model {model!r} is not in the repository", 404)
            live = mgr.live_version(model)
            if live is None:
                try:
                    policy = await asyncio.to_thread(control.policy, model)
                except (ControlError, ValueError) as exc:
                    raise RollbackError(f"cannot read {model}'s config: {exc}", 409) from exc
                if policy is None or len(policy) != 1:
                    raise RollbackError(
                        f"{model}/config.pbtxt needs version_policy specific [ <live> ] "
                        f"(found {policy}); the sidecar will not guess the live version",
                        409,
                    )
                live = policy[0]
            records = await asyncio.to_thread(mgr.store.decisions.read)
            target = to if to is not None else last_promotion_baseline(records, model)
            if target is None:
                raise RollbackError(
                    f"nothing to roll back to: no promotion of {model} is recorded; "
                    "pass 'to' to choose a version",
                    404,
                )
            if target == live:
                if to is not None:
                    raise RollbackError(f"version {target} of {model} is already live")
                raise RollbackError(
                    f"nothing to roll back to: version {target} of {model}, the baseline of its "
                    "last promotion, is already live; pass 'to' to choose a version",
                    404,
                )
            if not control.version_dir(model, target).is_dir():
                raise RollbackError(f"{model} has no version {target} in the repository", 404)
            pending = {
                "rollback_id": uuid.uuid4().hex,
                "model": model,
                "outcome": ROLLBACK,
                "from_version": live,
                "to_version": target,
                "reasons": [reason or f"rollback to version {target} by an operator"],
                "decided_by": "operator",
                "at": time.time(),
            }
            ms = mgr.store.model(model)
            ms["live"], ms["rollback"] = live, pending
            await mgr._save()
            _test_kill("pending")
            LOG.info("rollback %s: %s v%d -> v%d", pending["rollback_id"], model, live, target)
            await _finish_or_explain(mgr, model, pending)
    st = mgr.status(model)
    last = st.get("last") or {}
    if last.get("outcome") == ROLLBACK_FAILED:
        raise RollbackError("; ".join(last.get("reasons", [])), 502)
    return st


async def _finish_or_explain(mgr: CanaryManager, model: str, pending: dict[str, Any]) -> None:
    try:
        await _finish(mgr, model, pending)
    except Exception as exc:  # say, an unwritable repository: durable as pending, retried
        LOG.exception("acting on the rollback of %s failed; it stays pending", model)
        raise RollbackError(
            f"the rollback of {model} is recorded as pending but could not be carried out "
            f"({exc}); the next rollback request or a restart retries it",
            503,
        ) from exc


async def _finish(mgr: CanaryManager, model: str, pending: dict[str, Any]) -> None:
    """Act on a pending rollback (idempotent), append its record once, clear it (under the model's lock)."""
    existing = await asyncio.to_thread(_record_for, mgr.store, pending["rollback_id"])
    rec = dict(existing if existing is not None else pending)
    current, target = int(rec["from_version"]), int(rec["to_version"])
    # The record is appended only after the action finished: with a record, nothing is left to do.
    if existing is None:
        live = current
        try:
            await mgr.control.stage_rollback(model, target, current)
        except ControlError as exc:
            rec["outcome"] = ROLLBACK_FAILED
            rec["reasons"] = [*rec["reasons"], f"rollback failed, version {current} keeps serving: {exc}"]
        else:
            live = target
            mgr.store.model(model)["live"] = live  # from here every unversioned request goes to the target
            _test_kill("staged")
            timeout = mgr.config.upstream_timeout_s
            left = await mgr._drain_routed(model, current, timeout)
            if left:
                LOG.warning(
                    "%d requests to %s v%d still in flight after %gs; unloading it anyway",
                    left,
                    model,
                    current,
                    timeout,
                )
            try:
                await mgr.control.finish_rollback(model, target)
            except ControlError as exc:
                # the target serves; the other version stays loaded beside it until the next reload
                LOG.error("rolled %s back to v%d, but unloading v%d failed: %s", model, target, current, exc)
                rec["reasons"] = [*rec["reasons"], f"version {current} could not be unloaded: {exc}"]
        rec["live_after"] = live
        await asyncio.to_thread(mgr.store.decisions.append, rec)
        mgr.metrics.decisions.labels(model, rec["outcome"]).inc()
        mgr.metrics.last_decision.labels(model, rec["outcome"]).set(time.time())
    ms = mgr.store.model(model)
    ms["live"], ms["rollback"] = rec["live_after"], None
    ms["last"] = {
        "rollback_id": rec["rollback_id"],
        "state": "rolled_back" if rec["outcome"] == ROLLBACK else ROLLBACK_FAILED,
        "outcome": rec["outcome"],
        "from_version": current,
        "to_version": target,
        "reasons": rec["reasons"],
        "at": rec["at"],
    }
    await mgr._save()
    mgr._publish(model)
    LOG.info(
        "rollback %s of %s: %s (%s)", rec["rollback_id"], model, rec["outcome"], "; ".join(rec["reasons"])
    )
    if rec["outcome"] == ROLLBACK:
        await apply_retention(mgr, model)


async def finish_pending(mgr: CanaryManager) -> None:
    """After a restart: finish every rollback left pending (a failure is logged; the next request retries)."""
    for model in list(mgr.store.models()):
        pending = pending_rollback(mgr.store, model)
        if pending is None:
            continue
        try:
            async with mgr._locks[model]:
                await _finish(mgr, model, pending)
        except Exception:
            LOG.exception(
                "finishing the pending rollback of %s failed; the next rollback request retries it", model
            )


# -- retention -----------------------------------------------------------------------------------
def retained(all_versions: Iterable[int], keep_newest: int, protected: Iterable[int]) -> set[int]:
    """The versions to keep: the newest `keep_newest` (0: all) and every protected one."""
    vs = sorted(set(all_versions))
    if keep_newest <= 0:
        return set(vs)
    return set(vs[-keep_newest:]) | set(protected)


def _remove_old_versions(
    control: TritonControl, model: str, keep_newest: int, protected: set[int]
) -> list[int]:
    control.clean_trash(model)
    present = versions(control.repository / model)
    keep = retained(present, keep_newest, protected)
    removed = []
    for v in present:
        if v not in keep:
            control.remove_version(model, v)
            removed.append(v)
    return removed


async def apply_retention(mgr: CanaryManager, model: str) -> list[int]:
    """Delete the model's version directories beyond the newest `retain_versions`; returns those removed.

    Kept whatever their age: the live version, a running candidate (and its baseline), and the versions a
    rollback would bring back. A failure is logged and never undoes the promotion or rollback that ran it.
    """
    keep_newest = mgr.config.retain_versions
    if keep_newest <= 0:
        return []
    try:
        records = await asyncio.to_thread(mgr.store.decisions.read)
        protected = previous_live(records, model)
        live = mgr.live_version(model)
        if live is not None:
            protected.add(live)
        canary = mgr.canaries.get(model)
        if canary is not None:
            protected |= {canary.candidate, canary.baseline}
        pending = pending_rollback(mgr.store, model)
        if pending is not None:
            protected |= {int(pending["from_version"]), int(pending["to_version"])}
        removed = await asyncio.to_thread(_remove_old_versions, mgr.control, model, keep_newest, protected)
    except (OSError, ControlError, ValueError) as exc:
        LOG.warning("retention for %s failed: %s", model, exc)
        return []
    if removed:
        LOG.info(
            "retention: removed %s version(s) %s (keeping the newest %d and %s)",
            model,
            ", ".join(map(str, removed)),
            keep_newest,
            sorted(protected),
        )
    return removed
