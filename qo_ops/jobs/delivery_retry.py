"""delivery_retry: due delivery items are sent to the fulfilment system with their
business key as the idempotency key; delivered, retried with backoff, or dead-lettered.

Per batch: (1) claim — due items become IN_PROGRESS, attempt + 1, hidden until the claim
lapses (2 × lease TTL) — and commit; (2) call the downstream with no transaction open;
(3) record each result with an update conditional on the claim (same attempt number).
A process that dies between (2) and (3) leaves its items IN_PROGRESS; once the claim lapses
they are due again and are re-sent with the same idempotency key, which the downstream
answers with the original result: never a second delivery.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from qo_ops.db.schema import delivery_attempt_item
from qo_ops.downstream.calls import (
    call_for_each,
    call_settings,
    claim_seconds,
    finish_calls,
    prepare_calls,
)
from qo_ops.errors import one_line
from qo_ops.platform.retry import dispose
from qo_ops.platform.selection import DEAD_LETTER_CAP, capped_count, seconds_or_none
from qo_ops.platform.spec import (
    BatchContext,
    BatchOutcome,
    CheckSpec,
    JobSpec,
    Limits,
    OutcomeCheck,
    run_settings,
)

# literals, so the selection matches the partial index's predicate in every plan
DUE_STATES: list[sa.ColumnElement[str]] = [
    sa.literal_column("'READY'"),
    sa.literal_column("'IN_PROGRESS'"),
]
LAG_SLO_S = 900  # a due item older than this is a breach of the delivery lag SLO
SIDE_EFFECT = "submit_delivery"  # each call is one attempt at it (job_side_effects_total)


def due_items(ctx: BatchContext) -> sa.Select[Any]:
    """READY items that are due, and IN_PROGRESS items whose claim lapsed, oldest first."""
    item = delivery_attempt_item
    return (
        sa.select(item.c.id)
        .where(
            item.c.tenant_id == ctx.scope.tenant_id,
            item.c.status.in_(DUE_STATES),
            item.c.next_attempt_at <= sa.func.now(),
        )
        .order_by(item.c.next_attempt_at, item.c.id)
    )


# Claim: only items still due move (a rerun or a rival claims nothing twice); the attempt
# number taken here is what the result must match to be recorded.
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
    RETURNING i.id, i.business_key, i.tenant_id, i.attempt_count, i.max_attempts, i.payload,
              o.order_number
    """
)


def claim_delivery_batch(conn: Connection, ctx: BatchContext, ids: Sequence[Any]) -> BatchOutcome:
    """Claim the selected items for this run's calls."""
    prepare_calls(conn, ctx)
    claim_s = claim_seconds(ctx, len(ids))
    rows = conn.execute(
        CLAIM_DELIVERY_BATCH,
        {"ids": [str(i) for i in ids], "tenant": ctx.scope.tenant_id, "claim_s": claim_s},
    ).mappings()
    return BatchOutcome(work=[dict(r) for r in rows])


def send_deliveries(ctx: BatchContext, work: list[Any]) -> list[Any]:
    """Submit every claimed item to the fulfilment system (bounded concurrency)."""
    return call_for_each(
        ctx,
        work,
        lambda client, item: (
            client.submit_delivery(
                item["business_key"], item["tenant_id"], item["order_number"], item["payload"]
            ).duplicate
        ),
        attempt_field="attempt_count",
        max_attempts=lambda item: item["max_attempts"],
    )


# Record results, each only if the item is still under this claim (same attempt number). A
# released item (the run stopped before its call, or before its answer, or the breaker was
# open) is due again at once with its attempt given back: stopping is not the item's
# failure. So is a rate-limited item (due after Retry-After) and one spared by the breaker.
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
    RETURNING i.id, r.state
    """
)

_STATE = {
    "done": "DELIVERED",
    "retry": "READY",
    "dead": "DEAD_LETTER",
    "release": "READY",
    "wait": "READY",
    "spare": "READY",
}

# The breaker opened: the failures that started the outage in an earlier batch of this run
# get their attempt back and are due again (only while nobody claimed them since).
GIVE_BACK_DELIVERY_ATTEMPTS = sa.text(
    """
    UPDATE delivery_attempt_item i
       SET attempt_count = i.attempt_count - 1, next_attempt_at = clock_timestamp(),
           updated_at = clock_timestamp()
      FROM unnest(CAST(:ids AS uuid[]), CAST(:attempts AS int[])) AS r(id, attempt)
     WHERE i.id = r.id AND i.status = 'READY' AND i.attempt_count = r.attempt
    """
)


def record_delivery_results(
    conn: Connection, ctx: BatchContext, results: list[Any]
) -> BatchOutcome:
    """Write DELIVERED / READY with backoff / DEAD_LETTER for each call result."""
    policy = run_settings(ctx, call_settings).retry
    decisions = [(r, dispose(r, policy)) for r in results]
    rows = conn.execute(
        RECORD_DELIVERY_RESULTS,
        {
            "ids": [r.item_id for r, _ in decisions],
            "attempts": [r.attempt for r, _ in decisions],
            "states": [d.state for _, d in decisions],
            "statuses": [_STATE[d.state] for _, d in decisions],
            "delays": [d.delay_s for _, d in decisions],
            "refunds": [int(d.refund) for _, d in decisions],
            "codes": [r.code for r, _ in decisions],
            "messages": [one_line(r.message, 300) if r.message else None for r, _ in decisions],
        },
    ).all()
    recorded = {str(row.id): row.state for row in rows}
    return finish_calls(conn, ctx, decisions, recorded, SIDE_EFFECT, GIVE_BACK_DELIVERY_ATTEMPTS)


def check_deliveries(conn: Connection, ctx: BatchContext) -> list[OutcomeCheck]:
    """No due item older than the lag SLO; dead letters counted."""
    row = conn.execute(
        sa.text(
            """
            SELECT count(*) FILTER (WHERE status IN ('READY', 'IN_PROGRESS')
                                      AND next_attempt_at < now() - make_interval(secs => :slo)) AS late,
                   count(*) FILTER (WHERE status = 'DEAD_LETTER') AS dead
              FROM delivery_attempt_item WHERE tenant_id = :tenant
            """
        ),
        {"tenant": ctx.scope.tenant_id, "slo": LAG_SLO_S},
    ).one()
    return [
        OutcomeCheck(
            "no_delivery_past_lag_slo",
            row.late == 0,
            f"no due delivery item has waited more than {LAG_SLO_S // 60} minutes",
            {"late_items": row.late, "dead_letters": row.dead},
        )
    ]


def oldest_due_seconds(conn: Connection, ctx: BatchContext) -> float | None:
    """Seconds the oldest due delivery item has been waiting."""
    value = conn.execute(
        sa.text(
            "SELECT extract(epoch FROM now() - min(next_attempt_at)) FROM delivery_attempt_item "
            "WHERE tenant_id = :tenant AND status IN ('READY', 'IN_PROGRESS') AND next_attempt_at <= now()"
        ),
        {"tenant": ctx.scope.tenant_id},
    ).scalar()
    return seconds_or_none(value)


def dead_lettered(conn: Connection) -> int:
    """Delivery items dead-lettered now, every tenant (counted up to the exporter's cap)."""
    return capped_count(
        conn,
        sa.select(delivery_attempt_item.c.id).where(
            delivery_attempt_item.c.status == "DEAD_LETTER"
        ),
        DEAD_LETTER_CAP,
    )


SPEC = JobSpec(
    name="delivery_retry",
    kind="sweep",
    description="Send due fulfilment deliveries with their idempotency key; retry with backoff or dead-letter",
    partitioning="tenant",
    eligible=due_items,
    transition=claim_delivery_batch,
    external=send_deliveries,
    record=record_delivery_results,
    check=check_deliveries,
    lag=oldest_due_seconds,
    dead_letters=dead_lettered,
    outcome_asset="delivery_items",
    checks=(
        CheckSpec(
            "no_delivery_past_lag_slo",
            "No due delivery item older than the lag SLO",
            blocking=False,
        ),
    ),
    cron_schedule="*/5 * * * *",
    backlog_threshold=500,
    # 1,024, a multiple of 32 and 64 calls: a batch's calls wait for its slowest, then for the
    # record and the next claim; fewer, larger batches leave them idle less (bench/TUNING.md)
    defaults=Limits(batch_size=1024, concurrency=32),
    change="sent with its idempotency key: delivered, retried or dead-lettered",
    healthy="No delivery due for longer than 15 minutes, and no dead letter waiting for a person.",
    side_effects=(SIDE_EFFECT,),
    validate_settings=call_settings,  # downstream URL and retry policy, before any claim
)
