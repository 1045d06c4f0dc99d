"""How a run stops when its process is asked to (SIGTERM from Kubernetes, SIGINT from a
terminal), at any moment, within a grace period.

A signal never tears a write in half. A write is a batch transaction, the external calls
of a batch and the recording of their results, the lease, or the run record. During a
write the signal only sets :attr:`StopSignals.event`. The runner then stops at the next
safe point. That is the batch loop's head, or, inside an external phase, the moment before
the next call (what was not sent is released). Everywhere else (validating, counting,
waiting, the outcome checks) the signal raises :class:`Terminated` at once, and PostgreSQL
is told to cancel the running query. If a write is still running when the grace is over, a
watchdog interrupts it. The batch transaction then rolls back as a whole, and the run is
recorded ``cancelled``/``terminated`` all the same.
"""

from __future__ import annotations

import _thread
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from qo_ops.errors import ConfigError

STOP_GRACE_ENV = "QO_OPS_STOP_GRACE_S"
DEFAULT_STOP_GRACE_S = 10.0
MAX_STOP_GRACE_S = 600.0
TERMINATED = "terminated"  # the status reason of a run stopped by a signal
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Terminated(KeyboardInterrupt):
    """The process was asked to stop while the run was not writing.

    It is a ``KeyboardInterrupt`` on purpose. Job code's ``except Exception`` does not
    swallow it, and psycopg cancels the query it interrupts on the server."""


def stop_grace_s(environ: dict[str, str] | None = None) -> float:
    """Seconds a run has from SIGTERM/SIGINT to its recorded end (``QO_OPS_STOP_GRACE_S``,
    default 10). Keep it below the pod's ``terminationGracePeriodSeconds``."""
    raw = ((os.environ if environ is None else environ).get(STOP_GRACE_ENV) or "").strip()
    if not raw:
        return DEFAULT_STOP_GRACE_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 1.0 <= value <= MAX_STOP_GRACE_S:
        raise ConfigError(
            f"{STOP_GRACE_ENV} must be a number of seconds from 1 to {MAX_STOP_GRACE_S:g}, "
            f"got {raw!r}"
        )
    return value


class StopSignals:
    """SIGTERM/SIGINT handling for one run. It is installed from the main thread only.
    Elsewhere, such as a test calling ``run_job`` from a thread, only :meth:`request` stops
    the run."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.event = threading.Event()
        self.signal_name: str | None = None
        self.at: float | None = None  # monotonic time of the first request
        self._writing = 0  # depth of deferred() sections
        self._forced = False  # the grace is over, so interrupt even a write
        self._previous: dict[int, Any] = {}
        self._watchdog: threading.Timer | None = None
        self._finished = threading.Event()

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        self._finished.set()
        if self._watchdog is not None:
            self._watchdog.cancel()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    # ------------------------------------------------------------------ requests
    def _on_signal(self, signum: int, _frame: object) -> None:
        self.request(signal.Signals(signum).name)
        if self._writing == 0 or self._forced:
            raise Terminated(self.signal_name)

    def request(self, name: str = "stop") -> None:
        """Ask the run to stop, as a signal does. Any thread may call it."""
        if self.event.is_set():
            return
        self.signal_name, self.at = name, time.monotonic()
        self.event.set()
        if self._previous:  # installed, so the main thread can be interrupted
            self._watchdog = threading.Timer(self.grace_s, self._interrupt_if_still_writing)
            self._watchdog.daemon = True
            self._watchdog.start()

    def _interrupt_if_still_writing(self) -> None:
        if not self._finished.is_set() and self._writing and self._previous:
            self._forced = True
            _thread.interrupt_main(signal.SIGINT)  # runs _on_signal in the main thread

    @property
    def requested(self) -> bool:
        """Whether a stop was asked."""
        return self.event.is_set()

    def remaining_s(self) -> float:
        """Seconds of grace left (the whole grace before any request)."""
        if self.at is None:
            return self.grace_s
        return max(0.0, self.at + self.grace_s - time.monotonic())

    def calls_deadline(self) -> float | None:
        """Until when calls already sent may still be waited for (monotonic). That is half
        the grace, so recording their results and finishing the run fit in the rest."""
        return None if self.at is None else self.at + self.grace_s / 2

    @contextmanager
    def deferred(self) -> Iterator[None]:
        """A section a signal must not interrupt (a write). The request waits for the
        runner's next safe point instead, until the grace is over."""
        self._writing += 1
        try:
            yield
        finally:
            self._writing -= 1
