"""The jobs section's file jobs (temp_file_cleanup, audit_archive): their data (rows, and the
stored objects of temp_file_cleanup), their two limits each and the check that the work was
done.

Their limits are bare scripts, on purpose: the fewest set-based statements and file
operations that reach the job's end state in one transaction (and, for the second limit, the
work the job must do besides). temp_file_cleanup's limits select and delete by the job's own
eligibility predicate (``ELIGIBLE``), so they take exactly the rows the job would.
"""

from __future__ import annotations

import hashlib
import io
import os
import uuid
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import sqlalchemy as sa
from sqlalchemy.engine import URL

from bench.common import engine_for
from bench.jobs_common import (
    AUDIT_RETENTION_DAYS,
    CLEANUP_RETENTION_DAYS,
    TENANT,
    TENANT_SQL,
    Window,
    one_row,
    spread,
)
from qo_ops.jobs import audit_archive as archive_job
from qo_ops.jobs.audit_archive import format as archive_format
from qo_ops.jobs.audit_archive import storage as archive_storage
from qo_ops.jobs.temp_file_cleanup import ELIGIBLE
from qo_ops.platform.calls.object_store import OBJECTS_DIR

TEMP_FILE_BYTES = 1024  # each stored object of temp_file_cleanup

# ------------------------------------------------------------------------------ data


def temp_file_load(n: int, w: Window | None) -> str:
    # terminal files, not on hold, created in the window (past the 7-day retention)
    assert w is not None
    return f"""
    {TENANT_SQL}
    INSERT INTO temp_file (tenant_id, storage_path, size_bytes, status, legal_hold, created_at)
    SELECT 'tenant-001', {_object_path_sql("i")}, {TEMP_FILE_BYTES},
           CASE WHEN mod(i, 4) = 0 THEN 'FAILED_TERMINAL' ELSE 'COMPLETED' END, false,
           {spread("i - 1", n, w)}
      FROM generate_series(1::bigint, {n}) AS i;
    """


def _object_path_sql(i: str) -> str:
    return f"'tmp/tenant-001/' || lpad(({i} / 1000)::text, 5, '0') || '/' || lpad({i}::text, 9, '0') || '.bin'"


def _object_path(i: int) -> str:
    return f"tmp/tenant-001/{i // 1000:05d}/{i:09d}.bin"


def audit_load(n: int, w: Window | None) -> str:
    # records appended in time order (id order = occurrence order), all past retention
    assert w is not None
    return f"""
    {TENANT_SQL}
    INSERT INTO audit_record (tenant_id, occurred_at, actor_ref, action, entity_type, entity_id,
                              details)
    SELECT 'tenant-001', {spread("i - 1", n, w)}, 'user-' || mod(i, 50),
           (ARRAY['quote.created', 'quote.updated', 'order.submitted', 'price.overridden'])[1 + mod(i, 4)],
           (ARRAY['quote', 'quote', 'order', 'quote'])[1 + mod(i, 4)],
           (1000000 + mod(i * 7, 99991))::text,
           jsonb_build_object('source', 'bench', 'n', i, 'digest', md5(i::text))
      FROM generate_series(1::bigint, {n}) AS i;
    """


def write_objects(home: Path, n: int) -> None:
    """The stored object of every temp_file row (ids 1..n), TEMP_FILE_BYTES each."""
    block = os.urandom(TEMP_FILE_BYTES)
    root = home / OBJECTS_DIR
    made: set[str] = set()
    for i in range(1, n + 1):
        rel = _object_path(i)
        folder = rel.rsplit("/", 1)[0]
        if folder not in made:
            (root / folder).mkdir(parents=True, exist_ok=True)
            made.add(folder)
        head = b"%09d\n" % i
        (root / rel).write_bytes(head + block[len(head) :])


def count_files(root: Path) -> int:
    return sum(len(files) for _, _, files in os.walk(root)) if root.exists() else 0


# ------------------------------------------------------------------------------ limits

# Each takes (url, n, window, home), does the job's whole state change in ONE transaction
# and returns the rows it changed; the caller times it.


def _cleanup_params(w: Window) -> dict[str, Any]:
    """ELIGIBLE's parameters for the window, at the retention the job runs with."""
    return {"tenant": TENANT, "start": w.start, "end": w.end, "days": CLEANUP_RETENTION_DAYS}


# A bare script, not the job's statements (which work by batch of ids): the set-based limit.
CLEANUP_SELECT_SQL = sa.text(
    f"SELECT id, storage_path FROM temp_file WHERE {ELIGIBLE} ORDER BY id FOR UPDATE"
)
# the rows deleted and their complete tombstones (checksum of the bytes, deleted_at) at once
CLEANUP_DELETE_SQL = sa.text(
    f"""
    WITH gone AS (
        DELETE FROM temp_file WHERE {ELIGIBLE}
        RETURNING id, tenant_id, storage_path, size_bytes, status, created_at, legal_hold
    )
    INSERT INTO temp_file_tombstone (temp_file_id, tenant_id, storage_path, size_bytes, sha256,
                                     file_status, file_created_at, legal_hold, job_run_id,
                                     reason, selected_at, deleted_at)
    SELECT g.id, g.tenant_id, g.storage_path, g.size_bytes, h.sha256, g.status, g.created_at,
           g.legal_hold, CAST(:run AS uuid), 'bench baseline', clock_timestamp(),
           clock_timestamp()
      FROM gone g
      JOIN unnest(CAST(:ids AS bigint[]), CAST(:shas AS text[])) AS h(id, sha256) ON h.id = g.id
    RETURNING storage_path
    """
)


def _lock_and_hash(conn: Any, params: dict[str, Any], root: Path) -> tuple[list[int], list[str]]:
    """The eligible rows locked and listed, and the sha256 of each one's object: both
    limits of temp_file_cleanup start so."""
    ids, shas = [], []
    for f in conn.execute(CLEANUP_SELECT_SQL, params).all():
        ids.append(f.id)
        shas.append(hashlib.sha256((root / f.storage_path).read_bytes()).hexdigest())
    return ids, shas


def cleanup_baseline(url: URL, n: int, w: Window | None, home: Path) -> int:
    """Lock and list the eligible rows, hash their objects, delete the rows and write their
    tombstones in one statement, unlink the objects, commit."""
    assert w is not None
    root = home / OBJECTS_DIR
    params = _cleanup_params(w)
    engine = engine_for(url)
    with engine.begin() as conn:
        ids, shas = _lock_and_hash(conn, params, root)
        gone = conn.execute(
            CLEANUP_DELETE_SQL, {**params, "ids": ids, "shas": shas, "run": str(uuid.uuid4())}
        ).scalars()
        removed = 0
        for path in gone:
            (root / path).unlink()
            removed += 1
    engine.dispose()
    if removed != n:
        raise SystemExit(f"temp_file_cleanup baseline: {removed} removed, expected {n}")
    return removed


# the second, honest limit: the intents first (the checksum durable before any byte goes) ...
CLEANUP_INTENTS_SQL = sa.text(
    """
    INSERT INTO temp_file_tombstone (temp_file_id, tenant_id, storage_path, size_bytes, sha256,
                                     file_status, file_created_at, legal_hold, job_run_id,
                                     reason, selected_at)
    SELECT f.id, f.tenant_id, f.storage_path, f.size_bytes, h.sha256, f.status, f.created_at,
           f.legal_hold, CAST(:run AS uuid), 'bench baseline', clock_timestamp()
      FROM unnest(CAST(:ids AS bigint[]), CAST(:shas AS text[])) AS h(id, sha256)
      JOIN temp_file f ON f.id = h.id
    """
)

# ... then, in a second transaction, the rows deleted and their intents completed at once
CLEANUP_COMPLETE_SQL = sa.text(
    f"""
    WITH gone AS (
        DELETE FROM temp_file WHERE {ELIGIBLE}
        RETURNING id, storage_path, size_bytes, status, created_at, legal_hold
    )
    UPDATE temp_file_tombstone t
       SET storage_path = g.storage_path, size_bytes = g.size_bytes, file_status = g.status,
           file_created_at = g.created_at, legal_hold = g.legal_hold,
           deleted_at = clock_timestamp()
      FROM gone g
     WHERE t.temp_file_id = g.id
    RETURNING t.storage_path
    """
)


def cleanup_two_step_baseline(url: URL, n: int, w: Window | None, home: Path) -> int:
    """The job's two transactions, set-based over the whole window: lock and list the
    eligible rows, hash their objects, write every intent tombstone, COMMIT; then delete the
    rows and complete their tombstones in one statement, unlink the objects, COMMIT."""
    assert w is not None
    root = home / OBJECTS_DIR
    params = _cleanup_params(w)
    run = str(uuid.uuid4())
    engine = engine_for(url)
    with engine.begin() as conn:
        ids, shas = _lock_and_hash(conn, params, root)
        conn.execute(CLEANUP_INTENTS_SQL, {"ids": ids, "shas": shas, "run": run})
    with engine.begin() as conn:
        removed = 0
        for path in conn.execute(CLEANUP_COMPLETE_SQL, params).scalars():
            (root / path).unlink()
            removed += 1
    engine.dispose()
    if removed != n:
        raise SystemExit(f"temp_file_cleanup two-step baseline: {removed} removed, expected {n}")
    return removed


# A bare script, not the job's statements: every eligible record of the window as CSV straight
# from the server (COPY), parsed by pyarrow's C++ reader into the archive's schema
AUDIT_COPY_SQL = f"""
COPY (SELECT id, tenant_id,
             to_char(occurred_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'),
             actor_ref, action, entity_type, entity_id, details::text,
             (occurred_at AT TIME ZONE 'UTC')::date::text
        FROM audit_record
       WHERE tenant_id = %(tenant)s AND occurred_at >= %(start)s AND occurred_at < %(end)s
         AND occurred_at < now() - interval '{AUDIT_RETENTION_DAYS} days'
       ORDER BY id)
  TO STDOUT WITH (FORMAT csv)
"""

AUDIT_DELETE_SQL = f"""
DELETE FROM audit_record
 WHERE tenant_id = %(tenant)s AND occurred_at >= %(start)s AND occurred_at < %(end)s
   AND occurred_at < now() - interval '{AUDIT_RETENTION_DAYS} days'
"""

AUDIT_MANIFEST_SQL = """
INSERT INTO audit_archive_manifest (id, tenant_id, window_start, window_end, file_path,
                                    row_count, min_record_id, max_record_id, sha256, status,
                                    verified_at)
VALUES (%(id)s, %(tenant)s, %(ws)s, %(we)s, %(path)s, %(rows)s, %(lo)s, %(hi)s, %(sha)s,
        'VERIFIED', clock_timestamp())
"""


def _copy_window(conn: Any, params: dict[str, Any]) -> pa.Table:
    """The window's eligible records, COPYed out as CSV on ``conn`` (psycopg) and parsed by
    Arrow's C++ reader into the archive schema plus their UTC ``day``: both limits start so."""
    names = [*archive_job.COLUMNS, "day"]
    types = {f.name: f.type for f in archive_job.archive_schema()} | {"day": pa.string()}
    buffer = io.BytesIO()
    with conn.cursor() as cur, cur.copy(AUDIT_COPY_SQL, params) as copy:
        for chunk in copy:
            buffer.write(chunk)
    return pacsv.read_csv(
        io.BytesIO(buffer.getvalue()),
        read_options=pacsv.ReadOptions(column_names=names),
        convert_options=pacsv.ConvertOptions(
            column_types=types, strings_can_be_null=False, quoted_strings_can_be_null=False
        ),
    )


def audit_baseline(url: URL, n: int, w: Window | None, home: Path) -> int:
    """COPY the window's eligible records out, write one Parquet file per day (the archive's
    schema, zstd, fsync'd), insert their manifests VERIFIED and delete the records: one
    transaction."""
    assert w is not None
    params = {"tenant": TENANT, "start": w.start, "end": w.end}
    engine = engine_for(url)
    raw = engine.raw_connection()
    try:
        conn = raw.driver_connection
        assert conn is not None
        with conn.cursor() as cur:
            table = _copy_window(conn, params)
            written = 0
            for day in pc.unique(table.column("day")).to_pylist():
                part = table.filter(pc.equal(table.column("day"), day)).drop_columns(["day"])
                part = part.cast(archive_job.archive_schema())
                manifest_id = uuid.uuid4()
                rel = archive_job.relative_path(TENANT, date.fromisoformat(day), manifest_id)
                sink = io.BytesIO()
                pq.write_table(part, sink, compression="zstd")
                data = sink.getvalue()
                archive_storage.write_file(home / rel, data)
                ws = datetime.combine(date.fromisoformat(day), datetime.min.time(), UTC)
                ids = part.column("id")
                cur.execute(
                    AUDIT_MANIFEST_SQL,
                    {
                        "id": manifest_id,
                        "tenant": TENANT,
                        "ws": ws,
                        "we": ws + timedelta(days=1),
                        "path": rel,
                        "rows": part.num_rows,
                        "lo": pc.min(ids).as_py(),
                        "hi": pc.max(ids).as_py(),
                        "sha": hashlib.sha256(data).hexdigest(),
                    },
                )
                written += part.num_rows
            cur.execute(AUDIT_DELETE_SQL, params)
            deleted = cur.rowcount
        conn.commit()
    finally:
        raw.close()
        engine.dispose()
    if written != n or deleted != n:
        raise SystemExit(f"audit_archive baseline: {written} archived, {deleted} deleted, {n}")
    return deleted


def audit_verified_baseline(url: URL, n: int, w: Window | None, home: Path) -> int:
    """The second, honest limit of audit_archive: what ``audit_baseline`` does, plus the
    verification the job must do before it may delete — each day's file read back (sha256 of
    its bytes, parsed, the rows' digest in Arrow) and its records deleted by the job's own
    ``DELETE_DIGESTED``, whose digest of the deleted rows must equal the file's. One
    transaction; the deletes are kept only if every digest matches."""
    assert w is not None
    params = {"tenant": TENANT, "start": w.start, "end": w.end}
    engine = engine_for(url)
    deleted = 0
    with engine.begin() as conn:
        raw = conn.connection.driver_connection
        assert raw is not None
        table = _copy_window(raw, params)
        for day in pc.unique(table.column("day")).to_pylist():
            part = table.filter(pc.equal(table.column("day"), day)).drop_columns(["day"])
            part = part.cast(archive_job.archive_schema())
            manifest_id = uuid.uuid4()
            rel = archive_job.relative_path(TENANT, date.fromisoformat(day), manifest_id)
            sink = io.BytesIO()
            pq.write_table(part, sink, compression="zstd")
            sha = hashlib.sha256(sink.getvalue()).hexdigest()
            archive_storage.write_file(home / rel, sink.getvalue())
            del sink, part
            data = (home / rel).read_bytes()  # read back: its bytes, its rows
            if hashlib.sha256(data).hexdigest() != sha:
                raise SystemExit(f"audit_archive verified baseline: {rel} changed")
            back = archive_format.read_table(data)
            ids_digest, rows_digest = archive_format.table_digests(back)
            ws = datetime.combine(date.fromisoformat(day), datetime.min.time(), UTC)
            lo, hi = pc.min(back.column("id")).as_py(), pc.max(back.column("id")).as_py()
            gone = conn.execute(
                archive_format.DELETE_DIGESTED,
                {"t": TENANT, "lo": lo, "hi": hi, "ws": ws, "we": ws + timedelta(days=1)},
            ).one()
            if (gone.n, gone.ids, gone.rows) != (back.num_rows, ids_digest, rows_digest):
                raise SystemExit(f"audit_archive verified baseline: {rel} differs from source")
            conn.exec_driver_sql(
                AUDIT_MANIFEST_SQL,
                {
                    "id": manifest_id, "tenant": TENANT, "ws": ws, "we": ws + timedelta(days=1),
                    "path": rel, "rows": back.num_rows, "lo": lo, "hi": hi, "sha": sha,
                },
            )  # fmt: skip
            deleted += gone.n
    engine.dispose()
    if deleted != n:
        raise SystemExit(f"audit_archive verified baseline: {deleted} archived, expected {n}")
    return deleted


# ------------------------------------------------------------------------------ verification


def verify_cleanup(url: URL, n: int, w: Window | None, home: Path) -> dict[str, Any]:
    row = one_row(
        url,
        """
        SELECT (SELECT count(*) FROM temp_file WHERE tenant_id = :t) AS rows_left,
               (SELECT count(*) FROM temp_file_tombstone
                 WHERE tenant_id = :t AND deleted_at IS NOT NULL AND sha256 IS NOT NULL
                   AND NOT legal_hold) AS tombstones,
               (SELECT count(*) FROM temp_file_tombstone WHERE deleted_at IS NULL) AS intents,
               (SELECT count(*) FROM job_audit WHERE action = 'anomaly_override')
                   AS overrides
        """,
        {"t": TENANT},
    )
    row["objects_left"] = count_files(home / OBJECTS_DIR)
    ok = (
        row["rows_left"] == 0
        and row["tombstones"] == n
        and row["intents"] == 0
        and row["objects_left"] == 0
        and row["overrides"] == 0
    )
    return {"ok": ok, **row}


def verify_audit(url: URL, n: int, w: Window | None, home: Path) -> dict[str, Any]:
    engine = engine_for(url)
    with engine.connect() as conn:
        row = (
            conn.execute(
                sa.text(
                    """
                SELECT (SELECT count(*) FROM audit_record WHERE tenant_id = :t) AS remaining,
                       (SELECT coalesce(sum(row_count), 0) FROM audit_archive_manifest
                         WHERE tenant_id = :t AND status = 'VERIFIED') AS archived,
                       (SELECT count(*) FROM audit_archive_manifest
                         WHERE status <> 'VERIFIED') AS not_verified
                """
                ),
                {"t": TENANT},
            )
            .one()
            ._asdict()
        )
        files = conn.execute(
            sa.text(
                "SELECT file_path, sha256 FROM audit_archive_manifest WHERE status = 'VERIFIED'"
            )
        ).all()
    engine.dispose()
    bad = sum(1 for f in files if archive_storage.sha256_or_none(home / f.file_path) != f.sha256)
    in_files = sum(pq.read_metadata(home / f.file_path).num_rows for f in files)
    row |= {"archived": int(row["archived"]), "files": len(files), "files_not_matching": bad}
    row["rows_in_files"] = in_files
    ok = (
        row["remaining"] == 0
        and row["archived"] == in_files == n
        and row["not_verified"] == 0
        and bad == 0
    )
    return {"ok": ok, **row}
