"""The orchestration section's ticks: (a) a real daemon tick, (b) the same tick's
RunRequests submitted through GraphQL, the staggered load of the jobs sharing a cron, each
timed to its last job_run row and verified; and every tick's evaluation at 10,000 tenants
(``bench/tick_evaluation.py`` in its own process)."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import URL

from bench.common import REPO, admin_engine, engine_for, env_url, fresh_database, settle, stopwatch
from bench.orchestration_data import JOB, PREFIX, partition_start, verify
from bench.orchestration_deployment import (
    LOCATION,
    REPOSITORY,
    START_SCHEDULE,
    STOP_SCHEDULE,
    Deployment,
    wait_for,
)
from bench.suite import median

STAGGER_CRON = "15 3 * * *"  # the cron three nightly jobs share
ENDED = ("SUCCESS", "FAILURE", "CANCELED")


def _db_epoch(url: URL, sql: str, params: dict[str, Any]) -> float | None:
    engine = engine_for(url)
    with engine.connect() as conn:
        value = conn.scalar(sa.text(sql), params)
    engine.dispose()
    return None if value is None else float(value)


def _db_now(url: URL) -> float:
    return float(_db_epoch(url, "SELECT extract(epoch FROM clock_timestamp())", {}) or 0.0)


def wait_runs(d: Deployment, url: URL, ids: list[str], timeout: float) -> list[Any]:
    """Until every Dagster run has ended and no job_run row it wrote is still open; every
    run must have succeeded."""
    import dagster as dg

    from qo_ops.platform.job.statuses import FINAL

    engine = engine_for(url)
    records: list[Any] = []

    def done() -> bool:
        nonlocal records
        records = list(d.instance.get_run_records(filters=dg.RunsFilter(run_ids=ids)))
        if len(records) < len(ids) or any(r.dagster_run.status.value not in ENDED for r in records):
            return False
        with engine.connect() as conn:
            open_rows = conn.scalar(
                sa.text(
                    "SELECT count(*) FROM job_run WHERE dagster_run_id = ANY(:ids) "
                    "AND status <> ALL(:final)"
                ),
                {"ids": ids, "final": list(FINAL)},
            )
        return open_rows == 0

    try:
        wait_for(done, timeout, f"{len(ids)} Dagster runs", poll=0.5)
    finally:
        engine.dispose()
    failed = [r.dagster_run.run_id for r in records if r.dagster_run.status.value != "SUCCESS"]
    if failed:
        raise AssertionError(f"{len(failed)} Dagster run(s) did not succeed: {failed[:5]}")
    return records


def breakdown(d: Deployment, records: list[Any], url: URL, ids: list[str]) -> dict[str, Any]:
    """Per run (median): waiting in the queue (created → launched), process start (launched
    → RUN_START), the run worker (RUN_START → end); per tenant: run_job (job_run started →
    finished), the op's time around it (worker time / tenants − run_job) and the Dagster
    event-log entries written (asset events, log lines: the op's and the runner's
    qo_ops.events lines, which dagster.yaml's managed_python_loggers forwards)."""
    import dagster as dg

    queued, boot = [], []
    kinds: dict[str, int] = {}
    for r in records:
        logs = d.instance.all_logs(r.dagster_run.run_id)
        launched = [
            e.timestamp
            for e in logs
            if e.dagster_event is not None
            and e.dagster_event.event_type == dg.DagsterEventType.RUN_STARTING
        ]
        if launched and r.start_time:
            queued.append(launched[0] - r.create_timestamp.timestamp())
            boot.append(r.start_time - launched[0])
        for e in logs:
            if e.dagster_event is None:
                kind = "runner lines" if e.user_message.startswith("{") else "op lines"
            elif e.dagster_event.event_type_value.startswith("ASSET_"):
                kind = e.dagster_event.event_type_value.lower()
            else:
                kind = "run and step events"
            kinds[kind] = kinds.get(kind, 0) + 1
    worker = [r.end_time - r.start_time for r in records if r.start_time and r.end_time]
    engine = engine_for(url)
    with engine.connect() as conn:
        work = [
            float(v)
            for v in conn.execute(
                sa.text(
                    "SELECT extract(epoch FROM finished_at - started_at) FROM job_run "
                    "WHERE dagster_run_id = ANY(:ids) AND mode = 'execute'"
                ),
                {"ids": ids},
            ).scalars()
        ]
    engine.dispose()
    tenants = len(work) or 1
    return {
        "queued_s_median": median(queued) if queued else 0.0,
        "process_start_s_median": median(boot) if boot else 0.0,
        "worker_s_median": median(worker) if worker else 0.0,
        "worker_s_total": sum(worker),
        "run_job_ms_median": 1000 * median(work) if work else 0.0,
        "op_overhead_ms_per_tenant": 1000 * (sum(worker) - sum(work)) / tenants,
        "events_per_tenant": {k: v / tenants for k, v in sorted(kinds.items())},
    }


def storage_counts(d: Deployment) -> dict[str, int]:
    """Connections opened to the Dagster storage database and transactions committed in it
    so far (``pg_stat_database``): the event log's cost in connections, per tenant."""
    from sqlalchemy.engine import make_url

    engine = admin_engine()
    with engine.connect() as conn:
        row = conn.execute(
            sa.text("SELECT sessions, xact_commit FROM pg_stat_database WHERE datname = :db"),
            {"db": make_url(d.storage).database},
        ).one()
    engine.dispose()
    return {"sessions": int(row.sessions), "commits": int(row.xact_commit)}


def per_tenant(before: dict[str, int], after: dict[str, int], tenants: int) -> dict[str, float]:
    return {f"storage_{k}_per_tenant": (after[k] - before[k]) / tenants for k in before}


def materialized_everywhere(d: Deployment, tenants: list[str]) -> None:
    """Every tenant's partition of the quotes asset has a materialization."""
    import dagster as dg

    done = d.instance.get_materialized_partitions(dg.AssetKey(["qo_ops", "quotes"]))
    missing = [t for t in tenants if t not in done]
    if missing:
        raise AssertionError(f"{len(missing)} tenant partition(s) not materialized: {missing[:5]}")


def finish(
    d: Deployment, url: URL, tenants: list[str], expected: int, ids: list[str], t0: float
) -> dict[str, Any]:
    """Wait for the runs, then the figures (from ``t0``, database clock) and the checks."""
    records = wait_runs(d, url, ids, max(600.0, 2.0 * len(tenants)))
    end = _db_epoch(
        url,
        "SELECT extract(epoch FROM max(finished_at)) FROM job_run WHERE dagster_run_id = ANY(:ids)",
        {"ids": ids},
    )
    out = {
        "tick_s": float(end or 0.0) - t0,
        "dagster_runs": len(ids),
        "tenants": len(tenants),
        "runs_ended_s": max(r.end_time for r in records if r.end_time) - t0,
        **breakdown(d, records, url, ids),
        **verify(url, tenants, expected, ids),
    }
    materialized_everywhere(d, tenants)
    return out


def schedule_requests(d: Deployment, url: URL, size: int, when: datetime) -> list[Any]:
    """The RunRequests of quote_expiration_schedule at ``when``, evaluated in-process
    against the deployment's instance and database, the catalog entry's tenants_per_run
    replaced by ``size``."""
    import dagster as dg
    from dagster._core.definitions.partitions.context import partition_loading_context

    from qo_ops.dagster_defs.jobs import build_job
    from qo_ops.dagster_defs.resources import QoOpsDatabase
    from qo_ops.dagster_defs.schedules import build_schedule
    from qo_ops.jobs.catalog import CATALOG

    spec = CATALOG[JOB]
    spec = replace(spec, deployment=replace(spec.deployment, tenants_per_run=size))
    job = build_job(spec)
    schedule = build_schedule(spec, job)
    database = QoOpsDatabase(url=env_url(url))
    repo = dg.Definitions(
        jobs=[job], schedules=[schedule], resources={"database": database}
    ).get_repository_def()
    with (
        dg.build_schedule_context(
            instance=d.instance,
            scheduled_execution_time=when,
            repository_def=repo,
            resources={"database": database},
        ) as context,
        partition_loading_context(dynamic_partitions_store=d.instance),
    ):
        return list(schedule.evaluate_tick(context).run_requests or [])


def submitted_tick(
    d: Deployment, url: URL, tenants: list[str], size: int, expected: int
) -> dict[str, Any]:
    """(b) the tick's exact RunRequests, submitted through GraphQL launchRun."""
    d.set_tenants(tenants)
    when = datetime.now(UTC).replace(second=0, microsecond=0)
    requests = schedule_requests(d, url, size, when)
    covered = sorted(
        t for r in requests for t in r.run_config["ops"][f"{JOB}_op"]["config"]["tenants"]
    )
    assert covered == sorted(tenants), "the tick's runs do not cover exactly its tenants"
    assert len(requests) == math.ceil(len(tenants) / size), "not one run per chunk"
    settle(url)
    counted = storage_counts(d)
    t0 = _db_now(url)
    with stopwatch() as submitted:
        ids = [
            d.launch(
                r.run_config["ops"][f"{JOB}_op"]["config"],
                {**r.tags, "dagster/schedule_name": f"{JOB}_schedule"},
            )
            for r in requests
        ]
    out = finish(d, url, tenants, expected, ids, t0)
    out.update(per_tenant(counted, storage_counts(d), len(tenants)))
    out.update(submit_s=submitted[0], how="RunRequests via launchRun", chunk=size)
    return out


def _last_cron_time(cron: str, now: datetime) -> datetime:
    from dagster._utils.schedules import reverse_cron_string_iterator

    return next(reverse_cron_string_iterator(now.timestamp(), cron, "UTC"))


def daemon_tick(d: Deployment, names: list[str]) -> list[dict[str, Any]]:
    """A real tick of each schedule in ``names`` (one daemon iteration): each is started
    with its start time just before its last cron time, so the daemon's next iteration (at
    the start of a minute) evaluates that tick in the code server and submits its runs.
    Returns, per schedule, its tick's runs and its creation and end times (epoch)."""
    from dagster._core.scheduler.instigation import (
        InstigatorStatus,
        InstigatorType,
        ScheduleInstigatorData,
        TickStatus,
    )

    # the daemon must not look at a started schedule before its start time is set back
    wait_for(lambda: 3 <= datetime.now(UTC).second <= 45, 90, "a quiet second of the minute")
    state_ids = {}
    for name in names:
        selector = {
            "repositoryLocationName": LOCATION,
            "repositoryName": REPOSITORY,
            "scheduleName": name,
        }
        started = d.graphql(START_SCHEDULE, {"s": selector})["startSchedule"]
        if started["__typename"] != "ScheduleStateResult":
            raise RuntimeError(f"startSchedule {name}: {started}")
        state_ids[name] = started["scheduleState"]["id"]
    now = datetime.now(UTC)
    states = {
        s.instigator_name: s
        for s in d.instance.all_instigator_state(instigator_type=InstigatorType.SCHEDULE)
        if s.instigator_name in names
    }
    due = {}
    wanted = {}
    for name, state in states.items():
        data = state.instigator_data
        due[name] = _last_cron_time(data.cron_schedule, now)
        wanted[name] = state.with_status(InstigatorStatus.RUNNING).with_data(
            ScheduleInstigatorData(data.cron_schedule, due[name].timestamp() - 1)
        )
        d.instance.update_instigator_state(wanted[name])
    ticks: dict[str, Any] = {}

    def reassert(name: str) -> None:
        # A daemon iteration that read the schedule states before they were started (a slow
        # iteration under load) writes its stale copy back when it checkpoints: the schedule
        # then reads as stopped, or as started now, and never ticks for ``due``. Put ours back.
        stored = d.instance.get_instigator_state(
            wanted[name].instigator_origin_id, wanted[name].selector_id
        )
        if stored is None or (
            stored.status != InstigatorStatus.RUNNING
            or stored.instigator_data.start_timestamp != due[name].timestamp() - 1
        ):
            d.instance.update_instigator_state(wanted[name])

    def ticked() -> bool:
        for name, state in states.items():
            if name in ticks:
                continue
            found = d.instance.get_ticks(state.instigator_origin_id, state.selector_id, limit=1)
            # A later cron time than ``due`` is the same daemon tick when the minute it ran in
            # crossed the schedule's next cron time (Dagster then evaluates only the latest).
            if (
                found
                and found[0].timestamp >= due[name].timestamp()
                and found[0].status
                in (
                    TickStatus.SUCCESS,
                    TickStatus.SKIPPED,
                    TickStatus.FAILURE,
                )
            ):
                ticks[name] = found[0]
                due[name] = datetime.fromtimestamp(found[0].timestamp, UTC)
            elif not found or found[0].timestamp < due[name].timestamp():
                reassert(name)
        return len(ticks) == len(names)

    try:
        wait_for(ticked, 180, f"the daemon's tick of {', '.join(names)}", poll=0.25)
    except TimeoutError as e:
        seen = {}
        for name in names:
            w = wanted[name]
            stored = d.instance.get_instigator_state(w.instigator_origin_id, w.selector_id)
            last = d.instance.get_ticks(w.instigator_origin_id, w.selector_id, limit=1)
            seen[name] = (
                stored and stored.status.value,
                stored and stored.instigator_data.start_timestamp,
                last and (last[0].timestamp, last[0].status.value),
            )
        raise TimeoutError(f"{e}; due {due}; (status, start, last tick) {seen}") from None
    finally:
        for state_id in state_ids.values():
            d.graphql(STOP_SCHEDULE, {"id": state_id})
    out = []
    storage = sa.create_engine(d.storage, poolclass=sa.pool.NullPool)
    with storage.connect() as conn:
        for name in names:
            tick = ticks[name]
            if tick.status != TickStatus.SUCCESS:
                raise RuntimeError(f"tick of {name}: {tick.status} {tick.tick_data.error}")
            created = conn.scalar(
                sa.text(
                    "SELECT extract(epoch FROM create_timestamp AT TIME ZONE "
                    "current_setting('TimeZone')) FROM job_ticks WHERE id = :id"
                ),
                {"id": tick.tick_id},
            )
            out.append(
                {
                    "schedule": name,
                    "created": float(created),
                    "ended": float(tick.tick_data.end_timestamp or 0.0),
                    "run_ids": list(tick.run_ids),
                    "scheduled_for": due[name].isoformat(),
                }
            )
    storage.dispose()
    return out


def real_tick(d: Deployment, url: URL, tenants: list[str], expected: int) -> dict[str, Any]:
    """(a) a real daemon tick of quote_expiration_schedule over ``tenants``."""
    from qo_ops.jobs.catalog import CATALOG

    d.set_tenants(tenants)
    settle(url)
    counted = storage_counts(d)
    (tick,) = daemon_tick(d, [f"{JOB}_schedule"])
    ids = tick["run_ids"]
    size = CATALOG[JOB].deployment.tenants_per_run
    if len(ids) != math.ceil(len(tenants) / size):
        raise AssertionError(f"the tick requested {len(ids)} runs for {len(tenants)} tenants")
    out = finish(d, url, tenants, expected, ids, tick["created"])
    out.update(per_tenant(counted, storage_counts(d), len(tenants)))
    out.update(
        submit_s=tick["ended"] - tick["created"],
        how="real daemon tick",
        chunk=size,
        scheduled_for=tick["scheduled_for"],
    )
    return out


def stagger(d: Deployment, url: URL, tenants: list[str]) -> dict[str, Any]:
    """A real tick of every schedule sharing STAGGER_CRON over ``tenants``: when each tenant
    run started (job_run.started_at), per second."""
    from qo_ops.jobs.catalog import CATALOG

    names = [
        f"{s.name}_schedule" for s in CATALOG.values() if s.deployment.cron_schedule == STAGGER_CRON
    ]
    d.set_tenants(tenants)
    settle(url)
    ticks = daemon_tick(d, names)
    ids = [i for t in ticks for i in t["run_ids"]]
    wait_runs(d, url, ids, max(600.0, 2.0 * len(tenants) * len(names)))
    engine = engine_for(url)
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT job_name, split_part(scope, '/', 1) AS tenant, status, "
                "extract(epoch FROM started_at) AS started FROM job_run "
                "WHERE dagster_run_id = ANY(:ids)"
            ),
            {"ids": ids},
        ).all()
    engine.dispose()
    statuses: dict[str, int] = {}
    for r in rows:
        statuses[r.status] = statuses.get(r.status, 0) + 1
    if len(rows) != len(tenants) * len(names) or set(statuses) - {"success", "no_work"}:
        raise AssertionError(
            f"stagger tick: {len(rows)} tenant runs for {len(tenants)} tenants x "
            f"{len(names)} jobs, statuses {statuses}"
        )
    first = min(float(r.started) for r in rows)
    per_second: dict[int, int] = {}
    jobs_at: dict[tuple[str, int], set[str]] = {}
    for r in rows:
        second = int(float(r.started) - first)
        per_second[second] = per_second.get(second, 0) + 1
        jobs_at.setdefault((r.tenant, second), set()).add(r.job_name)
    counts = sorted(per_second.values())
    return {
        "jobs": [n.removesuffix("_schedule") for n in names],
        "tenants": len(tenants),
        "tenant_runs": len(rows),
        "dagster_runs": len(ids),
        "statuses": statuses,
        "max_per_second": counts[-1],
        "median_per_active_second": median([float(c) for c in counts]),
        "first_second": per_second.get(0, 0),
        "seconds_with_starts": len(per_second),
        "spread_s": max(float(r.started) for r in rows) - first,
        "same_tenant_same_second": sum(1 for jobs in jobs_at.values() if len(jobs) > 1),
        "per_second": [per_second.get(s, 0) for s in range(max(per_second) + 1)],
        "tick_submit_s": max(t["ended"] for t in ticks) - min(t["created"] for t in ticks),
    }


# ------------------------------------------------------------------ 10,000 tenants


def tick_evaluation(tenants: int, repeats: int) -> dict[str, Any]:
    """bench/tick_evaluation.py in its own process, on its own database and instance."""
    from bench.tick_evaluation import load_history, observations_note, stale_note
    from qo_ops.dagster_defs.sensors import MAX_TENANTS_PER_TICK

    with fresh_database(f"{PREFIX}_eval") as url:
        with stopwatch() as loaded:
            planted = load_history(url, tenants)
        storage_db = f"{PREFIX}_eval_dagster"
        admin = admin_engine()
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{storage_db}" WITH (FORCE)')
            conn.exec_driver_sql(f'CREATE DATABASE "{storage_db}"')
        storage = url.set(drivername="postgresql+psycopg2", database=storage_db)
        try:
            with tempfile.TemporaryDirectory(prefix="qo-ops-bench-eval-") as home:
                shutil.copy(REPO / "dagster.yaml", Path(home) / "dagster.yaml")
                env = {k: v for k, v in os.environ.items() if not k.startswith("QO_OPS_")}
                env.update(
                    QO_OPS_DATABASE_URL=env_url(url),
                    QO_OPS_DAGSTER_STORAGE_URL=storage.render_as_string(hide_password=False),
                    QO_OPS_PARTITION_START=partition_start().isoformat(),
                    QO_OPS_HOME=home,
                    QO_OPS_DOWNSTREAM_URL="http://127.0.0.1:9",
                    DAGSTER_HOME=home,
                )
                settle(url)
                proc = subprocess.run(
                    [sys.executable, "-m", "bench.tick_evaluation", str(tenants), str(repeats)],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=False,
                    cwd=REPO,
                    timeout=1200,
                )
        finally:
            with admin.connect() as conn:
                conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{storage_db}" WITH (FORCE)')
            admin.dispose()
    if proc.returncode != 0:
        raise RuntimeError(f"tick evaluation failed: {proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["load_s"] = loaded[0]
    out["planted"] = planted
    out["rows"] = planted["rows"]
    out["stale_note"] = stale_note(
        out["sensors"], planted["stale"], planted["jobs"], MAX_TENANTS_PER_TICK
    )
    out["observations_note"] = observations_note(out["sensors"])
    return out
