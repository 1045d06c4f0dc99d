"""What the nemesis works on: a PostgreSQL server it may restart, a fresh database of demo
data, the downstream simulator as a real HTTP process, and the environment every ``qo-ops``
process it starts gets."""

from __future__ import annotations

import os
import pwd
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import URL, Engine

from bench import common
from qo_ops.db.availability import retry_while_unavailable
from qo_ops.db.engine import parse_database_url, start_embedded_server, stop_embedded_server
from qo_ops.demo.data import load_demo_data
from qo_ops.downstream.client import DownstreamClient
from qo_ops.downstream.local import SimulatorProcess, simulator_process

T = TypeVar("T")
APPLICATION_NAME = "qo-ops-nemesis"  # the harness's own sessions, spared by backend_terminate
DATABASE = "qo_ops_nemesis"
QUOTES_PER_TENANT = 800  # enough for every job's anomalies, audit records past retention too
SIMULATOR_LATENCY_MS = 20  # a downstream call takes a while, so faults find calls in flight
# The project's short retry settings (docs/downstream.md), so an iteration takes seconds.
RUN_SETTINGS = {
    "QO_OPS_RETRY_BASE_S": "0.2",
    "QO_OPS_RETRY_CAP_S": "1",
    "QO_OPS_BREAKER_OPEN_S": "1",
    "QO_OPS_STOP_GRACE_S": "5",
    "QO_OPS_DB_RETRY_S": "30",
}


@dataclass(frozen=True)
class Server:
    """A PostgreSQL server (its URL names database ``postgres``); ``pgdata`` is its data
    directory when the nemesis owns it, and only then can it be restarted."""

    url: URL
    pgdata: Path | None

    @property
    def restartable(self) -> bool:
        return self.pgdata is not None

    def restart(self) -> None:
        """``pg_ctl restart -m fast``, as the server's owner, its output to a log file in
        the data directory: no pipe is captured (the new postmaster would keep it open)."""
        from pgserver import _commands

        assert self.pgdata is not None, "not the nemesis's own server"
        owner = self.pgdata.stat().st_uid
        user = pwd.getpwuid(owner).pw_name if owner != os.geteuid() else None
        pg_ctl = getattr(_commands, "pg_ctl")  # noqa: B009 - pgserver defines it at import time
        log = str(self.pgdata / "nemesis-restart.log")
        pg_ctl(
            ["-w", "-t", "60", "restart", "-m", "fast", "-l", log],
            pgdata=self.pgdata,
            user=user,
            timeout=90,
        )


@contextmanager
def own_server() -> Iterator[Server]:
    """A fresh embedded PostgreSQL in a temporary data directory, stopped and removed after."""
    root = Path(tempfile.mkdtemp(prefix="qo-ops-nemesis-pg-"))
    pgdata = root / "pgdata"
    try:
        yield Server(start_embedded_server(pgdata).set(database="postgres"), pgdata)
    finally:
        stop_embedded_server(pgdata)
        shutil.rmtree(root, ignore_errors=True)


@contextmanager
def bench_server() -> Iterator[Server]:
    """``QO_OPS_TEST_DATABASE_URL``'s server (not ours: never restarted), else our own."""
    external = os.environ.get("QO_OPS_TEST_DATABASE_URL")
    if external:
        yield Server(parse_database_url(external).set(database="postgres"), None)
        return
    with own_server() as server:
        yield server


def harness_engine(url: URL) -> Engine:
    """The harness's connections: no pool (a restart leaves nothing stale), named so that
    terminating qo-ops's backends spares them."""
    return sa.create_engine(
        url, poolclass=sa.pool.NullPool, connect_args={"application_name": APPLICATION_NAME}
    )


def patiently(action: Callable[[], T], what: str) -> T:
    """``action()``, tried again while the database restarts (the harness's own reads)."""
    return retry_while_unavailable(action, limit_s=90, what=what)


@contextmanager
def fresh_database(server: Server) -> Iterator[URL]:
    """Database ``qo_ops_nemesis`` at the head revision, dropped afterwards."""
    with common.fresh_database(DATABASE, server.url) as url:
        yield url


# The downstream's view of one tenant's orders (what seed_from_demo gives a new simulator).
TENANT_DOWNSTREAM_ORDERS = sa.text(
    "SELECT order_number, tenant_id, status FROM downstream_order WHERE tenant_id = :tenant"
)


@dataclass
class World:
    """The database, the simulator and where the runs keep their files."""

    server: Server
    url: URL
    engine: Engine
    home: Path  # QO_OPS_HOME of every run: the object store, the audit archives
    simulator: SimulatorProcess
    client: DownstreamClient
    data_seed: int

    def run_env(self) -> dict[str, str]:
        """The environment of a ``qo-ops`` process: no setting of the caller's, ours only."""
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("QO_OPS_") and k not in ("COLUMNS", "LINES")
        }
        url = self.url.set(drivername="postgresql").render_as_string(hide_password=False)
        env.update(
            QO_OPS_DATABASE_URL=url,
            QO_OPS_HOME=str(self.home),
            QO_OPS_DOWNSTREAM_URL=self.simulator.url,
            **RUN_SETTINGS,
        )
        return env

    def add_tenants(self, count: int) -> list[str]:
        """New demo tenants (every job's anomalies: new work arrives), and their orders in
        the simulator, as the demo seeds it."""
        report = patiently(
            lambda: load_demo_data(
                self.engine,
                tenants=count,
                quotes=QUOTES_PER_TENANT,
                seed=self.data_seed,
                as_of=datetime.now(UTC),
                append=True,
                objects=self.home / "objects",
            ),
            "loading a tenant",
        )
        for tenant in report.tenants:
            with self.engine.connect() as conn:
                rows = conn.execute(TENANT_DOWNSTREAM_ORDERS, {"tenant": tenant}).all()
            for row in rows:
                self.client.put_order(row.order_number, row.tenant_id, row.status)
        return list(report.tenants)

    def db_now(self) -> datetime:
        """The database's clock (what every decision about shared state is taken by)."""

        def read() -> datetime:
            with self.engine.connect() as conn:
                value: datetime = conn.execute(sa.text("SELECT clock_timestamp()")).scalar_one()
                return value

        return patiently(read, "reading the database clock")


@contextmanager
def world(server: Server, work: Path, seed: int) -> Iterator[World]:
    """A fresh database with no tenant yet, and a simulator (20 ms of latency, its fault
    decisions seeded by ``seed``) on a free loopback port."""
    home = work / "home"
    home.mkdir(parents=True, exist_ok=True)
    with fresh_database(server) as url:
        engine = harness_engine(url)
        flags = ("--latency-ms", str(SIMULATOR_LATENCY_MS), "--seed", str(seed % 2**31))
        with simulator_process(work / "downstream.sqlite3", *flags) as sim:
            client = DownstreamClient(sim.url, read_timeout=10.0)
            try:
                yield World(server, url, engine, home, sim, client, seed % 2**31)
            finally:
                client.close()
                engine.dispose()
