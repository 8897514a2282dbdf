"""The CLI's output layer: human output through rich on stderr/stdout, machine output as JSON on stdout."""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console

from tunegate.errors import TunegateError

err = Console(stderr=True, soft_wrap=True)
out = Console(soft_wrap=True)


def emit_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")
    sys.stdout.flush()


class CliError(TunegateError):
    """A user-facing error: printed without a traceback, exit code `code`."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code
