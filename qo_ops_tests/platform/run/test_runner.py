"""The runner's contract, on one job through ``run_job`` and the real ``qo-ops`` command: a
dry run writes nothing but its record and counts what an execute then changes; ``max_items``
caps a run; a run stops between batches, keeping what it committed, when its deadline passes
(``timeout``, exit 5) or when it is asked to (a cancel request, ``qo-ops cancel`` or SIGTERM:
``cancelled``, exit 6), and a rerun finishes the work; nothing eligible is ``no_work``
(exit 0). (SIGTERM and SIGINT in every other phase of a run: test_stopping.py.)

Tests ``qo_ops.platform.run.runner``; quote_expiration is the job these drive (its own rules:
qo_ops_tests/jobs/test_quote_expiration.py).
"""

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

from qo_ops.demo.data import load_demo_data
from qo_ops.platform.run.records import request_cancel
from qo_ops.platform.run.runner import RunSummary
from qo_ops_tests.conftest import QO_OPS_BIN, base_env
from qo_ops_tests.platform.run.quote_runs import (
    JOB,
    TENANT,
    assert_all_checks_passed,
    data_digest,
    digest_without,
    eligible_ids,
    events_per_quote,
    expired_among,
    quote_states,
    rows,
    run,
    run_row,
    scalar,
)

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


def count_runs(engine: sa.Engine) -> int:
    return scalar(engine, "SELECT count(*) FROM job_run")


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


# ------------------------------------------------------------------------- limits


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


# ------------------------------------------------------------------------- cancel and SIGTERM


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
