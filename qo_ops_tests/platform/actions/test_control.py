"""The kill switch on real PostgreSQL: a suspended job starts no run (audited refusal), a
running one stops at its next batch boundary with nothing half-written, a tenant's
suspension leaves the other tenants alone, and resume restores everything; every step is in
the audit trail. The CLI, the Dagster schedule and backlog sensor, and the API honour it too.

Tests ``qo_ops.platform.actions.control``.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from datetime import UTC, datetime

import dagster as dg
import pytest
import sqlalchemy as sa

from qo_ops.db.digest import database_digest
from qo_ops.db.schema import BUSINESS_TABLES, job_audit, job_control, outbox_event
from qo_ops.errors import BadInput
from qo_ops.jobs.catalog import CATALOG
from qo_ops.platform.actions.control import (
    ControlChange,
    JobSuspended,
    resume,
    suspend,
    suspension_for,
)
from qo_ops.platform.job.options import RunOptions
from qo_ops.platform.job.scope import Scope
from qo_ops.platform.run.runner import run_job
from qo_ops_tests.dagster.test_sensors import _database, schedule_tick

JOB = "quote_expiration"
SPEC = CATALOG[JOB]
KNOWN = set(CATALOG)


def _audit(engine, action: str) -> list[sa.Row]:
    with engine.connect() as conn:
        return conn.execute(
            sa.select(job_audit).where(job_audit.c.action == action).order_by(job_audit.c.id)
        ).all()


def _execute(engine, tenant: str = "tenant-001", **options):
    opts = {"mode": "execute", "reason": "test", "progress_interval_s": 3600, **options}
    return run_job(SPEC, Scope(tenant), RunOptions(**opts), engine=engine)


def _quote_figures(engine) -> tuple[int, int, int]:
    """tenant-001: EXPIRED quotes, QuoteExpired events, ACTIVE quotes past expiry."""
    with engine.connect() as conn:
        return tuple(
            conn.execute(
                sa.text(
                    """
                    SELECT (SELECT count(*) FROM quote WHERE tenant_id = 'tenant-001'
                              AND status = 'EXPIRED'),
                           (SELECT count(*) FROM outbox_event WHERE tenant_id = 'tenant-001'
                              AND event_type = 'QuoteExpired'),
                           (SELECT count(*) FROM quote WHERE tenant_id = 'tenant-001'
                              AND status = 'ACTIVE' AND expires_at < now())
                    """
                )
            ).one()
        )


def _digest(engine) -> str:
    with engine.connect() as conn:
        return str(database_digest(conn, (*BUSINESS_TABLES, outbox_event)))


def test_a_suspended_job_starts_no_run_and_resume_restores_it(loaded):
    engine = loaded.engine
    found, new = suspend(
        engine,
        ControlChange(JOB, None, actor="alice", reason="INC-7: downstream outage"),
        known_jobs=KNOWN,
    )
    assert new and found.tenant_id is None and found.suspended_by == "alice"
    before = _digest(engine)

    with pytest.raises(JobSuspended, match="suspended for every scope by alice.*INC-7"):
        _execute(engine, requester="bob")
    with pytest.raises(JobSuspended):
        _execute(engine, tenant="tenant-002", trigger="schedule", reason=None)

    assert _digest(engine) == before  # nothing ran
    with engine.connect() as conn:
        assert conn.scalar(sa.text("SELECT count(*) FROM job_run")) == 0
    refused = [r for r in _audit(engine, "trigger") if r.decision == "denied"]
    assert [(r.actor, r.scope, r.details["refused"]) for r in refused] == [
        ("bob", "tenant-001", "suspended"),
        ("unknown", "tenant-002", "suspended"),
    ]
    again, new = suspend(
        engine, ControlChange(JOB, None, actor="carol", reason="again"), known_jobs=KNOWN
    )
    assert not new and again.suspended_by == "alice"  # the first suspension stands

    lifted = resume(
        engine, ControlChange(JOB, None, actor="dave", reason="INC-7 resolved"), known_jobs=KNOWN
    )
    assert lifted is not None and lifted.reason == "INC-7: downstream outage"
    assert _execute(engine).status == "success"
    assert [(r.actor, r.decision) for r in _audit(engine, "suspend")] == [
        ("alice", "allowed"),
        ("carol", "already_suspended"),
    ]
    assert [(r.actor, r.decision, r.reason) for r in _audit(engine, "resume")] == [
        ("dave", "allowed", "INC-7 resolved")
    ]
    assert (
        resume(engine, ControlChange(JOB, None, actor="dave", reason="twice"), known_jobs=KNOWN)
        is None
    )
    assert _audit(engine, "resume")[-1].decision == "not_suspended"


def test_a_tenant_suspension_stops_only_that_tenant(loaded):
    engine = loaded.engine
    suspend(
        engine, ControlChange(JOB, "tenant-001", actor="alice", reason="data fix"), known_jobs=KNOWN
    )
    with pytest.raises(JobSuspended, match="tenant tenant-001"):
        _execute(engine, tenant="tenant-001")
    assert _execute(engine, tenant="tenant-002").status == "success"
    other = CATALOG["abandoned_checkout_close"]  # another job is not suspended
    run = run_job(other, Scope("tenant-001"), RunOptions(mode="dry_run"), engine=loaded.engine)
    assert run.status in ("success", "no_work")


@pytest.mark.parametrize(
    ("job", "tenant", "reason", "message"),
    [
        ("no_such_job", None, "why", "unknown job"),
        (JOB, None, "   ", "reason is required"),
        (JOB, "tenant-999", "why", "unknown tenant"),
        (JOB, "../etc", "why", "tenant"),
        (JOB, None, "x" * 501, "longer than"),
    ],
)
def test_bad_input_changes_nothing(loaded, job, tenant, reason, message):
    engine = loaded.engine
    with pytest.raises(BadInput, match=message):
        suspend(engine, ControlChange(job, tenant, actor="alice", reason=reason), known_jobs=KNOWN)
    with engine.connect() as conn:
        assert conn.scalar(sa.select(sa.func.count()).select_from(job_control)) == 0
        assert conn.scalar(sa.select(sa.func.count()).select_from(job_audit)) == 0


def test_suspending_a_running_job_stops_it_at_the_next_batch_boundary(loaded):
    """A run with small throttled batches is suspended after its first batches: it ends
    cancelled/suspended; every quote it expired has exactly its one event, the rest are
    untouched and still due; resume lets the next run finish the work."""
    engine = loaded.engine
    result: dict = {}
    expired_before, events_before, _ = _quote_figures(engine)

    def work() -> None:
        result["summary"] = _execute(engine, batch_size=10, throttle_ms=150)

    worker = threading.Thread(target=work)
    worker.start()
    deadline = time.monotonic() + 60
    with engine.connect() as conn:
        while time.monotonic() < deadline:
            done = conn.scalar(
                sa.text(
                    "SELECT coalesce(max(processed_count), 0) FROM job_run WHERE job_name = :j"
                ),
                {"j": JOB},
            )
            conn.rollback()
            if done >= 20:
                break
            time.sleep(0.05)
    suspend(
        engine, ControlChange(JOB, "tenant-001", actor="alice", reason="stop now"), known_jobs=KNOWN
    )
    worker.join(60)
    summary = result["summary"]

    assert (summary.status, summary.status_reason) == ("cancelled", "suspended")
    assert 20 <= summary.counts.processed < summary.eligible_count
    assert summary.counts.processed % 10 == 0  # whole batches only
    expired, events, still_due = _quote_figures(engine)
    with engine.connect() as conn:
        row = conn.execute(
            sa.text("SELECT status, status_reason FROM job_run WHERE id = :id"),
            {"id": uuid.UUID(summary.job_run_id)},
        ).one()
    expired, events = expired - expired_before, events - events_before
    assert expired == events == summary.counts.succeeded == summary.counts.processed
    assert still_due == summary.eligible_count - summary.counts.processed
    assert tuple(row) == ("cancelled", "suspended")

    resume(engine, ControlChange(JOB, "tenant-001", actor="dave", reason="go on"), known_jobs=KNOWN)
    rest = _execute(engine)
    assert rest.status == "success" and rest.counts.processed == still_due


def test_cli_suspend_status_run_resume(loaded, cli):
    suspended = cli("suspend", JOB, "--tenant", "tenant-001", "--reason", "INC-9", "--json")
    assert suspended.code == 0, suspended.stderr
    assert json.loads(suspended.stdout)["suspended"]["tenant_id"] == "tenant-001"

    status = cli("status", JOB, "--json")
    held = json.loads(status.stdout)["suspended"]
    assert [(s["tenant_id"], s["reason"]) for s in held] == [("tenant-001", "INC-9")]
    table = cli("status", JOB)
    assert "suspended" in table.stdout and "INC-9" in table.stdout

    refused = cli("run", JOB, "--tenant", "tenant-001", "--mode", "execute", "--reason", "x")
    assert refused.code == 7
    assert "suspended for tenant tenant-001" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1 and "Traceback" not in refused.stderr

    bad = cli("suspend", JOB, "--reason", "")
    assert bad.code == 2 and "reason is required" in bad.stderr

    resumed = cli("resume", JOB, "--tenant", "tenant-001", "--reason", "fixed")
    assert resumed.code == 0 and "resumed" in resumed.stdout
    ran = cli("run", JOB, "--tenant", "tenant-001", "--mode", "dry-run")
    assert ran.code == 0, ran.stderr


def test_schedule_and_backlog_sensor_skip_what_is_suspended(defs, instance, loaded):
    when = datetime(2026, 11, 29, 12, 15, tzinfo=UTC)
    resources = {"database": _database(loaded)}

    def tick():
        return schedule_tick(defs, instance, loaded, f"{JOB}_schedule", when)

    def sense():
        sensor = defs.resolve_sensor_def(f"{JOB}_backlog_sensor")
        return sensor.evaluate_tick(dg.build_sensor_context(instance=instance, resources=resources))

    def tenants(result) -> list[str]:  # of every run requested (chunks name them in config)
        return [
            t
            for r in result.run_requests or []
            for t in r.run_config["ops"][f"{JOB}_op"]["config"]["tenants"]
        ]

    engine = loaded.engine
    assert tenants(tick()) == ["tenant-001", "tenant-002"]
    suspend(
        engine, ControlChange(JOB, "tenant-001", actor="alice", reason="INC-1"), known_jobs=KNOWN
    )
    assert tenants(tick()) == ["tenant-002"]
    sensed = sense()
    assert "tenant-001" not in tenants(sensed)

    suspend(
        engine, ControlChange(JOB, None, actor="alice", reason="INC-2 everything"), known_jobs=KNOWN
    )
    whole = tick()
    assert not whole.run_requests and "INC-2 everything" in whole.skip_message
    sensed = sense()
    assert not sensed.run_requests and "suspended for every scope" in sensed.skip_message
    launched_by_hand = defs.resolve_job_def(JOB).execute_in_process(
        partition_key="tenant-002",
        instance=instance,
        run_config={"ops": {f"{JOB}_op": {"config": {"mode": "dry_run"}}}},
        raise_on_error=False,
    )
    assert not launched_by_hand.success
    failure = launched_by_hand.get_step_failure_events()[0].step_failure_data.user_failure_data
    assert "suspended for every scope by alice" in failure.description

    resume(engine, ControlChange(JOB, None, actor="dave", reason="ok"), known_jobs=KNOWN)
    resume(engine, ControlChange(JOB, "tenant-001", actor="dave", reason="ok"), known_jobs=KNOWN)
    assert tenants(tick()) == ["tenant-001", "tenant-002"]
    with loaded.engine.connect() as conn:
        assert suspension_for(conn, JOB, "tenant-001") is None
