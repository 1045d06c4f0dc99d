"""Where the database comes from: a URL, or the embedded server reused across processes."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import sqlalchemy as sa

from qo_ops.config import Settings
from qo_ops.db.engine import resolve_target, stop_embedded_server
from qo_ops.errors import ConfigError
from qo_ops_tests.conftest import QO_OPS_BIN, REPO, base_env, run_cli


def _postmaster_pid(pgdata: Path) -> int:
    return int((pgdata / "postmaster.pid").read_text().splitlines()[0])


@pytest.fixture
def qo_home():
    home = Path(tempfile.mkdtemp(prefix="qo-ops-home-"))
    yield home
    stop_embedded_server(home / "pgdata")
    shutil.rmtree(home, ignore_errors=True)


def test_embedded_server_is_started_once_and_reused_by_the_next_process(qo_home):
    env = base_env(QO_OPS_HOME=str(qo_home))
    first = run_cli(["db", "upgrade"], env)
    assert first.code == 0, first.stderr
    pgdata = qo_home / "pgdata"
    pid = _postmaster_pid(pgdata)
    os.kill(pid, 0)  # still running after the first process exited

    second = run_cli(["info", "--json"], env)
    assert second.code == 0, second.stderr
    info = json.loads(second.stdout)
    assert info["embedded"] is True
    assert info["schema_revision"] == info["head_revision"]
    assert str(pgdata) in info["database"]
    assert _postmaster_pid(pgdata) == pid  # the same server, not a second one


@pytest.mark.skipif(
    os.geteuid() != 0, reason="this run is already an ordinary user's: every other test covers it"
)
def test_embedded_server_works_for_an_ordinary_user():
    """As root, run the CLI as `nobody` too: pgserver then runs postgres as that user."""
    home = Path(tempfile.mkdtemp(prefix="qo-ops-nobody-"))
    nobody = pwd.getpwnam("nobody")
    os.chown(home, nobody.pw_uid, nobody.pw_gid)
    env = base_env(QO_OPS_HOME=str(home), HOME=str(home), XDG_RUNTIME_DIR=str(home))
    try:
        proc = subprocess.run(
            [
                "setpriv",
                f"--reuid={nobody.pw_uid}",
                f"--regid={nobody.pw_gid}",
                "--clear-groups",
                QO_OPS_BIN,
                "db",
                "upgrade",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            cwd=home,
        )
        assert proc.returncode == 0, proc.stderr
        pgdata = home / "pgdata"
        owner = pwd.getpwuid((pgdata / "PG_VERSION").stat().st_uid).pw_name
        assert owner == "nobody"
        pid = _postmaster_pid(pgdata)
        assert pwd.getpwuid(os.stat(f"/proc/{pid}").st_uid).pw_name == "nobody"
    finally:
        stop_embedded_server(home / "pgdata")
        shutil.rmtree(home, ignore_errors=True)


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("not a url", "not a database URL"),
        ("mysql://user:pw@localhost/db", "must be a postgresql:// URL"),
        ("postgresql://user:s3cr3t-pw@127.0.0.1:1/qo", "cannot connect"),
        ("postgresql://user:s3cr3t-pw@127.0.0.1:1/", "names no database"),
    ],
)
def test_bad_database_url_is_one_clear_line(url, expected):
    result = run_cli(["info"], base_env(QO_OPS_DATABASE_URL=url), timeout=60)
    assert result.code != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert expected in lines[0]
    assert "s3cr3t-pw" not in result.stderr + result.stdout  # the password never shows
    assert "Traceback" not in result.stderr


def test_resolve_target_with_url_never_starts_a_server(tmp_path):
    target = resolve_target(
        Settings(home=tmp_path, database_url="postgres://u:p@db.example:5432/qo")
    )
    assert not target.embedded
    assert target.url.drivername == "postgresql+psycopg"
    assert "p@" not in target.display()
    assert target.dagster_storage_url().startswith(
        "postgresql+psycopg2://u:p@db.example:5432/qo_dagster"
    )
    assert not (tmp_path / "pgdata").exists()
    with pytest.raises(ConfigError):
        resolve_target(Settings(home=tmp_path, database_url="sqlite:///x.db"))


def test_dagster_storage_runs_on_the_same_server(db, tmp_path, monkeypatch):
    """dagster.yaml's storage works with the URL qo-ops gives it (psycopg2, own database)."""
    from dagster import DagsterInstance

    from qo_ops.db.engine import ensure_database

    storage_url = db.target.dagster_storage_url()
    ensure_database(db.url, sa.engine.make_url(storage_url).database)
    shutil.copy(REPO / "dagster.yaml", tmp_path / "dagster.yaml")
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path))
    monkeypatch.setenv("QO_OPS_DAGSTER_STORAGE_URL", storage_url)
    with DagsterInstance.get() as instance:
        assert type(instance.run_storage).__name__ == "PostgresRunStorage"
        assert instance.get_runs() == []
    check = sa.create_engine(sa.engine.make_url(storage_url).set(drivername="postgresql+psycopg"))
    with check.connect() as conn:
        tables = set(sa.inspect(conn).get_table_names())
    check.dispose()
    assert {"runs", "event_logs"} <= tables
