"""Runs of quote_expiration, the job the runner's tests drive (qo_ops_tests/platform/run/) and
whose own tests are qo_ops_tests/jobs/test_quote_expiration.py: the demo world they load
(``loaded``: three tenants, every ACTIVE quote overdue), one run through ``run_job``, and
what they read back (the eligible quotes, their events, the run record, digests)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
import sqlalchemy as sa

from qo_ops.db.digest import database_digest
from qo_ops.db.schema import BUSINESS_TABLES, PLATFORM_TABLES, job_checkpoint, outbox_event
from qo_ops.demo.data import load_demo_data
from qo_ops.jobs.quote_expiration import SPEC
from qo_ops.platform.job.options import RunOptions
from qo_ops.platform.job.scope import Scope
from qo_ops.platform.run.runner import RunSummary, run_job

AS_OF = datetime(2026, 3, 1, tzinfo=UTC)  # in the past: every ACTIVE quote is overdue by now
TENANT = "tenant-001"
OTHERS = ("tenant-002", "tenant-003")
JOB = "quote_expiration"


def rows(engine: sa.Engine, sql: str, **params: Any) -> list[sa.Row]:
    with engine.connect() as conn:
        return conn.execute(sa.text(sql), params).all()


def scalar(engine: sa.Engine, sql: str, **params: Any) -> Any:
    with engine.connect() as conn:
        return conn.execute(sa.text(sql), params).scalar()


def eligible_ids(engine: sa.Engine, tenant: str = TENANT) -> list[int]:
    """ACTIVE quotes of ``tenant`` past expiry, in the job's order; computed independently."""
    return [
        r.id
        for r in rows(
            engine,
            "SELECT id FROM quote WHERE tenant_id = :t AND status = 'ACTIVE' AND expires_at < now() "
            "ORDER BY expires_at, id",
            t=tenant,
        )
    ]


def quote_states(engine: sa.Engine, ids: list[int]) -> dict[int, tuple[str, int]]:
    return {
        r.id: (r.status, r.version)
        for r in rows(
            engine, "SELECT id, status, version FROM quote WHERE id = ANY(:ids)", ids=list(ids)
        )
    }


def expired_among(engine: sa.Engine, ids: list[int]) -> set[int]:
    return {i for i, (status, _) in quote_states(engine, ids).items() if status == "EXPIRED"}


def events_per_quote(engine: sa.Engine, ids: list[int]) -> dict[int, int]:
    """How many QuoteExpired events each quote has (keyed 'quote:<id>:expired')."""
    found = dict.fromkeys(ids, 0)
    for r in rows(
        engine,
        "SELECT aggregate_id, count(*) AS n FROM outbox_event WHERE event_type = 'QuoteExpired' "
        "AND aggregate_id = ANY(:ids) GROUP BY aggregate_id",
        ids=[str(i) for i in ids],
    ):
        found[int(r.aggregate_id)] = r.n
    return found


def digest_without(engine: sa.Engine, *excluded: str) -> dict[str, str]:
    tables = tuple(t for t in BUSINESS_TABLES + PLATFORM_TABLES if t.name not in excluded)
    with engine.connect() as conn:
        return database_digest(conn, tables)


# business tables plus the job's own effects (events, checkpoints): what a run may change
DATA_TABLES = (*BUSINESS_TABLES, outbox_event, job_checkpoint)


def data_digest(engine: sa.Engine) -> dict[str, str]:
    with engine.connect() as conn:
        return database_digest(conn, DATA_TABLES)


def run_row(engine: sa.Engine, run_id: str | uuid.UUID) -> sa.Row:
    found = rows(engine, "SELECT * FROM job_run WHERE id = :id", id=uuid.UUID(str(run_id)))
    assert len(found) == 1, run_id
    return found[0]


def run(engine: sa.Engine, tenant: str = TENANT, **options: Any) -> RunSummary:
    options.setdefault("mode", "execute")
    options.setdefault("requester", "test:quote-expiration")
    options.setdefault("reason", "test run")
    return run_job(SPEC, Scope(tenant), RunOptions(**options), engine=engine)


def assert_all_checks_passed(summary: RunSummary) -> None:
    assert {c.name for c in summary.checks} == {
        "no_overdue_active_quotes",
        "one_event_per_expired_quote",
    }
    failed = [(c.name, c.metadata) for c in summary.checks if not c.passed]
    assert failed == []


@pytest.fixture
def loaded(db):
    """Three tenants; every ACTIVE quote is overdue (as_of is in the past)."""
    load_demo_data(db.engine, tenants=3, quotes=1000, seed=5, as_of=AS_OF)
    eligible = eligible_ids(db.engine)
    assert len(eligible) >= 500
    assert all(eligible_ids(db.engine, t) for t in OTHERS)
    return db, eligible
