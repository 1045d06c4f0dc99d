"""The kill switch through the operator API: only approvers suspend and resume (a
tenant-limited token cannot suspend a job for every tenant), a suspended scope's runs are
refused with 423, the status shows the suspension, and every decision is audited."""

from __future__ import annotations

import sqlalchemy as sa

JOB = "quote_expiration"


def test_api_suspend_and_resume_need_an_approver_and_refuse_runs_while_suspended(
    loaded, api_factory
):
    api = api_factory()
    approver, operator = api.token("ann", "approver"), api.token("otto", "operator")
    scoped = api.token("sam", "approver", tenant="tenant-002")
    path = f"/internal/jobs/{JOB}"

    denied = api.post(f"{path}/suspend", operator, json={"reason": "no"})
    assert denied.status_code == 403 and "approver" in denied.json()["error"]
    assert api.post(f"{path}/suspend", scoped, json={"reason": "all?"}).status_code == 403
    ok = api.post(f"{path}/suspend", approver, json={"tenant": "tenant-001", "reason": "INC-5"})
    assert ok.status_code == 200, ok.text
    assert ok.json()["suspended"]["suspended_by"] == "ann" and ok.json()["new"] is True

    body = {"mode": "dry_run", "tenant": "tenant-001"}
    refused = api.post(f"{path}/runs", operator, json=body)
    assert refused.status_code == 423 and "INC-5" in refused.json()["error"]
    status = api.get(f"{path}/status", operator).json()
    assert [s["tenant_id"] for s in status["suspended"]] == ["tenant-001"]

    back = api.post(f"{path}/resume", approver, json={"tenant": "tenant-001", "reason": "fixed"})
    assert back.status_code == 200 and back.json()["resumed"]["reason"] == "INC-5"
    after = api.post(f"{path}/runs", operator, json=body)
    assert after.status_code != 423  # accepted now (Dagster is not running here: 503)
    with loaded.engine.connect() as conn:
        actions = conn.execute(
            sa.text(
                "SELECT action, decision FROM job_audit WHERE action IN "
                "('suspend', 'resume', 'submit') ORDER BY id"
            )
        ).all()
    assert ("suspend", "denied: suspend and resume need the approver role") in actions
    assert ("suspend", "allowed") in actions and ("resume", "allowed") in actions
    assert ("submit", "denied: suspended") in actions
