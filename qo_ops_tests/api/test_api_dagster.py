"""The launch path for real: ``qo-ops api`` in front of a real Dagster webserver and daemon on
loopback (PostgreSQL storage). An accepted run executes in Dagster and ends with the same
job_run id; a concurrent duplicate gets 409; the same Idempotency-Key returns the same run;
cancel ends a running run ``cancelled``; and no log line of the whole cycle carries a token,
a password or a connection string."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

import dagster as dg
import sqlalchemy as sa

from qo_ops.api.tokens import PREFIX
from qo_ops.db.schema import job_run
from qo_ops_tests.dagster.stack import dagster_stack, wait_for

QE = "/internal/jobs/quote_expiration/runs"
PRICING = "/internal/jobs/pricing_snapshot_recalculation/runs"


def _run(db, run_id: str) -> sa.Row:
    with db.engine.connect() as conn:
        return conn.execute(sa.select(job_run).where(job_run.c.id == uuid.UUID(run_id))).one()


def _finished(db, run_id: str) -> bool:
    return _run(db, run_id).finished_at is not None


def _url_of(engine) -> str:
    return engine.url.set(drivername="postgresql").render_as_string(hide_password=False)


def test_runs_launched_through_the_api_execute_in_dagster(loaded, logins, api_factory, tmp_path):
    db = loaded
    # each process as its own least-privilege login (docs/security.md), passwords in the URLs
    runner_url = _url_of(logins.create(db, "qo_ops_runner"))
    api_url = _url_of(logins.create(db, "qo_ops_api"))
    db_passwords = [sa.engine.make_url(u).password for u in (runner_url, api_url)]
    home = tmp_path / "dagster"
    home.mkdir()
    with dagster_stack(db, home, env={"QO_OPS_DATABASE_URL": runner_url}) as (_, instance, port):
        instance.add_dynamic_partitions("tenants", ["tenant-001", "tenant-002"])
        instance.add_dynamic_partitions("tenant_chunks", ["chunk-001"])
        api = api_factory(
            dagster_url=f"http://127.0.0.1:{port}",
            database_url=api_url,
            QO_OPS_DAGSTER_PUBLIC_URL="https://dagster.example.internal",
        )
        olga = api.token("olga", "operator")
        vera = api.token("vera", "viewer")
        tokens = [olga, vera]

        # 1. an allowed request: 202 + Location, executed by Dagster with the same job_run id
        body = {"mode": "execute", "tenant": "tenant-001", "reason": "INC-1 expire stragglers"}
        accepted = api.post(QE, olga, json={**body, "correlationId": "INC-1"})
        assert accepted.status_code == 202, accepted.text
        run_id = accepted.json()["jobRunId"]
        assert accepted.json() == {"jobRunId": run_id, "status": "accepted", "mode": "execute"}
        assert accepted.headers["Location"] == f"{QE}/{run_id}"
        wait_for(lambda: _finished(db, run_id), 180, "the API run to finish")
        row = _run(db, run_id)
        assert (row.status, row.trigger_type, row.requester, row.mode) == (
            "success",
            "api",
            "olga",
            "execute",
        )
        assert row.correlation_id == "INC-1" and row.processed_count > 0
        dagster_run = instance.get_run_by_id(row.dagster_run_id)
        assert dagster_run is not None
        assert dagster_run.tags["qo_ops/job_run_id"] == run_id
        assert dagster_run.tags["dagster/partition"] == "tenant-001"
        wait_for(
            lambda: (
                instance.get_run_by_id(row.dagster_run_id).status == dg.DagsterRunStatus.SUCCESS
            ),
            60,
            "Dagster to mark the run a success",
        )
        with db.engine.connect() as conn:  # one row: Dagster adopted it, it made no other
            assert conn.scalar(sa.select(sa.func.count()).select_from(job_run)) == 1
        view = api.get(f"{QE}/{run_id}", vera).json()
        assert view["status"] == "success" and view["processed_count"] == row.processed_count
        assert view["mutated_count"] == row.succeeded_count > 0  # the seed's summary field
        assert view["dagster"] == {
            "runId": row.dagster_run_id,
            "link": f"https://dagster.example.internal/runs/{row.dagster_run_id}",
            "status": "SUCCESS",
        }

        # 2. a windowed job over two days: one run, the window it was asked for
        window = {
            "mode": "dry_run",
            "tenant": "tenant-002",
            "from": "2026-02-01",
            "to": "2026-02-03",
        }
        priced = api.post(PRICING, olga, json=window)
        assert priced.status_code == 202, priced.text
        priced_id = priced.json()["jobRunId"]
        wait_for(lambda: _finished(db, priced_id), 180, "the windowed run to finish")
        priced_row = _run(db, priced_id)
        assert priced_row.status in ("success", "no_work"), priced_row.last_error_text
        assert (str(priced_row.window_start), str(priced_row.window_end)) == (
            "2026-02-01",
            "2026-02-03",
        )
        assert priced_row.scope == "tenant-002/2026-02-01..2026-02-03"
        # the run's partition is the window's first day and the tenant's chunk (tagged per
        # dimension, as Dagster tags the runs it creates); its tenant is in run config
        priced_run = instance.get_run_by_id(priced_row.dagster_run_id)
        assert priced_run.tags["dagster/partition"] == "2026-02-01|chunk-001"
        assert priced_run.tags["dagster/partition/day"] == "2026-02-01"
        assert priced_run.tags["dagster/partition/tenant_chunk"] == "chunk-001"
        assert priced_run.tags["qo_ops/window"] == "2026-02-01..2026-02-02"  # the last included
        priced_config = priced_run.run_config["ops"]["pricing_snapshot_recalculation_op"]["config"]
        assert priced_config["tenants"] == ["tenant-002"]

        # 3. a slow run: a duplicate is 409, the same key is the same run, cancel stops it
        slow = {
            "mode": "execute",
            "tenant": "tenant-002",
            "reason": "INC-2 slow sweep",
            "batchSize": 1,
            "throttleMs": 400,
        }
        with ThreadPoolExecutor(4) as pool:  # four at once: one run, three conflicts
            racing = list(
                pool.map(
                    lambda i: api.post(
                        QE, olga, json=slow, headers={"Idempotency-Key": f"inc-2-sweep-{i}"}
                    ),
                    range(4),
                )
            )
        assert sorted(r.status_code for r in racing) == [202, 409, 409, 409], [
            r.text for r in racing
        ]
        winner = next(i for i, r in enumerate(racing) if r.status_code == 202)
        slow_id = racing[winner].json()["jobRunId"]
        assert {r.json()["activeRunId"] for r in racing if r.status_code == 409} == {slow_id}
        duplicate = api.post(QE, olga, json=slow)
        assert duplicate.status_code == 409
        assert duplicate.json()["activeRunId"] == slow_id and slow_id in duplicate.json()["error"]
        key = f"inc-2-sweep-{winner}"
        replay = api.post(QE, olga, json=slow, headers={"Idempotency-Key": key})
        assert replay.status_code == 202 and replay.json()["jobRunId"] == slow_id
        reused = api.post(QE, olga, json={**slow, "batchSize": 2}, headers={"Idempotency-Key": key})
        assert reused.status_code == 422

        wait_for(lambda: _run(db, slow_id).processed_count > 0, 180, "the slow run to progress")
        assert api.post(f"{QE}/{slow_id}/cancel", vera, json={"reason": "no"}).status_code == 403
        cancel = api.post(f"{QE}/{slow_id}/cancel", olga, json={"reason": "INC-2 wrong tenant"})
        assert cancel.status_code == 202, cancel.text
        assert cancel.json()["status"] == "cancel_requested"
        wait_for(lambda: _finished(db, slow_id), 120, "the cancelled run to stop")
        stopped = _run(db, slow_id)
        assert stopped.status == "cancelled", (stopped.status, stopped.status_reason)
        assert 0 < stopped.processed_count < stopped.eligible_count
        with db.engine.connect() as conn:  # nothing half-written: processed rows are expired
            expired = conn.scalar(
                sa.text(
                    "SELECT count(*) FROM quote WHERE tenant_id = 'tenant-002' "
                    "AND status = 'EXPIRED' AND updated_at >= :t"
                ),
                {"t": stopped.started_at},
            )
        assert expired == stopped.succeeded_count
        # cancelling a finished run is a conflict, not a silent success
        assert api.post(f"{QE}/{slow_id}/cancel", olga, json={"reason": "x"}).status_code == 409

        # 4. status: last run, last success, lease, backlog, checkpoint age
        status = api.get("/internal/jobs/quote_expiration/status?tenant=tenant-001", vera)
        assert status.status_code == 200
        (scope,) = status.json()["scopes"]
        assert scope["scope"] == "tenant-001" and scope["last_status"] == "success"
        assert scope["backlog"] == 0 and scope["lease_holder"] is None

        # the audit trail holds every decision of the cycle
        with db.engine.connect() as conn:
            audit = conn.execute(
                sa.text("SELECT actor, action, decision FROM job_audit ORDER BY id")
            ).all()
        decisions = [(a.actor, a.action, a.decision) for a in audit]
        for expected in [
            ("olga", "submit", "allowed"),
            ("olga", "submit", "denied: conflict"),
            ("olga", "submit", "replayed"),
            ("olga", "submit", "denied: idempotency key reused"),
            ("vera", "cancel", "denied: role viewer may only read"),
            ("olga", "cancel", "requested"),
        ]:
            assert expected in decisions, expected

        # 5. no token, password or connection string in any log line of the cycle
        texts = [api.log.read_text()]
        texts += [(home / name).read_text() for name in ("webserver.log", "daemon.log")]
        for rid in (row.dagster_run_id, priced_row.dagster_run_id, stopped.dagster_run_id):
            texts += [
                str(e.user_message) + " " + str(e.dagster_event) for e in instance.all_logs(rid)
            ]
        everything = "\n".join(texts)
        # the runner's JSON job events are in Dagster's event log of the run
        run_log = [str(e.user_message) for e in instance.all_logs(row.dagster_run_id)]
        assert any('"event.name": "job.finished"' in m and run_id in m for m in run_log)
        assert "api.request" in everything and "quote_expiration" in everything
        # a token is qoops_<16 hex id>_<secret>; the secret may hold "_" itself
        secrets = [t.removeprefix(PREFIX).split("_", 1)[1] for t in tokens]
        assert all(len(s) >= 40 for s in secrets)
        for secret in [*tokens, *secrets, *db_passwords]:
            assert secret not in everything
        for marker in ("postgresql://", "postgresql+psycopg", "Bearer "):
            assert marker not in everything, marker
