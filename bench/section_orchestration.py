"""Orchestration overhead: one schedule tick of quote_expiration over N tenants through
Dagster (webserver + daemon + run queue + run launcher), end to end, against the same work
done by ``run_job`` in one process.

Data: N demo tenants (2N with (c)) of 200 quotes each (10 eligible per tenant), built once, VACUUM ANALYZE, cloned (``CREATE DATABASE … TEMPLATE``) for every
measurement so each starts from the same bytes.

(a) Dagster. A real deployment as ``qo_ops_tests/dagster/stack.py`` starts it: dagster-webserver
and dagster-daemon on loopback over PostgreSQL storage (the project's dagster.yaml: the
QueuedRunCoordinator, at most 8 runs at once, one per ``qo_ops/scope``, DefaultRunLauncher:
one process per run). The tick is the real schedule's: ``quote_expiration_schedule`` is
evaluated in-process (``build_schedule_context``) and yields one RunRequest per tenant
partition; each request is submitted through GraphQL ``launchRun`` with its partition, run
config and tags plus ``dagster/schedule_name`` (so the op sees a schedule trigger). From
there every run takes the path of a daemon-launched tick run: queued, dequeued by the
daemon, launched by the run launcher as its own process. The daemon's schedule loop itself
cannot be made to tick on demand (the cron is ``*/15``; there is no "tick now" mutation or
CLI command), and creating N run records is a small part of the figure (reported as
``submit_s``). Timed from the first submission until every Dagster run has ended and every
job_run row is final. One warm-up run (a dry run) goes first, so the daemon has loaded the
code location. The stack's processes (process groups) are stopped in every case.

(b) ``run_job`` for the same N tenants in a loop in one fresh Python process (its start and
imports included), on a clone of the same data.

Per-run overhead = (a − b) / N; ratio = b / a. Both are verified: every eligible quote
expired, N final execute job_run rows.

(c) When the op supports partition-range runs (``dagster/asset_partition_range_start`` /
``_end`` tags: one Dagster run leases each tenant of the range in turn), the same tick for N
other tenants (same work per tenant, loaded beside the first N) as RANGE_RUNS range runs,
on the same deployment.

The default profile sends at most DAGSTER_TENANTS_MAX tenants through Dagster (one run per
tenant takes ~4 s of wall time on 2 cores, so 100 take ~7 minutes); the full profile sends
all of ``orchestration_tenants``. One Dagster tick per figure.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import URL

from bench.common import (
    REPO,
    admin_engine,
    cloned_database,
    engine_for,
    env_url,
    fresh_database,
    settle,
    stopwatch,
)
from bench.suite import Profile, Row, Section, median

TITLE = "Orchestration overhead"
JOB = "quote_expiration"
QUOTES_PER_TENANT = 200  # 10 eligible per tenant: small work, so overhead shows
SEED = 5
PREFIX = "qo_ops_bench_orch"
LOCATION = "qo_ops.definitions"
RANGE_RUNS = 4  # (c): the tick's tenants in this many partition-range runs
DAGSTER_TENANTS_MAX = 24  # below the full profile: 100 runs take ~7 minutes on 2 cores
BIN = Path(sys.executable).parent
RANGE_START_TAG = "dagster/asset_partition_range_start"
RANGE_END_TAG = "dagster/asset_partition_range_end"


# ------------------------------------------------------------------ data


def _load(url: URL, tenants: int) -> list[str]:
    from qo_ops.demo.data import load_demo_data

    engine = engine_for(url)
    as_of = datetime.now(UTC).replace(microsecond=0)
    report = load_demo_data(
        engine, tenants=tenants, quotes=QUOTES_PER_TENANT, seed=SEED, as_of=as_of
    )
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql("VACUUM ANALYZE")
    engine.dispose()
    return report.tenants


def _eligible(url: URL, tenants: list[str]) -> int:
    engine = engine_for(url)
    with engine.connect() as conn:
        n = conn.scalar(
            sa.text(
                "SELECT count(*) FROM quote WHERE tenant_id = ANY(:t) AND status = 'ACTIVE' "
                "AND expires_at < now()"
            ),
            {"t": tenants},
        )
    engine.dispose()
    return int(n or 0)


def _verify(url: URL, tenants: list[str], expected_expired: int, runs_expected: int) -> dict:
    """Every eligible quote expired with its event; one final execute job_run per run."""
    engine = engine_for(url)
    with engine.connect() as conn:
        left = conn.scalar(
            sa.text(
                "SELECT count(*) FROM quote WHERE tenant_id = ANY(:t) AND status = 'ACTIVE' "
                "AND expires_at < now()"
            ),
            {"t": tenants},
        )
        runs = conn.execute(
            sa.text(
                "SELECT status, count(*) AS n, coalesce(sum(succeeded_count), 0) AS mutated "
                "FROM job_run WHERE job_name = :job AND mode = 'execute' AND scope = ANY(:t) "
                "GROUP BY status"
            ),
            {"job": JOB, "t": tenants},
        ).all()
    engine.dispose()
    by_status = {r.status: int(r.n) for r in runs}
    mutated = sum(int(r.mutated) for r in runs)
    ok = (
        left == 0
        and sum(by_status.values()) == runs_expected
        and set(by_status) <= {"success", "no_work"}
        and mutated == expected_expired
    )
    if not ok:
        raise AssertionError(
            f"wrong work: {left} eligible left, runs {by_status} (expected {runs_expected}), "
            f"expired {mutated} (expected {expected_expired})"
        )
    return {"runs_by_status": by_status, "expired": mutated}


# ------------------------------------------------------------------ (b) one process

_LOOP = """
import json, sys, time
import sqlalchemy as sa
from qo_ops.jobs.catalog import CATALOG
from qo_ops.platform.runner import run_job
from qo_ops.platform.spec import RunOptions, Scope
url, job, tenants = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
engine = sa.create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))
spec = CATALOG[job]
started = time.perf_counter()
statuses = {}
for tenant in tenants:
    s = run_job(spec, Scope(tenant), RunOptions(mode="execute", trigger="schedule",
                requester="bench", progress_interval_s=60.0), engine=engine)
    statuses[s.status] = statuses.get(s.status, 0) + 1
print(json.dumps({"loop_s": time.perf_counter() - started, "statuses": statuses}))
"""


def _one_process(url: URL, tenants: list[str]) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QO_OPS_")}
    with stopwatch() as t:
        proc = subprocess.run(
            [sys.executable, "-c", _LOOP, env_url(url), JOB, json.dumps(tenants)],
            env=env,
            capture_output=True,
            text=True,
            check=False,
            cwd=REPO,
        )
    if proc.returncode != 0:
        raise RuntimeError(f"run_job loop failed: {proc.stderr[-2000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"wall_s": t[0], "loop_s": out["loop_s"], "statuses": out["statuses"]}


# ------------------------------------------------------------------ (a) Dagster


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(condition: Callable[[], bool], timeout: float, what: str, poll: float = 0.25) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return
        time.sleep(poll)
    raise TimeoutError(f"timed out waiting for {what}")


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


@contextmanager
def dagster_stack(url: URL, home: Path) -> Iterator[tuple[Any, Any]]:
    """dagster-webserver and dagster-daemon on loopback over PostgreSQL storage (a database
    of its own next to ``url``), as qo_ops_tests/dagster/stack.py starts them; yields
    (DagsterGraphQLClient, DagsterInstance); stops both process groups in every case."""
    import dagster as dg
    import httpx
    from dagster_graphql import DagsterGraphQLClient

    storage_db = f"{url.database}_dagster"
    admin = admin_engine()
    with admin.connect() as conn:
        conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{storage_db}" WITH (FORCE)')
        conn.exec_driver_sql(f'CREATE DATABASE "{storage_db}"')
    storage = url.set(drivername="postgresql+psycopg2", database=storage_db).render_as_string(
        hide_password=False
    )
    shutil.copy(REPO / "dagster.yaml", home / "dagster.yaml")
    (home / "qo_ops").mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("QO_OPS_")}
    env.update(
        QO_OPS_DATABASE_URL=env_url(url),
        QO_OPS_DAGSTER_STORAGE_URL=storage,
        QO_OPS_HOME=str(home / "qo_ops"),
        DAGSTER_HOME=str(home),
    )
    port = _free_port()
    logs = [open(home / name, "w") for name in ("webserver.log", "daemon.log")]  # noqa: SIM115
    procs: list[subprocess.Popen[bytes]] = []
    old = {k: os.environ.get(k) for k in ("DAGSTER_HOME", "QO_OPS_DAGSTER_STORAGE_URL")}
    try:
        procs.append(
            subprocess.Popen(
                [str(BIN / "dagster-webserver"), "-w", "workspace.yaml", "-h", "127.0.0.1"]
                + ["-p", str(port)],
                cwd=REPO,
                env=env,
                stdout=logs[0],
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
        procs.append(
            subprocess.Popen(
                [str(BIN / "dagster-daemon"), "run", "-w", "workspace.yaml"],
                cwd=REPO,
                env=env,
                stdout=logs[1],
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
        os.environ["DAGSTER_HOME"], os.environ["QO_OPS_DAGSTER_STORAGE_URL"] = str(home), storage

        def webserver_up() -> bool:
            if any(p.poll() is not None for p in procs):
                raise RuntimeError(
                    "a Dagster process exited:\n"
                    + _tail(home / "webserver.log")
                    + _tail(home / "daemon.log")
                )
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/server_info", timeout=2)
                return r.status_code == 200
            except httpx.HTTPError:
                return False

        _wait(webserver_up, 180, "the webserver")
        with dg.DagsterInstance.get() as instance:
            _wait(
                lambda: "QUEUED_RUN_COORDINATOR" in instance.get_daemon_heartbeats(),
                180,
                "the daemon's run queue",
                poll=0.5,
            )
            yield DagsterGraphQLClient("127.0.0.1", port_number=port), instance
    finally:
        for proc in procs:
            if proc.poll() is None:
                with suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        for proc in procs:  # children left in a group whose leader has gone (code servers)
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, 0)
                time.sleep(2)
                os.killpg(proc.pid, signal.SIGKILL)
        for log in logs:
            log.close()
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{storage_db}" WITH (FORCE)')
        admin.dispose()


def _schedule_requests(instance: Any, when: datetime, url: URL) -> list[Any]:
    """The RunRequests of one real tick of quote_expiration_schedule."""
    import dagster as dg

    from qo_ops.dagster_defs.jobs import build_job
    from qo_ops.dagster_defs.resources import QoOpsDatabase
    from qo_ops.dagster_defs.schedules import build_schedule
    from qo_ops.jobs.catalog import CATALOG

    spec = CATALOG[JOB]
    job = build_job(spec)
    schedule = build_schedule(spec, job)
    from dagster._core.definitions.partitions.context import partition_loading_context

    database = QoOpsDatabase(url=env_url(url))
    repo = dg.Definitions(
        jobs=[job], schedules=[schedule], resources={"database": database}
    ).get_repository_def()
    with (  # the schedule reads the kill switch through its database resource
        dg.build_schedule_context(
            instance=instance,
            scheduled_execution_time=when,
            repository_def=repo,
            resources={"database": database},
        ) as context,
        partition_loading_context(dynamic_partitions_store=instance),
    ):
        return list(schedule.evaluate_tick(context).run_requests or [])


def _wait_runs(instance: Any, url: URL, ids: list[str], timeout: float) -> list[Any]:
    """Until every Dagster run has ended and every job_run row it wrote is final."""
    import dagster as dg

    from qo_ops.platform.runs import FINAL_STATUSES

    ended = {
        dg.DagsterRunStatus.SUCCESS,
        dg.DagsterRunStatus.FAILURE,
        dg.DagsterRunStatus.CANCELED,
    }
    engine = engine_for(url)
    records: list[Any] = []

    def done() -> bool:
        nonlocal records
        records = list(instance.get_run_records(filters=dg.RunsFilter(run_ids=ids)))
        if len(records) < len(ids) or any(r.dagster_run.status not in ended for r in records):
            return False
        with engine.connect() as conn:
            open_rows = conn.scalar(
                sa.text(
                    "SELECT count(*) FROM job_run WHERE dagster_run_id = ANY(:ids) "
                    "AND status <> ALL(:final)"
                ),
                {"ids": ids, "final": list(FINAL_STATUSES)},
            )
        return open_rows == 0

    try:
        _wait(done, timeout, f"{len(ids)} Dagster runs", poll=0.5)
    finally:
        engine.dispose()
    failed = [r.dagster_run.run_id for r in records if r.dagster_run.status.value != "SUCCESS"]
    if failed:
        raise AssertionError(f"{len(failed)} Dagster run(s) did not succeed: {failed[:5]}")
    return records


def _run_breakdown(instance: Any, records: list[Any], url: URL, ids: list[str]) -> dict:
    """Medians per run: waiting in the queue (created → launched), process start (launched
    → RUN_START: interpreter, imports, loading the code location), the run worker (RUN_START
    → end) and, inside it, the op's run_job (job_run started_at → finished_at)."""
    import dagster as dg

    queued, boot = [], []
    for r in records:
        launched = [
            e.timestamp
            for e in instance.all_logs(
                r.dagster_run.run_id, of_type=dg.DagsterEventType.RUN_STARTING
            )
        ]
        if launched and r.start_time:
            queued.append(launched[0] - r.create_timestamp.timestamp())
            boot.append(r.start_time - launched[0])
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
    return {
        "queued_s_median": median(queued) if queued else 0.0,
        "process_start_s_median": median(boot) if boot else 0.0,
        "worker_s_median": median(worker) if worker else 0.0,
        "run_job_s_median": median(work) if work else 0.0,
        "run_job_s_total": sum(work),
    }


def _launch(client: Any, config: dict[str, Any], tags: dict[str, str]) -> str:
    return str(
        client.submit_job_execution(
            JOB,
            repository_location_name=LOCATION,
            run_config={"ops": {f"{JOB}_op": {"config": config}}},
            tags=tags,
        )
    )


def _measure_tick(
    instance: Any, client: Any, url: URL, tenants: list[str], submit: Callable[[], list[str]]
) -> dict[str, Any]:
    """Submit one tick's runs, wait until all ended with final job_run rows; verify."""
    expected = _eligible(url, tenants)
    settle(url)
    with stopwatch() as total:
        with stopwatch() as submitted:
            ids = submit()
        records = _wait_runs(instance, url, ids, max(600.0, 15.0 * len(tenants)))
    return {
        "tick_s": total[0],
        "submit_s": submitted[0],
        "dagster_runs": len(ids),
        **_run_breakdown(instance, records, url, ids),
        **_verify(url, tenants, expected, len(tenants)),
    }


def _dagster(template: URL, per_tenant: list[str], ranged: list[str]) -> dict[str, Any]:
    """(a) the tick for ``per_tenant``, one run per tenant; then (c) for ``ranged``, in
    partition-range runs (when the op supports them): one deployment, one clone."""
    out: dict[str, Any] = {}
    with (
        cloned_database(template, f"{PREFIX}_dagster") as url,
        tempfile.TemporaryDirectory(prefix="qo-ops-bench-dagster-") as tmp,
    ):
        home = Path(tmp)
        try:
            with dagster_stack(url, home) as (client, instance):
                instance.add_dynamic_partitions("tenants", per_tenant)
                # warm-up: one dry run, so the daemon and its code server are loaded
                with stopwatch() as warm:
                    warm_id = _launch(
                        client,
                        {"mode": "dry_run"},
                        {"dagster/partition": per_tenant[0], "qo_ops/scope": f"{JOB}:warm-up"},
                    )
                    _wait_runs(instance, url, [warm_id], 300)
                out["warmup_run_s"] = warm[0]
                when = datetime.now(UTC).replace(second=0, microsecond=0)
                # the tenants sensor (running by default) may have added every tenant by now
                requests = [
                    r
                    for r in _schedule_requests(instance, when, url)
                    if r.partition_key in per_tenant
                ]
                assert sorted(r.partition_key for r in requests) == sorted(per_tenant)

                def one_per_tenant() -> list[str]:
                    return [
                        _launch(
                            client,
                            r.run_config["ops"][f"{JOB}_op"]["config"],
                            {
                                **r.tags,
                                "dagster/partition": r.partition_key,
                                "dagster/schedule_name": f"{JOB}_schedule",
                            },
                        )
                        for r in requests
                    ]

                out["per_tenant"] = _measure_tick(instance, client, url, per_tenant, one_per_tenant)
                if ranged:
                    have = set(instance.get_dynamic_partitions("tenants"))
                    instance.add_dynamic_partitions("tenants", [t for t in ranged if t not in have])
                    runs = RANGE_RUNS if len(ranged) >= 2 * RANGE_RUNS else 1
                    size = math.ceil(len(ranged) / runs)
                    chunks = [ranged[k : k + size] for k in range(0, len(ranged), size)]

                    def ranges() -> list[str]:
                        return [
                            _launch(
                                client,
                                {"mode": "execute"},
                                {
                                    RANGE_START_TAG: c[0],
                                    RANGE_END_TAG: c[-1],
                                    "qo_ops/scope": f"{JOB}:{c[0]}..{c[-1]}",
                                    "dagster/schedule_name": f"{JOB}_schedule",
                                },
                            )
                            for c in chunks
                        ]

                    out["ranged"] = _measure_tick(instance, client, url, ranged, ranges)
        except Exception:
            traceback.print_exc()
            print(_tail(home / "daemon.log"), file=sys.stderr)
            raise
    return out


def _range_runs_supported() -> bool:
    from qo_ops.dagster_defs import jobs

    return hasattr(jobs, "_run_tenant_range")


# ------------------------------------------------------------------ the section


def run(profile: Profile) -> Section:
    n_all = profile.orchestration_tenants
    n = n_all if profile.name == "full" else min(n_all, DAGSTER_TENANTS_MAX)
    ranges = _range_runs_supported()
    with fresh_database(f"{PREFIX}_tpl") as template:
        tenants = _load(template, 2 * n if ranges else n)
        first, second = tenants[:n], tenants[n:]
        expected = _eligible(template, first)
        settle(template)

        def loop_once(i: int) -> dict[str, Any]:
            with cloned_database(template, f"{PREFIX}_loop_{i}") as url:
                settle(url)
                out = _one_process(url, first)
                out.update(_verify(url, first, expected, n))
            return out

        loops = [loop_once(i) for i in range(profile.repeats)]
        dagster = _dagster(template, first, second)

    b = median([x["wall_s"] for x in loops])
    b_loop = median([x["loop_s"] for x in loops])
    t0 = dagster["per_tenant"]
    a = t0["tick_s"]
    per_run = (a - b) / n
    size = f"{n} tenants × {QUOTES_PER_TENANT} quotes"
    rows = [
        Row(
            what=f"schedule tick through Dagster, one run per tenant ({JOB})",
            size=size,
            figure=f"{a:.1f} s",
            limit=f"{b:.1f} s (run_job loop, one process)",
            ratio=b / a,
            goal="report",
            met=None,
            note=f"{expected} quotes expired; {n_all} tenants ≈ {b + per_run * n_all:.0f} s",
        ),
        Row(
            what="per-run overhead of a Dagster run, (a − b) / N",
            size=f"{n} runs, ≤ 8 at once",
            figure=f"{per_run:.2f} s/run",
            limit=f"{b_loop / n * 1000:.0f} ms/tenant (run_job work)",
            ratio=None,
            goal="report",
            met=None,
        ),
    ]
    notes = [
        f"(a) {n} runs (the schedule's RunRequests, submitted through GraphQL launchRun in "
        f"{t0['submit_s']:.1f} s) all ended {a:.1f} s after the first submission. Per run "
        f"(median): {t0['queued_s_median']:.1f} s queued, {t0['process_start_s_median']:.1f} s "
        f"from launch to RUN_START (a new process: interpreter, imports, code location), "
        f"{t0['worker_s_median']:.1f} s in the run worker, of which "
        f"{t0['run_job_s_median'] * 1000:.0f} ms in run_job. A single run alone (warm-up, dry "
        f"run): {dagster['warmup_run_s']:.1f} s from launch request to end.",
        f"(b) the same {n} tenants by run_job in one fresh process: {b:.1f} s including "
        f"interpreter start and imports, {b_loop:.1f} s in the loop "
        f"({b_loop / n * 1000:.0f} ms per tenant).",
        "The schedules request one run per tenant partition (qo_ops/dagster_defs/schedules.py): "
        f"a tick over {n_all} tenants is {n_all} run processes, at most 8 at once; process "
        "start, not the work, sets the tick's duration.",
    ]
    if n < n_all:
        notes.append(
            f"The {profile.name} profile sends {n} of its {n_all} tenants through Dagster (time "
            f"budget); per-run overhead is per run, so {n_all} tenants ≈ b + {n_all} × "
            f"{per_run:.2f} s ≈ {b + per_run * n_all:.0f} s. The full profile measures all "
            f"{n_all}. One Dagster tick per figure; run_job figures are medians of "
            f"{profile.repeats}."
        )
    else:
        notes.append(
            f"One Dagster tick per figure; run_job figures are medians of {profile.repeats}."
        )
    raw: dict[str, Any] = {"loops": loops, "dagster": dagster, "tenants_through_dagster": n}
    if "ranged" in dagster:
        c_run = dagster["ranged"]
        c = c_run["tick_s"]
        rows.append(
            Row(
                what=f"schedule tick through Dagster, {c_run['dagster_runs']} partition-range runs",
                size=size,
                figure=f"{c:.1f} s",
                limit=f"{b:.1f} s (run_job loop, one process)",
                ratio=b / c,
                goal="report",
                met=None,
                note=f"{a / c:.1f}× faster than one run per tenant",
            )
        )
        notes.append(
            f"(c) the same tick as {c_run['dagster_runs']} runs over partition ranges (tags "
            "dagster/asset_partition_range_start/_end; the op runs run_job for each tenant in "
            f"turn, each with its own lease and job_run row): {c:.1f} s for {n} other tenants "
            f"with the same work, on the same deployment. The schedules still request one run "
            f"per tenant; a schedule yielding range RunRequests would use this path."
        )
    return Section(TITLE, rows, notes, raw)
