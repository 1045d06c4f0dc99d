"""audit_archive (tenant × day): audit records past retention are copied to Parquet files
with a checksum manifest, verified, and only then deleted from ``audit_record``.

The window is the UTC day the records *occurred* on; eligible are the tenant's records of
the window older than the retention (``QO_OPS_AUDIT_RETENTION_DAYS``, default 365 days).
Each archive file holds one tenant-day chunk of at most ``batch_size`` records (default
50,000), ordered by id, under ``QO_OPS_HOME/archive/<tenant>/<day>/<manifest id>.parquet``;
its columns are those of ``audit_record``, ``details`` as the JSON text PostgreSQL stores.

One batch of the runner is one chunk (or one per day when a window spans several days):

1. **select** (batch transaction 1, guarded by the lease): the next eligible ids of the
   day in id order, locked, and their rows copied out (``COPY … TO STDOUT`` as CSV, parsed
   by Arrow into the archive's columns). A chunk is therefore "every eligible
   record of (tenant, day) with an id in [min, max]", which is what its manifest states.
   A WRITTEN manifest left by an earlier run for exactly this chunk is adopted instead of
   writing a new file; one that overlaps the chunk differently is retired (row deleted
   here, file removed after commit).
2. **external** (no transaction open): write the file to ``<name>.tmp``, fsync, rename,
   fsync the directory; insert the manifest ``WRITTEN`` (its own committed transaction,
   fenced: only while this run's lease is current); read the file back and verify it:
   sha256 of its bytes equals the manifest's, it parses, its row count, id range, tenant
   and window match. Orphan files (no manifest row, older than the lease TTL by the
   database's clock) in the day's directory are removed, unless another run holds a lease
   over that day (:func:`_sweep_orphans`).
3. **record** (batch transaction 2, guarded): lock the source rows of the manifest's
   tenant, id range and window; they must be exactly the file's rows: PostgreSQL digests
   the locked rows' own values (``_SOURCE_DIGEST``) and Arrow the rows read back from the
   file (:func:`table_digests`), each on its own — ids, then every value. Then, in this
   one transaction, the manifest becomes ``VERIFIED``
   (``verified_at``) — conditionally, ``WHERE status = 'WRITTEN'`` — and exactly those rows
   are deleted. Any mismatch marks the manifest ``FAILED`` instead and deletes nothing;
   the run then stops with error code ``archive_verification_failed``.

States of one chunk, and where a crash (SIGKILL) anywhere leaves it::

    S0 source rows, no file, no manifest          crash before the rename: at most a .tmp file
    S1 source rows + complete file, no manifest    orphan file: swept by a later run, never counted
    S2 source rows + file + manifest WRITTEN       a rerun adopts it (same chunk) or retires it
    S3 manifest VERIFIED, source rows deleted      only reachable from S2 in ONE transaction
    SF source rows + file + manifest FAILED        verification failed; file kept as evidence

A record is therefore always in exactly one of two places: the source table, or the file of
a VERIFIED manifest (S3) — never neither (rows are deleted only in the transaction that
makes the manifest VERIFIED, after the rows locked by that very transaction were compared
with a file whose bytes match the manifest's checksum), never both (the same transaction
deletes them, and a second archive of the same rows could only be VERIFIED if those rows
were still in the source). WRITTEN and FAILED manifests never count as archived.

``restore`` (``qo-ops archive restore``) takes S3 back to S2 in one transaction: the rows of
every VERIFIED archive of the tenant-day are inserted with their ids (``ON CONFLICT (id) DO
NOTHING``) and the manifests become WRITTEN again, so nothing is counted twice; a later
archive run re-verifies and adopts those files.

No checkpoint: deleting a record removes it from the selection, so a rerun's selection is
exactly what is left. A FAILED chunk stays selectable, which is why a run stops at the first
verification failure instead of retrying the same rows in a loop.

Concurrency: one run per (job, scope) through the lease; runs of *overlapping* scopes (a
day, and a range containing it) take disjoint rows through ``SKIP LOCKED`` and every
destructive step re-checks under row locks and conditional updates, so the worst an overlap
can do is leave a manifest FAILED or retired — never lose or double-count a record.

Test-only fault injection, like the runner's: with ``QO_OPS_CRASH_AT`` set to one of
``ARCHIVE_CRASH_POINTS`` the process kills itself with SIGKILL at that point.
``archive_after_file_written`` (file renamed into place, no manifest),
``archive_after_manifest_written`` (WRITTEN committed, not verified),
``archive_before_delete_commit`` (delete + VERIFIED issued, not committed),
``archive_after_delete_commit`` (committed; fires as the next batch starts). The runner's own
``after_external_call`` is the point "verified, nothing deleted yet".
"""

from __future__ import annotations

import hashlib
import io
import os
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from datetime import time as dtime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from qo_ops.config import load_settings, whole_number
from qo_ops.db.schema import audit_archive_manifest, audit_record
from qo_ops.errors import BadInput, ConfigError, QoOpsError, one_line
from qo_ops.platform import runs
from qo_ops.platform.faults import crash_point
from qo_ops.platform.lease import LeaseLost
from qo_ops.platform.selection import seconds_or_none
from qo_ops.platform.spec import (
    BatchContext,
    BatchOutcome,
    CheckSpec,
    JobSpec,
    Limits,
    OutcomeCheck,
    ReportRow,
    RunResources,
    Scope,
    run_settings,
)
from qo_ops.platform.tenants import tenant_exists

JOB_NAME = "audit_archive"
RETENTION_ENV = "QO_OPS_AUDIT_RETENTION_DAYS"
DEFAULT_RETENTION_DAYS = 365
SIDE_EFFECT = "archive_file"  # writing one archive file (job_side_effects_total)
MAX_RETENTION_DAYS = 36_500
MAX_ROWS_PER_FILE = 50_000  # one file per batch: also bounds the memory a batch holds
ARCHIVE_DIR = "archive"  # under QO_OPS_HOME
VERIFICATION_FAILED = "archive_verification_failed"

ARCHIVE_CRASH_POINTS = (
    "archive_after_file_written",
    "archive_after_manifest_written",
    "archive_before_delete_commit",
    "archive_after_delete_commit",
)

# The file's columns: every column of audit_record, ``details`` as JSON text.
ARCHIVE_SCHEMA = pa.schema(
    [
        pa.field("id", pa.int64(), nullable=False),
        pa.field("tenant_id", pa.string(), nullable=False),
        pa.field("occurred_at", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("actor_ref", pa.string(), nullable=False),
        pa.field("action", pa.string(), nullable=False),
        pa.field("entity_type", pa.string(), nullable=False),
        pa.field("entity_id", pa.string(), nullable=False),
        pa.field("details", pa.string(), nullable=False),
    ]
)
COLUMNS = tuple(ARCHIVE_SCHEMA.names)
assert tuple(c.name for c in audit_record.columns) == COLUMNS, "archive columns drifted"

# Rows as the archive holds them (details as jsonb's own text form, which casts back exactly),
# copied out of PostgreSQL as CSV straight into Arrow columns (no Python object per value):
# occurred_at as ISO 8601 UTC with microseconds, which Arrow parses exactly.
_COPY_COLUMNS = (
    "id, tenant_id, to_char(occurred_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"'), "
    "actor_ref, action, entity_type, entity_id, details::text"
)
_DAY_COLUMN = "(occurred_at AT TIME ZONE 'UTC')::date::text"


class ArchiveError(QoOpsError):
    """An archive could not be written, verified or restored; nothing was deleted."""

    exit_code = 1
    error_code = "archive_error"


class ArchiveVerificationFailed(ArchiveError):
    """A file did not match its manifest or its source rows: the run stops."""

    error_code = VERIFICATION_FAILED


# ------------------------------------------------------------------------ settings, paths


class ArchiveConfigError(ConfigError):
    """An audit_archive setting in the environment is unusable; nothing was run."""

    error_code = "bad_config"


def retention_days(environ: Mapping[str, str] | None = None) -> int:
    """The retention in days (``QO_OPS_AUDIT_RETENTION_DAYS``, default 365, 1 to 36,500)."""
    return whole_number(
        RETENTION_ENV, DEFAULT_RETENTION_DAYS, 1, MAX_RETENTION_DAYS,
        unit="days", environ=environ, error=ArchiveConfigError,
    )  # fmt: skip


@dataclass(frozen=True)
class ArchiveSettings:
    """What an archive run works with, checked before it locks or writes anything."""

    retention_days: int
    archive_root: Path  # QO_OPS_HOME/archive: where the files go


def archive_settings(environ: Mapping[str, str] | None = None) -> ArchiveSettings:
    """The retention, and an archive directory this process can write (it, or the nearest
    directory above it that exists); :class:`ArchiveConfigError` names what is wrong."""
    env = os.environ if environ is None else environ
    days = retention_days(env)
    root = load_settings(dict(env)).home / ARCHIVE_DIR
    existing = next(p for p in (root, *root.parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ArchiveConfigError(
            f"archive files go to {root}, but {existing} is not a writable directory "
            "(check QO_OPS_HOME and its volume)"
        )
    return ArchiveSettings(days, root)


def _cutoff(ctx: BatchContext) -> sa.ColumnElement[Any]:
    """Records that occurred before this (database clock) are past the run's retention."""
    days = run_settings(ctx, archive_settings).retention_days
    return sa.func.now() - sa.cast(sa.literal(f"{days} days"), sa.Interval)


def archive_home() -> Path:
    """``QO_OPS_HOME``: manifests store file paths relative to it."""
    return load_settings().home


def relative_path(tenant_id: str, day: date, manifest_id: uuid.UUID) -> str:
    """Where a chunk's file lives, relative to ``QO_OPS_HOME``."""
    return f"{ARCHIVE_DIR}/{tenant_id}/{day.isoformat()}/{manifest_id}.parquet"


def resolve_path(file_path: str) -> Path:
    """The file of a manifest (relative paths are under ``QO_OPS_HOME``)."""
    path = Path(file_path)
    return path if path.is_absolute() else archive_home() / path


def _day_bounds(day: date) -> tuple[datetime, datetime]:
    start = datetime.combine(day, dtime(), UTC)
    return start, start + timedelta(days=1)


# ------------------------------------------------------------------------ file format


def copy_table(
    conn: Connection, where: str, params: dict[str, Any], *, by_day: bool = False
) -> pa.Table:
    """The ``audit_record`` rows matching ``where`` (psycopg ``%(name)s`` parameters) as an
    Arrow table of ``ARCHIVE_SCHEMA``, in id order (day, then id, with a trailing ``day``
    column when ``by_day``), through ``COPY … TO STDOUT`` in the caller's transaction."""
    columns = _COPY_COLUMNS + (f", {_DAY_COLUMN} AS day" if by_day else "")
    statement = (  # in index order; sorted by day here, not by a server sort that spills
        f"COPY (SELECT {columns} FROM audit_record WHERE {where} ORDER BY id) "
        "TO STDOUT WITH (FORMAT csv)"
    )
    raw = conn.connection.driver_connection
    assert raw is not None
    buffer = io.BytesIO()
    with raw.cursor() as cur, cur.copy(statement, params) as copy:
        for block in copy:
            buffer.write(block)
    schema = ARCHIVE_SCHEMA.append(pa.field("day", pa.string())) if by_day else ARCHIVE_SCHEMA
    buffer.seek(0)
    table = pacsv.read_csv(
        buffer,
        read_options=pacsv.ReadOptions(column_names=schema.names),
        parse_options=pacsv.ParseOptions(newlines_in_values=True),
        convert_options=pacsv.ConvertOptions(
            column_types={f.name: f.type for f in schema},
            strings_can_be_null=False,
            quoted_strings_can_be_null=False,
        ),
    )
    table = table.cast(schema)  # NOT NULL as in the table (none can be)
    return (
        table.sort_by([("day", "ascending"), ("id", "ascending")]) if by_day else table
    ).combine_chunks()


def parquet_bytes(table: pa.Table, metadata: dict[str, str]) -> bytes:
    """The archive file for ``table`` (``ARCHIVE_SCHEMA`` columns), as bytes."""
    schema = ARCHIVE_SCHEMA.with_metadata({f"qo_ops.{k}": v for k, v in metadata.items()})
    buffer = io.BytesIO()
    pq.write_table(table.select(list(COLUMNS)).cast(schema), buffer, compression="zstd")
    return buffer.getvalue()


def read_table(data: bytes) -> pa.Table:
    """An archive file's bytes as a table of ``ARCHIVE_SCHEMA`` (raises if unreadable)."""
    table = pq.read_table(pa.BufferReader(data))
    if tuple(table.column_names) != COLUMNS:
        raise ValueError(f"unexpected columns {table.column_names}")
    return table.cast(ARCHIVE_SCHEMA).combine_chunks()


# A digest of rows that PostgreSQL computes from its own values and Arrow from the file's,
# each on its own: the file is compared with the source rows without copying them out again.
# One line per row, in id order: id|epoch µs|then each text column as <bytes>:<text>, "|"
# between fields — length-prefixed, so no two different rows give the same line.
_TEXT_COLUMNS = ("tenant_id", "actor_ref", "action", "entity_type", "entity_id", "details")


def _sql_line() -> str:
    texts = [f"octet_length({c}) || ':' || {c}" for c in _TEXT_COLUMNS[:-1]]
    texts.append("octet_length(details::text) || ':' || details::text")
    fields = ["id::text", "(extract(epoch FROM occurred_at) * 1000000)::bigint::text", *texts]
    return " || '|' || ".join(fields) + " || E'\\n'"


_SOURCE_DIGEST = sa.text(
    f"""
    WITH locked AS (
        SELECT * FROM audit_record
         WHERE tenant_id = :t AND id BETWEEN :lo AND :hi
           AND occurred_at >= :ws AND occurred_at < :we
         ORDER BY id
           FOR UPDATE
    )
    SELECT count(*) AS n,
           encode(sha256(convert_to(coalesce(string_agg(id::text, ',' ORDER BY id), ''),
                                    'UTF8')), 'hex') AS ids,
           encode(sha256(convert_to(coalesce(string_agg({_sql_line()}, '' ORDER BY id), ''),
                                    'UTF8')), 'hex') AS rows
      FROM locked
    """
)


def _joined_sha256(pieces: pa.Array) -> str:
    """sha256 of the concatenation of a string array's values."""
    whole = pa.ListArray.from_arrays(pa.array([0, len(pieces)], pa.int32()), pieces)
    return hashlib.sha256(pc.binary_join(whole, "")[0].as_buffer()).hexdigest()


def table_digests(table: pa.Table) -> tuple[str, str]:
    """(ids digest, rows digest) of an archive table, as ``_SOURCE_DIGEST`` computes them."""
    ids = pc.cast(table.column("id"), pa.string()).combine_chunks()
    id_list = pa.ListArray.from_arrays(pa.array([0, len(ids)], pa.int32()), ids)
    ids_sha = hashlib.sha256(pc.binary_join(id_list, ",")[0].as_buffer()).hexdigest()
    micros = pc.cast(pc.cast(table.column("occurred_at"), pa.int64()), pa.string())
    texts = []
    for name in _TEXT_COLUMNS:
        col = table.column(name)
        length = pc.cast(pc.binary_length(col), pa.string())
        texts.append(pc.binary_join_element_wise(length, col, ":"))
    line = pc.binary_join_element_wise(ids, micros, *texts, "|")
    line = pc.binary_join_element_wise(line, pa.scalar(""), "\n")  # each line ends in \n
    return ids_sha, _joined_sha256(pa.chunked_array(line).combine_chunks())


def read_rows(data: bytes) -> list[tuple[Any, ...]]:
    """The rows of an archive file's bytes, in ``COLUMNS`` order (raises if unreadable)."""
    table = read_table(data)
    return list(zip(*(table.column(c).to_pylist() for c in COLUMNS), strict=True))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, data: bytes) -> None:
    """Durably put ``data`` at ``path``: temp name, fsync, rename, fsync the directory."""
    created = [p for p in (path.parent.parent, path.parent) if not p.exists()]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    for directory in created:  # new directory entries are durable too
        _fsync_dir(directory.parent)


def _sha256_or_none(path: Path) -> str | None:
    try:
        return sha256_of(path)
    except OSError:
        return None


def sha256_of(path: Path) -> str:
    """sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ------------------------------------------------------------------------ selection


def _day_expr() -> sa.ColumnElement[Any]:
    return sa.cast(sa.func.timezone("UTC", audit_record.c.occurred_at), sa.Date)


def archivable_records(ctx: BatchContext) -> sa.Select[Any]:
    """The tenant's records of the window past retention, by day, then id."""
    if ctx.state.pop("_archive_deleted", False):  # the previous batch's delete committed
        crash_point("archive_after_delete_commit")
    start, end = ctx.scope.window_bounds()
    query = sa.select(audit_record.c.id).where(
        audit_record.c.tenant_id == ctx.scope.tenant_id,
        audit_record.c.occurred_at >= start,
        audit_record.c.occurred_at < end,
        audit_record.c.occurred_at < _cutoff(ctx),
    )
    if end - start > timedelta(days=1):
        return query.order_by(_day_expr(), audit_record.c.id)
    return query.order_by(audit_record.c.id)


# ------------------------------------------------------------------------ one batch


@dataclass
class Chunk:
    """One file's worth: every eligible record of (tenant, day) with an id in [min, max]."""

    manifest_id: uuid.UUID
    tenant_id: str
    day: date
    window_start: datetime
    window_end: datetime
    file_path: str
    row_count: int
    min_id: int
    max_id: int
    table: pa.Table | None  # the records; None when adopting an existing WRITTEN manifest
    sha256: str | None = None  # known up front only when adopting
    retired: list[str] = field(default_factory=list)  # files of retired manifests
    adopted: bool = False  # a WRITTEN manifest of an earlier run, verified again


@dataclass
class Work:
    """What the selection hands the file phase."""

    engine: Engine
    job_name: str
    scope_key: str
    job_run_id: uuid.UUID
    fencing_token: int | None
    min_file_age_s: float
    chunks: list[Chunk]


@dataclass
class FileResult:
    """A chunk after the file phase: verified against its manifest, or why not."""

    chunk: Chunk
    ok: bool
    reason: str | None = None
    ids: list[int] = field(default_factory=list)  # the file's ids, in order
    digests: tuple[str, str] | None = None  # table_digests() of the file's rows
    orphans_removed: int = 0


def _baseline(conn: Connection, scope: Scope) -> int:
    """Records of the window that exist: in the source, or in a VERIFIED archive."""
    start, end = scope.window_bounds()
    return int(
        conn.execute(
            sa.text(
                """
                SELECT (SELECT count(*) FROM audit_record WHERE tenant_id = :t
                          AND occurred_at >= :s AND occurred_at < :e)
                     + (SELECT coalesce(sum(row_count), 0) FROM audit_archive_manifest
                         WHERE tenant_id = :t AND status = 'VERIFIED'
                           AND window_start >= :s AND window_start < :e)
                """
            ),
            {"t": scope.tenant_id, "s": start, "e": end},
        ).scalar_one()
    )


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


def select_chunks(conn: Connection, ctx: BatchContext, ids: Sequence[Any]) -> BatchOutcome:
    """Read the selected (locked) records and cut them into per-day chunks."""
    if ctx.state.get("archive_failure"):  # a file failed verification: stop, as a job's own stop
        raise ArchiveVerificationFailed(ctx.state["archive_failure"])
    if "archive_baseline" not in ctx.state:
        ctx.state["archive_baseline"] = _baseline(conn, ctx.scope)
    cutoff = conn.execute(sa.select(_cutoff(ctx))).scalar_one()  # now() of this transaction
    table = copy_table(
        conn,
        "id = ANY(%(ids)s) AND tenant_id = %(t)s",
        {"ids": [int(i) for i in ids], "t": ctx.scope.tenant_id},
        by_day=True,
    )
    chunks = []
    offset = 0
    for day_text in pc.unique(table.column("day")).to_pylist():  # in order: sorted by day
        count = pc.sum(pc.equal(table.column("day"), day_text)).as_py()
        day_table = table.slice(offset, count).drop_columns(["day"])
        offset += count
        day = date.fromisoformat(day_text)
        day_start, day_end = _day_bounds(day)
        day_ids = day_table.column("id")
        lo, hi = day_ids[0].as_py(), day_ids[-1].as_py()
        day_rows = day_table  # len() is its row count
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
            list(
                conn.execute(
                    sa.text(
                        "DELETE FROM audit_archive_manifest WHERE id = ANY(CAST(:ids AS uuid[])) "
                        "AND status = 'WRITTEN' RETURNING file_path"
                    ),
                    {"ids": [str(i) for i in retire]},
                ).scalars()
            )
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
    del table  # the chunks hold their slices
    fence = conn.execute(
        sa.text("SELECT fencing_token FROM job_run WHERE id = :id"), {"id": ctx.job_run_id}
    ).scalar()
    work = Work(
        engine=conn.engine,
        job_name=ctx.job_name,
        scope_key=ctx.scope.key,
        job_run_id=ctx.job_run_id,
        fencing_token=fence,
        min_file_age_s=ctx.limits.lease_ttl_s,
        chunks=chunks,
    )
    return BatchOutcome(work=[work])


# Fenced: a manifest is written only while this run's lease is current.
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


def verify_file(chunk: Chunk, sha: str) -> FileResult:
    """Read the file back: checksum, format, row count, id range, tenant, window."""
    path = resolve_path(chunk.file_path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        return FileResult(chunk, False, f"unreadable: {type(exc).__name__}")
    if hashlib.sha256(data).hexdigest() != sha:
        return FileResult(chunk, False, "sha256 differs from the manifest")
    try:
        table = read_table(data)
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
    if n and not pc.all(pc.equal(table.column("tenant_id"), chunk.tenant_id)).as_py():
        problems.append("rows of another tenant")
    occurred = table.column("occurred_at")
    if n and not (
        pc.min(occurred).as_py() >= chunk.window_start
        and pc.max(occurred).as_py() < chunk.window_end
    ):
        problems.append("rows outside the manifest window")
    if problems:
        return FileResult(chunk, False, "; ".join(problems))
    return FileResult(chunk, True, ids=ids.to_pylist(), digests=table_digests(table))


# How the sweep judges a day's directory: by the database's clock (never this process's),
# and whether another run holds a live lease of this job over a window containing the day.
_SWEEP_STATE = sa.text(
    """
    SELECT extract(epoch FROM clock_timestamp())::float8 AS now,
           EXISTS (SELECT 1 FROM job_lease l JOIN job_run r ON r.id = l.job_run_id
                    WHERE l.job_name = :job AND l.expires_at > clock_timestamp()
                      AND l.job_run_id <> :run AND split_part(l.scope, '/', 1) = :tenant
                      AND r.window_start <= :day AND r.window_end > :day) AS busy
    """
)


def _sweep_orphans(work: Work, chunk: Chunk) -> int:
    """Remove temp files and files without a manifest row from the chunk's day directory:
    only those older than the lease TTL by the database's clock, and none while another run
    holds a lease over that day (its newest file may not have its manifest yet).

    No decision here reads this process's clock: a host whose clock runs ahead would take
    a file another run has just written for an old one. Even so, a file swept before its
    manifest is committed makes that manifest fail verification: nothing leaves the source.
    """
    directory = resolve_path(chunk.file_path).parent
    if not directory.is_dir():
        return 0
    seen: list[tuple[Path, float]] = []
    for entry in directory.iterdir():
        if not (entry.name.endswith(".tmp") or entry.suffix == ".parquet"):
            continue  # not ours: leave it
        try:
            if entry.is_file():
                seen.append((entry, entry.stat().st_mtime))
        except FileNotFoundError:
            continue
    if not seen:
        return 0
    with work.engine.connect() as conn:
        state = conn.execute(
            _SWEEP_STATE,
            {"job": work.job_name, "run": work.job_run_id, "tenant": chunk.tenant_id,
             "day": chunk.day},
        ).one()  # fmt: skip
    if state.busy:
        return 0
    horizon = state.now - work.min_file_age_s
    candidates: dict[str, Path] = {}
    removed = 0
    for entry, mtime in seen:
        if mtime > horizon:
            continue
        if entry.name.endswith(".tmp"):
            entry.unlink(missing_ok=True)
            removed += 1
            continue
        try:
            candidates[str(uuid.UUID(entry.stem))] = entry
        except ValueError:
            continue  # not ours: leave it
    if candidates:
        with work.engine.connect() as conn:
            known = {
                str(i)
                for i in conn.execute(
                    sa.select(audit_archive_manifest.c.id).where(
                        audit_archive_manifest.c.id.in_([uuid.UUID(c) for c in candidates])
                    )
                ).scalars()
            }
        for key, path in candidates.items():
            if key not in known:
                path.unlink(missing_ok=True)
                removed += 1
    return removed


def write_and_verify(ctx: BatchContext, work_items: list[Any]) -> list[Any]:
    """Write each chunk's file and WRITTEN manifest, then read the file back (no transaction)."""
    results: list[FileResult] = []
    for work in work_items:
        assert isinstance(work, Work)
        for chunk in work.chunks:
            for retired in chunk.retired:  # their manifest rows are gone (committed)
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
                    _write_file(resolve_path(chunk.file_path), data)
                except OSError as exc:
                    raise ArchiveError(
                        f"cannot write archive file {chunk.file_path}: {one_line(str(exc), 200)}"
                    ) from None
                crash_point("archive_after_file_written")
                _insert_written(work, chunk, chunk.sha256)
                crash_point("archive_after_manifest_written")
            assert chunk.sha256 is not None
            result = verify_file(chunk, chunk.sha256)
            result.orphans_removed = _sweep_orphans(work, chunk)
            results.append(result)
    return results


def delete_verified(conn: Connection, ctx: BatchContext, results: list[Any]) -> BatchOutcome:
    """In one transaction per batch: verified chunks → manifest VERIFIED + source rows
    deleted; anything else → manifest FAILED, nothing deleted."""
    outcome = BatchOutcome(tally={})

    def tally(key: str, n: int = 1) -> None:
        outcome.tally[key] = outcome.tally.get(key, 0) + n

    for result in results:
        assert isinstance(result, FileResult)
        chunk = result.chunk
        tally("archives_replaced", len(chunk.retired))
        if result.orphans_removed:
            tally("orphan_files_removed", result.orphans_removed)
        tally("archives_adopted" if chunk.adopted else "archives_written")
        if chunk.adopted:  # an earlier attempt wrote this file and did not get to delete
            outcome.side_effect(SIDE_EFFECT, "duplicate_prevented")
        if result.ok:
            source = conn.execute(  # locked: nobody changes them until this commits
                _SOURCE_DIGEST,
                {
                    "t": chunk.tenant_id,
                    "lo": chunk.min_id,
                    "hi": chunk.max_id,
                    "ws": chunk.window_start,
                    "we": chunk.window_end,
                },
            ).one()
            assert result.digests is not None
            if (source.n, source.ids) != (len(result.ids), result.digests[0]):
                result.ok, result.reason = False, "source ids differ from the file's"
            elif source.rows != result.digests[1]:  # every value, exactly
                result.ok, result.reason = False, "source rows differ from the file's"
            elif _sha256_or_none(resolve_path(chunk.file_path)) != chunk.sha256:
                # the file is still the bytes that were verified, right before the delete
                result.ok, result.reason = False, "file changed after verification"
        ids = result.ids  # exactly the locked rows that equal the file's, when ok
        if result.ok:
            verified = conn.execute(
                sa.text(
                    "UPDATE audit_archive_manifest SET status = 'VERIFIED', verified_at = clock_timestamp() "
                    "WHERE id = :id AND status = 'WRITTEN' RETURNING id"
                ),
                {"id": chunk.manifest_id},
            ).first()
            if verified is None:  # resolved by someone else meanwhile: not ours to delete
                outcome.skipped += chunk.row_count
                tally("archives_taken_over")
                continue
            deleted = conn.execute(
                sa.text(
                    "DELETE FROM audit_record WHERE id = ANY(CAST(:ids AS bigint[])) AND tenant_id = :t"
                ),
                {"ids": ids, "t": chunk.tenant_id},
            ).rowcount
            if deleted != len(ids) or deleted != chunk.row_count:  # never half, never none
                raise ArchiveError(f"archive {chunk.manifest_id}: locked source rows vanished")
            outcome.succeeded += deleted
            tally("archives_verified")
            if not chunk.adopted:
                outcome.side_effect(SIDE_EFFECT, "success")
        else:
            conn.execute(
                sa.text(
                    "UPDATE audit_archive_manifest SET status = 'FAILED' "
                    "WHERE id = :id AND status = 'WRITTEN'"
                ),
                {"id": chunk.manifest_id},
            )
            outcome.failed += chunk.row_count
            outcome.failed_items.append((str(chunk.manifest_id), VERIFICATION_FAILED))
            tally("archives_failed")
            if not chunk.adopted:
                outcome.side_effect(SIDE_EFFECT, "failed")
            ctx.state["archive_failure"] = (
                f"archive {chunk.manifest_id} ({chunk.tenant_id} {chunk.day}) failed "
                f"verification: {result.reason}; nothing of it was deleted"
            )
    outcome.tally = {k: v for k, v in outcome.tally.items() if v}
    crash_point("archive_before_delete_commit")
    ctx.state["_archive_deleted"] = outcome.succeeded > 0
    return outcome


# ------------------------------------------------------------------------ outcome checks


def _verified_manifests(conn: Connection, scope: Scope) -> list[Any]:
    start, end = scope.window_bounds()
    return list(
        conn.execute(
            sa.select(audit_archive_manifest)
            .where(
                audit_archive_manifest.c.tenant_id == scope.tenant_id,
                audit_archive_manifest.c.status == "VERIFIED",
                audit_archive_manifest.c.window_start >= start,
                audit_archive_manifest.c.window_start < end,
            )
            .order_by(audit_archive_manifest.c.window_start, audit_archive_manifest.c.min_record_id)
        ).all()
    )


def check_archive(conn: Connection, ctx: BatchContext) -> list[OutcomeCheck]:
    """Every record of the window is in exactly one place; every archive file verifies."""
    scope = ctx.scope
    start, end = scope.window_bounds()
    manifests = _verified_manifests(conn, scope)
    row = conn.execute(
        sa.text(
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
        ),
        {"t": scope.tenant_id, "s": start, "e": end},
    ).one()
    archived = sum(m.row_count for m in manifests)
    malformed = sum(
        1
        for m in manifests
        if m.row_count < 1 or m.max_record_id - m.min_record_id + 1 < m.row_count
    )
    baseline = ctx.state.get("archive_baseline")
    total = int(row.remaining) + archived
    accounts = row.both_places == 0 and malformed == 0 and (baseline is None or total == baseline)

    mismatched: list[str] = []
    for m in manifests:
        if _sha256_or_none(resolve_path(m.file_path)) != m.sha256:
            mismatched.append(str(m.id))
    return [
        OutcomeCheck(
            "archive_accounts_for_every_record",
            accounts,
            "records of the window = remaining source rows + rows of VERIFIED archives, "
            "and no record is in both",
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
        OutcomeCheck(
            "archives_verify",
            not mismatched,
            "every VERIFIED archive file of the window still has its manifest's sha256",
            {
                "files_checked": len(manifests),
                "files_mismatched": len(mismatched),
                "mismatched_manifests": ", ".join(mismatched[:10]) or "none",
            },
        ),
    ]


def report_archive(conn: Connection, ctx: BatchContext) -> list[ReportRow]:
    """Per day and manifest status: archive files this run wrote or adopted, their records
    and checksums (first 12 hex digits)."""
    return [
        ReportRow(
            "archived" if r.status == "VERIFIED" else r.status.lower(),
            r.day.isoformat(),
            int(r.records),
            one_line(f"{r.files} file(s), sha256 {r.sums}", 160),
        )
        for r in conn.execute(
            sa.text(
                "SELECT (window_start AT TIME ZONE 'UTC')::date AS day, status, count(*) AS files, "
                "sum(row_count) AS records, string_agg(left(sha256, 12), ' ' ORDER BY min_record_id) AS sums "
                "FROM audit_archive_manifest WHERE job_run_id = :run GROUP BY 1, 2 ORDER BY 1, 2"
            ),
            {"run": ctx.job_run_id},
        )
    ]


def overdue_seconds(conn: Connection, ctx: BatchContext) -> float | None:
    """How long the oldest eligible record of the window has been past retention."""
    start, end = ctx.scope.window_bounds()
    oldest = conn.execute(
        sa.select(sa.func.min(audit_record.c.occurred_at)).where(
            audit_record.c.tenant_id == ctx.scope.tenant_id,
            audit_record.c.occurred_at >= start,
            audit_record.c.occurred_at < end,
            audit_record.c.occurred_at < _cutoff(ctx),
        )
    ).scalar()
    if oldest is None:
        return None
    value = conn.execute(
        sa.select(sa.func.extract("epoch", _cutoff(ctx) - sa.literal(oldest)))
    ).scalar()
    return seconds_or_none(value)


# ------------------------------------------------------------------------ restore


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
        return self.archived_rows - self.restored_rows


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


def restore_day(
    engine: Engine,
    tenant_id: str,
    day: date,
    *,
    actor: str = "unknown",
    reason: str | None = None,
) -> RestoreResult:
    """Put every VERIFIED archive of (tenant, day) back into ``audit_record``, same ids.

    One transaction: all files are checked against their manifests first (a file that does
    not match aborts the restore, changing nothing); rows go back with ``ON CONFLICT (id)
    DO NOTHING``; the manifests become WRITTEN (source intact, file a copy), so a record is
    never counted both as remaining and as archived. A second restore finds nothing to do.
    """
    scope = Scope(tenant_id, day, day + timedelta(days=1))  # validates the tenant key
    start, end = scope.window_bounds()
    with engine.begin() as conn:
        if not tenant_exists(conn, tenant_id):
            raise BadInput(f"unknown tenant {tenant_id}")
        manifests = conn.execute(
            sa.select(audit_archive_manifest)
            .where(
                audit_archive_manifest.c.tenant_id == tenant_id,
                audit_archive_manifest.c.status == "VERIFIED",
                audit_archive_manifest.c.window_start >= start,
                audit_archive_manifest.c.window_start < end,
            )
            .order_by(audit_archive_manifest.c.min_record_id)
            .with_for_update()
        ).all()
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
            conn.execute(
                sa.update(audit_archive_manifest)
                .where(audit_archive_manifest.c.id == m.id)
                .values(status="WRITTEN", verified_at=None)
            )
        runs.append_audit(
            conn,
            actor=actor,
            action="archive_restore",
            decision="allowed",
            job_name=JOB_NAME,
            scope=scope.key,
            reason=reason,
            details={"archives": len(manifests), "restored_rows": restored},
        )
    return RestoreResult(tenant_id, day, len(manifests), archived, restored)


# ------------------------------------------------------------------------ the job

SPEC = JobSpec(
    name=JOB_NAME,
    kind="archive",
    description=(
        "Copy audit records past retention to verified Parquet archives, then delete them, "
        "per tenant and day"
    ),
    partitioning="tenant_day",
    eligible=archivable_records,
    transition=select_chunks,
    external=write_and_verify,
    record=delete_verified,
    check=check_archive,
    lag=overdue_seconds,
    report=report_archive,
    lock_of=audit_record,
    outcome_asset="audit_records",
    checks=(
        CheckSpec(
            "archive_accounts_for_every_record",
            "Archived (VERIFIED) + remaining records = the records of the window; none in both",
        ),
        CheckSpec(
            "archives_verify", "Every VERIFIED archive file still matches its manifest checksum"
        ),
    ),
    cron_schedule="15 3 * * *",
    defaults=Limits(batch_size=MAX_ROWS_PER_FILE),
    change="archived to a verified Parquet file, then deleted",
    healthy="No audit record past retention left in the source, and every VERIFIED archive still matches its checksum.",
    # measured: 414 MiB peak RSS archiving 50,000-record chunks (CLI); a run worker adds Dagster
    run_resources=RunResources(cpu_request="500m", memory_request="1Gi", memory_limit="2Gi"),
    destructive=True,
    validate_settings=archive_settings,  # retention and a writable archive directory
    scheduled_window_age_days=lambda: retention_days() + 1,
    side_effects=(SIDE_EFFECT,),
    error_classes=(
        ArchiveError.error_code,
        ArchiveVerificationFailed.error_code,
        ArchiveConfigError.error_code,
    ),
)
