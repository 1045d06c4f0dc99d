"""Which PostgreSQL server qo-ops talks to, and the engines for it.

``QO_OPS_DATABASE_URL`` names any PostgreSQL server; without it an embedded server from
the ``pgserver`` package is started under ``QO_OPS_HOME`` and reused by later processes.
Our own code speaks psycopg 3; Dagster's storage is given a psycopg2 URL (dagster-postgres
fails writing events through psycopg 3).
"""

from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import URL, Engine, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError

from qo_ops.config import DATABASE_URL_ENV, Settings, load_settings
from qo_ops.errors import ConfigError, DatabaseUnavailable, one_line

APP_DATABASE = "qo_ops"
DAGSTER_DATABASE = "dagster"
_ACCEPTED_SCHEMES = {"postgresql", "postgres", "postgresql+psycopg", "postgresql+psycopg2"}


@dataclass(frozen=True)
class DatabaseTarget:
    """A resolved database: the URL for our code, and where it came from."""

    url: URL
    embedded_pgdata: Path | None = None

    @property
    def embedded(self) -> bool:
        """True when the server is the embedded one qo-ops started itself."""
        return self.embedded_pgdata is not None

    def display(self) -> str:
        """A human description with any password hidden."""
        if self.embedded:
            return (
                f"embedded PostgreSQL, data in {self.embedded_pgdata}, database {self.url.database}"
            )
        return self.url.render_as_string(hide_password=True)

    def with_database(self, name: str) -> DatabaseTarget:
        """The same server, another database."""
        return DatabaseTarget(self.url.set(database=name), self.embedded_pgdata)

    def dagster_storage_url(self) -> str:
        """URL for dagster-postgres: same server, its own database, psycopg2 driver."""
        dagster_db = DAGSTER_DATABASE if self.embedded else f"{self.url.database}_dagster"
        url = self.url.set(drivername="postgresql+psycopg2", database=dagster_db)
        return url.render_as_string(hide_password=False)


def parse_database_url(raw: str) -> URL:
    """Validate a user-supplied PostgreSQL URL and return it with our psycopg 3 driver."""
    try:
        url = make_url(raw)
    except ArgumentError:
        raise ConfigError(
            f"{DATABASE_URL_ENV} is not a database URL (expected postgresql://user:password@host:port/db)"
        ) from None
    if url.drivername not in _ACCEPTED_SCHEMES:
        raise ConfigError(
            f"{DATABASE_URL_ENV} must be a postgresql:// URL, not {url.drivername}://"
        )
    if not url.database:
        raise ConfigError(f"{DATABASE_URL_ENV} names no database (postgresql://…/DBNAME)")
    return url.set(drivername="postgresql+psycopg")


# The embedded server serves demos and tests: no replicas, so WAL can be minimal, which
# lets a load into tables truncated in the same transaction skip WAL entirely.
_EMBEDDED_SETTINGS = {"wal_level": "minimal", "max_wal_senders": "0"}
_SETTING = sa.text("SELECT current_setting(:name)")  # SHOW, with the name bound


def _tune_embedded(server: Any, uri: str) -> None:
    """Apply ``_EMBEDDED_SETTINGS`` once, restarting the fresh server (under pgserver's lock)."""
    from pgserver import _commands
    from pgserver.postgres_server import PostgresServer

    url = make_url(uri).set(drivername="postgresql+psycopg", password=None)
    engine = sa.create_engine(url, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    with PostgresServer._lock:
        with engine.connect() as conn:
            current = {k: conn.execute(_SETTING, {"name": k}).scalar() for k in _EMBEDDED_SETTINGS}
            if current == _EMBEDDED_SETTINGS:
                engine.dispose()
                return
            for key, value in _EMBEDDED_SETTINGS.items():
                conn.exec_driver_sql(f"ALTER SYSTEM SET {key} = '{value}'")
        engine.dispose()
        user = getattr(server, "system_user", None)
        pg_ctl = getattr(_commands, "pg_ctl")  # noqa: B009 - pgserver defines it at import time
        pg_ctl(["-w", "restart", "-m", "fast"], pgdata=server.pgdata, user=user, timeout=60)


def start_embedded_server(pgdata: Path) -> URL:
    """Start (or attach to) the embedded server in ``pgdata`` and return its socket URL."""
    pgdata.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # platformdirs warns when XDG_RUNTIME_DIR is unset
        try:
            from pgserver.postgres_server import get_server
        except ImportError:  # the container image leaves it out: a pod never needs it
            raise DatabaseUnavailable(
                f"{DATABASE_URL_ENV} is not set, and this installation has no embedded "
                "PostgreSQL (the pgserver package): set it to your server's URL"
            ) from None

        try:
            server = get_server(pgdata, cleanup_mode=None)
            uri = server.get_uri()
            _tune_embedded(server, uri)
        except Exception as exc:  # pgserver raises bare subprocess/assertion errors
            raise DatabaseUnavailable(
                f"cannot start the embedded PostgreSQL in {pgdata}: {one_line(str(exc), 200)}"
            ) from None
    return make_url(uri).set(drivername="postgresql+psycopg", password=None)


def ensure_database(server_url: URL, name: str) -> None:
    """Create database ``name`` on the server of ``server_url`` unless it exists."""
    admin = sa.create_engine(server_url.set(database="postgres"), isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            exists = conn.scalar(
                sa.text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": name}
            )
            if not exists:
                try:
                    conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
                except DBAPIError as exc:  # another process created it first
                    if "already exists" not in str(exc.orig):
                        raise
    except DBAPIError as exc:
        raise DatabaseUnavailable(_connection_message(server_url, exc)) from None
    finally:
        admin.dispose()


def resolve_target(settings: Settings | None = None) -> DatabaseTarget:
    """Resolve the application database, starting the embedded server when needed."""
    settings = settings or load_settings()
    if settings.database_url:
        return DatabaseTarget(parse_database_url(settings.database_url))
    server = start_embedded_server(settings.embedded_pgdata)
    ensure_database(server, APP_DATABASE)
    ensure_database(server, DAGSTER_DATABASE)
    return DatabaseTarget(server.set(database=APP_DATABASE), settings.embedded_pgdata)


def _connection_message(url: URL, exc: BaseException) -> str:
    orig = getattr(exc, "orig", exc)
    detail = str(orig).strip().splitlines()[0] if str(orig).strip() else type(orig).__name__
    return f"cannot connect to {url.render_as_string(hide_password=True)}: {one_line(detail, 200)}"


@functools.lru_cache(maxsize=16)
def _engine_for(url: URL) -> Engine:
    return sa.create_engine(url, pool_pre_ping=True, pool_size=5, max_overflow=10)


def get_engine(target: DatabaseTarget | None = None) -> Engine:
    """An engine for ``target`` (default: the configured one), checked to be reachable."""
    target = target or resolve_target()
    engine = _engine_for(target.url)
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")
    except DBAPIError as exc:
        raise DatabaseUnavailable(_connection_message(target.url, exc)) from None
    return engine


def stop_embedded_server(pgdata: Path) -> None:
    """Stop the embedded server of ``pgdata`` if it runs (fast shutdown: sessions are ended)."""
    pid_file = pgdata / "postmaster.pid"
    if not pid_file.exists():
        return
    from pgserver import _commands

    owner = pgdata.stat().st_uid
    user = None
    if owner != os.geteuid():
        import pwd

        user = pwd.getpwuid(owner).pw_name
    pg_ctl = getattr(_commands, "pg_ctl")  # noqa: B009 - pgserver defines it at import time
    pg_ctl(["-w", "stop", "-m", "fast"], pgdata=pgdata, user=user, timeout=60)
