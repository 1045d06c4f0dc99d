"""audit_archive takes a tenant's records past retention a UTC day at a time, in id order:
an index on (tenant_id, the record's UTC day, id) gives each batch its rows in that order
without sorting the window's remaining records again per batch.

An index only: nothing is rewritten, older code ignores it. Built concurrently
(``qo_ops/db/migrations/safe.py``): the plain CREATE INDEX it was held writes to
audit_record for the whole build (up to 5.6 s at 3,000,000 rows). No new grants.

Revision ID: 0013
Revises: 0012
"""

from __future__ import annotations

from qo_ops.db.migrations.safe import create_index_concurrently, drop_index_concurrently

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

UTC_DAY = "CAST(timezone('UTC', occurred_at) AS date)"  # steps.archivable_records' day


def upgrade() -> None:
    create_index_concurrently(
        "ix_audit_record_tenant_day_id", "audit_record", f"tenant_id, {UTC_DAY}, id"
    )


def downgrade() -> None:
    drop_index_concurrently("ix_audit_record_tenant_day_id")
