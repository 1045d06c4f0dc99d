"""audit_archive: records past retention go to verified Parquet archives and leave the source
in the same transaction that marks their manifest VERIFIED; restore brings them back exactly.

Real PostgreSQL, real files in a temporary QO_OPS_HOME, real SIGKILLs. The crash tests run
the job in a child process twice: through ``python -c`` (always) and through the real
``qo-ops run audit_archive`` CLI (once the job is registered in the catalog).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import sqlalchemy as sa

from qo_ops.db.digest import database_digest, table_digest
from qo_ops.db.schema import BUSINESS_TABLES, audit_record
from qo_ops.demo.data import load_demo_data
from qo_ops.errors import ConfigError
from qo_ops.jobs import audit_archive
from qo_ops.jobs.audit_archive import (
    ARCHIVE_CRASH_POINTS,
    SPEC,
    ArchiveError,
    read_rows,
    restore_day,
    steps,
    storage,
)
from qo_ops.platform.job.options import RunOptions
from qo_ops.platform.job.outcome import BatchContext
from qo_ops.platform.job.scope import Scope
from qo_ops.platform.run.faults import CRASH_ENV, CRASH_POINTS
from qo_ops.platform.run.runner import count_eligible, run_job
from qo_ops_tests.conftest import base_env, modules_loaded_by, run_cli, standing_approval

APPROVAL = standing_approval(SPEC.name)  # a destructive execute cites one

TENANT = "tenant-001"
DAY = date(2024, 6, 1)  # far past any retention
WINDOW = Scope(TENANT, DAY, DAY + timedelta(days=1))
ROWS_ON_DAY = 1234  # tenant-001's records on DAY (tenant-002 has its own, interleaved by id)
AS_OF = datetime(2026, 3, 1, tzinfo=UTC)


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "home"
    path.mkdir()
    monkeypatch.setenv("QO_OPS_HOME", str(path))
    monkeypatch.delenv(audit_archive.RETENTION_ENV, raising=False)
    monkeypatch.delenv(CRASH_ENV, raising=False)
    return path


SYNTHETIC = """
INSERT INTO audit_record (tenant_id, occurred_at, actor_ref, action, entity_type, entity_id, details)
SELECT CASE WHEN g % 5 = 0 THEN 'tenant-002' ELSE 'tenant-001' END,
       timestamptz '2024-06-01 00:00:00+00' + ((g * 7919) % 86400) * interval '1 second'
           + (g % 997) * interval '1 microsecond',
       'user-' || (g % 17),
       (ARRAY['quote.created', 'quote.updated', 'order.submitted'])[1 + g % 3],
       'quote', g::text,
       jsonb_build_object('n', g, 'text', E'\u00fc \u20ac "q" \\n', 'price', 1.50,
                          'nested', jsonb_build_object('a', jsonb_build_array(1, 2.0, 'x', null)),
                          'big', 123456789012345678901234567890::numeric)
  FROM generate_series(1, :n) AS g
"""


@pytest.fixture
def seeded(db, home):
    """Two demo tenants plus, on DAY, 1,234 records of tenant-001 and 308 of tenant-002 with
    interleaved ids, and records right outside DAY on both sides."""
    load_demo_data(db.engine, tenants=2, quotes=40, seed=1, as_of=AS_OF)
    with db.engine.begin() as conn:
        conn.execute(sa.text(SYNTHETIC), {"n": 1542})  # g % 5 != 0 → 1,234 for tenant-001
        conn.execute(
            sa.text(
                "INSERT INTO audit_record (tenant_id, occurred_at, actor_ref, action, entity_type, "
                "entity_id) VALUES (:t, :at, 'user-x', 'quote.created', 'quote', 'edge')"
            ),
            [
                {"t": TENANT, "at": datetime(2024, 5, 31, 23, 59, 59, 999999, tzinfo=UTC)},
                {"t": TENANT, "at": datetime(2024, 6, 2, tzinfo=UTC)},
                {"t": TENANT, "at": datetime(2024, 6, 2, 12, tzinfo=UTC)},
            ],
        )
    assert len(_day_ids(db.engine)) == ROWS_ON_DAY
    return db


def _day_ids(engine: sa.Engine, tenant: str = TENANT, day: date = DAY) -> list[int]:
    start = datetime.combine(day, datetime.min.time(), UTC)
    with engine.connect() as conn:
        return list(
            conn.execute(
                sa.text(
                    "SELECT id FROM audit_record WHERE tenant_id = :t AND occurred_at >= :s "
                    "AND occurred_at < :e ORDER BY id"
                ),
                {"t": tenant, "s": start, "e": start + timedelta(days=1)},
            ).scalars()
        )


def _audit_digest(engine: sa.Engine) -> str:
    with engine.connect() as conn:
        return table_digest(conn, audit_record)


def _manifests(engine: sa.Engine) -> list[sa.Row]:
    with engine.connect() as conn:
        return list(
            conn.execute(
                sa.text("SELECT * FROM audit_archive_manifest ORDER BY window_start, min_record_id")
            ).all()
        )


def _statuses(engine: sa.Engine) -> dict[str, int]:
    out: dict[str, int] = {}
    for m in _manifests(engine):
        out[m.status] = out.get(m.status, 0) + 1
    return out


def _files(home: Path) -> list[Path]:
    return sorted(p for p in (home / "archive").rglob("*") if p.is_file())


def _archived_ids(home: Path, engine: sa.Engine) -> list[int]:
    """Every id in the files of VERIFIED manifests (duplicates kept)."""
    ids: list[int] = []
    for m in _manifests(engine):
        if m.status == "VERIFIED":
            ids.extend(pq.read_table(home / m.file_path, columns=["id"]).column("id").to_pylist())
    return ids


def _execute(engine: sa.Engine, scope: Scope = WINDOW, **options):
    opts = {
        "mode": "execute",
        "reason": "test",
        "progress_interval_s": 3600,
        "approval": APPROVAL,
        **options,
    }
    return run_job(SPEC, scope, RunOptions(**opts), engine=engine)


def _checks(summary) -> dict[str, bool]:
    return {c.name: c.passed for c in summary.checks}


# ----------------------------------------------------------------------------- the job


def test_dry_run_writes_nothing_and_counts_exactly_what_execute_archives(seeded, home):
    db = seeded
    with db.engine.connect() as conn:
        before = database_digest(conn, BUSINESS_TABLES)
    dry = run_job(SPEC, WINDOW, RunOptions(mode="dry_run"), engine=db.engine)
    with db.engine.connect() as conn:
        assert database_digest(conn, BUSINESS_TABLES) == before
    assert not (home / "archive").exists()
    assert (dry.status, dry.eligible_count) == ("success", ROWS_ON_DAY)
    assert [int(i) for i in dry.sample_ids] == _day_ids(db.engine)[:10]  # in archive order

    done = _execute(db.engine, batch_size=500)
    assert (done.status, done.counts.succeeded, done.counts.processed) == (
        "success",
        ROWS_ON_DAY,
        ROWS_ON_DAY,
    )
    assert done.eligible_count == dry.eligible_count
    assert done.batches == 3
    assert _checks(done) == {"archive_accounts_for_every_record": True, "archives_verify": True}


def test_execute_writes_verified_archives_and_deletes_exactly_their_rows(seeded, home):
    db = seeded
    original = _day_ids(db.engine)
    other_tenant = _day_ids(db.engine, "tenant-002")
    next_day = _day_ids(db.engine, TENANT, DAY + timedelta(days=1))
    prev_day = _day_ids(db.engine, TENANT, DAY - timedelta(days=1))

    done = _execute(db.engine, batch_size=500)
    assert done.status == "success" and done.error_code is None
    assert done.tally == {
        "archives_written": 3,
        "archives_verified": 3,
        "side_effect.archive_file.success": 3,
    }

    manifests = _manifests(db.engine)
    assert [m.status for m in manifests] == ["VERIFIED"] * 3
    assert [m.row_count for m in manifests] == [500, 500, 234]
    assert all(
        m.verified_at is not None and m.job_run_id == uuid.UUID(done.job_run_id) for m in manifests
    )
    assert all(m.window_start == datetime(2024, 6, 1, tzinfo=UTC) for m in manifests)
    assert all(m.window_end == datetime(2024, 6, 2, tzinfo=UTC) for m in manifests)
    # files where promised, sha256 of their bytes in the manifest, nothing else on disk
    assert _files(home) == sorted(
        home / "archive" / TENANT / "2024-06-01" / f"{m.id}.parquet" for m in manifests
    )
    for m in manifests:
        assert m.file_path == f"archive/{TENANT}/2024-06-01/{m.id}.parquet"
        assert audit_archive.sha256_of(home / m.file_path) == m.sha256
        table = pq.read_table(home / m.file_path)
        assert table.column_names == [c.name for c in audit_record.columns]
        ids = table.column("id").to_pylist()
        assert (len(ids), ids[0], ids[-1]) == (m.row_count, m.min_record_id, m.max_record_id)
        assert json.loads(table.column("details")[0].as_py())["text"] == 'ü € "q" \n'

    assert sorted(_archived_ids(home, db.engine)) == original
    assert _day_ids(db.engine) == []
    assert _day_ids(db.engine, "tenant-002") == other_tenant  # another tenant: untouched
    assert _day_ids(db.engine, TENANT, DAY + timedelta(days=1)) == next_day  # other days too
    assert _day_ids(db.engine, TENANT, DAY - timedelta(days=1)) == prev_day

    again = _execute(db.engine)
    assert (again.status, again.counts.succeeded) == ("no_work", 0)
    assert all(c.passed for c in again.checks)
    assert len(_manifests(db.engine)) == 3


def test_restore_returns_exactly_the_original_records_and_twice_changes_nothing(seeded, home):
    db = seeded
    original = _audit_digest(db.engine)
    assert _execute(db.engine, batch_size=500).status == "success"
    assert _audit_digest(db.engine) != original

    result = restore_day(db.engine, TENANT, DAY, actor="test", reason="audit request")
    assert (result.archives, result.archived_rows, result.restored_rows) == (3, 1234, 1234)
    assert _audit_digest(db.engine) == original  # same ids, same content, nothing else
    assert _statuses(db.engine) == {"WRITTEN": 3}  # source intact again: nothing counted twice
    with db.engine.connect() as conn:
        audit = conn.execute(
            sa.text(
                "SELECT actor, action, scope, reason, details FROM job_audit WHERE action = 'archive_restore'"
            )
        ).one()
    assert (audit.actor, audit.scope, audit.reason) == ("test", WINDOW.key, "audit request")

    with db.engine.connect() as conn:
        everything = database_digest(conn, BUSINESS_TABLES)
    twice = restore_day(db.engine, TENANT, DAY, actor="test")
    assert (twice.archives, twice.restored_rows) == (0, 0)
    with db.engine.connect() as conn:
        assert database_digest(conn, BUSINESS_TABLES) == everything

    # the next archive run re-verifies and adopts the same files instead of writing new ones
    rerun = _execute(db.engine, batch_size=500)
    assert rerun.status == "success" and rerun.tally["archives_adopted"] == 3
    assert "archives_written" not in rerun.tally
    # counted as side effects not repeated: the files an earlier attempt wrote
    assert rerun.tally["side_effect.archive_file.duplicate_prevented"] == 3
    assert "side_effect.archive_file.success" not in rerun.tally
    assert _statuses(db.engine) == {"VERIFIED": 3} and len(_files(home)) == 3
    assert all(_checks(rerun).values())
    # restore with every row still present: idempotent by ON CONFLICT (id) DO NOTHING
    restore_day(db.engine, TENANT, DAY)
    with db.engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE audit_archive_manifest SET status = 'VERIFIED', verified_at = now()")
        )
    again = restore_day(db.engine, TENANT, DAY)
    assert (again.archived_rows, again.restored_rows, again.already_present) == (1234, 0, 1234)
    assert _audit_digest(db.engine) == original


AWKWARD_TEXT = [
    "",  # an empty string, not NULL
    "a,b",
    'say "hi"',
    "line\nbreak",
    "crlf\r\nend",
    "\\N",
    "  padded  ",
    "tab\there",
    "emoji \U0001f9fe, ümlaut, €",
    '"",",\n"',
]


def test_values_that_csv_must_quote_round_trip_exactly(seeded, home):
    """The rows travel PostgreSQL → CSV (COPY) → Arrow → Parquet and back: text needing
    quotes, empty strings, line breaks and exact microseconds survive archive and restore."""
    db = seeded
    with db.engine.begin() as conn:
        for i, text in enumerate(AWKWARD_TEXT):
            conn.execute(
                sa.text(
                    "INSERT INTO audit_record (tenant_id, occurred_at, actor_ref, action, "
                    "entity_type, entity_id, details) VALUES (:t, :at, :x, :x, :x, :x, "
                    "CAST(:d AS jsonb))"
                ),
                {
                    "t": TENANT,
                    "at": datetime(2024, 6, 1, 23, 59, 59, i * 111_111 % 1_000_000, tzinfo=UTC),
                    "x": text,
                    "d": json.dumps({"text": text, "n": i}),
                },
            )
    original = _audit_digest(db.engine)
    done = _execute(db.engine)
    assert (done.status, done.counts.succeeded) == ("success", ROWS_ON_DAY + len(AWKWARD_TEXT))
    assert _day_ids(db.engine) == [] and _statuses(db.engine) == {"VERIFIED": 1}
    archived = pq.read_table(home / _manifests(db.engine)[0].file_path).to_pylist()
    assert sorted(r["actor_ref"] for r in archived if r["entity_type"] != "quote") == sorted(
        AWKWARD_TEXT
    )
    restore_day(db.engine, TENANT, DAY)
    assert _audit_digest(db.engine) == original  # every value came back exactly


def test_a_corrupted_file_fails_verification_and_nothing_is_deleted(seeded, home, monkeypatch):
    db = seeded
    original = _audit_digest(db.engine)
    real_write = steps.write_file

    def write_then_flip_a_byte(path: Path, data: bytes) -> None:
        real_write(path, data)
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        path.write_bytes(bytes(raw))

    monkeypatch.setattr(steps, "write_file", write_then_flip_a_byte)
    failed = _execute(db.engine, batch_size=500)
    assert (failed.status, failed.error_code) == ("failed", "archive_verification_failed")
    assert "sha256 differs" in (failed.error_text or "")
    assert (failed.counts.succeeded, failed.counts.failed, failed.batches) == (0, 500, 1)
    assert _statuses(db.engine) == {"FAILED": 1}
    assert _audit_digest(db.engine) == original  # nothing deleted
    assert all(_checks(failed).values())  # FAILED archives are not counted

    monkeypatch.setattr(steps, "write_file", real_write)
    healed = _execute(db.engine, batch_size=500)
    assert healed.status == "success" and healed.counts.succeeded == ROWS_ON_DAY
    assert _statuses(db.engine) == {"FAILED": 1, "VERIFIED": 3}
    assert len(_files(home)) == 4  # the failed file stays as evidence
    assert all(_checks(healed).values())


def test_source_rows_changed_before_the_delete_fail_verification(seeded, home, monkeypatch):
    db = seeded
    real_verify = steps.verify_file

    def verify_then_change_a_source_row(chunk, sha):
        result = real_verify(chunk, sha)
        with db.engine.begin() as conn:
            conn.execute(
                sa.text("UPDATE audit_record SET actor_ref = 'someone-else' WHERE id = :id"),
                {"id": chunk.min_id},
            )
        return result

    monkeypatch.setattr(steps, "verify_file", verify_then_change_a_source_row)
    before = len(_day_ids(db.engine))
    failed = _execute(db.engine, batch_size=500)
    assert (failed.status, failed.error_code) == ("failed", "archive_verification_failed")
    assert "source rows differ" in (failed.error_text or "")
    assert _statuses(db.engine) == {"FAILED": 1}
    assert len(_day_ids(db.engine)) == before


def test_a_source_row_gone_before_the_delete_rolls_the_whole_delete_back(seeded, home, monkeypatch):
    """The delete digests the rows it removed; one missing makes the ids differ, and the
    savepoint takes back the rows it did delete: nothing of the chunk leaves the source."""
    db = seeded
    real_verify = steps.verify_file
    vanished: list[int] = []

    def verify_then_delete_a_source_row(chunk, sha):
        result = real_verify(chunk, sha)
        with db.engine.begin() as conn:
            conn.execute(sa.text("DELETE FROM audit_record WHERE id = :id"), {"id": chunk.max_id})
        vanished.append(chunk.max_id)
        return result

    monkeypatch.setattr(steps, "verify_file", verify_then_delete_a_source_row)
    before = _day_ids(db.engine)
    failed = _execute(db.engine, batch_size=500)
    assert (failed.status, failed.error_code) == ("failed", "archive_verification_failed")
    assert "source ids differ" in (failed.error_text or "")
    assert (failed.counts.succeeded, failed.counts.failed) == (0, 500)
    assert _statuses(db.engine) == {"FAILED": 1}
    assert _day_ids(db.engine) == [i for i in before if i not in vanished]  # 499 came back


def test_a_file_changed_between_verification_and_delete_is_caught(seeded, home, monkeypatch):
    """The delete transaction hashes the file once more: what is deleted is what verified."""
    db = seeded
    original = _audit_digest(db.engine)
    real_verify = steps.verify_file

    def verify_then_tamper(chunk, sha):
        result = real_verify(chunk, sha)
        path = home / chunk.file_path
        raw = bytearray(path.read_bytes())
        raw[10] ^= 0x01
        path.write_bytes(bytes(raw))
        return result

    monkeypatch.setattr(steps, "verify_file", verify_then_tamper)
    failed = _execute(db.engine, batch_size=500)
    assert (failed.status, failed.error_code) == ("failed", "archive_verification_failed")
    assert "file changed after verification" in (failed.error_text or "")
    assert _statuses(db.engine) == {"FAILED": 1}
    assert _audit_digest(db.engine) == original


def test_lag_is_the_age_of_the_oldest_record_past_retention(seeded, home):
    db = seeded
    ctx = BatchContext(SPEC.name, WINDOW, "dry_run", uuid.uuid4())
    with db.engine.connect() as conn:
        lag = SPEC.signals.lag(conn, ctx)
        oldest = conn.scalar(
            sa.text(
                "SELECT extract(epoch FROM now() - interval '365 days' - min(occurred_at)) "
                "FROM audit_record WHERE tenant_id = :t AND occurred_at >= :s AND occurred_at < :e"
            ),
            {"t": TENANT, "s": WINDOW.window_bounds()[0], "e": WINDOW.window_bounds()[1]},
        )
    assert lag is not None and abs(lag - float(oldest)) < 5
    _execute(db.engine)
    with db.engine.connect() as conn:
        assert SPEC.signals.lag(conn, ctx) is None


def test_checks_catch_a_record_in_both_places_and_a_tampered_file(seeded, home):
    db = seeded
    done = _execute(db.engine, batch_size=500)
    assert all(_checks(done).values())
    first = _manifests(db.engine)[0]
    ctx = BatchContext(SPEC.name, WINDOW, "dry_run", uuid.uuid4())

    path = home / first.file_path
    raw = bytearray(path.read_bytes())
    raw[-20] ^= 0xFF
    path.write_bytes(bytes(raw))
    with db.engine.connect() as conn:
        checks = {c.name: c for c in SPEC.check(conn, ctx)}
    assert not checks["archives_verify"].passed
    assert checks["archives_verify"].metadata["mismatched_manifests"] == str(first.id)
    assert checks["archive_accounts_for_every_record"].passed
    with pytest.raises(ArchiveError, match="checksum"):
        restore_day(db.engine, TENANT, DAY)  # refuses a tampered archive, restores nothing
    assert _day_ids(db.engine) == [] and _statuses(db.engine) == {"VERIFIED": 3}

    row = read_rows((home / _manifests(db.engine)[1].file_path).read_bytes())[0]
    with db.engine.begin() as conn:  # an archived record shows up in the source again
        conn.execute(
            sa.text(
                "INSERT INTO audit_record (id, tenant_id, occurred_at, actor_ref, action, "
                "entity_type, entity_id, details) VALUES (:i, :t, :o, :a, :ac, :et, :ei, CAST(:d AS jsonb))"
            ),
            dict(zip(["i", "t", "o", "a", "ac", "et", "ei", "d"], row, strict=True)),
        )
    with db.engine.connect() as conn:
        checks = {c.name: c for c in SPEC.check(conn, ctx)}
    accounts = checks["archive_accounts_for_every_record"]
    assert not accounts.passed and accounts.metadata["records_in_both_places"] == 1


def test_a_window_of_several_days_archives_one_file_set_per_day(seeded, home):
    db = seeded
    scope = Scope(TENANT, DAY - timedelta(days=1), DAY + timedelta(days=2))
    dry = run_job(SPEC, scope, RunOptions(mode="dry_run"), engine=db.engine)
    assert dry.eligible_count == ROWS_ON_DAY + 3
    done = _execute(db.engine, scope, batch_size=1000)
    assert done.status == "success" and done.counts.succeeded == ROWS_ON_DAY + 3
    days = sorted({m.window_start.date() for m in _manifests(db.engine)})
    assert days == [DAY - timedelta(days=1), DAY, DAY + timedelta(days=1)]
    assert {p.parent.name for p in _files(home)} == {d.isoformat() for d in days}
    assert all(_checks(done).values())
    assert done.checks[0].metadata["archived_records"] == ROWS_ON_DAY + 3


def test_orphans_and_temp_files_are_swept_only_when_old(seeded, home):
    db = seeded
    directory = home / "archive" / TENANT / DAY.isoformat()
    directory.mkdir(parents=True)
    old_orphan = directory / f"{uuid.uuid4()}.parquet"
    old_tmp = directory / f"{uuid.uuid4()}.parquet.tmp"
    young_orphan = directory / f"{uuid.uuid4()}.parquet"
    foreign = directory / "notes.txt"
    for p in (old_orphan, old_tmp, young_orphan, foreign):
        p.write_bytes(b"x")
    _set_mtime(db.engine, -3600, old_orphan, old_tmp, foreign)
    done = _execute(db.engine, batch_size=5000)
    assert done.status == "success" and done.tally["orphan_files_removed"] == 2
    assert not old_orphan.exists() and not old_tmp.exists()
    assert young_orphan.exists() and foreign.exists()


def _db_epoch(engine: sa.Engine) -> float:
    with engine.connect() as conn:
        return float(conn.execute(sa.text("SELECT extract(epoch FROM clock_timestamp())")).scalar())


def _set_mtime(engine: sa.Engine, offset_s: float, *paths: Path) -> None:
    """Give ``paths`` the modification time "database clock now + ``offset_s``"."""
    when = _db_epoch(engine) + offset_s
    for path in paths:
        os.utime(path, (when, when))


def _orphan_files(directory: Path, n: int, suffix: str = ".parquet") -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / f"{uuid.uuid4()}{suffix}" for _ in range(n)]
    for path in paths:
        path.write_bytes(b"PAR1 not yet recorded")
    return paths


@pytest.mark.parametrize("skew_s", [7200, -7200], ids=["process clock 2 h ahead", "2 h behind"])
def test_the_orphan_sweep_judges_file_age_by_the_database_clock(seeded, home, monkeypatch, skew_s):
    """A unit test of the sweep with this process's clock skewed by two hours (a fake
    time.time: the system clock cannot be moved), real files and the real database: a file
    another run has just written (no manifest yet) stays, orphans past the TTL go."""
    db = seeded
    directory = home / "archive" / TENANT / DAY.isoformat()
    (just_written,) = _orphan_files(directory, 1)
    (old_orphan,) = _orphan_files(directory, 1)
    (old_tmp,) = _orphan_files(directory, 1, ".parquet.tmp")
    _set_mtime(db.engine, -1, just_written)
    _set_mtime(db.engine, -120, old_orphan, old_tmp)  # past the 30 s TTL, within the skew
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + skew_s)
    work = audit_archive.Work(
        engine=db.engine, job_name=SPEC.name, scope_key=WINDOW.key, job_run_id=uuid.uuid4(),
        fencing_token=None, min_file_age_s=30.0, chunks=[],
    )  # fmt: skip
    start, end = WINDOW.window_bounds()
    manifest_id = uuid.uuid4()
    chunk = audit_archive.Chunk(
        manifest_id, TENANT, DAY, start, end,
        audit_archive.relative_path(TENANT, DAY, manifest_id), 0, 0, 0, table=None,
    )  # fmt: skip
    assert storage.sweep_orphans(work, chunk) == 2
    assert just_written.exists()
    assert not old_orphan.exists() and not old_tmp.exists()


def _another_run_holds(engine: sa.Engine, scope: Scope) -> None:
    """A live audit_archive run of another process over ``scope``: its row and lease."""
    run_id = uuid.uuid4()
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO job_run (id, job_name, scope, window_start, window_end, mode, "
                "trigger_type, owner_id, status) VALUES (:id, :job, :scope, :ws, :we, "
                "'execute', 'schedule', 'other-host:1:feedbeef', 'running')"
            ),
            {"id": run_id, "job": SPEC.name, "scope": scope.key,
             "ws": scope.window_start, "we": scope.window_end},
        )  # fmt: skip
        conn.execute(
            sa.text(
                "INSERT INTO job_lease (job_name, scope, owner_id, lease_token, fencing_token, "
                "acquired_at, heartbeat_at, expires_at, job_run_id) VALUES (:job, :scope, "
                "'other-host:1:feedbeef', 'their-token', 3, now(), now(), "
                "now() + interval '1 hour', :id)"
            ),
            {"job": SPEC.name, "scope": scope.key, "id": run_id},
        )


def test_a_file_of_another_live_run_is_kept_however_old_it_looks(seeded, home):
    """A real run over two days while another run holds the lease of the second: in the
    first day's directory a just-written file stays and an old orphan goes; in the second,
    a manifest-less file stays even though its time says hours ago (the writer's host clock
    may be behind): the other run may be about to record it."""
    db = seeded
    first, second = DAY, DAY + timedelta(days=1)
    _another_run_holds(db.engine, Scope(TENANT, second, second + timedelta(days=1)))
    just_written, old_orphan = _orphan_files(home / "archive" / TENANT / first.isoformat(), 2)
    (theirs,) = _orphan_files(home / "archive" / TENANT / second.isoformat(), 1)
    _set_mtime(db.engine, -1, just_written)
    _set_mtime(db.engine, -2 * 3600, old_orphan, theirs)
    done = _execute(db.engine, Scope(TENANT, first, second + timedelta(days=1)), batch_size=5000)
    assert done.status == "success", done.error_text
    assert done.counts.succeeded == ROWS_ON_DAY + 2  # both days archived (the 2nd has 2 edge rows)
    assert done.tally["orphan_files_removed"] == 1
    assert not old_orphan.exists()
    assert just_written.exists() and theirs.exists()


def test_the_retention_setting_is_checked_and_used(seeded, home, monkeypatch):
    db = seeded
    monkeypatch.setenv(audit_archive.RETENTION_ENV, "soon")
    with pytest.raises(ConfigError, match="QO_OPS_AUDIT_RETENTION_DAYS"):
        run_job(SPEC, WINDOW, RunOptions(mode="dry_run"), engine=db.engine)
    monkeypatch.setenv(audit_archive.RETENTION_ENV, "0")
    with pytest.raises(ConfigError, match="from 1 to"):
        audit_archive.retention_days()
    # a retention longer than the records' age: nothing is eligible
    age = (datetime.now(UTC).date() - DAY).days
    monkeypatch.setenv(audit_archive.RETENTION_ENV, str(age + 2))
    dry = run_job(SPEC, WINDOW, RunOptions(mode="dry_run"), engine=db.engine)
    assert (dry.status, dry.eligible_count) == ("no_work", 0)


def _first_day_with_work(engine: sa.Engine, start: date, days: int) -> tuple[date, int]:
    with engine.connect() as conn:
        for offset in range(days):
            day = start + timedelta(days=offset)
            ctx = BatchContext(
                SPEC.name, Scope(TENANT, day, day + timedelta(days=1)), "dry_run", uuid.uuid4()
            )
            count = count_eligible(conn, SPEC, ctx)
            if count:
                return day, count
    raise AssertionError("no day with work")


def test_does_real_work_on_the_dagster_test_data(db, home, monkeypatch):
    """The Dagster tests' load: its audit records are 1–200 days older than 2026-03-01."""
    load_demo_data(db.engine, tenants=2, quotes=400, seed=9, as_of=AS_OF)
    day, eligible = _first_day_with_work(db.engine, date(2025, 6, 1), 300)
    assert day < date(2026, 1, 1)  # with the default 365 days: the days of 2025 only
    done = _execute(db.engine, Scope(TENANT, day, day + timedelta(days=1)))
    assert (done.status, done.counts.succeeded, done.eligible_count) == (
        "success",
        eligible,
        eligible,
    )
    assert all(_checks(done).values())

    # with a shorter retention the days of 2026 (the Dagster partitions) have work too
    monkeypatch.setenv(audit_archive.RETENTION_ENV, "90")
    day, eligible = _first_day_with_work(db.engine, date(2026, 1, 1), 90)
    done = _execute(db.engine, Scope(TENANT, day, day + timedelta(days=1)))
    assert (done.status, done.counts.succeeded) == ("success", eligible)
    assert all(_checks(done).values())


# ----------------------------------------------------------------------------- restore CLI


def _module_cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "qo_ops.cli", "archive", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )


def test_restore_command_prints_the_rows_that_came_back(seeded, home):
    db = seeded
    original = _audit_digest(db.engine)
    assert _execute(db.engine, batch_size=500).status == "success"
    env = base_env(QO_OPS_DATABASE_URL=db.env_url, QO_OPS_HOME=str(home))
    args = ["restore", "--tenant", TENANT, "--date", DAY.isoformat(), "--reason", "ticket 42"]
    first = _module_cli(args, env)
    assert first.returncode == 0, first.stderr
    assert "restored_rows=1234" in first.stdout.splitlines()
    assert _audit_digest(db.engine) == original
    second = _module_cli([*args, "--json"], env)
    assert second.returncode == 0, second.stderr
    assert json.loads(second.stdout)["restored_rows"] == 0
    assert _audit_digest(db.engine) == original


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tenant", TENANT, "--date", "2024-13-01"], "--date must be a date"),
        (["--tenant", "Tenant 1", "--date", "2024-06-01"], "tenant must be"),
        (["--tenant", "tenant-404", "--date", "2024-06-01"], "unknown tenant"),
        (["--tenant", TENANT], "Missing option"),
    ],
)
def test_restore_command_bad_input_is_one_line_and_exit_2(seeded, home, args, message):
    env = base_env(QO_OPS_DATABASE_URL=seeded.env_url, QO_OPS_HOME=str(home))
    result = _module_cli(["restore", *args], env)
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and message in result.stderr
    assert "Traceback" not in result.stderr


# ----------------------------------------------------------------------------- crashes

PYTHON_RUN = """
import json, sys
from datetime import date, timedelta
from qo_ops.db.engine import get_engine
from qo_ops.jobs.audit_archive import SPEC
from qo_ops.platform.run.runner import run_job
from qo_ops.platform.job.options import RunOptions
from qo_ops.platform.job.scope import Scope

day = date.fromisoformat(sys.argv[1])
summary = run_job(
    SPEC,
    Scope(sys.argv[2], day, day + timedelta(days=1)),
    RunOptions(mode="execute", reason="crash test", batch_size=int(sys.argv[3]), lease_ttl_s=2, approval="apr-test-audit_archive",
               progress_interval_s=3600),
    engine=get_engine(),
)
print(json.dumps(summary.as_dict(), default=str))
sys.exit({"success": 0, "no_work": 0, "failed": 1, "partial_success": 3}.get(summary.status, 9))
"""


def _launch(launcher: str, env: dict[str, str], batch_size: int) -> tuple[int, str, str]:
    if launcher == "python":
        proc = subprocess.run(
            [sys.executable, "-c", PYTHON_RUN, DAY.isoformat(), TENANT, str(batch_size)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            stdin=subprocess.DEVNULL,
        )
        return proc.returncode, proc.stdout, proc.stderr
    result = run_cli(
        [
            "run",
            "audit_archive",
            "--tenant",
            TENANT,
            "--date",
            DAY.isoformat(),
            "--mode",
            "execute",
            "--reason",
            "x",
            "--approval",
            APPROVAL,
            "--lease-ttl-s",
            "2",
            "--batch-size",
            str(batch_size),
            "--json",
        ],
        env,
    )
    return result.code, result.stdout, result.stderr


def _wait_for_lease_expiry(engine: sa.Engine, killed_at: float) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with engine.connect() as conn:
            held = conn.scalar(
                sa.text(
                    "SELECT count(*) FROM job_lease WHERE job_name = 'audit_archive' "
                    "AND expires_at > clock_timestamp()"
                )
            )
        if not held and time.monotonic() - killed_at > 3.0:  # files of the crash are > TTL old
            return
        time.sleep(0.1)
    pytest.fail("the killed run's lease did not expire")


# what a SIGKILL at each point leaves behind: (files, manifests by status, source rows deleted)
AFTER_CRASH = {
    "after_lease_acquire": (0, {}, 0),
    "after_batch_select": (0, {}, 0),
    "before_commit": (0, {}, 0),
    "after_commit": (0, {}, 0),
    "archive_before_file_rename": (1, {}, 0),  # the .tmp file
    "archive_after_file_written": (1, {}, 0),
    "archive_after_manifest_written": (1, {"WRITTEN": 1}, 0),
    "after_external_call": (1, {"WRITTEN": 1}, 0),
    "archive_before_delete_commit": (1, {"WRITTEN": 1}, 0),
    "archive_after_delete_commit": (1, {"VERIFIED": 1}, 500),
    "before_finalize": (3, {"VERIFIED": 3}, ROWS_ON_DAY),
}
assert set(AFTER_CRASH) == set(CRASH_POINTS) | set(ARCHIVE_CRASH_POINTS)


def _assert_exact(db, home: Path, original_ids: list[int], original_digest: str) -> None:
    """Remaining + archived (VERIFIED) = the original records exactly; no duplicate anywhere."""
    archived = _archived_ids(home, db.engine)
    remaining = _day_ids(db.engine)
    assert len(archived) == len(set(archived))  # no record in two archives
    assert not set(archived) & set(remaining)  # none both archived and remaining
    assert sorted(archived + remaining) == original_ids
    manifests = _manifests(db.engine)
    assert {m.status for m in manifests} == {"VERIFIED"}
    assert sum(m.row_count for m in manifests) + len(remaining) == len(original_ids)
    assert _files(home) == sorted(home / m.file_path for m in manifests)  # no orphan left
    ctx = BatchContext(SPEC.name, WINDOW, "dry_run", uuid.uuid4())
    with db.engine.connect() as conn:
        assert all(c.passed for c in SPEC.check(conn, ctx))
    restore_day(db.engine, TENANT, DAY)  # and by digest: back to exactly the original table
    assert _audit_digest(db.engine) == original_digest


def _crash_then_rerun(db, home: Path, launcher: str, point: str) -> None:
    original_ids, original_digest = _day_ids(db.engine), _audit_digest(db.engine)
    env = base_env(QO_OPS_DATABASE_URL=db.env_url, QO_OPS_HOME=str(home))
    code, _, err = _launch(launcher, {**env, CRASH_ENV: point}, 500)
    killed_at = time.monotonic()
    assert code == -signal.SIGKILL, (code, err[-800:])

    files, statuses, deleted = AFTER_CRASH[point]
    assert len(_files(home)) == files
    if point == "archive_before_file_rename":
        assert [p.suffix for p in _files(home)] == [".tmp"]  # the killed run's, not yet renamed
    assert _statuses(db.engine) == statuses
    assert len(_day_ids(db.engine)) == ROWS_ON_DAY - deleted
    if deleted == 0:
        assert _audit_digest(db.engine) == original_digest  # the source is intact

    _wait_for_lease_expiry(db.engine, killed_at)
    code, out, err = _launch(launcher, env, 500)
    assert code == 0, (out[-800:], err[-800:])
    rerun = json.loads(out.strip().splitlines()[-1])
    assert rerun["status"] == ("no_work" if deleted == ROWS_ON_DAY else "success")
    assert rerun["succeeded_count"] == ROWS_ON_DAY - deleted
    if statuses.get("WRITTEN"):
        assert rerun["tally"].get("archives_adopted") == 1  # re-verified, not written again
    if point in ("archive_before_file_rename", "archive_after_file_written"):
        assert rerun["tally"].get("orphan_files_removed") == 1
    with db.engine.connect() as conn:
        killed = conn.execute(
            sa.text("SELECT status, status_reason FROM job_run ORDER BY started_at LIMIT 1")
        ).one()
    assert tuple(killed) == ("failed", "orphaned")
    _assert_exact(db, home, original_ids, original_digest)


@pytest.mark.parametrize("point", list(AFTER_CRASH))
def test_sigkill_at_every_step_then_rerun_is_exact(seeded, home, point):
    _crash_then_rerun(seeded, home, "python", point)


@pytest.mark.parametrize("point", list(AFTER_CRASH))
def test_cli_sigkill_at_every_step_then_rerun_is_exact(seeded, home, point):
    _crash_then_rerun(seeded, home, "cli", point)


def test_a_stale_written_archive_of_another_shape_is_replaced(seeded, home):
    """Killed with a WRITTEN manifest of 500 rows, rerun with 300-row batches: the stale
    manifest is retired (row and file) and the records archived anew."""
    db = seeded
    original_ids, original_digest = _day_ids(db.engine), _audit_digest(db.engine)
    env = base_env(QO_OPS_DATABASE_URL=db.env_url, QO_OPS_HOME=str(home))
    code, _, err = _launch("python", {**env, CRASH_ENV: "after_external_call"}, 500)
    killed_at = time.monotonic()
    assert code == -signal.SIGKILL, err[-800:]
    assert _statuses(db.engine) == {"WRITTEN": 1}
    _wait_for_lease_expiry(db.engine, killed_at)
    code, out, err = _launch("python", env, 300)
    assert code == 0, err[-800:]
    rerun = json.loads(out.strip().splitlines()[-1])
    assert rerun["tally"]["archives_replaced"] == 1 and rerun["tally"]["archives_written"] == 5
    assert rerun["succeeded_count"] == ROWS_ON_DAY
    _assert_exact(db, home, original_ids, original_digest)


# ----------------------------------------------------------------------------- via the CLI


def test_cli_dry_run_then_execute(seeded, home):
    db = seeded
    env = base_env(QO_OPS_DATABASE_URL=db.env_url, QO_OPS_HOME=str(home))
    base = ["run", "audit_archive", "--tenant", TENANT, "--date", DAY.isoformat()]
    with db.engine.connect() as conn:
        before = database_digest(conn, BUSINESS_TABLES)
    dry = run_cli([*base, "--json"], env)
    assert dry.code == 0, dry.stderr[-800:]
    assert json.loads(dry.stdout)["eligible_count"] == ROWS_ON_DAY
    with db.engine.connect() as conn:
        assert database_digest(conn, BUSINESS_TABLES) == before
    assert not (home / "archive").exists()
    done = run_cli(
        [*base, "--mode", "execute", "--reason", "retention", "--approval", APPROVAL], env
    )
    assert done.code == 0, done.stderr[-800:]
    assert "status=success" in done.stdout and "succeeded_count=1234" in done.stdout
    assert "check.archive_accounts_for_every_record=passed" in done.stdout
    assert "check.archives_verify=passed" in done.stdout


def test_cli_archive_restore(seeded, home):
    db = seeded
    original = _audit_digest(db.engine)
    assert _execute(db.engine).status == "success"
    env = base_env(QO_OPS_DATABASE_URL=db.env_url, QO_OPS_HOME=str(home))
    args = ["archive", "restore", "--tenant", TENANT, "--date", DAY.isoformat()]
    first = run_cli(args, env)
    assert first.code == 0, first.stderr
    assert "restored_rows=1234" in first.stdout
    second = run_cli(args, env)
    assert second.code == 0 and "restored_rows=0" in second.stdout
    assert _audit_digest(db.engine) == original
    bad = run_cli(["archive", "restore", "--tenant", TENANT, "--date", "yesterday"], env)
    assert bad.code == 2 and len(bad.stderr.strip().splitlines()) == 1


def test_importing_the_job_or_the_catalog_does_not_load_pyarrow():
    """The package loads Arrow only where it makes or reads a table (a CLI that only lists,
    counts or dry-runs never pays for it)."""
    code = (
        "import sys\n"
        "import qo_ops.jobs.audit_archive, qo_ops.jobs.catalog\n"
        "from qo_ops.jobs.audit_archive import steps, format, restore, checks, storage\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'pyarrow'))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert proc.stdout.strip() == "[]", proc.stdout[-500:]


def test_an_execute_run_archives_with_pyarrow_and_never_loads_pandas(seeded, home, tmp_path):
    """pyarrow imports pandas (when installed) on its first conversion of a Python value:
    seconds that a run would pay for nothing. An execute run converts none."""
    proc, modules = modules_loaded_by(
        tmp_path,
        base_env(QO_OPS_DATABASE_URL=seeded.env_url, QO_OPS_HOME=str(home)),
        *("run", "audit_archive", "--tenant", TENANT, "--date", DAY.isoformat()),
        *("--mode", "execute", "--reason", "test", "--approval", APPROVAL, "--json"),
    )
    assert proc.returncode == 0, proc.stderr[-800:]
    summary = json.loads(proc.stdout)
    assert (summary["status"], summary["succeeded_count"]) == ("success", ROWS_ON_DAY)
    loaded = {name.split(".")[0] for name in modules}
    assert "pyarrow" in loaded  # it did archive
    assert "pandas" not in loaded
