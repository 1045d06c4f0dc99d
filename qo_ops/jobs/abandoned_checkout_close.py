"""abandoned_checkout_close turns OPEN checkout sessions idle past a timeout into ABANDONED
ones. Each gets exactly one CheckoutAbandoned outbox event, in the same transaction.

The idle timeout is 24 hours unless ``QO_OPS_CHECKOUT_IDLE_HOURS`` says otherwise, as a whole
number of hours from 1 to 8760. It is read when a run first selects and kept for that run.

The job keeps no checkpoint. It selects by state (OPEN and idle past the timeout), and
closing a session takes it out of that state, so a rerun simply finds what is left.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from qo_ops.config import whole_number
from qo_ops.db.arrays import int_array
from qo_ops.db.schema import checkout_session
from qo_ops.platform.calls.outbox import transitions_with_events
from qo_ops.platform.job.options import Limits
from qo_ops.platform.job.outcome import BatchContext, BatchOutcome, OutcomeCheck, run_settings
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

SIDE_EFFECT = "checkout_abandoned_event"  # one per transition (job_side_effects_total)

IDLE_HOURS_ENV = "QO_OPS_CHECKOUT_IDLE_HOURS"
DEFAULT_IDLE_HOURS = 24
MIN_IDLE_HOURS = 1  # the job never closes a session idle for less than this
MAX_IDLE_HOURS = 24 * 365
GRACE_MINUTES = 5  # the outcome check forgives sessions that went idle this recently

OPEN: sa.ColumnElement[str] = sa.literal_column(
    "'OPEN'"
)  # a literal, so that every plan can use the partial index


def idle_timeout_hours(environ: dict[str, str] | None = None) -> int:
    """Read the idle timeout in hours from ``QO_OPS_CHECKOUT_IDLE_HOURS`` (default 24)."""
    return whole_number(
        IDLE_HOURS_ENV,
        DEFAULT_IDLE_HOURS,
        MIN_IDLE_HOURS,
        MAX_IDLE_HOURS,
        unit="hours",
        environ=environ,
    )


def _run_idle_hours(ctx: BatchContext) -> int:
    """Return the timeout checked before the run began. The selection, transition and check
    of one run then agree, even if the environment changes meanwhile."""
    return run_settings(ctx, idle_timeout_hours)


# Idle past the run's timeout, a bound interval of whole hours, on ix_checkout_session_open_idle.
_IDLE_PAST_TIMEOUT = sa.text(
    "checkout_session.last_activity_at "
    "< now() - make_interval(hours => CAST(:idle_hours AS integer))"
)


def idle_checkouts(ctx: BatchContext) -> sa.Select[Any]:
    """Select the tenant's OPEN sessions idle past the timeout, longest idle first, on
    ix_checkout_session_open_idle.

    Within a run, each batch starts after the last one (``position``), so it does not walk
    the index entries that earlier batches left dead. The runner ends with one pass from the
    start.
    """
    hours = _run_idle_hours(ctx)
    query = (
        sa.select(checkout_session.c.id)
        .where(
            checkout_session.c.tenant_id == ctx.scope.tenant_id,
            checkout_session.c.status == OPEN,
            _IDLE_PAST_TIMEOUT.bindparams(idle_hours=hours),
        )
        .order_by(checkout_session.c.last_activity_at, checkout_session.c.id)
    )
    query = after_position(
        query,
        (checkout_session.c.last_activity_at, checkout_session.c.id),
        ctx.position,
        ("last_activity_at", "id"),
    )
    return query


# Move each session that is still OPEN to ABANDONED, and insert its event under a unique
# business key.
# Twice: a session already closed, or active again, matches nothing, and a second event for
# it conflicts on business_key and is never inserted.
CLOSE_CHECKOUT_BATCH = sa.text(
    """
    WITH closed AS (
        UPDATE checkout_session
           SET status = 'ABANDONED', closed_at = clock_timestamp(), version = version + 1
         WHERE id = ANY(CAST(:ids AS bigint[]))
           AND tenant_id = :tenant AND status = 'OPEN'
           AND last_activity_at < now() - make_interval(hours => CAST(:hours AS integer))
        RETURNING id, tenant_id, quote_id, last_activity_at, closed_at, version
    ), events AS (
        INSERT INTO outbox_event (id, business_key, tenant_id, aggregate_type, aggregate_id,
                                  event_type, payload, created_at, available_at)
        SELECT gen_random_uuid(), format('checkout:%s:abandoned', id), tenant_id, 'checkout',
               id::text, 'CheckoutAbandoned',
               jsonb_build_object('checkout_id', id, 'quote_id', quote_id,
                                  'last_activity_at', last_activity_at,
                                  'abandoned_at', closed_at, 'version', version),
               clock_timestamp(), clock_timestamp()
          FROM closed
        ON CONFLICT (business_key) DO NOTHING
        RETURNING 1
    )
    SELECT (SELECT count(*) FROM closed) AS closed, (SELECT count(*) FROM events) AS events,
           (SELECT last_activity_at FROM checkout_session WHERE id = :last_id) AS last_activity_at
    """
)


def close_checkout_batch(conn: Connection, ctx: BatchContext, ids: Sequence[Any]) -> BatchOutcome:
    """Abandon the selected sessions and append their CheckoutAbandoned events."""
    row = conn.execute(
        CLOSE_CHECKOUT_BATCH,
        {
            "ids": int_array(ids),
            "tenant": ctx.scope.tenant_id,
            "hours": _run_idle_hours(ctx),
            "last_id": ids[-1],
        },
    ).one()
    outcome = transitions_with_events(
        SIDE_EFFECT, selected=len(ids), changed=row.closed, events=row.events
    )
    outcome.position = {"last_activity_at": row.last_activity_at, "id": ids[-1]}
    return outcome


# Sessions this job closed are those with an event, or closed at least MIN_IDLE_HOURS after
# their last activity. The job closes only sessions idle that long. The app closes a session
# as the user acts, so its closed_at follows the last activity by minutes and it has no event.
# Events are counted once per session in one grouped pass, not by a subquery per session.
EVENT_CHECK = sa.text(
    """
    SELECT count(*) FILTER (WHERE e.n IS NULL) AS missing,
           count(*) FILTER (WHERE e.n > 1) AS duplicated
      FROM checkout_session s
      LEFT JOIN (SELECT aggregate_id, count(*) AS n FROM outbox_event
                  WHERE tenant_id = :tenant AND aggregate_type = 'checkout'
                    AND event_type = 'CheckoutAbandoned'
                  GROUP BY aggregate_id) e ON e.aggregate_id = s.id::text
     WHERE s.tenant_id = :tenant AND s.status = 'ABANDONED'
       AND (e.n IS NOT NULL
            OR s.closed_at >= s.last_activity_at + make_interval(hours => CAST(:min_idle AS integer)))
    """
)
# OPEN sessions idle past :hours plus :grace_min minutes.
IDLE_PAST_GRACE = sa.text(
    "SELECT count(*) FROM checkout_session WHERE tenant_id = :tenant AND status = 'OPEN' "
    "AND last_activity_at < now() - make_interval(hours => CAST(:hours AS integer)) "
    "- make_interval(mins => CAST(:grace_min AS integer))"
)
OLDEST_IDLE_SECONDS = sa.text(
    "SELECT extract(epoch FROM now() - make_interval(hours => CAST(:hours AS integer)) "
    "- min(last_activity_at)) FROM checkout_session "
    "WHERE tenant_id = :tenant AND status = 'OPEN' "
    "AND last_activity_at < now() - make_interval(hours => CAST(:hours AS integer))"
)


# Each check is declared once. Its results in check_abandoned_checkouts carry the same text.
NO_IDLE_OPEN_CHECKOUTS = CheckSpec(
    "no_idle_open_checkouts",
    "No OPEN checkout session is idle past the timeout beyond the grace period",
)
ONE_EVENT_PER_ABANDONED_CHECKOUT = CheckSpec(
    "one_event_per_abandoned_checkout",
    "Every checkout session the job abandoned has exactly one CheckoutAbandoned event",
)


def check_abandoned_checkouts(conn: Connection, ctx: BatchContext) -> list[OutcomeCheck]:
    """Check that no OPEN session is idle past the timeout beyond grace, and that each session
    the job closed has one event."""
    hours = _run_idle_hours(ctx)
    params = {"tenant": ctx.scope.tenant_id, "hours": hours}
    idle = conn.execute(IDLE_PAST_GRACE, {**params, "grace_min": GRACE_MINUTES}).scalar()
    without_parallel_workers(conn)  # so that the events are counted once, not once per worker
    events = conn.execute(
        EVENT_CHECK, {"tenant": ctx.scope.tenant_id, "min_idle": MIN_IDLE_HOURS}
    ).one()
    return [
        NO_IDLE_OPEN_CHECKOUTS.result(
            idle == 0, {"idle_open_checkouts": idle, "idle_timeout_hours": hours}
        ),
        ONE_EVENT_PER_ABANDONED_CHECKOUT.result(
            events.missing == 0 and events.duplicated == 0,
            {"missing_events": events.missing, "duplicated_events": events.duplicated},
        ),
    ]


def oldest_idle_seconds(conn: Connection, ctx: BatchContext) -> float | None:
    """Return the seconds since the tenant's longest-idle OPEN session passed the timeout."""
    value = conn.execute(
        OLDEST_IDLE_SECONDS, {"tenant": ctx.scope.tenant_id, "hours": _run_idle_hours(ctx)}
    ).scalar()
    return seconds_or_none(value)


SPEC = JobSpec(
    name="abandoned_checkout_close",
    kind="sweep",
    description="Abandon OPEN checkout sessions idle past the timeout and emit one "
    "CheckoutAbandoned event each",
    partitioning="tenant",
    eligible=idle_checkouts,
    transition=close_checkout_batch,
    check=check_abandoned_checkouts,
    checks=(NO_IDLE_OPEN_CHECKOUTS, ONE_EVENT_PER_ABANDONED_CHECKOUT),
    defaults=Limits(batch_size=1000),
    validate_settings=idle_timeout_hours,
    batching=Batching(positions=Positions()),
    presentation=Presentation(
        outcome_asset="checkout_sessions",
        change="OPEN → ABANDONED, CheckoutAbandoned event",
        healthy="No OPEN checkout session idle past the timeout (backlog 0 after each run).",
    ),
    deployment=Deployment(cron_schedule="*/30 * * * *", backlog_threshold=1000),
    signals=Signals(lag=oldest_idle_seconds, side_effects=(SIDE_EFFECT,)),
)
