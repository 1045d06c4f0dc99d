"""Loading deterministic demo data with the anomalies the jobs exist for (``qo-ops demo-data``).

Every row is computed set-based in PostgreSQL from ``generate_series`` and a seeded hash
(``statements.py``), so 1,000,000 quotes load in seconds and the same (seed, as-of, sizes)
give the same rows. Which rows are anomalies depends only on each row's index within its
tenant, never on the hash (``rules.py``), so :class:`DemoPlan` can say exactly how many of
each anomaly a load creates. All of a load is one transaction: it lands whole or not at all.

Every temp file row gets a real stored object (small, of its ``size_bytes``) in the object
store temp_file_cleanup uses, so that a demo cleanup removes what production's would. The
objects are written while PostgreSQL finishes the load, before it commits; a load that fails
removes the objects it created, and ``--reset`` removes the objects of the rows it replaces.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from qo_ops.db.schema import BUSINESS_TABLES, PLATFORM_TABLES
from qo_ops.demo.rules import DemoPlan
from qo_ops.demo.statements import STATEMENTS
from qo_ops.errors import BadInput, ConfigError
from qo_ops.platform.calls.object_store import ObjectStore, ObjectStoreError

MAX_TENANTS = 999
MAX_QUOTES_PER_TENANT = 5_000_000


@dataclass
class DemoReport:
    """What a load did: the tenants it created, rows per table, anomalies planted."""

    tenants: list[str]
    rows: dict[str, int] = field(default_factory=dict)
    anomalies: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    objects_written: int = 0  # stored objects of the new temp file rows
    objects_removed: int = 0  # stored objects of the rows a reset replaced


# Tables whose ids the load sets explicitly: their identity must move past them.
_EXPLICIT_ID_TABLES = ("quote", "customer_order")


_INT_PARAMS = re.compile(r":(t0|t1|q|catalog|checkouts|temp_files|audit_records)\b")
_BIGINT_PARAMS = re.compile(r":(seed|id_base)\b")


def _typed_params(sql: str) -> str:
    """Cast integer binds explicitly: the driver would send small ints as smallint."""
    sql = _INT_PARAMS.sub(r"CAST(:\1 AS int)", sql)
    return _BIGINT_PARAMS.sub(r"CAST(:\1 AS bigint)", sql)


@contextlib.contextmanager
def _bulk_load(conn: Connection, tables: list[str]) -> Iterator[None]:
    """Load fast inside the current transaction, without weakening what ends committed.

    Secondary indexes are dropped and rebuilt once at the end (a sorted build beats a
    million incremental inserts); as superuser, foreign-key triggers are skipped for the
    load, which builds every reference from rows it has just inserted.
    """
    conn.exec_driver_sql("SET LOCAL maintenance_work_mem = '256MB'")
    if conn.scalar(sa.text("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")):
        conn.exec_driver_sql("SET LOCAL session_replication_role = replica")
    indexes = conn.execute(
        sa.text(
            """
            SELECT i.indexrelid::regclass::text AS name, pg_get_indexdef(i.indexrelid) AS ddl
            FROM pg_index i
            WHERE i.indrelid = ANY (CAST(:tables AS regclass[]))
              AND NOT EXISTS (SELECT 1 FROM pg_constraint c WHERE c.conindid = i.indexrelid)
            """
        ),
        {"tables": tables},
    ).all()
    for name, _ in indexes:
        conn.exec_driver_sql(f"DROP INDEX {name}")
    yield
    for _, ddl in indexes:
        conn.exec_driver_sql(ddl)
    conn.exec_driver_sql("SET LOCAL session_replication_role = origin")


class DemoDataExists(BadInput):
    """demo-data was asked to load into a database that already holds business data."""


def _existing_tenant_numbers(conn: Connection) -> list[int]:
    rows = conn.execute(sa.text("SELECT id FROM tenant ORDER BY id")).scalars()
    numbers = []
    for tid in rows:
        prefix, _, digits = tid.rpartition("-")
        if prefix == "tenant" and digits.isdigit():
            numbers.append(int(digits))
    return numbers


_TABLES = {t.name: t for t in BUSINESS_TABLES + PLATFORM_TABLES}


def _truncate(conn: Connection, tables: Sequence[sa.Table]) -> None:
    """``TRUNCATE … RESTART IDENTITY CASCADE`` of ``tables``, each name quoted by the
    dialect (TRUNCATE takes no bind parameters and SQLAlchemy has no construct for it)."""
    names = ", ".join(conn.dialect.identifier_preparer.format_table(t) for t in tables)
    # Twice: a table truncated again is empty again
    conn.exec_driver_sql(f"TRUNCATE {names} RESTART IDENTITY CASCADE")


def reset_demo_data(conn: Connection) -> None:
    """Empty every business and platform table except the append-only audit trail and the
    API's tokens (credentials outlive demo data)."""
    keep = ("job_audit", "api_token")
    _truncate(conn, [t for t in BUSINESS_TABLES + PLATFORM_TABLES if t.name not in keep])


def _truncate_empty(conn: Connection, names: list[str]) -> None:
    """Truncate the tables that are empty anyway: rows loaded into a table truncated in the
    same transaction skip WAL (the embedded server runs with wal_level=minimal)."""
    tables = [_TABLES[name] for name in names]
    empty = [t for t in tables if not conn.scalar(sa.select(sa.exists().select_from(t)))]
    if empty:
        # CASCADE reaches only tables referencing an empty one; with no tenant, all are empty
        _truncate(conn, empty)


# ---------------------------------------------------------------- stored objects


def demo_object(storage_path: str, size: int, seed: int) -> bytes:
    """The bytes the demo stores for a temp file: a line naming it, repeated to its size."""
    line = f"qo-ops demo temp file {storage_path} (seed {seed})\n".encode()
    return (line * (size // len(line) + 1))[:size]


class _ObjectWriter(threading.Thread):
    """Stores the new temp files' objects while the rest of the load runs (the database
    inserts, this thread writes files: the two overlap)."""

    def __init__(self, root: Path, files: Sequence[tuple[str, int]], seed: int) -> None:
        super().__init__(name="demo-objects", daemon=True)
        self.root, self.files, self.seed = root, files, seed
        self.created: list[str] = []  # new objects, removed again if the load fails
        self.error: ObjectStoreError | None = None

    def run(self) -> None:
        try:
            with ObjectStore(self.root) as store:
                for path, size in self.files:
                    if store.put(path, demo_object(path, size, self.seed)):
                        self.created.append(path)
        except ObjectStoreError as exc:
            self.error = exc

    def finish(self) -> None:
        """Wait for the writer; a write that failed fails the load (before its commit)."""
        self.join()
        if self.error is not None:
            raise ConfigError(f"demo objects under {self.root}: {self.error}")


def _remove_objects(root: Path, paths: Iterable[str]) -> int:
    """Remove the stored objects at ``paths`` (never through a symlink): how many went. One
    that cannot be removed, or whose path would leave the store, is left."""
    removed = 0
    with ObjectStore(root) as store:
        for path in paths:
            with contextlib.suppress(ObjectStoreError):
                removed += store.remove(path)
    return removed


def load_demo_data(
    engine: Engine,
    *,
    tenants: int,
    quotes: int,
    seed: int,
    as_of: datetime,
    append: bool = False,
    reset: bool = False,
    objects: Path | None = None,
) -> DemoReport:
    """Load ``tenants`` demo tenants of ``quotes`` quotes each, in one transaction.

    Refuses (changing nothing) when business data exists and neither ``append`` nor
    ``reset`` is given. ``reset`` empties the tables first; ``append`` adds new tenants
    numbered after the existing ones. ``objects`` is the object store root (the CLI: the
    one temp_file_cleanup uses, ``QO_OPS_HOME/objects``): each new temp file's object is
    stored there, and a reset removes the objects of the rows it replaces. None: rows only.
    """
    if not 1 <= tenants <= MAX_TENANTS:
        raise BadInput(f"--tenants must be between 1 and {MAX_TENANTS}, got {tenants}")
    if not 1 <= quotes <= MAX_QUOTES_PER_TENANT:
        raise BadInput(f"--quotes must be between 1 and {MAX_QUOTES_PER_TENANT}, got {quotes}")
    if append and reset:
        raise BadInput("--append and --reset exclude each other: choose one")
    if as_of.tzinfo is None:
        raise BadInput("--as-of needs a time zone (e.g. 2026-01-31T00:00:00Z)")
    if not 0 <= seed < 2**31:
        raise BadInput(f"--seed must be between 0 and {2**31 - 1}, got {seed}")

    plan = DemoPlan(tenants=tenants, quotes=quotes)
    started = time.perf_counter()
    writer: _ObjectWriter | None = None
    replaced: set[str] = set()  # storage paths of the rows a reset empties
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql("SET LOCAL synchronous_commit = off")
            conn.exec_driver_sql("SET LOCAL work_mem = '256MB'")
            existing = _existing_tenant_numbers(conn)
            has_data = conn.scalar(
                sa.text("SELECT EXISTS (SELECT 1 FROM tenant) OR EXISTS (SELECT 1 FROM quote)")
            )
            if has_data and not (append or reset):
                raise DemoDataExists(
                    "the database already holds business data: pass --append to add tenants "
                    "or --reset to replace everything (the job_audit trail is kept)"
                )
            if reset:
                if objects is not None:
                    replaced = set(conn.scalars(sa.text("SELECT storage_path FROM temp_file")))
                reset_demo_data(conn)
                existing = []
            elif not has_data:
                _truncate_empty(conn, [table for table, _ in STATEMENTS])
            t0 = (max(existing) if existing else 0) + 1
            t1 = t0 + tenants - 1
            if t1 > MAX_TENANTS:
                raise BadInput(
                    f"tenant numbers would pass tenant-{MAX_TENANTS}: load fewer tenants"
                )
            new_tenants = [f"tenant-{n:03d}" for n in range(t0, t1 + 1)]
            id_base = conn.scalar(sa.text("SELECT coalesce(max(id), 0) FROM quote")) or 0
            params = {
                "t0": t0,
                "t1": t1,
                "q": quotes,
                "seed": seed,
                "as_of": as_of,
                "id_base": id_base,
                "catalog": plan.catalog_items,
                "checkouts": plan.checkouts,
                "temp_files": plan.temp_files,
                "audit_records": plan.audit_records,
            }
            rows: dict[str, int] = {}
            with _bulk_load(conn, [table for table, _ in STATEMENTS]):
                for table, sql in STATEMENTS:
                    rows[table] = conn.execute(sa.text(_typed_params(sql)), params).rowcount
                    if table == "temp_file" and objects is not None:
                        files = conn.execute(
                            sa.text(
                                "SELECT storage_path, size_bytes FROM temp_file "
                                "WHERE tenant_id = ANY(CAST(:tenants AS text[]))"
                            ),
                            {"tenants": new_tenants},
                        ).all()
                        writer = _ObjectWriter(objects, [(f[0], f[1]) for f in files], seed)
                        writer.start()
            for table in _EXPLICIT_ID_TABLES:
                conn.execute(
                    sa.text(
                        f"SELECT setval(pg_get_serial_sequence('{table}', 'id'), "
                        f"(SELECT coalesce(max(id), 1) FROM {table}))"
                    )
                )
            if writer is not None:
                writer.finish()  # every new row's object is stored before the rows commit
    except BaseException:
        if writer is not None:  # the rows are gone again: so are the objects made for them
            writer.join()
            _remove_objects(writer.root, writer.created)
        raise
    removed = 0
    if objects is not None and replaced:  # the old rows are gone for good now
        kept = {path for path, _ in writer.files} if writer is not None else set()
        removed = _remove_objects(objects, sorted(replaced - kept))
    return DemoReport(
        tenants=new_tenants,
        rows=rows,
        anomalies=plan.expected_anomalies(),
        seconds=time.perf_counter() - started,
        objects_written=len(writer.files) if writer is not None else 0,
        objects_removed=removed,
    )
