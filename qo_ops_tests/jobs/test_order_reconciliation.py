"""order_reconciliation's re-submission budget and dead letters, through the one runner,
against a real downstream simulator seeded with the demo's view of the orders.

An order the downstream misses is re-submitted once (n = 1); reruns over unchanged state
add nothing; it is re-submitted again (n + 1) only after re-submission n was delivered and
the downstream still misses the order past QO_OPS_RESUBMIT_GRACE_MINUTES; after
QO_OPS_RESUBMIT_MAX it goes to manual review. A dead-lettered delivery item is never put
back by the job: the order is flagged and the operator is told to use `qo-ops review resolve`.
Bad budget settings are one line, exit 2, and nothing written.
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from qo_ops.db.digest import database_digest
from qo_ops.demo.data import load_demo_data
from qo_ops.downstream.local import seed_from_demo
from qo_ops.errors import ConfigError
from qo_ops.jobs import delivery_retry
from qo_ops.jobs.order_reconciliation import (
    RESUBMIT_GRACE_ENV,
    RESUBMIT_MAX_ENV,
    SPEC,
    ResubmitBudget,
    resubmit_budget,
)
from qo_ops.platform.calls.call_stats import is_manners_key
from qo_ops.platform.job.options import RunOptions
from qo_ops.platform.job.scope import Scope
from qo_ops.platform.run.runner import RunSummary, run_job
from qo_ops_tests.conftest import base_env, run_cli

AS_OF = datetime(2026, 3, 1, tzinfo=UTC)
TENANT = "tenant-001"
# a week of submitted orders: several of them never reached the downstream (demo rule)
SCOPE = Scope(TENANT, AS_OF.date() - timedelta(days=8), AS_OF.date() - timedelta(days=1))
RESUBMITTED = "side_effect.order_resubmit_requested_event"


def rows(engine: sa.Engine, sql: str, **params: Any) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(sa.text(sql), params))


def scalar(engine: sa.Engine, sql: str, **params: Any) -> Any:
    with engine.connect() as conn:
        return conn.execute(sa.text(sql), params).scalar()


def reconcile(db) -> RunSummary:
    summary = run_job(
        SPEC,
        SCOPE,
        RunOptions(mode="execute", trigger="schedule", progress_interval_s=3600),
        engine=db.engine,
    )
    assert summary.status in ("success", "partial_success"), summary
    return summary


def deliver(db) -> RunSummary:
    """One delivery_retry run: every due item is sent (the simulator has no faults)."""
    return run_job(
        delivery_retry.SPEC,
        Scope(TENANT),
        RunOptions(mode="execute", trigger="schedule", progress_interval_s=3600),
        engine=db.engine,
    )


@pytest.fixture
def world(db, downstream, monkeypatch):
    """Demo data, and the simulator holding the demo's downstream view of every order."""
    for name in (RESUBMIT_GRACE_ENV, RESUBMIT_MAX_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("QO_OPS_DOWNSTREAM_URL", downstream.url)
    load_demo_data(db.engine, tenants=1, quotes=3000, seed=18, as_of=AS_OF)
    seed_from_demo(db.engine, downstream.url)
    return db, downstream


def missing_orders(db) -> dict[int, str]:
    """In-flight orders of the window the downstream never received (computed from the
    demo's downstream view, not by the job), id → order number; delivery items not poison."""
    start, end = SCOPE.window_bounds()
    found = {
        r.id: r.order_number
        for r in rows(
            db.engine,
            "SELECT o.id, o.order_number FROM customer_order o "
            "JOIN delivery_attempt_item d ON d.order_id = o.id "
            "WHERE o.tenant_id = :t AND o.submitted_at >= :s AND o.submitted_at < :e "
            "AND o.status IN ('SUBMITTED', 'IN_FULFILLMENT') AND NOT o.needs_manual_review "
            "AND NOT (d.payload ? 'fault') "
            "AND NOT EXISTS (SELECT 1 FROM downstream_order x WHERE x.order_number = o.order_number) "
            "ORDER BY o.id",
            t=TENANT,
            s=start,
            e=end,
        )
    }
    assert len(found) >= 3, found  # the window holds several
    return found


def resubmit_events(db) -> dict[int, list[str]]:
    """OrderResubmitRequested events by order id: their business keys."""
    found: dict[int, list[str]] = {}
    for r in rows(
        db.engine,
        "SELECT aggregate_id, business_key FROM outbox_event "
        "WHERE event_type = 'OrderResubmitRequested' ORDER BY business_key",
    ):
        found.setdefault(int(r.aggregate_id), []).append(r.business_key)
    return found


def eligible_orders(db) -> list[int]:
    """The ids of the orders the run over ``SCOPE`` looks at, in the order it does."""
    start, end = SCOPE.window_bounds()
    return [
        r.id
        for r in rows(
            db.engine,
            "SELECT id FROM customer_order WHERE tenant_id = :t AND submitted_at >= :s "
            "AND submitted_at < :e AND status IN ('SUBMITTED', 'IN_FULFILLMENT') "
            "AND NOT needs_manual_review ORDER BY id",
            t=TENANT,
            s=start,
            e=end,
        )
    ]


def budget_rows(db, order_id: int) -> list[int]:
    return [
        r.resubmission
        for r in rows(
            db.engine,
            "SELECT resubmission FROM order_resubmission WHERE order_id = :o ORDER BY 1",
            o=order_id,
        )
    ]


def item(db, order_id: int) -> Any:
    found = rows(
        db.engine,
        "SELECT id, status, attempt_count, updated_at, next_attempt_at FROM delivery_attempt_item "
        "WHERE order_id = :o",
        o=order_id,
    )
    assert len(found) == 1
    return found[0]


def result(db, run: RunSummary, order_number: str) -> Any:
    found = rows(
        db.engine,
        "SELECT mismatch_type, action, outcome, detail FROM reconciliation_result "
        "WHERE job_run_id = :r AND order_number = :n",
        r=uuid.UUID(run.job_run_id),
        n=order_number,
    )
    return found[0] if found else None


def needs_review(db, order_id: int) -> bool:
    return bool(
        scalar(
            db.engine, "SELECT needs_manual_review FROM customer_order WHERE id = :o", o=order_id
        )
    )


def pass_the_grace(db, order_id: int, minutes: int) -> None:
    """Time passing, planted: the order's re-submissions and their delivery happened
    ``minutes`` earlier than recorded."""
    with db.engine.begin() as conn:
        for table, column in (("delivery_attempt_item", "updated_at"),
                              ("order_resubmission", "requested_at")):  # fmt: skip
            conn.execute(
                sa.text(
                    f"UPDATE {table} SET {column} = {column} - make_interval(mins => :m) "
                    "WHERE order_id = :o"
                ),
                {"o": order_id, "m": minutes},
            )


# ------------------------------------------------------------------------- idempotent reruns


def test_three_runs_over_an_unchanged_window_resubmit_each_missing_order_once(world):
    db, downstream = world
    missing = missing_orders(db)
    runs = [reconcile(db) for _ in range(3)]

    assert runs[0].tally[f"{RESUBMITTED}.success"] == len(missing)
    assert resubmit_events(db) == {o: [f"order:{o}:resubmit:1"] for o in missing}
    for order_id in missing:
        assert budget_rows(db, order_id) == [1]
        assert item(db, order_id).status == "READY"  # back in delivery_retry's hands
    for again in runs[1:]:  # nothing new: the earlier re-submission stands
        assert f"{RESUBMITTED}.success" not in again.tally, again.tally
        assert again.tally[f"{RESUBMITTED}.duplicate_prevented"] == len(missing)
        assert again.counts.succeeded == 0
        for number in missing.values():
            found = result(db, again, number)
            assert (found.action, found.outcome) == ("resubmit", "pending")
            assert found.detail == "re-submission 1 not delivered yet"
    assert downstream.client.stats(detail=False)["deliveries_distinct"] == 0


# ------------------------------------------------------------------------- the budget


def test_a_delivered_resubmission_still_missed_past_the_grace_is_resubmitted_once_more(
    world, monkeypatch
):
    db, downstream = world
    monkeypatch.setenv(RESUBMIT_GRACE_ENV, "30")
    missing = missing_orders(db)
    lost, number = next(iter(missing.items()))
    reconcile(db)
    delivered = deliver(db)
    assert item(db, lost).status == "DELIVERED", delivered
    # the downstream acknowledged it, then lost it again
    assert downstream.client.delete_order(number)

    within = reconcile(db)  # delivered just now: the downstream has 30 minutes to show it
    assert result(db, within, number).outcome == "pending"
    assert "delivered" in result(db, within, number).detail
    assert f"{RESUBMITTED}.success" not in within.tally
    assert budget_rows(db, lost) == [1] and item(db, lost).status == "DELIVERED"
    for other, other_number in missing.items():  # delivered and present downstream now
        if other != lost:
            assert result(db, within, other_number) is None

    pass_the_grace(db, lost, 31)
    past = reconcile(db)
    assert (result(db, past, number).outcome, result(db, past, number).detail) == (
        "corrected",
        "re-submission 2 of 3",
    )
    assert past.tally[f"{RESUBMITTED}.success"] == 1
    assert resubmit_events(db)[lost] == [f"order:{lost}:resubmit:1", f"order:{lost}:resubmit:2"]
    assert budget_rows(db, lost) == [1, 2] and item(db, lost).status == "READY"

    again = reconcile(db)  # re-submission 2 is not delivered yet: nothing new
    assert f"{RESUBMITTED}.success" not in again.tally
    assert again.tally[f"{RESUBMITTED}.duplicate_prevented"] == 1
    assert len(resubmit_events(db)[lost]) == 2 and budget_rows(db, lost) == [1, 2]


def test_after_the_last_resubmission_the_order_goes_to_manual_review_and_no_more_events(
    world, monkeypatch
):
    db, downstream = world
    monkeypatch.setenv(RESUBMIT_GRACE_ENV, "0")
    monkeypatch.setenv(RESUBMIT_MAX_ENV, "2")
    missing = missing_orders(db)
    lost, number = next(iter(missing.items()))
    for n in (1, 2):
        run = reconcile(db)
        assert (result(db, run, number).outcome, budget_rows(db, lost)) == (
            "corrected",
            list(range(1, n + 1)),
        )
        deliver(db)
        assert item(db, lost).status == "DELIVERED"
        downstream.client.delete_order(number)  # acknowledged, and lost again

    spent = reconcile(db)
    found = result(db, spent, number)
    assert (found.action, found.outcome) == ("manual_review", "budget_exhausted")
    assert found.detail == (
        f"re-submitted 2 times ({RESUBMIT_MAX_ENV}=2) and still missing downstream"
    )
    assert needs_review(db, lost)
    assert f"{RESUBMITTED}.success" not in spent.tally
    assert resubmit_events(db)[lost] == [f"order:{lost}:resubmit:1", f"order:{lost}:resubmit:2"]
    assert item(db, lost).status == "DELIVERED"  # left as it is

    after = reconcile(db)  # a flagged order waits for a person
    assert result(db, after, number) is None
    assert len(resubmit_events(db)[lost]) == 2 and budget_rows(db, lost) == [1, 2]


def test_a_zero_budget_sends_every_missing_order_to_a_person(world, monkeypatch):
    db, _ = world
    monkeypatch.setenv(RESUBMIT_MAX_ENV, "0")
    missing = missing_orders(db)
    run = reconcile(db)
    assert {result(db, run, n).outcome for n in missing.values()} == {"budget_exhausted"}
    assert f"{RESUBMITTED}.success" not in run.tally
    assert all(needs_review(db, o) for o in missing) and not resubmit_events(db)


# ------------------------------------------------------------------------- dead letters


def test_a_dead_lettered_item_is_flagged_never_requeued(world):
    db, _ = world
    missing = missing_orders(db)
    dead, number = next(iter(missing.items()))
    with db.engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE delivery_attempt_item SET status = 'DEAD_LETTER', attempt_count = 8, "
                "last_error_code = 'poison' WHERE order_id = :o"
            ),
            {"o": dead},
        )
    before = item(db, dead)

    run = reconcile(db)
    assert item(db, dead) == before  # still DEAD_LETTER, not a column changed
    assert needs_review(db, dead)
    found = result(db, run, number)
    assert (found.action, found.outcome) == ("manual_review", "dead_letter_flagged")
    assert f"delivery item {before.id} is dead-lettered" in found.detail
    assert (
        f"qo-ops review resolve order_reconciliation {number} --tenant {TENANT} --action resubmit"
        in found.detail
    )
    assert run.tally["action_dead_letter_flagged"] == 1
    assert dead not in resubmit_events(db) and budget_rows(db, dead) == []
    # the other missing orders were re-submitted as usual
    assert set(resubmit_events(db)) == set(missing) - {dead}

    again = reconcile(db)
    assert result(db, again, number) is None and item(db, dead) == before


def test_a_poison_item_resubmitted_once_ends_in_review_not_in_a_loop(world):
    db, _ = world
    poisoned, number = next(iter(missing_orders(db).items()))
    with db.engine.begin() as conn:  # the downstream never got it, and refuses it every time
        conn.execute(
            sa.text(
                'UPDATE delivery_attempt_item SET payload = payload || \'{"fault": "poison"}\' '
                "WHERE order_id = :o"
            ),
            {"o": poisoned},
        )
    reconcile(db)  # re-submission 1
    deliver(db)
    dead = item(db, poisoned)
    assert dead.status == "DEAD_LETTER"  # refused: delivery_retry dead-letters it

    flagged = reconcile(db)
    assert result(db, flagged, number).outcome == "dead_letter_flagged"
    assert needs_review(db, poisoned)
    assert deliver(db).counts.processed == 0  # nothing due: no second attempt at it
    reconcile(db)
    assert item(db, poisoned) == dead
    assert resubmit_events(db)[poisoned] == [f"order:{poisoned}:resubmit:1"]


# ------------------------------------------------------------------------- settings


def test_the_budget_settings_are_whole_numbers_in_range():
    assert resubmit_budget({}) == ResubmitBudget(grace_minutes=60, max_resubmissions=3)
    edges = {RESUBMIT_GRACE_ENV: "0", RESUBMIT_MAX_ENV: "10"}
    assert resubmit_budget(edges) == ResubmitBudget(0, 10)
    assert resubmit_budget({RESUBMIT_GRACE_ENV: "10080", RESUBMIT_MAX_ENV: "0"}) == (
        ResubmitBudget(10080, 0)
    )
    for name, bad in [
        (RESUBMIT_GRACE_ENV, "-1"),
        (RESUBMIT_GRACE_ENV, "10081"),
        (RESUBMIT_GRACE_ENV, "1.5"),
        (RESUBMIT_GRACE_ENV, "soon"),
        (RESUBMIT_MAX_ENV, "11"),
        (RESUBMIT_MAX_ENV, "three"),
    ]:
        with pytest.raises(ConfigError) as caught:
            resubmit_budget({name: bad})
        assert name in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("setting", "mode"),
    [({RESUBMIT_MAX_ENV: "-1"}, "execute"), ({RESUBMIT_GRACE_ENV: "an hour"}, "dry-run")],
    ids=["max-execute", "grace-dry-run"],
)
def test_a_bad_budget_exits_2_with_one_line_and_writes_nothing(
    world, setting: dict[str, str], mode: str
):
    db, downstream = world
    with db.engine.connect() as conn:
        before = database_digest(conn)
    result = run_cli(
        ["run", "order_reconciliation", "--tenant", TENANT, "--from", str(SCOPE.window_start),
         "--to", str(SCOPE.window_end - timedelta(days=1)), "--mode", mode, "--reason", "x"],
        base_env(QO_OPS_DATABASE_URL=db.env_url, QO_OPS_DOWNSTREAM_URL=downstream.url, **setting),
    )  # fmt: skip
    (name,) = setting
    assert result.code == 2, result
    assert len(result.stderr.strip().splitlines()) == 1 and name in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    with db.engine.connect() as conn:
        assert database_digest(conn) == before  # no run record, no lease, no audit row


def test_a_reconciliation_stopped_mid_batch_keeps_its_checkpoint_before_unchecked_orders(world):
    """A real SIGTERM while a batch asks a slow downstream: no further order is asked about,
    and the checkpoint stays at the last order that was, so the rerun looks at the rest."""
    import os
    import signal
    import threading
    import time

    db, downstream = world
    eligible = eligible_orders(db)
    assert len(eligible) > 60
    downstream.client.set_faults(latency_ms=150)

    def lookups() -> int:  # the simulator counts the latency it added, per request
        return downstream.client.stats()["latency_injected_ms"] // 150

    def terminate_during_the_second_batch() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if (scalar(db.engine, "SELECT max(processed_count) FROM job_run") or 0) >= 20:
                break  # the first batch is recorded
            time.sleep(0.05)
        first = lookups()
        while time.monotonic() < deadline and lookups() < first + 3:
            time.sleep(0.05)  # until three orders of the second batch were asked about
        os.kill(os.getpid(), signal.SIGTERM)

    sender = threading.Thread(target=terminate_during_the_second_batch)
    sender.start()
    summary = run_job(
        SPEC,
        SCOPE,
        RunOptions(
            mode="execute", trigger="schedule", batch_size=20, concurrency=1,
            progress_interval_s=3600,
        ),
        engine=db.engine,
    )  # fmt: skip
    sender.join()
    assert (summary.status, summary.status_reason) == ("cancelled", "terminated")
    last_id = scalar(
        db.engine,
        "SELECT (cursor->>'last_id')::bigint FROM job_checkpoint WHERE job_name = :j",
        j=SPEC.name,
    )
    assert eligible[19] <= last_id < eligible[39]  # inside the second batch, not past it
    recorded = scalar(
        db.engine,
        "SELECT max(order_id) FROM reconciliation_result WHERE job_run_id = :r",
        r=summary.job_run_id,
    )
    assert recorded is None or recorded <= last_id  # nothing recorded past the checkpoint
    downstream.client.set_faults(latency_ms=0)
    rerun = reconcile(db)
    assert rerun.checkpoint_before is not None and str(last_id) in rerun.checkpoint_before


def test_a_dry_run_prints_its_mismatches_by_type_as_text_too(world):
    """What the README promises of `qo-ops run order_reconciliation` (a dry run): the
    mismatches by type, as `tally.<type>=n` lines, the same counts --json has."""
    db, downstream = world
    args = ["run", "order_reconciliation", "--tenant", TENANT, "--from", str(SCOPE.window_start),
            "--to", str(SCOPE.window_end - timedelta(days=1))]  # fmt: skip
    env = base_env(QO_OPS_DATABASE_URL=db.env_url, QO_OPS_DOWNSTREAM_URL=downstream.url)
    text = run_cli(args, env)
    as_json = run_cli([*args, "--json"], env)
    assert text.code == 0 and as_json.code == 0, (text.stderr, as_json.stderr)
    lines = dict(ln.split("=", 1) for ln in text.stdout.splitlines() if ln.startswith("tally."))
    tally = json.loads(as_json.stdout.splitlines()[-1])["tally"]
    kept = {k: v for k, v in tally.items() if not is_manners_key(k)}  # on the downstream= line
    assert kept and lines == {f"tally.{k}": str(v) for k, v in kept.items()}
    assert f"{tally['downstream.calls']} calls" in text.stdout  # its lookups
    assert "missing_downstream" in tally  # the demo's missing orders, by their type


# ------------------------------------------------------------------------- the shared breaker


def test_an_outage_opens_the_shared_breaker_and_no_order_is_judged_until_it_closes(
    world, monkeypatch
):
    """The downstream answers every lookup 503. The run's lookups open the shared breaker
    after ten failures (at most the four in flight besides), the run halts with
    ``dependency_unavailable`` and judges no order: no mismatch recorded, none flagged,
    nothing re-submitted, the checkpoint before the orders not looked at. The row names this
    run; the next run sends nothing. Once the downstream is back and the probe due, a run
    probes, closes it and judges only the orders the downstream really misses.

    Planted once: with the breaker left off the run's client (``watch_breaker`` not called
    in ``read_orders``), every order was looked up in the outage and the row never opened."""
    db, downstream = world
    missing = set(missing_orders(db).values())
    eligible = eligible_orders(db)
    assert len(eligible) > 60
    monkeypatch.setenv("QO_OPS_BREAKER_OPEN_S", "60")
    downstream.client.set_faults(outage="503")
    options = RunOptions(
        mode="execute", trigger="schedule", concurrency=4, progress_interval_s=3600
    )

    def asked() -> int:
        return int(downstream.client.stats(detail=False)["outage_refused"])

    down = run_job(SPEC, SCOPE, options, engine=db.engine)
    assert (down.status, down.error_code) == ("failed", "dependency_unavailable"), down
    assert down.status_reason == f"circuit breaker open for {downstream.url}"
    assert 10 <= asked() <= 10 + 4
    assert down.tally["downstream.calls"] == asked()  # its lookups, counted as calls
    assert down.tally["breaker.open"] == 1 and down.tally["downstream.refused_open"] > 0
    assert scalar(db.engine, "SELECT count(*) FROM reconciliation_result") == 0
    assert scalar(db.engine, "SELECT count(*) FROM order_resubmission") == 0
    assert scalar(db.engine, "SELECT count(*) FROM customer_order WHERE needs_manual_review") == 0
    last_id = scalar(
        db.engine,
        "SELECT (cursor->>'last_id')::bigint FROM job_checkpoint WHERE job_name = :j",
        j=SPEC.name,
    )
    assert last_id is None or last_id < eligible[14]  # the rest are looked at later
    row = rows(db.engine, "SELECT state, reason, changed_by_run FROM downstream_breaker")
    assert [(r.state, str(r.changed_by_run)) for r in row] == [("open", down.job_run_id)]
    assert "10_in_a_row" in row[0].reason

    seen = asked()
    again = run_job(SPEC, SCOPE, options, engine=db.engine)
    assert (again.status, again.error_code) == ("failed", "dependency_unavailable")
    assert asked() == seen and again.tally.get("downstream.calls", 0) == 0  # no lookup
    assert scalar(db.engine, "SELECT count(*) FROM reconciliation_result") == 0

    downstream.client.set_faults(outage=None)
    with db.engine.begin() as conn:
        conn.execute(sa.text("UPDATE downstream_breaker SET probe_after = now()"))
    back = reconcile(db)
    assert (back.tally["breaker.half_open"], back.tally["breaker.closed"]) == (1, 1)
    assert scalar(db.engine, "SELECT state FROM downstream_breaker") == "closed"
    judged = {
        r.order_number
        for r in rows(
            db.engine,
            "SELECT order_number FROM reconciliation_result WHERE mismatch_type = 'missing_downstream'",
        )
    }
    assert judged and judged <= missing  # only the orders the downstream really misses


def test_a_fleet_rate_limit_it_cannot_read_stops_reconciliation_after_one_batch(world, monkeypatch):
    """The shared rate limit's row held by a stuck session: no lookup is made, so no order
    is looked at or judged, and the run stops after that batch in one line (a lookup not
    made is left to a later run, so the run must not select the same orders again).

    Planted once: with finish_lookups halting only on an open breaker, the run went round
    the same batch until its deadline (``timeout``, many batches)."""
    from qo_ops.downstream.calls import origin
    from qo_ops.platform.calls import ratelimit

    db, downstream = world
    monkeypatch.setenv("QO_OPS_DOWNSTREAM_RATE_LIMIT", "1000")
    monkeypatch.setattr(ratelimit, "GIVE_UP_S", 0.5)
    ratelimit.take_tokens(db.engine, origin(downstream.url), 1000.0, 100.0, 1)
    options = RunOptions(
        mode="execute", trigger="schedule", batch_size=20, concurrency=4, deadline_s=20,
        progress_interval_s=3600,
    )  # fmt: skip
    with db.engine.connect() as stuck:
        stuck.execute(sa.text("SELECT * FROM downstream_rate_limit FOR UPDATE"))
        run = run_job(SPEC, SCOPE, options, engine=db.engine)
        stuck.rollback()
    assert run.status_reason is not None and run.status_reason.startswith(
        f"rate limit unavailable for {origin(downstream.url)}: LockNotAvailable"
    ), run
    assert run.batches == 1 and run.counts.succeeded == 0
    assert run.tally.get("downstream.calls", 0) == 0
    assert scalar(db.engine, "SELECT count(*) FROM reconciliation_result") == 0
