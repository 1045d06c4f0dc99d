"""What a handler is given (FastAPI dependencies): the app's collaborators, the request's
audit trail, the authenticated caller, and the job or run its path names.

Every ``/internal`` route depends on :func:`principal` (see ``routes``), so a request is
authenticated and counted against its rate limit before anything else is looked at."""

# (no `from __future__ import annotations`: FastAPI reads these annotations at runtime)

import re
import uuid
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Path, Request
from sqlalchemy.engine import Engine

from qo_ops.api import authz, service
from qo_ops.api.dagster import DagsterClient
from qo_ops.api.errors import ApiError
from qo_ops.api.ratelimit import RateLimiter
from qo_ops.api.tokens import Principal, authenticate
from qo_ops.db import audit
from qo_ops.jobs.catalog import CATALOG
from qo_ops.platform.job.spec import JobSpec


@dataclass(frozen=True)
class ApiState:
    """The app's collaborators, shared by every request: the database, Dagster and the
    per-identity rate limit."""

    engine: Engine
    dagster: DagsterClient
    limiter: RateLimiter


def api_state(request: Request) -> ApiState:
    """The collaborators ``create_app`` put on the app."""
    state: ApiState = request.app.state.api
    return state


def request_meta(request: Request) -> service.RequestMeta:
    """The request's id and client address (set by the ``request_context`` middleware)."""
    meta: service.RequestMeta = request.state.meta
    return meta


Api = Annotated[ApiState, Depends(api_state)]
Meta = Annotated[service.RequestMeta, Depends(request_meta)]


@dataclass(frozen=True)
class Audit:
    """The request's audit trail: each call writes one ``job_audit`` row in its own
    transaction, stamped with the request's id and client address."""

    engine: Engine
    meta: service.RequestMeta

    def __call__(self, actor: str, action: str, decision: str, **about: Any) -> None:
        with self.engine.begin() as conn:
            audit.append_audit(conn, self.meta.entry(actor, action, decision, **about))

    def deny(self, p: Principal, action: str, why: str, **about: Any) -> ApiError:
        """Audit a refusal of ``p`` for ``why``; the ``403`` to raise."""
        self(p.identity, action, f"denied: {why}", **about)
        return ApiError(403, why)

    def readable(self, p: Principal, job_name: str, tenant: str | None) -> str | None:
        """The tenant ``p`` reads (``tenant``, else the token's own, else every one: None);
        an audited ``403`` if ``p`` may not read it."""
        wanted = tenant or p.tenant_id
        decision = authz.may_read(p, wanted)
        if not decision.allowed:
            raise self.deny(p, "read", decision.reason, job_name=job_name)
        return wanted

    def invalid(self, request: Request, message: str) -> None:
        """Audit a ``422`` (by the caller, if it authenticated)."""
        p: Principal | None = getattr(request.state, "principal", None)
        self(
            p.identity if p else "anonymous", "validate", f"denied: {message}",
            details={"path": request.url.path, "method": request.method},
        )  # fmt: skip


def auditor(request: Request) -> Audit:
    """The request's :class:`Audit`."""
    return Audit(api_state(request).engine, request_meta(request))


Auditor = Annotated[Audit, Depends(auditor)]


def principal(request: Request, api: Api, audit: Auditor) -> Principal:
    """The caller its bearer token names, within its rate limit: ``401`` without a valid
    token, ``429`` over the limit (both audited). Kept on ``request.state`` for the log line
    and the error handlers."""
    header = request.headers.get("authorization", "")
    scheme, _, presented = header.partition(" ")
    found = authenticate(api.engine, presented.strip()) if scheme.lower() == "bearer" else None
    where = {"path": request.url.path, "method": request.method}
    if found is None:
        wait = api.limiter.hit(f"anonymous:{audit.meta.client_address or 'unknown'}")
        why = "missing bearer token" if not header else "unknown, expired or revoked token"
        audit("anonymous", "authenticate", f"denied: {why}", details=where)
        if wait is not None:
            raise ApiError(429, "too many requests", {"Retry-After": f"{wait:.0f}"})
        raise ApiError(401, why, {"WWW-Authenticate": "Bearer"})
    request.state.principal = found
    wait = api.limiter.hit(f"identity:{found.identity}")
    if wait is not None:
        audit(found.identity, "rate_limit", "denied: rate limit", details=where)
        raise ApiError(
            429,
            f"rate limit of {api.limiter.limit} requests per {api.limiter.window_s:.0f} s exceeded",
            {"Retry-After": f"{max(wait, 1):.0f}"},
        )
    return found


Caller = Annotated[Principal, Depends(principal)]


# The path's job: its schema lists the catalog's names (an eleventh job appears by itself);
# a name outside it is a missing resource, answered by ``job_in_path``, not a validation error.
JobName = Annotated[
    str,
    Path(description="A job of the catalog.", json_schema_extra={"enum": list(CATALOG)}),
]


def job_in_path(jobName: JobName) -> JobSpec:
    """The catalog job the path names; ``404`` for a name the catalog does not know (never
    echoing a name that is not one)."""
    spec = CATALOG.get(jobName)
    if spec is None:
        shown = jobName if re.fullmatch(r"[a-z_]{1,64}", jobName) else "(not a job name)"
        raise ApiError(404, f"unknown job {shown}")
    return spec


Job = Annotated[JobSpec, Depends(job_in_path)]


@dataclass(frozen=True)
class RunInPath:
    """The run the path names (``/internal/jobs/{jobName}/runs/{runId}``)."""

    spec: JobSpec
    id: uuid.UUID

    def load(self, engine: Engine) -> dict[str, Any]:
        """The run's row; ``404`` if the job has no such run. Called by the handler, after
        the body is validated, so that a bad body is a ``422`` for any run."""
        row = service.get_run(engine, self.spec.name, self.id)
        if row is None:
            raise ApiError(404, f"no run {self.id} of {self.spec.name}")
        return row


def run_in_path(jobName: JobName, runId: uuid.UUID) -> RunInPath:
    """The job and run id the path names (a job unknown to the catalog: ``404``)."""
    return RunInPath(job_in_path(jobName), runId)


Run = Annotated[RunInPath, Depends(run_in_path)]
