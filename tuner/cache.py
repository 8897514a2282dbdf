"""The search cache: JSON lines, a header (spec digest, tool versions, settings) then one line per finished step.

Every line is appended with fsync (tunegate.records.JsonlLog), so a kill -9 loses at most the
step in flight; `--continue` replays the finished steps instead of redoing them. A cache whose
header has another spec digest refuses to resume: the gate and inputs it was built for differ.
Line kinds: "header", "baseline", "route" (one per route and stage), "e2e".
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from tunegate.records import JsonlLog, atomic_write_text

CACHE_FORMAT = 1


class CacheError(RuntimeError):
    """The cache cannot be resumed (missing, another spec, another format)."""


@dataclasses.dataclass
class SearchCache:
    path: Path
    header: dict[str, Any]
    entries: list[dict[str, Any]]

    @classmethod
    def open(cls, path: Path, header: dict[str, Any], *, resume: bool) -> SearchCache:
        """Start a new cache (replacing any old one) or, with `resume`, reopen one made for the same spec."""
        path = Path(path)
        header = {"kind": "header", "format": CACHE_FORMAT, "created_at": time.time(), **header}
        if not resume:
            atomic_write_text(path, "")
            JsonlLog(path).append(header)
            return cls(path, header, [])
        lines = JsonlLog(path).read()
        if not lines or lines[0].get("kind") != "header":
            raise CacheError(f"{path}: no search cache to continue (run without --continue to start one)")
        old = lines[0]
        if old.get("format") != CACHE_FORMAT:
            raise CacheError(f"{path}: cache format {old.get('format')} is not {CACHE_FORMAT}; start over without --continue")
        if old.get("spec_digest") != header["spec_digest"]:
            raise CacheError(
                f"{path}: the spec changed since this search started (digest {str(old.get('spec_digest'))[:12]} "
                f"vs {header['spec_digest'][:12]}); its results do not apply. Run without --continue to start over."
            )
        return cls(path, old, lines[1:])

    def append(self, entry: dict[str, Any]) -> None:
        JsonlLog(self.path).append(entry)
        self.entries.append(entry)

    def find(self, kind: str, route: str | None = None, stage: str | None = None) -> dict[str, Any] | None:
        for e in reversed(self.entries):
            if e.get("kind") == kind and (route is None or e.get("route") == route) and (stage is None or e.get("stage") == stage):
                return e
        return None

    def routes(self, stage: str | None = None) -> list[dict[str, Any]]:
        return [e for e in self.entries if e.get("kind") == "route" and (stage is None or e.get("stage") == stage)]
