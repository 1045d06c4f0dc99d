"""The exporter end to end: jobs run as separate short processes (success, partial success,
failure, skipped by a held lease), then a real ``qo-ops metrics`` process is scraped over
HTTP. Every seed metric is there with the value the run records imply, and only the
allowed labels appear."""

from __future__ import annotations

import subprocess
import time
import uuid

import httpx
import pytest
import sqlalchemy as sa
from prometheus_client.parser import text_string_to_metric_families

from qo_ops.demo.data import load_demo_data
from qo_ops.jobs.catalog import CATALOG
from qo_ops.platform.lease import acquire
from qo_ops.platform.spec import cadence_seconds
from qo_ops_tests.conftest import QO_OPS_BIN, base_env, run_cli
from qo_ops_tests.dagster.conftest import AS_OF
from qo_ops_tests.dagster.stack import free_port

SEED_METRICS = (
    "job_started_total",
    "job_completed_total",
    "job_failed_total",
    "job_skipped_total",
    "job_duration_seconds",
    "job_items_processed_total",
    "job_items_failed_total",
    "job_lag_seconds",
    "job_last_success_timestamp_seconds",
    "job_lock_acquire_failed_total",
    "job_retry_scheduled_total",
    "job_deadletter_total",
    "job_duplicate_side_effect_prevented_total",
    "job_checkpoint_age_seconds",
)
ALLOWED_LABELS = {"job_name", "status", "error_class"}


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def scrape_when(url: str, ready, timeout: float = 30.0):
    """Scrape until ``ready(samples)``: the exporter counts a run only once it is older than
    its settle time (2 s), so a run that just ended appears a scrape or two later."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(url)
        if ready(samples):
            return samples
        assert time.monotonic() < deadline, "the exporter never showed the runs"
        time.sleep(0.25)


def completed(samples, job: str) -> float:
    return sum(
        v for (n, labels), v in samples.items()
        if n == "job_completed_total" and ("job_name", job) in labels
    )  # fmt: skip


@pytest.fixture
def exporter(db, tmp_path):
    port = free_port()
    log = (tmp_path / "metrics.log").open("wb")
    proc = subprocess.Popen(
        [QO_OPS_BIN, "metrics", "--host", "127.0.0.1", "--port", str(port)],
        env=base_env(QO_OPS_DATABASE_URL=db.env_url, QO_OPS_METRICS_REFRESH_S="1"),
        stdout=log,
        stderr=log,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/metrics", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.1)
    yield url
    proc.terminate()
    proc.wait(timeout=15)
    log.close()


def _rows(db, sql: str, **params):
    with db.engine.connect() as conn:
        return conn.execute(sa.text(sql), params).all()


def test_every_seed_metric_follows_the_run_records(db, downstream_factory, exporter):
    load_demo_data(db.engine, tenants=2, quotes=300, seed=9, as_of=AS_OF)
    poisoned = downstream_factory(poison_rate=0.5, seed=3)
    env = base_env(QO_OPS_DATABASE_URL=db.env_url)

    def run(job: str, tenant: str, downstream_url: str | None = None) -> int:
        extra = {"QO_OPS_DOWNSTREAM_URL": downstream_url} if downstream_url else {}
        args = ["run", job, "--tenant", tenant, "--mode", "execute", "--reason", "metrics test"]
        return run_cli(args, {**env, **extra}).code

    assert run("quote_expiration", "tenant-001") == 0  # success
    assert run("delivery_retry", "tenant-001", poisoned.url) == 3  # partial_success
    assert run("delivery_retry", "tenant-002", f"http://127.0.0.1:{free_port()}") == 1  # failed
    held = acquire(db.engine, "quote_expiration", "tenant-002", "someone-else", 300, uuid.uuid4())
    assert held is not None
    assert run("quote_expiration", "tenant-002") == 4  # skipped: the lease is held

    samples = scrape_when(
        exporter,
        lambda s: completed(s, "quote_expiration") == 2 and completed(s, "delivery_retry") == 2,
    )

    names = {name for name, _ in samples}
    for metric in SEED_METRICS:
        assert any(n == metric or n.startswith(metric + "_") for n in names), metric
    for (name, labels), _ in samples.items():
        keys = {k for k, _ in labels} - ({"le"} if name.endswith("_bucket") else set())
        assert keys <= ALLOWED_LABELS, (name, labels)
        assert not any("tenant" in v for _, v in labels), (name, labels)

    runs = _rows(
        db,
        "SELECT job_name, status, last_error_code, processed_count, failed_count, "
        "deadlettered_count, retry_scheduled_count, finished_at FROM job_run",
    )
    assert sorted((r.job_name, r.status) for r in runs) == [
        ("delivery_retry", "failed"),
        ("delivery_retry", "partial_success"),
        ("quote_expiration", "skipped"),
        ("quote_expiration", "success"),
    ]
    for job in ("quote_expiration", "delivery_retry"):
        mine = [r for r in runs if r.job_name == job]
        assert value(samples, "job_started_total", job_name=job) == len(mine)
        for r in mine:
            assert value(samples, "job_completed_total", job_name=job, status=r.status) == 1
        for metric, column in (
            ("job_items_processed_total", "processed_count"),
            ("job_items_failed_total", "failed_count"),
            ("job_deadletter_total", "deadlettered_count"),
            ("job_retry_scheduled_total", "retry_scheduled_count"),
        ):
            assert value(samples, metric, job_name=job) == sum(getattr(r, column) for r in mine)
        assert value(samples, "job_duration_seconds_count", job_name=job, status=mine[0].status)
    failed = next(r for r in runs if r.status == "failed")
    assert (
        value(
            samples,
            "job_failed_total",
            job_name="delivery_retry",
            error_class=failed.last_error_code,
        )
        == 1
    )
    assert value(samples, "job_skipped_total", job_name="quote_expiration") == 1
    assert value(samples, "job_lock_acquire_failed_total", job_name="quote_expiration") == 1
    assert value(samples, "job_consecutive_failures", job_name="delivery_retry") == 1
    assert value(samples, "job_consecutive_failures", job_name="quote_expiration") == 0
    latest = max((r for r in runs if r.job_name == "delivery_retry"), key=lambda r: r.finished_at)
    assert (
        value(samples, "job_last_run_status", job_name="delivery_retry", status=latest.status) == 1
    )
    success = next(r for r in runs if r.status == "success")
    assert value(
        samples, "job_last_success_timestamp_seconds", job_name="quote_expiration"
    ) == pytest.approx(success.finished_at.timestamp(), abs=0.01)
    assert value(samples, "job_last_success_timestamp_seconds", job_name="delivery_retry") == 0
    assert value(samples, "job_lease_held", job_name="quote_expiration") == 1
    assert value(samples, "job_lease_age_seconds", job_name="quote_expiration") > 0
    assert value(samples, "job_running", job_name="quote_expiration") == 0
    assert value(samples, "job_expected_interval_seconds", job_name="quote_expiration") == 900

    # backlog and dead letters are what the tables say now
    (overdue,) = _rows(
        db,
        "SELECT count(*) FROM quote WHERE status = 'ACTIVE' AND expires_at <= now()",
    )[0]
    assert value(samples, "job_backlog_items", job_name="quote_expiration") == overdue > 0
    assert value(samples, "job_lag_seconds", job_name="quote_expiration") > 0
    (dead,) = _rows(db, "SELECT count(*) FROM delivery_attempt_item WHERE status = 'DEAD_LETTER'")[
        0
    ]
    assert value(samples, "job_deadletter_items", job_name="delivery_retry") == dead > 0
    assert value(samples, "qo_ops_database_up") == 1

    # a later run is counted once, by the next scrape after it settles
    held.release(db.engine)
    assert run("quote_expiration", "tenant-002") == 0
    later = scrape_when(exporter, lambda s: completed(s, "quote_expiration") == 3)
    assert value(later, "job_completed_total", job_name="quote_expiration", status="success") == 2
    assert value(later, "job_started_total", job_name="quote_expiration") == 3
    assert value(later, "job_lease_held", job_name="quote_expiration") == 0
    deadline = time.monotonic() + 10  # the backlog follows within the refresh period (1 s)
    while value(scrape(exporter), "job_backlog_items", job_name="quote_expiration") != 0:
        assert time.monotonic() < deadline, "backlog gauge did not follow"
        time.sleep(0.5)


def test_database_outage_is_reported_not_hidden(pg_server, tmp_path):
    from qo_ops_tests.conftest import _test_database

    gen = _test_database(pg_server, None)
    victim = next(gen)
    try:
        from qo_ops.db import migrate

        migrate.upgrade(victim.engine)
        port = free_port()
        proc = subprocess.Popen(
            [QO_OPS_BIN, "metrics", "--host", "127.0.0.1", "--port", str(port)],
            env=base_env(QO_OPS_DATABASE_URL=victim.env_url),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                first = scrape(url)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        assert value(first, "qo_ops_database_up") == 1
        from qo_ops_tests.conftest import drop_database

        drop_database(pg_server, victim.url.database)
        after = scrape(url)
        assert value(after, "qo_ops_database_up") == 0
        assert value(after, "job_expected_interval_seconds", job_name="quote_expiration") == 900
        proc.terminate()
        _, err = proc.communicate(timeout=15)
        assert b"Traceback" not in err and b"postgresql://" not in err
    finally:
        gen.close()


def test_every_catalog_schedule_has_a_cadence():
    assert {name: cadence_seconds(s.cron_schedule) for name, s in CATALOG.items()} == {
        "quote_expiration": 900,
        "delivery_retry": 300,
        "notification_publish": 60,
        "order_reconciliation": 86400,
        "read_model_repair": 86400,
        "pricing_snapshot_recalculation": 86400,
        "temp_file_cleanup": 86400,
        "audit_archive": 86400,
        "abandoned_checkout_close": 1800,
        "catalog_cache_refresh": 600,
    }
    with pytest.raises(ValueError):
        cadence_seconds("0 0 1 * *")


def test_metrics_command_refuses_bad_settings(db):
    bad = run_cli(
        ["metrics", "--once"],
        base_env(QO_OPS_DATABASE_URL=db.env_url, QO_OPS_METRICS_REFRESH_S="soon"),
    )
    assert bad.code == 2 and "QO_OPS_METRICS_REFRESH_S" in bad.stderr
    assert run_cli(["metrics", "--port", "0"], base_env(QO_OPS_DATABASE_URL=db.env_url)).code == 2
