"""Recovery without database surgery (qo_ops/platform/actions/recovery.py): the operator API's
requeue, review and checkpoint actions run the same statements as ``qo-ops requeue``,
``review resolve`` and ``checkpoint reset``, so its login gets exactly what those write:

- ``job_lease`` INSERT, UPDATE: an action takes its scope's lease and gives it back;
- ``job_checkpoint`` DELETE: a checkpoint reset;
- ``delivery_attempt_item``, ``outbox_event`` UPDATE: dead letters requeued, a re-submission;
- ``outbox_event`` INSERT: a re-submission's or an adoption's event, as the job writes it;
- ``customer_order`` UPDATE: a review decision clears the flag (and adopts a status);
- ``order_resubmission`` INSERT: a person's re-submission takes the next number.

And an index for the manual-review queue: the flagged orders, per tenant, without reading
every order (a partial index: flagged orders are few). Built concurrently, last, so that
writers to customer_order never wait for it (``qo_ops/db/migrations/safe.py``); the grants
before it commit first and are safe to run again.

Revision ID: 0014
Revises: 0013
"""

from __future__ import annotations

from alembic import op

from qo_ops.db.migrations.safe import create_index_concurrently, drop_index_concurrently

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

GRANTS = (
    "GRANT INSERT, UPDATE ON job_lease TO qo_ops_api",
    "GRANT DELETE ON job_checkpoint TO qo_ops_api",
    "GRANT UPDATE ON delivery_attempt_item, outbox_event, customer_order TO qo_ops_api",
    "GRANT INSERT ON order_resubmission, outbox_event TO qo_ops_api",
)


def upgrade() -> None:
    for grant in GRANTS:  # the roles exist since 0005
        op.execute(grant)
    create_index_concurrently(
        "ix_customer_order_needs_review",
        "customer_order",
        "tenant_id, id",
        where="needs_manual_review",
    )


def downgrade() -> None:
    for grant in GRANTS:
        op.execute(grant.replace("GRANT", "REVOKE").replace(" TO ", " FROM "))
    drop_index_concurrently("ix_customer_order_needs_review")
