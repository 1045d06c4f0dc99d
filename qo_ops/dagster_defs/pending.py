"""Work Dagster already has for a job: the scopes of its runs that are queued or running, so
that a schedule or sensor never asks for a scope again while a run of it waits (a backlog
must not feed itself: each tick adding runs behind the ones still queued)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import date, timedelta

import dagster as dg

from qo_ops.dagster_defs.partitions import tenants_partitions_def
from qo_ops.dagster_defs.submission import op_config
from qo_ops.errors import BadInput
from qo_ops.platform.job.scope import Scope
from qo_ops.platform.job.spec import JobSpec
from qo_ops.platform.schedule.partition_keys import split_windowed_key

PARTITION_TAG = "dagster/partition"
RANGE_START_TAG = "dagster/asset_partition_range_start"
RANGE_END_TAG = "dagster/asset_partition_range_end"

# A run not started yet is queued; one starting, running or being cancelled is active.
QUEUED = "previous_run_queued"
ACTIVE = "previous_run_active"
PENDING_STATUSES = {
    dg.DagsterRunStatus.NOT_STARTED: QUEUED,
    dg.DagsterRunStatus.QUEUED: QUEUED,
    dg.DagsterRunStatus.STARTING: ACTIVE,
    dg.DagsterRunStatus.STARTED: ACTIVE,
    dg.DagsterRunStatus.CANCELING: ACTIVE,
}


@dataclass
class Pending:
    """Scope key → why it is taken (``previous_run_queued`` or ``previous_run_active``), and
    the same per tenant (a backlog sensor's scope is the tenant's whole backlog). A scope
    both queued and running counts as running."""

    scopes: dict[str, str] = field(default_factory=dict)
    tenants: dict[str, str] = field(default_factory=dict)

    def add(self, tenant: str, key: str, reason: str) -> None:
        for table, name in ((self.scopes, key), (self.tenants, tenant)):
            if table.get(name) != ACTIVE:
                table[name] = reason


def pending_work(instance: dg.DagsterInstance, spec: JobSpec) -> Pending:
    """The scopes of ``spec``'s Dagster runs that are queued or running (whatever started
    them: a tick, a sensor, a backfill, a person)."""
    pending = Pending()
    records = instance.get_run_records(
        filters=dg.RunsFilter(job_name=spec.name, statuses=list(PENDING_STATUSES))
    )
    for record in records:
        run = record.dagster_run
        reason = PENDING_STATUSES[run.status]
        tenants, days = _named(instance, spec, run)
        for tenant in tenants:
            if spec.partitioning != "tenant_day":
                pending.add(tenant, tenant, reason)
                continue
            for day in days:
                try:
                    key = Scope(tenant, day, day + timedelta(days=1)).key
                except BadInput:  # a person's bad run config: refused at start, no scope
                    continue
                pending.add(tenant, key, reason)
    return pending


def _named(
    instance: dg.DagsterInstance, spec: JobSpec, run: dg.DagsterRun
) -> tuple[list[str], list[date]]:
    """The tenants a run names (run config, else its tenant partition or range) and, for a
    windowed job, the days of its day partition or range."""
    tags = run.tags
    keys: list[str]
    if PARTITION_TAG in tags:
        keys = [tags[PARTITION_TAG]]
    elif RANGE_START_TAG in tags and RANGE_END_TAG in tags:
        start, end = tags[RANGE_START_TAG], tags[RANGE_END_TAG]
        if spec.partitioning == "tenant_day":  # day|chunk (or an old day-only key) each end
            try:
                first, last = split_windowed_key(start)[0], split_windowed_key(end)[0]
            except BadInput:
                first, last = date.min, date.min - timedelta(days=1)  # no day named
            keys = [(first + timedelta(days=n)).isoformat() for n in range((last - first).days + 1)]
        else:
            known = list(  # a range of dynamic keys runs in their order
                tenants_partitions_def.get_partition_keys(dynamic_partitions_store=instance)
            )
            keys = (
                known[known.index(start) : known.index(end) + 1]
                if start in known and end in known
                else []
            )
    else:
        keys = []
    tenants = [str(t) for t in op_config(run).get("tenants") or []]
    if spec.partitioning != "tenant_day":
        return tenants or keys, []
    days = []
    for key in keys:
        try:
            days.append(split_windowed_key(key)[0])
        except BadInput:
            continue  # not a day partition: names no scope the schedule would ask for
    return tenants, days
