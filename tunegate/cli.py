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
    "tunegate.cmd_model",
    "tunegate.cmd_triton",
    "tunegate.cmd_demo",
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
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
