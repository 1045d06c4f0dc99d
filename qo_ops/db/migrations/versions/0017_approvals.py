"""Expand: approvals a destructive execute cites, on every path.

- ``run_approval``: an approval an approver grants for a destructive job over some tenants
  (or all), with the incident's reason, until it expires or is revoked
  (qo_ops/platform/actions/approvals.py). The API grants one when an approver executes or approves
  a held run; ``qo-ops approval grant`` and ``POST /internal/jobs/{job}/approvals`` grant one for the
  CLI, the Launchpad and a backfill to cite.
- ``job_run.approval_id``: the approval a run cited (NULL: none was needed).

Expand only: a new table and a new nullable column (no rewrite, no default); the code of
0016 keeps working on it (save its check for the exact revision). Short lock and statement
timeouts: adding a column takes an ACCESS EXCLUSIVE lock, briefly, and must never queue
writers behind it.

Revision ID: 0017
Revises: 0016
"""

from __future__ import annotations

from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # lock and statement timeouts: the migration runner's (qo_ops/db/migrate.py), 1 s and 60 s
    for statement in EXPAND:
        op.execute(statement)
    # the roles exist since 0005: the runner reads an approval, the API grants one
    op.execute("GRANT SELECT ON run_approval TO qo_ops_runner, qo_ops_readonly")
    op.execute("GRANT SELECT, INSERT, UPDATE ON run_approval TO qo_ops_api")


# Each statement whole, robust to a rerun after a failure part way; the table's primary key
# is the lookup a run's citation makes, so it needs no other index.
EXPAND = (
    "ALTER TABLE job_run ADD COLUMN IF NOT EXISTS approval_id text",
    """
    CREATE TABLE IF NOT EXISTS run_approval (
        id text NOT NULL,
        job_name text NOT NULL,
        tenants text[],
        reason text NOT NULL,
        granted_by text NOT NULL,
        granted_at timestamptz DEFAULT now() NOT NULL,
        expires_at timestamptz NOT NULL,
        revoked_at timestamptz,
        revoked_by text,
        CONSTRAINT pk_run_approval PRIMARY KEY (id)
    )
    """,
)


def downgrade() -> None:
    op.execute("DROP TABLE IF EXISTS run_approval")
    op.execute("ALTER TABLE job_run DROP COLUMN IF EXISTS approval_id")
