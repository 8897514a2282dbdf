"""`tunegate` command line: one subcommand per module, each registering itself through `register(subparsers)`."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from rich.markup import escape

from tunegate import __version__
from tunegate.console import CliError, err

# Modules that add subcommands; each has `register(subparsers) -> None` and sets `func` on its parsers.
COMMAND_MODULES = (
    "tunegate.app.cmd_model",
    "tunegate.app.cmd_triton",
    "tunegate.app.cmd_demo",
    "sidecar.cli",
    "tuner.cli",
    "loadtest.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tunegate",
        description="Evidence-gated release of tuned inference engines: tune build routes, gate accuracy, "
        "canary on Triton, promote or pin.",
    )
    parser.add_argument("--version", action="version", version=f"tunegate {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


# Options whose value is a route expression, which starts with a dash (`-quant=int8-channel`): argparse would
# take `--routes -quant=int8` for two options, so the value is joined to its option first.
DASH_VALUED = ("--routes",)


def _join_dash_values(argv: Sequence[str]) -> list[str]:
    out: list[str] = []
    it = iter(argv)
    for arg in it:
        if arg in DASH_VALUED:
            value = next(it, None)
            out.append(arg if value is None else f"{arg}={value}")
        else:
            out.append(arg)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(_join_dash_values(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(
        level=logging.WARNING - 10 * min(args.verbose, 2),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        return int(func(args) or 0)
    except CliError as exc:
        # escaped: messages quote spec keys like [model].source, which rich would take for markup
        err.print(f"[bold red]error:[/] {escape(str(exc))}")
        return exc.code
    except KeyboardInterrupt:
        err.print("interrupted")
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
