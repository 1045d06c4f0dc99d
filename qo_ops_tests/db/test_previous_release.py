"""The previous release's code keeps working on today's schema (upgrades without stopping the
world): the database is migrated to today's head by today's code and holds today's demo
data; the code of the previous migration head, checked out from git history
(qo_ops_tests/db/previous_release.py), then does its whole day's work on it, as separate
processes, for real:

1. every job of its catalog, dry-run and executed, through its ``qo-ops run``;
2. one tick of each of its Dagster sensors, and its run-failure recorder;
3. its operator API on loopback: a token, a launch, the run read back (its Dagster run
   executed by its code location), 2xx all along;
4. its metrics exporter, scraped over HTTP;
5. its runs and today's runs of one scope at once: exactly one executes, and the fencing
   token holds across the versions (a frozen holder of either version, taken over by the
   other, writes nothing once woken).

Previous code that refuses the schema (``database schema is at …, this code needs …``)
fails every test: its own schema check is asserted first, and each test's first step is one
of its commands (the sensor ticks check no schema revision themselves, as Dagster's path
never does: their test fails at the previous code's ``qo-ops run`` it makes first).
``QO_OPS_PREVIOUS_CODE_COMMIT=<commit>`` points the harness at another commit.

One database and one checkout for the module (its tests run in order, on one xdist worker:
qo_ops_tests/conftest.py groups each file); each part works on a tenant of its own.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import sqlalchemy as sa

from qo_ops.db import migrate
from qo_ops.db.digest import database_digest
from qo_ops.db.schema import BUSINESS_TABLES, outbox_event
from qo_ops.downstream.local import seed_from_demo
from qo_ops.jobs.catalog import CATALOG
from qo_ops_tests.api.conftest import ApiServer
from qo_ops_tests.conftest import (
    QO_OPS_BIN,
    CliResult,
    DownstreamServer,
    _test_database,
    base_env,
    run_cli,
)
from qo_ops_tests.dagster.conftest import AS_OF
from qo_ops_tests.dagster.stack import free_port
from qo_ops_tests.dagster.test_jobs import work_partition
from qo_ops_tests.db.previous_release import (
    NOT_PREVIOUS,
    PreviousRelease,
    RecordingDagster,
    checked_out,
    find_previous_code,
)
from qo_ops_tests.metrics.test_exporter import completed, finished_runs, scrape_when
from qo_ops_tests.platform.run.test_faults import wait_for

if TYPE_CHECKING:
    from qo_ops_tests.conftest import TestDatabase

TENANTS = ["tenant-001", "tenant-002", "tenant-003"]
JOBS_TENANT, API_TENANT, RACE_TENANT = TENANTS  # each part of the test has a tenant of its own
REFUSALS = ("database schema", "db upgrade", "SchemaNotReady", NOT_PREVIOUS)
# Settings both versions' processes run with: the audit retention that gives the demo's
# 2026 days audit work (as qo_ops_tests/dagster/conftest.py's ``defs``), fast retries.
SETTINGS = {
    "QO_OPS_AUDIT_RETENTION_DAYS": "90",
    "QO_OPS_RETRY_BASE_S": "0.2",
    "QO_OPS_RETRY_CAP_S": "1",
}


# ---------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def previous(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PreviousRelease]:
    """The previous code, checked out in a git worktree for this module."""
    code = find_previous_code()
    # a name of its own: git names the worktree after it (two xdist workers may add one each)
    where = tmp_path_factory.mktemp("previous-release") / f"qo-ops-{code.commit[:12]}-{os.getpid()}"
    with checked_out(code.commit, where) as path:
        print(f"previous code: {code.commit[:12]} (HEAD_REVISION {code.revision}), {code.found_by}")
        yield PreviousRelease(code, path)


@pytest.fixture(scope="module")
def simulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DownstreamServer]:
    """The fulfilment system's simulator (not qo-ops' code: today's, for both versions)."""
    where = tmp_path_factory.mktemp("downstream")
    server = DownstreamServer(where / "store.sqlite3", where / "simulator.log", {})
    yield server
    server.close()


@pytest.fixture(scope="module")
def shared(
    pg_server: Any, template_database: str, simulator: DownstreamServer
) -> Iterator[TestDatabase]:
    """One database for the module: migrated to head by today's code (the suite's template,
    qo_ops_tests/conftest.py), demo data loaded by today's ``qo-ops demo-data``, the
    simulator seeded from it. Each part of the test works on a tenant of its own."""
    made = _test_database(pg_server, template_database)
    db = next(made)
    loaded = run_cli(
        ["demo-data", "--tenants", "3", "--quotes", "200", "--seed", "1", "--reset",
         "--as-of", AS_OF.isoformat()],
        today_env(db),
    )  # fmt: skip
    assert loaded.code == 0, loaded.stderr[-2000:]
    with db.engine.begin() as conn:  # the demo's poison deliveries: a partial success by design
        conn.execute(
            sa.text(
                "UPDATE delivery_attempt_item SET payload = payload - 'fault' WHERE tenant_id = :t"
            ),
            {"t": JOBS_TENANT},
        )
    seed_from_demo(db.engine, simulator.url)
    yield db
    next(made, None)  # its database dropped


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("home")


@pytest.fixture(scope="module")
def old_env(
    previous: PreviousRelease, shared: TestDatabase, simulator: DownstreamServer, home: Path
) -> dict[str, str]:
    """The environment of the previous code's processes."""
    return previous.env(
        QO_OPS_DATABASE_URL=shared.env_url,
        QO_OPS_HOME=str(home),
        QO_OPS_DOWNSTREAM_URL=simulator.url,
        **SETTINGS,
    )


@pytest.fixture(scope="module")
def old_catalog(previous: PreviousRelease, old_env: dict[str, str]) -> dict[str, Any]:
    return previous.catalog(old_env)


def today_env(db: TestDatabase, **extra: str) -> dict[str, str]:
    """The environment of today's ``qo-ops`` (the venv's, no PYTHONPATH of the checkout)."""
    return base_env(QO_OPS_DATABASE_URL=db.env_url, **SETTINGS, **extra)


# ---------------------------------------------------------------------------- helpers


def assert_ran(result: CliResult, what: str, codes: tuple[int, ...] = (0,)) -> None:
    """Exit code in ``codes``, and no refusal of the schema (or of the checkout)."""
    said = result.stderr + result.stdout
    refused = [r for r in REFUSALS if r in said]
    assert not refused, f"{what}: refused ({refused}): {result.stderr[-1500:]}"
    assert result.code in codes, (what, result.code, result.stdout[-1500:], result.stderr[-1500:])
    assert "Traceback" not in result.stderr, (what, result.stderr[-3000:])


def scalar(db: TestDatabase, sql: str, **params: object) -> Any:
    with db.engine.connect() as conn:
        return conn.execute(sa.text(sql), params).scalar()


def scope_args(db: TestDatabase, job: str, tenant: str) -> list[str]:
    """``--tenant`` and, for a windowed job, ``--date`` of a day with work for ``tenant``
    (qo_ops_tests/dagster/test_jobs.py's ``work_partition``; it plants old run history for
    run_history_retention)."""
    assert job in CATALOG, f"{job}: a job of the previous catalog only; give its scope here"
    with pytest.MonkeyPatch.context() as env:  # the settings the runs get (audit retention)
        for name, value in SETTINGS.items():
            env.setenv(name, value)
        partition = work_partition(db, job, tenant)
    day = [] if CATALOG[job].partitioning == "tenant" else ["--date", partition.split("|")[0]]
    return ["--tenant", tenant, *day]


# ---------------------------------------------------------------------------- the checkout


def test_the_previous_code_is_the_checkout_at_the_previous_migration_head(
    previous: PreviousRelease, old_catalog: dict[str, Any]
) -> None:
    """The processes import the checkout's qo_ops (not the venv's editable install), it is
    the code of the revision the previous head was (or the commit named by hand), and its
    own schema check (what each of its commands does first) accepts today's schema."""
    assert old_catalog["qo_ops"] == str(previous.path / "qo_ops" / "__init__.py")
    assert old_catalog["head_revision"] == previous.code.revision
    assert old_catalog["schema_check"] == "ok"
    assert old_catalog["jobs"], "the previous catalog has no job"


# ---------------------------------------------------------------------------- 1. the jobs


def test_every_job_of_the_previous_catalog_runs_dry_and_executes(
    previous: PreviousRelease,
    old_catalog: dict[str, Any],
    old_env: dict[str, str],
    shared: TestDatabase,
) -> None:
    """``qo-ops run JOB --mode dry-run`` then ``--mode execute`` of the previous code, every
    job of its catalog, on a scope with work; a destructive job's execute cites an approval
    granted by the previous code's ``qo-ops approval grant``."""
    executed: dict[str, dict[str, Any]] = {}
    for job, spec in old_catalog["jobs"].items():
        scope = scope_args(shared, job, JOBS_TENANT)
        dry = previous.cli(old_env, "run", job, *scope, "--mode", "dry-run", "--json")
        assert_ran(dry, f"{job} dry-run")
        assert json.loads(dry.stdout)["status"] in ("success", "no_work"), dry.stdout
        approval: list[str] = []
        if spec["destructive"]:
            granted = previous.cli(
                old_env, "approval", "grant", job, "--tenant", JOBS_TENANT,
                "--reason", "previous release test", "--by", "ana", "--json",
            )  # fmt: skip
            assert_ran(granted, f"{job} approval grant")
            approval = ["--approval", json.loads(granted.stdout)["approvalId"]]
        done = previous.cli(
            old_env, "run", job, *scope, "--mode", "execute",
            "--reason", "previous release test", *approval, "--json",
        )  # fmt: skip
        assert_ran(done, f"{job} execute")
        executed[job] = json.loads(done.stdout)
    assert {job: s["status"] for job, s in executed.items()} == {
        job: "success" for job in old_catalog["jobs"]
    }
    idle = [job for job, s in executed.items() if not s["processed_count"]]
    assert not idle, f"executes that found no work (they would prove nothing): {idle}"
    with shared.engine.connect() as conn:  # each execute is on record, as the previous code
        recorded = conn.execute(
            sa.text("SELECT job_name, status, mode FROM job_run WHERE id = ANY(:ids)"),
            {"ids": [uuid.UUID(s["job_run_id"]) for s in executed.values()]},
        ).all()
    assert sorted(recorded) == sorted((job, "success", "execute") for job in executed)


# ---------------------------------------------------------------------------- 2. the sensors


def test_the_previous_code_locations_sensors_tick(
    previous: PreviousRelease, old_env: dict[str, str], shared: TestDatabase
) -> None:
    """One tick of every sensor of the previous code location (an ephemeral Dagster
    instance, this database), and its run-failure recorder on a failed run: no exception,
    the tenants found, the failure on record."""
    one = previous.cli(old_env, "run", "quote_expiration", "--tenant", JOBS_TENANT, "--json")
    assert_ran(one, "quote_expiration dry-run")  # a run outside Dagster, for outside_runs_sensor
    ticked = previous.dagster(old_env, {"sensors": True, "tenants": [JOBS_TENANT]})
    assert ticked["qo_ops"].startswith(f"{previous.path}/")
    errors = {name: seen["error"] for name, seen in ticked["sensors"].items() if "error" in seen}
    assert not errors, "\n".join(f"{name}:\n{trace}" for name, trace in errors.items())
    added = ticked["sensors"]["tenants_sensor"]["added_partitions"]
    assert [key for key in added if key.startswith("tenant-")] == TENANTS  # (0018: chunks too)
    assert len(ticked["sensors"]) >= 5, sorted(ticked["sensors"])
    assert ticked["sensors"]["outside_runs_sensor"]["asset_events"] > 0  # it read job_run
    recorder = ticked["sensors"]["run_failure_recorder"]
    details = scalar(
        shared,
        "SELECT details FROM job_audit WHERE action = 'run_failure' "
        "AND details->>'dagster_run_id' = :run",
        run=recorder["failed_run"],
    )
    assert details is not None and "reason" in details["message"], details


# ---------------------------------------------------------------------------- 3. the API


def test_the_previous_api_takes_a_launch_and_reports_the_run(
    previous: PreviousRelease, old_env: dict[str, str], shared: TestDatabase, home: Path
) -> None:
    """The previous code's ``qo-ops api`` on loopback, a token made by its CLI: a launch is
    accepted (202) and handed to Dagster (a stand-in that takes it), the run reads back
    (200); the launched Dagster run, executed by the previous code location, adopts the
    accepted run, which then reads back ``success``."""
    with RecordingDagster().serving() as dagster:
        env = {**old_env, "QO_OPS_DAGSTER_URL": dagster.url}
        made = previous.cli(
            env, "api", "token", "create", "--identity", "olga", "--role", "operator"
        )
        assert_ran(made, "api token create")
        token = made.stdout.strip().splitlines()[-1]
        api = ApiServer(
            env,
            home / "previous-api.log",
            env,
            command=lambda port: previous.cli_argv(
                "api", "--host", "127.0.0.1", "--port", str(port)
            ),
        )
        try:
            jobs = api.get("/internal/jobs", token)
            assert jobs.status_code == 200, jobs.text
            body = {"mode": "execute", "tenant": API_TENANT, "reason": "previous release test"}
            accepted = api.post("/internal/jobs/quote_expiration/runs", token, json=body)
            assert accepted.status_code == 202, accepted.text
            run_id = accepted.json()["jobRunId"]
            path = f"/internal/jobs/quote_expiration/runs/{run_id}"
            view = api.get(path, token)
            assert view.status_code == 200, view.text
            (launch,) = dagster.launched
            assert view.json()["status"] == "accepted"
            assert view.json()["dagster"]["runId"] == launch["run_id"]

            ran = previous.dagster(old_env, {"launched": [launch], "tenants": TENANTS})
            assert ran["launched"] == [{"job": "quote_expiration", "success": True}]
            dagster.status = "SUCCESS"
            view = api.get(path, token)
            assert view.status_code == 200, view.text
            assert view.json()["status"] == "success", view.json()
            assert view.json()["processed_count"] > 0
        finally:
            api.stop()
    assert "Traceback" not in (home / "previous-api.log").read_text()


# ---------------------------------------------------------------------------- 4. the exporter


def test_the_previous_exporter_serves_the_job_metrics(
    previous: PreviousRelease,
    old_catalog: dict[str, Any],
    old_env: dict[str, str],
    shared: TestDatabase,
    home: Path,
) -> None:
    """The previous code's ``qo-ops metrics`` on loopback, scraped: 200, and its job metrics
    count the runs on record (one run of its own made first)."""
    one = previous.cli(old_env, "run", "quote_expiration", "--tenant", API_TENANT, "--json")
    assert_ran(one, "quote_expiration dry-run")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with (home / "previous-metrics.log").open("wb") as log:
        proc = previous.popen(
            previous.cli_argv("metrics", "--host", "127.0.0.1", "--port", str(port)),
            {**old_env, "QO_OPS_METRICS_REFRESH_S": "1"},
            stdout=log,
            stderr=log,
        )
        try:

            def up() -> bool:
                assert proc.poll() is None, (home / "previous-metrics.log").read_text()[-3000:]
                try:
                    return httpx.get(f"{url}/metrics", timeout=2).status_code == 200
                except httpx.TransportError:
                    return False

            wait_for(up, 60, "the previous exporter's /metrics")
            runs = finished_runs(shared, "quote_expiration")
            samples = scrape_when(url, lambda s: completed(s, "quote_expiration") >= runs)
        finally:
            proc.terminate()
            proc.wait(timeout=15)
    labelled = {
        dict(labels).get("job_name") for (name, labels) in samples if name.startswith("job_")
    }
    assert set(old_catalog["jobs"]) <= labelled, set(old_catalog["jobs"]) - labelled


# ------------------------------------------------------------- 5. both versions, one scope


def plant_overdue(db: TestDatabase, count: int, tenant: str = RACE_TENANT) -> int:
    """``count`` more ACTIVE quotes of ``tenant`` past expiry; how many are overdue now."""
    with db.engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO quote (tenant_id, quote_number, customer_ref, status, total_amount, "
                "price_book_version, created_at, updated_at, expires_at) "
                "SELECT :t, :prefix || g, 'c', 'ACTIVE', 1, 2, now(), now(), "
                "now() - interval '1 day' FROM generate_series(1, :n) g"
            ),
            {"t": tenant, "n": count, "prefix": f"PR-{uuid.uuid4().hex[:8]}-"},
        )
    return overdue(db, tenant)


def overdue(db: TestDatabase, tenant: str = RACE_TENANT) -> int:
    return int(
        scalar(
            db,
            "SELECT count(*) FROM quote WHERE tenant_id = :t AND status = 'ACTIVE' "
            "AND expires_at < now()",
            t=tenant,
        )
    )


def fence(db: TestDatabase) -> int:
    """The lease's fencing token of (quote_expiration, RACE_TENANT); 0 before any lease."""
    return int(
        scalar(
            db,
            "SELECT fencing_token FROM job_lease WHERE job_name = 'quote_expiration' "
            "AND scope = :s",
            s=RACE_TENANT,
        )
        or 0
    )


def lease_unexpired(db: TestDatabase) -> bool:
    return bool(
        scalar(
            db,
            "SELECT expires_at > clock_timestamp() FROM job_lease "
            "WHERE job_name = 'quote_expiration' AND scope = :s",
            s=RACE_TENANT,
        )
    )


def business(db: TestDatabase) -> dict[str, str]:
    """Digest of every business table and the outbox: what a job's batches write."""
    with db.engine.connect() as conn:
        return database_digest(conn, (*BUSINESS_TABLES, outbox_event))


def assert_outcome_intact(db: TestDatabase) -> None:
    """Nothing overdue left, one QuoteExpired event per expired quote (none twice, none
    missing) for RACE_TENANT (test_faults' ``assert_outcome_intact``, for one tenant)."""
    missing, doubled = (
        scalar(
            db,
            f"""
            SELECT count(*) FILTER (WHERE n {cond}) FROM (
              SELECT (SELECT count(*) FROM outbox_event e WHERE e.event_type = 'QuoteExpired'
                         AND e.aggregate_id = q.id::text) AS n
                FROM quote q WHERE q.tenant_id = :t AND q.status = 'EXPIRED') s
            """,
            t=RACE_TENANT,
        )
        for cond in ("= 0", "> 1")
    )
    assert (missing, doubled) == (0, 0), "expired quotes without their event / with two"
    assert overdue(db) == 0


RACE_RUN = ("run", "quote_expiration", "--tenant", RACE_TENANT, "--mode", "execute",
            "--reason", "previous release race", "--json")  # fmt: skip


def start(
    version: str, previous: PreviousRelease, old_env: dict[str, str], db: TestDatabase, *extra: str
) -> subprocess.Popen[str]:
    """A ``qo-ops run`` of quote_expiration over RACE_TENANT by ``version`` ("previous" or
    "today"), its output piped."""
    pipes: dict[str, Any] = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    if version == "previous":
        return previous.popen(previous.cli_argv(*RACE_RUN, *extra), old_env, **pipes)
    return subprocess.Popen(
        [QO_OPS_BIN, *RACE_RUN, *extra],
        env=today_env(db),
        stdin=subprocess.DEVNULL,
        text=True,
        **pipes,
    )


def finish(proc: subprocess.Popen[str], what: str, codes: tuple[int, ...]) -> dict[str, Any]:
    out, err = proc.communicate(timeout=120)
    assert_ran(CliResult(proc.returncode, out, err), what, codes)
    return dict(json.loads(out))


def stop(*procs: subprocess.Popen[str]) -> None:
    """Kill what is still running (a test that failed half-way), thawed first."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait()


def test_both_versions_at_once_exactly_one_executes(
    previous: PreviousRelease, old_env: dict[str, str], shared: TestDatabase
) -> None:
    """The previous code's run and today's run of one job and tenant, started together
    (both slowed: small batches, a pause between them): one executes everything, the other
    is skipped for the lease it could not take (or finds nothing left); the lease was
    taken once, at the next fencing token."""
    eligible = plant_overdue(shared, 150)
    before = fence(shared)
    slow = ("--batch-size", "5", "--throttle-ms", "100")
    runs = {v: start(v, previous, old_env, shared, *slow) for v in ("previous", "today")}
    try:
        summaries = {v: finish(p, f"{v}'s run", (0, 4)) for v, p in runs.items()}
    finally:
        stop(*runs.values())
    winners = [v for v, s in summaries.items() if s["status"] == "success" and s["processed_count"]]
    assert len(winners) == 1, summaries
    (winner,) = winners
    (loser,) = set(summaries) - {winner}
    print(f"{winner}'s run executed; {loser}'s: {summaries[loser]['status']}")
    assert summaries[winner]["succeeded_count"] == eligible
    lost = summaries[loser]
    assert (lost["status"], lost.get("status_reason")) in (
        ("skipped", "lease-not-acquired"),
        ("no_work", None),
    ), lost
    assert lost["processed_count"] == 0
    # each lease taken at the next token, the winner's first (a loser that found nothing
    # left took it after the winner); the lease keeps the last one
    taken = sorted(s["fencing_token"] for s in summaries.values() if s.get("fencing_token"))
    assert taken == list(range(before + 1, before + 1 + len(taken))), (before, summaries)
    assert summaries[winner]["fencing_token"] == before + 1
    assert fence(shared) == taken[-1]
    assert_outcome_intact(shared)
    with shared.engine.connect() as conn:  # each run names the code that ran it
        codes = {
            v: conn.execute(
                sa.text("SELECT code_version, code_revision FROM job_run WHERE id = :id"),
                {"id": s["job_run_id"]},
            ).one()
            for v, s in summaries.items()
        }
    if int(previous.code.revision or "0") < 18:
        assert tuple(codes["previous"]) == (None, None)  # a release before 0018 names none
    else:
        assert codes["previous"].code_revision == previous.code.revision
    assert "/".join(codes["today"]) == migrate.code_version()


@pytest.mark.parametrize(("holder", "taker"), [("previous", "today"), ("today", "previous")])
def test_a_frozen_holder_of_one_version_is_fenced_by_the_other(
    holder: str,
    taker: str,
    previous: PreviousRelease,
    old_env: dict[str, str],
    shared: TestDatabase,
) -> None:
    """test_liveness's frozen holder across versions: ``holder``'s run, frozen (SIGSTOP)
    mid-way, keeps its scope until its TTL (``taker``'s run is skipped); then ``taker``
    takes the lease at a higher fencing token and finishes the work, and the holder, woken,
    changes no business row or event: its token is stale. It ends failed/lease_lost."""
    ttl = 8  # the skipped run must start and end inside it, on a loaded machine too
    eligible = plant_overdue(shared, 300)
    before = fence(shared)
    lease = ("--lease-ttl-s", str(ttl))
    proc = start(
        holder, previous, old_env, shared, *lease, "--batch-size", "10", "--throttle-ms", "200"
    )

    def under_way() -> bool:
        if proc.poll() is not None:  # it ended, or never began: say why
            finish(proc, f"{holder}'s run, to be frozen", ())
        return overdue(shared) <= eligible - 20

    try:
        wait_for(under_way, 60, f"{holder}'s run to get under way")
        proc.send_signal(signal.SIGSTOP)
        held = fence(shared)
        assert held == before + 1
        blocked = start(taker, previous, old_env, shared, *lease)
        skipped = finish(blocked, f"{taker}'s run beside a live lease", (4,))
        if fence(shared) != held or not lease_unexpired(shared):
            pytest.fail("the machine stalled past the frozen holder's TTL before the check")
        assert (skipped["status"], skipped["status_reason"]) == ("skipped", "lease-not-acquired")

        wait_for(lambda: not lease_unexpired(shared), 3 * ttl, "the frozen holder's TTL to lapse")
        second = finish(
            start(taker, previous, old_env, shared, *lease), f"{taker}'s takeover", (0,)
        )
        assert second["status"] == "success" and second["fencing_token"] > held, second
        after_takeover = business(shared)
        assert 0 < second["processed_count"] < eligible  # the holder was frozen mid-way
        proc.send_signal(signal.SIGCONT)
        out, err = proc.communicate(timeout=60)
    finally:
        stop(proc)
    assert proc.returncode == 1, (out[-1000:], err[-2000:])
    assert not [r for r in REFUSALS if r in err], err[-2000:]
    with shared.engine.connect() as conn:  # the holder's own record: how it ended
        woken = conn.execute(
            sa.text(
                "SELECT status, status_reason, processed_count FROM job_run WHERE "
                "job_name = 'quote_expiration' AND scope = :s AND fencing_token = :f"
            ),
            {"s": RACE_TENANT, "f": held},
        ).one()
    assert (woken.status, woken.status_reason) == ("failed", "lease_lost"), woken
    assert business(shared) == after_takeover  # the stale holder wrote nothing once woken
    assert woken.processed_count + second["processed_count"] == eligible
    assert fence(shared) == second["fencing_token"]  # the lease's token never went back
    assert_outcome_intact(shared)
