"""Expand: upgrades while qo-ops runs — which code ran what, and a record of each upgrade.

- ``job_run.code_version`` / ``code_revision``: the package version and the schema revision
  of the code that ran it (NULL: a release before 0018). ``qo-ops db upgrade --contract``
  waits for runs of code older than a contract step (qo_ops/db/migrate.py).
- ``schema_migration``: every ``qo-ops db upgrade`` that changed something or failed.
- From this revision Alembic records the revision in ``qo_ops_schema_version``;
  ``qo_ops_alembic_version`` holds the oldest code revision the schema serves (0017 until a
  contract step), which is what releases up to 0017 check. Both are read by every role.

Expand only: new nullable columns (no rewrite, no default) and a new table; the release at
0017 keeps running on it. The migration runner sets the lock and statement timeouts.

Revision ID: 0018
Revises: 0017
"""

from __future__ import annotations

from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None
phase = "expand"


def upgrade() -> None:
    for statement in EXPAND:
        op.execute(statement)
    op.execute(
        "GRANT SELECT ON qo_ops_schema_version, schema_migration "
        "TO qo_ops_runner, qo_ops_api, qo_ops_readonly"
    )


# Each statement whole, robust to a rerun after a failure part way.
EXPAND = (
    "ALTER TABLE job_run ADD COLUMN IF NOT EXISTS code_version text",
    "ALTER TABLE job_run ADD COLUMN IF NOT EXISTS code_revision text",
    """
    CREATE TABLE IF NOT EXISTS schema_migration (
        id uuid NOT NULL,
        started_at timestamptz DEFAULT now() NOT NULL,
        from_revision text,
        to_revision text,
        applied text[] DEFAULT '{}' NOT NULL,
        contract boolean DEFAULT false NOT NULL,
        requested_by text,
        reason text,
        outcome text NOT NULL,
        error text,
        lock_timeouts integer DEFAULT 0 NOT NULL,
        attempts integer DEFAULT 0 NOT NULL,
        duration_ms bigint DEFAULT 0 NOT NULL,
        code_version text,
        CONSTRAINT pk_schema_migration PRIMARY KEY (id),
        CONSTRAINT ck_schema_migration_outcome_allowed
            CHECK (outcome IN ('ok', 'failed', 'refused'))
    )
    """,
)


def downgrade() -> None:
    op.execute("DROP TABLE IF EXISTS schema_migration")
    op.execute("ALTER TABLE job_run DROP COLUMN IF EXISTS code_revision")
    op.execute("ALTER TABLE job_run DROP COLUMN IF EXISTS code_version")
