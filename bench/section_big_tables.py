"""Sensors and exporter on big tables: one tick of every qo-ops sensor that reads the
database, and one exporter scrape, with ``profile.big_rows`` rows in the largest tables.

Data: 100 demo tenants (small: 20 quotes each, for the tables no job grows), then
``big_rows`` rows spread set-based (``generate_series``) over the largest tables — quote 40 %,
outbox_event 25 %, delivery_attempt_item 20 %, job_run 15 % — tenants interleaved, with a
realistic distribution: mostly finished or inactive rows and a small eligible backlog (1 %
of quotes ACTIVE past expiry, 1 % of delivery items due, 1 % of events unpublished and due,
a few dead letters; job_run: every job's runs at its cadence for every tenant, back from
now as far as its share allows, ~90 % success, 5 % dry runs). Ten windowed
runs are ``running`` with a checkpoint (half of them stale), and 60 days of checkpoints per
tenant of the checkpointed jobs lie beside them. Then VACUUM ANALYZE.

Measured (median of ``profile.repeats``, after one untimed warm-up evaluation, since the
daemon evaluates ticks in a long-lived code server whose engine is pooled):

- each sensor's tick, in-process with ``dg.build_sensor_context`` against an ephemeral
  instance holding the ``tenants`` partitions (as qo_ops_tests/dagster/test_sensors.py does);
- the exporter: ``JobCollector.collect()`` (the scrape) after ``refresh_slow()`` (the
  background refresh), timed separately; and the first scrape of a fresh collector, which
  reads every retained job_run row once for its counters.

Verified: the backlog sensors' per-tenant figures equal the counts in the database, the
stale-success sensor's count of stale scopes equals one computed by a grouped pass (before
and after its ticks: staleness grows while the bench runs), the exporter's
``job_started_total`` equals the job_run rows and its quote_expiration backlog the eligible
quotes, and the checkpoint-age sensor names the stale checkpoints.
"""

from __future__ import annotations

import json
import re
import uuid
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import URL

from bench.common import engine_for, env_url, fresh_database, settle, stopwatch
from bench.suite import Profile, Row, Section, Spread, median
from qo_ops.jobs.quote_expiration import SPEC as QUOTE_SPEC
from qo_ops.platform.job.outcome import BatchContext
from qo_ops.platform.job.scope import Scope
from qo_ops.platform.run.selection import count_eligible

TITLE = "Sensors and exporter on big tables"
PREFIX = "qo_ops_bench_big"
TENANTS = 100
GOAL_S = 1.0
SCRAPE_TIMEOUT_S = 10.0  # Prometheus' default scrape_timeout
SHARES = {"quote": 0.40, "outbox_event": 0.25, "delivery_attempt_item": 0.20, "job_run": 0.15}
RUNNING = 10  # running windowed runs with a checkpoint; the first half stale (2 h old)

TENANT_OF = "('tenant-' || lpad((1 + g % :t)::text, 3, '0'))"
K = "(g / :t)"  # the row's index within its tenant

BULK = {
    "quote": f"""
        INSERT INTO quote (id, tenant_id, quote_number, customer_ref, status, currency,
                           total_amount, price_book_version, created_at, updated_at, expires_at)
        SELECT :base + g, {TENANT_OF}, 'B-' || g, 'c-' || (g % 997),
               CASE WHEN {K} % 100 < 20 THEN 'ACTIVE' WHEN {K} % 100 < 60 THEN 'EXPIRED'
                    WHEN {K} % 100 < 85 THEN 'ACCEPTED' WHEN {K} % 100 < 95 THEN 'CANCELLED'
                    ELSE 'DRAFT' END,
               'EUR', (g % 100000) / 100.0, 2, c.at, c.at,
               CASE WHEN {K} % 100 = 0 THEN now() - make_interval(mins => 1 + (g % 600)::int)
                    WHEN {K} % 100 < 20 THEN now() + interval '1 day' + make_interval(mins => (g % 43200)::int)
                    ELSE c.at + interval '30 days' END
          FROM generate_series(1, :n) AS g,
               LATERAL (SELECT now() - make_interval(days => (g % 365)::int,
                                                     mins => (g % 1440)::int) AS at) c
    """,
    "delivery_attempt_item": f"""
        INSERT INTO delivery_attempt_item (id, tenant_id, business_key, status, attempt_count,
            max_attempts, next_attempt_at, last_error_code, payload, created_at, updated_at)
        SELECT lpad(to_hex(g), 32, '0')::uuid, {TENANT_OF}, 'bulk:' || g,
               CASE WHEN {K} % 200 < 4 THEN 'READY' WHEN {K} % 200 = 4 THEN 'DEAD_LETTER'
                    ELSE 'DELIVERED' END,
               CASE WHEN {K} % 200 = 4 THEN 8 ELSE 1 END, 8,
               CASE WHEN {K} % 200 < 2 THEN now() - make_interval(mins => 1 + (g % 120)::int)
                    WHEN {K} % 200 < 4 THEN now() + interval '1 day' + make_interval(mins => (g % 60)::int)
                    ELSE c.at END,
               CASE WHEN {K} % 200 = 4 THEN 'DOWNSTREAM_REJECTED' END,
               jsonb_build_object('kind', 'fulfilment_request', 'n', g), c.at, c.at
          FROM generate_series(1, :n) AS g,
               LATERAL (SELECT now() - make_interval(days => (g % 90)::int,
                                                     mins => (g % 1440)::int) AS at) c
    """,
    "outbox_event": f"""
        INSERT INTO outbox_event (id, business_key, tenant_id, aggregate_type, aggregate_id,
                                  event_type, payload, created_at, available_at, published_at,
                                  publish_attempts, dead_lettered_at)
        SELECT lpad(to_hex(g), 32, '0')::uuid, 'bulk:' || g, {TENANT_OF}, 'order', g::text,
               'OrderSubmitted', jsonb_build_object('n', g), c.at,
               CASE WHEN {K} % 1000 < 10 THEN now() - make_interval(mins => 1 + (g % 90)::int)
                    WHEN {K} % 1000 < 14 THEN now() + interval '1 day' + make_interval(mins => (g % 1440)::int)
                    ELSE c.at END,
               CASE WHEN {K} % 1000 >= 15 THEN c.at + interval '1 minute' END,
               CASE WHEN {K} % 1000 >= 15 THEN 1 WHEN {K} % 1000 = 14 THEN 10 ELSE 0 END,
               CASE WHEN {K} % 1000 = 14 THEN c.at + interval '1 hour' END
          FROM generate_series(1, :n) AS g,
               LATERAL (SELECT now() - make_interval(days => (g % 90)::int,
                                                     mins => (g % 1440)::int) AS at) c
    """,
    # each job's runs at its cadence, for every tenant, going back from now as far as the
    # share allows (the k-th run back of job g % j for tenant (g / j) % t, j jobs), oldest first;
    # ~90 % success, 5 % dry runs
    "job_run": """
        INSERT INTO job_run (id, job_name, scope, window_start, window_end, mode, trigger_type,
                             requester, owner_id, created_at, started_at, heartbeat_at,
                             finished_at, status, status_reason, eligible_count,
                             processed_count, succeeded_count, failed_count, last_error_code)
        SELECT lpad(to_hex(g), 32, '0')::uuid, j.name,
               CASE WHEN j.windowed THEN x.tenant || '/' || x.day || '..' || (x.day + 1)
                    ELSE x.tenant END,
               CASE WHEN j.windowed THEN x.day END, CASE WHEN j.windowed THEN x.day + 1 END,
               CASE WHEN h.m < 5 THEN 'dry_run' ELSE 'execute' END, 'schedule',
               'dagster:schedule', 'bench', x.at, x.at, x.at + x.took, x.at + x.took,
               s.status, CASE WHEN s.status = 'skipped' THEN 'lease_held' END,
               g % 50, g % 50, CASE WHEN s.status = 'success' THEN g % 50 ELSE 0 END,
               CASE WHEN s.status = 'failed' THEN 1 ELSE 0 END,
               CASE WHEN s.status IN ('failed', 'timeout') THEN 'downstream_unavailable' END
          FROM generate_series(1, :n) AS g
          CROSS JOIN LATERAL (SELECT (CAST(:names AS text[]))[1 + g % :j] AS name,
                                     (CAST(:windowed AS boolean[]))[1 + g % :j] AS windowed,
                                     (CAST(:cadence AS int[]))[1 + g % :j] AS cadence) j
          CROSS JOIN LATERAL (SELECT (hashint8(g::bigint) & 2147483647) % 100 AS s,
                                     (hashint8(g::bigint + 7) & 2147483647) % 100 AS m) h
          CROSS JOIN LATERAL (
              SELECT 'tenant-' || lpad((1 + (g / :j) % :t)::text, 3, '0') AS tenant,
                     now() - make_interval(secs => 30 + ((:n - g) / (:j * :t)) * j.cadence
                                                  + g % 30) AS at,
                     make_interval(secs => 1 + g % 120) AS took
          ) x0
          CROSS JOIN LATERAL (SELECT x0.*, x0.at::date - 1 AS day) x
          CROSS JOIN LATERAL (SELECT CASE WHEN h.s < 90 THEN 'success'
                                          WHEN h.s < 96 THEN 'no_work'
                                          WHEN h.s < 98 THEN 'failed'
                                          WHEN h.s < 99 THEN 'skipped'
                                          ELSE 'timeout' END AS status) s
    """,
}

CHECKPOINTS = """
    INSERT INTO job_checkpoint (job_name, scope, cursor, updated_at)
    SELECT j, 'tenant-' || lpad(t::text, 3, '0') || '/' || d || '..' || (d + 1),
           '{"done": true}'::jsonb, d + interval '1 day 2 hours'
      FROM unnest(CAST(:jobs AS text[])) AS j, generate_series(1, :t) AS t,
           LATERAL (SELECT current_date - generate_series(2, 61) AS d) days
"""
RUNNING_SQL = """
    WITH r AS (
        SELECT gen_random_uuid() AS id, :job AS job_name,
               'tenant-' || lpad(t::text, 3, '0') || '/' || (current_date - 1) || '..'
                 || current_date AS scope,
               t <= :stale AS stale
          FROM generate_series(1, :running) AS t
    ), runs AS (
        INSERT INTO job_run (id, job_name, scope, window_start, window_end, mode, trigger_type,
                             owner_id, created_at, started_at, heartbeat_at, status)
        SELECT id, job_name, scope, current_date - 1, current_date, 'execute', 'schedule',
               'bench', now() - interval '3 hours', now() - interval '3 hours', now(), 'running'
          FROM r
    ), leases AS (
        INSERT INTO job_lease (job_name, scope, owner_id, lease_token, fencing_token,
                               acquired_at, heartbeat_at, expires_at, job_run_id)
        SELECT job_name, scope, 'bench', md5(scope), 1, now() - interval '3 hours', now(),
               now() + interval '10 minutes', id
          FROM r
    )
    INSERT INTO job_checkpoint (job_name, scope, cursor, updated_at, job_run_id)
    SELECT job_name, scope, '{"position": 1}'::jsonb,
           CASE WHEN stale THEN now() - interval '2 hours' ELSE now() - interval '1 minute' END,
           id
      FROM r
"""

FIRST_TICKS = """
    INSERT INTO job_schedule_tick (job_name, scheduled_for, decision)
    SELECT name, date_trunc('minute', now()) - interval '30 days', 'evaluated'
      FROM unnest(CAST(:names AS text[])) AS name
"""


_INT = re.compile(r":(n|t|j|running|stale)\b")


def _typed(sql: str) -> str:
    """Cast integer binds (the driver sends small ints as smallint)."""
    return _INT.sub(r"CAST(:\1 AS int)", sql).replace(":base", "CAST(:base AS bigint)")


def _load(url: URL, rows: int) -> dict[str, int]:
    from qo_ops.demo.data import _bulk_load, load_demo_data
    from qo_ops.jobs.catalog import CATALOG
    from qo_ops.platform.schedule.cron import cadence_seconds

    engine = engine_for(url)
    load_demo_data(
        engine, tenants=TENANTS, quotes=20, seed=3, as_of=datetime.now(UTC).replace(microsecond=0)
    )
    specs = list(CATALOG.values())
    sizes = {table: max(TENANTS, int(rows * share)) for table, share in SHARES.items()}
    checkpointed = [s.name for s in specs if s.batching.checkpoint is not None]
    with engine.begin() as conn:
        conn.exec_driver_sql("SET LOCAL synchronous_commit = off")
        conn.exec_driver_sql("SET LOCAL work_mem = '256MB'")
        base = conn.scalar(sa.text("SELECT coalesce(max(id), 0) FROM quote"))
        with _bulk_load(conn, list(BULK)):
            for table, sql in BULK.items():
                conn.execute(
                    sa.text(_typed(sql)),
                    {
                        "n": sizes[table],
                        "t": TENANTS,
                        "j": len(specs),
                        "base": base,
                        "names": [s.name for s in specs],
                        "windowed": [s.partitioning == "tenant_day" for s in specs],
                        "cadence": [
                            int(cadence_seconds(s.deployment.cron_schedule)) for s in specs
                        ],
                    },
                )
        conn.execute(
            sa.text("SELECT setval(pg_get_serial_sequence('quote', 'id'), max(id)) FROM quote")
        )
        conn.execute(sa.text(_typed(CHECKPOINTS)), {"jobs": checkpointed, "t": TENANTS})
        conn.execute(
            sa.text(_typed(RUNNING_SQL)),
            {"job": checkpointed[0], "running": RUNNING, "stale": RUNNING // 2},
        )
        # every schedule has been on for 30 days (its first tick): each job has been at work
        # long enough for its tenants to be judged stale (freshness.job_due)
        conn.execute(sa.text(FIRST_TICKS), {"names": [s.name for s in specs]})
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql("VACUUM ANALYZE")
        counts = {
            t: int(conn.scalar(sa.text(f"SELECT count(*) FROM {t}")) or 0)
            for t in (*SHARES, "job_checkpoint")
        }
    engine.dispose()
    return counts


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"


def _timed(times: int, fn: Any) -> tuple[list[float], Any]:
    """One untimed warm-up call, then ``times`` timed calls: (seconds, last result)."""
    result = fn()
    out = []
    for _ in range(times):
        with stopwatch() as t:
            result = fn()
        out.append(t[0])
    return out, result


def _sensors(url: URL, repeats: int) -> dict[str, dict[str, Any]]:
    import dagster as dg

    from qo_ops.dagster_defs.jobs import build_job
    from qo_ops.dagster_defs.resources import QoOpsDatabase
    from qo_ops.dagster_defs.sensors import (
        build_backlog_sensor,
        build_checkpoint_age_sensor,
        build_stale_success_sensor,
        tenants_sensor,
    )
    from qo_ops.jobs.catalog import CATALOG

    specs = list(CATALOG.values())
    jobs = {s.name: build_job(s) for s in specs}
    sensors = [
        tenants_sensor,
        *(build_backlog_sensor(s, jobs[s.name]) for s in specs if s.deployment.backlog_threshold),
        build_stale_success_sensor(specs),
        build_checkpoint_age_sensor(specs),
    ]
    database = QoOpsDatabase(url=env_url(url))
    defs = dg.Definitions(
        jobs=list(jobs.values()), sensors=sensors, resources={"database": database}
    )
    tenants = [f"tenant-{t:03d}" for t in range(1, TENANTS + 1)]
    results: dict[str, dict[str, Any]] = {}
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("tenants", tenants)
        for sensor in sensors:

            def tick(sensor: Any = sensor) -> Any:
                context = dg.build_sensor_context(
                    instance=instance, resources={"database": database}, definitions=defs
                )
                return sensor.evaluate_tick(context)

            first: list[float] = []
            with stopwatch() as cold:
                tick()
            first.append(cold[0])
            seconds, result = _timed(repeats, tick)
            results[sensor.name] = {
                "seconds": seconds,
                "cold_s": first[0],
                # a stale-success tick that asks for a marking run says it in the run's tag
                "skip": result.skip_message
                or next(
                    (
                        r.tags["qo_ops/stale"]
                        for r in result.run_requests or []
                        if "qo_ops/stale" in r.tags
                    ),
                    None,
                ),
                "cursor": result.cursor,
                "run_requests": len(result.run_requests or []),
            }
    return results


def _exporter(url: URL, repeats: int) -> dict[str, Any]:
    from qo_ops.jobs.catalog import CATALOG
    from qo_ops.metrics.exporter import JobCollector

    engine = sa.create_engine(url, pool_pre_ping=True)
    specs = list(CATALOG.values())
    first, refresh, scrape = [], [], []
    families: dict[str, Any] = {}
    for _ in range(repeats):
        collector = JobCollector(engine, specs)
        with stopwatch() as t:
            list(collector.collect())
        first.append(t[0])
        with stopwatch() as t:
            collector.refresh_slow()
        refresh.append(t[0])
        list(collector.collect())  # warm
        for _ in range(3):
            with stopwatch() as t:
                families = {f.name: f for f in collector.collect()}
            scrape.append(t[0])
    engine.dispose()
    started = sum(s.value for s in families["job_started"].samples if s.name.endswith("_total"))
    backlog = {s.labels["job_name"]: s.value for s in families["job_backlog_items"].samples}
    return {
        "first_scrape_s": first,
        "refresh_slow_s": refresh,
        "scrape_s": scrape,
        "started_total": started,
        "backlog": backlog,
    }


def _expected(url: URL) -> dict[str, Any]:
    engine = engine_for(url)
    with engine.connect() as conn:
        # the backlog the sensor counts: the job's own selection, each tenant's counted whole
        per_tenant: dict[str, int] = {}
        for tenant in conn.execute(sa.text("SELECT id FROM tenant")).scalars():
            ctx = BatchContext(QUOTE_SPEC.name, Scope(tenant), "dry_run", uuid.uuid4())
            if n := count_eligible(conn, QUOTE_SPEC, ctx):
                per_tenant[tenant] = n
        runs = conn.scalar(sa.text("SELECT count(*) FROM job_run"))
    engine.dispose()
    return {"quote_backlog": per_tenant, "job_runs": int(runs or 0), "stale": _stale(url)}


def _stale(url: URL) -> int:
    """Job scopes without a success (or a run ending in a status the job counts as fresh)
    for 3× their cadence, of the jobs at work that long, by one grouped pass per job (the
    stale-success sensor's answer, computed another way)."""
    from qo_ops.dagster_defs.freshness import job_due
    from qo_ops.dagster_defs.sensors import STALE_FACTOR
    from qo_ops.jobs.catalog import CATALOG
    from qo_ops.platform.schedule.cron import cadence_seconds

    engine = engine_for(url)
    stale = 0
    with engine.connect() as conn:
        tenants = list(conn.execute(sa.text("SELECT id FROM tenant")).scalars())
        for spec in CATALOG.values():
            if not job_due(conn, spec):
                continue
            limit_s = STALE_FACTOR * cadence_seconds(spec.deployment.cron_schedule)
            ages: dict[str, Any] = dict(
                conn.execute(
                    sa.text(
                        "SELECT split_part(scope, '/', 1), "
                        "extract(epoch FROM clock_timestamp() - max(finished_at)) FROM job_run "
                        "WHERE job_name = :job AND mode = 'execute' "
                        "AND status = ANY(:fresh) GROUP BY 1"
                    ),
                    {"job": spec.name, "fresh": list(spec.fresh_statuses)},
                ).all()
            )
            stale += len([t for t in tenants if ages.get(t) is None or ages[t] > limit_s])
    engine.dispose()
    return stale


def _explain(url: URL, sql: str, params: dict[str, Any]) -> str:
    engine = engine_for(url)
    with engine.connect() as conn:
        plan = conn.execute(sa.text("EXPLAIN (ANALYZE, BUFFERS) " + sql), params).scalars().all()
    engine.dispose()
    return "\n".join(plan)


def run(profile: Profile) -> Section:
    with fresh_database(f"{PREFIX}_{profile.name}") as url:
        with stopwatch() as load_t:
            counts = _load(url, profile.big_rows)
        settle(url)
        expected = _expected(url)
        sensors = _sensors(url, profile.repeats)
        stale_after = _stale(url)  # staleness only grows while the bench runs
        exporter = _exporter(url, profile.repeats)

    # verify: the work measured is the work wanted
    qe = json.loads(sensors["quote_expiration_backlog_sensor"]["cursor"])["last"]
    want = {t: min(n, 1000) for t, n in expected["quote_backlog"].items()}
    got = {t: n for t, n in qe.items() if n}
    assert got == want, f"backlog sensor figures differ from the database: {got} != {want}"
    assert exporter["started_total"] == expected["job_runs"], "exporter did not count every run"
    assert exporter["backlog"]["quote_expiration"] == sum(
        min(n, 10_000) for n in expected["quote_backlog"].values()
    ), "exporter backlog differs from the database"
    message = sensors["stale_success_sensor"]["skip"] or ""
    got_stale = int(message.split()[1]) if message.startswith("STALE:") else 0
    assert expected["stale"] <= got_stale <= stale_after, (
        f"stale-success sensor: {got_stale} stale scopes, expected "
        f"{expected['stale']}..{stale_after} (the sensor said: {message[:300]})"
    )
    stale = sensors["checkpoint_age_sensor"]["skip"] or ""
    assert stale.startswith("STALE CHECKPOINT") and stale.count(" min old") == RUNNING // 2, (
        f"checkpoint-age sensor did not name the {RUNNING // 2} stale checkpoints: {stale}"
    )

    total = sum(counts[t] for t in SHARES)
    size = f"{total:,} rows"
    rows: list[Row] = []
    tick = {name: median(r["seconds"]) for name, r in sensors.items()}
    backlog = sorted((n for n in tick if n.endswith("_backlog_sensor")), key=lambda n: -tick[n])
    for name in ["tenants_sensor", backlog[0], "stale_success_sensor", "checkpoint_age_sensor"]:
        s = tick[name]
        rows.append(
            Row(
                what=f"sensor tick: {name}"
                + (f" (slowest of {len(backlog)} backlog sensors)" if name == backlog[0] else ""),
                size=size,
                figure=Spread.of(sensors[name]["seconds"]).show(_ms),
                limit=f"{GOAL_S:.0f} s",
                ratio=s / GOAL_S,
                goal="< 1 s",
                met=s < GOAL_S,
                note=f"cold {sensors[name]['cold_s'] * 1000:.0f} ms",
            )
        )
    scrape = median(exporter["scrape_s"])
    first = median(exporter["first_scrape_s"])
    refresh = median(exporter["refresh_slow_s"])
    rows += [
        Row(
            what="exporter scrape: JobCollector.collect()",
            size=size,
            figure=Spread.of(exporter["scrape_s"]).show(_ms),
            limit=f"{GOAL_S:.0f} s",
            ratio=scrape / GOAL_S,
            goal="< 1 s",
            met=scrape < GOAL_S,
        ),
        Row(
            what="exporter first scrape (run-record feed reads every job_run row)",
            size=f"{counts['job_run']:,} job_run rows",
            figure=Spread.of(exporter["first_scrape_s"]).show(lambda v: f"{v:.2f} s"),
            limit=f"{SCRAPE_TIMEOUT_S:.0f} s (Prometheus scrape_timeout)",
            ratio=first / SCRAPE_TIMEOUT_S,
            goal="< 10 s",
            met=first < SCRAPE_TIMEOUT_S,
        ),
        Row(
            what="exporter refresh_slow() (background, every 30 s)",
            size=f"{TENANTS} tenants × 5 tenant jobs",
            figure=Spread.of(exporter["refresh_slow_s"]).show(lambda v: f"{v:.2f} s"),
            limit="30 s (refresh interval)",
            ratio=refresh / 30.0,
            goal="report",
            met=None,
        ),
    ]
    notes = [
        f"Rows: {', '.join(f'{t} {n:,}' for t, n in counts.items())}; {TENANTS} tenants; "
        f"loaded and VACUUM ANALYZEd in {load_t[0]:.0f} s.",
        f"Eligible backlog: {sum(expected['quote_backlog'].values()):,} quotes past expiry; "
        "1 % of delivery items due, 1 % of events unpublished and due.",
        "Sensor ticks are evaluated in-process (build_sensor_context, ephemeral instance); "
        "each figure is a median after one untimed warm-up (the daemon's code server keeps "
        "its engine pooled); 'cold' is the warm-up. Backlog sensors (one bounded count per "
        "tenant): "
        + ", ".join(f"{n.removesuffix('_backlog_sensor')} {tick[n] * 1000:.0f} ms" for n in backlog)
        + ".",
        "Before this benchmark, stale_success_sensor joined every tenant to every run of a job "
        "(an OR/LIKE join: 3.9 s per tick at 2,000,000 rows) and the exporter's first scrape "
        "fetched every job_run row into Python (13.4 s for 300,000 runs). Now the sensor reads "
        "only the last 3 cadences of runs (a range of ix_job_run_job_finished) and looks up the "
        "last success of the rare tenants without one; the exporter sums the runs per job and "
        "status in the database.",
        f"Exporter scrape: median of {len(exporter['scrape_s'])} scrapes after refresh_slow; "
        f"first scrape: a fresh collector, median of {profile.repeats}.",
    ]
    slow = [r for r in rows if r.met is False]
    raw = {"counts": counts, "sensors": sensors, "exporter": exporter, "load_s": load_t[0]}
    if slow:
        notes.append("Over the goal: " + ", ".join(r.what for r in slow))
    return Section(TITLE, rows, notes, raw)
