"""Jobs vs the database's limit: six jobs through the real CLI, each beside the same state
change done set-based in one transaction (the physical limit of this server for the work);
peak RSS of quote_expiration at several sizes; batch transaction times.

Per job: one tenant, ``profile.rows`` eligible rows (a share of it for the two slowest
jobs, ``SHARE``) built once with INSERT … SELECT
generate_series into a template database, VACUUM ANALYZE; every measurement runs on its own
``CREATE DATABASE … TEMPLATE`` clone (same bytes for the job and its baseline), after
``settle()``, and is verified afterwards (the state the job promises, counted in the
database and on disk). Job and baseline runs alternate; figures are medians over
``profile.repeats`` runs with their min and max; a ratio is the median of the repeats'
job/baseline pairs (each pair back to back), with the lowest and highest pair.

* The job: ``qo-ops run JOB --tenant T [--from D --to D] --mode execute --reason … --json``
  in its own process (``measure_command``: wall time and peak RSS), default batch size. Its
  rate is ``processed_count / duration_ms`` (the run's own clock: eligibility count,
  batches, outcome checks; not the interpreter's start-up, which the wall-time ratio in
  ``raw`` includes).
* The limit: the same end state reached by the minimal set of set-based statements in one
  transaction, timed from connect to commit in this process (see ``BASELINE_NOTES``).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import sqlalchemy as sa
from sqlalchemy.engine import URL

from bench.bench_quote_expiration import LOAD_SQL as QUOTE_LOAD_SQL
from bench.bench_quote_expiration import SET_BASED_SQL as QUOTE_SET_BASED_SQL
from bench.bench_quote_expiration import VERIFY_SQL as QUOTE_VERIFY_SQL
from bench.common import (
    QO_OPS,
    cloned_database,
    engine_for,
    env_url,
    fresh_database,
    measure_command,
    settle,
    standing_approvals,
    stopwatch,
)
from bench.suite import Profile, Row, Section, Spread, median, pairwise_ratios
from qo_ops.jobs import audit_archive as archive_job
from qo_ops.jobs import temp_file_cleanup as cleanup_job
from qo_ops.jobs.audit_archive import format as archive_format
from qo_ops.jobs.audit_archive import storage as archive_storage
from qo_ops.jobs.catalog import get_spec
from qo_ops.platform.calls.object_store import OBJECTS_DIR
from qo_ops.platform.job.options import Limits
from qo_ops.platform.job.outcome import BatchContext
from qo_ops.platform.job.scope import Scope

TITLE = "Jobs vs the database's limit"
TENANT = "tenant-001"
PREFIX = "qo_ops_bench_jobs"
GOAL_P99_MS = 250.0
GOAL_RSS_RATIO = 1.2
SPAN_DAYS = 10  # windowed jobs: rows spread over this many UTC days, window = exactly those
TEMP_FILE_BYTES = 1024  # each stored object of temp_file_cleanup
AUDIT_RETENTION_DAYS = 365
CLEANUP_RETENTION_DAYS = 7


def _mib(kb: float) -> str:
    return f"{kb / 1024:,.1f} MiB"


def _rate(value: float) -> str:
    return f"{value:,.0f} rows/s"


# ------------------------------------------------------------------------------ data


@dataclass(frozen=True)
class Window:
    """Rows of a windowed job lie in [first, last + 1 day); the CLI gets --from first --to last."""

    first: date
    last: date

    @property
    def start(self) -> datetime:
        return datetime.combine(self.first, datetime.min.time(), UTC)

    @property
    def end(self) -> datetime:
        return datetime.combine(self.last + timedelta(days=1), datetime.min.time(), UTC)

    def cli(self) -> list[str]:
        return ["--from", self.first.isoformat(), "--to", self.last.isoformat()]


def _scope(w: Window | None) -> Scope:
    """The run's scope: the tenant, over the window for a windowed job."""
    return Scope(TENANT, w.first, w.last + timedelta(days=1)) if w else Scope(TENANT)


def _window(days_ago: int) -> Window:
    first = datetime.now(UTC).date() - timedelta(days=days_ago)
    return Window(first, first + timedelta(days=SPAN_DAYS - 1))


def _spread(expr: str, n: int, window: Window) -> str:
    """SQL: a timestamp inside ``window`` for row ``expr`` of ``n`` (never on a bound)."""
    span_s = SPAN_DAYS * 86400 - 2
    return (
        f"(timestamptz '{window.start.isoformat()}' + interval '1 second' "
        f"+ make_interval(secs => ({expr}) * {span_s}.0 / {n}))"
    )


TENANT_SQL = "INSERT INTO tenant (id, name) VALUES ('tenant-001', 'bench');"


def _checkout_load(n: int, _w: Window | None) -> str:
    # OPEN sessions idle 2 to ~350 days, the oldest (lowest id) idle longest
    return f"""
    {TENANT_SQL}
    INSERT INTO checkout_session (tenant_id, status, started_at, last_activity_at)
    SELECT 'tenant-001', 'OPEN', a - interval '20 minutes', a
      FROM generate_series(1::bigint, {n}) AS i,
           LATERAL (SELECT now() - interval '2 days'
                           - make_interval(secs => ({n} - i) * 30000000.0 / {n})) AS t(a);
    """


def _pricing_load(n: int, w: Window | None) -> str:
    # quotes created in the window (created order scattered over id order), 1-3 lines each,
    # each with a snapshot for the old price book only: the job adds one at version 2
    assert w is not None
    return f"""
    {TENANT_SQL}
    INSERT INTO price_book (tenant_id, version, is_current, effective_from, price_factor)
    VALUES ('tenant-001', 1, false, now() - interval '400 days', 1),
           ('tenant-001', 2, true, now() - interval '1 day', 1.1);
    INSERT INTO quote (id, tenant_id, quote_number, customer_ref, status, total_amount,
                       price_book_version, created_at, updated_at, expires_at)
    SELECT i, 'tenant-001', 'Q-' || i, 'c-' || mod(i, 997), 'ACCEPTED', 0, 1, c, c,
           c + interval '30 days'
      FROM generate_series(1::bigint, {n}) AS i,
           LATERAL (SELECT {_spread("i - 1", n, w)}) AS t(c);
    INSERT INTO quote_line (quote_id, tenant_id, line_no, sku, quantity, unit_price, amount)
    SELECT i, 'tenant-001', k, 'SKU-' || mod(i * k, 500), v.qty, v.price, v.qty * v.price
      FROM generate_series(1::bigint, {n}) AS i,
           LATERAL generate_series(1, 1 + mod(i, 3)::int) AS k,
           LATERAL (SELECT 1 + mod(i + k, 5) AS qty,
                           round((5 + mod(i * 31 + k, 1000)) / 1.0, 2) AS price) AS v;
    UPDATE quote q SET total_amount = s.total
      FROM (SELECT quote_id, sum(amount) AS total FROM quote_line GROUP BY quote_id) s
     WHERE s.quote_id = q.id;
    INSERT INTO pricing_snapshot (tenant_id, quote_id, price_book_version, total_amount,
                                  line_count, computed_at)
    SELECT 'tenant-001', q.id, 1, q.total_amount, 1 + mod(q.id, 3)::int, q.created_at
      FROM quote q;
    """


def _read_model_load(n: int, w: Window | None) -> str:
    # orders (each from its quote) submitted in the window; every read-model row drifted: a
    # third missing, the rest one source version behind, half of those with a wrong total
    assert w is not None
    return f"""
    {TENANT_SQL}
    INSERT INTO quote (id, tenant_id, quote_number, customer_ref, status, total_amount,
                       price_book_version, created_at, updated_at, expires_at)
    SELECT i, 'tenant-001', 'Q-' || i, 'c-' || mod(i, 997), 'ACCEPTED', mod(i, 100000) / 100.0,
           1, s, s, s + interval '30 days'
      FROM generate_series(1::bigint, {n}) AS i,
           LATERAL (SELECT {_spread("i - 1", n, w)} - interval '1 day') AS t(s);
    INSERT INTO customer_order (id, tenant_id, quote_id, order_number, status, total_amount,
                                line_count, submitted_at, updated_at, version)
    SELECT i, 'tenant-001', i, 'ORD-' || lpad(i::text, 9, '0'),
           (ARRAY['SUBMITTED', 'IN_FULFILLMENT', 'COMPLETED'])[1 + mod(i, 3)],
           mod(i, 100000) / 100.0, 1 + mod(i, 3)::int, s, s, 2
      FROM generate_series(1::bigint, {n}) AS i,
           LATERAL (SELECT {_spread("i - 1", n, w)}) AS t(s);
    INSERT INTO order_read_model (order_id, tenant_id, order_number, quote_number, status,
                                  total_amount, line_count, source_version, refreshed_at)
    SELECT o.id, o.tenant_id, o.order_number, q.quote_number, o.status,
           CASE WHEN mod(o.id, 6) IN (1, 2) THEN o.total_amount + 1 ELSE o.total_amount END,
           o.line_count, 1, o.submitted_at
      FROM customer_order o JOIN quote q ON q.id = o.quote_id WHERE mod(o.id, 3) <> 0;
    """


def _temp_file_load(n: int, w: Window | None) -> str:
    # terminal files, not on hold, created in the window (past the 7-day retention)
    assert w is not None
    return f"""
    {TENANT_SQL}
    INSERT INTO temp_file (tenant_id, storage_path, size_bytes, status, legal_hold, created_at)
    SELECT 'tenant-001', {_object_path_sql("i")}, {TEMP_FILE_BYTES},
           CASE WHEN mod(i, 4) = 0 THEN 'FAILED_TERMINAL' ELSE 'COMPLETED' END, false,
           {_spread("i - 1", n, w)}
      FROM generate_series(1::bigint, {n}) AS i;
    """


def _object_path_sql(i: str) -> str:
    return f"'tmp/tenant-001/' || lpad(({i} / 1000)::text, 5, '0') || '/' || lpad({i}::text, 9, '0') || '.bin'"


def _object_path(i: int) -> str:
    return f"tmp/tenant-001/{i // 1000:05d}/{i:09d}.bin"


def _audit_load(n: int, w: Window | None) -> str:
    # records appended in time order (id order = occurrence order), all past retention
    assert w is not None
    return f"""
    {TENANT_SQL}
    INSERT INTO audit_record (tenant_id, occurred_at, actor_ref, action, entity_type, entity_id,
                              details)
    SELECT 'tenant-001', {_spread("i - 1", n, w)}, 'user-' || mod(i, 50),
           (ARRAY['quote.created', 'quote.updated', 'order.submitted', 'price.overridden'])[1 + mod(i, 4)],
           (ARRAY['quote', 'quote', 'order', 'quote'])[1 + mod(i, 4)],
           (1000000 + mod(i * 7, 99991))::text,
           jsonb_build_object('source', 'bench', 'n', i, 'digest', md5(i::text))
      FROM generate_series(1::bigint, {n}) AS i;
    """


def _quote_load(n: int, _w: Window | None) -> str:
    return QUOTE_LOAD_SQL.format(n=n)


def load_template(url: URL, sql: str) -> None:
    engine = engine_for(url)
    with engine.begin() as conn:
        conn.exec_driver_sql(sql)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql("VACUUM ANALYZE")
    engine.dispose()


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


def _count_files(root: Path) -> int:
    return sum(len(files) for _, _, files in os.walk(root)) if root.exists() else 0


# ------------------------------------------------------------------------------ baselines

# Each takes (url, n, window, home), does the job's whole state change in ONE transaction
# and returns the rows it changed; the caller times it.


def _scalar_row(url: URL, statement: sa.TextClause, params: dict[str, Any]) -> Any:
    engine = engine_for(url)
    with engine.begin() as conn:
        row = conn.execute(statement, params).one()
    engine.dispose()
    return row


def quote_baseline(url: URL, n: int, w: Window | None, home: Path) -> int:
    row = _scalar_row(url, QUOTE_SET_BASED_SQL, {"tenant": TENANT})
    if row.expired != n or row.events != n:
        raise SystemExit(f"quote_expiration baseline: {row.expired} expired, {row.events} events")
    return int(row.expired)


CHECKOUT_SET_BASED_SQL = sa.text(
    """
    WITH closed AS (
        UPDATE checkout_session
           SET status = 'ABANDONED', closed_at = clock_timestamp(), version = version + 1
         WHERE tenant_id = :tenant AND status = 'OPEN'
           AND last_activity_at < now() - make_interval(hours => 24)
        RETURNING id, tenant_id, quote_id, last_activity_at, closed_at, version
    ), events AS (
        INSERT INTO outbox_event (id, business_key, tenant_id, aggregate_type, aggregate_id,
                                  event_type, payload, created_at, available_at)
        SELECT gen_random_uuid(), format('checkout:%s:abandoned', id), tenant_id, 'checkout',
               id::text, 'CheckoutAbandoned',
               jsonb_build_object('checkout_id', id, 'quote_id', quote_id,
                                  'last_activity_at', last_activity_at,
                                  'abandoned_at', closed_at, 'version', version),
               clock_timestamp(), clock_timestamp()
          FROM closed
        ON CONFLICT (business_key) DO NOTHING
        RETURNING 1
    )
    SELECT (SELECT count(*) FROM closed) AS closed, (SELECT count(*) FROM events) AS events
    """
)


def checkout_baseline(url: URL, n: int, w: Window | None, home: Path) -> int:
    row = _scalar_row(url, CHECKOUT_SET_BASED_SQL, {"tenant": TENANT})
    if row.closed != n or row.events != n:
        raise SystemExit(f"abandoned_checkout_close baseline: {row.closed} closed, {row.events}")
    return int(row.closed)


PRICING_SET_BASED_SQL = sa.text(
    """
    WITH pb AS (
        SELECT version, price_factor FROM price_book WHERE tenant_id = :tenant AND is_current
    ), computed AS (
        SELECT q.id AS quote_id, q.tenant_id, pb.version,
               round(coalesce(sum(l.quantity * l.unit_price), 0) * pb.price_factor, 2) AS total_amount,
               count(l.id)::int AS line_count
          FROM quote q
          CROSS JOIN pb
          LEFT JOIN quote_line l ON l.quote_id = q.id
         WHERE q.tenant_id = :tenant AND q.created_at >= :start AND q.created_at < :end
         GROUP BY q.id, q.tenant_id, pb.version, pb.price_factor
    ), upserted AS (
        INSERT INTO pricing_snapshot AS s (tenant_id, quote_id, price_book_version, total_amount,
                                           line_count, computed_at, job_run_id)
        SELECT tenant_id, quote_id, version, total_amount, line_count, clock_timestamp(), NULL
          FROM computed
         ORDER BY quote_id
        ON CONFLICT (quote_id, price_book_version) DO UPDATE
           SET total_amount = EXCLUDED.total_amount, line_count = EXCLUDED.line_count,
               computed_at = EXCLUDED.computed_at, job_run_id = EXCLUDED.job_run_id
         WHERE (s.total_amount, s.line_count)
               IS DISTINCT FROM (EXCLUDED.total_amount, EXCLUDED.line_count)
        RETURNING 1
    )
    SELECT count(*) AS changed FROM upserted
    """
)


def pricing_baseline(url: URL, n: int, w: Window | None, home: Path) -> int:
    assert w is not None
    row = _scalar_row(
        url, PRICING_SET_BASED_SQL, {"tenant": TENANT, "start": w.start, "end": w.end}
    )
    if row.changed != n:
        raise SystemExit(f"pricing_snapshot_recalculation baseline: {row.changed} changed")
    return int(row.changed)


READ_MODEL_SET_BASED_SQL = sa.text(
    """
    WITH repaired AS (
        INSERT INTO order_read_model AS r (order_id, tenant_id, order_number, quote_number,
                                           status, total_amount, line_count, source_version,
                                           refreshed_at)
        SELECT o.id, o.tenant_id, o.order_number, q.quote_number, o.status, o.total_amount,
               o.line_count, o.version, clock_timestamp()
          FROM customer_order o LEFT JOIN quote q ON q.id = o.quote_id
         WHERE o.tenant_id = :tenant AND o.submitted_at >= :start AND o.submitted_at < :end
        ON CONFLICT (order_id) DO UPDATE
           SET order_number = EXCLUDED.order_number, quote_number = EXCLUDED.quote_number,
               status = EXCLUDED.status, total_amount = EXCLUDED.total_amount,
               line_count = EXCLUDED.line_count, source_version = EXCLUDED.source_version,
               refreshed_at = EXCLUDED.refreshed_at
         WHERE (r.order_number, r.quote_number, r.status, r.total_amount, r.line_count,
                r.source_version)
               IS DISTINCT FROM (EXCLUDED.order_number, EXCLUDED.quote_number, EXCLUDED.status,
                                 EXCLUDED.total_amount, EXCLUDED.line_count,
                                 EXCLUDED.source_version)
        RETURNING 1
    )
    SELECT count(*) AS repaired FROM repaired
    """
)


def read_model_baseline(url: URL, n: int, w: Window | None, home: Path) -> int:
    assert w is not None
    row = _scalar_row(
        url, READ_MODEL_SET_BASED_SQL, {"tenant": TENANT, "start": w.start, "end": w.end}
    )
    if row.repaired != n:
        raise SystemExit(f"read_model_repair baseline: {row.repaired} repaired")
    return int(row.repaired)


_CLEANUP_WHERE = f"""
       tenant_id = :tenant AND legal_hold = false AND status IN ('COMPLETED', 'FAILED_TERMINAL')
       AND created_at >= :start AND created_at < :end
       AND created_at < now() - interval '{CLEANUP_RETENTION_DAYS} days'
"""

CLEANUP_SELECT_SQL = sa.text(
    f"SELECT id, storage_path FROM temp_file WHERE {_CLEANUP_WHERE} ORDER BY id FOR UPDATE"
)

# the rows deleted and their complete tombstones (checksum of the bytes, deleted_at) at once
CLEANUP_DELETE_SQL = sa.text(
    f"""
    WITH gone AS (
        DELETE FROM temp_file WHERE {_CLEANUP_WHERE}
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
    params = {"tenant": TENANT, "start": w.start, "end": w.end}
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
        DELETE FROM temp_file WHERE {_CLEANUP_WHERE}
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
    params = {"tenant": TENANT, "start": w.start, "end": w.end}
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


# every eligible record of the window as CSV straight from the server (COPY), parsed by
# pyarrow's C++ reader into the archive's schema
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


@dataclass(frozen=True)
class SecondLimit:
    """A limit that also does work the one-transaction limit leaves out but the job must do,
    so that the job has a fair second figure beside the first (issue 24)."""

    baseline: Callable[[URL, int, Window | None, Path], int]
    label: str  # the table's limit column, short
    note: str  # what it does, for the section's notes


def _then_checks(
    job: str, baseline: Callable[[URL, int, Window | None, Path], int]
) -> Callable[[URL, int, Window | None, Path], int]:
    """``baseline``, then the job's own outcome checks and lag on the state it left: what a
    run does after its batches, before it may report success (its duration includes them)."""

    def measured(url: URL, n: int, w: Window | None, home: Path) -> int:
        changed = baseline(url, n, w, home)
        spec = get_spec(job)
        ctx = BatchContext(spec.name, _scope(w), "execute", uuid.uuid4())
        engine = engine_for(url)
        with engine.connect() as conn:
            failed = [c.name for c in spec.check(conn, ctx) if not c.passed]
            if spec.signals.lag is not None:
                spec.signals.lag(conn, ctx)
        engine.dispose()
        if failed:
            raise SystemExit(f"{job} second limit: outcome checks failed: {failed}")
        return changed

    return measured


_CHECKS_NOTE = (
    "the one statement above, then the job's own outcome checks and lag (`JobSpec.check`, "
    "`JobSpec.signals.lag`, the same statements on a new connection, every check required to pass): "
    "the proof of the outcome a run must give before it reports success, inside the job's "
    "duration and not in the first limit"
)

SECOND_LIMITS: dict[str, SecondLimit] = {
    "pricing_snapshot_recalculation": SecondLimit(
        _then_checks("pricing_snapshot_recalculation", pricing_baseline),
        "… + the job's outcome checks",
        _CHECKS_NOTE,
    ),
    "read_model_repair": SecondLimit(
        _then_checks("read_model_repair", read_model_baseline),
        "… + the job's outcome checks",
        _CHECKS_NOTE,
    ),
    "temp_file_cleanup": SecondLimit(
        cleanup_two_step_baseline,
        "hash + intents COMMITTED, then DELETE/complete + unlink",
        "the work the job must do that the limit above does not: the same hashes, but every "
        "intent tombstone written and COMMITTED before any unlink (the checksum durable before "
        "any byte goes), then in a second transaction one DELETE … RETURNING feeding the "
        "UPDATE that completes the intents, unlink, COMMIT — set-based over the whole window, "
        "without the job's batches, path-safety checks or outcome checks",
    ),
    "audit_archive": SecondLimit(
        audit_verified_baseline,
        "… + read back, digests compared, DELETE … RETURNING digest",
        "what the first limit does, plus the verification the job must do before it may "
        "delete: per day the file read back (sha256 of its bytes, parsed, the rows' digest in "
        "Arrow) and its records deleted by the job's own DELETE_DIGESTED, whose digest of the "
        "deleted rows must equal the file's; one transaction",
    ),
}


# ------------------------------------------------------------------------------ verification


def _one(url: URL, sql: str, params: dict[str, Any]) -> dict[str, Any]:
    engine = engine_for(url)
    with engine.connect() as conn:
        row = conn.execute(sa.text(sql), params).one()._asdict()
    engine.dispose()
    return row


def verify_quote(url: URL, n: int, w: Window | None, home: Path) -> dict[str, Any]:
    engine = engine_for(url)
    with engine.connect() as conn:
        row = conn.execute(QUOTE_VERIFY_SQL, {"tenant": TENANT}).one()._asdict()
    engine.dispose()
    ok = row["overdue"] == 0 and row["expired"] == row["events"] == row["quotes_with_event"] == n
    return {"ok": ok, **row}


def verify_checkout(url: URL, n: int, w: Window | None, home: Path) -> dict[str, Any]:
    row = _one(
        url,
        """
        SELECT (SELECT count(*) FROM checkout_session WHERE tenant_id = :t AND status = 'OPEN')
                   AS still_open,
               (SELECT count(*) FROM checkout_session
                 WHERE tenant_id = :t AND status = 'ABANDONED' AND version = 2
                   AND closed_at IS NOT NULL) AS abandoned,
               (SELECT count(DISTINCT aggregate_id) FROM outbox_event
                 WHERE event_type = 'CheckoutAbandoned') AS with_event,
               (SELECT count(*) FROM outbox_event) AS events
        """,
        {"t": TENANT},
    )
    ok = row["still_open"] == 0 and row["abandoned"] == row["with_event"] == row["events"] == n
    return {"ok": ok, **row}


def verify_pricing(url: URL, n: int, w: Window | None, home: Path) -> dict[str, Any]:
    assert w is not None
    from qo_ops.jobs.pricing_snapshot_recalculation import VERIFY_WINDOW

    engine = engine_for(url)
    with engine.connect() as conn:
        row = (
            conn.execute(VERIFY_WINDOW, {"tenant": TENANT, "start": w.start, "end": w.end})
            .one()
            ._asdict()
        )
        row["current_snapshots"] = conn.execute(
            sa.text("SELECT count(*) FROM pricing_snapshot WHERE price_book_version = 2")
        ).scalar_one()
    engine.dispose()
    ok = (
        row["quotes"] == n
        and row["missing"] == 0
        and row["mismatched"] == 0
        and row["current_snapshots"] == n
    )
    return {"ok": ok, **row}


def verify_read_model(url: URL, n: int, w: Window | None, home: Path) -> dict[str, Any]:
    row = _one(
        url,
        """
        SELECT count(*) AS orders, count(r.order_id) AS rows,
               count(*) FILTER (WHERE r.order_id IS NULL OR r.status <> o.status
                                  OR r.total_amount <> o.total_amount
                                  OR r.line_count <> o.line_count
                                  OR r.order_number <> o.order_number
                                  OR r.quote_number IS DISTINCT FROM q.quote_number
                                  OR r.source_version <> o.version) AS drifted
          FROM customer_order o LEFT JOIN order_read_model r ON r.order_id = o.id
          LEFT JOIN quote q ON q.id = o.quote_id
         WHERE o.tenant_id = :t
        """,
        {"t": TENANT},
    )
    ok = row["orders"] == row["rows"] == n and row["drifted"] == 0
    return {"ok": ok, **row}


def verify_cleanup(url: URL, n: int, w: Window | None, home: Path) -> dict[str, Any]:
    row = _one(
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
    row["objects_left"] = _count_files(home / OBJECTS_DIR)
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


# ------------------------------------------------------------------------------ cases


@dataclass(frozen=True)
class Case:
    job: str
    goal: float
    load: Callable[[int, Window | None], str]
    baseline: Callable[[URL, int, Window | None, Path], int]
    verify: Callable[[URL, int, Window | None, Path], dict[str, Any]]
    limit_label: str  # what the baseline is, short (the table's limit column)
    days_ago: int | None = None  # windowed: the window starts this many days ago
    env: dict[str, str] = field(default_factory=dict)  # besides QO_OPS_DATABASE_URL/HOME
    objects: bool = False  # temp_file_cleanup: the stored objects, written per measurement
    rows: int = 0  # eligible rows measured (profile.rows, or less for the slowest jobs)


# The two slowest jobs run on a share of profile.rows (never below the quick size) so that
# the section fits its time budget; their limit is measured at the same size.
SHARE = {"temp_file_cleanup": 0.1, "audit_archive": 0.4}


def rows_for(job: str, n: int) -> int:
    share = SHARE.get(job)
    return n if share is None else min(n, max(2_000, int(n * share)))


def _cases(n: int) -> list[Case]:
    cases = [
        Case(
            "quote_expiration",
            0.7,
            _quote_load,
            quote_baseline,
            verify_quote,
            "one UPDATE … RETURNING + INSERT outbox",
        ),
        Case(
            "abandoned_checkout_close",
            0.7,
            _checkout_load,
            checkout_baseline,
            verify_checkout,
            "one UPDATE … RETURNING + INSERT outbox",
            env={"QO_OPS_CHECKOUT_IDLE_HOURS": "24"},
        ),
        Case(
            "pricing_snapshot_recalculation",
            0.7,
            _pricing_load,
            pricing_baseline,
            verify_pricing,
            "one INSERT … SELECT GROUP BY … ON CONFLICT",
            days_ago=60,
        ),
        Case(
            "read_model_repair",
            0.7,
            _read_model_load,
            read_model_baseline,
            verify_read_model,
            "one INSERT … SELECT … ON CONFLICT",
            days_ago=60,
        ),
        Case(
            "temp_file_cleanup",
            0.7,
            _temp_file_load,
            cleanup_baseline,
            verify_cleanup,
            "hash + one DELETE/INSERT tombstones + unlink",
            days_ago=60,
            env={
                cleanup_job.RETENTION_ENV: str(CLEANUP_RETENTION_DAYS),
                cleanup_job.MAX_DELETE_ENV: str(rows_for("temp_file_cleanup", n)),
                cleanup_job.MAX_SHARE_ENV: "1.0",
            },
            objects=True,
        ),
        Case(
            "audit_archive",
            0.5,
            _audit_load,
            audit_baseline,
            verify_audit,
            "COPY out → pyarrow Parquet/day + one DELETE",
            days_ago=AUDIT_RETENTION_DAYS + 40,
            env={archive_job.RETENTION_ENV: str(AUDIT_RETENTION_DAYS)},
        ),
    ]
    return [replace(c, rows=rows_for(c.job, n)) for c in cases]


# ------------------------------------------------------------------------------ measuring


def _base_env() -> dict[str, str]:
    """The caller's environment without any QO_OPS_* setting (each run sets its own)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("QO_OPS_")}


def _check(case: Case, url: URL, n: int, w: Window | None, home: Path, label: str) -> dict:
    found = case.verify(url, n, w, home)
    if not found.pop("ok"):
        raise SystemExit(f"{case.job} {label}: the work was not done: {found} (expected {n})")
    return found


def run_job_cli(case: Case, url: URL, n: int, w: Window | None, home: Path) -> dict[str, Any]:
    """The real CLI in its own process, default batch size; verified afterwards."""
    cmd = [QO_OPS, "run", case.job, "--tenant", TENANT, *(w.cli() if w else [])]
    cmd += ["--mode", "execute", "--reason", "bench: jobs vs the limit", "--json"]
    if get_spec(case.job).destructive:  # its execute cites an approval, as on every path
        engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
        cmd += ["--approval", standing_approvals(engine)[case.job]]
        engine.dispose()
    env = {
        **_base_env(),
        "QO_OPS_DATABASE_URL": env_url(url),
        "QO_OPS_HOME": str(home),
        **case.env,
    }
    settle(url)
    measured = measure_command(cmd, env)
    if measured["returncode"] != 0:
        raise SystemExit(
            f"{case.job}: qo-ops run failed ({measured['returncode']}): "
            f"{str(measured['stdout'])[-1500:]} {str(measured['stderr'])[-1500:]}"
        )
    s = json.loads(str(measured["stdout"]))
    failed_checks = [c["name"] for c in s["checks"] if not c["passed"]]
    if (
        s["status"] != "success"
        or s["processed_count"] != n
        or s["succeeded_count"] != n
        or failed_checks
    ):
        raise SystemExit(f"{case.job}: qo-ops run did not do the work: {json.dumps(s)[:2000]}")
    verified = _check(case, url, n, w, home, "job")
    return {
        "rows": n,
        "duration_s": s["duration_ms"] / 1000,
        "wall_s": measured["wall_s"],
        "peak_rss_kb": measured["maxrss_kb"],
        "rows_per_s": n / (s["duration_ms"] / 1000),
        "rows_per_s_wall": n / float(measured["wall_s"]),  # type: ignore[arg-type]
        "batches": s["batches"],
        "batch_size": get_spec(case.job).defaults.batch_size,
        "batch_ms_p50": s["batch_ms_p50"],
        "batch_ms_p99": s["batch_ms_p99"],
        "batch_ms_max": s["batch_ms_max"],
        "tally": s["tally"],
        "verified": verified,
    }


def run_baseline(case: Case, url: URL, n: int, w: Window | None, home: Path) -> dict[str, Any]:
    settle(url)
    with stopwatch() as took:
        changed = case.baseline(url, n, w, home)
    verified = _check(case, url, n, w, home, "baseline")
    return {"rows": changed, "seconds": took[0], "rows_per_s": n / took[0], "verified": verified}


def _objects_tmp() -> str | None:
    """Where the stored objects of temp_file_cleanup are written: tmpfs when there is one. On
    a disk, unlinking an object the kernel has already written back costs 1.7–3 ms (ext4 with
    discard) against ~17 µs for one still in memory, and which of the two a run meets depends
    on writeback timing, not on the job: the figure would measure the disk's mood."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


def measure_case(case: Case, repeats: int) -> dict[str, Any]:
    """Template once; then per repeat a clone for the job, one for the baseline and one for
    the second limit where the job has one (the order rotating from repeat to repeat); last,
    the plans of one batch on the template."""
    n = case.rows
    w = _window(case.days_ago) if case.days_ago is not None else None
    short = case.job[:24]
    second = SECOND_LIMITS.get(case.job)
    kinds = ("job", "baseline", "second") if second else ("job", "baseline")
    runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in kinds}
    with fresh_database(f"{PREFIX}_{short}_tpl") as template:
        with stopwatch() as load_took:
            load_template(template, case.load(n, w))
        for i in range(repeats):
            order = kinds[i % len(kinds) :] + kinds[: i % len(kinds)]
            for kind in order:
                with (
                    cloned_database(template, f"{PREFIX}_{short}_{kind}") as url,
                    tempfile.TemporaryDirectory(
                        prefix="qo-ops-bench-jobs-", dir=_objects_tmp() if case.objects else None
                    ) as tmp,
                ):
                    home = Path(tmp)
                    if case.objects:
                        write_objects(home, n)
                    if kind == "job":
                        runs[kind].append(run_job_cli(case, url, n, w, home))
                    elif kind == "baseline":
                        runs[kind].append(run_baseline(case, url, n, w, home))
                    else:
                        assert second is not None
                        runs[kind].append(
                            run_baseline(replace(case, baseline=second.baseline), url, n, w, home)
                        )
        plans = explain_batches(case, template, n, w)  # last: it leaves dead rows behind
    return {
        "rows": n,
        "window": [w.first.isoformat(), w.last.isoformat()] if w else None,
        "load_s": load_took[0],
        **runs,
        "plans": plans,
    }


def measure_memory(sizes: tuple[int, ...], reuse: dict[int, list[int]]) -> dict[str, list[int]]:
    """Peak RSS of the quote_expiration CLI at each size: the throughput runs where the size
    is theirs, one run on a database of its own otherwise (peak RSS hardly varies)."""
    case = _cases(0)[0]
    found: dict[str, list[int]] = {}
    for n in sizes:
        if n in reuse:
            found[str(n)] = reuse[n]
            continue
        with (
            fresh_database(f"{PREFIX}_mem") as url,
            tempfile.TemporaryDirectory(prefix="qo-ops-bench-jobs-") as tmp,
        ):
            load_template(url, case.load(n, None))
            found[str(n)] = [run_job_cli(case, url, n, None, Path(tmp))["peak_rss_kb"]]
    return found


# ------------------------------------------------------------------------------ plans


def _transition_sql(job: str, ids: list[int], ctx: BatchContext) -> tuple[sa.TextClause, dict]:
    """The statement a job's batch applies to ``ids``, with the job's own parameters."""
    scope = ctx.scope
    if job == "quote_expiration":
        from qo_ops.jobs.quote_expiration import EXPIRE_QUOTE_BATCH

        return EXPIRE_QUOTE_BATCH, {"ids": ids, "tenant": TENANT, "last_id": ids[-1]}
    if job == "abandoned_checkout_close":
        from qo_ops.jobs.abandoned_checkout_close import CLOSE_CHECKOUT_BATCH

        params = {"ids": ids, "tenant": TENANT, "hours": 24, "last_id": ids[-1]}
        return CLOSE_CHECKOUT_BATCH, params
    if job == "pricing_snapshot_recalculation":
        from qo_ops.jobs.pricing_snapshot_recalculation import RECALCULATE_BATCH

        params = {"ids": ids, "tenant": TENANT, "run": ctx.job_run_id, "last": ids[-1]}
        return RECALCULATE_BATCH, params
    if job == "read_model_repair":
        from qo_ops.jobs.read_model_repair import REPAIR_READ_MODEL_BATCH

        return REPAIR_READ_MODEL_BATCH, {"ids": ids, "tenant": TENANT, "last_id": ids[-1]}
    start, end = scope.window_bounds()
    if job == "temp_file_cleanup":
        params = {"ids": ids, "tenant": TENANT, "start": start, "end": end}
        params |= {"run": str(ctx.job_run_id), "reason": "bench explain"}
        return cleanup_job._DELETE_ROWS, params | {"days": CLEANUP_RETENTION_DAYS}
    assert job == "audit_archive"
    params = {"t": TENANT, "lo": min(ids), "hi": max(ids), "ws": start, "we": end}
    return archive_format.DELETE_DIGESTED, params


def _plan(rows: Any) -> list[str]:
    return [line if len(line) <= 300 else line[:300] + " …" for line in rows]


def _explain_selection(conn: Any, spec: Any, ctx: BatchContext, limit: int) -> list[str]:
    query = spec.eligible(ctx).limit(limit)
    if spec.batching.locks is not None:
        query = query.with_for_update(skip_locked=True, of=spec.batching.locks.of)
    compiled = query.compile(dialect=conn.dialect)
    return _plan(
        conn.exec_driver_sql(
            "EXPLAIN (ANALYZE, BUFFERS) " + str(compiled), dict(compiled.params)
        ).scalars()
    )


def explain_batches(case: Case, url: URL, n: int, w: Window | None) -> dict[str, list[str]]:
    """EXPLAIN (ANALYZE, BUFFERS) of the job's own batch statements at this size, rolled
    back: the first batch's selection and transition, and — for the jobs whose transition
    takes a row out of the selection, or moves their cursor — the selection again after
    half of the rows were processed by the job's own transition (where a selection that
    walks what earlier batches left behind shows)."""
    spec = get_spec(case.job)
    batch = spec.defaults.batch_size
    scope = _scope(w)
    limits = Limits(lease_ttl_s=30.0, batch_size=batch)
    ctx = BatchContext(spec.name, scope, "execute", uuid.uuid4(), limits=limits)
    saved = {k: os.environ.get(k) for k in case.env}
    os.environ.update(case.env)  # the job's settings are read from the environment
    engine = engine_for(url)
    plans: dict[str, list[str]] = {}
    try:
        with engine.connect() as conn, conn.begin() as tx:
            plans["first_selection"] = _explain_selection(conn, spec, ctx, batch)
            ids = [int(i) for i in conn.execute(spec.eligible(ctx).limit(batch)).scalars()]
            statement, params = _transition_sql(case.job, ids, ctx)
            plans["first_transition"] = _plan(
                conn.execute(
                    sa.text("EXPLAIN (ANALYZE, BUFFERS) " + statement.text), params
                ).scalars()
            )
            half = (
                list(conn.execute(spec.eligible(ctx).limit(max(1, n // 2))).scalars())
                if spec.then is None
                else []
            )
            if half:  # (none left when the first batch took them all)
                outcome = spec.transition(conn, ctx, half)
                if outcome.cursor is not None:
                    ctx.cursor = outcome.cursor
                if outcome.position is not None:
                    # what the selection costs without the position: every batch walks the
                    # rows earlier batches already took out of the selection
                    plans["mid_run_selection_from_start"] = _explain_selection(
                        conn, spec, ctx, batch
                    )
                    ctx.position = outcome.position
                plans["mid_run_selection"] = _explain_selection(conn, spec, ctx, batch)
            tx.rollback()
    finally:
        engine.dispose()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return plans


def _exec_ms(plan: list[str]) -> float | None:
    for line in reversed(plan):
        if line.startswith("Execution Time:"):
            return float(line.split(":")[1].split()[0])
    return None


# ------------------------------------------------------------------------------ the section

BASELINE_NOTES = {
    "quote_expiration": "the job's own EXPIRE_QUOTE_BATCH (UPDATE … RETURNING + INSERT of the "
    "QuoteExpired outbox events ON CONFLICT DO NOTHING) over every eligible quote at once "
    "(bench_quote_expiration's SET_BASED_SQL)",
    "abandoned_checkout_close": "the job's CLOSE_CHECKOUT_BATCH over every idle OPEN session "
    "at once (UPDATE … RETURNING + INSERT of CheckoutAbandoned events)",
    "pricing_snapshot_recalculation": "the job's RECALCULATE_BATCH over every quote of the "
    "window at once (one INSERT … SELECT quote ⟕ quote_line GROUP BY … ON CONFLICT DO UPDATE "
    "WHERE different); no checkpoint row",
    "read_model_repair": "the job's REPAIR_READ_MODEL_BATCH over every order of the window at "
    "once (one INSERT … SELECT order ⟕ quote ON CONFLICT DO UPDATE WHERE different)",
    "temp_file_cleanup": "one transaction: SELECT the eligible rows FOR UPDATE, sha256 of each "
    "stored object (the tombstone's checksum is part of the job's end state), one DELETE … "
    "RETURNING feeding the INSERT of the completed tombstones, unlink of exactly the deleted "
    "rows' objects, COMMIT — the job's end state without its per-batch intent tombstones, "
    "path-safety checks or second transaction",
    "audit_archive": "one transaction: COPY (SELECT the window's eligible records) TO STDOUT "
    "as CSV, parsed by pyarrow's C++ reader into the archive schema, one zstd Parquet file per "
    "day written with the job's own durable write (tmp, fsync, rename, fsync dir), one "
    "VERIFIED manifest row per file, one DELETE of the records, COMMIT. This is the physical "
    "limit of moving the rows from the table into durable Parquet files; it does not read "
    "the files back or compare row digests, which the job does before it may delete (its "
    "second limit does)",
}


def _throughput(
    case: Case, r: dict[str, Any], limit: str, label: str
) -> tuple[Row, dict[str, float]]:
    """The job's rate beside one of its limits (``r[limit]``'s runs): the row and its summary.
    Repeat i's job and limits ran back to back on clones of one template, so the ratio is
    taken pair by pair."""
    job_rates = [x["rows_per_s"] for x in r["job"]]
    limit_rates = [x["rows_per_s"] for x in r[limit]]
    job, lim = Spread.of(job_rates), Spread.of(limit_rates)
    ratio = pairwise_ratios(job_rates, limit_rates)
    row = Row(
        what=f"throughput: {case.job}",
        size=f"{case.rows:,} rows, batch {r['job'][0]['batch_size']:,}",
        figure=job.show(_rate),
        limit=f"{lim.show(_rate)} ({label})",
        ratio=ratio.mid,
        goal=f">= {case.goal}",
        met=ratio.mid >= case.goal,
        ratio_range=ratio.range,
    )
    summary = {
        "job_rows_per_s": job.mid,
        "limit_rows_per_s": lim.mid,
        "ratio": ratio.mid,
        "ratio_min": ratio.low,
        "ratio_max": ratio.high,
    }
    return row, summary


def run(profile: Profile) -> Section:
    cases = _cases(profile.rows)
    results: dict[str, dict[str, Any]] = {}
    for case in cases:
        print(f"   {case.job} ({case.rows:,} rows)", flush=True)
        results[case.job] = measure_case(case, profile.repeats)

    rows: list[Row] = []
    for case in cases:
        r = results[case.job]
        row, r["summary"] = _throughput(case, r, "baseline", case.limit_label)
        wall = Spread.of([x["rows_per_s_wall"] for x in r["job"]])
        ratio_wall = pairwise_ratios(
            [x["rows_per_s_wall"] for x in r["job"]], [x["rows_per_s"] for x in r["baseline"]]
        )
        r["summary"] |= {"job_rows_per_s_wall": wall.mid, "ratio_wall": ratio_wall.mid}
        row.note = f"ratio by CLI wall time {ratio_wall.show(lambda v: f'{v:.2f}')}"
        rows.append(row)
        second = SECOND_LIMITS.get(case.job)
        if second is not None:
            row, r["summary"]["second"] = _throughput(case, r, "second", second.label)
            row.what += ", second limit (the work it must do too)"
            rows.append(row)

    print(f"   peak RSS at {', '.join(f'{m:,}' for m in profile.memory_sizes)}", flush=True)
    quote_runs = results["quote_expiration"]
    reuse = {quote_runs["rows"]: [x["peak_rss_kb"] for x in quote_runs["job"]]}
    memory = measure_memory(profile.memory_sizes, reuse)
    rss = {int(k): median([float(x) for x in v]) for k, v in memory.items()}
    small, big = min(rss), max(rss)
    rss_ratio = rss[big] / rss[small]
    rows.append(
        Row(
            what="peak RSS: quote_expiration CLI",
            size=" / ".join(f"{k:,}" for k in sorted(rss)) + " rows",
            figure=" / ".join(_mib(rss[k]) for k in sorted(rss)),
            limit=f"{_mib(rss[small])} (at {small:,} rows)",
            ratio=rss_ratio,
            goal=f"<= {GOAL_RSS_RATIO} (flat)",
            met=rss_ratio <= GOAL_RSS_RATIO,
        )
    )

    for case in cases:
        jobs = results[case.job]["job"]
        p50 = median([x["batch_ms_p50"] for x in jobs])
        p99 = Spread.of([x["batch_ms_p99"] for x in jobs])
        worst = max(x["batch_ms_max"] for x in jobs)
        batches = int(median([x["batches"] for x in jobs]))
        external = get_spec(case.job).then is not None
        rows.append(
            Row(
                what=f"batch transaction: {case.job}",
                size=f"{batches:,} batch(es) of ≤ {jobs[0]['batch_size']:,}",
                figure=f"p50 {p50:,.0f} / p99 {p99.show(lambda v: f'{v:,.0f}')} / "
                f"max {worst:,.0f} ms",
                limit="2 transactions + file phase (upper bound)"
                if external
                else "max ≈ longest lock hold",
                ratio=None,
                goal=f"p99 < {GOAL_P99_MS:.0f} ms",
                met=p99.mid < GOAL_P99_MS,
            )
        )

    return Section(
        TITLE,
        rows,
        _notes(profile, cases, results, memory),
        raw={"jobs": results, "peak_rss_kb": memory, "rows": profile.rows},
    )


def _plan_note(job: str, plans: dict[str, list[str]]) -> str:
    parts = []
    for key, label in (
        ("first_selection", "first selection"),
        ("mid_run_selection", "selection with half the rows done"),
        ("mid_run_selection_from_start", "the same from the window's start (no position)"),
        ("first_transition", "first transition"),
    ):
        ms = _exec_ms(plans.get(key, []))
        if ms is not None:
            parts.append(f"{label} {ms:,.1f} ms")
    scans = sorted(
        {
            line.strip().split("  (")[0].removeprefix("->  ")
            for plan in plans.values()
            for line in plan
            if "Seq Scan on" in line
        }
    )
    seq = f"; sequential scans: {', '.join(scans)}" if scans else "; no sequential scan"
    return f"{job}: {', '.join(parts)}{seq}"


def _notes(
    profile: Profile,
    cases: list[Case],
    results: dict[str, dict[str, Any]],
    memory: dict[str, list[int]],
) -> list[str]:
    capped = [c for c in cases if c.rows != profile.rows]
    notes = [
        "Job figure: eligible rows / the run's own duration_ms, from `qo-ops run JOB --tenant "
        "tenant-001 [--from D --to D] --mode execute --reason … --json` in its own process at "
        "the job's default batch size (duration_ms covers eligibility count, all batches and "
        "the outcome checks, not the interpreter's start-up; the ratio by CLI wall time is in "
        "each row's note). Limit: the same end state reached set-based in ONE transaction, "
        "timed from connect to commit. Each measurement on its own CREATE DATABASE … TEMPLATE "
        "clone of a generate_series load (VACUUM ANALYZE'd), after CHECKPOINT and no "
        "autovacuum running; job and baseline runs alternate (repeat i: job then baseline, "
        "or baseline then job); figures are medians of "
        f"{profile.repeats} run(s) with (min–max), the ratio the median of each repeat's "
        "job/baseline pair with its lowest and highest. Every run is verified afterwards (job: status success, "
        "processed = mutated = rows, all checks passed; both: the end state counted in the "
        "database and on disk) or the suite stops.",
        *[f"Limit of {c.job}: {BASELINE_NOTES[c.job]}." for c in cases],
        *[
            f"Second limit of {c.job}: {SECOND_LIMITS[c.job].note}."
            for c in cases
            if c.job in SECOND_LIMITS
        ],
        "Data: one tenant; quote_expiration: ACTIVE quotes all past expiry (expiry order ≠ id "
        "order); abandoned_checkout_close: OPEN sessions idle 2 days to ~1 year; "
        "pricing_snapshot_recalculation: quotes with 1-3 lines and a snapshot for price book 1 "
        "only (the job adds one for the current book 2); read_model_repair: orders with their "
        "quotes, every read-model row drifted (a third missing, the rest a source version "
        "behind, a third of all with a wrong total); temp_file_cleanup: terminal files, not on "
        f"hold, each with a stored object of {TEMP_FILE_BYTES:,} bytes (hashing cost is then "
        "negligible: the figure is the job's per-file overhead), written for each run "
        f"{'on tmpfs (/dev/shm)' if _objects_tmp() else 'on disk (no tmpfs here)'}, so that "
        "disk writeback timing (an unlink of a written-back file costs 1.7–3 ms on this ext4, "
        "of one still in memory ~17 µs) does not decide the figure of either side; audit_archive: records in "
        f"id = time order. Windowed jobs span {SPAN_DAYS} UTC days and run with --from/--to "
        "covering exactly those days. Time follows id, as in a table filled over time (idle, "
        "created and submitted order = id order); quote_expiration's expiry order interleaves "
        "(7/14/30/90-day validity). With the walk order scattered over id order instead "
        "(mod(i·7919, n), a batch's rows on as many heap pages as it has rows: the worst case), "
        "an earlier default run measured ratios of 0.50 (abandoned_checkout_close), 0.32 "
        "(pricing), 0.22 (read_model_repair), 0.15 (temp_file_cleanup). "
        "pricing_snapshot_recalculation's load sets quote.total_amount by one UPDATE after the "
        "lines, so its quote heap is half free space after the VACUUM.",
        "Environment of every run: all QO_OPS_* variables of the caller removed; "
        "QO_OPS_DATABASE_URL = the clone, QO_OPS_HOME = a fresh temporary directory (stored "
        "objects, archive files). abandoned_checkout_close: QO_OPS_CHECKOUT_IDLE_HOURS=24 (the "
        "default, explicit). temp_file_cleanup: QO_OPS_TEMP_FILE_RETENTION_DAYS="
        f"{CLEANUP_RETENTION_DAYS} (default), QO_OPS_CLEANUP_MAX_DELETE = the rows measured "
        "and QO_OPS_CLEANUP_MAX_SHARE=1.0 — the anomaly thresholds configured to admit exactly "
        "this deletion (every file of the tenant is eligible, so the default 0.5 share and "
        "10,000 cap would stop it); QO_OPS_CLEANUP_OVERRIDE is not set, so no anomaly_override "
        "audit row is written (verified: none). audit_archive: QO_OPS_AUDIT_RETENTION_DAYS="
        f"{AUDIT_RETENTION_DAYS} (default, explicit); records are "
        f"{AUDIT_RETENTION_DAYS + 40 - SPAN_DAYS + 1}-{AUDIT_RETENTION_DAYS + 40} days old.",
        "Peak RSS: maxrss of the qo-ops process (fresh helper per run, RUSAGE_CHILDREN); at "
        f"{profile.rows:,} rows the throughput runs (median), at the other sizes one run "
        "each on its own database. Raw: "
        + ", ".join(f"{int(k):,}: {', '.join(_mib(v) for v in vs)}" for k, vs in memory.items())
        + ".",
        "Batch transaction times are the runner's own (guard → select → transition → "
        "checkpoint → counters → commit, per batch; summary batch_ms_p50/p99/max, median of "
        "the runs' p50/p99, max of their max). A batch holds its row locks until its commit, so "
        "max ≈ the longest lock hold. For temp_file_cleanup and audit_archive a batch is two "
        "transactions with the file phase between them (no transaction open, no lock held), so "
        "their figures are an upper bound of any one lock hold.",
        "EXPLAIN (ANALYZE, BUFFERS) of one default-size batch at this size, on the template "
        "after the measurements, rolled back (full plans in raw.jobs.<job>.plans): "
        + "; ".join(_plan_note(c.job, results[c.job]["plans"]) for c in cases)
        + ".",
    ]
    if capped:
        notes.append(
            "Smaller runs for the slowest jobs, to keep the section within its time budget: "
            + ", ".join(f"{c.job} at {c.rows:,} rows" for c in capped)
            + f" (of {profile.rows:,}); their limit is measured at the same size."
        )
    return notes
