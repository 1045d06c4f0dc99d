"""Expand: a run's liveness, and the evidence its downstream's breaker is judged on.

- ``job_run.liveness_key`` / ``liveness_since``: the session advisory lock a run's process
  holds while it runs, and when it took it, so that a crashed run is found in seconds
  (qo_ops/platform/liveness.py). NULL (a run of older code): only the lease's TTL applies.
- ``downstream_breaker.recent`` / ``recent_at`` / ``spent``: the recent calls' outcomes in
  start order, shared by every run, and the failures among them that used an attempt.
- ``downstream_refund``: attempts owed back to items after an outage, taken by the item's
  job at its tenant's next claim.

Expand only: new nullable columns, columns with a constant default (no table rewrite) and a
new table; the code of 0015 keeps working on it. Short lock and statement timeouts: adding
a column takes an ACCESS EXCLUSIVE lock, briefly, and must never queue writers behind it.

Revision ID: 0016
Revises: 0015
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '2s'")
    op.execute("SET LOCAL statement_timeout = '30s'")
    op.add_column("job_run", sa.Column("liveness_key", sa.BigInteger(), nullable=True))
    op.add_column("job_run", sa.Column("liveness_since", sa.DateTime(timezone=True), nullable=True))
    op.add_column(
        "downstream_breaker",
        sa.Column("recent", sa.Text(), server_default="", nullable=False),
    )
    op.add_column(
        "downstream_breaker",
        sa.Column("recent_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.add_column(
        "downstream_breaker",
        sa.Column(
            "spent",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'[]'::jsonb"),
            nullable=False,
        ),
    )
    op.create_table(
        "downstream_refund",
        sa.Column("side_effect", sa.Text(), nullable=False),
        sa.Column("item_id", sa.UUID(), nullable=False),
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("refund", sa.Integer(), nullable=False),
        sa.Column("revive", sa.Boolean(), nullable=False),
        sa.Column(
            "owed_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.PrimaryKeyConstraint("side_effect", "item_id", name=op.f("pk_downstream_refund")),
    )
    # a new, empty table: no writer to block while its index is built
    op.create_index(
        "ix_downstream_refund_tenant", "downstream_refund", ["side_effect", "tenant_id"]
    )
    # the roles exist since 0005
    op.execute("GRANT SELECT, INSERT, DELETE ON downstream_refund TO qo_ops_runner")
    op.execute("GRANT SELECT ON downstream_refund TO qo_ops_api, qo_ops_readonly")


def downgrade() -> None:
    op.drop_table("downstream_refund")
    op.drop_column("downstream_breaker", "spent")
    op.drop_column("downstream_breaker", "recent_at")
    op.drop_column("downstream_breaker", "recent")
    op.drop_column("job_run", "liveness_since")
    op.drop_column("job_run", "liveness_key")
