"""run_history_retention: the indexes its selection and its keep-rules read, and the right
for the runner to delete run records.

- ``ix_job_run_retention``: a tenant's runs (scope ``T`` or ``T/<window>``) by
  ``finished_at``; ``ix_job_checkpoint_retention``: a tenant's checkpoints by ``updated_at``.
- ``ix_temp_file_tombstone_job_run``, ``ix_audit_archive_manifest_job_run``: a run named by
  a business record is kept, looked up per candidate run (``reconciliation_result`` is
  already indexed by ``(job_run_id, order_number)``).
- ``qo_ops_runner`` may DELETE ``job_run`` (it already may delete ``job_checkpoint``).
  ``job_audit`` stays append-only: its trigger refuses UPDATE, DELETE and TRUNCATE, and no
  role is granted them.

Revision ID: 0009
Revises: 0008
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # not partial: ANALYZE keeps statistics on the expressions of non-partial indexes only
    op.create_index(
        "ix_job_run_retention", "job_run", [sa.text("split_part(scope, '/', 1)"), "finished_at"]
    )
    op.create_index(
        "ix_job_checkpoint_retention",
        "job_checkpoint",
        [sa.text("split_part(scope, '/', 1)"), "updated_at"],
    )
    op.create_index("ix_temp_file_tombstone_job_run", "temp_file_tombstone", ["job_run_id"])
    op.create_index("ix_audit_archive_manifest_job_run", "audit_archive_manifest", ["job_run_id"])
    # the role exists since 0005
    op.execute("GRANT DELETE ON job_run TO qo_ops_runner")


def downgrade() -> None:
    op.execute("REVOKE DELETE ON job_run FROM qo_ops_runner")
    op.drop_index("ix_audit_archive_manifest_job_run", table_name="audit_archive_manifest")
    op.drop_index("ix_temp_file_tombstone_job_run", table_name="temp_file_tombstone")
    op.drop_index("ix_job_checkpoint_retention", table_name="job_checkpoint")
    op.drop_index("ix_job_run_retention", table_name="job_run")
