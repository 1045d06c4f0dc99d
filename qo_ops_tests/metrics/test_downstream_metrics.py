"""What the exporter says about the downstream: the runs' calls (retries, calls not sent,
rate-limit pauses, spared items, breaker transitions) as counters over their tallies, and
each downstream's shared circuit breaker as gauges read from ``downstream_breaker``.

First with planted rows (every figure and every broken state known in advance), then end to
end: delivery_retry against a simulator that is down, then up again, as separate ``qo-ops``
processes, with the operator's views (``qo-ops run``, ``runs``, ``status``,
``downstream-status``) and the exporter following the same incident.
"""

from __future__ import annotations

import json
import uuid

import pytest
import sqlalchemy as sa

from qo_ops.demo.data import load_demo_data
from qo_ops.jobs.catalog import CATALOG
from qo_ops.metrics.exporter import JobCollector
from qo_ops_tests.conftest import base_env, run_cli
from qo_ops_tests.dagster.conftest import AS_OF
from qo_ops_tests.metrics.test_exporter import (
    ALLOWED_LABELS,
    Samples,
    collect,
    collect_when,
    completed,
    finished_runs,
    value,
)

COUNTERS = (
    "job_downstream_calls_total",
    "job_downstream_retries_total",
    "job_downstream_not_sent_total",
    "job_downstream_rate_limit_pauses_total",
    "job_downstream_rate_limit_wait_seconds_total",
    "job_downstream_spared_total",
    "job_breaker_transitions_total",
)
# free text a breaker row or a tally may carry: none of it may reach the scrape
SECRET_ORIGIN = "https://svc:s3cr3tPassw0rd@tenant-007.example:443/INC-4711"
BREAKER_REASON = "connect_error 10_in_a_row"


def _run_row(db, job: str, status: str, tally: dict[str, int], finished: bool = True) -> None:
    """A job_run row of ``job`` that ended ``status`` 10 s ago with ``tally``."""
    with db.engine.begin() as conn:
        conn.execute(
            sa.text(
                """
                INSERT INTO job_run (id, job_name, scope, mode, trigger_type, owner_id, status,
                                     started_at, finished_at, tally)
                VALUES (:id, :job, 'tenant-001', 'execute', 'schedule', 'host:1:test', :status,
                        clock_timestamp() - interval '20 seconds',
                        CASE WHEN :finished THEN clock_timestamp() - interval '10 seconds' END,
                        CAST(:tally AS jsonb))
                """
            ),
            {
                "id": uuid.uuid4(),
                "job": job,
                "status": status,
                "finished": finished,
                "tally": json.dumps(tally),
            },
        )


def _breaker_row(db, downstream: str, state: str, opened_ago_s: float | None) -> None:
    """A downstream_breaker row as a run writes it: opened ``opened_ago_s`` ago."""
    with db.engine.begin() as conn:
        conn.execute(
            sa.text(
                """
                INSERT INTO downstream_breaker (downstream, state, opened_at, probe_after, reason,
                                                opened_count, changed_at)
                VALUES (:d, :state,
                        clock_timestamp() - make_interval(secs => :ago),
                        CASE WHEN :state = 'open' THEN clock_timestamp() + interval '30 s' END,
                        :reason, 3, clock_timestamp() - interval '5 seconds')
                """
            ),
            {"d": downstream, "state": state, "ago": opened_ago_s, "reason": BREAKER_REASON},
        )


def _labels_are_bounded(text: str, samples: Samples) -> None:
    for (name, labels), _ in samples.items():
        keys = {k for k, _ in labels} - ({"le"} if name.endswith("_bucket") else set())
        assert keys <= ALLOWED_LABELS, (name, labels)
    for secret in ("s3cr3tPassw0rd", "tenant-007", "INC-4711", BREAKER_REASON, "bogus"):
        assert secret not in text, secret


def test_downstream_counters_and_breaker_gauges_from_planted_rows(db):
    # two finished runs of delivery_retry: an outage (the breaker opened, probed, closed)
    # and a calm run; a run still going counts only once it has finished
    _run_row(
        db,
        "delivery_retry",
        "failed",
        {
            "downstream.calls": 100,
            "downstream.retries": 25,
            "downstream.refused_open": 7,
            "downstream.retry_budget_refused": 3,
            "downstream.rate_limit_pauses": 2,
            "downstream.rate_limit_wait_ms": 1500,
            "downstream.spared": 9,
            "breaker.open": 2,
            "breaker.half_open": 1,
            "breaker.closed": 1,
            "outcome.retryable.attempt_1.spared": 9,
        },
    )
    _run_row(db, "delivery_retry", "success", {"downstream.calls": 50, "downstream.retries": 5})
    _run_row(db, "delivery_retry", "running", {"downstream.calls": 1000}, finished=False)
    # a job that does not call the downstream: words outside the lists never become labels
    _run_row(db, "quote_expiration", "success", {"breaker.bogus": 5, "downstream.bogus": 4})
    # breakers: one open for 2 minutes, one probing after 45 s open, one closed again after
    # an earlier outage, one whose origin is not an origin (free text must not leak)
    _breaker_row(db, "http://fulfilment.internal:8443", "open", 120)
    _breaker_row(db, "http://sink.internal:80", "half_open", 45)
    _breaker_row(db, "https://old.internal:443", "closed", 3600)
    _breaker_row(db, SECRET_ORIGIN, "open", 600)
    _breaker_row(db, "fulfilment (INC-4711)", "closed", 60)  # two such rows: the worst shows
    collector = JobCollector(
        db.engine, CATALOG.values(), downstreams=["http://configured.internal:8089"]
    )

    samples = collect_when(collector, lambda s: completed(s, "delivery_retry") == 2)
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    text = generate_latest(registry).decode()
    _labels_are_bounded(text, samples)

    job = {"job_name": "delivery_retry"}
    assert value(samples, "job_downstream_calls_total", **job) == 150
    assert value(samples, "job_downstream_retries_total", **job) == 30
    # retry pressure, as the dashboard and QoOpsJobRetryPressureHigh compute it: 20 %
    pressure = value(samples, "job_downstream_retries_total", **job) / value(
        samples, "job_downstream_calls_total", **job
    )
    assert pressure == pytest.approx(0.2)
    assert value(samples, "job_downstream_not_sent_total", **job, reason="breaker_open") == 7
    assert value(samples, "job_downstream_not_sent_total", **job, reason="retry_budget") == 3
    assert value(samples, "job_downstream_rate_limit_pauses_total", **job) == 2
    assert value(samples, "job_downstream_rate_limit_wait_seconds_total", **job) == 1.5
    assert value(samples, "job_downstream_spared_total", **job) == 9
    for to, n in (("open", 2), ("half_open", 1), ("closed", 1)):
        assert value(samples, "job_breaker_transitions_total", **job, to=to) == n
    # a job that calls the downstream has every series from the first scrape, at 0
    publish = {"job_name": "notification_publish"}
    for metric in COUNTERS:
        got = {
            k: v
            for k, v in samples.items()
            if k[0] == metric and ("job_name", "notification_publish") in k[1]
        }
        assert got and set(got.values()) == {0.0}, metric
    assert value(samples, "job_breaker_transitions_total", **publish, to="open") == 0
    # a job that does not has none (its bogus keys included)
    assert not [k for k in samples if k[0] in COUNTERS and ("job_name", "quote_expiration") in k[1]]

    # breaker gauges, per origin: one state at 1, open seconds on the database's clock
    def state(downstream: str) -> dict[str, float]:
        return {
            s: value(samples, "qo_ops_downstream_breaker_state", downstream=downstream, state=s)
            for s in ("closed", "open", "half_open")
        }

    def open_s(downstream: str) -> float:
        return value(samples, "qo_ops_downstream_breaker_open_seconds", downstream=downstream)

    assert state("http://fulfilment.internal:8443") == {"closed": 0, "open": 1, "half_open": 0}
    assert open_s("http://fulfilment.internal:8443") == pytest.approx(120, abs=15)
    assert state("http://sink.internal:80") == {"closed": 0, "open": 0, "half_open": 1}
    assert open_s("http://sink.internal:80") == pytest.approx(45, abs=15)
    assert state("https://old.internal:443") == {"closed": 1, "open": 0, "half_open": 0}
    assert open_s("https://old.internal:443") == 0  # closed: 0, however long ago it opened
    assert state("other") == {"closed": 0, "open": 1, "half_open": 0}
    assert open_s("other") == pytest.approx(600, abs=15)
    # the configured downstream no run has opened yet: closed from the first scrape
    assert state("http://configured.internal:8089") == {"closed": 1, "open": 0, "half_open": 0}
    assert open_s("http://configured.internal:8089") == 0
    breakers = {
        dict(labels)["downstream"]
        for name, labels in samples
        if name == "qo_ops_downstream_breaker_open_seconds"
    }
    assert len(breakers) == 5

    # read on each scrape: the breaker closes, its gauges follow at once
    with db.engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE downstream_breaker SET state = 'closed', probe_after = NULL "
                "WHERE downstream = 'http://fulfilment.internal:8443'"
            )
        )
    after = collect(collector)
    assert (
        value(
            after,
            "qo_ops_downstream_breaker_state",
            downstream="http://fulfilment.internal:8443",
            state="closed",
        )
        == 1
    )
    assert (
        value(
            after,
            "qo_ops_downstream_breaker_open_seconds",
            downstream="http://fulfilment.internal:8443",
        )
        == 0
    )
    assert value(after, "job_downstream_calls_total", **job) == 150  # counted once


def _env(db, url: str, **extra: str) -> dict[str, str]:
    return base_env(
        QO_OPS_DATABASE_URL=db.env_url,
        QO_OPS_DOWNSTREAM_URL=url,
        QO_OPS_BREAKER_OPEN_S="0.1",  # a probe is due at once after the breaker opened
        **extra,
    )


def _delivery_run(db, url: str) -> tuple[int, dict[str, str]]:
    """``qo-ops run delivery_retry --mode execute`` as a process: exit code, ``key=value``
    lines."""
    result = run_cli(
        ["run", "delivery_retry", "--tenant", "tenant-001", "--mode", "execute",
         "--reason", "INC-20 drill"],
        _env(db, url),
    )  # fmt: skip
    assert "Traceback" not in result.stderr
    lines = dict(line.split("=", 1) for line in result.stdout.splitlines() if "=" in line)
    return result.code, lines


def test_a_downstream_incident_as_the_operator_and_the_exporter_see_it(db, downstream_factory):
    load_demo_data(db.engine, tenants=1, quotes=300, seed=4, as_of=AS_OF)
    with db.engine.begin() as conn:  # every delivery item due now, no poison
        due = conn.execute(
            sa.text(
                "UPDATE delivery_attempt_item SET status = 'READY', attempt_count = 0, "
                "max_attempts = 30, next_attempt_at = now() - interval '1 minute', "
                "payload = payload - 'fault' WHERE tenant_id = 'tenant-001'"
            )
        ).rowcount
    assert due > 40
    server = downstream_factory()
    server.stop()  # the downstream is down: every connection refused
    origin = server.url
    collector = JobCollector(db.engine, CATALOG.values(), downstreams=[origin])

    # the downstream is down: the breaker opens, the run stops dependency_unavailable
    code, out = _delivery_run(db, server.url)
    assert code == 1
    assert out["status"] == "failed" and out["error_code"] == "dependency_unavailable"
    assert out["status_reason"] == f"circuit breaker open for {origin}"
    assert "breaker opened 1" in out["downstream"] and "spared" in out["downstream"]
    down = collect_when(collector, lambda s: completed(s, "delivery_retry") == 1)
    job = {"job_name": "delivery_retry"}
    assert value(down, "job_breaker_transitions_total", **job, to="open") == 1
    assert value(down, "job_breaker_transitions_total", **job, to="closed") == 0
    assert value(down, "job_failed_total", **job, error_class="dependency_unavailable") == 1
    assert value(down, "qo_ops_downstream_breaker_state", downstream=origin, state="open") == 1
    assert value(down, "qo_ops_downstream_breaker_open_seconds", downstream=origin) > 0
    tally = _tally(db)
    assert value(down, "job_downstream_calls_total", **job) == tally["downstream.calls"] > 0
    assert value(down, "job_downstream_spared_total", **job) == tally["downstream.spared"] > 0
    # nothing was dead-lettered and no attempt used up by the outage
    assert (
        _scalar(db, "SELECT count(*) FROM delivery_attempt_item WHERE status = 'DEAD_LETTER'") == 0
    )

    # the operator's views: the breaker row without SQL, the stopped run in the history
    status = run_cli(["downstream-status"], _env(db, server.url))
    assert status.code == 0, status.stderr
    [line] = [x for x in status.stdout.splitlines() if x.startswith(origin)]
    assert " open " in line and "connect_error" in line
    as_json = json.loads(run_cli(["downstream-status", "--json"], _env(db, server.url)).stdout)
    [row] = as_json["breakers"]
    assert row["downstream"] == origin and row["state"] == "open" and row["opened_count"] == 1
    assert row["recent_calls"] == 0  # an open breaker starts from no evidence
    job_status = run_cli(["status", "delivery_retry"], _env(db, server.url))
    assert f"downstream {origin}: circuit breaker open" in job_status.stdout
    history = run_cli(["runs", "delivery_retry"], _env(db, server.url))
    assert "retry pressure" in history.stdout and "opened 1" in history.stdout

    # the downstream is back: the next run probes (half-open), closes it and delivers
    server.start()
    code, out = _delivery_run(db, server.url)
    assert code == 0, out
    assert "breaker half-opened 1, closed 1" in out["downstream"]
    up = collect_when(collector, lambda s: completed(s, "delivery_retry") == 2)
    for to, n in (("open", 1), ("half_open", 1), ("closed", 1)):
        assert value(up, "job_breaker_transitions_total", **job, to=to) == n
    assert value(up, "qo_ops_downstream_breaker_state", downstream=origin, state="closed") == 1
    assert value(up, "qo_ops_downstream_breaker_state", downstream=origin, state="open") == 0
    assert value(up, "qo_ops_downstream_breaker_open_seconds", downstream=origin) == 0
    tally = _tally(db)
    assert value(up, "job_downstream_calls_total", **job) == tally["downstream.calls"]
    assert value(up, "job_downstream_retries_total", **job) == tally.get("downstream.retries", 0)
    assert server.client.stats()["deliveries_distinct"] == due
    assert finished_runs(db, "delivery_retry") == 2
    closed = run_cli(["downstream-status"], _env(db, server.url)).stdout
    assert " closed " in closed and "probes_answered" in closed
    after = run_cli(["downstream-status", "--json"], _env(db, server.url)).stdout
    [evidence] = json.loads(after)["breakers"]
    # its evidence since it closed: the deliveries after the probes, none failed
    assert evidence["recent_calls"] > 0 and evidence["recent_failed"] == 0
    assert (
        "circuit breaker" not in run_cli(["status", "delivery_retry"], _env(db, server.url)).stdout
    )


def _scalar(db, sql: str) -> int:
    with db.engine.connect() as conn:
        return int(conn.execute(sa.text(sql)).scalar_one())


def _tally(db) -> dict[str, int]:
    """The delivery_retry runs' tallies, summed key by key."""
    with db.engine.connect() as conn:
        return {
            r.key: int(r.n)
            for r in conn.execute(
                sa.text(
                    "SELECT t.key, sum(t.value::bigint) AS n FROM job_run, "
                    "jsonb_each_text(tally) AS t(key, value) WHERE job_name = 'delivery_retry' "
                    "GROUP BY t.key"
                )
            )
        }
