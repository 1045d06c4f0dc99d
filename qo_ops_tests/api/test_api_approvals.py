"""One consent rule on every path — here the operator API, with the cases every path shares
(qo_ops_tests/approval_cases.py): a destructive execute citing no approval, another tenant's,
another job's, a revoked or an expired one is refused with a 403 and one line before anything
is accepted; a valid one is accepted and its run cites it. An approver grants approvals
(POST /internal/jobs/{job}/approvals); an operator or a viewer cannot. Against a real
``qo-ops api`` process and a real database."""

from __future__ import annotations

import sqlalchemy as sa

from qo_ops.db.schema import job_run
from qo_ops.demo.data import load_demo_data
from qo_ops_tests.approval_cases import CASES, JOB, REASON, TENANT, plant, run_rows
from qo_ops_tests.dagster.conftest import AS_OF

# ------------------------------------------------------------------------------- the API


def test_the_api_gives_the_rule_s_answer_for_every_case(db, api):
    load_demo_data(db.engine, tenants=2, quotes=100, seed=5, as_of=AS_OF)
    loaded = db
    cited = plant(loaded.engine)
    olga = api.token("olga", "operator")
    path = f"/internal/jobs/{JOB}/runs"
    for case, refusal in CASES.items():
        body = {"mode": "execute", "tenant": TENANT, "reason": REASON}
        if cited[case]:
            body["approvalId"] = cited[case]
        answer = api.post(path, olga, json=body)
        if refusal is None:
            # accepted; Dagster is not there in this test, so its launch answers 503
            assert answer.status_code in (202, 503), (case, answer.text)
            continue
        assert answer.status_code == 403, (case, answer.text)
        assert refusal in answer.json()["error"] and "\n" not in answer.json()["error"], case
        assert run_rows(loaded.engine) == [], case
    ((trigger, approval_id, _status),) = run_rows(loaded.engine)
    assert (trigger, approval_id) == ("api", cited["valid"])

    # an approver's own execute grants the approval its run cites; a viewer grants nothing
    ana = api.token("ana", "approver")
    vera = api.token("vera", "viewer")
    grant_path = f"/internal/jobs/{JOB}/approvals"
    refused = api.post(grant_path, olga, json={"tenants": [TENANT], "reason": REASON})
    assert refused.status_code == 403 and "approver role" in refused.json()["error"]
    assert api.post(grant_path, vera, json={"reason": REASON}).status_code == 403
    made = api.post(grant_path, ana, json={"tenants": ["tenant-002"], "reason": REASON})
    assert made.status_code == 201, made.text
    assert made.json()["tenants"] == ["tenant-002"] and made.json()["grantedBy"] == "ana"
    bad = api.post(grant_path, ana, json={"tenants": ["tenant-999"], "reason": REASON})
    assert bad.status_code == 422 and "unknown tenant tenant-999" in bad.json()["error"]
    other = {"mode": "execute", "tenant": "tenant-002", "reason": REASON}
    assert api.post(
        path, olga, json={**other, "approvalId": made.json()["approvalId"]}
    ).status_code in (202, 503)
    with loaded.engine.connect() as conn:
        cites = conn.scalar(sa.select(job_run.c.approval_id).where(job_run.c.scope == "tenant-002"))
    assert cites == made.json()["approvalId"]

    # an approver's own execute, citing nothing: the API grants the approval its run cites
    own = api.post(path, ana, json=other)
    assert own.status_code in (202, 503), own.text
    with loaded.engine.connect() as conn:
        granted = conn.execute(
            sa.text(
                "SELECT a.granted_by, a.tenants, a.job_name FROM job_run r "
                "JOIN run_approval a ON a.id = r.approval_id WHERE r.requester = 'ana'"
            )
        ).one()  # the run ana's request created (a 503 answer names no run: Dagster is absent)
    assert tuple(granted) == ("ana", ["tenant-002"], JOB)
