"""The kill switch: ``job_control`` holds what is suspended (a job for one tenant, or for
every scope), by whom, why and since when. Resuming deletes the row; job_audit keeps the
history.

Grants: the runner reads it (every run and batch checks it) and writes it (`qo-ops
suspend/resume` run with the runner's login); the API reads and writes it (approvers
suspend and resume); read-only logins read it (the exporter's suspension gauges).

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "job_control",
        sa.Column("job_name", sa.Text(), nullable=False),
        sa.Column("tenant_id", sa.Text(), server_default="", nullable=False),
        sa.Column("suspended_by", sa.Text(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column(
            "suspended_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.CheckConstraint("length(btrim(reason)) > 0", name=op.f("ck_job_control_reason_given")),
        sa.PrimaryKeyConstraint("job_name", "tenant_id", name=op.f("pk_job_control")),
    )
    # the roles exist since 0005
    op.execute("GRANT SELECT, INSERT, UPDATE, DELETE ON job_control TO qo_ops_runner, qo_ops_api")
    op.execute("GRANT SELECT ON job_control TO qo_ops_readonly")


def downgrade() -> None:
    op.drop_table("job_control")
