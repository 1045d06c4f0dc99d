"""What the job answers after a run, or at any time.

The outcome checks ask that every record is in exactly one place and that every archive
file still matches its checksum. The report lists the archives. The lag is how long the
oldest record past retention has waited.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from qo_ops.db.schema import audit_archive_manifest, audit_record
from qo_ops.errors import one_line
from qo_ops.jobs.audit_archive.batch import ArchiveRun
from qo_ops.jobs.audit_archive.settings import retention_cutoff
from qo_ops.jobs.audit_archive.storage import resolve_path, sha256_or_none
from qo_ops.platform.job.outcome import BatchContext, OutcomeCheck, ReportRow
from qo_ops.platform.job.spec import CheckSpec
from qo_ops.platform.run.selection import seconds_or_none

# The VERIFIED archives of a window (by the day they hold), in file order. They are what
# counts as archived. Restore locks the same rows.
VERIFIED_MANIFESTS = (
    sa.select(audit_archive_manifest)
    .where(
        audit_archive_manifest.c.tenant_id == sa.bindparam("t"),
        audit_archive_manifest.c.status == "VERIFIED",
        audit_archive_manifest.c.window_start >= sa.bindparam("s"),
        audit_archive_manifest.c.window_start < sa.bindparam("e"),
    )
    .order_by(audit_archive_manifest.c.window_start, audit_archive_manifest.c.min_record_id)
)

# Where the window's records are. Some are still in the source. Some are in the source
# although a VERIFIED archive has them too, and there must be none of those. Some are in
# WRITTEN or FAILED archives, which never count.
_PLACES = sa.text(
    """
    SELECT (SELECT count(*) FROM audit_record WHERE tenant_id = :t
              AND occurred_at >= :s AND occurred_at < :e) AS remaining,
           -- per archive, the source rows of its own day and id range (an index
           -- range each), however many days the window spans
           (SELECT coalesce(sum(n.rows), 0) FROM audit_archive_manifest m
              CROSS JOIN LATERAL (
                  SELECT count(*) AS rows FROM audit_record r
                   WHERE r.tenant_id = m.tenant_id
                     AND r.occurred_at >= m.window_start AND r.occurred_at < m.window_end
                     AND r.id BETWEEN m.min_record_id AND m.max_record_id) n
            WHERE m.tenant_id = :t AND m.status = 'VERIFIED'
              AND m.window_start >= :s AND m.window_start < :e) AS both_places,
           (SELECT count(*) FROM audit_archive_manifest WHERE tenant_id = :t
              AND status IN ('WRITTEN', 'FAILED')
              AND window_start >= :s AND window_start < :e) AS not_counted
    """
)


# Each check is declared once. Its results in check_archive carry the same description.
ACCOUNTS_FOR_EVERY_RECORD = CheckSpec(
    "archive_accounts_for_every_record",
    "Archived (VERIFIED) + remaining records = the records of the window; none in both",
)
ARCHIVES_VERIFY = CheckSpec(
    "archives_verify", "Every VERIFIED archive file still matches its manifest checksum"
)


def check_archive(conn: Connection, ctx: BatchContext) -> list[OutcomeCheck]:
    """Check that every record of the window is in exactly one place and every file verifies."""
    scope = ctx.scope
    start, end = scope.window_bounds()
    window = {"t": scope.tenant_id, "s": start, "e": end}
    manifests = list(conn.execute(VERIFIED_MANIFESTS, window).all())
    row = conn.execute(_PLACES, window).one()
    archived = sum(m.row_count for m in manifests)
    malformed = sum(
        1
        for m in manifests
        if m.row_count < 1 or m.max_record_id - m.min_record_id + 1 < m.row_count
    )
    baseline = ctx.run_state(ArchiveRun).baseline
    total = int(row.remaining) + archived
    accounts = row.both_places == 0 and malformed == 0 and (baseline is None or total == baseline)

    mismatched: list[str] = []
    for m in manifests:
        if sha256_or_none(resolve_path(m.file_path)) != m.sha256:
            mismatched.append(str(m.id))
    return [
        ACCOUNTS_FOR_EVERY_RECORD.result(
            accounts,
            {
                "remaining_records": int(row.remaining),
                "archived_records": archived,
                "verified_archives": len(manifests),
                "records_at_run_start": baseline,
                "records_in_both_places": int(row.both_places),
                "malformed_manifests": malformed,
                "unverified_archives": int(row.not_counted),
            },
        ),
        ARCHIVES_VERIFY.result(
            not mismatched,
            {
                "files_checked": len(manifests),
                "files_mismatched": len(mismatched),
                "mismatched_manifests": ", ".join(mismatched[:10]) or "none",
            },
        ),
    ]


# The files, records and checksums of the archives a run wrote or adopted, per day and status.
_RUN_ARCHIVES = sa.text(
    """
    SELECT (window_start AT TIME ZONE 'UTC')::date AS day, status, count(*) AS files,
           sum(row_count) AS records, string_agg(left(sha256, 12), ' ' ORDER BY min_record_id) AS sums
      FROM audit_archive_manifest
     WHERE job_run_id = :run
     GROUP BY 1, 2
     ORDER BY 1, 2
    """
)


def report_archive(conn: Connection, ctx: BatchContext) -> list[ReportRow]:
    """Report, per day and manifest status, the archive files this run wrote or adopted.

    Each row gives their records and checksums (the first 12 hex digits).
    """
    return [
        ReportRow(
            "archived" if r.status == "VERIFIED" else r.status.lower(),
            r.day.isoformat(),
            int(r.records),
            one_line(f"{r.files} file(s), sha256 {r.sums}", 160),
        )
        for r in conn.execute(_RUN_ARCHIVES, {"run": ctx.job_run_id})
    ]


def overdue_seconds(conn: Connection, ctx: BatchContext) -> float | None:
    """Return how long the oldest eligible record of the window has been past retention."""
    start, end = ctx.scope.window_bounds()
    oldest = conn.execute(
        sa.select(sa.func.min(audit_record.c.occurred_at)).where(
            audit_record.c.tenant_id == ctx.scope.tenant_id,
            audit_record.c.occurred_at >= start,
            audit_record.c.occurred_at < end,
            audit_record.c.occurred_at < retention_cutoff(ctx),
        )
    ).scalar()
    if oldest is None:
        return None
    value = conn.execute(
        sa.select(sa.func.extract("epoch", retention_cutoff(ctx) - sa.literal(oldest)))
    ).scalar()
    return seconds_or_none(value)
