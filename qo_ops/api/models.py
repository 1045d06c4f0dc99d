"""The shapes the API speaks: request bodies (validated by Pydantic before any handler runs),
the ``202 Accepted`` answer, and how stored rows become JSON."""

# (no `from __future__ import annotations`: FastAPI reads these annotations at runtime)

import uuid
from datetime import date, datetime
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from qo_ops.platform.job.options import MAX_BATCH_SIZE, MAX_ITEMS, MAX_TEXT, MAX_THROTTLE_MS
from qo_ops.platform.job.scope import TENANT_ID

SAFE_ID = r"^[A-Za-z0-9._:-]{1,128}$"
NO_CONTROL = r"^[^\x00-\x1f\x7f]+$"
ISO_DATE = r"^\d{4}-\d{2}-\d{2}$"
EXAMPLE_TENANT = "tenant-001"  # the demo data's first tenant


class RunRequestBody(BaseModel):
    """A request to run a job once."""

    model_config = ConfigDict(
        extra="forbid",
        populate_by_name=True,
        json_schema_extra={
            "examples": [
                {"mode": "dry_run", "tenant": EXAMPLE_TENANT, "reason": "look first"},
                {"mode": "execute", "tenant": EXAMPLE_TENANT, "reason": "INC-42"},
                {
                    "mode": "dry_run",
                    "tenant": EXAMPLE_TENANT,
                    "from": "2026-01-01",
                    "to": "2026-01-02",
                },
            ]
        },
    )

    mode: Literal["dry_run", "execute"] = Field(
        description="dry_run counts and samples, changing nothing; execute applies."
    )
    tenant: str = Field(
        pattern=TENANT_ID.pattern,
        description="The tenant, e.g. tenant-001.",
        examples=[EXAMPLE_TENANT],
    )
    from_: str | None = Field(
        default=None,
        alias="from",
        pattern=ISO_DATE,
        json_schema_extra={"format": "date"},
        description="Windowed jobs only: first day (YYYY-MM-DD, UTC), inclusive.",
    )
    to: str | None = Field(
        default=None,
        pattern=ISO_DATE,
        json_schema_extra={"format": "date"},
        description="Windowed jobs only: last day (YYYY-MM-DD, UTC), exclusive.",
    )
    maxItems: int | None = Field(default=None, ge=1, le=MAX_ITEMS, strict=True)
    batchSize: int | None = Field(default=None, ge=1, le=MAX_BATCH_SIZE, strict=True)
    throttleMs: int | None = Field(default=None, ge=0, le=MAX_THROTTLE_MS, strict=True)
    reason: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_TEXT,
        pattern=NO_CONTROL,
        description="Why this run is needed; required for execute.",
    )
    correlationId: str | None = Field(default=None, pattern=SAFE_ID)
    approvalId: str | None = Field(
        default=None,
        pattern=SAFE_ID,
        description=(
            "Destructive jobs: the approval this execute cites (apr-…), granted by an approver "
            "for this job and tenant (POST /internal/jobs/{job}/approvals, or qo-ops approval grant)."
        ),
    )
    requestApproval: bool = Field(
        default=False,
        strict=True,
        description="Operator executing a destructive job: hold the run for a second "
        "identity's approval instead of being refused.",
    )


class ReasonBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reason: str = Field(min_length=1, max_length=MAX_TEXT, pattern=NO_CONTROL)


class ApprovalBody(BaseModel):
    """Grant an approval a destructive job's execute cites (on any path)."""

    model_config = ConfigDict(extra="forbid")

    tenants: list[str] | None = Field(
        default=None,
        min_length=1,
        max_length=1000,
        description="The tenants it covers; omitted: every tenant (a token of one tenant: "
        "its tenant only).",
        examples=[[EXAMPLE_TENANT]],
    )
    reason: str = Field(min_length=1, max_length=MAX_TEXT, pattern=NO_CONTROL)
    validForS: int = Field(
        default=3600, ge=60, le=86400, strict=True, description="How long it may be cited."
    )


class ControlBody(BaseModel):
    """Suspend or resume a job: for one tenant, or (no tenant) for every scope."""

    model_config = ConfigDict(extra="forbid")

    tenant: str | None = Field(
        default=None,
        pattern=TENANT_ID.pattern,
        description="Only this tenant; omitted: the job for every scope.",
        examples=[EXAMPLE_TENANT],
    )
    reason: str = Field(min_length=1, max_length=MAX_TEXT, pattern=NO_CONTROL)


class Accepted(BaseModel):
    jobRunId: str
    status: str
    mode: str


# The 202's header, as the OpenAPI document shows it
ACCEPTED_HEADERS = {
    "Location": {"description": "The run's own path.", "schema": {"type": "string"}},
}


def accepted(job_name: str, run_id: uuid.UUID, status: str, mode: str) -> JSONResponse:
    """``202``: the run is recorded (and launched, or held); ``Location`` names it."""
    return JSONResponse(
        {"jobRunId": str(run_id), "status": status, "mode": mode},
        status_code=202,
        headers={"Location": f"/internal/jobs/{job_name}/runs/{run_id}"},
    )


def jsonable(data: dict[str, Any]) -> dict[str, Any]:
    """A stored row with its dates and ids as strings."""
    return {
        k: v.isoformat()
        if isinstance(v, datetime | date)
        else str(v)
        if isinstance(v, uuid.UUID)
        else v
        for k, v in data.items()
    }
