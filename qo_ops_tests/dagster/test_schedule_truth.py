"""Did the job start when it should have, and did a scheduled run go missing? The real
schedule is evaluated at frozen ticks (Dagster's clock frozen there), its run requests run
through real Dagster execution, and the exporter -- its clock frozen after the ticks' windows
-- reads the drift and the missed runs from the run records."""

from __future__ import annotations

import threading
import time
from datetime import datetime, timedelta

import dagster as dg
import pytest
import sqlalchemy as sa
from dagster._core.test_utils import freeze_time
from dagster._utils.schedules import cron_string_iterator

from qo_ops.jobs.catalog import CATALOG
from qo_ops.metrics.exporter import JobCollector
from qo_ops.metrics.feed import SETTLE_S
from qo_ops.metrics.histograms import DRIFT_BUCKETS
from qo_ops.platform.actions import control
from qo_ops.platform.job.options import RunOptions
from qo_ops.platform.job.scope import Scope
from qo_ops.platform.run import records
from qo_ops.platform.run.runner import run_job
from qo_ops.platform.schedule.cron import cron_ticks
from qo_ops.platform.schedule.missed import MISSED_REASONS, tick_window_s
from qo_ops_tests.dagster.test_sensors import _tenants_of, schedule_tick, submitted_run
from qo_ops_tests.metrics.test_exporter import collect, collect_when, value

JOB = "quote_expiration"
SPEC = CATALOG[JOB]


def _execute(defs, instance, request: dg.RunRequest, **config):
    """One run request of the schedule, executed as the daemon would launch it."""
    run_config = request.run_config
    op_config = run_config["ops"][f"{JOB}_op"]["config"]
    return defs.resolve_job_def(JOB).execute_in_process(
        run_config={"ops": {f"{JOB}_op": {"config": {**op_config, **config}}}},
        tags=request.tags,
        partition_key=request.partition_key,
        instance=instance,
        raise_on_error=False,
    )


def _wait_for(predicate, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


@pytest.mark.parametrize(
    "cron", ["* * * * *", "*/15 * * * *", "*/7 * * * *", "5 * * * *", "30 2 * * *"]
)
def test_cron_ticks_are_the_ticks_dagster_schedules(cron):
    start = datetime.fromisoformat("2026-11-28T22:53:17+00:00")
    until = start + timedelta(days=2)
    dagster_ticks = []
    for tick in cron_string_iterator(start.timestamp(), cron, "UTC"):
        if tick > until:
            break
        if tick > start:
            dagster_ticks.append(tick)
    assert cron_ticks(cron, start, until) == dagster_ticks
    assert cron_ticks(cron, dagster_ticks[0], dagster_ticks[0]) == []  # (after, until]


def _drifts(engine) -> list[tuple[str, str | None, float]]:
    with engine.connect() as conn:
        return [
            (r.scope, r.status, float(r.drift))
            for r in conn.execute(
                sa.text(
                    "SELECT scope, status, extract(epoch FROM started_at - scheduled_for) AS drift "
                    "FROM job_run WHERE job_name = :job AND scheduled_for IS NOT NULL "
                    "ORDER BY scope"
                ),
                {"job": JOB},
            )
        ]


def _missed(samples) -> dict[str, float]:
    """The job's missed runs by reason, the reasons that counted none left out."""
    counted = {
        reason: value(samples, "job_missed_runs_total", job_name=JOB, reason=reason)
        for reason in MISSED_REASONS
    }
    return {reason: n for reason, n in counted.items() if n}


def _recorded(engine) -> list[tuple[datetime, str, list[str]]]:
    with engine.connect() as conn:
        return [
            tuple(r)  # type: ignore[misc]
            for r in conn.execute(
                sa.text(
                    "SELECT scheduled_for, decision, tenants FROM job_schedule_tick "
                    "WHERE job_name = :job ORDER BY scheduled_for, decision"
                ),
                {"job": JOB},
            )
        ]


def test_a_run_still_queued_in_dagster_takes_its_scopes_off_the_next_ticks(defs, instance, loaded):
    """A backlog must not feed itself: while a tick's run waits in Dagster's queue, the next
    tick asks nothing for its tenants and records why; the exporter then counts the first
    tick's runs as ``queued`` (asked for, never started) and the next as
    ``previous_run_queued`` -- not ``daemon_down``, which only an unevaluated tick is."""
    engine = loaded.engine
    with engine.connect() as conn:
        now = conn.execute(sa.text("SELECT clock_timestamp()")).scalar_one()
    cadence = timedelta(minutes=15)
    t0 = cron_ticks(SPEC.deployment.cron_schedule, now, now + cadence)[
        0
    ]  # after the tenants were made
    t1, t2, t3 = t0 + cadence, t0 + 2 * cadence, t0 + 3 * cadence
    window = timedelta(seconds=tick_window_s(SPEC) + SETTLE_S + 1)
    frozen = {"now": t1 + window}
    collector = JobCollector(engine, CATALOG.values(), clock=lambda: frozen["now"])
    job = defs.resolve_job_def(JOB)

    with freeze_time(t0):
        first = schedule_tick(defs, instance, loaded, f"{JOB}_schedule", t0)
    (request,) = first.run_requests  # both tenants, one chunk
    # the daemon queues it; no run worker takes it (the queue is backed up)
    queued = submitted_run(instance, job, request.run_config, request.tags, "RUN_ENQUEUED")
    with freeze_time(t1):
        second = schedule_tick(defs, instance, loaded, f"{JOB}_schedule", t1)
    assert not second.run_requests
    assert "every tenant is still queued (2) or active (0)" in second.skip_message
    both = ["tenant-001", "tenant-002"]
    assert _recorded(engine) == [
        (t0, "evaluated", []),
        (t1, "evaluated", []),
        (t1, "previous_run_queued", both),
    ]
    assert _missed(collect(collector)) == {"queued": 2, "previous_run_queued": 2}

    # tenant-001 gets a run that starts (a person's, say): at t2 it is active, tenant-002
    # still waits behind the queued run
    started = submitted_run(
        instance,
        job,
        {"ops": {f"{JOB}_op": {"config": {"mode": "dry_run", "tenants": both[:1]}}}},
        {},
        "RUN_START",
    )
    with freeze_time(t2):
        third = schedule_tick(defs, instance, loaded, f"{JOB}_schedule", t2)
    assert not third.run_requests
    assert _recorded(engine)[-2:] == [
        (t2, "previous_run_active", ["tenant-001"]),
        (t2, "previous_run_queued", ["tenant-002"]),
    ]
    frozen["now"] = t2 + window
    assert _missed(collect(collector)) == {
        "queued": 2,
        "previous_run_queued": 3,
        "previous_run_active": 1,
    }

    # the queue drains (the run is cancelled, the other ends): the next tick asks again
    for run in (queued, started):
        instance.report_run_canceled(run)
    with freeze_time(t3):
        fourth = schedule_tick(defs, instance, loaded, f"{JOB}_schedule", t3)
    assert [_tenants_of(r) for r in fourth.run_requests] == [both]


def test_a_run_held_across_the_next_tick_is_one_missed_run(defs, instance, loaded):
    engine = loaded.engine
    with engine.connect() as conn:
        now = conn.execute(sa.text("SELECT clock_timestamp()")).scalar_one()
    cadence = timedelta(minutes=15)  # quote_expiration: */15
    t0 = cron_ticks(SPEC.deployment.cron_schedule, now - cadence, now)[
        -1
    ]  # the tick that just passed
    t1, t2 = t0 + cadence, t0 + 2 * cadence
    # the exporter's frozen clock: just after a tick's window (the cadence) has passed
    window = timedelta(seconds=tick_window_s(SPEC) + SETTLE_S + 1)
    frozen = {"now": t1 + window}
    collector = JobCollector(engine, CATALOG.values(), clock=lambda: frozen["now"])

    # tenant-001's work is done by hand first, so that in the tick's run it ends at once
    done = run_job(SPEC, Scope("tenant-001"), RunOptions(mode="execute", reason="t"), engine=engine)
    assert done.status == "success"

    # tick t0: one run for the chunk of both tenants; in it tenant-001's run ends, then
    # tenant-002's is held running (one batch of one item every 500 ms)
    with freeze_time(t0):
        first = schedule_tick(defs, instance, loaded, f"{JOB}_schedule", t0)
    (request,) = first.run_requests
    assert request.run_config["ops"][f"{JOB}_op"]["config"]["tenants"] == [
        "tenant-001",
        "tenant-002",
    ]

    def running() -> sa.Row | None:
        with engine.connect() as conn:
            return conn.execute(
                sa.text(
                    "SELECT r.id FROM job_run r JOIN job_lease l ON l.job_run_id = r.id "
                    "WHERE r.job_name = :job AND r.scope = 'tenant-002' "
                    "AND r.status = 'running' AND l.expires_at > clock_timestamp()"
                ),
                {"job": JOB},
            ).first()

    who = "ops@example.invalid"
    with dg.instance_for_test() as other:  # the held run's own Dagster instance (own thread)
        other.add_dynamic_partitions("tenants", ["tenant-001", "tenant-002"])
        held = threading.Thread(
            target=_execute,
            args=(defs, other, request),
            kwargs={"batch_size": 1, "throttle_ms": 500},
        )
        held.start()
        try:
            _wait_for(lambda: running() is not None, "the held run never started")
            control.suspend(
                engine,
                control.ControlChange(JOB, "tenant-001", actor=who, reason="schedule test"),
                known_jobs=set(CATALOG),
            )
            # tick t1: tenant-002's previous run is still active, tenant-001 is suspended
            with freeze_time(t1):
                second = schedule_tick(defs, instance, loaded, f"{JOB}_schedule", t1)
            assert not second.run_requests
            assert "every tenant is still queued (0) or active (1)" in second.skip_message

            # judged after t1's window, the run still active and the tenant still suspended:
            # t0 ran for both tenants, t1 missed once for each reason
            drift_count = ("job_scheduler_drift_seconds_count", (("job_name", JOB),))
            samples = collect_when(  # both t0 runs counted (runs settle for SETTLE_S first)
                collector, lambda s: s.get(drift_count, 0) >= 2
            )
            assert _missed(samples) == {"previous_run_active": 1, "suspended": 1}
            drifts = [d for _, _, d in _drifts(engine)]
            assert len(drifts) == 2 and all(0 <= d < cadence.total_seconds() for d in drifts)
            assert value(samples, "job_scheduler_drift_seconds_count", job_name=JOB) == 2
            assert value(samples, "job_scheduler_drift_seconds_sum", job_name=JOB) == (
                pytest.approx(sum(drifts))
            )
            for bound in DRIFT_BUCKETS:
                assert value(
                    samples,
                    "job_scheduler_drift_seconds_bucket",
                    job_name=JOB,
                    le=str(float(bound)),
                ) == sum(1 for d in drifts if d <= bound)
            other_job = {"job_name": "delivery_retry", "reason": "daemon_down"}
            assert value(samples, "job_missed_runs_total", **other_job) == 0  # never scheduled
            # a tick is judged once; a restarted exporter judges the same ticks the same way
            assert _missed(collect(collector)) == _missed(samples)
            restarted = JobCollector(engine, CATALOG.values(), clock=lambda: t1 + window)
            assert _missed(collect(restarted)) == _missed(samples)

            row = running()
            assert row is not None
            records.request_cancel(engine, row.id, "ops@example.invalid", "schedule test over")
        finally:
            held.join(timeout=120)
    assert not held.is_alive()
    control.resume(
        engine,
        control.ControlChange(JOB, "tenant-001", actor=who, reason="schedule test over"),
        known_jobs=set(CATALOG),
    )
    assert [(scope, status) for scope, status, _ in _drifts(engine)] == [
        ("tenant-001", "no_work"),
        ("tenant-002", "cancelled"),
    ]

    # t2 had no tick evaluated at all, nothing running, nothing suspended: the daemon was down
    frozen["now"] = t2 + window
    assert _missed(collect(collector)) == {
        "previous_run_active": 1,
        "suspended": 1,
        "daemon_down": 2,
    }
