"""Downstream calls at concurrency: delivery_retry and notification_publish against the real
simulator process (``qo-ops downstream --latency-ms 20``), beside the fastest bare client
measured against the same simulator at the same concurrency in the same run.

Per job and concurrency (32, 64), alternating bare client and job, ``profile.repeats`` times:

* the job: ``run_job`` (the real job, the real PostgreSQL) in a fresh process of its own
  (``--job-process``), on a ``CREATE DATABASE … TEMPLATE`` clone holding
  ``profile.downstream_items`` due items of one tenant. Its rate is deliveries ÷ the run's
  own ``duration_ms``; its CPU is that process's CPU time (every thread) during ``run_job``
  ÷ deliveries — the interpreter's start-up and imports are not in it. Verified afterwards:
  every item delivered/published after exactly one attempt, and the simulator holds each
  exactly once from one request each.
* the limit: :func:`bare_rate` — no qo-ops, no database: keep-alive connections posting the
  same requests, the fastest of ``bench/bare_client.py``'s three kinds (asyncio raw streams,
  a thread per ``http.client`` connection, a thread per raw socket), verified the same way on
  the simulator's counters.
* the ideal: concurrency ÷ latency (every call exactly the added latency, always
  ``concurrency`` in flight).

The simulator is one process for the section, reset (``/admin/reset``) before each
measurement; its CPU per request is reported beside, since on 2 cores it shares the machine
with the client, the job and PostgreSQL.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import uuid
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import URL

from bench.bare_client import BareRequest, bare_run
from bench.bench_delivery_retry import LOAD_SQL as DELIVERY_LOAD_SQL
from bench.common import REPO, cloned_database, engine_for, env_url, fresh_database, settle
from bench.delivery_simulator import Simulator, simulator, wait_quiet
from bench.fleet_rate_limit import fleet_note, fleet_row, measure_fleet
from bench.suite import Profile, Row, Section, Spread, median, pairwise_ratios

TITLE = "Downstream calls at concurrency"
TENANT = "tenant-001"
PREFIX = "qo_ops_bench_downstream"
LATENCY_MS = 20
CONCURRENCIES = (32, 64)
GOAL_RATIO = 0.85  # job ÷ the fastest bare client, same simulator, same concurrency
GOAL_CPU_MS = 0.25  # qo-ops CPU per delivery (issue 44)


# ---------------------------------------------------------------------- the two jobs

EVENT_LOAD_SQL = """
INSERT INTO tenant (id, name) VALUES ('tenant-001', 'bench');
INSERT INTO outbox_event (id, business_key, tenant_id, aggregate_type, aggregate_id, event_type,
                          payload, created_at, available_at)
SELECT md5('bench/event/' || i)::uuid, 'order:' || i || ':submitted', 'tenant-001', 'order',
       i::text, 'OrderSubmitted',
       jsonb_build_object('order_number', 'ORD-' || lpad(i::text, 8, '0'),
                          'notify', 'order_confirmation'),
       now() - interval '1 hour', now() - interval '1 hour' + make_interval(secs => i / 1000.0)
  FROM generate_series(1::bigint, {n}) AS i;
"""

DELIVERY_VERIFY_SQL = """
SELECT count(*) FILTER (WHERE status = 'DELIVERED' AND attempt_count = 1)
  FROM delivery_attempt_item WHERE tenant_id = 'tenant-001'
"""
EVENT_VERIFY_SQL = """
SELECT count(*) FILTER (WHERE published_at IS NOT NULL AND publish_attempts = 1)
  FROM outbox_event WHERE tenant_id = 'tenant-001'
"""


@dataclass(frozen=True)
class Kind:
    """One job and the request it sends, as the bare client sends it too."""

    job: str
    load_sql: str
    verify_sql: str  # items done after exactly one attempt
    path: str
    status: int  # the simulator's answer to a new item
    distinct: str  # simulator counters: items stored, requests received, duplicates
    requests: str
    duplicates: str

    def body(self, key: str) -> tuple[bytes, dict[str, str]]:
        """The bare request for a fresh ``key``: JSON body and extra headers."""
        doc: dict[str, Any]
        if self.path == "/notifications":
            doc = {"event_id": key, "event_type": "OrderSubmitted", "tenant_id": TENANT}
            doc["payload"] = {"order_number": key, "notify": "order_confirmation"}
            return json.dumps(doc).encode(), {}
        payload = {"kind": "fulfilment_request", "order_number": key, "lines": 1}
        doc = {"tenant_id": TENANT, "order_number": key, "payload": payload}
        return json.dumps(doc).encode(), {"Idempotency-Key": key}

    @property
    def request(self) -> BareRequest:
        """What the bare client posts for this job."""
        return BareRequest(self.path, self.body, self.status)


KINDS = (
    Kind(
        "delivery_retry", DELIVERY_LOAD_SQL, DELIVERY_VERIFY_SQL, "/fulfilment/deliveries", 201,
        "deliveries_distinct", "delivery_requests", "duplicates_suppressed",
    ),
    Kind(
        "notification_publish", EVENT_LOAD_SQL, EVENT_VERIFY_SQL, "/notifications", 202,
        "notifications_distinct", "notification_requests", "notification_duplicates",
    ),
)  # fmt: skip


def verify_simulator(sim: Simulator, kind: Kind, n: int, label: str) -> dict[str, Any]:
    """Exactly ``n`` items stored from ``n`` requests, no duplicate, no fault."""
    stats = sim.stats()
    if not (
        stats[kind.distinct] == stats[kind.requests] == n
        and stats[kind.duplicates] == 0
        and not any(stats["faults_injected"].values())
    ):
        raise SystemExit(f"{label}: simulator verification failed: {stats} (expected {n})")
    return {k: stats[k] for k in (kind.distinct, kind.requests, kind.duplicates)}


# ---------------------------------------------------------------------- the bare client


# the bare client's kinds, by the name the notes give them
BARE_CLIENTS = {
    "asyncio": "asyncio",
    "http.client threads": "threads",
    "raw socket threads": "sockets",
}


def bare_rate(
    sim: Simulator, concurrency: int, n: int, kind: Kind, quiet: bool = True
) -> dict[str, Any]:
    """The limit: the fastest bare client (no qo-ops, no database) posting ``n`` of
    ``kind``'s requests to ``sim`` at ``concurrency``; each client verified on the
    simulator's counters. Requests/s of the fastest, and of each."""
    clients: dict[str, dict[str, float]] = {}
    busy = []
    for name, client in BARE_CLIENTS.items():
        sim.client.reset()
        busy.append(wait_quiet() if quiet else 0.0)
        sim_cpu = sim.cpu_s()
        run = bare_run(sim.url, concurrency, count=n, kind=client, request=kind.request)
        verify_simulator(sim, kind, n, f"bare {name}")
        clients[name] = {
            "per_s": run.per_s,
            "client_cpu_ms": 1000 * run.client_cpu_s / n,
            "simulator_cpu_ms": 1000 * (sim.cpu_s() - sim_cpu) / n,
        }
    best = max(clients, key=lambda c: clients[c]["per_s"])
    return {"per_s": clients[best]["per_s"], "client": best, "clients": clients, "busy": max(busy)}


# ---------------------------------------------------------------------- the job


def job_process(job: str, concurrency: int, batch_size: int | None) -> dict[str, Any]:
    """In the job's own process (``--job-process``): one ``run_job`` as the CLI runs it
    (``QO_OPS_DATABASE_URL``, ``QO_OPS_DOWNSTREAM_URL``); its summary, and this process's CPU
    seconds (all threads) and context switches during it."""
    from qo_ops.db.engine import get_engine
    from qo_ops.jobs.catalog import get_spec
    from qo_ops.platform.job.options import RunOptions
    from qo_ops.platform.job.scope import Scope
    from qo_ops.platform.observability.events import configure_event_logging
    from qo_ops.platform.run.runner import run_job

    options = RunOptions(
        mode="execute",
        trigger="manual",
        batch_size=batch_size,
        concurrency=concurrency,
        requester="bench",
        reason="bench: downstream calls at concurrency",
        correlation_id=str(uuid.uuid4()),
    ).validated()
    engine = get_engine()
    configure_event_logging()
    before = resource.getrusage(resource.RUSAGE_SELF)
    summary = run_job(get_spec(job), Scope(TENANT), options, engine=engine)
    after = resource.getrusage(resource.RUSAGE_SELF)
    engine.dispose()
    return {
        "summary": summary.as_dict(),
        "cpu_s": (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime),
        "context_switches": (after.ru_nvcsw + after.ru_nivcsw)
        - (before.ru_nvcsw + before.ru_nivcsw),
    }


def run_job_measured(
    kind: Kind,
    template: URL,
    sim: Simulator,
    n: int,
    concurrency: int,
    batch_size: int | None = None,
    quiet: bool = True,
) -> dict[str, Any]:
    """The job in a fresh process on a clone of ``template``; verified afterwards."""
    label = f"{kind.job} c={concurrency}"
    with cloned_database(template, f"{PREFIX}_run") as url:
        settle(url)
        sim.client.reset()
        env = {k: v for k, v in os.environ.items() if not k.startswith("QO_OPS_")}
        env.update(QO_OPS_DATABASE_URL=env_url(url), QO_OPS_DOWNSTREAM_URL=sim.url)
        cmd = [sys.executable, "-m", "bench.section_downstream", "--job-process", kind.job]
        cmd += [str(concurrency), str(batch_size or 0)]
        busy = wait_quiet() if quiet else 0.0  # the share of the cores others kept busy
        sim_cpu = sim.cpu_s()
        proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, check=False)
        sim_cpu = sim.cpu_s() - sim_cpu
        if proc.returncode != 0:
            raise SystemExit(f"{label}: job process failed: {proc.stderr[-3000:]}")
        out = json.loads(proc.stdout.splitlines()[-1])
        s = out["summary"]
        failed = [c["name"] for c in s["checks"] if not c["passed"]]
        if s["status"] != "success" or s["succeeded_count"] != n or failed:
            raise SystemExit(f"{label}: did not do the work: {json.dumps(s)[:2000]}")
        engine = engine_for(url)
        with engine.connect() as conn:
            once = conn.execute(sa.text(kind.verify_sql)).scalar()
        engine.dispose()
        if once != n:
            raise SystemExit(f"{label}: {once} of {n} items done after exactly one attempt")
        verified = verify_simulator(sim, kind, n, label)
    seconds = s["duration_ms"] / 1000
    return {
        "per_s": n / seconds,
        "seconds": seconds,
        "cpu_ms": 1000 * out["cpu_s"] / n,
        "context_switches_per_delivery": out["context_switches"] / n,
        "simulator_cpu_ms": 1000 * sim_cpu / n,
        "batches": s["batches"],
        "batch_ms_p50": s["batch_ms_p50"],
        "busy": busy,
        "verified": verified,
    }


# ---------------------------------------------------------------------- the section


def _rate(value: float) -> str:
    return f"{value:,.0f}/s"


def run(profile: Profile) -> Section:
    n = profile.downstream_items
    quiet = profile.name != "quick"  # a smoke run keeps no figure: no waiting for idle cores
    results: dict[str, dict[str, Any]] = {}
    with simulator(LATENCY_MS) as sim:
        for kind in KINDS:
            with fresh_database(f"{PREFIX}_{kind.job[:12]}_tpl") as template:
                engine = engine_for(template)
                with engine.begin() as conn:
                    conn.exec_driver_sql(kind.load_sql.format(n=n))
                with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                    conn.exec_driver_sql("VACUUM ANALYZE")
                engine.dispose()
                for concurrency in CONCURRENCIES:
                    key = f"{kind.job} c={concurrency}"
                    runs: dict[str, list[dict[str, Any]]] = {"job": [], "bare": []}
                    for i in range(profile.repeats):  # alternating which goes first
                        order = ("bare", "job") if i % 2 == 0 else ("job", "bare")
                        for what in order:
                            if what == "bare":
                                runs["bare"].append(bare_rate(sim, concurrency, n, kind, quiet))
                            else:
                                runs["job"].append(
                                    run_job_measured(
                                        kind, template, sim, n, concurrency, None, quiet
                                    )
                                )
                    results[key] = runs
                    job, bare = runs["job"], runs["bare"]
                    print(
                        f"   {key}: job {median([r['per_s'] for r in job]):,.0f}/s "
                        f"({median([r['cpu_ms'] for r in job]):.2f} ms CPU each), bare "
                        f"{median([r['per_s'] for r in bare]):,.0f}/s, ideal "
                        f"{concurrency / (LATENCY_MS / 1000):,.0f}/s",
                        flush=True,
                    )
    rows: list[Row] = []
    notes: list[str] = []
    for kind in KINDS:
        for concurrency in CONCURRENCIES:
            key = f"{kind.job} c={concurrency}"
            job, bare = results[key]["job"], results[key]["bare"]
            job_rate = median([r["per_s"] for r in job])
            limit = Spread.of([r["per_s"] for r in bare])
            # repeat i's job and bare client ran back to back, in alternating order
            ratio = pairwise_ratios([r["per_s"] for r in job], [r["per_s"] for r in bare])
            cpu_ms = Spread.of([r["cpu_ms"] for r in job])
            ideal = concurrency / (LATENCY_MS / 1000)
            size = f"{n:,} items, c={concurrency}, +{LATENCY_MS} ms"
            rows.append(
                Row(
                    what=f"{kind.job}: deliveries/s through run_job",
                    size=size,
                    figure=Spread.of([r["per_s"] for r in job]).show(_rate),
                    limit=f"{limit.show(_rate)} (fastest bare client; ideal {_rate(ideal)})",
                    ratio=ratio.mid,
                    goal=f">= {GOAL_RATIO}",
                    met=ratio.mid >= GOAL_RATIO,
                    ratio_range=ratio.range,
                )
            )
            rows.append(
                Row(
                    what=f"{kind.job}: qo-ops CPU per delivery",
                    size=size,
                    figure=cpu_ms.show(lambda v: f"{v:.2f}") + " ms",
                    limit=f"{GOAL_CPU_MS} ms",
                    ratio=None,
                    goal=f"<= {GOAL_CPU_MS} ms",
                    met=cpu_ms.mid <= GOAL_CPU_MS,
                )
            )
            clients = ", ".join(
                f"{name} {median([b['clients'][name]['per_s'] for b in bare]):,.0f}/s"
                for name in BARE_CLIENTS
            )
            notes.append(
                f"{key}: job ÷ ideal {job_rate / ideal:.2f}; bare clients {clients}; simulator CPU per request "
                f"{median([r['simulator_cpu_ms'] for r in job]):.2f} ms under the job, "
                f"{median([b['clients'][b['client']]['simulator_cpu_ms'] for b in bare]):.2f} ms "
                f"under the fastest bare client; job batches "
                f"{median([r['batches'] for r in job]):.0f}, batch p50 "
                f"{median([r['batch_ms_p50'] for r in job]):,.0f} ms; context switches per "
                f"delivery {median([r['context_switches_per_delivery'] for r in job]):.1f}; "
                f"other work kept up to {200 * max(r['busy'] for r in job + bare):.0f}% of the "
                "200% busy just before a measurement"
            )
    notes.insert(
        0,
        f"Against one `qo-ops downstream --latency-ms {LATENCY_MS}` process (reset before each "
        "measurement). The job: `run_job` in a process of its own on a clone of the loaded "
        "database (default batch size), rate = items ÷ the run's duration_ms, CPU = that "
        "process's CPU time during run_job ÷ items. The limit: the fastest of an asyncio "
        "raw-stream client, a thread per keep-alive `http.client` connection and a thread "
        "per raw keep-alive socket (`bench/bare_client.py`), no qo-ops and no database, "
        "measured in the same run. Verified: every item done after one attempt, and the "
        "simulator holds each once from one request.",
    )
    fleet = measure_fleet()  # one rate limit for 8 runs at once (bench/fleet_rate_limit.py)
    rows.append(fleet_row(fleet))
    notes.append(fleet_note(fleet))
    return Section(TITLE, rows, notes, raw={"items": n, "runs": results, "fleet": fleet})


if __name__ == "__main__":
    if sys.argv[1:2] == ["--job-process"]:
        name, conc, batch = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
        print(json.dumps(job_process(name, conc, batch or None), default=str))
