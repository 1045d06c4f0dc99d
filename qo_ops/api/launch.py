"""Handing an accepted run to Dagster: the tags and run config its Dagster run carries, what
is recorded when Dagster cannot take it, and when an accepted run will never start."""

from __future__ import annotations

import logging
import uuid
from typing import Any

from qo_ops.api import service
from qo_ops.api.dagster import DagsterClient, DagsterUnavailable
from qo_ops.api.deps import ApiState
from qo_ops.api.errors import ApiError
from qo_ops.platform.job.statuses import RunStatus
from qo_ops.platform.observability.events import log_event
from qo_ops.platform.schedule.partition_keys import (
    JOB_RUN_TAG,
    MODE_TAG,
    REQUESTER_TAG,
    SCOPE_TAG,
    WINDOW_TAG,
    partition_key_for,
    partition_tags,
)
from qo_ops.platform.schedule.tenants import chunk_of

log = logging.getLogger("qo_ops.api")

STALE_LAUNCH_S = 120  # an accepted run with no Dagster run after this was lost in launch
DAGSTER_FINISHED = ("SUCCESS", "FAILURE", "CANCELED")


def launch(
    api: ApiState,
    meta: service.RequestMeta,
    identity: str,
    run_id: uuid.UUID,
    rr: service.RunRequest,
) -> None:
    """Launch the accepted run ``run_id`` in Dagster and link the two; if Dagster cannot
    take it, the run ends ``failed``/``launch_failed`` (audited) and this raises ``503``."""
    spec, scope = rr.spec, rr.scope
    chunk = None
    if spec.partitioning == "tenant_day":  # its partition: the day and the tenant's chunk
        with api.engine.connect() as conn:
            chunk = chunk_of(conn, scope.tenant_id)
    key = partition_key_for(spec, scope.tenant_id, scope.window_start, chunk)
    tags = {
        **partition_tags(key),  # per dimension too, as on the runs Dagster creates itself
        JOB_RUN_TAG: str(run_id),
        MODE_TAG: rr.mode,
        REQUESTER_TAG: identity,
        SCOPE_TAG: f"{spec.name}:{scope.key}",
    }
    if scope.window_start is not None:
        tags[WINDOW_TAG] = scope.text.partition("/")[2]  # the days, the last included
    config = {  # mirrors the accepted row, so the launchpad shows what will run
        "mode": rr.mode,
        **({"reason": rr.reason} if rr.reason else {}),
        **rr.limits,
        **({"tenants": [scope.tenant_id]} if spec.partitioning == "tenant_day" else {}),
    }
    try:
        dagster_run_id = api.dagster.launch(
            spec.name, {"ops": {f"{spec.name}_op": {"config": config}}}, tags
        )
    except DagsterUnavailable as exc:
        service.record_launch_failed(api.engine, identity, run_id, str(exc), meta)
        log_event(log, logging.WARNING, "api.launch_failed", job_run_id=str(run_id), error=str(exc))
        raise ApiError(503, f"run {run_id} not started: {exc}") from None
    service.record_launch(api.engine, run_id, dagster_run_id)


def stale_reason(dagster: DagsterClient, active: dict[str, Any]) -> str | None:
    """Why an accepted run will never start, or None (it may still)."""
    if active.get("status") != RunStatus.ACCEPTED:
        return None
    if active.get("dagster_run_id"):
        state = dagster.status(active["dagster_run_id"])
        return "dagster_run_ended_before_start" if state in DAGSTER_FINISHED else None
    return "launch_lost" if float(active["age_s"]) > STALE_LAUNCH_S else None
