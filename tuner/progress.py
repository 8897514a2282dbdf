"""Search progress on stderr: a rich bar over the routes planned so far, plus timestamped notes."""

from __future__ import annotations

import time
from typing import Any, Self

from tunegate.console import err


class Reporter:
    """A no-op unless enabled; `done` takes a route result (route, status, speedup, reused)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._progress: Any = None
        self._task: Any = None

    def __enter__(self) -> Self:
        if self.enabled:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
            )

            self._progress = Progress(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=err,
                transient=False,
            )
            self._progress.start()
            self._task = self._progress.add_task("routes", total=0)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()

    def note(self, msg: str) -> None:
        if self._progress is not None:
            self._progress.console.print(f"[dim]{time.strftime('%H:%M:%S')}[/] {msg}")

    def plan(self, n: int) -> None:
        if self._progress is not None:
            total = self._progress.tasks[0].total or 0
            self._progress.update(self._task, total=total + n)

    def route(self, key: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, description=key[:70])

    def done(self, result: Any) -> None:
        if self._progress is not None:
            self._progress.advance(self._task)
            spd = f" {result.speedup:.2f}x" if result.speedup is not None else ""
            color = {"passed": "green", "rejected": "red"}.get(result.status, "yellow")
            self.note(
                f"[{color}]{result.status}[/]{spd} {result.route}" + (" (cached)" if result.reused else "")
            )
