"""delivery_retry, notification_publish and order_reconciliation against a real downstream
simulator process on loopback, with injected faults, and real PostgreSQL."""

from __future__ import annotations

import signal
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa

from qo_ops.db.digest import database_digest
from qo_ops.db.schema import BUSINESS_TABLES, outbox_event
from qo_ops.demo.data import load_demo_data
from qo_ops.jobs import delivery_retry, notification_publish, order_reconciliation
from qo_ops.metrics.exporter import JobCollector
from qo_ops.platform.job.options import RunOptions
from qo_ops.platform.job.scope import Scope
from qo_ops.platform.job.spec import JobSpec
from qo_ops.platform.run.faults import CRASH_ENV
from qo_ops.platform.run.runner import RunSummary, run_job
from qo_ops_tests.conftest import base_env, run_cli
from qo_ops_tests.metrics.test_exporter import collect_when, completed, finished_runs, value

AS_OF = datetime(2026, 3, 1, tzinfo=UTC)
TENANT = "tenant-001"
BASE_S = 0.2  # retry backoff base in these tests (QO_OPS_RETRY_BASE_S)


@pytest.fixture
def fast_retries(monkeypatch):
    monkeypatch.setenv("QO_OPS_RETRY_BASE_S", str(BASE_S))
    monkeypatch.setenv("QO_OPS_RETRY_CAP_S", "1")


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


def wait_for_claims_to_lapse(engine: sa.Engine, timeout: float) -> None:
    """Until no delivery item is claimed into the future and no lease is unexpired: what a
    killed run leaves lapses, so the next run may take it."""
    wait_for(
        lambda: (
            scalar(
                engine, "SELECT count(*) FROM delivery_attempt_item WHERE next_attempt_at > now()"
            )
            == 0
            and scalar(engine, "SELECT count(*) FROM job_lease WHERE expires_at > now()") == 0
        ),
        timeout,
        "the claims and the lease to lapse",
    )


def q(engine: sa.Engine, sql: str, **params: object):
    with engine.connect() as conn:
        return conn.execute(sa.text(sql), params)


def scalar(engine: sa.Engine, sql: str, **params: object):
    with engine.connect() as conn:
        return conn.execute(sa.text(sql), params).scalar()


def execute_sql(engine: sa.Engine, sql: str, **params: object) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text(sql), params)


def execute(spec: JobSpec, db, scope: Scope | None = None, **options) -> RunSummary:
    return run_job(
        spec,
        scope or Scope(TENANT),
        RunOptions(mode="execute", trigger="schedule", progress_interval_s=3600, **options),
        engine=db.engine,
    )


def drain(spec: JobSpec, db, done: Callable[[], bool], **options) -> list[RunSummary]:
    """Run ``spec`` until ``done()`` (bounded): what a schedule does over time."""
    runs: list[RunSummary] = []
    for _ in range(60):
        runs.append(execute(spec, db, **options))
        if done():
            return runs
        time.sleep(BASE_S)
    pytest.fail(f"{spec.name} did not drain: {runs[-1]}")


def make_all_deliveries_due(db, max_attempts: int = 30, strip_poison: bool = False) -> int:
    with db.engine.begin() as conn:
        if strip_poison:  # a clean set: no planted poison items
            conn.execute(sa.text("UPDATE delivery_attempt_item SET payload = payload - 'fault'"))
        return conn.execute(
            sa.text(
                "UPDATE delivery_attempt_item SET status = 'READY', attempt_count = 0, "
                "max_attempts = :m, next_attempt_at = now() - interval '1 minute', last_error_code = NULL "
                "WHERE tenant_id = :t"
            ),
            {"t": TENANT, "m": max_attempts},
        ).rowcount


# ------------------------------------------------------------------------ delivery_retry


def test_deliveries_under_faults_are_delivered_exactly_once(
    db, downstream_factory, monkeypatch, fast_retries
):
    load_demo_data(db.engine, tenants=1, quotes=1000, seed=3, as_of=AS_OF)
    items = make_all_deliveries_due(db)
    server = downstream_factory(
        error_rate=0.2, timeout_rate=0.05, poison_rate=0.01, seed=11, timeout_s=1.5
    )
    monkeypatch.setenv("QO_OPS_DOWNSTREAM_URL", server.url)

    def nothing_due() -> bool:
        return (
            scalar(
                db.engine,
                "SELECT count(*) FROM delivery_attempt_item WHERE status IN ('READY', 'IN_PROGRESS')",
            )
            == 0
        )

    runs = drain(delivery_retry.SPEC, db, nothing_due, batch_size=50)
    assert any(r.counts.retry_scheduled > 0 for r in runs)  # the faults really bit
    rows = q(
        db.engine,
        "SELECT business_key, status, last_error_code, payload->>'fault' AS fault FROM delivery_attempt_item",
    ).all()
    delivered = {r.business_key for r in rows if r.status == "DELIVERED"}
    dead = [r for r in rows if r.status == "DEAD_LETTER"]
    assert len(delivered) + len(dead) == items
    assert dead and all(r.last_error_code == "poison" for r in dead)  # only poison is dead
    assert any(r.fault == "poison" for r in dead)  # the demo's planted poison items are among them
    stats = server.client.stats()
    assert stats["deliveries_distinct"] == len(
        delivered
    )  # each delivered item exactly once downstream
    assert set(stats["deliveries_by_key"]) == delivered
    assert not {r.business_key for r in dead} & set(stats["deliveries_by_key"])

    # every call is one attempt at the side effect, and the counts say how each one ended
    effects = _tally_sums(db, "delivery_retry")
    injected = stats["faults_injected"]
    assert injected["timeout"] > 0 and injected["error"] > 0
    assert effects["side_effect.submit_delivery.ambiguous"] == injected["timeout"]
    assert effects["side_effect_ambiguity.timeout_after_send"] == injected["timeout"]
    assert effects["side_effect.submit_delivery.failed"] == injected["error"] + injected["poison"]
    # a timed-out request was stored: its re-send is answered from the idempotency key
    assert (
        effects["side_effect.submit_delivery.duplicate_prevented"]
        == (stats["duplicates_suppressed"])
    )
    assert effects["side_effect.submit_delivery.duplicate_prevented"] == sum(
        r.counts.duplicates_prevented for r in runs
    )
    assert effects["side_effect.submit_delivery.success"] + effects[
        "side_effect.submit_delivery.duplicate_prevented"
    ] == len(delivered)  # one answered call per delivered item

    # the exporter serves the same counts
    samples = collect_when(
        JobCollector(db.engine, [delivery_retry.SPEC]),
        lambda s: completed(s, "delivery_retry") == finished_runs(db, "delivery_retry"),
    )
    for result in ("success", "duplicate_prevented", "failed", "ambiguous"):
        labels = {"job_name": "delivery_retry", "side_effect": "submit_delivery", "result": result}
        assert value(samples, "job_side_effects_total", **labels) == effects.get(
            f"side_effect.submit_delivery.{result}", 0
        )
    ambiguity = {"job_name": "delivery_retry", "reason": "timeout_after_send"}
    assert value(samples, "job_side_effect_ambiguity_total", **ambiguity) == injected["timeout"]
    assert (
        value(samples, "job_duplicate_side_effect_prevented_total", job_name="delivery_retry")
        == (stats["duplicates_suppressed"])
    )


def _tally_sums(db, job: str) -> dict[str, int]:
    """The job's runs' tallies, summed key by key."""
    return {
        r.key: int(r.n)
        for r in q(
            db.engine,
            "SELECT t.key, sum(t.value::bigint) AS n FROM job_run, jsonb_each_text(tally) "
            "AS t(key, value) WHERE job_name = :job GROUP BY t.key",
            job=job,
        )
    }


def test_backoff_of_items_that_fail_while_the_downstream_is_up(
    db, downstream_factory, monkeypatch, fast_retries
):
    """Items failing while the downstream answers most calls (40 % 503s) are the items'
    failures: each uses an attempt and backs off exponentially, and the breaker stays closed.
    A downstream that is down for every call opens it instead (test_downstream_manners.py)."""
    load_demo_data(db.engine, tenants=1, quotes=400, seed=3, as_of=AS_OF)
    items = make_all_deliveries_due(db, strip_poison=True)
    assert items >= 60
    server = downstream_factory(error_rate=0.4, seed=11)
    monkeypatch.setenv("QO_OPS_DOWNSTREAM_URL", server.url)
    failing = items
    for attempt in (1, 2):
        wait_for(
            lambda: (
                scalar(
                    db.engine,
                    "SELECT count(*) FROM delivery_attempt_item WHERE status = 'READY' "
                    "AND next_attempt_at > now()",
                )
                == 0
            ),
            10,
            "every item to be due again",
        )
        run = execute(delivery_retry.SPEC, db, batch_size=100, concurrency=1)  # one order
        assert run.status == "partial_success" and run.counts.processed == failing, run
        rows = q(
            db.engine,
            "SELECT status, attempt_count, last_error_code, "
            "extract(epoch FROM next_attempt_at - last_error_at) AS delay "
            "FROM delivery_attempt_item WHERE status <> 'DELIVERED'",
        ).all()
        assert 0 < len(rows) < failing
        failing = len(rows)
        assert {(r.status, r.attempt_count, r.last_error_code) for r in rows} == {
            ("READY", attempt, "http_503")
        }
        full = BASE_S * 2 ** (attempt - 1)  # exponential, jittered down to half
        assert all(full * 0.5 - 0.01 <= float(r.delay) <= full + 0.01 for r in rows), [
            r.delay for r in rows
        ][:5]
        assert run.tally.get("downstream.spared", 0) == 0
        assert scalar(db.engine, "SELECT state FROM downstream_breaker") == "closed"
    server.client.set_faults(error_rate=0.0)  # the downstream is back: nothing was lost
    wait_for(
        lambda: (
            scalar(
                db.engine,
                "SELECT count(*) FROM delivery_attempt_item WHERE next_attempt_at > now()",
            )
            == 0
        ),
        10,
        "due",
    )
    back = execute(delivery_retry.SPEC, db, batch_size=100)
    assert back.counts.succeeded == failing
    assert server.client.stats()["deliveries_distinct"] == items


def test_killed_after_sending_then_rerun_delivers_once(db, downstream, fast_retries):
    load_demo_data(db.engine, tenants=1, quotes=400, seed=3, as_of=AS_OF)
    items = make_all_deliveries_due(db, strip_poison=True)
    env = base_env(
        QO_OPS_DATABASE_URL=db.env_url,
        QO_OPS_DOWNSTREAM_URL=downstream.url,
        QO_OPS_RETRY_BASE_S=str(BASE_S),
    )
    args = [
        "run",
        "delivery_retry",
        "--tenant",
        TENANT,
        "--mode",
        "execute",
        "--reason",
        "crash",
        "--lease-ttl-s",
        "1",
        "--batch-size",
        str(items),
    ]
    killed = run_cli(args, {**env, CRASH_ENV: "after_external_call"})
    assert killed.code == -signal.SIGKILL
    assert downstream.client.stats()["deliveries_distinct"] == items  # sent...
    assert (
        scalar(db.engine, "SELECT count(*) FROM delivery_attempt_item WHERE status = 'IN_PROGRESS'")
        == items
    )  # ...not recorded
    wait_for_claims_to_lapse(db.engine, 15)
    rerun = run_cli(args, env)
    assert rerun.code == 0, rerun.stderr[-500:]
    assert (
        scalar(db.engine, "SELECT count(*) FROM delivery_attempt_item WHERE status = 'DELIVERED'")
        == items
    )
    stats = downstream.client.stats()
    assert stats["deliveries_distinct"] == items  # still exactly one delivery each
    assert stats["duplicates_suppressed"] == items  # the re-sends were answered from the key
    # ...and counted so: the killed run recorded nothing, the rerun's every call was a duplicate
    assert _tally_sums(db, "delivery_retry") == {
        "outcome.ok.attempt_2.delivered": items,
        "side_effect.submit_delivery.duplicate_prevented": items,
        "downstream.calls": items,  # the rerun's calls, each a retry (the second attempt)
        "downstream.retries": items,
    }
    assert scalar(db.engine, "SELECT sum(duplicates_prevented_count) FROM job_run") == items


# ------------------------------------------------------------------------ notification_publish


def test_notifications_under_faults_arrive_once_and_never_early(
    db, downstream_factory, monkeypatch, fast_retries
):
    load_demo_data(db.engine, tenants=1, quotes=2000, seed=3, as_of=datetime.now(UTC))
    due = set(
        q(
            db.engine,
            "SELECT id::text FROM outbox_event WHERE tenant_id = :t AND published_at IS NULL AND available_at <= now()",
            t=TENANT,
        ).scalars()
    )
    delayed = set(
        q(
            db.engine,
            "SELECT id::text FROM outbox_event WHERE tenant_id = :t AND available_at > now() + interval '20 minutes'",
            t=TENANT,
        ).scalars()
    )
    assert due and delayed
    server = downstream_factory(error_rate=0.2, timeout_rate=0.05, seed=5, timeout_s=1.5)
    monkeypatch.setenv("QO_OPS_DOWNSTREAM_URL", server.url)
    # a bigger attempt budget: 8 straight failures at 25% would dead-letter ~1 event in 60,000
    monkeypatch.setattr(notification_publish, "MAX_PUBLISH_ATTEMPTS", 30)

    def none_due() -> bool:
        return (
            scalar(
                db.engine,
                "SELECT count(*) FROM outbox_event WHERE published_at IS NULL AND dead_lettered_at IS NULL "
                "AND id = ANY(CAST(:ids AS uuid[]))",
                ids=list(due),
            )
            == 0
        )

    runs = drain(notification_publish.SPEC, db, none_due, batch_size=40)
    assert any(r.counts.retry_scheduled > 0 for r in runs)
    stats = server.client.stats()
    received = set(stats["notifications_by_event"])
    assert received == due  # every due event, and nothing else (no delayed one early)
    assert not received & delayed
    assert stats["notifications_distinct"] == len(due)
    published = set(
        q(
            db.engine,
            "SELECT id::text FROM outbox_event WHERE published_at IS NOT NULL AND id = ANY(CAST(:i AS uuid[]))",
            i=list(due),
        ).scalars()
    )
    assert published == due
    assert (
        scalar(
            db.engine,
            "SELECT count(*) FROM notification WHERE outbox_event_id = ANY(CAST(:i AS uuid[])) AND status <> 'SENT'",
            i=list(due),
        )
        == 0
    )


# ------------------------------------------------------------------------ order_reconciliation


def _plant_reconciliation(db, downstream) -> tuple[Scope, dict[str, str]]:
    """A day of in-flight orders, mirrored downstream except one of each mismatch type."""
    load_demo_data(db.engine, tenants=1, quotes=4000, seed=6, as_of=AS_OF)
    with db.engine.connect() as conn:
        day = conn.scalar(
            sa.text(
                "SELECT (submitted_at AT TIME ZONE 'UTC')::date FROM customer_order WHERE status = 'SUBMITTED' "
                "GROUP BY 1 HAVING count(*) >= 2 ORDER BY 1 LIMIT 1"
            )
        )
        scope = Scope(TENANT, day, day + timedelta(days=1))
        start, end = scope.window_bounds()
        orders = conn.execute(
            sa.text(
                "SELECT order_number, status FROM customer_order WHERE tenant_id = :t AND submitted_at >= :s "
                "AND submitted_at < :e AND status IN ('SUBMITTED', 'IN_FULFILLMENT') ORDER BY id"
            ),
            {"t": TENANT, "s": start, "e": end},
        ).all()
    assert len(orders) >= 4
    planted = {
        "missing_downstream": orders[0].order_number,
        "terminal_not_reflected": orders[1].order_number,
        "status_drift": orders[2].order_number,  # the downstream says ON_HOLD: unknown to us
    }
    for o in orders:
        if o.order_number == planted["missing_downstream"]:
            continue
        status = o.status
        if o.order_number == planted["terminal_not_reflected"]:
            status = "COMPLETED"
        elif o.order_number == planted["status_drift"]:
            status = "ON_HOLD"
        downstream.client.put_order(o.order_number, TENANT, status)
    downstream.client.put_order("ORD-777-0000001", TENANT, "IN_FULFILLMENT")
    planted["unknown_downstream"] = "ORD-777-0000001"
    return scope, planted


def test_reconciliation_reports_repairs_and_explains_every_mismatch(
    db, downstream, monkeypatch, fast_retries
):
    monkeypatch.setenv("QO_OPS_DOWNSTREAM_URL", downstream.url)
    scope, planted = _plant_reconciliation(db, downstream)
    business = (*BUSINESS_TABLES, outbox_event)
    with db.engine.connect() as conn:
        before = database_digest(conn, business)
    dry = run_job(order_reconciliation.SPEC, scope, RunOptions(mode="dry_run"), engine=db.engine)
    with db.engine.connect() as conn:
        assert database_digest(conn, business) == before  # report-only: nothing changed
    assert {k: dry.tally.get(k) for k in planted} == dict.fromkeys(planted, 1)

    done = execute(order_reconciliation.SPEC, db, scope)
    assert done.status == "success", done
    assert {k: done.tally.get(k) for k in planted} == dict.fromkeys(planted, 1)
    results = {
        r.order_number: r
        for r in q(
            db.engine,
            "SELECT * FROM reconciliation_result WHERE job_run_id = :id",
            id=uuid.UUID(done.job_run_id),
        )
    }
    assert {
        n: (results[n].mismatch_type, results[n].action, results[n].outcome)
        for n in planted.values()
    } == {
        planted["missing_downstream"]: ("missing_downstream", "resubmit", "corrected"),
        planted["terminal_not_reflected"]: ("terminal_not_reflected", "adopt_status", "corrected"),
        planted["status_drift"]: ("status_drift", "manual_review", "flagged"),
        planted["unknown_downstream"]: ("unknown_downstream", "manual_review", "flagged"),
    }
    assert len(results) == 4  # every change explained, nothing else touched

    def order(number: str):
        return q(
            db.engine,
            "SELECT o.status, o.needs_manual_review, d.status AS delivery FROM customer_order o "
            "JOIN delivery_attempt_item d ON d.order_id = o.id WHERE o.order_number = :n",
            n=number,
        ).one()

    assert order(planted["terminal_not_reflected"]).status == "COMPLETED"
    assert order(planted["missing_downstream"]).delivery == "READY"
    assert order(planted["status_drift"]).needs_manual_review is True
    assert all(c.passed for c in done.checks)
    # its side effects and checkpoints, counted: one event each, a checkpoint per batch, and
    # the checkpoint forgotten once the window was gone through (the next run rescans it)
    assert done.tally["side_effect.order_resubmit_requested_event.success"] == 1
    assert done.tally["side_effect.order_status_adopted_event.success"] == 1
    assert done.tally["checkpoint.updates"] == done.batches > 0
    assert done.tally["checkpoint.resets"] == 1
    assert scalar(db.engine, "SELECT count(*) FROM job_checkpoint") == 0
    samples = collect_when(
        JobCollector(db.engine, [order_reconciliation.SPEC]),
        lambda s: completed(s, "order_reconciliation") == finished_runs(db, "order_reconciliation"),
    )
    job = {"job_name": "order_reconciliation"}
    assert value(samples, "job_checkpoint_updates_total", **job) == done.batches
    assert value(samples, "job_checkpoint_resets_total", **job, reason="rescan_complete") == 1
    resubmitted = {**job, "side_effect": "order_resubmit_requested_event", "result": "success"}
    assert value(samples, "job_side_effects_total", **resubmitted) == 1

    # the re-submitted order is delivered (same idempotency key), then nothing is left to repair
    drain(delivery_retry.SPEC, db, lambda: order(planted["missing_downstream"]).delivery != "READY")
    again = execute(order_reconciliation.SPEC, db, scope)
    assert again.counts.succeeded == 0
    # only the order the downstream has and we do not is flagged again (it is no order of
    # ours to repair: each run tells a person once more); its lookups are counted as calls
    assert again.tally["downstream.calls"] == again.counts.processed
    skip = ("checkpoint.", "downstream.")
    assert {k: v for k, v in again.tally.items() if not k.startswith(skip)} == {
        "unknown_downstream": 1,
        "action_flagged": 1,
    }
    assert (
        scalar(
            db.engine,
            "SELECT count(*) FROM reconciliation_result WHERE job_run_id = :id AND mismatch_type <> 'unknown_downstream'",
            id=uuid.UUID(again.job_run_id),
        )
        == 0
    )


def test_reconciliation_with_the_downstream_down_loses_nothing(db, downstream, monkeypatch):
    """Every lookup failing: the shared breaker stops the run after ten failures in a row
    (and the lookups in flight, concurrency 16), no order is judged, and the checkpoint stays
    before the orders not looked at. Once the downstream is back and the probe due, the next
    run probes, closes it and goes on, and the next whole-window pass finds the missing
    order. (Before issue 44 the run went through the whole window failing every lookup.)"""
    monkeypatch.setenv("QO_OPS_DOWNSTREAM_URL", downstream.url)
    scope, _ = _plant_reconciliation(db, downstream)
    downstream.client.set_faults(error_rate=1.0)
    down = execute(order_reconciliation.SPEC, db, scope)
    assert (down.status, down.error_code) == ("failed", "dependency_unavailable")
    assert 10 <= down.counts.failed <= 10 + 16 < down.counts.processed
    assert scalar(db.engine, "SELECT count(*) FROM reconciliation_result") == 0
    # it stopped part way, so the next run resumes before the orders not looked at
    assert scalar(db.engine, "SELECT count(*) FROM job_checkpoint") == 1
    downstream.client.set_faults(error_rate=0.0)
    execute_sql(db.engine, "UPDATE downstream_breaker SET probe_after = now()")
    resumed = execute(order_reconciliation.SPEC, db, scope)
    assert resumed.tally["breaker.closed"] == 1 and resumed.counts.failed == 0
    back = execute(order_reconciliation.SPEC, db, scope)  # the whole window again
    assert back.tally.get("missing_downstream") == 1 and back.counts.failed == 0


def test_poison_events_are_dead_lettered_not_published(
    db, downstream_factory, monkeypatch, fast_retries
):
    load_demo_data(db.engine, tenants=1, quotes=600, seed=3, as_of=datetime.now(UTC))
    due = scalar(
        db.engine,
        "SELECT count(*) FROM outbox_event WHERE published_at IS NULL AND available_at <= now()",
    )
    server = downstream_factory(poison_rate=1.0)
    monkeypatch.setenv("QO_OPS_DOWNSTREAM_URL", server.url)
    run = execute(notification_publish.SPEC, db)
    assert (run.status, run.counts.deadlettered, run.counts.failed) == ("failed", due, due)
    rows = q(
        db.engine,
        "SELECT last_error_code, publish_attempts FROM outbox_event WHERE dead_lettered_at IS NOT NULL",
    ).all()
    assert len(rows) == due and {(r.last_error_code, r.publish_attempts) for r in rows} == {
        ("poison", 1)
    }
    assert server.client.stats()["notifications_distinct"] == 0
    again = execute(notification_publish.SPEC, db)
    assert again.status == "no_work"  # dead letters are not retried
