"""Every outcome check of every catalog job fails when its outcome is broken and passes when
it is met. Each check is tested both ways it runs:

- **at run time**: a real Dagster run of one partition (``execute_in_process``: a tenant
  job's tenant, a windowed job's day with the tenant in run config) yields an
  ``AssetCheckEvaluation`` for each check on the tenant's partition of the outcome asset;
- **on its own**: ``outcome_checks_job`` launched for the job from the Launchpad (no job
  run), which records each check's evaluation on every tenant partition and sums them up
  in its run's metadata; the code location's partitioned asset checks, executed for both
  tenant partitions, must agree. They look at every tenant and, for windowed jobs, every
  day that can hold overdue work, not only the last week.

Each test first makes the job's outcome healthy for every tenant and every day: one execute
run per tenant over all its days, through the platform's runner. Then it checks that the
outcome passes, plants a broken outcome in the database, and checks that it fails. A
breakage planted for a run must survive that run. Some runs are therefore limited with
``max_items`` and leave work behind, and others are the kind of damage a run does not
repair, such as an EXPIRED quote without its event.

``BREAKAGES`` is keyed by the catalog. A job that declares a check with no breakage case
fails ``test_every_declared_check_has_a_breakage_case``.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Connection

from qo_ops.dagster_defs.checks import OUTCOME_CHECKS_JOB, outcome_asset_key
from qo_ops.dagster_defs.freshness import RECENT_SUCCESS_CHECK
from qo_ops.demo.data import load_demo_data
from qo_ops.downstream.client import DownstreamClient
from qo_ops.downstream.local import seed_from_demo
from qo_ops.jobs.catalog import CATALOG
from qo_ops.jobs.temp_file_cleanup import GUARD_TRIGGER, OVERRIDE_ENV
from qo_ops.platform.job.options import RunOptions
from qo_ops.platform.job.outcome import BatchContext
from qo_ops.platform.job.scope import Scope, scope_text
from qo_ops.platform.job.spec import JobSpec
from qo_ops.platform.run.runner import count_eligible, run_job
from qo_ops.platform.schedule.overdue import (
    FIRST_DAY,
    backlog_scope,
    database_now,
    last_scheduled_day,
    overdue_scope,
)
from qo_ops.platform.schedule.partition_keys import partition_key_for
from qo_ops_tests.conftest import approval_config, standing_approval

TENANT = "tenant-001"
TENANT_CHUNK = "chunk-001"  # a windowed job's partition: the day and the tenant's chunk
RANGE = {  # one run over both tenants' partitions
    "dagster/asset_partition_range_start": "tenant-001",
    "dagster/asset_partition_range_end": "tenant-002",
}
OLD_LOOKBACK_DAYS = 7  # what the checks executed on their own used to look at
PARTITION_START = date(2026, 1, 1)
# the demo's audit records go back 200 days: with 150 days of retention, some age out
AUDIT_RETENTION_DAYS = "150"


@pytest.fixture
def loaded(db):
    """Demo data as of now (overrides the Dagster fixtures' fixed date): two tenants, so the
    checks executed on their own look at more than one."""
    load_demo_data(db.engine, tenants=2, quotes=400, seed=9, as_of=datetime.now(UTC))
    return db


@pytest.fixture
def env(defs, instance, loaded, downstream, tmp_path, monkeypatch):
    monkeypatch.setenv("QO_OPS_AUDIT_RETENTION_DAYS", AUDIT_RETENTION_DAYS)
    return Env(defs, instance, loaded.engine, tmp_path, monkeypatch, downstream.url)


@dataclass
class Env:
    defs: dg.Definitions
    instance: dg.DagsterInstance
    engine: sa.Engine
    home: Path
    monkeypatch: pytest.MonkeyPatch
    downstream_url: str


def _downstream_finished_orders(env: Env) -> None:
    """The fulfilment system's view: the demo's, with every in-flight order of TENANT
    completed there, so that reconciliation adopts statuses."""
    seed_from_demo(env.engine, env.downstream_url)
    with env.engine.connect() as conn:
        numbers = conn.execute(
            sa.text(
                "SELECT order_number FROM customer_order WHERE tenant_id = :t "
                "AND status IN ('SUBMITTED', 'IN_FULFILLMENT') ORDER BY id"
            ),
            {"t": TENANT},
        ).scalars()
        with DownstreamClient(env.downstream_url) as client:
            for number in numbers:
                client.put_order(number, TENANT, "COMPLETED")


PREPARE = {"order_reconciliation": _downstream_finished_orders}  # before the job heals


# ------------------------------------------------------------------------------ running


def heal(env: Env, spec: JobSpec) -> None:
    """Make the job's outcome healthy: one execute run per tenant over all its days."""
    if spec.name in PREPARE:
        PREPARE[spec.name](env)
    with env.engine.connect() as conn:
        now = database_now(conn)
        tenants = conn.execute(sa.text("SELECT id FROM tenant ORDER BY id")).scalars().all()
    with env.monkeypatch.context() as patch:
        patch.setenv(OVERRIDE_ENV, "1")  # catching up on every day at once is the anomaly
        for tenant in tenants:
            summary = run_job(
                spec,
                backlog_scope(spec, tenant, now),
                RunOptions(
                    mode="execute",
                    reason="test: heal every day",
                    batch_size=2000,
                    approval=standing_approval(spec.name),
                ),
                engine=env.engine,
            )
            assert summary.status in ("success", "no_work", "partial_success"), summary


@dataclass
class Judged:
    """A job's declared checks judged on their own: each check's evaluation of each tenant
    partition, and the run's summed-up metadata (its output, or its failure's)."""

    evaluations: dict[tuple[str, str], dg.AssetCheckEvaluation]
    summary: dict[str, Any]
    success: bool
    failure: str | None

    def of(self, check: str) -> dict[str, dg.AssetCheckEvaluation]:
        """The check's evaluation by tenant."""
        return {t: e for (c, t), e in self.evaluations.items() if c == check}


def _per_tenant(result: dg.ExecuteInProcessResult) -> dict[tuple[str, str], Any]:
    evaluations = result.get_asset_check_evaluations()
    assert all(e.partition is not None for e in evaluations), "each on a tenant partition"
    by_key = {(e.check_name, e.partition): e for e in evaluations}
    assert len(by_key) == len(evaluations), "one per check and tenant"
    return by_key


def standalone(env: Env, spec: JobSpec) -> Judged:
    """The job's checks judged on their own for every tenant, as a person does from the
    Launchpad (``outcome_checks_job``); the code location's partitioned asset checks,
    executed for both tenant partitions, judge every tenant the same way."""
    result = env.defs.resolve_job_def(OUTCOME_CHECKS_JOB).execute_in_process(
        instance=env.instance,
        run_config={"ops": {"outcome_checks_op": {"config": {"job": spec.name}}}},
        raise_on_error=False,
    )
    evaluations = _per_tenant(result)
    assert sorted(evaluations) == sorted(
        (c.name, t) for c in spec.checks for t in ("tenant-001", "tenant-002")
    )
    failure = next((e for e in result.all_events if e.is_step_failure), None)
    if failure is None:
        output = next(e for e in result.all_events if e.event_type_value == "STEP_OUTPUT")
        metadata = output.event_specific_data.metadata
        described = None
    else:
        data = failure.step_failure_data.user_failure_data
        metadata, described = (data.metadata, data.description) if data else ({}, None)
    judged = Judged(
        evaluations, {k: v.value for k, v in metadata.items()}, result.success, described
    )

    asset = outcome_asset_key(spec)  # the asset checks themselves, for the tenant partitions
    keys = {dg.AssetCheckKey(asset, c.name) for c in spec.checks}
    checks = env.defs.resolve_implicit_global_asset_job_def().get_subset(
        asset_selection=set(), asset_check_selection=keys
    )
    ranged = checks.execute_in_process(instance=env.instance, tags=RANGE, raise_on_error=False)
    verdicts = {k: e.passed for k, e in _per_tenant(ranged).items()}
    assert verdicts == {k: e.passed for k, e in evaluations.items()}
    return judged


def tenant_config(spec: JobSpec) -> dict[str, Any]:
    """A windowed job's run names its tenant in run config (its partition is the day)."""
    return {"tenants": [TENANT]} if spec.partitioning == "tenant_day" else {}


def own_reason() -> str:
    """A reason for one execute: a Dagster execute may not repeat an earlier one's."""
    return f"test {uuid.uuid4().hex[:8]}"


def run_partition(
    env: Env, spec: JobSpec, partition: str, config: dict[str, Any]
) -> dict[str, dg.AssetCheckEvaluation]:
    """One real Dagster execute run of ``partition`` for TENANT; its check evaluations (on
    the tenant's partition of the outcome asset) by name."""
    result = env.defs.resolve_job_def(spec.name).execute_in_process(
        partition_key=partition,
        instance=env.instance,
        run_config={
            "ops": {
                f"{spec.name}_op": {
                    "config": {
                        "mode": "execute",
                        "reason": own_reason(),
                        **approval_config(spec.name),
                        **tenant_config(spec),
                        **config,
                    }
                }
            }
        },
        raise_on_error=False,
    )
    evaluations = {e.check_name: e for e in result.get_asset_check_evaluations()}
    assert {e.partition for e in evaluations.values()} == {TENANT}
    evaluations.pop(RECENT_SUCCESS_CHECK, None)  # the job's success, not its outcome
    assert set(evaluations) == {c.name for c in spec.checks}, "the run checked its outcome"
    return evaluations


def value(evaluation: dg.AssetCheckEvaluation, key: str) -> Any:
    return evaluation.metadata[key].value


# ------------------------------------------------------------------------------ days

# Per windowed job: the tenant's days that hold what its breakages change, with how much.
DAYS_WITH_DATA = {
    "read_model_repair": "SELECT (submitted_at AT TIME ZONE 'UTC')::date AS day, count(*) AS n "
    "FROM customer_order WHERE tenant_id = :t GROUP BY 1",
    "pricing_snapshot_recalculation": "SELECT (created_at AT TIME ZONE 'UTC')::date AS day, "
    "count(*) AS n FROM quote WHERE tenant_id = :t GROUP BY 1",
    "order_reconciliation": "SELECT (o.submitted_at AT TIME ZONE 'UTC')::date AS day, "
    "count(*) AS n FROM reconciliation_result r JOIN customer_order o ON o.id = r.order_id "
    "WHERE r.tenant_id = :t AND r.action = 'adopt_status' AND r.outcome = 'corrected' "
    "AND o.status IN ('COMPLETED', 'CANCELLED', 'FAILED') GROUP BY 1",
    "audit_archive": "SELECT (window_start AT TIME ZONE 'UTC')::date AS day, count(*) AS n "
    "FROM audit_archive_manifest WHERE tenant_id = :t AND status = 'VERIFIED' GROUP BY 1",
    # new files are planted: a day past retention + grace, and one far older
    "temp_file_cleanup": "SELECT (now() AT TIME ZONE 'UTC')::date - d AS day, 3 - d / 20 AS n "
    "FROM unnest(ARRAY[12, 40]) AS d",
}


def due_days(env: Env, spec: JobSpec, need: int = 1, old_need: int = 1) -> tuple[date, date]:
    """(a day for the run: the fullest day, among partitions whose work is due, with at
    least ``need`` items; an old day: the oldest day with at least ``old_need`` items,
    beyond the old lookback)."""
    with env.engine.connect() as conn:
        last_due = last_scheduled_day(spec, database_now(conn))
        days = conn.execute(sa.text(DAYS_WITH_DATA[spec.name]), {"t": TENANT}).all()
    due = [(d.day, d.n) for d in days if d.day <= last_due]
    run_day = max((d for d in due if d[0] >= PARTITION_START), key=lambda d: (d[1], d[0]))
    old_day = min(d for d in due if d[1] >= old_need)[0]
    assert run_day[1] >= need, f"{spec.name}: no partition with {need} items: {due}"
    assert old_day < last_due - timedelta(days=OLD_LOOKBACK_DAYS + 1), (old_day, last_due)
    return run_day[0], old_day


# ------------------------------------------------------------------------------ breakages


@dataclass(frozen=True)
class Plant:
    """Where to plant: the tenant, its day (windowed jobs), and QO_OPS_HOME."""

    conn: Connection
    tenant: str
    day: date | None
    home: Path

    def bounds(self) -> dict[str, Any]:
        assert self.day is not None
        start = datetime.combine(self.day, datetime.min.time(), UTC)
        return {"t": self.tenant, "start": start, "end": start + timedelta(days=1)}

    def sql(self, statement: str, **params: Any) -> sa.CursorResult[Any]:
        return self.conn.execute(sa.text(statement), {"t": self.tenant, **params})


@dataclass(frozen=True)
class Breakage:
    """One way to break ``job``'s outcome that ``check`` must catch. ``run_config`` limits
    the run-time run so that part of the breakage outlives it."""

    job: str
    check: str
    name: str
    plant: Callable[[Plant], None]
    run_config: dict[str, Any] = field(default_factory=dict)
    run_time: bool = True
    standalone: bool = True
    min_items: int = 1  # what the plant changes needs a day with this many items

    @property
    def id(self) -> str:
        return f"{self.job}.{self.check}.{self.name}"


LIMITED = {"max_items": 1, "batch_size": 1}  # the run handles one item and leaves the rest


def _active_quotes_past_expiry(p: Plant) -> None:
    p.sql(
        "UPDATE quote SET status = 'ACTIVE', expires_at = now() - interval '2 hours' "
        "WHERE id IN (SELECT id FROM quote WHERE tenant_id = :t AND status = 'DRAFT' "
        "ORDER BY id LIMIT 3)"
    )


def _expired_quote_without_event(p: Plant) -> None:
    p.sql(
        "UPDATE quote SET status = 'EXPIRED' WHERE id = (SELECT min(id) FROM quote "
        "WHERE tenant_id = :t AND status = 'DRAFT')"
    )


def _second_event(aggregate: str, event_type: str) -> Callable[[Plant], None]:
    def plant(p: Plant) -> None:
        inserted = p.sql(
            "INSERT INTO outbox_event (id, business_key, tenant_id, aggregate_type, "
            "aggregate_id, event_type, payload, created_at, available_at) "
            "SELECT gen_random_uuid(), business_key || '#again', tenant_id, aggregate_type, "
            "aggregate_id, event_type, payload, now(), now() FROM outbox_event "
            "WHERE tenant_id = :t AND aggregate_type = :agg AND event_type = :type "
            "ORDER BY aggregate_id LIMIT 1",
            agg=aggregate,
            type=event_type,
        )
        assert inserted.rowcount == 1

    return plant


def _idle_open_checkouts(p: Plant) -> None:
    p.sql(
        "UPDATE checkout_session SET status = 'OPEN', closed_at = NULL, "
        "last_activity_at = now() - interval '30 hours' WHERE id IN (SELECT id FROM "
        "checkout_session WHERE tenant_id = :t AND status = 'COMPLETED' ORDER BY id LIMIT 3)"
    )


def _abandoned_checkout_without_event(p: Plant) -> None:
    # closed hours after its last activity, as the job closes them, but with no event
    p.sql(
        "UPDATE checkout_session SET status = 'ABANDONED', "
        "closed_at = last_activity_at + interval '2 hours' WHERE id = (SELECT min(id) FROM "
        "checkout_session WHERE tenant_id = :t AND status = 'COMPLETED')"
    )


def _deliveries_past_slo(p: Plant) -> None:
    p.sql(
        "UPDATE delivery_attempt_item SET status = 'READY', "
        "next_attempt_at = now() - interval '1 hour' WHERE id IN (SELECT id FROM "
        "delivery_attempt_item WHERE tenant_id = :t AND status = 'DELIVERED' ORDER BY id LIMIT 3)"
    )


def _events_past_slo(p: Plant) -> None:
    p.sql(
        "UPDATE outbox_event SET published_at = NULL, available_at = now() - interval '1 hour' "
        "WHERE id IN (SELECT id FROM outbox_event WHERE tenant_id = :t "
        "AND published_at IS NOT NULL ORDER BY id LIMIT 3)"
    )


def _stale_cache_entries(p: Plant) -> None:
    p.sql(
        "UPDATE catalog_item SET version = version + 1, updated_at = now() WHERE id IN "
        "(SELECT id FROM catalog_item WHERE tenant_id = :t ORDER BY id LIMIT 3)"
    )


def _expired_run_history(p: Plant) -> None:
    # three old dry runs of a scope, followed by a newer one: none of them must be kept
    p.sql(
        "INSERT INTO job_run (id, job_name, scope, mode, trigger_type, owner_id, status, "
        "started_at, finished_at) SELECT gen_random_uuid(), 'quote_expiration', :t, 'dry_run', "
        "'schedule', 'planted', 'success', now() - d * interval '1 day', "
        "now() - d * interval '1 day' FROM unnest(ARRAY[200, 201, 202, 1]) AS d"
    )


def _adopted_orders_back_in_flight(p: Plant) -> None:
    # orders whose status the job adopted from the downstream are in flight again
    changed = p.sql(
        "UPDATE customer_order o SET status = 'IN_FULFILLMENT' FROM reconciliation_result r "
        "WHERE r.order_id = o.id AND r.tenant_id = :t AND r.action = 'adopt_status' "
        "AND r.outcome = 'corrected' AND o.submitted_at >= :start AND o.submitted_at < :end",
        **p.bounds(),
    )
    assert changed.rowcount >= 1


def _drifted_read_models(p: Plant) -> None:
    changed = p.sql(
        "UPDATE order_read_model r SET total_amount = r.total_amount + 1 FROM customer_order o "
        "WHERE o.id = r.order_id AND o.tenant_id = :t AND o.submitted_at >= :start "
        "AND o.submitted_at < :end",
        **p.bounds(),
    )
    assert changed.rowcount >= 1


def _missing_snapshots(p: Plant) -> None:
    # every quote of the day but its first loses its current snapshot
    deleted = p.sql(
        "DELETE FROM pricing_snapshot s USING price_book b WHERE b.tenant_id = :t "
        "AND b.is_current AND s.price_book_version = b.version AND s.quote_id IN "
        "(SELECT id FROM quote WHERE tenant_id = :t AND created_at >= :start "
        "AND created_at < :end ORDER BY created_at, id OFFSET 1)",
        **p.bounds(),
    )
    assert deleted.rowcount >= 1


def _malformed_manifest(p: Plant) -> None:
    # a VERIFIED archive claims more records than its id range can hold
    changed = p.sql(
        "UPDATE audit_archive_manifest SET row_count = max_record_id - min_record_id + 2 "
        "WHERE id = (SELECT id FROM audit_archive_manifest WHERE tenant_id = :t "
        "AND status = 'VERIFIED' AND window_start >= :start AND window_start < :end "
        "ORDER BY min_record_id LIMIT 1)",
        **p.bounds(),
    )
    assert changed.rowcount == 1


def _record_in_both_places(p: Plant) -> None:
    # an archived record is back in the source, its archive still VERIFIED
    inserted = p.sql(
        "INSERT INTO audit_record (id, tenant_id, occurred_at, actor_ref, action, entity_type, "
        "entity_id) SELECT min_record_id, tenant_id, window_start + interval '1 minute', "
        "'planted', 'planted', 'planted', 'planted' FROM audit_archive_manifest "
        "WHERE tenant_id = :t AND status = 'VERIFIED' AND window_start >= :start "
        "AND window_start < :end ORDER BY min_record_id LIMIT 1",
        **p.bounds(),
    )
    assert inserted.rowcount == 1


def _altered_archive_file(p: Plant) -> None:
    path = p.sql(
        "SELECT file_path FROM audit_archive_manifest WHERE tenant_id = :t "
        "AND status = 'VERIFIED' AND window_start >= :start AND window_start < :end "
        "ORDER BY min_record_id LIMIT 1",
        **p.bounds(),
    ).scalar_one()
    with (p.home / path).open("ab") as f:
        f.write(b"\0")


def _held_file_deleted(p: Plant) -> None:
    p.sql(
        "INSERT INTO temp_file_tombstone (temp_file_id, tenant_id, storage_path, size_bytes, "
        "file_status, file_created_at, legal_hold, job_run_id, reason, deleted_at) VALUES "
        "(-1, :t, 'planted/held.bin', 10, 'COMPLETED', :start + interval '12 hours', true, "
        "gen_random_uuid(), 'planted', now())",
        **p.bounds(),
    )


def _guard_trigger_disabled(p: Plant) -> None:
    p.conn.exec_driver_sql(f"ALTER TABLE temp_file DISABLE TRIGGER {GUARD_TRIGGER}")


def _temp_files(p: Plant, n: int, prefix: str) -> None:
    p.sql(
        "INSERT INTO temp_file (tenant_id, storage_path, size_bytes, status, legal_hold, "
        "created_at) SELECT :t, :prefix || '/' || :t || '/' || k || '.bin', 10, 'COMPLETED', "
        "false, :start + interval '12 hours' + k * interval '1 second' "
        "FROM generate_series(1, :n) AS k",
        prefix=prefix,
        n=n,
        **p.bounds(),
    )


def _files_past_retention(p: Plant) -> None:
    _temp_files(p, 3, f"planted-{uuid.uuid4().hex[:8]}")


def _anomalous_amount_eligible(p: Plant) -> None:
    # more files eligible than the tenant has otherwise: above the share threshold (0.5)
    others = p.sql("SELECT count(*) FROM temp_file WHERE tenant_id = :t").scalar_one()
    _temp_files(p, others + 5, f"planted-{uuid.uuid4().hex[:8]}")


def _object_left_after_delete(p: Plant) -> None:
    path = f"planted/{uuid.uuid4().hex}.bin"
    p.sql(
        "INSERT INTO temp_file_tombstone (temp_file_id, tenant_id, storage_path, size_bytes, "
        "file_status, file_created_at, legal_hold, job_run_id, reason, deleted_at) VALUES "
        "(-2, :t, :path, 3, 'COMPLETED', :start + interval '12 hours', false, "
        "gen_random_uuid(), 'planted', now())",
        path=path,
        **p.bounds(),
    )
    stored = p.home / "objects" / path
    stored.parent.mkdir(parents=True, exist_ok=True)
    stored.write_bytes(b"old")


BREAKAGES = (
    Breakage(
        "quote_expiration",
        "no_overdue_active_quotes",
        "active_quotes_past_expiry",
        _active_quotes_past_expiry,
        LIMITED,
    ),
    Breakage(
        "quote_expiration",
        "one_event_per_expired_quote",
        "expired_quote_without_event",
        _expired_quote_without_event,
    ),
    Breakage(
        "quote_expiration",
        "one_event_per_expired_quote",
        "duplicate_event",
        _second_event("quote", "QuoteExpired"),
    ),
    Breakage(
        "abandoned_checkout_close",
        "no_idle_open_checkouts",
        "idle_open_checkouts",
        _idle_open_checkouts,
        LIMITED,
    ),
    Breakage(
        "abandoned_checkout_close",
        "one_event_per_abandoned_checkout",
        "abandoned_without_event",
        _abandoned_checkout_without_event,
    ),
    Breakage(
        "abandoned_checkout_close",
        "one_event_per_abandoned_checkout",
        "duplicate_event",
        _second_event("checkout", "CheckoutAbandoned"),
    ),
    Breakage(
        "delivery_retry",
        "no_delivery_past_lag_slo",
        "deliveries_past_slo",
        _deliveries_past_slo,
        LIMITED,
    ),
    Breakage(
        "notification_publish",
        "oldest_unpublished_within_slo",
        "events_past_slo",
        _events_past_slo,
        LIMITED,
    ),
    Breakage(
        "catalog_cache_refresh",
        "cache_versions_match_source",
        "stale_cache_entries",
        _stale_cache_entries,
        LIMITED,
    ),
    Breakage(
        "run_history_retention",
        "no_expired_run_history",
        "expired_run_history",
        _expired_run_history,
        LIMITED,
    ),
    Breakage(
        "order_reconciliation",
        "no_repaired_order_still_mismatched",
        "adopted_orders_back_in_flight",
        _adopted_orders_back_in_flight,
        LIMITED,
    ),
    Breakage(
        "read_model_repair",
        "read_model_matches_source",
        "drifted_read_models",
        _drifted_read_models,
        LIMITED,
    ),
    Breakage(
        "pricing_snapshot_recalculation",
        "current_snapshot_for_every_quote",
        "missing_snapshots",
        _missing_snapshots,
        LIMITED,
        min_items=2,  # the day's first quote keeps its snapshot
    ),
    Breakage(
        "audit_archive",
        "archive_accounts_for_every_record",
        "malformed_manifest",
        _malformed_manifest,
    ),
    Breakage(  # a run would archive the record a second time: only standalone sees it stay
        "audit_archive",
        "archive_accounts_for_every_record",
        "record_in_both_places",
        _record_in_both_places,
        run_time=False,
    ),
    Breakage("audit_archive", "archives_verify", "altered_archive_file", _altered_archive_file),
    Breakage("temp_file_cleanup", "no_legal_hold_removed", "held_file_deleted", _held_file_deleted),
    Breakage(
        "temp_file_cleanup",
        "no_legal_hold_removed",
        "guard_trigger_disabled",
        _guard_trigger_disabled,
    ),
    Breakage(
        "temp_file_cleanup",
        "nothing_eligible_past_grace",
        "files_past_retention_and_grace",
        _files_past_retention,
        LIMITED,
    ),
    Breakage(
        "temp_file_cleanup",
        "deleted_objects_gone",
        "object_left_after_delete",
        _object_left_after_delete,
    ),
    Breakage(
        "temp_file_cleanup",
        "eligible_within_anomaly_threshold",
        "anomalous_amount_eligible",
        _anomalous_amount_eligible,
    ),
)


def _cases(kind: str) -> list[Any]:
    return [pytest.param(b, id=b.id) for b in BREAKAGES if getattr(b, kind)]


def test_every_declared_check_has_a_breakage_case():
    """A check the catalog declares is proven both ways; a case names a declared check."""
    declared = {(spec.name, check.name) for spec in CATALOG.values() for check in spec.checks}
    for kind in ("run_time", "standalone"):
        covered = {(b.job, b.check) for b in BREAKAGES if getattr(b, kind)}
        assert declared - covered == set(), f"checks with no {kind} breakage case"
    assert {(b.job, b.check) for b in BREAKAGES} <= declared, "a case for an undeclared check"
    assert len({b.id for b in BREAKAGES}) == len(BREAKAGES)


def plant(env: Env, breakage: Breakage, day: date | None) -> None:
    with env.engine.begin() as conn:
        breakage.plant(Plant(conn, TENANT, day, env.home))


@pytest.mark.parametrize("breakage", _cases("run_time"))
def test_a_run_fails_its_check_when_the_outcome_is_broken(env, breakage):
    spec = CATALOG[breakage.job]
    heal(env, spec)
    # a limited run must leave some of the breakage behind: a day with two items or more
    need = 2 if breakage.run_config.get("max_items") else 1
    day = due_days(env, spec, need)[0] if spec.partitioning == "tenant_day" else None
    partition = partition_key_for(spec, TENANT, day, TENANT_CHUNK)

    healthy = run_partition(env, spec, partition, breakage.run_config)
    assert healthy[breakage.check].passed, healthy[breakage.check].metadata

    plant(env, breakage, day)
    broken = run_partition(env, spec, partition, breakage.run_config)
    evaluation = broken[breakage.check]
    assert evaluation.passed is False, evaluation.metadata
    assert value(evaluation, "scope").startswith(TENANT)
    declared = next(c for c in spec.checks if c.name == breakage.check)
    severity = dg.AssetCheckSeverity.ERROR if declared.blocking else dg.AssetCheckSeverity.WARN
    assert evaluation.severity == severity


@pytest.mark.parametrize("breakage", _cases("standalone"))
def test_the_check_on_its_own_fails_when_the_outcome_is_broken(env, breakage):
    spec = CATALOG[breakage.job]
    heal(env, spec)
    healthy = standalone(env, spec)
    assert healthy.success, healthy.failure
    assert all(e.passed for e in healthy.evaluations.values()), {
        k: {m: v.value for m, v in e.metadata.items()}
        for k, e in healthy.evaluations.items()
        if not e.passed
    }
    assert healthy.summary["tenants_checked"] == 2
    assert healthy.summary[f"{breakage.check}_failing_tenants"] == "none"

    # windowed jobs: on the oldest day with data, far older than a week
    old_need = breakage.min_items
    day = due_days(env, spec, old_need=old_need)[1] if spec.partitioning == "tenant_day" else None
    plant(env, breakage, day)
    broken = standalone(env, spec)
    judged = broken.of(breakage.check)  # each tenant on its own partition
    assert judged[TENANT].passed is False, judged[TENANT].metadata
    failing = broken.summary[f"{breakage.check}_failing_tenants"].split(", ")
    assert failing[0] == TENANT  # the summary names the partitions that failed
    assert sorted(t for t, e in judged.items() if not e.passed) == sorted(failing)
    # a blocking check failing on any tenant fails the run, naming the tenant
    blocking = {c.name for c in spec.checks if c.blocking}
    blocked = sorted(
        {t for (c, t), e in broken.evaluations.items() if c in blocking and not e.passed}
    )
    assert broken.success is not bool(blocked)
    if breakage.check in blocking:
        assert blocked and TENANT in (broken.failure or "")
    if day is not None:
        mine = judged[TENANT]
        assert value(mine, "first_day") <= day.isoformat() <= value(mine, "last_day")


@pytest.mark.parametrize(
    "breakage",
    [
        pytest.param(b, id=b.id)
        for b in BREAKAGES
        if b.run_time and CATALOG[b.job].partitioning == "tenant"  # ranges are of tenants
    ],
)
def test_a_run_over_many_tenants_fails_the_check_naming_the_broken_one(env, breakage):
    """A range run yields each check's evaluation on each tenant's partition: it fails on
    the tenant whose outcome is broken, and only there."""
    spec = CATALOG[breakage.job]
    heal(env, spec)
    plant(env, breakage, None)
    result = env.defs.resolve_job_def(spec.name).execute_in_process(
        instance=env.instance,
        run_config={
            "ops": {
                f"{spec.name}_op": {
                    "config": {
                        "mode": "execute",
                        "reason": own_reason(),
                        **approval_config(spec.name),
                        **breakage.run_config,
                    }
                }
            }
        },
        tags=RANGE,
        raise_on_error=False,
    )
    evaluations = {(e.check_name, e.partition): e for e in result.get_asset_check_evaluations()}
    judged = {t: e for (c, t), e in evaluations.items() if c == breakage.check}
    assert sorted(judged) == ["tenant-001", "tenant-002"]
    assert [t for t, e in judged.items() if not e.passed] == [TENANT]
    assert value(judged[TENANT], "scope") == TENANT


def test_a_bad_setting_fails_the_checks_on_their_own_with_one_line(env):
    """A check that cannot read its settings cannot judge the outcome: failed, and why."""
    spec = CATALOG["temp_file_cleanup"]
    env.monkeypatch.setenv("QO_OPS_TEMP_FILE_RETENTION_DAYS", "seven")
    judged = standalone(env, spec)
    assert all(e.passed is False for e in judged.evaluations.values())  # every check, tenant
    description = judged.evaluations["nothing_eligible_past_grace", TENANT].description or ""
    assert description.startswith("cannot check: QO_OPS_TEMP_FILE_RETENTION_DAYS")
    assert "\n" not in description and "Traceback" not in description
    assert not judged.success and judged.failure == description  # the run fails, one line


# ------------------------------------------------------------------------------ the range


def test_the_days_that_can_hold_overdue_work_end_where_the_schedule_has_run():
    """A daily schedule's tick runs one day; the day counts as due once that tick is a start
    window (1 h) and a run deadline (1 h) old. Retention jobs run the day that just aged
    out, so their last due day lies retention + 1 days before the tick."""
    repair, cleanup = CATALOG["read_model_repair"], CATALOG["temp_file_cleanup"]
    assert (
        repair.deployment.cron_schedule == "30 2 * * *"
        and cleanup.deployment.cron_schedule == "15 3 * * *"
    )
    at = datetime(2026, 3, 10, tzinfo=UTC)
    # before 04:30 the 02:30 tick of the 10th may still be running: the 9th is not due yet
    assert last_scheduled_day(repair, at.replace(hour=4, minute=29)) == date(2026, 3, 8)
    assert last_scheduled_day(repair, at.replace(hour=4, minute=31)) == date(2026, 3, 9)
    # retention 7 days: the tick of the 10th runs the 2nd, whose files are then 8 days old
    assert last_scheduled_day(cleanup, at.replace(hour=5, minute=16)) == date(2026, 3, 2)
    scope = overdue_scope(cleanup, TENANT, at.replace(hour=5, minute=16))
    assert (scope.window_start, scope.window_end) == (FIRST_DAY, date(2026, 3, 3))
    assert overdue_scope(CATALOG["quote_expiration"], TENANT, at).window_start is None


def test_the_check_on_its_own_counts_a_day_once_its_scheduled_run_is_due(env):
    """Drift on an order of the day after the last due day is not overdue yet (its run has
    not come); on the last due day it is."""
    spec = CATALOG["read_model_repair"]
    heal(env, spec)
    with env.engine.connect() as conn:
        last_due = last_scheduled_day(spec, database_now(conn))
    for day, passes in ((last_due + timedelta(days=1), True), (last_due, False)):
        with env.engine.begin() as conn:
            conn.execute(
                sa.text(
                    "UPDATE customer_order SET submitted_at = :at WHERE id = (SELECT min(id) "
                    "FROM customer_order WHERE tenant_id = :t)"
                ),
                {"t": TENANT, "at": datetime.combine(day, datetime.min.time(), UTC)},
            )
            conn.execute(
                sa.text(
                    "UPDATE order_read_model SET total_amount = total_amount + 1 "
                    "WHERE order_id = (SELECT min(id) FROM customer_order WHERE tenant_id = :t)"
                ),
                {"t": TENANT},
            )
        judged = standalone(env, spec)
        evaluation = judged.evaluations["read_model_matches_source", TENANT]
        assert evaluation.passed is passes, (day, evaluation.metadata)
        assert value(evaluation, "last_day") == last_due.isoformat()


# ------------------------------------------------------------------------------ backlog

# The tenant's whole backlog, counted here independently of the jobs' selections.
TENANT_BACKLOG = {
    "temp_file_cleanup": "SELECT count(*) FROM temp_file WHERE tenant_id = :t AND NOT legal_hold "
    "AND status IN ('COMPLETED', 'FAILED_TERMINAL') AND created_at < now() - interval '7 days'",
    "read_model_repair": "SELECT count(*) FROM customer_order o LEFT JOIN order_read_model r "
    "ON r.order_id = o.id WHERE o.tenant_id = :t AND (r.order_id IS NULL OR (r.status, "
    "r.total_amount, r.line_count, r.order_number, r.source_version) IS DISTINCT FROM "
    "(o.status, o.total_amount, o.line_count, o.order_number, o.version))",
    "audit_archive": "SELECT count(*) FROM audit_record WHERE tenant_id = :t "
    f"AND occurred_at < now() - interval '{AUDIT_RETENTION_DAYS} days'",
}


@pytest.mark.parametrize("job_name", sorted(TENANT_BACKLOG))
def test_a_windowed_run_plots_the_tenants_whole_backlog(env, job_name):
    """After a run of one day, the asset's backlog point is what is left on every day of the
    tenant, not the run's window (which the run just emptied)."""
    spec = CATALOG[job_name]
    with env.engine.connect() as conn:
        last_due = last_scheduled_day(spec, database_now(conn))
        day = next(
            last_due - timedelta(days=back)
            for back in range(200)
            if count_eligible(
                conn,
                spec,
                BatchContext(
                    spec.name,
                    Scope(
                        TENANT, last_due - timedelta(days=back), last_due - timedelta(days=back - 1)
                    ),
                    "dry_run",
                    uuid.uuid4(),
                ),
            )
        )
    result = env.defs.resolve_job_def(job_name).execute_in_process(
        partition_key=partition_key_for(spec, TENANT, day, TENANT_CHUNK),
        instance=env.instance,
        run_config={
            "ops": {
                f"{job_name}_op": {
                    "config": {
                        "mode": "execute",
                        "reason": own_reason(),
                        **approval_config(spec.name),
                        **tenant_config(spec),
                    }
                }
            }
        },
        raise_on_error=False,
    )
    summary = result.output_for_node(f"{job_name}_op")
    assert summary["backlog"] == 0  # the run's own window is done
    with env.engine.connect() as conn:
        left = conn.execute(sa.text(TENANT_BACKLOG[job_name]), {"t": TENANT}).scalar_one()
    assert left > 0
    # the run kept the outcome right: it materializes the tenant's partition
    (point,) = [
        r.asset_materialization
        for r in env.instance.fetch_materializations(outcome_asset_key(spec), limit=10).records
        if r.run_id == result.run_id
    ]
    assert point.metadata["backlog"].value == left
    assert point.partition == TENANT
    assert point.metadata["run_scope"].value == scope_text(summary["scope"])
    if spec.signals.lag is not None:  # and its age is the oldest of them, however old its day
        assert point.metadata["oldest_due_age_s"].value > (last_due - day).days * 86400
