"""Every catalog job's selection, as the runner issues it (its own statement, with its
limit and row locks), can be served by an index, never only a scan."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from qo_ops.demo.data import load_demo_data
from qo_ops.jobs.catalog import CATALOG
from qo_ops.platform.job.outcome import BatchContext
from qo_ops.platform.job.scope import Scope
from qo_ops.platform.job.spec import JobSpec

AS_OF = datetime(2026, 6, 1, tzinfo=UTC)
TENANT = "tenant-001"


@pytest.fixture(scope="module")
def loaded(pg_server, template_database):
    from qo_ops_tests.conftest import _test_database

    gen = _test_database(pg_server, template_database)
    database = next(gen)
    load_demo_data(database.engine, tenants=3, quotes=3000, seed=3, as_of=AS_OF)
    with database.engine.connect() as conn:
        conn.exec_driver_sql("ANALYZE")
    yield database
    gen.close()


def selection(spec: JobSpec) -> sa.Select[Any]:
    """The first batch's selection of ``spec`` for the demo tenant (a windowed job: the day
    before AS_OF), as ``select_batch`` issues it."""
    day = AS_OF.date() - timedelta(days=1)
    scope = Scope.days(TENANT, day, day) if spec.partitioning == "tenant_day" else Scope(TENANT)
    ctx = BatchContext(spec.name, scope, "execute", uuid.uuid4())
    query = spec.eligible(ctx).limit(spec.defaults.batch_size)
    if spec.batching.locks is not None:
        query = query.with_for_update(skip_locked=True, of=spec.batching.locks.of)
    return query


@pytest.mark.parametrize("job", sorted(CATALOG))
def test_selection_is_index_backed(loaded, job):
    spec = CATALOG[job]
    query = selection(spec)
    with loaded.engine.connect() as conn:
        conn.exec_driver_sql("SET enable_seqscan = off")  # only a usable index avoids a Seq Scan
        compiled = query.compile(dialect=conn.dialect)
        plan = "\n".join(
            r[0] for r in conn.exec_driver_sql("EXPLAIN " + str(compiled), dict(compiled.params))
        )
    assert "Seq Scan" not in plan, plan  # on any table it reads
    assert "Index" in plan, plan
