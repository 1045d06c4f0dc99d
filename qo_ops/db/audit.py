"""The audit trail (``job_audit``): who did what to which job, scope and run, and why.
Append-only; every operator action, every run with a person behind it and every schema
upgrade writes its row in the transaction of what it records."""

from __future__ import annotations

import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from qo_ops.db.schema import job_audit


@dataclass(frozen=True)
class AuditEntry:
    """One row of the audit trail: who (``actor``) did what (``action``) to which job, scope
    and run, what was decided and why; ``request_id`` and ``client_address`` say where an
    API request came from."""

    actor: str
    action: str
    decision: str
    job_name: str | None = None
    scope: str | None = None
    mode: str | None = None
    reason: str | None = None
    correlation_id: str | None = None
    job_run_id: uuid.UUID | None = None
    details: dict[str, Any] = field(default_factory=dict)
    request_id: str | None = None
    client_address: str | None = None


# Twice: the trail is append-only; a second call records a second decision (a retried
# request is one), and a rolled-back transaction takes its row with it.
_APPEND_AUDIT = sa.insert(job_audit)


def append_audit(conn: Connection, entry: AuditEntry) -> None:
    """Append ``entry`` to the append-only audit trail, in the caller's transaction."""
    conn.execute(_APPEND_AUDIT, asdict(entry))
