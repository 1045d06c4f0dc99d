"""A circuit breaker for another system, judged on evidence that every run shares.

**Evidence** is the outcomes of the recent calls to one downstream — *failed* (no answer, a
timeout, a 5xx) or *answered* (anything else; a ``429`` is neither) — in the order the calls
**started**. It lives in the downstream's row (``downstream_breaker.recent``), so every run,
process and pod adds to the same evidence: each batch appends its outcomes when it records,
and each batch starts from what the row holds then. Ten runs of two calls during an outage
are as much evidence as one run of twenty.

**Down** (the breaker opens) when, over that evidence:

- the last ``streak`` calls all failed (10 in a row), or
- at least ``min_calls`` of the last ``window`` calls are known and ``failure_ratio`` of them
  failed (60 % of the last 50, from 30 known).

**Why by start, not by completion.** A call's outcome joins the evidence only once every call
started before it has answered. A batch's slow failures (timeouts) start scattered among fast
answers but finish last and together: counted by completion they are a streak ("the tail"),
counted by start they are what they are, a few percent. A downstream that is *down* fails
every call, in any order; one that is *degraded* (flaky, slow) answers most of them and stays
closed: its failures are its items' own, and the retry policy handles them.

**Up** (a failure is the item's own): at least ``min_calls`` known and not down. A systemic
failure at an item's last attempt dead-letters it only when the downstream is up; otherwise
the item is *held* (it keeps its attempt and retries at its backoff), so an outage seen by a
run with a lone item never dead-letters it.

``closed``: every call goes. ``open``: no call goes; the run stops (``dependency_unavailable``)
and the row's ``probe_after`` is the database's clock + ``open_s``. ``half_open`` (a run
starting a batch after ``probe_after``): ``probes`` calls go, one at a time; when they all
answer it closes, when one fails it opens again. When it opens, the attempts that the failures
in the evidence used are owed back to their items (``downstream_refund``): each item job gives
back its own, at its tenant's next claim (``qo_ops/downstream/calls.py``).

The breaker keeps no clock of its own: staleness (``evidence_s``) and ``probe_after`` are
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
FAILED, ANSWERED = "F", "S"  # one call's outcome in ``downstream_breaker.recent``
_WAIT_S = 0.05  # how often a caller waiting for a probe looks at the stop request


@dataclass(frozen=True)
class BreakerSettings:
    """How the breaker judges the evidence, and how long it stays open before a probe."""

    # a quarter of calls failing at random (flaky, not down) makes 10 in a row by start
    # about once in 2 million calls, and 60 % of the last 50 (from 30 known) about once in
    # 4,000 fresh starts (a quiet downstream's first calls) and never in 2 million after
    window: int = 50
    min_calls: int = 30
    failure_ratio: float = 0.6
    streak: int = 10
    open_s: float = 30.0
    probes: int = 3
    # evidence last added to longer ago than this is forgotten (a quiet downstream starts
    # afresh); long enough for the sparse calls of a small backlog to add up
    evidence_s: float = 900.0


@dataclass
class Evidence:
    """The last ``window`` known outcomes in start order (True = failed), and how many of the
    newest failed in a row."""

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
        """Add the next outcome; the rule it trips (``10_in_a_row``, ``14/20``), or None."""
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
        """Enough known calls and not down: a failure now is the item's own."""
        return len(self.outcomes) >= self.settings.min_calls and self.down() is None


@dataclass(frozen=True)
class Transition:
    """One change of state, in the order it happened; ``reason`` is a short code."""

    to: str
    reason: str


@dataclass(frozen=True)
class SharedState:
    """What the downstream's row says when a batch starts: its state, whether an open
    breaker's probe is due, and its (fresh) evidence."""

    state: str = CLOSED
    probe_due: bool = False
    recent: str = ""


@dataclass
class CircuitBreaker:
    """The breaker of one downstream as one run sees it; thread-safe (the run's workers share
    it). Each call takes a ticket (its place in start order) from :meth:`allow` and hands it
    back with its outcome; outcomes join the evidence in ticket order."""

    settings: BreakerSettings = field(default_factory=BreakerSettings)
    state: str = CLOSED
    evidence: Evidence = field(init=False)
    _next_ticket: int = 1
    _next_known: int = 1  # the oldest ticket whose outcome has not joined the evidence
    _answers: dict[int, bool | None] = field(default_factory=dict)  # None: neutral
    _codes: dict[int, str] = field(default_factory=dict)
    _added: list[bool] = field(default_factory=list)  # joined while closed, not yet shared
    _probes_out: int = 0  # half-open: probe calls sent and not yet answered
    _probes_ok: int = 0
    _pending: list[Transition] = field(default_factory=list)  # not yet written
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _changed: threading.Condition = field(init=False)
    opened: int = 0  # how many times this run opened it
    refused: int = 0  # calls not sent because it was open

    def __post_init__(self) -> None:
        self._changed = threading.Condition(self._lock)
        self.evidence = Evidence(self.settings)

    # ------------------------------------------------------------------ one call
    def allow(self, stop: threading.Event | None = None) -> int | None:
        """A ticket if a call may go (when closed; never when open), else None. Half-open,
        the ``probes`` go one at a time and the other callers wait for their answers (or for
        ``stop``): then they go when it closed, and not when it opened again. Closed, a call
        waits while failures answered ahead of earlier calls still in flight would make the
        row if those failed too: the row is judged first, so an outage whose answers come a
        little out of order sends no more calls than one whose answers come in order."""
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
        """The call failed systemically (``code``: connect_error, timeout, http_503 …)."""
        self._answer(ticket, True, code)

    def neutral(self, ticket: int) -> None:
        """A call that says nothing about health (a 429, or never sent after all)."""
        self._answer(ticket, None, "")

    def _answer(self, ticket: int, failed: bool | None, code: str) -> None:
        with self._lock:
            if self.state == HALF_OPEN and self._probes_out:
                self._probe_answered(failed, code)
            self._answers[ticket] = failed
            self._codes[ticket] = code
            while self._next_known in self._answers:  # in start order, as far as known
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
        """Closed, with nothing but failures answered ahead of the calls in flight, and
        enough of them to make the row should those calls fail too."""
        ahead = self._answers
        return (
            self.state == CLOSED
            and bool(ahead)
            and all(a is True for a in ahead.values())
            and self.evidence.streak + len(ahead) >= self.settings.streak
        )

    def _row_so_far(self) -> int:
        """Failures in a row by start, counting timeouts that answered ahead of calls still
        in flight: the known evidence's row, then every answer since, as long as each was a
        timeout (an outage of timeouts answers out of order, yet opens at its tenth
        failure). Any other answer ahead of the evidence ends it: a fast failure may have
        overtaken slower successes (a 503 needs no work), a timeout never has."""
        ahead = self._answers
        if any(a is not True or self._codes[t] != CALL_TIMEOUT for t, a in ahead.items()):
            return 0
        return self.evidence.streak + len(ahead)

    def _probe_answered(self, failed: bool | None, code: str) -> None:
        self._probes_out = 0
        self._changed.notify_all()
        if failed is None:
            return  # a 429: the probe slot is free again
        if failed:
            self._move(OPEN, f"probe_failed {code}")
            return
        self._probes_ok += 1
        self._added.append(False)  # shared: runs too small to send every probe add up
        if self._probes_ok >= self.settings.probes:
            self._move(CLOSED, f"probes_answered {self._probes_ok}")

    # ------------------------------------------------------------------ the run's view
    def sync(self, shared: SharedState) -> None:
        """At a batch's start: take up what the shared row says. Closed there, the evidence
        is the row's (this run's earlier batches are in it); half-open there, this run
        probes on from the probes answered so far (another run's, alive or not); open there
        (another run opened it), no call goes, and an open breaker whose probe is due comes
        back half-open. Another run's transitions are not this run's to write or count."""
        with self._lock:
            if shared.state == CLOSED:
                if self.state != CLOSED:
                    self.state, self._probes_out, self._probes_ok = CLOSED, 0, 0
                self.evidence = Evidence.from_text(shared.recent, self.settings)
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
        """Whether the evidence says the downstream is up (a failure is the item's own)."""
        with self._lock:
            return self.state == CLOSED and self.evidence.up()

    def take_added(self) -> str:
        """The outcomes that joined the evidence since the last take (``F``/``S``), to add
        to the shared row."""
        with self._lock:
            added, self._added = self._added, []
            return "".join(FAILED if failed else ANSWERED for failed in added)

    def drain(self) -> list[Transition]:
        """The transitions since the last drain, oldest first (to write and to report)."""
        with self._lock:
            pending, self._pending = self._pending, []
            return pending

    def half_open(self) -> None:
        """An open breaker whose probe is due: the next call is a probe."""
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
    """A systemic failure that used its item's attempt (``dead``: and dead-lettered it): owed
    back if the breaker opens while it is in the evidence."""

    side_effect: str
    tenant_id: str
    item_id: str
    attempt: int
    dead: bool = False


@dataclass(frozen=True)
class Shared:
    """What one batch's record did to the shared row: the transitions (this run's, and an
    opening judged on the shared evidence), and whether it opened the breaker just now."""

    transitions: list[Transition]
    opened_now: bool


# The row as a batch starts: its state, whether an open breaker's probe is due, and its
# evidence unless it went stale. Read without a lock: the record step locks.
_READ_SHARED = sa.text(
    """
    SELECT state, coalesce(probe_after <= clock_timestamp(), false) AS probe_due,
           CASE WHEN recent_at > clock_timestamp() - make_interval(secs => :evidence_s)
                THEN recent ELSE '' END AS recent
      FROM downstream_breaker WHERE downstream = :downstream
    """
)


def read_shared(conn: Connection, downstream: str, settings: BreakerSettings) -> SharedState:
    """The shared row of ``downstream`` as a batch starts (closed with no evidence if none)."""
    row = conn.execute(
        _READ_SHARED, {"downstream": downstream, "evidence_s": settings.evidence_s}
    ).first()
    return SharedState() if row is None else SharedState(row.state, row.probe_due, row.recent)


# The row, locked for the rest of the record transaction (a short wait: the statement is
# the transaction's last), created closed on first use.
# Twice: the insert does nothing when the row exists; locking it again changes nothing.
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

# The row after a batch: its evidence, and its state when this batch changed it (an opening
# sets ``opened_at`` — kept while failed probes reopen it — and ``probe_after`` from the
# database's clock; ``opened_count`` adds the openings the batch's run made).
# Twice: the evidence and state are set, not added to; opened_count adds what the batch
# counted, which its transaction writes once (a rolled-back batch writes nothing).
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

# An opening owes the attempts of the failures in the evidence back to their items, one row
# per item (its attempt now, how many to give back, whether to bring it back from the dead).
# Twice: an item already owed keeps its row (the evidence is cleared when it opens, so the
# same failures are never owed twice).
_OWE = sa.text(
    """
    INSERT INTO downstream_refund (side_effect, tenant_id, item_id, attempt, refund, revive)
    SELECT * FROM unnest(CAST(:side_effects AS text[]), CAST(:tenants AS text[]),
                         CAST(:items AS uuid[]), CAST(:attempts AS bigint[]),
                         CAST(:refunds AS bigint[]), CAST(:revives AS bool[]))
    ON CONFLICT (side_effect, tenant_id, item_id) DO NOTHING
    """
)

# What is owed to a tenant's items of one side effect, taken (deleted) by the job's claim in
# its batch transaction, which gives it back before it claims anything.
# Twice: the rows are deleted as they are taken; a second take finds none.
_TAKE_OWED = sa.text(
    """
    DELETE FROM downstream_refund WHERE side_effect = :side_effect AND tenant_id = :tenant
    RETURNING item_id, attempt, refund, revive
    """
)


@dataclass(frozen=True)
class Owed:
    """Attempts owed back to one item after an outage: ``refund`` of them, if it is still at
    ``attempt``; ``revive``: it was dead-lettered by the outage and comes back."""

    item_id: str
    attempt: int
    refund: int
    revive: bool


def take_owed(conn: Connection, side_effect: str, tenant_id: str) -> list[Owed]:
    """The attempts owed to ``tenant_id``'s items of ``side_effect``, taken off the table."""
    rows = conn.execute(_TAKE_OWED, {"side_effect": side_effect, "tenant": tenant_id})
    return [Owed(str(r.item_id), r.attempt, r.refund, r.revive) for r in rows]


@dataclass(frozen=True)
class BatchEvidence:
    """What one recorded batch adds to its downstream's row: who recorded it, the outcomes
    that joined its run's evidence (start order), the transitions its run made, and the
    failures that used an attempt."""

    downstream: str
    run_id: uuid.UUID
    added: str
    transitions: list[Transition]
    spent: list[Spent]


def share_batch(conn: Connection, batch: BatchEvidence, settings: BreakerSettings) -> Shared:
    """Add a recorded batch to the downstream's row, under its lock, in the record
    transaction: its outcomes join the evidence, its run's transitions are written, and the
    shared evidence may open the breaker itself (runs too small to open it alone). When it
    opens, what the evidence's failures spent is owed back (``downstream_refund``)."""
    conn.execute(_ENSURE_ROW, {"downstream": batch.downstream})
    row = conn.execute(
        _LOCK_ROW, {"downstream": batch.downstream, "evidence_s": settings.evidence_s}
    ).one()
    transitions = list(batch.transitions)
    state = transitions[-1].to if transitions else row.state
    # the run's outcomes came after its last transition; with none, they follow the row's
    evidence = Evidence(settings) if transitions else Evidence.from_text(row.recent, settings)
    for mark in batch.added:
        tripped = evidence.add(mark == FAILED)
        if tripped and state == CLOSED:
            state = OPEN
            transitions.append(Transition(OPEN, f"shared {tripped}"))
    answered = len(evidence.outcomes) - sum(evidence.outcomes)
    if state == HALF_OPEN and not evidence.streak and answered >= settings.probes:
        state = CLOSED  # the probes of several small runs, all answered
        transitions.append(Transition(CLOSED, f"probes_answered {answered} shared"))
        evidence = Evidence(settings)
    earlier = _entries(row.spent)
    if transitions and transitions[-1].to == CLOSED:
        earlier = []  # its probes closed it: what failed before is not in the evidence now
    spent = [*earlier, *batch.spent][-settings.window :]
    if state != CLOSED:  # what the failures spent is owed back now
        _owe(conn, spent)
        spent = []
    if state == OPEN:
        evidence = Evidence(settings)  # an open breaker starts from no evidence
    opened = sum(1 for t in transitions if t.to == OPEN)
    if row.state == OPEN and transitions and transitions[0].to == OPEN:
        opened -= 1  # another run opened it first: this run only saw it so
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


def _entry(spent: Spent) -> list[Any]:
    return [spent.side_effect, spent.tenant_id, spent.item_id, spent.attempt, spent.dead]


def _entries(raw: Any) -> list[Spent]:
    return [Spent(str(s), str(t), str(i), int(a), bool(d)) for s, t, i, a, d in raw or []]


def _owe(conn: Connection, spent: list[Spent]) -> None:
    """Owe each item what its failures in the evidence spent: one row per item, at its
    latest attempt, one attempt back per failure."""
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
