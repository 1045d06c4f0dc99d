"""The ``qo-ops`` job commands as an operator uses them: run, status, runs, cancel.

Every case runs the real command against a real database. Bad input must end with exit
code 2, one line on stderr and nothing written anywhere (platform tables included).
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime

import pytest
import sqlalchemy as sa

from qo_ops.db.digest import database_digest
from qo_ops.db.schema import BUSINESS_TABLES
from qo_ops.demo.data import load_demo_data

AS_OF = datetime(2026, 3, 1, tzinfo=UTC)
JOB = "quote_expiration"
TENANT = "tenant-001"
OTHER_OWNER = "other-host:4242:deadbeef"

SUMMARY_KEYS = (
    "job_run_id",
    "job_name",
    "status",
    "mode",
    "scope",
    "requester",
    "eligible_count",
    "mutated_count",
    "processed_count",
    "succeeded_count",
    "failed_count",
    "skipped_count",
    "duration_ms",
)
# summary key -> job_run column, for everything the run row records
ROW_COLUMNS = {
    "job_run_id": "id",
    "job_name": "job_name",
    "status": "status",
    "mode": "mode",
    "scope": "scope",
    "requester": "requester",
    "eligible_count": "eligible_count",
    "processed_count": "processed_count",
    "succeeded_count": "succeeded_count",
    "failed_count": "failed_count",
    "skipped_count": "skipped_count",
}


@pytest.fixture
def demo(db):
    """Two small demo tenants; every ACTIVE quote of them is past expiry by now."""
    load_demo_data(db.engine, tenants=2, quotes=200, seed=7, as_of=AS_OF)
    return db


def digest(db) -> dict[str, str]:
    with db.engine.connect() as conn:
        return database_digest(conn)


def business_digest(db) -> dict[str, str]:
    with db.engine.connect() as conn:
        return database_digest(conn, BUSINESS_TABLES)


def overdue_active(db, tenant: str = TENANT) -> int:
    with db.engine.connect() as conn:
        return conn.scalar(
            sa.text(
                "SELECT count(*) FROM quote WHERE tenant_id = :t AND status = 'ACTIVE' "
                "AND expires_at < now()"
            ),
            {"t": tenant},
        )


def job_run_row(db, run_id: str) -> dict:
    with db.engine.connect() as conn:
        row = conn.execute(
            sa.text("SELECT * FROM job_run WHERE id = :id"), {"id": uuid.UUID(run_id)}
        ).one()
    return dict(row._mapping)


def hold_lease(db, owner: str = OTHER_OWNER) -> None:
    """Someone else holds the lease of (quote_expiration, tenant-001) for the next hour."""
    with db.engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO job_lease (job_name, scope, owner_id, lease_token, fencing_token, "
                "acquired_at, heartbeat_at, expires_at) "
                "VALUES (:job, :scope, :owner, 'held-elsewhere-token', 7, now(), now(), "
                "now() + interval '1 hour')"
            ),
            {"job": JOB, "scope": TENANT, "owner": owner},
        )


def parse_kv(stdout: str) -> dict[str, str]:
    pairs = {}
    for line in stdout.splitlines():
        assert "=" in line, f"not a key=value line: {line!r}"
        key, _, value = line.partition("=")
        pairs[key] = value
    return pairs


def assert_one_line_error(result) -> None:
    assert result.code == 2, (result.code, result.stdout, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].strip(), result.stderr
    assert "Traceback" not in result.stderr + result.stdout


# ------------------------------------------------------------------------- bad input

RUN = ("run", JOB, "--tenant", TENANT)
BAD_RUNS = {
    "unknown job": ("run", "quote_exterminator", "--tenant", TENANT),
    "unknown tenant": ("run", JOB, "--tenant", "tenant-999"),
    "impossible date": (*RUN, "--date", "2026-13-45"),
    "from without to": (*RUN, "--from", "2026-01-01"),
    "to without from": (*RUN, "--to", "2026-01-01"),
    "to before from": (*RUN, "--from", "2026-01-10", "--to", "2026-01-01"),
    "window on a non-windowed job": (*RUN, "--date", "2026-01-01"),
    "range on a non-windowed job": (*RUN, "--from", "2026-01-01", "--to", "2026-01-02"),
    "batch size 0": (*RUN, "--batch-size", "0"),
    "batch size -1": (*RUN, "--batch-size", "-1"),
    "batch size absurd": (*RUN, "--batch-size", "10000000"),
    "max items negative": (*RUN, "--max-items", "-5"),
    "throttle negative": (*RUN, "--throttle-ms", "-1"),
    "deadline 0": (*RUN, "--deadline-s", "0"),
    "lease ttl 0": (*RUN, "--lease-ttl-s", "0"),
    "execute without reason": (*RUN, "--mode", "execute"),
    "execute with blank reason": (*RUN, "--mode", "execute", "--reason", "   "),
    "mode sideways": (*RUN, "--mode", "sideways"),
    "tenant with DROP TABLE": ("run", JOB, "--tenant", "tenant-001'; DROP TABLE quote;--"),
    "tenant with OR 1=1": ("run", JOB, "--tenant", "x' OR '1'='1"),
    "execute limits bad": (*RUN, "--mode", "execute", "--reason", "r", "--batch-size", "0"),
}


@pytest.mark.parametrize("args", list(BAD_RUNS.values()), ids=list(BAD_RUNS))
def test_bad_run_input_exits_2_with_one_line_and_writes_nothing(demo, cli, args):
    before = digest(demo)
    result = cli(*args)
    assert_one_line_error(result)
    assert result.stdout == ""
    assert digest(demo) == before  # job_run, job_audit, job_lease and business tables alike


def test_sql_metacharacters_in_tenant_do_not_reach_the_database(demo, cli):
    for tenant in ("tenant-001'; DROP TABLE quote;--", "x' OR '1'='1"):
        result = cli("run", JOB, "--tenant", tenant, "--mode", "execute", "--reason", "r")
        assert_one_line_error(result)
    with demo.engine.connect() as conn:
        assert conn.scalar(sa.text("SELECT count(*) FROM quote")) == 400
        assert conn.scalar(sa.text("SELECT count(*) FROM job_run")) == 0


# ------------------------------------------------------------------------- run summary


def test_dry_run_prints_key_value_summary_and_changes_no_business_row(demo, cli):
    backlog = overdue_active(demo)
    assert backlog > 0
    before = business_digest(demo)

    result = cli("run", JOB, "--tenant", TENANT, "--mode", "dry-run", "--requester", "alice")

    assert result.code == 0, result.stderr
    assert "Traceback" not in result.stderr
    summary = parse_kv(result.stdout)
    for key in SUMMARY_KEYS:
        assert key in summary, f"{key} missing from {result.stdout}"
    assert summary["job_name"] == JOB
    assert summary["status"] == "success"
    assert summary["mode"] == "dry_run"
    assert summary["scope"] == TENANT
    assert summary["requester"] == "alice"
    assert int(summary["eligible_count"]) == backlog
    assert summary["mutated_count"] == "0"  # the seed's dry run: eligible_count=842 mutated_count=0
    assert summary["processed_count"] == "0"
    assert summary["succeeded_count"] == "0"
    assert summary["failed_count"] == "0"
    assert summary["skipped_count"] == "0"
    assert int(summary["duration_ms"]) >= 0
    assert business_digest(demo) == before
    row = job_run_row(demo, summary["job_run_id"])
    assert row["status"] == "success"
    assert row["mode"] == "dry_run"
    assert row["eligible_count"] == backlog
    assert overdue_active(demo) == backlog


def test_json_summary_matches_the_job_run_row(demo, cli):
    backlog = overdue_active(demo)
    result = cli(
        "run",
        JOB,
        "--tenant",
        TENANT,
        "--mode",
        "execute",
        "--reason",
        "test",
        "--requester",
        "bob",
        "--batch-size",
        "25",
        "--json",
    )

    assert result.code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 1, result.stdout
    summary = json.loads(lines[0])
    assert isinstance(summary, dict)
    for key in SUMMARY_KEYS:
        assert key in summary, key
    assert summary["status"] == "success"
    assert summary["mode"] == "execute"
    assert summary["processed_count"] == backlog
    assert summary["succeeded_count"] == backlog
    assert summary["mutated_count"] == backlog  # every overdue quote expired
    assert isinstance(summary["duration_ms"], int) and summary["duration_ms"] >= 0

    row = job_run_row(demo, summary["job_run_id"])
    for key, column in ROW_COLUMNS.items():
        value = str(row[column]) if column == "id" else row[column]
        assert summary[key] == value, (key, summary[key], value)
    assert row["trigger_type"] == "manual"
    assert row["finished_at"] is not None
    assert overdue_active(demo) == 0


def test_execute_exits_0_and_expires_the_backlog(demo, cli):
    backlog = overdue_active(demo)
    other = overdue_active(demo, "tenant-002")
    result = cli("run", JOB, "--tenant", TENANT, "--mode", "execute", "--reason", "r")
    assert result.code == 0, result.stderr
    summary = parse_kv(result.stdout)
    assert summary["status"] == "success"
    assert int(summary["succeeded_count"]) == backlog
    assert overdue_active(demo) == 0
    assert overdue_active(demo, "tenant-002") == other  # scope respected


def test_run_while_lease_is_held_is_skipped_with_exit_4(demo, cli):
    hold_lease(demo)
    before = business_digest(demo)

    result = cli("run", JOB, "--tenant", TENANT, "--mode", "execute", "--reason", "r")

    assert result.code == 4, (result.stdout, result.stderr)
    summary = parse_kv(result.stdout)
    assert summary["status"] == "skipped"
    assert summary["status_reason"] == "lease-not-acquired"
    assert summary["processed_count"] == "0"
    assert business_digest(demo) == before
    row = job_run_row(demo, summary["job_run_id"])
    assert row["status"] == "skipped"
    assert row["status_reason"] == "lease-not-acquired"
    with demo.engine.connect() as conn:
        owner = conn.scalar(
            sa.text("SELECT owner_id FROM job_lease WHERE job_name = :j AND scope = :s"),
            {"j": JOB, "s": TENANT},
        )
    assert owner == OTHER_OWNER  # the holder keeps its lease


# ------------------------------------------------------------------------- status / runs


def test_status_shows_lease_holder_and_backlog(demo, cli):
    hold_lease(demo)
    backlog = overdue_active(demo)
    other_backlog = overdue_active(demo, "tenant-002")
    assert backlog > 0

    text = cli("status")
    assert text.code == 0, text.stderr
    assert "job status" in text.stdout
    headers = ("job", "tenant", "last run", "mode", "status", "last success", "lease holder")
    for header in (*headers, "stale", "backlog", "checkpoint age", "code", "summary"):
        assert header in text.stdout
    line = next(ln for ln in text.stdout.splitlines() if ln.startswith(JOB) and f" {TENANT} " in ln)
    assert OTHER_OWNER in line
    # quote_expiration keeps no checkpoint; no run of it yet, so no code that ran it
    assert line.split()[-3:] == [str(backlog), "-", "-"]

    as_json = cli("status", JOB, "--json")
    assert as_json.code == 0, as_json.stderr
    rows = {r["scope"]: r for r in json.loads(as_json.stdout)["status"]}
    assert set(rows) == {TENANT, "tenant-002"}
    assert rows[TENANT]["job_name"] == JOB
    assert rows[TENANT]["lease_holder"] == OTHER_OWNER
    assert rows[TENANT]["backlog"] == backlog
    assert rows["tenant-002"]["lease_holder"] is None
    assert rows["tenant-002"]["backlog"] == other_backlog
    for key in ("last_run_at", "last_status", "last_success_at"):
        assert key in rows[TENANT]

    one = cli("status", JOB, "--tenant", "tenant-002", "--json")
    assert [r["scope"] for r in json.loads(one.stdout)["status"]] == ["tenant-002"]
    assert json.loads(one.stdout)["tenant_chunk"] == "chunk-001"  # its windowed partitions
    text = cli("status", JOB, "--tenant", "tenant-002").stdout
    assert text.splitlines()[0] == "summary of tenant-002 (windowed jobs: tenant chunk chunk-001)"


def test_status_after_execute_shows_last_success_and_no_backlog(demo, cli):
    run = cli("run", JOB, "--tenant", TENANT, "--mode", "execute", "--reason", "r", "--json")
    assert run.code == 0, run.stderr
    rows = {r["scope"]: r for r in json.loads(cli("status", JOB, "--json").stdout)["status"]}
    assert rows[TENANT]["backlog"] == 0
    assert rows[TENANT]["last_status"] == "success"
    assert rows[TENANT]["last_success_at"] is not None
    assert rows[TENANT]["lease_holder"] is None  # released at the end of the run
    assert rows["tenant-002"]["backlog"] == overdue_active(demo, "tenant-002") > 0


def test_runs_lists_history_as_table_and_json(demo, cli):
    dry = json.loads(cli("run", JOB, "--tenant", TENANT, "--json").stdout)
    execute = json.loads(
        cli("run", JOB, "--tenant", TENANT, "--mode", "execute", "--reason", "r", "--json").stdout
    )

    text = cli("runs", JOB)
    assert text.code == 0, text.stderr
    assert f"runs of {JOB}" in text.stdout
    for header in ("run", "dagster", "scope", "mode", "trigger", "started", "status", "processed"):
        assert header in text.stdout
    assert dry["job_run_id"][:8] in text.stdout  # short ids; --json has them whole
    assert execute["job_run_id"][:8] in text.stdout
    assert TENANT in text.stdout
    assert "retry pressure" not in text.stdout  # a job that calls no downstream: no such column

    as_json = cli("runs", JOB, "--tenant", TENANT, "--json")
    assert as_json.code == 0, as_json.stderr
    history = json.loads(as_json.stdout)["runs"]
    assert [r["id"] for r in history] == [execute["job_run_id"], dry["job_run_id"]]  # newest first
    newest = history[0]
    assert newest["job_name"] == JOB
    assert newest["scope"] == TENANT
    assert newest["mode"] == "execute"
    assert newest["trigger_type"] == "manual"
    assert newest["status"] == "success"
    assert newest["processed_count"] == execute["processed_count"]
    assert newest["tally"] == execute["tally"]
    assert history[1]["mode"] == "dry_run"

    assert json.loads(cli("runs", JOB, "--tenant", "tenant-002", "--json").stdout)["runs"] == []


def _runs_table(db, *args: str, columns: int = 120) -> tuple[list[str], dict[str, list[str]]]:
    """``qo-ops runs`` piped, COLUMNS wide: its header cells, and each run's lines (its row,
    then its note if it has one) by short run id."""
    from qo_ops_tests.conftest import base_env, run_cli

    result = run_cli(
        ["runs", *args], base_env(QO_OPS_DATABASE_URL=db.env_url, COLUMNS=str(columns))
    )
    assert result.code == 0, result.stderr
    title, header, *lines = result.stdout.splitlines()
    runs: dict[str, list[str]] = {}
    for line in lines:
        if line.startswith(" "):
            runs[list(runs)[-1]].append(line)  # a note goes with the row above it
        else:
            runs[line.split()[0]] = [line]
    return header.split(), runs


def test_runs_shows_why_a_run_ended_the_reason_it_was_asked_for_and_its_dagster_run(demo, cli):
    """The runner's words (status_reason) under "why", the requester's under "reason", each
    on the run's note line; the Dagster run id in short; long words cut to the width with an
    ellipsis, whole in --json."""
    from qo_ops.jobs.catalog import get_spec
    from qo_ops.platform.job.options import RunOptions
    from qo_ops.platform.job.scope import Scope
    from qo_ops.platform.run.runner import run_job

    reason = "INC-42 stale quotes after the pricing outage " + "and a long story " * 20
    capped = json.loads(
        cli(
            "run", JOB, "--tenant", TENANT, "--mode", "execute", "--max-items", "5",
            "--reason", reason, "--json",
        ).stdout
    )  # fmt: skip
    dagster_run_id = str(uuid.uuid4())
    scheduled = run_job(  # as the Dagster op calls it for a schedule's tick
        get_spec(JOB),
        Scope(TENANT),
        RunOptions(trigger="schedule", dagster_run_id=dagster_run_id).validated(),
        engine=demo.engine,
    )

    header, runs = _runs_table(demo, JOB, "--tenant", TENANT)
    assert header == [
        "run", "dagster", "scope", "started", "mode", "trigger", "status",
        "eligible", "processed", "failed",
    ]  # fmt: skip
    row, note = runs[capped["job_run_id"][:8]]
    assert row.split()[1] == "-"  # a CLI run has no Dagster run
    assert row.split()[5:8] == ["execute", "manual", "success"]  # (started: day, time)
    assert note.strip().startswith("why: max items reached · reason: INC-42 stale quotes after")
    assert note.endswith("…") and len(note) == 120  # cut at the width, not wrapped
    [row] = runs[scheduled.job_run_id[:8]]  # nothing to say: no note
    assert row.split()[1] == dagster_run_id[:8]
    assert row.split()[5:8] == ["dry_run", "schedule", "success"]
    assert all(len(lines[0]) <= 120 for lines in runs.values())  # rows of a tenant's runs

    narrow = _runs_table(demo, JOB, "--tenant", TENANT, columns=80)[1]
    assert len(narrow[capped["job_run_id"][:8]][1]) == 80

    history = {r["id"]: r for r in json.loads(cli("runs", JOB, "--json").stdout)["runs"]}
    whole = history[capped["job_run_id"]]
    assert whole["reason"] == reason  # every field whole in --json
    assert whole["status_reason"] == "max items reached"
    assert whole["dagster_run_id"] is None
    assert history[scheduled.job_run_id]["dagster_run_id"] == dagster_run_id
    assert history[scheduled.job_run_id]["reason"] is None


def test_downstream_status_before_any_breaker_opened(db, cli):
    """No run has opened a breaker: the view says so (the opened one, with its reason and
    next probe, is in qo_ops_tests/metrics/test_downstream_metrics.py)."""
    text = cli("downstream-status")
    assert text.code == 0, text.stderr
    assert text.stdout.strip() == "no breaker recorded: no run has called a downstream yet"
    assert json.loads(cli("downstream-status", "--json").stdout) == {"breakers": []}
    assert "breakers_not_closed" in json.loads(cli("status", JOB, "--json").stdout)
    bad = cli("downstream-status", "--tenant", TENANT)
    assert bad.code == 2 and "Traceback" not in bad.stderr


# ------------------------------------------------------------------------- cancel


def test_cancel_rejects_a_non_uuid(demo, cli):
    before = digest(demo)
    result = cli("cancel", "not-a-uuid", "--reason", "x")
    assert_one_line_error(result)
    assert digest(demo) == before


def test_cancel_of_an_unknown_run_is_bad_input_and_audits_nothing(demo, cli):
    before = digest(demo)
    result = cli("cancel", str(uuid.uuid4()), "--reason", "x")
    assert_one_line_error(result)
    assert digest(demo) == before


def _plant_running_run(db, run_id: str) -> None:
    """A ``running`` job_run row of quote_expiration (its process is not needed: cancel by
    a short id is refused before anything is looked at beyond the ids)."""
    with db.engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO job_run (id, job_name, scope, mode, trigger_type, owner_id, status) "
                "VALUES (:id, :job, :scope, 'execute', 'manual', :owner, 'running')"
            ),
            {"id": uuid.UUID(run_id), "job": JOB, "scope": TENANT, "owner": OTHER_OWNER},
        )


def test_cancel_by_a_short_id_needs_exactly_one_running_run_with_it(demo, cli):
    """A short id that no running run has (a finished run's too), or that two share, is
    refused with one line, changing nothing (no audit row); the stopping itself by a short
    id is in qo_ops_tests/platform/run/test_runner.py."""
    finished = json.loads(cli("run", JOB, "--tenant", TENANT, "--json").stdout)["job_run_id"]
    _plant_running_run(demo, "abcdef01-0000-4000-8000-000000000001")
    _plant_running_run(demo, "abcdef01-0000-4000-8000-000000000002")
    before = digest(demo)
    for short, says in (
        (finished[:8], "no running run has an id starting"),
        ("abcdef01", "several running runs have ids starting"),
        ("ABCDEF01-0000-4000-8000-00000000000", "several running runs"),
        ("abcdef0", "is not a run id"),  # too short to be one
        ("abcdefgh", "is not a run id"),
    ):
        result = cli("cancel", short, "--reason", "x")
        assert_one_line_error(result)
        assert says in result.stderr, (short, result.stderr)
    assert digest(demo) == before


def _on_a_terminal(db, *args: str) -> tuple[int, str]:
    """Run ``qo-ops`` with its stdout on a pseudo-terminal (boxed tables); its output."""
    import os
    import pty
    import subprocess

    from qo_ops_tests.conftest import QO_OPS_BIN, base_env

    master, slave = pty.openpty()
    env = base_env(QO_OPS_DATABASE_URL=db.env_url, COLUMNS="200", TERM="xterm")
    proc = subprocess.Popen(
        [QO_OPS_BIN, *args], stdout=slave, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env
    )
    os.close(slave)
    chunks = []
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    _, err = proc.communicate(timeout=120)
    out = b"".join(chunks).decode(errors="replace")
    return proc.returncode, out + err.decode(errors="replace")


def test_an_operators_words_in_a_terminal_table_are_shown_not_read_as_markup(demo, cli):
    reason = "INC-9 [/] [bold]not bold[/bold] [link=http://x]y"
    assert cli("suspend", JOB, "--tenant", TENANT, "--reason", reason).code == 0
    code, out = _on_a_terminal(demo, "status", JOB)
    assert code == 0, out
    assert "Traceback" not in out and "MarkupError" not in out
    assert "[bold]not bold[/bold]" in out and "[/]" in out  # the words, as typed


# ------------------------------------------------------------------------- demo-dagster


def _events(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _demo_runs_by_location(db) -> dict[str, tuple[str | None, int]]:
    """Each job's demo runs as the UI finds them: the runs carrying the code location's tag
    (the job's Runs tab filters on it), and the location of their origin (the timeline's)."""
    import dagster as dg

    from qo_ops.dagster_defs.instance import local_location_tags
    from qo_ops.db.engine import DatabaseTarget

    storage = DatabaseTarget(db.url).dagster_storage_url()
    found: dict[str, tuple[str | None, int]] = {}
    with dg.instance_for_test(
        overrides={"storage": {"postgres": {"postgres_url": storage}}}
    ) as instance:
        for run in instance.get_runs(filters=dg.RunsFilter(tags=local_location_tags())):
            origin = run.remote_job_origin
            where = origin.repository_origin.code_location_origin.location_name if origin else None
            seen = found.get(run.job_name, (where, 0))
            found[run.job_name] = (where if seen[0] == where else "mixed", seen[1] + 1)
    return found


def test_demo_dagster_runs_every_catalog_job_through_dagster(db, pg_server, tmp_path):
    """`make demo`'s Dagster step: every catalog job executed through real Dagster for one
    tenant (a windowed job: its latest day with work, the tenant in run config), each run a
    success with its outcome checks passed, on the tenant's partition. A person reads a few
    lines per run; the runs' JSON events are in a file under QO_OPS_HOME (--verbose shows
    them too, --json prints one object)."""
    from qo_ops.jobs.catalog import CATALOG
    from qo_ops_tests.conftest import base_env, drop_database, run_cli

    load_demo_data(db.engine, tenants=2, quotes=400, seed=1, as_of=datetime.now(UTC))
    env = base_env(QO_OPS_DATABASE_URL=db.env_url, QO_OPS_HOME=str(tmp_path))
    events_log = tmp_path / "logs" / "demo-dagster.jsonl"
    try:
        result = run_cli(["demo-dagster", "--tenant", TENANT], env, timeout=600)
        again = run_cli(
            ["demo-dagster", "--tenant", TENANT, "--json", "--verbose"], env, timeout=600
        )
        placed = _demo_runs_by_location(db)
    finally:  # the Dagster storage it created next to the test's database
        drop_database(pg_server, f"{db.url.database}_dagster")
    assert result.code == 0, (result.stdout, result.stderr)
    assert '"event.name"' not in result.stdout + result.stderr  # no JSON for a person
    first, approved, *lines, total, where = result.stdout.splitlines()
    assert str(events_log) in first and str(events_log) in where
    destructive = sorted(n for n, s in CATALOG.items() if s.destructive)
    assert approved.startswith("approvals for the destructive jobs' executes")  # as any path
    assert all(name in approved for name in destructive), approved
    assert total.startswith(f"{len(CATALOG)} Dagster runs, {len(CATALOG)} succeeded")
    heads = [line for line in lines if not line.startswith("  ")]
    assert len(lines) <= 3 * len(heads)  # a few lines a run
    runs = {line.split(" · ", 1)[0]: line for line in heads}
    assert sorted(runs) == sorted(CATALOG)
    for head in runs.values():  # e.g. "quote_expiration · tenant-001 · execute: success (…)"
        assert head.split(" · ")[1].split("/")[0] == TENANT, head
        assert " · execute: " in head and "FAILED" not in head, head
    status = {name: head.split(": ", 1)[1].split()[0] for name, head in runs.items()}
    checks = {  # job -> the checks its run passed, from the line under its counts
        line.split(" · ", 1)[0]: lines[n + 2].removeprefix("  checks passed: ").split(", ")
        for n, line in enumerate(lines)
        if line in heads
    }
    assert not any("FAILED" in line for line in lines)
    for spec in CATALOG.values():
        declared = {c.name for c in spec.checks}
        # and each success marks its tenant fresh (recent_success) on the outcome asset, as
        # does a partial success of a job whose catalog entry counts it (delivery_retry)
        fresh = {"recent_success"} if status[spec.name] in spec.fresh_statuses else set()
        assert set(checks[spec.name]) == declared | fresh, (spec.name, checks[spec.name])
    with db.engine.connect() as conn:  # every job ran for the tenant, executing
        ran = conn.execute(
            sa.text(
                "SELECT id, job_name, scope, mode, trigger_type, approval_id FROM job_run "
                "ORDER BY started_at"
            )
        ).all()
    assert sorted({r.job_name for r in ran}) == sorted(CATALOG)
    # each Dagster run is in the code location the UI serves (workspace.yaml's): the job's
    # Runs tab (by its tag) and the Overview timeline (by its origin) show it
    assert placed == {name: ("qo_ops.definitions", 2) for name in CATALOG}
    assert {(r.scope.split("/")[0], r.mode, r.trigger_type) for r in ran} == {
        (TENANT, "execute", "manual")
    }
    cited = sorted({r.job_name for r in ran if r.approval_id is not None})
    assert cited == destructive  # each destructive execute cites the demo's approval

    # --json: one object (the log holds the second demo's events only: rewritten each time)
    assert again.code == 0, (again.stdout, again.stderr)
    [line] = again.stdout.splitlines()
    output = json.loads(line)
    assert output["events_log"] == str(events_log) and output["dagster_failures"] == 0
    assert sorted(r["job_name"] for r in output["runs"]) == sorted(CATALOG)
    second = {r["job_run_id"] for r in output["runs"]}
    assert len(second) == len(CATALOG) and not second & {str(r.id) for r in ran[: len(CATALOG)]}
    assert all(uuid.UUID(r["dagster_run_id"]) for r in output["runs"])
    events = _events(events_log)
    assert {e["job.run_id"] for e in events if e["event.name"] == "job.finished"} == second
    assert {e["job.run_id"] for e in events if e["event.name"] == "job.started"} == second
    assert all(e["job.scope"].split("/")[0] == TENANT for e in events)
    # --verbose: Dagster's own lines, the JSON events among them, on stderr
    assert '"event.name": "job.finished"' in again.stderr
