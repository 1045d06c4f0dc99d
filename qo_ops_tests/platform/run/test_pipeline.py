"""Pipelined batches (qo_ops.platform.run.pipeline): a batch's call and record run on a
second thread and connection while the run claims the next batch. Through audit_archive,
the job that declares it: real PostgreSQL, real files, a real SIGTERM, and a real SIGKILL
while two batches are open (one in its record, the next claimed ahead).

The job's own tests (qo_ops_tests/jobs/test_audit_archive.py: every SIGKILL point, failed
verifications, the orphan sweep) run in this shape too. Each of the pipeline's three rules
(the position moves at the claim, the record's outcome carries none, the last pass from the
start waits for the batch in flight) was planted broken and failed 8 to 15 of them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from typing import Any

import pytest
import sqlalchemy as sa

from qo_ops.jobs.audit_archive import SPEC, steps
from qo_ops.platform.job.spec import Batching, ExternalPhase, Positions
from qo_ops.platform.run import runner
from qo_ops_tests.conftest import base_env
from qo_ops_tests.jobs import test_audit_archive as archive_tests
from qo_ops_tests.jobs.test_audit_archive import (
    DAY,
    PYTHON_RUN,
    ROWS_ON_DAY,
    TENANT,
    _archived_ids,
    _assert_exact,
    _audit_digest,
    _checks,
    _day_ids,
    _execute,
    _files,
    _statuses,
    _wait_for_lease_expiry,
)

home, seeded = archive_tests.home, archive_tests.seeded  # the job's test fixtures

_PID = sa.text("SELECT pg_backend_pid()")


class Intervals:
    """When each claim's COPY and each record's delete ran, and on which server process.
    Claim k (k >= 2) holds its transaction open until delete k - 1 has started, so that the
    two overlap when, and only when, the runner lets them run at once."""

    def __init__(self) -> None:
        self.started = threading.Condition()
        self.spans: list[tuple[str, int, float, float]] = []
        self.claims = self.deletes = 0

    def claim(self, real: Any) -> Any:
        def timed(conn: sa.Connection, *args: Any) -> Any:
            pid, started = conn.execute(_PID).scalar_one(), time.monotonic()
            with self.started:
                self.claims += 1
                before = self.claims - 1  # the delete of the batch before this claim's
                self.started.wait_for(lambda: self.deletes >= before, timeout=10)
            try:
                return real(conn, *args)
            finally:
                self._add("claim", pid, started)

        return timed

    def delete(self, real: Any) -> Any:
        def timed(conn: sa.Connection, *args: Any) -> Any:
            pid, started = conn.execute(_PID).scalar_one(), time.monotonic()
            with self.started:
                self.deletes += 1
                self.started.notify_all()
            try:
                return real(conn, *args)
            finally:
                self._add("delete", pid, started)

        return timed

    def _add(self, kind: str, pid: int, started: float) -> None:
        with self.started:
            self.spans.append((kind, pid, started, time.monotonic()))

    def of(self, kind: str) -> list[tuple[str, int, float, float]]:
        return [s for s in self.spans if s[0] == kind]


def test_a_claim_runs_on_its_own_connection_while_the_batch_before_is_recorded(
    seeded, home, monkeypatch
):
    db = seeded
    seen = Intervals()
    monkeypatch.setattr(steps, "copy_claimed", seen.claim(steps.copy_claimed))
    monkeypatch.setattr(steps, "_delete_if_equal", seen.delete(steps._delete_if_equal))
    done = _execute(db.engine, batch_size=300)
    assert (done.status, done.counts.succeeded, done.batches) == ("success", ROWS_ON_DAY, 5)
    claims, deletes = seen.of("claim"), seen.of("delete")
    overlapping = [
        (c, d) for c in claims for d in deletes if c[2] < d[3] and d[2] < c[3]
    ]  # a delete ran while a claim's transaction was open
    assert len(overlapping) >= 3, seen.spans
    assert all(c[1] != d[1] for c, d in overlapping)  # two server processes at once
    archived = _archived_ids(home, db.engine)
    assert sorted(archived) == sorted(set(archived)) and len(archived) == ROWS_ON_DAY
    assert _day_ids(db.engine) == [] and _statuses(db.engine) == {"VERIFIED": 5}
    assert all(_checks(done).values())


def test_a_sigterm_records_the_batch_in_flight_and_drops_the_one_claimed_ahead(
    seeded, home, monkeypatch
):
    db = seeded
    real_delete, real_claim = steps._delete_if_equal, runner.JobRun.claim
    claimed: list[Any] = []
    second_claimed = threading.Event()
    sent = []

    def claim(self: runner.JobRun, conn: sa.Connection, room: int) -> Any:
        outcome = real_claim(self, conn, room)  # committed when it returns
        claimed.append(outcome)
        if len(claimed) == 2:
            second_claimed.set()
        return outcome

    def delete_then_sigterm(conn: sa.Connection, result: Any) -> Any:
        if not sent:  # the first batch's record, once the second batch is claimed ahead
            sent.append(True)
            assert second_claimed.wait(30), "batch 2 was not claimed while batch 1 was recorded"
            os.kill(os.getpid(), signal.SIGTERM)  # handled by the run, on the main thread
        return real_delete(conn, result)

    monkeypatch.setattr(runner.JobRun, "claim", claim)
    monkeypatch.setattr(steps, "_delete_if_equal", delete_then_sigterm)
    stopped = _execute(db.engine, batch_size=300)
    assert (stopped.status, stopped.status_reason) == ("cancelled", "terminated")
    assert (stopped.counts.succeeded, stopped.batches) == (300, 1)  # the batch in flight
    assert _statuses(db.engine) == {"VERIFIED": 1}  # the claimed-ahead batch wrote nothing
    assert len(_files(home)) == 1
    assert len(_day_ids(db.engine)) == ROWS_ON_DAY - 300

    monkeypatch.setattr(steps, "_delete_if_equal", real_delete)
    rest = _execute(db.engine, batch_size=300)
    assert (rest.status, rest.counts.succeeded) == ("success", ROWS_ON_DAY - 300)
    archived = _archived_ids(home, db.engine)
    assert len(archived) == len(set(archived)) == ROWS_ON_DAY and _day_ids(db.engine) == []
    assert all(_checks(rest).values())


def test_a_pipelined_phase_needs_positions_and_no_checkpoint_or_overlap():
    with pytest.raises(ValueError, match="pipelined external phase needs positions"):
        replace(SPEC, batching=replace(SPEC.batching, positions=None))
    both = ExternalPhase(call=steps.write_and_verify, record=steps.delete_verified)
    with pytest.raises(ValueError, match="pipelined external phase needs positions"):
        replace(SPEC, then=replace(both, overlap=True, pipelined=True))
    assert replace(SPEC, batching=Batching(positions=Positions())).then == SPEC.then


# The run of PYTHON_RUN, killed by SIGKILL in batch 1's record once batch 2's claim committed:
# two batches open, one WRITTEN and not deleted, the other claimed and not yet called.
KILLED_WITH_TWO_OPEN = (
    """
import os, signal, sys, threading
from qo_ops.jobs.audit_archive import steps
from qo_ops.platform.run import runner

second_claim = threading.Event()
claims = []
real_claim, real_delete = runner.JobRun.claim, steps._delete_if_equal

def claim(self, conn, room):
    claimed = real_claim(self, conn, room)  # committed when it returns
    claims.append(claimed)
    if len(claims) == 2:
        second_claim.set()
    return claimed

def delete(conn, result):
    if not second_claim.wait(20):
        sys.exit("batch 2 was never claimed while batch 1 was recorded")
    os.kill(os.getpid(), signal.SIGKILL)

runner.JobRun.claim, steps._delete_if_equal = claim, delete
"""
    + PYTHON_RUN
)


def test_a_sigkill_with_two_batches_open_leaves_one_written_chunk_and_the_rerun_is_exact(
    seeded, home
):
    db = seeded
    original_ids, original_digest = _day_ids(db.engine), _audit_digest(db.engine)
    env = base_env(QO_OPS_DATABASE_URL=db.env_url, QO_OPS_HOME=str(home))
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_WITH_TWO_OPEN, DAY.isoformat(), TENANT, "300"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    killed_at = time.monotonic()
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-800:]
    # batch 1: its file and WRITTEN manifest, nothing deleted; batch 2: claimed, nothing written
    assert len(_files(home)) == 1 and _statuses(db.engine) == {"WRITTEN": 1}
    assert _day_ids(db.engine) == original_ids and _audit_digest(db.engine) == original_digest

    _wait_for_lease_expiry(db.engine, killed_at)
    rerun = _execute(db.engine, batch_size=300)
    assert (rerun.status, rerun.counts.succeeded) == ("success", ROWS_ON_DAY)
    assert rerun.tally.get("archives_adopted") == 1  # batch 1's file re-verified, not rewritten
    _assert_exact(db, home, original_ids, original_digest)


def test_a_claim_that_fails_while_the_batch_before_is_recorded_still_counts_that_record(
    seeded, home, monkeypatch
):
    """Batch 1's file fails verification; batch 2's claim sees that only once batch 1's
    record has marked it (forced here) and stops the run. The record committed, so the run's
    counters still hold it: 300 failed, one batch, as the sequential shape reports."""
    db = seeded
    real_write, real_before = steps.write_file, steps._before_copy

    def write_then_flip_a_byte(path: Any, data: bytes) -> None:
        real_write(path, data)
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        path.write_bytes(bytes(raw))

    def claim_after_the_failure(conn: sa.Connection, ctx: Any) -> None:
        run = ctx.run_state(steps.ArchiveRun)
        if run.baseline is not None:  # batch 2's claim: wait for batch 1's verdict
            deadline = time.monotonic() + 30
            while run.failure is None and time.monotonic() < deadline:
                time.sleep(0.01)
            assert run.failure is not None
        real_before(conn, ctx)

    monkeypatch.setattr(steps, "write_file", write_then_flip_a_byte)
    monkeypatch.setattr(steps, "_before_copy", claim_after_the_failure)
    failed = _execute(db.engine, batch_size=300)
    assert (failed.status, failed.error_code) == ("failed", "archive_verification_failed")
    assert (failed.counts.succeeded, failed.counts.failed, failed.batches) == (0, 300, 1)
    assert _statuses(db.engine) == {"FAILED": 1} and len(_day_ids(db.engine)) == ROWS_ON_DAY
    with db.engine.connect() as conn:
        recorded = conn.execute(
            sa.text("SELECT failed_count, status FROM job_run ORDER BY started_at DESC LIMIT 1")
        ).one()
    assert tuple(recorded) == (300, "failed")
