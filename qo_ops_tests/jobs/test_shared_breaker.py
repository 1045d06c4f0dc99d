"""The breaker judges the downstream, not one run (issue 40), against the real simulator.

- An outage over a backlog of 1-6 items per tenant, with runs every few tenths of a second
  long past the items' last attempt, dead-letters nothing and opens the shared breaker; the
  attempts it used come back, and every item is delivered once when the downstream returns.
- A flaky-but-up downstream (20 % 5xx + 5 % timeouts + 1 % poison; 10 % timeouts alone) at
  concurrency 32 and 64 drains with the breaker closed: every item delivered, or
  dead-lettered for its own error, nothing spared or held.
- An outage still opens it within ten failed calls: 503s, refused connections, all timeouts.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from qo_ops.demo.data import load_demo_data
from qo_ops.jobs import delivery_retry, notification_publish
from qo_ops.platform.job.scope import Scope
from qo_ops.platform.job.spec import JobSpec
from qo_ops.platform.run.runner import RunSummary
from qo_ops_tests.jobs.test_downstream_jobs import AS_OF, execute, execute_sql, q, scalar
from qo_ops_tests.jobs.test_downstream_manners import breaker_row, requests_seen

TENANTS = ("tenant-001", "tenant-002", "tenant-003")
MAX_ATTEMPTS = 8  # the production default
DEAD = "SELECT count(*) FROM delivery_attempt_item WHERE status = 'DEAD_LETTER'"
UNSETTLED = "SELECT count(*) FROM delivery_attempt_item WHERE status IN ('READY', 'IN_PROGRESS')"


@pytest.fixture
def quick_retries(monkeypatch):
    """Backoff 0.2 s doubling to 0.4 s: the whole 8-attempt schedule is ~2.6 s."""
    monkeypatch.setenv("QO_OPS_RETRY_BASE_S", "0.2")
    monkeypatch.setenv("QO_OPS_RETRY_CAP_S", "0.4")
    monkeypatch.setenv("QO_OPS_BREAKER_OPEN_S", "0.5")


def due_per_tenant(db, items: int) -> int:
    """Exactly ``items`` delivery items due per tenant (no planted poison), the rest DELIVERED."""
    execute_sql(
        db.engine,
        """
        UPDATE delivery_attempt_item i
           SET payload = i.payload - 'fault', last_error_code = NULL,
               status = CASE WHEN n.rank <= :items THEN 'READY' ELSE 'DELIVERED' END,
               attempt_count = 0, max_attempts = :max,
               next_attempt_at = now() - interval '1 minute'
          FROM (SELECT id, row_number() OVER (PARTITION BY tenant_id ORDER BY id) AS rank
                  FROM delivery_attempt_item) n
         WHERE n.id = i.id
        """,
        items=items,
        max=MAX_ATTEMPTS,
    )
    return int(scalar(db.engine, UNSETTLED))


def every_tenant(spec: JobSpec, db, **options: Any) -> list[RunSummary]:
    return [execute(spec, db, Scope(t), concurrency=4, **options) for t in TENANTS]


@pytest.mark.parametrize(("per_tenant", "outage"), [(1, "503"), (2, "refuse"), (6, "503")], ids=str)
def test_an_outage_over_a_small_backlog_dead_letters_nothing_and_opens_the_shared_breaker(
    db, downstream_factory, monkeypatch, quick_retries, per_tenant, outage
):
    """Three tenants with ``per_tenant`` due items each, every run far too small to see ten
    failures alone; runs every 0.3 s for three times the whole retry schedule."""
    load_demo_data(db.engine, tenants=3, quotes=400, seed=3, as_of=AS_OF)
    items = due_per_tenant(db, per_tenant)
    assert items == 3 * per_tenant
    server = downstream_factory(latency_ms=2)
    server.client.set_faults(outage=outage)
    monkeypatch.setenv("QO_OPS_DOWNSTREAM_URL", server.url)

    started = time.monotonic()
    while time.monotonic() - started < 8.0:  # the 8-attempt schedule is ~2.6 s
        every_tenant(delivery_retry.SPEC, db)
        assert scalar(db.engine, DEAD) == 0
        time.sleep(0.3)
    row = breaker_row(db)
    assert row.opened_count >= 1 and row.state in ("open", "half_open"), row
    assert requests_seen(server) > 0

    # the breaker open and no probe due: each tenant's next claim gives back what is owed
    execute_sql(
        db.engine, "UPDATE downstream_breaker SET probe_after = now() + interval '1 minute'"
    )
    every_tenant(delivery_retry.SPEC, db)
    attempts = q(
        db.engine,
        "SELECT status, max(attempt_count) AS most FROM delivery_attempt_item "
        "WHERE status <> 'DELIVERED' GROUP BY status",
    ).all()
    assert [tuple(r) for r in attempts] == [("READY", 0)]
    assert scalar(db.engine, "SELECT count(*) FROM downstream_refund") == 0

    server.client.set_faults(outage=None)  # back: the next probe closes it, all delivered
    execute_sql(db.engine, "UPDATE downstream_breaker SET probe_after = now()")
    for _ in range(20):
        every_tenant(delivery_retry.SPEC, db)
        if scalar(db.engine, UNSETTLED) == 0:
            break
        time.sleep(0.3)
    assert scalar(db.engine, UNSETTLED) == 0 and scalar(db.engine, DEAD) == 0
    stats = server.client.stats()
    assert stats["deliveries_distinct"] == items
    assert set(stats["deliveries_by_key"].values()) == {1}
    assert breaker_row(db).state == "closed"


def test_two_jobs_share_the_evidence_and_each_gets_its_attempts_back(
    db, downstream_factory, monkeypatch, quick_retries
):
    """One delivery item and three outbox events of one tenant, each job run in turn: no
    run of either sees ten failures, together they open it; each job gives its own back."""
    load_demo_data(db.engine, tenants=1, quotes=400, seed=3, as_of=AS_OF)
    assert due_per_tenant(db, 1) == 1
    execute_sql(
        db.engine,
        """
        UPDATE outbox_event SET published_at = CASE WHEN rank <= 3 THEN NULL ELSE now() END,
               dead_lettered_at = NULL, publish_attempts = 0,
               available_at = now() - interval '1 minute', payload = payload - 'fault'
          FROM (SELECT id AS ranked, row_number() OVER (ORDER BY id) AS rank FROM outbox_event) r
         WHERE r.ranked = outbox_event.id
        """,
    )
    server = downstream_factory(outage="503")
    monkeypatch.setenv("QO_OPS_DOWNSTREAM_URL", server.url)
    monkeypatch.setenv("QO_OPS_BREAKER_OPEN_S", "60")  # opened once, no probe meanwhile
    runs: list[RunSummary] = []
    for _ in range(4):  # 4 rounds of 1 + 3 calls: the 10th failure is in the third
        runs.append(execute(delivery_retry.SPEC, db))
        runs.append(execute(notification_publish.SPEC, db))
        time.sleep(0.45)
    assert max(len(r.tally) and r.tally.get("downstream.calls", 0) for r in runs) <= 3
    assert breaker_row(db).opened_count == 1
    opener = next(r for r in runs if r.tally.get("breaker.open"))
    assert opener.status_reason and "circuit breaker open" in opener.status_reason
    assert scalar(db.engine, DEAD) == 0
    assert (
        scalar(db.engine, "SELECT count(*) FROM outbox_event WHERE dead_lettered_at IS NOT NULL")
        == 0
    )
    execute(delivery_retry.SPEC, db)  # open: each job's claim gives back what it is owed
    execute(notification_publish.SPEC, db)
    assert scalar(db.engine, "SELECT max(attempt_count) FROM delivery_attempt_item") == 0
    assert scalar(db.engine, "SELECT max(publish_attempts) FROM outbox_event") == 0
    assert scalar(db.engine, "SELECT count(*) FROM downstream_refund") == 0


FLAKY = {"error_rate": 0.2, "timeout_rate": 0.05, "poison_rate": 0.01}
SLOW = {"timeout_rate": 0.1}


@pytest.mark.parametrize(
    ("faults", "concurrency"),
    [(FLAKY, 32), (FLAKY, 64), (SLOW, 32), (SLOW, 64)],
    ids=["flaky-c32", "flaky-c64", "timeouts-c32", "timeouts-c64"],
)
def test_a_flaky_downstream_drains_with_the_breaker_closed(
    db, downstream_factory, monkeypatch, quick_retries, faults, concurrency
):
    """600 due items, a downstream that answers most calls: each failure is the item's own.
    Every item ends DELIVERED, or DEAD_LETTER with its own error (poison; or every attempt
    failed while the downstream was up), the breaker never opens, nothing is spared or
    held, and the slow calls finishing last in each batch do not trip it."""
    load_demo_data(db.engine, tenants=1, quotes=3000, seed=3, as_of=AS_OF)
    items = due_per_tenant(db, 600)
    server = downstream_factory(latency_ms=5, timeout_s=1.5, seed=7, **faults)
    monkeypatch.setenv("QO_OPS_DOWNSTREAM_URL", server.url)
    runs: list[RunSummary] = []
    for _ in range(40):
        runs.append(execute(delivery_retry.SPEC, db, batch_size=256, concurrency=concurrency))
        if scalar(db.engine, UNSETTLED) == 0:
            break
        time.sleep(0.2)
    assert scalar(db.engine, UNSETTLED) == 0, runs[-1]
    row = breaker_row(db)
    assert (row.state, row.opened_count) == ("closed", 0)
    for key in ("downstream.spared", "downstream.held", "breaker.open"):
        assert sum(r.tally.get(key, 0) for r in runs) == 0, key
    assert all(r.error_code != "dependency_unavailable" for r in runs)
    dead = q(
        db.engine,
        "SELECT last_error_code, attempt_count FROM delivery_attempt_item "
        "WHERE status = 'DEAD_LETTER'",
    ).all()
    own = [d for d in dead if d.last_error_code == "poison" or d.attempt_count == MAX_ATTEMPTS]
    assert own == dead  # poison, or out of attempts while the downstream was up
    delivered = scalar(
        db.engine, "SELECT count(*) FROM delivery_attempt_item WHERE status = 'DELIVERED'"
    )
    assert delivered + len(dead) == items and delivered > items * 0.9
    timeouts = sum(
        v
        for r in runs
        for k, v in r.tally.items()
        if k.startswith("side_effect.") and "ambiguous" in k
    )
    assert timeouts > 0  # the slow calls were there, and finished last in their batches
    stats = server.client.stats()
    assert stats["deliveries_distinct"] >= delivered


@pytest.mark.parametrize(
    ("outage", "concurrency"),
    [("503", 4), ("refuse", 4), ("timeouts", 4), ("503", 32), ("timeouts", 32)],
    ids=str,
)
def test_an_outage_opens_it_within_ten_failed_calls(
    db, downstream_factory, monkeypatch, outage, concurrency
):
    """As before the breaker judged by start: ten failures open it, and at most the calls
    already in flight go besides (answers out of order neither delay it nor add calls)."""
    load_demo_data(db.engine, tenants=1, quotes=400, seed=3, as_of=AS_OF)
    due_per_tenant(db, 80)
    if outage == "timeouts":
        server = downstream_factory(timeout_rate=1.0, timeout_s=1.5)
    else:
        server = downstream_factory(outage=outage)
    monkeypatch.setenv("QO_OPS_DOWNSTREAM_URL", server.url)
    opened = execute(delivery_retry.SPEC, db, batch_size=80, concurrency=concurrency)
    assert (opened.status, opened.error_code) == ("failed", "dependency_unavailable")
    sent = opened.tally["downstream.calls"]
    assert 10 <= sent <= 10 + concurrency  # ten in a row open it; at most the ones in flight
    assert opened.tally["downstream.spared"] == sent  # and every attempt they used is kept
    assert scalar(db.engine, "SELECT max(attempt_count) FROM delivery_attempt_item") == 0
    assert breaker_row(db).state == "open"


ITEM_ROWS = (
    "SELECT id, status, attempt_count, next_attempt_at, updated_at FROM delivery_attempt_item "
    "ORDER BY id"
)


def open_breaker(db, origin: str) -> None:
    """The shared row open, its probe a minute away: as another run left it."""
    execute_sql(
        db.engine,
        "INSERT INTO downstream_breaker (downstream, state, opened_at, probe_after, reason) "
        "VALUES (:origin, 'open', now(), now() + interval '1 minute', 'http_503 10_in_a_row')",
        origin=origin,
    )


def test_a_chunk_of_tenants_claims_nothing_once_the_breaker_is_open(
    db, downstream_factory, monkeypatch
):
    """Five tenants' runs, one after another as a chunk runs them, with the shared row open
    and no probe due: each halts at its first claim with ``dependency_unavailable`` having
    claimed nothing: every item row is unchanged (not claimed and released, which moves
    ``next_attempt_at`` and ``updated_at``), and no call reaches the downstream (up all
    along, so a call would have been answered).

    Planted once: with the refusal in ``prepare_calls`` taken out, each tenant's run claimed
    and released its batch and the item rows changed; with the runner going on to the call
    and record steps after the refused claim, the claim's count (``refused_open``) was lost."""
    tenants = [f"tenant-00{n}" for n in range(1, 6)]
    load_demo_data(db.engine, tenants=len(tenants), quotes=600, seed=3, as_of=AS_OF)
    due = due_per_tenant(db, 4)
    assert due == 4 * len(tenants)
    server = downstream_factory()
    monkeypatch.setenv("QO_OPS_DOWNSTREAM_URL", server.url)
    open_breaker(db, server.url)
    before = [tuple(r) for r in q(db.engine, ITEM_ROWS).all()]
    shared_before = tuple(q(db.engine, "SELECT * FROM downstream_breaker").one())

    runs = [execute(delivery_retry.SPEC, db, Scope(t), concurrency=4) for t in tenants]
    for run in runs:
        assert (run.status, run.error_code) == ("failed", "dependency_unavailable"), run
        assert run.status_reason == f"circuit breaker open for {server.url}"
        assert run.batches == 1 and run.counts.succeeded == run.counts.failed == 0
        assert run.tally["downstream.refused_open"] == 4
        assert run.tally.get("downstream.calls", 0) == 0
    assert [tuple(r) for r in q(db.engine, ITEM_ROWS).all()] == before
    assert requests_seen(server) == 0
    row = breaker_row(db)
    assert (row.state, row.waiting) == ("open", True)  # nothing probed
    # nothing recorded either (no empty record step writing the row's recent_at)
    assert tuple(q(db.engine, "SELECT * FROM downstream_breaker").one()) == shared_before
