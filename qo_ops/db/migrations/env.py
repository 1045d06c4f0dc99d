"""Alembic environment: runs on the connection handed over by qo_ops.db.migrate."""

from __future__ import annotations

from alembic import context

from qo_ops.db.migrate import MIGRATION_LOCK_KEY, VERSION_TABLE
from qo_ops.db.schema import metadata

connection = context.config.attributes["connection"]
context.configure(
    connection=connection,
    target_metadata=metadata,
    version_table=VERSION_TABLE,
    transaction_per_migration=False,
)
with context.begin_transaction():
    connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK_KEY})")
    context.run_migrations()
