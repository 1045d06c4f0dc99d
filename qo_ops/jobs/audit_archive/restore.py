"""``restore`` (``qo-ops archive restore``) puts a tenant-day's VERIFIED archives back into
``audit_record`` with their ids, and makes the manifests WRITTEN again. This takes S3 back
to S2 in one transaction. The package's docstring describes the states."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import date, timedelta

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from qo_ops.db import audit
from qo_ops.errors import BadInput
from qo_ops.jobs.audit_archive.checks import VERIFIED_MANIFESTS
from qo_ops.jobs.audit_archive.errors import ArchiveError
from qo_ops.jobs.audit_archive.format import read_rows
from qo_ops.jobs.audit_archive.settings import JOB_NAME
from qo_ops.jobs.audit_archive.storage import resolve_path
from qo_ops.platform.job.scope import Scope
from qo_ops.platform.schedule.tenants import tenant_exists


@dataclass(frozen=True)
class RestoreResult:
    """What ``restore`` did for one tenant-day."""

    tenant_id: str
    day: date
    archives: int
    archived_rows: int
    restored_rows: int

    @property
    def already_present(self) -> int:
        """Archived rows that were in the source already, for example restored before."""
        return self.archived_rows - self.restored_rows


# The VERIFIED archives of the day, locked until the restore commits. The archives of one
# day all start at its midnight, so they are ordered by min_record_id.
_LOCK_VERIFIED = VERIFIED_MANIFESTS.with_for_update()

# One archive's rows back into the source, with their own ids.
# Twice: ON CONFLICT (id) DO NOTHING skips a row already there (restored before, or never
# deleted). RETURNING counts only the rows this statement put back.
_RESTORE_ROWS = sa.text(
    """
    INSERT INTO audit_record (id, tenant_id, occurred_at, actor_ref, action, entity_type,
                              entity_id, details)
    SELECT u.id, u.tenant_id, u.occurred_at, u.actor_ref, u.action, u.entity_type, u.entity_id,
           CAST(u.details AS jsonb)
      FROM unnest(CAST(:ids AS bigint[]), CAST(:tenants AS text[]), CAST(:occurred AS timestamptz[]),
                  CAST(:actors AS text[]), CAST(:actions AS text[]), CAST(:etypes AS text[]),
                  CAST(:eids AS text[]), CAST(:details AS text[]))
           AS u(id, tenant_id, occurred_at, actor_ref, action, entity_type, entity_id, details)
    ON CONFLICT (id) DO NOTHING
    RETURNING id
    """
)

# The archive is a copy again, because its rows are in the source. It becomes WRITTEN, and
# no one counts it as archived until an archive run re-verifies it.
# Twice: a second restore locks only VERIFIED manifests, so it never reaches this one again.
_REOPEN_MANIFEST = sa.text(
    "UPDATE audit_archive_manifest SET status = 'WRITTEN', verified_at = NULL WHERE id = :id"
)


def restore_day(
    engine: Engine,
    tenant_id: str,
    day: date,
    *,
    actor: str = "unknown",
    reason: str | None = None,
) -> RestoreResult:
    """Put every VERIFIED archive of (tenant, day) back into ``audit_record``, same ids.

    It all happens in one transaction. First, every file is checked against its manifest.
    A file that does not match aborts the restore, and nothing changes. Then the rows go
    back with ``ON CONFLICT (id) DO NOTHING``. The manifests become WRITTEN, since the source
    is intact and the file is a copy. So a record is never counted both as remaining and as
    archived. A second restore finds nothing to do.
    """
    scope = Scope(tenant_id, day, day + timedelta(days=1))  # this validates the tenant key
    start, end = scope.window_bounds()
    with engine.begin() as conn:
        if not tenant_exists(conn, tenant_id):
            raise BadInput(f"unknown tenant {tenant_id}")
        manifests = conn.execute(_LOCK_VERIFIED, {"t": tenant_id, "s": start, "e": end}).all()
        archived = restored = 0
        for m in manifests:
            path = resolve_path(m.file_path)
            try:
                data = path.read_bytes()
            except OSError as exc:
                raise ArchiveError(
                    f"archive {m.id} of {tenant_id} {day}: cannot read {m.file_path} "
                    f"({type(exc).__name__}); nothing restored"
                ) from None
            if hashlib.sha256(data).hexdigest() != m.sha256:
                raise ArchiveError(
                    f"archive {m.id} of {tenant_id} {day}: file does not match its manifest "
                    "checksum; nothing restored"
                )
            rows = read_rows(data)
            if len(rows) != m.row_count or any(r[1] != tenant_id for r in rows):
                raise ArchiveError(
                    f"archive {m.id} of {tenant_id} {day}: rows do not match the manifest; "
                    "nothing restored"
                )
            columns = list(zip(*rows, strict=True))
            back = conn.execute(
                _RESTORE_ROWS,
                {
                    "ids": list(columns[0]),
                    "tenants": list(columns[1]),
                    "occurred": list(columns[2]),
                    "actors": list(columns[3]),
                    "actions": list(columns[4]),
                    "etypes": list(columns[5]),
                    "eids": list(columns[6]),
                    "details": list(columns[7]),
                },
            ).all()
            archived += len(rows)
            restored += len(back)
            conn.execute(_REOPEN_MANIFEST, {"id": m.id})
        audit.append_audit(
            conn,
            audit.AuditEntry(
                actor=actor,
                action="archive_restore",
                decision="allowed",
                job_name=JOB_NAME,
                scope=scope.key,
                reason=reason,
                details={"archives": len(manifests), "restored_rows": restored},
            ),
        )
    return RestoreResult(tenant_id, day, len(manifests), archived, restored)
