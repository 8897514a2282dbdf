"""`tunegate tune SPEC`, `tunegate tune-serving SPEC` and `tunegate routes SPEC`: the tuner's command line (registered in tunegate/app/cli.py).

Exit codes: 0 done (a winner written, or a clear "no winner"), 1 the search could not run
(backend or server failure), 2 bad spec, bad route expression or a cache that cannot be resumed.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from rich.markup import escape

from tunegate.console import CliError, emit_json, err, out
from tunegate.serving import ServingError
from tunegate.triton import TritonError
from tuner.builders import BuildError
from tuner.cache import CacheError
from tuner.inputs import InputsError
from tuner.routes import RouteError
from tuner.search import TuneError, plan, tune
from tuner.serving import plan as serving_plan
from tuner.serving import tune_serving
from tuner.spec import STRATEGIES, SpecError, load_spec


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:

    t = sub.add_parser("tune", help="search build routes, gate accuracy, write the winner as a new version")
    t.add_argument("spec", type=Path, help="tuning spec (TOML), e.g. specs/minilm.toml")
    t.add_argument("--strategy", choices=STRATEGIES, default=None, help="override [search].strategy")
    t.add_argument("--budget-s", type=float, default=None, help="override [search].budget_s (seconds)")
    t.add_argument(
        "--routes",
        default=None,
        metavar="EXPR",
        help="override [search].routes, e.g. '-quant=int8-channel' to build one given route",
    )
    t.add_argument(
        "--continue",
        dest="resume",
        action="store_true",
        help="resume the cached search of this spec (after a kill) without redoing finished routes",
    )
    t.add_argument(
        "--dry-run", action="store_true", help="list the routes the strategy would run; build nothing"
    )
    t.add_argument("--no-write", action="store_true", help="search and report, but write no version")
    t.add_argument(
        "--serving",
        action="store_true",
        help="then search the serving configuration of the written winner ([serving]); a winning configuration "
        "is written as the next version, the engine and the configuration released together",
    )
    t.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    t.set_defaults(func=cmd_tune)

    sv = sub.add_parser(
        "tune-serving",
        help="search Triton's serving configuration (instances, batching) of a version; write the winner as a "
        "new version whose release carries it",
    )
    sv.add_argument("spec", type=Path, help="tuning spec with a [serving] table, e.g. specs/minilm.toml")
    sv.add_argument(
        "--version", type=int, default=None, help="the version whose files are served (default: live)"
    )
    sv.add_argument("--routes", default=None, metavar="EXPR", help="override [serving].routes")
    sv.add_argument("--no-write", action="store_true", help="measure and report, but write no version")
    sv.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    sv.set_defaults(func=cmd_tune_serving)

    r = sub.add_parser(
        "routes", help="list a spec's knobs (allowed values, default, help) and the routes a strategy runs"
    )
    r.add_argument("spec", type=Path)
    r.add_argument("--strategy", choices=STRATEGIES, default=None)
    r.add_argument("--json", action="store_true")
    r.set_defaults(func=cmd_routes)


def _load(args: argparse.Namespace) -> Any:

    try:
        spec = load_spec(args.spec)
        if getattr(args, "routes", None) is not None:
            spec = dataclasses.replace(spec, search=dataclasses.replace(spec.search, routes=args.routes))

        return spec, plan(spec, args.strategy)
    except (SpecError, RouteError) as exc:
        raise CliError(str(exc)) from exc
    except Exception as exc:
        if isinstance(exc, BuildError):
            raise CliError(str(exc)) from exc
        raise


def cmd_routes(args: argparse.Namespace) -> int:
    _spec, p = _load(args)
    if args.json:
        emit_json(p)
        return 0
    _print_plan(p)
    return 0


def _print_plan(p: dict[str, Any]) -> None:
    from rich.table import Table

    head = f"backend [bold]{p['backend']}[/]" + (
        "" if p["available"] else f" [red](unavailable: {escape(p['why'])})[/]"
    )
    out.print(head)
    knobs = Table("knob", "values", "default", "in this spec", "help", title="knobs")
    for k in p["knobs"]:
        knobs.add_row(
            f"-{k['name']}", "|".join(k["values"]), k["default"], "|".join(p["space"][k["name"]]), k["help"]
        )
    out.print(knobs)
    out.print(
        f"strategy [bold]{p['strategy']}[/]: {p['note']}; {len(p['routes'])} route(s) "
        f"(the full product has {p['full_size']}):"
    )
    for r in p["routes"]:
        out.print(f"  {r}")


def cmd_tune(args: argparse.Namespace) -> int:

    if args.budget_s is not None and not args.budget_s > 0:
        raise CliError(f"--budget-s must be a number of seconds > 0, got {args.budget_s:g}")
    spec, p = _load(args)
    if args.dry_run:
        if args.json:
            emit_json(p)
        else:
            _print_plan(p)
        return 0
    if not p["available"]:
        raise CliError(f"backend {p['backend']} cannot run here: {p['why']}", code=1)
    if args.serving:
        try:
            serving_plan(spec)
        except RouteError as exc:
            raise CliError(str(exc)) from exc
        if not spec.serving.routes:
            raise CliError(f"--serving needs [serving].routes in {args.spec}")
    try:
        result = tune(
            spec,
            strategy=args.strategy,
            budget_s=args.budget_s,
            resume=args.resume,
            progress=not args.json,
            write=not args.no_write,
        )
    except (CacheError, InputsError) as exc:
        raise CliError(str(exc)) from exc
    except (TuneError, TritonError) as exc:
        raise CliError(str(exc), code=1) from exc
    serving: dict[str, Any] | None = None
    if args.serving and result.version is not None:
        note = (lambda _m: None) if args.json else (lambda m: err.print(escape(m)))
        try:
            found, version, path = tune_serving(spec, result.version, note=note)
        except (TuneError, TritonError, ServingError, InputsError) as exc:
            raise CliError(
                f"version {result.version} is written; its serving search failed: {exc}", code=1
            ) from exc
        serving = {**found.to_dict(), "written_version": version, "written_path": str(path) if path else None}
    if args.json:
        emit_json({**result.summary(), **({"serving": serving} if serving is not None else {})})
        return 0
    _print_summary(result)
    if serving is not None:
        out.print(f"serving configuration of version {result.version}: {escape(serving['reason'])}")
        if serving["written_version"] is not None:
            out.print(
                f"written as version {serving['written_version']}: version {result.version}'s files served so"
            )
    return 0


def cmd_tune_serving(args: argparse.Namespace) -> int:
    try:
        spec = load_spec(args.spec)
        if args.routes is not None:
            spec = dataclasses.replace(spec, serving=dataclasses.replace(spec.serving, routes=args.routes))
        serving_plan(spec)  # a bad route expression fails before any work
    except (SpecError, RouteError) as exc:
        raise CliError(str(exc)) from exc
    note = (lambda _m: None) if args.json else (lambda m: err.print(escape(m)))
    try:
        result, version, path = tune_serving(spec, args.version, write=not args.no_write, note=note)
    except InputsError as exc:
        raise CliError(str(exc)) from exc
    except (TuneError, TritonError, ServingError) as exc:
        raise CliError(str(exc), code=1) from exc
    summary = {**result.to_dict(), "written_version": version, "written_path": str(path) if path else None}
    if args.json:
        emit_json(summary)
        return 0
    from rich.table import Table

    table = Table("route", "status", "throughput at objective (per round)", "ratio (median)", "gate",
                  title=f"{spec.model.name} v{result.version}: serving routes")  # fmt: skip
    for r in result.routes:
        rate = (r.gate or {}).get("rate") or {}
        table.add_row(
            escape(r.route),
            r.status,
            ", ".join(f"{t:.1f}" for t in r.throughput) or escape(r.error or "—"),
            f"{r.median_ratio:.2f}x" if r.median_ratio is not None else "—",
            f"{rate.get('k')}/{rate.get('n')}" if rate else "—",
        )
    out.print(table)
    if result.winner is not None:
        out.print(f"[bold green]winner[/] {escape(result.reason)}")
        if version is not None:
            out.print(f"written as version {version}: {path} (served so only after the canary promotes it)")
        else:
            out.print("not written: --no-write")
    else:
        out.print(f"[bold yellow]no winner[/]: {escape(result.reason)}; nothing written")
    return 0


def _speedup_cell(r: Any) -> str:
    if r.speedup is None:
        return "—"
    return f"{r.speedup:.2f}x" + (f" (>= {r.speedup_lower:.2f}x)" if r.speedup_lower is not None else "")


def _print_summary(result: Any) -> None:
    from rich.table import Table

    table = Table(
        "route",
        "status",
        "speedup",
        "objective ms",
        "build s",
        "gate",
        title=f"{result.model}: {result.strategy}",
    )
    colors = {"passed": "green", "rejected": "red", "failed": "yellow", "skipped": "dim"}
    for r in sorted(result.routes, key=lambda r: (r.status != "passed", r.objective_ms or 1e18)):
        gate = (r.accuracy or {}).get("summary") or (r.error or "")
        table.add_row(
            escape(r.route),
            f"[{colors.get(r.status, 'white')}]{r.status}[/]",
            _speedup_cell(r),
            f"{r.objective_ms:.2f}" if r.objective_ms is not None else "—",
            f"{r.build_seconds:.1f}" if r.build_seconds is not None else "—",
            escape(gate[:160]),
        )
    out.print(table)
    out.print(f"baseline version {result.baseline['version']}: {result.baseline['objective_ms']:.2f} ms")
    if result.winner is not None and result.version is not None:
        out.print(f"[bold green]winner[/] {escape(result.reason)}")
        out.print(f"written as version {result.version}: {result.version_path} (not served until the canary)")
        changes = ((result.release or {}).get("serving_changes") or {}).get("changes") or {}
        if changes:  # a native onnxruntime version: its session settings are config.pbtxt's, per model
            wanted = ", ".join(f"{k} {v['now']} -> {v['wanted']}" for k, v in changes.items())
            out.print(
                f"timed with config.pbtxt settings the canary applies on promotion (release.json serving): {wanted}"
            )
    elif result.winner is not None:
        out.print(f"[bold green]winner[/] {result.winner.route} (not written: --no-write)")
    else:
        out.print(f"[bold yellow]no winner[/]: {escape(result.reason)}; nothing written")
    err.print(f"report: {result.report_path}")
