"""How the API refuses: :class:`ApiError` carries a status and one safe line, and every
refusal reaches the caller as ``{"error": "...", "requestId": "..."}`` (``refusals`` is that
contract as the OpenAPI document shows it, per operation)."""

# (no `from __future__ import annotations`: FastAPI reads these annotations at runtime)

from typing import Any

from pydantic import BaseModel

from qo_ops.errors import one_line


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


# Every refusal the API can answer, with what it means. Each operation documents the ones
# it can answer (``refusals``), so that the OpenAPI document lists exactly those.
REFUSALS: dict[int, str] = {
    400: "The body is not UTF-8 text.",
    401: "No, unknown, expired or revoked bearer token.",
    403: "The token's role or tenant does not allow this.",
    404: "No such job in the catalog, or no such run of this job.",
    409: "The run's state does not allow this (named in activeRunId when a run is active).",
    411: "A POST without Content-Length.",
    413: "A body larger than 16,384 bytes, or of unknown length.",
    422: "Malformed body, path or query, out-of-range limits, an unknown tenant or an unsafe "
    "scope.",
    423: "The job is suspended for this scope (the kill switch): nothing accepted.",
    429: "Over the identity's rate limit (see Retry-After).",
    500: "An unexpected failure: one line, never a traceback (the log has its class).",
    503: "Dagster or the database could not be reached.",
}

# What any authenticated request may meet, whatever it asks: its token, its size, its rate,
# a failure, the database.
ANY_REQUEST = (401, 413, 429, 500, 503)
# ... and one with a JSON body
WITH_BODY = (400, 411, 422)


# The headers a refusal carries
_HEADERS: dict[int, dict[str, str]] = {
    401: {"WWW-Authenticate": "Bearer: the scheme a token is presented with."},
    429: {"Retry-After": "Seconds to wait before the next request."},
}


def refusals(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI ``responses`` of an operation that can refuse with ``codes`` besides
    ``ANY_REQUEST``: each with the one-line error body (and its header, if it has one)."""
    out: dict[int | str, dict[str, Any]] = {}
    for code in sorted({*ANY_REQUEST, *codes}):
        out[code] = {"model": ErrorBody, "description": REFUSALS[code]}
        if code in _HEADERS:
            out[code]["headers"] = {
                name: {"description": text, "schema": {"type": "string"}}
                for name, text in _HEADERS[code].items()
            }
    return out
