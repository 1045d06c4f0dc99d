"""One rate limit for the fleet: 8 runs of delivery_retry at once, one per tenant, each in a
process of its own, against one fleet limit (``QO_OPS_DOWNSTREAM_RATE_LIMIT=200``) kept in
PostgreSQL, for about 20 s (the items are sized so the fleet needs that long at the limit).

What is measured is what reaches the simulator, in its own whole seconds (``/admin/stats``
``rate_limit_per_s``): the first and last seconds, partly outside the runs, are left out.
The simulator's own limit is set to twice the fleet's, so it counts what the fleet sends
rather than enforcing the limit itself; a 429 would show there as refused.

Verified: every run ends ``success`` having delivered its tenant's items after one attempt.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from typing import Any

import sqlalchemy as sa

from bench.common import REPO, engine_for, env_url, fresh_database, settle
from bench.delivery_simulator import simulator
from bench.suite import Row

FLEET_RATE = 200.0  # calls a second, for the 8 runs together
RUNS = 8
SECONDS = 20
CONCURRENCY = 16  # each run could send far more than its share: 16 ÷ 20 ms = 800/s
LATENCY_MS = 20
GOAL = 1.10  # what reaches the simulator in any second ÷ the fleet limit
PREFIX = "qo_ops_bench_fleet_rate"
ITEMS_PER_TENANT = int(FLEET_RATE * SECONDS / RUNS)

LOAD_SQL = """
INSERT INTO tenant (id, name)
SELECT 'tenant-' || lpad(t::text, 3, '0'), 'bench' FROM generate_series(1, {runs}) AS t;
INSERT INTO customer_order (id, tenant_id, order_number, status, total_amount, line_count,
                            submitted_at, updated_at)
SELECT i, 'tenant-' || lpad((1 + mod(i, {runs}))::text, 3, '0'), 'ORD-' || lpad(i::text, 8, '0'),
       'SUBMITTED', mod(i, 100000) / 100.0, 1 + mod(i, 5), now() - interval '2 hours',
       now() - interval '2 hours'
  FROM generate_series(1::bigint, {n}) AS i;
INSERT INTO delivery_attempt_item (id, tenant_id, business_key, order_id, status, attempt_count,
                                   max_attempts, next_attempt_at, payload, created_at, updated_at)
SELECT gen_random_uuid(), o.tenant_id, 'fulfil:' || o.order_number, o.id, 'READY', 0, 8,
       now() - interval '1 hour',
       jsonb_build_object('kind', 'fulfilment_request', 'order_number', o.order_number,
                          'lines', o.line_count),
       now() - interval '1 hour', now() - interval '1 hour'
  FROM customer_order AS o;
"""


def run_process(tenant: str, start_at: float) -> dict[str, Any]:
    """In a run's own process (``--run-process``): wait for the common start, then one
    ``run_job`` of delivery_retry for ``tenant`` as the CLI runs it (the environment's
    database, downstream and rate limit); its summary."""
    from qo_ops.db.engine import get_engine
    from qo_ops.jobs.catalog import get_spec
    from qo_ops.platform.job.options import RunOptions
    from qo_ops.platform.job.scope import Scope
    from qo_ops.platform.run.runner import run_job

    options = RunOptions(
        mode="execute",
        trigger="manual",
        concurrency=CONCURRENCY,
        requester="bench",
        reason="bench: one rate limit for the fleet",
        correlation_id=str(uuid.uuid4()),
    ).validated()
    engine = get_engine()
    time.sleep(max(0.0, start_at - time.time()))
    summary = run_job(get_spec("delivery_retry"), Scope(tenant), options, engine=engine)
    engine.dispose()
    return summary.as_dict()


def measure_fleet() -> dict[str, Any]:
    """The 8 runs against a fresh simulator and a fresh database; the simulator's seconds."""
    n = ITEMS_PER_TENANT * RUNS
    with fresh_database(f"{PREFIX}_db") as url:
        engine = engine_for(url)
        with engine.begin() as conn:
            conn.exec_driver_sql(LOAD_SQL.format(runs=RUNS, n=n))
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql("VACUUM ANALYZE")
        settle(url)
        with simulator(LATENCY_MS, "--rate-limit", str(2 * FLEET_RATE)) as sim:
            env = {k: v for k, v in os.environ.items() if not k.startswith("QO_OPS_")}
            env.update(
                QO_OPS_DATABASE_URL=env_url(url),
                QO_OPS_DOWNSTREAM_URL=sim.url,
                QO_OPS_DOWNSTREAM_RATE_LIMIT=str(FLEET_RATE),
            )
            start_at = time.time() + 5.0  # every process has imported what it needs by then
            procs = [
                subprocess.Popen(
                    [sys.executable, "-m", "bench.fleet_rate_limit", "--run-process"]
                    + [f"tenant-{t:03d}", str(start_at)],
                    env=env,
                    cwd=REPO,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                for t in range(1, RUNS + 1)
            ]
            summaries = []
            for proc in procs:
                out, err = proc.communicate(timeout=600)
                if proc.returncode != 0:
                    raise SystemExit(f"fleet rate limit: a run failed: {err[-3000:]}")
                summaries.append(json.loads(out.splitlines()[-1]))
            stats = sim.stats()
        with engine.connect() as conn:
            once = conn.scalar(
                sa.text(
                    "SELECT count(*) FILTER (WHERE status = 'DELIVERED' AND attempt_count = 1) "
                    "FROM delivery_attempt_item"
                )
            )
        engine.dispose()
    bad = [s for s in summaries if s["status"] != "success"]
    if bad or once != n:
        raise SystemExit(
            f"fleet rate limit: {once} of {n} delivered once; {json.dumps(bad)[:2000]}"
        )
    seconds = stats["rate_limit_per_s"][1:-1]  # whole seconds inside the runs
    arrived = [s["admitted"] + s["rate_limited"] for s in seconds]
    return {
        "items": n,
        "seconds": len(seconds),
        "admitted_per_s": [s["admitted"] for s in seconds],
        "refused": sum(s["rate_limited"] for s in stats["rate_limit_per_s"]),
        "arrived_max": max(arrived),
        "arrived_mean": sum(arrived) / len(arrived),
        "wait_ms": sum(int(s["tally"].get("downstream.rate_limit_wait_ms", 0)) for s in summaries),
        "run_seconds": [s["duration_ms"] / 1000 for s in summaries],
    }


def fleet_row(result: dict[str, Any]) -> Row:
    """The table's row: what reached the simulator per second, max and mean, ÷ the limit."""
    admitted = result["admitted_per_s"]
    mean = sum(admitted) / len(admitted)
    ratio = result["arrived_max"] / FLEET_RATE
    return Row(
        what=f"{RUNS} concurrent delivery_retry runs, one fleet limit: admitted/s at the simulator",
        size=f"{RUNS} processes × c={CONCURRENCY}, {result['seconds']} whole s, +{LATENCY_MS} ms",
        figure=f"max {max(admitted)}/s, mean {mean:,.1f}/s, {result['refused']} refused",
        limit=f"{FLEET_RATE:,.0f}/s (QO_OPS_DOWNSTREAM_RATE_LIMIT)",
        ratio=ratio,
        goal=f"<= {GOAL:.2f} of the limit",
        met=ratio <= GOAL and result["refused"] == 0,
    )


def fleet_note(result: dict[str, Any]) -> str:
    """How the row was measured, and the figures behind it."""
    return (
        f"Fleet rate limit: {RUNS} runs of delivery_retry (one tenant each, "
        f"{ITEMS_PER_TENANT} items each), each `run_job` in a process of its own, all with "
        f"QO_OPS_DOWNSTREAM_RATE_LIMIT={FLEET_RATE:.0f} and concurrency {CONCURRENCY}, against "
        f"one simulator (+{LATENCY_MS} ms) whose own limit is {2 * FLEET_RATE:.0f}/s, so it "
        "counts what the fleet sends. Counted in the simulator's whole seconds inside the runs "
        f"(first and last left out): admitted/s {result['admitted_per_s']}; what arrived "
        f"(admitted + refused) at most {result['arrived_max']}/s, the ratio. The runs took "
        f"{min(result['run_seconds']):.1f}–{max(result['run_seconds']):.1f} s; their workers "
        f"waited {result['wait_ms'] / 1000:,.0f} s for tokens in all. Verified: every item "
        "delivered after one attempt, every run `success`."
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--run-process"]:
        print(json.dumps(run_process(sys.argv[2], float(sys.argv[3])), default=str))
    else:
        measured = measure_fleet()
        print(json.dumps(measured), flush=True)
        print(fleet_row(measured))
