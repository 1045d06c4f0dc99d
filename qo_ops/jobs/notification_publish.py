"""notification_publish is the outbox relay. It publishes due events to the notification
sink at least once, with the event id as the dedupe key. A delayed event is due once its
``available_at`` passes. Each event is then marked published, retried with backoff, or
dead-lettered.

Each batch runs the same three steps as delivery_retry
(:class:`~qo_ops.downstream.claims.ClaimedCalls`). It claims the events and commits, which
hides each event until the claim lapses and raises its attempt count by one. It publishes
with no transaction open. It records each result only while the claim holds.

A crash between publishing and recording publishes the event again later. The sink dedupes
on the event id.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, RowMapping

from qo_ops.db.arrays import text_array
from qo_ops.db.schema import outbox_event
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

MAX_PUBLISH_ATTEMPTS = 8
LAG_SLO_S = 600  # the oldest due, unpublished event may wait this long
SIDE_EFFECT = "publish_notification"  # each call is one attempt (job_side_effects_total)


def due_events(ctx: BatchContext) -> sa.Select[Any]:
    """Select the tenant's due events that are neither published nor dead-lettered, oldest first."""
    e = outbox_event
    return select_due(
        ctx, e, e.c.available_at, e.c.published_at.is_(None), e.c.dead_lettered_at.is_(None)
    )


# Claim each event that is still due and unpublished. It stays hidden until the claim lapses.
# Twice: a claimed event is not due again until its claim lapses, so a rerun or a rival
# claims nothing twice.
CLAIM_EVENT_BATCH = sa.text(
    """
    UPDATE outbox_event
       SET publish_attempts = publish_attempts + 1,
           available_at = clock_timestamp() + make_interval(secs => :claim_s)
     WHERE id = ANY(CAST(:ids AS uuid[])) AND tenant_id = :tenant
       AND published_at IS NULL AND dead_lettered_at IS NULL AND available_at <= now()
    RETURNING id::text AS id, event_type, tenant_id, payload, publish_attempts
    """
)


def publish_event(client: DownstreamClient, event: RowMapping) -> bool:
    """Publish one claimed event to the notification sink. Return whether it had it already."""
    return client.publish_notification(
        event["id"], event["event_type"], event["tenant_id"], event["payload"]
    )


# Record each result only while the event is still under this claim (same attempt number).
# An event is released when the run stopped before publishing it or before the answer. A
# released event is due again at once, and its attempt is given back.
# Twice: after a rival's claim (a higher attempt) it matches nothing. If it is recorded again,
# a result that settled the event (published, dead, attempt given back) matches nothing, and
# a retry is set to the same state once more.
RECORD_PUBLISH_RESULTS = sa.text(
    """
    UPDATE outbox_event e
       SET published_at = CASE WHEN r.state = 'done' THEN clock_timestamp() END,
           dead_lettered_at = CASE WHEN r.state = 'dead' THEN clock_timestamp() END,
           available_at = CASE WHEN r.state IN ('retry', 'release', 'wait', 'spare', 'hold')
                               THEN clock_timestamp() + make_interval(secs => r.delay_s)
                               ELSE e.available_at END,
           publish_attempts = e.publish_attempts
                              - CASE WHEN r.state IN ('release', 'wait', 'spare', 'hold')
                                     THEN 1 ELSE 0 END,
           last_error_code = CASE WHEN r.state = 'release' THEN e.last_error_code ELSE r.code END
      FROM unnest(CAST(:ids AS uuid[]), CAST(:attempts AS int[]), CAST(:states AS text[]),
                  CAST(:delays AS float8[]), CAST(:codes AS text[]))
           AS r(id, attempt, state, delay_s, code)
     WHERE e.id = r.id AND e.published_at IS NULL AND e.dead_lettered_at IS NULL
       AND e.publish_attempts = r.attempt
    RETURNING e.id::text AS id, r.state
    """
)

# Give back what an outage owed. The breaker opened while these events' systemic failures
# were in its evidence. Their attempts come back, and all of them, dead-lettered ones too,
# are due now.
# Twice: it matches only at the attempt owed, which it lowers, so a second one matches nothing.
GIVE_BACK_PUBLISH_ATTEMPTS = sa.text(
    """
    UPDATE outbox_event e
       SET publish_attempts = e.publish_attempts - r.refund, dead_lettered_at = NULL,
           available_at = clock_timestamp()
      FROM unnest(CAST(:ids AS uuid[]), CAST(:attempts AS int[]), CAST(:refunds AS int[]),
                  CAST(:revives AS bool[])) AS r(id, attempt, refund, revive)
     WHERE e.id = r.id AND e.published_at IS NULL AND e.publish_attempts = r.attempt
       AND (e.dead_lettered_at IS NULL OR r.revive)
    """
)

# Mark as sent the notifications waiting for an event that was just published.
# Twice: only PENDING notifications move, so a second run finds them SENT.
MARK_NOTIFICATIONS_SENT = sa.text(
    """
    UPDATE notification SET status = 'SENT', sent_at = clock_timestamp()
     WHERE outbox_event_id = ANY(CAST(:ids AS uuid[])) AND status = 'PENDING'
    """
)


def publish_columns(decisions: list[Decision]) -> dict[str, str]:
    """Build the error columns RECORD_PUBLISH_RESULTS takes beside ids, attempts, states, delays."""
    return {"codes": text_array([one_line(r.code, 60) if r.code else None for r, _ in decisions])}


EVENTS = ClaimedCalls(
    side_effect=SIDE_EFFECT,
    claim=CLAIM_EVENT_BATCH,
    call=publish_event,
    attempt_field="publish_attempts",
    max_attempts=lambda _event: MAX_PUBLISH_ATTEMPTS,
    record=RECORD_PUBLISH_RESULTS,
    columns=publish_columns,
    give_back=GIVE_BACK_PUBLISH_ATTEMPTS,
    on_done=MARK_NOTIFICATIONS_SENT,  # the notifications waiting for a published event
)


OLDEST_UNPUBLISHED_SECONDS = sa.text(
    "SELECT extract(epoch FROM now() - min(available_at)) FROM outbox_event "
    "WHERE tenant_id = :tenant AND published_at IS NULL AND dead_lettered_at IS NULL "
    "AND available_at <= now()"
)
TENANT_DEAD_EVENTS = sa.text(
    "SELECT count(*) FROM outbox_event WHERE tenant_id = :t AND dead_lettered_at IS NOT NULL"
)
# A tenant's dead-lettered events (all, or the ones named), at most :limit, oldest first.
# This is what a requeue would release, shown by its dry run.
DEAD_TO_REQUEUE = sa.text(
    """
    SELECT id FROM outbox_event
     WHERE tenant_id = :tenant AND dead_lettered_at IS NOT NULL AND published_at IS NULL
       AND (CAST(:ids AS uuid[]) IS NULL OR id = ANY(CAST(:ids AS uuid[])))
     ORDER BY dead_lettered_at, id LIMIT :limit
    """
)
# Make those events due again now, with their attempts reset. Re-publishing is safe because
# the sink and consumers dedupe on the event id.
# Twice: only dead-lettered events move, and a released one is no longer dead-lettered, so
# a second requeue moves nothing.
REQUEUE_DEAD = sa.text(
    """
    UPDATE outbox_event
       SET dead_lettered_at = NULL, publish_attempts = 0, available_at = clock_timestamp()
     WHERE id = ANY(ARRAY(
           SELECT id FROM outbox_event
            WHERE tenant_id = :tenant AND dead_lettered_at IS NOT NULL AND published_at IS NULL
              AND (CAST(:ids AS uuid[]) IS NULL OR id = ANY(CAST(:ids AS uuid[])))
            ORDER BY dead_lettered_at, id LIMIT :limit FOR UPDATE))
    RETURNING id
    """
)
# Every tenant's dead letters, for the exporter's capped count.
DEAD_EVENTS = sa.select(outbox_event.c.id).where(outbox_event.c.dead_lettered_at.is_not(None))


def oldest_unpublished_seconds(conn: Connection, ctx: BatchContext) -> float | None:
    """Return the seconds the tenant's oldest due, unpublished event has been waiting."""
    value = conn.execute(OLDEST_UNPUBLISHED_SECONDS, {"tenant": ctx.scope.tenant_id}).scalar()
    return seconds_or_none(value)


def dead_lettered(conn: Connection) -> int:
    """Count the outbox events dead-lettered now, in every tenant, up to the exporter's cap."""
    return capped_count(conn, DEAD_EVENTS, DEAD_LETTER_CAP)


# Declared once. Its results in check_outbox carry the same description.
OLDEST_UNPUBLISHED_WITHIN_SLO = CheckSpec(
    "oldest_unpublished_within_slo", "Oldest due, unpublished event within the SLO", blocking=False
)


def check_outbox(conn: Connection, ctx: BatchContext) -> list[OutcomeCheck]:
    """Check that the oldest due, unpublished event is within the SLO."""
    age = oldest_unpublished_seconds(conn, ctx)
    dead = conn.execute(TENANT_DEAD_EVENTS, {"t": ctx.scope.tenant_id}).scalar()
    return [
        OLDEST_UNPUBLISHED_WITHIN_SLO.result(
            age is None or age <= LAG_SLO_S,
            {"oldest_unpublished_seconds": round(age or 0.0, 1), "dead_lettered_events": dead},
        )
    ]


SPEC = JobSpec(
    name="notification_publish",
    kind="relay",
    description="Publish due outbox events (delayed ones included) to the notification sink, deduped by event id",
    partitioning="tenant",
    eligible=due_events,
    check=check_outbox,
    checks=(OLDEST_UNPUBLISHED_WITHIN_SLO,),
    **EVENTS.steps,  # the claim, call and record steps, the downstream's settings and defaults
    presentation=Presentation(
        outcome_asset="outbox",
        change="published once by event id, retried or dead-lettered",
        healthy="No outbox event overdue for publishing, and no dead letter waiting for a person.",
    ),
    deployment=Deployment(cron_schedule="* * * * *", backlog_threshold=1000, calls_downstream=True),
    signals=Signals(
        lag=oldest_unpublished_seconds,
        dead_letters=dead_lettered,
        side_effects=(EVENTS.side_effect,),
        # Poison items fail on purpose and are dead-lettered, with their own signal and alert.
        # A run that ends partial_success because of them still keeps the tenant fresh.
        partial_success_is_fresh=True,
    ),
    recovery=Recovery(requeue=DeadLetterKind("outbox event", DEAD_TO_REQUEUE, REQUEUE_DEAD)),
)
