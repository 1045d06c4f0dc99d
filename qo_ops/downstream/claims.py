"""Claim → call → record: the three steps of a job that sends items to the downstream
(delivery_retry, notification_publish), written once. Each job names its own statements,
whole; this runs them.

1. *claim* (a batch transaction, then commit): the selected items that are still due get
   attempt + 1 and are hidden until the claim lapses;
2. *call*, with no transaction open: each claimed item is sent (:func:`call_for_each`);
3. *record* (a second transaction): each result is written only while the item is still
   under this claim (the same attempt number), then the run's manners (:func:`finish_calls`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

import sqlalchemy as sa
from sqlalchemy.engine import Connection, RowMapping

from qo_ops.db.arrays import float_array, int_array, text_array
from qo_ops.downstream.calls import (
    CallSettings,
    CallSteps,
    ClaimedItem,
    call_for_each,
    call_settings,
    claim_seconds,
    finish_calls,
    hold_unless_up,
    prepare_calls,
)
from qo_ops.downstream.client import DownstreamClient
from qo_ops.platform.calls.retry import CallResult, Disposition, dispose
from qo_ops.platform.job.options import Limits
from qo_ops.platform.job.outcome import BatchContext, BatchOutcome, run_settings
from qo_ops.platform.job.spec import ExternalPhase

Decision = tuple[CallResult, Disposition]  # a call's result and what the retry policy made of it

# 4,096, a multiple of 32 and 64 calls: a batch's calls wait for its slowest before the next
# batch's start; with the claim and the record overlapped, fewer, larger batches leave them
# idle less, and a stop still stops the calls mid-batch (bench/TUNING.md)
CALLING_DEFAULTS = Limits(batch_size=4096, concurrency=32)


def select_due(
    ctx: BatchContext, table: sa.Table, due_at: sa.Column[Any], *due: sa.ColumnElement[bool]
) -> sa.Select[Any]:
    """The ids (as text) of the tenant's rows of ``table`` that are ``due`` and whose
    ``due_at`` has passed, the longest due first (``id`` breaking ties): what a claim → call
    → record job selects. Text, because the claim binds them as text and a ``uuid`` object
    each costs more to make than the rest of the selection."""
    return (
        sa.select(sa.cast(table.c.id, sa.Text).label("id"))
        .where(table.c.tenant_id == ctx.scope.tenant_id, *due, due_at <= sa.func.now())
        .order_by(due_at, table.c.id)
    )


class CallingSteps(TypedDict):
    """The JobSpec fields a claim → call → record job takes from its :class:`ClaimedCalls`."""

    transition: Callable[[Connection, BatchContext, Sequence[Any]], BatchOutcome]
    then: ExternalPhase
    validate_settings: Callable[[], CallSettings]
    defaults: Limits


@dataclass(frozen=True)
class ClaimedCalls:
    """One job's claim, call and record.

    ``claim`` takes ``:ids``, ``:tenant`` and ``:claim_s`` and returns the items it claimed
    (``id`` as text, the attempt number in ``attempt_field``, what ``call`` needs), each
    handed to the call step as a :class:`~qo_ops.downstream.calls.ClaimedItem`; ``call``
    sends one item (its row) and answers whether the downstream had seen it already.
    ``record`` takes one array per result — ``:ids``, ``:attempts``, ``:states``,
    ``:delays`` and the job's own ``columns`` (each one array value, :mod:`qo_ops.db.arrays`)
    — and returns ``(id, state)`` of each result it recorded; ``on_done`` (if any) then runs
    over the ``:ids`` recorded done; ``give_back`` takes ``:ids``,
    ``:attempts``, ``:refunds`` and ``:revives``: what an outage owes back to items (each
    only while it is still at that attempt; a revived one was dead-lettered by the outage
    and is due again) (:func:`prepare_calls`, :func:`finish_calls`)."""

    side_effect: str
    claim: sa.TextClause
    call: Callable[[DownstreamClient, RowMapping], bool]
    attempt_field: str
    max_attempts: Callable[[RowMapping], int]
    record: sa.TextClause
    columns: Callable[[list[Decision]], dict[str, str]]
    give_back: sa.TextClause
    on_done: sa.TextClause | None = None

    @property
    def steps(self) -> CallingSteps:
        """Its three steps, the downstream's settings (URL, retry policy, manners: checked
        before any claim) and the batch defaults, for the job's JobSpec."""
        return CallingSteps(
            transition=self.claim_batch,
            # the next batch is claimed and the last recorded while a batch's calls are in flight
            then=ExternalPhase(call=self.call_batch, record=self.record_batch, overlap=True),
            validate_settings=call_settings,
            defaults=CALLING_DEFAULTS,
        )

    def claim_batch(self, conn: Connection, ctx: BatchContext, ids: Sequence[Any]) -> BatchOutcome:
        """Claim the selected items for this run's calls, after the run's breaker took up the
        shared row and what an outage owes the tenant's items was given back. While the
        breaker is open (its probe not due), claim nothing and halt the run."""
        refused = prepare_calls(conn, ctx, self.side_effect, self.give_back, len(ids))
        if refused is not None:  # the breaker is open: nothing claimed, the run halts
            return refused
        claim_s = claim_seconds(ctx, len(ids))
        ids_value = text_array([str(i) for i in ids])
        params = {"ids": ids_value, "tenant": ctx.scope.tenant_id, "claim_s": claim_s}
        rows = conn.execute(self.claim, params).mappings().all()  # read-only rows, not copied
        attempt, max_attempts = self.attempt_field, self.max_attempts
        return BatchOutcome(
            work=[ClaimedItem(r["id"], r[attempt], max_attempts(r), r) for r in rows]
        )

    def call_batch(self, ctx: BatchContext, work: list[ClaimedItem]) -> list[CallResult]:
        """Send every claimed item to the downstream (bounded concurrency)."""
        return call_for_each(ctx, work, self.call)

    def record_batch(
        self, conn: Connection, ctx: BatchContext, results: list[CallResult]
    ) -> BatchOutcome:
        """Record each result as the retry policy disposes of it (done, retry with backoff,
        dead, held, or given back), while the item is still under this claim."""
        policy = run_settings(ctx, call_settings).retry
        decisions = hold_unless_up(ctx, [(r, dispose(r, policy)) for r in results], policy)
        rows = conn.execute(
            self.record,
            {
                "ids": text_array([r.item_id for r, _ in decisions]),
                "attempts": int_array([r.attempt for r, _ in decisions]),
                "states": text_array([d.state for _, d in decisions]),
                "delays": float_array([d.delay_s for _, d in decisions]),
                **self.columns(decisions),
            },
        ).all()
        recorded = {row.id: row.state for row in rows}
        done = [i for i, state in recorded.items() if state == "done"]
        if self.on_done is not None and done:
            conn.execute(self.on_done, {"ids": text_array(done)})
        return finish_calls(
            conn, ctx, decisions, recorded, CallSteps(self.side_effect, self.give_back)
        )
