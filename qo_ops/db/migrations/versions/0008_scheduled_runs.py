"""Scheduled runs, found by their tick: the metrics exporter starts judging a job's missed
runs at its first scheduled run (``min(scheduled_for)``), read from this index on every
scrape until the job has one.

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index(
        "ix_job_run_scheduled",
        "job_run",
        ["job_name", "scheduled_for"],
        postgresql_where=sa.text("scheduled_for IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_index("ix_job_run_scheduled", table_name="job_run")
