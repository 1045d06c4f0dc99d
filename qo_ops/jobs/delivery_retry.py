"""delivery_retry sends due delivery items to the fulfilment system, with their business
key as the idempotency key. Each item is delivered, retried with backoff, or dead-lettered.

Each batch runs the three steps of :class:`~qo_ops.downstream.claims.ClaimedCalls`:

1. Claim the due items and commit. They become IN_PROGRESS with their attempt count raised
   by one, and stay hidden until the claim lapses (2 × lease TTL).
2. Call the downstream with no transaction open.
3. Record each result with an update that holds only under the claim (same attempt number).

A process that dies between steps 2 and 3 leaves its items IN_PROGRESS. Once the claim
lapses they are due again and are re-sent with the same idempotency key. The downstream
answers with the original result, so an item is never delivered twice.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, RowMapping

from qo_ops.db.arrays import int_array, text_array
from qo_ops.db.schema import delivery_attempt_item
from qo_ops.downstream.claims import ClaimedCalls, Decision, select_due
from qo_ops.downstream.client import DownstreamClient
from qo_ops.errors import one_line
from qo_ops.platform.job.outcome import BatchContext, OutcomeCheck
from qo_ops.platform.job.review import DeadLetterKind
from qo_ops.platform.job.spec import (
    CheckSpec,
    Deployment,
    JobSpec,
    Presentation,
    Recovery,
    Signals,
)
from qo_ops.platform.run.selection import DEAD_LETTER_CAP, capped_count, seconds_or_none

# Literals, so that the selection matches the partial index's predicate in every plan.
DUE_STATES: list[sa.ColumnElement[str]] = [
    sa.literal_column("'READY'"),
    sa.literal_column("'IN_PROGRESS'"),
]
LAG_SLO_S = 900  # a due item older than this breaches the delivery lag SLO
SIDE_EFFECT = "submit_delivery"  # each call is one attempt (job_side_effects_total)


def due_items(ctx: BatchContext) -> sa.Select[Any]:
    """Select READY items that are due and IN_PROGRESS items whose claim lapsed, oldest first."""
    item = delivery_attempt_item
    return select_due(ctx, item, item.c.next_attempt_at, item.c.status.in_(DUE_STATES))


# Claim the items. A result is recorded only if it matches the attempt number taken here.
# Twice: only items still due move, and a claim hides them until it lapses, so a rerun or
# a rival claims nothing twice.
CLAIM_DELIVERY_BATCH = sa.text(
    """
    UPDATE delivery_attempt_item i
       SET status = 'IN_PROGRESS', attempt_count = i.attempt_count + 1,
           next_attempt_at = clock_timestamp() + make_interval(secs => :claim_s),
           updated_at = clock_timestamp()
      FROM customer_order o
     WHERE i.id = ANY(CAST(:ids AS uuid[])) AND i.tenant_id = :tenant
       AND i.status IN ('READY', 'IN_PROGRESS') AND i.next_attempt_at <= now()
       AND o.id = i.order_id
    RETURNING i.id::text AS id, i.business_key, i.tenant_id, i.attempt_count, i.max_attempts,
              i.payload, o.order_number
    """
)


def submit_delivery(client: DownstreamClient, item: RowMapping) -> bool:
    """Submit one claimed item to the fulfilment system. Return whether it had the key already."""
    return client.submit_delivery(
        item["business_key"], item["tenant_id"], item["order_number"], item["payload"]
    ).duplicate


# Record results, each only if the item is still under this claim (same attempt number).
# A released item is due again at once, and its attempt is given back, because stopping is
# not the item's failure. An item is released when the run stopped before its call or its
# answer, or when the breaker was open. A rate-limited item (due after Retry-After) and one
# spared by the breaker get their attempt back too.
# Twice: a recorded item is no longer IN_PROGRESS at that attempt, so recording it again, or
# after a rival claimed it, matches nothing.
RECORD_DELIVERY_RESULTS = sa.text(
    """
    UPDATE delivery_attempt_item i
       SET status = r.status, next_attempt_at = clock_timestamp() + make_interval(secs => r.delay_s),
           attempt_count = i.attempt_count - r.refund,
           last_error_code = CASE WHEN r.state = 'release' THEN i.last_error_code ELSE r.code END,
           last_error_message = CASE WHEN r.state = 'release' THEN i.last_error_message ELSE r.message END,
           last_error_at = CASE WHEN r.code IS NULL OR r.state = 'release' THEN i.last_error_at
                                ELSE clock_timestamp() END,
           updated_at = clock_timestamp()
      FROM unnest(CAST(:ids AS uuid[]), CAST(:attempts AS int[]), CAST(:states AS text[]),
                  CAST(:statuses AS text[]), CAST(:delays AS float8[]), CAST(:refunds AS int[]),
                  CAST(:codes AS text[]), CAST(:messages AS text[]))
           AS r(id, attempt, state, status, delay_s, refund, code, message)
     WHERE i.id = r.id AND i.status = 'IN_PROGRESS' AND i.attempt_count = r.attempt
    RETURNING i.id::text AS id, r.state
    """
)

_STATE = {
    "done": "DELIVERED",
    "retry": "READY",
    "dead": "DEAD_LETTER",
    "release": "READY",
    "wait": "READY",
    "spare": "READY",
    "hold": "READY",
}

# Give back what an outage owed. The breaker opened while these items' systemic failures were
# in its evidence. Their attempts come back, the dead-lettered ones return to READY, and all
# are due now.
# Twice: it matches only at the attempt owed, which it lowers, so a second one matches nothing.
GIVE_BACK_DELIVERY_ATTEMPTS = sa.text(
    """
    UPDATE delivery_attempt_item i
       SET attempt_count = i.attempt_count - r.refund, status = 'READY',
           next_attempt_at = clock_timestamp(), updated_at = clock_timestamp()
      FROM unnest(CAST(:ids AS uuid[]), CAST(:attempts AS int[]), CAST(:refunds AS int[]),
                  CAST(:revives AS bool[])) AS r(id, attempt, refund, revive)
     WHERE i.id = r.id AND i.attempt_count = r.attempt
       AND (i.status = 'READY' OR (r.revive AND i.status = 'DEAD_LETTER'))
    """
)


def delivery_columns(decisions: list[Decision]) -> dict[str, str]:
    """Build the columns RECORD_DELIVERY_RESULTS takes besides ids, attempts, states and delays.

    They are the status (DELIVERED, READY or DEAD_LETTER), the attempt given back, and the
    error.
    """
    return {
        "statuses": text_array([_STATE[d.state] for _, d in decisions]),
        "refunds": int_array([d.refund for _, d in decisions]),
        "codes": text_array([r.code for r, _ in decisions]),
        "messages": text_array(
            [one_line(r.message, 300) if r.message else None for r, _ in decisions]
        ),
    }


DELIVERIES = ClaimedCalls(
    side_effect=SIDE_EFFECT,
    claim=CLAIM_DELIVERY_BATCH,
    call=submit_delivery,
    attempt_field="attempt_count",
    max_attempts=lambda item: item["max_attempts"],
    record=RECORD_DELIVERY_RESULTS,
    columns=delivery_columns,
    give_back=GIVE_BACK_DELIVERY_ATTEMPTS,
)


# The tenant's items due for longer than :slo seconds, and its dead letters.
LATE_AND_DEAD = sa.text(
    """
    SELECT count(*) FILTER (WHERE status IN ('READY', 'IN_PROGRESS')
                              AND next_attempt_at < now() - make_interval(secs => :slo)) AS late,
           count(*) FILTER (WHERE status = 'DEAD_LETTER') AS dead
      FROM delivery_attempt_item WHERE tenant_id = :tenant
    """
)
OLDEST_DUE_SECONDS = sa.text(
    "SELECT extract(epoch FROM now() - min(next_attempt_at)) FROM delivery_attempt_item "
    "WHERE tenant_id = :tenant AND status IN ('READY', 'IN_PROGRESS') AND next_attempt_at <= now()"
)
# A tenant's dead letters (all, or the ones named), at most :limit, oldest first. This is
# what a requeue would move, shown by its dry run.
DEAD_TO_REQUEUE = sa.text(
    """
    SELECT id FROM delivery_attempt_item
     WHERE tenant_id = :tenant AND status = 'DEAD_LETTER'
       AND (CAST(:ids AS uuid[]) IS NULL OR id = ANY(CAST(:ids AS uuid[])))
     ORDER BY updated_at, id LIMIT :limit
    """
)
# Move those dead letters back to READY, due now, with their attempts reset. The idempotency
# key stays, and the downstream answers a re-send of a delivered item with its first result.
# Twice: only DEAD_LETTER rows move, so requeueing twice moves nothing the second time.
REQUEUE_DEAD = sa.text(
    """
    UPDATE delivery_attempt_item
       SET status = 'READY', attempt_count = 0, next_attempt_at = clock_timestamp(),
           updated_at = clock_timestamp()
     WHERE id = ANY(ARRAY(
           SELECT id FROM delivery_attempt_item
            WHERE tenant_id = :tenant AND status = 'DEAD_LETTER'
              AND (CAST(:ids AS uuid[]) IS NULL OR id = ANY(CAST(:ids AS uuid[])))
            ORDER BY updated_at, id LIMIT :limit FOR UPDATE))
    RETURNING id
    """
)
# Every tenant's dead letters, for the exporter's capped count.
DEAD_ITEMS = sa.select(delivery_attempt_item.c.id).where(
    delivery_attempt_item.c.status == "DEAD_LETTER"
)


# Declared once. Its results in check_deliveries carry the same description.
NO_DELIVERY_PAST_LAG_SLO = CheckSpec(
    "no_delivery_past_lag_slo", "No due delivery item older than the lag SLO", blocking=False
)


def check_deliveries(conn: Connection, ctx: BatchContext) -> list[OutcomeCheck]:
    """Check that no due item is older than the lag SLO, and count the dead letters."""
    row = conn.execute(LATE_AND_DEAD, {"tenant": ctx.scope.tenant_id, "slo": LAG_SLO_S}).one()
    return [
        NO_DELIVERY_PAST_LAG_SLO.result(
            row.late == 0, {"late_items": row.late, "dead_letters": row.dead}
        )
    ]


def oldest_due_seconds(conn: Connection, ctx: BatchContext) -> float | None:
    """Return the seconds the oldest due delivery item has been waiting."""
    return seconds_or_none(
        conn.execute(OLDEST_DUE_SECONDS, {"tenant": ctx.scope.tenant_id}).scalar()
    )


def dead_lettered(conn: Connection) -> int:
    """Count the delivery items dead-lettered now, in every tenant, up to the exporter's cap."""
    return capped_count(conn, DEAD_ITEMS, DEAD_LETTER_CAP)


SPEC = JobSpec(
    name="delivery_retry",
    kind="sweep",
    description="Send due fulfilment deliveries with their idempotency key; retry with backoff or dead-letter",
    partitioning="tenant",
    eligible=due_items,
    check=check_deliveries,
    checks=(NO_DELIVERY_PAST_LAG_SLO,),
    **DELIVERIES.steps,  # the claim, call and record steps, the downstream's settings and defaults
    presentation=Presentation(
        outcome_asset="delivery_items",
        change="sent with its idempotency key: delivered, retried or dead-lettered",
        healthy="No delivery due for longer than 15 minutes, and no dead letter waiting for a person.",
    ),
    deployment=Deployment(
        cron_schedule="*/5 * * * *", backlog_threshold=500, calls_downstream=True
    ),
    signals=Signals(
        lag=oldest_due_seconds,
        dead_letters=dead_lettered,
        side_effects=(DELIVERIES.side_effect,),
        # Poison items fail on purpose and are dead-lettered, with their own signal and alert.
        # A run that ends partial_success because of them still keeps the tenant fresh.
        partial_success_is_fresh=True,
    ),
    recovery=Recovery(requeue=DeadLetterKind("delivery item", DEAD_TO_REQUEUE, REQUEUE_DEAD)),
)
