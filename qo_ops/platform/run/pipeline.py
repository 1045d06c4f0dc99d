"""Pipelined batches: a batch's call and record run on a second thread and connection while
the run's thread claims the next batch (``ExternalPhase(pipelined=True)``).

    the run's thread:    claim 1 | claim 2          | claim 3          | claim 4 ...
    the batch's thread:          | call 1, record 1 | call 2, record 2 | ...

The database work of two batches (one's claim, the other's record) then runs on two server
processes at once, and the call's own work beside them. Each claim and each record is its
own transaction under the lease's guard, exactly as in the sequential shape; only when they
run changes, and the record runs on the run's second connection.

- **At most two batches are open**: the one in its call and record, and the one claimed
  after it. Batch N+1's call starts once batch N is recorded and taken into the run (its
  counters, its events, whether it halts the run), always on the run's thread.
- **The position moves at the claim.** The next claim starts after the last row of the
  batch claimed before it, whose record may still be running; the record's outcome carries
  no position. So a job sets ``pipelined`` only when its claim's position is where the next
  claim starts (``Positions``, no checkpoint).
- **The last pass from the start** (for rows another run held) waits for the batch in
  flight to be recorded, so it never selects that batch's rows again.
- **A claim that is never called is harmless**: a job sets ``pipelined`` only when its claim
  commits nothing a later run needs from it (audit_archive's claim reads and locks; a stale
  manifest it retired leaves an orphan file that a later run sweeps). The run drops the
  batch claimed ahead when it stops, when a record halts it, or on an error.
- **A stop** (a signal, the deadline, a cancel) ends claiming; the batch in flight is still
  called and recorded. **On an error** the run waits for the batch in flight to end (its
  record commits or rolls back) before the error ends the run, unless a stop's grace is
  over; a record that committed is taken into the run's counters all the same.

Each batch is one ``batch`` span, from its call's start to its record being taken in.
``batch_ms`` is a batch's own work: its claim plus its call and record, without the wait
for the batch before it.
"""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from enum import Enum
from typing import Any

from sqlalchemy.engine import Connection

from qo_ops.platform.job.counts import SPAN, Counts
from qo_ops.platform.job.outcome import BatchOutcome
from qo_ops.platform.job.spec import ExternalPhase
from qo_ops.platform.observability.tracing import OFF, SpanLike, span
from qo_ops.platform.run.faults import crash_point
from qo_ops.platform.run.overlap import OverlappingRun

_POLL_S = 0.05  # the run's thread waits for a batch in steps this long (signals)


class _InFlight:
    """One claimed batch's call and record, on a thread of its own and the run's second
    connection, inside the batch's span. The span stays open until the run takes it in."""

    def __init__(self, number: int, claimed: BatchOutcome, claim_ms: float) -> None:
        self.number, self.claimed, self.claim_ms = number, claimed, claim_ms
        self.span: SpanLike = OFF
        self.work_ms = 0.0
        self._outcome: BatchOutcome | None = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._taken = threading.Event()

    def take_off(self, run: OverlappingRun, phase: ExternalPhase, second: Connection) -> _InFlight:
        """Start the batch's call and record, in the run's trace context."""
        context = contextvars.copy_context()
        threading.Thread(
            target=context.run,
            args=(self._fly, run, phase, second),
            name="qo-ops-batch",
            daemon=True,
        ).start()
        return self

    def _fly(self, run: OverlappingRun, phase: ExternalPhase, second: Connection) -> None:
        attributes = {"batch.number": self.number, **Counts().event_fields(SPAN)}
        started = time.perf_counter()
        with span("batch", **attributes) as batch_span:
            self.span = batch_span
            try:
                results = phase.call(run.ctx, self.claimed.work)
                crash_point("after_external_call")
                self._outcome = run.record(second, self.claimed, results)
            except BaseException as exc:  # the run ends on it, on its own thread
                self._error = exc
            finally:
                self.work_ms = (time.perf_counter() - started) * 1000
                self._done.set()
            self._taken.wait()  # the span ends once the run took the batch in

    def wait(self, limit_s: float | None = None) -> bool:
        """Wait until the batch's record ended (in steps, so a signal's handler runs).
        Return whether it did within ``limit_s``."""
        end = None if limit_s is None else time.monotonic() + limit_s
        while not self._done.wait(_POLL_S):
            if end is not None and time.monotonic() >= end:
                return False
        return True

    def outcome(self) -> BatchOutcome:
        """The batch's recorded outcome, once its record ended. Raise its error, if any."""
        self.wait()
        if self._error is not None:
            raise self._error
        assert self._outcome is not None
        return self._outcome

    def recorded_well(self) -> bool:
        """Whether the batch's record ended and committed (no error)."""
        return self._done.is_set() and self._error is None and self._outcome is not None

    def taken(self) -> None:
        """The run took the batch in (or gave up on it): its span may end."""
        self._taken.set()


def pipelined_batches(
    run: OverlappingRun,
    conn: Connection,
    phase: ExternalPhase,
    connect: Callable[[], AbstractContextManager[Connection]],
) -> None:
    """Run the batches of a pipelined external phase until the work is done or the run must
    stop (the module docstring shows the shape). ``connect`` gives the second connection."""
    flight: _InFlight | None = None
    claims = 0
    with connect() as second:  # closed only once no batch uses it
        try:
            while True:
                with run.stop.deferred():  # a signal waits for the batch in flight to be recorded
                    started = time.perf_counter()
                    claimed = _claim(run, conn, flight, claims)
                    if flight is not None:
                        landed, flight = flight, None  # an error in its take-in: not twice
                        halted = _take_in(run, landed)
                        if halted or run.room() <= 0:  # a record halted it, a stop, the deadline
                            return  # the batch claimed ahead is dropped: its claim is harmless
                    if claimed is _AFTER_FLIGHT:
                        continue  # claim again, now that the batch in flight is recorded
                    if not isinstance(claimed, BatchOutcome):
                        return
                    if claimed.ends_at_claim:
                        run.recorded(claimed, OFF)
                        return
                    claims += 1
                    claim_ms = (time.perf_counter() - started) * 1000
                    flight = _InFlight(claims, claimed, claim_ms).take_off(run, phase, second)
        except BaseException:
            if flight is not None:  # its record commits or rolls back before the run ends
                if flight.wait(run.stop.remaining_s() if run.stop.requested else None) and (
                    flight.recorded_well()
                ):
                    _take_in(run, flight)  # a committed record counts, whatever ended the run
                flight.taken()
            raise


_AFTER_FLIGHT = object()  # claim once the batch in flight is recorded


def _claim(run: OverlappingRun, conn: Connection, flight: _InFlight | None, claims: int) -> Any:
    """Claim the next batch while ``flight`` is called and recorded, and move the run's
    position to its end. Return it, ``_AFTER_FLIGHT`` when the claim must wait for the batch
    in flight (the last pass from the start, or the run's item limit), or the runner's
    reason there is nothing to claim."""
    room = run.room()  # 0: a stop, the deadline or the item limit (the summary says which)
    if room <= 0:
        return None
    room -= flight.claimed.processed if flight is not None else 0
    if room <= 0:
        return _AFTER_FLIGHT  # the batch in flight takes what is left; look again after it
    if claims and run.limits.throttle_ms:  # a stop signal wakes it
        run.stop.event.wait(run.limits.throttle_ms / 1000.0)
    claimed = run.claim(conn, room)
    if isinstance(claimed, BatchOutcome):
        if claimed.position is not None:
            run.ctx.position = claimed.position  # where the next claim starts
        return claimed
    if isinstance(claimed, Enum) and claimed.name == "AGAIN":  # the runner's _Step.AGAIN
        return _AFTER_FLIGHT  # it set the position back to the start
    return claimed


def _take_in(run: OverlappingRun, flight: _InFlight) -> bool:
    """Take a batch whose record ended into the run. Return whether it halts the run."""
    try:
        outcome = flight.outcome()
        outcome.position = None  # the position moved at its claim; the run is past it now
        halted = run.recorded(outcome, flight.span)
    finally:
        flight.taken()
    run.batch_ms.append(flight.claim_ms + flight.work_ms)
    return halted
