"""The catalog (``GET /internal/jobs``) and one job's state per scope
(``GET /internal/jobs/{jobName}/status``)."""

# (no `from __future__ import annotations`: FastAPI reads these annotations at runtime)

from typing import Annotated, Any

from fastapi import APIRouter, Query

from qo_ops.api.deps import Api, Auditor, Caller, Job
from qo_ops.api.errors import refusals
from qo_ops.api.models import EXAMPLE_TENANT, jsonable
from qo_ops.jobs.catalog import CATALOG
from qo_ops.platform.actions import control
from qo_ops.platform.actions.status import job_status
from qo_ops.platform.job.scope import TENANT_ID

router = APIRouter()


@router.get("/internal/jobs", responses=refusals(), summary="The job catalog")
def list_jobs() -> dict[str, Any]:
    return {
        "jobs": [
            {
                "name": s.name,
                "kind": s.kind,
                "windowed": s.partitioning == "tenant_day",
                "destructive": s.destructive,
                "description": s.description,
            }
            for s in CATALOG.values()
        ]
    }


@router.get(
    "/internal/jobs/{jobName}/status",
    responses=refusals(403, 404, 422),
    summary="Per scope: last run, last success, lease holder, backlog, checkpoint age",
)
def status(
    spec: Job,
    p: Caller,
    api: Api,
    audit: Auditor,
    tenant: Annotated[
        str | None, Query(pattern=TENANT_ID.pattern, examples=[EXAMPLE_TENANT])
    ] = None,
) -> dict[str, Any]:
    wanted = audit.readable(p, spec.name, tenant)
    rows = job_status(api.engine, spec, wanted)
    with api.engine.connect() as conn:
        held = control.suspensions(conn, spec.name, wanted)
    return {
        "job": spec.name,
        "scopes": [jsonable(r.as_dict()) for r in rows],
        "suspended": [jsonable(s.as_dict()) for s in held],
    }
