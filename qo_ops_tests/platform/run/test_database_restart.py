"""PostgreSQL really restarted (``pg_ctl restart -m fast`` and ``-m immediate``) under two
running quote_expiration runs, the operator API and the exporter.

The runs end ``failed`` with the error class ``database_unavailable``, their records
finished and their leases given back once the server is back; a rerun right after
proceeds and finishes the work exactly; the API and the exporter answer again without
being restarted. The server is this module's own, so restarting it disturbs no other test.

Tests ``qo_ops.platform.run.runner`` (with ``qo_ops.db.availability``); quote_expiration is
the job these drive.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL

from qo_ops.db import migrate
from qo_ops.db.engine import start_embedded_server, stop_embedded_server
from qo_ops.demo.data import load_demo_data
from qo_ops_tests.api.conftest import ApiServer
from qo_ops_tests.conftest import QO_OPS_BIN, base_env, create_database, run_cli
from qo_ops_tests.conftest import TestDatabase as Database
from qo_ops_tests.dagster.stack import free_port
from qo_ops_tests.metrics.test_exporter import scrape, value
from qo_ops_tests.platform.run.test_faults import (
    AS_OF,
    assert_outcome_intact,
    overdue,
    scalar,
    wait_for,
)

TENANTS = ("tenant-001", "tenant-002")


@pytest.fixture(scope="module")
def own_server() -> Iterator[tuple[URL, Path]]:
    """A PostgreSQL server of this module's own: its URL and data directory."""
    pgdata = Path(tempfile.mkdtemp(prefix="qo-ops-restart-pg-")) / "pgdata"
    try:
        yield start_embedded_server(pgdata).set(database="postgres"), pgdata
    finally:
        stop_embedded_server(pgdata)
        shutil.rmtree(pgdata.parent, ignore_errors=True)


@pytest.fixture
def restart_db(own_server, request) -> Iterator[tuple[Database, Path]]:
    server, pgdata = own_server
    url = create_database(
        server, f"restart_{request.node.name[-40:].replace('[', '_').replace(']', '')}"
    )
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    migrate.upgrade(engine)
    load_demo_data(engine, tenants=2, quotes=2000, seed=7, as_of=AS_OF)
    yield Database(url, engine), pgdata
    engine.dispose()


def pg_ctl(pgdata: Path, *args: str) -> None:
    """``pg_ctl ARGS`` as the server's user, logging to a file in the data directory and
    capturing no pipe (a new postmaster would hold a pipe open forever)."""
    import os
    import pwd

    from pgserver import _commands

    owner = pgdata.stat().st_uid
    user = pwd.getpwuid(owner).pw_name if owner != os.geteuid() else None
    command = getattr(_commands, "pg_ctl")  # noqa: B009
    log = ["-l", str(pgdata / "restart.log")] if args[0] in ("start", "restart") else []
    command(["-w", "-t", "60", *args, *log], pgdata=pgdata, user=user, timeout=90)


def run_args(tenant: str) -> list[str]:
    return ["run", "quote_expiration", "--tenant", tenant, "--mode", "execute", "--reason", "t"]


@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_runs_api_and_exporter_ride_out_a_database_restart(restart_db, tmp_path, mode):
    db, pgdata = restart_db
    env = base_env(QO_OPS_DATABASE_URL=db.env_url, QO_OPS_HOME=str(tmp_path))
    exporter_port = free_port()
    exporter = subprocess.Popen(
        [QO_OPS_BIN, "metrics", "--host", "127.0.0.1", "--port", str(exporter_port)],
        env={**env, "QO_OPS_METRICS_REFRESH_S": "1"},
        stdout=(tmp_path / "metrics.log").open("w"),
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    api = ApiServer(
        {**env, "QO_OPS_DAGSTER_URL": f"http://127.0.0.1:{free_port()}"},
        tmp_path / "api.log",
        env,
    )
    runs: list[subprocess.Popen] = []
    try:
        viewer = api.token("vera", "viewer")
        assert api.get("/internal/jobs/quote_expiration/status", viewer).status_code == 200
        metrics_url = f"http://127.0.0.1:{exporter_port}"
        wait_for(lambda: _database_up(metrics_url) == 1, what="the exporter's first scrape")

        for tenant in TENANTS:
            runs.append(
                subprocess.Popen(
                    [QO_OPS_BIN, *run_args(tenant), "--batch-size", "50", "--throttle-ms", "200"],
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=(tmp_path / f"{tenant}.out").open("w"),
                    stderr=(tmp_path / f"{tenant}.err").open("w"),
                )
            )
        wait_for(
            lambda: (
                scalar(
                    db.engine,
                    "SELECT count(*) FROM job_run WHERE status = 'running' AND processed_count >= 50",
                )
                == 2
            ),
            what="both runs under way",
        )
        pg_ctl(pgdata, "restart", "-m", mode)
        codes = [proc.wait(timeout=180) for proc in runs]  # a test bound, not a timing assertion
        errors = [(tmp_path / f"{t}.err").read_text() for t in TENANTS]
        assert codes == [1, 1], errors
        assert all("Traceback" not in e for e in errors), errors

        with db.engine.connect() as conn:
            rows = conn.execute(
                sa.text("SELECT status, last_error_code, finished_at FROM job_run ORDER BY scope")
            ).all()
        assert [(r.status, r.last_error_code) for r in rows] == [
            ("failed", "database_unavailable")
        ] * 2
        assert all(r.finished_at is not None for r in rows)
        assert scalar(db.engine, "SELECT count(*) FROM job_lease WHERE expires_at > now()") == 0
        assert all(overdue(db.engine, t) > 0 for t in TENANTS)  # cut short, for real

        for tenant in TENANTS:  # right away: nothing to wait out
            rerun = run_cli(run_args(tenant), env)
            assert rerun.code == 0, rerun.stderr[-800:]
        assert all(overdue(db.engine, t) == 0 for t in TENANTS)
        assert_outcome_intact(db.engine)

        # the API and the exporter were never restarted
        wait_for(
            lambda: _status_code(api, viewer) == 200, timeout=60, what="the API to answer again"
        )
        wait_for(lambda: _database_up(metrics_url) == 1, timeout=60, what="the exporter to recover")
        assert exporter.poll() is None and api.process.poll() is None
    finally:
        for proc in runs:
            if proc.poll() is None:
                proc.kill()
        api.stop()
        exporter.terminate()
        exporter.wait(timeout=15)


def _status_code(api: ApiServer, token: str) -> int:
    try:
        return api.get("/internal/jobs/quote_expiration/status", token).status_code
    except httpx.TransportError:
        return 0


def _database_up(url: str) -> float:
    try:
        return value(scrape(url), "qo_ops_database_up")
    except (httpx.TransportError, KeyError):
        return -1
    finally:
        time.sleep(0.2)


def test_a_run_whose_database_never_returns_says_so_in_one_line(own_server, tmp_path):
    """The server stays down: the run gives up after QO_OPS_DB_RETRY_S with one line and
    exit 1; its record is left to the reaper (it cannot be written)."""
    server, pgdata = own_server
    url = create_database(server, "restart_never")
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    migrate.upgrade(engine)
    load_demo_data(engine, tenants=1, quotes=500, seed=7, as_of=AS_OF)
    db = Database(url, engine)
    env = base_env(QO_OPS_DATABASE_URL=db.env_url, QO_OPS_DB_RETRY_S="3")
    proc = subprocess.Popen(
        [QO_OPS_BIN, *run_args("tenant-001"), "--batch-size", "20", "--throttle-ms", "200"],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=(tmp_path / "out").open("w"),
        stderr=(tmp_path / "err").open("w"),
    )
    try:
        wait_for(
            lambda: (scalar(engine, "SELECT max(processed_count) FROM job_run") or 0) >= 20,
            what="the run under way",
        )
        pg_ctl(pgdata, "stop", "-m", "fast")
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        pg_ctl(pgdata, "start")  # back for the module's teardown
    err = (tmp_path / "err").read_text().strip().splitlines()
    assert code == 1
    assert err[-1].startswith("qo-ops: error: the database did not come back within 3 s"), err[-3:]
    assert "Traceback" not in (tmp_path / "err").read_text()
    engine.dispose()
