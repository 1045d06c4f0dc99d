"""order_reconciliation's re-submission budget: ``order_resubmission`` holds one row per
re-submission of an order the downstream misses (numbered from 1, the number is also the
key of its ``OrderResubmitRequested`` event), so a rerun over unchanged state re-submits
nothing and the job knows when an order has used up ``QO_OPS_RESUBMIT_MAX``.

Grants: the runner reads and appends (order_reconciliation; never updates or deletes a
row); the API and read-only logins read it, like every business table.

Revision ID: 0010
Revises: 0009
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "order_resubmission",
        sa.Column("order_id", sa.BigInteger(), nullable=False),
        sa.Column("resubmission", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("job_run_id", sa.UUID(), nullable=False),
        sa.Column(
            "requested_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.CheckConstraint(
            "resubmission >= 1", name=op.f("ck_order_resubmission_resubmission_from_one")
        ),
        sa.ForeignKeyConstraint(
            ["order_id"],
            ["customer_order.id"],
            name=op.f("fk_order_resubmission_order_id_customer_order"),
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenant.id"], name=op.f("fk_order_resubmission_tenant_id_tenant")
        ),
        sa.PrimaryKeyConstraint("order_id", "resubmission", name=op.f("pk_order_resubmission")),
    )
    # the roles exist since 0005
    op.execute("GRANT SELECT, INSERT ON order_resubmission TO qo_ops_runner")
    op.execute("GRANT SELECT ON order_resubmission TO qo_ops_api, qo_ops_readonly")


def downgrade() -> None:
    op.drop_table("order_resubmission")
