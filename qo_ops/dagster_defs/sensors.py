"""Sensors, each tick bounded (a handful of index-backed queries, capped fan-out):

- ``tenants_sensor``: keeps the ``tenants`` dynamic partitions equal to the tenant table;
- ``<job>_backlog_sensor``: launches the job for a tenant whose backlog passed its threshold;
- ``stale_success_sensor``: marks each tenant partition whose job has not succeeded for 3× its
  cadence (``recent_success`` check, ``freshness.py``) and names them;
- ``checkpoint_age_sensor``: says which windowed job's checkpoint stopped advancing;
- ``outside_runs_sensor``: records each run started outside Dagster (``qo-ops run``) on its
  tenant's partition of the outcome asset, as a Dagster run's op does, and asks an
  ``outcome_checks_job`` run to judge the checks of the tenants it executed;
- ``run_failure_recorder``: records every failed Dagster run of a catalog job, with its cause.
"""

import base64
import hashlib
import itertools
import json
import time
import uuid
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC
from typing import Any

import dagster as dg
import sqlalchemy as sa

from qo_ops.dagster_defs.checks import outcome_asset_key
from qo_ops.dagster_defs.freshness import (
    RECENT_SUCCESS_CHECK,
    RECENT_SUCCESS_JOB,
    Freshness,
    Tenant,
    all_tenants,
    build_recent_success_job,
    last_success_ages,
    recent_tenants,
)
from qo_ops.dagster_defs.jobs import TENANT_TAG, outcome_event
from qo_ops.dagster_defs.partitions import tenant_chunks_partitions_def, tenants_partitions_def
from qo_ops.dagster_defs.pending import pending_work
from qo_ops.dagster_defs.resources import QoOpsDatabase
from qo_ops.dagster_defs.schedules import chunk_run_request
from qo_ops.dagster_defs.submission import REFUSED_PREFIX, REFUSED_TAG, refusal_audit
from qo_ops.db.audit import AuditEntry, append_audit
from qo_ops.errors import first_few, one_line
from qo_ops.platform.actions.control import suspensions
from qo_ops.platform.job.counts import Counts
from qo_ops.platform.job.outcome import BatchContext, RunSummary
from qo_ops.platform.job.scope import Scope, tenant_of
from qo_ops.platform.job.spec import JobSpec
from qo_ops.platform.job.statuses import RunStatus
from qo_ops.platform.run.records import finish_unstarted
from qo_ops.platform.schedule.freshness import STALE_FACTOR, job_due, stale_limit_s
from qo_ops.platform.schedule.overdue import backlog_scope, database_now, tenant_backlog
from qo_ops.platform.schedule.partition_keys import (
    JOB_RUN_TAG,
    SCOPE_TAG,
    chunk_keys,
    chunk_tenants,
)
from qo_ops.platform.schedule.run_queue import QueueSample, record_run_queue

MAX_TENANTS_PER_TICK = (
    1000  # a tick counts at most this many tenants (~0.75 ms each); the cursor rotates
)
BACKLOG_COOLDOWN_S = 300  # one backlog-triggered run per job and tenant per 5 minutes
MAX_STALE_EVENTS_PER_TICK = 2_000  # recent_success evaluations a run records; the rest wait
STALE_TAG = "qo_ops/stale"  # on a recent_success_job run: the tick's summary
RUN_KEY_TAG = "dagster/run_key"  # set by the daemon on every run a sensor requested
NAMED_STALE = 20  # stale job/tenant pairs named in the skip reason and the log
CHECKPOINT_MAX_AGE_S = 3600


@dg.sensor(
    name="tenants_sensor",
    minimum_interval_seconds=60,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Adds and removes `tenants` partitions to match the tenant table, and "
    "`tenant_chunks` (windowed jobs) to match its count",
)
def tenants_sensor(context: dg.SensorEvaluationContext, database: QoOpsDatabase) -> dg.SensorResult:
    with database.engine().connect() as conn:
        wanted = set(conn.execute(sa.text("SELECT id FROM tenant")).scalars())
    requests: list[dg.AddDynamicPartitionsRequest | dg.DeleteDynamicPartitionsRequest] = []
    in_sync = []
    for partitions_def, keys, what in (
        (tenants_partitions_def, wanted, "tenant partitions"),
        (tenant_chunks_partitions_def, set(chunk_keys(len(wanted))), "tenant chunks"),
    ):
        have = set(partitions_def.get_partition_keys(dynamic_partitions_store=context.instance))
        added, removed = sorted(keys - have), sorted(have - keys)
        if added:
            requests.append(partitions_def.build_add_request(added))
        if removed:
            requests.append(partitions_def.build_delete_request(removed))
        in_sync.append(f"{len(have)} {what}")
    return dg.SensorResult(
        dynamic_partitions_requests=requests,
        skip_reason=None if requests else f"{' and '.join(in_sync)}, all in sync",
        cursor=json.dumps({"tenants": len(wanted)}),
    )


def build_backlog_sensor(spec: JobSpec, job: dg.JobDefinition) -> dg.SensorDefinition:
    """Launch ``spec`` for tenants whose eligible backlog reached ``spec.deployment.backlog_threshold``."""
    threshold = spec.deployment.backlog_threshold or 0

    @dg.sensor(
        name=f"{spec.name}_backlog_sensor",
        job=job,
        minimum_interval_seconds=60,
        description=f"Runs {spec.name} for a tenant once {threshold} items are waiting",
    )
    def backlog_sensor(
        context: dg.SensorEvaluationContext, database: QoOpsDatabase
    ) -> dg.SensorResult:
        state: dict[str, Any] = json.loads(context.cursor) if context.cursor else {"offset": 0}
        tenants = sorted(
            tenants_partitions_def.get_partition_keys(dynamic_partitions_store=context.instance)
        )
        offset = state.get("offset", 0) % max(len(tenants), 1)
        window = (tenants[offset:] + tenants[:offset])[:MAX_TENANTS_PER_TICK]
        bucket = int(time.time() // BACKLOG_COOLDOWN_S)
        # a tenant launched in this cooldown bucket is not launched again in it (the cursor)
        launched: dict[str, int] = (
            state.get("launched", {}) if state.get("bucket") == bucket else {}
        )
        due: list[str] = []
        waiting_in_dagster: list[str] = []  # a run of the tenant still queued or running
        pending = pending_work(context.instance, spec).tenants
        figures = {}
        with database.engine().connect() as conn:
            held = {s.tenant_id: s for s in suspensions(conn, spec.name)}  # the kill switch
            if None in held:
                return dg.SensorResult(
                    skip_reason=f"{held[None].describe()}; no run requested",
                    cursor=context.cursor,
                )
            now = database_now(conn)
            for tenant in window:
                if tenant in held:
                    continue
                # the tenant's whole backlog (every day, were the job windowed)
                scope = backlog_scope(spec, tenant, now)
                ctx = BatchContext(spec.name, scope, "dry_run", uuid.uuid4())
                # bounded count: stop counting at the threshold
                waiting = conn.execute(
                    sa.select(sa.func.count()).select_from(
                        spec.eligible(ctx).limit(threshold).subquery()
                    )
                ).scalar_one()
                figures[tenant] = waiting
                if waiting >= threshold and tenant in pending:
                    waiting_in_dagster.append(tenant)  # that run takes this backlog too
                elif waiting >= threshold and tenant not in launched:
                    due.append(tenant)
        runs = [  # one run per chunk of tenants past the threshold, not one per tenant
            chunk_run_request(
                spec,
                chunk,
                None,
                run_key=f"backlog:{spec.name}:{chunk[0]}..{chunk[-1]}:{bucket}",
                tags={},
            )
            for chunk in chunk_tenants(spec, due)
        ]
        launched |= dict.fromkeys(due, 1)
        cursor = json.dumps(
            {
                "offset": offset + len(window),
                "last": figures,
                "bucket": bucket,
                "launched": launched,
            }
        )
        # the backlog over time on the outcome asset's page (counted up to the threshold)
        observations = (
            [
                dg.AssetObservation(
                    asset_key=outcome_asset_key(spec),
                    partition=tenant,
                    metadata={
                        "backlog": waiting,
                        "backlog_counted_up_to": threshold,
                        "scope": tenant,
                    },
                )
                for tenant, waiting in figures.items()
            ]
            if spec.presentation.outcome_asset
            else []
        )
        if runs:
            return dg.SensorResult(run_requests=runs, cursor=cursor, asset_events=observations)
        suspended = [t for t in window if t in held]
        return dg.SensorResult(
            skip_reason=f"no tenant has {threshold} waiting"
            + (" without a run queued or running" if waiting_in_dagster else "")
            + f" ({len(window) - len(suspended)} checked)"
            + (f"; suspended, not checked: {', '.join(suspended)}" if suspended else "")
            + (
                f"; a run is already queued or running for: {', '.join(waiting_in_dagster)}"
                if waiting_in_dagster
                else ""
            ),
            cursor=cursor,
            asset_events=observations,
        )

    return backlog_sensor


def _digest(ids: Sequence[str]) -> str:
    return hashlib.blake2b("\n".join(ids).encode(), digest_size=8).hexdigest()


def _pack(ids: Sequence[str], reported: dict[str, set[str]]) -> dict[str, str]:
    """One bit per tenant of ``ids`` a job (zlib, base64): a few dozen bytes when nearly none
    or nearly all are set, at most ``len(ids) / 8`` bytes before base64."""
    packed: dict[str, str] = {}
    for job, names in sorted(reported.items()):
        if names:
            bits = bytearray((len(ids) + 7) // 8)
            for i, tenant in enumerate(ids):
                if tenant in names:
                    bits[i >> 3] |= 1 << (i & 7)
            packed[job] = base64.b64encode(zlib.compress(bytes(bits), 9)).decode()
    return packed


def _unpack(ids: Sequence[str], packed: dict[str, str]) -> dict[str, set[str]]:
    out = {}
    for job, blob in packed.items():
        bits = zlib.decompress(base64.b64decode(blob))
        out[job] = {t for i, t in enumerate(ids) if bits[i >> 3] & (1 << (i & 7))}
    return out


@dataclass
class StaleCursor:
    """What the stale-success sensor has had recorded: the (job → tenants) marked stale on
    their partitions, and the run it requested last with what that run will record.

    Kept as bits over the tick's tenant list, which the next tick rebuilds as today's list
    without the tenants created since. When that fails (a tenant was removed, or added with
    an older ``created_at``) the tick starts over and has every stale tenant marked again."""

    stale: dict[str, set[str]]
    pending_key: str | None = None  # run key of the recent_success_job run requested last
    pending: dict[str, set[str]] | None = None  # ``stale`` once that run has succeeded
    lost: bool = False

    @classmethod
    def read(cls, cursor: str | None, everyone: Sequence[Tenant]) -> "StaleCursor":
        state = json.loads(cursor) if cursor else {}
        if state.get("v") != 2:
            return cls({})
        known = [t.id for t in everyone if t.created <= state["at"]]
        if len(known) != state["n"] or _digest(known) != state["digest"]:
            return cls({}, lost=True)
        pending = state.get("pending")
        return cls(
            _unpack(known, state["stale"]),
            pending["key"] if pending else None,
            _unpack(known, pending["stale"]) if pending else None,
        )

    def write(self, everyone: Sequence[Tenant], now: float) -> str:
        ids = [t.id for t in everyone]
        state: dict[str, Any] = {"v": 2, "at": now, "n": len(ids), "digest": _digest(ids)}
        state["stale"] = _pack(ids, self.stale)
        if self.pending_key is not None and self.pending is not None:
            state["pending"] = {"key": self.pending_key, "stale": _pack(ids, self.pending)}
        return json.dumps(state, separators=(",", ":"))


def _fair(groups: dict[str, list[str]], limit: int) -> list[tuple[str, str]]:
    """Up to ``limit`` (job, tenant) pairs, taking one of each job in turn."""
    columns = [[(job, t) for t in tenants] for job, tenants in groups.items()]
    rounds = itertools.chain.from_iterable(itertools.zip_longest(*columns))
    return list(itertools.islice((p for p in rounds if p is not None), limit))


def _run_status(instance: dg.DagsterInstance, run_key: str) -> dg.DagsterRunStatus | None:
    runs = instance.get_runs(
        filters=dg.RunsFilter(job_name=RECENT_SUCCESS_JOB, tags={RUN_KEY_TAG: run_key}), limit=1
    )
    return runs[0].status if runs else None


def build_stale_success_sensor(specs: Sequence[JobSpec]) -> dg.SensorDefinition:
    """Judge every (job, tenant) each tick: no execute success/no_work within 3× the job's
    cadence is stale. When tenants turned stale or recovered since the last tick, request a
    ``recent_success_job`` run that records it on their partitions (up to
    ``MAX_STALE_EVENTS_PER_TICK`` a run; the rest follow once it has succeeded). The skip
    reason, the run's ``qo_ops/stale`` tag and the daemon log name the stale ones."""
    by_name = {s.name: s for s in specs}
    marked = {s.name for s in specs if s.presentation.outcome_asset}  # jobs with partitions to mark

    @dg.sensor(
        name="stale_success_sensor",
        job=build_recent_success_job(specs),
        minimum_interval_seconds=300,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description="Marks each tenant partition whose job has not succeeded for "
        f"{STALE_FACTOR}× its cadence ({RECENT_SUCCESS_CHECK} check) and names them",
    )
    def stale_success_sensor(
        context: dg.SensorEvaluationContext, database: QoOpsDatabase
    ) -> dg.SensorResult:
        with database.engine().connect() as conn:
            everyone, now = all_tenants(conn)
            state = StaleCursor.read(context.cursor, everyone)
            if state.lost:
                context.log.info("the tenant list changed under the cursor: marking again")
            waiting = None
            if state.pending_key is not None:
                status = _run_status(context.instance, state.pending_key)
                if status == dg.DagsterRunStatus.SUCCESS:
                    state.stale = state.pending or {}
                elif status not in (
                    None,
                    dg.DagsterRunStatus.FAILURE,
                    dg.DagsterRunStatus.CANCELED,
                ):
                    waiting = state.pending_key  # queued or running: one such run at a time
                if waiting is None:
                    state.pending_key = state.pending = None
            # the whole judgement: one index range per job over its last 3 cadences of runs
            stale: dict[str, list[str]] = {}
            not_due: set[str] = set()
            for spec in specs:
                if not job_due(conn, spec):  # not at work for its limit yet: nobody judged
                    stale[spec.name] = []
                    not_due.add(spec.name)
                    continue
                limit, recent = stale_limit_s(spec), recent_tenants(conn, spec)
                stale[spec.name] = [
                    t.id for t in everyone if t.age_s > limit and t.id not in recent
                ]
            named = [(j, t) for j, tenants in stale.items() for t in tenants][:NAMED_STALE]
            wanted: dict[str, set[str]] = {}
            for job, tenant in named:
                wanted.setdefault(job, set()).add(tenant)
            ages = {j: last_success_ages(conn, by_name[j], ts) for j, ts in wanted.items()}

        current = {t.id for t in everyone}
        state.stale = {j: names & current for j, names in state.stale.items() if j in marked}
        turned = {j: [t for t in stale[j] if t not in state.stale.get(j, ())] for j in marked}
        back = {j: sorted(state.stale.get(j, set()) - set(stale[j])) for j in marked}
        changes = sum(map(len, turned.values())) + sum(map(len, back.values()))
        chosen = [] if waiting else _fair(turned, MAX_STALE_EVENTS_PER_TICK)
        recovered = [] if waiting else _fair(back, MAX_STALE_EVENTS_PER_TICK - len(chosen))

        total = sum(map(len, stale.values()))
        if total:
            headline = f"STALE: {total} job scope(s)"
            named_text = ": " + "; ".join(
                f"{j}/{t} ({Freshness(t, ages[j][t], stale_limit_s(by_name[j])).describe()})"
                for j, t in named
            )
            context.log.warning(f"stale last success: {headline}{named_text}")
        else:
            idle = [spec.name for spec in specs if spec.name in not_due]
            headline = f"no stale tenant: every job succeeded within {STALE_FACTOR}× its cadence"
            named_text = (
                f" (not judged yet, not at work that long: {first_few(idle)})" if idle else ""
            )
        cursor = state.write(everyone, now) if now is not None else None
        if waiting:
            return dg.SensorResult(
                skip_reason=f"{headline}{named_text} — {changes} change(s) to mark once run "
                f"{waiting} has recorded the last",
                cursor=cursor,
            )
        if not (chosen or recovered):
            return dg.SensorResult(skip_reason=headline + named_text, cursor=cursor)
        left = changes - len(chosen) - len(recovered)
        marks = (
            f" — marking {len(chosen)} tenant partition(s) stale, {len(recovered)} recovered"
            + (f", {left} left for the next runs" if left else "")
        )
        context.log.info(headline + marks)
        # what the run will have recorded: the cursor takes it once the run has succeeded
        pending = {j: set(names) for j, names in state.stale.items()}
        to_judge: dict[str, list[str]] = {}
        for job, tenant in chosen:
            pending.setdefault(job, set()).add(tenant)
            to_judge.setdefault(job, []).append(tenant)
        for job, tenant in recovered:
            pending[job].discard(tenant)
            to_judge.setdefault(job, []).append(tenant)
        state.pending_key, state.pending = f"recent_success:{now:.3f}", pending
        request = dg.RunRequest(
            run_key=state.pending_key,
            run_config={"ops": {"recent_success_op": {"config": {"tenants": to_judge}}}},
            tags={STALE_TAG: headline + marks},
        )
        return dg.SensorResult(
            run_requests=[request], cursor=state.write(everyone, now) if now is not None else None
        )

    return stale_success_sensor


QUEUE_SAMPLE_S = 30  # how often run_queue_sensor samples the queue (the exporter's refresh)


def build_run_queue_sensor(specs: Sequence[JobSpec]) -> dg.SensorDefinition:
    """Sample Dagster's run queue per catalog job into ``job_run_queue`` (the exporter's
    ``job_run_queue_depth`` and ``job_run_queue_oldest_seconds``)."""
    names = [s.name for s in specs]

    @dg.sensor(
        name="run_queue_sensor",
        minimum_interval_seconds=QUEUE_SAMPLE_S,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description="Records how many runs of each job wait in the run queue, and since when",
    )
    def run_queue_sensor(
        context: dg.SensorEvaluationContext, database: QoOpsDatabase
    ) -> dg.SkipReason:
        samples: dict[str, QueueSample] = {}
        for job in names:
            records = context.instance.get_run_records(
                filters=dg.RunsFilter(job_name=job, statuses=[dg.DagsterRunStatus.QUEUED]),
                order_by="create_timestamp",
                ascending=True,
                limit=1,
            )
            if records:
                depth = context.instance.get_runs_count(
                    dg.RunsFilter(job_name=job, statuses=[dg.DagsterRunStatus.QUEUED])
                )
                created = records[0].create_timestamp
                samples[job] = QueueSample(
                    depth, created if created.tzinfo else created.replace(tzinfo=UTC)
                )
        with database.engine().begin() as conn:
            record_run_queue(conn, names, samples)
        queued = ", ".join(f"{job} {s.depth}" for job, s in sorted(samples.items()))
        return dg.SkipReason(f"queued runs: {queued}" if queued else "no run is queued")

    return run_queue_sensor


def build_checkpoint_age_sensor(specs: Sequence[JobSpec]) -> dg.SensorDefinition:
    """Say which checkpointed job has a running run whose checkpoint stopped advancing."""
    names = [s.name for s in specs if s.batching.checkpoint is not None]

    @dg.sensor(
        name="checkpoint_age_sensor",
        minimum_interval_seconds=300,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description="Reports running checkpointed jobs whose checkpoint has not moved for an hour",
    )
    def checkpoint_age_sensor(
        context: dg.SensorEvaluationContext, database: QoOpsDatabase
    ) -> dg.SkipReason:
        if not names:
            return dg.SkipReason("no catalog job uses a checkpoint")
        with database.engine().connect() as conn:
            rows = conn.execute(
                sa.text(
                    """
                    SELECT c.job_name, c.scope, extract(epoch FROM clock_timestamp() - c.updated_at) AS age
                      FROM job_checkpoint c
                      JOIN job_run r ON r.job_name = c.job_name AND r.scope = c.scope AND r.status = 'running'
                     WHERE c.job_name = ANY(:names)
                       AND c.updated_at < clock_timestamp() - make_interval(secs => :max_age)
                     LIMIT 50
                    """
                ),
                {"names": names, "max_age": CHECKPOINT_MAX_AGE_S},
            ).all()
        if rows:
            text = "; ".join(
                f"{r.job_name}/{r.scope} checkpoint {r.age / 60:.0f} min old" for r in rows
            )
            context.log.warning("checkpoint stopped advancing: " + text)
            return dg.SkipReason("STALE CHECKPOINT: " + text)
        return dg.SkipReason("every running checkpointed job advanced within the hour")

    return checkpoint_age_sensor


OUTSIDE_RUNS_PER_TICK = 200  # runs recorded a tick (each: one backlog count of its tenant)
OUTSIDE_RUNS_SINCE_H = 24  # a first tick records the runs that finished this long ago at most

# Runs that finished outside Dagster (the CLI: no Dagster run id) since the cursor, oldest
# first; ix_job_run_created bounds the scan (a run finishes after it is created).
_OUTSIDE_RUNS = sa.text(
    """
    SELECT id, job_name, scope, window_start, window_end, mode, trigger_type, requester,
           status, eligible_count, succeeded_count, failed_count, finished_at
      FROM job_run
     WHERE dagster_run_id IS NULL AND finished_at IS NOT NULL
       AND created_at > CAST(:since AS timestamptz) - interval '1 day'
       AND (finished_at, id) > (CAST(:since AS timestamptz), CAST(:after AS uuid))
     ORDER BY finished_at, id
     LIMIT :limit
    """
)


def build_outside_runs_sensor(
    specs: Sequence[JobSpec], checks_job: dg.JobDefinition
) -> dg.SensorDefinition:
    """``outside_runs_sensor``: puts each run that did not run in Dagster (``qo-ops run``, an
    API run outside Dagster) on its tenant's partition of the job's outcome asset, as a
    Dagster run's op does: a materialization when an execute kept the outcome, an observation
    otherwise (a dry run, a failure), with the run's status, mode, counts and the tenant's
    backlog now. Then the tenant's checks, as the op judges them after an execute: one
    ``outcome_checks_job`` run per job and tick judges the declared checks of the tenants
    whose last run outside Dagster was an execute, on their partitions. So the Partitions tab
    shows a tenant fixed from the CLI as materialized, the check's partitions say which
    tenants are healthy and which failing, and the backlog plots move with every run.

    The checks go through a run, not the tick's own events: Dagster 1.13 stores a runless
    check evaluation under one run id for every partition (``asset_check_executions`` is
    unique on check, run and partition), so a tenant's second runless evaluation fails."""
    by_name = {s.name: s for s in specs}

    @dg.sensor(
        name="outside_runs_sensor",
        minimum_interval_seconds=30,
        default_status=dg.DefaultSensorStatus.RUNNING,
        job=checks_job,
        description=(
            "Records runs started outside Dagster (qo-ops run) on their tenant's partition of "
            "the outcome asset: a materialization for an execute that kept the outcome, an "
            "observation otherwise; after an execute, an outcome_checks_job run judges the "
            "tenant's checks"
        ),
    )
    def outside_runs_sensor(
        context: dg.SensorEvaluationContext, database: QoOpsDatabase
    ) -> dg.SensorResult:
        state = json.loads(context.cursor) if context.cursor else {}
        events: list[dg.AssetMaterialization | dg.AssetObservation] = []
        judge: dict[str, dict[str, bool]] = {}  # job -> tenant -> judge its checks
        with database.engine().connect() as conn:
            since = (
                state.get("since")
                or conn.execute(
                    sa.text("SELECT now() - make_interval(hours => :h)"),
                    {"h": OUTSIDE_RUNS_SINCE_H},
                ).scalar_one()
            )
            rows = conn.execute(
                _OUTSIDE_RUNS,
                {
                    "since": since,
                    "after": state.get("after", str(uuid.UUID(int=0))),
                    "limit": OUTSIDE_RUNS_PER_TICK,
                },
            ).all()
            for row in rows:
                spec = by_name.get(row.job_name)
                if spec is not None and spec.presentation.outcome_asset:
                    events.append(_outside_event(conn, spec, row))
                    executed = row.mode == "execute" and row.status != RunStatus.SKIPPED
                    judge.setdefault(spec.name, {})[tenant_of(row.scope)] = executed
        if rows:
            last = rows[-1]
            state = {"since": last.finished_at.isoformat(), "after": str(last.id)}
        elif "since" not in state:
            state = {"since": since.isoformat(), "after": str(uuid.UUID(int=0))}
        requests = [
            _checks_request(by_name[job], sorted(t for t, yes in tenants.items() if yes), state)
            for job, tenants in sorted(judge.items())
            if by_name[job].checks and any(tenants.values())
        ]
        return dg.SensorResult(
            asset_events=events,
            run_requests=requests,
            cursor=json.dumps(state),
            skip_reason=None if events else "no run outside Dagster finished since the last tick",
        )

    return outside_runs_sensor


OUTSIDE_CHECKS_TAG = "qo_ops/checks_after"  # on an outcome_checks_job run the sensor asked for


def _checks_request(spec: JobSpec, tenants: list[str], state: dict[str, str]) -> dg.RunRequest:
    """One ``outcome_checks_job`` run: ``spec``'s declared checks on ``tenants`` now."""
    return dg.RunRequest(
        run_key=f"{spec.name}:{state['since']}:{state['after']}",
        run_config={
            "ops": {"outcome_checks_op": {"config": {"job": spec.name, "tenants": tenants}}}
        },
        tags={OUTSIDE_CHECKS_TAG: f"{spec.name} run outside Dagster", **_tenant_tag(tenants)},
    )


def _tenant_tag(tenants: list[str]) -> dict[str, str]:
    """The tenant tag of a run of one tenant (the Runs list filters by it)."""
    return {TENANT_TAG: tenants[0]} if len(tenants) == 1 else {}


def _outside_event(
    conn: sa.Connection, spec: JobSpec, row: Any
) -> dg.AssetMaterialization | dg.AssetObservation:
    """The outcome event of one run outside Dagster, as its op would have yielded it."""
    summary = RunSummary(
        job_run_id=str(row.id),
        job_name=row.job_name,
        status=row.status,
        mode=row.mode,
        scope=row.scope,
        trigger=row.trigger_type,
        requester=row.requester,
        eligible_count=int(row.eligible_count),
        counts=Counts(succeeded=int(row.succeeded_count), failed=int(row.failed_count)),
    )
    scope = Scope.parse(row.scope)
    event = outcome_event(
        outcome_asset_key(spec), summary, scope, tenant_backlog(conn, spec, scope.tenant_id)
    )
    metadata = {**event.metadata, "recorded_by": "outside_runs_sensor", "trigger": row.trigger_type}
    return type(event)(asset_key=event.asset_key, partition=event.partition, metadata=metadata)


def _job_run_id(tag: str | None) -> uuid.UUID | None:
    try:
        return uuid.UUID(tag) if tag else None
    except ValueError:
        return None


def failure_cause(context: dg.RunFailureSensorContext) -> str:
    """Why the run failed, in one line: the first failed step's own description (the
    runner's one-line error, e.g. a refusal) rather than Dagster's "Steps failed"."""
    for event in context.get_step_failure_events():
        data = event.step_failure_data
        described = data.user_failure_data.description if data.user_failure_data else None
        if described or data.error is not None:
            return one_line(described or data.error.message, 300)  # type: ignore[union-attr]
    return one_line(context.failure_event.message or "no message", 300)


@dg.run_failure_sensor(name="run_failure_recorder", default_status=dg.DefaultSensorStatus.RUNNING)
def run_failure_recorder(context: dg.RunFailureSensorContext, database: QoOpsDatabase) -> None:
    """Record each failed catalog run in the audit trail (and the log), with its scope and
    its cause, so a failure is on record even when it happened before the runner wrote a
    job_run row. A run the coordinator refused before queueing but could not audit then (the
    database was out; it ends FAILURE, its message says so) is recorded as the runner records
    a refusal: ``trigger``, ``denied``, who, mode, reason."""
    run = context.dagster_run
    refused = (context.failure_event.message or "").startswith(REFUSED_PREFIX)
    message = (
        one_line(context.failure_event.message or "", 300) if refused else failure_cause(context)
    )
    scope = run.tags.get(SCOPE_TAG, "").partition(":")[2] or None
    context.log.error(f"run {run.run_id} of {run.job_name} failed ({scope or '?'}): {message}")
    with database.engine().begin() as conn:
        accepted = _job_run_id(run.tags.get(JOB_RUN_TAG))
        if accepted is not None:  # an API run that failed before its op adopted the row
            finish_unstarted(
                conn, accepted, RunStatus.FAILED, "dagster_run_failed", "dagster_run_failed"
            )
        if refused:  # refused before queueing when the database could not audit it then
            append_audit(conn, refusal_audit(run, run.tags.get(REFUSED_TAG, "bad_input"), message))
            return
        append_audit(
            conn,
            AuditEntry(
                actor="dagster",
                action="run_failure",
                decision="recorded",
                job_name=run.job_name,
                scope=scope,
                details={"dagster_run_id": run.run_id, "message": message},
            ),
        )
