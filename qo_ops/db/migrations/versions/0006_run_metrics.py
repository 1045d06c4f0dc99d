"""What the metrics exporter reads: a run's count of side effects it did not repeat, and
indexes that keep each scrape bounded (runs created or finished since the last scrape; a
job's latest runs; dead-lettered outbox events).

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "job_run",
        sa.Column(
            "duplicates_prevented_count", sa.BigInteger(), server_default="0", nullable=False
        ),
    )
    op.create_index("ix_job_run_created", "job_run", ["created_at"])
    op.create_index("ix_job_run_job_started", "job_run", ["job_name", sa.text("started_at DESC")])
    op.create_index(
        "ix_job_run_finished",
        "job_run",
        ["finished_at"],
        postgresql_where=sa.text("finished_at IS NOT NULL"),
    )
    op.create_index(
        "ix_job_run_job_finished",
        "job_run",
        ["job_name", sa.text("finished_at DESC")],
        postgresql_where=sa.text("finished_at IS NOT NULL"),
    )

    op.create_index(
        "ix_outbox_event_dead",
        "outbox_event",
        ["dead_lettered_at"],
        postgresql_where=sa.text("dead_lettered_at IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_index("ix_outbox_event_dead", table_name="outbox_event")
    op.drop_index("ix_job_run_job_finished", table_name="job_run")
    op.drop_index("ix_job_run_finished", table_name="job_run")
    op.drop_index("ix_job_run_job_started", table_name="job_run")
    op.drop_index("ix_job_run_created", table_name="job_run")
    op.drop_column("job_run", "duplicates_prevented_count")
