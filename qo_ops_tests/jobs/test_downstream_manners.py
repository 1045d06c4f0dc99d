"""The downstream jobs' manners against the real simulator: an outage dead-letters nothing
and uses no attempt, the circuit breaker opens, stays open, half-opens and closes (each
visible), our own rate limit and the downstream's Retry-After are honoured, and a run's
retries are bounded."""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from typing import Any

import pytest
import sqlalchemy as sa

from qo_ops.demo.data import load_demo_data
from qo_ops.jobs import delivery_retry, notification_publish
from qo_ops.platform.observability.events import EVENT_LOGGER
from qo_ops_tests.jobs.test_downstream_jobs import (
    AS_OF,
    BASE_S,
    execute,
    execute_sql,
    fast_retries,  # noqa: F401 (a fixture, used by every test below)
    make_all_deliveries_due,
    q,
    scalar,
    wait_for,
)

pytestmark = pytest.mark.usefixtures("fast_retries")  # backoff of 0.2 s, capped at 1 s

NOT_DELIVERED = "SELECT count(*) FROM delivery_attempt_item WHERE status <> 'DELIVERED'"


def breaker_row(db) -> Any:
    return q(
        db.engine,
        "SELECT state, opened_count, reason, opened_at, probe_after > clock_timestamp() AS waiting "
        "FROM downstream_breaker",
    ).one_or_none()


def probe_due(db) -> bool:
    return bool(
        scalar(
            db.engine,
            "SELECT coalesce(bool_and(probe_after <= clock_timestamp()), true) "
            "FROM downstream_breaker",
        )
    )


def breaker_events(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The breaker transitions the runs reported, in order (their event names)."""
    names = []
    for record in caplog.records:
        if record.name != EVENT_LOGGER:
            continue
        name = json.loads(record.getMessage()).get("event.name", "")
        if name.startswith("downstream.breaker."):
            names.append(name.removeprefix("downstream.breaker."))
    return names


def requests_seen(server) -> int:
    """Every delivery request the simulator received, the ones it failed on purpose too."""
    stats = server.client.stats(detail=False)
    injected = int(stats["faults_injected"]["error"])
    return int(stats["delivery_requests"]) + injected + int(stats["outage_refused"])


@pytest.mark.parametrize("outage", ["503", "refuse"])
def test_an_outage_mid_run_dead_letters_nothing_and_uses_no_attempt(
    db, downstream_factory, monkeypatch, caplog, outage
):
    """The outage starts while a run is sending and lasts several times the whole retry
    schedule (3 attempts: 0.2 s + 0.4 s of backoff); runs keep coming every probe interval.
    Nothing is dead-lettered, no undelivered item used an attempt, and once the downstream is
    back every item is delivered exactly once (the simulator's own counters)."""
    caplog.set_level(logging.INFO, logger=EVENT_LOGGER)
    load_demo_data(db.engine, tenants=1, quotes=1000, seed=3, as_of=AS_OF)
    items = make_all_deliveries_due(db, max_attempts=3, strip_poison=True)
    assert items >= 200
    server = downstream_factory(latency_ms=5)
    monkeypatch.setenv("QO_OPS_DOWNSTREAM_URL", server.url)
    monkeypatch.setenv("QO_OPS_BREAKER_OPEN_S", "0.3")

    runs: list[Any] = []
    first = threading.Thread(
        target=lambda: runs.append(execute(delivery_retry.SPEC, db, batch_size=40, concurrency=4))
    )
    first.start()
    wait_for(lambda: requests_seen(server) >= items // 4, 60, "a quarter of the items sent")
    server.client.set_faults(outage=outage)  # 503 or a dropped connection, nothing stored
    first.join(120)
    (cut,) = runs
    assert (cut.status, cut.error_code) == ("failed", "dependency_unavailable")
    delivered_before = scalar(
        db.engine, "SELECT count(*) FROM delivery_attempt_item WHERE status = 'DELIVERED'"
    )
    assert 0 < delivered_before < items

    outage_started = time.monotonic()
    schedule_s = BASE_S * (1 + 2)  # the whole retry schedule of a 3-attempt item
    probes = 0
    while time.monotonic() - outage_started < 5 * schedule_s or probes < 4:
        wait_for(lambda: probe_due(db), 10, "the breaker's probe to be due")
        before = requests_seen(server)
        down = execute(delivery_retry.SPEC, db, batch_size=40, concurrency=4)
        assert (down.status, down.error_code) == ("failed", "dependency_unavailable")
        assert requests_seen(server) - before == 1  # one probe, then no call
        probes += 1

    assert (
        scalar(db.engine, "SELECT count(*) FROM delivery_attempt_item WHERE status = 'DEAD_LETTER'")
        == 0
    )
    attempts = q(
        db.engine,
        "SELECT attempt_count, count(*) AS n FROM delivery_attempt_item "
        "WHERE status <> 'DELIVERED' GROUP BY attempt_count",
    ).all()
    assert {(r.attempt_count, r.n) for r in attempts} == {(0, items - delivered_before)}
    assert breaker_row(db).state == "open"

    server.client.set_faults(outage=None)  # the downstream is back
    wait_for(lambda: probe_due(db), 10, "the breaker's probe to be due")
    back = execute(delivery_retry.SPEC, db, batch_size=40, concurrency=4)
    assert back.status == "success", back
    assert scalar(db.engine, NOT_DELIVERED) == 0
    stats = server.client.stats()
    assert stats["deliveries_distinct"] == items
    assert set(stats["deliveries_by_key"].values()) == {1}  # each stored once, never again
    assert breaker_row(db).state == "closed"
    events = breaker_events(caplog)
    assert events[0] == "open" and events[-2:] == ["half_open", "closed"]
    assert events.count("half_open") == probes + 1


def test_the_breaker_opens_stays_open_half_opens_and_closes(
    db, downstream_factory, monkeypatch, caplog
):
    caplog.set_level(logging.INFO, logger=EVENT_LOGGER)
    load_demo_data(db.engine, tenants=1, quotes=400, seed=3, as_of=AS_OF)
    items = make_all_deliveries_due(db, strip_poison=True)
    server = downstream_factory(error_rate=1.0)  # down from the start
    monkeypatch.setenv("QO_OPS_DOWNSTREAM_URL", server.url)
    monkeypatch.setenv("QO_OPS_BREAKER_OPEN_S", "4")

    opened = execute(delivery_retry.SPEC, db, batch_size=100, concurrency=4)
    assert (opened.status, opened.error_code) == ("failed", "dependency_unavailable")
    sent = requests_seen(server)
    assert 10 <= sent <= 10 + 4  # ten failures in a row open it; at most 4 more were in flight
    assert opened.tally["breaker.open"] == 1
    assert opened.tally["downstream.calls"] == sent
    assert opened.tally.get("downstream.spared", 0) == sent
    row = breaker_row(db)
    assert (row.state, row.opened_count, row.waiting) == ("open", 1, True)
    assert "in_a_row" in row.reason
    assert breaker_events(caplog) == ["open"]

    if not breaker_row(db).waiting:
        pytest.fail("the machine stalled past the 4 s open time before the second run")
    stays = execute(delivery_retry.SPEC, db, batch_size=100, concurrency=4)
    assert (stays.status, stays.error_code) == ("failed", "dependency_unavailable")
    assert requests_seen(server) == sent  # no call at all while it is open
    assert stays.tally["downstream.refused_open"] > 0
    assert "breaker.open" not in stays.tally and breaker_events(caplog) == ["open"]

    wait_for(lambda: probe_due(db), 10, "the probe to be due")
    probed = execute(delivery_retry.SPEC, db, batch_size=100, concurrency=4)
    assert (probed.status, probed.error_code) == ("failed", "dependency_unavailable")
    assert requests_seen(server) == sent + 1  # one probe
    assert breaker_events(caplog) == ["open", "half_open", "open"]
    reopened = breaker_row(db)
    assert reopened.opened_count == 2
    assert reopened.opened_at == row.opened_at  # the outage's start, kept by a failed probe

    server.client.set_faults(error_rate=0.0)
    wait_for(lambda: probe_due(db), 10, "the probe to be due")
    closed = execute(delivery_retry.SPEC, db, batch_size=100, concurrency=4)
    assert closed.status == "success", closed
    assert (closed.tally["breaker.half_open"], closed.tally["breaker.closed"]) == (1, 1)
    assert breaker_events(caplog) == ["open", "half_open", "open", "half_open", "closed"]
    assert (breaker_row(db).state, breaker_row(db).opened_at) == ("closed", None)
    assert scalar(db.engine, NOT_DELIVERED) == 0
    assert scalar(db.engine, "SELECT max(attempt_count) FROM delivery_attempt_item") == 1
    assert server.client.stats()["deliveries_distinct"] == items


def test_notification_publish_spares_its_events_in_an_outage(db, downstream_factory, monkeypatch):
    load_demo_data(db.engine, tenants=1, quotes=400, seed=3, as_of=AS_OF)
    execute_sql(
        db.engine,
        "UPDATE outbox_event SET published_at = NULL, dead_lettered_at = NULL, "
        "publish_attempts = 0, available_at = now() - interval '1 minute'",
    )
    events = scalar(db.engine, "SELECT count(*) FROM outbox_event")
    assert events >= 20
    server = downstream_factory(error_rate=1.0)
    monkeypatch.setenv("QO_OPS_DOWNSTREAM_URL", server.url)
    down = execute(notification_publish.SPEC, db, batch_size=100, concurrency=4)
    assert (down.status, down.error_code) == ("failed", "dependency_unavailable")
    assert scalar(db.engine, "SELECT max(publish_attempts) FROM outbox_event") == 0
    assert (
        scalar(db.engine, "SELECT count(*) FROM outbox_event WHERE dead_lettered_at IS NOT NULL")
        == 0
    )


def test_failures_before_the_breaker_opened_in_an_earlier_batch_get_their_attempt_back(
    db, downstream_factory, monkeypatch
):
    """Batches of 4: the outage's first failures are recorded in batches before the one in
    which the tenth failure in a row opens the breaker; they get their attempt back too."""
    load_demo_data(db.engine, tenants=1, quotes=400, seed=3, as_of=AS_OF)
    make_all_deliveries_due(db, strip_poison=True)
    monkeypatch.setenv("QO_OPS_RETRY_BASE_S", "60")  # no failed item comes due again meanwhile
    monkeypatch.setenv("QO_OPS_RETRY_CAP_S", "60")
    server = downstream_factory(error_rate=1.0)
    monkeypatch.setenv("QO_OPS_DOWNSTREAM_URL", server.url)
    down = execute(delivery_retry.SPEC, db, batch_size=4, concurrency=2)
    assert (down.status, down.error_code) == ("failed", "dependency_unavailable")
    assert down.batches == 3  # 4 + 4 failures recorded, the 10th in the third batch
    sent = requests_seen(server)
    assert 10 <= sent <= 10 + 1  # the 10th opened it; one more may have been in flight
    assert down.tally["downstream.spared"] == sent == down.tally["downstream.calls"]
    assert scalar(db.engine, "SELECT max(attempt_count) FROM delivery_attempt_item") == 0


def test_our_rate_limit_is_respected(db, downstream_factory, monkeypatch):
    load_demo_data(db.engine, tenants=1, quotes=400, seed=3, as_of=AS_OF)
    make_all_deliveries_due(db, strip_poison=True)
    execute_sql(
        db.engine,
        "UPDATE delivery_attempt_item SET status = 'DELIVERED' WHERE id NOT IN "
        "(SELECT id FROM delivery_attempt_item ORDER BY id LIMIT 60)",
    )
    server = downstream_factory()
    monkeypatch.setenv("QO_OPS_DOWNSTREAM_URL", server.url)
    monkeypatch.setenv("QO_OPS_DOWNSTREAM_RATE_LIMIT", "40")
    started = time.monotonic()
    run = execute(delivery_retry.SPEC, db, batch_size=50, concurrency=16)
    elapsed = time.monotonic() - started
    assert run.status == "success" and run.counts.succeeded == 60
    # a burst of 4 (a tenth of a second's worth), then 40 a second: never above 44 a second
    assert (60 - 4) / elapsed <= 40 * 1.1, f"{60 / elapsed:.1f} calls a second"
    assert run.tally["downstream.rate_limit_wait_ms"] > 0


def test_a_fleet_limit_it_cannot_read_sends_nothing_and_stops_the_run(
    db, downstream_factory, monkeypatch
):
    """The shared rate limit's row is held by a stuck session, so every grant meets the
    lock timeout: after the give-up time no call is sent (there is no fallback to a limit
    per run), every item keeps its attempt, and the run stops after that batch in one line.
    The next run, the row free again, delivers them."""
    from qo_ops.downstream.calls import origin
    from qo_ops.platform.calls import ratelimit

    load_demo_data(db.engine, tenants=1, quotes=400, seed=3, as_of=AS_OF)
    items = make_all_deliveries_due(db, strip_poison=True)
    server = downstream_factory()
    monkeypatch.setenv("QO_OPS_DOWNSTREAM_URL", server.url)
    monkeypatch.setenv("QO_OPS_DOWNSTREAM_RATE_LIMIT", "1000")
    monkeypatch.setattr(ratelimit, "GIVE_UP_S", 0.5)
    ratelimit.take_tokens(db.engine, origin(server.url), 1000.0, 100.0, 1)  # the origin's row
    with db.engine.connect() as stuck:
        stuck.execute(sa.text("SELECT * FROM downstream_rate_limit FOR UPDATE"))
        run = execute(delivery_retry.SPEC, db, batch_size=20, concurrency=4)
        stuck.rollback()
    # the driver's error and its SQLSTATE (55P03: lock_not_available), no server, no secret
    reason = f"rate limit unavailable for {origin(server.url)}: LockNotAvailable (SQLSTATE 55P03)"
    assert run.status_reason == reason, run
    # the batch it met the limit in, and the one it had claimed ahead (overlapped batches):
    # both recorded with nothing sent, and no third claimed
    assert run.batches in (1, 2) and run.counts.succeeded == 0, run
    assert run.counts.processed <= 2 * 20, run
    assert requests_seen(server) == 0
    assert run.tally.get("downstream.calls", 0) == 0
    assert scalar(db.engine, "SELECT max(attempt_count) FROM delivery_attempt_item") == 0
    assert scalar(db.engine, NOT_DELIVERED) == items

    again = execute(delivery_retry.SPEC, db, batch_size=items, concurrency=4)
    assert again.status == "success" and again.counts.succeeded == items, again
    assert scalar(db.engine, NOT_DELIVERED) == 0


def test_the_retry_budget_bounds_a_runs_retries(db, downstream_factory, monkeypatch):
    load_demo_data(db.engine, tenants=1, quotes=400, seed=3, as_of=AS_OF)
    items = make_all_deliveries_due(db, strip_poison=True)
    execute_sql(db.engine, "UPDATE delivery_attempt_item SET attempt_count = 1")  # failed once
    server = downstream_factory()
    monkeypatch.setenv("QO_OPS_DOWNSTREAM_URL", server.url)
    monkeypatch.setenv("QO_OPS_RETRY_BUDGET", "7")
    run = execute(delivery_retry.SPEC, db, batch_size=50, concurrency=4)
    assert run.status_reason == "retry budget used up (7 retries)"
    assert (run.tally["downstream.retries"], run.counts.succeeded) == (7, 7)
    assert requests_seen(server) == 7
    assert run.tally["downstream.retry_budget_refused"] == 50 - 7
    assert scalar(db.engine, NOT_DELIVERED) == items - 7
    assert (
        scalar(
            db.engine, "SELECT max(attempt_count) FROM delivery_attempt_item WHERE status = 'READY'"
        )
        == 1
    )


def test_the_downstreams_rate_limit_and_retry_after_are_honoured(
    db, downstream_factory, monkeypatch
):
    """The simulator admits 20 calls a second (then 429 + Retry-After: 1). A rate-limited
    item uses no attempt and waits at least the Retry-After; the run pauses every worker
    for it; no item fails, and in the end each is delivered exactly once."""
    load_demo_data(db.engine, tenants=1, quotes=400, seed=3, as_of=AS_OF)
    items = make_all_deliveries_due(db, strip_poison=True)
    server = downstream_factory(rate_limit=20)
    monkeypatch.setenv("QO_OPS_DOWNSTREAM_URL", server.url)
    first = execute(delivery_retry.SPEC, db, batch_size=items, concurrency=8)
    assert first.status == "success" and first.counts.failed == 0, first
    limited = server.client.stats(detail=False)["rate_limited"]
    assert limited > 0 and first.tally["downstream.rate_limit_pauses"] == limited
    assert first.tally["downstream.rate_limit_wait_ms"] > 0  # the run slowed down
    waiting = q(
        db.engine,
        "SELECT attempt_count, last_error_code, "
        "extract(epoch FROM next_attempt_at - last_error_at) AS wait_s "
        "FROM delivery_attempt_item WHERE status = 'READY'",
    ).all()
    assert len(waiting) == items - first.counts.succeeded > 0
    assert {(r.attempt_count, r.last_error_code) for r in waiting} == {(0, "http_429")}
    assert min(float(r.wait_s) for r in waiting) >= 1.0 - 0.01  # Retry-After: 1
    for _ in range(30):
        if scalar(db.engine, NOT_DELIVERED) == 0:
            break
        wait_for(
            lambda: (
                scalar(
                    db.engine,
                    "SELECT count(*) FROM delivery_attempt_item "
                    "WHERE status = 'READY' AND next_attempt_at > now()",
                )
                == 0
            ),
            10,
            "the rate-limited items to be due",
        )
        again = execute(delivery_retry.SPEC, db, batch_size=items, concurrency=8)
        assert again.counts.failed == 0
    assert scalar(db.engine, NOT_DELIVERED) == 0
    assert scalar(db.engine, "SELECT max(attempt_count) FROM delivery_attempt_item") == 1
    stats = server.client.stats()
    assert stats["deliveries_distinct"] == items
    assert set(stats["deliveries_by_key"].values()) == {1}


def test_a_rate_limited_batch_is_claimed_for_as_long_as_sending_it_takes(monkeypatch):
    from qo_ops.downstream.calls import call_settings, claim_seconds
    from qo_ops.platform.job.options import Limits
    from qo_ops.platform.job.outcome import BatchContext
    from qo_ops.platform.job.scope import Scope

    monkeypatch.setenv("QO_OPS_DOWNSTREAM_URL", "http://127.0.0.1:9")

    def ctx() -> BatchContext:
        return BatchContext(
            "delivery_retry",
            Scope("tenant-001"),
            "execute",
            uuid.uuid4(),
            limits=Limits(lease_ttl_s=30.0),
            settings=call_settings(),
        )

    assert claim_seconds(ctx(), 1024) == 60.0  # no limit of ours: twice the lease TTL
    monkeypatch.setenv("QO_OPS_DOWNSTREAM_RATE_LIMIT", "10")
    # 1,024 calls at 10 a second, after as many of the batch before (overlapped batches)
    assert claim_seconds(ctx(), 1024) == 60.0 + 2 * 102.4
