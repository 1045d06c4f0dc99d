"""read_model_repair recomputes order_read_model rows that drifted from their source
(customer_order, quote), per tenant and day. A dry run reports the drifted rows.

The job keeps no checkpoint. The selection is "orders of the window whose read-model row
differs", and the repair removes a row from it, so a rerun finds exactly what is left.

Within a run, each batch starts after the last one. Its ``position`` is its last order's
``(submitted_at, id)``. So a batch does not walk the orders that earlier batches already
repaired. Without it, every batch would re-read the window from its start, which is
quadratic in the window's size. The runner ends with one pass from the start. It takes that
pass only if the selection, counted from the start with held rows included, still matches
something. With nothing left, that pass's plan walks every order of the window, while the
count is a cheaper join (figures in bench/TUNING.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from qo_ops.db.arrays import int_array
from qo_ops.db.schema import customer_order, order_read_model
from qo_ops.platform.job.options import Limits
from qo_ops.platform.job.outcome import BatchContext, BatchOutcome, OutcomeCheck
from qo_ops.platform.job.spec import (
    Batching,
    CheckSpec,
    Deployment,
    JobSpec,
    Positions,
    Presentation,
    SkipLocked,
)
from qo_ops.platform.run.selection import after_position, with_selection

# Drift by kind: the row is missing, or a column derived from the order differs.
_DRIFT_KINDS: dict[str, sa.ColumnElement[bool]] = {
    "missing": order_read_model.c.order_id.is_(None),
    "status": order_read_model.c.status != customer_order.c.status,
    "total_amount": order_read_model.c.total_amount != customer_order.c.total_amount,
    "line_count": order_read_model.c.line_count != customer_order.c.line_count,
    "order_number": order_read_model.c.order_number != customer_order.c.order_number,
    "source_version": order_read_model.c.source_version != customer_order.c.version,
}
# Drift is any of them. The selection and the outcome check share it.
_DRIFT = sa.or_(*_DRIFT_KINDS.values())


def drifted_orders(ctx: BatchContext) -> sa.Select[Any]:
    """Select the tenant's orders submitted in the window whose read-model row drifted, after
    the run's position, on ix_customer_order_tenant_submitted."""
    return after_position(
        _drifted_in_window(ctx),
        (customer_order.c.submitted_at, customer_order.c.id),
        ctx.position,
        ("submitted_at", "id"),
    )


def _drifted_in_window(ctx: BatchContext) -> sa.Select[Any]:
    """Select every drifted order of the window, by (submitted_at, id), whatever the position."""
    return (
        _orders_of_window(sa.select(customer_order.c.id), ctx)
        .where(_DRIFT)
        .order_by(customer_order.c.submitted_at, customer_order.c.id)
    )


def _orders_of_window(query: sa.Select[Any], ctx: BatchContext) -> sa.Select[Any]:
    """Run ``query`` over the tenant's orders submitted in the window, each beside its
    read-model row (if any)."""
    start, end = ctx.scope.window_bounds()
    return query.select_from(
        customer_order.outerjoin(
            order_read_model, order_read_model.c.order_id == customer_order.c.id
        )
    ).where(
        customer_order.c.tenant_id == ctx.scope.tenant_id,
        customer_order.c.submitted_at >= start,
        customer_order.c.submitted_at < end,
    )


# Recompute the rows from the source. The two statements below share the upsert: its
# columns here, its rows (``o``, an order, beside ``q``, its quote) each statement's own.
_REPAIR_INTO = """
        INSERT INTO order_read_model AS r (order_id, tenant_id, order_number, quote_number, status,
                                           total_amount, line_count, source_version, refreshed_at)
        SELECT o.id, o.tenant_id, o.order_number, q.quote_number, o.status, o.total_amount,
               o.line_count, o.version, clock_timestamp()"""
# The rest of the upsert the two statements below share: only rows that differ are written.
_REPAIR_ON_CONFLICT = """
        ON CONFLICT (order_id) DO UPDATE
           SET order_number = EXCLUDED.order_number, quote_number = EXCLUDED.quote_number,
               status = EXCLUDED.status, total_amount = EXCLUDED.total_amount,
               line_count = EXCLUDED.line_count, source_version = EXCLUDED.source_version,
               refreshed_at = EXCLUDED.refreshed_at
         WHERE (r.order_number, r.quote_number, r.status, r.total_amount, r.line_count, r.source_version)
               IS DISTINCT FROM (EXCLUDED.order_number, EXCLUDED.quote_number, EXCLUDED.status,
                                 EXCLUDED.total_amount, EXCLUDED.line_count, EXCLUDED.source_version)
        RETURNING 1"""

# The batch given as ids. It also returns the last order's submitted_at, where the next
# batch's selection starts.
# Twice: the WHERE on the update leaves rows that are already right untouched, so a second
# run writes nothing.
REPAIR_READ_MODEL_BATCH = sa.text(
    f"""
    WITH repaired AS ({_REPAIR_INTO}
          FROM customer_order o LEFT JOIN quote q ON q.id = o.quote_id
         WHERE o.id = ANY(CAST(:ids AS bigint[])) AND o.tenant_id = :tenant {_REPAIR_ON_CONFLICT}
    )
    SELECT (SELECT count(*) FROM repaired) AS repaired,
           (SELECT submitted_at FROM customer_order WHERE id = :last_id) AS last_submitted_at
    """
)

# The batch selected in the statement itself (Batching.claims): the runner's selection, which
# locks the orders, with the columns the upsert reads, goes in ``{selection}``
# (selection.with_selection); the orders are not looked up again. How many it holds is the
# batch's size, and its last order by (submitted_at, id) where the next batch starts.
# Twice: the WHERE on the update leaves rows that are already right untouched, so a second
# run writes nothing.
CLAIM_BATCH = f"""
    WITH batch AS ({{selection}}), repaired AS ({_REPAIR_INTO}
          FROM batch o LEFT JOIN quote q ON q.id = o.quote_id {_REPAIR_ON_CONFLICT}
    )
    SELECT (SELECT count(*) FROM repaired) AS repaired,
           (SELECT count(*) FROM batch) AS selected,
           (SELECT submitted_at FROM batch ORDER BY submitted_at DESC, id DESC LIMIT 1)
               AS last_submitted_at,
           (SELECT id FROM batch ORDER BY submitted_at DESC, id DESC LIMIT 1) AS last_id
    """
# What the upsert reads of each order, beside the id the selection returns.
_ORDER_COLUMNS = ("tenant_id", "order_number", "status", "total_amount", "line_count", "version",
                  "quote_id", "submitted_at")  # fmt: skip


def repair_read_model_batch(
    conn: Connection, ctx: BatchContext, ids: Sequence[Any]
) -> BatchOutcome:
    """Recompute the selected orders' read-model rows."""
    row = conn.execute(
        REPAIR_READ_MODEL_BATCH,
        {"ids": int_array(ids), "tenant": ctx.scope.tenant_id, "last_id": ids[-1]},
    ).one()
    return BatchOutcome(
        succeeded=row.repaired,
        skipped=len(ids) - row.repaired,
        position={"submitted_at": row.last_submitted_at, "id": ids[-1]},
    )


def claim_batch(conn: Connection, ctx: BatchContext, selection: sa.Select[Any]) -> BatchOutcome:
    """Select (and lock) the next drifted orders, the runner's ``selection``, and recompute
    their read-model rows, in one statement. Nothing selected: nothing written, processed 0."""
    columns = [customer_order.c[name] for name in _ORDER_COLUMNS]
    statement, params = with_selection(CLAIM_BATCH, selection.add_columns(*columns))
    row = conn.execute(statement, params).one()
    if not row.selected:
        return BatchOutcome()
    return BatchOutcome(
        processed=int(row.selected),
        succeeded=row.repaired,
        skipped=int(row.selected) - row.repaired,
        position={"submitted_at": row.last_submitted_at, "id": int(row.last_id)},
    )


def drift_of_window(ctx: BatchContext) -> sa.Select[Any]:
    """Count the window's drifted orders, all of them and by kind, in one pass over the window.

    The count uses the selection's own predicate, whatever the position.
    """
    counts: list[sa.ColumnElement[int]] = [sa.func.count().filter(_DRIFT).label("drifted")]
    counts += [sa.func.count().filter(expr).label(kind) for kind, expr in _DRIFT_KINDS.items()]
    return _orders_of_window(cast(sa.Select[Any], sa.select(*counts)), ctx)


# Declared once. Its results in check_read_model carry the same description.
READ_MODEL_MATCHES_SOURCE = CheckSpec(
    "read_model_matches_source", "The read model equals its source for the scope"
)


def check_read_model(conn: Connection, ctx: BatchContext) -> list[OutcomeCheck]:
    """Check that the read model equals its source for every order of the scope.

    Drift is counted by kind, so a dry run's summary says what execute would repair, and why.
    The count of drifted orders is the selection's from its start, which is also the run's
    backlog.
    """
    row = conn.execute(drift_of_window(ctx)).one()
    return [
        READ_MODEL_MATCHES_SOURCE.result(
            row.drifted == 0,
            {"drifted_rows": row.drifted, **{f"drift_{k}": row._mapping[k] for k in _DRIFT_KINDS}},
            backlog=row.drifted,
        )
    ]


SPEC = JobSpec(
    name="read_model_repair",
    kind="repair",
    description="Recompute order_read_model rows that drifted from their orders, per tenant and day",
    partitioning="tenant_day",
    eligible=drifted_orders,
    transition=repair_read_model_batch,
    check=check_read_model,
    checks=(READ_MODEL_MATCHES_SOURCE,),
    defaults=Limits(batch_size=2000),
    destructive=True,
    batching=Batching(
        locks=SkipLocked(of=customer_order),
        # The last pass's LIMIT plan walks every order of the window, so count first.
        positions=Positions(count_before_last_pass=True),
        claims=claim_batch,  # the batch selected, locked and written in one statement
    ),
    presentation=Presentation(
        outcome_asset="order_read_model",
        change="read-model row recomputed from its order",
        healthy="No order_read_model row drifted from its order.",
    ),
    deployment=Deployment(cron_schedule="30 2 * * *"),
)
