"""A job's selection as the runner uses it (counted, and taken a batch at a time), and
small pieces the jobs' selections share."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from qo_ops.platform.spec import BatchContext, JobSpec


def count_eligible(conn: Connection, spec: JobSpec, ctx: BatchContext) -> int:
    """How many items the run's selection matches now (the dry-run estimate)."""
    selection = spec.eligible(ctx).order_by(None).subquery()
    return int(conn.execute(sa.select(sa.func.count()).select_from(selection)).scalar() or 0)


def select_batch(conn: Connection, spec: JobSpec, ctx: BatchContext, limit: int) -> list[Any]:
    """The next ``limit`` items, locked for this transaction (skipping ones others hold)."""
    query = spec.eligible(ctx).limit(limit)
    if spec.compete_with_skip_locked:
        query = query.with_for_update(skip_locked=True, of=spec.lock_of)
    return list(conn.execute(query).scalars().all())


def after_position(
    query: sa.Select[Any],
    columns: tuple[sa.ColumnElement[Any], ...],
    position: dict[str, Any] | None,
    keys: tuple[str, ...],
) -> sa.Select[Any]:
    """``query`` restricted to rows after ``position`` in the order of ``columns`` (a row
    comparison the index on those columns serves); unchanged when there is no position."""
    if not position:
        return query
    return query.where(sa.tuple_(*columns) > sa.tuple_(*(sa.literal(position[k]) for k in keys)))


def seconds_or_none(value: Any) -> float | None:
    """An age from ``extract(epoch …)``: a float, or None when nothing is waiting."""
    return float(value) if value is not None else None


DEAD_LETTER_CAP = 100_000


def capped_count(conn: Connection, selection: sa.Select[Any], cap: int) -> int:
    """``count(*)`` of ``selection``, reading at most ``cap`` rows (bounded on any table)."""
    limited = selection.limit(cap).subquery()
    return int(conn.execute(sa.select(sa.func.count()).select_from(limited)).scalar_one())
