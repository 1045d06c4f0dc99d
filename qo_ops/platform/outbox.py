"""The transactional outbox: events are written in the business transaction, once per
business key, and published later by the relay (consumers dedupe on the event id)."""

from __future__ import annotations

import json

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from qo_ops.platform.spec import BatchOutcome


def append_event(
    conn: Connection,
    *,
    business_key: str,
    tenant_id: str,
    aggregate_type: str,
    aggregate_id: str,
    event_type: str,
    payload: dict[str, object],
) -> bool:
    """Append one event; False when its business key already has one (duplicate prevented)."""
    inserted = conn.execute(
        sa.text(
            "INSERT INTO outbox_event (id, business_key, tenant_id, aggregate_type, aggregate_id, "
            "event_type, payload) VALUES (gen_random_uuid(), :key, :tenant, :agg_type, :agg_id, "
            ":event_type, CAST(:payload AS jsonb)) ON CONFLICT (business_key) DO NOTHING RETURNING 1"
        ),
        {
            "key": business_key,
            "tenant": tenant_id,
            "agg_type": aggregate_type,
            "agg_id": aggregate_id,
            "event_type": event_type,
            "payload": json.dumps(payload, sort_keys=True),
        },
    ).first()
    return inserted is not None


def transitions_with_events(
    side_effect: str, *, selected: int, changed: int, events: int
) -> BatchOutcome:
    """The outcome of a batch that changed ``changed`` of ``selected`` rows, each change
    appending one event under its business key: ``events`` were appended, the rest found
    theirs already there (a duplicate prevented). Rows not changed had moved on since the
    selection (skipped). Each change is one attempt at ``side_effect``."""
    outcome = BatchOutcome(
        succeeded=changed,
        skipped=selected - changed,
        events_written=events,
        duplicates_prevented=changed - events,
    )
    outcome.side_effect(side_effect, "success", events)
    outcome.side_effect(side_effect, "duplicate_prevented", changed - events)
    return outcome
