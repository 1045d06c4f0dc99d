"""Migrations while the business writes: ``qo-ops db upgrade`` from the oldest revision a
deployment may still be at (:data:`FROM_REVISION`) to head, over ``profile.big_rows`` rows in
every table a migration of that range touches, while the application writes to them.

Tables: each migration from 0013 to head read for what it locks or reads —
audit_record (0013: an index), customer_order (0014: an index; its grants), job_run (0016,
0017, 0018: ADD COLUMN, an ACCESS EXCLUSIVE lock for a moment), downstream_breaker (0016: ADD
COLUMN with constant defaults). 0014's grants on job_lease, job_checkpoint,
delivery_attempt_item, outbox_event and order_resubmission take no lock on those tables and
read none of their rows (a GRANT updates the catalog only), and 0015 to 0019 create new
tables: none of them is loaded.

Data: :data:`TENANTS` tenants first, then ``big_rows`` rows in each table, set-based
(``generate_series``, secondary indexes rebuilt after, as the demo loader does), at the
schema of :data:`FROM_REVISION`; then VACUUM ANALYZE and a checkpoint.

Measured, in one run (a maximum is never a median):

- **baseline**: one writer thread per table, one write every :data:`PACE_S` (a single-row
  INSERT; on downstream_breaker, an UPDATE of a random row, as runs do), each timed, for
  :data:`BASELINE_S` with no migration running;
- **during the upgrade**: the same writers, and one reader (the GoCardless pattern) whose
  transaction holds an ACCESS SHARE lock on job_run from before the upgrade began until
  :data:`READER_HOLD_S` after the upgrade first queued behind it (its first ALTER TABLE
  job_run), so that the lock-timeout retry path runs; then ``migrate.upgrade`` to head, in a
  process of its own as ``qo-ops db upgrade`` is. Its duration and lock timeouts are the
  UpgradeReport's; each writer's p50, p99 and max over the writes that began while it ran,
  beside the goal: max ≤ the runner's lock_timeout + 0.5 s.

Verified: the database is at head with both new indexes valid, the upgrade is recorded in
schema_migration with its lock timeouts, every timed write landed (rows counted), and no
write failed.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import random
import re
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import URL, Engine

from bench.common import engine_for, fresh_database, percentile, settle, stopwatch
from bench.suite import Profile, Row, Section
from qo_ops.db import migrate

TITLE = "Migrations while the business writes"
PREFIX = "qo_ops_bench_migrations"
FROM_REVISION = "0012"  # the oldest revision a deployment may still be at
TENANTS = 100
PACE_S = 0.020  # one write per table every 20 ms
BASELINE_S = {"quick": 3.0}  # else DEFAULT_BASELINE_S
DEFAULT_BASELINE_S = 10.0
READER_HOLD_S = 3.0
MARGIN_S = 0.5  # the goal: a write waits at most lock_timeout + this
SLOW_S = 0.050  # a write this slow is reported with what it waited for
NEW_INDEXES = ("ix_audit_record_tenant_day_id", "ix_customer_order_needs_review")
WRITER = "bench-writer"  # marks the writers' rows

TENANT_OF = "'tenant-' || lpad((1 + g % CAST(:t AS int))::text, 3, '0')"
# when, spread back over a year from now, oldest first
AT = "now() - make_interval(secs => (CAST(:n AS int) - g) * (31536000.0 / CAST(:n AS int)))"

LOAD = {
    "audit_record": f"""
        INSERT INTO audit_record (tenant_id, occurred_at, actor_ref, action, entity_type,
                                  entity_id, details)
        SELECT {TENANT_OF}, {AT}, 'user-' || (g % 997),
               (ARRAY['create', 'update', 'submit', 'approve'])[1 + g % 4], 'order',
               (g / 4)::text, jsonb_build_object('n', g)
          FROM generate_series(1, CAST(:n AS int)) AS g
    """,
    "customer_order": f"""
        INSERT INTO customer_order (tenant_id, order_number, status, total_amount, line_count,
                                    submitted_at, updated_at, needs_manual_review)
        SELECT {TENANT_OF}, 'B-' || g,
               CASE g % 20 WHEN 0 THEN 'CANCELLED' WHEN 1 THEN 'FAILED' WHEN 2 THEN 'SUBMITTED'
                           WHEN 3 THEN 'IN_FULFILLMENT' ELSE 'COMPLETED' END,
               (g % 100000) / 100.0, 1 + g % 9, at, at, g % 1000 = 0
          FROM generate_series(1, CAST(:n AS int)) AS g, LATERAL (SELECT {AT} AS at) c
    """,
    "job_run": f"""
        INSERT INTO job_run (id, job_name, scope, mode, trigger_type, requester, reason,
                             dagster_run_id, owner_id, created_at, started_at, heartbeat_at,
                             finished_at, status, eligible_count, processed_count,
                             succeeded_count)
        SELECT lpad(to_hex(g), 32, '0')::uuid,
               (ARRAY['quote_expiration', 'delivery_retry', 'notification_publish',
                      'order_reconciliation', 'audit_archive'])[1 + g % 5],
               {TENANT_OF}, CASE WHEN g % 20 = 0 THEN 'dry_run' ELSE 'execute' END,
               CASE WHEN g % 100 = 0 THEN 'manual' ELSE 'schedule' END, 'dagster:schedule',
               CASE WHEN g % 100 = 0 THEN 'incident ' || (g % 37) END,
               CASE WHEN g % 100 = 0 THEN 'dagster-' || g END, 'bench', at, at,
               at + interval '30 seconds', at + interval '30 seconds',
               CASE WHEN g % 50 = 0 THEN 'failed' WHEN g % 10 = 0 THEN 'no_work'
                    ELSE 'success' END, g % 50, g % 50, g % 50
          FROM generate_series(1, CAST(:n AS int)) AS g, LATERAL (SELECT {AT} AS at) c
    """,
    # one row per downstream origin: as many origins as rows in the other tables
    "downstream_breaker": """
        INSERT INTO downstream_breaker (downstream, state, reason, changed_at)
        SELECT 'http://downstream-' || g || '.bench:8080', 'closed', 'bench', now()
          FROM generate_series(1, CAST(:n AS int)) AS g
    """,
}
TABLES = tuple(LOAD)

# What the application writes, one row a statement, autocommit.
WRITES = {
    "audit_record": (
        "INSERT INTO audit_record (tenant_id, occurred_at, actor_ref, action, entity_type, "
        f"entity_id) VALUES (:tenant, now(), '{WRITER}', 'update', 'order', :key)"
    ),
    "customer_order": (
        "INSERT INTO customer_order (tenant_id, order_number, status, total_amount, "
        "line_count, submitted_at, updated_at) VALUES (:tenant, 'W-' || :key, 'SUBMITTED', "
        "42.00, 2, now(), now())"
    ),
    "job_run": (
        "INSERT INTO job_run (id, job_name, scope, mode, trigger_type, owner_id, status) "
        f"VALUES (gen_random_uuid(), 'quote_expiration', :tenant, 'execute', 'api', "
        f"'{WRITER}', 'accepted')"
    ),
    "downstream_breaker": (
        "UPDATE downstream_breaker SET opened_count = opened_count + 1, changed_at = now(), "
        f"reason = '{WRITER}' WHERE downstream = 'http://downstream-' || :row || '.bench:8080'"
    ),
}
# The writes that landed: rows the inserts made, updates counted by opened_count.
LANDED = {
    "audit_record": f"SELECT count(*) FROM audit_record WHERE actor_ref = '{WRITER}'",
    "customer_order": "SELECT count(*) FROM customer_order WHERE order_number LIKE 'W-%'",
    "job_run": f"SELECT count(*) FROM job_run WHERE owner_id = '{WRITER}'",
    "downstream_breaker": (
        f"SELECT coalesce(sum(opened_count), 0) FROM downstream_breaker WHERE reason = '{WRITER}'"
    ),
}


def _seconds(setting: str) -> float:
    units = {"ms": 0.001, "s": 1.0, "min": 60.0}
    for unit, factor in units.items():
        if setting.endswith(unit) and setting[: -len(unit)].isdigit():
            return int(setting[: -len(unit)]) * factor
    raise ValueError(f"cannot read {setting!r} as seconds")


LOCK_TIMEOUT_S = _seconds(migrate.LOCK_TIMEOUT)
GOAL_S = LOCK_TIMEOUT_S + MARGIN_S


def _load_table(url: URL, table: str, rows: int) -> float:
    from qo_ops.demo.data import _bulk_load

    engine = engine_for(url)
    with stopwatch() as took, engine.begin() as conn:
        conn.exec_driver_sql("SET LOCAL synchronous_commit = off")
        conn.exec_driver_sql("SET LOCAL work_mem = '256MB'")
        with _bulk_load(conn, [table]):
            conn.execute(sa.text(LOAD[table]), {"n": rows, "t": TENANTS})
    engine.dispose()
    return took[0]


def _load(url: URL, rows: int) -> dict[str, Any]:
    """Tenants, then ``rows`` rows in each table (two at a time: two cores), VACUUM ANALYZE."""
    engine = engine_for(url)
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO tenant (id, name) SELECT 'tenant-' || lpad(t::text, 3, '0'), "
                "'Tenant ' || t FROM generate_series(1, CAST(:t AS int)) AS t"
            ),
            {"t": TENANTS},
        )
    with ThreadPoolExecutor(max_workers=2) as pool:
        took = dict(zip(TABLES, pool.map(lambda t: _load_table(url, t, rows), TABLES), strict=True))

    def vacuum(table: str) -> None:
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql(f"VACUUM ANALYZE {table}")

    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(vacuum, TABLES))
    with engine.connect() as conn:
        counts = {
            t: int(conn.scalar(sa.text(f"SELECT count(*) FROM {t}")) or 0)  # noqa: S608
            for t in TABLES
        }
        sizes = {
            t: int(
                conn.scalar(
                    sa.text("SELECT pg_total_relation_size(CAST(:t AS regclass))"), {"t": t}
                )
                or 0
            )
            for t in TABLES
        }
    engine.dispose()
    return {"counts": counts, "bytes": sizes, "load_s": took}


@dataclass
class Writer:
    """One table's application writes: one every PACE_S, each timed (start, seconds)."""

    table: str
    rows: int
    samples: list[tuple[float, float]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    pid: int = 0  # its server process
    waited: list[tuple[float, str]] = field(default_factory=list)  # (when, wait event) sampled

    def params(self, i: int, pick: random.Random) -> dict[str, Any]:
        if self.table == "downstream_breaker":
            return {"row": str(pick.randint(1, self.rows))}
        return {"tenant": f"tenant-{1 + i % TENANTS:03d}", "key": f"{time.time_ns()}-{i}"}

    def run(self, engine: Engine, stop: threading.Event) -> None:
        statement = sa.text(WRITES[self.table])
        pick = random.Random(self.table)
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            self.pid = int(conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one())
            i = 0
            next_at = time.monotonic()
            while not stop.is_set():
                now = time.monotonic()
                if now < next_at:
                    stop.wait(next_at - now)
                    continue
                began = time.monotonic()
                try:
                    conn.execute(statement, self.params(i, pick))
                except sa.exc.DBAPIError as exc:
                    self.errors.append(str(exc.orig).splitlines()[0])
                    conn.rollback()
                else:
                    ended = time.monotonic()
                    self.samples.append((began, ended - began))
                i += 1
                next_at = max(began + PACE_S, time.monotonic())  # no burst to catch up

    def between(self, start: float, end: float) -> list[float]:
        return [s for began, s in self.samples if start <= began <= end]

    def slow(self, start: float, end: float) -> list[tuple[float, float, str]]:
        """The writes over SLOW_S that began in [start, end]: (began, seconds, what their
        server process was seen waiting for, most often first)."""
        out = []
        for began, took in self.samples:
            if start <= began <= end and took > SLOW_S:
                seen = Counter(e for at, e in self.waited if began <= at <= began + took)
                what = ", ".join(f"{e} ×{n}" for e, n in seen.most_common(3)) or "no wait seen"
                out.append((began, took, what))
        return out


# What each writer's server process waits for, while it waits (sampled every 20 ms).
WAIT_EVENTS = sa.text(
    "SELECT pid, wait_event_type || ':' || wait_event FROM pg_stat_activity "
    "WHERE pid = ANY(:pids) AND state = 'active' AND wait_event IS NOT NULL"
)


def _sample_waits(engine: Engine, writers: dict[str, Writer], stop: threading.Event) -> None:
    until = time.monotonic() + 60
    while not all(w.pid for w in writers.values()) and time.monotonic() < until:
        stop.wait(0.01)
    by_pid = {w.pid: w for w in writers.values()}
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        while not stop.is_set():
            now = time.monotonic()
            for pid, event in conn.execute(WAIT_EVENTS, {"pids": list(by_pid)}):
                by_pid[pid].waited.append((now, event))
            stop.wait(0.02)


@contextmanager
def _writing(engine: Engine, rows: int) -> Iterator[dict[str, Writer]]:
    writers = {t: Writer(t, rows) for t in TABLES}
    stop = threading.Event()
    threads = [
        threading.Thread(target=w.run, args=(engine, stop), daemon=True) for w in writers.values()
    ]
    threads.append(
        threading.Thread(target=_sample_waits, args=(engine, writers, stop), daemon=True)
    )
    for t in threads:
        t.start()
    try:
        yield writers
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)


WAITING_ON_JOB_RUN = sa.text(
    "SELECT count(*) FROM pg_locks WHERE locktype = 'relation' "
    "AND relation = CAST('job_run' AS regclass) AND mode = 'AccessExclusiveLock' AND NOT granted"
)


@dataclass
class Reader:
    """A long transaction holding job_run (ACCESS SHARE) from before the upgrade until
    READER_HOLD_S after the upgrade first queues an ACCESS EXCLUSIVE lock behind it."""

    began: float = 0.0
    queued: float | None = None  # when the upgrade was first seen waiting for job_run
    ended: float = 0.0
    ready: threading.Event = field(default_factory=threading.Event)

    def run(self, engine: Engine, done: threading.Event) -> None:
        with engine.connect() as conn, engine.connect() as watch:
            conn.execute(
                sa.text("SELECT count(*) FROM job_run WHERE created_at > now() - interval '1 day'")
            )  # a report's read: its lock is held until the transaction ends
            self.began = time.monotonic()
            self.ready.set()
            until: float | None = None
            while not done.is_set() and (until is None or time.monotonic() < until):
                if self.queued is None and watch.scalar(WAITING_ON_JOB_RUN):
                    self.queued = time.monotonic()
                    until = self.queued + READER_HOLD_S
                watch.rollback()
                done.wait(0.02)
            conn.rollback()
            self.ended = time.monotonic()


@contextmanager
def _commits(engine: Engine) -> Iterator[list[float]]:
    """When each migration committed: the commits, on ``engine``, of a transaction that
    wrote the runner's version table (one per migration, in order)."""
    version_write = re.compile(rf"^\s*(?:UPDATE|INSERT INTO)\s+{migrate.VERSION_TABLE}\b", re.I)
    pending: set[Any] = set()
    times: list[float] = []

    def execute(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if version_write.match(statement):
            pending.add(conn)

    def commit(conn: Any) -> None:
        if conn in pending:
            pending.discard(conn)
            times.append(time.monotonic())

    sa.event.listen(engine, "before_cursor_execute", execute)
    sa.event.listen(engine, "commit", commit)
    try:
        yield times
    finally:
        sa.event.remove(engine, "before_cursor_execute", execute)
        sa.event.remove(engine, "commit", commit)


# A migration's own lock_timeout (SET LOCAL), in place of the runner's for its transaction.
OWN_LOCK_TIMEOUT = re.compile(r"SET LOCAL lock_timeout = '([0-9]+[a-z]+)'")


def _own_lock_timeouts(revisions: list[str]) -> dict[str, str]:
    """The migrations among ``revisions`` that set their own lock_timeout, and its value."""
    script = migrate.script_directory()
    found = {}
    for revision in revisions:
        path = script.get_revision(revision).path
        match = OWN_LOCK_TIMEOUT.search(Path(path).read_text(encoding="utf-8"))
        if match:
            found[revision] = match.group(1)
    return found


def _baseline(engine: Engine, rows: int, seconds: float) -> dict[str, Writer]:
    with _writing(engine, rows) as writers:
        time.sleep(seconds)
    return writers


def _migrator(url: str, go: Any, out: Any) -> None:
    """The upgrade, in a process of its own as ``qo-ops db upgrade`` is (the writers' timings
    then never include Alembic's Python work): waits for ``go``, sends back the
    UpgradeReport, when it began and ended, and when each migration committed."""
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    migrate.script_directory()  # Alembic imported, as a CLI process has it before it starts
    out.send("ready")
    go.wait()
    with _commits(engine) as commits:
        start = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process
        try:
            report = migrate.upgrade(
                engine, requested_by="bench", reason="bench: migrations while the business writes"
            )
        except Exception as exc:
            out.send({"error": f"{type(exc).__name__}: {exc}"})
            return
        finally:
            end = time.monotonic()
            engine.dispose()
    out.send({"report": report, "start": start, "end": end, "commits": commits})


def _upgrade(engine: Engine, rows: int) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")  # never fork a process that runs threads
    go = ctx.Event()
    results, out = ctx.Pipe(duplex=False)
    url = engine.url.render_as_string(hide_password=False)
    child = ctx.Process(target=_migrator, args=(url, go, out), daemon=True)
    child.start()
    assert results.poll(120) and results.recv() == "ready", "the migrating process did not start"
    done = threading.Event()
    reader = Reader()
    reader_thread = threading.Thread(target=reader.run, args=(engine, done), daemon=True)
    with _writing(engine, rows) as writers:
        time.sleep(1.0)  # the writers at their pace
        reader_thread.start()
        reader.ready.wait(60)
        time.sleep(0.2)
        load_before = os.getloadavg()[0]
        go.set()
        try:
            got = results.recv()
        finally:
            done.set()
            reader_thread.join(timeout=60)
            child.join(timeout=60)
        load_after = os.getloadavg()[0]
        time.sleep(0.5)
    assert "error" not in got, f"the upgrade failed: {got['error']}"
    report: migrate.UpgradeReport = got["report"]
    return {
        "report": report,
        "writers": writers,
        "start": got["start"],
        "end": got["end"],
        "reader": reader,
        "committed": dict(zip(report.applied, got["commits"], strict=True)),
        "loadavg": (load_before, load_after),
    }


def _verify(url: URL, upgrade: dict[str, Any], writers: list[dict[str, Writer]]) -> dict[str, Any]:
    report = upgrade["report"]
    engine = engine_for(url)
    with engine.connect() as conn:
        assert migrate.current_on(conn) == migrate.head_revision(), "not at head"
        valid: dict[str, bool] = dict(
            conn.execute(
                sa.text(
                    "SELECT c.relname, i.indisvalid FROM pg_index i JOIN pg_class c "
                    "ON c.oid = i.indexrelid WHERE c.relname = ANY(:names)"
                ),
                {"names": list(NEW_INDEXES)},
            ).all()
        )
        assert valid == dict.fromkeys(NEW_INDEXES, True), f"new indexes: {valid}"
        recorded = conn.execute(
            sa.text(
                "SELECT outcome, lock_timeouts, applied FROM schema_migration "
                "WHERE requested_by = 'bench' ORDER BY started_at DESC LIMIT 1"
            )
        ).one()
        landed = {t: int(conn.scalar(sa.text(sql)) or 0) for t, sql in LANDED.items()}
    engine.dispose()
    assert report.outcome == "ok" and report.after == migrate.head_revision(), report
    assert (recorded.outcome, recorded.lock_timeouts) == ("ok", report.lock_timeouts), recorded
    assert list(recorded.applied) == report.applied
    assert upgrade["reader"].queued is not None, "the upgrade never queued behind the reader"
    assert report.lock_timeouts >= 1, "no lock timeout: the retry path did not run"
    for table in TABLES:
        done = sum(len(w[table].samples) for w in writers)
        failed = [e for w in writers for e in w[table].errors]
        assert not failed, f"{table}: {len(failed)} write(s) failed: {failed[:3]}"
        assert landed[table] == done, f"{table}: {done} writes timed, {landed[table]} landed"
    return landed


def _ms(seconds: float, up: bool = False) -> str:
    """Milliseconds, one decimal under 10 ms; ``up`` rounds up (a maximum beside its goal)."""
    ms = seconds * 1000
    if ms < 10:
        return f"{(math.ceil(ms * 10) / 10 if up else ms):.1f}"
    return f"{(math.ceil(ms) if up else round(ms)):,}"


def _stats(values: list[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "p50": percentile(values, 0.50),
        "p99": percentile(values, 0.99),
        "max": max(values, default=0.0),
    }


def _show(s: dict[str, float]) -> str:
    return f"p50 {_ms(s['p50'])} / p99 {_ms(s['p99'])} / max {_ms(s['max'], up=True)} ms"


def run(profile: Profile) -> Section:
    rows = profile.big_rows
    baseline_s = BASELINE_S.get(profile.name, DEFAULT_BASELINE_S)
    with fresh_database(f"{PREFIX}_{profile.name}", revision=FROM_REVISION) as url:
        with stopwatch() as load_t:
            loaded = _load(url, rows)
        settle(url)
        engine = engine_for(url)
        base_load = os.getloadavg()[0]
        base = _baseline(engine, rows, baseline_s)
        up = _upgrade(engine, rows)
        engine.dispose()
        landed = _verify(url, up, [base, up["writers"]])

    report: migrate.UpgradeReport = up["report"]
    reader: Reader = up["reader"]
    start, end = up["start"], up["end"]
    counts = loaded["counts"]
    during = {t: _stats(up["writers"][t].between(start, end)) for t in TABLES}
    before = {t: _stats([s for _, s in base[t].samples]) for t in TABLES}
    for table in TABLES:
        assert during[table]["n"] > 0 and before[table]["n"] > 0, f"{table}: no writes timed"

    size = f"{rows:,} rows in each of {len(TABLES)} tables"
    applied = f"{report.applied[0]} … {report.applied[-1]}" if report.applied else "none"
    queued = reader.queued - start if reader.queued is not None else float("nan")
    committed = up["committed"]
    steps, previous = [], start
    for revision, at in committed.items():  # from the previous migration's commit to its own
        steps.append(f"{revision} {at - previous:.1f} s")
        previous = at
    own = _own_lock_timeouts(report.applied)

    def running(at: float) -> str:
        """The migration under way at ``at``: the first not yet committed."""
        return next((r for r, done in committed.items() if done >= at), "the runner's end")

    rows_out = [
        Row(
            what=f"upgrade {report.before} → {report.after} ({applied}, one transaction each)",
            size=size,
            figure=f"{report.duration_s:.1f} s",
            limit="report",
            ratio=None,
            goal="report",
            met=None,
        ),
        Row(
            what="lock timeouts retried (a reader holds job_run, ACCESS SHARE)",
            size=f"reader held job_run until {READER_HOLD_S:.0f} s after the upgrade queued behind it",
            figure=f"{report.lock_timeouts} ({report.attempts} attempts for {len(report.applied)} migrations)",
            limit=f"{migrate.LOCK_ATTEMPTS} tries per migration, lock_timeout {migrate.LOCK_TIMEOUT}",
            ratio=None,
            goal="report (≥ 1: the retry path ran)",
            met=None,
        ),
    ]
    goal = f"max ≤ {GOAL_S * 1000:,.0f} ms (lock_timeout {migrate.LOCK_TIMEOUT} + {MARGIN_S} s)"
    for table in TABLES:
        d, b = during[table], before[table]
        write = "UPDATE of a random row" if table == "downstream_breaker" else "INSERT"
        rows_out.append(
            Row(
                what=f"writes to {table} during the upgrade ({write}, one per {PACE_S * 1000:.0f} ms)",
                size=f"{counts[table]:,} rows; {d['n']:,} writes",
                figure=_show(d),
                limit=f"no migration: {_show(b)} ({b['n']:,} writes)",
                ratio=d["p99"] / b["p99"] if b["p99"] else None,
                goal=goal,
                met=d["max"] <= GOAL_S,
            )
        )
    missed = [t for t in TABLES if during[t]["max"] > GOAL_S]
    notes = [
        f"From {FROM_REVISION}, the oldest revision a deployment may still be at, to head "
        f"({migrate.head_revision()}): {', '.join(report.applied)} applied by "
        f"`migrate.upgrade` (qo-ops db upgrade), one transaction per migration, lock_timeout "
        f"{migrate.LOCK_TIMEOUT} and statement_timeout {migrate.STATEMENT_TIMEOUT} on each; the "
        "index builds on existing tables (0012, 0013, 0014) concurrently "
        "(qo_ops/db/migrations/safe.py).",
        f"Rows: {', '.join(f'{t} {counts[t]:,}' for t in TABLES)} ({TENANTS} tenants); "
        f"loaded and VACUUM ANALYZEd in {load_t[0]:.0f} s. Tables a migration touches: "
        "audit_record (0013: index), customer_order (0014: index), job_run (0016, 0017, 0018: "
        "ADD COLUMN), downstream_breaker (0016: ADD COLUMN with constant defaults). 0014's "
        "grants on job_lease, job_checkpoint, delivery_attempt_item, outbox_event and "
        "order_resubmission take no lock on them (catalog only) and are not loaded.",
        f"Writers: one thread per table, one statement every {PACE_S * 1000:.0f} ms "
        "(autocommit; INSERT, or an UPDATE of a random row of downstream_breaker), each timed "
        "from send to answer; the figures are the writes that began while the upgrade ran. "
        f"Baseline: the same writers for {baseline_s:.0f} s just before, no migration running; "
        "the ratio is p99 during / p99 baseline. Every write landed (rows counted: "
        + ", ".join(f"{t} {landed[t]:,}" for t in TABLES)
        + ").",
        "The upgrade: `migrate.upgrade(engine)` in a process of its own, as `qo-ops db "
        "upgrade` is (the writers' timings never include Alembic's Python work).",
        f"Reader (the GoCardless pattern): a transaction that read job_run (ACCESS SHARE) and "
        f"stayed open from before the upgrade; the upgrade's first ALTER TABLE job_run queued "
        f"behind it {queued:.1f} s in, and the reader ended {READER_HOLD_S:.0f} s after that. "
        f"Lock timeouts retried: {report.lock_timeouts} ({report.attempts} attempts). The "
        f"upgrade took {report.duration_s:.1f} s; each migration, to its commit: {', '.join(steps)}.",
        f"Writes over {SLOW_S * 1000:.0f} ms during the upgrade, with what the writer's "
        "server process was seen waiting for (pg_stat_activity, sampled every 20 ms): "
        + (
            "; ".join(
                f"{t} at +{b - start:.1f} s, in {running(b)}: {_ms(took, up=True)} ms ({what})"
                for t in TABLES
                for b, took, what in up["writers"][t].slow(start, end)
            )
            or "none"
        )
        + ".",
        f"Goal: a write waits at most the runner's lock_timeout ({migrate.LOCK_TIMEOUT}) + "
        f"{MARGIN_S} s = {GOAL_S * 1000:,.0f} ms. "
        + (
            f"**Missed** on {', '.join(missed)}: "
            + "; ".join(f"{t} max {_ms(during[t]['max'], up=True)} ms" for t in missed)
            + "."
            if missed
            else "Met on every table."
        )
        + (
            " Migrations that set their own lock_timeout (SET LOCAL) in place of the "
            "runner's: "
            + ", ".join(f"{r} ({v})" for r, v in own.items())
            + ": an ALTER TABLE of theirs waits that long behind a reader, and every write "
            "to that table waits behind the ALTER."
            if own
            else ""
        ),
        f"Load average (1 min) on this {os.cpu_count()}-core machine: {base_load:.1f} before "
        f"the baseline, {up['loadavg'][0]:.1f} / {up['loadavg'][1]:.1f} at the upgrade's "
        "start / end.",
    ]
    raw = {
        "rows": rows,
        "loaded": loaded,
        "load_s": load_t[0],
        "report": {
            "before": report.before,
            "after": report.after,
            "applied": report.applied,
            "lock_timeouts": report.lock_timeouts,
            "attempts": report.attempts,
            "duration_s": report.duration_s,
        },
        "reader": {
            "queued_after_s": queued,
            "held_s": reader.ended - reader.began,
        },
        "committed_after_s": {r: at - start for r, at in committed.items()},
        "own_lock_timeouts": own,
        "during": during,
        "slow": {  # (began: seconds after the upgrade began, seconds taken, waited for)
            t: [
                (round(b - start, 3), round(took, 4), what)
                for b, took, what in up["writers"][t].slow(start, end)
            ]
            for t in TABLES
        },
        "baseline": before,
        "landed": landed,
        "goal_s": GOAL_S,
        "loadavg": {"baseline": base_load, "upgrade": up["loadavg"]},
    }
    return Section(TITLE, rows_out, notes, raw)
