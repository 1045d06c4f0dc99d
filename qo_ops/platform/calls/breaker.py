"""A circuit breaker for another system, judged on evidence that every run shares.

**Evidence** is the list of outcomes of the recent calls to one downstream, in the order the
calls **started**. A call either *failed* (no answer, a timeout, a 5xx) or was *answered*
(anything else). A ``429`` counts as neither. The evidence lives in the downstream's row
(``downstream_breaker.recent``), so every run, process and pod adds to the same evidence.
Each batch appends its outcomes when it records, and each batch starts from what the row
holds at that moment. Ten runs of two calls during an outage are as much evidence as one run
of twenty.

**Down** means the breaker opens. The downstream is down when either rule holds:

- the last ``streak`` calls all failed (10 in a row), or
- at least ``min_calls`` of the last ``window`` calls are known, and ``failure_ratio`` of
  them failed (60 % of the last 50, from 30 known).

**Why order by start, not by completion.** A call's outcome joins the evidence only once
every call started before it has answered. A batch's slow failures (timeouts) start
scattered among fast answers, but they finish last and together. Counted by completion they
would look like a streak ("the tail"). Counted by start they are what they are, a few
percent. A downstream that is *down* fails every call, in any order. One that is *degraded*
(flaky or slow) answers most calls, so the breaker stays closed. Its failures then belong to
their items, and the retry policy handles them.

**Up** means a failure is the item's own. The downstream is up when at least ``min_calls``
outcomes are known and it is not down. A systemic failure at an item's last attempt
dead-letters the item only when the downstream is up. Otherwise the item is *held*: it keeps
its attempt and retries at its backoff. So an outage seen by a run with a lone item never
dead-letters that item.

The three states:

- ``closed``: every call goes.
- ``open``: no call goes. The run stops with ``dependency_unavailable``, and the row's
  ``probe_after`` is set to the database's clock plus ``open_s``.
- ``half_open``: a run that starts a batch after ``probe_after`` sends ``probes`` calls, one
  at a time. When they all answer, the breaker closes. When one fails, it opens again.

When the breaker opens, the attempts that the failures in the evidence used are owed back to
their items (``downstream_refund``). Each item job gives back its own items' attempts at its
tenant's next claim (``qo_ops/downstream/calls.py``).

The breaker keeps no clock of its own. Staleness (``evidence_s``) and ``probe_after`` are
judged by the database's ``clock_timestamp()``.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from qo_ops.platform.job.labels import CALL_TIMEOUT

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
FAILED, ANSWERED = "F", "S"  # how one call's outcome is written in downstream_breaker.recent
_WAIT_S = 0.05  # a caller waiting for a probe checks the stop request this often (seconds)


@dataclass(frozen=True)
class BreakerSettings:
    """How the breaker judges the evidence, and how long it stays open before a probe."""

    # These defaults tolerate a flaky downstream where a quarter of calls fail at random.
    # Such a downstream makes 10 failures in a row (by start) about once in 2 million calls.
    # It reaches 60 % of the last 50 (from 30 known) about once in 4,000 fresh starts (a
    # quiet downstream's first calls), and never in 2 million calls after that.
    window: int = 50
    min_calls: int = 30
    failure_ratio: float = 0.6
    streak: int = 10
    open_s: float = 30.0
    probes: int = 3
    # Evidence not added to for this long is forgotten, so a quiet downstream starts afresh.
    # It is long enough for the sparse calls of a small backlog to add up.
    evidence_s: float = 900.0


@dataclass
class Evidence:
    """The last ``window`` known outcomes in start order (True means failed), and how many of
    the newest failed in a row."""

    settings: BreakerSettings
    outcomes: deque[bool] = field(default_factory=deque)
    streak: int = 0

    @classmethod
    def from_text(cls, text: str, settings: BreakerSettings) -> Evidence:
        """The evidence a ``recent`` column holds (``F``/``S``, oldest first)."""
        evidence = cls(settings)
        for mark in text[-settings.window :]:
            evidence.add(mark == FAILED)
        return evidence

    def text(self) -> str:
        return "".join(FAILED if failed else ANSWERED for failed in self.outcomes)

    def add(self, failed: bool) -> str | None:
        """Add the next outcome and return the rule it trips (``10_in_a_row``, ``14/20``), or
        None."""
        self.outcomes.append(failed)
        if len(self.outcomes) > self.settings.window:
            self.outcomes.popleft()
        self.streak = self.streak + 1 if failed else 0
        return self.down()

    def down(self) -> str | None:
        """Which rule says the downstream is down, or None."""
        s = self.settings
        if self.streak >= s.streak:
            return f"{self.streak}_in_a_row"
        failures, known = sum(self.outcomes), len(self.outcomes)
        if known >= s.min_calls and failures >= s.failure_ratio * known:
            return f"{failures}/{known}"
        return None

    def up(self) -> bool:
        """Whether enough calls are known and the downstream is not down.

        When this is true, a failure now is the item's own."""
        return len(self.outcomes) >= self.settings.min_calls and self.down() is None


@dataclass(frozen=True)
class Transition:
    """One change of state, in the order it happened. ``reason`` is a short code."""

    to: str
    reason: str


@dataclass(frozen=True)
class SharedState:
    """What the downstream's row says when a batch starts.

    It holds the state, whether an open breaker's probe is due, and the evidence (if it is
    fresh)."""

    state: str = CLOSED
    probe_due: bool = False
    recent: str = ""


@dataclass
class CircuitBreaker:
    """The breaker of one downstream, as one run sees it.

    It is thread-safe because the run's workers share it. Each call takes a ticket (its place
    in start order) from :meth:`allow` and hands it back with its outcome. Outcomes join the
    evidence in ticket order."""

    settings: BreakerSettings = field(default_factory=BreakerSettings)
    state: str = CLOSED
    evidence: Evidence = field(init=False)
    _next_ticket: int = 1
    _next_known: int = 1  # the oldest ticket whose outcome has not joined the evidence
    _answers: dict[int, bool | None] = field(default_factory=dict)  # None means neutral
    _codes: dict[int, str] = field(default_factory=dict)
    _added: list[bool] = field(default_factory=list)  # joined while closed; not shared yet
    _probes_out: int = 0  # probe calls sent while half-open and not answered yet
    _probes_ok: int = 0
    _pending: list[Transition] = field(default_factory=list)  # not written yet
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _changed: threading.Condition = field(init=False)
    opened: int = 0  # how many times this run opened it
    refused: int = 0  # calls not sent because it was open

    def __post_init__(self) -> None:
        self._changed = threading.Condition(self._lock)
        self.evidence = Evidence(self.settings)

    # ------------------------------------------------------------------ one call
    def allow(self, stop: threading.Event | None = None) -> int | None:
        """Return a ticket if a call may go, else None.

        A call may go when the breaker is closed, and never when it is open. When it is
        half-open, the ``probes`` go one at a time. The other callers wait for the probes'
        answers (or for ``stop``). They go if the breaker closed, and not if it opened again.

        When closed, a call may also wait. It waits while the failures that answered ahead of
        earlier calls still in flight would complete the row, should those calls fail too.
        The row is judged first. So an outage whose answers come a little out of order sends
        no more calls than one whose answers come in order."""
        with self._changed:
            while (self.state == HALF_OPEN and self._probes_out) or self._row_pending():
                if stop is not None and stop.is_set():
                    break
                self._changed.wait(_WAIT_S)
            if self.state == HALF_OPEN and not self._probes_out:
                self._probes_out = 1
            elif self.state != CLOSED:
                self.refused += 1
                return None
            ticket = self._next_ticket
            self._next_ticket += 1
            return ticket

    def succeeded(self, ticket: int) -> None:
        """The call got an answer that shows the other system is up."""
        self._answer(ticket, False, "")

    def failed(self, ticket: int, code: str) -> None:
        """The call failed systemically. ``code`` names how (connect_error, timeout, http_503
        …)."""
        self._answer(ticket, True, code)

    def neutral(self, ticket: int) -> None:
        """A call that says nothing about health (a 429, or never sent after all)."""
        self._answer(ticket, None, "")

    def refuse(self, calls: int) -> None:
        """Count ``calls`` not sent because the breaker is open (a batch that took nothing)."""
        with self._lock:
            self.refused += calls

    def _answer(self, ticket: int, failed: bool | None, code: str) -> None:
        with self._lock:
            if self.state == HALF_OPEN and self._probes_out:
                self._probe_answered(failed, code)
            self._answers[ticket] = failed
            self._codes[ticket] = code
            while self._next_known in self._answers:  # in start order, as far as it is known
                known = self._answers.pop(self._next_known)
                failed_code = self._codes.pop(self._next_known)
                self._next_known += 1
                if known is not None and self.state == CLOSED:
                    self._added.append(known)
                    if tripped := self.evidence.add(known):
                        self._move(OPEN, f"{failed_code} {tripped}")
            if failed and self.state == CLOSED and self._row_so_far() >= self.settings.streak:
                self._move(OPEN, f"{code} {self._row_so_far()}_in_a_row")
            self._changed.notify_all()  # a caller may be waiting for the row to be judged

    def _row_pending(self) -> bool:
        """Whether a call should wait for the row to be judged.

        This is so when the breaker is closed, only failures have answered ahead of the calls
        in flight, and there are enough of them to make the row if those calls fail too."""
        ahead = self._answers
        return (
            self.state == CLOSED
            and bool(ahead)
            and all(a is True for a in ahead.values())
            and self.evidence.streak + len(ahead) >= self.settings.streak
        )

    def _row_so_far(self) -> int:
        """Count the failures in a row by start, including timeouts that answered ahead of
        calls still in flight.

        The count is the known evidence's row plus every answer since, as long as each of
        those answers was a timeout. An outage of timeouts answers out of order, yet it still
        opens the breaker at its tenth failure. Any other answer ahead of the evidence ends
        the count. A fast failure may have overtaken slower successes (a 503 needs no work),
        but a timeout never has."""
        ahead = self._answers
        if any(a is not True or self._codes[t] != CALL_TIMEOUT for t, a in ahead.items()):
            return 0
        return self.evidence.streak + len(ahead)

    def _probe_answered(self, failed: bool | None, code: str) -> None:
        self._probes_out = 0
        self._changed.notify_all()
        if failed is None:
            return  # a 429 frees the probe slot again
        if failed:
            self._move(OPEN, f"probe_failed {code}")
            return
        self._probes_ok += 1
        self._added.append(False)  # shared, so runs too small to send every probe add up
        if self._probes_ok >= self.settings.probes:
            self._move(CLOSED, f"probes_answered {self._probes_ok}")

    # ------------------------------------------------------------------ the run's view
    def sync(self, shared: SharedState) -> None:
        """Take up what the shared row says, at a batch's start.

        If the row is closed, the evidence becomes the row's (this run's earlier batches are
        in it). If the row is half-open, this run continues probing from the probes answered
        so far, which may be another run's, alive or not. If the row is open, another run
        opened it and no call goes. An open breaker whose probe is due comes back half-open.
        This run does not write or count another run's transitions.

        A run whose batches overlap may take up the row while calls are in flight: outcomes
        it has not written yet stay in its evidence, and while a transition of its own is
        not written yet, its state is newer than the row's and stays."""
        with self._lock:
            if self._pending:
                return
            if shared.state == CLOSED:
                if self.state != CLOSED:
                    self.state, self._probes_out, self._probes_ok = CLOSED, 0, 0
                unshared = "".join(FAILED if failed else ANSWERED for failed in self._added)
                self.evidence = Evidence.from_text(shared.recent + unshared, self.settings)
            elif shared.state == HALF_OPEN:
                if self.state != HALF_OPEN:
                    answered = len(shared.recent) - len(shared.recent.rstrip(ANSWERED))
                    self.state, self._probes_out, self._probes_ok = HALF_OPEN, 0, answered
            else:
                if self.state != OPEN:
                    self.state, self._probes_out = OPEN, 0
                if shared.probe_due:
                    self._move(HALF_OPEN, "probe_due")

    def up(self) -> bool:
        """Whether the evidence says the downstream is up, so a failure is the item's own."""
        with self._lock:
            return self.state == CLOSED and self.evidence.up()

    def take_added(self) -> str:
        """Take the outcomes that joined the evidence since the last take (``F``/``S``).

        The caller adds them to the shared row."""
        with self._lock:
            added, self._added = self._added, []
            return "".join(FAILED if failed else ANSWERED for failed in added)

    def drain(self) -> list[Transition]:
        """Take the transitions since the last drain, oldest first, to write and report."""
        with self._lock:
            pending, self._pending = self._pending, []
            return pending

    def half_open(self) -> None:
        """Move an open breaker whose probe is due to half-open. The next call is a probe."""
        with self._lock:
            if self.state == OPEN:
                self._move(HALF_OPEN, "probe_due")

    def _move(self, to: str, reason: str) -> None:
        self.state = to
        self.evidence = Evidence(self.settings)  # each state starts from no evidence
        self._added.clear()
        self._probes_out = self._probes_ok = 0
        if to == OPEN:
            self.opened += 1
        self._pending.append(Transition(to, reason))
        self._changed.notify_all()


# --------------------------------------------------------------------- the shared row
@dataclass(frozen=True)
class Spent:
    """A systemic failure that used its item's attempt.

    ``dead`` says it also dead-lettered the item. The attempt is owed back if the breaker
    opens while the failure is in the evidence."""

    side_effect: str
    tenant_id: str
    item_id: str
    attempt: int
    dead: bool = False


@dataclass(frozen=True)
class Shared:
    """What one batch's record did to the shared row.

    ``transitions`` holds this run's transitions, plus any opening judged on the shared
    evidence. ``opened_now`` says whether this record opened the breaker."""

    transitions: list[Transition]
    opened_now: bool


# Read the row as a batch starts: its state, whether an open breaker's probe is due, and its
# evidence unless that went stale. This read takes no lock, because the record step locks.
_READ_SHARED = sa.text(
    """
    SELECT state, coalesce(probe_after <= clock_timestamp(), false) AS probe_due,
           CASE WHEN recent_at > clock_timestamp() - make_interval(secs => :evidence_s)
                THEN recent ELSE '' END AS recent
      FROM downstream_breaker WHERE downstream = :downstream
    """
)


def read_shared(conn: Connection, downstream: str, settings: BreakerSettings) -> SharedState:
    """Read the shared row of ``downstream`` as a batch starts.

    With no row yet, the breaker is closed with no evidence."""
    row = conn.execute(
        _READ_SHARED, {"downstream": downstream, "evidence_s": settings.evidence_s}
    ).first()
    return SharedState() if row is None else SharedState(row.state, row.probe_due, row.recent)


# Lock the row for the rest of the record transaction, creating it closed on first use. The
# wait is short because this is the transaction's last statement.
# Twice: the insert does nothing when the row exists, and locking it again changes nothing.
_ENSURE_ROW = sa.text(
    "INSERT INTO downstream_breaker (downstream, state) VALUES (:downstream, 'closed') "
    "ON CONFLICT (downstream) DO NOTHING"
)
_LOCK_ROW = sa.text(
    """
    SELECT state,
           CASE WHEN recent_at > clock_timestamp() - make_interval(secs => :evidence_s)
                THEN recent ELSE '' END AS recent,
           CASE WHEN recent_at > clock_timestamp() - make_interval(secs => :evidence_s)
                THEN spent ELSE '[]'::jsonb END AS spent
      FROM downstream_breaker WHERE downstream = :downstream FOR UPDATE
    """
)

# Save the row after a batch: its evidence, and its state if this batch changed it.
# An opening sets ``opened_at`` and ``probe_after`` from the database's clock. ``opened_at``
# is kept while failed probes reopen the breaker. ``opened_count`` adds the openings that the
# batch's run made.
# Twice: the evidence and state are set, not added to. opened_count adds what the batch
# counted, and its transaction writes that once (a rolled-back batch writes nothing).
_SAVE_SHARED = sa.text(
    """
    UPDATE downstream_breaker AS b
       SET recent = :recent, spent = CAST(:spent AS jsonb), recent_at = clock_timestamp(),
           state = coalesce(CAST(:state AS text), b.state),
           opened_at = CASE WHEN CAST(:state AS text) = 'open'
                             AND (b.state = 'closed' OR b.opened_at IS NULL)
                            THEN clock_timestamp()
                            WHEN CAST(:state AS text) = 'closed' THEN NULL
                            ELSE b.opened_at END,
           probe_after = CASE WHEN CAST(:state AS text) = 'open'
                              THEN clock_timestamp() + make_interval(secs => :open_s)
                              WHEN CAST(:state AS text) = 'closed' THEN NULL
                              ELSE b.probe_after END,
           opened_count = b.opened_count + :opened,
           reason = coalesce(CAST(:reason AS text), b.reason),
           changed_at = CASE WHEN CAST(:state AS text) IS NULL THEN b.changed_at ELSE clock_timestamp() END,
           changed_by_run = CASE WHEN CAST(:state AS text) IS NULL THEN b.changed_by_run
                                 ELSE CAST(:run_id AS uuid) END
     WHERE downstream = :downstream
    """
)

# When the breaker opens, the attempts of the failures in the evidence are owed back to their
# items. Each item gets one row: its attempt now, how many attempts to give back, and whether
# to bring it back from the dead letters.
# Twice: an item already owed keeps its row. The evidence is cleared when the breaker opens,
# so the same failures are never owed twice.
_OWE = sa.text(
    """
    INSERT INTO downstream_refund (side_effect, tenant_id, item_id, attempt, refund, revive)
    SELECT * FROM unnest(CAST(:side_effects AS text[]), CAST(:tenants AS text[]),
                         CAST(:items AS uuid[]), CAST(:attempts AS bigint[]),
                         CAST(:refunds AS bigint[]), CAST(:revives AS bool[]))
    ON CONFLICT (side_effect, tenant_id, item_id) DO NOTHING
    """
)

# Take (delete) what is owed to a tenant's items of one side effect. The job's claim does
# this in its batch transaction and gives the attempts back before it claims anything.
# Twice: the rows are deleted as they are taken, so a second take finds none.
_TAKE_OWED = sa.text(
    """
    DELETE FROM downstream_refund WHERE side_effect = :side_effect AND tenant_id = :tenant
    RETURNING item_id, attempt, refund, revive
    """
)


@dataclass(frozen=True)
class Owed:
    """Attempts owed back to one item after an outage.

    ``refund`` attempts are given back if the item is still at ``attempt``. ``revive`` says
    the outage dead-lettered the item, so it comes back."""

    item_id: str
    attempt: int
    refund: int
    revive: bool


def take_owed(conn: Connection, side_effect: str, tenant_id: str) -> list[Owed]:
    """Take the attempts owed to ``tenant_id``'s items of ``side_effect`` off the table."""
    rows = conn.execute(_TAKE_OWED, {"side_effect": side_effect, "tenant": tenant_id})
    return [Owed(str(r.item_id), r.attempt, r.refund, r.revive) for r in rows]


@dataclass(frozen=True)
class BatchEvidence:
    """What one recorded batch adds to its downstream's row.

    It names the run that recorded it, the outcomes that joined the run's evidence (in start
    order), the transitions the run made, and the failures that used an attempt."""

    downstream: str
    run_id: uuid.UUID | None  # None: the idle probe (qo_ops.platform.calls.idle_probe)
    added: str
    transitions: list[Transition]
    spent: list[Spent]


def share_batch(conn: Connection, batch: BatchEvidence, settings: BreakerSettings) -> Shared:
    """Add a recorded batch to the downstream's row, under the row's lock, in the record
    transaction.

    The batch's outcomes join the evidence and its run's transitions are written. The shared
    evidence may open the breaker by itself, for runs too small to open it alone. When the
    breaker opens, what the evidence's failures spent is owed back (``downstream_refund``)."""
    conn.execute(_ENSURE_ROW, {"downstream": batch.downstream})
    row = conn.execute(
        _LOCK_ROW, {"downstream": batch.downstream, "evidence_s": settings.evidence_s}
    ).one()
    transitions, added = _after_other_probes(batch, row.state)
    state = transitions[-1].to if transitions else row.state
    # The run's outcomes came after its last transition. With no transition, they follow the
    # row's evidence.
    evidence = Evidence(settings) if transitions else Evidence.from_text(row.recent, settings)
    for mark in added:
        tripped = evidence.add(mark == FAILED)
        if tripped and state == CLOSED:
            state = OPEN
            transitions.append(Transition(OPEN, f"shared {tripped}"))
    answered = len(evidence.outcomes) - sum(evidence.outcomes)
    if state == HALF_OPEN and not evidence.streak and answered >= settings.probes:
        state = CLOSED  # the probes of several small runs all answered
        transitions.append(Transition(CLOSED, f"probes_answered {answered} shared"))
        evidence = Evidence(settings)
    earlier = _entries(row.spent)
    if transitions and transitions[-1].to == CLOSED:
        earlier = []  # probes closed it, so earlier failures are no longer in the evidence
    spent = [*earlier, *batch.spent][-settings.window :]
    if state != CLOSED:  # what the failures spent is owed back now
        _owe(conn, spent)
        spent = []
    if state == OPEN:
        evidence = Evidence(settings)  # an open breaker starts from no evidence
    opened = sum(1 for t in transitions if t.to == OPEN)
    if row.state == OPEN and transitions and transitions[0].to == OPEN:
        opened -= 1  # another run opened it first, and this run only saw it open
    last = transitions[-1] if transitions else None
    conn.execute(
        _SAVE_SHARED,
        {
            "downstream": batch.downstream,
            "recent": evidence.text(),
            "spent": json.dumps([_entry(s) for s in spent]),
            "state": last.to if last is not None else None,
            "reason": last.reason[:80] if last is not None else None,
            "opened": opened,
            "open_s": settings.open_s,
            "run_id": batch.run_id,
        },
    )
    opened_now = state == OPEN and row.state != OPEN
    return Shared(transitions, opened_now)


def _after_other_probes(batch: BatchEvidence, row_state: str) -> tuple[list[Transition], str]:
    """The batch's transitions and outcomes to write over a row in ``row_state``.

    A run that took up an open breaker whose probe was due half-opened it and probed. If the
    row is no longer open when it records, another prober (a run, or the idle probe) has
    half-opened or decided it meanwhile. Then the run's half-open is not written twice. Over
    a half-open row its probes join the ones there. Over a closed row its verdict is not
    written either: its probe's answer joins the evidence (a failed probe as one failure)."""
    transitions, added = list(batch.transitions), batch.added
    if not transitions or transitions[0].to != HALF_OPEN or row_state == OPEN:
        return transitions, added
    rest = transitions[1:]
    if row_state == HALF_OPEN or not rest:
        return rest, added
    if rest[0].to == OPEN:  # its probe failed: one failure of a closed downstream
        added = FAILED + added
    return rest[1:], added  # what happened after its probes' verdict still counts


def _entry(spent: Spent) -> list[Any]:
    return [spent.side_effect, spent.tenant_id, spent.item_id, spent.attempt, spent.dead]


def _entries(raw: Any) -> list[Spent]:
    return [Spent(str(s), str(t), str(i), int(a), bool(d)) for s, t, i, a, d in raw or []]


def _owe(conn: Connection, spent: list[Spent]) -> None:
    """Owe each item what its failures in the evidence spent.

    Each item gets one row, at its latest attempt, with one attempt back per failure."""
    owed: dict[tuple[str, str], tuple[str, int, int, bool]] = {}
    for s in spent:
        tenant, attempt, refund, revive = owed.get(
            (s.side_effect, s.item_id), (s.tenant_id, 0, 0, False)
        )
        owed[(s.side_effect, s.item_id)] = (
            tenant,
            max(attempt, s.attempt),
            refund + 1,
            revive or s.dead,
        )
    if not owed:
        return
    keys, values = list(owed), list(owed.values())
    conn.execute(
        _OWE,
        {
            "side_effects": [k[0] for k in keys],
            "items": [k[1] for k in keys],
            "tenants": [v[0] for v in values],
            "attempts": [v[1] for v in values],
            "refunds": [v[2] for v in values],
            "revives": [v[3] for v in values],
        },
    )
