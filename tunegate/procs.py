"""Child processes that do not outlive the process that started them.

`die_with_parent` is a `preexec_fn` for `subprocess.Popen`: on Linux the child asks the kernel for SIGKILL
when its parent dies (prctl PR_SET_PDEATHSIG), so a tuner or demo killed with SIGKILL leaves no build worker
or tritonserver behind. The kernel sends it when the *thread* that started the child exits: start children
from a thread that lives as long as they should (the main thread, or a pool's worker that waits on them).
Elsewhere than Linux it does nothing; process groups (`start_new_session`) still let a living parent reap.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import sys

LOG = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
# Resolved once here, so that the child (forked from a process that may run threads) makes one foreign call
# between fork and exec and imports or allocates nothing of note.
_PRCTL = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").prctl if sys.platform == "linux" else None
_ARGS = (ctypes.c_int(PR_SET_PDEATHSIG), ctypes.c_ulong(signal.SIGKILL), ctypes.c_ulong(0), ctypes.c_ulong(0),
         ctypes.c_ulong(0))  # fmt: skip


def die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the parent dies (Linux)."""
    if _PRCTL is not None:
        _PRCTL(*_ARGS)


# Test seam, used only by the crash tests: a process SIGKILLs itself at a named point of its work when the
# environment variable names that point. The tuner's points: "search" (a route's result is in the cache),
# "serving" (the finalists' tritonserver is up), "writing" (a version's staging directory is full, not yet
# renamed), "written" (the version is in place, its cache line not yet written).
TUNE_KILL_AT_ENV = "TUNEGATE_TEST_TUNE_KILL_AT"


def kill_point(env: str, point: str) -> None:
    """SIGKILL this process if `env` names `point` (crash tests only; a no-op otherwise)."""
    if os.environ.get(env) == point:
        LOG.warning("%s=%s: killing this process (crash test)", env, point)
        os.kill(os.getpid(), signal.SIGKILL)
