"""Recovery without database surgery, on a real PostgreSQL and through the real CLI: the
catalog's dead letters requeued (delivery items and outbox events), the manual-review queue
listed and decided (order_reconciliation's flagged orders: resubmit, adopt, dismiss), and
checkpoints shown and reset (pricing_snapshot_recalculation).

For each change: what it changes and nothing else, its audit row in the same transaction,
its refusal while a run holds the scope's lease, its dry run changing nothing, and a second
call changing nothing.

Tests ``qo_ops.platform.actions.recovery``.
"""

from __future__ import annotations

import json
import uuid
from datetime import date
from typing import Any

import pytest
import sqlalchemy as sa

from qo_ops.db.digest import database_digest
from qo_ops.jobs import notification_publish, pricing_snapshot_recalculation
from qo_ops.jobs.order_reconciliation import RESUBMIT_MAX_ENV
from qo_ops.jobs.order_reconciliation import SPEC as RECONCILIATION
from qo_ops.metrics.exporter import JobCollector
from qo_ops.platform.actions.recovery import (
    Checkpoints,
    Decision,
    ScopeBusy,
    Who,
    reset_checkpoints,
    resolve,
)
from qo_ops.platform.job.options import RunOptions
from qo_ops.platform.job.scope import Scope
from qo_ops.platform.run import lease as leases
from qo_ops.platform.run.runner import run_job
from qo_ops_tests.conftest import base_env, run_cli
from qo_ops_tests.jobs.test_order_reconciliation import (
    SCOPE,
    TENANT,
    deliver,
    item,
    missing_orders,
    reconcile,
    rows,
    scalar,
)
from qo_ops_tests.metrics.test_exporter import collect_when, value

WHO = Who("alice", "INC-9 decided")
AUDITED = ("job_audit",)
LEASES = ("job_lease",)  # an action takes and gives back its scope's lease


def digest(db, skip: tuple[str, ...] = ()) -> dict[str, str]:
    """Every table's content digest, but the ones in ``skip``."""
    with db.engine.connect() as conn:
        found = database_digest(conn)
    return {t: d for t, d in found.items() if t not in skip}


def audit_rows(db) -> list[Any]:
    return rows(db.engine, "SELECT * FROM job_audit ORDER BY id")


def cli(db, *args: str) -> Any:
    return run_cli(list(args), base_env(QO_OPS_DATABASE_URL=db.env_url))


def hold(db, job: str, scope: str) -> leases.Lease:
    """A run's lease on ``scope``, as a run holds it."""
    taken = leases.acquire(db.engine, job, scope, "run-elsewhere", 600, uuid.uuid4())
    assert taken is not None
    return taken


# ------------------------------------------------------------------------- the review queue


@pytest.fixture
def flagged(world, monkeypatch):
    """A reconciled week with a zero re-submission budget: every order the downstream misses
    is flagged (budget_exhausted); one order the downstream shows behind us (SUBMITTED while
    ours is IN_FULFILLMENT) and one in a status we do not have (ON_HOLD) are flagged as drift."""
    db, downstream = world
    monkeypatch.setenv(RESUBMIT_MAX_ENV, "0")
    missing = missing_orders(db)
    start, end = SCOPE.window_bounds()
    ahead = rows(
        db.engine,
        "SELECT o.order_number FROM customer_order o JOIN downstream_order x "
        "ON x.order_number = o.order_number WHERE o.tenant_id = :t AND o.status = 'IN_FULFILLMENT' "
        "AND x.status = 'IN_FULFILLMENT' AND o.submitted_at >= :s AND o.submitted_at < :e "
        "ORDER BY o.id LIMIT 2",
        t=TENANT,
        s=start,
        e=end,
    )
    assert len(ahead) == 2
    behind, unknown = ahead[0].order_number, ahead[1].order_number
    downstream.client.put_order(behind, TENANT, "SUBMITTED")
    downstream.client.put_order(unknown, TENANT, "ON_HOLD")
    run = reconcile(db)
    assert run.tally["status_drift"] == 2
    return db, missing, behind, unknown


def flagged_numbers(db) -> set[str]:
    return {
        r.order_number
        for r in rows(
            db.engine, "SELECT order_number FROM customer_order WHERE needs_manual_review"
        )
    }


def test_review_list_shows_every_flagged_order_with_why_and_the_actions(flagged):
    db, missing, behind, unknown = flagged
    expected = set(missing.values()) | {behind, unknown}
    assert flagged_numbers(db) == expected  # planted: what the run flagged

    listed = cli(db, "review", "list", "--json")
    assert listed.code == 0, listed.stderr
    waiting = {w["item"]: w for w in json.loads(listed.stdout)["waiting"]}
    assert set(waiting) == expected
    assert {waiting[n]["outcome"] for n in missing.values()} == {"budget_exhausted"}
    assert (waiting[behind]["kind"], waiting[behind]["ours"], waiting[behind]["theirs"]) == (
        "status_drift",
        "IN_FULFILLMENT",
        "SUBMITTED",
    )
    assert all(w["job_name"] == "order_reconciliation" for w in waiting.values())
    assert all(w["flagged_by_run"] for w in waiting.values())

    table = cli(db, "review", "list", "order_reconciliation", "--tenant", TENANT)
    assert table.code == 0, table.stderr
    assert behind in table.stdout and "resubmit|adopt|dismiss" in table.stdout
    assert "re-submitted 0 times" in table.stdout  # why, from the result row
    other = cli(db, "review", "list", "--tenant", "tenant-999")
    assert (other.code, other.stdout.strip()) == (0, "nothing is waiting for review")


def test_dismiss_clears_the_flag_only_with_its_audit_row_and_twice_changes_nothing(flagged):
    db, missing, _, _ = flagged
    order_id, number = next(iter(missing.items()))
    before, audit_before = digest(db, ("customer_order", *AUDITED, *LEASES)), audit_rows(db)

    dry = cli(db, "review", "resolve", "order_reconciliation", number, "--tenant", TENANT,
              "--action", "dismiss", "--reason", "INC-9 known", "--dry-run")  # fmt: skip
    assert dry.code == 0, dry.stderr
    assert f"would dismiss {number}" in dry.stdout
    assert number in flagged_numbers(db) and audit_rows(db) == audit_before  # nothing written

    done = cli(db, "review", "resolve", "order_reconciliation", number, "--tenant", TENANT,
               "--action", "dismiss", "--reason", "INC-9 known", "--requester", "alice")  # fmt: skip
    assert done.code == 0, done.stderr
    assert f"dismiss {number}: flag cleared" in done.stdout
    assert number not in flagged_numbers(db)
    assert digest(db, ("customer_order", *AUDITED, *LEASES)) == before  # nothing else moved
    audit = audit_rows(db)[len(audit_before) :]
    assert [(a.actor, a.action, a.reason, a.mode) for a in audit] == [
        ("alice", "review_dismiss", "INC-9 known", "execute")
    ]
    assert audit[0].details["item"] == number and audit[0].details["flagged"] == "budget_exhausted"
    assert audit[0].scope.startswith(f"{TENANT}/")

    settled = digest(db, (*AUDITED, *LEASES))
    again = cli(db, "review", "resolve", "order_reconciliation", number, "--tenant", TENANT,
                "--action", "dismiss", "--reason", "again")  # fmt: skip
    assert again.code == 0, again.stderr
    assert "not waiting for review; nothing changed" in again.stdout
    assert digest(db, (*AUDITED, *LEASES)) == settled


def test_resubmit_puts_a_dead_letter_back_takes_the_next_resubmission_and_delivers(flagged):
    db, missing, _, _ = flagged
    order_id, number = next(iter(missing.items()))
    with db.engine.begin() as conn:  # its delivery item died since: the resubmit revives it
        conn.execute(
            sa.text(
                "UPDATE delivery_attempt_item SET status = 'DEAD_LETTER', attempt_count = 8 "
                "WHERE order_id = :o"
            ),
            {"o": order_id},
        )
    audit_before = len(audit_rows(db))

    done = resolve(db.engine, RECONCILIATION, WHO, Decision(TENANT, number, "resubmit"))
    assert done.changed == 1 and "re-submission 1" in done.summary
    revived = item(db, order_id)
    assert (revived.status, revived.attempt_count) == ("READY", 0)
    assert [r.resubmission for r in rows(
        db.engine, "SELECT resubmission FROM order_resubmission WHERE order_id = :o", o=order_id
    )] == [1]  # fmt: skip
    keys = rows(
        db.engine,
        "SELECT business_key FROM outbox_event WHERE aggregate_id = :o "
        "AND event_type = 'OrderResubmitRequested'",
        o=str(order_id),
    )
    assert [k.business_key for k in keys] == [f"order:{order_id}:resubmit:1"]
    assert number not in flagged_numbers(db)
    assert [a.action for a in audit_rows(db)[audit_before:]] == ["review_resubmit"]

    settled = digest(db, (*AUDITED, *LEASES))
    again = resolve(db.engine, RECONCILIATION, WHO, Decision(TENANT, number, "resubmit"))
    assert again.changed == 0 and digest(db, (*AUDITED, *LEASES)) == settled
    assert deliver(db).counts.succeeded >= 1
    assert item(db, order_id).status == "DELIVERED"


def test_adopt_takes_the_downstream_status_and_refuses_what_it_cannot_adopt(flagged):
    db, missing, behind, unknown = flagged
    before = digest(db, (*AUDITED, *LEASES))
    for number, why in (
        (unknown, "not one an order has here"),
        (next(iter(missing.values())), "no status"),
    ):
        refused = cli(db, "review", "resolve", "order_reconciliation", number, "--tenant", TENANT,
                      "--action", "adopt", "--reason", "INC-9")  # fmt: skip
        assert refused.code == 2 and why in refused.stderr, refused
        assert len(refused.stderr.strip().splitlines()) == 1
    assert digest(db, (*AUDITED, *LEASES)) == before

    done = resolve(db.engine, RECONCILIATION, WHO, Decision(TENANT, behind, "adopt"))
    assert done.changed == 1
    order = rows(db.engine, "SELECT id, status, needs_manual_review FROM customer_order "
                 "WHERE order_number = :n", n=behind)[0]  # fmt: skip
    assert (order.status, order.needs_manual_review) == ("SUBMITTED", False)
    assert scalar(
        db.engine, "SELECT count(*) FROM outbox_event WHERE business_key = :k",
        k=f"order:{order.id}:adopted:SUBMITTED",
    ) == 1  # fmt: skip


def test_a_resolve_is_refused_while_a_run_holds_the_scope_and_changes_nothing(flagged):
    db, missing, _, _ = flagged
    number = next(iter(missing.values()))
    day = scalar(db.engine, "SELECT CAST(submitted_at AT TIME ZONE 'UTC' AS date) "
                 "FROM customer_order WHERE order_number = :n", n=number)  # fmt: skip
    for held in (Scope.days(TENANT, day, day).key, SCOPE.key):  # its day, or a range over it
        lease = hold(db, RECONCILIATION.name, held)
        before = digest(db)
        with pytest.raises(ScopeBusy, match="holds"):
            resolve(db.engine, RECONCILIATION, WHO, Decision(TENANT, number, "dismiss"))
        refused = cli(db, "review", "resolve", "order_reconciliation", number, "--tenant", TENANT,
                      "--action", "dismiss", "--reason", "INC-9")  # fmt: skip
        assert refused.code == 4 and "nothing changed" in refused.stderr, refused
        assert digest(db) == before
        lease.release(db.engine)
    assert resolve(db.engine, RECONCILIATION, WHO, Decision(TENANT, number, "dismiss")).changed == 1  # fmt: skip


# ------------------------------------------------------------------------- dead letters


def dead_events(db, tenant: str = TENANT) -> list[uuid.UUID]:
    return [
        r.id
        for r in rows(
            db.engine,
            "SELECT id FROM outbox_event WHERE tenant_id = :t AND dead_lettered_at IS NOT NULL "
            "ORDER BY dead_lettered_at, id",
            t=tenant,
        )
    ]


def test_requeue_covers_outbox_events_from_the_catalog_with_dry_run_and_audit(world):
    db, _ = world
    with db.engine.begin() as conn:  # three events died in an outage (planted)
        conn.execute(
            sa.text(
                "UPDATE outbox_event SET dead_lettered_at = clock_timestamp(), publish_attempts = 8 "
                "WHERE id = ANY(ARRAY(SELECT id FROM outbox_event WHERE tenant_id = :t "
                "AND published_at IS NULL ORDER BY id LIMIT 3))"
            ),
            {"t": TENANT},
        )
    dead = dead_events(db)
    assert len(dead) == 3
    before, audit_before = digest(db), audit_rows(db)

    dry = cli(db, "requeue", "notification_publish", "--tenant", TENANT, "--all-dead",
              "--reason", "INC-9 sink back", "--dry-run")  # fmt: skip
    assert dry.code == 0, dry.stderr
    assert "would requeue 3 dead-lettered outbox event(s)" in dry.stdout
    assert all(str(i) in dry.stdout for i in dead)
    assert digest(db) == before

    lease = hold(db, "notification_publish", TENANT)  # a run of the tenant is publishing
    before = digest(db)
    busy = cli(db, "requeue", "notification_publish", "--tenant", TENANT, "--all-dead",
               "--reason", "INC-9 sink back")  # fmt: skip
    assert busy.code == 4 and "holds tenant-001: nothing changed" in busy.stderr, busy
    assert digest(db) == before
    lease.release(db.engine)

    done = cli(db, "requeue", "notification_publish", "--tenant", TENANT, "--item", str(dead[0]),
               "--reason", "INC-9 sink back", "--requester", "bob", "--json")  # fmt: skip
    assert done.code == 0, done.stderr
    assert json.loads(done.stdout)["items"] == [str(dead[0])]
    assert dead_events(db) == dead[1:]
    released = rows(db.engine, "SELECT publish_attempts, available_at <= now() AS due "
                    "FROM outbox_event WHERE id = :i", i=dead[0])[0]  # fmt: skip
    assert (released.publish_attempts, released.due) == (0, True)
    audit = audit_rows(db)[len(audit_before) :]
    assert [(a.actor, a.action, a.job_name, a.decision) for a in audit] == [
        ("bob", "requeue", "notification_publish", "requeued 1")
    ]

    settled = digest(db, (*AUDITED, *LEASES))
    again = cli(db, "requeue", "notification_publish", "--tenant", TENANT, "--item", str(dead[0]),
                "--reason", "again")  # fmt: skip
    assert again.code == 0 and "requeued 0" in again.stdout
    assert digest(db, (*AUDITED, *LEASES)) == settled
    assert run_job(
        notification_publish.SPEC, Scope(TENANT),
        RunOptions(mode="execute", trigger="schedule", progress_interval_s=3600), engine=db.engine,
    ).counts.succeeded >= 1  # fmt: skip
    assert scalar(db.engine, "SELECT published_at IS NOT NULL FROM outbox_event WHERE id = :i",
                  i=dead[0])  # fmt: skip


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["requeue", "quote_expiration", "--tenant", TENANT, "--all-dead", "--reason", "r"],
         "keeps no dead letters"),
        (["requeue", "nope", "--tenant", TENANT, "--all-dead", "--reason", "r"], "unknown job"),
        (["requeue", "delivery_retry", "--tenant", TENANT, "--all-dead"], "reason is required"),
        (["requeue", "delivery_retry", "--tenant", "Bad Tenant", "--all-dead", "--reason", "r"],
         "tenant must be"),
        (["review", "resolve", "order_reconciliation", "ORD-1", "--tenant", TENANT,
          "--action", "shrug", "--reason", "r"], "offers --action resubmit|adopt|dismiss"),
        (["review", "resolve", "quote_expiration", "Q-1", "--tenant", TENANT,
          "--action", "dismiss", "--reason", "r"], "flags nothing for manual review"),
        (["checkpoint", "reset", "quote_expiration", "--tenant", TENANT, "--reason", "r"],
         "keeps no checkpoint"),
        (["checkpoint", "reset", "pricing_snapshot_recalculation", "--tenant", TENANT,
          "--from", "2026-02-01", "--reason", "r"], "give both --from and --to"),
        (["checkpoint", "reset", "pricing_snapshot_recalculation", "--tenant", TENANT,
          "--from", "2026-02-03", "--to", "2026-02-01", "--reason", "r"], "must not be before"),
        (["checkpoint", "show", "pricing_snapshot_recalculation", "--tenant", TENANT,
          "--from", "yesterday", "--to", "2026-02-01"], "must be a date"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_exit_2_and_changes_nothing(world, args, says):
    db, _ = world
    before = digest(db)
    done = cli(db, *args)
    assert done.code == 2, done
    assert says in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert digest(db) == before


# ------------------------------------------------------------------------- checkpoints

PRICING = pricing_snapshot_recalculation.SPEC
DAYS = [date(2026, 2, 10), date(2026, 2, 11), date(2026, 2, 12)]


@pytest.fixture
def checkpointed(world):
    """pricing_snapshot_recalculation run over three days, one scope each: a checkpoint each."""
    db, _ = world
    for day in DAYS:
        done = run_job(
            PRICING, Scope.days(TENANT, day, day),
            RunOptions(mode="execute", trigger="schedule", progress_interval_s=3600),
            engine=db.engine,
        )  # fmt: skip
        assert done.status in ("success", "no_work"), done
    keys = [Scope.days(TENANT, d, d).key for d in DAYS]
    saved = [r.scope for r in rows(db.engine, "SELECT scope FROM job_checkpoint ORDER BY scope")]
    assert saved == keys
    return db, keys


def test_checkpoint_show_and_reset_within_days_with_dry_run_audit_and_metric(checkpointed):
    db, keys = checkpointed
    shown = cli(db, "checkpoint", "show", PRICING.name, "--tenant", TENANT, "--json")
    assert shown.code == 0, shown.stderr
    assert [c["scope"] for c in json.loads(shown.stdout)["checkpoints"]] == keys
    assert all(c["held"] is False for c in json.loads(shown.stdout)["checkpoints"])

    window = ["--from", "2026-02-11", "--to", "2026-02-12"]
    before = digest(db)
    dry = cli(db, "checkpoint", "reset", PRICING.name, "--tenant", TENANT, *window,
              "--reason", "INC-9 new price book", "--dry-run")  # fmt: skip
    assert dry.code == 0, dry.stderr
    assert "would forget 2 checkpoint(s)" in dry.stdout and keys[1] in dry.stdout
    assert digest(db) == before

    done = cli(db, "checkpoint", "reset", PRICING.name, "--tenant", TENANT, *window,
               "--reason", "INC-9 new price book", "--requester", "carol")  # fmt: skip
    assert done.code == 0, done.stderr
    assert "forgot 2 checkpoint(s)" in done.stdout
    left = [r.scope for r in rows(db.engine, "SELECT scope FROM job_checkpoint ORDER BY scope")]
    assert left == keys[:1]
    audit = audit_rows(db)[-1]
    assert (audit.actor, audit.action, audit.reason, audit.decision) == (
        "carol",
        "checkpoint_reset",
        "INC-9 new price book",
        "forgot 2",
    )
    assert audit.details["scopes"] == keys[1:] and set(audit.details["cursors"]) == set(keys[1:])

    settled = digest(db, AUDITED)
    again = reset_checkpoints(db.engine, PRICING, WHO, Checkpoints(TENANT, DAYS[1], DAYS[2]))
    assert again.changed == 0 and digest(db, AUDITED) == settled

    samples = collect_when(
        JobCollector(db.engine, [PRICING]),
        lambda s: value(s, "job_checkpoint_resets_total", job_name=PRICING.name,
                        reason="operator") >= 2,
    )  # fmt: skip
    assert value(samples, "job_checkpoint_resets_total", job_name=PRICING.name,
                 reason="operator") == 2  # fmt: skip
    assert value(samples, "job_checkpoint_resets_total", job_name=PRICING.name,
                 reason="rescan_complete") == 0  # fmt: skip


def test_a_checkpoint_reset_is_refused_while_a_run_holds_a_scope(checkpointed):
    db, keys = checkpointed
    lease = hold(db, PRICING.name, keys[2])
    before = digest(db)
    refused = cli(db, "checkpoint", "reset", PRICING.name, "--tenant", TENANT,
                  "--reason", "INC-9")  # fmt: skip
    assert refused.code == 4, refused
    assert keys[2] in refused.stderr and "nothing changed" in refused.stderr
    assert digest(db) == before  # not even the free scopes' checkpoints went
    shown = json.loads(cli(db, "checkpoint", "show", PRICING.name, "--tenant", TENANT,
                           "--json").stdout)  # fmt: skip
    assert [c["held"] for c in shown["checkpoints"]] == [False, False, True]
    lease.release(db.engine)
    after = reset_checkpoints(db.engine, PRICING, WHO, Checkpoints(TENANT))
    assert after.changed == 3
    assert scalar(db.engine, "SELECT count(*) FROM job_checkpoint") == 0
