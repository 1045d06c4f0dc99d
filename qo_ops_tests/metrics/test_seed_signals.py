"""The seed's job signals beyond the core counters (docs/observability.md): start delay,
lock acquisitions and waits, overlaps, retries by scope and reason, exhausted retries,
manual reruns, and the reconciliation family.

First a fresh database: every catalog job's series exist at 0 for every label value the
code declares, so ``increase()`` sees the first failure. The expected values are written out
here, not read from the code, so a value dropped from a declaration fails. Then real runs
through the one runner (leases, a held lease, a rerun, a downstream that fails, an order
reconciliation against the simulator) and a few planted rows for what a test cannot cause
cheaply (a Dagster run retry, a queued start): each figure is what the records say.
"""

from __future__ import annotations

import json
import uuid

import pytest
import sqlalchemy as sa

from qo_ops.demo.data import load_demo_data
from qo_ops.downstream.local import seed_from_demo
from qo_ops.jobs import delivery_retry, order_reconciliation, quote_expiration
from qo_ops.jobs.catalog import CATALOG
from qo_ops.metrics.exporter import JobCollector
from qo_ops.platform.job.options import RunOptions
from qo_ops.platform.job.scope import Scope
from qo_ops.platform.run.lease import acquire
from qo_ops.platform.run.runner import run_job
from qo_ops_tests.jobs.test_order_reconciliation import AS_OF, SCOPE
from qo_ops_tests.metrics.test_exporter import (
    ALLOWED_LABELS,
    Samples,
    collect,
    collect_when,
    finished_runs,
    value,
)

STATUSES = ("success", "partial_success", "failed", "timeout", "cancelled", "skipped", "no_work")
TRIGGERS = ("schedule", "sensor", "manual", "backfill", "retry", "api")
PLATFORM_ERRORS = (
    "items_failed", "deadline", "lease_lost", "orphaned", "database_unavailable",
    "database_error", "dependency_unavailable", "internal_error", "other",
)  # fmt: skip
JOB_ERRORS = {
    "temp_file_cleanup": ("anomaly_threshold", "bad_config", "object_store_error"),
    "audit_archive": ("archive_error", "archive_verification_failed", "bad_config"),
    "pricing_snapshot_recalculation": ("no_current_price_book",),
}
ITEM_REASONS = (
    "dependency_timeout", "dependency_connection", "dependency_rate_limited",
    "dependency_error", "other",
)  # fmt: skip
CALLING = ("delivery_retry", "notification_publish")
RERUN_REASONS = ("after_failure", "after_partial_success", "after_cancelled", "after_success")
AMBIGUITY = (
    "timeout_after_send", "connection_reset_after_send", "terminated_after_send",
    "unreadable_answer", "claim_lost_after_call", "other",
)  # fmt: skip
RECONCILIATION = {
    "reconciliation_mismatches_total": (
        "mismatch_type",
        ("missing_downstream", "terminal_not_reflected", "status_drift", "unknown_downstream"),
    ),
    "reconciliation_corrections_total": ("result", ("corrected", "failed", "pending")),
    "reconciliation_unresolved_total": (
        "reason",
        ("manual_review_required", "budget_exhausted", "dead_letter_flagged"),
    ),
}


def expected_zero_series() -> list[tuple[str, dict[str, str]]]:
    """Every (metric, labels) a fresh database must serve at 0."""
    out: list[tuple[str, dict[str, str]]] = []
    for job, spec in CATALOG.items():
        j = {"job_name": job}
        out += [("job_started_total", j), ("job_overlap_detected_total", j)]
        out += [("job_completed_total", {**j, "status": s}) for s in STATUSES]
        out += [("job_duration_seconds_count", {**j, "status": s}) for s in STATUSES]
        out += [
            ("job_failed_total", {**j, "error_class": e})
            for e in (*PLATFORM_ERRORS, *JOB_ERRORS.get(job, ()))
        ]
        out += [("job_lock_acquire_total", {**j, "result": r}) for r in ("acquired", "skipped_already_running")]  # fmt: skip
        out += [("job_lock_wait_seconds_count", j), ("job_scheduler_drift_seconds_count", j)]
        out += [("job_start_delay_seconds_count", {**j, "trigger": t}) for t in TRIGGERS]
        out += [("job_retries_total", {**j, "scope": "run", "reason": "worker_crashed"})]
        out += [("job_retry_exhausted_total", {**j, "scope": "run"})]
        out += [("job_manual_reruns_total", {**j, "reason": r}) for r in RERUN_REASONS]
        if job in CALLING:
            out += [
                ("job_retries_total", {**j, "scope": "item", "reason": r}) for r in ITEM_REASONS
            ]
            out += [("job_retry_exhausted_total", {**j, "scope": "item"})]
        if spec.signals.side_effects:
            out += [("job_side_effect_ambiguity_total", {**j, "reason": r}) for r in AMBIGUITY]
    recon = {"job_name": "order_reconciliation"}
    out += [("reconciliation_runs_total", {**recon, "status": s}) for s in STATUSES]
    out += [("reconciliation_items_scanned_total", recon)]
    for metric, (label, values) in RECONCILIATION.items():
        out += [(metric, {**recon, label: v}) for v in values]
    return out


def test_a_fresh_database_serves_every_declared_series_at_zero(db):
    samples = collect(JobCollector(db.engine, CATALOG.values()))
    missing = [
        (name, labels)
        for name, labels in expected_zero_series()
        if (name, tuple(sorted(labels.items()))) not in samples
    ]
    assert not missing, missing[:10]
    for name, labels in expected_zero_series():
        assert value(samples, name, **labels) == 0, (name, labels)
    # the reconciliation family belongs to the reconciliation job only
    assert {
        dict(labels)["job_name"] for name, labels in samples if name.startswith("reconciliation_")
    } == {"order_reconciliation"}
    for (name, labels), _ in samples.items():
        keys = {k for k, _ in labels} - ({"le"} if name.endswith("_bucket") else set())
        assert keys <= ALLOWED_LABELS, (name, labels)


def _runs(db, sql: str, **params):
    with db.engine.connect() as conn:
        return conn.execute(sa.text(sql), params).all()


def _tally_sum(db, job: str, key: str) -> int:
    return int(
        _runs(
            db,
            "SELECT coalesce(sum((tally->>:k)::bigint), 0) FROM job_run WHERE job_name = :j",
            k=key,
            j=job,
        )[0][0]
    )


def _options(trigger: str = "manual", reason: str | None = "signals test") -> RunOptions:
    return RunOptions(
        mode="execute", trigger=trigger, reason=reason, requester="tester", progress_interval_s=3600
    )  # type: ignore[arg-type]


def test_locks_reruns_and_item_retries_follow_real_runs(db, downstream_factory, monkeypatch):
    load_demo_data(db.engine, tenants=2, quotes=300, seed=9, as_of=AS_OF)
    expire = quote_expiration.SPEC
    first = run_job(expire, Scope("tenant-001"), _options(), engine=db.engine)
    assert first.status == "success"
    again = run_job(expire, Scope("tenant-001"), _options(), engine=db.engine)  # a rerun
    assert again.status == "no_work"
    # a scheduled run is no person's rerun, and a first run of a scope is no rerun at all
    run_job(expire, Scope("tenant-002"), _options("schedule", None), engine=db.engine)
    held = acquire(db.engine, expire.name, "tenant-001", "someone-else", 300, uuid.uuid4())
    assert held is not None
    skipped = run_job(expire, Scope("tenant-001"), _options(), engine=db.engine)
    assert skipped.status == "skipped"

    # the downstream fails a third of its answers with a 503: items retry, by reason
    failing = downstream_factory(error_rate=0.3, seed=4)
    monkeypatch.setenv("QO_OPS_DOWNSTREAM_URL", failing.url)
    monkeypatch.setenv("QO_OPS_BREAKER_OPEN_S", "30")
    deliveries = run_job(
        delivery_retry.SPEC, Scope("tenant-001"), _options("schedule", None), engine=db.engine
    )
    assert deliveries.counts.retry_scheduled > 0, deliveries

    collector = JobCollector(db.engine, CATALOG.values())
    total = finished_runs(db, expire.name) + finished_runs(db, delivery_retry.SPEC.name)
    samples = collect_when(
        collector,
        lambda s: sum(
            v for (n, labels), v in s.items()
            if n == "job_completed_total" and dict(labels)["job_name"] in (expire.name, "delivery_retry")
        ) == total,
    )  # fmt: skip
    job = {"job_name": expire.name}
    assert value(samples, "job_lock_acquire_total", **job, result="acquired") == 3
    assert value(samples, "job_lock_acquire_total", **job, result="skipped_already_running") == 1
    assert value(samples, "job_lock_wait_seconds_count", **job) == 4  # refused ones waited too
    waited = _runs(db, "SELECT sum(lock_wait_ms) FROM job_run WHERE job_name = :j", j=expire.name)
    assert value(samples, "job_lock_wait_seconds_sum", **job) == pytest.approx(
        waited[0][0] / 1000.0
    )
    # the rerun after a success, and the skipped one after the rerun (no_work: a success)
    assert value(samples, "job_manual_reruns_total", **job, reason="after_success") == 2
    for reason in ("after_failure", "after_partial_success", "after_cancelled"):
        assert value(samples, "job_manual_reruns_total", **job, reason=reason) == 0
    assert value(samples, "job_start_delay_seconds_count", **job, trigger="manual") == 3
    assert value(samples, "job_start_delay_seconds_count", **job, trigger="schedule") == 1

    d = {"job_name": "delivery_retry", "scope": "item"}
    assert value(samples, "job_retries_total", **d, reason="dependency_error") == _tally_sum(
        db, "delivery_retry", "retry.item.dependency_error"
    )
    retried = sum(value(samples, "job_retries_total", **d, reason=r) for r in ITEM_REASONS)
    assert retried == deliveries.counts.retry_scheduled > 0
    exhausted = _tally_sum(db, "delivery_retry", "retry_exhausted.item")
    assert value(samples, "job_retry_exhausted_total", **d) == exhausted
    held.release(db.engine)


def test_reconciliation_family_follows_the_results_it_recorded(db, downstream, monkeypatch):
    monkeypatch.setenv("QO_OPS_DOWNSTREAM_URL", downstream.url)
    load_demo_data(db.engine, tenants=1, quotes=3000, seed=18, as_of=AS_OF)
    seed_from_demo(db.engine, downstream.url)
    spec = order_reconciliation.SPEC
    dry = run_job(
        spec, SCOPE, RunOptions(mode="dry_run", progress_interval_s=3600), engine=db.engine
    )
    first = run_job(spec, SCOPE, _options("schedule", None), engine=db.engine)
    assert first.status in ("success", "partial_success"), first

    samples = collect_when(
        JobCollector(db.engine, CATALOG.values()),
        lambda s: sum(
            v for (n, labels), v in s.items()
            if n == "reconciliation_runs_total"
        ) == 2,
    )  # fmt: skip
    job = {"job_name": spec.name}
    for status in {dry.status, first.status}:
        runs = [dry.status, first.status].count(status)
        assert value(samples, "reconciliation_runs_total", **job, status=status) == runs
    assert value(samples, "reconciliation_items_scanned_total", **job) == (
        dry.counts.processed + first.counts.processed
    )
    # mismatches: what both runs found, by type (the dry run counts what it would repair)
    for kind in RECONCILIATION["reconciliation_mismatches_total"][1]:
        found = dry.tally.get(kind, 0) + first.tally.get(kind, 0)
        assert value(samples, "reconciliation_mismatches_total", **job, mismatch_type=kind) == found
    assert first.tally.get("missing_downstream", 0) > 0
    # corrections and unresolved: the result rows the execute run wrote, by outcome
    outcomes = dict(
        _runs(
            db,
            "SELECT outcome, count(*) FROM reconciliation_result WHERE job_run_id = :r "
            "GROUP BY outcome",
            r=uuid.UUID(first.job_run_id),
        )
    )
    assert (
        value(samples, "reconciliation_corrections_total", **job, result="corrected")
        == (outcomes.get("corrected", 0))
        > 0
    )
    assert value(samples, "reconciliation_corrections_total", **job, result="pending") == (
        outcomes.get("pending", 0)
    )
    assert value(
        samples, "reconciliation_unresolved_total", **job, reason="manual_review_required"
    ) == outcomes.get("flagged", 0)
    assert value(
        samples, "reconciliation_unresolved_total", **job, reason="dead_letter_flagged"
    ) == outcomes.get("dead_letter_flagged", 0)


def _planted_run(db, job: str, status: str, **columns) -> None:
    """A finished run row of ``job`` (ended 10 s ago), with ``columns`` set."""
    values = {
        "id": uuid.uuid4(),
        "job": job,
        "status": status,
        "trigger": columns.pop("trigger", "schedule"),
        "scope": columns.pop("scope", "tenant-001"),
        "mode": columns.pop("mode", "execute"),
        "started_ago": columns.pop("started_ago", 20.0),
        "requested_ago": columns.pop("requested_ago", None),
        "retry_number": columns.pop("retry_number", 0),
        "retries_max": columns.pop("retries_max", None),
        "error": columns.pop("error", None),
        "tally": json.dumps(columns.pop("tally", {})),
    }
    assert not columns, columns
    with db.engine.begin() as conn:
        conn.execute(
            sa.text(
                """
                INSERT INTO job_run (id, job_name, scope, mode, trigger_type, owner_id, status,
                                     created_at, started_at, finished_at, requested_at,
                                     retry_number, retries_max, last_error_code, tally)
                VALUES (:id, :job, :scope, :mode, :trigger, 'host:1:test', :status,
                        clock_timestamp() - make_interval(secs => :started_ago),
                        clock_timestamp() - make_interval(secs => :started_ago),
                        clock_timestamp() - interval '10 seconds',
                        clock_timestamp() - make_interval(secs => :started_ago + :requested_ago),
                        :retry_number, :retries_max, :error, CAST(:tally AS jsonb))
                """
            ),
            values,
        )


def test_run_retries_start_delays_and_foreign_words_from_planted_rows(db):
    job = "read_model_repair"
    # Dagster re-ran a run whose worker died; the retry failed again with none left
    _planted_run(db, job, "failed", retry_number=1, retries_max=1, error="orphaned")
    _planted_run(db, job, "success", retry_number=1, retries_max=2, requested_ago=None)
    # a run that waited 40 s in the queue, one started at once, one whose start is unknown
    _planted_run(db, job, "success", trigger="manual", requested_ago=40.0)
    _planted_run(db, job, "success", trigger="manual", requested_ago=0.5)
    # words outside the declarations: never a label of their own
    _planted_run(db, job, "failed", error="Traceback tenant-007 says no")
    _planted_run(db, job, "timeout")
    _planted_run(
        db, "delivery_retry", "success",
        tally={"retry.item.tenant-007": 3, "retry.item.dependency_timeout": 2,
               "side_effect_ambiguity.tenant_007_after_send": 1},
    )  # fmt: skip
    collector = JobCollector(db.engine, CATALOG.values())
    samples: Samples = collect_when(
        collector,
        lambda s: sum(
            v for (n, labels), v in s.items()
            if n == "job_completed_total" and ("job_name", job) in labels
        ) == 6,
    )  # fmt: skip
    j = {"job_name": job}
    assert value(samples, "job_retries_total", **j, scope="run", reason="worker_crashed") == 2
    assert value(samples, "job_retry_exhausted_total", **j, scope="run") == 1
    assert value(samples, "job_failed_total", **j, error_class="orphaned") == 1
    assert value(samples, "job_failed_total", **j, error_class="other") == 1
    assert value(samples, "job_failed_total", **j, error_class="deadline") == 1
    manual = {**j, "trigger": "manual"}
    assert value(samples, "job_start_delay_seconds_count", **manual) == 2
    assert value(samples, "job_start_delay_seconds_bucket", **manual, le="1.0") == 1
    assert value(samples, "job_start_delay_seconds_bucket", **manual, le="30.0") == 1
    assert value(samples, "job_start_delay_seconds_bucket", **manual, le="60.0") == 2
    assert value(samples, "job_start_delay_seconds_sum", **manual) == pytest.approx(40.5, abs=0.1)
    d = {"job_name": "delivery_retry", "scope": "item"}
    assert value(samples, "job_retries_total", **d, reason="dependency_timeout") == 2
    assert value(samples, "job_retries_total", **d, reason="other") == 3
    assert (
        value(samples, "job_side_effect_ambiguity_total", job_name="delivery_retry", reason="other")
        == 1
    )
    for (name, labels), _ in samples.items():
        assert not any("tenant" in v or "Traceback" in v for _, v in labels), (name, labels)


def test_retry_reasons_are_bounded():
    from qo_ops.platform.job.labels import ITEM_RETRY_REASONS, retry_reason

    cases = {
        "timeout": "dependency_timeout",
        "http_408": "dependency_timeout",
        "connect_error": "dependency_connection",
        "connection_reset": "dependency_connection",
        "http_429": "dependency_rate_limited",
        "http_503": "dependency_error",
        "http_500": "dependency_error",
        "http_425": "dependency_error",
        "poison": "other",
        "transport_error": "other",
        None: "other",
    }
    for code, reason in cases.items():
        assert retry_reason(code) == reason, code
        assert retry_reason(code) in ITEM_RETRY_REASONS


def test_an_api_run_waited_from_its_acceptance(db):
    """An API run is asked for when the API accepts it: its start delay counts from there
    (queueing and the Dagster run's launch included), not from when its op began."""
    load_demo_data(db.engine, tenants=1, quotes=50, seed=2, as_of=AS_OF)
    accepted = uuid.uuid4()
    with db.engine.begin() as conn:  # the row as qo_ops/api/service.py writes it, 30 s ago
        conn.execute(
            sa.text(
                """
                INSERT INTO job_run (id, job_name, scope, mode, trigger_type, requester, reason,
                                     owner_id, options, status, created_at, started_at)
                VALUES (:id, 'quote_expiration', 'tenant-001', 'execute', 'api', 'ops', 'api run',
                        'api', '{}', 'accepted', clock_timestamp() - interval '30 seconds',
                        clock_timestamp() - interval '30 seconds')
                """
            ),
            {"id": accepted},
        )
    options = RunOptions(
        mode="execute", trigger="api", reason="api run", requester="ops", job_run_id=accepted,
        progress_interval_s=3600,
    )  # fmt: skip
    assert run_job(
        quote_expiration.SPEC, Scope("tenant-001"), options, engine=db.engine
    ).status in (
        "success",
        "no_work",
    )
    (row,) = _runs(
        db, "SELECT requested_at, created_at, started_at FROM job_run WHERE id = :id", id=accepted
    )
    assert row.requested_at == row.created_at
    assert (row.started_at - row.requested_at).total_seconds() >= 30
    samples = collect_when(
        JobCollector(db.engine, CATALOG.values()),
        lambda s: (
            value(s, "job_completed_total", job_name="quote_expiration", status="success")
            + value(s, "job_completed_total", job_name="quote_expiration", status="no_work")
            == 1
        ),
    )
    api = {"job_name": "quote_expiration", "trigger": "api"}
    assert value(samples, "job_start_delay_seconds_count", **api) == 1
    assert value(samples, "job_start_delay_seconds_bucket", **api, le="15.0") == 0
    assert value(samples, "job_start_delay_seconds_sum", **api) >= 30
