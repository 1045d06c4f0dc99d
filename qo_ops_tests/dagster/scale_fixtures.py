"""Helpers of the tenant-scale tests: many tenants in one statement, a planted backlog, a
planted failing tenant, a code location Dagster itself can load (for a real re-execution),
and readers of what a run left on the instance."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

import dagster as dg
import sqlalchemy as sa
from dagster._core.definitions.partitions.context import partition_loading_context
from sqlalchemy.engine import Engine

from qo_ops.dagster_defs.resources import QoOpsDatabase
from qo_ops.jobs.catalog import CATALOG
from qo_ops.platform.actions import control

SCALE_TENANTS = 10_000


def tenant_id(n: int) -> str:
    return f"scale-{n:05d}"


def insert_tenants(engine: Engine, count: int) -> list[str]:
    """``count`` tenants (scale-00001 …) in one INSERT … SELECT generate_series."""
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO tenant (id, name) "
                "SELECT format('scale-%s', lpad(g::text, 5, '0')), 'Scale tenant ' || g "
                "FROM generate_series(1, :n) g"
            ),
            {"n": count},
        )
    return [tenant_id(n) for n in range(1, count + 1)]


def plant_expired_quotes(engine: Engine, tenants: Sequence[str], per_tenant: int) -> None:
    """``per_tenant`` ACTIVE quotes past their expiry for each tenant (quote_expiration's
    backlog), in one statement."""
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO quote (tenant_id, quote_number, customer_ref, status, total_amount, "
                "price_book_version, created_at, updated_at, expires_at) "
                "SELECT t, 'BL-' || g, 'c', 'ACTIVE', 1, 2, now(), now(), now() - interval '1 day' "
                "FROM unnest(CAST(:tenants AS text[])) t, generate_series(1, :n) g"
            ),
            {"tenants": list(tenants), "n": per_tenant},
        )


def hold_lease(engine: Engine, job_name: str, scope: str) -> None:
    """A lease on (job, scope) held by another owner for an hour: a run there is skipped."""
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO job_lease VALUES (:job, :scope, 'elsewhere', 'tok', 7, "
                "now(), now(), now() + interval '1 hour', NULL)"
            ),
            {"job": job_name, "scope": scope},
        )


def suspend(engine: Engine, job_name: str, tenant: str) -> None:
    """The per-tenant kill switch, as an operator sets it."""
    control.suspend(
        engine,
        control.ControlChange(job_name, tenant, actor="test", reason="planted"),
        known_jobs=set(CATALOG),
    )


def resume(engine: Engine, job_name: str, tenant: str) -> None:
    control.resume(
        engine,
        control.ControlChange(job_name, tenant, actor="test", reason="fixed"),
        known_jobs=set(CATALOG),
    )


FAILING = "planted_expiry_fails"


def plant_failing_expiry(engine: Engine, tenant: str) -> None:
    """A constraint that the tenant's quotes cannot become EXPIRED (NOT VALID: rows already
    expired stay): quote_expiration's first batch for that tenant fails in PostgreSQL."""
    with engine.begin() as conn:
        conn.exec_driver_sql(
            f"ALTER TABLE quote ADD CONSTRAINT {FAILING} "
            f"CHECK (tenant_id <> '{tenant}' OR status <> 'EXPIRED') NOT VALID"
        )


def unplant_failing_expiry(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.exec_driver_sql(f"ALTER TABLE quote DROP CONSTRAINT {FAILING}")


def plant_missing_event(engine: Engine, tenant: str) -> None:
    """An EXPIRED quote with no QuoteExpired event: one_event_per_expired_quote must fail."""
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE quote SET status = 'EXPIRED' WHERE id = (SELECT min(id) FROM quote "
                "WHERE tenant_id = :t AND status = 'DRAFT')"
            ),
            {"t": tenant},
        )


def overdue(engine: Engine, tenant: str) -> int:
    """ACTIVE quotes of the tenant past their expiry."""
    with engine.connect() as conn:
        return int(
            conn.scalar(
                sa.text(
                    "SELECT count(*) FROM quote WHERE tenant_id = :t AND status = 'ACTIVE' "
                    "AND expires_at < now()"
                ),
                {"t": tenant},
            )
        )


def job_runs(engine: Engine, job_name: str) -> list[Any]:
    """Every job_run row of the job: id, scope, status, reason, counts, Dagster run."""
    with engine.connect() as conn:
        return list(
            conn.execute(
                sa.text(
                    "SELECT id, scope, status, status_reason, last_error_code, succeeded_count, "
                    "dagster_run_id FROM job_run WHERE job_name = :job ORDER BY created_at, scope"
                ),
                {"job": job_name},
            )
        )


def schedule_tick(
    defs: dg.Definitions, instance: dg.DagsterInstance, url: str, name: str, when: datetime
) -> Any:
    """One real evaluation of a schedule at ``when``, as the daemon makes it."""
    with (
        dg.build_schedule_context(
            instance=instance,
            scheduled_execution_time=when,
            repository_def=defs.get_repository_def(),
            resources={"database": QoOpsDatabase(url=url)},
        ) as context,
        partition_loading_context(dynamic_partitions_store=instance),
    ):
        return defs.resolve_schedule_def(name).evaluate_tick(context)


def sensor_tick(
    defs: dg.Definitions,
    instance: dg.DagsterInstance,
    url: str,
    name: str,
    cursor: str | None,
) -> Any:
    """One real evaluation of a sensor with ``cursor``, as the daemon makes it."""
    context = dg.build_sensor_context(
        instance=instance,
        cursor=cursor,
        resources={"database": QoOpsDatabase(url=url)},
        definitions=defs,
    )
    with partition_loading_context(dynamic_partitions_store=instance):
        return defs.resolve_sensor_def(name).evaluate_tick(context)


def chunk_tenants_of(request: dg.RunRequest, job_name: str) -> list[str]:
    return list(request.run_config["ops"][f"{job_name}_op"]["config"]["tenants"])


def step_failure(instance: dg.DagsterInstance, run_id: str) -> Any:
    """The run's one step failure: its user failure data (description, metadata)."""
    records = instance.all_logs(run_id, of_type=dg.DagsterEventType.STEP_FAILURE)
    assert len(records) == 1, records
    data = records[0].dagster_event.step_failure_data
    assert data.user_failure_data is not None, data.error
    return data.user_failure_data


@dg.definitions
def scale_defs() -> dg.Definitions:
    """The qo-ops code location, built when Dagster loads it (against the test's settings)."""
    from qo_ops.definitions import build_definitions

    return build_definitions()


def schedules_on_since(engine: Engine, days: int = 30) -> None:
    """Every catalog job's schedule first evaluated a tick ``days`` ago (the record a running
    schedule leaves, ``job_schedule_tick``): the jobs have been at work long enough for the
    staleness judgement (``freshness.job_due``)."""
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO job_schedule_tick (job_name, scheduled_for, decision) "
                "SELECT unnest(CAST(:jobs AS text[])), now() - make_interval(days => :days), "
                "'evaluated'"
            ),
            {"jobs": list(CATALOG), "days": days},
        )
