"""quote_expiration through the one runner (``run_job``) and the real ``qo-ops`` command:
dry-run writes nothing, execute expires exactly the eligible quotes with one event each,
deadline and cancel (flag or SIGTERM) stop between batches keeping progress, manual runs
are audited, and the reaper finishes runs that were left ``running``."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from qo_ops.db.digest import database_digest
from qo_ops.db.schema import BUSINESS_TABLES, PLATFORM_TABLES, job_checkpoint, outbox_event
from qo_ops.demo.data import load_demo_data
from qo_ops.jobs.quote_expiration import SPEC
from qo_ops.platform.job.options import RunOptions
from qo_ops.platform.job.scope import Scope
from qo_ops.platform.run.records import reap_orphans, request_cancel
from qo_ops.platform.run.runner import RunSummary, run_job
from qo_ops_tests.conftest import QO_OPS_BIN, base_env

AS_OF = datetime(2026, 3, 1, tzinfo=UTC)  # in the past: every ACTIVE quote is overdue by now
TENANT = "tenant-001"
OTHERS = ("tenant-002", "tenant-003")
JOB = "quote_expiration"

# ------------------------------------------------------------------------- helpers


def wait_for(condition: Callable[[], Any], timeout: float = 60.0, what: str = "condition") -> Any:
    """Poll ``condition`` until it returns something truthy (returned); fail after ``timeout``."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    pytest.fail(f"timed out after {timeout}s waiting for {what}")


def rows(engine: sa.Engine, sql: str, **params: Any) -> list[sa.Row]:
    with engine.connect() as conn:
        return conn.execute(sa.text(sql), params).all()


def scalar(engine: sa.Engine, sql: str, **params: Any) -> Any:
    with engine.connect() as conn:
        return conn.execute(sa.text(sql), params).scalar()


def eligible_ids(engine: sa.Engine, tenant: str = TENANT) -> list[int]:
    """ACTIVE quotes of ``tenant`` past expiry, in the job's order; computed independently."""
    return [
        r.id
        for r in rows(
            engine,
            "SELECT id FROM quote WHERE tenant_id = :t AND status = 'ACTIVE' AND expires_at < now() "
            "ORDER BY expires_at, id",
            t=tenant,
        )
    ]


def quote_states(engine: sa.Engine, ids: list[int]) -> dict[int, tuple[str, int]]:
    return {
        r.id: (r.status, r.version)
        for r in rows(
            engine, "SELECT id, status, version FROM quote WHERE id = ANY(:ids)", ids=list(ids)
        )
    }


def expired_among(engine: sa.Engine, ids: list[int]) -> set[int]:
    return {i for i, (status, _) in quote_states(engine, ids).items() if status == "EXPIRED"}


def events_per_quote(engine: sa.Engine, ids: list[int]) -> dict[int, int]:
    """How many QuoteExpired events each quote has (keyed 'quote:<id>:expired')."""
    found = dict.fromkeys(ids, 0)
    for r in rows(
        engine,
        "SELECT aggregate_id, count(*) AS n FROM outbox_event WHERE event_type = 'QuoteExpired' "
        "AND aggregate_id = ANY(:ids) GROUP BY aggregate_id",
        ids=[str(i) for i in ids],
    ):
        found[int(r.aggregate_id)] = r.n
    return found


def tenant_fingerprint(engine: sa.Engine, tenants: tuple[str, ...]) -> tuple[str, str]:
    """md5 over the quotes and outbox events of ``tenants``."""
    return (
        scalar(
            engine,
            "SELECT md5(string_agg(q::text, '|' ORDER BY q.id)) FROM quote q "
            "WHERE q.tenant_id = ANY(:t)",
            t=list(tenants),
        ),
        scalar(
            engine,
            "SELECT md5(coalesce(string_agg(e::text, '|' ORDER BY e.id), '')) FROM outbox_event e "
            "WHERE e.tenant_id = ANY(:t)",
            t=list(tenants),
        ),
    )


def digest_without(engine: sa.Engine, *excluded: str) -> dict[str, str]:
    tables = tuple(t for t in BUSINESS_TABLES + PLATFORM_TABLES if t.name not in excluded)
    with engine.connect() as conn:
        return database_digest(conn, tables)


# business tables plus the job's own effects (events, checkpoints): what a run may change
DATA_TABLES = (*BUSINESS_TABLES, outbox_event, job_checkpoint)


def data_digest(engine: sa.Engine) -> dict[str, str]:
    with engine.connect() as conn:
        return database_digest(conn, DATA_TABLES)


def run_row(engine: sa.Engine, run_id: str | uuid.UUID) -> sa.Row:
    found = rows(engine, "SELECT * FROM job_run WHERE id = :id", id=uuid.UUID(str(run_id)))
    assert len(found) == 1, run_id
    return found[0]


def count_runs(engine: sa.Engine) -> int:
    return scalar(engine, "SELECT count(*) FROM job_run")


def run(engine: sa.Engine, tenant: str = TENANT, **options: Any) -> RunSummary:
    options.setdefault("mode", "execute")
    options.setdefault("requester", "test:quote-expiration")
    options.setdefault("reason", "test run")
    return run_job(SPEC, Scope(tenant), RunOptions(**options), engine=engine)


def running_with_progress(engine: sa.Engine, tenant: str = TENANT) -> uuid.UUID | None:
    """The id of the running execute of ``tenant`` once it has committed a batch, else None."""
    found = rows(
        engine,
        "SELECT id FROM job_run WHERE job_name = :j AND scope = :t AND mode = 'execute' "
        "AND status = 'running' AND processed_count > 0",
        j=JOB,
        t=tenant,
    )
    assert len(found) <= 1
    return found[0].id if found else None


def assert_all_checks_passed(summary: RunSummary) -> None:
    assert {c.name for c in summary.checks} == {
        "no_overdue_active_quotes",
        "one_event_per_expired_quote",
    }
    failed = [(c.name, c.metadata) for c in summary.checks if not c.passed]
    assert failed == []


def assert_stopped_with_progress_kept(engine: sa.Engine, run_id: Any, eligible: list[int]) -> int:
    """The run row's processed count is what really changed, strictly between 0 and all."""
    row = run_row(engine, run_id)
    done = expired_among(engine, eligible)
    assert row.processed_count == row.succeeded_count == len(done)
    assert 0 < len(done) < len(eligible)
    assert row.finished_at is not None
    # the quotes expired so far are the oldest ones, each with its one event
    assert done == set(eligible[: len(done)])
    assert set(events_per_quote(engine, sorted(done)).values()) == {1}
    assert set(events_per_quote(engine, eligible[len(done) :]).values()) == {0}
    return len(done)


def assert_rerun_finishes(engine: sa.Engine, eligible: list[int], done: int) -> None:
    """A rerun expires exactly the rest; every eligible quote ends with exactly one event."""
    events_before = scalar(engine, "SELECT count(*) FROM outbox_event")
    summary = run(engine, reason="resume")
    assert summary.status == "success"
    assert summary.counts.processed == summary.counts.succeeded == len(eligible) - done
    assert eligible_ids(engine) == []
    assert expired_among(engine, eligible) == set(eligible)
    assert set(events_per_quote(engine, eligible).values()) == {1}
    assert (
        scalar(engine, "SELECT count(*) FROM outbox_event") == events_before + len(eligible) - done
    )
    assert_all_checks_passed(summary)


@pytest.fixture
def loaded(db):
    """Three tenants; every ACTIVE quote is overdue (as_of is in the past)."""
    load_demo_data(db.engine, tenants=3, quotes=1000, seed=5, as_of=AS_OF)
    eligible = eligible_ids(db.engine)
    assert len(eligible) >= 500
    assert all(eligible_ids(db.engine, t) for t in OTHERS)
    return db, eligible


# ------------------------------------------------------------------------- dry-run


def test_dry_run_writes_nothing_and_counts_what_execute_then_mutates(loaded):
    db, eligible = loaded
    before = digest_without(db.engine, "job_run", "job_audit")
    runs_before = count_runs(db.engine)

    dry = run(db.engine, mode="dry_run")

    assert digest_without(db.engine, "job_run", "job_audit") == before
    assert count_runs(db.engine) == runs_before + 1
    assert dry.status == "success"
    assert dry.eligible_count == len(eligible)
    assert dry.counts.processed == dry.counts.succeeded == 0
    assert dry.sample_ids == [str(i) for i in eligible[:10]]  # exactly what execute would take
    row = run_row(db.engine, dry.job_run_id)
    assert (row.mode, row.status, row.eligible_count, row.processed_count) == (
        "dry_run",
        "success",
        len(eligible),
        0,
    )
    assert row.finished_at is not None

    executed = run(db.engine)

    assert executed.status == "success"
    assert executed.counts.succeeded == dry.eligible_count == len(eligible)
    assert run_row(db.engine, executed.job_run_id).succeeded_count == dry.eligible_count


def test_dry_run_through_the_cli_writes_nothing(loaded, cli):
    db, eligible = loaded
    before = digest_without(db.engine, "job_run", "job_audit")
    runs_before = count_runs(db.engine)

    result = cli("run", JOB, "--tenant", TENANT, "--json")

    assert result.code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert (summary["mode"], summary["status"]) == ("dry_run", "success")
    assert summary["eligible_count"] == len(eligible)
    assert summary["processed_count"] == 0
    assert digest_without(db.engine, "job_run", "job_audit") == before
    assert count_runs(db.engine) == runs_before + 1
    assert run_row(db.engine, summary["job_run_id"]).eligible_count == len(eligible)


# ------------------------------------------------------------------------- execute


def test_execute_expires_every_eligible_quote_with_one_event_each_and_nothing_else(loaded):
    db, eligible = loaded
    versions = {i: v for i, (_, v) in quote_states(db.engine, eligible).items()}
    others_before = tenant_fingerprint(db.engine, OTHERS)
    with db.engine.connect() as conn:
        untouched_before = conn.execute(
            sa.text(
                "SELECT md5(string_agg(q::text, '|' ORDER BY id)) FROM quote q "
                "WHERE tenant_id = :t AND id <> ALL(:ids)"
            ),
            {"t": TENANT, "ids": eligible},
        ).scalar()
    events_before = scalar(db.engine, "SELECT count(*) FROM outbox_event")

    summary = run(db.engine, batch_size=97)

    assert summary.status == "success"
    assert summary.eligible_count == summary.counts.processed == summary.counts.succeeded
    assert summary.counts.succeeded == len(eligible)
    assert summary.counts.failed == summary.counts.skipped == 0
    assert summary.batches == -(-len(eligible) // 97)
    assert_all_checks_passed(summary)

    after = quote_states(db.engine, eligible)
    assert after == {i: ("EXPIRED", versions[i] + 1) for i in eligible}
    events = rows(
        db.engine,
        "SELECT business_key, tenant_id, aggregate_type, aggregate_id, event_type, payload "
        "FROM outbox_event WHERE business_key = ANY(:keys)",
        keys=[f"quote:{i}:expired" for i in eligible],
    )
    assert len(events) == len(eligible)
    for e in events:
        quote_id = int(e.aggregate_id)
        assert e.business_key == f"quote:{quote_id}:expired"
        assert (e.tenant_id, e.aggregate_type, e.event_type) == (TENANT, "quote", "QuoteExpired")
        assert e.payload["quote_id"] == quote_id
        assert e.payload["version"] == versions[quote_id] + 1
    assert scalar(db.engine, "SELECT count(*) FROM outbox_event") == events_before + len(eligible)
    assert set(events_per_quote(db.engine, eligible).values()) == {1}

    assert tenant_fingerprint(db.engine, OTHERS) == others_before
    with db.engine.connect() as conn:
        untouched_after = conn.execute(
            sa.text(
                "SELECT md5(string_agg(q::text, '|' ORDER BY id)) FROM quote q "
                "WHERE tenant_id = :t AND id <> ALL(:ids)"
            ),
            {"t": TENANT, "ids": eligible},
        ).scalar()
    assert untouched_after == untouched_before

    row = run_row(db.engine, summary.job_run_id)
    assert (row.status, row.eligible_count, row.processed_count, row.succeeded_count) == (
        "success",
        len(eligible),
        len(eligible),
        len(eligible),
    )
    assert row.fencing_token is not None and row.finished_at is not None
    # the lease is given back at the end
    assert scalar(
        db.engine,
        "SELECT expires_at <= clock_timestamp() FROM job_lease WHERE job_name = :j AND scope = :t",
        j=JOB,
        t=TENANT,
    )


def test_a_second_execute_is_no_work_and_changes_no_data(loaded):
    db, eligible = loaded
    first = run(db.engine)
    assert first.status == "success" and first.counts.succeeded == len(eligible)
    before = data_digest(db.engine)

    second = run(db.engine)

    assert second.status == "no_work"
    assert second.eligible_count == second.counts.processed == second.counts.succeeded == 0
    assert data_digest(db.engine) == before
    assert run_row(db.engine, second.job_run_id).status == "no_work"
    assert_all_checks_passed(second)


def test_max_items_is_respected_and_the_rest_stays_active(loaded):
    db, eligible = loaded

    summary = run(db.engine, max_items=7, batch_size=3)

    assert summary.counts.processed == summary.counts.succeeded == 7
    assert summary.batches == 3  # 3 + 3 + 1: the last batch shrinks to the room left
    row = run_row(db.engine, summary.job_run_id)
    assert row.processed_count == row.succeeded_count == 7
    assert row.status_reason == "max items reached"
    assert expired_among(db.engine, eligible) == set(eligible[:7])
    assert {s for s, _ in quote_states(db.engine, eligible[7:]).values()} == {"ACTIVE"}
    assert eligible_ids(db.engine) == eligible[7:]
    # the outcome check tells the truth: quotes remain overdue
    check = {c.name: c for c in summary.checks}["no_overdue_active_quotes"]
    assert not check.passed
    assert check.metadata["overdue_active_quotes"] == len(eligible) - 7


# ------------------------------------------------------------------------- deadline


def test_deadline_stops_mid_run_as_timeout_keeping_progress_and_a_rerun_finishes(loaded):
    db, eligible = loaded

    summary = run(db.engine, batch_size=2, throttle_ms=100, deadline_s=1.0)

    assert summary.status == "timeout"
    row = run_row(db.engine, summary.job_run_id)
    assert (row.status, row.status_reason) == ("timeout", "deadline reached")
    done = assert_stopped_with_progress_kept(db.engine, summary.job_run_id, eligible)
    assert summary.counts.processed == done
    assert_rerun_finishes(db.engine, eligible, done)


def test_deadline_through_the_cli_exits_5(loaded, cli):
    db, eligible = loaded

    result = cli(
        "run",
        JOB,
        "--tenant",
        TENANT,
        "--mode",
        "execute",
        "--reason",
        "deadline test",
        "--batch-size",
        "2",
        "--throttle-ms",
        "100",
        "--deadline-s",
        "1",
        "--json",
    )

    assert result.code == 5, result.stderr
    summary = json.loads(result.stdout)
    assert summary["status"] == "timeout"
    row = run_row(db.engine, summary["job_run_id"])
    assert row.status == "timeout"
    assert row.processed_count == len(expired_among(db.engine, eligible)) < len(eligible)


# ------------------------------------------------------------------------- cancel


def _run_in_thread(engine: sa.Engine, **options: Any) -> tuple[threading.Thread, dict[str, Any]]:
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["summary"] = run(engine, **options)
        except BaseException as exc:  # surfaced by the test, not lost in the thread
            result["error"] = exc

    thread = threading.Thread(target=target, name="quote-expiration-under-test", daemon=True)
    thread.start()
    return thread, result


def test_cancel_request_stops_the_run_as_cancelled_keeping_progress(loaded):
    db, eligible = loaded
    thread, result = _run_in_thread(db.engine, batch_size=2, throttle_ms=100)
    try:
        run_id = wait_for(
            lambda: running_with_progress(db.engine) or ("error" in result and result["error"]),
            what="the run to commit its first batch",
        )
        assert isinstance(run_id, uuid.UUID), result.get("error")

        status = request_cancel(db.engine, run_id, "ops:alice", "INC-9 stop the sweep")

        assert status == "running"
    finally:
        thread.join(timeout=120)
    assert not thread.is_alive()
    assert "error" not in result, result.get("error")
    summary: RunSummary = result["summary"]
    assert summary.status == "cancelled"
    assert summary.job_run_id == str(run_id)
    row = run_row(db.engine, run_id)
    assert (row.status, row.status_reason) == ("cancelled", "cancel requested")
    assert row.cancel_requested_at is not None
    done = assert_stopped_with_progress_kept(db.engine, run_id, eligible)
    assert summary.counts.processed == done

    audit = rows(
        db.engine, "SELECT * FROM job_audit WHERE action = 'cancel' AND job_run_id = :id", id=run_id
    )
    assert len(audit) == 1
    a = audit[0]
    assert (a.actor, a.reason, a.decision, a.job_name, a.scope, a.mode) == (
        "ops:alice",
        "INC-9 stop the sweep",
        "requested",
        JOB,
        TENANT,
        "execute",
    )

    assert_rerun_finishes(db.engine, eligible, done)


def test_cancelling_a_finished_run_changes_nothing_but_is_audited(loaded):
    db, _ = loaded
    summary = run(db.engine, max_items=3)
    before = run_row(db.engine, summary.job_run_id)

    status = request_cancel(db.engine, uuid.UUID(summary.job_run_id), "ops:bob", "too late")

    assert status == "success"
    assert run_row(db.engine, summary.job_run_id) == before
    audit = rows(
        db.engine,
        "SELECT actor, decision FROM job_audit WHERE action = 'cancel' AND job_run_id = :id",
        id=uuid.UUID(summary.job_run_id),
    )
    assert [tuple(a) for a in audit] == [("ops:bob", "ignored: run is success")]


def _start_cli_run(db, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            QO_OPS_BIN,
            "run",
            JOB,
            "--tenant",
            TENANT,
            "--mode",
            "execute",
            "--reason",
            "x",
            "--batch-size",
            "5",
            "--throttle-ms",
            "200",
            *extra,
        ],
        env=base_env(QO_OPS_DATABASE_URL=db.env_url),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for_progress_of(proc: subprocess.Popen[str], engine: sa.Engine) -> uuid.UUID:
    def ready() -> uuid.UUID | None:
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"qo-ops exited early with {proc.returncode}: {out} {err}")
        return running_with_progress(engine)

    return wait_for(ready, what="the qo-ops process to commit its first batch")


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=30)


def test_sigterm_stops_the_cli_run_as_cancelled_with_exit_6_keeping_progress(loaded):
    db, eligible = loaded
    proc = _start_cli_run(db)
    try:
        run_id = _wait_for_progress_of(proc, db.engine)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        _stop(proc)

    assert proc.returncode == 6, (out, err)
    assert "status=cancelled" in out
    assert "Traceback" not in err
    row = run_row(db.engine, run_id)
    assert row.status == "cancelled"
    done = assert_stopped_with_progress_kept(db.engine, run_id, eligible)
    assert f"processed_count={done}" in out
    # the lease is released, so a rerun can take it straight away and finish
    assert_rerun_finishes(db.engine, eligible, done)


@pytest.mark.parametrize("given", ["run id", "short id"])  # as `qo-ops runs` shows it
def test_cancel_command_stops_a_running_cli_run(loaded, cli, given):
    db, eligible = loaded
    proc = _start_cli_run(db)
    try:
        run_id = _wait_for_progress_of(proc, db.engine)
        which = str(run_id) if given == "run id" else str(run_id)[:8]
        result = cli("cancel", which, "--reason", "stop it", "--requester", "ops:carol")
        assert result.code == 0, result.stderr
        assert "cancel requested" in result.stdout
        out, err = proc.communicate(timeout=120)
    finally:
        _stop(proc)

    assert proc.returncode == 6, (out, err)
    assert run_row(db.engine, run_id).status == "cancelled"
    assert_stopped_with_progress_kept(db.engine, run_id, eligible)
    audit = rows(
        db.engine,
        "SELECT actor, reason FROM job_audit WHERE action = 'cancel' AND job_run_id = :id",
        id=run_id,
    )
    assert [tuple(a) for a in audit] == [("ops:carol", "stop it")]


# ------------------------------------------------------------------------- no work


def test_nothing_eligible_is_no_work_with_exit_0(db, cli):
    # a data set anchored in the future: no quote is past its expiry yet
    load_demo_data(
        db.engine, tenants=1, quotes=200, seed=2, as_of=datetime.now(UTC) + timedelta(days=400)
    )
    assert eligible_ids(db.engine) == []
    before = data_digest(db.engine)

    dry = cli("run", JOB, "--tenant", TENANT, "--json")
    execute = cli("run", JOB, "--tenant", TENANT, "--mode", "execute", "--reason", "x", "--json")

    for result, mode in ((dry, "dry_run"), (execute, "execute")):
        assert result.code == 0, result.stderr
        summary = json.loads(result.stdout)
        assert (summary["mode"], summary["status"]) == (mode, "no_work")
        assert summary["eligible_count"] == summary["processed_count"] == 0
        row = run_row(db.engine, summary["job_run_id"])
        assert (row.status, row.processed_count) == ("no_work", 0)
    assert data_digest(db.engine) == before


def test_no_work_after_everything_is_done_via_cli(loaded, cli):
    db, eligible = loaded
    assert run(db.engine).counts.succeeded == len(eligible)

    result = cli("run", JOB, "--tenant", TENANT, "--mode", "execute", "--reason", "again")

    assert result.code == 0, result.stderr
    assert "status=no_work" in result.stdout
    assert "processed_count=0" in result.stdout


# ------------------------------------------------------------------------- audit


def _trigger_audit(engine: sa.Engine, run_id: str) -> list[sa.Row]:
    return rows(
        engine,
        "SELECT * FROM job_audit WHERE action = 'trigger' AND job_run_id = :id",
        id=uuid.UUID(run_id),
    )


def test_manual_run_appends_one_trigger_audit_row_that_cannot_be_changed(loaded):
    db, _ = loaded
    audit_before = scalar(db.engine, "SELECT count(*) FROM job_audit")

    summary = run(
        db.engine,
        requester="ops:dana",
        reason="INC-11 expire backlog",
        correlation_id="corr-11",
        max_items=5,
    )

    assert scalar(db.engine, "SELECT count(*) FROM job_audit") == audit_before + 1
    audit = _trigger_audit(db.engine, summary.job_run_id)
    assert len(audit) == 1
    a = audit[0]
    assert (a.actor, a.reason, a.scope, a.mode, a.correlation_id, a.job_name, a.decision) == (
        "ops:dana",
        "INC-11 expire backlog",
        TENANT,
        "execute",
        "corr-11",
        JOB,
        "allowed",
    )
    assert str(a.job_run_id) == summary.job_run_id
    row = run_row(db.engine, summary.job_run_id)
    assert (row.requester, row.reason, row.correlation_id, row.trigger_type) == (
        "ops:dana",
        "INC-11 expire backlog",
        "corr-11",
        "manual",
    )

    with pytest.raises(sa.exc.DBAPIError, match="append-only"), db.engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE job_audit SET reason = 'rewritten', actor = 'mallory' WHERE id = :id"),
            {"id": a.id},
        )
    with pytest.raises(sa.exc.DBAPIError, match="append-only"), db.engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM job_audit WHERE id = :id"), {"id": a.id})
    assert _trigger_audit(db.engine, summary.job_run_id) == audit


def test_cli_run_audits_requester_reason_mode_and_correlation_id(loaded, cli):
    db, _ = loaded

    result = cli(
        "run",
        JOB,
        "--tenant",
        TENANT,
        "--requester",
        "ops:erin",
        "--reason",
        "check backlog",
        "--correlation-id",
        "TICKET-5",
        "--json",
    )

    assert result.code == 0, result.stderr
    run_id = json.loads(result.stdout)["job_run_id"]
    audit = _trigger_audit(db.engine, run_id)
    assert [(a.actor, a.reason, a.scope, a.mode, a.correlation_id) for a in audit] == [
        ("ops:erin", "check backlog", TENANT, "dry_run", "TICKET-5")
    ]


def test_a_manual_execute_without_a_reason_is_refused_before_anything_is_written(loaded, cli):
    db, _ = loaded
    before = digest_without(db.engine)

    result = cli("run", JOB, "--tenant", TENANT, "--mode", "execute")

    assert result.code == 2
    assert "reason" in result.stderr
    assert digest_without(db.engine) == before


# ------------------------------------------------------------------------- reaper


def _insert_running(
    engine: sa.Engine, heartbeat_age_s: float, scope: str = TENANT, job: str = JOB
) -> uuid.UUID:
    run_id = uuid.uuid4()
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                """
                INSERT INTO job_run (id, job_name, scope, mode, trigger_type, owner_id, status,
                                     started_at, heartbeat_at, processed_count)
                VALUES (:id, :job, :scope, 'execute', 'schedule', 'host:1:dead', 'running',
                        clock_timestamp() - make_interval(secs => :age + 60),
                        clock_timestamp() - make_interval(secs => :age), 42)
                """
            ),
            {"id": run_id, "job": job, "scope": scope, "age": heartbeat_age_s},
        )
    return run_id


def _insert_lease(engine: sa.Engine, run_id: uuid.UUID, scope: str, expires_in_s: float) -> None:
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                """
                INSERT INTO job_lease (job_name, scope, owner_id, lease_token, fencing_token,
                                       acquired_at, heartbeat_at, expires_at, job_run_id)
                VALUES (:job, :scope, 'host:2:alive', 'secret', 1, clock_timestamp(),
                        clock_timestamp(), clock_timestamp() + make_interval(secs => :ttl), :id)
                """
            ),
            {"job": JOB, "scope": scope, "ttl": expires_in_s, "id": run_id},
        )


def _assert_orphaned(engine: sa.Engine, run_id: uuid.UUID) -> None:
    row = run_row(engine, run_id)
    assert (row.status, row.status_reason, row.last_error_code) == (
        "failed",
        "orphaned",
        "orphaned",
    )
    assert row.finished_at is not None
    assert row.processed_count == 42  # the counters stay truthful


def _assert_still_running(engine: sa.Engine, run_id: uuid.UUID) -> None:
    row = run_row(engine, run_id)
    assert (row.status, row.finished_at, row.status_reason) == ("running", None, None)


def test_reaper_fails_stale_runs_without_a_live_lease_only(loaded):
    db, _ = loaded
    stale = _insert_running(db.engine, heartbeat_age_s=3600)
    stale_lease_expired = _insert_running(db.engine, heartbeat_age_s=3600, scope="tenant-002")
    _insert_lease(db.engine, stale_lease_expired, "tenant-002", expires_in_s=-60)
    stale_but_leased = _insert_running(db.engine, heartbeat_age_s=3600, scope="tenant-003")
    _insert_lease(db.engine, stale_but_leased, "tenant-003", expires_in_s=600)
    fresh = _insert_running(db.engine, heartbeat_age_s=0, scope="tenant-002")

    reaped = reap_orphans(db.engine, JOB, grace_s=30)

    assert set(reaped) == {stale, stale_lease_expired}
    _assert_orphaned(db.engine, stale)
    _assert_orphaned(db.engine, stale_lease_expired)
    _assert_still_running(db.engine, stale_but_leased)
    _assert_still_running(db.engine, fresh)
    # a second pass finds nothing more, and leaves the finished rows alone
    finished = run_row(db.engine, stale)
    assert reap_orphans(db.engine, JOB, grace_s=30) == []
    assert run_row(db.engine, stale) == finished


def test_reaper_only_reaps_the_job_it_is_asked_about(loaded):
    db, _ = loaded
    other = _insert_running(db.engine, heartbeat_age_s=3600, job="some_other_job")

    assert reap_orphans(db.engine, JOB, grace_s=30) == []
    _assert_still_running(db.engine, other)
    assert reap_orphans(db.engine, None, grace_s=30) == [other]


def test_reap_command_fails_orphans_and_spares_fresh_runs(loaded, cli):
    db, _ = loaded
    stale = _insert_running(db.engine, heartbeat_age_s=3600)
    fresh = _insert_running(db.engine, heartbeat_age_s=0, scope="tenant-002")

    result = cli("reap")

    assert result.code == 0, result.stderr
    assert "reaped 1 orphaned run(s)" in result.stdout
    assert str(stale) in result.stdout and str(fresh) not in result.stdout
    _assert_orphaned(db.engine, stale)
    _assert_still_running(db.engine, fresh)

    again = cli("reap", JOB)
    assert again.code == 0, again.stderr
    assert "reaped 0 orphaned run(s)" in again.stdout
    _assert_still_running(db.engine, fresh)


def test_a_new_run_reaps_orphans_of_its_job_first(loaded):
    db, eligible = loaded
    stale = _insert_running(db.engine, heartbeat_age_s=3600)

    summary = run(db.engine)

    _assert_orphaned(db.engine, stale)
    assert summary.status == "success" and summary.counts.succeeded == len(eligible)
