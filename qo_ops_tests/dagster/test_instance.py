"""A real Dagster deployment on loopback: webserver + daemon over PostgreSQL storage, runs
launched through the GraphQL API, the queue keeping one run per job and scope, a
terminated run ending `cancelled` in job_run, a tenant partition backfill (each run
audited), and a windowed job's backfill over tenants × days: Dagster's own backfill of its
days × tenant chunks runs each day and chunk for the chunk's tenants (or those of them the
tag qo_ops/backfill_tenants names), tenant_backfill_job's becomes chunk runs."""

from __future__ import annotations

from datetime import date, timedelta

import dagster as dg
import httpx
import sqlalchemy as sa
from dagster_graphql import DagsterGraphQLClient

from qo_ops.dagster_defs.backfills import BACKFILL_JOB, BACKFILL_OP
from qo_ops.dagster_defs.submission import BACKFILL_RUN_TAG
from qo_ops.platform.schedule.tenants import chunk_members, tenant_chunk_keys, tenant_ids
from qo_ops_tests.dagster.stack import LOCATION, dagster_stack, wait_for


def _status(instance: dg.DagsterInstance, run_id: str) -> dg.DagsterRunStatus:
    run = instance.get_run_by_id(run_id)
    assert run is not None
    return run.status


def _launch(client: DagsterGraphQLClient, tenant: str, config: dict) -> str:
    return client.submit_job_execution(
        "quote_expiration",
        repository_location_name=LOCATION,
        run_config={"ops": {"quote_expiration_op": {"config": config}}},
        tags={"dagster/partition": tenant, "qo_ops/scope": f"quote_expiration:{tenant}"},
    )


FINISHED = (dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED)


def test_queue_terminate_and_backfill_on_a_real_deployment(loaded, tmp_path):
    db = loaded
    with dagster_stack(db, tmp_path) as (client, instance, port):
        instance.add_dynamic_partitions("tenants", ["tenant-001", "tenant-002"])
        slow = {"mode": "execute", "reason": "queue test", "batch_size": 10, "throttle_ms": 250}

        # two runs of one job and tenant: the second waits in the queue until the first ends
        first = _launch(client, "tenant-001", slow)
        # its own reason: a Launchpad execute may not repeat an earlier one's (consent.py)
        second = _launch(client, "tenant-001", {**slow, "reason": "queue test, second"})
        wait_for(
            lambda: _status(instance, first) == dg.DagsterRunStatus.STARTED,
            120,
            "the first run to start",
        )
        assert _status(instance, second) == dg.DagsterRunStatus.QUEUED
        wait_for(lambda: _status(instance, first) in FINISHED, 180, "the first run to finish")
        assert _status(instance, first) == dg.DagsterRunStatus.SUCCESS
        wait_for(lambda: _status(instance, second) in FINISHED, 180, "the second run to finish")
        assert _status(instance, second) == dg.DagsterRunStatus.SUCCESS
        first_end = instance.get_run_record_by_id(first).end_time
        second_start = instance.get_run_record_by_id(second).start_time
        assert second_start >= first_end  # never at the same time
        with db.engine.connect() as conn:
            rows = dict(
                conn.execute(
                    sa.text(
                        "SELECT dagster_run_id, status FROM job_run WHERE dagster_run_id = ANY(:ids)"
                    ),
                    {"ids": [first, second]},
                ).all()
            )
        assert rows == {first: "success", second: "no_work"}  # the second found the work done

        # terminate a long run: it stops after its current batch, ends cancelled, keeps progress
        long_run = _launch(
            client,
            "tenant-002",
            {**slow, "reason": "terminate test", "batch_size": 2, "throttle_ms": 500},
        )

        def processed() -> int:
            with db.engine.connect() as conn:
                return conn.scalar(
                    sa.text(
                        "SELECT coalesce(max(processed_count), 0) FROM job_run WHERE dagster_run_id = :id"
                    ),
                    {"id": long_run},
                )

        wait_for(lambda: processed() > 0, 120, "the long run to make progress")
        client.terminate_run(long_run)
        wait_for(lambda: _status(instance, long_run) in FINISHED, 120, "the terminated run to stop")
        assert _status(instance, long_run) == dg.DagsterRunStatus.CANCELED
        with db.engine.connect() as conn:
            job_run = conn.execute(
                sa.text("SELECT status, processed_count FROM job_run WHERE dagster_run_id = :id"),
                {"id": long_run},
            ).one()
            expired = conn.scalar(
                sa.text(
                    "SELECT count(*) FROM quote WHERE tenant_id = 'tenant-002' AND status = 'EXPIRED'"
                )
            )
        assert job_run.status == "cancelled"
        assert job_run.processed_count > 0

        # a partition backfill (no run config: the mode comes from a tag) over both tenants
        backfill_id = _backfill(port, "quote_expiration", ["tenant-001", "tenant-002"])

        runs = _finished_backfill_runs(instance, backfill_id, 2)
        assert sorted(r.tags["dagster/partition"] for r in runs) == ["tenant-001", "tenant-002"]
        assert all(r.status == dg.DagsterRunStatus.SUCCESS for r in runs)
        with db.engine.connect() as conn:
            modes = conn.execute(
                sa.text(
                    "SELECT trigger_type, mode, status FROM job_run WHERE dagster_run_id = ANY(:ids)"
                ),
                {"ids": [r.run_id for r in runs]},
            ).all()
            overdue = conn.scalar(
                sa.text("SELECT count(*) FROM quote WHERE status = 'ACTIVE' AND expires_at < now()")
            )
        assert {tuple(m) for m in modes} <= {
            ("backfill", "execute", "success"),
            ("backfill", "execute", "no_work"),
        }
        assert overdue == 0 and expired > 0

        # every run of the backfill is on record: who (the backfill), scope, mode, reason
        with db.engine.connect() as conn:
            audited = conn.execute(
                sa.text(
                    "SELECT actor, scope, mode, reason, decision, details FROM job_audit "
                    "WHERE action = 'trigger' AND correlation_id = ANY(:ids) ORDER BY scope"
                ),
                {"ids": [r.run_id for r in runs]},
            ).all()
        assert [(a.actor, a.scope, a.mode, a.reason, a.decision) for a in audited] == [
            (f"backfill:{backfill_id}", tenant, "execute", "backfill test", "allowed")
            for tenant in ("tenant-001", "tenant-002")
        ]
        assert {a.details["trigger"] for a in audited} == {"backfill"}

        # a windowed job's partitions are a day × a tenant chunk: Dagster's own Launch
        # backfill over 3 days of chunk-001 (no run config) runs each day for the chunk's
        # tenants (both); with the tag qo_ops/backfill_tenants, for those tenants only
        instance.add_dynamic_partitions("tenant_chunks", ["chunk-001"])
        native_days = ["2026-02-20", "2026-02-21", "2026-02-22"]  # not the days below
        native_keys = [f"{d}|chunk-001" for d in native_days]
        windowed_job = "pricing_snapshot_recalculation"
        native = _finished_backfill_runs(instance, _backfill(port, windowed_job, native_keys), 3)
        assert sorted(r.tags["dagster/partition"] for r in native) == native_keys
        assert sorted(r.tags["dagster/partition/day"] for r in native) == native_days
        assert {r.status for r in native} == {dg.DagsterRunStatus.SUCCESS}
        chosen = _finished_backfill_runs(
            instance,
            _backfill(
                port,
                windowed_job,
                ["2026-02-23|chunk-001"],
                {"qo_ops/backfill_tenants": "tenant-002"},
            ),
            1,
        )
        assert {r.status for r in chosen} == {dg.DagsterRunStatus.SUCCESS}
        with db.engine.connect() as conn:
            covered = conn.execute(
                sa.text(
                    "SELECT dagster_run_id, scope, trigger_type FROM job_run "
                    "WHERE dagster_run_id = ANY(:ids)"
                ),
                {"ids": [r.run_id for r in (*native, *chosen)]},
            ).all()
        by_run: dict[str, set[str]] = {}
        for row in covered:
            assert row.trigger_type == "backfill"
            by_run.setdefault(row.dagster_run_id, set()).add(row.scope.split("/")[0])
        assert [by_run[r.run_id] for r in native] == [{"tenant-001", "tenant-002"}] * 3
        assert by_run[chosen[0].run_id] == {"tenant-002"}

        # tenant_backfill_job: both tenants × 3 days, executed, one run per chunk and day
        days = ["2026-02-10", "2026-02-11", "2026-02-12"]
        launcher = client.submit_job_execution(
            BACKFILL_JOB,
            repository_location_name=LOCATION,
            run_config={
                "ops": {
                    BACKFILL_OP: {
                        "config": {
                            "job": windowed_job,
                            "first_day": days[0],
                            "last_day": days[-1],
                            "days_per_run": 1,
                            "mode": "execute",
                            "reason": "backfill test",
                        }
                    }
                }
            },
        )
        wait_for(lambda: _status(instance, launcher) in FINISHED, 180, "the backfill launcher")
        assert _status(instance, launcher) == dg.DagsterRunStatus.SUCCESS

        def chunk_runs() -> list:
            return instance.get_runs(filters=dg.RunsFilter(tags={BACKFILL_RUN_TAG: launcher}))

        wait_for(
            lambda: len(chunk_runs()) == 3 and all(r.status in FINISHED for r in chunk_runs()),
            300,
            "the backfill's chunk runs",
        )
        windowed = chunk_runs()
        assert all(r.status == dg.DagsterRunStatus.SUCCESS for r in windowed)
        assert sorted(r.tags["dagster/asset_partition_range_start"] for r in windowed) == [
            f"{d}|chunk-001" for d in days
        ]
        assert all(
            r.run_config["ops"][f"{windowed_job}_op"]["config"]["tenants"]
            == ["tenant-001", "tenant-002"]
            for r in windowed
        )
        with db.engine.connect() as conn:
            scopes = conn.execute(
                sa.text(
                    "SELECT scope, mode, trigger_type, succeeded_count FROM job_run "
                    "WHERE dagster_run_id = ANY(:ids)"
                ),
                {"ids": [r.run_id for r in windowed]},
            ).all()
            unpriced = conn.scalar(
                sa.text(
                    """
                    SELECT count(*) FROM quote q
                      JOIN price_book pb ON pb.tenant_id = q.tenant_id AND pb.is_current
                      LEFT JOIN pricing_snapshot s
                        ON s.quote_id = q.id AND s.price_book_version = pb.version
                     WHERE q.created_at >= '2026-02-10' AND q.created_at < '2026-02-13'
                       AND s.quote_id IS NULL
                    """
                )
            )
        assert sorted(s.scope for s in scopes) == sorted(
            f"{t}/{d}..{(date.fromisoformat(d) + timedelta(days=1)).isoformat()}"
            for t in ("tenant-001", "tenant-002")
            for d in days
        )
        assert {(s.mode, s.trigger_type) for s in scopes} == {("execute", "backfill")}
        assert sum(s.succeeded_count for s in scopes) > 0 and unpriced == 0  # real work, all done


def test_a_native_backfill_over_days_and_every_tenant_chunk_runs_one_chunk_per_run(
    loaded, tmp_path
):
    """Dagster's own Launch backfill of a windowed job over 2 days × every tenant chunk (150
    tenants: chunk-001 and chunk-002), no run config: one run per day and chunk, each
    covering exactly its chunk's tenants, every tenant of every day once; the backfill
    completes as one entry with its runs."""
    db = loaded
    with db.engine.begin() as conn:  # with the demo's two: 150 tenants, two chunks
        conn.execute(
            sa.text(
                "INSERT INTO tenant (id, name) SELECT 'bulk-' || lpad(g::text, 3, '0'), 'b' "
                "FROM generate_series(1, 148) g"
            )
        )
    with db.engine.connect() as conn:
        chunks = {c: set(chunk_members(conn, c)) for c in tenant_chunk_keys(conn)}
        everyone = set(tenant_ids(conn))
    assert list(chunks) == ["chunk-001", "chunk-002"]
    assert [len(m) for m in chunks.values()] == [100, 50]
    job = "pricing_snapshot_recalculation"
    days = ["2026-02-24", "2026-02-25"]
    keys = [f"{d}|{c}" for d in days for c in chunks]
    with dagster_stack(db, tmp_path) as (_, instance, port):
        instance.add_dynamic_partitions("tenants", sorted(everyone))
        instance.add_dynamic_partitions("tenant_chunks", list(chunks))
        backfill_id = _backfill(port, job, keys, {})  # the dialog's defaults: a dry run
        runs = _finished_backfill_runs(instance, backfill_id, len(keys))
        wait_for(  # the daemon marks the backfill done after its runs end
            lambda: instance.get_backfill(backfill_id).status.value == "COMPLETED_SUCCESS",
            120,
            "the backfill to be marked completed",
        )
    assert {r.status for r in runs} == {dg.DagsterRunStatus.SUCCESS}
    assert sorted(r.tags["dagster/partition"] for r in runs) == sorted(keys)
    with db.engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT dagster_run_id, scope, window_start, trigger_type, mode FROM job_run "
                "WHERE dagster_run_id = ANY(:ids)"
            ),
            {"ids": [r.run_id for r in runs]},
        ).all()
    assert {(r.trigger_type, r.mode) for r in rows} == {("backfill", "dry_run")}
    by_run: dict[str, list[str]] = {}
    for row in rows:
        by_run.setdefault(row.dagster_run_id, []).append(row.scope.split("/")[0])
    for run in runs:  # each run: exactly its chunk's tenants, each once
        covered = by_run[run.run_id]
        assert len(covered) == len(set(covered))
        assert set(covered) == chunks[run.tags["dagster/partition/tenant_chunk"]], run.tags
    for day in days:  # every tenant of every day exactly once
        on_day = [r.scope.split("/")[0] for r in rows if str(r.window_start) == day]
        assert sorted(on_day) == sorted(everyone)


BACKFILL_TAGS = {"qo_ops/mode": "execute", "qo_ops/reason": "backfill test"}


def _backfill(
    port: int, job_name: str, partitions: list[str], tags: dict[str, str] = BACKFILL_TAGS
) -> str:
    """Launch a partition backfill through GraphQL; the mode comes from run tags."""
    result = httpx.post(
        f"http://127.0.0.1:{port}/graphql",
        json={
            "query": """
            mutation($params: LaunchBackfillParams!) {
              launchPartitionBackfill(backfillParams: $params) {
                __typename
                ... on LaunchBackfillSuccess { backfillId }
                ... on PythonError { message }
              }
            }""",
            "variables": {
                "params": {
                    "selector": {
                        "partitionSetName": f"{job_name}_partition_set",
                        "repositorySelector": {
                            "repositoryLocationName": LOCATION,
                            "repositoryName": "__repository__",
                        },
                    },
                    "partitionNames": partitions,
                    "tags": [{"key": k, "value": v} for k, v in tags.items()],
                }
            },
        },
        timeout=60,
    ).json()
    launched = result["data"]["launchPartitionBackfill"]
    assert launched["__typename"] == "LaunchBackfillSuccess", launched
    return launched["backfillId"]


def _finished_backfill_runs(instance: dg.DagsterInstance, backfill_id: str, count: int) -> list:
    def runs() -> list:
        return instance.get_runs(filters=dg.RunsFilter(tags={"dagster/backfill": backfill_id}))

    wait_for(
        lambda: len(runs()) == count and all(r.status in FINISHED for r in runs()),
        300,
        "the backfill",
    )
    return runs()
