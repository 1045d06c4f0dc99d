"""Downstream jobs: outbox dead letters, lapsed delivery claims in the due index, and the
reconciliation results table.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "job_run",
        sa.Column(
            "tally", postgresql.JSONB(), server_default=sa.text("'{}'::jsonb"), nullable=False
        ),
    )
    op.add_column(
        "outbox_event", sa.Column("dead_lettered_at", sa.DateTime(timezone=True), nullable=True)
    )
    op.drop_index("ix_outbox_event_unpublished", table_name="outbox_event")
    op.create_index(
        "ix_outbox_event_unpublished",
        "outbox_event",
        ["tenant_id", "available_at", "id"],
        postgresql_where=sa.text("published_at IS NULL AND dead_lettered_at IS NULL"),
    )
    op.drop_index("ix_delivery_attempt_item_due", table_name="delivery_attempt_item")
    op.create_index(
        "ix_delivery_attempt_item_due",
        "delivery_attempt_item",
        ["tenant_id", "next_attempt_at", "id"],
        postgresql_where=sa.text("status IN ('READY', 'IN_PROGRESS')"),
    )
    op.create_table(
        "reconciliation_result",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("job_run_id", sa.UUID(), nullable=False),
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("order_id", sa.BigInteger(), nullable=True),
        sa.Column("order_number", sa.Text(), nullable=False),
        sa.Column("mismatch_type", sa.Text(), nullable=False),
        sa.Column("our_status", sa.Text(), nullable=True),
        sa.Column("downstream_status", sa.Text(), nullable=True),
        sa.Column("action", sa.Text(), nullable=False),
        sa.Column("outcome", sa.Text(), nullable=False),
        sa.Column("detail", sa.Text(), nullable=True),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.CheckConstraint(
            "mismatch_type IN ('missing_downstream', 'status_drift', 'terminal_not_reflected', 'unknown_downstream')",
            name=op.f("ck_reconciliation_result_mismatch_type_allowed"),
        ),
        sa.ForeignKeyConstraint(
            ["order_id"],
            ["customer_order.id"],
            name=op.f("fk_reconciliation_result_order_id_customer_order"),
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenant.id"], name=op.f("fk_reconciliation_result_tenant_id_tenant")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_reconciliation_result")),
        sa.UniqueConstraint(
            "job_run_id",
            "order_number",
            name=op.f("uq_reconciliation_result_job_run_id_order_number"),
        ),
    )
    op.create_index(
        "ix_reconciliation_result_order",
        "reconciliation_result",
        ["tenant_id", "order_number", "created_at"],
    )


def downgrade() -> None:
    op.drop_index("ix_reconciliation_result_order", table_name="reconciliation_result")
    op.drop_table("reconciliation_result")
    op.drop_index("ix_delivery_attempt_item_due", table_name="delivery_attempt_item")
    op.create_index(
        "ix_delivery_attempt_item_due",
        "delivery_attempt_item",
        ["tenant_id", "next_attempt_at", "id"],
        postgresql_where=sa.text("status = 'READY'"),
    )
    op.drop_index("ix_outbox_event_unpublished", table_name="outbox_event")
    op.create_index(
        "ix_outbox_event_unpublished",
        "outbox_event",
        ["available_at", "id"],
        postgresql_where=sa.text("published_at IS NULL"),
    )
    op.drop_column("outbox_event", "dead_lettered_at")
    op.drop_column("job_run", "tally")
