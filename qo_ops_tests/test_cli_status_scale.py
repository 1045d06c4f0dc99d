"""``qo-ops status`` and ``qo-ops runs`` as an operator reads them over 10,000 tenants: a
summary per job first, then only the tenants that need a look (failing, stale, running),
``--failing`` / ``--stale`` filters, a mode column (a dry run is not a success of the job),
an unknown tenant refused with exit 2, and ``runs`` without a job ("what ran in the last
hour?"). Real PostgreSQL and the real CLI; the times are printed (measured, not asserted:
``make bench`` is where speed is judged)."""

from __future__ import annotations

import json
import time

import pytest
import sqlalchemy as sa

from qo_ops_tests.dagster import scale_fixtures as sf

JOB = "quote_expiration"  # hourly: stale after 3 h without a successful execute
FAILING = "scale-00007"
STALE = ["scale-00011", "scale-00012", "scale-00013"]
DRY_ONLY = "scale-00021"  # its last run a dry run: success of a dry run is no success
NEVER = "scale-00031"


def _report(capsys: pytest.CaptureFixture[str], line: str) -> None:
    with capsys.disabled():
        print(f"\n[status scale] {line}")


@pytest.fixture
def fleet(db):
    """10,000 tenants a day old; every one's quote_expiration ran an execute 10 minutes ago
    (and its first run a day ago), but: one's last run failed, three last succeeded 5 h ago,
    one's last success is 5 h old and its last run a dry run since, one never ran; and one
    run of another job in the last hour."""
    tenants = sf.insert_tenants(db.engine, sf.SCALE_TENANTS)
    with db.engine.begin() as conn:
        conn.execute(sa.text("UPDATE tenant SET created_at = now() - interval '1 day'"))
        insert = """
            INSERT INTO job_run (id, job_name, scope, mode, trigger_type, owner_id, status,
                                 created_at, started_at, heartbeat_at, finished_at)
            SELECT gen_random_uuid(), :job, t, :mode, 'schedule', 'test', :status,
                   now() - make_interval(secs => :ago), now() - make_interval(secs => :ago),
                   now() - make_interval(secs => :ago), now() - make_interval(secs => :ago - 1)
              FROM unnest(CAST(:tenants AS text[])) t
        """
        everyone = [t for t in tenants if t != NEVER]

        def runs(tenants: list[str], ago: float, status: str = "success", mode="execute", job=JOB):
            conn.execute(
                sa.text(insert),
                {"job": job, "tenants": tenants, "ago": ago, "status": status, "mode": mode},
            )

        runs(everyone, 86_000)  # the job at work for a day
        runs([t for t in everyone if t not in STALE and t != DRY_ONLY], 600)
        runs(STALE + [DRY_ONLY], 5 * 3600)
        runs([DRY_ONLY], 300, mode="dry_run")
        runs([FAILING], 120, status="failed")
        runs(["scale-00001"], 60, job="delivery_retry")
    return db


def test_status_and_runs_over_10_000_tenants_say_what_needs_a_look(fleet, cli, capsys):
    started = time.monotonic()
    text = cli("status", JOB)
    took = time.monotonic() - started
    assert text.code == 0, text.stderr
    lines = text.stdout.splitlines()
    assert lines[0] == "summary"  # the summary first
    summary = lines[2].split()
    # failing 1; stale 5 (a tenant that never succeeded is stale too); never run 1
    assert summary[:6] == [JOB, "10000", "1", "5", "1", "0"], lines[:3]
    listed = [ln.split()[1] for ln in lines if ln.startswith(f"{JOB}  scale-")]
    assert sorted(listed) == sorted([FAILING, *STALE, DRY_ONLY, NEVER]), listed  # not 10,000
    dry = next(ln for ln in lines if f" {DRY_ONLY} " in ln)
    assert " dry-run " in dry and "STALE" in dry  # its last run a dry run: mode shown
    assert " failed " in next(ln for ln in lines if f" {FAILING} " in ln)
    _report(capsys, f"qo-ops status {JOB} over 10,000 tenants: {took:.2f} s (the CLI process)")

    failing = cli("status", JOB, "--failing")
    assert [ln.split()[1] for ln in failing.stdout.splitlines() if ln.startswith(f"{JOB}  ")][
        1:
    ] == [FAILING]
    stale = json.loads(cli("status", JOB, "--stale", "--json").stdout)
    assert sorted(r["scope"] for r in stale["status"]) == sorted([*STALE, DRY_ONLY, NEVER])
    assert stale["summary"] == [
        {"job_name": JOB, "tenants": 10000, "failing": 1, "stale": 5, "never_run": 1,
         "running": 0, "suspended": 0}
    ]  # fmt: skip
    every = json.loads(cli("status", JOB, "--json").stdout)  # --json: all rows
    assert len(every["status"]) == 10_000

    started = time.monotonic()
    whole = cli("status")
    took_all = time.monotonic() - started
    assert whole.code == 0 and whole.stdout.splitlines()[0] == "summary"
    _report(capsys, f"qo-ops status (11 jobs) over 10,000 tenants: {took_all:.2f} s")

    unknown = cli("status", "--tenant", "tenant-999")
    assert (
        unknown.code == 2 and unknown.stderr.strip() == "qo-ops: error: unknown tenant tenant-999"
    )
    one = cli("status", JOB, "--tenant", NEVER)
    assert one.code == 0 and f" {NEVER} " in one.stdout

    started = time.monotonic()
    recent = cli("runs", "--since", "1h")
    took_runs = time.monotonic() - started
    assert recent.code == 0, recent.stderr
    assert recent.stdout.splitlines()[0] == "runs of every job asked for in the last 1h"
    rows = [ln for ln in recent.stdout.splitlines() if "  schedule  " in ln]
    assert len(rows) == 20  # --limit's default, newest first
    assert "delivery_retry" in rows[0] and FAILING in rows[1] and DRY_ONLY in rows[2]
    few = json.loads(cli("runs", "--since", "90s", "--json").stdout)["runs"]
    assert [(r["job_name"], r["scope"]) for r in few] == [("delivery_retry", "scale-00001")]
    _report(capsys, f"qo-ops runs --since 1h over 10,000 tenants' runs: {took_runs:.2f} s")
