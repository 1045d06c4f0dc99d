"""order_reconciliation (tenant × day): orders in flight in the window are compared with
the fulfilment system's view, and every mismatch is recorded with what was done about it.

| mismatch | meaning | execute | dry-run |
|---|---|---|---|
| missing_downstream | we have it in flight, the downstream never received it | re-submit: its delivery item goes back to READY (same idempotency key) + OrderResubmitRequested event | counted |
| terminal_not_reflected | the downstream finished it (COMPLETED, CANCELLED, FAILED), we did not hear | adopt the downstream status, conditional on the version read + OrderStatusAdopted event | counted |
| status_drift | the downstream is behind us or in a status we do not know | flag for manual review (excluded from later runs until cleared) | counted |
| unknown_downstream | the downstream has an order of this tenant we do not know | manual review (result row only) | counted |

Per batch: select orders after the cursor (one transaction), ask the downstream about them
with no transaction open, then classify and repair in a second guarded transaction. The
cursor is checkpointed so an interrupted run resumes; a run that gets through the window
forgets it, so the next run checks the whole window again. Unknown downstream orders are
looked for once per run, in its first batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from qo_ops.db.schema import customer_order
from qo_ops.downstream.calls import downstream_client
from qo_ops.downstream.client import DownstreamError, downstream_url
from qo_ops.errors import one_line
from qo_ops.platform.external import call_each
from qo_ops.platform.spec import (
    BatchContext,
    BatchOutcome,
    CheckSpec,
    JobDefaults,
    JobSpec,
    OutcomeCheck,
    ReportRow,
    run_settings,
)

IN_FLIGHT: list[sa.ColumnElement[str]] = [
    sa.literal_column("'SUBMITTED'"),
    sa.literal_column("'IN_FULFILLMENT'"),
]
TERMINAL = ("COMPLETED", "CANCELLED", "FAILED")
MAX_UNKNOWN_SCAN = 50_000  # downstream orders looked at per run, at most


def in_flight_orders(ctx: BatchContext) -> sa.Select[Any]:
    """Orders of the tenant submitted in the window and still in flight, after the cursor."""
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
    cursor = ctx.params.get("cursor")
    if cursor:
        query = query.where(o.c.id > cursor["last_id"])
    return query


def read_orders(conn: Connection, ctx: BatchContext, ids: Sequence[Any]) -> BatchOutcome:
    """Read what the comparison needs (no claim: nothing is changed yet)."""
    rows = conn.execute(
        sa.text(
            "SELECT id, order_number, status, version FROM customer_order "
            "WHERE id = ANY(CAST(:ids AS bigint[])) ORDER BY id"
        ),
        {"ids": list(ids)},
    ).mappings()
    return BatchOutcome(work=[dict(r) for r in rows], cursor={"last_id": int(ids[-1])})


def ask_downstream(ctx: BatchContext, work: list[Any]) -> list[Any]:
    """Each order's downstream view; in the run's first batch also the unknown orders."""
    client = downstream_client(ctx, run_settings(ctx, downstream_url))

    def look(order: dict[str, Any]) -> dict[str, Any]:
        try:
            found = client.get_order(order["order_number"])
        except DownstreamError as exc:
            return {**order, "error": exc.code}
        return {**order, "downstream": found.status if found else None}

    results = call_each(work, look, ctx.params["limits"]["concurrency"])
    cursor = ctx.params.get("cursor")
    if not ctx.params.get("unknown_scanned") and not cursor:
        ctx.params["unknown_scanned"] = True
        downstream: list[dict[str, Any]] = []
        try:
            for seen, order in enumerate(client.iter_orders(ctx.scope.tenant_id)):
                if seen >= MAX_UNKNOWN_SCAN:
                    break
                downstream.append({"order_number": order.order_number, "status": order.status})
        except DownstreamError as exc:
            results.append({"unknown_scan_error": exc.code})
        results.append({"downstream_orders": downstream})
    return results


# In flight on both sides is in sync while the downstream is at or ahead of us
# (SUBMITTED here, IN_FULFILLMENT there: it started work we have not heard of yet).
FLIGHT_RANK = {"SUBMITTED": 0, "IN_FULFILLMENT": 1}


def _classify(ours: str, theirs: str | None) -> str | None:
    if theirs is None:
        return "missing_downstream"
    if theirs in TERMINAL:
        return "terminal_not_reflected"
    if theirs in FLIGHT_RANK and FLIGHT_RANK[theirs] >= FLIGHT_RANK[ours]:
        return None
    return "status_drift"  # behind us, or a status we do not know


# Adopt the downstream's terminal status, only if the order is as we read it (version).
ADOPT_STATUS = sa.text(
    """
    UPDATE customer_order SET status = :status, version = version + 1, updated_at = clock_timestamp()
     WHERE id = :id AND version = :version AND status IN ('SUBMITTED', 'IN_FULFILLMENT')
    RETURNING id
    """
)
# Re-submit: the order's delivery item goes back to READY, keeping its idempotency key.
RESUBMIT = sa.text(
    """
    UPDATE delivery_attempt_item
       SET status = 'READY', next_attempt_at = clock_timestamp(), updated_at = clock_timestamp()
     WHERE order_id = :id AND status IN ('DELIVERED', 'DEAD_LETTER', 'READY')
    RETURNING id
    """
)
FLAG_REVIEW = sa.text(
    "UPDATE customer_order SET needs_manual_review = true WHERE id = :id AND NOT needs_manual_review RETURNING id"
)
EVENT = sa.text(
    """
    INSERT INTO outbox_event (id, business_key, tenant_id, aggregate_type, aggregate_id, event_type, payload)
    VALUES (gen_random_uuid(), :key, :tenant, 'order', CAST(:id AS text), :type, CAST(:payload AS jsonb))
    ON CONFLICT (business_key) DO NOTHING
    """
)
RESULT = sa.text(
    """
    INSERT INTO reconciliation_result (job_run_id, tenant_id, order_id, order_number, mismatch_type,
                                       our_status, downstream_status, action, outcome, detail)
    VALUES (:run, :tenant, :order_id, :order_number, :type, :ours, :theirs, :action, :outcome, :detail)
    ON CONFLICT (job_run_id, order_number) DO NOTHING
    """
)
ACTIONS = {
    "missing_downstream": "resubmit",
    "terminal_not_reflected": "adopt_status",
    "status_drift": "manual_review",
    "unknown_downstream": "manual_review",
}


ADOPTED_EVENT = "order_status_adopted_event"
RESUBMIT_EVENT = "order_resubmit_requested_event"


def _event(conn: Connection, out: BatchOutcome, side_effect: str, values: dict[str, Any]) -> None:
    """Append a correction event under its business key, counted as ``side_effect``."""
    appended = conn.execute(EVENT, values).rowcount == 1
    out.side_effect(side_effect, "success" if appended else "duplicate_prevented")
    out.events_written += appended
    out.duplicates_prevented += not appended


def repair_mismatches(conn: Connection, ctx: BatchContext, results: list[Any]) -> BatchOutcome:
    """Classify each order; in execute, repair per type and record every mismatch."""
    import json

    execute = ctx.mode == "execute"
    tenant, run = ctx.scope.tenant_id, ctx.job_run_id
    out = BatchOutcome()
    for r in results:
        if "downstream_orders" in r:
            known = set(
                conn.execute(
                    sa.text(
                        "SELECT order_number FROM customer_order WHERE tenant_id = :t "
                        "AND order_number = ANY(CAST(:n AS text[]))"
                    ),
                    {"t": tenant, "n": [d["order_number"] for d in r["downstream_orders"]]},
                ).scalars()
            )
            for d in r["downstream_orders"]:
                if d["order_number"] not in known:
                    out.tally["unknown_downstream"] = out.tally.get("unknown_downstream", 0) + 1
                    if execute:
                        conn.execute(
                            RESULT,
                            {
                                "run": run,
                                "tenant": tenant,
                                "order_id": None,
                                "order_number": d["order_number"],
                                "type": "unknown_downstream",
                                "ours": None,
                                "theirs": d["status"],
                                "action": "manual_review",
                                "outcome": "flagged",
                                "detail": "the downstream has an order qo-ops does not know",
                            },
                        )
            continue
        if "unknown_scan_error" in r:
            out.failed_items.append(("unknown-orders-scan", r["unknown_scan_error"]))
            continue
        if "error" in r:
            out.failed += 1
            out.failed_items.append((r["order_number"], r["error"]))
            continue
        kind = _classify(r["status"], r["downstream"])
        if kind is None:
            out.skipped += 1  # in sync
            continue
        out.tally[kind] = out.tally.get(kind, 0) + 1
        if not execute:
            continue
        outcome, detail = "flagged", None
        if kind == "terminal_not_reflected":
            adopted = conn.execute(
                ADOPT_STATUS, {"id": r["id"], "version": r["version"], "status": r["downstream"]}
            ).first()
            outcome = "corrected" if adopted else "failed"
            detail = (
                None if adopted else "the order changed since it was read; left for the next run"
            )
            if adopted:
                _event(
                    conn,
                    out,
                    ADOPTED_EVENT,
                    {
                        "key": f"order:{r['id']}:adopted:{r['downstream']}",
                        "tenant": tenant,
                        "id": r["id"],
                        "type": "OrderStatusAdopted",
                        "payload": json.dumps(
                            {"order_number": r["order_number"], "status": r["downstream"]}
                        ),
                    },
                )
        elif kind == "missing_downstream":
            requeued = conn.execute(RESUBMIT, {"id": r["id"]}).first()
            outcome = "corrected" if requeued else "failed"
            detail = None if requeued else "no delivery item to re-submit"
            _event(
                conn,
                out,
                RESUBMIT_EVENT,
                {
                    "key": f"order:{r['id']}:resubmit:{run}",
                    "tenant": tenant,
                    "id": r["id"],
                    "type": "OrderResubmitRequested",
                    "payload": json.dumps({"order_number": r["order_number"]}),
                },
            )
        else:
            conn.execute(FLAG_REVIEW, {"id": r["id"]})
        conn.execute(
            RESULT,
            {
                "run": run,
                "tenant": tenant,
                "order_id": r["id"],
                "order_number": r["order_number"],
                "type": kind,
                "ours": r["status"],
                "theirs": r["downstream"],
                "action": ACTIONS[kind],
                "outcome": outcome,
                "detail": one_line(detail, 200) if detail else None,
            },
        )
        out.tally[f"action_{outcome}"] = out.tally.get(f"action_{outcome}", 0) + 1
        if outcome == "failed":
            out.failed += 1
        else:
            out.succeeded += 1
    return out


def report_mismatches(conn: Connection, ctx: BatchContext) -> list[ReportRow]:
    """Mismatches this run recorded, by type, with the action taken and its outcome."""
    return [
        ReportRow("mismatch", r.mismatch_type, r.n, f"{r.action} → {r.outcome}")
        for r in conn.execute(
            sa.text(
                "SELECT mismatch_type, action, outcome, count(*) AS n FROM reconciliation_result "
                "WHERE job_run_id = :run GROUP BY 1, 2, 3 ORDER BY 1, 2, 3"
            ),
            {"run": ctx.job_run_id},
        )
    ]


def check_reconciliation(conn: Connection, ctx: BatchContext) -> list[OutcomeCheck]:
    """No order repaired in this scope is still mismatched; unresolved ones counted by type."""
    start, end = ctx.scope.window_bounds()
    row = conn.execute(
        sa.text(
            """
            SELECT count(*) FILTER (WHERE r.action = 'adopt_status' AND r.outcome = 'corrected'
                                      AND o.status IN ('SUBMITTED', 'IN_FULFILLMENT')) AS still_mismatched,
                   count(*) FILTER (WHERE r.outcome IN ('flagged', 'failed')) AS unresolved
              FROM reconciliation_result r JOIN customer_order o ON o.id = r.order_id
             WHERE r.tenant_id = :t AND o.submitted_at >= :start AND o.submitted_at < :end
            """
        ),
        {"t": ctx.scope.tenant_id, "start": start, "end": end},
    ).one()
    return [
        OutcomeCheck(
            "no_repaired_order_still_mismatched",
            row.still_mismatched == 0,
            "every order whose status was adopted from the downstream now has it",
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
    external=ask_downstream,
    record=repair_mismatches,
    report=report_mismatches,
    check=check_reconciliation,
    outcome_asset="orders",
    checks=(
        CheckSpec("no_repaired_order_still_mismatched", "No repaired order is still mismatched"),
    ),
    cron_schedule="15 3 * * *",
    defaults=JobDefaults(batch_size=200, concurrency=16),
    change="compared with the fulfilment system; mismatch repaired or flagged",
    healthy="No in-flight order of a day still mismatched with the fulfilment system after its run.",
    uses_checkpoint=True,
    rescan_when_complete=True,
    dry_run_scans=True,
    compete_with_skip_locked=False,  # read-only selection: one run per scope holds the lease
    side_effects=(ADOPTED_EVENT, RESUBMIT_EVENT),
    validate_settings=downstream_url,  # checked before the run reads or repairs anything
)
