"""The HTTP surface of the operator API (FastAPI). Every request is authenticated (bearer
token), rate-limited per identity, validated against the catalog and authorized; every
decision is audited; a run is created ``accepted`` and handed to Dagster, which executes it
out of band. Errors are one line of JSON: ``{"error": "...", "requestId": "..."}``."""

# (no `from __future__ import annotations`: FastAPI reads these annotations at runtime)

import logging
import re
import time
import uuid
from datetime import date, datetime
from typing import Annotated, Any, Literal

from fastapi import Body, Depends, FastAPI, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError
from starlette.exceptions import HTTPException as StarletteHTTPException

from qo_ops.api import authz, service
from qo_ops.api.dagster import DagsterClient, DagsterUnavailable
from qo_ops.api.ratelimit import RateLimiter
from qo_ops.api.tokens import Principal, authenticate
from qo_ops.errors import BadInput, one_line
from qo_ops.jobs.catalog import CATALOG
from qo_ops.platform import control, runs
from qo_ops.platform.manners import DownstreamCalls
from qo_ops.platform.partition_keys import (
    JOB_RUN_TAG,
    MODE_TAG,
    REQUESTER_TAG,
    SCOPE_TAG,
    WINDOW_TAG,
)
from qo_ops.platform.spec import (
    FIRST_DAY,
    LAST_DAY,
    MAX_BATCH_SIZE,
    MAX_ITEMS,
    MAX_TEXT,
    MAX_THROTTLE_MS,
    TENANT_ID,
    JobSpec,
    Scope,
    tenant_of,
)
from qo_ops.platform.status import job_status
from qo_ops.platform.telemetry import log_event

log = logging.getLogger("qo_ops.api")

SAFE_ID = r"^[A-Za-z0-9._:-]{1,128}$"
_SAFE_ID = re.compile(SAFE_ID)
NO_CONTROL = r"^[^\x00-\x1f\x7f]+$"
ISO_DATE = r"^\d{4}-\d{2}-\d{2}$"
MAX_WINDOW_DAYS = 366
MAX_BODY_BYTES = 16_384
STALE_LAUNCH_S = 120  # an accepted run with no Dagster run after this was lost in launch
DAGSTER_FINISHED = ("SUCCESS", "FAILURE", "CANCELED")


# ------------------------------------------------------------------------------ models


class RunRequestBody(BaseModel):
    """A request to run a job once."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    mode: Literal["dry_run", "execute"] = Field(
        description="dry_run counts and samples, changing nothing; execute applies."
    )
    tenant: str = Field(pattern=TENANT_ID.pattern, description="The tenant, e.g. tenant-001.")
    from_: str | None = Field(
        default=None,
        alias="from",
        pattern=ISO_DATE,
        description="Windowed jobs only: first day (YYYY-MM-DD, UTC), inclusive.",
    )
    to: str | None = Field(
        default=None,
        pattern=ISO_DATE,
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
    requestApproval: bool = Field(
        default=False,
        strict=True,
        description="Operator executing a destructive job: hold the run for a second "
        "identity's approval instead of being refused.",
    )


class ReasonBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reason: str = Field(min_length=1, max_length=MAX_TEXT, pattern=NO_CONTROL)


class ControlBody(BaseModel):
    """Suspend or resume a job: for one tenant, or (no tenant) for every scope."""

    model_config = ConfigDict(extra="forbid")

    tenant: str | None = Field(
        default=None,
        pattern=TENANT_ID.pattern,
        description="Only this tenant; omitted: the job for every scope.",
    )
    reason: str = Field(min_length=1, max_length=MAX_TEXT, pattern=NO_CONTROL)


class Accepted(BaseModel):
    jobRunId: str
    status: str
    mode: str


class ErrorBody(BaseModel):
    error: str
    requestId: str
    activeRunId: str | None = None


class ApiError(Exception):
    """A refusal with its status code; the message is one safe line."""

    def __init__(
        self,
        status: int,
        message: str,
        headers: dict[str, str] | None = None,
        active_run: str | None = None,
        audited: bool = False,
    ) -> None:
        super().__init__(message)
        self.audited = audited
        self.status, self.message, self.headers, self.active_run = (
            status,
            one_line(message, 300),
            headers,
            active_run,
        )


ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody, "description": text}
    for code, text in (
        (401, "No, unknown, expired or revoked bearer token."),
        (403, "The token's role or tenant does not allow this."),
        (404, "No such run of this job."),
        (409, "A run of this job and scope is already active (named in activeRunId)."),
        (422, "Malformed body, unknown job, out-of-range limits or unsafe scope."),
        (423, "The job is suspended for this scope (the kill switch): nothing accepted."),
        (429, "Over the identity's rate limit (see Retry-After)."),
        (503, "Dagster or the database could not be reached."),
    )
}


# ------------------------------------------------------------------------------- app


def create_app(engine: Engine, dagster: DagsterClient, limiter: RateLimiter) -> FastAPI:
    """The operator API over ``engine``, launching through ``dagster``."""
    app = FastAPI(
        title="qo-ops operator API",
        version="1",
        description=(
            "Authenticated, authorized and audited manual runs of qo-ops jobs. Every request "
            "carries `Authorization: Bearer <token>` (`qo-ops api token create`). Runs are "
            "accepted here and executed by Dagster out of band."
        ),
        docs_url=None,
        redoc_url=None,
    )

    def meta(request: Request) -> service.RequestMeta:
        return request.state.meta

    def principal(request: Request) -> Principal:
        header = request.headers.get("authorization", "")
        scheme, _, presented = header.partition(" ")
        found = authenticate(engine, presented.strip()) if scheme.lower() == "bearer" else None
        client = meta(request).client_address or "unknown"
        if found is None:
            wait = limiter.hit(f"anonymous:{client}")
            why = "missing bearer token" if not header else "unknown, expired or revoked token"
            service.audit(
                engine, "anonymous", "authenticate", f"denied: {why}", meta(request),
                details={"path": request.url.path, "method": request.method},
            )  # fmt: skip
            if wait is not None:
                raise ApiError(429, "too many requests", {"Retry-After": f"{wait:.0f}"})
            raise ApiError(401, why, {"WWW-Authenticate": "Bearer"})
        request.state.principal = found
        wait = limiter.hit(f"identity:{found.identity}")
        if wait is not None:
            service.audit(
                engine, found.identity, "rate_limit", "denied: rate limit", meta(request),
                details={"path": request.url.path, "method": request.method},
            )  # fmt: skip
            raise ApiError(
                429,
                f"rate limit of {limiter.limit} requests per {limiter.window_s:.0f} s exceeded",
                {"Retry-After": f"{max(wait, 1):.0f}"},
            )
        return found

    Caller = Annotated[Principal, Depends(principal)]

    def spec_of(job_name: str) -> JobSpec:
        spec = CATALOG.get(job_name)
        if spec is None:
            shown = job_name if re.fullmatch(r"[a-z_]{1,64}", job_name) else "(not a job name)"
            raise ApiError(422, f"unknown job {shown}")
        return spec

    def run_of(job_name: str, run_id: uuid.UUID) -> tuple[JobSpec, dict[str, Any]]:
        spec = spec_of(job_name)
        row = service.get_run(engine, spec.name, run_id)
        if row is None:
            raise ApiError(404, f"no run {run_id} of {spec.name}")
        return spec, row

    def deny(request: Request, p: Principal, action: str, why: str, **fields: Any) -> ApiError:
        service.audit(engine, p.identity, action, f"denied: {why}", meta(request), **fields)
        return ApiError(403, why)

    # ------------------------------------------------------------------ middleware

    @app.middleware("http")
    async def request_context(request: Request, call_next: Any) -> Any:
        given = request.headers.get("x-request-id", "")
        request_id = given if _SAFE_ID.match(given) else str(uuid.uuid4())
        client = request.client.host if request.client else None
        request.state.meta = service.RequestMeta(request_id, client)
        started = time.monotonic()
        length = request.headers.get("content-length", "0")
        try:
            if not length.isdigit() or int(length) > MAX_BODY_BYTES:
                response = JSONResponse(
                    {"error": f"body larger than {MAX_BODY_BYTES} bytes", "requestId": request_id},
                    status_code=413,
                )
            elif request.method == "POST" and "content-length" not in request.headers:
                response = JSONResponse(
                    {"error": "Content-Length required", "requestId": request_id},
                    status_code=411,
                )
            else:
                response = await call_next(request)
        except Exception as exc:  # nothing but one safe line leaves the process
            log_event(
                log, logging.ERROR, "api.error", request_id=request_id, error=type(exc).__name__
            )
            response = JSONResponse(
                {"error": "internal error", "requestId": request_id}, status_code=500
            )
        response.headers["X-Request-Id"] = request_id
        p = getattr(request.state, "principal", None)
        log_event(
            log,
            logging.INFO,
            "api.request",
            request_id=request_id,
            method=request.method,
            path=request.url.path,  # never the query string or headers
            status=response.status_code,
            identity=p.identity if p else None,
            client=client,
            duration_ms=int((time.monotonic() - started) * 1000),
        )
        return response

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        if (
            exc.status == 422 and not exc.audited
        ):  # refusals the handlers found (catalog rules): audited here
            p = getattr(request.state, "principal", None)
            service.audit(
                engine, p.identity if p else "anonymous", "validate", f"denied: {exc.message}",
                meta(request), details={"path": request.url.path, "method": request.method},
            )  # fmt: skip
        body: dict[str, Any] = {"error": exc.message, "requestId": meta(request).request_id}
        if exc.active_run:
            body["activeRunId"] = exc.active_run
        return JSONResponse(body, status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        if getattr(request.state, "principal", None) is None:
            try:  # a body that is not JSON fails before authentication: authenticate first
                principal(request)
            except ApiError as refused:
                return await api_error(request, refused)
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or "body"
        message = one_line(f"{where}: {first.get('msg', 'invalid')}", 300)
        p = getattr(request.state, "principal", None)
        service.audit(
            engine, p.identity if p else "anonymous", "validate", f"denied: {message}",
            meta(request), details={"path": request.url.path, "method": request.method},
        )  # fmt: skip
        return JSONResponse(
            {"error": message, "requestId": meta(request).request_id}, status_code=422
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = {404: "not found", 405: "method not allowed"}.get(exc.status_code, "refused")
        return JSONResponse(
            {"error": message, "requestId": meta(request).request_id},
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(DBAPIError)
    async def database_down(request: Request, exc: DBAPIError) -> JSONResponse:
        log_event(log, logging.ERROR, "api.database_error", error=type(exc.orig).__name__)
        return JSONResponse(
            {"error": "database unavailable", "requestId": meta(request).request_id},
            status_code=503,
        )

    # ------------------------------------------------------------------ routes

    @app.get("/healthz", include_in_schema=False)
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/internal/jobs", responses=ERRORS, summary="The job catalog")
    def list_jobs(p: Caller) -> dict[str, Any]:
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

    @app.post(
        "/internal/jobs/{jobName}/runs",
        status_code=202,
        response_model=Accepted,
        responses=ERRORS,
        summary="Request a run (returns at once; Dagster executes it)",
    )
    def submit_run(
        jobName: str,
        request: Request,
        p: Caller,
        body: Annotated[RunRequestBody, Body()],
        idempotency_key: Annotated[
            str | None, Header(alias="Idempotency-Key", pattern=SAFE_ID)
        ] = None,
    ) -> JSONResponse:
        spec = spec_of(jobName)
        run_request = _validated(spec, body)
        scope = run_request.scope
        decision = authz.may_submit(p, spec, body.mode, scope.tenant_id, body.requestApproval)
        if not decision.allowed:
            raise deny(
                request, p, "submit", decision.reason, job_name=spec.name, scope=scope.key,
                mode=body.mode, reason=body.reason, correlation_id=body.correlationId,
            )  # fmt: skip
        if not service.tenant_exists(engine, scope.tenant_id):
            raise ApiError(422, f"unknown tenant {scope.tenant_id}")
        with engine.connect() as conn:
            held = control.suspension_for(conn, spec.name, scope.tenant_id)
        if held is not None:
            service.audit(
                engine, p.identity, "submit", "denied: suspended", meta(request),
                job_name=spec.name, scope=scope.key, mode=body.mode, reason=body.reason,
                correlation_id=body.correlationId, details=held.as_dict(),
            )  # fmt: skip
            raise ApiError(423, f"{held.describe()}; no run accepted", audited=True)
        submitted = service.submit(
            engine, p.identity, run_request, decision.hold_for_approval, idempotency_key,
            meta(request),
        )  # fmt: skip
        stale = _stale(submitted.active_run) if submitted.outcome == "conflict" else None
        if stale is not None:
            service.expire_stale(engine, submitted.active_run["id"], stale, meta(request))
            submitted = service.submit(
                engine, p.identity, run_request, decision.hold_for_approval, idempotency_key,
                meta(request),
            )  # fmt: skip
        if submitted.outcome == "key_reused":
            raise ApiError(
                422, "Idempotency-Key already used for a different request", audited=True
            )
        if submitted.outcome == "conflict":
            raise ApiError(
                409,
                f"{spec.name} {scope.key} already has an active run "
                f"{submitted.run_id} ({submitted.status})",
                active_run=str(submitted.run_id),
            )
        assert submitted.run_id is not None and submitted.status is not None
        status = submitted.status
        if submitted.outcome == "created" and status == "accepted":
            status = launch(request, p.identity, spec, submitted.run_id, run_request)
        return _accepted(spec, submitted.run_id, status, body.mode)

    def _stale(active: dict[str, Any]) -> str | None:
        """Why an accepted run will never start, or None (it may still)."""
        if active.get("status") != "accepted":
            return None
        if active.get("dagster_run_id"):
            state = dagster.status(active["dagster_run_id"])
            return "dagster_run_ended_before_start" if state in DAGSTER_FINISHED else None
        return "launch_lost" if float(active["age_s"]) > STALE_LAUNCH_S else None

    def launch(
        request: Request, identity: str, spec: JobSpec, run_id: uuid.UUID, rr: service.RunRequest
    ) -> str:
        tags = {
            "dagster/partition": _partition_key(spec, rr.scope),
            JOB_RUN_TAG: str(run_id),
            MODE_TAG: rr.mode,
            REQUESTER_TAG: identity,
            SCOPE_TAG: f"{spec.name}:{rr.scope.key}",
        }
        if rr.scope.window_start is not None:
            tags[WINDOW_TAG] = f"{rr.scope.window_start}..{rr.scope.window_end}"
        config = {  # mirrors the accepted row, so the launchpad shows what will run
            "mode": rr.mode,
            **({"reason": rr.reason} if rr.reason else {}),
            **{k: v for k, v in rr.limits.items()},
            **({"tenants": [rr.scope.tenant_id]} if spec.partitioning == "tenant_day" else {}),
        }
        try:
            dagster_run_id = dagster.launch(
                spec.name, {"ops": {f"{spec.name}_op": {"config": config}}}, tags
            )
        except DagsterUnavailable as exc:
            service.record_launch_failed(engine, identity, run_id, str(exc), meta(request))
            log_event(
                log, logging.WARNING, "api.launch_failed", job_run_id=str(run_id), error=str(exc)
            )
            raise ApiError(503, f"run {run_id} not started: {exc}") from None
        service.record_launch(engine, run_id, dagster_run_id)
        return "accepted"

    @app.get(
        "/internal/jobs/{jobName}/runs/{runId}",
        responses=ERRORS,
        summary="A run: status, counters, its calls to the downstream, Dagster run and link",
    )
    def get_run(jobName: str, runId: uuid.UUID, request: Request, p: Caller) -> dict[str, Any]:
        spec, row = run_of(jobName, runId)
        decision = authz.may_read(p, tenant_of(row["scope"]))
        if not decision.allowed:
            raise deny(request, p, "read", decision.reason, job_name=spec.name, run_id=runId)
        return _run_view(row, dagster)

    @app.post(
        "/internal/jobs/{jobName}/runs/{runId}/cancel",
        status_code=202,
        responses=ERRORS,
        summary="Cancel a run (it stops at its next batch boundary; audited)",
    )
    def cancel_run(
        jobName: str,
        runId: uuid.UUID,
        request: Request,
        p: Caller,
        body: Annotated[ReasonBody, Body()],
    ) -> dict[str, Any]:
        spec, row = run_of(jobName, runId)
        decision = authz.may_cancel(p, tenant_of(row["scope"]))
        if not decision.allowed:
            raise deny(
                request, p, "cancel", decision.reason, job_name=spec.name, scope=row["scope"],
                run_id=runId, reason=body.reason,
            )  # fmt: skip
        before = runs.request_cancel(
            engine, runId, p.identity, body.reason,
            request_id=meta(request).request_id, client_address=meta(request).client_address,
        )  # fmt: skip
        if before not in runs.ACTIVE_STATUSES:
            raise ApiError(409, f"run {runId} already ended ({before})")
        terminated = None
        dagster_run_id = row["dagster_run_id"]  # set at launch, before any cancel
        if dagster_run_id:
            try:
                terminated = dagster.terminate(dagster_run_id)
            except DagsterUnavailable:
                terminated = False  # the cancel flag stops it at its next batch anyway
        status = "cancelled" if before in runs.UNSTARTED_STATUSES else "cancel_requested"
        return {"jobRunId": str(runId), "status": status, "dagsterTerminated": terminated}

    @app.post(
        "/internal/jobs/{jobName}/runs/{runId}/approve",
        status_code=202,
        response_model=Accepted,
        responses=ERRORS,
        summary="Approve a held destructive run as a second identity (it then launches)",
    )
    def approve_run(
        jobName: str,
        runId: uuid.UUID,
        request: Request,
        p: Caller,
        body: Annotated[ReasonBody, Body()],
    ) -> JSONResponse:
        spec, row = run_of(jobName, runId)
        decision = authz.may_approve(p, row["requester"], tenant_of(row["scope"]))
        if not decision.allowed:
            raise deny(
                request, p, "approve", decision.reason, job_name=spec.name, scope=row["scope"],
                mode=row["mode"], run_id=runId, reason=body.reason,
            )  # fmt: skip
        before = service.approve(engine, p.identity, runId, body.reason, meta(request))
        if before != "awaiting_approval":
            raise ApiError(409, f"run {runId} is not awaiting approval ({before})")
        rr = service.RunRequest(
            spec=spec,
            mode=row["mode"],
            scope=Scope(tenant_of(row["scope"]), row["window_start"], row["window_end"]),
            limits={},
            reason=row["reason"],
            correlation_id=row["correlation_id"],
            request_approval=True,
        )
        status = launch(request, p.identity, spec, runId, rr)
        return _accepted(spec, runId, status, row["mode"])

    def control_change(
        jobName: str, request: Request, p: Principal, body: ControlBody, action: str
    ) -> dict[str, Any]:
        spec = spec_of(jobName)
        decision = authz.may_control(p, body.tenant)
        scope = body.tenant or "*"
        if not decision.allowed:
            raise deny(request, p, action, decision.reason, job_name=spec.name, scope=scope,
                       reason=body.reason)  # fmt: skip
        if body.tenant is not None and not service.tenant_exists(engine, body.tenant):
            raise ApiError(422, f"unknown tenant {body.tenant}")
        audit = {"request_id": meta(request).request_id,
                 "client_address": meta(request).client_address}  # fmt: skip
        if action == "suspend":
            found, new = control.suspend(
                engine, spec.name, body.tenant, actor=p.identity, reason=body.reason,
                known_jobs=set(CATALOG), audit=audit,
            )  # fmt: skip
            return {"job": spec.name, "suspended": _jsonable(found.as_dict()), "new": new}
        lifted = control.resume(
            engine, spec.name, body.tenant, actor=p.identity, reason=body.reason,
            known_jobs=set(CATALOG), audit=audit,
        )  # fmt: skip
        with engine.connect() as conn:
            left = control.suspensions(conn, spec.name)
        return {
            "job": spec.name,
            "resumed": _jsonable(lifted.as_dict()) if lifted else None,
            "stillSuspended": [_jsonable(s.as_dict()) for s in left],
        }

    @app.post(
        "/internal/jobs/{jobName}/suspend",
        responses=ERRORS,
        summary="Kill switch: suspend a job for a tenant or every scope (approver; audited)",
    )
    def suspend_job(
        jobName: str, request: Request, p: Caller, body: Annotated[ControlBody, Body()]
    ) -> dict[str, Any]:
        return control_change(jobName, request, p, body, "suspend")

    @app.post(
        "/internal/jobs/{jobName}/resume",
        responses=ERRORS,
        summary="Lift a suspension made by suspend (approver; audited)",
    )
    def resume_job(
        jobName: str, request: Request, p: Caller, body: Annotated[ControlBody, Body()]
    ) -> dict[str, Any]:
        return control_change(jobName, request, p, body, "resume")

    @app.get(
        "/internal/jobs/{jobName}/status",
        responses=ERRORS,
        summary="Per scope: last run, last success, lease holder, backlog, checkpoint age",
    )
    def status(
        jobName: str,
        request: Request,
        p: Caller,
        tenant: Annotated[str | None, Query(pattern=TENANT_ID.pattern)] = None,
    ) -> dict[str, Any]:
        spec = spec_of(jobName)
        wanted = tenant or p.tenant_id
        decision = authz.may_read(p, wanted)
        if not decision.allowed:
            raise deny(request, p, "read", decision.reason, job_name=spec.name)
        rows = job_status(engine, spec, wanted)
        with engine.connect() as conn:
            held = control.suspensions(conn, spec.name, wanted)
        return {
            "job": spec.name,
            "scopes": [_jsonable(r.as_dict()) for r in rows],
            "suspended": [_jsonable(s.as_dict()) for s in held],
        }

    return app


# ---------------------------------------------------------------------------- helpers


def _validated(spec: JobSpec, body: RunRequestBody) -> service.RunRequest:
    """The catalog's rules on top of the body's shape; ApiError(422) for anything off."""
    windowed = spec.partitioning == "tenant_day"
    start = end = None
    if windowed:
        if body.from_ is None or body.to is None:
            raise ApiError(422, f"{spec.name} is windowed: give from and to (YYYY-MM-DD)")
        try:
            start, end = date.fromisoformat(body.from_), date.fromisoformat(body.to)
        except ValueError:
            raise ApiError(422, "from/to must be real dates (YYYY-MM-DD)") from None
        if not 0 < (end - start).days <= MAX_WINDOW_DAYS:
            raise ApiError(422, f"to must be 1 to {MAX_WINDOW_DAYS} days after from")
    elif body.from_ is not None or body.to is not None:
        raise ApiError(422, f"{spec.name} is not windowed: drop from and to")
    if body.mode == "execute" and not (body.reason or "").strip():
        raise ApiError(422, "reason is required to execute")
    limits = {
        k: v
        for k, v in (
            ("batch_size", body.batchSize),
            ("max_items", body.maxItems),
            ("throttle_ms", body.throttleMs),
        )
        if v is not None
    }
    try:
        scope = Scope(body.tenant, start, end)  # days at the calendar's edges are refused
    except BadInput:
        raise ApiError(
            422, f"the window's days must lie from {FIRST_DAY} to {LAST_DAY} (to is exclusive)"
        ) from None
    return service.RunRequest(
        spec=spec,
        mode=body.mode,
        scope=scope,
        limits=limits,
        reason=body.reason.strip() if body.reason else None,
        correlation_id=body.correlationId,
        request_approval=body.requestApproval,
    )


def _partition_key(spec: JobSpec, scope: Scope) -> str:
    if spec.partitioning == "tenant_day":
        return str(scope.window_start)  # a windowed job's partition is the day; tenants: config
    return scope.tenant_id


def _accepted(spec: JobSpec, run_id: uuid.UUID, status: str, mode: str) -> JSONResponse:
    return JSONResponse(
        {"jobRunId": str(run_id), "status": status, "mode": mode},
        status_code=202,
        headers={"Location": f"/internal/jobs/{spec.name}/runs/{run_id}"},
    )


def _jsonable(data: dict[str, Any]) -> dict[str, Any]:
    return {
        k: v.isoformat()
        if isinstance(v, datetime | date)
        else str(v)
        if isinstance(v, uuid.UUID)
        else v
        for k, v in data.items()
    }


def _run_view(row: dict[str, Any], dagster: DagsterClient) -> dict[str, Any]:
    view = _jsonable(row)
    view["jobRunId"] = view.pop("id")
    calls = DownstreamCalls.from_tally(view.pop("tally", None))
    view["downstream"] = calls.as_dict() if calls is not None else None
    dagster_run_id = row.get("dagster_run_id")
    view["dagster"] = (
        {
            "runId": dagster_run_id,
            "link": dagster.run_link(dagster_run_id),
            "status": dagster.status(dagster_run_id),
        }
        if dagster_run_id
        else None
    )
    return view
