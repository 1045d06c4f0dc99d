"""quote_expiration's own rules, through the one runner (``run_job``): an execute expires
exactly the eligible quotes of its tenant, each with one event, and changes nothing else; a
second execute is ``no_work`` and changes no data. (The runner's contract, driven with this
job: qo_ops_tests/platform/run/test_runner.py, test_records.py and test_admission.py.)"""

from __future__ import annotations

import sqlalchemy as sa

from qo_ops_tests.platform.run.quote_runs import (
    JOB,
    OTHERS,
    TENANT,
    assert_all_checks_passed,
    data_digest,
    events_per_quote,
    loaded,  # noqa: F401 (a fixture)
    quote_states,
    rows,
    run,
    run_row,
    scalar,
)

# ------------------------------------------------------------------------- helpers


def tenant_fingerprint(engine: sa.Engine, tenants: tuple[str, ...]) -> tuple[str, str]:
    """md5 over the quotes and outbox events of ``tenants``."""
    return (
        scalar(
            engine,
            "SELECT md5(string_agg(q::text, '|' ORDER BY q.id)) FROM quote q "
            "WHERE q.tenant_id = ANY(:t)",
            t=list(tenants),
        ),
        scalar(
            engine,
            "SELECT md5(coalesce(string_agg(e::text, '|' ORDER BY e.id), '')) FROM outbox_event e "
            "WHERE e.tenant_id = ANY(:t)",
            t=list(tenants),
        ),
    )


# ------------------------------------------------------------------------- execute


def test_execute_expires_every_eligible_quote_with_one_event_each_and_nothing_else(loaded):  # noqa: F811
    db, eligible = loaded
    versions = {i: v for i, (_, v) in quote_states(db.engine, eligible).items()}
    others_before = tenant_fingerprint(db.engine, OTHERS)
    with db.engine.connect() as conn:
        untouched_before = conn.execute(
            sa.text(
                "SELECT md5(string_agg(q::text, '|' ORDER BY id)) FROM quote q "
                "WHERE tenant_id = :t AND id <> ALL(:ids)"
            ),
            {"t": TENANT, "ids": eligible},
        ).scalar()
    events_before = scalar(db.engine, "SELECT count(*) FROM outbox_event")

    summary = run(db.engine, batch_size=97)

    assert summary.status == "success"
    assert summary.eligible_count == summary.counts.processed == summary.counts.succeeded
    assert summary.counts.succeeded == len(eligible)
    assert summary.counts.failed == summary.counts.skipped == 0
    assert summary.batches == -(-len(eligible) // 97)
    assert_all_checks_passed(summary)

    after = quote_states(db.engine, eligible)
    assert after == {i: ("EXPIRED", versions[i] + 1) for i in eligible}
    events = rows(
        db.engine,
        "SELECT business_key, tenant_id, aggregate_type, aggregate_id, event_type, payload "
        "FROM outbox_event WHERE business_key = ANY(:keys)",
        keys=[f"quote:{i}:expired" for i in eligible],
    )
    assert len(events) == len(eligible)
    for e in events:
        quote_id = int(e.aggregate_id)
        assert e.business_key == f"quote:{quote_id}:expired"
        assert (e.tenant_id, e.aggregate_type, e.event_type) == (TENANT, "quote", "QuoteExpired")
        assert e.payload["quote_id"] == quote_id
        assert e.payload["version"] == versions[quote_id] + 1
    assert scalar(db.engine, "SELECT count(*) FROM outbox_event") == events_before + len(eligible)
    assert set(events_per_quote(db.engine, eligible).values()) == {1}

    assert tenant_fingerprint(db.engine, OTHERS) == others_before
    with db.engine.connect() as conn:
        untouched_after = conn.execute(
            sa.text(
                "SELECT md5(string_agg(q::text, '|' ORDER BY id)) FROM quote q "
                "WHERE tenant_id = :t AND id <> ALL(:ids)"
            ),
            {"t": TENANT, "ids": eligible},
        ).scalar()
    assert untouched_after == untouched_before

    row = run_row(db.engine, summary.job_run_id)
    assert (row.status, row.eligible_count, row.processed_count, row.succeeded_count) == (
        "success",
        len(eligible),
        len(eligible),
        len(eligible),
    )
    assert row.fencing_token is not None and row.finished_at is not None
    # the lease is given back at the end
    assert scalar(
        db.engine,
        "SELECT expires_at <= clock_timestamp() FROM job_lease WHERE job_name = :j AND scope = :t",
        j=JOB,
        t=TENANT,
    )


def test_a_second_execute_is_no_work_and_changes_no_data(loaded):  # noqa: F811
    db, eligible = loaded
    first = run(db.engine)
    assert first.status == "success" and first.counts.succeeded == len(eligible)
    before = data_digest(db.engine)

    second = run(db.engine)

    assert second.status == "no_work"
    assert second.eligible_count == second.counts.processed == second.counts.succeeded == 0
    assert data_digest(db.engine) == before
    assert run_row(db.engine, second.job_run_id).status == "no_work"
    assert_all_checks_passed(second)
