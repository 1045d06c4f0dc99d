"""Shared fixtures: one real PostgreSQL server per test session, one database per test.

The server is ``QO_OPS_TEST_DATABASE_URL`` when set, otherwise an embedded server from
``pgserver`` in a temporary directory. A template database is migrated once; each test
gets its own copy (``CREATE DATABASE … TEMPLATE``), dropped afterwards.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL, Engine

from qo_ops.db import migrate
from qo_ops.db.engine import (
    DatabaseTarget,
    parse_database_url,
    start_embedded_server,
    stop_embedded_server,
)

REPO = Path(__file__).resolve().parent.parent
QO_OPS_BIN = str(Path(sys.executable).with_name("qo-ops"))
_counter = itertools.count()


@pytest.fixture(scope="session")
def pg_server() -> Iterator[URL]:
    """URL of the test PostgreSQL server (database ``postgres``)."""
    external = os.environ.get("QO_OPS_TEST_DATABASE_URL")
    if external:
        yield parse_database_url(external).set(database="postgres")
        return
    pgdata = Path(tempfile.mkdtemp(prefix="qo-ops-test-pg-")) / "pgdata"
    try:
        yield start_embedded_server(pgdata).set(database="postgres")
    finally:
        stop_embedded_server(pgdata)
        shutil.rmtree(pgdata.parent, ignore_errors=True)


def _admin(server: URL) -> Engine:
    return sa.create_engine(server, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)


def create_database(server: URL, name: str, template: str | None = None) -> URL:
    """Create database ``name`` (optionally from ``template``) and return its URL."""
    admin = _admin(server)
    with admin.connect() as conn:
        conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        suffix = f' TEMPLATE "{template}"' if template else ""
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"{suffix}')
    admin.dispose()
    return server.set(database=name)


def drop_database(server: URL, name: str) -> None:
    """Drop database ``name``, disconnecting whoever is still connected."""
    admin = _admin(server)
    with admin.connect() as conn:
        conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    admin.dispose()


@pytest.fixture(scope="session")
def template_database(pg_server: URL) -> Iterator[str]:
    """A database migrated to head, copied for every test."""
    name = f"qo_ops_template_{os.getpid()}"
    url = create_database(pg_server, name)
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    migrate.upgrade(engine)
    engine.dispose()
    yield name
    drop_database(pg_server, name)


@dataclass
class TestDatabase:
    """One test's own database: its URL, an engine, and how to point a CLI at it."""

    url: URL
    engine: Engine

    @property
    def target(self) -> DatabaseTarget:
        return DatabaseTarget(self.url)

    @property
    def env_url(self) -> str:
        return self.url.set(drivername="postgresql").render_as_string(hide_password=False)


def _test_database(server: URL, template: str | None) -> Iterator[TestDatabase]:
    name = f"qo_ops_test_{os.getpid()}_{next(_counter)}"
    url = create_database(server, name, template)
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        yield TestDatabase(url, engine)
    finally:
        engine.dispose()
        drop_database(server, name)


@pytest.fixture
def db(pg_server: URL, template_database: str) -> Iterator[TestDatabase]:
    """A fresh database at the head schema revision, for this test only."""
    yield from _test_database(pg_server, template_database)


@pytest.fixture
def empty_db(pg_server: URL) -> Iterator[TestDatabase]:
    """A fresh database with no schema at all."""
    yield from _test_database(pg_server, None)


@dataclass
class CliResult:
    code: int
    stdout: str
    stderr: str


def run_cli(args: list[str], env: dict[str, str], timeout: float = 300) -> CliResult:
    """Run the installed ``qo-ops`` command as a real process."""
    proc = subprocess.run(
        [QO_OPS_BIN, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    return CliResult(proc.returncode, proc.stdout, proc.stderr)


def base_env(**extra: str) -> dict[str, str]:
    """The process environment without qo-ops settings, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("QO_OPS_")}
    env.update(extra)
    return env


@pytest.fixture
def cli(db: TestDatabase):
    """Run ``qo-ops`` against this test's database."""

    def _run(*args: str, timeout: float = 300) -> CliResult:
        return run_cli(list(args), base_env(QO_OPS_DATABASE_URL=db.env_url), timeout)

    return _run
