"""pricing_snapshot_recalculation on real PostgreSQL: a checkpointed, throttled backfill.

Demo data: quote totals are the sum of their lines, every odd quote has only a snapshot at
price-book version 1 while version 2 is current, and quotes are created 1–90 days before
``as_of``. The window 2026-01-01..2026-03-01 (inclusive) holds about two thirds of a tenant's
quotes; December's quotes and tenant-002 are outside it.
"""

from __future__ import annotations

import json
import math
import signal
import time
import uuid
from collections.abc import Callable
from contextlib import contextmanager
from datetime import UTC, date, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from qo_ops.db.digest import database_digest
from qo_ops.db.schema import BUSINESS_TABLES
from qo_ops.demo.data import load_demo_data
from qo_ops.jobs.pricing_snapshot_recalculation import CHECK_NAME, SPEC
from qo_ops.platform.job.options import RunOptions
from qo_ops.platform.job.outcome import BatchContext, OutcomeCheck
from qo_ops.platform.job.scope import Scope
from qo_ops.platform.run.faults import CRASH_ENV
from qo_ops.platform.run.runner import RunSummary, count_eligible, run_job
from qo_ops_tests.conftest import _test_database, base_env, run_cli

AS_OF = datetime(2026, 3, 1, tzinfo=UTC)
TENANT = "tenant-001"
JOB = "pricing_snapshot_recalculation"
WINDOW = Scope(TENANT, date(2026, 1, 1), date(2026, 3, 2))  # CLI: --from 2026-01-01 --to 2026-03-01


# ------------------------------------------------------------------------------ helpers


def load(engine: sa.Engine, quotes: int = 2000, seed: int = 5) -> None:
    load_demo_data(engine, tenants=2, quotes=quotes, seed=seed, as_of=AS_OF)


def execute(engine: sa.Engine, scope: Scope = WINDOW, **options: Any) -> RunSummary:
    return run_job(
        SPEC,
        scope,
        RunOptions(
            mode="execute",
            trigger="backfill",
            reason="INC-1 backfill",
            progress_interval_s=3600,
            **options,
        ),
        engine=engine,
    )


def scalar(engine: sa.Engine, sql: str, **params: object) -> Any:
    with engine.connect() as conn:
        return conn.execute(sa.text(sql), params).scalar()


def window_params(scope: Scope = WINDOW) -> dict[str, object]:
    start, end = scope.window_bounds()
    return {"t": scope.tenant_id, "start": start, "end": end}


def quotes_in_window(engine: sa.Engine, scope: Scope = WINDOW) -> int:
    return int(
        scalar(
            engine,
            "SELECT count(*) FROM quote WHERE tenant_id = :t AND created_at >= :start AND created_at < :end",
            **window_params(scope),
        )
    )


def not_current(engine: sa.Engine, scope: Scope = WINDOW) -> int:
    """Quotes of the window whose snapshot at the current price book is missing or wrong
    (recomputed here independently of the job's SQL)."""
    return int(
        scalar(
            engine,
            """
            SELECT count(*) FROM quote q
             WHERE q.tenant_id = :t AND q.created_at >= :start AND q.created_at < :end
               AND NOT EXISTS (
                   SELECT 1 FROM pricing_snapshot s
                     JOIN price_book pb ON pb.tenant_id = q.tenant_id AND pb.is_current
                                        AND pb.version = s.price_book_version
                    WHERE s.quote_id = q.id
                      AND s.line_count = (SELECT count(*) FROM quote_line l WHERE l.quote_id = q.id)
                      AND s.total_amount = round(pb.price_factor * (
                              SELECT coalesce(sum(l.quantity * l.unit_price), 0)
                                FROM quote_line l WHERE l.quote_id = q.id), 2))
            """,
            **window_params(scope),
        )
    )


def snapshot_values_digest(engine: sa.Engine) -> str:
    """md5 over every snapshot's (quote, version, total, line count): what a run computes,
    without computed_at / job_run_id / the identity id."""
    return str(
        scalar(
            engine,
            """
            SELECT count(*) || ':' || md5(coalesce(string_agg(
                       concat_ws('|', quote_id, price_book_version, total_amount, line_count), ';'
                       ORDER BY quote_id, price_book_version), ''))
              FROM pricing_snapshot
            """,
        )
    )


def outside_digest(engine: sa.Engine, scope: Scope = WINDOW) -> str:
    """md5 over every column of every snapshot that does not belong to a quote of the scope."""
    return str(
        scalar(
            engine,
            """
            SELECT count(*) || ':' || md5(coalesce(string_agg(md5(s::text), '' ORDER BY s.id), ''))
              FROM pricing_snapshot s JOIN quote q ON q.id = s.quote_id
             WHERE NOT (q.tenant_id = :t AND q.created_at >= :start AND q.created_at < :end)
            """,
            **window_params(scope),
        )
    )


def business_digest(engine: sa.Engine) -> dict[str, str]:
    with engine.connect() as conn:
        return database_digest(conn, BUSINESS_TABLES)


def checkpoint(engine: sa.Engine, scope: Scope = WINDOW) -> dict[str, object] | None:
    with engine.connect() as conn:
        return conn.execute(
            sa.text("SELECT cursor FROM job_checkpoint WHERE job_name = :j AND scope = :s"),
            {"j": JOB, "s": scope.key},
        ).scalar()


def nth_quote_key(engine: sa.Engine, n: int, scope: Scope = WINDOW) -> tuple[datetime, int]:
    """The (created_at, id) of the n-th quote (1-based) of the scope in cursor order."""
    with engine.connect() as conn:
        row = conn.execute(
            sa.text(
                "SELECT created_at, id FROM quote WHERE tenant_id = :t AND created_at >= :start "
                "AND created_at < :end ORDER BY created_at, id OFFSET :o LIMIT 1"
            ),
            {**window_params(scope), "o": n - 1},
        ).one()
    return row.created_at, int(row.id)


def check_of(summary: RunSummary) -> OutcomeCheck:
    (check,) = [c for c in summary.checks if c.name == CHECK_NAME]
    return check


def wait_for(condition: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    """Poll ``condition`` until true; fail the test after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


@pytest.fixture
def loaded(db):
    load(db.engine)
    n = quotes_in_window(db.engine)
    todo = not_current(db.engine)
    assert n > 1000 and 0 < todo < n  # roughly half (the odd quotes) lack a current snapshot
    return db, n, todo


# ------------------------------------------------------------------------------ dry-run


def test_dry_run_counts_the_whole_window_and_writes_nothing(loaded):
    db, n, todo = loaded
    before = business_digest(db.engine)
    summary = run_job(
        SPEC, WINDOW, RunOptions(mode="dry_run", progress_interval_s=3600), engine=db.engine
    )
    assert summary.status == "success"
    assert summary.eligible_count == n  # every quote of the window, right or not
    assert summary.counts.processed == 0 and summary.counts.succeeded == 0
    first_ten = [str(nth_quote_key(db.engine, i)[1]) for i in range(1, 11)]
    assert summary.sample_ids == first_ten  # in (created_at, id) order
    assert business_digest(db.engine) == before
    assert checkpoint(db.engine) is None
    check = check_of(summary)
    assert not check.passed
    assert check.metadata["quotes"] == n
    assert check.metadata["missing_snapshots"] + check.metadata["mismatched_snapshots"] == todo


# ------------------------------------------------------------------------------ execute


def test_execute_recalculates_the_window_only_and_a_second_run_is_no_work(loaded):
    db, n, todo = loaded
    outside = outside_digest(db.engine)
    summary = execute(db.engine)
    assert summary.status == "success", summary
    assert summary.eligible_count == summary.counts.processed == n
    assert summary.counts.succeeded == todo  # only what was missing or wrong was written
    assert summary.counts.skipped == n - todo  # already right: left as it was
    assert summary.batches == math.ceil(n / SPEC.defaults.batch_size)  # the default batch size
    assert check_of(summary).passed
    assert not_current(db.engine) == 0
    assert outside_digest(db.engine) == outside  # tenant-002 and December untouched
    written = scalar(
        db.engine,
        "SELECT count(*) FROM pricing_snapshot WHERE job_run_id = :r",
        r=uuid.UUID(summary.job_run_id),
    )
    assert written == todo

    cursor = checkpoint(db.engine)
    last_created, last_id = nth_quote_key(db.engine, n)
    assert cursor == {"created_at": last_created.isoformat(), "id": last_id}
    assert json.loads(json.dumps(cursor)) == cursor

    before = business_digest(db.engine)
    again = execute(db.engine)
    assert again.status == "no_work"  # the checkpoint says the window is done
    assert (again.eligible_count, again.counts.processed, again.counts.succeeded) == (0, 0, 0)
    assert check_of(again).passed
    assert business_digest(db.engine) == before


def test_the_current_price_factor_is_applied_and_old_versions_are_left_alone(loaded):
    db, _, _ = loaded
    scope = Scope(TENANT, date(2026, 2, 1), date(2026, 2, 8))
    n = quotes_in_window(db.engine, scope)
    with db.engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE price_book SET price_factor = 1.2345 WHERE tenant_id = :t AND is_current"
            ),
            {"t": TENANT},
        )
    v1_before = scalar(
        db.engine,
        "SELECT md5(string_agg(md5(s::text), '' ORDER BY s.id)) FROM pricing_snapshot s "
        "WHERE price_book_version = 1",
    )
    assert n > 0 and not_current(db.engine, scope) == n
    summary = execute(db.engine, scope, batch_size=40)
    assert summary.status == "success" and check_of(summary).passed
    assert summary.counts.succeeded == n  # every total changes with the factor
    assert not_current(db.engine, scope) == 0
    assert (
        scalar(
            db.engine,
            "SELECT md5(string_agg(md5(s::text), '' ORDER BY s.id)) FROM pricing_snapshot s "
            "WHERE price_book_version = 1",
        )
        == v1_before
    )


def test_without_a_current_price_book_the_run_fails_and_writes_nothing(loaded):
    db, _, _ = loaded
    with db.engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE price_book SET is_current = false WHERE tenant_id = :t"), {"t": TENANT}
        )
    before = business_digest(db.engine)
    summary = execute(db.engine)
    assert (summary.status, summary.error_code) == ("failed", "no_current_price_book")
    assert "no current price book" in (summary.error_text or "")
    assert summary.counts.processed == 0
    assert business_digest(db.engine) == before
    assert checkpoint(db.engine) is None
    assert not check_of(summary).passed


def test_the_selection_after_a_cursor_is_index_backed(loaded):
    db, _, _ = loaded
    created, qid = nth_quote_key(db.engine, 300)
    ctx = BatchContext(
        JOB,
        WINDOW,
        "execute",
        uuid.uuid4(),
        cursor={"created_at": created.isoformat(), "id": qid},
    )
    query = SPEC.eligible(ctx).limit(500)
    compiled = query.compile(db.engine, compile_kwargs={"literal_binds": True})
    with db.engine.connect() as conn:
        plan = "\n".join(conn.exec_driver_sql(f"EXPLAIN {compiled}").scalars())
        first = conn.execute(query.limit(1)).scalar()
    assert "ix_quote_tenant_created" in plan, plan
    assert "ROW(created_at, id) >" in plan, plan  # the cursor bounds the index scan
    assert "Sort" not in plan, plan  # the index gives the order
    assert first == nth_quote_key(db.engine, 301)[1]


# ------------------------------------------------------------------------------ resume


def test_an_interrupted_backfill_resumes_from_its_checkpoint_and_matches_an_uninterrupted_one(
    loaded, pg_server, template_database
):
    db, n, todo = loaded
    first = execute(db.engine, batch_size=100, max_items=700)
    assert (first.status, first.status_reason) == ("success", "max items reached")
    assert (first.counts.processed, first.batches) == (700, 7)
    created, qid = nth_quote_key(db.engine, 700)
    assert checkpoint(db.engine) == {"created_at": created.isoformat(), "id": qid}
    assert not check_of(first).passed

    # stopped by its deadline: at most four 300 ms-throttled batches fit in one second
    second = execute(db.engine, batch_size=100, throttle_ms=300, deadline_s=1.0)
    assert second.status == "timeout"
    assert second.eligible_count == n - 700  # it started after the checkpoint
    assert 0 < second.counts.processed < n - 700

    third = execute(db.engine, batch_size=100)
    assert third.status == "success" and check_of(third).passed
    assert third.eligible_count == third.counts.processed == n - 700 - second.counts.processed

    runs = [first, second, third]
    assert sum(r.counts.processed for r in runs) == n  # no quote was selected twice
    assert sum(r.counts.succeeded + r.counts.skipped for r in runs) == n
    assert sum(r.counts.succeeded for r in runs) == todo  # nothing recomputed twice
    recorded = scalar(
        db.engine,
        "SELECT sum(processed_count) || '/' || sum(succeeded_count + skipped_count) "
        "FROM job_run WHERE job_name = :j",
        j=JOB,
    )
    assert recorded == f"{n}/{n}"
    assert not_current(db.engine) == 0

    with contextmanager(_test_database)(pg_server, template_database) as other:
        load(other.engine)  # the same data, backfilled in one go
        uninterrupted = execute(other.engine, batch_size=100)
        assert uninterrupted.counts.processed == n and uninterrupted.counts.succeeded == todo
        assert snapshot_values_digest(other.engine) == snapshot_values_digest(db.engine)


def test_the_cursor_resumes_inside_a_run_of_equal_created_at(loaded):
    db, _, _ = loaded
    scope = Scope(TENANT, date(2026, 2, 1), date(2026, 2, 8))
    with db.engine.begin() as conn:  # every quote of the week created in the same microsecond
        conn.execute(
            sa.text(
                "UPDATE quote SET created_at = '2026-02-03 12:00:00.123456+00' WHERE tenant_id = :t "
                "AND created_at >= :start AND created_at < :end"
            ),
            window_params(scope),
        )
    n, todo = quotes_in_window(db.engine, scope), not_current(db.engine, scope)
    assert n > 100 and todo > 0
    first = execute(db.engine, scope, batch_size=40, max_items=80)
    assert first.counts.processed == 80
    assert checkpoint(db.engine, scope) == {
        "created_at": "2026-02-03T12:00:00.123456+00:00",
        "id": nth_quote_key(db.engine, 80, scope)[1],
    }
    rest = execute(db.engine, scope, batch_size=40)
    assert rest.eligible_count == rest.counts.processed == n - 80  # ties broken by id
    assert first.counts.succeeded + rest.counts.succeeded == todo
    assert not_current(db.engine, scope) == 0 and check_of(rest).passed


# ------------------------------------------------------------------------------ throttle


def test_throttle_bounds_the_write_rate(loaded):
    db, _, _ = loaded
    scope = Scope(TENANT, date(2026, 2, 1), date(2026, 2, 8))
    n = quotes_in_window(db.engine, scope)
    assert n > 100
    summary = execute(db.engine, scope, batch_size=50, throttle_ms=200)
    assert summary.status == "success" and summary.counts.processed == n
    assert summary.batches == math.ceil(n / 50)
    floor_s = (summary.batches - 1) * 0.2  # a pause of 200 ms between consecutive batches
    recorded_s = float(
        scalar(
            db.engine,
            "SELECT extract(epoch FROM finished_at - started_at) FROM job_run WHERE id = :r",
            r=uuid.UUID(summary.job_run_id),
        )
    )
    assert recorded_s >= floor_s
    assert summary.duration_ms / 1000 >= floor_s


# ------------------------------------------------------------------------------ Dagster data


def test_the_dagster_test_data_has_a_day_with_work_that_executes_cleanly(db):
    load(db.engine, quotes=400, seed=9)  # as qo_ops_tests/dagster/conftest.py loads it
    with db.engine.connect() as conn:
        for offset in range(90):  # as qo_ops_tests/dagster/test_jobs.py picks a partition
            day = date(2026, 1, 1) + timedelta(days=offset)
            scope = Scope(TENANT, day, day + timedelta(days=1))
            if count_eligible(conn, SPEC, BatchContext(JOB, scope, "dry_run", uuid.uuid4())):
                break
        else:
            pytest.fail("no day with work")
    summary = execute(db.engine, scope, batch_size=25)
    assert summary.status == "success"
    assert summary.counts.processed == summary.eligible_count > 0
    assert summary.counts.succeeded > 0
    assert check_of(summary).passed


# ------------------------------------------------------------------------------ CLI (catalog)


def _rerun_once_the_kill_lapsed(db: Any, run_id: Any, env: dict[str, str]) -> dict[str, Any]:
    """Wait for the killed run's lease to expire, rerun by the CLI, its JSON summary."""
    wait_for(
        lambda: _lease_expired_and_run_stale(db.engine, run_id, 2.0),
        what="the killed run's lease to expire",
    )
    rerun = run_cli([*CLI_RUN, "--json"], env)
    assert rerun.code == 0, rerun.stderr[-800:]
    return dict(json.loads(rerun.stdout.strip().splitlines()[-1]))


def _lease_expired_and_run_stale(engine: sa.Engine, run_id: object, grace_s: float) -> bool:
    return bool(
        scalar(
            engine,
            """
            SELECT NOT EXISTS (SELECT 1 FROM job_lease WHERE job_name = :j AND scope = :scope
                                 AND expires_at > clock_timestamp())
               AND (SELECT heartbeat_at < clock_timestamp() - make_interval(secs => :g)
                      FROM job_run WHERE id = :id)
            """,
            j=JOB,
            scope=WINDOW.key,
            id=run_id,
            g=grace_s,
        )
    )


CLI_RUN = [
    "run",
    JOB,
    "--tenant",
    TENANT,
    "--from",
    "2026-01-01",
    "--to",
    "2026-03-01",
    "--mode",
    "execute",
    "--reason",
    "x",
    "--lease-ttl-s",
    "2",
]


def test_cli_killed_after_its_one_statement_selected_and_wrote_leaves_nothing(loaded):
    """The batch is selected and written by one statement (``Batching.claims``), and the
    runner's ``after_batch_select`` follows it: killed there, the statement's writes roll
    back with the transaction, so no snapshot, no checkpoint and no count is left, and the
    rerun does the whole window."""
    db, n, todo = loaded
    assert SPEC.batching.claims is not None
    env = base_env(QO_OPS_DATABASE_URL=db.env_url)
    killed = run_cli([*CLI_RUN, "--batch-size", "100"], {**env, CRASH_ENV: "after_batch_select"})
    assert killed.code == -signal.SIGKILL, (killed.code, killed.stderr[-800:])

    run_id = scalar(db.engine, "SELECT id FROM job_run WHERE job_name = :j", j=JOB)
    processed = scalar(db.engine, "SELECT processed_count FROM job_run WHERE id = :id", id=run_id)
    assert (processed, checkpoint(db.engine), not_current(db.engine)) == (0, None, todo)

    summary = _rerun_once_the_kill_lapsed(db, run_id, env)
    assert (summary["status"], summary["processed_count"], summary["succeeded_count"]) == (
        "success",
        n,
        todo,
    )
    assert not_current(db.engine) == 0


def test_cli_killed_after_a_commit_resumes_after_that_batch(loaded):
    """Needs the job in the catalog (the CLI only runs catalog jobs)."""
    db, n, todo = loaded
    env = base_env(QO_OPS_DATABASE_URL=db.env_url)
    killed = run_cli([*CLI_RUN, "--batch-size", "100"], {**env, CRASH_ENV: "after_commit"})
    assert killed.code == -signal.SIGKILL, (killed.code, killed.stderr[-800:])

    run_id = scalar(db.engine, "SELECT id FROM job_run WHERE job_name = :j", j=JOB)
    row = (
        sa.text("SELECT status, processed_count FROM job_run WHERE id = :id"),
        {"id": run_id},
    )
    with db.engine.connect() as conn:
        status, processed = conn.execute(*row).one()
    assert (status, processed) == ("running", 100)  # one batch committed, then the kill
    created, qid = nth_quote_key(db.engine, 100)
    assert checkpoint(db.engine) == {"created_at": created.isoformat(), "id": qid}

    summary = _rerun_once_the_kill_lapsed(db, run_id, env)
    assert summary["status"] == "success"
    assert summary["eligible_count"] == summary["processed_count"] == n - 100
    assert summary["checks"][0]["passed"]

    with db.engine.connect() as conn:
        killed_row = conn.execute(
            sa.text("SELECT status, status_reason FROM job_run WHERE id = :id"), {"id": run_id}
        ).one()
        changed = conn.execute(
            sa.text("SELECT sum(succeeded_count) FROM job_run WHERE job_name = :j"), {"j": JOB}
        ).scalar()
    assert tuple(killed_row) == ("failed", "orphaned")
    assert changed == todo  # the first batch was not recomputed by the rerun
    assert not_current(db.engine) == 0
