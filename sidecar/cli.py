"""`tunegate sidecar` (the proxy); `tunegate canary start|status|promote|pin|rollback|decisions` (admin)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
from pathlib import Path
from typing import Any

from rich.table import Table

from sidecar.app import serve
from sidecar.client import AdminClient, AdminError
from sidecar.config import ConfigError, load_config, read_token
from sidecar.grpc_native import BINARY as GRPC_BINARY
from sidecar.grpc_native import find_binary
from tunegate.console import CliError, emit_json, err, out
from tunegate.records import atomic_write_text


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "sidecar", help="run the KServe v2 sidecar in front of Triton (mirror, judge, promote/pin)"
    )
    p.add_argument(
        "--config", type=Path, help="TOML file (keys as the flags, plus a [canary] table of defaults)"
    )
    p.add_argument("--listen", help="host:port to listen on (default 127.0.0.1:8080; port 0 picks one)")
    p.add_argument("--upstream", help="Triton's HTTP URL, e.g. http://127.0.0.1:8000")
    p.add_argument(
        "--upstream-grpc",
        metavar="HOST:PORT",
        help="Triton's gRPC address, e.g. 127.0.0.1:8001: model loads go there and stall no HTTP client",
    )
    p.add_argument(
        "--grpc-listen",
        metavar="HOST:PORT",
        help="serve Triton's gRPC inference API here too (needs --upstream-grpc; port 0 picks one)",
    )
    p.add_argument(
        "--grpc-max-message-bytes",
        type=int,
        help="largest gRPC message either way (RESOURCE_EXHAUSTED above)",
    )
    p.add_argument(
        "--grpc-front",
        choices=("auto", "native", "python"),
        help="the compiled gRPC front (native), grpcio's asyncio one (python), or native where installed (auto)",
    )
    p.add_argument("--state-dir", type=Path, help="where state.json and decisions.jsonl live")
    p.add_argument("--repository", type=Path, help="the model repository Triton serves (shared with Triton)")
    p.add_argument(
        "--admin-token-file", type=Path, help="file holding the admin bearer token (read at startup)"
    )
    p.add_argument("--capture-dir", type=Path, help="write sampled requests here (tunegate.capture format)")
    p.add_argument("--capture-rate", type=float, help="fraction of requests captured (default 0)")
    p.add_argument("--max-body-bytes", type=int, help="largest request body accepted (413 above)")
    p.add_argument(
        "--retain-versions",
        type=int,
        metavar="N",
        help="after a promotion or rollback, keep a model's newest N versions (3; 0: all)",
    )
    p.add_argument(
        "--admin-listen",
        metavar="HOST:PORT",
        help="serve the admin API (/canary, /decisions) on this address only, not on the client port",
    )
    p.add_argument("--ready-file", type=Path, help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_sidecar)

    c = sub.add_parser(
        "canary", help="start, inspect, promote or pin a canary through the sidecar's admin API"
    )
    c.add_argument("--url", default=os.environ.get("TUNEGATE_SIDECAR_URL", "http://127.0.0.1:8080"),
                   help="sidecar URL (env TUNEGATE_SIDECAR_URL)")  # fmt: skip
    c.add_argument("--token-file", type=Path, default=None,
                   help="admin token file (env TUNEGATE_ADMIN_TOKEN_FILE)")  # fmt: skip
    c.add_argument("--json", action="store_true", help="machine-readable output")
    csub = c.add_subparsers(dest="canary_command", metavar="ACTION", required=True)
    st = csub.add_parser("start", help="start a canary of a candidate version")
    st.add_argument("model")
    st.add_argument("candidate", type=int)
    st.add_argument(
        "--tolerance", type=Path, help="JSON tolerance spec (needed when the version has no release.json)"
    )
    st.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                    help="canary parameter, e.g. min_samples=200 deadline_s=120 sample_rate=0.5 (repeatable)")  # fmt: skip
    for name, helptext in (("status", "show a model's canary (or all)"), ("promote", "promote the candidate now"),
                           ("pin", "pin the baseline now"), ("decisions", "list decision records")):  # fmt: skip
        a = csub.add_parser(name, help=helptext)
        a.add_argument("model", nargs="?" if name in ("status", "decisions") else None)
    rb = csub.add_parser("rollback", help="bring back the previous live version (no downtime), recorded")
    rb.add_argument("model")
    rb.add_argument(
        "--to",
        type=int,
        metavar="VERSION",
        help="the version to bring back (default: the last promotion's baseline)",
    )
    rb.add_argument("--reason", help="why, for the decision record")
    c.set_defaults(func=cmd_canary)


def cmd_sidecar(args: argparse.Namespace) -> int:
    overrides: dict[str, Any] = {
        "listen": args.listen, "upstream": args.upstream, "upstream_grpc": args.upstream_grpc, "state_dir": args.state_dir,
        "repository": args.repository, "admin_token_file": args.admin_token_file,
        "capture_dir": args.capture_dir, "capture_rate": args.capture_rate, "max_body_bytes": args.max_body_bytes,
        "retain_versions": args.retain_versions, "admin_listen": args.admin_listen, "grpc_listen": args.grpc_listen,
        "grpc_max_message_bytes": args.grpc_max_message_bytes, "grpc_front": args.grpc_front,
    }  # fmt: skip
    try:
        config = load_config(args.config, overrides)
    except ConfigError as exc:
        raise CliError(str(exc)) from exc
    if config.grpc_listen is not None and config.grpc_front == "native" and find_binary() is None:
        raise CliError(
            f'grpc_front = "native" but {GRPC_BINARY} is not installed (`make native`; or set TUNEGATE_GRPC_FRONT)'
        )

    def ready(port: int, grpc_port: int | None = None) -> None:
        err.print(f"[green]sidecar[/] listening on {config.listen_host}:{port} -> {config.upstream}")
        if grpc_port is not None and config.grpc_listen is not None:
            err.print(
                f"[green]sidecar[/] gRPC on {config.grpc_listen[0]}:{grpc_port} -> {config.upstream_grpc}"
            )
        if config.upstream_grpc is None:
            err.print(
                "[yellow]upstream_grpc is not set[/]: model loads go through Triton's HTTP API, which holds the "
                "HTTP clients for the whole load; set it to Triton's gRPC host:port"
            )
        if args.ready_file is not None:
            atomic_write_text(args.ready_file, f"{port} {grpc_port}" if grpc_port is not None else str(port))

    async def main() -> None:
        task = asyncio.ensure_future(serve(config, ready))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await task

    import uvloop

    uvloop.run(main())
    return 0


def _parse_param(item: str) -> tuple[str, Any]:
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise CliError(f"--param needs KEY=VALUE, got {item!r}")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw


def cmd_canary(args: argparse.Namespace) -> int:
    token_file = args.token_file or os.environ.get("TUNEGATE_ADMIN_TOKEN_FILE")
    if not token_file:
        raise CliError("give --token-file (or set TUNEGATE_ADMIN_TOKEN_FILE)")
    try:
        admin = AdminClient(args.url, read_token(Path(token_file)))
    except ConfigError as exc:
        raise CliError(str(exc)) from exc
    action = args.canary_command
    try:
        if action == "start":
            tol = None
            if args.tolerance is not None:
                try:
                    tol = json.loads(args.tolerance.read_text())
                except (OSError, json.JSONDecodeError) as exc:
                    raise CliError(f"cannot read tolerance {args.tolerance}: {exc}") from exc
            result = admin.start(args.model, args.candidate, tol, **dict(_parse_param(p) for p in args.param))
        elif action == "status":
            result = admin.status(args.model)
        elif action == "promote":
            result = admin.promote(args.model)
        elif action == "pin":
            result = admin.pin(args.model)
        elif action == "rollback":
            result = admin.rollback(args.model, args.to, args.reason)
        else:
            result = {"decisions": admin.decisions(args.model)}
    except AdminError as exc:
        raise CliError(str(exc), 2 if 400 <= exc.status < 500 else 1) from exc
    if args.json:
        emit_json(result)
    elif action == "decisions":
        _print_decisions(result["decisions"])
    else:
        _print_status(result if "models" in result else {"models": {result["model"]: result}})
    return 0


def _print_status(result: dict[str, Any]) -> None:
    t = Table("model", "state", "live", "candidate", "compared", "out of tol.", "errors", "memory MiB c/b",
              "capacity c/b", "skipped",
              "mirror rate (client p50)", "judge says")  # fmt: skip
    for model, st in result["models"].items():
        c = st.get("canary") or {}
        ev = c.get("evidence", {})
        j = c.get("judgement") or {}
        says = (j.get("outcome", "") + ": " + "; ".join(j.get("reasons", []))) if j else ""
        if not c and st.get("last"):
            says = f"{st['last']['outcome']}: " + "; ".join(st["last"]["reasons"])
        t.add_row(model, st["state"], str(st.get("live")), str(c.get("candidate", "")), str(ev.get("compared", "")),
                  str(ev.get("out_of_tolerance", "")), str(ev.get("errors", "")), _memory_cell(c),
                  _capacity_cell(c),
                  ", ".join(f"{k} {v}" for k, v in sorted((ev.get("skipped") or {}).items()) if v), _budget_cell(c),
                  says)  # fmt: skip
    out.print(t)


def _budget_cell(canary: dict[str, Any]) -> str:
    """The effective mirror sample rate and the client latency quantile with and without mirroring
    ("0.25 (p50 3.1/2.9 ms, +6.9%)")."""
    b = canary.get("mirror_budget") or {}
    if not b:
        return ""
    cell = f"{b['sample_rate']:.3g}"
    if not b.get("enabled"):
        return cell + " (budget off)"
    on, off, added = b.get("client_latency_mirroring_s"), b.get("client_latency_paused_s"), b.get("added")
    ms = "/".join("?" if v is None else f"{1000 * v:.3g}" for v in (on, off))
    limit = f"{100 * b['max_client_slowdown']:g}%"
    return (
        f"{cell} (p{100 * float(b.get('quantile') or 0.5):g} {ms} ms, "
        + ("?" if added is None else f"{100 * added:+.1f}%")
        + f" of {limit}"
        + (", paused)" if b.get("phase") == "paused" else ")")
    )


def _capacity_cell(canary: dict[str, Any]) -> str:
    """Inferences per second the candidate's and the baseline's instances sustain ("410/400, 1.03"), from Triton."""
    t = canary.get("throughput") or {}
    c, b = t.get("candidate_capacity_rps"), t.get("baseline_capacity_rps")
    if c is None or b is None:
        return ""
    return f"{c:.0f}/{b:.0f}, {t['ratio']:.2f}"


def _memory_cell(canary: dict[str, Any]) -> str:
    """Peak memory of the candidate and the baseline ("123/120"), or why it is unknown."""
    if not canary:
        return ""
    peaks = (canary.get("evidence") or {}).get("memory") or {}
    info = canary.get("memory") or {}
    figures = "/".join(
        "?" if peaks.get(r) is None else f"{peaks[r] / 2**20:.0f}" for r in ("candidate", "baseline")
    )
    if info.get("kind") == "gpu":
        figures += " (GPU)"
    return figures if not info.get("unknown") else f"{figures} (unknown: {info['unknown']})"


def _print_decisions(recs: list[dict[str, Any]]) -> None:
    t = Table("when (unix)", "model", "outcome", "versions", "live after", "by", "reasons")
    for r in recs:
        if "rollback_id" in r:  # a rollback: from the version that served to the one brought back
            versions = f"{r.get('from_version')} -> {r.get('to_version')}"
        else:
            versions = f"{r.get('candidate')} vs {r.get('baseline')}"
        t.add_row(f"{r.get('at', 0):.0f}", r.get("model", ""), r.get("outcome", ""), versions,
                  str(r.get("live_after", "")), r.get("decided_by", ""),
                  "; ".join(r.get("reasons", [])))  # fmt: skip
    out.print(t)
