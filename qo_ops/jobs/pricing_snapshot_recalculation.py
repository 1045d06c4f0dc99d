"""pricing_snapshot_recalculation is a backfill per tenant and day. Every quote created in
the window gets a pricing snapshot for the tenant's CURRENT price book. The snapshot is
recomputed from the quote's lines (``sum(quantity * unit_price) * price_factor``,
``line_count``) and upserted by ``(quote_id, price_book_version)``.

A backfill walks a key range. The selection is every quote of the window after the
checkpoint cursor, in ``(created_at, id)`` order (index ``ix_quote_tenant_created``), whether
or not its snapshot is right. Quotes do not leave the selection when processed. So the
cursor, saved in each batch's own transaction, is what makes a rerun resume where the last
commit left off. Once a run has gone through the window, the checkpoint stays (done is done),
and a later run of that window is ``no_work``. The upsert only writes a row whose values
differ, so redoing a batch is harmless. Changed rows count as succeeded, and already-right
ones as skipped.

The selection takes no row locks (``Batching(locks=None)``). One run per scope
holds the lease, and ``SKIP LOCKED`` would let a quote locked by some business transaction
fall behind the cursor and never be recalculated.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from qo_ops.db.arrays import int_array
from qo_ops.db.schema import quote
from qo_ops.errors import ClassifiedError
from qo_ops.platform.job.options import Limits
from qo_ops.platform.job.outcome import BatchContext, BatchOutcome, OutcomeCheck
from qo_ops.platform.job.spec import (
    Batching,
    Checkpointing,
    CheckSpec,
    Deployment,
    JobSpec,
    Presentation,
    Signals,
)
from qo_ops.platform.run.selection import with_selection

CHECK_NAME = "current_snapshot_for_every_quote"


class NoCurrentPriceBook(ClassifiedError):
    """The tenant has no current price book, so there is nothing to recompute against."""

    error_code = "no_current_price_book"


def quotes_after_cursor(ctx: BatchContext) -> sa.Select[Any]:
    """Select the tenant's quotes created in the window after the checkpoint, by created_at, id."""
    start, end = ctx.scope.window_bounds()
    query = (
        sa.select(quote.c.id)
        .where(
            quote.c.tenant_id == ctx.scope.tenant_id,
            quote.c.created_at >= start,
            quote.c.created_at < end,
        )
        .order_by(quote.c.created_at, quote.c.id)
    )
    cursor = ctx.cursor
    if cursor:
        after = sa.tuple_(
            sa.bindparam(
                "cursor_created_at", parse_cursor_time(cursor), sa.DateTime(timezone=True)
            ),
            sa.bindparam("cursor_id", int(cursor["id"]), sa.BigInteger),
        )
        query = query.where(sa.tuple_(quote.c.created_at, quote.c.id) > after)
    return query


def parse_cursor_time(cursor: dict[str, Any]) -> datetime:
    """Parse the cursor's ``created_at``, an ISO string with its UTC offset, as a datetime."""
    value = datetime.fromisoformat(str(cursor["created_at"]))
    if value.tzinfo is None:
        raise ValueError("checkpoint cursor created_at has no UTC offset")
    return value


# One set-based statement per batch recomputes the batch's snapshots for the current price
# book and upserts only what differs. It reports how many rows changed, whether the tenant has
# a current price book, and where the next batch starts. The two statements below share it:
# RECALCULATE_BATCH is given the batch as ids, CLAIM_BATCH selects it itself. Between the
# head and its lines comes ``FROM <quotes> q``, where q has each quote's id and tenant_id.
_RECALCULATE_HEAD = """
    pb AS (
        SELECT version, price_factor FROM price_book WHERE tenant_id = :tenant AND is_current
    ), computed AS (
        SELECT q.id AS quote_id, q.tenant_id, pb.version,
               round(coalesce(sum(l.quantity * l.unit_price), 0) * pb.price_factor, 2) AS total_amount,
               count(l.id)::int AS line_count"""
# The quotes' lines, the tenant's quotes only: shared by the two statements below.
_RECALCULATE_LINES = """
          CROSS JOIN pb
          LEFT JOIN quote_line l ON l.quote_id = q.id
         WHERE q.tenant_id = :tenant"""
# The rest of the statement the two below share: the upsert and the counts.
_RECALCULATE_TAIL = """
         GROUP BY q.id, q.tenant_id, pb.version, pb.price_factor
    ), upserted AS (
        INSERT INTO pricing_snapshot AS s (tenant_id, quote_id, price_book_version, total_amount,
                                           line_count, computed_at, job_run_id)
        SELECT tenant_id, quote_id, version, total_amount, line_count, clock_timestamp(), :run
          FROM computed
         ORDER BY quote_id
        ON CONFLICT (quote_id, price_book_version) DO UPDATE
           SET total_amount = EXCLUDED.total_amount, line_count = EXCLUDED.line_count,
               computed_at = EXCLUDED.computed_at, job_run_id = EXCLUDED.job_run_id
         WHERE (s.total_amount, s.line_count)
               IS DISTINCT FROM (EXCLUDED.total_amount, EXCLUDED.line_count)
        RETURNING 1
    )
    SELECT (SELECT count(*) FROM upserted) AS changed,
           EXISTS (SELECT 1 FROM pb) AS has_price_book,"""

# The batch given as ids; the new cursor is the last id's created_at.
# Twice: one snapshot per (quote, price-book version), updated only where it differs, so a
# second run over the same quotes and book writes nothing.
RECALCULATE_BATCH = sa.text(
    f"""
    WITH {_RECALCULATE_HEAD}
          FROM quote q {_RECALCULATE_LINES} AND q.id = ANY(CAST(:ids AS bigint[]))
    {_RECALCULATE_TAIL}
           (SELECT created_at FROM quote WHERE id = :last AND tenant_id = :tenant) AS last_created_at
    """
)

# The batch selected in the statement itself (Batching.claims): the runner's selection, each
# quote's created_at and tenant_id beside its id, goes in ``{selection}``
# (selection.with_selection). The snapshots are computed from the selection's rows as they
# are, without looking each quote up again by its primary key (15 % of the statement at
# 1,000,000 quotes, bench/TUNING.md). How many it holds is the batch's size, and its last
# quote by (created_at, id) the new cursor.
# Twice: one snapshot per (quote, price-book version), updated only where it differs, so a
# second run over the same quotes and book writes nothing.
CLAIM_BATCH = f"""
    WITH batch AS ({{selection}}),
    {_RECALCULATE_HEAD}
          FROM batch q {_RECALCULATE_LINES} {_RECALCULATE_TAIL}
           (SELECT count(*) FROM batch) AS selected,
           (SELECT created_at FROM batch ORDER BY created_at DESC, id DESC LIMIT 1) AS last_created_at,
           (SELECT id FROM batch ORDER BY created_at DESC, id DESC LIMIT 1) AS last_id
    """


def recalculate_batch(conn: Connection, ctx: BatchContext, ids: Sequence[Any]) -> BatchOutcome:
    """Upsert the selected quotes' snapshots for the current price book."""
    row = conn.execute(
        RECALCULATE_BATCH,
        {
            "ids": int_array(ids),
            "tenant": ctx.scope.tenant_id,
            "run": ctx.job_run_id,
            "last": int(ids[-1]),
        },
    ).one()
    return _outcome(ctx, row, len(ids), int(ids[-1]))


def claim_batch(conn: Connection, ctx: BatchContext, selection: sa.Select[Any]) -> BatchOutcome:
    """Select the next quotes (the runner's ``selection``) and upsert their snapshots for the
    current price book, in one statement. Nothing selected: nothing written, processed 0."""
    statement, params = with_selection(
        CLAIM_BATCH, selection.add_columns(quote.c.created_at, quote.c.tenant_id)
    )
    params |= {"tenant": ctx.scope.tenant_id, "run": ctx.job_run_id}
    row = conn.execute(statement, params).one()
    if not row.selected:
        return BatchOutcome()
    outcome = _outcome(ctx, row, int(row.selected), int(row.last_id))
    outcome.processed = int(row.selected)
    return outcome


def _outcome(ctx: BatchContext, row: Any, selected: int, last_id: int) -> BatchOutcome:
    """A recalculated batch's outcome, its cursor at the last quote selected (``last_id``)."""
    if not row.has_price_book:
        # Raising rolls the batch back and fails the run. The checkpoint stays where it was.
        raise NoCurrentPriceBook(f"tenant {ctx.scope.tenant_id} has no current price book")
    if row.last_created_at is None:  # cannot happen, since the selection just returned it
        raise RuntimeError("the last selected quote vanished before its cursor was taken")
    changed = int(row.changed)
    return BatchOutcome(
        succeeded=changed,
        skipped=selected - changed,
        cursor={"created_at": row.last_created_at.isoformat(), "id": last_id},
    )


# One grouped pass over the window's quotes and their lines, joined to their snapshot at the
# current price-book version. The price factor is one value for the whole pass, not a join
# repeated for each line. It comes from a scalar subquery, NULL without a current book.
VERIFY_WINDOW = sa.text(
    """
    WITH pb AS (
        SELECT version, price_factor FROM price_book WHERE tenant_id = :tenant AND is_current
    ), expected AS (
        SELECT q.id,
               round(coalesce(sum(l.quantity * l.unit_price), 0) * (SELECT price_factor FROM pb), 2)
                   AS total_amount,
               count(l.id)::int AS line_count
          FROM quote q
          LEFT JOIN quote_line l ON l.quote_id = q.id
         WHERE q.tenant_id = :tenant AND q.created_at >= :start AND q.created_at < :end
         GROUP BY q.id
    )
    SELECT (SELECT version FROM pb) AS current_version,
           count(*) AS quotes,
           count(*) FILTER (WHERE s.quote_id IS NULL) AS missing,
           count(*) FILTER (WHERE s.quote_id IS NOT NULL
                              AND (s.total_amount, s.line_count)
                                  IS DISTINCT FROM (e.total_amount, e.line_count)) AS mismatched
      FROM expected e
      LEFT JOIN pricing_snapshot s
        ON s.quote_id = e.id AND s.price_book_version = (SELECT version FROM pb)
    """
)


# Declared once. Its results in check_snapshots carry the same description.
CURRENT_SNAPSHOT_FOR_EVERY_QUOTE = CheckSpec(
    CHECK_NAME, "Every quote of the window has a snapshot for the current price book; totals match"
)


def check_snapshots(conn: Connection, ctx: BatchContext) -> list[OutcomeCheck]:
    """Check that every quote of the window has a current-version snapshot with the right total."""
    start, end = ctx.scope.window_bounds()
    row = conn.execute(
        VERIFY_WINDOW, {"tenant": ctx.scope.tenant_id, "start": start, "end": end}
    ).one()
    has_price_book = row.current_version is not None
    passed = row.quotes == 0 or (has_price_book and row.missing == 0 and row.mismatched == 0)
    return [
        CURRENT_SNAPSHOT_FOR_EVERY_QUOTE.result(
            passed,
            {
                "quotes": int(row.quotes),
                "missing_snapshots": int(row.missing),
                "mismatched_snapshots": int(row.mismatched),
                "current_price_book_version": row.current_version,
            },
        )
    ]


SPEC = JobSpec(
    name="pricing_snapshot_recalculation",
    kind="backfill",
    description="Recompute each quote's pricing snapshot for the current price book, per tenant and day",
    partitioning="tenant_day",
    eligible=quotes_after_cursor,
    transition=recalculate_batch,
    check=check_snapshots,
    checks=(CURRENT_SNAPSHOT_FOR_EVERY_QUOTE,),
    defaults=Limits(batch_size=2000, throttle_ms=0),
    batching=Batching(
        locks=None,  # one run per scope holds the lease (see the docstring)
        checkpoint=Checkpointing(rescan_when_complete=False),  # a window gone through stays done
        claims=claim_batch,  # the batch selected and written in one statement
    ),
    presentation=Presentation(
        outcome_asset="pricing_snapshots",
        change="snapshot recomputed for the current price book",
        healthy="Every quote of a day has a snapshot of the current price book equal to its lines.",
    ),
    deployment=Deployment(cron_schedule="45 1 * * *"),  # daily, UTC
    signals=Signals(error_classes=(NoCurrentPriceBook.error_code,)),
)
