"""Probing an open breaker when no run has work to probe it with.

A run probes an open breaker only when it starts a batch after ``probe_after``. With no work
queued, no run comes, and the breaker would stay open after the downstream returned. The
idle probe does the run's half-open probe without a run: for each shared row that is open
with its probe due, it sends the breaker's ``probes`` calls one at a time through a
:class:`~qo_ops.platform.calls.breaker.CircuitBreaker` and writes the verdict with
:func:`~qo_ops.platform.calls.breaker.share_batch`. So the rules are the run's: when every
probe is answered the breaker closes, when one fails it opens again for ``open_s`` (its
``opened_at`` kept), and a ``429`` is neither.

**No double transitions.** The probe is taken first, by a conditional update that moves an
open, due row's ``probe_after`` on by :data:`PROBE_LEASE_S`. A run that reads the row after
that sees the breaker open and not due, and claims nothing. Another prober's update matches
nothing. The verdict is written under the row's lock, only while the row is still the one
this probe took (open, ``probe_after`` unchanged). If a run's half-open probe, started just
before, wrote its own verdict meanwhile, this probe's is dropped. When the probe cannot be
made (a bad origin), the row stays open and the next probe comes after the lease.

The platform does not know how to call the downstream. The caller passes ``ask``: one probe
call to an origin, whose answer it tells the breaker it is given (through ``allow`` and
``succeeded``/``failed``/``neutral``, as the run's client does).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from qo_ops.errors import one_line
from qo_ops.platform.calls.breaker import (
    HALF_OPEN,
    OPEN,
    BatchEvidence,
    BreakerSettings,
    CircuitBreaker,
    SharedState,
    Transition,
    share_batch,
)

PROBE_LEASE_S = 60.0  # how long a taken probe keeps runs and other probers off the row
IDLE = "idle_probe"  # appended to the reason of the transitions the idle probe writes
MAX_DUE = 50  # the most rows probed in one pass

# The rows whose breaker is open with its probe due, the longest due first.
_DUE = sa.text(
    """
    SELECT downstream FROM downstream_breaker
     WHERE state = 'open' AND probe_after <= clock_timestamp()
     ORDER BY probe_after, downstream LIMIT :limit
    """
)
# Take the probe: only a row still open and due moves its probe_after on by the lease.
# Twice: the second update finds the probe no longer due and matches nothing.
_TAKE = sa.text(
    """
    UPDATE downstream_breaker
       SET probe_after = clock_timestamp() + make_interval(secs => :lease_s)
     WHERE downstream = :downstream AND state = 'open' AND probe_after <= clock_timestamp()
    RETURNING probe_after
    """
)
# Lock the row for the verdict, if it is still the one this probe took.
_STILL_TAKEN = sa.text(
    """
    SELECT 1 FROM downstream_breaker
     WHERE downstream = :downstream AND state = 'open' AND probe_after = :taken
       FOR UPDATE
    """
)


@dataclass(frozen=True)
class ProbeReport:
    """What the idle probe did to one downstream's breaker.

    ``outcome`` is ``closed``, ``open`` (failed again), ``half_open`` (no verdict yet: only
    429s), ``taken`` (another prober or a run got there first) or ``not_probed`` (the call
    could not be made). ``reason`` is a short code or a one-line error."""

    downstream: str
    outcome: str
    reason: str

    def line(self) -> str:
        """One line for people, e.g. ``http://127.0.0.1:8089 closed (probes_answered 3)``."""
        return f"{self.downstream} {self.outcome} ({self.reason})"


Ask = Callable[[str, CircuitBreaker], None]


def probe_idle_breakers(engine: Engine, settings: BreakerSettings, ask: Ask) -> list[ProbeReport]:
    """Probe every open breaker whose probe is due, and write each verdict on its row.

    ``ask(origin, breaker)`` sends one probe call. Each downstream is probed on its own,
    with no transaction open during its calls."""
    with engine.connect() as conn:
        due = list(conn.execute(_DUE, {"limit": MAX_DUE}).scalars())
    return [_probe(engine, str(downstream), settings, ask) for downstream in due]


def _probe(engine: Engine, downstream: str, settings: BreakerSettings, ask: Ask) -> ProbeReport:
    """Take one row's probe, send its calls, and write the verdict if the row is still ours."""
    with engine.begin() as conn:
        taken = conn.execute(_TAKE, {"downstream": downstream, "lease_s": PROBE_LEASE_S}).scalar()
    if taken is None:
        return ProbeReport(downstream, "taken", "probed by another prober or a run")
    breaker = CircuitBreaker(settings)
    breaker.sync(SharedState(OPEN, probe_due=True))  # half-open, as a run's would be
    try:
        for _ in range(2 * settings.probes):  # a 429 frees the slot; a few of those are allowed
            if breaker.state != HALF_OPEN:
                break
            ask(downstream, breaker)
    except Exception as exc:  # a bad origin: the row stays open, probed again after the lease
        return ProbeReport(downstream, "not_probed", one_line(f"{type(exc).__name__}: {exc}", 200))
    transitions = [Transition(t.to, f"{t.reason} {IDLE}") for t in breaker.drain()]
    with engine.begin() as conn:
        if conn.execute(_STILL_TAKEN, {"downstream": downstream, "taken": taken}).first() is None:
            return ProbeReport(downstream, "taken", "a run's probe decided first")
        evidence = BatchEvidence(downstream, None, breaker.take_added(), transitions, [])
        shared = share_batch(conn, evidence, settings)
    last = shared.transitions[-1]
    return ProbeReport(downstream, last.to, last.reason.removesuffix(f" {IDLE}"))
