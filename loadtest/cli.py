"""`tunegate loadtest` (headless replay of a capture with Locust) and `tunegate capture synth`."""

from __future__ import annotations

import argparse
import urllib.error
import urllib.request
from pathlib import Path

import grpc
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from loadtest.replay import ReplayPlan
from loadtest.runner import LoadOptions, LoadTestError, run
from loadtest.synth import DEFAULT_BATCH_MIX, SynthSpec, parse_batch_mix, write_synthetic
from tunegate.capture import CaptureError, load_capture
from tunegate.console import CliError, emit_json, err, out


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "loadtest", help="replay a capture through Locust, headless (exit 1 past --max-failure-ratio)"
    )
    p.add_argument("--capture", type=Path, required=True, help="capture file or directory")
    p.add_argument(
        "--host", required=True, help="base URL of the sidecar or Triton, e.g. http://127.0.0.1:8080"
    )
    p.add_argument(
        "--protocol",
        choices=["http", "grpc"],
        default="http",
        help="replay over HTTP (--host http://...) or as gRPC ModelInfer calls (--host HOST:PORT)",
    )
    p.add_argument("--users", type=int, default=4)
    p.add_argument("--spawn-rate", type=float, default=4.0)
    p.add_argument(
        "--duration", type=float, default=30.0, help="seconds (capture profile: 0 = the capture's length)"
    )
    p.add_argument(
        "--mode", choices=["exact", "synth"], default="exact", help="exact payloads or synthesized ones"
    )
    p.add_argument(
        "--profile",
        choices=["fixed", "capture"],
        default="fixed",
        help="fixed users or the capture's arrivals",
    )
    p.add_argument(
        "--time-scale", type=float, default=1.0, help="capture profile speed-up (2 = twice as fast)"
    )
    p.add_argument("--rate", type=float, default=0.0, help="fixed profile: total requests/s (0 = unpaced)")
    p.add_argument("--per-user-rate", type=float, default=2.0)
    p.add_argument("--name-by", choices=["model", "batch", "shape"], default="model")
    p.add_argument("--csv", type=Path, default=None, help="CSV prefix for Locust's stats files")
    p.add_argument("--max-failure-ratio", type=float, default=0.01)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_loadtest)

    c = sub.add_parser("capture", help="inspect or synthesize request captures")
    csub = c.add_subparsers(dest="capture_command", metavar="ACTION", required=True)
    s = csub.add_parser(
        "synth", help="write a synthetic capture for the demo model (real sentences, long-tailed batches)"
    )
    s.add_argument("--out", type=Path, required=True)
    s.add_argument("--model", default="minilm")
    s.add_argument("--requests", type=int, default=400)
    s.add_argument("--rate", type=float, default=20.0)
    s.add_argument(
        "--batch-mix", default=None, help="BATCH:WEIGHT,... (default 1:0.55,2:0.2,4:0.13,8:0.08,16:0.04)"
    )
    s.add_argument("--json-bodies", action="store_true", help="JSON bodies instead of the binary extension")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_synth)
    i = csub.add_parser("info", help="summarize a capture: requests, models, shape mix, duration")
    i.add_argument("capture", type=Path)
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=cmd_info)


def cmd_loadtest(args: argparse.Namespace) -> int:
    try:
        opts = LoadOptions(
            capture=args.capture, host=args.host, users=args.users, spawn_rate=args.spawn_rate,
            duration_s=args.duration, mode=args.mode, profile=args.profile, time_scale=args.time_scale,
            rate=args.rate, per_user_rate=args.per_user_rate, name_by=args.name_by, csv_prefix=args.csv,
            protocol=args.protocol,
        )  # fmt: skip
        load_capture(args.capture)  # fail fast on a bad capture, before Locust starts
    except (ValueError, CaptureError) as exc:
        raise CliError(str(exc)) from exc
    _check_host(args.host, args.protocol)
    with Progress(TextColumn("[bold]locust[/]"), BarColumn(), TimeElapsedColumn(), console=err,
                  disable=args.json) as bar:  # fmt: skip
        task = bar.add_task("replay", total=max(1.0, args.duration))
        try:
            result = run(opts, progress=lambda t: bar.update(task, completed=min(t, args.duration)))
        except LoadTestError as exc:
            raise CliError(str(exc), code=1) from exc
    ok = result.total.requests > 0 and result.failure_ratio <= args.max_failure_ratio
    if args.json:
        emit_json({**result.to_dict(), "ok": ok})
    else:
        t = result.total
        out.print(
            f"{t.requests} requests, {t.failures} failures ({result.failure_ratio:.2%}), {t.rps:.1f} req/s, "
            f"p50 {t.median_ms:.0f} ms, p95 {t.p95_ms:.0f} ms, p99 {t.p99_ms:.0f} ms"
        )
        for name, s in sorted(result.by_name.items()):
            out.print(f"  {name}: {s.requests} req, {s.failures} fail, p50 {s.median_ms:.0f} ms")
        if not ok:
            err.print(
                f"[red]failure ratio {result.failure_ratio:.2%} exceeds {args.max_failure_ratio:.2%}[/]"
            )
    return 0 if ok else 1


def _check_host(host: str, protocol: str = "http", timeout_s: float = 5.0) -> None:
    """Fail fast, before Locust starts, when nothing answers at `host` (Locust would count failures quietly)."""
    if protocol == "grpc":
        target = host.removeprefix("grpc://")
        with grpc.insecure_channel(target) as channel:
            try:
                grpc.channel_ready_future(channel).result(timeout=timeout_s)
            except grpc.FutureTimeoutError as exc:
                raise CliError(f"nothing answers gRPC at {target}: start Triton or the sidecar's gRPC front "
                               "first, or fix --host", code=1) from exc  # fmt: skip
        return
    url = host.rstrip("/") + "/v2/health/live"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s):
            pass
    except urllib.error.HTTPError:
        pass  # something answers: a sidecar or Triton that is not live yet shows as failed requests
    except (urllib.error.URLError, OSError, ValueError) as exc:
        why = getattr(exc, "reason", exc)
        raise CliError(f"nothing answers at {host} ({why}): start Triton or the sidecar first, or fix --host",
                       code=1) from exc  # fmt: skip


def cmd_synth(args: argparse.Namespace) -> int:

    try:
        spec = SynthSpec(
            model=args.model, requests=args.requests, rate=args.rate, binary=not args.json_bodies, seed=args.seed,
            batch_mix=parse_batch_mix(args.batch_mix) if args.batch_mix else DEFAULT_BATCH_MIX,
        )  # fmt: skip
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    records = write_synthetic(args.out, spec)
    if args.json:
        emit_json({"out": str(args.out), "requests": len(records)})
    else:
        err.print(f"[green]ok[/] {len(records)} requests -> {args.out}")
    return 0


def cmd_info(args: argparse.Namespace) -> int:

    try:
        plan = ReplayPlan.load(args.capture)
    except (ValueError, CaptureError) as exc:
        raise CliError(str(exc)) from exc
    ts = [r.ts for r in plan.records]
    models = sorted({r.model for r in plan.records})
    shape_mix = plan.shape_mix()
    info = {
        "requests": len(plan.records),
        "models": models,
        "duration_s": round(max(ts) - min(ts), 3),
        "shape_mix": shape_mix,
    }
    if args.json:
        emit_json(info)
    else:
        out.print(f"{info['requests']} requests over {info['duration_s']}s, models {', '.join(models)}")
        for k, v in sorted(shape_mix.items(), key=lambda kv: -kv[1])[:15]:
            out.print(f"  {v:6.1%}  {k}")
    return 0
