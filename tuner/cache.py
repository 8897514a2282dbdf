"""The search cache: JSON lines, a header (spec digest, tool versions, settings) then one line per finished step.

Every line is appended with fsync (tunegate.records.JsonlLog), so a kill -9 loses at most the
step in flight; `--continue` replays the finished steps instead of redoing them. The header keeps a digest
of each thing the results depend on (`digests`: the spec, the source model's bytes, the baseline version's
files, the captured inputs, the tool and machine versions); a cache whose digests differ refuses to resume
and names what changed.
Line kinds: "header", "baseline", "route" (one per route and stage), "e2e".
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from tunegate.errors import ServiceError
from tunegate.records import JsonlLog, atomic_write_text

CACHE_FORMAT = 2  # 2: routes keep their timed runs and the speed-up's lower bound (tuner.bench.speedup_lower)
# What a search's results depend on, as the header's `digests` name them (tuner.search.run_digests).
DIGEST_NAMES = {
    "spec": "the spec",
    "source": "the source model",
    "baseline": "the baseline version's files",
    "inputs": "the captured inputs",
    "tools": "the tool or machine versions",
    "serving": "the model's serving form or its config.pbtxt session settings",
}


class CacheError(ServiceError):
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
            raise CacheError(
                f"{path}: cache format {old.get('format')} is not {CACHE_FORMAT}; start over without --continue"
            )
        old_digests = dict(old.get("digests") or {"spec": old.get("spec_digest")})
        new_digests = dict(header.get("digests") or {"spec": header["spec_digest"]})
        changed = [k for k in DIGEST_NAMES if k in old_digests and old_digests.get(k) != new_digests.get(k)]
        if changed:
            what = " and ".join(DIGEST_NAMES[k] for k in changed)
            detail = ", ".join(
                f"{k} {str(old_digests.get(k))[:12]} vs {str(new_digests.get(k))[:12]}" for k in changed
            )
            raise CacheError(
                f"{path}: {what} changed since this search started ({detail}); its results do not apply. "
                "Run without --continue to start over."
            )
        return cls(path, old, lines[1:])

    def append(self, entry: dict[str, Any]) -> None:
        JsonlLog(self.path).append(entry)
        self.entries.append(entry)

    def find(self, kind: str, route: str | None = None, stage: str | None = None) -> dict[str, Any] | None:
        e: dict[str, Any]  # stated: mypy infers reversed() of a list of dict[str, Any] as Any
        for e in reversed(self.entries):
            if (
                e.get("kind") == kind
                and (route is None or e.get("route") == route)
                and (stage is None or e.get("stage") == stage)
            ):
                return e
        return None

    def routes(self, stage: str | None = None) -> list[dict[str, Any]]:
        return [
            e for e in self.entries if e.get("kind") == "route" and (stage is None or e.get("stage") == stage)
        ]
