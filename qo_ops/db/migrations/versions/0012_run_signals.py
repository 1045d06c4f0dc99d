"""What the seed's start, lock and retry signals need from a run record
(``docs/observability.md``): when the run was asked for (``requested_at``: the Dagster
run's creation, else the API's acceptance, else the schedule's tick), how long taking its
lease took (``lock_wait_ms``), and which of the trigger's retries it is (``retry_number``,
0 for the first attempt, of ``retries_max``).

Nullable or defaulted columns only: adding them rewrites nothing, and older code ignores
them; one partial index for the Launchpad's reason rule. No new grants: the roles'
grants on ``job_run`` cover its new columns.

Revision ID: 0012
Revises: 0011
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

REASON_KEY = r"btrim(regexp_replace(lower(reason), '\s+', ' ', 'g'))"  # consent.normalized_reason


def upgrade() -> None:
    op.add_column("job_run", sa.Column("requested_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("job_run", sa.Column("lock_wait_ms", sa.Integer(), nullable=True))
    op.add_column(
        "job_run",
        sa.Column("retry_number", sa.Integer(), server_default="0", nullable=False),
    )
    op.add_column("job_run", sa.Column("retries_max", sa.Integer(), nullable=True))
    # the Launchpad rule (qo_ops/platform/consent.py): an earlier Dagster execute of the job
    # with the same reason, found by lookup (a few rows: executes a person gave a reason)
    op.create_index(
        "ix_job_run_dagster_reason",
        "job_run",
        ["job_name", sa.text(REASON_KEY)],
        postgresql_where=sa.text(
            "mode = 'execute' AND reason IS NOT NULL AND dagster_run_id IS NOT NULL"
        ),
    )


def downgrade() -> None:
    op.drop_index("ix_job_run_dagster_reason", table_name="job_run")
    for column in ("retries_max", "retry_number", "lock_wait_ms", "requested_at"):
        op.drop_column("job_run", column)
