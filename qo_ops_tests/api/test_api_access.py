"""The operator API's doors, against a real ``qo-ops api`` process and a real database, with
Dagster unreachable (so an allowed launch answers 503 and says so in the run record):
authentication (401), authorization (403), validation (422), the rate limit (429), the
two-person rule for destructive jobs, and an audit row for every decision — while denied
requests change nothing else."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import sqlalchemy as sa

from qo_ops.db.digest import database_digest
from qo_ops.db.schema import job_run
from qo_ops.demo.data import load_demo_data
from qo_ops_tests.conftest import REPO, run_cli
from qo_ops_tests.dagster.conftest import AS_OF

RUNS = "/internal/jobs/quote_expiration/runs"
DRY = {"mode": "dry_run", "tenant": "tenant-001", "reason": "look first"}


def _audit(db, since: int = 0) -> list[dict]:
    with db.engine.connect() as conn:
        return [
            dict(r._mapping)
            for r in conn.execute(
                sa.text("SELECT * FROM job_audit WHERE id > :since ORDER BY id"), {"since": since}
            )
        ]


def _last_audit_id(db) -> int:
    with db.engine.connect() as conn:
        return int(conn.scalar(sa.text("SELECT coalesce(max(id), 0) FROM job_audit")))


def _state(db) -> dict[str, str]:
    """Everything but the audit trail: what a denied request must leave untouched."""
    with db.engine.connect() as conn:
        digest = database_digest(conn)
    digest.pop("job_audit")
    return digest


def _one_line_error(response) -> str:
    body = response.json()
    assert set(body) >= {"error", "requestId"}, body
    assert "\n" not in body["error"] and "Traceback" not in body["error"]
    assert response.headers["X-Request-Id"] == body["requestId"]
    return body["error"]


def test_a_token_is_shown_once_and_stored_only_as_a_hash(api, db):
    created = run_cli(
        ["api", "token", "create", "--identity", "alice@ops", "--role", "operator"], api.admin_env
    )
    assert created.code == 0, created.stderr
    token = created.stdout.strip().splitlines()[-1]
    assert token.startswith("qoops_") and token not in created.stdout.splitlines()[0]
    token_id, secret = token.removeprefix("qoops_").split("_", 1)
    with db.engine.connect() as conn:
        row = conn.execute(sa.text("SELECT * FROM api_token WHERE id = :i"), {"i": token_id}).one()
        dump = json.dumps(
            [dict(r._mapping) for r in conn.execute(sa.text("SELECT * FROM api_token"))],
            default=str,
        )
    assert secret not in dump and token not in dump
    assert row.secret_sha256 == hashlib.sha256(secret.encode()).hexdigest()
    assert (row.identity, row.roles, row.tenant_id) == ("alice@ops", ["operator"], None)

    listed = run_cli(["api", "token", "list", "--json"], api.admin_env)
    assert listed.code == 0 and secret not in listed.stdout and token_id in listed.stdout
    assert api.get("/internal/jobs", token).status_code == 200

    assert run_cli(["api", "token", "revoke", token_id], api.admin_env).code == 0
    assert api.get("/internal/jobs", token).status_code == 401

    bad = run_cli(["api", "token", "create", "--identity", "x", "--role", "root"], api.admin_env)
    assert bad.code == 2 and "role must be one of" in bad.stderr and "Traceback" not in bad.stderr


def test_unauthenticated_requests_get_401_and_are_audited(api, db):
    good = api.token("olga", "operator")
    expired = api.token("eve", "operator")
    with db.engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE api_token SET expires_at = now() - interval '1 second' WHERE id = :i"),
            {"i": expired.split("_")[1]},
        )
    tampered = good[:-4] + ("AAAA" if not good.endswith("AAAA") else "BBBB")
    unknown = "qoops_0123456789abcdef_" + "x" * 43
    before, mark = _state(db), _last_audit_id(db)
    attempts = [
        api.post(RUNS, None, json=DRY),
        api.post(RUNS, None, json=DRY, headers={"Authorization": f"Basic {good}"}),
        api.post(RUNS, unknown, json=DRY),
        api.post(RUNS, tampered, json=DRY),
        api.post(RUNS, expired, json=DRY),
        api.post(RUNS, "not-a-token", json=DRY),
        api.get("/internal/jobs/quote_expiration/status", None),
        api.post(RUNS, None, content=b"{not json", headers={"Content-Type": "application/json"}),
    ]
    for response in attempts:
        assert response.status_code == 401, response.text
        assert response.headers["WWW-Authenticate"] == "Bearer"
        _one_line_error(response)
    rows = _audit(db, mark)
    assert len(rows) == len(attempts)
    assert {r["actor"] for r in rows} == {"anonymous"}
    assert all(r["decision"].startswith("denied:") and r["request_id"] for r in rows)
    assert {r["client_address"] for r in rows} == {"127.0.0.1"}
    assert _state(db) == before


def test_roles_modes_and_tenants_are_enforced_with_403(api, db):
    load_demo_data(db.engine, tenants=2, quotes=100, seed=9, as_of=AS_OF)
    viewer = api.token("vera", "viewer")
    operator = api.token("olga", "operator")
    approver = api.token("abe", "approver")
    scoped = api.token("tina", "operator", tenant="tenant-001")
    # a run of tenant-002 exists (its launch fails: Dagster is not there)
    other = api.post(
        "/internal/jobs/quote_expiration/runs", approver, json={**DRY, "tenant": "tenant-002"}
    )
    assert other.status_code == 503
    other_id = other.json()["error"].split()[1]
    before, mark = _state(db), _last_audit_id(db)

    cleanup = {
        "mode": "execute",
        "tenant": "tenant-001",
        "from": "2026-02-01",
        "to": "2026-02-02",
        "reason": "disk pressure",
    }
    denied = {
        "viewer dry-run": api.post(RUNS, viewer, json=DRY),
        "viewer execute": api.post(RUNS, viewer, json={**DRY, "mode": "execute"}),
        "operator executes a destructive job": api.post(
            "/internal/jobs/temp_file_cleanup/runs", operator, json=cleanup
        ),
        "other tenant submit": api.post(RUNS, scoped, json={**DRY, "tenant": "tenant-002"}),
        "other tenant read": api.get(f"{RUNS}/{other_id}", scoped),
        "other tenant status": api.get(
            "/internal/jobs/quote_expiration/status?tenant=tenant-002", scoped
        ),
        "viewer cancel": api.post(f"{RUNS}/{other_id}/cancel", viewer, json={"reason": "stop"}),
        "other tenant cancel": api.post(f"{RUNS}/{other_id}/cancel", scoped, json={"reason": "x"}),
    }
    for what, response in denied.items():
        assert response.status_code == 403, (what, response.text)
        _one_line_error(response)
    assert "approver" in denied["operator executes a destructive job"].json()["error"]
    rows = _audit(db, mark)
    assert len(rows) == len(denied)
    assert all(r["decision"].startswith("denied:") for r in rows)
    assert {r["actor"] for r in rows} == {"vera", "olga", "tina"}
    submit_rows = [r for r in rows if r["action"] == "submit"]
    assert {(r["job_name"], r["mode"]) for r in submit_rows} >= {
        ("quote_expiration", "dry_run"),
        ("temp_file_cleanup", "execute"),
    }
    assert all(r["request_id"] and r["client_address"] == "127.0.0.1" for r in rows)
    assert _state(db) == before

    # what each may do: the viewer reads, the scoped operator works on its own tenant
    assert api.get(f"{RUNS}/{other_id}", viewer).status_code == 200
    own = api.post(RUNS, scoped, json=DRY)
    assert own.status_code == 503  # allowed, but Dagster is unreachable
    status = api.get("/internal/jobs/quote_expiration/status", scoped)
    assert status.status_code == 200
    assert {s["scope"] for s in status.json()["scopes"]} == {"tenant-001"}


def test_malformed_out_of_range_and_unsafe_requests_get_422_and_unknown_jobs_404(api, db):
    load_demo_data(db.engine, tenants=2, quotes=100, seed=9, as_of=AS_OF)
    operator = api.token("olga", "operator")
    before, mark = _state(db), _last_audit_id(db)
    window = {"from": "2026-02-01", "to": "2026-02-02"}
    cases = {
        "not JSON": dict(content=b"{mode: dry_run", headers={"Content-Type": "application/json"}),
        "unknown job": dict(path="/internal/jobs/expire_all_quotes/runs", json=DRY, status=404),
        "job name with SQL characters": dict(
            path="/internal/jobs/quote_expiration';--/runs", json=DRY, status=404
        ),
        "unknown field": dict(json={**DRY, "where": "1=1"}),
        "mode missing": dict(json={"tenant": "tenant-001"}),
        "mode unknown": dict(json={**DRY, "mode": "force"}),
        "batch size 0": dict(json={**DRY, "batchSize": 0}),
        "batch size over the maximum": dict(json={**DRY, "batchSize": 10_001}),
        "max items as a string": dict(json={**DRY, "maxItems": "5"}),
        "max items negative": dict(json={**DRY, "maxItems": -1}),
        "throttle too long": dict(json={**DRY, "throttleMs": 3_600_000}),
        "SQL in the tenant": dict(json={**DRY, "tenant": "tenant-001'; DROP TABLE quote; --"}),
        "path in the tenant": dict(json={**DRY, "tenant": "../../etc/passwd"}),
        "glob in the tenant": dict(json={**DRY, "tenant": "tenant-*"}),
        "unknown tenant": dict(json={**DRY, "tenant": "tenant-999"}),
        "dates on a sweep job": dict(json={**DRY, **window}),
        "windowed job without dates": dict(
            path="/internal/jobs/pricing_snapshot_recalculation/runs", json=DRY
        ),
        "window ending before it starts": dict(
            path="/internal/jobs/pricing_snapshot_recalculation/runs",
            json={**DRY, "from": "2026-02-02", "to": "2026-02-01"},
        ),
        "impossible date": dict(
            path="/internal/jobs/pricing_snapshot_recalculation/runs",
            json={**DRY, "from": "2026-02-30", "to": "2026-03-01"},
        ),
        "first day of the calendar": dict(
            path="/internal/jobs/pricing_snapshot_recalculation/runs",
            json={**DRY, "from": "0001-01-01", "to": "0001-01-02"},
        ),
        "a window from before 1900": dict(
            path="/internal/jobs/order_reconciliation/runs",
            json={**DRY, "from": "1899-12-31", "to": "1900-01-01"},
        ),
        "a window ending past the calendar": dict(
            path="/internal/jobs/order_reconciliation/runs",
            json={**DRY, "from": "9999-12-31", "to": "10000-01-01"},
        ),
        "date with SQL": dict(
            path="/internal/jobs/pricing_snapshot_recalculation/runs",
            json={**DRY, "from": "2026-02-01' OR '1'='1", "to": "2026-02-02"},
        ),
        "execute without a reason": dict(json={"mode": "execute", "tenant": "tenant-001"}),
        "reason with a newline": dict(json={**DRY, "reason": "ok\nFORGED LOG LINE"}),
        "correlation id with spaces": dict(json={**DRY, "correlationId": "a b; rm -rf /"}),
        "idempotency key with SQL": dict(json=DRY, headers={"Idempotency-Key": "k' OR 1=1"}),
    }
    for what, case in cases.items():
        response = api.post(
            case.get("path", RUNS),
            operator,
            json=case.get("json"),
            content=case.get("content"),
            headers=case.get("headers"),
        )
        expected = case.get("status", 422)  # a job the catalog does not know is not there
        assert response.status_code == expected, (what, response.status_code, response.text)
        message = _one_line_error(response)
        assert "DROP TABLE" not in message and "FORGED" not in message, (what, message)
    rows = _audit(db, mark)
    assert len(rows) == len(cases)
    assert [r["actor"] for r in rows if not r["decision"].startswith("denied:")] == [], rows
    assert {r["actor"] for r in rows} == {"olga"}
    # bytes that are not UTF-8: 400 in the same shape, and only once the token is checked
    garbled = dict(content=b'"\xff"', headers={"Content-Type": "application/json"})
    assert api.post(RUNS, None, **garbled).status_code == 401
    unreadable = api.post(RUNS, operator, **garbled)
    assert unreadable.status_code == 400
    assert _one_line_error(unreadable) == "the body is not UTF-8"
    # a path that names no route at all is a plain 404, in the same one-line shape
    lost = api.post("/internal/jobs/..%2F..%2Fetc%2Fpasswd/runs", operator, json=DRY)
    assert lost.status_code == 404 and _one_line_error(lost) == "not found"
    assert _state(db) == before


def test_an_identity_over_its_rate_limit_gets_429(api_factory, db):
    api = api_factory(QO_OPS_API_RATE_LIMIT="5")
    busy = api.token("busy", "viewer")
    calm = api.token("calm", "viewer")
    mark = _last_audit_id(db)
    answers = [api.get("/internal/jobs", busy).status_code for _ in range(7)]
    assert answers == [200] * 5 + [429] * 2
    limited = api.get("/internal/jobs", busy)
    assert limited.status_code == 429 and int(limited.headers["Retry-After"]) >= 1
    assert api.get("/internal/jobs", calm).status_code == 200  # per identity
    rows = [r for r in _audit(db, mark) if r["action"] == "rate_limit"]
    assert len(rows) == 3 and {r["actor"] for r in rows} == {"busy"}


def test_launch_failure_leaves_a_failed_run_and_a_503(api, db):
    load_demo_data(db.engine, tenants=1, quotes=50, seed=9, as_of=AS_OF)
    operator = api.token("olga", "operator")
    mark = _last_audit_id(db)
    response = api.post(RUNS, operator, json={**DRY, "correlationId": "inc-42"})
    assert response.status_code == 503
    assert "Dagster unreachable" in _one_line_error(response)
    with db.engine.connect() as conn:
        rows = conn.execute(sa.select(job_run)).all()
    assert len(rows) == 1
    run = rows[0]
    assert (run.status, run.status_reason, run.last_error_code) == (
        "failed",
        "launch_failed",
        "launch_failed",
    )
    assert (run.trigger_type, run.requester, run.correlation_id) == ("api", "olga", "inc-42")
    assert run.finished_at is not None and run.dagster_run_id is None
    decisions = [(r["action"], r["decision"]) for r in _audit(db, mark)]
    assert decisions == [("submit", "allowed"), ("launch", "failed: launch_failed")]
    view = api.get(f"{RUNS}/{run.id}", operator).json()
    assert view["status"] == "failed" and view["status_reason"] == "launch_failed"
    # a failed launch does not hold the scope: the next request is not a conflict
    assert api.post(RUNS, operator, json=DRY).status_code == 503


def _accepted_run(db, minutes_ago: int) -> None:
    """An accepted run of quote_expiration for tenant-001 whose launch never happened,
    created ``minutes_ago`` by the database's clock."""
    with db.engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO job_run (id, job_name, scope, mode, trigger_type, owner_id, status, "
                "created_at) VALUES (gen_random_uuid(), 'quote_expiration', 'tenant-001', "
                "'dry_run', 'api', 'qo-ops-api', 'accepted', "
                "clock_timestamp() - make_interval(mins => :m))"
            ),
            {"m": minutes_ago},
        )


def test_an_accepted_run_whose_launch_was_lost_is_judged_by_the_database_clock(api, db):
    load_demo_data(db.engine, tenants=1, quotes=50, seed=9, as_of=AS_OF)
    operator = api.token("olga", "operator")
    _accepted_run(db, minutes_ago=0)  # its launch may still be in flight: it holds the scope
    assert api.post(RUNS, operator, json=DRY).status_code == 409
    with db.engine.begin() as conn:
        conn.execute(sa.text("UPDATE job_run SET created_at = created_at - interval '10 minutes'"))
    assert api.post(RUNS, operator, json=DRY).status_code == 503  # expired; the new one ran
    with db.engine.connect() as conn:
        reasons = conn.execute(sa.text("SELECT status_reason FROM job_run ORDER BY created_at"))
        assert reasons.scalars().all() == ["launch_lost", "launch_failed"]


def test_a_destructive_execute_waits_for_a_second_identity(api, db):
    load_demo_data(db.engine, tenants=1, quotes=50, seed=9, as_of=AS_OF)
    olga = api.token("olga", "operator")
    otto = api.token("otto", "operator")
    vera = api.token("vera", "viewer")
    path = "/internal/jobs/temp_file_cleanup/runs"
    body = {
        "mode": "execute",
        "tenant": "tenant-001",
        "from": "2026-02-01",
        "to": "2026-02-02",
        "reason": "disk pressure",
        "requestApproval": True,
    }
    held = api.post(path, olga, json=body)
    assert held.status_code == 202, held.text
    run_id = held.json()["jobRunId"]
    assert held.json() == {"jobRunId": run_id, "status": "awaiting_approval", "mode": "execute"}
    assert held.headers["Location"] == f"{path}/{run_id}"
    # the held run is the scope's active run
    again = api.post(path, otto, json=body)
    assert again.status_code == 409 and again.json()["activeRunId"] == run_id

    assert api.post(f"{path}/{run_id}/approve", olga, json={"reason": "me"}).status_code == 403
    assert api.post(f"{path}/{run_id}/approve", vera, json={"reason": "me"}).status_code == 403
    with db.engine.connect() as conn:
        assert conn.scalar(sa.select(job_run.c.status).where(job_run.c.id == run_id)) == (
            "awaiting_approval"
        )
    approved = api.post(f"{path}/{run_id}/approve", otto, json={"reason": "checked the dry-run"})
    assert approved.status_code == 503  # released, but Dagster is not there
    with db.engine.connect() as conn:
        run = conn.execute(sa.select(job_run).where(job_run.c.id == run_id)).one()
    assert (run.approved_by, run.status, run.status_reason) == ("otto", "failed", "launch_failed")
    rows = [r for r in _audit(db) if r["job_run_id"] is not None and str(r["job_run_id"]) == run_id]
    assert [(r["actor"], r["action"], r["decision"]) for r in rows] == [
        ("olga", "submit", "held for approval"),
        ("otto", "submit", "denied: conflict"),
        (
            "olga",
            "approve",
            "denied: a run needs a second identity's approval, not its requester's",
        ),
        ("vera", "approve", "denied: role viewer may only read"),
        ("otto", "approve", "allowed"),
        ("otto", "launch", "failed: launch_failed"),
    ]

    # a held run can also be cancelled before anyone approves it
    held = api.post(path, olga, json=body).json()["jobRunId"]
    cancelled = api.post(f"{path}/{held}/cancel", olga, json={"reason": "not needed"})
    assert cancelled.status_code == 202 and cancelled.json()["status"] == "cancelled"
    assert api.get(f"{path}/{held}", vera).json()["status"] == "cancelled"


def test_the_committed_openapi_document_is_the_served_one(api):
    committed = json.loads((REPO / "docs" / "openapi.json").read_text())
    printed = run_cli(["api", "openapi"], api.admin_env)
    assert printed.code == 0
    assert json.loads(printed.stdout) == committed
    served = api.get("/openapi.json").json()
    assert served == committed
    paths = set(committed["paths"])
    assert {
        "/internal/jobs/{jobName}/runs",
        "/internal/jobs/{jobName}/runs/{runId}",
        "/internal/jobs/{jobName}/runs/{runId}/cancel",
        "/internal/jobs/{jobName}/status",
    } <= paths
    assert Path(REPO / "docs" / "openapi.json").stat().st_size > 1000
