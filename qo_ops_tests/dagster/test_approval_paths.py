"""One consent rule on every path — here the CLI, the Dagster Launchpad and backfills
(qo-ops's tenant_backfill_job and Dagster's own partition backfill); the operator API's in
qo_ops_tests/api/test_api_approvals.py — with the same cases (qo_ops_tests/approval_cases.py)
and the same answer: no approval, another tenant's, another job's, a revoked one and an
expired one are refused before anything is claimed, with one line, audited ``denied``; a
valid one runs and the run record cites it.

Real PostgreSQL, the real ``qo-ops`` CLI, real Dagster execution and the real run
coordinator."""

from __future__ import annotations

import dagster as dg
import pytest
import sqlalchemy as sa

from qo_ops.dagster_defs.submission import (
    REFUSED_TAG,
    QoOpsRunCoordinator,
    refusal_at_submission,
    refusal_in_database,
)
from qo_ops.errors import BadInput
from qo_ops.platform.actions import approvals
from qo_ops.platform.schedule.partition_keys import MODE_TAG, REASON_TAG, SCOPE_TAG
from qo_ops_tests.approval_cases import (
    CASES,
    JOB,
    REASON,
    TENANT,
    business_digest,
    denied_audits,
    plant,
    run_rows,
)
from qo_ops_tests.dagster.test_submission import _coordinated_instance

# ------------------------------------------------------------------------------------- CLI


def test_the_cli_gives_the_rule_s_answer_for_every_case(loaded, cli):
    cited = plant(loaded.engine)
    before = business_digest(loaded.engine)
    for case, refusal in CASES.items():
        args = ["run", JOB, "--tenant", TENANT, "--mode", "execute", "--reason", REASON]
        if cited[case]:
            args += ["--approval", cited[case]]
        result = cli(*args)
        if refusal is None:
            assert result.code == 0, (case, result.stderr)
            continue
        assert result.code == 2, (case, result.stdout, result.stderr)
        (line,) = result.stderr.strip().splitlines()
        assert refusal in line and "Traceback" not in line, (case, line)
        assert run_rows(loaded.engine) == [], case  # refused before anything was claimed
    assert business_digest(loaded.engine) == before  # run_history_retention touches no business row
    ((trigger, approval_id, status),) = run_rows(loaded.engine)
    assert (trigger, approval_id) == ("manual", cited["valid"])
    assert status in ("success", "no_work")  # it ran (the demo keeps no old run history)
    denied = denied_audits(loaded.engine)
    assert [r.details["refused"] for r in denied] == ["approval_required"] * 5
    assert [r.details.get("approval") for r in denied] == [cited[c] for c in CASES if c != "valid"]


def test_granting_refuses_what_cannot_be_right_and_writes_nothing(loaded, cli):
    for args, says in (
        (["quote_expiration", "--tenant", TENANT], "is not destructive"),
        ([JOB, "--tenant", "tenant-999"], "unknown tenant tenant-999"),
        ([JOB], "name the tenants it covers"),
        ([JOB, "--tenant", TENANT, "--all-tenants"], "name the tenants it covers"),
        ([JOB, "--tenant", TENANT, "--valid-for", "25h"], "valid for 60 s to 24 h"),
        ([JOB, "--tenant", TENANT, "--valid-for", "soon"], "must look like 90s, 30m, 2h or 1d"),
        (["no_such_job", "--tenant", TENANT], "unknown job"),
    ):
        result = cli("approval", "grant", *args, "--reason", REASON)
        assert result.code == 2, (args, result.stdout, result.stderr)
        assert says in result.stderr and len(result.stderr.strip().splitlines()) == 1, args
    with loaded.engine.connect() as conn:
        granted = "SELECT count(*) FROM run_approval WHERE granted_by <> 'qo_ops_tests'"
        assert conn.scalar(sa.text(granted)) == 0  # the suite's standing approvals aside
    granted = cli("approval", "grant", JOB, "--tenant", TENANT, "--reason", REASON, "--by", "ana")
    assert granted.code == 0, granted.stderr
    approval_id = granted.stdout.split()[1].rstrip(":")
    assert approval_id.startswith("apr-") and f"--approval {approval_id}" in granted.stdout
    listed = cli("approval", "list")
    assert approval_id in listed.stdout and REASON in listed.stdout
    assert cli("approval", "revoke", approval_id, "--by", "ana").code == 0
    assert approval_id not in cli("approval", "list").stdout  # no longer citable
    assert approval_id in cli("approval", "list", "--all").stdout
    with loaded.engine.connect() as conn:
        audited = conn.execute(
            sa.text("SELECT actor, decision FROM job_audit WHERE action = 'approve' ORDER BY id")
        ).all()
    assert [tuple(r) for r in audited] == [("ana", "granted"), ("ana", "revoked")]
    with pytest.raises(BadInput, match="no approval apr-nope"):
        approvals.revoke(loaded.engine, "apr-nope", "ana")


# ------------------------------------------- the Launchpad and backfills (the coordinator)


def _create(instance, defs, config: dict, tags: dict) -> dg.DagsterRun:
    job = defs.resolve_job_def(JOB)
    return instance.create_run_for_job(
        job,
        run_config={"ops": {f"{JOB}_op": {"config": config}}},
        tags={**job.run_tags, SCOPE_TAG: f"{JOB}:{TENANT}", "dagster/partition": TENANT, **tags},
    )


def _submit(instance, run: dg.DagsterRun) -> dg.DagsterRun:
    """Through the instance's coordinator. A run queued in earnest needs a code location:
    one that passes is checked with the coordinator's own checks (and runs in the next
    test), one refused never gets that far."""
    assert isinstance(instance.run_coordinator, QoOpsRunCoordinator)
    return instance.run_coordinator.submit_run(dg.SubmitRunContext(run, workspace=None))


def _launchpad(cited: str | None) -> tuple[dict, dict]:
    config = {"mode": "execute", "reason": REASON, **({"approval": cited} if cited else {})}
    return config, {}


def _partition_backfill(cited: str | None) -> tuple[dict, dict]:
    """Dagster's own Launch backfill: no run config, the mode, reason and approval as tags."""
    tags = {"dagster/backfill": "bf1", MODE_TAG: "execute", REASON_TAG: REASON}
    return {}, {**tags, **({"qo_ops/approval": cited} if cited else {})}


@pytest.mark.parametrize("path", [_launchpad, _partition_backfill])
def test_the_launchpad_and_a_partition_backfill_give_the_rule_s_answer_before_queueing(
    defs, loaded, path
):
    cited = plant(loaded.engine)
    with _coordinated_instance() as instance:
        for case, refusal in CASES.items():
            config, tags = path(cited[case])
            run = _create(instance, defs, config, tags)
            if refusal is None:
                assert refusal_at_submission(run) is None
                assert refusal_in_database(run, loaded.engine) is None
                continue
            run = _submit(instance, run)
            assert run.status == dg.DagsterRunStatus.CANCELED, case  # refused, not failed
            assert run.tags[REFUSED_TAG] == "approval_required"
            (ended,) = instance.all_logs(run.run_id, of_type=dg.DagsterEventType.RUN_CANCELED)
            message = ended.dagster_event.message
            assert message.startswith("refused before queueing: ") and refusal in message, case
            assert "\n" not in message
    assert run_rows(loaded.engine) == []  # nothing ran
    denied = denied_audits(loaded.engine)
    assert [r.details["refused"] for r in denied] == ["approval_required"] * 5
    assert {r.details["at"] for r in denied} == {"submission"}
    assert [r.details.get("approval") for r in denied] == [cited[c] for c in CASES if c != "valid"]


def test_a_launchpad_execute_citing_a_valid_approval_runs_and_its_record_cites_it(defs, loaded):
    cited = plant(loaded.engine)
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("tenants", [TENANT, "tenant-002"])
        for case in ("valid", "revoked"):  # the runner checks again at start (a race)
            config = {"mode": "execute", "reason": f"{REASON} ({case})", "approval": cited[case]}
            result = defs.resolve_job_def(JOB).execute_in_process(
                partition_key=TENANT,
                instance=instance,
                run_config={"ops": {f"{JOB}_op": {"config": config}}},
                raise_on_error=False,
            )
            assert result.success is (case == "valid"), case
    ((trigger, approval_id, status),) = run_rows(loaded.engine)
    assert (trigger, approval_id) == ("manual", cited["valid"])
    assert status in ("success", "no_work")  # it ran (the demo keeps no old run history)


def test_tenant_backfill_job_gives_the_rule_s_answer_for_every_case(defs, loaded):
    cited = plant(loaded.engine)
    with dg.instance_for_test() as instance:
        for case, refusal in CASES.items():
            config = {
                "job": JOB,
                "tenants": [TENANT],
                "mode": "execute",
                "reason": REASON,
                **({"approval": cited[case]} if cited[case] else {}),
            }
            result = defs.resolve_job_def("tenant_backfill_job").execute_in_process(
                instance=instance,
                run_config={"ops": {"plan_tenant_backfill": {"config": config}}},
                raise_on_error=False,
            )
            if refusal is None:
                assert result.success, case
                plan = result.output_for_node("plan_tenant_backfill")
                assert plan["approval"] == cited["valid"]
                continue
            assert not result.success, case
            (failure,) = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
            cause = failure.event_specific_data.user_failure_data.description
            assert refusal in cause and "\n" not in cause, case
    denied = denied_audits(loaded.engine)
    assert [(r.action, r.details["refused"]) for r in denied] == [
        ("backfill", "approval_required")
    ] * 5
    assert [r.details.get("approval") for r in denied] == [cited[c] for c in CASES if c != "valid"]
