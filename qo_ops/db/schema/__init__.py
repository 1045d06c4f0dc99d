"""The schema, as SQLAlchemy Core tables: the platform's own tables and the Quote & Order
business tables the jobs act on.

This package is the source of truth; ``qo_ops/db/migrations`` creates it and a test checks
that the migrated database and these tables agree. Every selection a job makes has an
index here (partial where a status filter applies). Timestamps are ``timestamptz``.

The tables are declared in ``platform_tables.py`` and ``business_tables.py`` (on the one
``metadata`` of ``base.py``); everything else imports them from here, ``qo_ops.db.schema``.
"""

from __future__ import annotations

from qo_ops.db.schema.base import NOW, TS, metadata
from qo_ops.db.schema.business_tables import (
    BUSINESS_TABLES,
    CHECKOUT_STATUSES,
    DELIVERY_STATUSES,
    MANIFEST_STATUSES,
    MISMATCH_TYPES,
    NOTIFICATION_STATUSES,
    ORDER_STATUSES,
    QUOTE_STATUSES,
    TEMP_FILE_STATUSES,
    audit_archive_manifest,
    audit_record,
    catalog_cache,
    catalog_item,
    checkout_session,
    customer_order,
    delivery_attempt_item,
    downstream_order,
    notification,
    order_read_model,
    order_resubmission,
    price_book,
    pricing_snapshot,
    quote,
    quote_line,
    reconciliation_result,
    temp_file,
    temp_file_tombstone,
    tenant,
)
from qo_ops.db.schema.platform_tables import (
    API_ROLES,
    JOB_RUN_STATUSES,
    PLATFORM_TABLES,
    RUN_MODES,
    TRIGGER_TYPES,
    api_idempotency,
    api_token,
    downstream_breaker,
    job_audit,
    job_checkpoint,
    job_control,
    job_lease,
    job_run,
    outbox_event,
)

__all__ = [
    "NOW",
    "TS",
    "metadata",
    "JOB_RUN_STATUSES",
    "RUN_MODES",
    "TRIGGER_TYPES",
    "job_lease",
    "job_run",
    "job_checkpoint",
    "job_control",
    "downstream_breaker",
    "outbox_event",
    "job_audit",
    "API_ROLES",
    "api_token",
    "api_idempotency",
    "PLATFORM_TABLES",
    "QUOTE_STATUSES",
    "ORDER_STATUSES",
    "DELIVERY_STATUSES",
    "CHECKOUT_STATUSES",
    "TEMP_FILE_STATUSES",
    "NOTIFICATION_STATUSES",
    "MANIFEST_STATUSES",
    "tenant",
    "price_book",
    "quote",
    "quote_line",
    "pricing_snapshot",
    "customer_order",
    "downstream_order",
    "order_read_model",
    "delivery_attempt_item",
    "notification",
    "checkout_session",
    "temp_file",
    "audit_record",
    "audit_archive_manifest",
    "catalog_item",
    "catalog_cache",
    "MISMATCH_TYPES",
    "reconciliation_result",
    "order_resubmission",
    "temp_file_tombstone",
    "BUSINESS_TABLES",
]
