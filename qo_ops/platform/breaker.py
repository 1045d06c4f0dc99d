"""A circuit breaker for another system, shared by the runs that call it.

``closed``: every call goes. It opens when failures are systemic: at least ``min_calls`` of
the last ``window`` calls answered and ``failure_ratio`` of them failed (a connection error,
a timeout, a 5xx), or ``streak`` calls in a row failed. ``open``: no call goes; the run that
opened it stops calling and ends ``dependency_unavailable``, and the state is written to
``downstream_breaker`` with ``probe_after`` = the database's clock + ``open_s``. ``half_open``
(a run starting after ``probe_after``): ``probes`` calls go, one at a time; when they all
answer it closes, when one fails it opens again.

A ``429`` is neither success nor failure here (the rate limiter handles it); any other
answer (2xx, 4xx) shows the other system is up and counts as a success.

The breaker itself keeps no clock for shared state: a run reads the row, decides from the
database's ``probe_after <= clock_timestamp()``, and writes its transitions back in the
same transactions that record its items.
"""

from __future__ import annotations

import threading
import uuid
from collections import deque
from dataclasses import dataclass, field

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from qo_ops.db.schema import downstream_breaker

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
_WAIT_S = 0.05  # how often a caller waiting for a probe looks at the stop request


@dataclass(frozen=True)
class BreakerSettings:
    """How quickly the breaker opens, and how long it stays open before a probe."""

    # 60 % of the last 50 calls, or 10 in a row: a quarter of calls failing at random (a
    # flaky downstream, not a down one) opens it about once in ten million windows
    window: int = 50
    min_calls: int = 20
    failure_ratio: float = 0.6
    streak: int = 10
    open_s: float = 30.0
    probes: int = 3


@dataclass(frozen=True)
class Transition:
    """One change of state, in the order it happened; ``reason`` is a short code."""

    to: str
    reason: str


@dataclass
class CircuitBreaker:
    """The breaker of one downstream in one run; thread-safe (the run's workers share it)."""

    settings: BreakerSettings = field(default_factory=BreakerSettings)
    state: str = CLOSED
    _recent: deque[bool] = field(default_factory=deque)  # True = failed, newest last
    _streak: int = 0
    _probes_out: int = 0  # half-open: probe calls sent and not yet answered
    _probes_ok: int = 0
    _pending: list[Transition] = field(default_factory=list)  # not yet written
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _changed: threading.Condition = field(init=False)
    opened: int = 0  # how many times it opened in this run
    refused: int = 0  # calls not sent because it was open

    def __post_init__(self) -> None:
        self._changed = threading.Condition(self._lock)

    def allow(self, stop: threading.Event | None = None) -> bool:
        """Whether a call may go: always when closed, never when open. Half-open, the
        ``probes`` go one at a time and the other callers wait for their answers (or for
        ``stop``): then they go when it closed, and not when it opened again."""
        with self._changed:
            while self.state == HALF_OPEN and self._probes_out:
                if stop is not None and stop.is_set():
                    break
                self._changed.wait(_WAIT_S)
            if self.state == CLOSED:
                return True
            if self.state == HALF_OPEN and not self._probes_out:
                self._probes_out = 1
                return True
            self.refused += 1
            return False

    def succeeded(self) -> None:
        """A call got an answer that shows the other system is up."""
        with self._lock:
            self._streak = 0
            if self.state == HALF_OPEN:
                self._probes_out = max(0, self._probes_out - 1)
                self._changed.notify_all()
                self._probes_ok += 1
                if self._probes_ok >= self.settings.probes:
                    self._move(CLOSED, f"probes_answered {self._probes_ok}")
                return
            self._note(False)

    def failed(self, code: str) -> None:
        """A call failed systemically (``code``: connect_error, timeout, http_503 …)."""
        with self._lock:
            self._streak += 1
            if self.state == HALF_OPEN:
                self._probes_out = max(0, self._probes_out - 1)
                self._changed.notify_all()
                self._move(OPEN, f"probe_failed {code}")
                return
            if self.state == OPEN:
                return
            self._note(True)
            failures, calls = sum(self._recent), len(self._recent)
            s = self.settings
            if self._streak >= s.streak:
                self._move(OPEN, f"{code} {self._streak}_in_a_row")
            elif calls >= s.min_calls and failures >= s.failure_ratio * calls:
                self._move(OPEN, f"{code} {failures}/{calls}")

    def neutral(self) -> None:
        """A call that says nothing about health (a 429): a half-open probe slot is freed."""
        with self._lock:
            if self.state == HALF_OPEN:
                self._probes_out = max(0, self._probes_out - 1)
                self._changed.notify_all()

    def half_open(self) -> None:
        """An open breaker whose probe is due: the next call is a probe."""
        with self._lock:
            if self.state == OPEN:
                self._move(HALF_OPEN, "probe_due")

    def drain(self) -> list[Transition]:
        """The transitions since the last drain, oldest first (to write and to report)."""
        with self._lock:
            pending, self._pending = self._pending, []
            return pending

    def _note(self, failed: bool) -> None:
        self._recent.append(failed)
        while len(self._recent) > self.settings.window:
            self._recent.popleft()

    def _move(self, to: str, reason: str) -> None:
        self.state = to
        self._recent.clear()
        self._probes_out = self._probes_ok = 0
        if to == OPEN:
            self.opened += 1
        if to != HALF_OPEN:
            self._streak = 0
        self._pending.append(Transition(to, reason))


def load_breaker(conn: Connection, downstream: str, settings: BreakerSettings) -> CircuitBreaker:
    """The breaker as the shared row leaves it: closed when there is none; an open one whose
    ``probe_after`` has passed (the database's clock) comes back half-open."""
    row = conn.execute(
        sa.select(
            downstream_breaker.c.state,
            (downstream_breaker.c.probe_after <= sa.func.clock_timestamp()).label("due"),
        ).where(downstream_breaker.c.downstream == downstream)
    ).first()
    breaker = CircuitBreaker(settings)
    if row is None or row.state == CLOSED:
        return breaker
    breaker.state = OPEN
    if row.state == HALF_OPEN or row.due:
        breaker.half_open()  # a run that died while probing, or a probe that is due
    return breaker


# The downstream's one shared row takes the last transition of a batch (an ``open`` one sets
# ``opened_at`` and ``probe_after`` from the database clock).
# Twice: the state columns are set, not added to, so the same transition written again
# leaves the same state; only opened_count adds up, and the run's breaker hands each opening
# over once (drained) before it is written.
_SAVE_TRANSITION = sa.text(
    """
    INSERT INTO downstream_breaker AS b
           (downstream, state, opened_at, probe_after, reason, opened_count,
            changed_at, changed_by_run)
    VALUES (:downstream, :state,
            CASE WHEN :state = 'open' THEN clock_timestamp() END,
            CASE WHEN :state = 'open'
                 THEN clock_timestamp() + make_interval(secs => :open_s) END,
            :reason, :opened, clock_timestamp(), :run_id)
    ON CONFLICT (downstream) DO UPDATE
       SET state = excluded.state,
           -- when the outage began: kept while failed probes open it again
           opened_at = CASE WHEN excluded.state = 'open'
                             AND (b.state = 'closed' OR b.opened_at IS NULL)
                            THEN excluded.opened_at
                            WHEN excluded.state = 'closed' THEN NULL
                            ELSE b.opened_at END,
           probe_after = CASE WHEN excluded.state = 'open' THEN excluded.probe_after
                              WHEN excluded.state = 'closed' THEN NULL
                              ELSE b.probe_after END,
           reason = excluded.reason,
           opened_count = b.opened_count + excluded.opened_count,
           changed_at = excluded.changed_at,
           changed_by_run = excluded.changed_by_run
    """
)


def save_transitions(
    conn: Connection,
    downstream: str,
    transitions: list[Transition],
    settings: BreakerSettings,
    run_id: uuid.UUID,
) -> None:
    """Write the last of ``transitions`` to the shared row (an ``open`` one sets
    ``opened_at`` and ``probe_after`` from the database's clock)."""
    if not transitions:
        return
    last = transitions[-1]
    opened = sum(1 for t in transitions if t.to == OPEN)
    conn.execute(
        _SAVE_TRANSITION,
        {
            "downstream": downstream,
            "state": last.to,
            "open_s": settings.open_s,
            "reason": last.reason[:80],
            "opened": opened,
            "run_id": run_id,
        },
    )
