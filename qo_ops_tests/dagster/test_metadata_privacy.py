"""No report or observation carries personal data, a credential or a payload.

A full demo through real Dagster execution (every catalog job dry-run and executed, a range
run, a run whose outcome check fails, a refused run, a tick of every sensor with its
observations recorded as the daemon records them), then every string and number of every
event Dagster stored is searched for what the demo database holds about people (customer,
recipient and actor references), for the payloads the jobs move (outbox events, fulfilment
requests, cache entries, audit details: their texts and their key sets), for API tokens,
passwords, connection URLs and bearer credentials. The forbidden values are read from the
database, so the test follows the demo data. A second test plants each kind of leak in a
run's output and in observations and shows that the search finds every one.
"""

from __future__ import annotations

from typing import Any

import dagster as dg
import pandas as pd
import pytest
import sqlalchemy as sa
from dagster._core.definitions.partitions.context import partition_loading_context

from qo_ops.dagster_defs.resources import QoOpsDatabase
from qo_ops.jobs.catalog import CATALOG
from qo_ops_tests.conftest import approval_config
from qo_ops_tests.dagster.event_metadata import event_values, find_leaks, forbidden_values
from qo_ops_tests.dagster.test_jobs import tenant_config, work_partition

SPECS = sorted(CATALOG)


def _execute(
    defs, instance, job_name: str, config: dict, **kwargs: Any
) -> dg.ExecuteInProcessResult:
    return defs.resolve_job_def(job_name).execute_in_process(
        instance=instance,
        run_config={"ops": {f"{job_name}_op": {"config": config}}},
        raise_on_error=False,
        **kwargs,
    )


def _tick_every_sensor(defs, instance, loaded) -> int:
    """One tick of each sensor (not the run-failure hook); their asset events recorded as the
    daemon records them. Returns how many asset events they gave."""
    reported = 0
    for sensor in defs.sensors:
        if isinstance(sensor, dg.RunStatusSensorDefinition):
            continue
        context = dg.build_sensor_context(
            instance=instance,
            resources={"database": QoOpsDatabase(url=loaded.env_url)},
            definitions=defs,
        )
        with partition_loading_context(dynamic_partitions_store=instance):
            result = sensor.evaluate_tick(context)
        for event in result.asset_events:
            instance.report_runless_asset_event(event)
            reported += 1
    return reported


def test_no_report_or_observation_carries_personal_data(defs, instance, loaded):
    results = []
    for job_name in SPECS:
        partition = work_partition(loaded, job_name)
        for config in (
            {"mode": "dry_run"},
            {
                "mode": "execute",
                "reason": f"privacy test: {job_name}",
                "batch_size": 25,
                **approval_config(job_name),
            },
        ):
            config |= tenant_config(job_name)  # a windowed job's day names its tenant
            results.append(_execute(defs, instance, job_name, config, partition_key=partition))
    assert all(r.success for r in results), [r.run_id for r in results if not r.success]

    ranged = _execute(  # one run over both tenants
        defs,
        instance,
        "abandoned_checkout_close",
        {"mode": "execute", "reason": "privacy test: both tenants"},
        tags={
            "dagster/asset_partition_range_start": "tenant-001",
            "dagster/asset_partition_range_end": "tenant-002",
        },
    )
    assert ranged.success
    with loaded.engine.begin() as conn:  # an EXPIRED quote that never got its event
        conn.execute(
            sa.text(
                "UPDATE quote SET status = 'EXPIRED' WHERE id = (SELECT min(id) FROM quote "
                "WHERE tenant_id = 'tenant-002' AND status = 'DRAFT')"
            )
        )
    broken = _execute(
        defs,
        instance,
        "quote_expiration",
        {"mode": "execute", "reason": "privacy test: a broken outcome"},
        partition_key="tenant-002",
    )
    assert not broken.success  # the blocking outcome check failed: the failure carries a report
    refused = _execute(
        defs, instance, "quote_expiration", {"mode": "execute"}, partition_key="tenant-001"
    )
    assert not refused.success  # executing by hand needs a reason
    sensor_events = _tick_every_sensor(defs, instance, loaded)

    forbidden = forbidden_values(loaded.engine, loaded.url.password)
    assert len(forbidden.references) > 500 and len(forbidden.payload_keys) >= 4  # a real demo
    found = event_values(instance)
    leaks = find_leaks(found, forbidden)
    assert not leaks, "\n".join(leaks)

    # and the search did read the reports: every run's output or failure, its observation,
    # its checks, and what the sensors observed
    assert found.event_types["STEP_OUTPUT"] == len(results) + 1
    assert found.event_types["STEP_FAILURE"] == 2
    assert found.event_types["ASSET_CHECK_EVALUATION"] > 0
    # each run's outcome on its tenant's partition: materialized by an execute run that kept
    # it right, observed otherwise (a dry run)
    outcomes = found.event_types["ASSET_OBSERVATION"] + found.event_types["ASSET_MATERIALIZATION"]
    assert found.event_types["ASSET_MATERIALIZATION"] > 0
    assert outcomes >= len(results) + sensor_events
    assert sensor_events > 0
    assert found.metadata_labels["report"] >= len(results) + 1


def _table(rows: list[dict[str, Any]]) -> dg.TableMetadataValue:
    frame = pd.DataFrame(rows, columns=["kind", "name", "count", "detail"])
    return dg.MetadataValue.table(
        [dg.TableRecord(r) for r in frame.to_dict("records")],
        dg.TableSchema(
            columns=[
                dg.TableColumn("kind", "string"),
                dg.TableColumn("name", "string"),
                dg.TableColumn("count", "int"),
                dg.TableColumn("detail", "string"),
            ]
        ),
    )


def test_the_search_finds_each_kind_of_leak(loaded):
    """Proof that the test above would fail: one leak of each kind, planted in a run's
    output report, its failure and in observations, is found where it was planted."""
    with loaded.engine.connect() as conn:
        customer = conn.scalar(sa.text("SELECT min(customer_ref) FROM quote"))
        recipient = conn.scalar(sa.text("SELECT min(recipient_ref) FROM notification"))
        actor = conn.scalar(sa.text("SELECT min(actor_ref) FROM audit_record"))
        request = conn.scalar(sa.text("SELECT payload FROM delivery_attempt_item LIMIT 1"))
        event = conn.scalar(sa.text("SELECT payload::text FROM outbox_event LIMIT 1"))

    @dg.op
    def leaky_op() -> dg.Output:
        return dg.Output(
            1,
            metadata={
                "report": _table(
                    [{"kind": "sample", "name": "17", "count": 1, "detail": f"for {customer}"}]
                ),
                "note": f"sent to {recipient}",
            },
        )

    @dg.op
    def failing_op() -> None:
        raise dg.Failure(description="boom", metadata={"who": dg.MetadataValue.md(f"*{actor}*")})

    @dg.job
    def leaky_job() -> None:
        leaky_op()
        failing_op()

    with dg.instance_for_test() as instance:
        leaky_job.execute_in_process(instance=instance, raise_on_error=False)
        quotes = dg.AssetKey(["qo_ops", "quotes"])
        for metadata in (
            {"payload": dg.MetadataValue.json(request)},  # a payload as JSON metadata
            {"detail": f"event {event}"},  # a payload inside a text
            {"auth": "Authorization: Bearer qoops_0123456789abcdef_" + "x" * 43},
            {"db": "postgresql+psycopg2://qo:s3cret@db.internal/qo"},
        ):
            instance.report_runless_asset_event(dg.AssetObservation(quotes, metadata=metadata))
        leaks = find_leaks(event_values(instance), forbidden_values(loaded.engine, "s3cret"))

    def found(what: str, where: str) -> bool:
        return any(what in leak and where in leak for leak in leaks)

    assert found(f"a personal reference ({customer!r})", "STEP_OUTPUT")
    assert found(f"a personal reference ({recipient!r})", "STEP_OUTPUT")
    assert found(f"a personal reference ({actor!r})", "STEP_FAILURE")
    assert found("a payload with keys", "asset qo_ops/quotes")  # the JSON metadata value
    assert found("a payload (", "asset qo_ops/quotes")  # the text
    assert found("an API token", "asset qo_ops/quotes")
    assert found("a bearer credential", "asset qo_ops/quotes")
    assert found("a connection URL", "asset qo_ops/quotes")
    assert not found("a password", "asset qo_ops/quotes")  # "s3cret" is no such word …
    assert found("a secret ('…')", "asset qo_ops/quotes")  # … but the given secret is found


@pytest.mark.parametrize(
    "text",
    [
        "ACTIVE → EXPIRED",
        "tenant-001/2026-01-30..2026-01-31",
        "row and stored object deleted, tombstoned",
        "eligible of 39; cap 10000, share 50%",
    ],
)
def test_report_wording_is_not_taken_for_a_leak(loaded, text):
    with dg.instance_for_test() as instance:
        instance.report_runless_asset_event(
            dg.AssetObservation(["qo_ops", "quotes"], metadata={"detail": text})
        )
        assert find_leaks(event_values(instance), forbidden_values(loaded.engine)) == []
