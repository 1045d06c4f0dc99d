"""What the seed's start, lock and retry signals need from a run record
(``docs/observability.md``): when the run was asked for (``requested_at``: the Dagster
run's creation, else the API's acceptance, else the schedule's tick), how long taking its
lease took (``lock_wait_ms``), and which of the trigger's retries it is (``retry_number``,
0 for the first attempt, of ``retries_max``).

Nullable or defaulted columns only: adding them rewrites nothing, and older code ignores
them; one partial index for the Launchpad's reason rule, built concurrently so that writers
to ``job_run`` never wait for it (``qo_ops/db/migrations/safe.py``; it commits the columns
first, so each statement is safe to run again). No new grants: the roles' grants on
``job_run`` cover its new columns.

Revision ID: 0012
Revises: 0011
"""

from __future__ import annotations

from alembic import op

from qo_ops.db.migrations.safe import create_index_concurrently, drop_index_concurrently

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

REASON_KEY = r"btrim(regexp_replace(lower(reason), '\s+', ' ', 'g'))"  # consent.normalized_reason

# Each statement whole and safe to run again: the index below is built concurrently, outside
# the transaction, which commits these first; a retry (a lock timeout) runs them again.
COLUMNS = (
    "ALTER TABLE job_run ADD COLUMN IF NOT EXISTS requested_at timestamptz",
    "ALTER TABLE job_run ADD COLUMN IF NOT EXISTS lock_wait_ms integer",
    "ALTER TABLE job_run ADD COLUMN IF NOT EXISTS retry_number integer DEFAULT 0 NOT NULL",
    "ALTER TABLE job_run ADD COLUMN IF NOT EXISTS retries_max integer",
)


def upgrade() -> None:
    for statement in COLUMNS:
        op.execute(statement)
    # the Launchpad rule (qo_ops/platform/run/consent.py): an earlier Dagster execute of the job
    # with the same reason, found by lookup (a few rows: executes a person gave a reason).
    # Concurrently, last (qo_ops/db/migrations/safe.py): job_run keeps taking writes.
    create_index_concurrently(
        "ix_job_run_dagster_reason",
        "job_run",
        f"job_name, {REASON_KEY}",
        where="mode = 'execute' AND reason IS NOT NULL AND dagster_run_id IS NOT NULL",
    )


def downgrade() -> None:
    for column in ("retries_max", "retry_number", "lock_wait_ms", "requested_at"):
        op.execute(f"ALTER TABLE job_run DROP COLUMN IF EXISTS {column}")
    drop_index_concurrently("ix_job_run_dagster_reason")
