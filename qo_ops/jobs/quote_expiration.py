"""quote_expiration turns ACTIVE quotes past their expiry into EXPIRED quotes. Each one gets
exactly one QuoteExpired outbox event, in the same transaction.

The job keeps no checkpoint. It selects by state (ACTIVE and past expiry), and the transition
takes a quote out of that state, so a rerun simply finds what is left.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from qo_ops.db.arrays import int_array
from qo_ops.db.schema import quote
from qo_ops.platform.calls.outbox import transitions_with_events
from qo_ops.platform.job.options import Limits
from qo_ops.platform.job.outcome import BatchContext, BatchOutcome, OutcomeCheck
from qo_ops.platform.job.spec import (
    Batching,
    CheckSpec,
    Deployment,
    JobSpec,
    Positions,
    Presentation,
    Signals,
)
from qo_ops.platform.run.selection import (
    after_position,
    seconds_or_none,
    without_parallel_workers,
)

SIDE_EFFECT = "quote_expired_event"  # one per transition, counted in job_side_effects_total

GRACE_MINUTES = 5  # the outcome check forgives quotes that expired this recently


ACTIVE: sa.ColumnElement[str] = sa.literal_column(
    "'ACTIVE'"
)  # a literal, so that every plan can use the partial index


def eligible_quotes(ctx: BatchContext) -> sa.Select[Any]:
    """Select the tenant's ACTIVE quotes past expiry, oldest first, on ix_quote_active_expiry.

    Within a run, each batch starts after the last one (``position``), so it does not walk
    the index entries that earlier batches left dead. The runner ends with one pass from the
    start.
    """
    query = (
        sa.select(quote.c.id)
        .where(
            quote.c.tenant_id == ctx.scope.tenant_id,
            quote.c.status == ACTIVE,
            quote.c.expires_at < sa.func.now(),
        )
        .order_by(quote.c.expires_at, quote.c.id)
    )
    query = after_position(
        query, (quote.c.expires_at, quote.c.id), ctx.position, ("expires_at", "id")
    )
    return query


# Move each quote that is still ACTIVE to EXPIRED, and insert its event under a unique
# business key.
# Twice: a quote already EXPIRED matches nothing, and a second event for it conflicts on
# business_key and is never inserted.
EXPIRE_QUOTE_BATCH = sa.text(
    """
    WITH expired AS (
        UPDATE quote
           SET status = 'EXPIRED', version = version + 1, updated_at = clock_timestamp()
         WHERE id = ANY(CAST(:ids AS bigint[]))
           AND tenant_id = :tenant AND status = 'ACTIVE' AND expires_at < now()
        RETURNING id, tenant_id, expires_at, version
    ), events AS (
        INSERT INTO outbox_event (id, business_key, tenant_id, aggregate_type, aggregate_id,
                                  event_type, payload, created_at, available_at)
        SELECT gen_random_uuid(), format('quote:%s:expired', id), tenant_id, 'quote', id::text,
               'QuoteExpired',
               jsonb_build_object('quote_id', id, 'expired_at', expires_at, 'version', version),
               clock_timestamp(), clock_timestamp()
          FROM expired
        ON CONFLICT (business_key) DO NOTHING
        RETURNING 1
    )
    SELECT (SELECT count(*) FROM expired) AS expired, (SELECT count(*) FROM events) AS events,
           (SELECT expires_at FROM quote WHERE id = :last_id) AS last_expires_at
    """
)


def expire_quote_batch(conn: Connection, ctx: BatchContext, ids: Sequence[Any]) -> BatchOutcome:
    """Expire the selected quotes and append their QuoteExpired events."""
    row = conn.execute(
        EXPIRE_QUOTE_BATCH,
        {"ids": int_array(ids), "tenant": ctx.scope.tenant_id, "last_id": ids[-1]},
    ).one()
    outcome = transitions_with_events(
        SIDE_EFFECT, selected=len(ids), changed=row.expired, events=row.events
    )
    outcome.position = {"expires_at": row.last_expires_at, "id": ids[-1]}
    return outcome


# The tenant's ACTIVE quotes past expiry by more than :grace_min minutes.
OVERDUE_ACTIVE_QUOTES = sa.text(
    "SELECT count(*) FROM quote WHERE tenant_id = :tenant AND status = 'ACTIVE' "
    "AND expires_at < now() - make_interval(mins => CAST(:grace_min AS integer))"
)
# Count the EXPIRED quotes that have no event or more than one. The events are counted in one
# grouped pass, not by a subquery per quote.
EXPIRED_QUOTE_EVENTS = sa.text(
    """
    SELECT count(*) FILTER (WHERE e.n IS NULL) AS missing,
           count(*) FILTER (WHERE e.n > 1) AS duplicated
      FROM quote q
      LEFT JOIN (SELECT aggregate_id, count(*) AS n FROM outbox_event
                  WHERE tenant_id = :tenant AND aggregate_type = 'quote'
                    AND event_type = 'QuoteExpired'
                  GROUP BY aggregate_id) e ON e.aggregate_id = q.id::text
     WHERE q.tenant_id = :tenant AND q.status = 'EXPIRED'
    """
)
OLDEST_OVERDUE_SECONDS = sa.text(
    "SELECT extract(epoch FROM now() - min(expires_at)) FROM quote "
    "WHERE tenant_id = :tenant AND status = 'ACTIVE' AND expires_at < now()"
)


# Each check is declared once. Its results in check_quote_expiration carry the same description.
NO_OVERDUE_ACTIVE_QUOTES = CheckSpec(
    "no_overdue_active_quotes", "No ACTIVE quote is past its expiry beyond the grace period"
)
ONE_EVENT_PER_EXPIRED_QUOTE = CheckSpec(
    "one_event_per_expired_quote", "Every EXPIRED quote has exactly one QuoteExpired event"
)


def check_quote_expiration(conn: Connection, ctx: BatchContext) -> list[OutcomeCheck]:
    """Check that no ACTIVE quote is past expiry beyond grace and each EXPIRED one has one event."""
    tenant = {"tenant": ctx.scope.tenant_id}
    overdue = conn.execute(OVERDUE_ACTIVE_QUOTES, {**tenant, "grace_min": GRACE_MINUTES}).scalar()
    without_parallel_workers(conn)  # so that the events are counted once, not once per worker
    bad_events = conn.execute(EXPIRED_QUOTE_EVENTS, tenant).one()
    return [
        NO_OVERDUE_ACTIVE_QUOTES.result(overdue == 0, {"overdue_active_quotes": overdue}),
        ONE_EVENT_PER_EXPIRED_QUOTE.result(
            bad_events.missing == 0 and bad_events.duplicated == 0,
            {"missing_events": bad_events.missing, "duplicated_events": bad_events.duplicated},
        ),
    ]


def oldest_overdue_seconds(conn: Connection, ctx: BatchContext) -> float | None:
    """Return the seconds since the oldest still-ACTIVE quote of the tenant expired."""
    value = conn.execute(OLDEST_OVERDUE_SECONDS, {"tenant": ctx.scope.tenant_id}).scalar()
    return seconds_or_none(value)


SPEC = JobSpec(
    name="quote_expiration",
    kind="sweep",
    description="Expire ACTIVE quotes past expires_at and emit one QuoteExpired event each",
    partitioning="tenant",
    eligible=eligible_quotes,
    transition=expire_quote_batch,
    check=check_quote_expiration,
    checks=(NO_OVERDUE_ACTIVE_QUOTES, ONE_EVENT_PER_EXPIRED_QUOTE),
    defaults=Limits(batch_size=2000),  # bench/TUNING.md
    batching=Batching(positions=Positions()),
    presentation=Presentation(
        outcome_asset="quotes",
        change="ACTIVE → EXPIRED, QuoteExpired event",
        healthy="No ACTIVE quote past its expiry (backlog 0 after each run; oldest due age near 0).",
    ),
    deployment=Deployment(cron_schedule="*/15 * * * *", backlog_threshold=1000),
    signals=Signals(lag=oldest_overdue_seconds, side_effects=(SIDE_EFFECT,)),
)
