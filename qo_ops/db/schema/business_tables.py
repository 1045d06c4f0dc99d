"""The Quote & Order business tables the jobs act on (tenants, quotes, orders, deliveries,
notifications, checkouts, temp files, audit records, the catalog and its cache), the
fulfilment system's own store the demo seeds, and what the jobs keep of their work
(reconciliation results, re-submissions, archive manifests, tombstones)."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB, UUID

from qo_ops.db.schema.base import NOW, TS, metadata, status_check, tenant_fk

QUOTE_STATUSES = ("DRAFT", "ACTIVE", "ACCEPTED", "EXPIRED", "CANCELLED")
ORDER_STATUSES = ("SUBMITTED", "IN_FULFILLMENT", "COMPLETED", "CANCELLED", "FAILED")
DELIVERY_STATUSES = ("READY", "IN_PROGRESS", "DELIVERED", "DEAD_LETTER")
CHECKOUT_STATUSES = ("OPEN", "COMPLETED", "ABANDONED")
TEMP_FILE_STATUSES = ("PENDING", "COMPLETED", "FAILED_TERMINAL")
NOTIFICATION_STATUSES = ("PENDING", "SENT", "FAILED")
MANIFEST_STATUSES = ("WRITTEN", "VERIFIED", "FAILED")

tenant = sa.Table(
    "tenant",
    metadata,
    sa.Column("id", sa.Text, primary_key=True),  # short text key, e.g. tenant-001
    sa.Column("name", sa.Text, nullable=False),
    sa.Column("time_zone", sa.Text, nullable=False, server_default="UTC"),
    sa.Column("created_at", TS, nullable=False, server_default=NOW),
    sa.CheckConstraint("id ~ '^[a-z0-9][a-z0-9-]{0,62}$'", name="id_format"),
)

price_book = sa.Table(
    "price_book",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    tenant_fk(),
    sa.Column("version", sa.Integer, nullable=False),
    sa.Column("is_current", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Column("effective_from", TS, nullable=False),
    sa.Column("price_factor", sa.Numeric(8, 4), nullable=False, server_default="1"),
    sa.UniqueConstraint("tenant_id", "version"),
    sa.Index(
        "uq_price_book_current", "tenant_id", unique=True, postgresql_where=sa.text("is_current")
    ),
)

quote = sa.Table(
    "quote",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    tenant_fk(),
    sa.Column("quote_number", sa.Text, nullable=False),
    sa.Column("customer_ref", sa.Text, nullable=False),  # opaque reference, never a name or e-mail
    sa.Column("status", sa.Text, nullable=False),
    sa.Column("currency", sa.Text, nullable=False, server_default="EUR"),
    sa.Column("total_amount", sa.Numeric(14, 2), nullable=False),
    sa.Column("price_book_version", sa.Integer, nullable=False),
    sa.Column("created_at", TS, nullable=False),
    sa.Column("updated_at", TS, nullable=False),
    sa.Column("expires_at", TS, nullable=False),
    sa.Column("version", sa.Integer, nullable=False, server_default="1"),
    status_check("status", QUOTE_STATUSES),
    sa.UniqueConstraint("tenant_id", "quote_number"),
    # quote_expiration: ACTIVE quotes past expiry, oldest first
    sa.Index(
        "ix_quote_active_expiry",
        "tenant_id",
        "expires_at",
        "id",
        postgresql_where=sa.text("status = 'ACTIVE'"),
    ),
    # pricing_snapshot_recalculation: quotes of a tenant created in a window, by stable cursor
    sa.Index("ix_quote_tenant_created", "tenant_id", "created_at", "id"),
    sa.Index("ix_quote_tenant_id", "tenant_id", "id"),
)

quote_line = sa.Table(
    "quote_line",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    sa.Column("quote_id", sa.BigInteger, sa.ForeignKey("quote.id"), nullable=False),
    tenant_fk(),
    sa.Column("line_no", sa.Integer, nullable=False),
    sa.Column("sku", sa.Text, nullable=False),
    sa.Column("quantity", sa.Integer, nullable=False),
    sa.Column("unit_price", sa.Numeric(14, 2), nullable=False),
    sa.Column("amount", sa.Numeric(14, 2), nullable=False),
    sa.UniqueConstraint("quote_id", "line_no"),
)

pricing_snapshot = sa.Table(
    "pricing_snapshot",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    tenant_fk(),
    sa.Column("quote_id", sa.BigInteger, sa.ForeignKey("quote.id"), nullable=False),
    sa.Column("price_book_version", sa.Integer, nullable=False),
    sa.Column("total_amount", sa.Numeric(14, 2), nullable=False),
    sa.Column("line_count", sa.Integer, nullable=False),
    sa.Column("computed_at", TS, nullable=False),
    sa.Column("job_run_id", UUID(as_uuid=True)),
    sa.UniqueConstraint("quote_id", "price_book_version"),  # the upsert key of the backfill
)

customer_order = sa.Table(
    "customer_order",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    tenant_fk(),
    sa.Column("quote_id", sa.BigInteger, sa.ForeignKey("quote.id"), unique=True),
    sa.Column("order_number", sa.Text, nullable=False, unique=True),  # the downstream reference
    sa.Column("status", sa.Text, nullable=False),
    sa.Column("total_amount", sa.Numeric(14, 2), nullable=False),
    sa.Column("line_count", sa.Integer, nullable=False),
    sa.Column("submitted_at", TS, nullable=False),
    sa.Column("updated_at", TS, nullable=False),
    sa.Column("version", sa.Integer, nullable=False, server_default="1"),
    sa.Column("needs_manual_review", sa.Boolean, nullable=False, server_default=sa.false()),
    status_check("status", ORDER_STATUSES),
    # order_reconciliation: orders of a tenant submitted in a window, by stable cursor
    sa.Index("ix_customer_order_tenant_submitted", "tenant_id", "submitted_at", "id"),
    sa.Index("ix_customer_order_tenant_id", "tenant_id", "id"),
    # the manual-review queue (qo-ops review list): the few flagged orders, per tenant
    sa.Index(
        "ix_customer_order_needs_review",
        "tenant_id",
        "id",
        postgresql_where=sa.text("needs_manual_review"),
    ),
)

# The fulfilment system's own store, served by the downstream simulator over HTTP.
# Jobs never read it directly: it stands for a system qo-ops does not own.
downstream_order = sa.Table(
    "downstream_order",
    metadata,
    sa.Column("order_number", sa.Text, primary_key=True),
    sa.Column("tenant_id", sa.Text, nullable=False),
    sa.Column("status", sa.Text, nullable=False),
    sa.Column("received_at", TS, nullable=False),
    sa.Column("updated_at", TS, nullable=False),
    sa.Index("ix_downstream_order_tenant", "tenant_id", "order_number"),
)

order_read_model = sa.Table(
    "order_read_model",
    metadata,
    sa.Column("order_id", sa.BigInteger, sa.ForeignKey("customer_order.id"), primary_key=True),
    tenant_fk(),
    sa.Column("order_number", sa.Text, nullable=False),
    sa.Column("quote_number", sa.Text),
    sa.Column("status", sa.Text, nullable=False),
    sa.Column("total_amount", sa.Numeric(14, 2), nullable=False),
    sa.Column("line_count", sa.Integer, nullable=False),
    sa.Column("source_version", sa.Integer, nullable=False),
    sa.Column("refreshed_at", TS, nullable=False),
    sa.Index("ix_order_read_model_tenant", "tenant_id", "order_id"),
)

delivery_attempt_item = sa.Table(
    "delivery_attempt_item",
    metadata,
    sa.Column("id", UUID(as_uuid=True), primary_key=True),
    tenant_fk(),
    sa.Column("business_key", sa.Text, nullable=False, unique=True),  # also the idempotency key
    sa.Column("order_id", sa.BigInteger, sa.ForeignKey("customer_order.id")),
    sa.Column("status", sa.Text, nullable=False),
    sa.Column("attempt_count", sa.Integer, nullable=False, server_default="0"),
    sa.Column("max_attempts", sa.Integer, nullable=False, server_default="8"),
    sa.Column("next_attempt_at", TS, nullable=False),
    sa.Column("last_error_code", sa.Text),
    sa.Column("last_error_message", sa.Text),
    sa.Column("last_error_at", TS),
    sa.Column("payload", JSONB, nullable=False),
    sa.Column("created_at", TS, nullable=False),
    sa.Column("updated_at", TS, nullable=False),
    status_check("status", DELIVERY_STATUSES),
    # delivery_retry: READY items that are due, and IN_PROGRESS items whose claim lapsed
    # (their process died between sending and recording), oldest first
    sa.Index(
        "ix_delivery_attempt_item_due",
        "tenant_id",
        "next_attempt_at",
        "id",
        postgresql_where=sa.text("status IN ('READY', 'IN_PROGRESS')"),
    ),
    sa.Index(
        "ix_delivery_attempt_item_dead",
        "tenant_id",
        "updated_at",
        postgresql_where=sa.text("status = 'DEAD_LETTER'"),
    ),
)

notification = sa.Table(
    "notification",
    metadata,
    sa.Column("id", UUID(as_uuid=True), primary_key=True),
    tenant_fk(),
    sa.Column("order_id", sa.BigInteger, sa.ForeignKey("customer_order.id")),
    sa.Column("channel", sa.Text, nullable=False),
    sa.Column("template", sa.Text, nullable=False),
    sa.Column("recipient_ref", sa.Text, nullable=False),  # opaque reference, never an address
    sa.Column("status", sa.Text, nullable=False),
    sa.Column("outbox_event_id", UUID(as_uuid=True)),
    sa.Column("send_after", TS, nullable=False),
    sa.Column("sent_at", TS),
    sa.Column("created_at", TS, nullable=False),
    status_check("status", NOTIFICATION_STATUSES),
    sa.Index(
        "ix_notification_pending",
        "tenant_id",
        "send_after",
        "id",
        postgresql_where=sa.text("status = 'PENDING'"),
    ),
)

checkout_session = sa.Table(
    "checkout_session",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    tenant_fk(),
    sa.Column("quote_id", sa.BigInteger, sa.ForeignKey("quote.id")),
    sa.Column("status", sa.Text, nullable=False),
    sa.Column("started_at", TS, nullable=False),
    sa.Column("last_activity_at", TS, nullable=False),
    sa.Column("closed_at", TS),
    sa.Column("version", sa.Integer, nullable=False, server_default="1"),
    status_check("status", CHECKOUT_STATUSES),
    # abandoned_checkout_close: OPEN flows idle the longest first
    sa.Index(
        "ix_checkout_session_open_idle",
        "tenant_id",
        "last_activity_at",
        "id",
        postgresql_where=sa.text("status = 'OPEN'"),
    ),
)

temp_file = sa.Table(
    "temp_file",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    tenant_fk(),
    sa.Column("storage_path", sa.Text, nullable=False, unique=True),
    sa.Column("size_bytes", sa.BigInteger, nullable=False),
    sa.Column("status", sa.Text, nullable=False),
    sa.Column("legal_hold", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Column("created_at", TS, nullable=False),
    status_check("status", TEMP_FILE_STATUSES),
    # temp_file_cleanup: terminal files not on legal hold, oldest first
    sa.Index(
        "ix_temp_file_cleanup",
        "tenant_id",
        "created_at",
        "id",
        postgresql_where=sa.text(
            "legal_hold = false AND status IN ('COMPLETED', 'FAILED_TERMINAL')"
        ),
    ),
)

audit_record = sa.Table(
    "audit_record",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    tenant_fk(),
    sa.Column("occurred_at", TS, nullable=False),
    sa.Column("actor_ref", sa.Text, nullable=False),
    sa.Column("action", sa.Text, nullable=False),
    sa.Column("entity_type", sa.Text, nullable=False),
    sa.Column("entity_id", sa.Text, nullable=False),
    sa.Column("details", JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
    # audit_archive: records of a tenant past retention, by time then id
    sa.Index("ix_audit_record_tenant_occurred", "tenant_id", "occurred_at", "id"),
    # audit_archive's batches: a tenant's records by UTC day, then id (no sort per batch)
    sa.Index(
        "ix_audit_record_tenant_day_id",
        "tenant_id",
        sa.text("CAST(timezone('UTC', occurred_at) AS date)"),
        "id",
    ),
)

audit_archive_manifest = sa.Table(
    "audit_archive_manifest",
    metadata,
    sa.Column("id", UUID(as_uuid=True), primary_key=True),
    tenant_fk(),
    sa.Column("window_start", TS, nullable=False),
    sa.Column("window_end", TS, nullable=False),
    sa.Column("file_path", sa.Text, nullable=False),
    sa.Column("row_count", sa.BigInteger, nullable=False),
    sa.Column("min_record_id", sa.BigInteger, nullable=False),
    sa.Column("max_record_id", sa.BigInteger, nullable=False),
    sa.Column("sha256", sa.Text, nullable=False),
    sa.Column("status", sa.Text, nullable=False),
    sa.Column("job_run_id", UUID(as_uuid=True)),
    sa.Column("created_at", TS, nullable=False, server_default=NOW),
    sa.Column("verified_at", TS),
    status_check("status", MANIFEST_STATUSES),
    sa.Index("ix_audit_archive_manifest_tenant", "tenant_id", "window_start"),
    # run_history_retention keeps the runs a manifest names
    sa.Index("ix_audit_archive_manifest_job_run", "job_run_id"),
)

catalog_item = sa.Table(
    "catalog_item",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    tenant_fk(),
    sa.Column("sku", sa.Text, nullable=False),
    sa.Column("name", sa.Text, nullable=False),
    sa.Column("list_price", sa.Numeric(14, 2), nullable=False),
    sa.Column("version", sa.Integer, nullable=False, server_default="1"),
    sa.Column("updated_at", TS, nullable=False),
    sa.UniqueConstraint("tenant_id", "sku"),
    sa.Index("ix_catalog_item_tenant_id", "tenant_id", "id"),
)

catalog_cache = sa.Table(
    "catalog_cache",
    metadata,
    sa.Column("catalog_item_id", sa.BigInteger, sa.ForeignKey("catalog_item.id"), primary_key=True),
    tenant_fk(),
    sa.Column("cached_version", sa.Integer, nullable=False),
    sa.Column("payload", JSONB, nullable=False),
    sa.Column("refreshed_at", TS, nullable=False),
)

MISMATCH_TYPES = (
    "missing_downstream",
    "status_drift",
    "terminal_not_reflected",
    "unknown_downstream",
)

# One row per mismatch an order_reconciliation run found: what, what it did, how it went.
reconciliation_result = sa.Table(
    "reconciliation_result",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    sa.Column("job_run_id", UUID(as_uuid=True), nullable=False),
    tenant_fk(),
    sa.Column("order_id", sa.BigInteger, sa.ForeignKey("customer_order.id")),
    sa.Column("order_number", sa.Text, nullable=False),
    sa.Column("mismatch_type", sa.Text, nullable=False),
    sa.Column("our_status", sa.Text),
    sa.Column("downstream_status", sa.Text),
    sa.Column(
        "action", sa.Text, nullable=False
    ),  # report_only, resubmit, adopt_status, manual_review
    # corrected, pending (a re-submission not yet delivered, or in its grace), flagged,
    # dead_letter_flagged, budget_exhausted, failed
    sa.Column("outcome", sa.Text, nullable=False),
    sa.Column("detail", sa.Text),
    sa.Column("created_at", TS, nullable=False, server_default=NOW),
    status_check("mismatch_type", MISMATCH_TYPES),
    sa.UniqueConstraint("job_run_id", "order_number"),
    sa.Index("ix_reconciliation_result_order", "tenant_id", "order_number", "created_at"),
)

# order_reconciliation's re-submission budget (migration 0010): one row per re-submission of
# an order the downstream misses, numbered from 1 in the transaction that puts its delivery
# item back to READY. The number is the key of its OrderResubmitRequested event
# (order:{id}:resubmit:{n}), so a rerun over unchanged state adds neither row nor event.
order_resubmission = sa.Table(
    "order_resubmission",
    metadata,
    sa.Column("order_id", sa.BigInteger, sa.ForeignKey("customer_order.id"), primary_key=True),
    sa.Column("resubmission", sa.Integer, primary_key=True),  # 1, 2, … QO_OPS_RESUBMIT_MAX
    tenant_fk(),
    sa.Column("job_run_id", UUID(as_uuid=True), nullable=False),  # a stamp, like pricing's
    sa.Column("requested_at", TS, nullable=False, server_default=NOW),
    sa.CheckConstraint("resubmission >= 1", name="resubmission_from_one"),
)

# temp_file_cleanup (migration 0003). One tombstone per temp file the job removes: written
# with the object's checksum BEFORE anything is removed (deleted_at NULL: removal decided),
# completed (deleted_at set) in the transaction that deletes the row and its stored object.
# Triggers (in the migration, not declared here):
#   temp_file_legal_hold_guard   BEFORE DELETE ON temp_file: refuses to delete a row on legal hold
#   temp_file_tombstone_immutable BEFORE UPDATE OR DELETE ON temp_file_tombstone: a completed
#                                 tombstone (deleted_at set) is never changed or removed
temp_file_tombstone = sa.Table(
    "temp_file_tombstone",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    sa.Column("temp_file_id", sa.BigInteger, nullable=False, unique=True),  # the row is gone: no FK
    tenant_fk(),
    sa.Column("storage_path", sa.Text, nullable=False),
    sa.Column("size_bytes", sa.BigInteger, nullable=False),
    sa.Column("sha256", sa.Text),  # of the stored object's bytes; NULL: the object was already gone
    sa.Column("file_status", sa.Text, nullable=False),
    sa.Column("file_created_at", TS, nullable=False),
    sa.Column("legal_hold", sa.Boolean, nullable=False),  # as returned by the row's DELETE
    sa.Column("job_run_id", UUID(as_uuid=True), nullable=False),
    sa.Column("reason", sa.Text, nullable=False),
    sa.Column("selected_at", TS, nullable=False, server_default=NOW),
    sa.Column("deleted_at", TS),  # NULL: removal decided, not (yet) committed
    sa.CheckConstraint("sha256 IS NULL OR sha256 ~ '^[0-9a-f]{64}$'", name="sha256_format"),
    sa.Index("ix_temp_file_tombstone_tenant_created", "tenant_id", "file_created_at"),
    # run_history_retention keeps the runs a tombstone names
    sa.Index("ix_temp_file_tombstone_job_run", "job_run_id"),
)

# temp_file_cleanup: a tenant's files overall (the anomaly share) and a window's held files
sa.Index("ix_temp_file_tenant_created", temp_file.c.tenant_id, temp_file.c.created_at)

BUSINESS_TABLES = (
    tenant,
    price_book,
    quote,
    quote_line,
    pricing_snapshot,
    customer_order,
    downstream_order,
    order_read_model,
    delivery_attempt_item,
    notification,
    checkout_session,
    temp_file,
    audit_record,
    audit_archive_manifest,
    catalog_item,
    catalog_cache,
    reconciliation_result,
    temp_file_tombstone,
    order_resubmission,
)
