"""temp_file_cleanup: deletion tombstones, the legal-hold guard on temp_file, and an index
for a tenant's files.

- ``temp_file_tombstone``: one row per temp file the job removes (path, size, checksum of
  the stored bytes, the row's legal_hold as its DELETE returned it, run, reason, times).
- ``temp_file_legal_hold_guard``: the database refuses to DELETE a temp_file row on legal
  hold, whatever path the DELETE comes from (job, console, script). Lifting a hold (an
  UPDATE) stays possible: that is an authorised human decision, not a deletion.
- ``temp_file_tombstone_immutable``: a completed tombstone (``deleted_at`` set) can be
  neither changed nor removed.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "temp_file_tombstone",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("temp_file_id", sa.BigInteger(), nullable=False),
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("storage_path", sa.Text(), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("sha256", sa.Text(), nullable=True),
        sa.Column("file_status", sa.Text(), nullable=False),
        sa.Column("file_created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("legal_hold", sa.Boolean(), nullable=False),
        sa.Column("job_run_id", sa.UUID(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column(
            "selected_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(
            "sha256 IS NULL OR sha256 ~ '^[0-9a-f]{64}$'",
            name=op.f("ck_temp_file_tombstone_sha256_format"),
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenant.id"], name=op.f("fk_temp_file_tombstone_tenant_id_tenant")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_temp_file_tombstone")),
        sa.UniqueConstraint("temp_file_id", name=op.f("uq_temp_file_tombstone_temp_file_id")),
    )
    op.create_index(
        "ix_temp_file_tombstone_tenant_created",
        "temp_file_tombstone",
        ["tenant_id", "file_created_at"],
    )
    op.create_index("ix_temp_file_tenant_created", "temp_file", ["tenant_id", "created_at"])
    op.execute(
        """
        CREATE FUNCTION temp_file_refuse_held_delete() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            RAISE EXCEPTION 'temp_file % is on legal hold: DELETE refused', OLD.id
                USING ERRCODE = 'insufficient_privilege';
        END $$;
        CREATE TRIGGER temp_file_legal_hold_guard
            BEFORE DELETE ON temp_file
            FOR EACH ROW WHEN (OLD.legal_hold)
            EXECUTE FUNCTION temp_file_refuse_held_delete();

        CREATE FUNCTION temp_file_tombstone_refuse_change() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            RAISE EXCEPTION 'temp_file_tombstone % is complete: % refused', OLD.id, TG_OP
                USING ERRCODE = 'insufficient_privilege';
        END $$;
        CREATE TRIGGER temp_file_tombstone_immutable
            BEFORE UPDATE OR DELETE ON temp_file_tombstone
            FOR EACH ROW WHEN (OLD.deleted_at IS NOT NULL)
            EXECUTE FUNCTION temp_file_tombstone_refuse_change();
        """
    )


def downgrade() -> None:
    op.execute("DROP TRIGGER temp_file_tombstone_immutable ON temp_file_tombstone")
    op.execute("DROP FUNCTION temp_file_tombstone_refuse_change()")
    op.execute("DROP TRIGGER temp_file_legal_hold_guard ON temp_file")
    op.execute("DROP FUNCTION temp_file_refuse_held_delete()")
    op.drop_index("ix_temp_file_tenant_created", table_name="temp_file")
    op.drop_index("ix_temp_file_tombstone_tenant_created", table_name="temp_file_tombstone")
    op.drop_table("temp_file_tombstone")
