"""How the API refuses: :class:`ApiError` carries a status and one safe line, and every
refusal reaches the caller as ``{"error": "...", "requestId": "..."}`` (``ERRORS`` is that
contract as the OpenAPI document shows it)."""

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
