"""The exporter end to end: jobs run as separate short processes (success, partial success,
failure, skipped by a held lease), then a real ``qo-ops metrics`` process is scraped over
HTTP. Every seed metric is there with the value the run records imply, and only the
allowed labels appear. Suspensions (``job_control`` rows) become per-job gauges that carry
neither their tenant nor their free text, and leave suspended tenants out of the streaks and
backlogs that alert."""

from __future__ import annotations

import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta

import httpx
import pytest
import sqlalchemy as sa
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from qo_ops.demo.data import load_demo_data
from qo_ops.jobs.catalog import CATALOG
from qo_ops.metrics.exporter import JobCollector
from qo_ops.platform.run.lease import acquire
from qo_ops.platform.schedule.cron import cadence_seconds, cron_ticks
from qo_ops_tests.conftest import QO_OPS_BIN, approval_args, base_env, run_cli
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
ALLOWED_LABELS = {  # SPEC §2 Telemetry: bounded sets declared in code
    "job_name", "status", "error_class", "side_effect", "result", "reason",
    "scope", "mismatch_type", "trigger",
    "downstream", "state", "to",  # a breaker's origin and state; a transition's target
    "service_version", "code_revision",  # qo_ops_build_info, runs by code: releases only
}  # fmt: skip


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> Samples:
    return parse(httpx.get(f"{url}/metrics", timeout=10).text)


def parse(text: str) -> Samples:
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def _until(read, ready, timeout: float) -> Samples:
    """``read()`` until ``ready(samples)``: the exporter counts a run only once it is older
    than its settle time (2 s), so a run that just ended appears a scrape or two later."""
    deadline = time.monotonic() + timeout
    while True:
        samples = read()
        if ready(samples):
            return samples
        assert time.monotonic() < deadline, "the exporter never showed the runs"
        time.sleep(0.25)


def scrape_when(url: str, ready, timeout: float = 30.0) -> Samples:
    """Scrape the exporter process at ``url`` until ``ready(samples)``."""
    return _until(lambda: scrape(url), ready, timeout)


def collect(collector: JobCollector) -> Samples:
    """One scrape of an in-process collector."""
    registry = CollectorRegistry()
    registry.register(collector)
    return parse(generate_latest(registry).decode())


def collect_when(collector: JobCollector, ready, timeout: float = 30.0) -> Samples:
    """Scrape an in-process collector until ``ready(samples)``."""
    return _until(lambda: collect(collector), ready, timeout)


def finished_runs(db, job: str) -> int:
    """How many runs of ``job`` have finished (what job_completed_total will count)."""
    with db.engine.connect() as conn:
        return int(
            conn.execute(
                sa.text(
                    "SELECT count(*) FROM job_run WHERE job_name = :j AND finished_at IS NOT NULL"
                ),
                {"j": job},
            ).scalar_one()
        )


def completed(samples, job: str) -> float:
    return sum(
        v for (n, labels), v in samples.items()
        if n == "job_completed_total" and ("job_name", job) in labels
    )  # fmt: skip


@contextmanager
def running_exporter(db, tmp_path, **settings: str) -> Iterator[str]:
    """A real ``qo-ops metrics`` process on this test's database; yields its URL."""
    port = free_port()
    log = (tmp_path / "metrics.log").open("wb")
    proc = subprocess.Popen(
        [QO_OPS_BIN, "metrics", "--host", "127.0.0.1", "--port", str(port)],
        env=base_env(QO_OPS_DATABASE_URL=db.env_url, QO_OPS_METRICS_REFRESH_S="1", **settings),
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
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=15)
        log.close()


@pytest.fixture
def exporter(db, tmp_path):
    with running_exporter(db, tmp_path) as url:
        yield url


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
        args += approval_args(job)
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
    # delivery_retry's partial success counts (its poison items fail on purpose), its failure not
    partial = next(r for r in runs if r.status == "partial_success")
    assert value(
        samples, "job_last_success_timestamp_seconds", job_name="delivery_retry"
    ) == pytest.approx(partial.finished_at.timestamp(), abs=0.01)
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
    # a job whose backlog grows by design between its daily runs serves none (no alert)
    assert not any(
        name == "job_backlog_items" and ("job_name", "run_history_retention") in labels
        for name, labels in samples
    )
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


def _suspend(db, job: str, tenant: str, by: str, reason: str, age_s: float) -> None:
    """A job_control row as `qo-ops suspend` writes it ('' = every scope), ``age_s`` old."""
    with db.engine.begin() as conn:
        conn.execute(
            sa.text(
                """
                INSERT INTO job_control (job_name, tenant_id, suspended_by, reason, suspended_at)
                VALUES (:job, :tenant, :by, :reason,
                        clock_timestamp() - make_interval(secs => :age))
                """
            ),
            {"job": job, "tenant": tenant, "by": by, "reason": reason, "age": age_s},
        )


def _resume_all(db) -> None:
    with db.engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM job_control"))


SUSPENSION_GAUGES = ("job_suspended", "job_suspensions", "job_suspended_seconds")
# Free text a suspension carries: none of it may reach the scrape, not even redacted.
SECRET_REASON = (
    "INC-4711 downstream leaking data, ask ops-lead@example.com; "
    "token=s3cr3tT0kenValue qoops_0123456789abcdef_PrivateTokenBody Bearer eyJhbGciOiJIUzI1"
)
SECRET_TEXT = (
    "ops-lead@example.com",
    "s3cr3tT0kenValue",
    "PrivateTokenBody",
    "eyJhbGciOiJIUzI1",
    "INC-4711",
    "leaking",
    "alice.admin@example.com",
    "bob@example.org",
    "tenant-007",
    "tenant-008",
    "retired_job",
)


def _suspension_samples(samples: Samples) -> Samples:
    return {k: v for k, v in samples.items() if k[0] in SUSPENSION_GAUGES}


def test_suspensions_are_job_gauges_without_tenant_reason_or_author(db, tmp_path):
    _suspend(db, "quote_expiration", "", "alice.admin@example.com", SECRET_REASON, 7200)
    _suspend(db, "delivery_retry", "tenant-007", "bob@example.org", SECRET_REASON, 1800)
    _suspend(db, "delivery_retry", "tenant-008", "bob@example.org", "INC-4711 too", 600)
    _suspend(db, "retired_job", "", "bob@example.org", "no longer in the catalog", 60)
    with running_exporter(db, tmp_path, QO_OPS_SUSPENSION_ALERT_AFTER_S="5400") as url:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        samples = parse(text)
        for secret in SECRET_TEXT:
            assert secret not in text, secret
        for (name, labels), _ in samples.items():
            keys = {k for k, _ in labels} - ({"le"} if name.endswith("_bucket") else set())
            assert keys <= ALLOWED_LABELS, (name, labels)

        # exactly these series: one per suspended catalog job, labelled by job_name alone
        got = _suspension_samples(samples)
        assert set(got) == {
            ("job_suspended", (("job_name", "quote_expiration"),)),
            ("job_suspensions", (("job_name", "quote_expiration"),)),
            ("job_suspensions", (("job_name", "delivery_retry"),)),
            ("job_suspended_seconds", (("job_name", "quote_expiration"),)),
            ("job_suspended_seconds", (("job_name", "delivery_retry"),)),
        }
        assert value(samples, "job_suspended", job_name="quote_expiration") == 1
        assert value(samples, "job_suspensions", job_name="quote_expiration") == 1
        assert value(samples, "job_suspensions", job_name="delivery_retry") == 2
        # the oldest suspension's age, on the database's clock
        assert value(
            samples, "job_suspended_seconds", job_name="quote_expiration"
        ) == pytest.approx(7200, abs=30)
        assert value(samples, "job_suspended_seconds", job_name="delivery_retry") == pytest.approx(
            1800, abs=30
        )
        assert value(samples, "job_suspension_alert_after_seconds") == 5400

        # read at each scrape: the age grows, and a resumed job's series are gone
        time.sleep(1.1)
        later = scrape(url)
        assert value(later, "job_suspended_seconds", job_name="delivery_retry") > value(
            samples, "job_suspended_seconds", job_name="delivery_retry"
        )
        _resume_all(db)
        after = scrape(url)
        assert _suspension_samples(after) == {}
        assert value(after, "job_suspension_alert_after_seconds") == 5400
        assert value(after, "qo_ops_database_up") == 1


def _finished_runs(db, job: str, scope: str, statuses: list[str]) -> None:
    """Execute runs of ``job`` on ``scope`` that ended in ``statuses``, oldest first."""
    with db.engine.begin() as conn:
        for i, status in enumerate(statuses):
            conn.execute(
                sa.text(
                    """
                    INSERT INTO job_run (id, job_name, scope, mode, trigger_type, owner_id,
                                         status, started_at, finished_at)
                    VALUES (:id, :job, :scope, 'execute', 'schedule', 'host:1:test', :status,
                            clock_timestamp() - make_interval(secs => :ago + 5),
                            clock_timestamp() - make_interval(secs => :ago))
                    """
                ),
                {
                    "id": uuid.uuid4(),
                    "job": job,
                    "scope": scope,
                    "status": status,
                    "ago": 600 - 60 * i,
                },
            )


def _collect(collector: JobCollector) -> Samples:
    """One scrape of ``collector`` in this process, backlog refreshed first."""
    collector.refresh_slow()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return parse(generate_latest(registry).decode())


def test_a_suspended_tenant_is_left_out_of_streaks_and_backlogs(db):
    """A tenant suspended on its own waits on purpose: its failure streak, backlog and lag do
    not count for the job (whose alerts speak for the other tenants). A job-wide suspension
    leaves the gauges whole: job_suspended quiets the alerts instead."""
    load_demo_data(db.engine, tenants=2, quotes=300, seed=9, as_of=AS_OF)
    _finished_runs(db, "delivery_retry", "tenant-001", ["failed", "failed", "timeout"])
    _finished_runs(db, "delivery_retry", "tenant-002", ["success", "failed"])
    overdue = dict(
        _rows(
            db,
            "SELECT tenant_id, count(*) FROM quote WHERE status = 'ACTIVE' AND expires_at < now()"
            " GROUP BY tenant_id",
        )
    )
    assert overdue.get("tenant-001") and overdue.get("tenant-002")
    collector = JobCollector(db.engine, CATALOG.values())

    def gauges(samples: Samples) -> tuple[float, float, float]:
        return (
            value(samples, "job_consecutive_failures", job_name="delivery_retry"),
            value(samples, "job_backlog_items", job_name="quote_expiration"),
            value(samples, "job_lag_seconds", job_name="quote_expiration"),
        )

    streak, backlog, lag = gauges(_collect(collector))
    assert (streak, backlog) == (3, overdue["tenant-001"] + overdue["tenant-002"])

    _suspend(db, "delivery_retry", "tenant-001", "ops", "INC-1", 60)
    _suspend(db, "quote_expiration", "tenant-001", "ops", "INC-1", 60)
    streak, backlog_2, lag_2 = gauges(_collect(collector))
    assert (streak, backlog_2) == (1, overdue["tenant-002"])
    assert 0 < lag_2 <= lag

    _resume_all(db)
    _suspend(db, "delivery_retry", "", "ops", "INC-2", 60)
    _suspend(db, "quote_expiration", "", "ops", "INC-2", 60)
    samples = _collect(collector)
    assert gauges(samples)[:2] == (3, backlog)
    assert value(samples, "job_suspended", job_name="delivery_retry") == 1


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


@pytest.mark.parametrize(
    "cron, seconds",
    [("* * * * *", 60), ("*/15 * * * *", 900), ("7 * * * *", 3600), ("15 3 * * *", 86400)],
)
def test_each_cron_form_has_its_cadence(cron, seconds):
    assert cadence_seconds(cron) == seconds


@pytest.mark.parametrize("name", sorted(CATALOG))
def test_every_catalog_schedule_has_the_cadence_its_ticks_keep(name):
    """The cadence served as job_expected_interval_seconds is the gap between two of the
    schedule's own ticks, every gap of a day of them (cron_ticks counts them apart)."""
    cron = CATALOG[name].deployment.cron_schedule
    start = datetime(2026, 3, 1, tzinfo=UTC)
    ticks = cron_ticks(cron, start, start + timedelta(days=2))
    gaps = {(b - a).total_seconds() for a, b in zip(ticks, ticks[1:], strict=False)}
    assert gaps == {cadence_seconds(cron)}


def test_a_cron_without_one_cadence_is_refused():
    with pytest.raises(ValueError):
        cadence_seconds("0 0 1 * *")


def test_metrics_command_refuses_bad_settings(db):
    bad = run_cli(
        ["metrics", "--once"],
        base_env(QO_OPS_DATABASE_URL=db.env_url, QO_OPS_METRICS_REFRESH_S="soon"),
    )
    assert bad.code == 2 and "QO_OPS_METRICS_REFRESH_S" in bad.stderr
    for wrong in ("1d", "59", "nan", "1e9"):
        bad = run_cli(
            ["metrics", "--once"],
            base_env(QO_OPS_DATABASE_URL=db.env_url, QO_OPS_SUSPENSION_ALERT_AFTER_S=wrong),
        )
        assert bad.code == 2, (wrong, bad)
        assert "QO_OPS_SUSPENSION_ALERT_AFTER_S" in bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1 and "Traceback" not in bad.stderr
    good = run_cli(
        ["metrics", "--once"],
        base_env(QO_OPS_DATABASE_URL=db.env_url, QO_OPS_SUSPENSION_ALERT_AFTER_S="600"),
    )
    assert good.code == 0 and "job_suspension_alert_after_seconds 600.0" in good.stdout
    # the configured downstream's breaker is served closed before any run opened it
    configured = run_cli(
        ["metrics", "--once"],
        base_env(
            QO_OPS_DATABASE_URL=db.env_url, QO_OPS_DOWNSTREAM_URL="http://u:pw@fulfil.internal/x"
        ),
    )
    assert configured.code == 0, configured.stderr
    assert (
        'qo_ops_downstream_breaker_state{downstream="http://fulfil.internal:80",state="closed"} 1.0'
        in configured.stdout
    )
    assert "pw@" not in configured.stdout
    bad = run_cli(
        ["metrics", "--once"],
        base_env(QO_OPS_DATABASE_URL=db.env_url, QO_OPS_DOWNSTREAM_URL="ftp://fulfil.internal"),
    )
    assert bad.code == 2 and "QO_OPS_DOWNSTREAM_URL" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and "Traceback" not in bad.stderr
    assert run_cli(["metrics", "--port", "0"], base_env(QO_OPS_DATABASE_URL=db.env_url)).code == 2
