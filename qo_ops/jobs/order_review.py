"""This module holds order_reconciliation's corrections as events, and its manual-review
queue. The queue lists the orders a run flagged for a person
(``customer_order.needs_manual_review``), with the reason from the latest
``reconciliation_result`` row. The table shows what a person may decide for each order with
``qo-ops review``. ``qo_ops.platform.actions.recovery`` runs a decision under the scope's
lease, and audits it.

| action | what it does, in one transaction | refused when |
|---|---|---|
| resubmit | the order's delivery items back to READY (a dead letter with its attempts reset), the next re-submission recorded with its OrderResubmitRequested event | the order is not in flight; no delivery item (or one being sent) |
| adopt | our status becomes the downstream's as the run saw it, if ours is unchanged since, with its OrderStatusAdopted event | the downstream had no status, or one an order cannot have |
| dismiss | nothing else | never |

Every decision first clears the flag, conditionally. A decided order is then off the queue,
and a second decision on it changes nothing.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from qo_ops.db.schema.business_tables import ORDER_STATUSES
from qo_ops.errors import BadInput
from qo_ops.platform.job.outcome import BatchOutcome, SideEffectResult
from qo_ops.platform.job.review import Review, ReviewAction, ReviewItem

# A correction's event, under its business key (adopted:<status>, resubmit:<n>).
# Twice: a second insert of the same correction conflicts on business_key and adds nothing.
# It is counted as a duplicate prevented.
EVENT = sa.text(
    """
    INSERT INTO outbox_event (id, business_key, tenant_id, aggregate_type, aggregate_id, event_type, payload)
    VALUES (gen_random_uuid(), :key, :tenant, 'order', CAST(:id AS text), :type, CAST(:payload AS jsonb))
    ON CONFLICT (business_key) DO NOTHING
    """
)

ADOPTED_EVENT = "order_status_adopted_event"
RESUBMIT_EVENT = "order_resubmit_requested_event"


def append_event(
    conn: Connection, out: BatchOutcome, side_effect: str, values: dict[str, Any]
) -> None:
    """Append a correction event under its business key, and count it as ``side_effect``."""
    appended = conn.execute(EVENT, values).rowcount == 1
    out.side_effect(
        side_effect,
        SideEffectResult.SUCCESS if appended else SideEffectResult.DUPLICATE_PREVENTED,
    )
    out.events_written += appended
    out.duplicates_prevented += not appended


# Orders flagged for a person, each with the latest result row a run recorded for it. That
# row gives the mismatch, outcome and detail, and our status and the downstream's at the time.
# The day is the one whose scope a run works the order in (submitted_at, UTC).
WAITING_FOR_REVIEW = sa.text(
    """
    SELECT o.tenant_id AS tenant, o.order_number AS item,
           CAST(o.submitted_at AT TIME ZONE 'UTC' AS date) AS day,
           coalesce(r.mismatch_type, 'unrecorded') AS kind,
           coalesce(r.outcome, 'flagged') AS outcome, coalesce(r.detail, '') AS detail,
           coalesce(r.our_status, o.status) AS ours, r.downstream_status AS theirs,
           CAST(r.job_run_id AS text) AS flagged_by_run, r.created_at AS flagged_at
      FROM customer_order o
      LEFT JOIN LATERAL (
            SELECT x.mismatch_type, x.outcome, x.detail, x.our_status, x.downstream_status,
                   x.job_run_id, x.created_at
              FROM reconciliation_result x
             WHERE x.tenant_id = o.tenant_id AND x.order_number = o.order_number
             ORDER BY x.created_at DESC, x.id DESC LIMIT 1) AS r ON true
     WHERE o.needs_manual_review
       AND (CAST(:tenant AS text) IS NULL OR o.tenant_id = :tenant)
       AND (CAST(:item AS text) IS NULL OR o.order_number = :item)
     ORDER BY r.created_at NULLS FIRST, o.id
     LIMIT :limit
    """
)
# A person's decision takes the order off the queue. Whatever else it does follows in the
# same transaction (behind the scope's lease), or rolls back with it.
# Twice: only a flagged order matches, so a second resolve (or a rival's) finds it cleared
# and changes nothing.
CLEAR_REVIEW_FLAG = sa.text(
    """
    UPDATE customer_order SET needs_manual_review = false
     WHERE tenant_id = :tenant AND order_number = :item AND needs_manual_review
    RETURNING id, status, version
    """
)
# A person's re-submission puts the order's delivery items back to READY, never one being
# sent. A dead letter gets its attempts reset. The idempotency key stays the same, so the
# downstream dedupes a re-send.
# Twice: it runs only after CLEAR_REVIEW_FLAG matched, once per decision. A second decision
# finds no flag and never gets here.
REVIVE_DELIVERY_ITEMS = sa.text(
    """
    UPDATE delivery_attempt_item
       SET attempt_count = CASE WHEN status = 'DEAD_LETTER' THEN 0 ELSE attempt_count END,
           status = 'READY', next_attempt_at = clock_timestamp(), updated_at = clock_timestamp()
     WHERE order_id = :id AND status IN ('DELIVERED', 'READY', 'DEAD_LETTER')
    RETURNING id
    """
)
# The person's re-submission takes the next number of the order's budget. It may go beyond
# a spent budget, because a person decided.
# Twice: n is taken once. A rival taking the same n conflicts, adds nothing, and the
# decision rolls back (below).
RECORD_REVIEWED_RESUBMISSION = sa.text(
    """
    INSERT INTO order_resubmission (order_id, resubmission, tenant_id, job_run_id, requested_at)
    SELECT :id, coalesce(max(resubmission), 0) + 1, :tenant, :action_id, clock_timestamp()
      FROM order_resubmission WHERE order_id = :id
    ON CONFLICT (order_id, resubmission) DO NOTHING
    RETURNING resubmission
    """
)
# A person adopts the downstream's status, only if ours is still the one the run saw.
# Twice: the status and version move, so a second adoption with the same reading matches
# nothing. The flag, cleared first, stops it even earlier.
ADOPT_REVIEWED_STATUS = sa.text(
    """
    UPDATE customer_order SET status = :status, version = version + 1,
           updated_at = clock_timestamp()
     WHERE id = :id AND status = :ours
    RETURNING id
    """
)


def _cleared(conn: Connection, item: ReviewItem) -> Any:
    return conn.execute(CLEAR_REVIEW_FLAG, {"tenant": item.tenant, "item": item.item}).first()


def _dismiss(conn: Connection, item: ReviewItem, action_id: Any) -> str | None:
    return "flag cleared; nothing else changed" if _cleared(conn, item) else None


def _describe_resubmit(item: ReviewItem) -> str:
    if item.ours not in ("SUBMITTED", "IN_FULFILLMENT"):
        raise BadInput(f"{item.item} is {item.ours}, not in flight: nothing to re-submit")
    return (
        "its delivery items back to READY (a dead letter with its attempts reset), the next "
        "re-submission recorded with its OrderResubmitRequested event, the flag cleared"
    )


def _resubmit_reviewed(conn: Connection, item: ReviewItem, action_id: Any) -> str | None:
    order = _cleared(conn, item)
    if order is None:
        return None
    _describe_resubmit(replace(item, ours=order.status))
    revived = conn.execute(REVIVE_DELIVERY_ITEMS, {"id": order.id}).scalars().all()
    if not revived:
        raise BadInput(
            f"{item.item} has no delivery item to re-submit (none, or one being sent now): "
            "nothing changed"
        )
    n = conn.execute(
        RECORD_REVIEWED_RESUBMISSION,
        {"id": order.id, "tenant": item.tenant, "action_id": action_id},
    ).scalar()
    if n is None:
        raise BadInput(f"{item.item} was re-submitted by someone else meanwhile: nothing changed")
    append_event(
        conn,
        BatchOutcome(),
        RESUBMIT_EVENT,
        {
            "key": f"order:{order.id}:resubmit:{n}",
            "tenant": item.tenant,
            "id": order.id,
            "type": "OrderResubmitRequested",
            "payload": json.dumps({"order_number": item.item, "resubmission": n}),
        },
    )
    return f"re-submission {n}: {len(revived)} delivery item(s) back to READY; flag cleared"


def _describe_adopt(item: ReviewItem) -> str:
    if item.theirs is None:
        raise BadInput(
            f"the downstream had no status for {item.item} to adopt (it was missing there): "
            "resubmit or dismiss it"
        )
    if item.theirs not in ORDER_STATUSES:
        raise BadInput(f"the downstream's status {item.theirs} is not one an order has here")
    return f"its status {item.ours} → {item.theirs} with its OrderStatusAdopted event, the flag cleared"


def _adopt_reviewed(conn: Connection, item: ReviewItem, action_id: Any) -> str | None:
    order = _cleared(conn, item)
    if order is None:
        return None
    _describe_adopt(item)
    adopted = conn.execute(
        ADOPT_REVIEWED_STATUS, {"id": order.id, "status": item.theirs, "ours": item.ours}
    ).first()
    if adopted is None:
        raise BadInput(
            f"{item.item} is {order.status} now, not {item.ours} as flagged: nothing changed; "
            "look at it again (qo-ops review list)"
        )
    append_event(
        conn,
        BatchOutcome(),
        ADOPTED_EVENT,
        {
            "key": f"order:{order.id}:adopted:{item.theirs}",
            "tenant": item.tenant,
            "id": order.id,
            "type": "OrderStatusAdopted",
            "payload": json.dumps({"order_number": item.item, "status": item.theirs}),
        },
    )
    return f"status {item.ours} → {item.theirs} adopted; flag cleared"


REVIEW = Review(
    waiting=WAITING_FOR_REVIEW,
    actions={
        "resubmit": ReviewAction(
            "send the order to the fulfilment system again", _describe_resubmit, _resubmit_reviewed
        ),
        "adopt": ReviewAction(
            "take the fulfilment system's status as ours", _describe_adopt, _adopt_reviewed
        ),
        "dismiss": ReviewAction(
            "clear the flag and change nothing else",
            lambda item: "the flag cleared; nothing else changes",
            _dismiss,
        ),
    },
)
