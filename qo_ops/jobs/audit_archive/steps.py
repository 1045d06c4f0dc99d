"""The job's batch, in the runner's steps.

- **eligible** selects the records past retention.
- **transition** is the select. It copies the locked records out and cuts them into per-day
  chunks.
- **external** writes each file and its WRITTEN manifest, reads the file back, and sweeps
  orphans.
- **record** deletes the source rows and compares what was deleted with the file, in one
  transaction. The chunk ends VERIFIED and deleted, or rolled back and FAILED.

The package's docstring describes the states a chunk goes through.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Sequence
from datetime import UTC, date, datetime, timedelta
from datetime import time as dtime
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from qo_ops.db.schema import audit_record
from qo_ops.errors import one_line
from qo_ops.jobs.audit_archive.batch import ArchiveRun, Chunk, FileResult, Work
from qo_ops.jobs.audit_archive.errors import (
    VERIFICATION_FAILED,
    ArchiveError,
    ArchiveVerificationFailed,
)
from qo_ops.jobs.audit_archive.format import (
    COPY_CLAIMED,
    DELETE_DIGESTED,
    copy_batch,
    copy_claimed,
    load_arrow,
    parquet_bytes,
    read_table,
    same_text,
    table_digests,
)
from qo_ops.jobs.audit_archive.settings import retention_cutoff
from qo_ops.jobs.audit_archive.storage import (
    relative_path,
    resolve_path,
    sha256_or_none,
    sweep_orphans,
    write_file,
)
from qo_ops.platform.job.outcome import BatchContext, BatchOutcome, SideEffectResult
from qo_ops.platform.job.scope import Scope
from qo_ops.platform.run.faults import crash_point
from qo_ops.platform.run.lease import LeaseLost
from qo_ops.platform.run.selection import after_position, with_selection

if TYPE_CHECKING:  # pyarrow is loaded by the functions that use it, never on import
    import pyarrow as pa

SIDE_EFFECT = "archive_file"  # one archive file written (job_side_effects_total)

ARCHIVE_CRASH_POINTS = (
    "archive_before_file_rename",
    "archive_after_file_written",
    "archive_after_manifest_written",
    "archive_before_delete_commit",
    "archive_after_delete_commit",
)


def _day_bounds(day: date) -> tuple[datetime, datetime]:
    start = datetime.combine(day, dtime(), UTC)
    return start, start + timedelta(days=1)


# ------------------------------------------------------------------------ eligible


def _day_expr() -> sa.ColumnElement[Any]:
    """Return a record's UTC day, as the index ix_audit_record_tenant_day_id has it."""
    return sa.cast(sa.func.timezone("UTC", audit_record.c.occurred_at), sa.Date)


def _days_of(start: datetime, end: datetime) -> tuple[date, date]:
    """Return the UTC days [first, after) that the window [start, end) touches."""
    first, last = start.astimezone(UTC), (end - timedelta(microseconds=1)).astimezone(UTC)
    return first.date(), last.date() + timedelta(days=1)


def archivable_records(ctx: BatchContext) -> sa.Select[Any]:
    """Select the tenant's records of the window past retention, by UTC day, then id.

    That is the order of ix_audit_record_tenant_day_id, so a batch reads its rows off the
    index and never sorts what is left of the window. The day bounds only let the index
    bound the scan.
    """
    if ctx.mode == "execute":  # Counted before the first batch. Arrow loads here, not in
        load_arrow()  # a batch that holds row locks. A dry run never loads it.
    start, end = ctx.scope.window_bounds()
    first_day, after_day = _days_of(start, end)
    query = (
        sa.select(audit_record.c.id)
        .where(
            audit_record.c.tenant_id == ctx.scope.tenant_id,
            _day_expr() >= first_day,
            _day_expr() < after_day,
            audit_record.c.occurred_at >= start,
            audit_record.c.occurred_at < end,
            audit_record.c.occurred_at < retention_cutoff(ctx),
        )
        .order_by(_day_expr(), audit_record.c.id)
    )
    # Within a run, start after the previous batch's last record, not through the index
    # entries of every record the run has deleted. The runner makes one last pass from the start.
    return after_position(query, (_day_expr(), audit_record.c.id), ctx.position, ("day", "id"))


# ------------------------------------------------------------------------ transition (select)

# Records of the window that exist, in the source or in a VERIFIED archive.
_BASELINE = sa.text(
    """
    SELECT (SELECT count(*) FROM audit_record WHERE tenant_id = :t
              AND occurred_at >= :s AND occurred_at < :e)
         + (SELECT coalesce(sum(row_count), 0) FROM audit_archive_manifest
             WHERE tenant_id = :t AND status = 'VERIFIED'
               AND window_start >= :s AND window_start < :e)
    """
)


def _baseline(conn: Connection, scope: Scope) -> int:
    start, end = scope.window_bounds()
    return int(conn.execute(_BASELINE, {"t": scope.tenant_id, "s": start, "e": end}).scalar_one())


# Lock the WRITTEN manifests of earlier runs over the chunk's day that overlap its id range.
# One of exactly the chunk's shape is adopted, and any other is retired.
_STALE_WRITTEN = sa.text(
    """
    SELECT id, window_start, window_end, file_path, row_count, min_record_id, max_record_id, sha256
      FROM audit_archive_manifest
     WHERE tenant_id = :t AND status = 'WRITTEN' AND window_start = :ws
       AND min_record_id <= :hi AND max_record_id >= :lo
       AND job_run_id IS DISTINCT FROM :run
     ORDER BY min_record_id
       FOR UPDATE
    """
)

# Retire stale WRITTEN manifests. Their files are removed after this commits.
# Twice: a manifest already retired, or no longer WRITTEN, matches nothing.
_RETIRE_WRITTEN = sa.text(
    """
    DELETE FROM audit_archive_manifest
     WHERE id = ANY(CAST(:ids AS uuid[])) AND status = 'WRITTEN'
    RETURNING file_path
    """
)

# The run's fencing token, which the manifest insert must still find on the lease.
_FENCING_TOKEN = sa.text("SELECT fencing_token FROM job_run WHERE id = :id")


def select_chunks(conn: Connection, ctx: BatchContext, ids: Sequence[Any]) -> BatchOutcome:
    """Read the selected (locked) records and cut them into per-day chunks."""
    _before_copy(conn, ctx)
    return _chunked(conn, ctx, copy_batch(conn, [int(i) for i in ids], ctx.scope.tenant_id))


def claim_chunks(conn: Connection, ctx: BatchContext, selection: sa.Select[Any]) -> BatchOutcome:
    """Lock the batch's records and read them in one statement (``format.COPY_CLAIMED``),
    then cut them into per-day chunks, as ``select_chunks`` does for selected ids."""
    _before_copy(conn, ctx)
    statement, params = with_selection(COPY_CLAIMED, selection)
    table = copy_claimed(conn, statement, {**params, "t": ctx.scope.tenant_id})
    if table is None:
        return BatchOutcome()  # nothing selected, nothing written
    outcome = _chunked(conn, ctx, table)
    outcome.processed = table.num_rows
    return outcome


def _before_copy(conn: Connection, ctx: BatchContext) -> None:
    """Stop at a failed verification; count the window's records at the first batch."""
    run = ctx.run_state(ArchiveRun)
    if run.failure:  # a file failed verification, so stop as a job's own stop
        raise ArchiveVerificationFailed(run.failure)
    if run.baseline is None:
        run.baseline = _baseline(conn, ctx.scope)


def _chunked(conn: Connection, ctx: BatchContext, table: pa.Table) -> BatchOutcome:
    """Cut the copied records (sorted by day, then id) into per-day chunks, adopting or
    retiring the WRITTEN manifests of earlier runs over them."""
    import pyarrow.compute as pc

    cutoff = conn.execute(sa.select(retention_cutoff(ctx))).scalar_one()  # this txn's now()
    chunks = []
    offset = 0
    for day_value in pc.unique(table.column("day")):  # in order, since the table is sorted by day
        count = pc.sum(pc.equal(table.column("day"), day_value)).as_py()
        day_table = table.slice(offset, count).drop_columns(["day"])
        offset += count
        day = date.fromisoformat(day_value.as_py())
        day_start, day_end = _day_bounds(day)
        day_ids = day_table.column("id")
        lo, hi = day_ids[0].as_py(), day_ids[-1].as_py()
        day_rows = day_table  # its len() is its row count
        stale = conn.execute(
            _STALE_WRITTEN,
            {"t": ctx.scope.tenant_id, "ws": day_start, "lo": lo, "hi": hi, "run": ctx.job_run_id},
        ).all()
        adopt = next(
            (
                m
                for m in stale
                if (m.min_record_id, m.max_record_id, m.row_count) == (lo, hi, day_rows.num_rows)
            ),
            None,
        )
        retire = [m.id for m in stale if m is not adopt]
        retired = (
            list(conn.execute(_RETIRE_WRITTEN, {"ids": [str(i) for i in retire]}).scalars())
            if retire
            else []
        )
        if adopt is not None:
            chunks.append(
                Chunk(
                    adopt.id,
                    ctx.scope.tenant_id,
                    day,
                    adopt.window_start,
                    adopt.window_end,
                    adopt.file_path,
                    adopt.row_count,
                    adopt.min_record_id,
                    adopt.max_record_id,
                    table=None,
                    sha256=adopt.sha256,
                    retired=retired,
                    adopted=True,
                )
            )
            continue
        manifest_id = uuid.uuid4()
        chunks.append(
            Chunk(
                manifest_id,
                ctx.scope.tenant_id,
                day,
                day_start,
                min(day_end, cutoff),
                relative_path(ctx.scope.tenant_id, day, manifest_id),
                day_rows.num_rows,
                lo,
                hi,
                table=day_rows,
                retired=retired,
            )
        )
    fence = conn.execute(_FENCING_TOKEN, {"id": ctx.job_run_id}).scalar()
    work = Work(
        engine=conn.engine,
        job_name=ctx.job_name,
        scope_key=ctx.scope.key,
        job_run_id=ctx.job_run_id,
        fencing_token=fence,
        min_file_age_s=ctx.limits.lease_ttl_s,
        chunks=chunks,
    )
    last = chunks[-1]  # the next claim starts after it, by day then id (the runner pipelines)
    return BatchOutcome(work=[work], position={"day": last.day, "id": last.max_id})


# ------------------------------------------------------------------------ external (files)

# Fenced, so a manifest is written only while this run's lease is current.
# Twice: a rerun never writes one again for the same chunk. It adopts this WRITTEN manifest
# (same chunk) or retires it (another shape). A run that lost its lease inserts nothing.
_INSERT_WRITTEN = sa.text(
    """
    INSERT INTO audit_archive_manifest (id, tenant_id, window_start, window_end, file_path,
                                        row_count, min_record_id, max_record_id, sha256, status,
                                        job_run_id)
    SELECT :id, :tenant, :ws, :we, :path, :rows, :lo, :hi, :sha, 'WRITTEN', :run
     WHERE EXISTS (SELECT 1 FROM job_lease WHERE job_name = :job AND scope = :scope
                     AND fencing_token = :fence AND expires_at > clock_timestamp())
    RETURNING id
    """
)


def _insert_written(work: Work, chunk: Chunk, sha: str) -> None:
    with work.engine.begin() as conn:
        inserted = conn.execute(
            _INSERT_WRITTEN,
            {
                "id": chunk.manifest_id,
                "tenant": chunk.tenant_id,
                "ws": chunk.window_start,
                "we": chunk.window_end,
                "path": chunk.file_path,
                "rows": chunk.row_count,
                "lo": chunk.min_id,
                "hi": chunk.max_id,
                "sha": sha,
                "run": work.job_run_id,
                "job": work.job_name,
                "scope": work.scope_key,
                "fence": work.fencing_token,
            },
        ).first()
    if inserted is None:
        raise LeaseLost(f"lease on {work.job_name}/{work.scope_key} lost before the manifest")


def _micros(moment: datetime) -> int:
    """Return a zoned moment as µs since the epoch, as an archive's occurred_at holds it."""
    return (moment - _EPOCH) // timedelta(microseconds=1)


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def verify_file(chunk: Chunk, sha: str) -> FileResult:
    """Read the file back and check its checksum, format, row count, id range, tenant, window."""
    import pyarrow as pa
    import pyarrow.compute as pc

    path = resolve_path(chunk.file_path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        return FileResult(chunk, False, f"unreadable: {type(exc).__name__}")
    if hashlib.sha256(data).hexdigest() != sha:
        return FileResult(chunk, False, "sha256 differs from the manifest")
    try:
        table = read_table(data, use_threads=False)
    except Exception as exc:  # any parse error is a failed verification
        return FileResult(chunk, False, f"unreadable parquet: {type(exc).__name__}")
    ids = table.column("id")
    n = table.num_rows
    problems = []
    if n != chunk.row_count:
        problems.append(f"{n} rows, manifest says {chunk.row_count}")
    if n and (ids[0].as_py(), ids[-1].as_py()) != (chunk.min_id, chunk.max_id):
        problems.append("id range differs from the manifest")
    if n > 1 and not pc.all(pc.greater(ids.slice(1), ids.slice(0, n - 1))).as_py():
        problems.append("ids not strictly ascending")
    if n and not same_text(table.column("tenant_id"), chunk.tenant_id):
        problems.append("rows of another tenant")
    occurred = pc.min_max(pc.cast(table.column("occurred_at"), pa.int64())).as_py()  # µs, UTC
    if n and not _micros(chunk.window_start) <= occurred["min"] <= occurred["max"] < _micros(
        chunk.window_end
    ):
        problems.append("rows outside the manifest window")
    if problems:
        return FileResult(chunk, False, "; ".join(problems))
    return FileResult(chunk, True, digests=table_digests(table))


def write_and_verify(ctx: BatchContext, work_items: list[Work]) -> list[FileResult]:
    """Write each chunk's file and WRITTEN manifest, then read the file back (no transaction)."""
    run = ctx.run_state(ArchiveRun)
    if run.deleted:  # the batch before's delete committed, and this is the next step
        run.deleted = False
        crash_point("archive_after_delete_commit")
    if run.failure:  # the batch before failed verification: write no file of this one
        raise ArchiveVerificationFailed(run.failure)
    results: list[FileResult] = []
    swept = run.swept_days
    for work in work_items:
        for chunk in work.chunks:
            for retired in chunk.retired:  # their manifest rows are gone, committed
                resolve_path(retired).unlink(missing_ok=True)
            if chunk.table is not None:
                rows, chunk.table = chunk.table, None  # the file holds them from here on
                data = parquet_bytes(
                    rows,
                    {
                        "manifest_id": str(chunk.manifest_id),
                        "tenant_id": chunk.tenant_id,
                        "window_start": chunk.window_start.isoformat(),
                        "window_end": chunk.window_end.isoformat(),
                    },
                )
                del rows
                chunk.sha256 = hashlib.sha256(data).hexdigest()
                try:
                    write_file(resolve_path(chunk.file_path), data)
                except OSError as exc:
                    raise ArchiveError(
                        f"cannot write archive file {chunk.file_path}: {one_line(str(exc), 200)}"
                    ) from None
                crash_point("archive_after_file_written")
                _insert_written(work, chunk, chunk.sha256)
                crash_point("archive_after_manifest_written")
            assert chunk.sha256 is not None
            result = verify_file(chunk, chunk.sha256)
            if chunk.day not in swept:  # orphans are earlier runs', swept once per day and run
                result.orphans_removed = sweep_orphans(work, chunk)
                swept.add(chunk.day)
            results.append(result)
    return results


# ------------------------------------------------------------------------ record (delete)

# Only a WRITTEN manifest becomes VERIFIED, in the transaction that deletes its rows.
# Twice: a manifest already VERIFIED (or FAILED) is not WRITTEN. Nothing is returned, so
# nothing is deleted.
_MARK_VERIFIED = sa.text(
    """
    UPDATE audit_archive_manifest SET status = 'VERIFIED', verified_at = clock_timestamp()
     WHERE id = :id AND status = 'WRITTEN'
    RETURNING id
    """
)

# Twice: a manifest already FAILED (or VERIFIED by another run) is not WRITTEN, so nothing changes.
_MARK_FAILED = sa.text(
    "UPDATE audit_archive_manifest SET status = 'FAILED' WHERE id = :id AND status = 'WRITTEN'"
)


def _delete_if_equal(conn: Connection, result: FileResult) -> str | None:
    """Mark the manifest VERIFIED and delete its source rows, under a savepoint.

    The savepoint is kept only if the deleted rows are exactly the file's (count, ids, every
    value). Otherwise it is rolled back. Return why not, None when done, or "taken over"
    when the manifest is no longer WRITTEN.
    """
    chunk = result.chunk
    assert result.digests is not None
    savepoint = conn.begin_nested()
    if conn.execute(_MARK_VERIFIED, {"id": chunk.manifest_id}).first() is None:
        savepoint.rollback()  # someone else resolved it meanwhile, so it is not ours to delete
        return "taken over"
    gone = conn.execute(
        DELETE_DIGESTED,
        {
            "t": chunk.tenant_id,
            "lo": chunk.min_id,
            "hi": chunk.max_id,
            "ws": chunk.window_start,
            "we": chunk.window_end,
        },
    ).one()
    reason = None
    if (gone.n, gone.ids) != (chunk.row_count, result.digests[0]):
        reason = "source ids differ from the file's"
    elif gone.rows != result.digests[1]:  # every value, exactly
        reason = "source rows differ from the file's"
    if reason is None:
        savepoint.commit()  # stands with the batch's commit
    else:
        savepoint.rollback()  # nothing is deleted, and the manifest is WRITTEN again
    return reason


def delete_verified(conn: Connection, ctx: BatchContext, results: list[FileResult]) -> BatchOutcome:
    """Settle the batch's chunks in one transaction.

    For a verified chunk, the manifest becomes VERIFIED and the source rows are deleted. The
    delete is kept only if the deleted rows equal the file's. Any other chunk's manifest
    becomes FAILED, and nothing is deleted.
    """
    outcome = BatchOutcome(tally={})

    def tally(key: str, n: int = 1) -> None:
        outcome.tally[key] = outcome.tally.get(key, 0) + n

    for result in results:
        chunk = result.chunk
        tally("archives_replaced", len(chunk.retired))
        if result.orphans_removed:
            tally("orphan_files_removed", result.orphans_removed)
        tally("archives_adopted" if chunk.adopted else "archives_written")
        if chunk.adopted:  # an earlier attempt wrote this file and did not get to delete
            outcome.side_effect(SIDE_EFFECT, SideEffectResult.DUPLICATE_PREVENTED)
        if result.ok and sha256_or_none(resolve_path(chunk.file_path)) != chunk.sha256:
            # check that the file is still the bytes that were verified, right before the delete
            result.ok, result.reason = False, "file changed after verification"
        if result.ok:
            why_not = _delete_if_equal(conn, result)
            if why_not == "taken over":
                outcome.skipped += chunk.row_count
                tally("archives_taken_over")
                continue
            if why_not is not None:
                result.ok, result.reason = False, why_not
        if result.ok:
            outcome.succeeded += chunk.row_count
            tally("archives_verified")
            if not chunk.adopted:
                outcome.side_effect(SIDE_EFFECT, SideEffectResult.SUCCESS)
        else:
            conn.execute(_MARK_FAILED, {"id": chunk.manifest_id})
            outcome.failed += chunk.row_count
            outcome.failed_items.append((str(chunk.manifest_id), VERIFICATION_FAILED))
            tally("archives_failed")
            if not chunk.adopted:
                outcome.side_effect(SIDE_EFFECT, SideEffectResult.FAILED)
            ctx.run_state(ArchiveRun).failure = (
                f"archive {chunk.manifest_id} ({chunk.tenant_id} {chunk.day}) failed "
                f"verification: {result.reason}; nothing of it was deleted"
            )
    outcome.tally = {k: v for k, v in outcome.tally.items() if v}
    crash_point("archive_before_delete_commit")
    ctx.run_state(ArchiveRun).deleted = outcome.succeeded > 0
    return outcome
