"""Shared fixtures: one real PostgreSQL server per test session, one database per test.

The server is ``QO_OPS_TEST_DATABASE_URL`` when set, otherwise an embedded server from
``pgserver`` in a temporary directory. A template database is migrated once; each test
gets its own copy (``CREATE DATABASE … TEMPLATE``), dropped afterwards.
"""

from __future__ import annotations

import itertools
import json
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
from qo_ops.jobs.catalog import CATALOG

REPO = Path(__file__).resolve().parent.parent
QO_OPS_BIN = str(Path(sys.executable).with_name("qo-ops"))
_counter = itertools.count()

# a helper module of asserts shared by test files: its failures show their values too
pytest.register_assert_rewrite("qo_ops_tests.platform.run.quote_runs")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under ``make test`` (pytest-xdist, ``--dist loadgroup``) each test file runs whole on
    one worker, so a module's fixture (a Dagster stack, a browser) starts once; a test
    marked ``xdist_group`` keeps its group (the image tests share one image build)."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.path.relative_to(REPO).as_posix()))


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


# one approval per destructive job, every tenant, planted in the template database
STANDING_APPROVALS = {
    name: f"apr-test-{name}" for name, spec in CATALOG.items() if spec.destructive
}


@pytest.fixture(scope="session")
def template_database(pg_server: URL) -> Iterator[str]:
    """A database migrated to head, copied for every test."""
    name = f"qo_ops_template_{os.getpid()}"
    url = create_database(pg_server, name)
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    migrate.upgrade(engine)
    with engine.begin() as conn:  # the suite's standing approvals (STANDING_APPROVALS)
        conn.execute(
            sa.text(
                "INSERT INTO run_approval (id, job_name, reason, granted_by, expires_at) "
                "SELECT 'apr-test-' || j, j, 'the test suite''s standing approval', "
                "'qo_ops_tests', now() + interval '1 day' FROM unnest(CAST(:jobs AS text[])) j"
            ),
            {"jobs": sorted(STANDING_APPROVALS)},
        )
    engine.dispose()
    yield name
    drop_database(pg_server, name)


def standing_approval(job_name: str) -> str | None:
    """The approval a test's execute of ``job_name`` cites (every destructive job's
    execute does, on every path: qo_ops/platform/actions/approvals.py); None for the others. Granted
    for every tenant in every test database (``template_database``); tests of the rule
    itself grant their own."""
    return STANDING_APPROVALS.get(job_name)


def approval_config(job_name: str) -> dict[str, str]:
    """``{"approval": …}`` for a destructive job's Dagster run config, else ``{}``."""
    found = standing_approval(job_name)
    return {"approval": found} if found else {}


def approval_args(job_name: str) -> list[str]:
    """``["--approval", …]`` for a destructive job's ``qo-ops run``, else ``[]``."""
    found = standing_approval(job_name)
    return ["--approval", found] if found else []


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
    """The process environment without qo-ops settings, plus ``extra``. The terminal's
    size is left out too (COLUMNS, LINES: pytest-xdist's workers get the size of the
    terminal, or 80 columns without one), so that a table's notes are cut alike everywhere."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("QO_OPS_") and k not in ("COLUMNS", "LINES")
    }
    env.update(extra)
    return env


# The console script's own call (qo_ops.cli.run), with sys.modules written to a file at exit.
_MODULES_PROBE = """
import atexit, json, sys
out = sys.argv.pop(1)
atexit.register(lambda: open(out, "w").write(json.dumps(sorted(sys.modules))))
sys.argv[0] = "qo-ops"
from qo_ops.cli import run
run()
"""


def modules_loaded_by(
    tmp_path: Path, env: dict[str, str], *args: str
) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """Run ``qo-ops ARGS`` in a fresh interpreter; its result and every module it had loaded
    when it exited (what a command imports, read from ``sys.modules``, never timed)."""
    out = tmp_path / "modules.json"
    proc = subprocess.run(
        [sys.executable, "-c", _MODULES_PROBE, str(out), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    return proc, set(json.loads(out.read_text(encoding="utf-8")))


@pytest.fixture
def cli(db: TestDatabase):
    """Run ``qo-ops`` against this test's database."""

    def _run(*args: str, timeout: float = 300) -> CliResult:
        return run_cli(list(args), base_env(QO_OPS_DATABASE_URL=db.env_url), timeout)

    return _run


# --------------------------------------------------------------------- downstream simulator
# A real downstream simulator process (`python -m qo_ops.downstream.cli`, i.e.
# `qo-ops downstream`) on a free 127.0.0.1 port, its SQLite store in tmp_path:
#
#     def test_a(downstream):                       # started without faults
#         downstream.client.submit_delivery("key-1", "tenant-001", "ORD-1", {})
#         assert downstream.client.stats()["deliveries_distinct"] == 1
#
#     def test_b(downstream_factory):               # start with faults (or several servers)
#         server = downstream_factory(error_rate=1.0, timeout_s=0.5)
#
#     @pytest.mark.parametrize("downstream", [{"poison_rate": 0.5, "seed": 3}], indirect=True)
#     def test_c(downstream): ...
#
# Faults also change at run time: `downstream.client.set_faults(error_rate=0)`.
# `downstream.restart()` stops the process and starts it again on the same port and store.
# Every process started is terminated when the test ends; its output is in `.log`.

import socket  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import httpx  # noqa: E402

from qo_ops.downstream.client import DownstreamClient  # noqa: E402


class DownstreamServer:
    """A running downstream simulator: ``.url``, ``.client`` (a ``DownstreamClient``),
    ``.process``, plus ``.store`` (its SQLite file) and ``.log`` (its stdout/stderr)."""

    def __init__(self, store: Path, log: Path, faults: dict[str, Any]) -> None:
        self.store, self.log, self.faults = store, log, faults
        self.port = 0
        self.url = ""
        self.process: subprocess.Popen[bytes] | None = None
        for attempt in range(3):  # a free port can be taken before the server binds it
            self.port = _free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            if self.start(raise_on_exit=attempt == 2):
                break
        self.client: DownstreamClient = DownstreamClient(self.url)

    def command(self) -> list[str]:
        flags = [f"--{name.replace('_', '-')}={value}" for name, value in self.faults.items()]
        return [
            sys.executable,
            "-m",
            "qo_ops.downstream.cli",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--store",
            str(self.store),
            *flags,
        ]

    def start(self, *, raise_on_exit: bool = True, wait_s: float = 30.0) -> bool:
        """Start the process and poll ``/healthz`` until it answers (at most ``wait_s``)."""
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=log,
                stdin=subprocess.DEVNULL,
                env=base_env(),
                cwd=self.store.parent,
            )
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                if raise_on_exit:
                    raise RuntimeError(
                        f"downstream simulator exited: {self.log.read_text()[-2000:]}"
                    )
                return False
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1.0).status_code == 200:
                    return True
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"downstream simulator did not answer /healthz in {wait_s} s")

    def stop(self) -> None:
        """Terminate the process (SIGTERM, then SIGKILL after 10 s)."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def restart(self) -> None:
        """Stop and start again: same port, same store, the faults it was started with."""
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()
        self.client.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def downstream_factory(tmp_path: Path) -> Iterator[Callable[..., DownstreamServer]]:
    """``start(store=None, **faults)`` starts a simulator process with those faults
    (``Faults`` field names: latency_ms, error_rate, timeout_rate, reset_rate, poison_rate,
    seed, timeout_s); all of them are terminated after the test."""
    servers: list[DownstreamServer] = []

    def start(store: Path | None = None, **faults: Any) -> DownstreamServer:
        n = len(servers)
        server = DownstreamServer(
            store or tmp_path / f"downstream-{n}.sqlite3", tmp_path / f"downstream-{n}.log", faults
        )
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


@pytest.fixture
def downstream(
    request: pytest.FixtureRequest, downstream_factory: Callable[..., DownstreamServer]
) -> DownstreamServer:
    """A downstream simulator process; initial faults via ``indirect`` parametrization."""
    return downstream_factory(**getattr(request, "param", {}))


# ------------------------------------------------------------------------ database logins
# Real LOGIN roles (random passwords) in one of the group roles of migration 0005, for
# tests that connect as the runner, the API or the read-only role (docs/security.md).

import secrets  # noqa: E402
import uuid  # noqa: E402
from dataclasses import field  # noqa: E402


@dataclass
class Logins:
    """Makes LOGIN roles that belong to one of the group roles; drops them all at the end."""

    server: URL
    made: list[tuple[str, Engine]] = field(default_factory=list)
    databases: list[TestDatabase] = field(default_factory=list)

    def _admin(self) -> Engine:
        return sa.create_engine(
            self.server, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool
        )

    def create(self, database: TestDatabase, group: str | None) -> Engine:
        """A new login (in ``group``, or in no role at all) and an engine connecting as it."""
        name = f"qo_ops_test_{(group or 'none').removeprefix('qo_ops_')}_{uuid.uuid4().hex[:10]}"
        password = secrets.token_hex(16)
        member = f" IN ROLE {group}" if group else ""
        admin = self._admin()
        with admin.connect() as conn:
            conn.exec_driver_sql(f"CREATE ROLE {name} LOGIN PASSWORD '{password}'{member}")
        admin.dispose()
        if database not in self.databases:
            self.databases.append(database)
        engine = sa.create_engine(
            database.url.set(username=name, password=password), poolclass=sa.pool.NullPool
        )
        self.made.append((name, engine))
        return engine

    def drop_all(self) -> None:
        admin = self._admin()
        for name, engine in self.made:
            engine.dispose()
            for database in self.databases:  # owns nothing, holds no grant itself: a no-op
                owner = database.engine.execution_options(isolation_level="AUTOCOMMIT")
                with owner.connect() as conn:
                    conn.exec_driver_sql(f"DROP OWNED BY {name}")
            with admin.connect() as conn:
                conn.exec_driver_sql(f"DROP ROLE {name}")
        admin.dispose()


@pytest.fixture
def logins(pg_server: URL) -> Iterator[Logins]:
    """Request it after the database fixture: its logins are dropped before the database."""
    made = Logins(pg_server)
    yield made
    made.drop_all()
