"""The nemesis's invariant checker: plain functions over a connection to the database and
the simulator's ``GET /admin/stats`` (with ``detail``), each returning what it found wrong,
one line each, never a payload or a personal datum. ``check_all`` runs them all after the
faults were healed and a final clean pass ran.

- side_effects: no lost or doubled side effect at the simulator (deliveries, notifications);
- events: one outbox event per transition, and no event without its transition;
- runs: no run left ``running`` (nor ``accepted``/``awaiting_approval``);
- leases_and_claims: no lease, claimed item or claimed event past its time;
- audit: every execute a person asked for has its ``allowed`` audit row;
- outcome_checks: every run of the final clean pass ended well with every check passed;
- manners: an outage dead-letters nothing and is the only thing that opens the breaker.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

SHOWN = 5  # examples named per finding; the count says how many more
# After an outage is healed, calls made during it are still being recorded for this long.
OUTAGE_SLACK = timedelta(seconds=5)
# Codes of a call that got no answer, or a 5xx: the downstream was down, not the item bad.
SYSTEMIC_CODES = ("timeout", "connect_error", "connection_reset", "transport_error")
# Codes of a call that may have landed without our knowing (qo_ops.downstream.calls:
# outcome_unknown, ``<code>_after_send``); a timeout only when it came while reading/writing.
UNKNOWN_OUTCOME_CODES = ("connection_reset", "bad_response")
UNKNOWN_OUTCOME_TIMEOUTS = ("ReadTimeout", "WriteTimeout")
ENDED_WELL = ("success", "no_work", "partial_success")  # partial: the demo's poison items


@dataclass(frozen=True)
class Violation:
    """One broken invariant: which, and what was seen."""

    invariant: str
    what: str

    def __str__(self) -> str:
        return f"{self.invariant}: {self.what}"


@dataclass(frozen=True)
class FinalRun:
    """A run of the final clean pass: its (job, scope), exit code and ``--json`` summary."""

    target: str
    exit_code: int | None
    summary: dict[str, Any] | None


@dataclass(frozen=True)
class Outage:
    """When the downstream was out (database clock), in which iteration of the nemesis."""

    iteration: int
    began: datetime
    ended: datetime


@dataclass(frozen=True)
class Evidence:
    """What the checker needs besides the database and the simulator: when the nemesis
    began (database clock), the outages' windows, and the final clean pass."""

    since: datetime
    outages: Sequence[Outage] = ()
    final_runs: Sequence[FinalRun] = field(default_factory=list)


def _named(rows: Iterable[Any], name: Callable[[Any], str], what: str) -> list[str]:
    """One finding for ``rows`` (if any): how many, and the first few named."""
    found = list(rows)
    if not found:
        return []
    shown = ", ".join(name(r) for r in found[:SHOWN])
    more = f" and {len(found) - SHOWN} more" if len(found) > SHOWN else ""
    return [f"{len(found)} {what}: {shown}{more}"]


def _unknown_outcome(code: str | None, message: str | None) -> bool:
    """Whether an item's last error says its call may have landed (no answer came back)."""
    if code in UNKNOWN_OUTCOME_CODES:
        return True
    return code == "timeout" and (message or "").endswith(UNKNOWN_OUTCOME_TIMEOUTS)


# ------------------------------------------------------------------ side effects

TOUCHED_ITEMS = sa.text(
    "SELECT id, business_key, status, last_error_code, last_error_message "
    "FROM delivery_attempt_item WHERE updated_at >= :since ORDER BY id"
)
KNOWN_KEYS = sa.text(
    "SELECT business_key FROM delivery_attempt_item WHERE business_key = ANY(:keys)"
)
PUBLISHED_SINCE = sa.text("SELECT id FROM outbox_event WHERE published_at >= :since ORDER BY id")
EVENTS_BY_ID = sa.text(
    "SELECT id::text AS id, published_at IS NOT NULL AS published, "
    "dead_lettered_at IS NOT NULL AS dead, last_error_code "
    "FROM outbox_event WHERE id::text = ANY(:ids)"
)


def lost_or_doubled_deliveries(
    conn: Connection, stats: dict[str, Any], since: datetime
) -> list[str]:
    """Every item delivered in the nemesis is one delivery at the simulator; the simulator
    has nothing for an item still READY or dead-lettered unless its last call's outcome was
    unknown; and nothing for a key qo-ops does not have."""
    at_simulator: dict[str, int] = stats["deliveries_by_key"]
    items = conn.execute(TOUCHED_ITEMS, {"since": since}).all()
    lost = [i for i in items if i.status == "DELIVERED" and i.business_key not in at_simulator]
    unrecorded = [
        i
        for i in items
        if i.status in ("READY", "DEAD_LETTER")
        and i.business_key in at_simulator
        and not _unknown_outcome(i.last_error_code, i.last_error_message)
    ]
    known = set(conn.execute(KNOWN_KEYS, {"keys": list(at_simulator)}).scalars())
    unknown = sorted(set(at_simulator) - known)
    return [
        *_named(lost, lambda i: f"{i.id}", "items DELIVERED that the simulator never got"),
        *_named(
            unrecorded,
            lambda i: f"{i.id} {i.status} (last error {i.last_error_code})",
            "items the simulator has but qo-ops did not record as delivered",
        ),
        *_named(unknown, str, "deliveries at the simulator for a key qo-ops does not have"),
    ]


def lost_or_doubled_notifications(
    conn: Connection, stats: dict[str, Any], since: datetime
) -> list[str]:
    """Every event published in the nemesis is known by the sink by its id (once: the sink
    dedupes); the sink knows no event qo-ops has not recorded as published unless its last
    call's outcome was unknown, and no event qo-ops does not have."""
    at_sink: dict[str, int] = stats["notifications_by_event"]
    published = [str(i) for i in conn.execute(PUBLISHED_SINCE, {"since": since}).scalars()]
    lost = [e for e in published if e not in at_sink]
    rows = {r.id: r for r in conn.execute(EVENTS_BY_ID, {"ids": list(at_sink)})}
    unknown = sorted(set(at_sink) - set(rows))
    unrecorded = [
        r
        for r in rows.values()
        if not r.published and r.last_error_code not in (*UNKNOWN_OUTCOME_CODES, "timeout")
    ]
    return [
        *_named(lost, str, "events published that the sink never got"),
        *_named(
            unrecorded,
            lambda r: (
                f"{r.id} ({'dead-lettered' if r.dead else 'unpublished'}, last error "
                f"{r.last_error_code})"
            ),
            "events the sink has but qo-ops did not record as published",
        ),
        *_named(unknown, str, "notifications at the sink for an event qo-ops does not have"),
    ]


# ------------------------------------------------------------------ one event per transition

# Each transition's rows and how many events of its type name it (0 or 2+ is wrong).
QUOTES_WITHOUT_ONE_EVENT = sa.text(
    """
    SELECT q.id, count(e.id) AS events FROM quote q
      LEFT JOIN outbox_event e ON e.aggregate_type = 'quote' AND e.event_type = 'QuoteExpired'
                              AND e.aggregate_id = q.id::text
     WHERE q.status = 'EXPIRED' GROUP BY q.id HAVING count(e.id) <> 1 ORDER BY q.id
    """
)
# Sessions the job closed: with an event, or closed an hour or more after their last
# activity (abandoned_checkout_close's own predicate; the app's closes come minutes after).
CHECKOUTS_WITHOUT_ONE_EVENT = sa.text(
    """
    SELECT s.id, count(e.id) AS events FROM checkout_session s
      LEFT JOIN outbox_event e ON e.aggregate_type = 'checkout'
                              AND e.event_type = 'CheckoutAbandoned' AND e.aggregate_id = s.id::text
     WHERE s.status = 'ABANDONED'
     GROUP BY s.id, s.closed_at, s.last_activity_at
    HAVING count(e.id) > 1
        OR (count(e.id) = 0 AND s.closed_at >= s.last_activity_at + interval '1 hour')
     ORDER BY s.id
    """
)
ADOPTIONS_WITHOUT_ONE_EVENT = sa.text(
    """
    SELECT o.id, count(DISTINCT e.id) AS events FROM customer_order o
      JOIN reconciliation_result r ON r.order_id = o.id
                                  AND r.action = 'adopt_status' AND r.outcome = 'corrected'
      LEFT JOIN outbox_event e ON e.aggregate_type = 'order'
                              AND e.event_type = 'OrderStatusAdopted' AND e.aggregate_id = o.id::text
     GROUP BY o.id HAVING count(DISTINCT e.id) <> 1 ORDER BY o.id
    """
)
RESUBMISSIONS_WITHOUT_ONE_EVENT = sa.text(
    """
    SELECT s.order_id || '/' || s.resubmission AS id FROM order_resubmission s
     WHERE NOT EXISTS (SELECT 1 FROM outbox_event e
                        WHERE e.business_key = format('order:%s:resubmit:%s', s.order_id, s.resubmission)
                          AND e.event_type = 'OrderResubmitRequested')
     ORDER BY s.order_id, s.resubmission
    """
)
# Events whose transition is not there: the quote not EXPIRED, the session not ABANDONED,
# the order not at the status adopted, no re-submission row for the key.
EVENTS_WITHOUT_TRANSITION = sa.text(
    """
    SELECT e.event_type || ' ' || e.aggregate_id AS id FROM outbox_event e
     WHERE (e.event_type = 'QuoteExpired' AND NOT EXISTS (
               SELECT 1 FROM quote q WHERE q.id::text = e.aggregate_id AND q.status = 'EXPIRED'))
        OR (e.event_type = 'CheckoutAbandoned' AND NOT EXISTS (
               SELECT 1 FROM checkout_session s WHERE s.id::text = e.aggregate_id
                                                  AND s.status = 'ABANDONED'))
        OR (e.event_type = 'OrderStatusAdopted' AND NOT EXISTS (
               SELECT 1 FROM customer_order o WHERE o.id::text = e.aggregate_id
                                                AND o.status = e.payload->>'status'))
        OR (e.event_type = 'OrderResubmitRequested' AND NOT EXISTS (
               SELECT 1 FROM order_resubmission s
                WHERE e.business_key = format('order:%s:resubmit:%s', s.order_id, s.resubmission)))
     ORDER BY 1
    """
)


def one_event_per_transition(conn: Connection) -> list[str]:
    """Every transition that writes an event has exactly one (QuoteExpired per EXPIRED quote,
    CheckoutAbandoned per session the job abandoned, OrderStatusAdopted per adopted order,
    OrderResubmitRequested per re-submission), and every such event its transition."""
    found = []
    for statement, what in (
        (QUOTES_WITHOUT_ONE_EVENT, "EXPIRED quotes without exactly one QuoteExpired event"),
        (CHECKOUTS_WITHOUT_ONE_EVENT, "abandoned sessions without exactly one CheckoutAbandoned"),
        (ADOPTIONS_WITHOUT_ONE_EVENT, "adopted orders without exactly one OrderStatusAdopted"),
    ):
        rows = conn.execute(statement).all()
        found += _named(rows, lambda r: f"{r.id} ({r.events} events)", what)
    resubmissions = conn.execute(RESUBMISSIONS_WITHOUT_ONE_EVENT).scalars()
    found += _named(resubmissions, str, "re-submissions without their OrderResubmitRequested")
    orphans = conn.execute(EVENTS_WITHOUT_TRANSITION).scalars()
    found += _named(orphans, str, "events without their transition")
    return found


# ------------------------------------------------------------------ runs, leases, claims, audit

LEFT_RUNNING = sa.text(
    "SELECT id, job_name, scope, status FROM job_run "
    "WHERE status IN ('running', 'accepted', 'awaiting_approval') ORDER BY started_at"
)
LEASES_HELD = sa.text(
    "SELECT job_name, scope, owner_id, round(extract(epoch FROM expires_at - clock_timestamp())) "
    "AS left_s FROM job_lease WHERE expires_at > clock_timestamp() ORDER BY job_name, scope"
)
ITEMS_CLAIMED_PAST_CLAIM = sa.text(
    "SELECT id, tenant_id FROM delivery_attempt_item "
    "WHERE status = 'IN_PROGRESS' AND next_attempt_at < clock_timestamp() ORDER BY id"
)
# A claimed (or retried) event due again and still unpublished after the final pass.
EVENTS_CLAIMED_PAST_CLAIM = sa.text(
    "SELECT id, tenant_id FROM outbox_event WHERE published_at IS NULL "
    "AND dead_lettered_at IS NULL AND publish_attempts > 0 AND available_at < clock_timestamp() "
    "ORDER BY id"
)
EXECUTES_NOT_AUDITED = sa.text(
    """
    SELECT r.id, r.job_name, r.scope, r.status FROM job_run r
     WHERE r.mode = 'execute' AND r.trigger_type = 'manual' AND r.reason IS NOT NULL
       AND NOT EXISTS (SELECT 1 FROM job_audit a WHERE a.job_run_id = r.id
                          AND a.action = 'trigger' AND a.decision = 'allowed')
     ORDER BY r.started_at
    """
)


def no_run_left_running(conn: Connection) -> list[str]:
    """No run is recorded ``running`` (nor accepted or awaiting approval) once all ended."""
    rows = conn.execute(LEFT_RUNNING).all()
    return _named(rows, lambda r: f"{r.job_name} {r.scope} {r.status} ({r.id})", "runs left")


def no_lease_or_claim_past_its_time(conn: Connection) -> list[str]:
    """No lease unexpired once every run ended; no item or event still claimed past its
    claim (the final pass would have sent it)."""
    return [
        *_named(
            conn.execute(LEASES_HELD).all(),
            lambda r: f"{r.job_name} {r.scope} ({r.left_s:.0f} s left)",
            "leases held with no run alive",
        ),
        *_named(
            conn.execute(ITEMS_CLAIMED_PAST_CLAIM).all(),
            lambda r: f"{r.id} ({r.tenant_id})",
            "delivery items IN_PROGRESS past their claim",
        ),
        *_named(
            conn.execute(EVENTS_CLAIMED_PAST_CLAIM).all(),
            lambda r: f"{r.id} ({r.tenant_id})",
            "outbox events claimed, due again and never published",
        ),
    ]


def every_execute_audited(conn: Connection) -> list[str]:
    """Every execute started from the CLI with a reason has its ``allowed`` audit row."""
    rows = conn.execute(EXECUTES_NOT_AUDITED).all()
    return _named(
        rows, lambda r: f"{r.job_name} {r.scope} {r.status} ({r.id})", "executes not audited"
    )


# ------------------------------------------------------------------ outcome checks, manners


def outcome_checks_pass(final_runs: Sequence[FinalRun]) -> list[str]:
    """Every run of the final clean pass ended well and passed every outcome check. None of
    the demo's planted anomalies fails a check once its job executed over the scope (poison
    items are dead-lettered, which delivery_retry's check counts but does not fail on), so
    no check is excused."""
    found = []
    for run in final_runs:
        summary = run.summary
        if summary is None:
            found.append(f"{run.target}: no summary (exit {run.exit_code})")
            continue
        if summary.get("status") not in ENDED_WELL:
            why = summary.get("status_reason") or summary.get("error_code") or ""
            found.append(f"{run.target}: ended {summary.get('status')} ({why})")
        for check in summary.get("checks") or []:
            if not check.get("passed"):
                found.append(f"{run.target}: check {check['name']} failed {check['metadata']}")
        if summary.get("status") in ENDED_WELL and not summary.get("checks"):
            found.append(f"{run.target}: ended {summary.get('status')} without its checks")
    return found


SYSTEMIC_DEAD_LETTERS = sa.text(
    """
    SELECT 'delivery item ' || id AS what, last_error_code AS code, last_error_at AS at
      FROM delivery_attempt_item
     WHERE status = 'DEAD_LETTER' AND last_error_at >= :since
       AND (last_error_code = ANY(:codes) OR last_error_code LIKE 'http\\_5%')
    UNION ALL
    SELECT 'outbox event ' || id, last_error_code, dead_lettered_at FROM outbox_event
     WHERE dead_lettered_at >= :since
       AND (last_error_code = ANY(:codes) OR last_error_code LIKE 'http\\_5%')
     ORDER BY at
    """
)
BREAKER_OPENED_BY = sa.text(
    """
    SELECT id, job_name, scope, started_at, coalesce(finished_at, clock_timestamp()) AS finished_at
      FROM job_run WHERE started_at >= :since AND coalesce((tally->>'breaker.open')::int, 0) > 0
     ORDER BY started_at
    """
)


def manners_towards_the_downstream(
    conn: Connection, since: datetime, outages: Sequence[Outage]
) -> list[str]:
    """An outage dead-letters nothing (an item or event dead-lettered with a systemic error
    while the downstream was out), and only an outage opens the breaker (a flaky or healthy
    downstream leaves it closed)."""

    def outage_at(start: datetime, end: datetime) -> Outage | None:
        return next(
            (o for o in outages if start <= o.ended + OUTAGE_SLACK and end >= o.began), None
        )

    codes = {"since": since, "codes": list(SYSTEMIC_CODES)}
    dead = [
        (r, outage)
        for r in conn.execute(SYSTEMIC_DEAD_LETTERS, codes)
        if (outage := outage_at(r.at, r.at)) is not None
    ]
    opened = [
        r
        for r in conn.execute(BREAKER_OPENED_BY, {"since": since})
        if outage_at(r.started_at, r.finished_at) is None
    ]
    return [
        *_named(
            dead,
            lambda d: f"{d[0].what} ({d[0].code}, iteration {d[1].iteration})",
            "dead-lettered by an outage",
        ),
        *_named(
            opened,
            lambda r: f"{r.job_name} {r.scope} ({r.id})",
            "runs that opened the breaker with no outage on",
        ),
    ]


# How much the invariants looked at: rows the nemesis's runs wrote or changed.
COVERAGE = sa.text(
    """
    SELECT (SELECT count(*) FROM delivery_attempt_item WHERE updated_at >= :since) AS items,
           (SELECT count(*) FROM outbox_event WHERE published_at >= :since) AS published,
           (SELECT count(*) FROM outbox_event WHERE created_at >= :since) AS events,
           (SELECT count(*) FROM job_run WHERE started_at >= :since) AS runs,
           (SELECT count(*) FROM job_audit WHERE occurred_at >= :since
               AND action = 'trigger' AND decision = 'allowed') AS audited
    """
)


def coverage(conn: Connection, stats: dict[str, Any], since: datetime) -> dict[str, int]:
    """What the checker judged: delivery items changed, events published and written, runs
    and their audit rows since ``since``; deliveries and notifications at the simulator."""
    row = conn.execute(COVERAGE, {"since": since}).one()
    return {
        "delivery items changed": row.items,
        "deliveries at the simulator": len(stats["deliveries_by_key"]),
        "events written": row.events,
        "events published": row.published,
        "notifications at the sink": len(stats["notifications_by_event"]),
        "runs": row.runs,
        "allowed audit rows": row.audited,
    }


def check_all(conn: Connection, stats: dict[str, Any], evidence: Evidence) -> list[Violation]:
    """Every invariant, over the database (``conn``) and the simulator's ``stats``."""
    since = evidence.since
    found = {
        "side_effects": lost_or_doubled_deliveries(conn, stats, since)
        + lost_or_doubled_notifications(conn, stats, since),
        "events": one_event_per_transition(conn),
        "runs": no_run_left_running(conn),
        "leases_and_claims": no_lease_or_claim_past_its_time(conn),
        "audit": every_execute_audited(conn),
        "outcome_checks": outcome_checks_pass(evidence.final_runs),
        "manners": manners_towards_the_downstream(conn, since, evidence.outages),
    }
    return [Violation(name, what) for name, lines in found.items() for what in lines]
