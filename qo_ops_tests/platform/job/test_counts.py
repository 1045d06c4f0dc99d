"""One set of counters (``Counts``), named once: the job_run columns, the event fields, the
report rows and the run summary's JSON all derive from it.

Tests ``qo_ops.platform.job.counts`` (and the run record's counters,
``qo_ops.platform.run.records``).
"""

from __future__ import annotations

import sqlalchemy as sa

from qo_ops.db.schema import job_run
from qo_ops.platform.job.counts import COLUMNS, COUNTERS, Counts, mutated_count
from qo_ops.platform.job.options import RunOptions
from qo_ops.platform.job.outcome import BatchOutcome, RunSummary
from qo_ops.platform.job.scope import Scope
from qo_ops.platform.run import records


def test_every_counter_is_a_job_run_column_and_every_counted_column_a_counter():
    counted = {c.name for c in job_run.columns if c.name.endswith("_count")}
    assert set(COLUMNS.values()) == counted - {"eligible_count"}  # counted before the batches
    assert COLUMNS["succeeded"] == "succeeded_count"  # one name in code, one in the record


def test_the_event_fields_keep_their_names():
    fields = Counts(1, 2, 3, 4, 5, 6, 7).event_fields()  # job.finished, as logs know them
    assert " ".join(f"{k}={v}" for k, v in fields.items()) == (
        "items.processed=1 items.succeeded=2 items.failed=3 items.skipped=4 "
        "retry.scheduled=5 items.deadlettered=6 items.duplicates_prevented=7"
    )
    progress = Counts(processed=3, failed=1).event_fields(("processed", "failed"))
    assert progress == {"items.processed": 3, "items.failed": 1}


def test_a_batch_outcome_adds_into_the_run_counter_by_counter():
    run = Counts(processed=2, succeeded=1, failed=1)
    same = run
    run += BatchOutcome(processed=5, succeeded=3, skipped=2, events_written=9, tally={"x": 1})
    run += Counts(retry_scheduled=1, deadlettered=2, duplicates_prevented=3)
    assert run is same
    assert run == Counts(
        processed=7,
        succeeded=4,
        failed=1,
        skipped=2,
        retry_scheduled=1,
        deadlettered=2,
        duplicates_prevented=3,
    )


def test_the_report_shows_four_counters_always_and_the_others_when_there_are_any():
    assert list(Counts(processed=4, succeeded=4).report_items().items()) == [
        ("processed", 4),
        ("succeeded", 4),
        ("failed", 0),
        ("skipped", 0),
    ]
    items = Counts(processed=4, failed=4, deadlettered=4, duplicates_prevented=1).report_items()
    assert list(items) == [
        "processed",
        "succeeded",
        "failed",
        "skipped",
        "deadlettered",
        "duplicates_prevented",
    ]


def test_the_summary_json_names_the_counters_as_the_run_record_does_where_counts_stood():
    summary = RunSummary("id", "job", "success", "execute", "tenant-001", "manual", None)
    summary.eligible_count, summary.batches = 9, 2
    summary.counts += Counts(processed=9, succeeded=8, failed=1, duplicates_prevented=2)
    data = summary.as_dict()
    keys = list(data)
    assert "counts" not in data
    at = keys.index("eligible_count")
    assert keys[at + 1] == "mutated_count"  # the seed's pair, side by side
    assert keys[at + 2 : at + 2 + len(COUNTERS)] == list(COLUMNS.values())
    assert keys[at + 2 + len(COUNTERS)] == "batches"
    assert (data["succeeded_count"], data["failed_count"]) == (8, 1)
    assert data["duplicates_prevented_count"] == 2
    assert data["mutated_count"] == 8  # an execute: what it changed


def test_a_dry_run_mutates_nothing_whatever_it_counted():
    """A dry run that looks (it runs its batches) counts what would change in succeeded;
    the seed's mutated_count stays 0: nothing was changed."""
    summary = RunSummary("id", "job", "success", "dry_run", "tenant-001", "manual", None)
    summary.eligible_count = 842
    summary.counts += Counts(processed=842, succeeded=842)
    data = summary.as_dict()
    assert (data["eligible_count"], data["mutated_count"]) == (842, 0)
    assert mutated_count("dry_run", 842) == 0 and mutated_count("execute", 842) == 842


def test_the_run_record_adds_each_batch_counter_by_counter_and_its_tally_key_by_key(db):
    with db.engine.begin() as conn:
        run_id = records.create_run(
            conn,
            "quote_expiration",
            Scope("tenant-001"),
            RunOptions(mode="execute"),
            records.RunOwner("t"),
            {},
        )
    with db.engine.begin() as conn:
        records.add_counts(
            conn, run_id, Counts(processed=3, succeeded=2, skipped=1), {"a": 2, "b": 1}
        )
        records.add_counts(conn, run_id, Counts(processed=2, failed=2), {"a": 1, "c": 5})
        records.add_counts(conn, run_id, Counts(duplicates_prevented=4))  # no tally: kept
    with db.engine.connect() as conn:
        row = conn.execute(sa.select(job_run).where(job_run.c.id == run_id)).one()
    assert {c: row._mapping[c] for c in COLUMNS.values()} == Counts(
        processed=5, succeeded=2, failed=2, skipped=1, duplicates_prevented=4
    ).columns()
    assert row.tally == {"a": 3, "b": 1, "c": 5}
