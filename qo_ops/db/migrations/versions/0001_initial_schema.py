"""Initial schema: the platform tables and the Quote & Order business tables.

Revision ID: 0001
Revises:
Create Date: 2026-11-29 17:27:48.660361
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "downstream_order",
        sa.Column("order_number", sa.Text(), nullable=False),
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column("received_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("order_number", name=op.f("pk_downstream_order")),
    )
    op.create_index(
        "ix_downstream_order_tenant",
        "downstream_order",
        ["tenant_id", "order_number"],
        unique=False,
    )
    op.create_table(
        "job_audit",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column(
            "occurred_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column("actor", sa.Text(), nullable=False),
        sa.Column("action", sa.Text(), nullable=False),
        sa.Column("job_name", sa.Text(), nullable=True),
        sa.Column("scope", sa.Text(), nullable=True),
        sa.Column("mode", sa.Text(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("correlation_id", sa.Text(), nullable=True),
        sa.Column("decision", sa.Text(), nullable=False),
        sa.Column("job_run_id", sa.UUID(), nullable=True),
        sa.Column(
            "details",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_job_audit")),
    )
    op.create_index("ix_job_audit_job", "job_audit", ["job_name", "occurred_at"], unique=False)
    op.create_table(
        "job_checkpoint",
        sa.Column("job_name", sa.Text(), nullable=False),
        sa.Column("scope", sa.Text(), nullable=False),
        sa.Column("cursor", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column("job_run_id", sa.UUID(), nullable=True),
        sa.PrimaryKeyConstraint("job_name", "scope", name=op.f("pk_job_checkpoint")),
    )
    op.create_table(
        "job_lease",
        sa.Column("job_name", sa.Text(), nullable=False),
        sa.Column("scope", sa.Text(), nullable=False),
        sa.Column("owner_id", sa.Text(), nullable=False),
        sa.Column("lease_token", sa.Text(), nullable=False),
        sa.Column("fencing_token", sa.BigInteger(), nullable=False),
        sa.Column("acquired_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("job_run_id", sa.UUID(), nullable=True),
        sa.PrimaryKeyConstraint("job_name", "scope", name=op.f("pk_job_lease")),
    )
    op.create_table(
        "job_run",
        sa.Column("id", sa.UUID(), nullable=False),
        sa.Column("job_name", sa.Text(), nullable=False),
        sa.Column("scope", sa.Text(), nullable=False),
        sa.Column("window_start", sa.Date(), nullable=True),
        sa.Column("window_end", sa.Date(), nullable=True),
        sa.Column("mode", sa.Text(), nullable=False),
        sa.Column("trigger_type", sa.Text(), nullable=False),
        sa.Column("requester", sa.Text(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("correlation_id", sa.Text(), nullable=True),
        sa.Column("scheduled_for", sa.DateTime(timezone=True), nullable=True),
        sa.Column("dagster_run_id", sa.Text(), nullable=True),
        sa.Column("owner_id", sa.Text(), nullable=False),
        sa.Column("fencing_token", sa.BigInteger(), nullable=True),
        sa.Column(
            "options",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column(
            "started_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column(
            "heartbeat_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column("status_reason", sa.Text(), nullable=True),
        sa.Column("cancel_requested_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("eligible_count", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("processed_count", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("succeeded_count", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("failed_count", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("skipped_count", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("retry_scheduled_count", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("deadlettered_count", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("last_error_code", sa.Text(), nullable=True),
        sa.Column("last_error_text", sa.Text(), nullable=True),
        sa.CheckConstraint("mode IN ('dry_run', 'execute')", name=op.f("ck_job_run_mode_allowed")),
        sa.CheckConstraint(
            "status IN ('running', 'success', 'partial_success', 'failed', 'timeout', 'cancelled', 'skipped', 'no_work')",
            name=op.f("ck_job_run_status_allowed"),
        ),
        sa.CheckConstraint(
            "trigger_type IN ('schedule', 'sensor', 'manual', 'backfill', 'retry', 'api')",
            name=op.f("ck_job_run_trigger_type_allowed"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_job_run")),
    )
    op.create_index(
        "ix_job_run_history",
        "job_run",
        ["job_name", "scope", sa.literal_column("started_at DESC")],
        unique=False,
    )
    op.create_index(
        "ix_job_run_running",
        "job_run",
        ["job_name"],
        unique=False,
        postgresql_where=sa.text("status = 'running'"),
    )
    op.create_table(
        "outbox_event",
        sa.Column("id", sa.UUID(), nullable=False),
        sa.Column("business_key", sa.Text(), nullable=False),
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("aggregate_type", sa.Text(), nullable=False),
        sa.Column("aggregate_id", sa.Text(), nullable=False),
        sa.Column("event_type", sa.Text(), nullable=False),
        sa.Column(
            "payload",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column(
            "available_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column("published_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("publish_attempts", sa.Integer(), server_default="0", nullable=False),
        sa.Column("last_error_code", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_outbox_event")),
        sa.UniqueConstraint("business_key", name=op.f("uq_outbox_event_business_key")),
    )
    op.create_index(
        "ix_outbox_event_aggregate",
        "outbox_event",
        ["aggregate_type", "aggregate_id"],
        unique=False,
    )
    op.create_index(
        "ix_outbox_event_unpublished",
        "outbox_event",
        ["available_at", "id"],
        unique=False,
        postgresql_where=sa.text("published_at IS NULL"),
    )
    op.create_table(
        "tenant",
        sa.Column("id", sa.Text(), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("time_zone", sa.Text(), server_default="UTC", nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.CheckConstraint("id ~ '^[a-z0-9][a-z0-9-]{0,62}$'", name=op.f("ck_tenant_id_format")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tenant")),
    )
    op.create_table(
        "audit_archive_manifest",
        sa.Column("id", sa.UUID(), nullable=False),
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("window_start", sa.DateTime(timezone=True), nullable=False),
        sa.Column("window_end", sa.DateTime(timezone=True), nullable=False),
        sa.Column("file_path", sa.Text(), nullable=False),
        sa.Column("row_count", sa.BigInteger(), nullable=False),
        sa.Column("min_record_id", sa.BigInteger(), nullable=False),
        sa.Column("max_record_id", sa.BigInteger(), nullable=False),
        sa.Column("sha256", sa.Text(), nullable=False),
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column("job_run_id", sa.UUID(), nullable=True),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column("verified_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(
            "status IN ('WRITTEN', 'VERIFIED', 'FAILED')",
            name=op.f("ck_audit_archive_manifest_status_allowed"),
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenant.id"], name=op.f("fk_audit_archive_manifest_tenant_id_tenant")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_archive_manifest")),
    )
    op.create_index(
        "ix_audit_archive_manifest_tenant",
        "audit_archive_manifest",
        ["tenant_id", "window_start"],
        unique=False,
    )
    op.create_table(
        "audit_record",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("occurred_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("actor_ref", sa.Text(), nullable=False),
        sa.Column("action", sa.Text(), nullable=False),
        sa.Column("entity_type", sa.Text(), nullable=False),
        sa.Column("entity_id", sa.Text(), nullable=False),
        sa.Column(
            "details",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenant.id"], name=op.f("fk_audit_record_tenant_id_tenant")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_record")),
    )
    op.create_index(
        "ix_audit_record_tenant_occurred",
        "audit_record",
        ["tenant_id", "occurred_at", "id"],
        unique=False,
    )
    op.create_table(
        "catalog_item",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("sku", sa.Text(), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("list_price", sa.Numeric(precision=14, scale=2), nullable=False),
        sa.Column("version", sa.Integer(), server_default="1", nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenant.id"], name=op.f("fk_catalog_item_tenant_id_tenant")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_catalog_item")),
        sa.UniqueConstraint("tenant_id", "sku", name=op.f("uq_catalog_item_tenant_id_sku")),
    )
    op.create_index("ix_catalog_item_tenant_id", "catalog_item", ["tenant_id", "id"], unique=False)
    op.create_table(
        "price_book",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("is_current", sa.Boolean(), server_default=sa.text("false"), nullable=False),
        sa.Column("effective_from", sa.DateTime(timezone=True), nullable=False),
        sa.Column(
            "price_factor", sa.Numeric(precision=8, scale=4), server_default="1", nullable=False
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenant.id"], name=op.f("fk_price_book_tenant_id_tenant")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_price_book")),
        sa.UniqueConstraint("tenant_id", "version", name=op.f("uq_price_book_tenant_id_version")),
    )
    op.create_index(
        "uq_price_book_current",
        "price_book",
        ["tenant_id"],
        unique=True,
        postgresql_where=sa.text("is_current"),
    )
    op.create_table(
        "quote",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("quote_number", sa.Text(), nullable=False),
        sa.Column("customer_ref", sa.Text(), nullable=False),
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column("currency", sa.Text(), server_default="EUR", nullable=False),
        sa.Column("total_amount", sa.Numeric(precision=14, scale=2), nullable=False),
        sa.Column("price_book_version", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("version", sa.Integer(), server_default="1", nullable=False),
        sa.CheckConstraint(
            "status IN ('DRAFT', 'ACTIVE', 'ACCEPTED', 'EXPIRED', 'CANCELLED')",
            name=op.f("ck_quote_status_allowed"),
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenant.id"], name=op.f("fk_quote_tenant_id_tenant")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_quote")),
        sa.UniqueConstraint(
            "tenant_id", "quote_number", name=op.f("uq_quote_tenant_id_quote_number")
        ),
    )
    op.create_index(
        "ix_quote_active_expiry",
        "quote",
        ["tenant_id", "expires_at", "id"],
        unique=False,
        postgresql_where=sa.text("status = 'ACTIVE'"),
    )
    op.create_index(
        "ix_quote_tenant_created", "quote", ["tenant_id", "created_at", "id"], unique=False
    )
    op.create_index("ix_quote_tenant_id", "quote", ["tenant_id", "id"], unique=False)
    op.create_table(
        "temp_file",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("storage_path", sa.Text(), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column("legal_hold", sa.Boolean(), server_default=sa.text("false"), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint(
            "status IN ('PENDING', 'COMPLETED', 'FAILED_TERMINAL')",
            name=op.f("ck_temp_file_status_allowed"),
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenant.id"], name=op.f("fk_temp_file_tenant_id_tenant")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_temp_file")),
        sa.UniqueConstraint("storage_path", name=op.f("uq_temp_file_storage_path")),
    )
    op.create_index(
        "ix_temp_file_cleanup",
        "temp_file",
        ["tenant_id", "created_at", "id"],
        unique=False,
        postgresql_where=sa.text(
            "legal_hold = false AND status IN ('COMPLETED', 'FAILED_TERMINAL')"
        ),
    )
    op.create_table(
        "catalog_cache",
        sa.Column("catalog_item_id", sa.BigInteger(), nullable=False),
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("cached_version", sa.Integer(), nullable=False),
        sa.Column("payload", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("refreshed_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["catalog_item_id"],
            ["catalog_item.id"],
            name=op.f("fk_catalog_cache_catalog_item_id_catalog_item"),
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenant.id"], name=op.f("fk_catalog_cache_tenant_id_tenant")
        ),
        sa.PrimaryKeyConstraint("catalog_item_id", name=op.f("pk_catalog_cache")),
    )
    op.create_table(
        "checkout_session",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("quote_id", sa.BigInteger(), nullable=True),
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_activity_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("closed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("version", sa.Integer(), server_default="1", nullable=False),
        sa.CheckConstraint(
            "status IN ('OPEN', 'COMPLETED', 'ABANDONED')",
            name=op.f("ck_checkout_session_status_allowed"),
        ),
        sa.ForeignKeyConstraint(
            ["quote_id"], ["quote.id"], name=op.f("fk_checkout_session_quote_id_quote")
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenant.id"], name=op.f("fk_checkout_session_tenant_id_tenant")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_checkout_session")),
    )
    op.create_index(
        "ix_checkout_session_open_idle",
        "checkout_session",
        ["tenant_id", "last_activity_at", "id"],
        unique=False,
        postgresql_where=sa.text("status = 'OPEN'"),
    )
    op.create_table(
        "customer_order",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("quote_id", sa.BigInteger(), nullable=True),
        sa.Column("order_number", sa.Text(), nullable=False),
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column("total_amount", sa.Numeric(precision=14, scale=2), nullable=False),
        sa.Column("line_count", sa.Integer(), nullable=False),
        sa.Column("submitted_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("version", sa.Integer(), server_default="1", nullable=False),
        sa.Column(
            "needs_manual_review", sa.Boolean(), server_default=sa.text("false"), nullable=False
        ),
        sa.CheckConstraint(
            "status IN ('SUBMITTED', 'IN_FULFILLMENT', 'COMPLETED', 'CANCELLED', 'FAILED')",
            name=op.f("ck_customer_order_status_allowed"),
        ),
        sa.ForeignKeyConstraint(
            ["quote_id"], ["quote.id"], name=op.f("fk_customer_order_quote_id_quote")
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenant.id"], name=op.f("fk_customer_order_tenant_id_tenant")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_customer_order")),
        sa.UniqueConstraint("order_number", name=op.f("uq_customer_order_order_number")),
        sa.UniqueConstraint("quote_id", name=op.f("uq_customer_order_quote_id")),
    )
    op.create_index(
        "ix_customer_order_tenant_id", "customer_order", ["tenant_id", "id"], unique=False
    )
    op.create_index(
        "ix_customer_order_tenant_submitted",
        "customer_order",
        ["tenant_id", "submitted_at", "id"],
        unique=False,
    )
    op.create_table(
        "pricing_snapshot",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("quote_id", sa.BigInteger(), nullable=False),
        sa.Column("price_book_version", sa.Integer(), nullable=False),
        sa.Column("total_amount", sa.Numeric(precision=14, scale=2), nullable=False),
        sa.Column("line_count", sa.Integer(), nullable=False),
        sa.Column("computed_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("job_run_id", sa.UUID(), nullable=True),
        sa.ForeignKeyConstraint(
            ["quote_id"], ["quote.id"], name=op.f("fk_pricing_snapshot_quote_id_quote")
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenant.id"], name=op.f("fk_pricing_snapshot_tenant_id_tenant")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_pricing_snapshot")),
        sa.UniqueConstraint(
            "quote_id",
            "price_book_version",
            name=op.f("uq_pricing_snapshot_quote_id_price_book_version"),
        ),
    )
    op.create_table(
        "quote_line",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("quote_id", sa.BigInteger(), nullable=False),
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("line_no", sa.Integer(), nullable=False),
        sa.Column("sku", sa.Text(), nullable=False),
        sa.Column("quantity", sa.Integer(), nullable=False),
        sa.Column("unit_price", sa.Numeric(precision=14, scale=2), nullable=False),
        sa.Column("amount", sa.Numeric(precision=14, scale=2), nullable=False),
        sa.ForeignKeyConstraint(
            ["quote_id"], ["quote.id"], name=op.f("fk_quote_line_quote_id_quote")
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenant.id"], name=op.f("fk_quote_line_tenant_id_tenant")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_quote_line")),
        sa.UniqueConstraint("quote_id", "line_no", name=op.f("uq_quote_line_quote_id_line_no")),
    )
    op.create_table(
        "delivery_attempt_item",
        sa.Column("id", sa.UUID(), nullable=False),
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("business_key", sa.Text(), nullable=False),
        sa.Column("order_id", sa.BigInteger(), nullable=True),
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column("attempt_count", sa.Integer(), server_default="0", nullable=False),
        sa.Column("max_attempts", sa.Integer(), server_default="8", nullable=False),
        sa.Column("next_attempt_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_error_code", sa.Text(), nullable=True),
        sa.Column("last_error_message", sa.Text(), nullable=True),
        sa.Column("last_error_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("payload", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint(
            "status IN ('READY', 'IN_PROGRESS', 'DELIVERED', 'DEAD_LETTER')",
            name=op.f("ck_delivery_attempt_item_status_allowed"),
        ),
        sa.ForeignKeyConstraint(
            ["order_id"],
            ["customer_order.id"],
            name=op.f("fk_delivery_attempt_item_order_id_customer_order"),
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenant.id"], name=op.f("fk_delivery_attempt_item_tenant_id_tenant")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_delivery_attempt_item")),
        sa.UniqueConstraint("business_key", name=op.f("uq_delivery_attempt_item_business_key")),
    )
    op.create_index(
        "ix_delivery_attempt_item_dead",
        "delivery_attempt_item",
        ["tenant_id", "updated_at"],
        unique=False,
        postgresql_where=sa.text("status = 'DEAD_LETTER'"),
    )
    op.create_index(
        "ix_delivery_attempt_item_due",
        "delivery_attempt_item",
        ["tenant_id", "next_attempt_at", "id"],
        unique=False,
        postgresql_where=sa.text("status = 'READY'"),
    )
    op.create_table(
        "notification",
        sa.Column("id", sa.UUID(), nullable=False),
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("order_id", sa.BigInteger(), nullable=True),
        sa.Column("channel", sa.Text(), nullable=False),
        sa.Column("template", sa.Text(), nullable=False),
        sa.Column("recipient_ref", sa.Text(), nullable=False),
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column("outbox_event_id", sa.UUID(), nullable=True),
        sa.Column("send_after", sa.DateTime(timezone=True), nullable=False),
        sa.Column("sent_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint(
            "status IN ('PENDING', 'SENT', 'FAILED')", name=op.f("ck_notification_status_allowed")
        ),
        sa.ForeignKeyConstraint(
            ["order_id"],
            ["customer_order.id"],
            name=op.f("fk_notification_order_id_customer_order"),
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenant.id"], name=op.f("fk_notification_tenant_id_tenant")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_notification")),
    )
    op.create_index(
        "ix_notification_pending",
        "notification",
        ["tenant_id", "send_after", "id"],
        unique=False,
        postgresql_where=sa.text("status = 'PENDING'"),
    )
    op.create_table(
        "order_read_model",
        sa.Column("order_id", sa.BigInteger(), nullable=False),
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("order_number", sa.Text(), nullable=False),
        sa.Column("quote_number", sa.Text(), nullable=True),
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column("total_amount", sa.Numeric(precision=14, scale=2), nullable=False),
        sa.Column("line_count", sa.Integer(), nullable=False),
        sa.Column("source_version", sa.Integer(), nullable=False),
        sa.Column("refreshed_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["order_id"],
            ["customer_order.id"],
            name=op.f("fk_order_read_model_order_id_customer_order"),
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenant.id"], name=op.f("fk_order_read_model_tenant_id_tenant")
        ),
        sa.PrimaryKeyConstraint("order_id", name=op.f("pk_order_read_model")),
    )
    op.create_index(
        "ix_order_read_model_tenant", "order_read_model", ["tenant_id", "order_id"], unique=False
    )

    # job_audit is append-only: the database itself refuses to rewrite history.
    op.execute(
        """
        CREATE FUNCTION job_audit_refuse_change() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            RAISE EXCEPTION 'job_audit is append-only: % refused', TG_OP
                USING ERRCODE = 'insufficient_privilege';
        END $$;
        CREATE TRIGGER job_audit_append_only
            BEFORE UPDATE OR DELETE ON job_audit
            FOR EACH ROW EXECUTE FUNCTION job_audit_refuse_change();
        CREATE TRIGGER job_audit_no_truncate
            BEFORE TRUNCATE ON job_audit
            FOR EACH STATEMENT EXECUTE FUNCTION job_audit_refuse_change();
        """
    )


def downgrade() -> None:
    op.execute("DROP TRIGGER job_audit_no_truncate ON job_audit")
    op.execute("DROP TRIGGER job_audit_append_only ON job_audit")
    op.execute("DROP FUNCTION job_audit_refuse_change()")
    op.drop_index("ix_order_read_model_tenant", table_name="order_read_model")
    op.drop_table("order_read_model")
    op.drop_index(
        "ix_notification_pending",
        table_name="notification",
        postgresql_where=sa.text("status = 'PENDING'"),
    )
    op.drop_table("notification")
    op.drop_index(
        "ix_delivery_attempt_item_due",
        table_name="delivery_attempt_item",
        postgresql_where=sa.text("status = 'READY'"),
    )
    op.drop_index(
        "ix_delivery_attempt_item_dead",
        table_name="delivery_attempt_item",
        postgresql_where=sa.text("status = 'DEAD_LETTER'"),
    )
    op.drop_table("delivery_attempt_item")
    op.drop_table("quote_line")
    op.drop_table("pricing_snapshot")
    op.drop_index("ix_customer_order_tenant_submitted", table_name="customer_order")
    op.drop_index("ix_customer_order_tenant_id", table_name="customer_order")
    op.drop_table("customer_order")
    op.drop_index(
        "ix_checkout_session_open_idle",
        table_name="checkout_session",
        postgresql_where=sa.text("status = 'OPEN'"),
    )
    op.drop_table("checkout_session")
    op.drop_table("catalog_cache")
    op.drop_index(
        "ix_temp_file_cleanup",
        table_name="temp_file",
        postgresql_where=sa.text(
            "legal_hold = false AND status IN ('COMPLETED', 'FAILED_TERMINAL')"
        ),
    )
    op.drop_table("temp_file")
    op.drop_index("ix_quote_tenant_id", table_name="quote")
    op.drop_index("ix_quote_tenant_created", table_name="quote")
    op.drop_index(
        "ix_quote_active_expiry", table_name="quote", postgresql_where=sa.text("status = 'ACTIVE'")
    )
    op.drop_table("quote")
    op.drop_index(
        "uq_price_book_current", table_name="price_book", postgresql_where=sa.text("is_current")
    )
    op.drop_table("price_book")
    op.drop_index("ix_catalog_item_tenant_id", table_name="catalog_item")
    op.drop_table("catalog_item")
    op.drop_index("ix_audit_record_tenant_occurred", table_name="audit_record")
    op.drop_table("audit_record")
    op.drop_index("ix_audit_archive_manifest_tenant", table_name="audit_archive_manifest")
    op.drop_table("audit_archive_manifest")
    op.drop_table("tenant")
    op.drop_index(
        "ix_outbox_event_unpublished",
        table_name="outbox_event",
        postgresql_where=sa.text("published_at IS NULL"),
    )
    op.drop_index("ix_outbox_event_aggregate", table_name="outbox_event")
    op.drop_table("outbox_event")
    op.drop_index(
        "ix_job_run_running", table_name="job_run", postgresql_where=sa.text("status = 'running'")
    )
    op.drop_index("ix_job_run_history", table_name="job_run")
    op.drop_table("job_run")
    op.drop_table("job_lease")
    op.drop_table("job_checkpoint")
    op.drop_index("ix_job_audit_job", table_name="job_audit")
    op.drop_table("job_audit")
    op.drop_index("ix_downstream_order_tenant", table_name="downstream_order")
    op.drop_table("downstream_order")
