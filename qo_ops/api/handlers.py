"""What wraps every request: its id, the body-size rule and one JSON log line
(:func:`request_context`), and how each kind of failure becomes one line of JSON — audited
when it is a refusal of the request (``422``)."""

# (no `from __future__ import annotations`: FastAPI reads these annotations at runtime)

import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DBAPIError
from starlette.exceptions import HTTPException as StarletteHTTPException

from qo_ops.api import service
from qo_ops.api.deps import api_state, auditor, principal, request_meta
from qo_ops.api.errors import ApiError
from qo_ops.api.models import SAFE_ID
from qo_ops.errors import one_line
from qo_ops.platform.observability.events import log_event

log = logging.getLogger("qo_ops.api")

_SAFE_ID = re.compile(SAFE_ID)
MAX_BODY_BYTES = 16_384


async def request_context(
    request: Request, call_next: Callable[[Request], Awaitable[Response]]
) -> Response:
    """Give the request its id (the caller's ``X-Request-Id`` if safe), refuse bodies too
    large or of unknown length, turn any unexpected exception into ``500 internal error``,
    and log one line: never the query string or headers."""
    given = request.headers.get("x-request-id", "")
    request_id = given if _SAFE_ID.match(given) else str(uuid.uuid4())
    client = request.client.host if request.client else None
    request.state.meta = service.RequestMeta(request_id, client)
    started = time.monotonic()
    length = request.headers.get("content-length", "0")
    try:
        if not length.isdigit() or int(length) > MAX_BODY_BYTES:
            response: Response = JSONResponse(
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
        log_event(log, logging.ERROR, "api.error", request_id=request_id, error=type(exc).__name__)
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


async def api_error(request: Request, exc: ApiError) -> JSONResponse:
    """A refusal raised by a dependency or handler; a ``422`` or ``404`` not audited yet (a
    catalog rule the handler applied, a job or run the path names that does not exist) is
    audited here."""
    if exc.status in (404, 422) and not exc.audited:
        auditor(request).invalid(request, exc.message)
    body: dict[str, Any] = {"error": exc.message, "requestId": request_meta(request).request_id}
    if exc.active_run:
        body["activeRunId"] = exc.active_run
    return JSONResponse(body, status_code=exc.status, headers=exc.headers)


async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
    """A body, path, query or header that fails its schema: ``422`` with the first error's
    place and text (never the value), audited."""
    if (refused := await _unauthenticated(request)) is not None:
        return refused
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or "body"
    message = one_line(f"{where}: {first.get('msg', 'invalid')}", 300)
    auditor(request).invalid(request, message)
    return JSONResponse(
        {"error": message, "requestId": request_meta(request).request_id}, status_code=422
    )


async def _unauthenticated(request: Request) -> JSONResponse | None:
    """A body that cannot be parsed fails before authentication: authenticate first, so that
    a caller without a valid token learns nothing more than ``401`` (or ``429``)."""
    if getattr(request.state, "principal", None) is not None:
        return None
    try:
        principal(request, api_state(request), auditor(request))
    except ApiError as refused:
        return await api_error(request, refused)
    return None


async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """No such route (``404``) or method (``405``), or a body that is not UTF-8 (``400``,
    after authentication), in the same one-line shape."""
    if exc.status_code == 400 and (refused := await _unauthenticated(request)) is not None:
        return refused
    message = {
        400: "the body is not UTF-8",
        404: "not found",
        405: "method not allowed",
    }.get(exc.status_code, "refused")
    return JSONResponse(
        {"error": message, "requestId": request_meta(request).request_id},
        status_code=exc.status_code,
        headers=getattr(exc, "headers", None),
    )


async def database_down(request: Request, exc: DBAPIError) -> JSONResponse:
    """The database could not answer: ``503``, and only the driver error's class is logged."""
    log_event(log, logging.ERROR, "api.database_error", error=type(exc.orig).__name__)
    return JSONResponse(
        {"error": "database unavailable", "requestId": request_meta(request).request_id},
        status_code=503,
    )
