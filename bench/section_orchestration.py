"""Orchestration at tenant scale: a schedule tick through a real Dagster deployment, run by
chunks of tenants (``Deployment.tenants_per_run``), against the same ``run_job`` calls in one
process; the chunk size; tenant runs starting in the same second when several jobs share a
cron; and, at 10,000 tenants, every schedule's and sensor's tick evaluation and every
PartitionsDefinition's size (``bench/tick_evaluation.py``).

Data: tenants ``tenant-00001`` … of 200 quotes each, 10 of them ACTIVE past expiry (small
work, so the orchestration shows), one disjoint set of tenants per Dagster measurement,
loaded once, VACUUM ANALYZEd and cloned (``CREATE DATABASE … TEMPLATE``) for the deployment
and for each in-process loop, so every measurement starts from the same bytes.

The deployment: dagster-webserver and dagster-daemon on loopback over PostgreSQL storage,
both reaching one code server of its own (``dagster api grpc``, a grpc_server workspace
entry, as the Helm chart's user deployment), with the project's dagster.yaml (QoOpsRunCoordinator: at most 8 runs at once, one per
``qo_ops/scope``; DefaultRunLauncher: one process per run), as qo_ops_tests/dagster/stack.py
starts it (it lets each spawn its own code server). The tenants sensor is stopped before the daemon starts: each measurement sets
the ``tenants`` partitions to exactly its tenants (a tick covers every tenant partition).

(a) A real tick: the schedule is started (GraphQL startSchedule) with its start time set
just before its last cron time, so the daemon's next iteration (at the start of a minute)
evaluates that tick in the code server and submits its chunk runs. The daemon ticks a
schedule once per cron time, so each schedule gets one real tick per deployment: the
headline tick of quote_expiration at the largest size, and the stagger tick. Timed from the
tick's creation (its row in the schedule storage) to the last of its tenants' job_run rows
finishing (one database server: one clock).

(b) The same tick's exact RunRequests: ``quote_expiration_schedule`` evaluated in-process
(``build_schedule_context`` against the deployment's instance and database) — for another
chunk size, the schedule built from the catalog entry with ``tenants_per_run`` replaced —
and each request submitted through GraphQL launchRun with its run config and tags plus
``dagster/schedule_name``, as the daemon submits a tick's runs (create the run, hand it to
the run coordinator's queue). Timed from just before the first submission to the last
job_run row finishing.

(c) ``run_job`` over the same tenants in a loop in one fresh Python process (start and
imports included), on a clone of the same data, once before and once after the deployment's
measurements (the mean counts: the machine is shared). Ratio = loop / tick (goal >= 0.5,
reach 0.8).

Every measurement is verified: every eligible quote expired, one final execute job_run per
tenant (success) written by the measured Dagster runs, every Dagster run succeeded, and
every tenant's partition of the ``quotes`` asset materialized.

Staggered load: a real tick of the jobs sharing ``15 3 * * *`` (one daemon iteration),
counted from job_run.started_at: tenant runs starting per second (max, median), the first
second, and tenants started by two jobs within the same second.

The section's parts: ``orchestration_data`` (the tenants, the check, the one-process loop),
``orchestration_deployment`` (webserver, daemon, code server), ``orchestration_ticks`` (the
ticks measured, the tick evaluation); this module turns the figures into rows.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from bench.common import (
    cloned_database,
    fresh_database,
    stopwatch,
)
from bench.orchestration_data import (
    JOB,
    PREFIX,
    QUOTES_PER_TENANT,
    YEARS_OF_DAYS,
    eligible,
    load,
    loops,
    partition_start,
    tenant_key,
)
from bench.orchestration_deployment import deployment, tail
from bench.orchestration_ticks import (
    STAGGER_CRON,
    real_tick,
    stagger,
    submitted_tick,
    tick_evaluation,
    wait_runs,
)
from bench.suite import Profile, Row, Section, median

TITLE = "Orchestration at tenant scale"
REPLACES = ("Orchestration overhead",)  # its title before issue 19 (BENCHMARKS.md updates)
RATIO_GOAL, RATIO_REACH = 0.5, 0.8
GOAL_TENANTS = 1_000  # the throughput goal's size
TICK_GOAL_S = 10.0
PARTITIONS_GOAL = 100_000


# ------------------------------------------------------------------ the section


def _tick_row(what: str, r: dict[str, Any], loop_s: float, note: str = "") -> Row:
    """A tick beside the loop; the goal is judged at GOAL_TENANTS (the issue's size)."""
    ratio = loop_s / r["tick_s"]
    judged = r["tenants"] >= GOAL_TENANTS
    return Row(
        what=what,
        size=f"{r['tenants']:,} tenants × {QUOTES_PER_TENANT} quotes, {r['dagster_runs']} runs "
        f"of ≤ {r['chunk']}",
        figure=f"{r['tick_s']:.1f} s",
        limit=f"{loop_s:.1f} s (run_job loop, one process)",
        ratio=ratio,
        goal=f">= {RATIO_GOAL} (reach {RATIO_REACH})"
        if judged
        else f"report (goal >= {RATIO_GOAL} at {GOAL_TENANTS:,})",
        met=ratio >= RATIO_GOAL if judged else None,
        note=note,
    )


def run(profile: Profile) -> Section:
    ticks = sorted(profile.orchestration_tenants)
    sizes = sorted(profile.chunk_sizes)
    big = ticks[-1]
    from qo_ops.jobs.catalog import CATALOG

    default = CATALOG[JOB].deployment.tenants_per_run
    # one disjoint tenant set per Dagster measurement; the chunk sizes at the largest tick
    counts = [("tick", n) for n in ticks] + [(f"chunk{s}", big) for s in sizes if s != default]
    sets: dict[str, list[str]] = {}
    k = 1
    for name, n in counts:
        key = f"{name}_{n}" if name == "tick" else name
        sets[key] = [tenant_key(i) for i in range(k, k + n)]
        k += n
    total = k - 1
    load_avg = os.getloadavg()
    started = time.monotonic()
    with fresh_database(f"{PREFIX}_tpl") as template:
        load_s = load(template, total)
        print(
            f"   loaded {total:,} tenants × {QUOTES_PER_TENANT} quotes in {load_s:.0f} s",
            flush=True,
        )
        expected = {name: eligible(template, t) for name, t in sets.items()}
        loop_sets = {f"tick_{n}": sets[f"tick_{n}"] for n in ticks}
        before = loops(template, loop_sets, expected, 0)
        dagster: dict[str, Any] = {}
        with (
            cloned_database(template, f"{PREFIX}_dagster") as url,
            tempfile.TemporaryDirectory(prefix="qo-ops-bench-dagster-") as tmp,
        ):
            home = Path(tmp)
            env = {
                "QO_OPS_PARTITION_START": partition_start().isoformat(),
                "QO_OPS_DOWNSTREAM_URL": "http://127.0.0.1:9",  # no order: never called
            }
            deployed = time.monotonic()
            try:
                with deployment(url, home, env) as d:
                    d.set_tenants(sets[f"tick_{ticks[0]}"][:1])
                    with stopwatch() as warm:  # loads the run worker's imports once
                        warm_id = d.launch(
                            {"mode": "dry_run", "tenants": sets[f"tick_{ticks[0]}"][:2]},
                            {"qo_ops/scope": f"{JOB}:warm-up"},
                        )
                        wait_runs(d, url, [warm_id], 300)
                    dagster["warmup_run_s"] = warm[0]
                    print(f"   deployment up; warm-up run {warm[0]:.1f} s", flush=True)
                    r = real_tick(d, url, sets[f"tick_{big}"], expected[f"tick_{big}"])
                    dagster[f"tick_{big}"] = r
                    print(f"   real tick, {big} tenants: {r['tick_s']:.1f} s", flush=True)
                    for n in ticks[:-1]:
                        r = submitted_tick(
                            d, url, sets[f"tick_{n}"], default, expected[f"tick_{n}"]
                        )
                        dagster[f"tick_{n}"] = r
                        print(f"   tick's requests, {n} tenants: {r['tick_s']:.1f} s", flush=True)
                    for s in sizes:
                        if s == default:
                            continue
                        r = submitted_tick(d, url, sets[f"chunk{s}"], s, expected[f"chunk{s}"])
                        dagster[f"chunk{s}"] = r
                        print(f"   chunks of {s}, {big} tenants: {r['tick_s']:.1f} s", flush=True)
                    stagger_set = [tenant_key(i) for i in range(1, profile.stagger_tenants + 1)]
                    dagster["stagger"] = stagger(d, url, stagger_set)
                    print(
                        f"   stagger tick: {dagster['stagger']['tenant_runs']} tenant runs",
                        flush=True,
                    )
            except Exception:
                traceback.print_exc()
                print(tail(home / "daemon.log"), file=sys.stderr)
                raise
            dagster_s = time.monotonic() - deployed
        after = loops(template, loop_sets, expected, 1)
    with stopwatch() as evaluated:
        evaluation = tick_evaluation(profile.eval_tenants, profile.repeats)
    took = time.monotonic() - started

    loop_s = {n: (before[f"tick_{n}"]["wall_s"] + after[f"tick_{n}"]["wall_s"]) / 2 for n in ticks}
    rows: list[Row] = []
    for n in ticks:
        r = dagster[f"tick_{n}"]
        rows.append(
            _tick_row(
                f"schedule tick through Dagster, {JOB} ({r['how']})",
                r,
                loop_s[n],
                f"{r['dagster_runs']} runs, ≤ 8 at once; {expected[f'tick_{n}']:,} quotes expired",
            )
        )
    chunk_rows = {}
    for s in sizes:
        r = dagster[f"tick_{big}"] if s == default else dagster[f"chunk{s}"]
        chunk_rows[s] = r
        rows.append(
            Row(
                what=f"chunk size {s}: tick over {big:,} tenants ({r['how']})",
                size=f"{r['dagster_runs']} runs",
                figure=f"{r['tick_s']:.1f} s",
                limit=f"{loop_s[big]:.1f} s (run_job loop)",
                ratio=loop_s[big] / r["tick_s"],
                goal="report (the default's evidence)",
                met=None,
                note=f"per run: {r['process_start_s_median']:.1f} s process start, "
                f"{r['worker_s_median']:.1f} s in the worker; {r['queued_s_median']:.1f} s queued",
            )
        )
    best = min(sizes, key=lambda s: chunk_rows[s]["tick_s"])
    slower = {s: chunk_rows[s]["tick_s"] / chunk_rows[best]["tick_s"] - 1 for s in sizes}
    st = dagster["stagger"]
    rows.append(
        Row(
            what=f"staggered load: tenant runs starting in one second ({', '.join(st['jobs'])} at "
            f"one tick of {STAGGER_CRON})",
            size=f"{st['tenants']} tenants × {len(st['jobs'])} jobs, {st['dagster_runs']} runs",
            figure=f"max {st['max_per_second']} / s",
            limit=f"{st['tenant_runs']} tenant runs in the tick",
            ratio=st["max_per_second"] / st["tenant_runs"],
            goal="report",
            met=None,
            note=f"{st['first_second']} in the first second, over {st['spread_s']:.1f} s; "
            f"{st['same_tenant_same_second']} tenant(s) started by two jobs in the same second",
        )
    )
    ev = evaluation
    for kind in ("schedules", "sensors"):
        for name, e in ev[kind].items():
            slowest = max([e["cold_s"], *e["seconds"]])
            rows.append(
                Row(
                    what=f"tick evaluation: {name}",
                    size=f"{ev['tenants']:,} tenants",
                    figure=f"{median(e['seconds']):.2f} s (cold {e['cold_s']:.2f} s)",
                    limit=f"{TICK_GOAL_S:.0f} s",
                    ratio=slowest / TICK_GOAL_S,
                    goal=f"< {TICK_GOAL_S:.0f} s",
                    met=slowest < TICK_GOAL_S,
                    note=e["outcome"],
                )
            )
    for name, p in ev["partitions"].items():
        rows.append(
            Row(
                what=f"partitions: {name}",
                size=f"{ev['tenants']:,} tenants × {YEARS_OF_DAYS} years",
                figure=f"{p['keys']:,} keys",
                limit=f"{PARTITIONS_GOAL:,}",
                ratio=p["keys"] / PARTITIONS_GOAL,
                goal=f"<= {PARTITIONS_GOAL:,}",
                met=p["keys"] <= PARTITIONS_GOAL,
                note=f"listed in {p['list_s'] * 1000:.0f} ms; used by {p['used_by']}",
            )
        )

    t_big = dagster[f"tick_{big}"]
    notes = [
        f"Throughput: {total:,} tenants × {QUOTES_PER_TENANT} quotes (10 a tenant ACTIVE past "
        f"expiry) loaded in {load_s:.0f} s; each Dagster measurement on its own tenants of one "
        "clone (the tenants partitions set to exactly them), each run_job loop on a fresh clone.",
        f"(a) The {big:,}-tenant tick is the daemon's own: {JOB}_schedule started with its start "
        "time set just before its last cron time; the daemon's next iteration evaluated it in "
        f"the code server and submitted {t_big['dagster_runs']} runs "
        f"({t_big['submit_s']:.1f} s from the tick's creation to its end); timed from the "
        "tick's creation to the last tenant's job_run finishing. The daemon ticks a schedule "
        "once per cron time, so the other figures are (b): the same schedule function's exact "
        "RunRequests (evaluated in-process against the deployment's instance and database; "
        "for another chunk size with tenants_per_run replaced), submitted through GraphQL "
        "launchRun with dagster/schedule_name, timed from the first submission.",
        f"Per run at {big:,} tenants (median): {t_big['queued_s_median']:.1f} s queued, "
        f"{t_big['process_start_s_median']:.1f} s from launch to RUN_START (a new process), "
        f"{t_big['worker_s_median']:.1f} s in the run worker; per tenant "
        f"{t_big['run_job_ms_median']:.0f} ms in run_job and "
        f"{t_big['op_overhead_ms_per_tenant']:.0f} ms around it in the op; Dagster event-log "
        "entries per tenant: "
        + ", ".join(f"{v:.1f} {k}" for k, v in t_big["events_per_tenant"].items())
        + " (runner lines: the runner's qo_ops.events JSON lines, forwarded into the event log "
        "by dagster.yaml's managed_python_loggers, written while run_job runs; in a chunk only "
        "its warnings, e.g. job.scheduler.drift.detected when the tick is run over 5 min after "
        "its cron time). The Dagster storage database meanwhile, per tenant (every process of "
        f"the deployment): {t_big['storage_sessions_per_tenant']:.1f} connections opened, "
        f"{t_big['storage_commits_per_tenant']:.0f} transactions committed (the event log "
        "keeps its connections pooled: qo_ops/dagster_defs/storage.py). At "
        f"{ticks[0]:,} tenants ({dagster[f'tick_{ticks[0]}']['dagster_runs']} runs, the "
        f"machine less contended): {dagster[f'tick_{ticks[0]}']['run_job_ms_median']:.0f} ms "
        f"in run_job, {dagster[f'tick_{ticks[0]}']['op_overhead_ms_per_tenant']:.0f} ms around "
        f"it. A single run alone (warm-up, dry run of 2 tenants): {dagster['warmup_run_s']:.1f} s.",
        "(c) run_job over the same tenants in one fresh process, wall time with start-up: "
        + "; ".join(
            f"{n:,} tenants {before[f'tick_{n}']['wall_s']:.1f} s before and "
            f"{after[f'tick_{n}']['wall_s']:.1f} s after the Dagster measurements"
            for n in ticks
        )
        + " (the mean is the limit).",
        f"Chunk size at {big:,} tenants: "
        + ", ".join(
            f"{s}: {chunk_rows[s]['tick_s']:.1f} s ({chunk_rows[s]['dagster_runs']} runs)"
            for s in sizes
        )
        + f". Fastest here: {best}; "
        + ", ".join(f"{s} {100 * slower[s]:.0f} % slower" for s in sizes if s != best)
        + ". Smaller chunks pay a process start (a new interpreter loading the code location) "
        "per few tenants; larger ones leave run slots idle once fewer runs than the 8 the queue "
        "allows are left, and make a chunk's re-run, its pod and its logs bigger.",
        "What bounds the ratio here: the run workers' time per tenant, summed over the runs and "
        f"divided by the 8 that run at once, is {t_big['worker_s_total'] / big / 8 * 1000:.0f} ms "
        f"at {big:,} tenants against {loop_s[big] / big * 1000:.0f} ms per tenant for the whole "
        "loop; inside a run each tenant writes the event-log entries above (each asset event "
        "and forwarded log line is its own INSERT in the event log, over a pooled connection) "
        "on 2 cores shared by 8 run processes and PostgreSQL.",
        "Verified for every Dagster measurement: every run SUCCESS, one success execute "
        "job_run per tenant written by the measured runs, every eligible quote expired, every "
        "tenant's partition of qo_ops/quotes materialized.",
        f"Staggered load: a real tick of {', '.join(st['jobs'])} (their schedules started "
        f"together, one daemon iteration) over {st['tenants']} tenants: "
        f"{st['tenant_runs']} tenant runs ({st['statuses']}) in {st['dagster_runs']} Dagster "
        f"runs; starts per second from job_run.started_at: {st['per_second'][:40]}"
        + (" …" if len(st["per_second"]) > 40 else "")
        + f". Chunks run their tenants one after another, at most 8 runs at once, and each "
        "job starts its chunks at a different offset (crc32 of its name), so a tenant is "
        f"rarely hit by two jobs at once ({st['same_tenant_same_second']} tenant-seconds). "
        "The jobs found no work (the tenants hold only quotes): the figure is the tick's "
        "shape, each tenant run a lease, a job_run row and the outcome checks.",
        f"Tick evaluation at {ev['tenants']:,} tenants: every schedule and sensor of the code "
        "location (build_schedule_context / build_sensor_context, in one process as a code "
        "server, after the first 'cold' one, median of the rest) against a Dagster instance on "
        f"PostgreSQL holding {ev['tenants']:,} tenant partitions and a database of "
        f"{ev['tenants']:,} tenants with {ev['rows']['job_run']:,} job_run rows (each job's "
        f"runs at its cadence; loaded in {ev['load_s']:.0f} s), "
        f"{ev['rows']['quote']:,} quotes, {ev['rows']['outbox_event']:,} outbox events, "
        f"{ev['rows']['delivery_attempt_item']:,} delivery items, "
        f"{ev['planted']['busy']} running quote_expiration leases, and "
        f"{len(ev['planted']['stale'])} tenants per job without a success for 4 cadences "
        f"({', '.join(ev['planted']['stale'][:4])} …). QO_OPS_PARTITION_START "
        f"{ev['partition_start']} ({YEARS_OF_DAYS} years of days).",
        "Schedules verified: their runs together cover every tenant but the busy ones "
        "(quote_expiration) exactly once, no run over its job's tenants_per_run. "
        + ev["stale_note"]
        + " "
        + ev["observations_note"],
        f"Partition counts: every PartitionsDefinition of the code location's jobs, assets and "
        f"checks with {ev['tenants']:,} tenants and days from {ev['partition_start']} to today; "
        f"the old tenant × day definition would hold {ev['tenants'] * ev['days']:,} keys.",
        f"Load average (1 min) at the start / end: {load_avg[0]:.1f} / {os.getloadavg()[0]:.1f} "
        f"on {os.cpu_count()} cores (the machine is shared). Section time: "
        f"{dagster_s / 60:.1f} min with the deployment up, {evaluated[0] / 60:.1f} min for the "
        f"{ev['tenants']:,}-tenant part, {took / 60:.1f} min in all.",
    ]
    raw = {
        "sets": {k: len(v) for k, v in sets.items()},
        "loops_before": before,
        "loops_after": after,
        "dagster": dagster,
        "evaluation": evaluation,
        "recommended_chunk": best,
    }
    return Section(TITLE, rows, notes, raw)
