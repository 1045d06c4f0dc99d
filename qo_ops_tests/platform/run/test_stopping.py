"""SIGTERM and SIGINT, really sent, in every phase of a run: before its batches, while it
waits for the lease, between batches, during a slow downstream batch, during the outcome
checks (a real query cancelled on the server), and as PID 1 of a PID namespace, the way a
container without an init runs it.

Afterwards there is never a ``running`` row, a held lease or a claimed item, the business
invariants of test_faults.py hold, and a rerun finishes the work.

Tests ``qo_ops.platform.run.stopping``; quote_expiration is the job these drive.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import threading
from pathlib import Path

import pytest
import sqlalchemy as sa

from qo_ops.demo.data import load_demo_data
from qo_ops.jobs.quote_expiration import SPEC
from qo_ops.platform.job.options import RunOptions
from qo_ops.platform.job.scope import Scope
from qo_ops.platform.run.faults import HOLD_ENV
from qo_ops.platform.run.runner import run_job
from qo_ops.platform.run.stopping import STOP_GRACE_ENV
from qo_ops_tests.conftest import QO_OPS_BIN, run_cli
from qo_ops_tests.platform.run.test_faults import (
    AS_OF,
    TENANT,
    assert_outcome_intact,
    cli_env,
    overdue,
    run_args,
    scalar,
    wait_for,
)

EXIT_CANCELLED = 6


@pytest.fixture
def quotes(db):
    load_demo_data(db.engine, tenants=2, quotes=2000, seed=7, as_of=AS_OF)
    eligible = overdue(db.engine)
    assert eligible > 500
    return db, eligible


def start(args: list[str], env: dict[str, str], tmp_path: Path, *prefix: str) -> subprocess.Popen:
    """``qo-ops ARGS`` as a real process (optionally behind ``prefix``, e.g. unshare)."""
    return subprocess.Popen(
        [*prefix, QO_OPS_BIN, *args],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=(tmp_path / "stdout").open("w"),
        stderr=(tmp_path / "stderr").open("w"),
    )


def lease_held(engine: sa.Engine, job: str = "quote_expiration", scope: str = TENANT) -> bool:
    return bool(
        scalar(
            engine,
            "SELECT count(*) FROM job_lease WHERE job_name = :j AND scope = :s "
            "AND expires_at > clock_timestamp()",
            j=job,
            s=scope,
        )
    )


def the_run(engine: sa.Engine, job: str = "quote_expiration") -> sa.Row:
    with engine.connect() as conn:
        return conn.execute(
            sa.text(
                "SELECT id, status, status_reason, finished_at, processed_count, "
                "succeeded_count, last_error_code FROM job_run WHERE job_name = :j "
                "ORDER BY started_at DESC LIMIT 1"
            ),
            {"j": job},
        ).one()


def assert_nothing_left_behind(engine: sa.Engine, job: str = "quote_expiration") -> None:
    """No running row, no held lease, no claimed delivery item or outbox event."""
    assert scalar(engine, "SELECT count(*) FROM job_run WHERE status = 'running'") == 0
    assert scalar(engine, "SELECT count(*) FROM job_lease WHERE expires_at > now()") == 0
    assert (
        scalar(engine, "SELECT count(*) FROM delivery_attempt_item WHERE status = 'IN_PROGRESS'")
        == 0
    )


def held_at(tmp_path: Path, point: str, what: str) -> None:
    """Wait for the run started in ``tmp_path`` to say it holds at ``point`` (its stderr)."""
    wait_for(lambda: f"holding at {point}" in (tmp_path / "stderr").read_text(), what=what)


def stopped(proc: subprocess.Popen, sig: int, tmp_path: Path) -> int:
    proc.send_signal(sig)
    try:
        return proc.wait(timeout=120)  # a test bound, not a timing assertion
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(
            f"the run ignored {signal.Signals(sig).name}: {(tmp_path / 'stderr').read_text()[-800:]}"
        )


# --------------------------------------------------------------------------- phases


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_before_the_batches_ends_the_run_cancelled_and_frees_the_lease(
    quotes, tmp_path, sig
):
    db, eligible = quotes
    proc = start(run_args(), cli_env(db, **{HOLD_ENV: "after_lease_acquire"}), tmp_path)
    # The hold's line, not the lease row: the row is committed while the run is still inside
    # the acquire's deferred section, and a signal there waits for the batches' first check.
    held_at(tmp_path, "after_lease_acquire", "the run to hold after taking its lease")
    assert lease_held(db.engine)
    assert stopped(proc, sig, tmp_path) == EXIT_CANCELLED
    row = the_run(db.engine)
    assert (row.status, row.status_reason, row.processed_count) == ("cancelled", "terminated", 0)
    assert row.finished_at is not None
    assert overdue(db.engine) == eligible  # no batch ran
    assert_nothing_left_behind(db.engine)
    rerun = run_cli(run_args(), cli_env(db))
    assert rerun.code == 0, rerun.stderr[-800:]
    assert_outcome_intact(db.engine)


def test_sigterm_while_waiting_for_the_lease_ends_the_run_without_ever_holding_it(quotes, tmp_path):
    db, eligible = quotes
    with db.engine.begin() as conn:  # a lease row to wait on (expired: free to take)
        conn.execute(
            sa.text(
                "INSERT INTO job_lease (job_name, scope, owner_id, lease_token, fencing_token, "
                "acquired_at, heartbeat_at, expires_at) VALUES ('quote_expiration', :s, 'test', "
                "'t', 1, now(), now(), now() - interval '1 minute')"
            ),
            {"s": TENANT},
        )
    blocker = db.engine.connect()
    holding = blocker.begin()
    blocker.execute(sa.text("SELECT 1 FROM job_lease FOR UPDATE"))  # as a long batch would
    try:
        proc = start(run_args(), cli_env(db), tmp_path)
        wait_for(
            lambda: bool(
                scalar(
                    db.engine,
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                    "AND query LIKE '%INSERT INTO job_lease%'",
                )
            ),
            timeout=30,
            what="the run to wait for the lease row",
        )
        code = stopped(proc, signal.SIGTERM, tmp_path)
    finally:
        holding.rollback()
        blocker.close()
    assert code == EXIT_CANCELLED, (tmp_path / "stderr").read_text()[-800:]
    row = the_run(db.engine)
    assert (row.status, row.status_reason) == ("cancelled", "terminated")
    assert scalar(db.engine, "SELECT fencing_token FROM job_lease") == 1  # never taken
    assert overdue(db.engine) == eligible
    assert_nothing_left_behind(db.engine)


def test_sigterm_between_batches_keeps_every_committed_batch_and_the_rerun_completes(
    quotes, tmp_path
):
    db, eligible = quotes
    proc = start(run_args("--batch-size", "50", "--throttle-ms", "300"), cli_env(db), tmp_path)
    wait_for(
        lambda: (scalar(db.engine, "SELECT max(processed_count) FROM job_run") or 0) >= 100,
        what="two batches",
    )
    assert stopped(proc, signal.SIGTERM, tmp_path) == EXIT_CANCELLED
    row = the_run(db.engine)
    assert (row.status, row.status_reason) == ("cancelled", "terminated")
    assert 100 <= row.processed_count < eligible
    assert eligible - overdue(db.engine) == row.succeeded_count  # the record tells the truth
    assert_nothing_left_behind(db.engine)
    rerun = run_cli(run_args(), cli_env(db))
    assert rerun.code == 0, rerun.stderr[-800:]
    assert_outcome_intact(db.engine)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_the_instant_the_lease_is_taken_still_frees_it(quotes, tmp_path, sig):
    """The window CI once hit: the signal lands after the lease is committed and before the
    batches' ``try`` (the run held at ``lease_taken``, just after the lease's deferred
    section). Planted once: with the lease's ``try``/``finally`` starting after that point
    again (as before), the run ended cancelled and its lease stayed held for its TTL."""
    db, eligible = quotes
    proc = start(run_args(), cli_env(db, **{HOLD_ENV: "lease_taken"}), tmp_path)
    held_at(tmp_path, "lease_taken", "the run to take its lease")
    assert lease_held(db.engine)
    assert stopped(proc, sig, tmp_path) == EXIT_CANCELLED
    row = the_run(db.engine)
    assert (row.status, row.status_reason, row.processed_count) == ("cancelled", "terminated", 0)
    assert overdue(db.engine) == eligible  # no batch ran
    assert_nothing_left_behind(db.engine)


def test_sigterm_in_the_outcome_check_phase_keeps_the_work_and_ends_the_record(quotes, tmp_path):
    db, eligible = quotes
    proc = start(run_args(), cli_env(db, **{HOLD_ENV: "before_finalize"}), tmp_path)
    # the run says it reached the phase (its lease is given back before it)
    held_at(tmp_path, "before_finalize", "the run to reach its outcome checks")
    assert overdue(db.engine) == 0 and not lease_held(db.engine)  # the batches are done
    assert stopped(proc, signal.SIGTERM, tmp_path) == 0  # the work itself succeeded
    row = the_run(db.engine)
    assert (row.status, row.status_reason) == ("success", "terminated during outcome checks")
    assert row.processed_count == eligible and row.finished_at is not None
    assert_nothing_left_behind(db.engine)
    assert_outcome_intact(db.engine)


def test_sigterm_cancels_an_outcome_check_query_on_the_server(quotes):
    """In this process (the main thread, where the handler lives): a real SIGTERM while a
    check's query runs; the query is cancelled on the server, not left running."""
    db, _ = quotes

    def slow_check(conn, ctx):
        conn.execute(sa.text("SELECT pg_sleep(600)"))
        return []

    def sleeping() -> bool:
        return bool(
            scalar(
                db.engine,
                "SELECT count(*) FROM pg_stat_activity WHERE query = 'SELECT pg_sleep(600)' "
                "AND state = 'active'",
            )
        )

    def send_when_sleeping() -> None:
        wait_for(sleeping, what="the check's query")
        os.kill(os.getpid(), signal.SIGTERM)

    sender = threading.Thread(target=send_when_sleeping)
    sender.start()
    summary = run_job(
        dataclasses.replace(SPEC, check=slow_check),
        Scope(TENANT),
        RunOptions(mode="execute", reason="t"),
        engine=db.engine,
    )
    sender.join()
    assert (summary.status, summary.status_reason) == (
        "success",
        "terminated during outcome checks",
    )
    wait_for(lambda: not sleeping(), what="the server to cancel the query")
    assert_nothing_left_behind(db.engine)
    assert the_run(db.engine).finished_at is not None


@pytest.mark.parametrize("batch", [256, 64], ids=["one-batch", "a-batch-claimed-ahead"])
def test_sigterm_during_a_slow_downstream_batch_releases_every_unsent_item(
    db, downstream_factory, tmp_path, batch
):
    """256 items, 900 ms per call, 4 at a time: a batch takes about a minute, longer than
    Kubernetes waits. SIGTERM mid-batch: the calls in flight finish and are recorded, the
    rest are given back (READY, attempt refunded), and the run ends within the grace. In
    batches of 64, the next batch is claimed while the first one's calls are in flight
    (qo_ops/platform/run/overlap.py): it sends nothing and is given back too."""
    load_demo_data(db.engine, tenants=1, quotes=3000, seed=3, as_of=AS_OF)
    with db.engine.begin() as conn:  # 256 due, clean items
        conn.execute(sa.text("UPDATE delivery_attempt_item SET payload = payload - 'fault'"))
        conn.execute(
            sa.text(
                "UPDATE delivery_attempt_item SET status = 'READY', attempt_count = 0, "
                "next_attempt_at = now() - interval '1 minute' WHERE id IN "
                "(SELECT id FROM delivery_attempt_item ORDER BY id LIMIT 256)"
            )
        )
        conn.execute(
            sa.text(
                "UPDATE delivery_attempt_item SET status = 'DELIVERED' WHERE id NOT IN "
                "(SELECT id FROM delivery_attempt_item ORDER BY id LIMIT 256)"
            )
        )
    server = downstream_factory(latency_ms=900)
    args = ["run", "delivery_retry", "--tenant", "tenant-001", "--mode", "execute"]
    args += ["--reason", "t", "--batch-size", str(batch), "--concurrency", "4"]
    env = cli_env(db, QO_OPS_DOWNSTREAM_URL=server.url, **{STOP_GRACE_ENV: "10"})
    proc = start(args, env, tmp_path)
    claimed = "SELECT count(*) FROM delivery_attempt_item WHERE status = 'IN_PROGRESS'"
    wait_for(
        lambda: (
            server.client.stats()["delivery_requests"] >= 8
            and scalar(db.engine, claimed) == min(256, 2 * batch)
        ),
        what="calls under way (and the next batch claimed)",
    )
    assert stopped(proc, signal.SIGTERM, tmp_path) == EXIT_CANCELLED
    row = the_run(db.engine, "delivery_retry")
    assert (row.status, row.status_reason) == ("cancelled", "terminated")
    assert_nothing_left_behind(db.engine, "delivery_retry")
    with db.engine.connect() as conn:
        states = dict(
            conn.execute(
                sa.text(
                    "SELECT status, count(*) FROM delivery_attempt_item "
                    "WHERE id IN (SELECT id FROM delivery_attempt_item ORDER BY id LIMIT 256) "
                    "GROUP BY status"
                )
            ).all()
        )
        attempts_of_ready = conn.execute(
            sa.text(
                "SELECT coalesce(max(attempt_count), 0) FROM delivery_attempt_item WHERE status = 'READY'"
            )
        ).scalar()
    sent = server.client.stats()["deliveries_distinct"]
    assert 8 <= sent < 256
    assert states.get("DELIVERED", 0) == sent  # every answered call is recorded
    assert states["READY"] == 256 - sent  # every unsent item is due again …
    assert attempts_of_ready == 0  # … with its attempt given back
    rerun = run_cli(args, env)
    assert rerun.code == 0, rerun.stderr[-800:]
    stats = server.client.stats()
    assert stats["deliveries_distinct"] == 256  # all delivered, each once
    assert_nothing_left_behind(db.engine, "delivery_retry")


@pytest.mark.parametrize("init", [False, True], ids=["qo-ops-as-pid-1", "image-init-as-pid-1"])
def test_sigterm_to_pid_1_of_a_pid_namespace_ends_the_run(quotes, tmp_path, init):
    """Without an init, the process is PID 1, and the kernel drops signals PID 1 has no
    handler for: the runner's handler must be there. With the image's init (its ENTRYPOINT,
    dumb-init), the init is PID 1 and must pass SIGTERM on."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) for a PID namespace")
    db, eligible = quotes
    namespace = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc"]
    if init:
        namespace += [str(Path(QO_OPS_BIN).with_name("dumb-init")), "--"]
    proc = start(
        run_args("--batch-size", "50", "--throttle-ms", "300"), cli_env(db), tmp_path, *namespace
    )
    wait_for(
        lambda: (scalar(db.engine, "SELECT max(processed_count) FROM job_run") or 0) >= 50,
        what="a batch",
    )
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    assert len(children) == 1
    pid_1 = int(children[0])
    status = Path(f"/proc/{pid_1}/status").read_text().splitlines()
    ns_pids = [ln for ln in status if ln.startswith("NSpid:")]
    assert ns_pids[0].split()[-1] == "1"  # PID 1 inside its namespace
    name = [ln for ln in status if ln.startswith("Name:")][0].split()[-1]
    assert name == ("dumb-init" if init else "qo-ops")
    os.kill(pid_1, signal.SIGTERM)
    try:
        code = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("PID 1 ignored SIGTERM")
    assert code == EXIT_CANCELLED, (tmp_path / "stderr").read_text()[-800:]
    row = the_run(db.engine)
    assert (row.status, row.status_reason) == ("cancelled", "terminated")
    assert row.processed_count < eligible
    assert_nothing_left_behind(db.engine)
    rerun = run_cli(run_args(), cli_env(db))
    assert rerun.code == 0, rerun.stderr[-800:]
    assert_outcome_intact(db.engine)
