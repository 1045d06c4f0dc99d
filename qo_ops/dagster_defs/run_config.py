"""The typed run config of every catalog job's Dagster run (what the Launchpad shows), and
the run modes."""

import enum

# (no `from __future__ import annotations`: Dagster reads these annotations at decoration time)
import dagster as dg
from pydantic import Field

from qo_ops.platform.job.options import (
    MAX_BATCH_SIZE,
    MAX_DEADLINE_S,
    MAX_ITEMS,
    MAX_TEXT,
    MAX_THROTTLE_MS,
)


class Mode(enum.Enum):
    """dry_run counts and samples what execute would change, and changes nothing."""

    dry_run = "dry_run"
    execute = "execute"


class JobRunConfig(dg.Config):
    """How this run behaves. Empty fields take the job's defaults."""

    mode: Mode | None = Field(
        default=None,
        description=(
            "dry_run: count and sample, change nothing. execute: apply. Empty: execute for "
            "schedules and sensors, dry_run when launched by hand or by a backfill (a backfill "
            "executes when tagged qo_ops/mode=execute)."
        ),
    )
    batch_size: int | None = Field(
        default=None, ge=1, le=MAX_BATCH_SIZE, description="Items per batch transaction."
    )
    max_items: int | None = Field(
        default=None, ge=1, le=MAX_ITEMS, description="Stop after this many items."
    )
    throttle_ms: int | None = Field(
        default=None,
        ge=0,
        le=MAX_THROTTLE_MS,
        description="Pause between batches, in milliseconds.",
    )
    deadline_s: float | None = Field(
        default=None,
        gt=0,
        le=MAX_DEADLINE_S,
        description="Stop with status timeout after this many seconds.",
    )
    reason: str | None = Field(
        default=None,
        max_length=MAX_TEXT,
        description=(
            "Why this run is needed (required to execute by hand; kept in the audit trail). "
            "One incident's reason may cover many tenants; the Launchpad copies an earlier "
            "run's config, so an execute giving the reason an earlier execute of this job "
            "gave for the same tenant is refused (Re-execute that run to repeat it)."
        ),
    )
    approval: str | None = Field(
        default=None,
        max_length=MAX_TEXT,
        description=(
            "Destructive jobs only: the approval this execute cites (apr-…), granted by an "
            "approver for this job and tenant (qo-ops approval grant, or POST "
            "/internal/jobs/{job}/approvals). Without a valid one an execute is refused before queueing."
        ),
    )
    tenants: list[str] | None = Field(
        default=None,
        description=(
            "The tenants this run covers, each run on its own (lease, job run, kill switch). "
            "Required for a windowed job (its partition is the day); a tenant job's run "
            "covers its tenant partition when empty. Schedules and sensors fill it in chunks."
        ),
    )
