"""The orchestration section's data and its limit: tenants of quotes loaded once into a
template, the quotes each tenant set has eligible, the check that a measurement did the work,
and (c) ``run_job`` over the same tenants in a loop in one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import UTC, date, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import URL

from bench.common import REPO, cloned_database, engine_for, env_url, settle, stopwatch

JOB = "quote_expiration"
QUOTES_PER_TENANT = 200  # 10 eligible per tenant: small work, so orchestration shows
PREFIX = "qo_ops_bench_orch"
YEARS_OF_DAYS = 3


def tenant_key(k: int) -> str:
    return f"tenant-{k:05d}"


def partition_start() -> date:
    """The first day partition of the deployment: 3 years back, as a 3-year-old one has."""
    today = datetime.now(UTC).date()
    return today.replace(year=today.year - YEARS_OF_DAYS, day=1)


# ------------------------------------------------------------------ data

# k tenants from :first; 200 quotes each: every 20th ACTIVE past expiry (10 a tenant), the
# rest ACTIVE until later, ACCEPTED, CANCELLED or DRAFT (no EXPIRED quote without its event)
LOAD_SQL = """
INSERT INTO tenant (id, name)
SELECT 'tenant-' || lpad(t::text, 5, '0'), 'bench'
  FROM generate_series(CAST(:first AS int), CAST(:last AS int)) AS t;
INSERT INTO quote (id, tenant_id, quote_number, customer_ref, status, currency, total_amount,
                   price_book_version, created_at, updated_at, expires_at)
SELECT (t - 1) * CAST(:q AS bigint) + i, 'tenant-' || lpad(t::text, 5, '0'), 'Q-' || i,
       'c-' || (i % 97),
       CASE WHEN i % 20 < 12 THEN 'ACTIVE' WHEN i % 20 < 17 THEN 'ACCEPTED'
            WHEN i % 20 < 19 THEN 'CANCELLED' ELSE 'DRAFT' END,
       'EUR', (i % 1000) * 10.0, 1, c, c,
       CASE WHEN i % 20 = 0 THEN now() - make_interval(mins => 5 + i) ELSE c + interval '400 days' END
  FROM generate_series(CAST(:first AS int), CAST(:last AS int)) AS t,
       generate_series(1, CAST(:q AS int)) AS i,
       LATERAL (SELECT now() - make_interval(days => 1 + i % 60) AS c) AS cc;
"""


def load(url: URL, tenants: int) -> float:
    from qo_ops.demo.data import _bulk_load

    engine = engine_for(url)
    with stopwatch() as took:
        with engine.begin() as conn:
            conn.exec_driver_sql("SET LOCAL synchronous_commit = off")
            with _bulk_load(conn, ["quote"]):
                for statement in LOAD_SQL.split(";\n"):
                    if statement.strip():
                        conn.execute(
                            sa.text(statement),
                            {"first": 1, "last": tenants, "q": QUOTES_PER_TENANT},
                        )
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql("VACUUM ANALYZE")
    engine.dispose()
    return took[0]


def eligible(url: URL, tenants: list[str]) -> int:
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


def verify(url: URL, tenants: list[str], expected: int, dagster_ids: list[str] | None) -> dict:
    """Every eligible quote of ``tenants`` expired; one final execute job_run per tenant,
    success, written by ``dagster_ids`` (the measured Dagster runs) when given."""
    engine = engine_for(url)
    with engine.connect() as conn:
        left = conn.scalar(
            sa.text(
                "SELECT count(*) FROM quote WHERE tenant_id = ANY(:t) AND status = 'ACTIVE' "
                "AND expires_at < now()"
            ),
            {"t": tenants},
        )
        rows = conn.execute(
            sa.text(
                "SELECT status, count(*) AS n, count(DISTINCT scope) AS scopes, "
                "coalesce(sum(succeeded_count), 0) AS mutated, "
                "count(*) FILTER (WHERE dagster_run_id = ANY(:ids)) AS ours "
                "FROM job_run WHERE job_name = :job AND mode = 'execute' AND scope = ANY(:t) "
                "GROUP BY status"
            ),
            {"job": JOB, "t": tenants, "ids": dagster_ids or []},
        ).all()
    engine.dispose()
    by_status = {r.status: int(r.n) for r in rows}
    mutated = sum(int(r.mutated) for r in rows)
    ours = sum(int(r.ours) for r in rows)
    ok = (
        left == 0
        and by_status == {"success": len(tenants)}
        and sum(int(r.scopes) for r in rows) == len(tenants)
        and mutated == expected
        and (dagster_ids is None or ours == len(tenants))
    )
    if not ok:
        raise AssertionError(
            f"wrong work: {left} eligible left, job runs {by_status} for {len(tenants)} "
            f"tenants ({ours} by the measured Dagster runs), expired {mutated} (expected "
            f"{expected})"
        )
    return {"runs_by_status": by_status, "expired": mutated}


# ------------------------------------------------------------------ (c) one process

_LOOP = """
import json, sys, time
import sqlalchemy as sa
from qo_ops.jobs.catalog import CATALOG
from qo_ops.platform.run.runner import run_job
from qo_ops.platform.job.options import RunOptions
from qo_ops.platform.job.scope import Scope
url, job, tenants = sys.argv[1], sys.argv[2], json.loads(sys.stdin.read())
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


def one_process(url: URL, tenants: list[str]) -> dict[str, Any]:
    """``run_job`` for each tenant in one fresh process: wall time, start-up included."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("QO_OPS_")}
    settle(url)
    with stopwatch() as t:
        proc = subprocess.run(
            [sys.executable, "-c", _LOOP, env_url(url), JOB],
            input=json.dumps(tenants),  # on stdin: 10,000 tenants exceed an argument's size
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


def loops(template: URL, sets: dict[str, list[str]], expected: dict[str, int], i: int) -> dict:
    """(c) for every tenant set, on one clone of the template."""
    out = {}
    with cloned_database(template, f"{PREFIX}_loop_{i}") as url:
        for name, tenants in sets.items():
            r = one_process(url, tenants)
            r.update(verify(url, tenants, expected[name], None))
            out[name] = r
            print(
                f"   run_job loop {name} ({len(tenants)} tenants): {r['wall_s']:.1f} s", flush=True
            )
    return out
