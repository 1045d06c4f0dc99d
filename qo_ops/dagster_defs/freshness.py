"""Staleness on every tenant partition: each outcome asset has a ``recent_success`` check,
partitioned by tenant, that passes when the job's last execute run for the tenant ended
``success`` or ``no_work`` (or ``partial_success``, for a job whose catalog entry says so)
within ``STALE_FACTOR`` × the job's cadence.

Evaluations are recorded by runs, each on the tenant's own partition:

- the job's op, after a tenant's execute run ends success/no_work (a passing evaluation,
  :func:`recent_success_evaluation`);
- ``recent_success_job``, which ``stale_success_sensor`` (``sensors.py``) requests when its
  judgement of every tenant found tenants that turned stale or recovered since the last
  tick; a person may launch it too, naming tenants per job to judge now;
- the check executed on its own for one tenant partition or a range of them (not from the
  UI: Dagster 1.13's Execute button is disabled for partitioned checks).

Not the sensor itself: Dagster 1.13 records a run-less evaluation of a partitioned check
(``SensorResult(asset_events=…)``) once per partition and then refuses the next one
(``idx_asset_check_executions_unique`` on asset, check, run id ``''`` and partition), which
would fail the sensor's tick for good. In a run each evaluation is keyed by the run's id.

A tenant is judged once it has existed for the limit, and once the job has been at work for
the limit (its first run finished, or its first tick evaluated, that long ago): a tenant
created a minute ago, or a daily job on a fresh deployment, has not yet missed three
cadences. A run ending ``partial_success`` counts as a success where the catalog says so
(``JobSpec.signals.partial_success_is_fresh``: items failing on purpose, such as poison items).
"""

import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import dagster as dg
import sqlalchemy as sa
from sqlalchemy.engine import Connection

from qo_ops.dagster_defs.checks import (
    TargetMaterialization,
    judged_materialization,
    outcome_asset_key,
)
from qo_ops.dagster_defs.partitions import tenants_partitions_def
from qo_ops.dagster_defs.resources import QoOpsDatabase
from qo_ops.platform.job.scope import TENANT_OF_SCOPE
from qo_ops.platform.job.spec import JobSpec
from qo_ops.platform.schedule.freshness import STALE_FACTOR, job_due, stale_limit_s

RECENT_SUCCESS_CHECK = "recent_success"
RECENT_SUCCESS_JOB = "recent_success_job"


# Tenants with a success within the limit: a range of ix_job_run_job_finished (now(), not
# clock_timestamp(): a volatile bound cannot use the index), so a tick reads only the last
# 3 cadences of runs, however long job_run is. A windowed job's scope is tenant/window.
_RECENT_SUCCESS = sa.text(
    f"""
    SELECT DISTINCT {TENANT_OF_SCOPE} AS tenant FROM job_run
     WHERE job_name = :job AND finished_at IS NOT NULL
       AND finished_at > now() - make_interval(secs => :limit_s)
       AND mode = 'execute' AND status = ANY(CAST(:fresh AS text[]))
    """
)
# The last success of some tenants of a tenant job (whose scope is the tenant): one walk of
# ix_job_run_history per tenant, newest first, stopping at its last success.
_LAST_SUCCESS_TENANT = sa.text(
    """
    SELECT t.id AS tenant, extract(epoch FROM now() - r.finished_at) AS age
      FROM unnest(CAST(:tenants AS text[])) AS t(id)
      LEFT JOIN LATERAL (
            SELECT finished_at FROM job_run
             WHERE job_name = :job AND scope = t.id AND mode = 'execute'
               AND status = ANY(CAST(:fresh AS text[])) AND finished_at IS NOT NULL
             ORDER BY started_at DESC
             LIMIT 1) r ON true
    """
)
# A windowed job's scopes are tenant/window: ix_job_run_retention walks the tenant's runs
# (of every job) newest first, stopping at this job's last success.
_LAST_SUCCESS_WINDOWED = sa.text(
    f"""
    SELECT t.id AS tenant, extract(epoch FROM now() - r.finished_at) AS age
      FROM unnest(CAST(:tenants AS text[])) AS t(id)
      LEFT JOIN LATERAL (
            SELECT finished_at FROM job_run
             WHERE {TENANT_OF_SCOPE} = t.id AND finished_at IS NOT NULL
               AND job_name = :job AND mode = 'execute'
               AND status = ANY(CAST(:fresh AS text[]))
             ORDER BY finished_at DESC
             LIMIT 1) r ON true
    """
)
# Every tenant, how long it has existed, and the statement's clock (for the sensor's cursor).
_TENANTS = sa.text(
    """
    SELECT id, extract(epoch FROM now() - created_at) AS age,
           extract(epoch FROM created_at) AS created, extract(epoch FROM now()) AS now
      FROM tenant
     ORDER BY id
    """
)


@dataclass(frozen=True)
class Tenant:
    """A tenant as the freshness judgement sees it."""

    id: str
    age_s: float  # how long it has existed
    created: float  # epoch seconds


def all_tenants(conn: Connection) -> tuple[list[Tenant], float | None]:
    """Every tenant, by id, and the database's now (epoch seconds; None without tenants)."""
    rows = conn.execute(_TENANTS).all()
    return [Tenant(r.id, float(r.age), float(r.created)) for r in rows], (
        float(rows[0].now) if rows else None
    )


def recent_tenants(conn: Connection, spec: JobSpec) -> set[str]:
    """Tenants with an execute run of ``spec`` that ended in one of its fresh statuses
    (``spec.fresh_statuses``) within the limit."""
    return set(
        conn.execute(
            _RECENT_SUCCESS,
            {"job": spec.name, "limit_s": stale_limit_s(spec), "fresh": list(spec.fresh_statuses)},
        ).scalars()
    )


def last_success_ages(
    conn: Connection, spec: JobSpec, ids: Iterable[str]
) -> dict[str, float | None]:
    """Seconds since each tenant's last success of ``spec`` (``None``: never)."""
    wanted = sorted(set(ids))
    if not wanted:
        return {}
    query = _LAST_SUCCESS_TENANT if spec.partitioning == "tenant" else _LAST_SUCCESS_WINDOWED
    found = {
        r.tenant: float(r.age) if r.age is not None else None
        for r in conn.execute(
            query, {"job": spec.name, "tenants": wanted, "fresh": list(spec.fresh_statuses)}
        )
    }
    return {t: found.get(t) for t in wanted}


@dataclass(frozen=True)
class Freshness:
    """One tenant's judgement for one job."""

    tenant: str
    age_s: float | None  # since the last success; None: never
    limit_s: float
    new: bool = False  # the tenant, or the job's work, newer than the limit: not judged yet

    @property
    def stale(self) -> bool:
        return not self.new and (self.age_s is None or self.age_s > self.limit_s)

    def metadata(self) -> dict[str, Any]:
        return {"last_success_age_s": "never" if self.age_s is None else round(self.age_s)}

    def describe(self) -> str:
        age = "never" if self.age_s is None else f"{self.age_s / 60:.0f} min ago"
        text = f"last success {age}, limit {self.limit_s / 60:.0f} min"
        return text + (
            " (the tenant, or the job's first run or tick, newer than the limit: not judged yet)"
            if self.new
            else ""
        )


def judge(
    conn: Connection, spec: JobSpec, ids: Sequence[str], known: Mapping[str, Tenant] | None = None
) -> list[Freshness]:
    """The freshness of ``spec`` for each of ``ids``, by tenant (``known``: the tenants, when
    the caller has read them; a tenant missing from them is judged without a new tenant's
    grace)."""
    limit = stale_limit_s(spec)
    if known is None:
        known = {t.id: t for t in all_tenants(conn)[0]}
    ages = last_success_ages(conn, spec, ids)
    due = job_due(conn, spec)
    return [
        Freshness(t, ages[t], limit, new=not due or (t in known and known[t].age_s <= limit))
        for t in sorted(set(ids))
    ]


def recent_success_evaluation(
    spec: JobSpec,
    tenant: str,
    passed: bool,
    metadata: Mapping[str, Any] | None = None,
    description: str | None = None,
    target: TargetMaterialization | None = None,
) -> dg.AssetCheckEvaluation:
    """The ``recent_success`` evaluation of ``spec`` on ``tenant``'s partition (WARN: a stale
    tenant is a warning, never a blocked asset). ``limit_s`` is always in the metadata."""
    return dg.AssetCheckEvaluation(
        asset_key=outcome_asset_key(spec),
        check_name=RECENT_SUCCESS_CHECK,
        passed=passed,
        partition=tenant,
        severity=dg.AssetCheckSeverity.WARN,
        metadata={"limit_s": round(stale_limit_s(spec)), **(metadata or {})},
        description=description,
        # the partition's latest materialization (judged_materialization), or the UI shows
        # the tenant Missing once it has one
        target_materialization_data=target,
    )


def evaluation_of(
    spec: JobSpec, freshness: Freshness, instance: dg.DagsterInstance
) -> dg.AssetCheckEvaluation:
    """A judged tenant as its ``recent_success`` evaluation."""
    return recent_success_evaluation(
        spec,
        freshness.tenant,
        passed=not freshness.stale,
        metadata=freshness.metadata(),
        description=("STALE: " if freshness.stale else "") + freshness.describe(),
        target=judged_materialization(instance, outcome_asset_key(spec), freshness.tenant),
    )


def _build_check(spec: JobSpec) -> dg.AssetChecksDefinition:
    limit = stale_limit_s(spec)
    with warnings.catch_warnings():  # partitioned checks are a preview in the pinned Dagster
        warnings.simplefilter("ignore", dg.PreviewWarning)

        @dg.asset_check(  # type: ignore[arg-type]  # yields evaluations, not one AssetCheckResult
            asset=outcome_asset_key(spec),
            name=RECENT_SUCCESS_CHECK,
            partitions_def=tenants_partitions_def,
            blocking=False,
            description=f"{spec.name} ended success or no_work (execute) for the tenant within "
            f"the last {STALE_FACTOR} cadences ({limit / 60:.0f} min); kept by the job's runs "
            "and stale_success_sensor",
        )
        def recent_success(
            context: dg.AssetCheckExecutionContext, database: QoOpsDatabase
        ) -> Iterator[dg.AssetCheckEvaluation | dg.Output[None]]:
            # a run over one partition or a range of them: one evaluation per tenant partition
            # (an AssetCheckResult would carry no partition in a range run); a run over none
            # (the UI's "Execute all" on the asset's checks) judges every tenant
            with database.engine().connect() as conn:
                partitioned = context.has_partition_key or context.has_partition_key_range
                keys = (
                    list(context.partition_keys)
                    if partitioned
                    else [t.id for t in all_tenants(conn)[0]]
                )
                judged = judge(conn, spec, keys)
            for freshness in judged:
                yield evaluation_of(spec, freshness, context.instance)
            if not partitioned:  # Execute all: its own, unpartitioned record says how it went
                stale = [f.tenant for f in judged if f.stale]
                yield dg.AssetCheckEvaluation(
                    asset_key=outcome_asset_key(spec),
                    check_name=RECENT_SUCCESS_CHECK,
                    passed=not stale,
                    severity=dg.AssetCheckSeverity.WARN,
                    metadata={"tenants_judged": len(judged), "tenants_stale": len(stale)},
                    description=f"{len(stale)} of {len(judged)} tenants stale"
                    + (f" (first: {', '.join(stale[:5])})" if stale else "")
                    + "; each tenant's judgement is on its partition",
                )
            yield dg.Output(None)  # the check's own output; the evaluations above are its result

    return recent_success


def build_recent_success_checks(specs: Sequence[JobSpec]) -> list[dg.AssetChecksDefinition]:
    """One tenant-partitioned ``recent_success`` check per job with an outcome asset."""
    owners: dict[str, str] = {}
    for spec in specs:
        if spec.presentation.outcome_asset:
            other = owners.setdefault(spec.presentation.outcome_asset, spec.name)
            if other != spec.name:
                raise ValueError(
                    f"{spec.name} and {other} share outcome asset {spec.presentation.outcome_asset}: "
                    f"{RECENT_SUCCESS_CHECK} is one check per asset"
                )
    return [_build_check(spec) for spec in specs if spec.presentation.outcome_asset]


class RecentSuccessConfig(dg.Config):
    """Which tenants to judge now, by job (``{"quote_expiration": ["tenant-001"]}``)."""

    tenants: dict[str, list[str]]


def build_recent_success_job(specs: Sequence[JobSpec]) -> dg.JobDefinition:
    """The run that records ``recent_success`` evaluations: it judges the tenants it is
    given, per job, and records one evaluation on each tenant's partition."""
    by_name = {s.name: s for s in specs if s.presentation.outcome_asset}

    @dg.op(name="recent_success_op")
    def recent_success_op(
        context: dg.OpExecutionContext, config: RecentSuccessConfig, database: QoOpsDatabase
    ) -> Iterator[dg.AssetCheckEvaluation | dg.Output[None]]:
        unknown = sorted(set(config.tenants) - set(by_name))
        if unknown:
            raise dg.Failure(f"not a job with an outcome asset: {', '.join(unknown[:10])}")
        with database.engine().connect() as conn:
            known = {t.id: t for t in all_tenants(conn)[0]}
            missing = sorted({t for ts in config.tenants.values() for t in ts} - set(known))
            if missing:  # validated before anything is recorded
                raise dg.Failure(f"not a tenant: {', '.join(missing[:10])}")
            judged = {
                job: judge(conn, by_name[job], tenants, known)
                for job, tenants in sorted(config.tenants.items())
            }
        stale = [f"{job}/{f.tenant}" for job, found in judged.items() for f in found if f.stale]
        for job, found in judged.items():
            for freshness in found:
                yield evaluation_of(by_name[job], freshness, context.instance)
        total = sum(map(len, judged.values()))
        context.log.info(f"{total} tenant partition(s) judged, {len(stale)} stale")
        yield dg.Output(
            None,
            metadata={
                "tenants_judged": total,
                "stale": len(stale),
                "stale_first": ", ".join(stale[:20]) or "none",
            },
        )

    @dg.job(
        name=RECENT_SUCCESS_JOB,
        description="Records the recent_success check on tenant partitions: requested by "
        "stale_success_sensor for the tenants that turned stale or recovered; to judge some "
        'now, launch it with {"tenants": {"<job>": ["<tenant>", …]}}',
    )
    def recent_success_job() -> None:
        recent_success_op()

    return recent_success_job
