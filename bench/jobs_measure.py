"""The jobs section's cases and how each is measured: the real CLI on a clone of a template,
each limit on a clone of its own, the work verified after every run, and the plans of one
batch of the job's own statements."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import URL

from bench.common import (
    QO_OPS,
    cloned_database,
    engine_for,
    env_url,
    fresh_database,
    measure_command,
    settle,
    standing_approvals,
    stopwatch,
)
from bench.jobs_common import (
    AUDIT_RETENTION_DAYS,
    CLEANUP_RETENTION_DAYS,
    IDLE_HOURS,
    TENANT,
    Window,
    load_template,
    scope_of,
    transition_sql,
    window_for,
)
from bench.jobs_files import (
    audit_baseline,
    audit_load,
    audit_verified_baseline,
    cleanup_baseline,
    cleanup_two_step_baseline,
    temp_file_load,
    verify_audit,
    verify_cleanup,
    write_objects,
)
from bench.jobs_rows import (
    CHECKS_NOTE,
    checkout_baseline,
    checkout_load,
    pricing_baseline,
    pricing_load,
    quote_baseline,
    quote_load,
    read_model_baseline,
    read_model_load,
    then_checks,
    verify_checkout,
    verify_pricing,
    verify_quote,
    verify_read_model,
)
from qo_ops.jobs import audit_archive as archive_job
from qo_ops.jobs import temp_file_cleanup as cleanup_job
from qo_ops.jobs.catalog import get_spec
from qo_ops.platform.job.options import Limits
from qo_ops.platform.job.outcome import BatchContext

PREFIX = "qo_ops_bench_jobs"


@dataclass(frozen=True)
class SecondLimit:
    """A limit that also does work the one-transaction limit leaves out but the job must do,
    so that the job has a fair second figure beside the first (issue 24)."""

    baseline: Callable[[URL, int, Window | None, Path], int]
    label: str  # the table's limit column, short
    note: str  # what it does, for the section's notes


SECOND_LIMITS: dict[str, SecondLimit] = {
    "pricing_snapshot_recalculation": SecondLimit(
        then_checks("pricing_snapshot_recalculation", pricing_baseline),
        "… + the job's outcome checks",
        CHECKS_NOTE,
    ),
    "read_model_repair": SecondLimit(
        then_checks("read_model_repair", read_model_baseline),
        "… + the job's outcome checks",
        CHECKS_NOTE,
    ),
    "temp_file_cleanup": SecondLimit(
        cleanup_two_step_baseline,
        "hash + intents COMMITTED, then DELETE/complete + unlink",
        "the work the job must do that the limit above does not: the same hashes, but every "
        "intent tombstone written and COMMITTED before any unlink (the checksum durable before "
        "any byte goes), then in a second transaction one DELETE … RETURNING feeding the "
        "UPDATE that completes the intents, unlink, COMMIT — set-based over the whole window, "
        "without the job's batches, path-safety checks or outcome checks",
    ),
    "audit_archive": SecondLimit(
        audit_verified_baseline,
        "… + read back, digests compared, DELETE … RETURNING digest",
        "what the first limit does, plus the verification the job must do before it may "
        "delete: per day the file read back (sha256 of its bytes, parsed, the rows' digest in "
        "Arrow) and its records deleted by the job's own DELETE_DIGESTED, whose digest of the "
        "deleted rows must equal the file's; one transaction",
    ),
}


# ------------------------------------------------------------------------------ cases


@dataclass(frozen=True)
class Case:
    job: str
    goal: float
    load: Callable[[int, Window | None], str]
    baseline: Callable[[URL, int, Window | None, Path], int]
    verify: Callable[[URL, int, Window | None, Path], dict[str, Any]]
    limit_label: str  # what the baseline is, short (the table's limit column)
    days_ago: int | None = None  # windowed: the window starts this many days ago
    env: dict[str, str] = field(default_factory=dict)  # besides QO_OPS_DATABASE_URL/HOME
    objects: bool = False  # temp_file_cleanup: the stored objects, written per measurement
    rows: int = 0  # eligible rows measured (profile.rows, or less for the slowest jobs)


# The two slowest jobs run on a share of profile.rows (never below the quick size) so that
# the section fits its time budget; their limit is measured at the same size.
SHARE = {"temp_file_cleanup": 0.1, "audit_archive": 0.4}


def rows_for(job: str, n: int) -> int:
    share = SHARE.get(job)
    return n if share is None else min(n, max(2_000, int(n * share)))


def cases_for(n: int) -> list[Case]:
    cases = [
        Case(
            "quote_expiration",
            0.7,
            quote_load,
            quote_baseline,
            verify_quote,
            "one UPDATE … RETURNING + INSERT outbox",
        ),
        Case(
            "abandoned_checkout_close",
            0.7,
            checkout_load,
            checkout_baseline,
            verify_checkout,
            "one UPDATE … RETURNING + INSERT outbox",
            env={"QO_OPS_CHECKOUT_IDLE_HOURS": str(IDLE_HOURS)},
        ),
        Case(
            "pricing_snapshot_recalculation",
            0.7,
            pricing_load,
            pricing_baseline,
            verify_pricing,
            "one INSERT … SELECT GROUP BY … ON CONFLICT",
            days_ago=60,
        ),
        Case(
            "read_model_repair",
            0.7,
            read_model_load,
            read_model_baseline,
            verify_read_model,
            "one INSERT … SELECT … ON CONFLICT",
            days_ago=60,
        ),
        Case(
            "temp_file_cleanup",
            0.7,
            temp_file_load,
            cleanup_baseline,
            verify_cleanup,
            "hash + one DELETE/INSERT tombstones + unlink",
            days_ago=60,
            env={
                cleanup_job.RETENTION_ENV: str(CLEANUP_RETENTION_DAYS),
                cleanup_job.MAX_DELETE_ENV: str(rows_for("temp_file_cleanup", n)),
                cleanup_job.MAX_SHARE_ENV: "1.0",
            },
            objects=True,
        ),
        Case(
            "audit_archive",
            0.5,
            audit_load,
            audit_baseline,
            verify_audit,
            "COPY out → pyarrow Parquet/day + one DELETE",
            days_ago=AUDIT_RETENTION_DAYS + 40,
            env={archive_job.RETENTION_ENV: str(AUDIT_RETENTION_DAYS)},
        ),
    ]
    return [replace(c, rows=rows_for(c.job, n)) for c in cases]


# ------------------------------------------------------------------------------ measuring


def _base_env() -> dict[str, str]:
    """The caller's environment without any QO_OPS_* setting (each run sets its own)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("QO_OPS_")}


def _check(case: Case, url: URL, n: int, w: Window | None, home: Path, label: str) -> dict:
    found = case.verify(url, n, w, home)
    if not found.pop("ok"):
        raise SystemExit(f"{case.job} {label}: the work was not done: {found} (expected {n})")
    return found


PROFILE_ENV = "BENCH_JOBS_PROFILE"  # a directory: each job run under cProfile, its stats there


def _profiled(job: str) -> list[str]:
    """The CLI's command, under cProfile when BENCH_JOBS_PROFILE names a directory (one
    ``<job>-<n>.prof`` per run; the figures of such a run measure the profiler too)."""
    out = os.environ.get(PROFILE_ENV)
    if not out:
        return [QO_OPS]
    Path(out).mkdir(parents=True, exist_ok=True)
    n = len(list(Path(out).glob(f"{job}-*.prof")))
    return [sys.executable, "-m", "cProfile", "-o", str(Path(out) / f"{job}-{n}.prof"), QO_OPS]


def run_job_cli(case: Case, url: URL, n: int, w: Window | None, home: Path) -> dict[str, Any]:
    """The real CLI in its own process, default batch size; verified afterwards."""
    cmd = [*_profiled(case.job), "run", case.job, "--tenant", TENANT, *(w.cli() if w else [])]
    cmd += ["--mode", "execute", "--reason", "bench: jobs vs the limit", "--json"]
    if get_spec(case.job).destructive:  # its execute cites an approval, as on every path
        engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
        cmd += ["--approval", standing_approvals(engine)[case.job]]
        engine.dispose()
    env = {
        **_base_env(),
        "QO_OPS_DATABASE_URL": env_url(url),
        "QO_OPS_HOME": str(home),
        **case.env,
    }
    settle(url)
    measured = measure_command(cmd, env)
    if measured["returncode"] != 0:
        raise SystemExit(
            f"{case.job}: qo-ops run failed ({measured['returncode']}): "
            f"{str(measured['stdout'])[-1500:]} {str(measured['stderr'])[-1500:]}"
        )
    s = json.loads(str(measured["stdout"]))
    failed_checks = [c["name"] for c in s["checks"] if not c["passed"]]
    if (
        s["status"] != "success"
        or s["processed_count"] != n
        or s["succeeded_count"] != n
        or failed_checks
    ):
        raise SystemExit(f"{case.job}: qo-ops run did not do the work: {json.dumps(s)[:2000]}")
    verified = _check(case, url, n, w, home, "job")
    return {
        "rows": n,
        "duration_s": s["duration_ms"] / 1000,
        "wall_s": measured["wall_s"],
        "peak_rss_kb": measured["maxrss_kb"],
        "rows_per_s": n / (s["duration_ms"] / 1000),
        "rows_per_s_wall": n / float(measured["wall_s"]),  # type: ignore[arg-type]
        "batches": s["batches"],
        "batch_size": get_spec(case.job).defaults.batch_size,
        "batch_ms_p50": s["batch_ms_p50"],
        "batch_ms_p99": s["batch_ms_p99"],
        "batch_ms_max": s["batch_ms_max"],
        "tally": s["tally"],
        "verified": verified,
    }


def run_baseline(case: Case, url: URL, n: int, w: Window | None, home: Path) -> dict[str, Any]:
    settle(url)
    with stopwatch() as took:
        changed = case.baseline(url, n, w, home)
    verified = _check(case, url, n, w, home, "baseline")
    return {"rows": changed, "seconds": took[0], "rows_per_s": n / took[0], "verified": verified}


def objects_tmp() -> str | None:
    """Where the stored objects of temp_file_cleanup are written: tmpfs when there is one. On
    a disk, unlinking an object the kernel has already written back costs 1.7–3 ms (ext4 with
    discard) against ~17 µs for one still in memory, and which of the two a run meets depends
    on writeback timing, not on the job: the figure would measure the disk's mood."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


def measure_case(case: Case, repeats: int) -> dict[str, Any]:
    """Template once; then per repeat a clone for the job, one for the baseline and one for
    the second limit where the job has one (the order rotating from repeat to repeat); last,
    the plans of one batch on the template."""
    n = case.rows
    w = window_for(case.days_ago) if case.days_ago is not None else None
    short = case.job[:24]
    second = SECOND_LIMITS.get(case.job)
    kinds = ("job", "baseline", "second") if second else ("job", "baseline")
    runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in kinds}
    with fresh_database(f"{PREFIX}_{short}_tpl") as template:
        with stopwatch() as load_took:
            load_template(template, case.load(n, w))
        for i in range(repeats):
            order = kinds[i % len(kinds) :] + kinds[: i % len(kinds)]
            for kind in order:
                with (
                    cloned_database(template, f"{PREFIX}_{short}_{kind}") as url,
                    tempfile.TemporaryDirectory(
                        prefix="qo-ops-bench-jobs-", dir=objects_tmp() if case.objects else None
                    ) as tmp,
                ):
                    home = Path(tmp)
                    if case.objects:
                        write_objects(home, n)
                    if kind == "job":
                        runs[kind].append(run_job_cli(case, url, n, w, home))
                    elif kind == "baseline":
                        runs[kind].append(run_baseline(case, url, n, w, home))
                    else:
                        assert second is not None
                        runs[kind].append(
                            run_baseline(replace(case, baseline=second.baseline), url, n, w, home)
                        )
        plans = explain_batches(case, template, n, w)  # last: it leaves dead rows behind
    return {
        "rows": n,
        "window": [w.first.isoformat(), w.last.isoformat()] if w else None,
        "load_s": load_took[0],
        **runs,
        "plans": plans,
    }


def measure_memory(sizes: tuple[int, ...], reuse: dict[int, list[int]]) -> dict[str, list[int]]:
    """Peak RSS of the quote_expiration CLI at each size: the throughput runs where the size
    is theirs, one run on a database of its own otherwise (peak RSS hardly varies)."""
    case = cases_for(0)[0]
    found: dict[str, list[int]] = {}
    for n in sizes:
        if n in reuse:
            found[str(n)] = reuse[n]
            continue
        with (
            fresh_database(f"{PREFIX}_mem") as url,
            tempfile.TemporaryDirectory(prefix="qo-ops-bench-jobs-") as tmp,
        ):
            load_template(url, case.load(n, None))
            found[str(n)] = [run_job_cli(case, url, n, None, Path(tmp))["peak_rss_kb"]]
    return found


# ------------------------------------------------------------------------------ plans


def _plan(rows: Any) -> list[str]:
    return [line if len(line) <= 300 else line[:300] + " …" for line in rows]


def _explain_selection(conn: Any, spec: Any, ctx: BatchContext, limit: int) -> list[str]:
    query = spec.eligible(ctx).limit(limit)
    if spec.batching.locks is not None:
        query = query.with_for_update(skip_locked=True, of=spec.batching.locks.of)
    compiled = query.compile(dialect=conn.dialect)
    return _plan(
        conn.exec_driver_sql(
            "EXPLAIN (ANALYZE, BUFFERS) " + str(compiled), dict(compiled.params)
        ).scalars()
    )


def explain_batches(case: Case, url: URL, n: int, w: Window | None) -> dict[str, list[str]]:
    """EXPLAIN (ANALYZE, BUFFERS) of the job's own batch statements at this size, rolled
    back: the first batch's selection and transition, and — for the jobs whose transition
    takes a row out of the selection, or moves their cursor — the selection again after
    half of the rows were processed by the job's own transition (where a selection that
    walks what earlier batches left behind shows)."""
    spec = get_spec(case.job)
    batch = spec.defaults.batch_size
    scope = scope_of(w)
    limits = Limits(lease_ttl_s=30.0, batch_size=batch)
    ctx = BatchContext(spec.name, scope, "execute", uuid.uuid4(), limits=limits)
    saved = {k: os.environ.get(k) for k in case.env}
    os.environ.update(case.env)  # the job's settings are read from the environment
    engine = engine_for(url)
    plans: dict[str, list[str]] = {}
    try:
        with engine.connect() as conn, conn.begin() as tx:
            plans["first_selection"] = _explain_selection(conn, spec, ctx, batch)
            ids = [int(i) for i in conn.execute(spec.eligible(ctx).limit(batch)).scalars()]
            statement, params = transition_sql(case.job, ids, ctx)
            plans["first_transition"] = _plan(
                conn.execute(
                    sa.text("EXPLAIN (ANALYZE, BUFFERS) " + statement.text), params
                ).scalars()
            )
            half = (
                list(conn.execute(spec.eligible(ctx).limit(max(1, n // 2))).scalars())
                if spec.then is None
                else []
            )
            if half:  # (none left when the first batch took them all)
                outcome = spec.transition(conn, ctx, half)
                if outcome.cursor is not None:
                    ctx.cursor = outcome.cursor
                if outcome.position is not None:
                    # what the selection costs without the position: every batch walks the
                    # rows earlier batches already took out of the selection
                    plans["mid_run_selection_from_start"] = _explain_selection(
                        conn, spec, ctx, batch
                    )
                    ctx.position = outcome.position
                plans["mid_run_selection"] = _explain_selection(conn, spec, ctx, batch)
            tx.rollback()
    finally:
        engine.dispose()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return plans


def exec_ms(plan: list[str]) -> float | None:
    for line in reversed(plan):
        if line.startswith("Execution Time:"):
            return float(line.split(":")[1].split()[0])
    return None
