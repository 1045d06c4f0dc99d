"""Rate limits for the calls runs make to another system.

A token bucket allows at most ``rate`` calls a second on average, and ``burst`` calls at
once after a quiet spell. When the other system asks for a pause (``429`` with
``Retry-After``), every caller pauses.

- :class:`TokenBucket`: one run's, shared by its workers, in memory.
- :class:`SharedTokenBucket`: one per downstream origin for every run, process and pod,
  kept in PostgreSQL (``downstream_rate_limit``) and counted by the database clock; a run
  takes its tokens in small grants and its pauses are everyone's."""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError

_EPSILON = 1e-9
_WAIT_S = 0.05  # the longest a waiting caller sleeps before it checks the stop request


class TokenBucket:
    """Call ``acquire()`` before each call. A ``rate`` of None means no limit, but pauses
    still apply."""

    def __init__(
        self,
        rate: float | None,
        burst: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if rate is not None and not rate > 0:
            raise ValueError("rate must be positive")
        self.rate = rate
        self.burst = max(1.0, burst if burst is not None else (rate or 1.0) / 10)
        self._clock = clock
        self._tokens = self.burst
        self._at = clock()
        self._paused_until = 0.0
        self._lock = threading.Lock()
        self.waited_s = 0.0  # the time callers spent waiting, summed (the run's slow-down)
        self.pauses = 0  # Retry-After pauses taken
        self.unavailable: str | None = None  # never: nothing outside this process is asked

    def pause(self, seconds: float) -> None:
        """Let no call go for ``seconds`` from now. A pause never shortens an earlier one."""
        with self._lock:
            self._paused_until = max(self._paused_until, self._clock() + max(0.0, seconds))
            self.pauses += 1

    def acquire(self, stop: threading.Event | None = None) -> bool:
        """Wait for a token and return True. Return False, with no token taken, if ``stop``
        is set meanwhile."""
        started: float | None = None
        while True:
            with self._lock:
                now = self._clock()
                wait = self._paused_until - now
                if wait <= 0 and self.rate is None:
                    break
                if wait <= 0 and self.rate is not None:
                    self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
                    self._at = now
                    if self._tokens >= 1.0 - _EPSILON:  # a clock's rounding is no reason to wait
                        self._tokens = max(0.0, self._tokens - 1.0)
                        break
                    wait = (1.0 - self._tokens) / self.rate
                if started is None:
                    started = now
            if stop is not None and stop.is_set():
                return False
            _sleep(min(wait, _WAIT_S), stop)
        if started is not None:
            with self._lock:
                self.waited_s += self._clock() - started
        return True


def _sleep(seconds: float, stop: threading.Event | None) -> None:
    if stop is None:
        time.sleep(seconds)
    else:
        stop.wait(seconds)


class Limiter(Protocol):
    """What a client asks of its rate limiter: :class:`TokenBucket` (one process) or
    :class:`SharedTokenBucket` (the fleet, through PostgreSQL)."""

    waited_s: float
    pauses: int
    unavailable: str | None

    def acquire(self, stop: threading.Event | None = None) -> bool: ...

    def pause(self, seconds: float) -> None: ...


class LimiterUnavailable(Exception):
    """The shared limit could not be read for :data:`GIVE_UP_S`: no call goes without it."""


# --------------------------------------------------------------------------- the fleet's bucket

GRANT_S = 0.05  # a grant holds at most this much of the rate: a database round trip per 50 ms
HOLD_S = 0.1  # tokens granted but unused for this long are dropped, so no run can hoard a burst
GIVE_UP_S = 5.0  # how long the database may fail grants before calls stop going
_RETRY_S = (0.05, 0.1, 0.2, 0.5, 1.0)  # waits between grants that failed, one after another

# Make the origin's row once, with a full bucket.
# Twice: the insert does nothing when the row exists (a rerun, a rival process).
ENSURE_BUCKET = sa.text(
    """
    INSERT INTO downstream_rate_limit (downstream, tokens, counted_at)
    VALUES (:downstream, :burst, coalesce(CAST(:now AS timestamptz), clock_timestamp()))
    ON CONFLICT (downstream) DO NOTHING
    """
)

# Refill the origin's bucket by the database clock since it was last counted (at most :burst
# held), then take up to :want whole tokens, none while a Retry-After pause runs. (:now
# stands in for the clock in tests only.)
# Twice: each run of it takes only the tokens it returns, under the row's lock; counted_at
# never goes back, so a clock read before a wait for that lock counts no second twice.
TAKE_TOKENS = sa.text(
    """
    WITH counted AS (
        SELECT r.downstream,
               greatest(r.counted_at, t.now) AS now,
               least(CAST(:burst AS float8),
                     r.tokens + CAST(:rate AS float8)
                         * greatest(0.0, extract(epoch FROM t.now - r.counted_at)::float8)) AS have,
               r.paused_until
          FROM downstream_rate_limit AS r
         CROSS JOIN (SELECT coalesce(CAST(:now AS timestamptz), clock_timestamp()) AS now) AS t
         WHERE r.downstream = :downstream
           FOR UPDATE OF r
    ), taken AS (
        SELECT c.*,
               CASE WHEN c.paused_until > c.now THEN 0.0
                    ELSE least(CAST(:want AS float8), floor(c.have + 1e-9)) END AS n
          FROM counted AS c
    )
    UPDATE downstream_rate_limit AS r
       SET tokens = greatest(0.0, taken.have - taken.n), counted_at = taken.now
      FROM taken
     WHERE r.downstream = taken.downstream
    RETURNING taken.n AS granted, greatest(0.0, taken.have - taken.n) AS tokens_left,
              extract(epoch FROM greatest(taken.paused_until - taken.now, interval '0'))::float8
                  AS paused_s
    """
)

# A 429's Retry-After holds every run's calls to the origin until then.
# Twice: a pause never shortens an earlier one (greatest), so a second write changes nothing.
PAUSE_ALL = sa.text(
    """
    INSERT INTO downstream_rate_limit AS r (downstream, tokens, counted_at, paused_until)
    VALUES (:downstream, 0, clock_timestamp(), clock_timestamp() + make_interval(secs => :seconds))
    ON CONFLICT (downstream) DO UPDATE
       SET paused_until = greatest(r.paused_until, EXCLUDED.paused_until)
    """
)

# The grant's own transaction waits for no lock and no statement for long: a stuck session
# holding the row fails the grant (and is retried) instead of holding every run up.
SHORT_TIMEOUTS = sa.text(
    "SELECT set_config('lock_timeout', '250ms', true), set_config('statement_timeout', '1s', true)"
)


@dataclass(frozen=True)
class Grant:
    """What one trip to the shared bucket brought back."""

    granted: int  # tokens taken for this process
    tokens_left: float  # what the bucket still holds
    paused_s: float  # how long a Retry-After pause still runs (0: none)


def take_tokens(
    engine: Engine,
    downstream: str,
    rate: float,
    burst: float,
    want: int,
    now: datetime | None = None,
) -> Grant:
    """Take up to ``want`` tokens from ``downstream``'s shared bucket (``rate`` a second, at
    most ``burst`` held), in a transaction of its own that commits at once. ``now`` stands in
    for the database clock in tests."""
    params = {"downstream": downstream, "rate": rate, "burst": burst, "want": want, "now": now}
    with engine.begin() as conn:
        conn.execute(SHORT_TIMEOUTS)
        row = conn.execute(TAKE_TOKENS, params).one_or_none()
        if row is None:  # the origin's first call ever: its row, then the grant
            conn.execute(ENSURE_BUCKET, params)
            row = conn.execute(TAKE_TOKENS, params).one()
    return Grant(int(row.granted), float(row.tokens_left), float(row.paused_s))


def pause_all(engine: Engine, downstream: str, seconds: float) -> None:
    """Pause every run's calls to ``downstream`` for ``seconds`` (a ``429``'s Retry-After)."""
    with engine.begin() as conn:
        conn.execute(SHORT_TIMEOUTS)
        conn.execute(PAUSE_ALL, {"downstream": downstream, "seconds": max(0.0, seconds)})


class SharedTokenBucket:
    """``rate`` calls a second to ``downstream`` for every run, process and pod together, kept
    in PostgreSQL (``downstream_rate_limit``) and counted by the database clock.

    A run takes tokens in small grants (at most :data:`GRANT_S` of the rate, no more than its
    callers waiting, never more than the burst) and hands them to its workers; a token not
    used within :data:`HOLD_S` is dropped. A ``429``'s pause is written to the row, so every
    run pauses. The database is never asked while a transaction of the run is open: each
    grant is one short transaction of its own.

    When the database fails a grant, the bucket tries again after a short wait. Calls wait
    meanwhile; after :data:`GIVE_UP_S` of failures ``acquire`` raises
    :class:`LimiterUnavailable` (no call is sent without the fleet's permission) and
    ``unavailable`` says why, in one line."""

    def __init__(
        self,
        engine: Engine,
        downstream: str,
        rate: float,
        burst: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not rate > 0:
            raise ValueError("rate must be positive")
        self.engine, self.downstream, self.rate = engine, downstream, rate
        self.burst = max(1.0, burst if burst is not None else rate / 10)
        self.grant_max = max(1, min(int(self.burst), math.ceil(rate * GRANT_S)))
        self._clock = clock
        self._cond = threading.Condition()
        self._tokens = 0  # granted to this process, not handed out yet
        self._granted_at = 0.0
        self._not_before = 0.0  # a pause, an empty shared bucket, or a failed grant's wait
        self._asking = False  # one caller at a time goes to the database
        self._waiting = 0  # callers inside acquire: how many tokens to ask for
        self._failing_since: float | None = None
        self._failures = 0
        self._gave_up = False  # failing for GIVE_UP_S: calls fail at once until a grant works
        self.waited_s = 0.0
        self.pauses = 0
        self.grants = 0  # trips to the database that brought tokens back
        self.unavailable: str | None = None  # why the last grant failed, while they fail

    def pause(self, seconds: float) -> None:
        """Let no call of any run go to the origin for ``seconds`` from now."""
        with self._cond:
            self._not_before = max(self._not_before, self._clock() + max(0.0, seconds))
            self._tokens = 0
            self.pauses += 1
        # this run pauses anyway; if the row cannot be written the others meet their own 429
        with contextlib.suppress(SQLAlchemyError):
            pause_all(self.engine, self.downstream, seconds)

    def acquire(self, stop: threading.Event | None = None) -> bool:
        """Wait for a token of the fleet's and return True. Return False, with no token
        taken, if ``stop`` is set meanwhile. Raise :class:`LimiterUnavailable` when the
        database has failed every grant for :data:`GIVE_UP_S`."""
        started: float | None = None
        with self._cond:
            self._waiting += 1
        try:
            while True:
                with self._cond:
                    now = self._clock()
                    if self._tokens and now - self._granted_at > HOLD_S:
                        self._tokens = 0  # held too long: spending them now would be a burst
                    wait = self._not_before - now
                    if wait <= 0 and self._tokens:
                        self._tokens -= 1
                        return True
                    if started is None:
                        started = now
                    if stop is not None and stop.is_set():
                        return False
                    if self._gave_up and (wait > 0 or self._asking):  # fail fast meanwhile
                        raise LimiterUnavailable(
                            f"shared rate limit unavailable: {self.unavailable}"
                        )
                    if wait > 0 or self._asking:  # woken early when the asking caller is back
                        self._cond.wait(min(wait, _WAIT_S) if wait > 0 else _WAIT_S)
                        continue
                    self._asking = True
                    want = min(self.grant_max, self._waiting)
                if self._ask(want):
                    return True
        finally:
            with self._cond:
                self._waiting -= 1
                if started is not None:
                    self.waited_s += self._clock() - started

    def _ask(self, want: int) -> bool:
        """One grant from the database; True when it brought a token for this caller."""
        grant: Grant | None = None
        error: str | None = None
        try:
            grant = take_tokens(self.engine, self.downstream, self.rate, self.burst, want)
        except SQLAlchemyError as exc:
            error = _safe_reason(exc)
        except BaseException:  # never leave the other callers waiting for this one
            with self._cond:
                self._asking = False
                self._cond.notify_all()
            raise
        with self._cond:
            self._asking = False
            now = self._clock()
            self._cond.notify_all()
            if grant is None:
                if self._failing_since is None:
                    self._failing_since = now
                self.unavailable = error
                if now - self._failing_since >= GIVE_UP_S:
                    self._not_before = now + _RETRY_S[-1]  # then one caller asks again
                    self._gave_up = True
                    raise LimiterUnavailable(f"shared rate limit unavailable: {error}")
                self._not_before = now + _RETRY_S[min(self._failures, len(_RETRY_S) - 1)]
                self._failures += 1
                return False
            self._failing_since, self._failures, self.unavailable = None, 0, None
            self._gave_up = False
            if grant.paused_s > 0:
                self._not_before = max(self._not_before, now + grant.paused_s)
            if grant.granted == 0:  # empty: wait until a grant's worth is back
                need = min(want, self.grant_max) - grant.tokens_left
                self._not_before = max(self._not_before, now + max(need, 0.0) / self.rate)
                return False
            self.grants += 1
            self._tokens, self._granted_at = grant.granted - 1, now
            return True


def _safe_reason(exc: SQLAlchemyError) -> str:
    """A database error in one line, naming no server, user or password."""
    orig = getattr(exc, "orig", None) or exc
    code = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    return f"{type(orig).__name__}" + (f" (SQLSTATE {code})" if code else "")
