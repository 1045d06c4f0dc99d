"""Who and what a Dagster run is, from its tags and run config, before it runs: its trigger,
mode, requester and run options — and the run coordinator that refuses, before the run is
queued, a run the platform would refuse at start (``dagster.yaml``: ``QoOpsRunCoordinator``).

The webserver and the daemon load this module with the instance: it uses the platform's
rules themselves (``RunOptions.validated`` and the consent rule's steps,
``qo_ops/platform/run/consent.py``), so a refusal here is the runner's refusal, one line, before the
run is queued.
"""

import logging
from collections.abc import Mapping
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import dagster as dg
from sqlalchemy.engine import Engine

from qo_ops.dagster_defs.resources import QoOpsDatabase
from qo_ops.db.audit import AuditEntry, append_audit
from qo_ops.errors import BadInput, error_class, one_line
from qo_ops.jobs.catalog import CATALOG
from qo_ops.platform.job.options import RunOptions, Trigger, check_consent
from qo_ops.platform.job.scope import Scope
from qo_ops.platform.run.consent import check_approval, check_reason_is_new
from qo_ops.platform.schedule.partition_keys import (
    JOB_RUN_TAG,
    MODE_TAG,
    REASON_TAG,
    REQUESTER_TAG,
    SCOPE_TAG,
    split_windowed_key,
)
from qo_ops.platform.schedule.tenants import chunk_members

PARTITION_TAG = "dagster/partition"
RANGE_START_TAG = "dagster/asset_partition_range_start"
USER_TAG = "dagster/user"  # the signed-in person (Dagster+; absent in the OSS webserver)
BACKFILL_TAG = "dagster/backfill"
PARENT_RUN_TAG = "dagster/parent_run_id"  # a re-execution (by a person, or an automatic retry)
RETRY_NUMBER_TAG = "dagster/retry_number"  # only on Dagster's automatic run retries
ROOT_RUN_TAG = "dagster/root_run_id"
MAX_RETRIES_TAG = "dagster/max_retries"  # 0: the run-retry daemon leaves a failed run alone
DESTRUCTIVE_TAG = "qo_ops/destructive"  # on every run of a JobSpec.destructive job
WINDOWED_TAG = "qo_ops/windowed"  # on every run of a windowed job: its runs name their tenants
REFUSED_TAG = "qo_ops/refused"  # set by QoOpsRunCoordinator on a run it refused: why (a code)
REFUSED_PREFIX = "refused before queueing: "  # its failure message (re-executions copy tags)
SCHEDULED_FOR_TAG = "qo_ops/scheduled_for"  # set by the schedules: the tick's time
BACKFILL_RUN_TAG = "qo_ops/backfill"  # a run of a tenant backfill: the launcher's run id
BACKFILL_TENANTS_TAG = "qo_ops/backfill_tenants"  # a windowed job's day backfill: its tenants
APPROVAL_TAG = "qo_ops/approval"  # the approval a destructive backfill (or re-execution) cites

log = logging.getLogger(__name__)


def trigger_from_tags(tags: Mapping[str, str]) -> Trigger:
    """How this Dagster run came about, from the tags Dagster puts on it.

    A re-execution copies its parent's tags (schedule and sensor names included): one
    without ``dagster/retry_number`` was started by a person (``manual``). Dagster's own run
    retries (``run_retries`` in dagster.yaml) carry that tag and keep their parent's
    trigger, so ``retry`` is left for the retry of a run a person launched by hand."""
    if JOB_RUN_TAG in tags:
        return "api"
    if BACKFILL_TAG in tags or BACKFILL_RUN_TAG in tags:
        return "backfill"
    retry_number = int(tags.get(RETRY_NUMBER_TAG, "0") or 0)
    if PARENT_RUN_TAG in tags and retry_number == 0:
        return "manual"
    if "dagster/schedule_name" in tags:
        return "schedule"
    if "dagster/sensor_name" in tags:
        return "sensor"
    if retry_number > 0:
        return "retry"
    return "manual"


def resolve_mode(config_mode: str | None, tags: Mapping[str, str], trigger: Trigger) -> str:
    """A backfill's mode tag first: Dagster gives a backfill's runs no run config but the
    partition's own, whose ``mode: dry_run`` is the Launchpad's default (``launchpad_config``),
    not a person's choice (dagster#10079). Otherwise config wins, then the mode tag (a retry
    has its parent's), then: schedules and sensors execute, what a person started dry-runs."""
    if trigger == "backfill" and tags.get(MODE_TAG) in ("dry_run", "execute"):
        return tags[MODE_TAG]
    if config_mode is not None:
        return config_mode
    if tags.get(MODE_TAG) in ("dry_run", "execute"):
        return tags[MODE_TAG]
    return "execute" if trigger in ("schedule", "sensor") else "dry_run"


def requester_from_tags(tags: Mapping[str, str], trigger: Trigger, run_id: str) -> str:
    """Who asked: the Dagster user where Dagster knows one, else the backfill or the run a
    person launched (a retry: its first run); ``dagster:<trigger>`` for schedules and
    sensors."""
    if tags.get(USER_TAG):
        return tags[USER_TAG]
    if BACKFILL_RUN_TAG in tags:  # who launched the backfill, as its launcher saw it
        return tags.get(REQUESTER_TAG) or f"dagster-run:{tags[BACKFILL_RUN_TAG]}"
    if trigger == "backfill":
        return f"backfill:{tags[BACKFILL_TAG]}"
    if trigger == "manual":
        return f"dagster-run:{run_id}"
    if trigger == "retry":
        return f"dagster-run:{tags.get(ROOT_RUN_TAG, run_id)}"
    return f"dagster:{trigger}"


def _scheduled_for(tags: Mapping[str, str]) -> datetime | None:
    """The tick a scheduled run belongs to (UTC), from its tag; None when absent or bad."""
    try:
        when = datetime.fromisoformat(tags[SCHEDULED_FOR_TAG])
    except (KeyError, ValueError):
        return None
    return when if when.tzinfo is not None else None


def run_options(config: Mapping[str, Any], tags: Mapping[str, str], run_id: str) -> RunOptions:
    """Run options of a run that was not accepted by the API, from its op config (the
    ``JobRunConfig`` fields) and its tags. Not validated: ``run_job`` does that."""
    trigger = trigger_from_tags(tags)
    mode = config.get("mode")
    return RunOptions(
        mode=resolve_mode(getattr(mode, "value", mode), tags, trigger),  # type: ignore[arg-type]
        trigger=trigger,
        batch_size=config.get("batch_size"),
        max_items=config.get("max_items"),
        throttle_ms=config.get("throttle_ms"),
        deadline_s=config.get("deadline_s"),
        requester=requester_from_tags(tags, trigger, run_id),
        reason=config.get("reason") or tags.get(REASON_TAG),
        approval=config.get("approval") or tags.get(APPROVAL_TAG),
        correlation_id=run_id,
        dagster_run_id=run_id,
        dagster_parent_run_id=tags.get(PARENT_RUN_TAG),
        progress_interval_s=10.0,
        scheduled_for=_scheduled_for(tags) if trigger == "schedule" else None,
    )


def with_run_facts(options: RunOptions, instance: dg.DagsterInstance, run_id: str) -> RunOptions:
    """``options`` with what only the instance knows of its run: when the Dagster run was
    created (queued), which automatic retry it is and how many the instance allows (a
    ``dagster/max_retries`` tag overrides dagster.yaml). Facts for the seed's start-delay
    and retry signals; a run the instance cannot describe keeps the defaults."""
    record = instance.get_run_record_by_id(run_id)
    if record is None:
        return options
    tags = record.dagster_run.tags
    created = record.create_timestamp
    retries_max = (
        _whole(tags.get(MAX_RETRIES_TAG))
        if MAX_RETRIES_TAG in tags
        else (instance.run_retries_max_retries if instance.run_retries_enabled else 0)
    )
    return replace(
        options,
        requested_at=created if created.tzinfo is not None else created.replace(tzinfo=UTC),
        retry_number=_whole(tags.get(RETRY_NUMBER_TAG)) or 0,
        retries_max=retries_max,
    )


def _whole(value: str | None) -> int | None:
    """A tag's whole number at least 0, or None."""
    try:
        number = int(value or "")
    except ValueError:
        return None
    return number if number >= 0 else None


def op_config(run: dg.DagsterRun) -> Mapping[str, Any]:
    """The catalog op's config in a run's run config (``{}`` when none was given)."""
    run_config: Mapping[str, Any] = run.run_config or {}
    ops: Mapping[str, Any] = run_config.get("ops") or {}
    return (ops.get(f"{run.job_name}_op") or {}).get("config") or {}


def refusal_at_submission(run: dg.DagsterRun) -> tuple[str, str] | None:
    """``(code, one-line cause)`` when the platform would refuse this run at start (options
    out of range, a person's execute without a reason, a destructive backfill execute);
    None to let it queue. API runs were validated when the API accepted them."""
    tags = run.tags
    if "qo_ops/job" not in tags or JOB_RUN_TAG in tags:
        return None
    config = op_config(run)
    options = run_options(config, tags, run.run_id)
    try:
        options.validated()
        # consent first: a destructive execute is told of the approval flow, not sent to
        # tenant_backfill_job, which would refuse it too
        check_consent(
            options, destructive=tags.get(DESTRUCTIVE_TAG) == "true", job_name=run.job_name
        )
        if (
            tags.get(WINDOWED_TAG) == "true"
            and not config.get("tenants")
            and not _names_a_chunk(tags)  # a day × chunk partition: the chunk's tenants
            and options.trigger != "backfill"  # a backfill of the old day-only keys: all
        ):
            raise BadInput(
                f"{run.job_name} is windowed: pick a day and tenant chunk partition (its "
                "tenants), or name its tenants in run config (tenants)"
            )
    except BadInput as refused:
        return error_class(refused, "bad_input"), str(refused)
    return None


def _names_a_chunk(tags: Mapping[str, str]) -> bool:
    """Whether a windowed run's partition (or range) names a tenant chunk."""
    keys = [tags.get(PARTITION_TAG), tags.get(RANGE_START_TAG)]
    return any(k and split_windowed_key_or_none(k) for k in keys)


def split_windowed_key_or_none(key: str) -> str | None:
    """The tenant chunk a windowed partition key names, or None (a day-only key, or none)."""
    try:
        return split_windowed_key(key)[1]
    except BadInput:
        return None


def refusal_in_database(run: dg.DagsterRun, engine: Engine) -> tuple[str, str] | None:
    """``(code, one-line cause)`` for what only the database can tell before queueing: the
    approval a destructive execute cites does not allow it (each of its tenants), or a
    Launchpad execute repeats the reason an earlier execute gave for its tenant. A windowed
    run of a day × chunk naming no tenants is checked for each of its chunk's (those of
    the tag ``qo_ops/backfill_tenants`` in a backfill). The runner checks both again at
    start; windowed runs' reasons are checked there only."""
    tags = run.tags
    spec = CATALOG.get(run.job_name)
    if spec is None or "qo_ops/job" not in tags or JOB_RUN_TAG in tags:
        return None
    config = op_config(run)
    options = run_options(config, tags, run.run_id)
    tenants = list(config.get("tenants") or ())
    if not tenants and spec.partitioning == "tenant" and tags.get(PARTITION_TAG):
        tenants = [tags[PARTITION_TAG]]
    named = [t.strip() for t in tags.get(BACKFILL_TENANTS_TAG, "").split(",") if t.strip()]
    chunk = split_windowed_key_or_none(tags.get(PARTITION_TAG, ""))
    if not tenants and spec.partitioning == "tenant_day" and chunk is not None:
        with engine.connect() as conn:  # a day × chunk run without tenants: the chunk's
            tenants = chunk_members(conn, chunk)
        if named and options.trigger == "backfill":  # as the op narrows it
            tenants = [t for t in tenants if t in named]
    if not tenants and named:  # a windowed job's backfill of an old day-only key
        tenants = named
    try:
        for tenant in tenants:
            check_approval(engine, spec, Scope(tenant), options)
            if spec.partitioning == "tenant":
                check_reason_is_new(engine, spec.name, Scope(tenant).key, options)
    except BadInput as refused:
        return error_class(refused, "bad_input"), str(refused)
    return None


def refusal_audit(run: dg.DagsterRun, code: str, cause: str) -> AuditEntry:
    """The audit row of a run refused before queueing, as the runner records a refusal:
    ``trigger``, ``denied``, who, mode, reason, why."""
    options = run_options(op_config(run), run.tags, run.run_id)
    details: dict[str, Any] = {
        "refused": code,
        "cause": cause,
        "trigger": options.trigger,
        "dagster_run_id": run.run_id,
        "at": "submission",
    }
    if options.approval:
        details["approval"] = options.approval
    return AuditEntry(
        actor=options.requester or "unknown",
        action="trigger",
        decision="denied",
        job_name=run.job_name,
        scope=run.tags.get(SCOPE_TAG, "").partition(":")[2] or None,
        mode=options.mode,
        reason=options.reason,
        correlation_id=run.run_id,
        details=details,
    )


class QoOpsRunCoordinator(dg.QueuedRunCoordinator):
    """Dagster's queue (same config), refusing at submission a run the platform would refuse
    at start. A refused run is never queued or launched: it ends CANCELED — refused, not
    failed: no failure alert, no run retry — with one line (its message, and the tag
    ``qo_ops/refused`` naming the rule), audited ``denied`` here. Every submission passes
    here — the Launchpad, backfills, re-executions, schedules, sensors, retries.

    When the database cannot be reached, the checks that need it are left to the runner,
    and a refusal that cannot be audited here ends FAILURE as before, for
    ``run_failure_recorder`` to audit when the database is back."""

    def submit_run(self, context: dg.SubmitRunContext) -> dg.DagsterRun:
        run = context.dagster_run
        if run.status != dg.DagsterRunStatus.NOT_STARTED:
            return super().submit_run(context)
        engine: Engine | None = None
        try:
            refusal = refusal_at_submission(run)
            if refusal is None and _needs_database(run):
                engine = QoOpsDatabase().engine()
                refusal = refusal_in_database(run, engine)
        except Exception:  # a check that cannot decide lets the run queue: the runner decides
            log.exception("run %s: submission check failed; the runner checks at start", run.run_id)
            refusal = None
        if refusal is None:
            return super().submit_run(context)
        code, cause = refusal
        # never retried: an automatic retry would copy its config and tags and be refused again
        self._instance.add_run_tags(run.run_id, {REFUSED_TAG: code, MAX_RETRIES_TAG: "0"})
        try:
            engine = engine or QoOpsDatabase().engine()
            with engine.begin() as conn:
                append_audit(conn, refusal_audit(run, code, one_line(cause, 300)))
        except Exception:  # the failure sensor audits it later (REFUSED_PREFIX)
            log.exception("run %s: refusal not audited; ending it FAILURE", run.run_id)
            self._instance.report_run_failed(run, message=REFUSED_PREFIX + cause)
        else:
            self._instance.report_run_canceled(run, message=REFUSED_PREFIX + cause)
        log.warning("run %s of %s refused before queueing: %s", run.run_id, run.job_name, code)
        refused = self._instance.get_run_by_id(run.run_id)
        assert refused is not None
        return refused


def _needs_database(run: dg.DagsterRun) -> bool:
    """Whether ``refusal_in_database`` has anything to check: a person's execute."""
    tags = run.tags
    if "qo_ops/job" not in tags or JOB_RUN_TAG in tags:
        return False
    options = run_options(op_config(run), tags, run.run_id)
    return options.mode == "execute" and options.person_behind
