"""Upgrades while qo-ops runs (qo_ops/db/migrate.py): the code refuses only a schema older
than it needs or contracted past it; a database an older release migrated is adopted and
keeps serving that release; a migration queued behind a long transaction gives way to the
business's writers (lock timeout), retries with backoff and succeeds once it ends, or fails
after its bounded tries having applied nothing; a contract step waits for older code's runs.

The previous release's own code against the new schema: test_previous_release.py."""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from qo_ops.cli import db as db_cli
from qo_ops.cli import main
from qo_ops.db import migrate
from qo_ops.db.schema import job_run
from qo_ops.errors import SchemaNotReady
from qo_ops.metrics.exporter import JobCollector
from qo_ops.platform.observability.events import EVENT_LOGGER

# a writer's insert may wait this much beyond the lock timeout (a loaded 2-core CI machine);
# BENCHMARKS.md measures the real figure
MARGIN_S = 1.0


def _set_version(engine: Engine, table: str, value: str) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text(f"UPDATE {table} SET version_num = :v"), {"v": value})


def _columns(engine: Engine, table: str) -> set[str]:
    return {c["name"] for c in sa.inspect(engine).get_columns(table)}


def test_every_migration_after_0017_says_expand_or_contract():
    script = migrate.script_directory()
    contract = set()
    for rev in script.walk_revisions():
        if int(rev.revision) <= int(migrate.FIRST_SIDE_BY_SIDE):
            continue  # written before the rule; applied stop-the-world
        phase = getattr(rev.module, "phase", None)
        assert phase in ("expand", "contract"), f"{rev.revision}: phase = 'expand' or 'contract'"
        if phase == "contract":
            contract.add(rev.revision)
    assert contract == set(migrate.CONTRACT_REVISIONS), "name it in migrate.CONTRACT_REVISIONS"


def test_a_database_an_older_release_migrated_is_adopted_and_keeps_serving_it(empty_db):
    engine = empty_db.engine
    migrate.upgrade(engine, "0017")
    with engine.begin() as conn:  # as the release at 0017 left it: its revision in the old table
        conn.execute(sa.text(f"DROP TABLE {migrate.VERSION_TABLE}"))
    assert migrate.current_revision(engine) == "0017"

    report = migrate.upgrade(engine)

    assert (report.before, report.after) == ("0017", migrate.HEAD_REVISION)
    assert migrate.current_revision(engine) == migrate.HEAD_REVISION
    # what the release at 0017 checks: the old table still says its own head
    with engine.connect() as conn:
        old_view = conn.scalars(sa.text(f"SELECT version_num FROM {migrate.SERVES_TABLE}")).all()
    assert old_view == ["0017"]
    assert {"code_version", "code_revision"} <= _columns(engine, "job_run")
    migrate.require_current(engine)


def test_the_code_refuses_only_an_older_schema_or_one_contracted_past_it(db, cli):
    engine = db.engine
    migrate.require_current(engine)  # at head
    _set_version(engine, migrate.VERSION_TABLE, "0031")  # newer expand steps: fine (Oban's rule)
    migrate.require_current(engine)
    assert cli("status").code == 0

    _set_version(engine, migrate.VERSION_TABLE, "0016")
    with pytest.raises(SchemaNotReady) as older:
        migrate.require_current(engine)
    assert "at 0016" in str(older.value) and f"needs {migrate.HEAD_REVISION}" in str(older.value)

    _set_version(engine, migrate.VERSION_TABLE, "0031")
    _set_version(engine, migrate.SERVES_TABLE, "0030")  # a contract step at 0030 ran
    result = cli("status")
    assert result.code != 0 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert (
        "serves code from 0030" in result.stderr and f"at {migrate.HEAD_REVISION}" in result.stderr
    )


def test_db_status_says_revision_served_code_and_pending_steps(cli):
    upgraded = cli("db", "upgrade", "--reason", "weekly release")
    assert upgraded.code == 0 and "already at" in upgraded.stdout
    events = [json.loads(line) for line in upgraded.stderr.splitlines() if line.startswith("{")]
    assert [e["event.name"] for e in events] == ["migration.start", "migration.end"]
    assert events[1]["outcome"] == "ok" and events[1]["applied"] == []
    result = cli("db", "status")
    assert result.code == 0, result.stderr
    assert f"schema:      {migrate.HEAD_REVISION}" in result.stdout
    assert "serves code: 0017 and newer" in result.stdout
    assert "pending:     expand none; contract none" in result.stdout


def _insert_run(conn: sa.Connection, **values: object) -> uuid.UUID:
    """A job_run row as a run (or the business's writer) leaves it; ``values`` override."""
    row = {
        "id": uuid.uuid4(),
        "job_name": "quote_expiration",
        "scope": "tenant-001",
        "mode": "dry_run",
        "trigger_type": "manual",
        "owner_id": "test",
        "status": "success",
        **values,
    }
    conn.execute(sa.insert(job_run).values(row))
    return row["id"]  # type: ignore[return-value]


def _writer(engine: Engine, stop: threading.Event, waits: list[float]) -> None:
    """The business's writes into the table the migration alters: one insert every 50 ms,
    each timed."""
    while not stop.is_set():
        began = time.monotonic()
        with engine.begin() as conn:
            _insert_run(conn, job_name="writer")
        waits.append(time.monotonic() - began)
        stop.wait(0.05)


def _long_transaction(engine: Engine, hold_s: float, started: threading.Event) -> None:
    """A reader's transaction that keeps job_run locked (ACCESS SHARE) for ``hold_s``."""
    with engine.begin() as conn:
        conn.execute(sa.text("SELECT count(*) FROM job_run"))
        started.set()
        time.sleep(hold_s)


def test_a_migration_behind_a_long_transaction_gives_way_to_writers_then_succeeds(empty_db):
    engine = empty_db.engine
    migrate.upgrade(engine, "0017")
    stop, started, waits = threading.Event(), threading.Event(), []
    reader = threading.Thread(target=_long_transaction, args=(engine, 4.0, started))
    writer = threading.Thread(target=_writer, args=(engine, stop, waits))
    reader.start()
    started.wait(10)
    writer.start()
    try:
        report = migrate.upgrade(engine, requested_by="test", reason="behind a long reader")
    finally:
        stop.set()
        reader.join()
        writer.join()

    assert report.applied == ["0018", "0019"] and report.outcome == "ok"
    assert report.lock_timeouts >= 2  # it gave way at least twice in the 4 s the reader held
    assert {"code_version", "code_revision"} <= _columns(engine, "job_run")
    assert f"SET lock_timeout = '{migrate.LOCK_TIMEOUT}'" == migrate.SET_LOCK_TIMEOUT
    assert f"SET statement_timeout = '{migrate.STATEMENT_TIMEOUT}'" == migrate.SET_STATEMENT_TIMEOUT
    lock_timeout_s = float(migrate.LOCK_TIMEOUT.removesuffix("s"))
    assert len(waits) >= 5  # it kept writing through the upgrade (fewer on a loaded machine)
    assert max(waits) <= lock_timeout_s + MARGIN_S, sorted(waits)[-5:]
    assert max(waits) > lock_timeout_s / 2  # they did queue behind the migration's attempts
    with engine.connect() as conn:
        row = conn.execute(
            sa.text("SELECT outcome, lock_timeouts, reason, applied FROM schema_migration")
        ).one()
    samples = {  # the exporter's view of it
        (m.name, tuple(sorted(smp.labels.items()))): smp.value
        for m in JobCollector(engine, []).collect()
        for smp in m.samples
    }
    assert samples[("qo_ops_schema_upgrade_last_lock_timeouts", ())] == report.lock_timeouts
    assert samples[("qo_ops_schema_upgrade_last_failed", ())] == 0
    assert samples[("qo_ops_schema_revision", ())] == int(migrate.HEAD_REVISION)
    assert samples[("qo_ops_schema_serves_code_from", ())] == 17
    assert (row.outcome, row.lock_timeouts, row.reason) == (
        "ok",
        report.lock_timeouts,
        "behind a long reader",
    )
    assert row.applied == ["0018", "0019"]


def test_a_migration_that_never_gets_its_locks_fails_in_one_line_having_applied_nothing(
    empty_db, monkeypatch
):
    engine = empty_db.engine
    migrate.upgrade(engine, "0017")
    monkeypatch.setattr(migrate, "LOCK_ATTEMPTS", 3)
    slept: list[float] = []
    started = threading.Event()
    reader = threading.Thread(target=_long_transaction, args=(engine, 6.0, started))
    reader.start()
    started.wait(10)
    try:
        with pytest.raises(migrate.MigrationBlocked) as blocked:
            migrate.upgrade(engine, sleep=slept.append)
    finally:
        reader.join()
    message = str(blocked.value)
    assert "\n" not in message and "0018" in message and "0018 was rolled back" in message
    assert slept == [0.5, 1.0]  # backoff between the 3 tries
    assert migrate.current_revision(engine) == "0017"
    assert not {"code_version", "code_revision"} & _columns(engine, "job_run")
    assert migrate.upgrade(engine).applied == ["0018", "0019"]  # the reader gone: it goes through


CONTRACT_STEP = '''"""Contract (planted by the test): drops what the release at 0019 still reads.

Revision ID: 0020
Revises: 0019
"""

from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None
phase = "contract"


def upgrade() -> None:
    op.execute("COMMENT ON COLUMN job_run.window_end IS 'unused since 0020'")


def downgrade() -> None:
    op.execute("COMMENT ON COLUMN job_run.window_end IS NULL")
'''


@pytest.fixture
def with_contract_step(tmp_path: Path, monkeypatch) -> None:
    """This code's migrations plus a contract step 0020, as the next release would ship."""
    planted = tmp_path / "migrations"
    shutil.copytree(migrate.MIGRATIONS_DIR, planted, ignore=shutil.ignore_patterns("__pycache__"))
    (planted / "versions" / "0020_planted_contract.py").write_text(CONTRACT_STEP)
    monkeypatch.setattr(migrate, "MIGRATIONS_DIR", planted)
    monkeypatch.setattr(migrate, "HEAD_REVISION", "0020")
    monkeypatch.setattr(migrate, "CONTRACT_REVISIONS", frozenset({"0020"}))


def _older_run_holding_a_lease(engine: Engine) -> uuid.UUID:
    with engine.begin() as conn:
        run_id = _insert_run(
            conn, mode="execute", trigger_type="schedule", status="running", code_revision="0019"
        )
        conn.execute(
            sa.text(
                "INSERT INTO job_lease (job_name, scope, owner_id, lease_token, fencing_token, "
                "acquired_at, heartbeat_at, expires_at, job_run_id) VALUES ('quote_expiration', "
                "'tenant-001', 'old-worker', 'lt', 7, now(), now(), now() + interval '5 minutes', :id)"
            ),
            {"id": run_id},
        )
    return run_id


def test_a_contract_step_waits_for_older_codes_runs_then_retires_that_code(
    db, with_contract_step, monkeypatch
):
    engine = db.engine
    run_id = _older_run_holding_a_lease(engine)
    running = [
        (tuple(smp.labels.items()), smp.value)
        for m in JobCollector(engine, []).collect()
        for smp in m.samples
        if smp.name == "job_runs_running_by_code"
    ]
    assert running == [((("code_revision", "0019"),), 1.0)]  # what a rollout's dashboard shows

    expand_only = migrate.upgrade(engine)  # a plain `db upgrade` never contracts
    assert expand_only.pending_contract == ["0020"] and expand_only.applied == []
    with pytest.raises(migrate.MigrationBlocked) as refused:
        migrate.upgrade(engine, contract=True, requested_by="sre", reason="retire 0019")
    message = str(refused.value)
    assert "\n" not in message and "contract step 0020 refused" in message
    assert "quote_expiration tenant-001 (code 0019)" in message
    assert migrate.current_revision(engine) == "0019"
    with engine.connect() as conn:
        asked = conn.execute(
            sa.text("SELECT outcome, requested_by FROM schema_migration WHERE contract")
        ).all()
    assert [tuple(r) for r in asked] == [("refused", "sre")]
    with engine.connect() as conn:
        audited = conn.execute(
            sa.text(
                "SELECT actor, decision, reason FROM job_audit "
                "WHERE action = 'schema_upgrade_contract'"
            )
        ).all()
    assert [tuple(r) for r in audited] == [("sre", "refused", "retire 0019")]

    with engine.begin() as conn:  # the old run ends and gives its lease back
        conn.execute(
            sa.text("UPDATE job_run SET status = 'success' WHERE id = :id"), {"id": run_id}
        )
        conn.execute(sa.text("DELETE FROM job_lease"))
    assert migrate.upgrade(engine, contract=True).applied == ["0020"]
    assert migrate.serves_from(engine) == "0020"
    migrate.require_current(engine)  # the release that shipped the contract step runs on
    monkeypatch.setattr(migrate, "HEAD_REVISION", "0019")  # the release before it does not
    monkeypatch.setattr(migrate, "CONTRACT_REVISIONS", frozenset())
    with pytest.raises(SchemaNotReady, match="serves code from 0020 on; this code is at 0019"):
        migrate.require_current(engine)


def test_status_names_the_code_that_ran_each_tenants_last_run(cli, db):
    assert cli("demo-data", "--tenants", "2", "--quotes", "50", "--seed", "1", "--reset").code == 0
    ran = cli("run", "quote_expiration", "--tenant", "tenant-001", "--mode", "dry-run")
    assert ran.code == 0, ran.stderr
    with db.engine.begin() as conn:  # tenant-002's last run: by a release before 0018
        _insert_run(conn, scope="tenant-002", finished_at=sa.func.now())
    status = cli("status", "quote_expiration", "--all")
    assert status.code == 0, status.stderr
    rows = {ln.split()[1]: ln for ln in status.stdout.splitlines() if ln.startswith("quote_exp")}
    assert rows["tenant-001"].rstrip().endswith(migrate.code_version())
    assert rows["tenant-002"].rstrip().endswith("before 0018")


def test_after_a_contract_step_a_bad_release_is_fixed_by_the_next_not_by_a_downgrade(
    db, with_contract_step, monkeypatch, tmp_path
):
    """Roll forward (docs/deploy.md): the release at 0020 contracted; going back to 0019's
    code is refused; the fix ships as 0021, an expand step, and both 0020 and 0021 run on
    the schema while it rolls out."""
    engine = db.engine
    assert migrate.upgrade(engine, contract=True).applied == ["0020"]
    monkeypatch.setattr(migrate, "HEAD_REVISION", "0019")  # "roll back" the code: refused
    with pytest.raises(SchemaNotReady, match="deploy a release at 0020 or newer"):
        migrate.require_current(engine)

    fix = migrate.MIGRATIONS_DIR / "versions" / "0021_planted_fix.py"
    fix.write_text(
        CONTRACT_STEP.replace(
            "Contract (planted by the test): drops what the release at 0019 still reads.",
            "Expand: the fix of the release at 0020.",
        )
        .replace('revision = "0020"', 'revision = "0021"')
        .replace('down_revision = "0019"', 'down_revision = "0020"')
        .replace("Revision ID: 0020\nRevises: 0019", "Revision ID: 0021\nRevises: 0020")
        .replace('phase = "contract"', 'phase = "expand"')
        .replace("job_run.window_end", "job_run.window_start")
    )
    monkeypatch.setattr(migrate, "HEAD_REVISION", "0021")
    report = migrate.upgrade(engine)  # the next release's expand step, no --contract needed
    assert report.applied == ["0021"] and migrate.serves_from(engine) == "0020"
    migrate.require_current(engine)  # the fixed release runs
    monkeypatch.setattr(migrate, "HEAD_REVISION", "0020")
    migrate.require_current(engine)  # and the bad one still runs beside it while it rolls out


def test_db_upgrade_fails_in_one_line_when_a_pending_contract_step_holds_back_this_codes_expand(
    db, with_contract_step, monkeypatch, capsys
):
    """The migrate Job of a release whose expand step comes after a contract step still
    pending exits non-zero (the new code would refuse the schema), and says what to do."""
    (migrate.MIGRATIONS_DIR / "versions" / "0021_planted_expand.py").write_text(
        CONTRACT_STEP.replace('revision = "0020"', 'revision = "0021"')
        .replace('down_revision = "0019"', 'down_revision = "0020"')
        .replace('phase = "contract"', 'phase = "expand"')
    )
    monkeypatch.setattr(migrate, "HEAD_REVISION", "0021")
    monkeypatch.setenv("QO_OPS_DATABASE_URL", db.env_url)
    events = logging.getLogger(EVENT_LOGGER)  # the command adds a JSON handler to stderr
    monkeypatch.setattr(events, "handlers", list(events.handlers))  # gone after this test
    code = main(["db", "upgrade"])  # in process: the planted migrations are this process's
    err = capsys.readouterr().err
    assert code != 0
    [line] = [ln for ln in err.splitlines() if not ln.startswith("{")]  # events are JSON
    assert "before contract step(s) 0020" in line and "needs 0021" in line
    assert "db upgrade --contract" in line and "Traceback" not in err
    assert migrate.current_revision(db.engine) == "0019"


def _index_valid(engine: Engine, name: str) -> bool | None:
    with engine.connect() as conn:
        return conn.scalar(
            sa.text("SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass(:n)"),
            {"n": name},
        )


def test_an_invalid_index_a_failed_concurrent_build_left_is_rebuilt_on_retry(empty_db):
    """0013 builds its index on audit_record concurrently (qo_ops/db/migrations/safe.py); a
    build that failed half-way (a lock or statement timeout, a cancel) leaves an INVALID
    index of that name, which the retry drops and builds again, not keeps."""
    engine = empty_db.engine
    index = "ix_audit_record_tenant_day_id"
    migrate.upgrade(engine, "0012")
    with engine.begin() as conn:  # what the failed first attempt left
        conn.execute(sa.text(f"CREATE INDEX {index} ON audit_record (tenant_id)"))
        conn.execute(
            sa.text("UPDATE pg_index SET indisvalid = false WHERE indexrelid = to_regclass(:n)"),
            {"n": index},
        )
    assert _index_valid(engine, index) is False

    assert migrate.upgrade(engine, "0013").applied == ["0013"]

    assert _index_valid(engine, index) is True
    with engine.connect() as conn:  # and it is 0013's index, not the leftover's definition
        definition = conn.scalar(sa.text("SELECT pg_get_indexdef(to_regclass(:n))"), {"n": index})
    assert "timezone('UTC'" in definition and definition.rstrip(")").endswith("id")


def test_a_person_at_a_terminal_reads_each_lock_timeout_retry_as_a_line(capsys):
    """`qo-ops db upgrade` in a terminal prints no JSON: a line per retry, then the summary
    (a Job's log, not a terminal, gets the JSON events: test_db_status_…)."""
    handler = db_cli._RetryLines()
    events = logging.getLogger(f"{EVENT_LOGGER}.migrate")
    events.addHandler(handler)
    try:
        migrate._event(
            logging.WARNING, "migration.lock_timeout", revision="0018", attempt=2, retry_in_s=1.0
        )
        migrate._event(logging.INFO, "migration.end", outcome="ok")
    finally:
        events.removeHandler(handler)
    err = capsys.readouterr().err
    assert err == "migration 0018 gave way to writers (lock timeout, try 2); again in 1.0 s\n"
