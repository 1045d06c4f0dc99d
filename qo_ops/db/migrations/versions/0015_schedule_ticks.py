"""What a schedule decided at each tick (``job_schedule_tick``), so that a missed scheduled
run says why (qo_ops/platform/schedule/missed.py): the tick was evaluated at all (a run that then
never started waited in Dagster's queue: ``queued``; no evaluation: ``daemon_down``), or a
tenant was skipped because a run of its scope was still queued or running in Dagster
(``previous_run_queued``, ``previous_run_active``).

And Dagster's run queue per job (``job_run_queue``), as the ``run_queue_sensor`` samples it
from the instance's run storage: the exporter's ``job_run_queue_depth`` and
``job_run_queue_oldest_seconds``.

Grants: the runner (schedules and sensors, in the Dagster daemon's code server) writes both
(and prunes the ticks); the read-only login (the exporter) and the API read them.

Revision ID: 0015
Revises: 0014
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "job_schedule_tick",
        sa.Column("job_name", sa.Text(), nullable=False),
        sa.Column("scheduled_for", sa.DateTime(timezone=True), nullable=False),
        sa.Column("decision", sa.Text(), nullable=False),
        sa.Column("tenants", postgresql.ARRAY(sa.Text()), server_default="{}", nullable=False),
        sa.Column(
            "recorded_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.CheckConstraint(
            "decision IN ('evaluated', 'previous_run_queued', 'previous_run_active')",
            name=op.f("ck_job_schedule_tick_decision_allowed"),
        ),
        sa.PrimaryKeyConstraint(
            "job_name", "scheduled_for", "decision", name=op.f("pk_job_schedule_tick")
        ),
    )
    op.create_table(
        "job_run_queue",
        sa.Column("job_name", sa.Text(), nullable=False),
        sa.Column("depth", sa.Integer(), nullable=False),
        sa.Column("oldest_queued_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column(
            "sampled_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.PrimaryKeyConstraint("job_name", name=op.f("pk_job_run_queue")),
    )
    # the roles exist since 0005
    op.execute("GRANT SELECT, INSERT, UPDATE, DELETE ON job_schedule_tick TO qo_ops_runner")
    op.execute("GRANT SELECT, INSERT, UPDATE ON job_run_queue TO qo_ops_runner")
    op.execute("GRANT SELECT ON job_schedule_tick, job_run_queue TO qo_ops_api, qo_ops_readonly")


def downgrade() -> None:
    op.drop_table("job_run_queue")
    op.drop_table("job_schedule_tick")
