"""Index builds and drops a migration runs while the business writes.

A plain ``CREATE INDEX`` holds a SHARE lock on its table for the whole build: every INSERT,
UPDATE and DELETE on that table waits until the build ends (seconds to minutes on a table of
millions of rows), and ``lock_timeout`` does not help once the lock is held. ``CREATE INDEX
CONCURRENTLY`` takes a SHARE UPDATE EXCLUSIVE lock instead, which writers do not conflict
with; it scans the table twice and waits for the transactions that could still miss the new
index, so it is slower, and PostgreSQL refuses it inside a transaction block.

So these helpers, inside an Alembic migration, run in ``op.get_context().autocommit_block()``:

- **The migration's transaction commits at that point** (Alembic commits what ran before the
  block; the version row is written after the migration returns). A migration that builds
  an index concurrently therefore does it last, and every statement before it must be safe
  to run again (``ADD COLUMN IF NOT EXISTS``, ``CREATE … IF NOT EXISTS``, a GRANT): a lock
  timeout (retried by :func:`qo_ops.db.migrate.upgrade`) or any failure after the commit runs
  the whole migration again.
- **A failed concurrent build leaves an INVALID index** of that name (``pg_index.indisvalid``
  false: a lock timeout while it waited for older transactions, a statement timeout, a
  cancel). Writers still maintain it, nothing reads it, and ``IF NOT EXISTS`` alone would
  keep it for good. :func:`create_index_concurrently` drops such an index (``DROP INDEX
  CONCURRENTLY IF EXISTS``) before building it again; a valid index of that name is kept and
  the build skipped.
- **Timeouts**: the runner's ``lock_timeout`` (1 s) and ``statement_timeout`` (60 s) are for
  statements that hold locks writers wait on; a concurrent build of a big table takes
  longer, and neither its lock nor its waits for older transactions hold a writer up, so it
  runs under :data:`BUILD_STATEMENT_TIMEOUT` and :data:`BUILD_LOCK_TIMEOUT`, and the
  session's own values are put back afterwards (also when the build fails).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import sqlalchemy as sa
from alembic import op

BUILD_STATEMENT_TIMEOUT = "2h"  # one concurrent index build (10,000,000 rows: about a minute)
BUILD_LOCK_TIMEOUT = "10min"  # its waits for older transactions, which hold no writer up

_NAME = re.compile(r"[a-z_][a-z0-9_]*")

# Whether the index ``name`` exists and whether it is valid (NULL: it does not exist). A
# catalog read: the lint leaves it out as the runner's bookkeeping.
_VALID = sa.text(
    "SELECT i.indisvalid FROM pg_catalog.pg_index i WHERE i.indexrelid = to_regclass(:name)"
)


def _identifier(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise ValueError(f"not a plain lower-case identifier: {name!r}")
    return name


@contextmanager
def _build_timeout() -> Iterator[None]:
    """``statement_timeout`` at :data:`BUILD_STATEMENT_TIMEOUT` and ``lock_timeout`` at
    :data:`BUILD_LOCK_TIMEOUT` for the statements inside, on the session (autocommit: no
    transaction to scope them), then back to what they were. A concurrent build's lock
    (SHARE UPDATE EXCLUSIVE) and its waits for older transactions block no writer, so the
    runner's 1 s would only fail a long build at its end, to start it again."""
    bind = op.get_bind()
    before = {
        name: bind.exec_driver_sql(f"SHOW {name}").scalar_one()
        for name in ("statement_timeout", "lock_timeout")
    }
    op.execute(f"SET statement_timeout = '{BUILD_STATEMENT_TIMEOUT}'")
    op.execute(f"SET lock_timeout = '{BUILD_LOCK_TIMEOUT}'")
    try:
        yield
    finally:
        for name, value in before.items():
            op.execute(f"SET {name} = '{value}'")


def create_index_concurrently(
    name: str,
    table: str,
    columns_sql: str,
    where: str | None = None,
    unique: bool = False,
) -> None:
    """``CREATE [UNIQUE] INDEX CONCURRENTLY IF NOT EXISTS name ON table (columns_sql)
    [WHERE where]``, outside the migration's transaction (which this commits: call it last),
    after dropping an INVALID index of that name that an earlier failed build left.

    ``columns_sql`` is the index's column list as SQL (columns and expressions, e.g.
    ``"tenant_id, CAST(timezone('UTC', occurred_at) AS date), id"``); ``where`` makes it
    partial. Safe to run again: a valid index of that name is left as it is.
    """
    name, table = _identifier(name), _identifier(table)
    with op.get_context().autocommit_block(), _build_timeout():
        valid = op.get_bind().execute(_VALID, {"name": name}).scalar_one_or_none()
        if valid is False:  # a failed concurrent build's leftover: never used, still written
            op.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {name}")
        op.execute(
            f"CREATE {'UNIQUE ' if unique else ''}INDEX CONCURRENTLY IF NOT EXISTS {name} "
            f"ON {table} ({columns_sql})" + (f" WHERE {where}" if where else "")
        )


def drop_index_concurrently(name: str) -> None:
    """``DROP INDEX CONCURRENTLY IF EXISTS name`` outside the migration's transaction (which
    this commits: call it last). A plain DROP INDEX takes an ACCESS EXCLUSIVE lock on the
    index's table, queued behind any long reader and ahead of every writer."""
    name = _identifier(name)
    with op.get_context().autocommit_block(), _build_timeout():
        op.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {name}")
