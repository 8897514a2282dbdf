"""Builds one route in a child process: `run_build` starts `python -m tuner.builders.worker REQUEST.json`.

The child writes into a temporary directory beside the final one; the parent renames it into
place only after the child exited 0 and left a readable artifact.json. A crash, a non-zero exit
or a timeout (the child's whole process group is killed) fails that route with the log's tail.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tunegate.procs import die_with_parent
from tuner.builders import get_builder
from tuner.builders.base import Artifact, BuildContext, BuildError

PROJECT_ROOT = Path(__file__).resolve().parents[2]


class BuildTimeout(BuildError):
    """The build ran past its timeout and was killed."""


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.strip().splitlines()[-lines:])


def run_build(
    builder_ref: str,
    source: Path,
    route: Mapping[str, str],
    dest: Path,
    ctx: BuildContext,
    *,
    timeout_s: float,
) -> tuple[Artifact, float]:
    """Build `route` into `dest` in a child process; returns the artifact and the build seconds."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{dest.name}-", dir=dest.parent))
    request = {
        "builder": builder_ref,
        "source": str(source),
        "route": dict(route),
        "out": str(tmp / "artifact"),
        "options": dict(ctx.options),
        "calibration": str(ctx.calibration) if ctx.calibration else None,
        "form": ctx.form,
    }
    (tmp / "request.json").write_text(json.dumps(request, indent=2, default=str))
    log = tmp / "build.log"
    env = os.environ.copy()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PROJECT_ROOT), env.get("PYTHONPATH", "")) if p)
    t0 = time.perf_counter()
    try:
        with open(log, "wb") as logf:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tuner.builders.worker", str(tmp / "request.json")],
                stdout=logf,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,  # its own group: a timeout kills everything it started
                preexec_fn=die_with_parent,  # noqa: PLW1509 - one prepared prctl call; dies with the tuner
            )
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise BuildTimeout(f"build timed out after {timeout_s:.0f}s and was killed") from None
            except BaseException:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise
        seconds = time.perf_counter() - t0
        if rc != 0:
            how = f"killed by signal {-rc}" if rc < 0 else f"exit code {rc}"
            raise BuildError(f"build failed ({how}): {_tail(log) or 'no output'}")
        Artifact.load(tmp / "artifact")  # readable before it is renamed into place
        (tmp / "artifact" / "build.log").write_bytes(log.read_bytes())
        if dest.exists():
            shutil.rmtree(dest)
        os.rename(tmp / "artifact", dest)
        return Artifact.load(dest), seconds
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str]) -> int:

    request: dict[str, Any] = json.loads(Path(argv[0]).read_text())
    builder = get_builder(request["builder"])
    out = Path(request["out"])
    out.mkdir(parents=True)
    calib = request.get("calibration")
    ctx = BuildContext(
        options=request.get("options") or {},
        calibration=Path(calib) if calib else None,
        form=request.get("form") or "python",
    )
    try:
        artifact = builder.build(Path(request["source"]), request["route"], out, ctx)
    except BuildError as exc:
        sys.stderr.write(f"BuildError: {exc}\n")
        return 1
    artifact.save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
