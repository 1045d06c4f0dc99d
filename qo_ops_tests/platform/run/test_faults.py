"""Faults, for real: processes killed with SIGKILL at each crash point, runs that overlap on
purpose, a run record and its audit row committed together. (A holder frozen with SIGSTOP
while another run takes over: test_liveness.py; runs of one scope started at once:
test_lease.py.)

After each, the data must show no duplicate event, no expired quote without its event,
no ACTIVE quote left past expiry, and a truthful run record.

Tests the crash points of ``qo_ops.platform.run.faults`` against
``qo_ops.platform.run.runner``; quote_expiration is the job these drive.
"""

from __future__ import annotations

import signal
import threading
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime

import pytest
import sqlalchemy as sa

from qo_ops.demo.data import load_demo_data
from qo_ops.jobs.quote_expiration import SPEC
from qo_ops.platform.job.options import RunOptions
from qo_ops.platform.job.outcome import BatchContext, OutcomeCheck
from qo_ops.platform.job.scope import Scope
from qo_ops.platform.run.faults import CRASH_ENV, CRASH_POINTS
from qo_ops.platform.run.runner import RunSummary, run_job, select_batch
from qo_ops_tests.conftest import base_env, run_cli

AS_OF = datetime(2026, 3, 1, tzinfo=UTC)  # in the past: every ACTIVE quote is overdue now
TENANT = "tenant-001"


def wait_for(condition: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    """Poll ``condition`` until true; fail the test after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


def scalar(engine: sa.Engine, sql: str, **params: object) -> object:
    with engine.connect() as conn:
        return conn.execute(sa.text(sql), params).scalar()


def overdue(engine: sa.Engine, tenant: str = TENANT) -> int:
    return int(
        scalar(
            engine,
            "SELECT count(*) FROM quote WHERE tenant_id = :t AND status = 'ACTIVE' AND expires_at < now()",
            t=tenant,
        )
    )


def expired(engine: sa.Engine, tenant: str = TENANT) -> int:
    return int(
        scalar(
            engine,
            "SELECT count(*) FROM quote WHERE tenant_id = :t AND status = 'EXPIRED'",
            t=tenant,
        )
    )


def assert_outcome_intact(engine: sa.Engine) -> None:
    """Zero duplicate events, zero expired quotes without their event, zero overdue ACTIVE."""
    with engine.connect() as conn:
        per_quote = conn.execute(
            sa.text(
                """
                SELECT count(*) FILTER (WHERE n = 0), count(*) FILTER (WHERE n > 1)
                  FROM (SELECT (SELECT count(*) FROM outbox_event e WHERE e.event_type = 'QuoteExpired'
                                  AND e.aggregate_id = q.id::text) AS n
                          FROM quote q WHERE q.status = 'EXPIRED') s
                """
            )
        ).one()
        orphan_events = conn.scalar(
            sa.text(
                "SELECT count(*) FROM outbox_event e WHERE e.event_type = 'QuoteExpired' AND NOT EXISTS "
                "(SELECT 1 FROM quote q WHERE q.id::text = e.aggregate_id AND q.status = 'EXPIRED')"
            )
        )
    assert tuple(per_quote) == (0, 0), "expired quotes without an event / with duplicates"
    assert orphan_events == 0
    assert overdue(engine) == 0


def cli_env(db, **extra: str) -> dict[str, str]:
    return base_env(QO_OPS_DATABASE_URL=db.env_url, **extra)


def run_args(*extra: str) -> list[str]:
    return [
        "run",
        "quote_expiration",
        "--tenant",
        TENANT,
        "--mode",
        "execute",
        "--reason",
        "fault test",
        *extra,
    ]


@pytest.fixture
def loaded(db):
    load_demo_data(db.engine, tenants=2, quotes=2000, seed=7, as_of=AS_OF)
    eligible = overdue(db.engine)
    assert eligible > 500
    return db, eligible


def _lease_released_and_run_stale(
    engine: sa.Engine, run_id: object, grace_s: float
) -> Callable[[], bool]:
    def check() -> bool:
        return bool(
            scalar(
                engine,
                """
                SELECT NOT EXISTS (SELECT 1 FROM job_lease WHERE job_name = 'quote_expiration'
                                     AND scope = :scope AND expires_at > clock_timestamp())
                   AND (SELECT heartbeat_at < clock_timestamp() - make_interval(secs => :g)
                          FROM job_run WHERE id = :id)
                """,
                scope=TENANT,
                id=run_id,
                g=grace_s,
            )
        )

    return check


@pytest.mark.parametrize(
    "point", [p for p in CRASH_POINTS if p != "after_external_call"]
)  # no external phase
def test_sigkill_at_every_crash_point_then_rerun_is_exact(loaded, point):
    db, eligible = loaded
    before_expired = expired(db.engine)
    killed = run_cli(
        run_args("--batch-size", "100", "--lease-ttl-s", "2"), cli_env(db, **{CRASH_ENV: point})
    )
    assert killed.code == -signal.SIGKILL, (killed.code, killed.stderr[-500:])

    run_id = scalar(
        db.engine,
        "SELECT id FROM job_run WHERE job_name = 'quote_expiration' ORDER BY started_at LIMIT 1",
    )
    assert scalar(db.engine, "SELECT status FROM job_run WHERE id = :id", id=run_id) == "running"
    committed = expired(db.engine) - before_expired
    # the crash happened where it says: nothing, one batch, or everything committed
    expected_committed = {
        "after_lease_acquire": 0,
        "after_batch_select": 0,
        "before_commit": 0,
        "after_commit": 100,
        "before_finalize": eligible,
    }[point]
    assert committed == expected_committed

    wait_for(
        _lease_released_and_run_stale(db.engine, run_id, 2.0),
        what="the killed run's lease to expire",
    )
    rerun = run_cli(run_args("--lease-ttl-s", "2", "--json"), cli_env(db))
    assert rerun.code == 0, rerun.stderr[-800:]

    with db.engine.connect() as conn:
        killed_row = conn.execute(
            sa.text("SELECT status, status_reason FROM job_run WHERE id = :id"), {"id": run_id}
        ).one()
    assert tuple(killed_row) == ("failed", "orphaned")
    assert expired(db.engine) - before_expired == eligible
    assert_outcome_intact(db.engine)
    # the other tenant was never touched
    assert overdue(db.engine, "tenant-002") > 0


def _threads(count: int, target: Callable[[int], RunSummary]) -> list[RunSummary]:
    results: list[RunSummary | BaseException] = [None] * count  # type: ignore[list-item]
    barrier = threading.Barrier(count)

    def body(i: int) -> None:
        barrier.wait()
        try:
            results[i] = target(i)
        except BaseException as exc:  # reported below
            results[i] = exc

    threads = [threading.Thread(target=body, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results  # type: ignore[return-value]


@pytest.fixture
def busy_engine(db):
    engine = sa.create_engine(db.url, pool_size=20, max_overflow=10)
    yield engine
    engine.dispose()


def test_competing_workers_with_skip_locked_take_disjoint_batches(loaded, busy_engine):
    """The batch selection itself is safe for competing workers (FOR UPDATE SKIP LOCKED)."""
    db, eligible = loaded
    ctx = BatchContext(SPEC.name, Scope(TENANT), "execute", uuid.uuid4())
    taken: list[list[int]] = [[] for _ in range(4)]

    def worker(i: int) -> RunSummary:
        while True:
            with busy_engine.begin() as conn:
                ids = select_batch(conn, SPEC, ctx, 25)
                if not ids:
                    return None  # type: ignore[return-value]
                conn.exec_driver_sql("SELECT pg_sleep(0.02)")  # hold the locks so workers overlap
                outcome = SPEC.transition(conn, ctx, ids)
                assert outcome.succeeded == len(ids)
                taken[i].extend(ids)

    _threads(4, worker)
    all_ids = [i for batch in taken for i in batch]
    assert len(all_ids) == len(set(all_ids)) == eligible  # disjoint, and nothing missed
    assert sum(1 for t in taken if t) >= 2  # they really competed
    assert_outcome_intact(db.engine)


def test_an_interrupt_during_the_outcome_checks_still_finishes_the_run_record(loaded):
    """Dagster terminates a run by interrupting it: if that lands after the batches, while the
    outcome checks run, the record still ends with the batches' outcome — never `running`."""
    import dataclasses

    def interrupted(conn, ctx):
        raise KeyboardInterrupt

    db, before = loaded
    spec = dataclasses.replace(SPEC, check=interrupted)
    assert before > 0
    with pytest.raises(KeyboardInterrupt):
        run_job(spec, Scope(TENANT), RunOptions(mode="execute", reason="t"), engine=db.engine)
    with db.engine.connect() as conn:
        row = conn.execute(
            sa.text("SELECT status, status_reason, finished_at, processed_count FROM job_run")
        ).one()
    assert row.status == "success" and row.finished_at is not None
    assert row.status_reason == "interrupted during outcome checks"
    assert row.processed_count == before and overdue(db.engine) == 0
    assert scalar(db.engine, "SELECT count(*) FROM job_lease WHERE expires_at > now()") == 0


def test_a_check_that_counted_the_selection_gives_the_report_its_backlog(loaded):
    """A check that says it counted the job's selection (``OutcomeCheck.backlog``) is the
    report's backlog: the platform does not count the same rows again."""
    import dataclasses

    def counted(conn, ctx):
        return [OutcomeCheck("counted", True, "counted the selection", backlog=42)]

    db, before = loaded
    spec = dataclasses.replace(SPEC, check=counted)
    done = run_job(spec, Scope(TENANT), RunOptions(mode="execute", reason="t"), engine=db.engine)
    assert done.counts.processed == before and overdue(db.engine) == 0
    assert done.backlog == 42  # counted again, it would be 0


def test_a_persons_run_record_and_its_audit_row_commit_together(loaded):
    """The audit row of a person's execute is written in the transaction of the run's
    record: when it cannot be written (here a trigger refuses it, as a server shutting down
    between the two would), no record is left that the audit trail does not know of."""
    db, _ = loaded
    with db.engine.begin() as conn:
        conn.execute(
            sa.text(
                """
                CREATE FUNCTION refuse_audit() RETURNS trigger LANGUAGE plpgsql AS
                $$ BEGIN RAISE EXCEPTION 'audit refused for the test'; END $$;
                CREATE TRIGGER refuse_audit BEFORE INSERT ON job_audit
                   FOR EACH ROW EXECUTE FUNCTION refuse_audit();
                """
            )
        )
    refused = run_cli(run_args(), cli_env(db))
    assert refused.code != 0 and "Traceback" not in refused.stderr
    assert scalar(db.engine, "SELECT count(*) FROM job_run") == 0
    with db.engine.begin() as conn:
        conn.execute(sa.text("DROP TRIGGER refuse_audit ON job_audit"))
    done = run_cli(run_args(), cli_env(db))
    assert done.code == 0, done.stderr[-800:]
    audited = scalar(
        db.engine,
        "SELECT count(*) FROM job_run r JOIN job_audit a ON a.job_run_id = r.id "
        "AND a.decision = 'allowed'",
    )
    assert audited == 1
