"""The downstream's circuit breaker: ``downstream_breaker`` holds one row per downstream
origin, shared by every run that calls it, so a run that finds the downstream down tells
the next runs to stop calling it until a probe is due (qo_ops/platform/calls/breaker.py).

Grants: the runner reads and writes it (delivery_retry, notification_publish); the API and
read-only logins read it (the exporter's breaker gauges, status pages).

Revision ID: 0011
Revises: 0010
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "downstream_breaker",
        sa.Column("downstream", sa.Text(), nullable=False),
        sa.Column("state", sa.Text(), nullable=False),
        sa.Column("opened_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("probe_after", sa.DateTime(timezone=True), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("opened_count", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column(
            "changed_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.Column("changed_by_run", sa.UUID(), nullable=True),
        sa.CheckConstraint(
            "state IN ('closed', 'open', 'half_open')",
            name=op.f("ck_downstream_breaker_state_known"),
        ),
        sa.PrimaryKeyConstraint("downstream", name=op.f("pk_downstream_breaker")),
    )
    # the roles exist since 0005
    op.execute("GRANT SELECT, INSERT, UPDATE ON downstream_breaker TO qo_ops_runner")
    op.execute("GRANT SELECT ON downstream_breaker TO qo_ops_api, qo_ops_readonly")


def downgrade() -> None:
    op.drop_table("downstream_breaker")
