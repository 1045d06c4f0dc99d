"""Alembic environment: runs on the connection handed over by qo_ops.db.migrate, which holds
the migration lock and set the timeouts. One transaction per migration: its changes, its
version row and the serves table (the oldest code revision the schema serves) commit
together, or none of them."""

from __future__ import annotations

from typing import Any

from alembic import context

from qo_ops.db.migrate import VERSION_TABLE, write_serves
from qo_ops.db.schema import metadata

connection = context.config.attributes["connection"]


def _serves(*, ctx: Any, step: Any, heads: Any, run_args: Any) -> None:
    write_serves(ctx.connection)


context.configure(
    connection=connection,
    target_metadata=metadata,
    version_table=VERSION_TABLE,
    transaction_per_migration=True,
    on_version_apply=_serves,  # type: ignore[arg-type]  # Alembic passes them by name
)
with context.begin_transaction():
    context.run_migrations()
