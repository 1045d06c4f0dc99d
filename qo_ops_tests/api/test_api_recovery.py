"""Recovery through the operator API, on a real ``qo-ops api`` and PostgreSQL: requeue (an
operator), the review queue (listed by anyone, decided by an operator), checkpoints (shown
by anyone, reset by an approver; an operator may only dry-run a reset). Each change is
audited with the request's id, a second call changes nothing, a refusal changes nothing,
and a run holding the scope makes it a 409.

What each action changes in the database is proven in qo_ops_tests/platform/actions/test_recovery.py
(the same code path); here the HTTP contract and the roles."""

from __future__ import annotations

import uuid
from datetime import date

import sqlalchemy as sa

from qo_ops.db.digest import database_digest
from qo_ops.platform.job.scope import Scope
from qo_ops.platform.run import lease as leases

TENANT = "tenant-001"
AUDITED = ("job_audit", "job_lease")


def digest(db) -> dict[str, str]:
    with db.engine.connect() as conn:
        return {t: d for t, d in database_digest(conn).items() if t not in AUDITED}


def one(db, sql: str, **params):
    with db.engine.connect() as conn:
        return conn.execute(sa.text(sql), params).first()


def plant(db) -> tuple[list[str], str, list[str]]:
    """Two dead-lettered outbox events, one flagged order, two pricing checkpoints."""
    with db.engine.begin() as conn:
        events = conn.execute(
            sa.text(
                "UPDATE outbox_event SET dead_lettered_at = clock_timestamp() WHERE id = ANY(ARRAY("
                "SELECT id FROM outbox_event WHERE tenant_id = :t AND published_at IS NULL "
                "ORDER BY id LIMIT 2)) RETURNING id"
            ),
            {"t": TENANT},
        ).scalars()
        order = conn.scalar(
            sa.text(
                "UPDATE customer_order SET needs_manual_review = true WHERE id = (SELECT min(id) "
                "FROM customer_order WHERE tenant_id = :t) RETURNING order_number"
            ),
            {"t": TENANT},
        )
        keys = [Scope.days(TENANT, date(2026, 2, d), date(2026, 2, d)).key for d in (10, 11)]
        for key in keys:
            conn.execute(
                sa.text(
                    "INSERT INTO job_checkpoint (job_name, scope, cursor, job_run_id, updated_at) "
                    "VALUES ('pricing_snapshot_recalculation', :s, '{\"last_id\": 7}', :r, now())"
                ),
                {"s": key, "r": uuid.uuid4()},
            )
        return sorted(str(e) for e in events), order, keys


def test_requeue_by_an_operator_with_dry_run_audit_and_refusals(loaded, api_factory):
    api = api_factory()
    events, _, _ = plant(loaded)
    assert len(events) == 2
    olga, vera = api.token("olga", "operator"), api.token("vera", "viewer")
    other = api.token("tom", "operator", tenant="tenant-002")
    path = "/internal/jobs/notification_publish/dead-letters/requeue"
    body = {"tenant": TENANT, "allDead": True, "reason": "INC-9 sink back"}
    before = digest(loaded)

    for token, status in ((vera, 403), (other, 403)):
        refused = api.post(path, token, json=body)
        assert refused.status_code == status, refused.text
    assert api.post(path, olga, json={**body, "items": [events[0]]}).status_code == 422
    none = api.post("/internal/jobs/quote_expiration/dead-letters/requeue", olga, json=body)
    assert none.status_code == 404 and "keeps no dead letters" in none.json()["error"]
    dry = api.post(path, olga, json={**body, "dryRun": True})
    assert dry.status_code == 200, dry.text
    assert sorted(dry.json()["items"]) == events and dry.json()["changed"] == 0
    held = leases.acquire(loaded.engine, "notification_publish", TENANT, "run-elsewhere", 600,
                          uuid.uuid4())  # fmt: skip
    assert held is not None
    busy = api.post(path, olga, json=body)
    assert busy.status_code == 409 and "nothing changed" in busy.json()["error"], busy.text
    assert digest(loaded) == before  # refusals and the dry run changed nothing
    held.release(loaded.engine)

    done = api.post(path, olga, json=body)
    assert done.status_code == 200 and done.json()["changed"] == 2, done.text
    assert one(loaded, "SELECT count(*) AS n FROM outbox_event WHERE dead_lettered_at IS NOT NULL "
               "AND tenant_id = :t", t=TENANT).n == 0  # fmt: skip
    audit = one(loaded, "SELECT * FROM job_audit WHERE action = 'requeue' ORDER BY id DESC")
    assert (audit.actor, audit.reason, audit.decision) == ("olga", "INC-9 sink back", "requeued 2")
    assert audit.request_id == done.headers["X-Request-Id"]
    denied = one(loaded, "SELECT decision FROM job_audit WHERE actor = 'vera' ORDER BY id DESC")
    assert denied.decision == "denied: role viewer may only read"

    settled = digest(loaded)
    again = api.post(path, olga, json=body)
    assert again.status_code == 200 and again.json()["changed"] == 0
    assert digest(loaded) == settled


def test_reviews_listed_by_a_viewer_decided_by_an_operator_and_409_while_a_run_holds_it(
    loaded, api_factory
):
    api = api_factory()
    _, order, _ = plant(loaded)
    olga, vera = api.token("olga", "operator"), api.token("vera", "viewer")
    path = "/internal/jobs/order_reconciliation/reviews"

    listed = api.get(f"{path}?tenant={TENANT}", vera)
    assert listed.status_code == 200, listed.text
    assert [w["item"] for w in listed.json()["waiting"]] == [order]
    assert set(listed.json()["actions"]) == {"resubmit", "adopt", "dismiss"}
    assert api.get("/internal/jobs/quote_expiration/reviews", vera).status_code == 404

    decide = f"{path}/{order}/resolve"
    body = {"tenant": TENANT, "action": "dismiss", "reason": "INC-9 known"}
    before = digest(loaded)
    assert api.post(decide, vera, json=body).status_code == 403
    shrug = api.post(decide, olga, json={**body, "action": "shrug"})
    assert shrug.status_code == 422 and "resubmit|adopt|dismiss" in shrug.json()["error"]
    day = one(loaded, "SELECT CAST(submitted_at AT TIME ZONE 'UTC' AS date) AS d "
              "FROM customer_order WHERE order_number = :n", n=order).d  # fmt: skip
    held = leases.acquire(loaded.engine, "order_reconciliation", Scope.days(TENANT, day, day).key,
                          "run-elsewhere", 600, uuid.uuid4())  # fmt: skip
    assert held is not None
    busy = api.post(decide, olga, json=body)
    assert busy.status_code == 409 and "nothing changed" in busy.json()["error"]
    held.release(loaded.engine)
    dry = api.post(decide, olga, json={**body, "dryRun": True})
    assert dry.status_code == 200 and dry.json()["summary"].startswith(f"would dismiss {order}")
    assert digest(loaded) == before

    done = api.post(decide, olga, json=body)
    assert done.status_code == 200 and done.json()["changed"] == 1, done.text
    assert one(loaded, "SELECT needs_manual_review AS f FROM customer_order "
               "WHERE order_number = :n", n=order).f is False  # fmt: skip
    assert api.get(f"{path}?tenant={TENANT}", vera).json()["waiting"] == []
    settled = digest(loaded)
    again = api.post(decide, olga, json=body)
    assert again.status_code == 200 and again.json()["changed"] == 0
    assert digest(loaded) == settled


def test_checkpoints_shown_to_anyone_reset_by_an_approver_only(loaded, api_factory):
    api = api_factory()
    _, _, keys = plant(loaded)
    ann, olga, vera = (api.token("ann", "approver"), api.token("olga", "operator"),
                       api.token("vera", "viewer"))  # fmt: skip
    path = "/internal/jobs/pricing_snapshot_recalculation/checkpoints"

    shown = api.get(f"{path}?tenant={TENANT}&from=2026-02-10&to=2026-02-12", vera)
    assert shown.status_code == 200, shown.text
    assert [c["scope"] for c in shown.json()["checkpoints"]] == keys
    assert (
        api.get(f"/internal/jobs/quote_expiration/checkpoints?tenant={TENANT}", vera).status_code
        == 404
    )

    body = {"tenant": TENANT, "from": "2026-02-11", "to": "2026-02-12", "reason": "INC-9 v3"}
    before = digest(loaded)
    refused = api.post(f"{path}/reset", olga, json=body)
    assert refused.status_code == 403 and "approver" in refused.json()["error"]
    dry = api.post(f"{path}/reset", olga, json={**body, "dryRun": True})
    assert dry.status_code == 200 and dry.json()["items"] == keys[1:], dry.text
    bad = api.post(f"{path}/reset", ann, json={**body, "from": "2026-02-12"})
    assert bad.status_code == 422 and "must be after from" in bad.json()["error"]
    off = api.post(f"{path}/reset", ann, json={**body, "to": "2026-02-30"})
    assert off.status_code == 422 and "on the calendar" in off.json()["error"]
    assert digest(loaded) == before

    done = api.post(f"{path}/reset", ann, json=body)
    assert done.status_code == 200 and done.json()["items"] == keys[1:], done.text
    left = api.get(f"{path}?tenant={TENANT}", vera).json()["checkpoints"]
    assert [c["scope"] for c in left] == keys[:1]
    again = api.post(f"{path}/reset", ann, json=body)
    assert again.status_code == 200 and again.json()["changed"] == 0

    held = leases.acquire(loaded.engine, "pricing_snapshot_recalculation", keys[0],
                          "run-elsewhere", 600, uuid.uuid4())  # fmt: skip
    assert held is not None
    busy = api.post(f"{path}/reset", ann, json={"tenant": TENANT, "reason": "all"})
    assert busy.status_code == 409 and keys[0] in busy.json()["error"]
    assert [
        c["scope"] for c in api.get(f"{path}?tenant={TENANT}", vera).json()["checkpoints"]
    ] == keys[:1]
