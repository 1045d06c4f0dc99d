"""Overlapped batches: the database work of the batches around a batch runs while that
batch's calls are in flight (``ExternalPhase(overlap=True)``).

    the run's thread:  claim 1 | claim 2           | record 1, claim 3 | record 2, claim 4 ...
    a batch's calls:           | calls 1           | calls 2           | calls 3 ...

Each claim and each record is its own transaction under the lease's guard, on the run's
connection, exactly as in the sequential shape: a claim hides its items (attempt + 1) until
its record or until the claim lapses, and a record writes an item's result only while the
item is still under that claim (same attempt number). What changes is only when they run.

- **Two batches' calls never overlap.** Batch N+1's calls start once every call of batch N
  has answered (or was given up at a stop). So "a batch's calls" stays one set, for the
  breaker's and the retry budget's rules alike (``qo_ops/downstream/calls.py``).
- **At most two batches are claimed and not recorded**: the one whose calls are in flight,
  and the next, claimed ahead. A killed process leaves both claimed; their claims lapse and
  a later run sends them again with the same idempotency keys.
- **The run stops claiming** when it must stop (a signal, the deadline, its item limit, a
  cancel) or when a record says so (the breaker opened, the retry budget is used up). The
  batch in flight and the one claimed ahead are still recorded: what the calls did not send
  is released, its attempt given back (a stop sends no call; an open breaker refuses them).
- **On an error** (the lease lost, the database gone) the run gives up on the batches it
  holds: no further call is sent, nothing more is recorded, and their claims lapse.

Each batch is one ``batch`` span, open from its calls' start to its record, and its calls'
spans are its children.
"""

from __future__ import annotations

import contextvars
import threading
import time
from enum import Enum
from typing import Any, Protocol

from sqlalchemy.engine import Connection

from qo_ops.platform.calls.external import giving_up
from qo_ops.platform.job.counts import SPAN, Counts
from qo_ops.platform.job.options import Limits
from qo_ops.platform.job.outcome import BatchContext, BatchOutcome
from qo_ops.platform.job.spec import ExternalPhase
from qo_ops.platform.observability.tracing import OFF, SpanLike, span
from qo_ops.platform.run.faults import crash_point
from qo_ops.platform.run.stopping import StopSignals

_POLL_S = 0.05  # the run's thread waits for a batch's calls in steps this long (signals)


class OverlappingRun(Protocol):
    """What the overlapped batches need of their run (``runner.JobRun``)."""

    ctx: BatchContext
    stop: StopSignals
    limits: Limits
    batch_ms: list[float]

    def room(self) -> int: ...  # 0 when the run must end now (the summary says why)

    def claim(self, conn: Connection, room: int) -> BatchOutcome | Enum: ...

    def record(
        self, conn: Connection, claimed: BatchOutcome, results: list[Any]
    ) -> BatchOutcome: ...

    def recorded(self, outcome: BatchOutcome, batch_span: SpanLike) -> bool: ...


class _Flight:
    """One claimed batch, from its calls' start to its record. Its calls run on a thread of
    their own, inside the batch's span, which stays open until the record is taken in."""

    def __init__(self, number: int, claimed: BatchOutcome, claimed_at: float) -> None:
        self.number, self.claimed, self.claimed_at = number, claimed, claimed_at
        self.span: SpanLike = OFF
        self._results: list[Any] | None = None
        self._error: BaseException | None = None
        self._answered = threading.Event()
        self._recorded = threading.Event()
        self._give_up = threading.Event()

    def take_off(self, phase: ExternalPhase, run_context: BatchContext) -> _Flight:
        """Start the batch's calls (``phase.call``), in the run's trace context."""
        context = contextvars.copy_context()
        threading.Thread(
            target=context.run,
            args=(self._fly, phase, run_context),
            name="qo-ops-batch",
            daemon=True,
        ).start()
        return self

    def _fly(self, phase: ExternalPhase, run_context: BatchContext) -> None:
        attributes = {"batch.number": self.number, **Counts().event_fields(SPAN)}
        with span("batch", **attributes) as batch_span:
            self.span = batch_span
            try:
                with giving_up(self._give_up):
                    self._results = phase.call(run_context, self.claimed.work)
            except BaseException as exc:  # a bug in the call step: the run fails on it
                self._error = exc
            finally:
                self._answered.set()
            self._recorded.wait()  # the span ends with the batch's record

    def answers(self) -> list[Any]:
        """The batch's call results, once every call answered or was given up."""
        while not self._answered.wait(_POLL_S):  # in steps, so a signal's handler runs
            pass
        if self._error is not None:
            raise self._error
        assert self._results is not None
        return self._results

    def landed(self) -> None:
        """The batch is recorded (or given up): its span may end."""
        self._recorded.set()

    def give_up(self) -> None:
        """Send no further call of this batch and record nothing of it."""
        self._give_up.set()
        self._recorded.set()


def overlapped_batches(run: OverlappingRun, conn: Connection, phase: ExternalPhase) -> None:
    """Run the batches of an overlapping external phase until the work is done or the run
    must stop (the module docstring shows the shape)."""
    flying: _Flight | None = None  # the batch whose calls are in flight
    landed: _Flight | None = None  # the batch whose calls answered, not recorded yet
    ahead: _Flight | None = None  # the batch claimed ahead, its calls not started
    claiming, claims = True, 0
    try:
        while True:
            with run.stop.deferred():  # a signal waits for the batches held to be recorded
                if landed is not None:
                    claiming = _record(run, conn, landed) and claiming
                    landed = None
                if claiming:
                    ahead, claiming = _claim_ahead(run, conn, flying, claims)
                    claims += ahead is not None
                if flying is None:
                    if ahead is None:
                        if run.stop.requested:
                            run.room()  # a signal during the last batches: the run was stopped
                        return
                    flying, ahead = ahead.take_off(phase, run.ctx), None
                    continue
                flying.answers()  # every call of batch N answered: N+1's calls may start
                crash_point("after_external_call")
                landed, flying = flying, None
                if ahead is not None:
                    flying, ahead = ahead.take_off(phase, run.ctx), None
    except BaseException:
        for held in (flying, landed):
            if held is not None:
                held.give_up()  # their claims lapse; a later run sends them again
        raise


def _claim_ahead(
    run: OverlappingRun, conn: Connection, flying: _Flight | None, claims: int
) -> tuple[_Flight | None, bool]:
    """Claim the next batch while ``flying``'s calls are in flight. Return it (or None) and
    whether the run goes on claiming."""
    room = run.room()  # 0: a stop, the deadline or the item limit (the summary says which)
    if room <= 0:
        return None, False
    room -= flying.claimed.processed if flying is not None else 0
    if room <= 0:
        return None, True  # the batch in flight takes what is left; look again after it
    if claims and run.limits.throttle_ms:  # a stop signal wakes it
        run.stop.event.wait(run.limits.throttle_ms / 1000.0)
    started = time.perf_counter()
    claimed = run.claim(conn, room)
    if not isinstance(claimed, BatchOutcome):
        return None, False  # nothing left, or a cancel (the summary says which)
    if claimed.ends_at_claim:  # an open breaker: the claim took nothing and is recorded
        run.recorded(claimed, OFF)
        return None, False
    return _Flight(claims + 1, claimed, started), True


def _record(run: OverlappingRun, conn: Connection, landed: _Flight) -> bool:
    """Record a batch whose calls answered. Return whether the run may go on claiming."""
    try:
        outcome = run.record(conn, landed.claimed, landed.answers())
        halted = run.recorded(outcome, landed.span)
    finally:
        landed.landed()
    run.batch_ms.append((time.perf_counter() - landed.claimed_at) * 1000)
    return not halted
