"""Pipelined batches (qo_ops.platform.run.pipeline): a batch's call and record run on a
second thread and connection while the run claims the next batch. Through audit_archive,
the job that declares it: real PostgreSQL, real files, a real SIGTERM.

The job's own tests (qo_ops_tests/jobs/test_audit_archive.py: every SIGKILL point, failed
verifications, the orphan sweep) run in this shape too. Each of the pipeline's three rules
(the position moves at the claim, the record's outcome carries none, the last pass from the
start waits for the batch in flight) was planted broken and failed 8 to 15 of them."""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import replace
from typing import Any

import pytest
import sqlalchemy as sa

from qo_ops.jobs.audit_archive import SPEC, steps
from qo_ops.platform.job.spec import Batching, ExternalPhase, Positions
from qo_ops_tests.jobs import test_audit_archive as archive_tests
from qo_ops_tests.jobs.test_audit_archive import (
    ROWS_ON_DAY,
    _archived_ids,
    _checks,
    _day_ids,
    _execute,
    _files,
    _statuses,
)

home, seeded = archive_tests.home, archive_tests.seeded  # the job's test fixtures

_PID = sa.text("SELECT pg_backend_pid()")


class Intervals:
    """When each claim's COPY and each record's delete ran, and on which server process."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.spans: list[tuple[str, int, float, float]] = []

    def wrap(self, kind: str, real: Any, pause_s: float = 0.0) -> Any:
        def timed(conn: sa.Connection, *args: Any) -> Any:
            pid = conn.execute(_PID).scalar_one()
            started = time.monotonic()
            try:
                return real(conn, *args)
            finally:
                time.sleep(pause_s)  # in the transaction, so the other side has time to run
                with self.lock:
                    self.spans.append((kind, pid, started, time.monotonic()))

        return timed

    def of(self, kind: str) -> list[tuple[str, int, float, float]]:
        return [s for s in self.spans if s[0] == kind]


def test_a_claim_runs_on_its_own_connection_while_the_batch_before_is_recorded(
    seeded, home, monkeypatch
):
    db = seeded
    seen = Intervals()
    monkeypatch.setattr(steps, "copy_claimed", seen.wrap("claim", steps.copy_claimed, 0.25))
    monkeypatch.setattr(steps, "_delete_if_equal", seen.wrap("delete", steps._delete_if_equal))
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
    real_delete = steps._delete_if_equal
    sent = []

    def delete_then_sigterm(conn: sa.Connection, result: Any) -> Any:
        if not sent:  # the first batch's record: the second batch is claimed meanwhile
            sent.append(True)
            os.kill(os.getpid(), signal.SIGTERM)  # handled by the run, on the main thread
            time.sleep(0.3)  # the claim ahead is committed by now
        return real_delete(conn, result)

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
