"""order_reconciliation compares the orders in flight in the window with the fulfilment
system's view, per tenant and day. It records every mismatch with what was done about it.

| mismatch | meaning | execute | dry-run |
|---|---|---|---|
| missing_downstream | we have it in flight, the downstream never received it | re-submit within the budget (below), or flag it; a dead-lettered delivery item is flagged, never requeued | counted |
| terminal_not_reflected | the downstream finished it (COMPLETED, CANCELLED, FAILED), we did not hear | adopt the downstream status, conditional on the version read + OrderStatusAdopted event | counted |
| status_drift | the downstream is behind us or in a status we do not know | flag for manual review (excluded from later runs until cleared) | counted |
| unknown_downstream | the downstream has an order of this tenant we do not know | manual review (result row only) | counted |

**Re-submission budget.** In execute, a ``missing_downstream`` order follows this table.
Each re-submission is one row of ``order_resubmission``, numbered n from 1.

| the order's state | execute | result (action / outcome) |
|---|---|---|
| never re-submitted | re-submission 1 | resubmit / corrected |
| re-submission n not delivered yet, or delivered less than the grace ago | nothing (event n: duplicate_prevented) | resubmit / pending |
| re-submission n delivered (item DELIVERED after it) and the grace past, n < max | re-submission n + 1 | resubmit / corrected |
| the same, n = max | flag for manual review | manual_review / budget_exhausted |
| its delivery item DEAD_LETTER | flag; the item is left as it is (a person's ``qo-ops review resolve … --action resubmit`` or ``qo-ops requeue`` moves it) | manual_review / dead_letter_flagged |
| its delivery item being sent (IN_PROGRESS) | nothing | resubmit / pending |
| no delivery item | flag | manual_review / flagged |

A re-submission puts the delivery item back to READY with the same idempotency key. In the
same savepoint it appends its row and one OrderResubmitRequested event keyed
``order:{id}:resubmit:{n}``, so a rerun over unchanged state inserts nothing. The grace is
``QO_OPS_RESUBMIT_GRACE_MINUTES`` (default 60, 0 to 10080) after the delivery, on the
database clock. The max is ``QO_OPS_RESUBMIT_MAX`` (default 3, 0 to 10). Both are validated
before a run writes anything, and read once per run.

Each batch has three steps. First, one transaction selects the orders after the cursor.
Second, with no transaction open, the job asks the downstream about them: a :data:`Lookup`
per order, plus the unknown orders in the run's first batch. Third, a second guarded
transaction classifies and repairs. The cursor is checkpointed so that an interrupted run
resumes. A run that gets through the window forgets the cursor, so the next run checks the
whole window again. Unknown downstream orders are looked for once per run, in its first
batch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, assert_never

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from qo_ops.config import whole_number
from qo_ops.db.schema import customer_order
from qo_ops.downstream.calls import (
    Manners,
    downstream_client,
    finish_lookups,
    manners_from_env,
    refuse_while_open,
    watch_breaker,
)
from qo_ops.downstream.client import DownstreamError, DownstreamOrder, downstream_url
from qo_ops.errors import one_line
from qo_ops.jobs.order_review import ADOPTED_EVENT, RESUBMIT_EVENT, REVIEW, append_event
from qo_ops.platform.calls.external import NotCalled, call_each
from qo_ops.platform.job.labels import Reconciliation
from qo_ops.platform.job.options import Limits
from qo_ops.platform.job.outcome import (
    BatchContext,
    BatchOutcome,
    OutcomeCheck,
    ReportRow,
    run_settings,
)
from qo_ops.platform.job.spec import (
    Batching,
    Checkpointing,
    CheckSpec,
    Deployment,
    ExternalPhase,
    JobSpec,
    Presentation,
    Recovery,
    Signals,
)

IN_FLIGHT: list[sa.ColumnElement[str]] = [
    sa.literal_column("'SUBMITTED'"),
    sa.literal_column("'IN_FULFILLMENT'"),
]
TERMINAL = ("COMPLETED", "CANCELLED", "FAILED")
MAX_UNKNOWN_SCAN = 50_000  # the most downstream orders looked at per run

RESUBMIT_GRACE_ENV = "QO_OPS_RESUBMIT_GRACE_MINUTES"
DEFAULT_RESUBMIT_GRACE_MINUTES = 60  # the downstream's time to show a delivered order
MAX_RESUBMIT_GRACE_MINUTES = 7 * 24 * 60
RESUBMIT_MAX_ENV = "QO_OPS_RESUBMIT_MAX"
DEFAULT_RESUBMIT_MAX = 3
MAX_RESUBMIT_MAX = 10  # with 0, every missing order goes to a person
# The outcome of a mismatch whose action could not be done (in reconciliation_result).
# It is not a run's status.
ACTION_FAILED = "failed"


@dataclass(frozen=True)
class ResubmitBudget:
    """How often, and how soon again, a missing order may be re-submitted."""

    grace_minutes: int
    max_resubmissions: int


def resubmit_budget(environ: Mapping[str, str] | None = None) -> ResubmitBudget:
    """Read the budget from ``QO_OPS_RESUBMIT_GRACE_MINUTES`` and ``QO_OPS_RESUBMIT_MAX``.

    A bad value raises ConfigError with one line. It is checked before a run writes anything.
    """
    return ResubmitBudget(
        grace_minutes=whole_number(
            RESUBMIT_GRACE_ENV,
            DEFAULT_RESUBMIT_GRACE_MINUTES,
            0,
            MAX_RESUBMIT_GRACE_MINUTES,
            unit="minutes",
            environ=environ,
        ),
        max_resubmissions=whole_number(
            RESUBMIT_MAX_ENV, DEFAULT_RESUBMIT_MAX, 0, MAX_RESUBMIT_MAX, environ=environ
        ),
    )


@dataclass(frozen=True)
class ReconciliationSettings:
    """What a reconciliation run works with, checked before it reads or writes anything."""

    downstream_url: str
    budget: ResubmitBudget
    manners: Manners  # the request rate towards the downstream


def reconciliation_settings(environ: Mapping[str, str] | None = None) -> ReconciliationSettings:
    """Read ``QO_OPS_DOWNSTREAM_URL`` and the re-submission budget (``ConfigError`` if bad)."""
    return ReconciliationSettings(
        downstream_url(environ), resubmit_budget(environ), manners_from_env(environ)
    )


def _run_budget(ctx: BatchContext) -> ResubmitBudget:
    """Return the budget checked before the run began. It stays fixed for the run."""
    return run_settings(ctx, reconciliation_settings).budget


def in_flight_orders(ctx: BatchContext) -> sa.Select[Any]:
    """Select the tenant's orders submitted in the window and still in flight, after the cursor."""
    start, end = ctx.scope.window_bounds()
    o = customer_order
    query = (
        sa.select(o.c.id)
        .where(
            o.c.tenant_id == ctx.scope.tenant_id,
            o.c.submitted_at >= start,
            o.c.submitted_at < end,
            o.c.status.in_(IN_FLIGHT),
            o.c.needs_manual_review.is_(False),  # flagged orders wait for a person
        )
        .order_by(o.c.id)
    )
    cursor = ctx.cursor
    if cursor:
        query = query.where(o.c.id > cursor["last_id"])
    return query


# What the comparison needs of the batch's orders. There is no claim, since nothing changes yet.
READ_ORDERS = sa.text(
    "SELECT id, order_number, status, version FROM customer_order "
    "WHERE id = ANY(CAST(:ids AS bigint[])) ORDER BY id"
)


@dataclass(frozen=True)
class OrderToCompare:
    """An in-flight order as the batch read it. The downstream is asked about it."""

    id: int
    order_number: str
    status: str
    version: int  # the adoption changes the order only if it is still at this version


def read_orders(conn: Connection, ctx: BatchContext, ids: Sequence[Any]) -> BatchOutcome:
    """Read what the comparison needs (no claim: nothing changes yet). While the breaker is
    open, its probe not due, read nothing: the run halts, its checkpoint where it was."""
    settings = run_settings(ctx, reconciliation_settings)
    calls = watch_breaker(conn, ctx, settings.downstream_url, settings.manners)
    if (refused := refuse_while_open(calls, len(ids))) is not None:
        return refused
    rows = conn.execute(READ_ORDERS, {"ids": list(ids)}).all()
    work = [OrderToCompare(r.id, r.order_number, r.status, r.version) for r in rows]
    return BatchOutcome(work=work, cursor={"last_id": int(ids[-1])})


# What asking the downstream gives the repair. Each is one result, and the repair
# dispatches on its type.


@dataclass(frozen=True)
class Compared:
    """The downstream's status of one order, or None when it does not have the order."""

    order: OrderToCompare
    downstream: str | None


@dataclass(frozen=True)
class NotCompared:
    """The downstream could not be asked about one order. ``code`` is the call's error."""

    order: OrderToCompare
    code: str


@dataclass(frozen=True)
class ResumeAfter:
    """The run stopped before every order was looked at. The checkpoint stays after
    ``last_id``, before the orders not looked at."""

    last_id: int


@dataclass(frozen=True)
class DownstreamOrders:
    """The tenant's orders the downstream has, looked for once per run, at most
    :data:`MAX_UNKNOWN_SCAN`. Those qo-ops does not know are recorded."""

    orders: tuple[DownstreamOrder, ...]


@dataclass(frozen=True)
class ScanFailed:
    """Looking for the downstream's unknown orders failed part way, with error ``code``."""

    code: str


Lookup = Compared | NotCompared | ResumeAfter | DownstreamOrders | ScanFailed


@dataclass
class ReconciliationRun:
    """What a reconciliation run keeps between its batches (``ctx.run_state``)."""

    unknown_scanned: bool = False  # the downstream's orders were looked through


def ask_downstream(ctx: BatchContext, work: list[OrderToCompare]) -> list[Lookup]:
    """Ask for each order's downstream view, and in the run's first batch the unknown orders.

    The run's client honours the breaker: an order whose lookup the open breaker held back
    is not looked at (never judged missing), as if the run had stopped before it."""
    settings = run_settings(ctx, reconciliation_settings)
    client = downstream_client(ctx, settings.downstream_url, settings.manners)

    def look(order: OrderToCompare) -> Compared | NotCompared | None:
        try:
            found = client.get_order(order.order_number)
        except DownstreamError as exc:  # None: never sent (the breaker is open, or stopping)
            return NotCompared(order, exc.code) if exc.sent else None
        return Compared(order, found.status if found else None)

    cursor = ctx.cursor
    looked: list[Compared | NotCompared] = []
    for result in call_each(work, look, ctx.limits.concurrency, ctx.stop):
        if result is None or isinstance(result, NotCalled):  # Stopping, or the breaker is
            # open. Keep what was looked at up to the first order that was not; resume there.
            resume = looked[-1].order.id if looked else (cursor or {}).get("last_id", 0)
            return [*looked, ResumeAfter(int(resume))]
        looked.append(result)
    results: list[Lookup] = list(looked)
    run = ctx.run_state(ReconciliationRun)
    if not run.unknown_scanned and not cursor:
        run.unknown_scanned = True
        downstream: list[DownstreamOrder] = []
        try:
            for seen, order in enumerate(client.iter_orders(ctx.scope.tenant_id)):
                if seen >= MAX_UNKNOWN_SCAN:
                    break
                downstream.append(order)
        except DownstreamError as exc:
            results.append(ScanFailed(exc.code))
        results.append(DownstreamOrders(tuple(downstream)))
    return results


# An order in flight on both sides is in sync while the downstream is at or ahead of us.
# SUBMITTED here and IN_FULFILLMENT there means it started work we have not heard of yet.
FLIGHT_RANK = {"SUBMITTED": 0, "IN_FULFILLMENT": 1}


def _classify(ours: str, theirs: str | None) -> str | None:
    if theirs is None:
        return "missing_downstream"
    if theirs in TERMINAL:
        return "terminal_not_reflected"
    if theirs in FLIGHT_RANK and FLIGHT_RANK[theirs] >= FLIGHT_RANK[ours]:
        return None
    return "status_drift"  # behind us, or a status we do not know


# Adopt the downstream's terminal status, only if the order is still at the version we read.
# Twice: adopting bumps the version and leaves the in-flight statuses, so a second run (or a
# rival) with the same reading matches nothing.
ADOPT_STATUS = sa.text(
    """
    UPDATE customer_order SET status = :status, version = version + 1, updated_at = clock_timestamp()
     WHERE id = :id AND version = :version AND status IN ('SUBMITTED', 'IN_FULFILLMENT')
    RETURNING id
    """
)
# Where each missing order stands with its budget, read in the repair transaction. It reads
# the delivery items and the last re-submission. It also reads whether that re-submission was
# delivered (after it was made) and whether the grace has passed since, on the database clock.
RESUBMIT_STATE = sa.text(
    """
    SELECT o.id,
           count(d.id) AS items,
           array_remove(array_agg(CASE WHEN d.status = 'DEAD_LETTER' THEN d.id END), NULL)
               AS dead_items,
           count(d.id) FILTER (WHERE d.status = 'IN_PROGRESS') AS in_progress,
           coalesce(r.resubmission, 0) AS resubmissions,
           coalesce(bool_and(d.status = 'DELIVERED' AND d.updated_at > r.requested_at), false)
               AS delivered,
           coalesce(bool_and(d.updated_at + make_interval(mins => :grace) <= clock_timestamp()),
                    false) AS past_grace
      FROM customer_order o
      LEFT JOIN delivery_attempt_item d ON d.order_id = o.id
      LEFT JOIN LATERAL (SELECT s.resubmission, s.requested_at FROM order_resubmission s
                          WHERE s.order_id = o.id ORDER BY s.resubmission DESC LIMIT 1) r ON true
     WHERE o.id = ANY(CAST(:ids AS bigint[]))
     GROUP BY o.id, r.resubmission, r.requested_at
    """
)
# Re-submit by putting the order's delivery items back to READY with their idempotency key.
# It never moves a DEAD_LETTER item (only the audited requeue does) or one being sent.
# Twice: this statement alone is not safe, because a DELIVERED item would go back to READY
# again. So a rerun reads the budget first in RESUBMIT_STATE, which requires the last
# re-submission delivered and past its grace. This also runs in one savepoint with
# RECORD_RESUBMISSION, where a rival taking the same n conflicts and rolls it back. A re-send
# would be deduped on the key downstream.
RESUBMIT = sa.text(
    """
    UPDATE delivery_attempt_item
       SET status = 'READY', next_attempt_at = clock_timestamp(), updated_at = clock_timestamp()
     WHERE order_id = :id AND status IN ('DELIVERED', 'READY')
    RETURNING id
    """
)
# Take re-submission n of the order's budget.
# Twice: n is taken once. A rival or a rerun conflicts on (order, n), adds nothing, and
# rolls its RESUBMIT back.
RECORD_RESUBMISSION = sa.text(
    """
    INSERT INTO order_resubmission (order_id, resubmission, tenant_id, job_run_id, requested_at)
    VALUES (:id, :n, :tenant, :run, clock_timestamp())
    ON CONFLICT (order_id, resubmission) DO NOTHING
    RETURNING resubmission
    """
)
# Flag the order for a person.
# Twice: only an order not flagged yet changes, so a second run matches nothing.
FLAG_REVIEW = sa.text(
    "UPDATE customer_order SET needs_manual_review = true WHERE id = :id AND NOT needs_manual_review RETURNING id"
)
# What the run found and did about one order. This is the run's evidence, kept with its job_run.
# Twice: there is one row per run and order, so recording the same order again in a run adds
# nothing. A rerun records what it finds under its own run id.
RESULT = sa.text(
    """
    INSERT INTO reconciliation_result (job_run_id, tenant_id, order_id, order_number, mismatch_type,
                                       our_status, downstream_status, action, outcome, detail)
    VALUES (:run, :tenant, :order_id, :order_number, :type, :ours, :theirs, :action, :outcome, :detail)
    ON CONFLICT (job_run_id, order_number) DO NOTHING
    """
)
# Which of the downstream's order numbers the tenant has (the rest are unknown to qo-ops).
KNOWN_ORDER_NUMBERS = sa.text(
    "SELECT order_number FROM customer_order WHERE tenant_id = :t "
    "AND order_number = ANY(CAST(:n AS text[]))"
)
# The mismatches a run recorded, by type, action and outcome.
RECORDED_MISMATCHES = sa.text(
    "SELECT mismatch_type, action, outcome, count(*) AS n FROM reconciliation_result "
    "WHERE job_run_id = :run GROUP BY 1, 2, 3 ORDER BY 1, 2, 3"
)
# Among the scope's recorded mismatches, count the adopted orders not at their adopted status
# yet, and the ones no action resolved.
STILL_MISMATCHED = sa.text(
    """
    SELECT count(*) FILTER (WHERE r.action = 'adopt_status' AND r.outcome = 'corrected'
                              AND o.status IN ('SUBMITTED', 'IN_FULFILLMENT')) AS still_mismatched,
           count(*) FILTER (WHERE r.outcome IN ('flagged', 'dead_letter_flagged',
                                                'budget_exhausted', 'failed')) AS unresolved
      FROM reconciliation_result r JOIN customer_order o ON o.id = r.order_id
     WHERE r.tenant_id = :t AND o.tenant_id = :t
       AND o.submitted_at >= :start AND o.submitted_at < :end
    """
)
ACTIONS = {
    "missing_downstream": "resubmit",
    "terminal_not_reflected": "adopt_status",
    "status_drift": "manual_review",
    "unknown_downstream": "manual_review",
}


def _resubmit(conn: Connection, ctx: BatchContext, order_id: int, n: int) -> bool:
    """Take re-submission ``n`` of the order. Its delivery items go back to READY and its
    budget row is written, together or not at all. A savepoint undoes both if an item
    started being sent or was dead-lettered since it was read, or if a rival took ``n``."""
    savepoint = conn.begin_nested()
    requeued = conn.execute(RESUBMIT, {"id": order_id}).all()
    taken = (
        bool(requeued)
        and conn.execute(
            RECORD_RESUBMISSION,
            {"id": order_id, "n": n, "tenant": ctx.scope.tenant_id, "run": ctx.job_run_id},
        ).first()
        is not None
    )
    if taken:
        savepoint.commit()
    else:
        savepoint.rollback()
    return taken


def _resubmitappend_event(
    conn: Connection, ctx: BatchContext, out: BatchOutcome, order: OrderToCompare, n: int
) -> None:
    append_event(
        conn,
        out,
        RESUBMIT_EVENT,
        {
            "key": f"order:{order.id}:resubmit:{n}",  # one event per re-submission, not per run
            "tenant": ctx.scope.tenant_id,
            "id": order.id,
            "type": "OrderResubmitRequested",
            "payload": json.dumps({"order_number": order.order_number, "resubmission": n}),
        },
    )


def _repair_missing(
    conn: Connection, ctx: BatchContext, out: BatchOutcome, order: OrderToCompare, state: Any
) -> tuple[str, str, str | None]:
    """Return (action, outcome, detail), what the budget allows for an order not downstream."""
    budget, n = _run_budget(ctx), int(state.resubmissions)
    if state.dead_items:  # only the audited requeue moves a dead letter
        conn.execute(FLAG_REVIEW, {"id": order.id})
        item = state.dead_items[0]
        return (
            "manual_review",
            "dead_letter_flagged",
            f"delivery item {item} is dead-lettered: once its cause is fixed, qo-ops review "
            f"resolve order_reconciliation {order.order_number} --tenant {ctx.scope.tenant_id} "
            "--action resubmit --reason …",
        )
    if not state.items:
        conn.execute(FLAG_REVIEW, {"id": order.id})
        return "manual_review", "flagged", "no delivery item to re-submit"
    # Spent means the last re-submission (if any) was delivered and the order is still missing.
    spent = n == 0 or (state.delivered and state.past_grace)
    if spent and n >= budget.max_resubmissions:
        conn.execute(FLAG_REVIEW, {"id": order.id})
        return (
            "manual_review",
            "budget_exhausted",
            f"re-submitted {n} times ({RESUBMIT_MAX_ENV}={budget.max_resubmissions}) "
            "and still missing downstream",
        )
    if spent and not state.in_progress and _resubmit(conn, ctx, order.id, n + 1):
        _resubmitappend_event(conn, ctx, out, order, n + 1)
        return "resubmit", "corrected", f"re-submission {n + 1} of {budget.max_resubmissions}"
    if n:  # the earlier re-submission stands, and its event is there already
        _resubmitappend_event(conn, ctx, out, order, n)
    if not spent:
        why = (
            f"re-submission {n} delivered; the downstream has {budget.grace_minutes} min to show it"
            if state.delivered
            else f"re-submission {n} not delivered yet"
        )
    else:
        why = "its delivery item is being sent (or changed meanwhile); the next run looks again"
    return "resubmit", "pending", why


def repair_mismatches(conn: Connection, ctx: BatchContext, results: list[Lookup]) -> BatchOutcome:
    """Classify each order. In execute, repair it per type and record every mismatch."""
    out = BatchOutcome()
    missing = [
        r.order.id
        for r in results
        if isinstance(r, Compared)
        and _classify(r.order.status, r.downstream) == "missing_downstream"
    ]
    states = (
        {
            row.id: row
            for row in conn.execute(
                RESUBMIT_STATE, {"ids": missing, "grace": _run_budget(ctx).grace_minutes}
            )
        }
        if ctx.mode == "execute" and missing
        else {}
    )
    for r in results:
        match r:
            case ResumeAfter(last_id):  # stopped early, so the checkpoint stays before the rest
                out.cursor = {"last_id": last_id}
            case DownstreamOrders(orders):
                _record_unknown(conn, ctx, out, orders)
            case ScanFailed(code):
                out.failed_items.append(("unknown-orders-scan", code))
            case NotCompared(order, code):
                out.failed += 1
                out.failed_items.append((order.order_number, code))
            case Compared():
                _repair(conn, ctx, out, r, states)
            case _:
                assert_never(r)  # mypy checks that every kind of Lookup is handled
    sent = sum(1 for r in results if isinstance(r, Compared | NotCompared))  # lookups made
    return finish_lookups(conn, ctx, out, sent)  # their evidence joins the breaker's row


def _record_unknown(
    conn: Connection, ctx: BatchContext, out: BatchOutcome, orders: tuple[DownstreamOrder, ...]
) -> None:
    """Count the downstream's orders qo-ops does not know. In execute, record them for a
    person."""
    tenant = ctx.scope.tenant_id
    numbers = [d.order_number for d in orders]
    known = set(conn.execute(KNOWN_ORDER_NUMBERS, {"t": tenant, "n": numbers}).scalars())
    for d in orders:
        if d.order_number not in known:
            out.tally["unknown_downstream"] = out.tally.get("unknown_downstream", 0) + 1
            if ctx.mode == "execute":
                conn.execute(
                    RESULT,
                    {
                        "run": ctx.job_run_id,
                        "tenant": tenant,
                        "order_id": None,
                        "order_number": d.order_number,
                        "type": "unknown_downstream",
                        "ours": None,
                        "theirs": d.status,
                        "action": "manual_review",
                        "outcome": "flagged",
                        "detail": "the downstream has an order qo-ops does not know",
                    },
                )
                out.tally["action_flagged"] = out.tally.get("action_flagged", 0) + 1


def _repair(
    conn: Connection, ctx: BatchContext, out: BatchOutcome, r: Compared, states: dict[int, Any]
) -> None:
    """Classify one order. In execute, repair it per type and record the mismatch.

    ``states`` tells where each missing order stands with its budget.
    """
    order, theirs = r.order, r.downstream
    kind = _classify(order.status, theirs)
    if kind is None:
        out.skipped += 1  # in sync
        return
    out.tally[kind] = out.tally.get(kind, 0) + 1
    if ctx.mode != "execute":
        return
    tenant = ctx.scope.tenant_id
    action, outcome, detail = ACTIONS[kind], "flagged", None
    if kind == "terminal_not_reflected":
        adopted = conn.execute(
            ADOPT_STATUS, {"id": order.id, "version": order.version, "status": theirs}
        ).first()
        outcome = "corrected" if adopted else ACTION_FAILED
        detail = None if adopted else "the order changed since it was read; left for the next run"
        if adopted:
            append_event(
                conn,
                out,
                ADOPTED_EVENT,
                {
                    "key": f"order:{order.id}:adopted:{theirs}",
                    "tenant": tenant,
                    "id": order.id,
                    "type": "OrderStatusAdopted",
                    "payload": json.dumps({"order_number": order.order_number, "status": theirs}),
                },
            )
    elif kind == "missing_downstream":
        action, outcome, detail = _repair_missing(conn, ctx, out, order, states[order.id])
    else:
        conn.execute(FLAG_REVIEW, {"id": order.id})
    conn.execute(
        RESULT,
        {
            "run": ctx.job_run_id,
            "tenant": tenant,
            "order_id": order.id,
            "order_number": order.order_number,
            "type": kind,
            "ours": order.status,
            "theirs": theirs,
            "action": action,
            "outcome": outcome,
            "detail": one_line(detail, 300) if detail else None,
        },
    )
    out.tally[f"action_{outcome}"] = out.tally.get(f"action_{outcome}", 0) + 1
    if outcome == ACTION_FAILED:
        out.failed += 1
    elif outcome == "pending":
        out.skipped += 1  # nothing changed while the earlier re-submission is pending
    else:
        out.succeeded += 1


def report_mismatches(conn: Connection, ctx: BatchContext) -> list[ReportRow]:
    """Report the mismatches this run recorded, by type, with the action taken and its outcome."""
    return [
        ReportRow("mismatch", r.mismatch_type, r.n, f"{r.action} → {r.outcome}")
        for r in conn.execute(RECORDED_MISMATCHES, {"run": ctx.job_run_id})
    ]


# Declared once. Its results in check_reconciliation carry the same description.
NO_REPAIRED_ORDER_STILL_MISMATCHED = CheckSpec(
    "no_repaired_order_still_mismatched", "No repaired order is still mismatched"
)


def check_reconciliation(conn: Connection, ctx: BatchContext) -> list[OutcomeCheck]:
    """Check that no order repaired in this scope is still mismatched. Count unresolved ones."""
    start, end = ctx.scope.window_bounds()
    row = conn.execute(
        STILL_MISMATCHED, {"t": ctx.scope.tenant_id, "start": start, "end": end}
    ).one()
    return [
        NO_REPAIRED_ORDER_STILL_MISMATCHED.result(
            row.still_mismatched == 0,
            {"still_mismatched": row.still_mismatched, "unresolved_mismatches": row.unresolved},
        )
    ]


SPEC = JobSpec(
    name="order_reconciliation",
    kind="reconciliation",
    description="Compare in-flight orders of a day with the fulfilment system; repair or flag each mismatch",
    partitioning="tenant_day",
    eligible=in_flight_orders,
    transition=read_orders,
    then=ExternalPhase(call=ask_downstream, record=repair_mismatches),
    check=check_reconciliation,
    checks=(NO_REPAIRED_ORDER_STILL_MISMATCHED,),
    defaults=Limits(batch_size=200, concurrency=16),
    validate_settings=reconciliation_settings,  # a bad setting is refused before any read or write
    batching=Batching(
        locks=None,  # the selection only reads, and one run per scope holds the lease
        checkpoint=Checkpointing(rescan_when_complete=True),
        dry_run_scans=True,
    ),
    presentation=Presentation(
        outcome_asset="orders",
        change="compared with the fulfilment system; mismatch repaired or flagged",
        healthy="No in-flight order of a day still mismatched with the fulfilment system after its run.",
    ),
    deployment=Deployment(cron_schedule="15 3 * * *", calls_downstream=True),
    signals=Signals(
        report=report_mismatches,
        side_effects=(ADOPTED_EVENT, RESUBMIT_EVENT),
        reconciliation=Reconciliation(
            mismatch_types=tuple(ACTIONS),
            corrections={
                "action_corrected": "corrected",
                "action_failed": ACTION_FAILED,
                "action_pending": "pending",
            },
            unresolved={
                "action_flagged": "manual_review_required",
                "action_budget_exhausted": "budget_exhausted",
                "action_dead_letter_flagged": "dead_letter_flagged",
            },
        ),
    ),
    recovery=Recovery(review=REVIEW),
)
