"""Soak: a real deployment with every schedule and sensor on, asked for more runs than it can
start, with the downstream stopped for the middle third.

The deployment is the orchestration section's (a code server, dagster-webserver and
dagster-daemon on loopback over PostgreSQL storage, the project's dagster.yaml: at most 8
runs at once, one process per run), loading ``bench.soak_location``: the catalog with every
job's cron every minute and ``soak_tenants_per_run`` tenants per run (``bench/soak_catalog.py``),
so that each minute asks for more runs than a 2-core machine starts. Demo data
(``qo-ops demo-data``, anomalies included) for ``soak_tenants`` tenants, a local downstream
simulator seeded from it, ``qo-ops metrics`` over the same accelerated catalog, and a real
Prometheus scraping it every 5 s with ``ops/prometheus/alerts.yml`` loaded. Every schedule
and every sensor is started (GraphQL), then for ``soak_s`` seconds the section samples, every
10 s, Dagster's run storage (runs queued, the oldest queued run's age, runs queued or
running per job and scope) and Prometheus's alerts (pending and firing). The simulator is
killed at one third and started again on its URL at two thirds.

What it reports, per phase (before, during and after the outage): the deepest run queue,
runs started per minute, and tick-to-start delay (a schedule run from its tick's scheduled
time, a sensor run from its creation, to the run's start); missed runs by reason (the
exporter's ``job_missed_runs_total`` at the end); every alert that went pending or firing.

It passes only if
- the queue stays bounded: never more runs queued than the coalescing bound (one run per
  job and chunk of tenants: a tick never asks again for a scope that has a run waiting or
  running), and no job and scope ever had two runs queued or running at once;
- every alert is the right one: each one that went pending or firing (counted from
  Prometheus's first good scrape of the exporter) is explained by what the soak did or by
  what the database shows its runs met (see ``judge``): misses as previous_run_queued or
  queued only for a job whose runs the samples saw waiting in the queue, scheduler drift
  only for a job whose tenant runs started over 60 s after their tick (p90 of
  ``job_run.started_at - scheduled_for``, as the exporter counts it), retry
  pressure or item failures only for a job whose runs retried or failed items (the demo's
  poison items and faults), the downstream's alerts only once it was stopped. ``daemon_down``
  misses, ``QoOpsExporterDown`` and an alert nothing explains are wrong.
The queue's alert and what the queue explains: ``bench/soak_judge.py``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from bench.common import REPO, engine_for, env_url, fresh_database, percentile, stop_group
from bench.orchestration_data import partition_start
from bench.orchestration_deployment import (
    LOCATION,
    REPOSITORY,
    Deployment,
    deployment,
    free_port,
    tail,
    wait_for,
)
from bench.soak_catalog import CRON, PER_RUN_ENV
from bench.soak_judge import QUEUE_RULE, Facts, Timeline, facts, judge
from bench.suite import Profile, Row, Section, Spread, median

TITLE = "Soak: every schedule and sensor under backlog"
PREFIX = "qo_ops_bench_soak"
QUOTES_PER_TENANT = 200
SAMPLE_S = 10.0
SCRAPE_S = 5
PHASES = ("before", "outage", "after")

REPOSITORY_STATE = """
query($r: RepositorySelector!) { repositoryOrError(repositorySelector: $r) { __typename
  ... on Repository { schedules { name } sensors { name } } } }
"""
START_SCHEDULE = """
mutation($s: ScheduleSelector!) { startSchedule(scheduleSelector: $s) { __typename
  ... on PythonError { message } } }
"""
START_SENSOR = """
mutation($s: SensorSelector!) { startSensor(sensorSelector: $s) { __typename
  ... on PythonError { message } } }
"""


def start_everything(d: Deployment) -> tuple[list[str], list[str]]:
    """Start every schedule and every sensor of the code location (those already running,
    such as run_queue_sensor, answer an error that says so: left as they are)."""
    repo = {"repositoryLocationName": LOCATION, "repositoryName": REPOSITORY}
    found = d.graphql(REPOSITORY_STATE, {"r": repo})["repositoryOrError"]
    schedules = [s["name"] for s in found["schedules"]]
    sensors = [s["name"] for s in found["sensors"]]
    for name in schedules:
        out = d.graphql(START_SCHEDULE, {"s": {**repo, "scheduleName": name}})["startSchedule"]
        if out["__typename"] == "PythonError" and "already" not in out["message"]:
            raise RuntimeError(f"startSchedule {name}: {out['message']}")
    for name in sensors:
        out = d.graphql(START_SENSOR, {"s": {**repo, "sensorName": name}})["startSensor"]
        if out["__typename"] == "PythonError" and "already" not in out["message"]:
            raise RuntimeError(f"startSensor {name}: {out['message']}")
    return schedules, sensors


# ------------------------------------------------------------------ the exporter, Prometheus


@contextmanager
def process(cmd: list[str], env: dict[str, str], log: Path) -> Any:
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            yield proc
        finally:
            stop_group(proc, grace_s=20)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class Prometheus:
    url: str

    def alerts(self) -> list[dict[str, Any]]:
        body = httpx.get(f"{self.url}/api/v1/alerts", timeout=10).json()
        return list(body["data"]["alerts"])

    def evaluated_since(self, when: float) -> bool:
        """Whether every rule group was evaluated after ``when`` (unix time)."""
        body = httpx.get(f"{self.url}/api/v1/rules", timeout=10).json()
        groups = body["data"]["groups"]
        return bool(groups) and all(_rfc3339(g["lastEvaluation"]) > when for g in groups)

    def query(self, promql: str) -> list[dict[str, Any]]:
        body = httpx.get(f"{self.url}/api/v1/query", params={"query": promql}, timeout=10).json()
        if body.get("status") != "success":
            raise RuntimeError(f"Prometheus query {promql!r}: {body}")
        return list(body["data"]["result"])


def _rfc3339(text: str) -> float:
    """Prometheus's RFC 3339 time (nanoseconds, ``Z``) as unix time."""
    whole, _, fraction = text.rstrip("Z").partition(".")
    return datetime.fromisoformat(whole + "+00:00").timestamp() + float(f"0.{fraction or 0}")


@contextmanager
def monitoring(home: Path, env: dict[str, str]) -> Any:
    """``qo-ops metrics`` over the accelerated catalog, and Prometheus scraping it (job
    ``qo-ops``, every 5 s) with the project's alert rules, evaluated every 5 s."""
    metrics_port, prom_port = free_port(), free_port()
    config = home / "prometheus.yml"
    config.write_text(
        json.dumps(
            {
                "global": {
                    "scrape_interval": f"{SCRAPE_S}s",
                    "evaluation_interval": f"{SCRAPE_S}s",
                },
                "rule_files": [str(REPO / "ops" / "prometheus" / "alerts.yml")],
                "scrape_configs": [
                    {
                        "job_name": "qo-ops",
                        "static_configs": [{"targets": [f"127.0.0.1:{metrics_port}"]}],
                    }
                ],
            }
        )
    )
    exporter = [sys.executable, "-m", "bench.soak_catalog", "metrics", "--port", str(metrics_port)]
    prometheus = [
        "prometheus",
        f"--config.file={config}",
        f"--storage.tsdb.path={home / 'prometheus-data'}",
        f"--web.listen-address=127.0.0.1:{prom_port}",
    ]
    with (
        process(exporter, env, home / "exporter.log") as exp,
        process(prometheus, env, home / "prometheus.log") as prom,
    ):

        def up() -> bool:
            for p, log in ((exp, "exporter.log"), (prom, "prometheus.log")):
                if p.poll() is not None:
                    raise RuntimeError(f"{log} process exited:\n{tail(home / log)}")
            return _answers(f"http://127.0.0.1:{metrics_port}/metrics") and _answers(
                f"http://127.0.0.1:{prom_port}/-/ready"
            )

        wait_for(up, 120, "the exporter and Prometheus", poll=0.5)
        prom = Prometheus(f"http://127.0.0.1:{prom_port}")

        # the soak's alerts count from the first rule evaluation after a good scrape (before
        # it, QoOpsExporterDown's absent(up) is true of a Prometheus that just started)
        first: list[float] = []

        def scraped() -> bool:
            first[:] = [float(r["value"][0]) for r in prom.query('up{job="qo-ops"} == 1')]
            return bool(first)

        wait_for(scraped, 60, "Prometheus's first scrape of the exporter", poll=0.5)
        wait_for(lambda: prom.evaluated_since(first[0]), 60, "a rule evaluation after it", poll=0.5)
        yield prom


# ------------------------------------------------------------------ sampling


def _scope_keys(run: Any) -> list[tuple[str, str, str]]:
    """(job, tenant, window) for each scope a run names: its config's tenants (a schedule's
    or sensor's chunk), else its tenant partition; the window is its day partition, if any."""
    from qo_ops.dagster_defs.submission import op_config

    tags = run.tags
    partition = tags.get("dagster/partition", "")
    tenants = [str(t) for t in op_config(run).get("tenants") or []]
    if tenants:
        return [(run.job_name, t, partition) for t in tenants]
    return [(run.job_name, partition, "")] if partition else []


def sample(d: Deployment, t: float) -> dict[str, Any]:
    """Runs queued (per job, and the oldest's age) and runs running; (job, scope) pairs with
    more than one run queued or running."""
    import dagster as dg

    queued_statuses = [dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED]
    active_statuses = [
        dg.DagsterRunStatus.STARTING,
        dg.DagsterRunStatus.STARTED,
        dg.DagsterRunStatus.CANCELING,
    ]
    records = list(
        d.instance.get_run_records(
            filters=dg.RunsFilter(statuses=queued_statuses + active_statuses)
        )
    )
    now = time.time()
    queued = [r for r in records if r.dagster_run.status in queued_statuses]
    by_job = Counter(r.dagster_run.job_name for r in queued)
    oldest_by_job: dict[str, float] = defaultdict(float)
    for r in queued:
        job = r.dagster_run.job_name
        oldest_by_job[job] = max(oldest_by_job[job], now - r.create_timestamp.timestamp())
    scopes = Counter(k for r in records for k in _scope_keys(r.dagster_run))
    doubled = sorted(f"{j}/{s}{'/' + w if w else ''}" for (j, s, w), n in scopes.items() if n > 1)
    return {
        "t": round(t, 1),
        "queued": len(queued),
        "running": len(records) - len(queued),
        "queued_by_job": dict(by_job),
        "oldest_s": round(max(oldest_by_job.values(), default=0.0), 1),
        "oldest_by_job": {k: round(v, 1) for k, v in oldest_by_job.items()},
        "doubled": doubled,
    }


def note_alerts(timeline: Timeline, prom: Prometheus, t: float) -> None:
    for alert in prom.alerts():
        labels = alert["labels"]
        key = (labels["alertname"], tuple(sorted((k, v) for k, v in labels.items())))
        seen = timeline.alerts.setdefault(key, {"first_t": t, "state": alert["state"]})
        if alert["state"] == "firing":
            seen["state"] = "firing"


# ------------------------------------------------------------------ figures


def starts(d: Deployment, timeline: Timeline) -> list[dict[str, Any]]:
    """Each run created during the soak: its phase when created, and when it started, its
    phase then and its tick-to-start delay."""
    import dagster as dg
    from dagster._core.storage.tags import SCHEDULED_EXECUTION_TIME_TAG

    records = d.instance.get_run_records(
        filters=dg.RunsFilter(created_after=datetime.fromtimestamp(timeline.started, UTC))
    )
    # RUN_STARTING: the daemon took the run off the queue and launches it (RUN_DEQUEUED is not
    # a run status event Dagster lets one fetch by type)
    dequeued = _status_times(d, dg.DagsterEventType.RUN_STARTING, timeline.started)
    out = []
    for r in records:
        created = r.create_timestamp.timestamp()
        scheduled = r.dagster_run.tags.get(SCHEDULED_EXECUTION_TIME_TAG)
        asked = datetime.fromisoformat(scheduled).timestamp() if scheduled else created
        t = None if r.start_time is None else r.start_time - timeline.started
        left = dequeued.get(r.dagster_run.run_id)
        out.append(
            {
                "job": r.dagster_run.job_name,
                "asked_in": timeline.phase(created - timeline.started),
                "t": t,
                "phase": None if t is None else timeline.phase(t),
                "delay_s": None if r.start_time is None else r.start_time - asked,
                # the delay's three parts: the tick's evaluation (asked → created), the run
                # queue (created → dequeued), the launch (dequeued → the worker's start)
                "created_s": created - asked,
                "queued_s": None if left is None else left - created,
                "launch_s": None if left is None or r.start_time is None else r.start_time - left,
                "by": "schedule" if scheduled else "sensor",
            }
        )
    return out


def _status_times(d: Deployment, event_type: Any, since: float) -> dict[str, float]:
    """When each run since ``since`` got a run status event of ``event_type`` (its last)."""
    from dagster._core.event_api import RunStatusChangeRecordsFilter

    wanted = RunStatusChangeRecordsFilter(event_type=event_type, after_timestamp=since)
    out: dict[str, float] = {}
    cursor = None
    while True:
        page = d.instance.fetch_run_status_changes(wanted, 1000, cursor, ascending=True)
        out.update((rec.run_id, rec.timestamp) for rec in page.records)
        if not page.has_more:
            return out
        cursor = page.cursor


def coalescing_bound(tenants: int, per_run: int, jobs: int) -> int:
    """Runs that may be queued at once if no job and scope ever has two: one per job and
    chunk of tenants (a sensor's chunk covers the same tenants as the schedule's)."""
    return jobs * math.ceil(tenants / per_run)


# ------------------------------------------------------------------ the section


def run(profile: Profile) -> Section:
    """The soak ``profile.repeats`` times in a row on the machine as it is (quiet for a
    measurement), then, except at the quick profile, once more under load: one busy process
    per core beside the deployment for the whole run."""
    if shutil.which("prometheus") is None:  # before anything is built, in one line
        raise SystemExit(
            "soak: no prometheus on PATH (Debian's package prometheus, which .ci/run installs)"
        )
    quiet = []
    for k in range(profile.repeats):
        print(f"   soak run {k + 1} of {profile.repeats}", flush=True)
        quiet.append(soak_once(profile))
    if profile.name == "quick":
        return combined(quiet, [], 0)
    busy = os.cpu_count() or 1
    print(f"   soak under load: {busy} busy processes beside it", flush=True)
    with busy_processes(busy):
        loaded = soak_once(profile)
    return combined(quiet, [loaded], busy)


@contextmanager
def busy_processes(n: int) -> Any:
    """``n`` processes spinning on the CPU (at normal priority) until the block ends."""
    spin = [sys.executable, "-c", "while True: pass"]
    procs = [subprocess.Popen(spin, start_new_session=True) for _ in range(n)]
    try:
        yield procs
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def combined(quiet: list[Section], loaded: list[Section], busy: int) -> Section:
    """One table for the runs: each figure's median and range over the quiet runs (met only
    if every run met it), then the loaded run's rows as they are; every run's notes."""
    if len(quiet) == 1 and not loaded:
        return quiet[0]
    rows = [_over_runs([s.rows[i] for s in quiet], [s.raw["figures"] for s in quiet], i)
            for i in range(len(quiet[0].rows))]  # fmt: skip
    for row in loaded[0].rows if loaded else []:
        what = row.what.replace("(soak)", f"(soak, {busy} busy processes beside it)")
        rows.append(Row(what, row.size, row.figure, row.limit, row.ratio, row.goal, row.met,
                        note=row.note))  # fmt: skip
    notes = [QUEUE_RULE] + [f"Run {k}. {n}" for k, s in enumerate(quiet, 1) for n in s.notes]
    notes += [f"Under load ({busy} busy processes). {n}" for s in loaded for n in s.notes]
    raw = {"runs": [s.raw for s in quiet], "loaded": [s.raw for s in loaded], "busy": busy}
    return Section(TITLE, rows, notes, raw)


def _over_runs(rows: list[Row], figures: list[dict[str, float]], i: int) -> Row:
    """Row ``i`` of each run as one: its figure's median (min–max), met in every run."""
    first, runs = rows[0], len(rows)
    ratios = [r.ratio for r in rows if r.ratio is not None]
    spread = Spread.of(ratios) if ratios else None
    met = all(r.met for r in rows) if all(r.met is not None for r in rows) else None
    if i == 0:
        figure = Spread.of([f["deepest"] for f in figures]).show(lambda v: f"{v:.0f} runs")
        limit = first.limit
    elif i == 1:
        figure = Spread.of([f["delay_p95_s"] for f in figures]).show(lambda v: f"{v:.0f} s")
        bounds = Spread.of([f["delay_bound_s"] for f in figures]).show(lambda v: f"{v:.0f} s")
        limit = f"{bounds}: tick lag p95 + deepest queue / starts a minute, per run"
    else:
        alerts = Spread.of([f["alerts"] for f in figures]).show(lambda v: f"{v:.0f}")
        wrong = ", ".join(f"{f['wrong']:.0f}" for f in figures)
        figure, limit = f"{alerts} alerts, wrong per run: {wrong}", first.limit
    return Row(
        f"{first.what[:-1]}, {runs} runs)" if first.what.endswith(")") else first.what,
        first.size,
        figure,
        limit,
        None if spread is None else spread.mid,
        f"{first.goal} in every run" if first.goal else "",
        met,
        note=" | ".join(f"run {k}: {r.note}" for k, r in enumerate(rows, 1)),
        ratio_range=None if spread is None else spread.range,
    )


def soak_once(profile: Profile) -> Section:
    from qo_ops.downstream.local import seed_from_demo, simulator_process

    tenants, per_run, soak_s = profile.soak_tenants, profile.soak_tenants_per_run, profile.soak_s
    outage = (soak_s / 3, 2 * soak_s / 3)
    with (
        fresh_database(f"{PREFIX}_db") as url,
        tempfile.TemporaryDirectory(prefix="qo-ops-bench-soak-") as tmp,
    ):
        home = Path(tmp)
        qo_home = home / "qo_ops"
        qo_home.mkdir()
        base = {k: v for k, v in os.environ.items() if not k.startswith("QO_OPS_")}
        base.update(QO_OPS_DATABASE_URL=env_url(url), QO_OPS_HOME=str(qo_home))
        subprocess.run(
            [str(Path(sys.executable).parent / "qo-ops"), "demo-data", "--tenants", str(tenants)]
            + ["--quotes", str(QUOTES_PER_TENANT)],
            cwd=REPO,
            env=base,
            check=True,
            capture_output=True,
        )
        engine = engine_for(url)
        with simulator_process(qo_home / "downstream.sqlite3") as sim:
            seeded = seed_from_demo(engine, sim.url)
            env = {
                "QO_OPS_DOWNSTREAM_URL": sim.url,
                "QO_OPS_PARTITION_START": partition_start().isoformat(),
                PER_RUN_ENV: str(per_run),
            }
            print(
                f"   {tenants} tenants of demo data, {seeded:,} orders in the simulator; "
                f"every cron {CRON!r}, {per_run} tenants per run",
                flush=True,
            )
            with (
                deployment(url, home, env, "bench.soak_location", stop_tenants_sensor=False) as d,
                monitoring(home, {**base, **env}) as prom,
            ):
                schedules, sensors = start_everything(d)
                since = datetime.now(UTC)
                timeline = Timeline(time.time(), outage)
                stopped = revived = False
                while (t := time.time() - timeline.started) < soak_s:
                    if not stopped and t >= outage[0]:
                        sim.process.kill()  # the downstream goes away without a word
                        sim.process.wait()
                        stopped = True
                        print(f"   {t:.0f} s: downstream stopped", flush=True)
                    if stopped and not revived and t >= outage[1]:
                        print(f"   {t:.0f} s: {sim.revive()}", flush=True)
                        revived = True
                    s = sample(d, t)
                    timeline.samples.append(s)
                    note_alerts(timeline, prom, t)
                    print(
                        f"   {t:5.0f} s {timeline.phase(t):6} queued {s['queued']:3} "
                        f"(oldest {s['oldest_s']:5.0f} s), running {s['running']}, "
                        f"alerts {len(timeline.alerts)}",
                        flush=True,
                    )
                    time.sleep(max(0.0, SAMPLE_S - (time.time() - timeline.started - t)))
                missed = {
                    r["metric"].get("reason", "?"): float(r["value"][1])
                    for r in prom.query("sum by (reason) (job_missed_runs_total)")
                }
                started = starts(d, timeline)
                found = facts(url, since, outage[0], timeline, started)
                daemon_log = tail(home / "daemon.log", 2000)
        engine.dispose()
    return figures(
        profile, timeline, started, missed, found, len(schedules), len(sensors), daemon_log
    )


def queue_wait_bound_s(ahead: int, slowest_per_min: float, tick_s: float, launch_s: float) -> float:
    """How late a scheduled run can start when the queue is the only cause. It is created when
    the scheduler evaluates its tick (``tick_s`` after its scheduled time), then waits in the
    run queue, which is FIFO and holds at most one run per job and scope (the coalescing
    bound): at most ``ahead`` runs are before it, and they start at least at the slowest
    rate the deployment sustained in the soak (a wait spans phases); then it is launched
    (``launch_s``). The tick and launch are the phase's p95, measured. A delay over this is
    not explained by the queue: a run starved or a launch stalled (docs/dagster.md, the run
    queue's bound)."""
    if slowest_per_min <= 0:  # a phase started nothing: no wait in the queue is explained
        return tick_s + launch_s
    return tick_s + ahead / slowest_per_min * 60.0 + launch_s


def _delay_ratio(phase: dict[str, Any]) -> float:
    """A phase's tick-to-start p95 over what its queue explains (no run started: 0)."""
    if phase["delay_bound_s"] > 0:
        return float(phase["delay_p95_s"] / phase["delay_bound_s"])
    return math.inf if phase["delay_p95_s"] > 0 else 0.0


def figures(
    profile: Profile,
    timeline: Timeline,
    started: list[dict[str, Any]],
    missed: dict[str, float],
    found: Facts,
    schedules: int,
    sensors: int,
    daemon_log: str,
) -> Section:
    tenants, per_run, soak_s = profile.soak_tenants, profile.soak_tenants_per_run, profile.soak_s
    from qo_ops.jobs.catalog import JOBS

    jobs = len(JOBS)
    bound = coalescing_bound(tenants, per_run, jobs)
    for s in timeline.samples:  # the catalog's jobs (recent_success_job's runs are not bounded)
        s["queued_catalog"] = sum(n for job, n in s["queued_by_job"].items() if job in JOBS)
    phases: dict[str, dict[str, Any]] = {}
    for phase in PHASES:
        samples = [s for s in timeline.samples if timeline.phase(s["t"]) == phase]
        runs = [r for r in started if r["phase"] == phase]
        delays = [r["delay_s"] for r in runs]
        asked = sum(1 for r in started if r["asked_in"] == phase)
        minutes = max(1e-9, soak_s / 3 / 60)
        phases[phase] = {
            "max_queued": max((s["queued_catalog"] for s in samples), default=0),
            "last_queued": samples[-1]["queued_catalog"] if samples else 0,
            "max_queued_other": max(
                (s["queued"] - s["queued_catalog"] for s in samples), default=0
            ),
            "max_oldest_s": max((s["oldest_s"] for s in samples), default=0.0),
            "created_per_min": asked / minutes,
            "started_per_min": len(runs) / minutes,
            "delay_p50_s": median(delays) if delays else 0.0,
            "delay_p95_s": percentile(delays, 0.95),
        }
        phases[phase]["created_p95_s"] = percentile([r.get("created_s", 0.0) for r in runs], 0.95)
        for part in ("queued_s", "launch_s"):
            values = [r[part] for r in runs if r.get(part) is not None]
            phases[phase][f"{part[:-2]}_p95_s"] = percentile(values, 0.95) if values else 0.0
    ahead = bound - 1 + max(p["max_queued_other"] for p in phases.values())
    slowest = min(p["started_per_min"] for p in phases.values())
    for p in phases.values():
        p["delay_bound_s"] = queue_wait_bound_s(
            ahead, slowest, p["created_p95_s"], p["launch_p95_s"]
        )
    max_queued = max(p["max_queued"] for p in phases.values())
    worst_phase = max(PHASES, key=lambda p: _delay_ratio(phases[p]))
    worst = phases[worst_phase]
    doubled = sorted({d for s in timeline.samples for d in s["doubled"]})
    verdicts = []
    for (name, labels), seen in sorted(timeline.alerts.items()):
        why = judge(name, dict(labels), seen["first_t"], found)
        shown = ",".join(
            f"{k}={v}" for k, v in labels if k in ("job_name", "reason", "downstream", "problem")
        )
        verdicts.append(
            {
                "alert": f"{name}{{{shown}}}",
                "state": seen["state"],
                "first_s": round(seen["first_t"]),
                "right": why is not None,
                "why": why or "nothing the soak did explains it",
            }
        )
    wrong = [v for v in verdicts if not v["right"]]
    size = (
        f"{tenants} tenants, {per_run} a run, {jobs} jobs every minute, {soak_s / 60:.0f} min, "
        f"outage {timeline.outage[0] / 60:.0f}–{timeline.outage[1] / 60:.0f} min"
    )
    per_phase = "; ".join(
        f"{p}: max {phases[p]['max_queued']}, last {phases[p]['last_queued']}" for p in PHASES
    )
    delays = "; ".join(
        f"{p}: p50 {phases[p]['delay_p50_s']:.0f} s, p95 {phases[p]['delay_p95_s']:.0f} s "
        f"(bound {phases[p]['delay_bound_s']:.0f} s; p95 of its parts: tick "
        f"{phases[p]['created_p95_s']:.0f} s, queue {phases[p]['queued_p95_s']:.0f} s, launch "
        f"{phases[p]['launch_p95_s']:.0f} s), "
        f"{phases[p]['created_per_min']:.1f} created/min, {phases[p]['started_per_min']:.1f} "
        "started/min"
        for p in PHASES
    )
    reasons = ", ".join(f"{k} {v:.0f}" for k, v in sorted(missed.items())) or "none"
    queue_ok = max_queued <= bound and not doubled
    rows = [
        Row(
            "Run queue, deepest (soak)",
            size,
            f"{max_queued} runs",
            f"{bound} runs (one per job and chunk)",
            max_queued / bound,
            "<= 1.0, no scope twice",
            queue_ok,
            note=f"{per_phase}; scopes with two runs at once: {len(doubled)}",
        ),
        Row(
            "Tick-to-start delay p95 (soak)",
            size,
            f"{worst['delay_p95_s']:.0f} s ({worst_phase})",
            f"{worst['delay_bound_s']:.0f} s: tick {worst['created_p95_s']:.0f} s + {ahead} runs "
            f"ahead at most / {slowest:.1f} starts a minute (the slowest phase) + launch "
            f"{worst['launch_p95_s']:.0f} s; one phase: {soak_s / 3:.0f} s, "
            f"p95 {worst['delay_p95_s'] / (soak_s / 3):.2f} of it",
            _delay_ratio(worst),
            "<= 1.0 in every phase",
            all(_delay_ratio(p) <= 1.0 for p in phases.values()),
            note=delays,
        ),
        Row(
            "Alerts pending or firing (soak)",
            size,
            f"{len(verdicts)} alerts, {len(wrong)} wrong",
            "0 wrong",
            None,
            "0 wrong",
            not wrong,
            note=f"missed runs by reason: {reasons}",
        ),
    ]
    notes = [
        f"Soak ({size}): {schedules} schedules and {sensors} sensors on; the coalescing bound "
        f"is {jobs} jobs × {math.ceil(tenants / per_run)} chunks. Per phase — {delays}.",
        "Alerts: "
        + (
            "; ".join(
                f"{v['alert']} {v['state']} from {v['first_s']} s — "
                f"{'right: ' if v['right'] else 'WRONG: '}{v['why']}"
                for v in verdicts
            )
            or "none went pending"
        ),
    ]
    if doubled:
        notes.append(f"Scopes with two runs queued or running at once: {', '.join(doubled[:10])}")
    raw = {
        "figures": {
            "deepest": float(max_queued),
            "delay_p95_s": float(worst["delay_p95_s"]),
            "delay_bound_s": float(worst["delay_bound_s"]),
            "alerts": float(len(verdicts)),
            "wrong": float(len(wrong)),
        },
        "samples": timeline.samples,
        "phases": phases,
        "missed": missed,
        "alerts": verdicts,
        "bound": bound,
        "daemon_log_tail": daemon_log if not (queue_ok and not wrong) else "",
    }
    return Section(TITLE, rows, notes, raw)
