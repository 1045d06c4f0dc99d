"""Test-only fault injection, one helper for the runner and the jobs.

When ``QO_OPS_CRASH_AT`` names a crash point, the process kills itself with SIGKILL when it
reaches that point, as a crash would. When ``QO_OPS_HOLD_AT`` names a hold point, the run
waits there for up to 120 s, as a slow phase would, so a fault test can send a signal then.
Outside the fault tests both are unset, and each costs one dictionary lookup.
docs/platform.md lists the points."""

from __future__ import annotations

import os
import signal
import sys
import time

CRASH_ENV = "QO_OPS_CRASH_AT"
# The runner's crash points. Jobs name their own (such as audit_archive.ARCHIVE_CRASH_POINTS).
CRASH_POINTS = (
    "after_lease_acquire",
    "after_batch_select",
    "before_commit",
    "after_commit",
    "after_external_call",  # in an external phase, sent but its result not recorded
    "before_finalize",
)

HOLD_ENV = "QO_OPS_HOLD_AT"
HOLD_S = 120.0


def crash_point(name: str) -> None:
    """SIGKILL this process here when ``QO_OPS_CRASH_AT`` names ``name``."""
    if os.environ.get(CRASH_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)


def hold_point(name: str) -> None:
    """Wait here when ``QO_OPS_HOLD_AT`` names ``name``. Say so on stderr first, because the
    test waits for that line before it sends its signal."""
    if os.environ.get(HOLD_ENV) == name:
        print(f"{HOLD_ENV}: holding at {name}", file=sys.stderr, flush=True)
        time.sleep(HOLD_S)
