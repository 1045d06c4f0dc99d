"""Expand: a run's liveness, and the evidence its downstream's breaker is judged on.

- ``job_run.liveness_key`` / ``liveness_since``: the session advisory lock a run's process
  holds while it runs, and when it took it, so that a crashed run is found in seconds
  (qo_ops/platform/run/liveness.py). NULL (a run of older code): only the lease's TTL applies.
- ``downstream_breaker.recent`` / ``recent_at`` / ``spent``: the recent calls' outcomes in
  start order, shared by every run, and the failures among them that used an attempt.
- ``downstream_refund``: attempts owed back to items after an outage, taken by the item's
  job at its tenant's next claim.

Expand only: new nullable columns, columns with a constant default (no table rewrite) and a
new table; the code of 0015 keeps working on it (save its check for the exact revision).
Short lock and statement timeouts: adding a column takes an ACCESS EXCLUSIVE lock, briefly,
and must never queue writers behind it. squawk finds nothing in it.

Revision ID: 0016
Revises: 0015
"""

from __future__ import annotations

from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # lock and statement timeouts: the migration runner's (qo_ops/db/migrate.py), 1 s and 60 s
    for statement in EXPAND:
        op.execute(statement)
    # the roles exist since 0005
    op.execute("GRANT SELECT, INSERT, DELETE ON downstream_refund TO qo_ops_runner")
    op.execute("GRANT SELECT ON downstream_refund TO qo_ops_api, qo_ops_readonly")


# Each statement whole, robust to a rerun after a failure part way (squawk's
# prefer-robust-stmts); the new table's primary key serves the claim's lookup (side effect,
# tenant), so it needs no index of its own built while writers wait.
EXPAND = (
    "ALTER TABLE job_run ADD COLUMN IF NOT EXISTS liveness_key bigint",
    "ALTER TABLE job_run ADD COLUMN IF NOT EXISTS liveness_since timestamptz",
    "ALTER TABLE downstream_breaker ADD COLUMN IF NOT EXISTS recent text DEFAULT '' NOT NULL",
    "ALTER TABLE downstream_breaker ADD COLUMN IF NOT EXISTS recent_at timestamptz",
    "ALTER TABLE downstream_breaker "
    "ADD COLUMN IF NOT EXISTS spent jsonb DEFAULT '[]'::jsonb NOT NULL",
    """
    CREATE TABLE IF NOT EXISTS downstream_refund (
        side_effect text NOT NULL,
        tenant_id text NOT NULL,
        item_id uuid NOT NULL,
        attempt bigint NOT NULL,
        refund bigint NOT NULL,
        revive boolean NOT NULL,
        owed_at timestamptz DEFAULT now() NOT NULL,
        CONSTRAINT pk_downstream_refund PRIMARY KEY (side_effect, tenant_id, item_id)
    )
    """,
)


def downgrade() -> None:
    op.execute("DROP TABLE IF EXISTS downstream_refund")
    op.execute("ALTER TABLE downstream_breaker DROP COLUMN IF EXISTS spent")
    op.execute("ALTER TABLE downstream_breaker DROP COLUMN IF EXISTS recent_at")
    op.execute("ALTER TABLE downstream_breaker DROP COLUMN IF EXISTS recent")
    op.execute("ALTER TABLE job_run DROP COLUMN IF EXISTS liveness_since")
    op.execute("ALTER TABLE job_run DROP COLUMN IF EXISTS liveness_key")
