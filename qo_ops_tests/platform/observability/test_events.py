"""Job telemetry: JSON event lines that identify the run and leak nothing, rate-limited
progress, and Prometheus metrics with only low-cardinality labels.

Tests ``qo_ops.platform.observability.events``; quote_expiration is the job these drive.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
import sqlalchemy as sa

from qo_ops.demo.data import load_demo_data
from qo_ops.jobs.catalog import CATALOG
from qo_ops.jobs.quote_expiration import SPEC
from qo_ops.platform.job.options import RunOptions
from qo_ops.platform.job.outcome import RunSummary
from qo_ops.platform.job.scope import Scope
from qo_ops.platform.observability.events import EVENT_LOGGER, JobMetrics
from qo_ops.platform.run.runner import run_job

AS_OF = datetime(2026, 3, 1, tzinfo=UTC)
JOB = "quote_expiration"
TENANT = "tenant-001"
ALLOWED_LABELS = {"job_name", "status", "error_class", "le"}


@pytest.fixture
def demo(db):
    """Two demo tenants of 200 quotes; 120 ACTIVE quotes each are past expiry by now."""
    load_demo_data(db.engine, tenants=2, quotes=200, seed=3, as_of=AS_OF)
    return db


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.events: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.events.append(dict(getattr(record, "event", {})))


@pytest.fixture
def events() -> Iterator[list[dict]]:
    """Every event the 'qo_ops.events' logger emits during the test."""
    logger = logging.getLogger(EVENT_LOGGER)
    handler = _Capture()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler.events
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def overdue_active(db, tenant: str = TENANT) -> int:
    with db.engine.connect() as conn:
        return conn.scalar(
            sa.text(
                "SELECT count(*) FROM quote WHERE tenant_id = :t AND status = 'ACTIVE' "
                "AND expires_at < now()"
            ),
            {"t": tenant},
        )


def hold_lease(db) -> None:
    with db.engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO job_lease (job_name, scope, owner_id, lease_token, fencing_token, "
                "acquired_at, heartbeat_at, expires_at) "
                "VALUES (:job, :scope, 'elsewhere:1:x', 'not-ours', 1, now(), now(), "
                "now() + interval '1 hour') "
                "ON CONFLICT (job_name, scope) DO UPDATE SET owner_id = EXCLUDED.owner_id, "
                "lease_token = EXCLUDED.lease_token, expires_at = EXCLUDED.expires_at, "
                "job_run_id = NULL"  # a holder elsewhere, not one of our finished runs
            ),
            {"job": JOB, "scope": TENANT},
        )


def execute(**options) -> RunOptions:
    return RunOptions(mode="execute", trigger="manual", requester="test", reason="r", **options)


# ------------------------------------------------------------------------- event lines


def test_cli_events_are_json_lines_that_identify_the_run_and_leak_nothing(demo, cli):
    backlog = overdue_active(demo)
    result = cli(
        "run", JOB, "--tenant", TENANT, "--mode", "execute", "--reason", "r", "--batch-size", "20"
    )
    assert result.code == 0, result.stderr
    summary = dict(line.partition("=")[::2] for line in result.stdout.splitlines())
    run_id = summary["job_run_id"]
    assert int(summary["processed_count"]) == backlog > 20  # several batches

    lines = result.stderr.splitlines()
    assert lines, "no events on stderr"
    events = [json.loads(line) for line in lines]  # every line is one JSON object
    assert all(isinstance(e, dict) for e in events)
    names = [e["event.name"] for e in events]
    for expected in ("job.started", "job.lock.acquire.succeeded", "job.progress", "job.finished"):
        assert expected in names, names
    assert names[0] == "job.started"
    assert names[-1] == "job.finished"
    assert names.index("job.lock.acquire.succeeded") < names.index("job.progress")
    for event in events:
        assert event["job.name"] == JOB
        assert event["job.run_id"] == run_id
        assert event["job.trigger"] == "manual"
        assert event["job.scope"] == TENANT

    with demo.engine.connect() as conn:
        row = conn.execute(sa.text("SELECT * FROM job_run WHERE id = :id"), {"id": run_id}).one()
        lease_token = conn.scalar(
            sa.text("SELECT lease_token FROM job_lease WHERE job_name = :j AND scope = :s"),
            {"j": JOB, "s": TENANT},
        )
        customer_refs = list(conn.scalars(sa.text("SELECT DISTINCT customer_ref FROM quote")))
        payload_values = list(
            conn.scalars(
                sa.text(
                    "SELECT DISTINCT payload->>'expired_at' FROM outbox_event "
                    "WHERE event_type = 'QuoteExpired' AND tenant_id = :t"
                ),
                {"t": TENANT},
            )
        )

    finished = events[-1]
    assert finished["job.status"] == row.status == "success"
    assert finished["items.eligible"] == row.eligible_count
    assert finished["items.processed"] == row.processed_count
    assert finished["items.succeeded"] == row.succeeded_count
    assert finished["items.failed"] == row.failed_count
    assert finished["items.skipped"] == row.skipped_count

    assert lease_token and len(lease_token) >= 16
    assert lease_token not in result.stderr
    assert lease_token not in result.stdout
    assert customer_refs
    leaked = [ref for ref in customer_refs if ref in result.stderr]
    assert leaked == []
    assert len(payload_values) >= backlog  # the events this run wrote, at least
    leaked_payload = [v for v in payload_values if v in result.stderr]
    assert leaked_payload == []


def test_progress_is_rate_limited_to_one_event_per_interval(demo, events):
    summary = run_job(
        SPEC,
        Scope(TENANT),
        execute(batch_size=20, progress_interval_s=3600),
        engine=demo.engine,
        metrics=JobMetrics(),
    )
    assert summary.status == "success"
    assert summary.batches > 1
    progress = [e for e in events if e.get("event.name") == "job.progress"]
    assert len(progress) == 1, (
        f"{len(progress)} job.progress events over {summary.batches} batches "
        "with progress_interval_s=3600"
    )
    assert progress[0]["job.run_id"] == summary.job_run_id


def test_progress_interval_zero_reports_every_batch(demo, events):
    summary = run_job(
        SPEC,
        Scope(TENANT),
        execute(batch_size=20, progress_interval_s=0),
        engine=demo.engine,
        metrics=JobMetrics(),
    )
    assert summary.status == "success"
    assert summary.batches > 1
    progress = [e for e in events if e.get("event.name") == "job.progress"]
    assert len(progress) == summary.batches
    assert [e["batch_number"] for e in progress] == list(range(1, summary.batches + 1))
    assert progress[-1]["items.processed"] == summary.counts.processed


# ------------------------------------------------------------------------- metrics


def sample(metrics: JobMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"job_name": JOB, **labels})


def test_metrics_of_a_partial_then_a_full_run(demo):
    metrics = JobMetrics()
    backlog = overdue_active(demo)

    partial = run_job(
        SPEC,
        Scope(TENANT),
        execute(batch_size=20, max_items=40),
        engine=demo.engine,
        metrics=metrics,
    )
    assert partial.counts.processed == 40
    assert sample(metrics, "job_lag_seconds") > 0  # quotes are still overdue

    full = run_job(SPEC, Scope(TENANT), execute(batch_size=20), engine=demo.engine, metrics=metrics)
    assert full.status == "success"
    assert full.counts.processed == backlog - 40

    assert sample(metrics, "job_started_total") == 2
    assert sample(metrics, "job_completed_total", status="success") == 2
    assert sample(metrics, "job_items_processed_total") == backlog
    assert sample(metrics, "job_items_processed_total") == (
        partial.counts.processed + full.counts.processed
    )
    assert (sample(metrics, "job_last_success_timestamp_seconds") or 0) > 0
    assert sample(metrics, "job_lag_seconds") == 0
    assert sample(metrics, "job_duration_seconds_count", status="success") == 2
    assert sample(metrics, "job_skipped_total") is None
    assert sample(metrics, "job_lock_acquire_failed_total") is None


def test_metrics_of_a_skipped_run(demo):
    metrics = JobMetrics()
    hold_lease(demo)
    summary = run_job(SPEC, Scope(TENANT), execute(), engine=demo.engine, metrics=metrics)
    assert summary.status == "skipped"
    assert sample(metrics, "job_lock_acquire_failed_total") == 1
    assert sample(metrics, "job_skipped_total") == 1
    assert sample(metrics, "job_completed_total", status="skipped") == 1
    assert sample(metrics, "job_items_processed_total") is None
    assert sample(metrics, "job_last_success_timestamp_seconds") is None


def test_the_last_success_is_an_execute_ending_in_one_of_the_jobs_fresh_statuses():
    """The in-process gauge names the same last success as the exporter and ``qo-ops status``:
    a delivery job's partial success (its poison items fail on purpose) counts, a sweep's
    does not, and a dry run never does (issue 43)."""

    def last_success(job: str, status: str, mode: str = "execute") -> float | None:
        metrics = JobMetrics()
        summary = RunSummary("r", job, status, mode, "tenant-001", "manual", None)
        metrics.count_run(CATALOG[job], summary, 1.0)
        return metrics.registry.get_sample_value(
            "job_last_success_timestamp_seconds", {"job_name": job}
        )

    assert last_success("delivery_retry", "partial_success")
    assert last_success("delivery_retry", "no_work")
    assert last_success(JOB, "partial_success") is None
    assert last_success(JOB, "success")
    assert last_success(JOB, "success", mode="dry_run") is None
    assert last_success(JOB, "failed") is None


def test_metric_labels_never_carry_tenant_run_or_item_ids(demo):
    metrics = JobMetrics()
    ok = run_job(SPEC, Scope(TENANT), execute(batch_size=50), engine=demo.engine, metrics=metrics)
    dry = run_job(SPEC, Scope("tenant-002"), RunOptions(), engine=demo.engine, metrics=metrics)
    hold_lease(demo)
    skipped = run_job(SPEC, Scope(TENANT), execute(), engine=demo.engine, metrics=metrics)
    assert (ok.status, dry.status, skipped.status) == ("success", "success", "skipped")

    samples = [s for family in metrics.registry.collect() for s in family.samples]
    labelled = [s for s in samples if s.labels]
    assert labelled, "no labelled samples collected"
    names = {label for s in samples for label in s.labels}
    assert names <= ALLOWED_LABELS, names - ALLOWED_LABELS
    forbidden = {TENANT, "tenant-002", ok.job_run_id, dry.job_run_id, skipped.job_run_id}
    forbidden |= set(dry.sample_ids)
    values = {value for s in samples for value in s.labels.values()}
    assert values.isdisjoint(forbidden), values & forbidden
