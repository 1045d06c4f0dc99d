"""The run records' own rules, on one job: a cancel request for a run that has finished
changes nothing but is audited; the orphan reaper fails the stale ``running`` runs whose
lease is not live, only of the job it is asked about (``reap_orphans`` and ``qo-ops reap``),
and a new run reaps its job's orphans first.

Tests ``qo_ops.platform.run.records``; quote_expiration is the job these drive.
"""

from __future__ import annotations

import uuid

import sqlalchemy as sa

from qo_ops.platform.run.records import reap_orphans, request_cancel
from qo_ops_tests.platform.run.quote_runs import JOB, TENANT, rows, run, run_row

# ------------------------------------------------------------------------- cancel


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
