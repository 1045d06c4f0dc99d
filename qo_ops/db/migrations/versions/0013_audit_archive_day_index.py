"""audit_archive takes a tenant's records past retention a UTC day at a time, in id order:
an index on (tenant_id, the record's UTC day, id) gives each batch its rows in that order
without sorting the window's remaining records again per batch.

An index only: nothing is rewritten, older code ignores it. No new grants.

Revision ID: 0013
Revises: 0012
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

UTC_DAY = "CAST(timezone('UTC', occurred_at) AS date)"  # steps.archivable_records' day


def upgrade() -> None:
    op.create_index(
        "ix_audit_record_tenant_day_id",
        "audit_record",
        ["tenant_id", sa.text(UTC_DAY), "id"],
    )


def downgrade() -> None:
    op.drop_index("ix_audit_record_tenant_day_id", table_name="audit_record")
