"""Jobs vs the database's limit: six jobs through the real CLI, each beside the same state
change done set-based in one transaction (the physical limit of this server for the work);
peak RSS of quote_expiration at several sizes; batch transaction times.

Per job: one tenant, ``profile.rows`` eligible rows (a share of it for the two slowest
jobs, ``SHARE``) built once with INSERT … SELECT
generate_series into a template database, VACUUM ANALYZE; every measurement runs on its own
``CREATE DATABASE … TEMPLATE`` clone (same bytes for the job and its baseline), after
``settle()``, and is verified afterwards (the state the job promises, counted in the
database and on disk). Job and baseline runs alternate; figures are medians over
``profile.repeats`` runs with their min and max; a ratio is the median of the repeats'
job/baseline pairs (each pair back to back), with the lowest and highest pair.

* The job: ``qo-ops run JOB --tenant T [--from D --to D] --mode execute --reason … --json``
  in its own process (``measure_command``: wall time and peak RSS), default batch size. Its
  rate is ``processed_count / duration_ms`` (the run's own clock: eligibility count,
  batches, outcome checks; not the interpreter's start-up, which the wall-time ratio in
  ``raw`` includes).
* The limit: the same end state in one transaction, timed from connect to commit in this
  process (see ``BASELINE_NOTES``): for the four row jobs, the job's own selection and batch
  statement once over every eligible row; for the two file jobs, the fewest set-based
  statements and file operations that reach it.

The section's parts: ``jobs_common`` (the window, the template load, the job's batch
statement), ``jobs_rows`` and ``jobs_files`` (each family's data, limits and verification),
``jobs_measure`` (the cases, the runs, the plans); this module turns the figures into rows.
"""

from __future__ import annotations

import os
from typing import Any

from bench.jobs_common import AUDIT_RETENTION_DAYS, CLEANUP_RETENTION_DAYS, SPAN_DAYS
from bench.jobs_files import TEMP_FILE_BYTES
from bench.jobs_measure import (
    SECOND_LIMITS,
    Case,
    cases_for,
    exec_ms,
    measure_case,
    measure_memory,
    objects_tmp,
)
from bench.suite import Profile, Row, Section, Spread, median, pairwise_ratios
from qo_ops.jobs.catalog import get_spec

TITLE = "Jobs vs the database's limit"
GOAL_P99_MS = 250.0
GOAL_RSS_RATIO = 1.2


def _mib(kb: float) -> str:
    return f"{kb / 1024:,.1f} MiB"


def _rate(value: float) -> str:
    return f"{value:,.0f} rows/s"


# ------------------------------------------------------------------------------ the section

_AT_ONCE = (
    "one transaction: the job's own selection (`SPEC.eligible`, every eligible row, no LIMIT), "
    "then the job's own {statement} over all of those ids at once ({what})"
)
BASELINE_NOTES = {
    "quote_expiration": _AT_ONCE.format(
        statement="EXPIRE_QUOTE_BATCH",
        what="UPDATE … RETURNING + INSERT of the QuoteExpired outbox events ON CONFLICT DO NOTHING",
    ),
    "abandoned_checkout_close": _AT_ONCE.format(
        statement="CLOSE_CHECKOUT_BATCH",
        what="UPDATE … RETURNING + INSERT of CheckoutAbandoned events",
    ),
    "pricing_snapshot_recalculation": _AT_ONCE.format(
        statement="RECALCULATE_BATCH",
        what="one INSERT … SELECT quote ⟕ quote_line GROUP BY … ON CONFLICT DO UPDATE WHERE "
        "different; no checkpoint row",
    ),
    "read_model_repair": _AT_ONCE.format(
        statement="REPAIR_READ_MODEL_BATCH",
        what="one INSERT … SELECT order ⟕ quote ON CONFLICT DO UPDATE WHERE different",
    ),
    "temp_file_cleanup": "one transaction: SELECT the eligible rows (the job's own ELIGIBLE "
    "predicate) FOR UPDATE, sha256 of each "
    "stored object (the tombstone's checksum is part of the job's end state), one DELETE … "
    "RETURNING feeding the INSERT of the completed tombstones, unlink of exactly the deleted "
    "rows' objects, COMMIT — the job's end state without its per-batch intent tombstones, "
    "path-safety checks or second transaction",
    "audit_archive": "one transaction: COPY (SELECT the window's eligible records) TO STDOUT "
    "as CSV, parsed by pyarrow's C++ reader into the archive schema, one zstd Parquet file per "
    "day written with the job's own durable write (tmp, fsync, rename, fsync dir), one "
    "VERIFIED manifest row per file, one DELETE of the records, COMMIT. This is the physical "
    "limit of moving the rows from the table into durable Parquet files; it does not read "
    "the files back or compare row digests, which the job does before it may delete (its "
    "second limit does)",
}


def _throughput(
    case: Case, r: dict[str, Any], limit: str, label: str
) -> tuple[Row, dict[str, float]]:
    """The job's rate beside one of its limits (``r[limit]``'s runs): the row and its summary.
    Repeat i's job and limits ran back to back on clones of one template, so the ratio is
    taken pair by pair."""
    job_rates = [x["rows_per_s"] for x in r["job"]]
    limit_rates = [x["rows_per_s"] for x in r[limit]]
    job, lim = Spread.of(job_rates), Spread.of(limit_rates)
    ratio = pairwise_ratios(job_rates, limit_rates)
    row = Row(
        what=f"throughput: {case.job}",
        size=f"{case.rows:,} rows, batch {r['job'][0]['batch_size']:,}",
        figure=job.show(_rate),
        limit=f"{lim.show(_rate)} ({label})",
        ratio=ratio.mid,
        goal=f">= {case.goal}",
        met=ratio.mid >= case.goal,
        ratio_range=ratio.range,
    )
    summary = {
        "job_rows_per_s": job.mid,
        "limit_rows_per_s": lim.mid,
        "ratio": ratio.mid,
        "ratio_min": ratio.low,
        "ratio_max": ratio.high,
    }
    return row, summary


ONLY_ENV = "BENCH_JOBS"  # comma-separated job names: measure only those (for iterating)


def run(profile: Profile) -> Section:
    cases = cases_for(profile.rows)
    if only := {j.strip() for j in os.environ.get(ONLY_ENV, "").split(",") if j.strip()}:
        cases = [c for c in cases if c.job in only]
    results: dict[str, dict[str, Any]] = {}
    for case in cases:
        print(f"   {case.job} ({case.rows:,} rows)", flush=True)
        results[case.job] = measure_case(case, profile.repeats)

    rows: list[Row] = []
    for case in cases:
        r = results[case.job]
        row, r["summary"] = _throughput(case, r, "baseline", case.limit_label)
        wall = Spread.of([x["rows_per_s_wall"] for x in r["job"]])
        ratio_wall = pairwise_ratios(
            [x["rows_per_s_wall"] for x in r["job"]], [x["rows_per_s"] for x in r["baseline"]]
        )
        r["summary"] |= {"job_rows_per_s_wall": wall.mid, "ratio_wall": ratio_wall.mid}
        row.note = f"ratio by CLI wall time {ratio_wall.show(lambda v: f'{v:.2f}')}"
        rows.append(row)
        second = SECOND_LIMITS.get(case.job)
        if second is not None:
            row, r["summary"]["second"] = _throughput(case, r, "second", second.label)
            row.what += ", second limit (the work it must do too)"
            rows.append(row)

    memory: dict[str, list[int]] = {}
    if "quote_expiration" in results:  # not when BENCH_JOBS leaves it out
        memory = _memory_row(profile, results, rows)
    _batch_rows(cases, results, rows)
    return Section(
        TITLE,
        rows,
        _notes(profile, cases, results, memory),
        raw={"jobs": results, "peak_rss_kb": memory, "rows": profile.rows},
    )


def _memory_row(
    profile: Profile, results: dict[str, dict[str, Any]], rows: list[Row]
) -> dict[str, list[int]]:
    print(f"   peak RSS at {', '.join(f'{m:,}' for m in profile.memory_sizes)}", flush=True)
    quote_runs = results["quote_expiration"]
    reuse = {quote_runs["rows"]: [x["peak_rss_kb"] for x in quote_runs["job"]]}
    memory = measure_memory(profile.memory_sizes, reuse)
    rss = {int(k): median([float(x) for x in v]) for k, v in memory.items()}
    small, big = min(rss), max(rss)
    rss_ratio = rss[big] / rss[small]
    rows.append(
        Row(
            what="peak RSS: quote_expiration CLI",
            size=" / ".join(f"{k:,}" for k in sorted(rss)) + " rows",
            figure=" / ".join(_mib(rss[k]) for k in sorted(rss)),
            limit=f"{_mib(rss[small])} (at {small:,} rows)",
            ratio=rss_ratio,
            goal=f"<= {GOAL_RSS_RATIO} (flat)",
            met=rss_ratio <= GOAL_RSS_RATIO,
        )
    )
    return memory


def _batch_rows(cases: list[Case], results: dict[str, dict[str, Any]], rows: list[Row]) -> None:
    for case in cases:
        jobs = results[case.job]["job"]
        p50 = median([x["batch_ms_p50"] for x in jobs])
        p99 = Spread.of([x["batch_ms_p99"] for x in jobs])
        worst = max(x["batch_ms_max"] for x in jobs)
        batches = int(median([x["batches"] for x in jobs]))
        external = get_spec(case.job).then is not None
        rows.append(
            Row(
                what=f"batch transaction: {case.job}",
                size=f"{batches:,} batch(es) of ≤ {jobs[0]['batch_size']:,}",
                figure=f"p50 {p50:,.0f} / p99 {p99.show(lambda v: f'{v:,.0f}')} / "
                f"max {worst:,.0f} ms",
                limit="2 transactions + file phase (upper bound)"
                if external
                else "max ≈ longest lock hold",
                ratio=None,
                goal=f"p99 < {GOAL_P99_MS:.0f} ms",
                met=p99.mid < GOAL_P99_MS,
            )
        )


def _plan_note(job: str, plans: dict[str, list[str]]) -> str:
    parts = []
    for key, label in (
        ("first_selection", "first selection"),
        ("mid_run_selection", "selection with half the rows done"),
        ("mid_run_selection_from_start", "the same from the window's start (no position)"),
        ("first_transition", "first transition"),
    ):
        ms = exec_ms(plans.get(key, []))
        if ms is not None:
            parts.append(f"{label} {ms:,.1f} ms")
    scans = sorted(
        {
            line.strip().split("  (")[0].removeprefix("->  ")
            for plan in plans.values()
            for line in plan
            if "Seq Scan on" in line
        }
    )
    seq = f"; sequential scans: {', '.join(scans)}" if scans else "; no sequential scan"
    return f"{job}: {', '.join(parts)}{seq}"


def _notes(
    profile: Profile,
    cases: list[Case],
    results: dict[str, dict[str, Any]],
    memory: dict[str, list[int]],
) -> list[str]:
    capped = [c for c in cases if c.rows != profile.rows]
    notes = [
        "Job figure: eligible rows / the run's own duration_ms, from `qo-ops run JOB --tenant "
        "tenant-001 [--from D --to D] --mode execute --reason … --json` in its own process at "
        "the job's default batch size (duration_ms covers eligibility count, all batches and "
        "the outcome checks, not the interpreter's start-up; the ratio by CLI wall time is in "
        "each row's note). Limit: the same end state reached set-based in ONE transaction, "
        "timed from connect to commit. Each measurement on its own CREATE DATABASE … TEMPLATE "
        "clone of a generate_series load (VACUUM ANALYZE'd), after CHECKPOINT and no "
        "autovacuum running; job and baseline runs alternate (repeat i: job then baseline, "
        "or baseline then job); figures are medians of "
        f"{profile.repeats} run(s) with (min–max), the ratio the median of each repeat's "
        "job/baseline pair with its lowest and highest. Every run is verified afterwards (job: status success, "
        "processed = mutated = rows, all checks passed; both: the end state counted in the "
        "database and on disk) or the suite stops.",
        *[f"Limit of {c.job}: {BASELINE_NOTES[c.job]}." for c in cases],
        *[
            f"Second limit of {c.job}: {SECOND_LIMITS[c.job].note}."
            for c in cases
            if c.job in SECOND_LIMITS
        ],
        "Data: one tenant; quote_expiration: ACTIVE quotes all past expiry (expiry order ≠ id "
        "order); abandoned_checkout_close: OPEN sessions idle 2 days to ~1 year; "
        "pricing_snapshot_recalculation: quotes with 1-3 lines and a snapshot for price book 1 "
        "only (the job adds one for the current book 2); read_model_repair: orders with their "
        "quotes, every read-model row drifted (a third missing, the rest a source version "
        "behind, a third of all with a wrong total); temp_file_cleanup: terminal files, not on "
        f"hold, each with a stored object of {TEMP_FILE_BYTES:,} bytes (hashing cost is then "
        "negligible: the figure is the job's per-file overhead), written for each run "
        f"{'on tmpfs (/dev/shm)' if objects_tmp() else 'on disk (no tmpfs here)'}, so that "
        "disk writeback timing (an unlink of a written-back file costs 1.7–3 ms on this ext4, "
        "of one still in memory ~17 µs) does not decide the figure of either side; audit_archive: records in "
        f"id = time order. Windowed jobs span {SPAN_DAYS} UTC days and run with --from/--to "
        "covering exactly those days. Time follows id, as in a table filled over time (idle, "
        "created and submitted order = id order); quote_expiration's expiry order interleaves "
        "(7/14/30/90-day validity). With the walk order scattered over id order instead "
        "(mod(i·7919, n), a batch's rows on as many heap pages as it has rows: the worst case), "
        "an earlier default run measured ratios of 0.50 (abandoned_checkout_close), 0.32 "
        "(pricing), 0.22 (read_model_repair), 0.15 (temp_file_cleanup). "
        "pricing_snapshot_recalculation's load sets quote.total_amount by one UPDATE after the "
        "lines, so its quote heap is half free space after the VACUUM.",
        "Environment of every run: all QO_OPS_* variables of the caller removed; "
        "QO_OPS_DATABASE_URL = the clone, QO_OPS_HOME = a fresh temporary directory (stored "
        "objects, archive files). abandoned_checkout_close: QO_OPS_CHECKOUT_IDLE_HOURS=24 (the "
        "default, explicit). temp_file_cleanup: QO_OPS_TEMP_FILE_RETENTION_DAYS="
        f"{CLEANUP_RETENTION_DAYS} (default), QO_OPS_CLEANUP_MAX_DELETE = the rows measured "
        "and QO_OPS_CLEANUP_MAX_SHARE=1.0 — the anomaly thresholds configured to admit exactly "
        "this deletion (every file of the tenant is eligible, so the default 0.5 share and "
        "10,000 cap would stop it); QO_OPS_CLEANUP_OVERRIDE is not set, so no anomaly_override "
        "audit row is written (verified: none). audit_archive: QO_OPS_AUDIT_RETENTION_DAYS="
        f"{AUDIT_RETENTION_DAYS} (default, explicit); records are "
        f"{AUDIT_RETENTION_DAYS + 40 - SPAN_DAYS + 1}-{AUDIT_RETENTION_DAYS + 40} days old.",
        "Peak RSS: maxrss of the qo-ops process (fresh helper per run, RUSAGE_CHILDREN); at "
        f"{profile.rows:,} rows the throughput runs (median), at the other sizes one run "
        "each on its own database. Raw: "
        + ", ".join(f"{int(k):,}: {', '.join(_mib(v) for v in vs)}" for k, vs in memory.items())
        + ".",
        "Batch transaction times are the runner's own (guard → select → transition → "
        "checkpoint → counters → commit, per batch; summary batch_ms_p50/p99/max, median of "
        "the runs' p50/p99, max of their max). A batch holds its row locks until its commit, so "
        "max ≈ the longest lock hold. For temp_file_cleanup and audit_archive a batch is two "
        "transactions with the file phase between them (no transaction open, no lock held), so "
        "their figures are an upper bound of any one lock hold.",
        "EXPLAIN (ANALYZE, BUFFERS) of one default-size batch at this size, on the template "
        "after the measurements, rolled back (full plans in raw.jobs.<job>.plans): "
        + "; ".join(_plan_note(c.job, results[c.job]["plans"]) for c in cases)
        + ".",
    ]
    if capped:
        notes.append(
            "Smaller runs for the slowest jobs, to keep the section within its time budget: "
            + ", ".join(f"{c.job} at {c.rows:,} rows" for c in capped)
            + f" (of {profile.rows:,}); their limit is measured at the same size."
        )
    return notes
