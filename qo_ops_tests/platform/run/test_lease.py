"""The lease for real: of eight runs of one scope started at once exactly one executes (the
others are skipped, ``lease-not-acquired``), runs of different scopes go on in parallel, and
the lease's guard cuts off a batch transaction left idle past the lease's TTL. (A holder
frozen while another run takes over: test_liveness.py; the data invariants and the demo
world these share: test_faults.py.)

Tests ``qo_ops.platform.run.lease``; quote_expiration is the job these drive.
"""

from __future__ import annotations

import time
import uuid

import pytest
import sqlalchemy as sa

from qo_ops.jobs.quote_expiration import SPEC
from qo_ops.platform.job.options import RunOptions
from qo_ops.platform.job.scope import Scope
from qo_ops.platform.run.lease import acquire
from qo_ops.platform.run.runner import run_job
from qo_ops_tests.platform.run.test_faults import (
    TENANT,
    _threads,
    assert_outcome_intact,
    busy_engine,  # noqa: F401 (a fixture)
    loaded,  # noqa: F401 (a fixture)
    overdue,
)


def test_eight_concurrent_runs_of_one_scope_exactly_one_executes(loaded, busy_engine):  # noqa: F811
    db, eligible = loaded
    options = RunOptions(
        mode="execute", trigger="schedule", batch_size=50, throttle_ms=100, progress_interval_s=3600
    )
    results = _threads(8, lambda i: run_job(SPEC, Scope(TENANT), options, engine=busy_engine))
    statuses = sorted(r.status for r in results)
    assert statuses == ["skipped"] * 7 + ["success"], statuses
    winner = next(r for r in results if r.status == "success")
    assert winner.counts.succeeded == eligible
    assert all(r.status_reason == "lease-not-acquired" for r in results if r.status == "skipped")
    assert_outcome_intact(db.engine)


def test_runs_of_different_tenants_proceed_in_parallel(loaded, busy_engine):  # noqa: F811
    db, _ = loaded
    options = RunOptions(
        mode="execute", trigger="schedule", batch_size=50, throttle_ms=50, progress_interval_s=3600
    )
    tenants = ["tenant-001", "tenant-002"]
    results = _threads(2, lambda i: run_job(SPEC, Scope(tenants[i]), options, engine=busy_engine))
    assert [r.status for r in results] == ["success", "success"]
    with db.engine.connect() as conn:
        spans = conn.execute(
            sa.text(
                "SELECT started_at, finished_at FROM job_run WHERE id = ANY(CAST(:ids AS uuid[]))"
            ),
            {"ids": [r.job_run_id for r in results]},
        ).all()
    (a_start, a_end), (b_start, b_end) = spans
    assert a_start < b_end and b_start < a_end  # their lifetimes overlapped
    assert overdue(db.engine, "tenant-001") == 0 and overdue(db.engine, "tenant-002") == 0


def test_a_batch_transaction_left_idle_past_the_lease_ttl_is_cut_off_by_the_server(db):
    """The lease's guard, the first statement of every batch transaction, also sets that
    transaction's idle timeout to the lease's TTL: a holder frozen mid-batch loses its
    connection (and with it the locks it holds) instead of holding the lease's row forever."""
    lease = acquire(db.engine, SPEC.name, TENANT, "frozen-holder", 1.0, uuid.uuid4())
    assert lease is not None
    with db.engine.connect() as conn:
        conn.begin()
        assert lease.guard(conn) is None
        assert conn.exec_driver_sql("SHOW idle_in_transaction_session_timeout").scalar() == "1s"
        time.sleep(1.5)  # idle inside the transaction, past the TTL
        with pytest.raises(sa.exc.DBAPIError):
            conn.exec_driver_sql("SELECT 1")
