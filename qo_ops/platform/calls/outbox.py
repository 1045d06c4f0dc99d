"""The transactional outbox.

Events are written in the business transaction, once per business key. The relay publishes
them later, and consumers dedupe on the event id."""

from __future__ import annotations

from qo_ops.platform.job.outcome import BatchOutcome, SideEffectResult


def transitions_with_events(
    side_effect: str, *, selected: int, changed: int, events: int
) -> BatchOutcome:
    """The outcome of a batch that changed ``changed`` of ``selected`` rows.

    Each change appends one event under its business key. ``events`` of them were appended.
    The rest found their event already there, which counts as a duplicate prevented. Rows
    not changed had moved on since the selection, so they count as skipped. Each change is
    one attempt at ``side_effect``."""
    outcome = BatchOutcome(
        succeeded=changed,
        skipped=selected - changed,
        events_written=events,
        duplicates_prevented=changed - events,
    )
    outcome.side_effect(side_effect, SideEffectResult.SUCCESS, events)
    outcome.side_effect(side_effect, SideEffectResult.DUPLICATE_PREVENTED, changed - events)
    return outcome
