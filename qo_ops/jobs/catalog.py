"""The job catalog: every operational job, declared once. Dagster jobs, schedules, sensors,
checks, CLI commands, API routes and metrics are derived from this list."""

from __future__ import annotations

from qo_ops.errors import BadInput
from qo_ops.jobs import (
    abandoned_checkout_close,
    audit_archive,
    catalog_cache_refresh,
    delivery_retry,
    notification_publish,
    order_reconciliation,
    pricing_snapshot_recalculation,
    quote_expiration,
    read_model_repair,
    run_history_retention,
    temp_file_cleanup,
)
from qo_ops.platform.spec import JobSpec

CATALOG: dict[str, JobSpec] = {
    spec.name: spec
    for spec in (
        quote_expiration.SPEC,
        delivery_retry.SPEC,
        notification_publish.SPEC,
        order_reconciliation.SPEC,
        read_model_repair.SPEC,
        pricing_snapshot_recalculation.SPEC,
        audit_archive.SPEC,
        temp_file_cleanup.SPEC,
        catalog_cache_refresh.SPEC,
        abandoned_checkout_close.SPEC,
        run_history_retention.SPEC,
    )
}


def get_spec(name: str) -> JobSpec:
    """The spec of job ``name``; a one-line error naming the known jobs otherwise."""
    normalized = name.strip().replace("-", "_")
    spec = CATALOG.get(normalized)
    if spec is None:
        raise BadInput(f"unknown job {name!r}; known jobs: {', '.join(sorted(CATALOG))}")
    return spec
