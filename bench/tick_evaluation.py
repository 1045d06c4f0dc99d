"""Every schedule and sensor of the code location, evaluated at N tenants, and every
PartitionsDefinition's size (the orchestration section's 10,000-tenant part).

``load_history(url, n)`` builds the database: n tenants, each job's job_run history at its
cadence, a little business data, running leases and planted stale tenants.

``python -m bench.tick_evaluation N REPEATS`` (environment: QO_OPS_DATABASE_URL, DAGSTER_HOME
with the project's dagster.yaml, QO_OPS_DAGSTER_STORAGE_URL, QO_OPS_PARTITION_START) adds N
tenant partitions to the instance, builds the code location's definitions as a code server
does, and evaluates each schedule (``build_schedule_context`` at its last cron time) and
each sensor (``build_sensor_context``, its cursor carried from tick to tick): one 'cold'
evaluation, then REPEATS timed ones, in one process. Prints one JSON line.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import URL

from bench.common import engine_for

BUSY = 20  # tenants whose quote_expiration lease is held (a run still active)
STALE_SHIFT = 4  # planted stale tenants: their history ends 4 cadences ago
HISTORY_SPAN_S = 86400  # each job's runs cover about the last day, at least 2, at most 12
MAX_RUNS = 12

TENANT = "('tenant-' || lpad(t::text, 5, '0'))"

LOAD = {
    "tenant": f"INSERT INTO tenant (id, name) SELECT {TENANT}, 'bench' FROM generate_series(1, :n) t",
    # 20 quotes a tenant, one ACTIVE past expiry
    "quote": f"""
        INSERT INTO quote (id, tenant_id, quote_number, customer_ref, status, currency,
                           total_amount, price_book_version, created_at, updated_at, expires_at)
        SELECT (t - 1) * 20 + i, {TENANT}, 'Q-' || i, 'c-' || (i % 97),
               CASE WHEN i % 4 = 0 THEN 'ACCEPTED' ELSE 'ACTIVE' END, 'EUR', i * 10.0, 1,
               now() - interval '10 days', now() - interval '10 days',
               CASE WHEN i = 20 THEN now() - interval '1 hour' ELSE now() + interval '30 days' END
          FROM generate_series(1, :n) t, generate_series(1, 20) i
    """,
    # 10 events a tenant, one unpublished and due
    "outbox_event": f"""
        INSERT INTO outbox_event (id, business_key, tenant_id, aggregate_type, aggregate_id,
                                  event_type, payload, created_at, available_at, published_at,
                                  publish_attempts)
        SELECT gen_random_uuid(), 'bench:' || t || ':' || i, {TENANT}, 'order', i::text,
               'OrderSubmitted', '{{}}'::jsonb, now() - interval '1 day',
               now() - interval '1 day',
               CASE WHEN i < 10 THEN now() - interval '23 hours' END, CASE WHEN i < 10 THEN 1 ELSE 0 END
          FROM generate_series(1, :n) t, generate_series(1, 10) i
    """,
    # 10 delivery items a tenant, one READY and due
    "delivery_attempt_item": f"""
        INSERT INTO delivery_attempt_item (id, tenant_id, business_key, status, attempt_count,
                                           max_attempts, next_attempt_at, payload, created_at,
                                           updated_at)
        SELECT gen_random_uuid(), {TENANT}, 'bench:' || t || ':' || i,
               CASE WHEN i < 10 THEN 'DELIVERED' ELSE 'READY' END, 1, 8,
               now() - interval '1 hour', '{{}}'::jsonb, now() - interval '1 day',
               now() - interval '1 day'
          FROM generate_series(1, :n) t, generate_series(1, 10) i
    """,
    # each job's runs at its cadence for every tenant, newest 30-60 s ago; the planted stale
    # tenants' runs end STALE_SHIFT cadences ago; one run in 50 failed
    "job_run": f"""
        INSERT INTO job_run (id, job_name, scope, window_start, window_end, mode, trigger_type,
                             requester, owner_id, scheduled_for, created_at, started_at,
                             heartbeat_at, finished_at, status, last_error_code,
                             eligible_count, processed_count, succeeded_count, failed_count)
        SELECT gen_random_uuid(), j.name,
               CASE WHEN j.windowed THEN {TENANT} || '/' || x.day || '..' || (x.day + 1)
                    ELSE {TENANT} END,
               CASE WHEN j.windowed THEN x.day END, CASE WHEN j.windowed THEN x.day + 1 END,
               'execute', 'schedule', 'dagster:schedule', 'bench', x.at, x.at, x.at,
               x.at + interval '2 seconds', x.at + interval '2 seconds',
               CASE WHEN (t + k) % 50 = 0 THEN 'failed' ELSE 'success' END,
               CASE WHEN (t + k) % 50 = 0 THEN 'downstream_unavailable' END,
               k % 5, k % 5, CASE WHEN (t + k) % 50 = 0 THEN 0 ELSE k % 5 END,
               CASE WHEN (t + k) % 50 = 0 THEN 1 ELSE 0 END
          FROM unnest(CAST(:names AS text[]), CAST(:windowed AS boolean[]),
                      CAST(:cadence AS int[]), CAST(:runs AS int[]))
                 AS j(name, windowed, cadence, runs),
               generate_series(1, :n) t,
               LATERAL generate_series(0, j.runs - 1) k,
               LATERAL (SELECT now() - make_interval(
                                secs => 30 + t % 30
                                       + (k + CASE WHEN t = ANY(CAST(:stale AS int[]))
                                                   THEN :shift ELSE 0 END) * j.cadence) AS at) x0,
               LATERAL (SELECT x0.at, x0.at::date - 1 AS day) x
    """,
}
# BUSY tenants with a quote_expiration run still active (its lease held)
BUSY_SQL = f"""
    WITH r AS (
        INSERT INTO job_run (id, job_name, scope, mode, trigger_type, owner_id, created_at,
                             started_at, heartbeat_at, status)
        SELECT gen_random_uuid(), 'quote_expiration', {TENANT}, 'execute', 'schedule', 'bench',
               now() - interval '1 minute', now() - interval '1 minute', now(), 'running'
          FROM generate_series(1, :n, greatest(:n / :busy, 1)) t
         LIMIT :busy
        RETURNING id, job_name, scope
    )
    INSERT INTO job_lease (job_name, scope, owner_id, lease_token, fencing_token, acquired_at,
                           heartbeat_at, expires_at, job_run_id)
    SELECT job_name, scope, 'bench', md5(scope), 1, now() - interval '1 minute', now(),
           now() + interval '1 hour', id
      FROM r
"""
_INT = re.compile(r":(n|busy|shift)\b")


def tenant_key(k: int) -> str:
    return f"tenant-{k:05d}"


def stale_tenants(n: int) -> list[int]:
    """Tenants planted without a success for 4 cadences: one among the first 100, and ten
    spread over the rest of the id range."""
    spread = [n // 20 + m * n // 10 for m in range(10)]
    return sorted({min(100, n), *[t for t in spread if 1 <= t <= n]})


def history_runs(cadence_s: float) -> int:
    return max(2, min(MAX_RUNS, math.ceil(HISTORY_SPAN_S / cadence_s)))


def load_history(url: URL, n: int) -> dict[str, Any]:
    """The 10,000-tenant database (see the module docstring); returns what was planted."""
    from qo_ops.demo.data import _bulk_load
    from qo_ops.jobs.catalog import CATALOG
    from qo_ops.platform.schedule.cron import cadence_seconds

    specs = list(CATALOG.values())
    cadence = [int(cadence_seconds(s.deployment.cron_schedule)) for s in specs]
    stale = stale_tenants(n)
    params = {
        "n": n,
        "busy": BUSY,
        "shift": STALE_SHIFT,
        "names": [s.name for s in specs],
        "windowed": [s.partitioning == "tenant_day" for s in specs],
        "cadence": cadence,
        "runs": [history_runs(c) for c in cadence],
        "stale": stale,
    }
    engine = engine_for(url)
    with engine.begin() as conn:
        conn.exec_driver_sql("SET LOCAL synchronous_commit = off")
        conn.exec_driver_sql("SET LOCAL work_mem = '256MB'")
        with _bulk_load(conn, list(LOAD)):
            for sql in LOAD.values():
                conn.execute(sa.text(_INT.sub(r"CAST(:\1 AS int)", sql)), params)
        conn.execute(sa.text(_INT.sub(r"CAST(:\1 AS int)", BUSY_SQL)), params)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql("VACUUM ANALYZE")
        rows = {t: int(conn.scalar(sa.text(f"SELECT count(*) FROM {t}")) or 0) for t in LOAD}
    engine.dispose()
    return {
        "stale": [tenant_key(t) for t in stale],
        "busy": BUSY,
        "jobs": len(specs),
        "rows": rows,
    }


# ------------------------------------------------------------------ in its own process


def _label(pd: Any) -> str:
    import dagster as dg

    if isinstance(pd, dg.DynamicPartitionsDefinition):
        return f"{pd.name} (dynamic)"
    if isinstance(pd, dg.TimeWindowPartitionsDefinition):
        return f"days (daily from {pd.start.date().isoformat()})"
    if isinstance(pd, dg.MultiPartitionsDefinition):
        return " × ".join(_label(d.partitions_def) for d in pd.partitions_defs)
    return type(pd).__name__


def count_partitions(repo: Any, instance: Any) -> dict[str, dict[str, Any]]:
    """Every PartitionsDefinition the code location's jobs, assets and checks use: its key
    count now (with the instance's dynamic partitions) and the time to list them."""
    from dagster._core.definitions.partitions.context import partition_loading_context

    found: list[tuple[Any, dict[str, int]]] = []

    def add(pd: Any, kind: str) -> None:
        if pd is None:
            return
        for known, users in found:
            if known == pd:
                users[kind] = users.get(kind, 0) + 1
                return
        found.append((pd, {kind: 1}))

    for job in repo.get_all_jobs():
        if not job.name.startswith("__"):  # Dagster's implicit asset job
            add(job.partitions_def, "jobs")
    for assets in repo.assets_defs_by_key.values():
        add(assets.partitions_def, "assets")
    for checks in repo.asset_checks_defs_by_key.values():
        add(getattr(checks, "partitions_def", None), "checks")
    out = {}
    with partition_loading_context(dynamic_partitions_store=instance):
        for pd, users in found:
            started = time.perf_counter()
            keys = pd.get_partition_keys(dynamic_partitions_store=instance)
            took = time.perf_counter() - started
            out[_label(pd)] = {
                "keys": len(keys),
                "list_s": took,
                "used_by": ", ".join(f"{v} {k}" for k, v in users.items()),
            }
    return out


def _timed(fn: Any, repeats: int, carry: Any = None) -> tuple[float, list[float], Any]:
    """One cold call, then ``repeats`` timed ones; ``carry(result)`` feeds the next call."""
    started = time.perf_counter()
    result = fn(None)
    cold = time.perf_counter() - started
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        result = fn(carry(result) if carry else None)
        seconds.append(time.perf_counter() - started)
    return cold, seconds, result


def evaluate(tenants: int, repeats: int) -> dict[str, Any]:
    import dagster as dg
    from dagster._core.definitions.partitions.context import partition_loading_context
    from dagster._utils.schedules import reverse_cron_string_iterator

    from qo_ops.dagster_defs.partitions import days_partitions_def
    from qo_ops.dagster_defs.resources import QoOpsDatabase
    from qo_ops.definitions import build_definitions
    from qo_ops.jobs.catalog import CATALOG
    from qo_ops.platform.schedule.partition_keys import chunk_keys

    keys = [tenant_key(k) for k in range(1, tenants + 1)]
    database = QoOpsDatabase(url=os.environ["QO_OPS_DATABASE_URL"])
    busy = set(
        sa.create_engine(
            os.environ["QO_OPS_DATABASE_URL"].replace("postgresql://", "postgresql+psycopg://", 1),
            poolclass=sa.pool.NullPool,
        )
        .connect()
        .execute(sa.text("SELECT scope FROM job_lease WHERE job_name = 'quote_expiration'"))
        .scalars()
    )
    out: dict[str, Any] = {
        "tenants": tenants,
        "partition_start": os.environ["QO_OPS_PARTITION_START"],
    }
    with dg.DagsterInstance.get() as instance:
        started = time.perf_counter()
        instance.add_dynamic_partitions("tenants", keys)
        instance.add_dynamic_partitions("tenant_chunks", chunk_keys(len(keys)))
        out["add_partitions_s"] = time.perf_counter() - started
        defs = build_definitions()
        repo = defs.get_repository_def()
        out["partitions"] = count_partitions(repo, instance)
        out["days"] = days_partitions_def.get_num_partitions()
        now = datetime.now(UTC)
        schedules: dict[str, Any] = {}
        for schedule in repo.schedule_defs:
            when = next(
                reverse_cron_string_iterator(now.timestamp(), str(schedule.cron_schedule), "UTC")
            )

            def tick(_: Any, schedule: Any = schedule, when: datetime = when) -> Any:
                with (
                    dg.build_schedule_context(
                        instance=instance,
                        scheduled_execution_time=when,
                        repository_def=repo,
                        resources={"database": database},
                    ) as context,
                    partition_loading_context(dynamic_partitions_store=instance),
                ):
                    return schedule.evaluate_tick(context)

            cold, seconds, result = _timed(tick, repeats)
            requests = list(result.run_requests or [])
            job = schedule.job_name
            spec = CATALOG[job]
            covered = [
                t for r in requests for t in r.run_config["ops"][f"{job}_op"]["config"]["tenants"]
            ]
            want = sorted(set(keys) - (busy if job == "quote_expiration" else set()))
            if sorted(covered) != want or any(
                len(r.run_config["ops"][f"{job}_op"]["config"]["tenants"])
                > spec.deployment.tenants_per_run
                for r in requests
            ):
                raise AssertionError(
                    f"{schedule.name}: {len(requests)} runs cover {len(covered)} tenants "
                    f"(expected {len(want)}, ≤ {spec.deployment.tenants_per_run} a run); skip: "
                    f"{result.skip_message}"
                )
            schedules[schedule.name] = {
                "cold_s": cold,
                "seconds": seconds,
                "run_requests": len(requests),
                "outcome": f"{len(requests)} runs over {len(covered):,} tenants",
            }
        out["schedules"] = schedules
        sensors: dict[str, Any] = {}
        for sensor in repo.sensor_defs:

            def sense(cursor: Any, sensor: Any = sensor) -> Any:
                context = dg.build_sensor_context(
                    instance=instance,
                    resources={"database": database},
                    repository_def=repo,
                    cursor=cursor,
                )
                return sensor.evaluate_tick(context)

            cold, seconds, result = _timed(sense, repeats, carry=lambda r: r.cursor)
            skip = result.skip_message or ""
            asked = len(result.run_requests or [])
            events = len(getattr(result, "asset_events", None) or [])
            outcome = f"{asked} runs requested" if asked else (skip[:120] or "no skip message")
            if events:
                outcome += f"; {events} asset events"
            sensors[sensor.name] = {
                "cold_s": cold,
                "seconds": seconds,
                "run_requests": asked,
                "asset_events": events,
                "skip": skip[:2000],
                "outcome": outcome,
            }
        out["sensors"] = sensors
    return out


def stale_note(sensors: dict[str, Any], planted: list[str], jobs: int, cap: int) -> str:
    """What the stale-success sensor said about the planted stale tenants."""
    stale = sensors.get("stale_success_sensor")
    if stale is None:
        return "No stale_success_sensor in the code location."
    skip = stale["skip"]
    match = re.search(r"STALE: (\d+) job scope", skip)
    if match is None:
        return f"stale_success_sensor on {len(planted)} planted stale tenants: {skip[:200]!r}."
    reported = int(match.group(1))
    first = [t for t in planted if int(t.rsplit("-", 1)[1]) <= cap]
    note = (
        f"stale_success_sensor reported {reported} stale job scope(s) for {len(planted)} "
        f"planted stale tenants × {jobs} jobs ({len(planted) * jobs} expected)"
    )
    if reported == len(first) * jobs < len(planted) * jobs:
        note += (
            f": only those of the {len(first)} planted tenant(s) among the first {cap} tenant "
            f"ids ({', '.join(first)}) — a tick reads the first {cap} tenants (ORDER BY id "
            "LIMIT), so the others are never checked"
        )
    return note + "."


def observations_note(sensors: dict[str, Any]) -> str:
    """How many asset events the sensors' ticks hand to the daemon to store."""
    events = {n: s["asset_events"] for n, s in sensors.items() if s["asset_events"]}
    if not events:
        return ""
    return (
        f"{len(events)} sensors return asset events on a tick ({sum(events.values())} in all, "
        f"up to {max(events.values())} each: one observation per tenant checked), which the "
        "daemon then writes to the event log; that write is not part of the evaluation timed."
    )


def main(argv: list[str]) -> int:
    tenants, repeats = int(argv[1]), int(argv[2])
    out = evaluate(tenants, repeats)
    print(json.dumps(out, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
