"""temp_file_cleanup against real PostgreSQL and real stored objects (files under a temporary
QO_OPS_HOME): exactly the eligible files go, row and object, each with a tombstone; legal
holds survive every path; an anomalous amount stops the run before anything is deleted; a
dry-run counts exactly what execute deletes; a crash at any point is mended by a rerun."""

from __future__ import annotations

import dataclasses
import hashlib
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError

from qo_ops.db import migrate
from qo_ops.db.digest import database_digest
from qo_ops.db.schema import BUSINESS_TABLES
from qo_ops.demo.data import load_demo_data
from qo_ops.jobs import temp_file_cleanup as tfc
from qo_ops.jobs.temp_file_cleanup import SPEC
from qo_ops.platform.calls import object_store
from qo_ops.platform.job.options import RunOptions
from qo_ops.platform.job.outcome import BatchContext, BatchOutcome
from qo_ops.platform.job.scope import Scope
from qo_ops.platform.job.spec import SecondTransaction
from qo_ops.platform.run.records import reap_orphans
from qo_ops.platform.run.runner import RunSummary, run_job
from qo_ops_tests.conftest import base_env, run_cli, standing_approval

APPROVAL = standing_approval(SPEC.name)  # a destructive execute cites one

TENANT, OTHER = "tenant-001", "tenant-002"
CHECKS = {
    "no_legal_hold_removed",
    "nothing_eligible_past_grace",
    "deleted_objects_gone",
    "eligible_within_anomaly_threshold",
}
ENV = (
    tfc.RETENTION_ENV,
    tfc.MAX_DELETE_ENV,
    tfc.MAX_SHARE_ENV,
    tfc.OVERRIDE_ENV,
    "QO_OPS_CRASH_AT",
)

# ------------------------------------------------------------------------- helpers


@dataclasses.dataclass(frozen=True)
class Stored:
    storage_path: str
    size: int
    sha256: str


def today() -> date:
    return datetime.now(UTC).date()


def window(first_days_ago: int, last_days_ago: int, tenant: str = TENANT) -> Scope:
    """Files created from ``first_days_ago`` days ago up to (excluding) ``last_days_ago``."""
    return Scope(
        tenant, today() - timedelta(days=first_days_ago), today() - timedelta(days=last_days_ago)
    )


WHOLE = (31, -1)  # every demo file: ages 0..29 days plus up to 10 hours
MIXED = (14, 2)  # files aged about 2..14 days: some past the 7-day retention, some not


def write_objects(engine: sa.Engine, home: Path) -> dict[int, Stored]:
    """A small object for every temp_file row; size_bytes becomes the object's real size."""
    found = {}
    with engine.begin() as conn:
        rows = conn.execute(sa.text("SELECT id, tenant_id, storage_path FROM temp_file")).all()
        for r in rows:
            data = f"{r.tenant_id}/{r.id}\n".encode() * (1 + r.id % 7)
            path = home / "objects" / r.storage_path
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            found[r.id] = Stored(r.storage_path, len(data), hashlib.sha256(data).hexdigest())
        conn.execute(
            sa.text(
                "UPDATE temp_file f SET size_bytes = s.size FROM unnest(CAST(:ids AS bigint[]), "
                "CAST(:sizes AS bigint[])) AS s(id, size) WHERE f.id = s.id"
            ),
            {"ids": list(found), "sizes": [s.size for s in found.values()]},
        )
    return found


def tree(home: Path) -> dict[str, str]:
    """Every stored object: path under objects/ -> sha256 of its bytes."""
    root = home / "objects"
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def rows(engine: sa.Engine, sql: str, **params: Any) -> list[sa.Row]:
    with engine.connect() as conn:
        return conn.execute(sa.text(sql), params).all()


def scalar(engine: sa.Engine, sql: str, **params: Any) -> Any:
    with engine.connect() as conn:
        return conn.execute(sa.text(sql), params).scalar()


def expected_ids(engine: sa.Engine, scope: Scope, retention_days: int = 7) -> list[int]:
    """The eligible files, by the rule of the seed note, in the job's order."""
    start, end = scope.window_bounds()
    return [
        r.id
        for r in rows(
            engine,
            "SELECT id FROM temp_file WHERE tenant_id = :t AND created_at >= :s AND created_at < :e "
            "AND created_at < now() - make_interval(days => :d) "
            "AND status IN ('COMPLETED', 'FAILED_TERMINAL') AND NOT legal_hold "
            "ORDER BY created_at, id",
            t=scope.tenant_id,
            s=start,
            e=end,
            d=retention_days,
        )
    ]


def file_ids(engine: sa.Engine) -> set[int]:
    return {r.id for r in rows(engine, "SELECT id FROM temp_file")}


def tombstones(engine: sa.Engine) -> dict[int, sa.Row]:
    return {r.temp_file_id: r for r in rows(engine, "SELECT * FROM temp_file_tombstone")}


def business_digest(engine: sa.Engine) -> dict[str, str]:
    with engine.connect() as conn:
        return database_digest(conn, BUSINESS_TABLES)


def run(engine: sa.Engine, scope: Scope, **options: Any) -> RunSummary:
    options.setdefault("mode", "execute")
    options.setdefault("requester", "test:temp-file-cleanup")
    if options["mode"] == "execute" and options.get("trigger", "manual") == "manual":
        options.setdefault("reason", "test cleanup")
        options.setdefault("approval", APPROVAL)
    return run_job(SPEC, scope, RunOptions(**options), engine=engine)


def failed_checks(summary: RunSummary) -> list[tuple[str, dict]]:
    assert {c.name for c in summary.checks} == CHECKS
    return [(c.name, c.metadata) for c in summary.checks if not c.passed]


def assert_consistent(
    engine: sa.Engine, home: Path, stored: dict[int, Stored], deleted: set[int], run_ids: set[str]
) -> None:
    """Rows, objects and tombstones agree: every remaining row has its original object, no
    deleted file's object is left, and each deleted file has one complete tombstone with its
    original path, size and checksum."""
    remaining = file_ids(engine)
    assert remaining == set(stored) - deleted
    on_disk = tree(home)
    assert on_disk == {stored[i].storage_path: stored[i].sha256 for i in remaining}
    stones = tombstones(engine)
    assert set(stones) == deleted
    for file_id, stone in stones.items():
        assert stone.deleted_at is not None and stone.legal_hold is False
        assert (stone.storage_path, stone.size_bytes, stone.sha256) == (
            stored[file_id].storage_path,
            stored[file_id].size,
            stored[file_id].sha256,
        )
        assert str(stone.job_run_id) in run_ids
        assert stone.tenant_id == TENANT


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """QO_OPS_HOME for the job (objects live under it); cleanup settings at their defaults."""
    path = tmp_path / "home"
    (path / "objects").mkdir(parents=True)
    monkeypatch.setenv("QO_OPS_HOME", str(path))
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    return path


@pytest.fixture
def loaded(db, home) -> Iterator[tuple[Any, Path, dict[int, Stored]]]:
    """Two tenants of 100 temp files each, aged 0..29 days from now, every one stored."""
    load_demo_data(db.engine, tenants=2, quotes=1000, seed=11, as_of=datetime.now(UTC))
    yield db, home, write_objects(db.engine, home)


# ------------------------------------------------------------------------- dry-run, execute


def test_dry_run_counts_exactly_what_execute_deletes_row_object_and_tombstone(loaded):
    db, home, stored = loaded
    scope = window(*MIXED)
    expected = expected_ids(db.engine, scope)
    start, end = scope.window_bounds()
    in_window = {
        r.id: r
        for r in rows(
            db.engine,
            "SELECT id, status, legal_hold, created_at < now() - interval '7 days' AS old "
            "FROM temp_file WHERE tenant_id = :t AND created_at >= :s AND created_at < :e",
            t=TENANT,
            s=start,
            e=end,
        )
    }
    # the window holds every kind of file the job must leave alone
    assert 5 <= len(expected) < len(in_window)
    held_old = {i for i, r in in_window.items() if r.legal_hold and r.old}
    young = {i for i, r in in_window.items() if not r.old and r.status != "PENDING"}
    pending_old = {i for i, r in in_window.items() if r.status == "PENDING" and r.old}
    assert held_old and young and pending_old

    before, objects_before = business_digest(db.engine), tree(home)
    dry = run(db.engine, scope, mode="dry_run")
    assert business_digest(db.engine) == before and tree(home) == objects_before
    assert (dry.status, dry.eligible_count) == ("success", len(expected))
    assert dry.sample_ids == [str(i) for i in expected[:10]]

    done = run(db.engine, scope, batch_size=3)

    assert done.status == "success", (done.error_code, done.error_text)
    assert (
        done.eligible_count == done.counts.processed == done.counts.succeeded == dry.eligible_count
    )
    assert done.batches == -(-len(expected) // 3)
    assert done.tally == {
        "objects_removed": len(expected),
        "objects_already_gone": 0,
        "bytes_removed": sum(stored[i].size for i in expected),
        "side_effect.object_delete.success": len(expected),
    }
    assert failed_checks(done) == []
    assert_consistent(db.engine, home, stored, set(expected), {done.job_run_id})
    assert held_old | young | pending_old <= file_ids(db.engine)  # all of them still there
    stones = tombstones(db.engine)
    assert [stones[i].file_status for i in expected] == [in_window[i].status for i in expected]
    assert {s.reason for s in stones.values()} == {"retention: terminal and older than 7 days"}

    again = run(db.engine, scope)
    assert (again.status, again.counts.processed) == ("no_work", 0)
    assert_consistent(db.engine, home, stored, set(expected), {done.job_run_id})


def test_only_the_scope_is_touched(loaded):
    db, home, stored = loaded
    scope = window(*MIXED)
    expected = set(expected_ids(db.engine, scope))
    other_tenant = expected_ids(db.engine, window(*MIXED, tenant=OTHER))
    earlier = expected_ids(db.engine, window(30, 14))
    assert other_tenant and earlier

    run(db.engine, scope)

    assert file_ids(db.engine) == set(stored) - expected
    assert set(other_tenant) | set(earlier) <= file_ids(db.engine)


def test_retention_is_read_from_the_environment_when_the_run_starts(loaded, monkeypatch):
    db, home, stored = loaded
    scope = window(*MIXED)
    monkeypatch.setenv(tfc.RETENTION_ENV, "10")
    longer = expected_ids(db.engine, scope, retention_days=10)
    assert 0 < len(longer) < len(expected_ids(db.engine, scope))

    done = run(db.engine, scope)

    assert done.counts.succeeded == len(longer)
    assert_consistent(db.engine, home, stored, set(longer), {done.job_run_id})


def test_the_selection_uses_the_partial_cleanup_index(loaded):
    db, _, _ = loaded
    ctx = BatchContext(SPEC.name, window(*MIXED), "dry_run", uuid.uuid4())
    query = SPEC.eligible(ctx).limit(200).with_for_update(skip_locked=True)
    compiled = query.compile(dialect=db.engine.dialect)
    with db.engine.connect() as conn:
        conn.exec_driver_sql("SET enable_seqscan = off")
        plan = "\n".join(
            r[0] for r in conn.exec_driver_sql(f"EXPLAIN {compiled}", compiled.params).all()
        )
    assert "ix_temp_file_cleanup" in plan, plan


# ------------------------------------------------------------------------- legal hold


def test_the_database_refuses_to_delete_a_held_row(loaded):
    db, _, _ = loaded
    held = scalar(db.engine, "SELECT count(*) FROM temp_file WHERE legal_hold")
    assert held > 0
    with pytest.raises(DBAPIError, match="legal hold"), db.engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM temp_file WHERE legal_hold"))
    with pytest.raises(DBAPIError, match="legal hold"), db.engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM temp_file WHERE tenant_id = :t"), {"t": TENANT})
    assert scalar(db.engine, "SELECT count(*) FROM temp_file WHERE legal_hold") == held
    # lifting a hold is a person's decision, not a deletion: allowed; then the row may go
    with db.engine.begin() as conn:
        lifted = conn.execute(
            sa.text(
                "UPDATE temp_file SET legal_hold = false WHERE id = "
                "(SELECT min(id) FROM temp_file WHERE legal_hold) RETURNING id"
            )
        ).scalar_one()
        conn.execute(sa.text("DELETE FROM temp_file WHERE id = :id"), {"id": lifted})


def test_held_files_past_retention_survive_execute_and_the_override(loaded, monkeypatch):
    db, home, stored = loaded
    held = {
        r.id
        for r in rows(
            db.engine,
            "SELECT id FROM temp_file WHERE legal_hold AND created_at < now() - interval '7 days'",
        )
    }
    assert len(held) >= 4
    for tenant in (TENANT, OTHER):
        assert run(db.engine, window(*WHOLE, tenant=tenant)).status == "success"
    monkeypatch.setenv(tfc.RETENTION_ENV, "0")  # an anomaly, overridden: still no held file
    monkeypatch.setenv(tfc.OVERRIDE_ENV, "1")
    overridden = run(db.engine, window(*WHOLE), reason="INC-1: disk full, approved by SRE")
    assert overridden.status == "success" and overridden.counts.succeeded > 0
    assert failed_checks(overridden) == []

    assert held <= file_ids(db.engine)
    on_disk = tree(home)
    assert all(on_disk[stored[i].storage_path] == stored[i].sha256 for i in held)
    assert not held & set(tombstones(db.engine))


def test_a_hold_put_on_between_decision_and_removal_is_respected(loaded):
    db, home, stored = loaded
    scope = window(*MIXED)
    expected = expected_ids(db.engine, scope)
    victim = expected[1]

    def put_on_hold(
        conn: Connection, ctx: BatchContext, work: list[tfc.DecidedFile]
    ) -> BatchOutcome:
        if any(w.id == victim for w in work):  # someone places a hold right now
            with db.engine.begin() as other:
                other.execute(
                    sa.text("UPDATE temp_file SET legal_hold = true WHERE id = :id"), {"id": victim}
                )
        return tfc.remove_batch(conn, ctx, work)

    racing = dataclasses.replace(SPEC, then=SecondTransaction(finish=put_on_hold))
    done = run_job(
        racing,
        scope,
        RunOptions(mode="execute", reason="test", batch_size=4, approval=APPROVAL),
        engine=db.engine,
    )

    assert done.status == "success"
    assert (done.counts.succeeded, done.counts.skipped) == (len(expected) - 1, 1)
    assert failed_checks(done) == []
    assert victim in file_ids(db.engine) and victim not in tombstones(db.engine)
    assert tree(home)[stored[victim].storage_path] == stored[victim].sha256
    assert_consistent(db.engine, home, stored, set(expected) - {victim}, {done.job_run_id})


# ------------------------------------------------------------------------- anomaly stop


def test_a_planted_anomaly_stops_the_run_before_anything_is_deleted(loaded, monkeypatch):
    db, home, stored = loaded
    scope = window(*WHOLE)
    monkeypatch.setenv(tfc.RETENTION_ENV, "0")  # a misconfiguration: everything looks old
    everything = expected_ids(db.engine, scope, retention_days=0)
    assert len(everything) > 0.5 * scalar(
        db.engine, "SELECT count(*) FROM temp_file WHERE tenant_id = :t", t=TENANT
    )
    before, objects_before = business_digest(db.engine), tree(home)

    dry = run(db.engine, scope, mode="dry_run")  # the dry-run shows it coming
    assert "eligible_within_anomaly_threshold" in dict(failed_checks(dry))
    stopped = run(db.engine, scope)

    assert (stopped.status, stopped.error_code) == ("failed", "anomaly_threshold")
    assert "nothing deleted" in (stopped.error_text or "")
    assert stopped.counts.processed == stopped.counts.succeeded == 0
    assert business_digest(db.engine) == before and tree(home) == objects_before
    row = rows(db.engine, "SELECT * FROM job_run WHERE id = :id", id=uuid.UUID(stopped.job_run_id))
    assert (row[0].status, row[0].last_error_code) == ("failed", "anomaly_threshold")
    assert scalar(db.engine, "SELECT count(*) FROM temp_file_tombstone") == 0
    # the reports say so: what a gate would decide, then what the run's gate decided
    gates = [[r for r in s.report if r["kind"] == "anomaly_gate"] for s in (dry, stopped)]
    assert [(g[0]["name"], g[0]["count"]) for g in gates] == [
        ("would stop", len(everything)),
        ("stopped", len(everything)),
    ]


def test_the_report_has_the_gate_and_each_day_deleted(loaded):
    db, home, stored = loaded
    scope = window(*MIXED)
    expected = expected_ids(db.engine, scope)
    done = run(db.engine, scope)
    by_kind: dict[str, list[dict]] = {}
    for r in done.report:
        by_kind.setdefault(r["kind"], []).append(r)
    assert [(g["name"], g["count"]) for g in by_kind["anomaly_gate"]] == [("passed", len(expected))]
    assert sum(r["count"] for r in by_kind["deleted"]) == done.counts.succeeded == len(expected)
    assert sum(r["count"] for r in by_kind["bytes_deleted"]) == sum(
        stored[i].size for i in expected
    )
    assert len(by_kind["deleted"]) == len({r["name"] for r in by_kind["deleted"]}) > 1  # per day


def test_the_absolute_cap_stops_the_run_too(loaded, monkeypatch):
    db, home, _ = loaded
    scope = window(*MIXED)
    monkeypatch.setenv(tfc.MAX_DELETE_ENV, "3")
    assert len(expected_ids(db.engine, scope)) > 3
    before = business_digest(db.engine)

    stopped = run(db.engine, scope)

    assert (stopped.status, stopped.error_code) == ("failed", "anomaly_threshold")
    assert "above the cap of 3" in (stopped.error_text or "")
    assert business_digest(db.engine) == before


def test_the_override_needs_a_reason_and_is_audited(loaded, monkeypatch):
    db, home, stored = loaded
    scope = window(*WHOLE)
    monkeypatch.setenv(tfc.RETENTION_ENV, "0")
    monkeypatch.setenv(tfc.OVERRIDE_ENV, "1")
    everything = expected_ids(db.engine, scope, retention_days=0)
    before = business_digest(db.engine)

    scheduled = run(db.engine, scope, trigger="schedule")  # no reason: no override
    assert (scheduled.status, scheduled.error_code) == ("failed", "anomaly_threshold")
    assert "needs a reason" in (scheduled.error_text or "")
    assert business_digest(db.engine) == before

    done = run(db.engine, scope, reason="INC-7: reclaim storage", correlation_id="INC-7")

    assert done.status == "success" and done.counts.succeeded == len(everything)
    assert_consistent(db.engine, home, stored, set(everything), {done.job_run_id})
    audit = rows(
        db.engine,
        "SELECT * FROM job_audit WHERE action = 'anomaly_override' AND job_run_id = :id",
        id=uuid.UUID(done.job_run_id),
    )
    assert len(audit) == 1
    assert (audit[0].actor, audit[0].reason, audit[0].correlation_id, audit[0].decision) == (
        "test:temp-file-cleanup",
        "INC-7: reclaim storage",
        "INC-7",
        "allowed",
    )
    assert audit[0].details["eligible"] == len(everything) and audit[0].details["breaches"]
    assert {s.reason for s in tombstones(db.engine).values()} == {
        "retention: terminal and older than 0 days (anomaly threshold overridden)"
    }


def test_bad_settings_are_refused_by_name(monkeypatch, home):
    monkeypatch.setenv(tfc.MAX_SHARE_ENV, "lots")
    with pytest.raises(tfc.CleanupConfigError, match=tfc.MAX_SHARE_ENV):
        tfc.settings_from_env()
    monkeypatch.setenv(tfc.MAX_SHARE_ENV, "0.2")
    monkeypatch.setenv(tfc.RETENTION_ENV, "-1")
    with pytest.raises(tfc.CleanupConfigError, match=tfc.RETENTION_ENV):
        tfc.settings_from_env()
    monkeypatch.setenv(tfc.RETENTION_ENV, "30")
    settings = tfc.settings_from_env()
    assert (settings.retention_days, settings.max_share, settings.max_delete) == (30, 0.2, 10_000)
    assert settings.objects_root == home / "objects"


def test_a_run_with_a_bad_setting_is_refused_before_anything_is_written(db, home, monkeypatch):
    monkeypatch.setenv(tfc.RETENTION_ENV, "seven")
    before = scalar(db.engine, "SELECT count(*) FROM job_run")
    for mode in ("dry_run", "execute"):
        with pytest.raises(tfc.CleanupConfigError, match=tfc.RETENTION_ENV):
            run(db.engine, window(*MIXED), mode=mode)
    assert scalar(db.engine, "SELECT count(*) FROM job_run") == before


# ------------------------------------------------------------------------- crashes and faults


CRASH_SCRIPT = """
import sys
import sqlalchemy as sa
from datetime import date
from qo_ops.jobs.temp_file_cleanup import SPEC
from qo_ops.platform.run.runner import run_job
from qo_ops.platform.job.options import RunOptions
from qo_ops.platform.job.scope import Scope

engine = sa.create_engine(sys.argv[1])
scope = Scope(sys.argv[2], date.fromisoformat(sys.argv[3]), date.fromisoformat(sys.argv[4]))
run_job(SPEC, scope, RunOptions(mode="execute", reason="crash test", batch_size=4,
        lease_ttl_s=1, approval="apr-test-temp_file_cleanup"), engine=engine)
"""


def rerun_until_leased(engine: sa.Engine, scope: Scope) -> RunSummary:
    """Rerun once the dead run's 1 s lease has expired (its record is reaped on the way)."""
    for _ in range(100):
        summary = run(engine, scope, lease_ttl_s=1, reason="rerun after crash")
        if summary.status != "skipped":
            return summary
        time.sleep(0.2)
    raise AssertionError("the dead run's lease never expired")


@pytest.mark.parametrize(
    ("point", "objects_gone", "intents"),
    [
        ("before_commit", 0, 0),  # step 1 written, not committed
        ("after_commit", 0, 4),  # step 1 committed: intents, nothing removed
        ("before_object_delete", 0, 4),  # step 2: rows deleted, nothing unlinked, no commit
        ("after_object_delete", 4, 4),  # step 2: objects unlinked, rows' delete not committed
    ],
)
def test_sigkill_then_rerun_converges(loaded, point, objects_gone, intents):
    db, home, stored = loaded
    scope = window(*MIXED)
    expected = expected_ids(db.engine, scope)
    assert len(expected) > 4
    url = db.url.render_as_string(hide_password=False)
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            CRASH_SCRIPT,
            url,
            TENANT,
            str(scope.window_start),
            str(scope.window_end),
        ],
        env=base_env(QO_OPS_HOME=str(home), QO_OPS_CRASH_AT=point),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]

    # what the crash left: every row (nothing committed a delete), the first batch's objects
    # gone only after the crash in step 2, intents only once step 1 committed
    assert file_ids(db.engine) == set(stored)
    on_disk = tree(home)
    gone = {i for i in stored if stored[i].storage_path not in on_disk}
    assert gone == set(expected[:objects_gone])
    stones = tombstones(db.engine)
    assert set(stones) == set(expected[:intents])
    assert all(s.deleted_at is None for s in stones.values())
    assert all(s.sha256 == stored[i].sha256 for i, s in stones.items())  # bytes as they were

    rerun = rerun_until_leased(db.engine, scope)

    assert rerun.status == "success", (rerun.error_code, rerun.error_text)
    assert rerun.counts.succeeded == len(expected)
    assert rerun.tally["objects_already_gone"] == objects_gone
    # the dead run's deletions are not repeated, and counted so
    assert rerun.tally.get("side_effect.object_delete.duplicate_prevented", 0) == objects_gone
    assert failed_checks(rerun) == []
    # converged, with the original checksums even for the objects the dead run removed
    assert_consistent(db.engine, home, stored, set(expected), {rerun.job_run_id})
    # the dead run's record is reaped (by a later run, or `qo-ops reap`), never left running
    crashed = scalar(db.engine, "SELECT id FROM job_run WHERE reason = 'crash test'")
    for _ in range(100):
        if crashed in reap_orphans(db.engine, SPEC.name, grace_s=1) or scalar(
            db.engine, "SELECT status <> 'running' FROM job_run WHERE id = :id", id=crashed
        ):
            break
        time.sleep(0.1)
    assert rows(
        db.engine, "SELECT status, status_reason FROM job_run WHERE id = :id", id=crashed
    ) == [("failed", "orphaned")]


def test_an_object_store_error_rolls_the_batch_back_and_a_rerun_converges(loaded, monkeypatch):
    db, home, stored = loaded
    scope = window(*MIXED)
    expected = expected_ids(db.engine, scope)
    real_remove, calls = object_store._remove_object, []

    def flaky(dir_fd: int, name: str) -> bool:
        calls.append(name)
        if len(calls) == 3:
            raise object_store.ObjectStoreError("cannot remove a stored object: Input/output error")
        return real_remove(dir_fd, name)

    monkeypatch.setattr(object_store, "_remove_object", flaky)
    failed = run(db.engine, scope, batch_size=5)

    assert (failed.status, failed.error_code) == ("failed", "object_store_error")
    assert file_ids(db.engine) == set(stored)  # the batch's delete was rolled back
    assert len(tree(home)) == len(stored) - 2  # two objects went before the error
    assert set(tombstones(db.engine)) == set(expected[:5])  # intents with their checksums

    monkeypatch.setattr(object_store, "_remove_object", real_remove)
    rerun = run(db.engine, scope, reason="retry after storage error")

    assert rerun.status == "success" and rerun.counts.succeeded == len(expected)
    assert_consistent(db.engine, home, stored, set(expected), {rerun.job_run_id})


def test_a_path_leaving_the_object_store_is_never_touched(loaded, tmp_path):
    db, home, stored = loaded
    scope = window(*MIXED)
    expected = expected_ids(db.engine, scope)
    outside = tmp_path / "precious.txt"
    outside.write_text("not an object")
    with db.engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE temp_file SET storage_path = :p WHERE id = :id"),
            {"p": "../../precious.txt", "id": expected[0]},
        )

    done = run(db.engine, scope)

    assert done.status == "partial_success"
    assert (done.counts.succeeded, done.counts.failed) == (len(expected) - 1, 1)
    assert done.tally["unsafe_storage_path"] == 1
    assert outside.read_text() == "not an object"
    assert expected[0] in file_ids(db.engine) and expected[0] not in tombstones(db.engine)


def _outside_copy(home: Path, tmp_path: Path, storage_path: str) -> Path:
    """A directory outside the store holding a file of the same name as the object."""
    outside = tmp_path / "outside"
    outside.mkdir(exist_ok=True)
    (outside / Path(storage_path).name).write_text("precious, outside the store")
    return outside


def test_a_symlinked_directory_in_the_store_is_never_followed(loaded, tmp_path):
    db, home, stored = loaded
    scope = window(*MIXED)
    expected = expected_ids(db.engine, scope)
    victim = stored[expected[0]].storage_path
    directory = home / "objects" / Path(victim).parent
    siblings = [i for i in expected if Path(stored[i].storage_path).parent == Path(victim).parent]
    outside = _outside_copy(home, tmp_path, victim)
    directory.rename(tmp_path / "moved-away")
    directory.symlink_to(outside, target_is_directory=True)

    done = run(db.engine, scope)

    assert (done.counts.failed, done.counts.succeeded) == (
        len(siblings),
        len(expected) - len(siblings),
    )
    assert done.tally["unsafe_storage_path"] == len(siblings) >= 1
    assert (outside / Path(victim).name).read_text() == "precious, outside the store"
    assert set(siblings) <= file_ids(db.engine)  # their rows stay, with no tombstone
    assert not set(siblings) & set(tombstones(db.engine))


def test_a_directory_swapped_for_a_symlink_between_the_steps_stops_the_batch(
    loaded, tmp_path, monkeypatch
):
    """Step 1 hashed the objects; before step 2 unlinks them their directory becomes a
    symlink to somewhere else: nothing outside is removed, the batch rolls back."""
    db, home, stored = loaded
    scope = window(*MIXED)
    expected = expected_ids(db.engine, scope)
    victim = stored[expected[0]].storage_path
    directory = home / "objects" / Path(victim).parent
    outside = _outside_copy(home, tmp_path, victim)
    real_sha256 = object_store.ObjectStore.sha256

    def then_swap(self: object_store.ObjectStore, storage_path: str) -> tuple[bool, str | None]:
        found = real_sha256(self, storage_path)
        if storage_path == victim and directory.is_dir() and not directory.is_symlink():
            directory.rename(tmp_path / "moved-away")
            directory.symlink_to(outside, target_is_directory=True)
        return found

    monkeypatch.setattr(object_store.ObjectStore, "sha256", then_swap)
    before = file_ids(db.engine)
    failed = run(db.engine, scope, batch_size=5)

    assert (failed.status, failed.error_code) == ("failed", "object_store_error")
    assert (outside / Path(victim).name).read_text() == "precious, outside the store"
    assert file_ids(db.engine) == before  # the batch's delete was rolled back
    assert (tmp_path / "moved-away" / Path(victim).name).exists()  # the real object stays


def test_objects_already_gone_are_tombstoned_without_a_checksum(loaded):
    db, home, stored = loaded
    scope = window(*MIXED)
    expected = expected_ids(db.engine, scope)
    (home / "objects" / stored[expected[0]].storage_path).unlink()

    done = run(db.engine, scope)

    assert done.tally["objects_already_gone"] == 1
    stone = tombstones(db.engine)[expected[0]]
    assert stone.sha256 is None and stone.deleted_at is not None


def test_a_complete_tombstone_can_be_neither_changed_nor_removed(loaded):
    db, _, _ = loaded
    run(db.engine, window(*MIXED))
    for sql in (
        "UPDATE temp_file_tombstone SET reason = 'rewritten'",
        "DELETE FROM temp_file_tombstone",
    ):
        with pytest.raises(DBAPIError, match="is complete"), db.engine.begin() as conn:
            conn.execute(sa.text(sql))


# ------------------------------------------------------------------------- demo data


def test_a_demo_cleanup_removes_an_object_for_every_row_it_deletes(db, home):
    """`qo-ops demo-data` stores each temp file's object under QO_OPS_HOME, where the job
    looks: the dry run sees them, and execute removes as many objects as it deletes rows,
    none counted as already gone (duplicate_prevented)."""
    env = base_env(QO_OPS_DATABASE_URL=db.env_url, QO_OPS_HOME=str(home))
    loaded = run_cli(["demo-data", "--tenants", "2", "--quotes", "1000", "--seed", "9"], env)
    assert loaded.code == 0, loaded.stderr
    scope = window(*MIXED)
    expected = expected_ids(db.engine, scope)
    before = tree(home)
    assert len(before) == 200  # a temp file per ten quotes, each with its object

    dry = run(db.engine, scope, mode="dry_run")
    (objects,) = [r for r in dry.report if r["kind"] == "objects"]
    assert (objects["name"], objects["count"]) == ("stored", len(expected))
    assert objects["detail"] == f"of the {len(expected)} eligible files; 0 already gone"

    done = run(db.engine, scope)

    assert done.status == "success", (done.error_code, done.error_text)
    assert done.counts.succeeded == len(expected) > 0
    assert done.tally["objects_removed"] == done.counts.succeeded
    assert done.tally["objects_already_gone"] == 0 and done.counts.duplicates_prevented == 0
    assert done.tally["side_effect.object_delete.success"] == len(expected)
    assert "side_effect.object_delete.duplicate_prevented" not in done.tally
    assert failed_checks(done) == []
    stones = tombstones(db.engine)
    assert set(stones) == set(expected)
    gone = {stones[i].storage_path for i in expected}
    assert tree(home) == {p: sha for p, sha in before.items() if p not in gone}
    assert all(stones[i].sha256 == before[stones[i].storage_path] for i in expected)
    deleted = [r for r in done.report if r["kind"] == "deleted"]  # one row per creation day
    assert sum(r["count"] for r in deleted) == len(expected)
    assert {r["detail"] for r in deleted} == {
        f"{r['count']} checksummed, 0 object(s) already gone" for r in deleted
    }


def test_a_day_of_the_dagster_demo_data_is_cleaned_without_an_anomaly(db, home):
    """The Dagster tests' load (rows only, no object store given): a day with work, its
    objects never stored (already gone)."""
    load_demo_data(db.engine, tenants=2, quotes=400, seed=9, as_of=datetime(2026, 3, 1, tzinfo=UTC))
    day = next(
        d
        for d in (date(2026, 1, 1) + timedelta(days=n) for n in range(90))
        if expected_ids(db.engine, Scope(TENANT, d, d + timedelta(days=1)))
    )
    scope = Scope(TENANT, day, day + timedelta(days=1))
    expected = expected_ids(db.engine, scope)
    dry = run(db.engine, scope, mode="dry_run")
    assert dry.eligible_count == len(expected) > 0

    done = run(db.engine, scope, batch_size=25)

    assert done.status == "success", (done.error_code, done.error_text)
    assert done.counts.succeeded == dry.eligible_count
    assert failed_checks(done) == []
    assert done.tally == {
        "objects_removed": 0,
        "objects_already_gone": len(expected),
        "side_effect.object_delete.duplicate_prevented": len(expected),
    }
    assert {s.sha256 for s in tombstones(db.engine).values()} == {None}


# ------------------------------------------------------------------------- migration


def test_migration_0003_downgrades_cleanly(empty_db):
    engine = empty_db.engine
    migrate.upgrade(engine)
    migrate.downgrade(engine, "0002")
    with engine.connect() as conn:
        left = conn.execute(
            sa.text(
                "SELECT (SELECT count(*) FROM pg_proc WHERE proname IN "
                "('temp_file_refuse_held_delete', 'temp_file_tombstone_refuse_change')), "
                "(SELECT count(*) FROM pg_trigger WHERE tgname = 'temp_file_legal_hold_guard'), "
                "to_regclass('temp_file_tombstone') IS NULL"
            )
        ).one()
    assert tuple(left) == (0, 0, True)
    migrate.upgrade(engine)
    assert migrate.current_revision(engine) == migrate.head_revision()


# ----------------------------------------------------------------------------------- CLI


def _cli(db, home: Path, *args: str, **env: str):
    return run_cli(
        [*args, "--json"],
        base_env(QO_OPS_DATABASE_URL=db.env_url, QO_OPS_HOME=str(home), **env),
    )


def test_cli_dry_run_then_execute(loaded):
    import json

    db, home, stored = loaded
    scope = window(*MIXED)
    expected = expected_ids(db.engine, scope)
    dates = ["--from", str(scope.window_start), "--to", str(scope.window_end - timedelta(days=1))]
    dry = _cli(db, home, "run", SPEC.name, "--tenant", TENANT, *dates)
    assert dry.code == 0, dry.stderr
    assert json.loads(dry.stdout)["eligible_count"] == len(expected)
    assert file_ids(db.engine) == set(stored)

    done = _cli(
        db,
        home,
        "run",
        SPEC.name,
        "--tenant",
        TENANT,
        *dates,
        "--mode",
        "execute",
        "--reason",
        "cli test",
        "--approval",
        APPROVAL,
    )
    assert done.code == 0, done.stderr
    summary = json.loads(done.stdout)
    assert (summary["status"], summary["succeeded_count"]) == ("success", len(expected))
    assert_consistent(db.engine, home, stored, set(expected), {summary["job_run_id"]})


def test_cli_killed_after_the_object_delete_then_rerun_converges(loaded):
    import json

    db, home, stored = loaded
    scope = window(*MIXED)
    expected = expected_ids(db.engine, scope)
    dates = ["--from", str(scope.window_start), "--to", str(scope.window_end - timedelta(days=1))]
    args = [
        "run",
        SPEC.name,
        "--tenant",
        TENANT,
        *dates,
        "--mode",
        "execute",
        "--reason",
        "cli crash",
        "--approval",
        APPROVAL,
    ]
    killed = _cli(
        db,
        home,
        *args,
        "--batch-size",
        "4",
        "--lease-ttl-s",
        "1",
        QO_OPS_CRASH_AT="after_object_delete",
    )
    assert killed.code == -signal.SIGKILL, killed.stderr[-1000:]
    assert len(tree(home)) == len(stored) - 4 and file_ids(db.engine) == set(stored)

    for _ in range(100):
        again = _cli(db, home, *args, "--lease-ttl-s", "1")
        if json.loads(again.stdout)["status"] != "skipped":
            break
        time.sleep(0.2)
    assert again.code == 0, again.stderr
    summary = json.loads(again.stdout)
    assert (summary["status"], summary["succeeded_count"]) == ("success", len(expected))
    assert_consistent(db.engine, home, stored, set(expected), {summary["job_run_id"]})
