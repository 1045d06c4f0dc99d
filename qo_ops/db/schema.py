"""The schema, as SQLAlchemy Core tables: the platform's own tables and the Quote & Order
business tables the jobs act on.

This module is the source of truth; ``qo_ops/db/migrations`` creates it and a test checks
that the migrated database and these tables agree. Every selection a job makes has an
index here (partial where a status filter applies). Timestamps are ``timestamptz``.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB, UUID

metadata = sa.MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    }
)

TS = sa.DateTime(timezone=True)
NOW = sa.text("now()")


def _status_check(column: str, values: tuple[str, ...]) -> sa.CheckConstraint:
    allowed = ", ".join(f"'{v}'" for v in values)
    return sa.CheckConstraint(f"{column} IN ({allowed})", name=f"{column}_allowed")


def _tenant_fk() -> sa.Column[str]:
    return sa.Column("tenant_id", sa.Text, sa.ForeignKey("tenant.id"), nullable=False)


# ---------------------------------------------------------------------------- platform

JOB_RUN_STATUSES = (
    "awaiting_approval",  # an API request for a destructive execute, held for a second identity
    "accepted",  # created by the API; the Dagster run adopts it when its op starts
    "running",
    "success",
    "partial_success",
    "failed",
    "timeout",
    "cancelled",
    "skipped",
    "no_work",
)
RUN_MODES = ("dry_run", "execute")
TRIGGER_TYPES = ("schedule", "sensor", "manual", "backfill", "retry", "api")

# One row per (job, scope): whoever holds an unexpired lease may write for that scope.
job_lease = sa.Table(
    "job_lease",
    metadata,
    sa.Column("job_name", sa.Text, primary_key=True),
    sa.Column("scope", sa.Text, primary_key=True),
    sa.Column("owner_id", sa.Text, nullable=False),
    sa.Column("lease_token", sa.Text, nullable=False),
    sa.Column("fencing_token", sa.BigInteger, nullable=False),
    sa.Column("acquired_at", TS, nullable=False),
    sa.Column("heartbeat_at", TS, nullable=False),
    sa.Column("expires_at", TS, nullable=False),
    sa.Column("job_run_id", UUID(as_uuid=True)),
)

job_run = sa.Table(
    "job_run",
    metadata,
    sa.Column("id", UUID(as_uuid=True), primary_key=True),
    sa.Column("job_name", sa.Text, nullable=False),
    sa.Column("scope", sa.Text, nullable=False),
    sa.Column("window_start", sa.Date),
    sa.Column("window_end", sa.Date),
    sa.Column("mode", sa.Text, nullable=False),
    sa.Column("trigger_type", sa.Text, nullable=False),
    sa.Column("requester", sa.Text),
    sa.Column("reason", sa.Text),
    sa.Column("correlation_id", sa.Text),
    sa.Column("scheduled_for", TS),
    sa.Column("dagster_run_id", sa.Text),
    sa.Column("owner_id", sa.Text, nullable=False),
    sa.Column("fencing_token", sa.BigInteger),
    sa.Column("options", JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
    sa.Column("created_at", TS, nullable=False, server_default=NOW),
    sa.Column("started_at", TS, nullable=False, server_default=NOW),
    sa.Column("heartbeat_at", TS, nullable=False, server_default=NOW),
    sa.Column("finished_at", TS),
    sa.Column("status", sa.Text, nullable=False),
    sa.Column("status_reason", sa.Text),
    sa.Column("cancel_requested_at", TS),
    sa.Column("eligible_count", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("processed_count", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("succeeded_count", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("failed_count", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("skipped_count", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("retry_scheduled_count", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("deadlettered_count", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column(
        "tally", JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")
    ),  # job-specific counts
    sa.Column("last_error_code", sa.Text),
    sa.Column("last_error_text", sa.Text),
    sa.Column("duplicates_prevented_count", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("approved_by", sa.Text),  # the second identity that released a held run
    sa.Column("approved_at", TS),
    # when the run was asked for: the Dagster run's creation, the API's acceptance (0012)
    sa.Column("requested_at", TS),
    sa.Column("lock_wait_ms", sa.Integer),  # how long taking the lease took (execute runs)
    # which of its trigger's retries this run is (0: the first attempt), of retries_max
    sa.Column("retry_number", sa.Integer, nullable=False, server_default="0"),
    sa.Column("retries_max", sa.Integer),
    _status_check("status", JOB_RUN_STATUSES),
    _status_check("mode", RUN_MODES),
    _status_check("trigger_type", TRIGGER_TYPES),
    sa.Index("ix_job_run_history", "job_name", "scope", sa.text("started_at DESC")),
    sa.Index("ix_job_run_running", "job_name", postgresql_where=sa.text("status = 'running'")),
    # the metrics exporter reads what started and finished since its last scrape
    sa.Index("ix_job_run_created", "created_at"),
    sa.Index("ix_job_run_job_started", "job_name", sa.text("started_at DESC")),
    sa.Index(
        "ix_job_run_finished", "finished_at", postgresql_where=sa.text("finished_at IS NOT NULL")
    ),
    sa.Index(
        "ix_job_run_job_finished",
        "job_name",
        sa.text("finished_at DESC"),
        postgresql_where=sa.text("finished_at IS NOT NULL"),
    ),
    # the exporter's missed-run judgement starts at a job's first scheduled run
    sa.Index(
        "ix_job_run_scheduled",
        "job_name",
        "scheduled_for",
        postgresql_where=sa.text("scheduled_for IS NOT NULL"),
    ),
    # an earlier Dagster execute of a job with the same reason (qo_ops/platform/consent.py)
    sa.Index(
        "ix_job_run_dagster_reason",
        "job_name",
        sa.text(r"btrim(regexp_replace(lower(reason), '\s+', ' ', 'g'))"),
        postgresql_where=sa.text(
            "mode = 'execute' AND reason IS NOT NULL AND dagster_run_id IS NOT NULL"
        ),
    ),
    sa.Index(
        "ix_job_run_active",
        "job_name",
        "scope",
        postgresql_where=sa.text("status IN ('awaiting_approval', 'accepted', 'running')"),
    ),
    # run_history_retention: a tenant's runs (scope T or T/<window>) by finished_at; not
    # partial, so that ANALYZE keeps statistics on the expression (the planner then knows
    # how many runs a tenant has and walks the index in order)
    sa.Index("ix_job_run_retention", sa.text("split_part(scope, '/', 1)"), "finished_at"),
)

# The resume point of a (job, scope); written in the transaction of the batch it follows.
job_checkpoint = sa.Table(
    "job_checkpoint",
    metadata,
    sa.Column("job_name", sa.Text, primary_key=True),
    sa.Column("scope", sa.Text, primary_key=True),
    sa.Column("cursor", JSONB, nullable=False),
    sa.Column("updated_at", TS, nullable=False, server_default=NOW),
    sa.Column("job_run_id", UUID(as_uuid=True)),
    # run_history_retention: a tenant's checkpoints, least recently written first
    sa.Index("ix_job_checkpoint_retention", sa.text("split_part(scope, '/', 1)"), "updated_at"),
)

# The kill switch: a row suspends a job for one tenant, or (tenant_id '') for every scope.
# Resuming deletes the row; who suspended and resumed what, when and why is in job_audit.
job_control = sa.Table(
    "job_control",
    metadata,
    sa.Column("job_name", sa.Text, primary_key=True),
    sa.Column("tenant_id", sa.Text, primary_key=True, server_default=""),  # '' = every scope
    sa.Column("suspended_by", sa.Text, nullable=False),
    sa.Column("reason", sa.Text, nullable=False),
    sa.Column("suspended_at", TS, nullable=False, server_default=NOW),
    sa.CheckConstraint("length(btrim(reason)) > 0", name="reason_given"),
)

# The downstream's circuit breaker (migration 0011): one row per downstream origin
# (scheme://host:port, never credentials), shared by every run that calls it. A run that
# sees most of its recent calls fail systemically writes ``open`` with ``probe_after`` (the
# database's clock + the open time); the next run after that probes with a few calls
# (``half_open``) and writes ``closed`` when they answer. See qo_ops/platform/breaker.py.
downstream_breaker = sa.Table(
    "downstream_breaker",
    metadata,
    sa.Column("downstream", sa.Text, primary_key=True),
    sa.Column("state", sa.Text, nullable=False),
    sa.Column("opened_at", TS),  # when the outage began (kept while failed probes reopen it)
    sa.Column("probe_after", TS),  # an open breaker is probed from then on
    sa.Column("reason", sa.Text),  # why it last changed: a short code, e.g. connect_error 7/10
    sa.Column("opened_count", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("changed_at", TS, nullable=False, server_default=NOW),
    sa.Column("changed_by_run", UUID(as_uuid=True)),
    sa.CheckConstraint("state IN ('closed', 'open', 'half_open')", name="state_known"),
)

# Events written in the business transaction, published later by the relay.
outbox_event = sa.Table(
    "outbox_event",
    metadata,
    sa.Column("id", UUID(as_uuid=True), primary_key=True),
    sa.Column("business_key", sa.Text, nullable=False, unique=True),
    sa.Column("tenant_id", sa.Text, nullable=False),
    sa.Column("aggregate_type", sa.Text, nullable=False),
    sa.Column("aggregate_id", sa.Text, nullable=False),
    sa.Column("event_type", sa.Text, nullable=False),
    sa.Column("payload", JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
    sa.Column("created_at", TS, nullable=False, server_default=NOW),
    sa.Column("available_at", TS, nullable=False, server_default=NOW),
    sa.Column("published_at", TS),
    sa.Column("publish_attempts", sa.Integer, nullable=False, server_default="0"),
    sa.Column("last_error_code", sa.Text),
    sa.Column("dead_lettered_at", TS),  # poison or out of attempts: never published
    # notification_publish: a tenant's due, unpublished events, oldest first
    sa.Index(
        "ix_outbox_event_unpublished",
        "tenant_id",
        "available_at",
        "id",
        postgresql_where=sa.text("published_at IS NULL AND dead_lettered_at IS NULL"),
    ),
    sa.Index("ix_outbox_event_aggregate", "aggregate_type", "aggregate_id"),
    sa.Index(
        "ix_outbox_event_dead",
        "dead_lettered_at",
        postgresql_where=sa.text("dead_lettered_at IS NOT NULL"),
    ),
)

# Append-only record of every manual action; the database refuses UPDATE/DELETE/TRUNCATE.
job_audit = sa.Table(
    "job_audit",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    sa.Column("occurred_at", TS, nullable=False, server_default=NOW),
    sa.Column("actor", sa.Text, nullable=False),
    sa.Column("action", sa.Text, nullable=False),
    sa.Column("job_name", sa.Text),
    sa.Column("scope", sa.Text),
    sa.Column("mode", sa.Text),
    sa.Column("reason", sa.Text),
    sa.Column("correlation_id", sa.Text),
    sa.Column("decision", sa.Text, nullable=False),
    sa.Column("job_run_id", UUID(as_uuid=True)),
    sa.Column("details", JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
    sa.Column("request_id", sa.Text),  # the API request this decision answered
    sa.Column("client_address", sa.Text),
    sa.Index("ix_job_audit_job", "job_name", "occurred_at"),
    sa.Index("ix_job_audit_actor", "actor", "occurred_at"),
)

API_ROLES = ("viewer", "operator", "approver")

# Bearer tokens of the operator API: only a SHA-256 of the secret part is stored. The token
# a client holds is ``qoops_<id>_<secret>``; ``id`` finds the row, the secret proves it.
api_token = sa.Table(
    "api_token",
    metadata,
    sa.Column("id", sa.Text, primary_key=True),
    sa.Column("identity", sa.Text, nullable=False),
    sa.Column("roles", sa.ARRAY(sa.Text), nullable=False),
    sa.Column("tenant_id", sa.Text),  # NULL: every tenant
    sa.Column("secret_sha256", sa.Text, nullable=False),
    sa.Column("created_at", TS, nullable=False, server_default=NOW),
    sa.Column("created_by", sa.Text, nullable=False),
    sa.Column("expires_at", TS, nullable=False),
    sa.Column("revoked_at", TS),
    sa.CheckConstraint("id ~ '^[0-9a-f]{16}$'", name="id_format"),
    sa.CheckConstraint("secret_sha256 ~ '^[0-9a-f]{64}$'", name="secret_sha256_format"),
    sa.CheckConstraint(
        "cardinality(roles) > 0 AND roles <@ ARRAY['viewer', 'operator', 'approver']::text[]",
        name="roles_known",
    ),
    sa.Index("ix_api_token_identity", "identity"),
)

# Idempotent submission: one (identity, Idempotency-Key) names one run, for a day at least.
api_idempotency = sa.Table(
    "api_idempotency",
    metadata,
    sa.Column("identity", sa.Text, primary_key=True),
    sa.Column("idempotency_key", sa.Text, primary_key=True),
    sa.Column("request_sha256", sa.Text, nullable=False),
    sa.Column("job_run_id", UUID(as_uuid=True), nullable=False),
    sa.Column("created_at", TS, nullable=False, server_default=NOW),
    sa.Index("ix_api_idempotency_created", "created_at"),
)

PLATFORM_TABLES = (
    job_lease,
    job_run,
    job_checkpoint,
    outbox_event,
    job_audit,
    api_token,
    api_idempotency,
    job_control,
    downstream_breaker,
)

# ---------------------------------------------------------------------------- business

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
    _tenant_fk(),
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
    _tenant_fk(),
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
    _status_check("status", QUOTE_STATUSES),
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
    _tenant_fk(),
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
    _tenant_fk(),
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
    _tenant_fk(),
    sa.Column("quote_id", sa.BigInteger, sa.ForeignKey("quote.id"), unique=True),
    sa.Column("order_number", sa.Text, nullable=False, unique=True),  # the downstream reference
    sa.Column("status", sa.Text, nullable=False),
    sa.Column("total_amount", sa.Numeric(14, 2), nullable=False),
    sa.Column("line_count", sa.Integer, nullable=False),
    sa.Column("submitted_at", TS, nullable=False),
    sa.Column("updated_at", TS, nullable=False),
    sa.Column("version", sa.Integer, nullable=False, server_default="1"),
    sa.Column("needs_manual_review", sa.Boolean, nullable=False, server_default=sa.false()),
    _status_check("status", ORDER_STATUSES),
    # order_reconciliation: orders of a tenant submitted in a window, by stable cursor
    sa.Index("ix_customer_order_tenant_submitted", "tenant_id", "submitted_at", "id"),
    sa.Index("ix_customer_order_tenant_id", "tenant_id", "id"),
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
    _tenant_fk(),
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
    _tenant_fk(),
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
    _status_check("status", DELIVERY_STATUSES),
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
    _tenant_fk(),
    sa.Column("order_id", sa.BigInteger, sa.ForeignKey("customer_order.id")),
    sa.Column("channel", sa.Text, nullable=False),
    sa.Column("template", sa.Text, nullable=False),
    sa.Column("recipient_ref", sa.Text, nullable=False),  # opaque reference, never an address
    sa.Column("status", sa.Text, nullable=False),
    sa.Column("outbox_event_id", UUID(as_uuid=True)),
    sa.Column("send_after", TS, nullable=False),
    sa.Column("sent_at", TS),
    sa.Column("created_at", TS, nullable=False),
    _status_check("status", NOTIFICATION_STATUSES),
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
    _tenant_fk(),
    sa.Column("quote_id", sa.BigInteger, sa.ForeignKey("quote.id")),
    sa.Column("status", sa.Text, nullable=False),
    sa.Column("started_at", TS, nullable=False),
    sa.Column("last_activity_at", TS, nullable=False),
    sa.Column("closed_at", TS),
    sa.Column("version", sa.Integer, nullable=False, server_default="1"),
    _status_check("status", CHECKOUT_STATUSES),
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
    _tenant_fk(),
    sa.Column("storage_path", sa.Text, nullable=False, unique=True),
    sa.Column("size_bytes", sa.BigInteger, nullable=False),
    sa.Column("status", sa.Text, nullable=False),
    sa.Column("legal_hold", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Column("created_at", TS, nullable=False),
    _status_check("status", TEMP_FILE_STATUSES),
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
    _tenant_fk(),
    sa.Column("occurred_at", TS, nullable=False),
    sa.Column("actor_ref", sa.Text, nullable=False),
    sa.Column("action", sa.Text, nullable=False),
    sa.Column("entity_type", sa.Text, nullable=False),
    sa.Column("entity_id", sa.Text, nullable=False),
    sa.Column("details", JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
    # audit_archive: records of a tenant past retention, by time then id
    sa.Index("ix_audit_record_tenant_occurred", "tenant_id", "occurred_at", "id"),
)

audit_archive_manifest = sa.Table(
    "audit_archive_manifest",
    metadata,
    sa.Column("id", UUID(as_uuid=True), primary_key=True),
    _tenant_fk(),
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
    _status_check("status", MANIFEST_STATUSES),
    sa.Index("ix_audit_archive_manifest_tenant", "tenant_id", "window_start"),
    # run_history_retention keeps the runs a manifest names
    sa.Index("ix_audit_archive_manifest_job_run", "job_run_id"),
)

catalog_item = sa.Table(
    "catalog_item",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    _tenant_fk(),
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
    _tenant_fk(),
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
    _tenant_fk(),
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
    _status_check("mismatch_type", MISMATCH_TYPES),
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
    _tenant_fk(),
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
    _tenant_fk(),
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
