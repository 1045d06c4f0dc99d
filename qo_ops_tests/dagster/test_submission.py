"""What a Dagster run is before it runs (trigger, mode, who) and the run coordinator that
refuses, before queueing, a run the platform would refuse: a person's execute without a
reason, a destructive job's execute without an approval, options out of range. The refused
run ends CANCELED (refused, not failed) with one line, never queued, audited ``denied`` by
the coordinator; when the database cannot take the audit row, it ends FAILURE for
``run_failure_recorder`` to audit. (The same on a real webserver and daemon:
test_person_runs.py.)"""

from __future__ import annotations

import dagster as dg
import pytest
import sqlalchemy as sa

from qo_ops.dagster_defs.submission import (
    DESTRUCTIVE_TAG,
    REFUSED_TAG,
    QoOpsRunCoordinator,
    refusal_at_submission,
    refusal_in_database,
    requester_from_tags,
    run_options,
    trigger_from_tags,
)
from qo_ops.errors import BadInput
from qo_ops.jobs.catalog import CATALOG
from qo_ops.platform.schedule.partition_keys import MODE_TAG, REASON_TAG, SCOPE_TAG
from qo_ops_tests.dagster.test_sensors import _database

PARENT = {"dagster/parent_run_id": "p1", "dagster/root_run_id": "p1"}
SCHEDULED = {"dagster/schedule_name": "quote_expiration_schedule", MODE_TAG: "execute"}


@pytest.mark.parametrize(
    ("tags", "trigger"),
    [
        ({}, "manual"),  # the Launchpad
        ({"dagster/backfill": "b1"}, "backfill"),
        ({"dagster/backfill": "b1", "dagster/retry_number": "1", **PARENT}, "backfill"),
        (SCHEDULED, "schedule"),
        ({"dagster/sensor_name": "quote_expiration_backlog_sensor"}, "sensor"),
        ({"qo_ops/job_run_id": "00000000-0000-0000-0000-000000000001"}, "api"),
        # Dagster's automatic retry (run_retries) copies the parent's tags and numbers itself
        ({**SCHEDULED, **PARENT, "dagster/retry_number": "1"}, "schedule"),
        ({**PARENT, "dagster/retry_number": "1"}, "retry"),
        # a person's re-execution copies the parent's tags too, but carries no retry number
        ({**SCHEDULED, **PARENT}, "manual"),
        ({"dagster/sensor_name": "s", **PARENT}, "manual"),
        ({**PARENT}, "manual"),
    ],
)
def test_the_trigger_tells_automatic_retries_from_a_persons_re_execution(tags, trigger):
    assert trigger_from_tags(tags) == trigger


def test_who_asked_is_the_dagster_user_else_the_backfill_else_the_run():
    assert requester_from_tags({"dagster/user": "ana@ops"}, "manual", "r1") == "ana@ops"
    assert requester_from_tags({"dagster/backfill": "b1"}, "backfill", "r1") == "backfill:b1"
    assert requester_from_tags(PARENT, "manual", "r1") == "dagster-run:r1"
    assert requester_from_tags(SCHEDULED, "schedule", "r1") == "dagster:schedule"
    retried = {**PARENT, "dagster/retry_number": "1"}
    assert requester_from_tags(retried, "retry", "r2") == "dagster-run:p1"  # the first run


def test_a_re_execution_of_a_scheduled_execute_needs_a_reason_and_may_carry_its_parents():
    options = run_options({}, {**SCHEDULED, **PARENT}, "r2")
    assert (options.trigger, options.mode, options.reason) == ("manual", "execute", None)
    carried = run_options({}, {**SCHEDULED, **PARENT, REASON_TAG: "INC-8"}, "r2")
    assert (carried.trigger, carried.reason) == ("manual", "INC-8")
    assert run_options({}, {**SCHEDULED, **PARENT, "dagster/retry_number": "1"}, "r2").mode == (
        "execute"
    )  # Dagster's retry of a scheduled run is the schedule's


def test_a_retry_of_a_persons_run_is_that_persons_dry_run_unless_its_parent_executed():
    retried = {**PARENT, "dagster/retry_number": "1"}
    crashed_early = run_options({}, retried, "r3")  # the parent died before its op started
    assert (crashed_early.trigger, crashed_early.mode) == ("retry", "dry_run")
    executed = run_options({}, {**retried, MODE_TAG: "execute"}, "r3")
    assert executed.mode == "execute" and executed.person_behind
    with pytest.raises(BadInput, match="needs a reason"):
        executed.validated()
    kept = run_options({"mode": "execute", "reason": "INC-2"}, retried, "r3")  # config copied
    assert kept.validated().reason == "INC-2"


def test_the_launchpad_shows_the_mode_a_partition_will_run_in_and_a_backfill_tag_decides():
    """Picking a partition in the Launchpad loads the partition's config: ``mode: dry_run``
    and, empty, what an execute needs (issue 41: the mode was invisible before launch, and
    "Scaffold missing config" adds only required fields). A run a person launches with it
    dry-runs; one whose config says execute executes. A run of Dagster's own backfill gets the
    same partition config (no run config, dagster#10079): its ``qo_ops/mode`` tag decides."""
    from qo_ops.definitions import build_definitions
    from qo_ops.jobs.catalog import CATALOG

    defs = build_definitions()
    for spec in CATALOG.values():
        job = defs.resolve_job_def(spec.name)
        key = "2026-12-01|chunk-001" if spec.partitioning == "tenant_day" else "tenant-001"
        shown = job.partitioned_config.get_run_config_for_partition_key(key)  # type: ignore[union-attr]
        config = shown["ops"][f"{spec.name}_op"]["config"]
        assert config["mode"] == "dry_run" and config["reason"] is None, spec.name
        assert ("approval" in config) is spec.destructive, spec.name
        assert ("tenants" in config) is (spec.partitioning == "tenant_day"), spec.name
        dg.validate_run_config(job, shown)  # the Launchpad launches it as shown
    as_shown = {"mode": "dry_run", "reason": None}
    assert run_options(as_shown, {}, "r1").mode == "dry_run"  # the Launchpad, unchanged
    assert run_options({**as_shown, "mode": "execute"}, {}, "r1").mode == "execute"
    backfill = {"dagster/backfill": "b1"}
    assert run_options(as_shown, {**backfill, MODE_TAG: "execute"}, "r1").mode == "execute"
    assert run_options(as_shown, backfill, "r1").mode == "dry_run"  # untagged: a dry run
    # a retry of a person's run copies the config the person launched, not a tag: config wins
    retried = {**PARENT, "dagster/retry_number": "1", MODE_TAG: "execute"}
    assert run_options(as_shown, retried, "r3").mode == "dry_run"


def _coordinated_instance():
    return dg.instance_for_test(
        overrides={
            "run_coordinator": {
                "module": "qo_ops.dagster_defs.submission",
                "class": "QoOpsRunCoordinator",
                "config": {"max_concurrent_runs": 1},
            }
        }
    )


def _create(instance, defs, job_name: str, config: dict, tags: dict) -> dg.DagsterRun:
    job = defs.resolve_job_def(job_name)
    return instance.create_run_for_job(
        job,
        run_config={"ops": {f"{job_name}_op": {"config": config}}},
        tags={**job.run_tags, **tags},
    )


def _submit(instance, defs, job_name: str, config: dict, tags: dict) -> dg.DagsterRun:
    """Through the instance's coordinator. A run queued in earnest needs a code location, so
    runs that pass are checked with ``refusal_at_submission`` here and queued in
    test_person_runs.py."""
    run = _create(instance, defs, job_name, config, tags)
    assert isinstance(instance.run_coordinator, QoOpsRunCoordinator)
    return instance.run_coordinator.submit_run(dg.SubmitRunContext(run, workspace=None))


def test_the_coordinator_refuses_before_queueing_and_the_refusal_is_audited(defs, loaded):
    with _coordinated_instance() as instance:
        scope = {SCOPE_TAG: "quote_expiration:tenant-001", "dagster/partition": "tenant-001"}
        no_reason = _submit(instance, defs, "quote_expiration", {"mode": "execute"}, scope)
        absurd = _submit(instance, defs, "quote_expiration", {"batch_size": 0}, scope)
        destructive = _submit(  # Dagster's backfill: the day × chunk's own scope tag, no tenants
            instance,
            defs,
            "read_model_repair",
            {},
            {
                "dagster/backfill": "b9",
                MODE_TAG: "execute",
                REASON_TAG: "INC-9",
                SCOPE_TAG: "read_model_repair:2026-02-10|chunk-001",
                "dagster/partition": "2026-02-10|chunk-001",
            },
        )
        fine = _create(
            instance, defs, "quote_expiration", {"mode": "execute", "reason": "x"}, scope
        )
        day = {"dagster/partition": "2026-02-10|chunk-001"}  # a windowed run: day × chunk
        named = {"tenants": ["tenant-001"]}
        dry_backfill = _create(
            instance, defs, "read_model_repair", named, {"dagster/backfill": "b9", **day}
        )
        scheduled = _create(instance, defs, "temp_file_cleanup", named, {**SCHEDULED, **day})

        for run, code in (
            (no_reason, "reason_required"),
            (absurd, "bad_input"),
            (destructive, "approval_required"),
        ):
            assert run.status == dg.DagsterRunStatus.CANCELED, run.run_id  # refused, not failed
            assert run.tags[REFUSED_TAG] == code
            (ended,) = instance.all_logs(run.run_id, of_type=dg.DagsterEventType.RUN_CANCELED)
            message = ended.dagster_event.message
            assert message.startswith("refused before queueing: ") and "\n" not in message
            assert not instance.all_logs(run.run_id, of_type=dg.DagsterEventType.RUN_ENQUEUED)
            assert not instance.all_logs(run.run_id, of_type=dg.DagsterEventType.RUN_FAILURE)
        assert refusal_at_submission(fine) is None
        assert refusal_at_submission(dry_backfill) is None  # a dry run needs nothing
        assert refusal_at_submission(scheduled) is None  # a schedule is not a person
        assert destructive.tags[DESTRUCTIVE_TAG] == "true"  # from the job's own tags
    with loaded.engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT actor, action, decision, job_name, scope, mode, reason, correlation_id, "
                "details FROM job_audit ORDER BY id"
            )
        ).all()
        runs = conn.scalar(sa.text("SELECT count(*) FROM job_run"))
    assert runs == 0  # nothing ran
    assert [(r.actor, r.action, r.decision, r.job_name, r.scope, r.mode, r.reason) for r in rows] == [
        (f"dagster-run:{no_reason.run_id}", "trigger", "denied", "quote_expiration",
         "tenant-001", "execute", None),
        (f"dagster-run:{absurd.run_id}", "trigger", "denied", "quote_expiration",
         "tenant-001", "dry_run", None),
        ("backfill:b9", "trigger", "denied", "read_model_repair", "2026-02-10|chunk-001", "execute",
         "INC-9"),
    ]  # fmt: skip
    assert rows[0].details["refused"] == "reason_required"
    assert "needs a reason" in rows[0].details["cause"]
    assert rows[2].details["refused"] == "approval_required"
    assert "needs an approval" in rows[2].details["cause"]
    assert [r.correlation_id for r in rows] == [no_reason.run_id, absurd.run_id, destructive.run_id]


def test_a_refusal_the_database_cannot_audit_ends_failure_for_the_sensor_to_audit(
    defs, loaded, monkeypatch
):
    """The database out at submission: the refusal still holds (no run), ends FAILURE, and
    run_failure_recorder audits it once the database is back."""
    with _coordinated_instance() as instance:
        scope = {SCOPE_TAG: "quote_expiration:tenant-001", "dagster/partition": "tenant-001"}
        monkeypatch.setenv("QO_OPS_DATABASE_URL", "postgresql://nobody@127.0.0.1:9/none")
        refused = _submit(instance, defs, "quote_expiration", {"mode": "execute"}, scope)
        monkeypatch.setenv("QO_OPS_DATABASE_URL", loaded.env_url)
        assert refused.status == dg.DagsterRunStatus.FAILURE
        assert refused.tags[REFUSED_TAG] == "reason_required"
        with loaded.engine.connect() as conn:
            assert conn.scalar(sa.text("SELECT count(*) FROM job_audit")) == 0
        event = instance.all_logs(refused.run_id, of_type=dg.DagsterEventType.RUN_FAILURE)[0]
        defs.resolve_sensor_def("run_failure_recorder")(
            dg.build_run_status_sensor_context(
                sensor_name="run_failure_recorder",
                dagster_event=event.dagster_event,
                dagster_instance=instance,
                dagster_run=instance.get_run_by_id(refused.run_id),
                resources={"database": _database(loaded)},
            ).for_run_failure()
        )
    with loaded.engine.connect() as conn:
        row = conn.execute(sa.text("SELECT actor, decision, details FROM job_audit")).one()
    assert (row.actor, row.decision) == (f"dagster-run:{refused.run_id}", "denied")
    assert row.details["refused"] == "reason_required" and row.details["at"] == "submission"


def test_every_destructive_job_and_only_those_tag_their_runs(defs):
    for name, spec in CATALOG.items():
        tags = defs.resolve_job_def(name).run_tags
        assert (tags.get(DESTRUCTIVE_TAG) == "true") is spec.destructive, name


def test_a_destructive_chunk_backfill_needs_an_approval_covering_each_tenant_of_the_chunk(
    defs, loaded
):
    """Dagster's backfill of a destructive windowed job over day × chunk names no tenant:
    its approval is checked before queueing against each tenant of the chunk (those of the
    tag qo_ops/backfill_tenants, when set), as the op would run them."""
    from qo_ops.platform.actions import approvals

    spec = CATALOG["read_model_repair"]
    one = approvals.grant(
        loaded.engine, spec, approvals.Grant(spec.name, ["tenant-001"], "INC-41 chunk", "ana")
    )
    backfill = {
        "dagster/backfill": "b41",
        MODE_TAG: "execute",
        REASON_TAG: "INC-41 chunk",
        "qo_ops/approval": one.id,
        "dagster/partition": "2026-02-10|chunk-001",  # tenant-001 and tenant-002
    }
    with _coordinated_instance() as instance:
        whole = _create(instance, defs, spec.name, {}, backfill)
        refusal = refusal_in_database(whole, loaded.engine)
        assert refusal is not None and "tenant-002" in refusal[1] and "\n" not in refusal[1]
        narrowed = {**backfill, "qo_ops/backfill_tenants": "tenant-001"}
        assert (
            refusal_in_database(_create(instance, defs, spec.name, {}, narrowed), loaded.engine)
            is None
        )
