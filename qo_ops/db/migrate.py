"""Schema migrations (Alembic), driven from code, safe to run while qo-ops runs.

**Two versions side by side.** Each migration is *expand* (the previous release keeps
working on it: new tables, new nullable columns, indexes built concurrently) or *contract*
(it removes what an older release uses). ``qo-ops db upgrade`` applies expand steps and
stops before the first contract step; ``qo-ops db upgrade --contract`` applies contract
steps, refused while a run of older code still holds a lease or is running. Code refuses
only a schema older than it needs, or one a contract step made too new for it
(:func:`require_current`, which every command runs first).

**Two version tables.** Alembic records the revision in ``qo_ops_schema_version``. The old
table ``qo_ops_alembic_version`` holds *the oldest code revision the schema still serves*:
releases up to 0017 checked that it equals their own head, so while only expand steps
follow 0017 it stays ``0017`` and those releases keep running on a newer schema. A contract
step raises it to its own revision.

**Never stop the business.** One transaction per migration, its version row in the same
transaction; ``lock_timeout`` and ``statement_timeout`` on every one; a lock timeout rolls
the migration back (nothing of it applied) and is retried with backoff, a bounded number of
times, then fails with one line. Indexes on existing tables are built ``CONCURRENTLY``
outside a transaction (:mod:`qo_ops.db.migrations.safe`). Each ``db upgrade`` is recorded
in ``schema_migration`` (who, why, from → to, duration, lock timeouts, outcome) once that
table exists.

Checking the schema needs no Alembic: the revisions are rows of the version tables, and the
revision this code needs is :data:`HEAD_REVISION`. Alembic, slow to import, is loaded only
to migrate.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from qo_ops.errors import QoOpsError, SchemaNotReady

if TYPE_CHECKING:
    from alembic.config import Config
    from alembic.script import ScriptDirectory
    from sqlalchemy.engine import Connection

log = logging.getLogger(__name__)

MIGRATIONS_DIR = Path(__file__).parent / "migrations"
VERSION_TABLE = "qo_ops_schema_version"  # Alembic's: the revision the schema is at
SERVES_TABLE = "qo_ops_alembic_version"  # the oldest code revision the schema serves
MIGRATION_LOCK_KEY = 0x716F6F7073  # advisory lock: two `db upgrade` at once run one after the other
# The newest revision in migrations/versions/: a new migration moves it (a test holds it to
# Alembic's head), and a contract step is named in CONTRACT_REVISIONS too (a test holds
# that to each migration's ``phase``).
HEAD_REVISION = "0019"
CONTRACT_REVISIONS: frozenset[str] = frozenset()
# Releases from this revision on check the schema as this module does, or (0017) check the
# serves table for their own head; the expand steps after it keep serving them.
FIRST_SIDE_BY_SIDE = "0017"

LOCK_TIMEOUT = "1s"  # a migration waits this long for a lock, then gives way to writers
STATEMENT_TIMEOUT = "60s"  # one statement of a migration (a concurrent index build: safe.py)
LOCK_ATTEMPTS = 6  # a migration's tries at its locks, backing off between them
BACKOFF_S = (0.5, 1.0, 2.0, 4.0, 8.0)  # waits between tries: 15.5 s in all
RECENT_RUN = "15 minutes"  # a `running` run whose heartbeat is this recent is running

# Whether a table exists yet (an empty database has none). Read-only.
TABLE_EXISTS = sa.text("SELECT to_regclass(:name) IS NOT NULL")
# The rows of each version table (one, or none). Read-only.
VERSIONS = {
    VERSION_TABLE: sa.text("SELECT version_num FROM qo_ops_schema_version"),
    SERVES_TABLE: sa.text("SELECT version_num FROM qo_ops_alembic_version"),
}
# The serves table, for a database this code created (releases up to 0017 made it Alembic's).
# Twice: IF NOT EXISTS; every upgrade runs it under the migration lock.
CREATE_SERVES_TABLE = (
    "CREATE TABLE IF NOT EXISTS qo_ops_alembic_version (version_num varchar(32) NOT NULL, "
    "CONSTRAINT qo_ops_alembic_version_pkc PRIMARY KEY (version_num))"
)
# Twice: the serves table's one row rewritten to the value the schema serves, delete and
# insert in the migration's transaction: a rerun writes the same row again.
CLEAR_SERVES = sa.text("DELETE FROM qo_ops_alembic_version")
# Twice: after CLEAR_SERVES in the same transaction (above).
WRITE_SERVES = sa.text("INSERT INTO qo_ops_alembic_version (version_num) VALUES (:v)")
# Alembic's version table, for a database a release up to 0017 migrated: created once.
# Twice: only when to_regclass finds no such table, under the migration lock.
CREATE_VERSION_TABLE = (
    "CREATE TABLE qo_ops_schema_version (version_num varchar(32) NOT NULL, "
    "CONSTRAINT qo_ops_schema_version_pkc PRIMARY KEY (version_num))"
)
# Twice: into the table created just before (above), in its transaction.
ADOPT_VERSION = sa.text("INSERT INTO qo_ops_schema_version (version_num) VALUES (:v)")
TAKE_MIGRATION_LOCK = sa.text("SELECT pg_advisory_lock(:key)")  # a session lock: see below
GIVE_MIGRATION_LOCK = sa.text("SELECT pg_advisory_unlock(:key)")
# The timeouts of every migration (SET takes no parameters; squawk reads them as written).
SET_LOCK_TIMEOUT = "SET lock_timeout = '1s'"  # LOCK_TIMEOUT (a test holds them equal)
SET_STATEMENT_TIMEOUT = "SET statement_timeout = '60s'"  # STATEMENT_TIMEOUT
# Runs of code older than a contract step (its code revision below it, or unknown: before
# 0018) that hold a lease or are running (heartbeat in the last RECENT_RUN). Read-only.
OLDER_CODE_BUSY = sa.text(
    """
    SELECT r.job_name, r.scope, coalesce(r.code_revision, 'before 0018') AS code
      FROM job_run r
     WHERE (r.code_revision IS NULL OR r.code_revision < :rev)
       AND (EXISTS (SELECT 1 FROM job_lease l
                     WHERE l.job_run_id = r.id AND l.expires_at > now())
            OR (r.status = 'running'
                AND r.heartbeat_at > now() - CAST(:recent AS interval)))
     ORDER BY r.started_at LIMIT 20
    """
)
# Twice: one row per upgrade, a fresh id each: a second upgrade is another row.
RECORD_UPGRADE = sa.text(
    """
    INSERT INTO schema_migration (id, from_revision, to_revision, applied, contract,
        requested_by, reason, outcome, error, lock_timeouts, attempts, duration_ms,
        code_version)
    VALUES (:id, :from_rev, :to_rev, :applied, :contract, :who, :reason, :outcome, :error,
        :lock_timeouts, :attempts, :duration_ms, :code_version)
    """
)
# The newest recorded upgrades. Read-only.
RECENT_UPGRADES = sa.text(
    """
    SELECT started_at, from_revision, to_revision, outcome, requested_by, reason,
           lock_timeouts, duration_ms, code_version
      FROM schema_migration ORDER BY started_at DESC LIMIT :n
    """
)


class MigrationBlocked(QoOpsError):
    """A migration could not take its locks in time, or a contract step is not safe yet;
    nothing of that migration was applied."""


@dataclass(frozen=True)
class Step:
    """One pending migration: its revision, and whether it contracts."""

    revision: str
    contract: bool


# How an upgrade ended (schema_migration.outcome, whose check lists the same words)
UPGRADE_OK, UPGRADE_FAILED, UPGRADE_REFUSED = "ok", "failed", "refused"


@dataclass
class UpgradeReport:
    """What one ``db upgrade`` did."""

    before: str | None
    after: str | None = None
    applied: list[str] = field(default_factory=list)
    pending_contract: list[str] = field(default_factory=list)
    lock_timeouts: int = 0  # lock timeouts met (each retried, or the last one failed)
    attempts: int = 0  # migrations tried, retries included
    duration_s: float = 0.0
    outcome: str = UPGRADE_OK  # or UPGRADE_FAILED, UPGRADE_REFUSED
    error: str | None = None


def _rev(revision: str | None) -> int:
    return int(revision) if revision else 0


def _config(connection: Connection) -> Config:
    from alembic.config import Config  # Alembic only to migrate: see the module docstring

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.attributes["connection"] = connection
    return cfg


def script_directory() -> ScriptDirectory:
    """Alembic's view of migrations/versions/ (imports Alembic)."""
    from alembic.script import ScriptDirectory

    cfg = _config(None)  # type: ignore[arg-type]
    return ScriptDirectory.from_config(cfg)


def head_revision() -> str:
    """The newest revision this code knows."""
    return HEAD_REVISION


def code_version() -> str:
    """This code as a rollout tells releases apart: ``<package version>/<schema revision>``
    (``qo-ops status``, the Dagster run page, ``schema_migration``)."""
    from qo_ops.platform.observability.resource import package_version

    return f"{package_version()}/{HEAD_REVISION}"


def required_revision() -> str:
    """The oldest revision this code runs on: its newest expand step (it is written to run
    before and after its own contract steps)."""
    expands = [r for r in range(1, _rev(HEAD_REVISION) + 1) if f"{r:04d}" not in CONTRACT_REVISIONS]
    return f"{max(expands):04d}"


def _exists(conn: Connection, table: str) -> bool:
    return bool(conn.scalar(TABLE_EXISTS, {"name": table}))


def _versions(conn: Connection, table: str) -> list[str]:
    if not _exists(conn, table):
        return []
    return list(conn.scalars(VERSIONS[table]))


def _one(found: list[str], table: str) -> str | None:
    if len(found) > 1:  # Alembic's own check: our history has one line, never branches
        raise SchemaNotReady(f"{table} has several rows {sorted(found)}: repair it")
    return found[0] if found else None


def current_revision(engine: Engine) -> str | None:
    """The revision the database is at, or None for an empty database. A database last
    migrated by a release up to 0017 has it only in the serves table."""
    with engine.connect() as conn:
        return current_on(conn)


def current_on(conn: Connection) -> str | None:
    if _exists(conn, VERSION_TABLE):
        return _one(_versions(conn, VERSION_TABLE), VERSION_TABLE)
    return _one(_versions(conn, SERVES_TABLE), SERVES_TABLE)


def serves_from(engine: Engine) -> str | None:
    """The oldest code revision the schema still serves (None: an empty database)."""
    with engine.connect() as conn:
        return serves_on(conn)


def serves_on(conn: Connection) -> str | None:
    """:func:`serves_from` on an open connection."""
    return _one(_versions(conn, SERVES_TABLE), SERVES_TABLE)


def require_current(engine: Engine) -> None:
    """Raise :class:`SchemaNotReady` unless this code can run on the database's schema: at
    least the revision it needs, and not contracted past it. One line, both versions."""
    with engine.connect() as conn:
        current = current_on(conn)
        serves = _one(_versions(conn, SERVES_TABLE), SERVES_TABLE)
    needed = required_revision()
    if current is None or _rev(current) < _rev(needed):
        raise SchemaNotReady(
            f"database schema is at {current or 'empty'}, this code needs {needed} or newer: "
            "run `qo-ops db upgrade`"
        )
    if serves is not None and _rev(serves) > _rev(HEAD_REVISION):
        raise SchemaNotReady(
            f"database schema is at {current} and serves code from {serves} on; this code is "
            f"at {HEAD_REVISION} (a contract step removed what it uses): deploy a release at "
            f"{serves} or newer"
        )


_CHECKED: dict[int, float] = {}  # id(engine) -> when it last passed require_current
CHECK_EVERY_S = 60.0


def require_current_cached(engine: Engine) -> None:
    """:func:`require_current` at most once a minute per engine (every run checks: a chunk
    run's tenants would otherwise check once each)."""
    now = time.monotonic()
    if now - _CHECKED.get(id(engine), -CHECK_EVERY_S) < CHECK_EVERY_S:
        return
    require_current(engine)
    _CHECKED[id(engine)] = now


def pending_steps(engine: Engine, revision: str = "head") -> list[Step]:
    """The migrations between the database and ``revision``, oldest first."""
    script = script_directory()
    current = current_revision(engine)
    target = script.get_current_head() if revision == "head" else revision
    steps = []
    for rev in script.iterate_revisions(target, current or "base"):
        module = rev.module
        steps.append(Step(rev.revision, getattr(module, "phase", "expand") == "contract"))
    return list(reversed(steps))


def _serves(current: str | None) -> str | None:
    """The oldest code revision a schema at ``current`` serves: the newest contract step
    applied, else the first release that runs beside newer expand steps (or ``current``
    itself, below that release: those releases need their exact revision)."""
    if current is None:
        return None
    contracts = [r for r in CONTRACT_REVISIONS if _rev(r) <= _rev(current)]
    base = current if _rev(current) < _rev(FIRST_SIDE_BY_SIDE) else FIRST_SIDE_BY_SIDE
    return max([base, *contracts], key=_rev)


def write_serves(conn: Connection) -> None:
    """Keep the serves table equal to what the schema serves (in the caller's transaction)."""
    serves = _serves(_one(_versions(conn, VERSION_TABLE), VERSION_TABLE))
    conn.exec_driver_sql(CREATE_SERVES_TABLE)
    conn.execute(CLEAR_SERVES)
    if serves is not None:
        conn.execute(WRITE_SERVES, {"v": serves})


def _adopt_old_version_table(conn: Connection) -> None:
    """A database last migrated by a release up to 0017 has its revision in the old table
    only: copy it to Alembic's new one (once)."""
    if _exists(conn, VERSION_TABLE):
        return
    old = _one(_versions(conn, SERVES_TABLE), SERVES_TABLE)
    if old is None:
        return
    conn.exec_driver_sql(CREATE_VERSION_TABLE)
    conn.execute(ADOPT_VERSION, {"v": old})


@contextmanager
def _migration_connection(engine: Engine) -> Iterator[Connection]:
    """A connection holding the migration lock (session-level: it spans the per-migration
    transactions), with the timeouts every migration runs under."""
    with engine.connect() as conn:
        conn.execute(TAKE_MIGRATION_LOCK, {"key": MIGRATION_LOCK_KEY})
        conn.commit()
        try:
            yield conn
        finally:
            conn.rollback()
            conn.execute(GIVE_MIGRATION_LOCK, {"key": MIGRATION_LOCK_KEY})
            conn.commit()


def set_timeouts(conn: Connection) -> None:
    """The timeouts of the migration about to run, on the session (each migration's SQL
    starts with them: squawk's require-timeout-settings sees them there)."""
    conn.exec_driver_sql(SET_LOCK_TIMEOUT)
    conn.exec_driver_sql(SET_STATEMENT_TIMEOUT)
    conn.commit()


def _is_lock_timeout(exc: BaseException) -> bool:
    orig = getattr(exc, "orig", None)
    return getattr(orig, "sqlstate", None) == "55P03"  # lock_not_available


def older_code_busy(conn: Connection, revision: str) -> list[str]:
    """Runs of code older than ``revision`` that hold a lease or are running (their code
    revision is below it, or unknown: recorded before 0018). A contract step waits for them."""
    rows = conn.execute(OLDER_CODE_BUSY, {"rev": revision, "recent": RECENT_RUN})
    return [f"{job} {scope} (code {code})" for job, scope, code in rows]


def upgrade(
    engine: Engine,
    revision: str = "head",
    *,
    contract: bool = False,
    requested_by: str | None = None,
    reason: str | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> UpgradeReport:
    """Migrate up to ``revision`` one migration (one transaction) at a time; a no-op when
    already there. Expand steps only unless ``contract``; a contract step is refused while
    older code runs. Raises :class:`MigrationBlocked` after the bounded retries of a lock
    timeout, or for a contract step refused; what was applied before it stays applied."""
    from alembic import command  # Alembic only to migrate: see the module docstring

    started = time.monotonic()
    with _migration_connection(engine) as conn:
        _adopt_old_version_table(conn)
        conn.commit()
        report = UpgradeReport(before=current_on(conn))
        steps = pending_steps(engine, revision)
        _event(
            logging.INFO,
            "migration.start",
            **{"from": report.before, "to": steps[-1].revision if steps else report.before},
        )
        try:
            for step in steps:
                if step.contract and not contract:
                    report.pending_contract = [s.revision for s in steps if s.contract]
                    break
                if step.contract:
                    busy = older_code_busy(conn, step.revision)
                    conn.commit()
                    if busy:
                        report.outcome = UPGRADE_REFUSED
                        raise MigrationBlocked(
                            f"contract step {step.revision} refused: {len(busy)} run(s) of older "
                            f"code still hold a lease or are running ({'; '.join(busy[:3])}); "
                            "let them finish (or stop them), then retry"
                        )
                _apply(conn, command, step, report, sleep)
        except BaseException as exc:
            if report.outcome == UPGRADE_OK:
                report.outcome = UPGRADE_FAILED
            report.error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise
        finally:
            conn.rollback()
            report.after = current_on(conn)
            conn.rollback()
            report.duration_s = time.monotonic() - started
            _record(conn, report, requested_by, reason, contract)
    return report


def _apply(conn: Connection, command, step: Step, report: UpgradeReport, sleep) -> None:  # type: ignore[no-untyped-def]
    """One migration in its own transaction, retried on a lock timeout with backoff."""
    for attempt in range(1, LOCK_ATTEMPTS + 1):
        report.attempts += 1
        set_timeouts(conn)
        try:
            command.upgrade(_config(conn), step.revision)
        except sa.exc.DBAPIError as exc:
            conn.rollback()
            if not _is_lock_timeout(exc):
                raise
            report.lock_timeouts += 1
            if attempt == LOCK_ATTEMPTS:
                raise MigrationBlocked(
                    f"migration {step.revision} could not take its locks within {LOCK_TIMEOUT} "
                    f"in {LOCK_ATTEMPTS} tries (a long transaction holds a table it alters?); "
                    f"{step.revision} was rolled back (an index it built concurrently stays, "
                    "valid or repaired on retry): retry when that transaction has ended"
                ) from None
            wait = BACKOFF_S[min(attempt - 1, len(BACKOFF_S) - 1)]
            _event(
                logging.WARNING,
                "migration.lock_timeout",
                revision=step.revision,
                attempt=attempt,
                retry_in_s=wait,
            )
            sleep(wait)
        else:
            report.applied.append(step.revision)
            return


def _record(
    conn: Connection,
    report: UpgradeReport,
    requested_by: str | None,
    reason: str | None,
    contract: bool,
) -> None:
    """The upgrade's end event, its row in schema_migration and its audit entry (once the
    table exists: 0018)."""
    _event(
        logging.INFO if report.outcome == UPGRADE_OK else logging.ERROR,
        "migration.end",
        **{
            "from": report.before,
            "to": report.after,
            "applied": report.applied,
            "outcome": report.outcome,
            "lock_timeouts": report.lock_timeouts,
            "duration_s": round(report.duration_s, 3),
        },
    )
    if not report.applied and report.outcome == UPGRADE_OK:
        return  # nothing to do, nothing to record
    from qo_ops.db.audit import AuditEntry, append_audit

    try:
        with conn.begin():
            if not _exists(conn, "schema_migration"):
                return
            conn.execute(
                RECORD_UPGRADE,
                {
                    "id": uuid.uuid4(),
                    "from_rev": report.before,
                    "to_rev": report.after,
                    "applied": report.applied,
                    "contract": contract,
                    "who": requested_by,
                    "reason": reason,
                    "outcome": report.outcome,
                    "error": report.error,
                    "lock_timeouts": report.lock_timeouts,
                    "attempts": report.attempts,
                    "duration_ms": int(report.duration_s * 1000),
                    "code_version": code_version(),
                },
            )
            if report.before is None:
                return  # a new database: its creation is the row above; its audit starts empty
            append_audit(
                conn,
                AuditEntry(
                    actor=requested_by or "unknown",
                    action="schema_upgrade_contract" if contract else "schema_upgrade",
                    decision=report.outcome,
                    reason=reason,
                    details={
                        "from": report.before,
                        "to": report.after,
                        "applied": report.applied,
                        "lock_timeouts": report.lock_timeouts,
                        "error": report.error,
                    },
                ),
            )
    except sa.exc.DBAPIError:  # recording must not hide what happened: the log has it
        log.warning("migration.record_failed", exc_info=True)


def _event(level: int, name: str, /, **fields: object) -> None:
    """A structured event of the upgrade (JSON where event logging is on)."""
    from qo_ops.platform.observability.events import EVENT_LOGGER, log_event

    log_event(logging.getLogger(f"{EVENT_LOGGER}.migrate"), level, name, **fields)


def downgrade(engine: Engine, revision: str = "-1") -> None:
    """Migrate down to ``revision`` (``base`` drops every qo-ops table)."""
    from alembic import command  # Alembic only to migrate: see the module docstring

    with _migration_connection(engine) as conn:
        _adopt_old_version_table(conn)
        conn.commit()
        command.downgrade(_config(conn), revision)


def applied_migrations(engine: Engine, limit: int = 5) -> Sequence[sa.Row[Any]]:
    """The newest recorded upgrades (``qo-ops db status``)."""
    with engine.connect() as conn:
        return applied_migrations_on(conn, limit)


def applied_migrations_on(conn: Connection, limit: int) -> Sequence[sa.Row[Any]]:
    """:func:`applied_migrations` on an open connection ([] before 0018)."""
    if not _exists(conn, "schema_migration"):
        return []
    return list(conn.execute(RECENT_UPGRADES, {"n": limit}))
