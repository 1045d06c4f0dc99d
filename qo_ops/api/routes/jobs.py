"""The catalog (``GET /internal/jobs``) and one job's state per scope
(``GET /internal/jobs/{jobName}/status``)."""

# (no `from __future__ import annotations`: FastAPI reads these annotations at runtime)

from typing import Annotated, Any

from fastapi import APIRouter, Query

from qo_ops.api import authz
from qo_ops.api.deps import Api, Auditor, Caller, Job
from qo_ops.api.errors import ERRORS
from qo_ops.api.models import jsonable
from qo_ops.jobs.catalog import CATALOG
from qo_ops.platform import control
from qo_ops.platform.spec import TENANT_ID
from qo_ops.platform.status import job_status

router = APIRouter()


@router.get("/internal/jobs", responses=ERRORS, summary="The job catalog")
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
    responses=ERRORS,
    summary="Per scope: last run, last success, lease holder, backlog, checkpoint age",
)
def status(
    spec: Job,
    p: Caller,
    api: Api,
    audit: Auditor,
    tenant: Annotated[str | None, Query(pattern=TENANT_ID.pattern)] = None,
) -> dict[str, Any]:
    wanted = tenant or p.tenant_id
    decision = authz.may_read(p, wanted)
    if not decision.allowed:
        raise audit.deny(p, "read", decision.reason, job_name=spec.name)
    rows = job_status(api.engine, spec, wanted)
    with api.engine.connect() as conn:
        held = control.suspensions(conn, spec.name, wanted)
    return {
        "job": spec.name,
        "scopes": [jsonable(r.as_dict()) for r in rows],
        "suspended": [jsonable(s.as_dict()) for s in held],
    }
