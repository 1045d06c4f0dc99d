"""How fast `qo-ops run quote_expiration --mode execute` expires 1,000,000 quotes, and how
much memory it needs for that compared with 10,000.

Baseline, in the same run on identical data: the job's own selection (``SPEC.eligible``,
every eligible quote of the tenant, no LIMIT) and its own transition, EXPIRE_QUOTE_BATCH,
over all of them at once in one transaction (every quote expired, its QuoteExpired outbox
event inserted; no batching) — the physical limit of this server for the work. The job does the same work in bounded batch
transactions (lease guard, select FOR UPDATE SKIP LOCKED, transition, run counters); the
ratio job/baseline says what the batching costs.

Data: one tenant, N quotes, all ACTIVE and past expiry (expires_at = created_at + 7, 14,
30 or 90 days, so expiry order interleaves creation order), built once with INSERT … SELECT
generate_series, then VACUUM ANALYZE, and cloned with CREATE DATABASE … TEMPLATE so the
baseline and the job start from the same bytes. Every measured run is verified afterwards
(no ACTIVE quote past expiry left, exactly one QuoteExpired event per quote). Each
measurement starts after a CHECKPOINT, with the previous measurement's database dropped
and no autovacuum worker busy (2 cores: a leftover vacuum would skew the next figure).

Peak RSS of the qo-ops process is measured per run by a fresh helper process that starts
it and reads getrusage(RUSAGE_CHILDREN).ru_maxrss, so no maximum mixes two runs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import URL, Connection, Engine

from bench.common import (
    REPO,
    RSS_HELPER,
    cloned_database,
    engine_for,
    fresh_database,
    print_table,
    settle,
    stopwatch,
)
from qo_ops.db.arrays import int_array
from qo_ops.jobs.quote_expiration import EXPIRE_QUOTE_BATCH, SPEC
from qo_ops.platform.job.outcome import BatchContext
from qo_ops.platform.job.scope import Scope

TENANT = "tenant-001"
BIG, SMALL = 1_000_000, 10_000
BATCH = SPEC.defaults.batch_size  # the job runs with its default
PREFIX = "qo_ops_bench_qexp"
GOAL_RATIO, GOAL_RSS_RATIO, GOAL_P99_MS = 0.7, 1.2, 250.0

# One tenant, n quotes, all ACTIVE and expired: created 500..100 days ago, valid for
# 7/14/30/90 days (scattered by id), so expiry order is not id order.
LOAD_SQL = """
INSERT INTO tenant (id, name) VALUES ('tenant-001', 'bench');
INSERT INTO quote (id, tenant_id, quote_number, customer_ref, status, total_amount,
                   price_book_version, created_at, updated_at, expires_at)
SELECT i, 'tenant-001', 'Q-' || i, 'c-' || mod(i, 997), 'ACTIVE', mod(i, 100000) / 100.0, 1,
       c, c, c + (ARRAY[7, 14, 30, 90])[1 + mod(i * 7919, 4)] * interval '1 day'
  FROM generate_series(1::bigint, {n}) AS i,
       LATERAL (SELECT now() - interval '500 days'
                       + make_interval(secs => i * 34560000.0 / {n})) AS t(c);
"""

VERIFY_SQL = sa.text(
    """
    SELECT (SELECT count(*) FROM quote
             WHERE tenant_id = :tenant AND status = 'ACTIVE' AND expires_at < now()) AS overdue,
           (SELECT count(*) FROM quote
             WHERE tenant_id = :tenant AND status = 'EXPIRED' AND version = 2) AS expired,
           (SELECT count(*) FROM outbox_event) AS events,
           (SELECT count(DISTINCT aggregate_id) FROM outbox_event
             WHERE event_type = 'QuoteExpired' AND aggregate_type = 'quote') AS quotes_with_event
    """
)


def load(url: URL, n: int) -> float:
    """Fill a migrated database with one tenant and ``n`` expired ACTIVE quotes."""
    engine = engine_for(url)
    with stopwatch() as took:
        with engine.begin() as conn:
            conn.exec_driver_sql(LOAD_SQL.format(n=n))
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql("VACUUM ANALYZE")
    engine.dispose()
    return took[0]


def verify(url: URL, n: int, label: str) -> dict[str, int]:
    """The work was really done: no overdue ACTIVE quote, one QuoteExpired event each."""
    engine = engine_for(url)
    with engine.connect() as conn:
        row = conn.execute(VERIFY_SQL, {"tenant": TENANT}).one()._asdict()
    engine.dispose()
    ok = row["overdue"] == 0 and row["expired"] == row["events"] == row["quotes_with_event"] == n
    if not ok:
        raise SystemExit(f"{label}: verification failed: {row} (expected {n} of each, 0 overdue)")
    return row


def expire_all_at_once(conn: Connection) -> Any:
    """(a) The physical limit: the job's own selection, every eligible quote, then its own
    EXPIRE_QUOTE_BATCH over all of them at once."""
    ctx = BatchContext(SPEC.name, Scope(TENANT), "execute", uuid.uuid4())
    ids = list(conn.execute(SPEC.eligible(ctx)).scalars())
    params = {"ids": int_array(ids), "tenant": TENANT, "last_id": ids[-1]}
    return conn.execute(EXPIRE_QUOTE_BATCH, params).one()


def run_set_based(url: URL, n: int) -> dict[str, Any]:
    """(a) One statement for everything, timed to its commit."""
    settle(url)
    engine = engine_for(url)
    with stopwatch() as took, engine.begin() as conn:
        row = expire_all_at_once(conn)
    engine.dispose()
    if row.expired != n or row.events != n:
        raise SystemExit(f"set-based: expired {row.expired}, events {row.events}, expected {n}")
    return {"rows": n, "seconds": took[0], "verified": verify(url, n, "set-based")}


def _selection(engine: Engine, lock: bool) -> tuple[str, dict[str, Any]]:
    """The job's batch selection, compiled as the job sends it (bound parameters)."""
    ctx = BatchContext(SPEC.name, Scope(TENANT), "execute", uuid.uuid4())
    query = SPEC.eligible(ctx).limit(BATCH)
    if lock:
        query = query.with_for_update(skip_locked=True)
    compiled = query.compile(dialect=engine.dialect)
    return str(compiled), dict(compiled.params)


def _print_plan(title: str, statement: str, plan: list[str]) -> None:
    print(f"\n{title}:\n  {' '.join(statement.split())}")
    for line in plan:  # an id list can be thousands of characters: shortened on screen
        print(f"    {line if len(line) <= 200 else line[:200] + ' …'}")


def explain_batch(url: URL) -> dict[str, list[str]]:
    """EXPLAIN (ANALYZE, BUFFERS) of one batch as the job issues it, then rolled back.

    The selection is the job's own statement (SPEC.eligible + LIMIT + FOR UPDATE SKIP
    LOCKED, same bound parameters), the transition is EXPIRE_QUOTE_BATCH itself.
    """
    engine = engine_for(url)
    sql, params = _selection(engine, lock=True)
    explain = "EXPLAIN (ANALYZE, BUFFERS) "
    with engine.connect() as conn, conn.begin() as tx:
        select_plan = list(conn.exec_driver_sql(explain + sql, params).scalars())
        ids = list(conn.exec_driver_sql(sql, params).scalars())
        update_plan = list(
            conn.execute(
                sa.text(explain + EXPIRE_QUOTE_BATCH.text),
                {"ids": ids, "tenant": TENANT, "last_id": ids[-1]},
            ).scalars()
        )
        tx.rollback()
    engine.dispose()
    _print_plan(
        "EXPLAIN (ANALYZE, BUFFERS) of the batch selection, before the run", sql, select_plan
    )
    _print_plan(
        f"EXPLAIN (ANALYZE, BUFFERS) of the batch transition ({len(ids)} ids), before the run",
        EXPIRE_QUOTE_BATCH.text,
        update_plan,
    )
    return {"select": select_plan, "update": update_plan}


def _explain_mid_run(engine: Engine, done: int) -> dict[str, Any]:
    """The selection, read-only (no FOR UPDATE: the running job is not disturbed)."""
    sql, params = _selection(engine, lock=False)
    with engine.connect() as conn:
        plan = conn.exec_driver_sql("EXPLAIN (ANALYZE, BUFFERS) " + sql, params).scalars()
        return {"processed": done, "statement": sql, "plan": list(plan)}


def run_job(url: URL, n: int, probe_at: int | None = None) -> dict[str, Any]:
    """(b) The real CLI in its own process (default batch size), with its peak RSS.

    With ``probe_at``, the selection is EXPLAINed once the run has processed that many.
    """
    settle(url)
    qo_ops = str(Path(sys.executable).with_name("qo-ops"))
    cmd = [qo_ops, "run", "quote_expiration", "--tenant", TENANT, "--mode", "execute"]
    cmd += ["--reason", "bench", "--json"]
    env = {
        **os.environ,
        "QO_OPS_DATABASE_URL": url.set(drivername="postgresql").render_as_string(
            hide_password=False
        ),
    }
    engine = engine_for(url)
    probe: dict[str, Any] | None = None
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "measured.json"
        helper = subprocess.Popen(
            [sys.executable, "-c", RSS_HELPER, json.dumps(cmd), result],
            env=env,
            start_new_session=True,  # its own process group: stopped with qo-ops on error
        )
        try:
            while helper.poll() is None:
                time.sleep(0.5)
                if probe_at is None or probe is not None:
                    continue
                with engine.connect() as conn:
                    done = conn.execute(
                        sa.text(
                            "SELECT processed_count FROM job_run "
                            "WHERE job_name = :job AND status = 'running'"
                        ),
                        {"job": SPEC.name},
                    ).scalar()
                if done is not None and done >= probe_at:
                    probe = _explain_mid_run(engine, done)
        except BaseException:
            os.killpg(helper.pid, signal.SIGTERM)
            helper.wait()
            raise
        if helper.returncode != 0:
            raise SystemExit(f"measuring helper failed ({helper.returncode})")
        measured = json.loads(result.read_text())
    engine.dispose()
    if measured["returncode"] != 0:
        raise SystemExit(
            f"qo-ops run failed ({measured['returncode']}): {measured['stderr'][-2000:]}"
        )
    summary = json.loads(measured["stdout"])
    failed_checks = [c for c in summary["checks"] if not c["passed"]]
    if summary["status"] != "success" or summary["processed_count"] != n or failed_checks:
        raise SystemExit(f"qo-ops run did not do the work: {json.dumps(summary)[:2000]}")
    progress = [
        {"elapsed_ms": e["elapsed_ms"], "processed": e["items.processed"]}
        for e in (json.loads(ln) for ln in measured["stderr"].splitlines() if ln.startswith("{"))
        if e.get("event.name") == "job.progress"
    ]
    return {
        "rows": n,
        "wall_s": measured["wall_s"],
        "peak_rss_kb": measured["maxrss_kb"],
        "summary": summary,
        "progress": progress,
        "mid_run_select": probe,
        "verified": verify(url, n, f"job at {n:,}"),
    }


def _mib(kb: int) -> str:
    return f"{kb / 1024:,.1f} MiB"


def _verdict(ok: bool) -> str:
    return "ok" if ok else "MISSED"


def main() -> None:
    started = time.perf_counter()
    print(f"quote_expiration bench ({time.strftime('%Y-%m-%d %H:%M')})")
    with fresh_database(f"{PREFIX}_tpl") as template:
        load_s = load(template, BIG)
        print(f"  {BIG:,} expired ACTIVE quotes loaded in {load_s:.1f} s")
        with cloned_database(template, f"{PREFIX}_job") as job_db:
            with fresh_database(f"{PREFIX}_small") as small:
                load(small, SMALL)
                job_small = run_job(small, SMALL)
            print(f"  (b) job at {SMALL:,}: {job_small['wall_s']:.1f} s, verified")

            with cloned_database(template, f"{PREFIX}_set") as set_db:
                set_based = run_set_based(set_db, BIG)
            print(f"  (a) set-based at {BIG:,}: {set_based['seconds']:.1f} s, verified")

            # on the template (same bytes as the job's clone), so the job's data is untouched
            plans = explain_batch(template)
            job_big = run_job(job_db, BIG, probe_at=BIG // 2)
            print(f"\n  (b) job at {BIG:,}: {job_big['wall_s']:.1f} s, verified")

    probe = job_big["mid_run_select"]
    if probe:
        _print_plan(
            f"EXPLAIN (ANALYZE, BUFFERS) of the selection (read-only) with "
            f"{probe['processed']:,} of {BIG:,} quotes done",
            probe["statement"],
            probe["plan"],
        )

    stages, previous = [], (0, 0)
    for p in job_big["progress"]:
        ms, done = p["elapsed_ms"] - previous[0], p["processed"] - previous[1]
        stages.append([f"{previous[1]:,} .. {p['processed']:,}", ms / 1000, done / (ms / 1000)])
        previous = (p["elapsed_ms"], p["processed"])
    if stages:
        print_table(
            f"(b) job at {BIG:,}: throughput along the run (its job.progress events)",
            ["quotes processed", "seconds", "rows/s"],
            stages,
        )

    s = job_big["summary"]
    a_rate = BIG / set_based["seconds"]
    b_rate = s["processed_count"] / (s["duration_ms"] / 1000)
    b_wall_rate = BIG / job_big["wall_s"]
    ratio, wall_ratio = b_rate / a_rate, b_wall_rate / a_rate
    rss_ratio = job_big["peak_rss_kb"] / job_small["peak_rss_kb"]
    print_table(
        f"quote_expiration, {BIG:,} expired ACTIVE quotes, batch size {BATCH} "
        f"({time.strftime('%Y-%m-%d %H:%M')})",
        ["measure", "value", "goal", ""],
        [
            ["(a) set-based statement: seconds", set_based["seconds"], "", ""],
            ["(a) set-based statement: rows/s", a_rate, "", ""],
            ["(b) qo-ops run: seconds, job duration_ms", s["duration_ms"] / 1000, "", ""],
            ["(b) qo-ops run: seconds, CLI wall time", job_big["wall_s"], "", ""],
            [
                "(b) wall - duration_ms (process startup)",
                job_big["wall_s"] - s["duration_ms"] / 1000,
                "",
                "",
            ],
            ["(b) qo-ops run: rows/s (duration_ms)", b_rate, "", ""],
            ["(b) qo-ops run: rows/s (CLI wall time)", b_wall_rate, "", ""],
            ["ratio b/a (duration_ms)", ratio, f">= {GOAL_RATIO}", _verdict(ratio >= GOAL_RATIO)],
            [
                "ratio b/a (CLI wall time)",
                wall_ratio,
                f">= {GOAL_RATIO}",
                _verdict(wall_ratio >= GOAL_RATIO),
            ],
            ["(b) batches", s["batches"], "", ""],
            ["(b) batch ms p50", s["batch_ms_p50"], "", ""],
            [
                "(b) batch ms p99",
                s["batch_ms_p99"],
                f"< {GOAL_P99_MS:.0f}",
                _verdict(s["batch_ms_p99"] < GOAL_P99_MS),
            ],
            ["(b) batch ms max", s["batch_ms_max"], "", ""],
            [f"peak RSS qo-ops, {SMALL:,} quotes", _mib(job_small["peak_rss_kb"]), "", ""],
            [f"peak RSS qo-ops, {BIG:,} quotes", _mib(job_big["peak_rss_kb"]), "", ""],
            [
                f"peak RSS ratio {BIG:,} / {SMALL:,}",
                rss_ratio,
                f"<= {GOAL_RSS_RATIO}",
                _verdict(rss_ratio <= GOAL_RSS_RATIO),
            ],
        ],
    )
    total = time.perf_counter() - started
    print(
        "\nverified after each run: 0 ACTIVE quotes past expiry, one QuoteExpired event per "
        f"quote, job status success with its checks passed; bench took {total:.0f} s"
    )

    out = REPO / "bench" / "results"
    out.mkdir(exist_ok=True)
    (out / "quote_expiration.json").write_text(
        json.dumps(
            {
                "quotes": BIG,
                "batch_size": BATCH,
                "load_seconds": load_s,
                "set_based": set_based,
                "set_based_rows_per_s": a_rate,
                "job": job_big,
                "job_rows_per_s": b_rate,
                "job_rows_per_s_wall": b_wall_rate,
                "ratio_job_to_set_based": ratio,
                "ratio_job_to_set_based_wall": wall_ratio,
                "job_small": job_small,
                "peak_rss_kb": {
                    str(SMALL): job_small["peak_rss_kb"],
                    str(BIG): job_big["peak_rss_kb"],
                },
                "peak_rss_ratio": rss_ratio,
                "batch_ms": {k: s[f"batch_ms_{k}"] for k in ("p50", "p99", "max")},
                "explain_before_run": plans,
                "goals": {
                    "ratio_min": GOAL_RATIO,
                    "rss_ratio_max": GOAL_RSS_RATIO,
                    "batch_p99_ms_max": GOAL_P99_MS,
                },
                "bench_seconds": total,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
