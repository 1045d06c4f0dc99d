"""A job's selection as the runner uses it, counted and taken a batch at a time. Also the
small pieces the jobs' selections share."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql.base import PGDialect
from sqlalchemy.engine import Connection

from qo_ops.platform.job.outcome import BatchContext, BatchOutcome
from qo_ops.platform.job.spec import JobSpec


def count_eligible(conn: Connection, spec: JobSpec, ctx: BatchContext) -> int:
    """How many items the run's selection matches now. This is the dry run's estimate."""
    selection = spec.eligible(ctx).order_by(None).subquery()
    return int(conn.execute(sa.select(sa.func.count()).select_from(selection)).scalar() or 0)


def batch_query(spec: JobSpec, ctx: BatchContext, limit: int) -> sa.Select[Any]:
    """The selection of the next ``limit`` items, locking them for the transaction (items
    others hold are skipped) when the job takes row locks."""
    query = spec.eligible(ctx).limit(limit)
    locks = spec.batching.locks
    if locks is not None:
        query = query.with_for_update(skip_locked=True, of=locks.of)
    return query


def select_batch(conn: Connection, spec: JobSpec, ctx: BatchContext, limit: int) -> list[Any]:
    """The next ``limit`` items, locked for this transaction. Items others hold are skipped."""
    return list(conn.execute(batch_query(spec, ctx, limit)).scalars().all())


def take_batch(
    conn: Connection, spec: JobSpec, ctx: BatchContext, limit: int
) -> list[Any] | BatchOutcome:
    """The next batch: its items, or, for a job whose one statement selects and writes
    (``Batching.claims``), that statement's outcome. An empty list when nothing is left."""
    claims = spec.batching.claims
    if claims is None:
        return select_batch(conn, spec, ctx, limit)
    outcome = claims(conn, ctx, batch_query(spec, ctx, limit))
    return outcome if outcome.processed else []


# Compiles a selection with :name parameters (no casts), which text() binds as its own.
_NAMED = PGDialect(paramstyle="named")  # type: ignore[no-untyped-call]


def with_selection(
    statement: str, selection: sa.Select[Any]
) -> tuple[sa.TextClause, dict[str, Any]]:
    """``statement`` with its ``{selection}`` replaced by ``selection``, compiled, and the
    selection's parameters to bind with the statement's own. The selection is the runner's
    own query, so the statement takes exactly the rows a batch of ids would have held."""
    compiled = selection.compile(dialect=_NAMED, compile_kwargs={"render_postcompile": True})
    return sa.text(statement.replace("{selection}", str(compiled))), dict(compiled.params)


# No parallel workers for the rest of the caller's transaction (SET LOCAL, value bound).
_NO_PARALLEL_WORKERS = sa.text("SELECT set_config('max_parallel_workers_per_gather', '0', true)")


def without_parallel_workers(conn: Connection) -> None:
    """Plan the rest of ``conn``'s transaction without parallel workers.

    A count per key in a subquery (``GROUP BY``) joined to its rows gets a parallel plan in
    which every worker builds that whole aggregate again. That made an outcome check several
    times slower (bench/TUNING.md has the figures). A parallel hash join shares its table,
    so it is faster with workers, and it is left alone."""
    conn.execute(_NO_PARALLEL_WORKERS)


def after_position(
    query: sa.Select[Any],
    columns: tuple[sa.ColumnElement[Any], ...],
    position: dict[str, Any] | None,
    keys: tuple[str, ...],
) -> sa.Select[Any]:
    """``query`` restricted to rows after ``position`` in the order of ``columns``. It is a
    row comparison that the index on those columns serves. With no position, ``query`` is
    returned unchanged."""
    if not position:
        return query
    return query.where(sa.tuple_(*columns) > sa.tuple_(*(sa.literal(position[k]) for k in keys)))


def seconds_or_none(value: Any) -> float | None:
    """An age from ``extract(epoch …)`` as a float, or None when nothing is waiting."""
    return float(value) if value is not None else None


DEAD_LETTER_CAP = 100_000


def capped_count(conn: Connection, selection: sa.Select[Any], cap: int) -> int:
    """``count(*)`` of ``selection``, reading at most ``cap`` rows, so it is bounded on any
    table."""
    limited = selection.limit(cap).subquery()
    return int(conn.execute(sa.select(sa.func.count()).select_from(limited)).scalar_one())
