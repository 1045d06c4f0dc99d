"""The operator API: bearer tokens (hashed), idempotency keys, runs the API accepts before
Dagster starts them (and runs held for a second identity's approval), and audit rows that
name the request and the client.

- ``api_token``: identity, roles, optional tenant, SHA-256 of the secret, expiry, revocation.
- ``api_idempotency``: (identity, Idempotency-Key) → the run it created.
- ``job_run``: statuses ``awaiting_approval`` and ``accepted``; ``approved_by``/``approved_at``;
  a partial index over the active runs of a job and scope (the API's 409 check).
- ``job_audit``: ``request_id`` and ``client_address``; an index by actor.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

_OLD_STATUSES = (
    "running",
    "success",
    "partial_success",
    "failed",
    "timeout",
    "cancelled",
    "skipped",
    "no_work",
)
_NEW_STATUSES = ("awaiting_approval", "accepted", *_OLD_STATUSES)


def _status_check(values: tuple[str, ...]) -> None:
    op.drop_constraint(op.f("ck_job_run_status_allowed"), "job_run", type_="check")
    allowed = ", ".join(f"'{v}'" for v in values)
    op.create_check_constraint(
        op.f("ck_job_run_status_allowed"), "job_run", f"status IN ({allowed})"
    )


def upgrade() -> None:
    op.create_table(
        "api_token",
        sa.Column("id", sa.Text(), nullable=False),
        sa.Column("identity", sa.Text(), nullable=False),
        sa.Column("roles", postgresql.ARRAY(sa.Text()), nullable=False),
        sa.Column("tenant_id", sa.Text(), nullable=True),
        sa.Column("secret_sha256", sa.Text(), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column("created_by", sa.Text(), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint("id ~ '^[0-9a-f]{16}$'", name=op.f("ck_api_token_id_format")),
        sa.CheckConstraint(
            "secret_sha256 ~ '^[0-9a-f]{64}$'", name=op.f("ck_api_token_secret_sha256_format")
        ),
        sa.CheckConstraint(
            "cardinality(roles) > 0 AND roles <@ ARRAY['viewer', 'operator', 'approver']::text[]",
            name=op.f("ck_api_token_roles_known"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_token")),
    )
    op.create_index("ix_api_token_identity", "api_token", ["identity"])
    op.create_table(
        "api_idempotency",
        sa.Column("identity", sa.Text(), nullable=False),
        sa.Column("idempotency_key", sa.Text(), nullable=False),
        sa.Column("request_sha256", sa.Text(), nullable=False),
        sa.Column("job_run_id", sa.UUID(), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint("identity", "idempotency_key", name=op.f("pk_api_idempotency")),
    )
    op.create_index("ix_api_idempotency_created", "api_idempotency", ["created_at"])

    op.add_column("job_run", sa.Column("approved_by", sa.Text(), nullable=True))
    op.add_column("job_run", sa.Column("approved_at", sa.DateTime(timezone=True), nullable=True))
    _status_check(_NEW_STATUSES)
    op.create_index(
        "ix_job_run_active",
        "job_run",
        ["job_name", "scope"],
        postgresql_where=sa.text("status IN ('awaiting_approval', 'accepted', 'running')"),
    )

    op.add_column("job_audit", sa.Column("request_id", sa.Text(), nullable=True))
    op.add_column("job_audit", sa.Column("client_address", sa.Text(), nullable=True))
    op.create_index("ix_job_audit_actor", "job_audit", ["actor", "occurred_at"])


def downgrade() -> None:
    op.drop_index("ix_job_audit_actor", table_name="job_audit")
    # job_audit refuses UPDATE/DELETE but not DDL: the columns go, the rows stay.
    op.drop_column("job_audit", "client_address")
    op.drop_column("job_audit", "request_id")
    op.drop_index("ix_job_run_active", table_name="job_run")
    # runs the API left unstarted cannot exist at the older revision
    op.execute(
        "UPDATE job_run SET status = 'cancelled', status_reason = 'schema downgraded', "
        "finished_at = now() WHERE status IN ('awaiting_approval', 'accepted')"
    )
    _status_check(_OLD_STATUSES)
    op.drop_column("job_run", "approved_at")
    op.drop_column("job_run", "approved_by")
    op.drop_index("ix_api_idempotency_created", table_name="api_idempotency")
    op.drop_table("api_idempotency")
    op.drop_index("ix_api_token_identity", table_name="api_token")
    op.drop_table("api_token")
