"""A crashed run is found by the liveness PostgreSQL gives for free (qo_ops/platform/run/
liveness.py), for real: a ``qo-ops run`` process killed with SIGKILL mid-batch, with a lease
TTL of two minutes, is finished and its scope taken over by the next run at once; a frozen
holder (SIGSTOP) still keeps its scope until its TTL; a run whose liveness session is
terminated while it works says itself how it ended; a lock from before the server last
started says nothing. Asserted by state (records, leases, fencing tokens), never by time.

Tests ``qo_ops.platform.run.liveness``; quote_expiration is the job these drive.
"""

from __future__ import annotations

import json
import signal
import subprocess
import uuid

import pytest
import sqlalchemy as sa

from qo_ops.jobs.quote_expiration import SPEC
from qo_ops.platform.job.options import RunOptions
from qo_ops.platform.job.scope import Scope
from qo_ops.platform.run.lease import held_scopes
from qo_ops.platform.run.records import reap_orphans
from qo_ops.platform.run.runner import run_job
from qo_ops_tests.conftest import QO_OPS_BIN, run_cli
from qo_ops_tests.platform.run.test_faults import (
    TENANT,
    assert_outcome_intact,
    cli_env,
    expired,
    loaded,  # noqa: F401 (a fixture)
    run_args,
    scalar,
    wait_for,
)

LONG_TTL_S = 120  # far longer than any of these tests waits: only liveness can free it


def start_run(db, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [QO_OPS_BIN, *run_args("--batch-size", "10", "--throttle-ms", "200", "--json", *extra)],
        env=cli_env(db),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def first_run(db) -> uuid.UUID:
    return uuid.UUID(str(scalar(db.engine, "SELECT id FROM job_run ORDER BY started_at LIMIT 1")))


def under_way(db) -> bool:
    return (scalar(db.engine, "SELECT max(processed_count) FROM job_run") or 0) >= 20


def lease_unexpired(db) -> bool:
    return bool(
        scalar(
            db.engine,
            "SELECT expires_at > clock_timestamp() FROM job_lease "
            "WHERE job_name = 'quote_expiration' AND scope = :s",
            s=TENANT,
        )
    )


def test_a_killed_run_is_found_by_its_dropped_lock_long_before_its_ttl(loaded):  # noqa: F811
    db, eligible = loaded
    holder = start_run(db, "--lease-ttl-s", str(LONG_TTL_S))
    try:
        wait_for(lambda: under_way(db), what="the run to commit two batches")
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    finally:
        if holder.poll() is None:
            holder.kill()
    killed = first_run(db)
    assert scalar(db.engine, "SELECT status FROM job_run WHERE id = :id", id=killed) == "running"
    killed_fence = scalar(db.engine, "SELECT fencing_token FROM job_run WHERE id = :id", id=killed)
    assert lease_unexpired(db)  # its TTL has nearly two minutes to go: only liveness frees it

    rerun = run_cli(run_args("--lease-ttl-s", str(LONG_TTL_S), "--json"), cli_env(db))
    assert rerun.code == 0, rerun.stderr[-800:]
    summary = json.loads(rerun.stdout)
    assert summary["status"] == "success" and summary["fencing_token"] > killed_fence
    row = sa.text("SELECT status, status_reason, last_error_code FROM job_run WHERE id = :id")
    with db.engine.connect() as conn:
        assert tuple(conn.execute(row, {"id": killed}).one()) == ("failed", "orphaned", "orphaned")
    assert str(killed) in rerun.stderr  # job.orphans.reaped names it
    assert expired(db.engine) >= eligible
    assert_outcome_intact(db.engine)


def test_a_frozen_holder_keeps_its_scope_until_its_ttl_and_is_fenced(loaded):  # noqa: F811
    """SIGSTOP: the process lives, so does its session and its lock. Liveness frees nothing;
    the TTL does, a second run takes over and finishes the work, and the holder, woken,
    writes nothing: its fencing token is stale."""
    db, eligible = loaded
    ttl = 6
    holder = start_run(db, "--lease-ttl-s", str(ttl))
    try:
        wait_for(lambda: under_way(db), what="the run to commit two batches")
        holder.send_signal(signal.SIGSTOP)
        frozen_at = expired(db.engine)
        blocked = run_job(SPEC, Scope(TENANT), execute_options(ttl), engine=db.engine)
        if not lease_unexpired(db):
            pytest.fail("the machine stalled past the frozen holder's TTL before the check")
        assert (blocked.status, blocked.status_reason) == ("skipped", "lease-not-acquired")
        with db.engine.connect() as conn:
            assert TENANT in held_scopes(conn, "quote_expiration")
        assert reap_orphans(db.engine, "quote_expiration", grace_s=ttl) == []

        wait_for(lambda: not lease_unexpired(db), timeout=3 * ttl, what="the TTL to lapse")
        second = run_job(SPEC, Scope(TENANT), execute_options(ttl), engine=db.engine)
        assert second.status == "success", second
        after_takeover = expired(db.engine)
        assert frozen_at < after_takeover  # frozen mid-way, not at the end
        holder.send_signal(signal.SIGCONT)
        _, err = holder.communicate(timeout=60)
    finally:
        if holder.poll() is None:
            holder.send_signal(signal.SIGCONT)
            holder.kill()
    assert holder.returncode == 1, err[-800:]
    frozen = first_run(db)
    with db.engine.connect() as conn:
        row = conn.execute(
            sa.text(
                "SELECT status, status_reason, processed_count, fencing_token FROM job_run "
                "WHERE id = :id"
            ),
            {"id": frozen},
        ).one()
    assert (row.status, row.status_reason) == ("failed", "lease_lost")
    assert second.fencing_token is not None and second.fencing_token > row.fencing_token
    # nothing written by the holder after it woke: counts are what they were at takeover
    assert expired(db.engine) == after_takeover
    assert row.processed_count + second.counts.processed == eligible
    assert_outcome_intact(db.engine)


def execute_options(ttl: float) -> RunOptions:
    return RunOptions(mode="execute", trigger="schedule", lease_ttl_s=ttl, progress_interval_s=3600)


def test_a_run_whose_liveness_session_is_cut_says_itself_how_it_ended(loaded):  # noqa: F811
    """pg_terminate_backend of the live run's lock session: another run of the job reaps it
    as orphaned meanwhile (its lock is gone), yet it lives, takes its lock again at its next
    heartbeat, finishes its work and writes its own ending over the reaper's."""
    db, eligible = loaded
    holder = start_run(db, "--lease-ttl-s", "3")
    try:
        wait_for(lambda: under_way(db), what="the run to commit two batches")
        live = first_run(db)
        terminated = scalar(
            db.engine,
            """
            SELECT count(pg_terminate_backend(k.pid)) FROM pg_locks k JOIN job_run r
                ON ((CAST(k.classid AS bigint) << 32) | CAST(k.objid AS bigint)) = r.liveness_key
             WHERE k.locktype = 'advisory' AND r.id = :id
            """,
            id=live,
        )
        assert terminated == 1
        wait_for(
            lambda: bool(reap_orphans(db.engine, "quote_expiration", grace_s=3)),
            timeout=10,
            what="the reaper to see the lock gone",
        )
        assert scalar(db.engine, "SELECT status FROM job_run WHERE id = :id", id=live) == "failed"
        out, err = holder.communicate(timeout=120)
    finally:
        if holder.poll() is None:
            holder.kill()
    assert holder.returncode == 0, err[-800:]
    assert json.loads(out)["status"] == "success"
    with db.engine.connect() as conn:
        row = conn.execute(
            sa.text("SELECT status, status_reason, liveness_since FROM job_run WHERE id = :id"),
            {"id": live},
        ).one()
    assert (row.status, row.status_reason) == ("success", None)
    assert expired(db.engine) >= eligible
    assert_outcome_intact(db.engine)


@pytest.mark.parametrize(
    ("since", "gone"), [("+ interval '1 second'", True), ("- interval '1 second'", False)]
)
def test_a_lock_taken_before_the_server_last_started_says_nothing(db, since, gone):
    """A record whose lock nobody holds is gone only if the lock was taken on the server
    that is up now; one from before its last start (every lock dropped by the restart) is
    judged by its heartbeat and lease, as before."""
    run_id = uuid.uuid4()
    with db.engine.begin() as conn:
        conn.execute(
            sa.text(
                f"""
                INSERT INTO job_run (id, job_name, scope, mode, trigger_type, owner_id, status,
                                     liveness_key, liveness_since)
                VALUES (:id, 'quote_expiration', 'tenant-001', 'execute', 'manual', 'h:1:x',
                        'running', 12345, pg_postmaster_start_time() {since})
                """
            ),
            {"id": run_id},
        )
    reaped = reap_orphans(db.engine, "quote_expiration", grace_s=3600)
    assert (reaped == [run_id]) is gone
