"""Traces of real runs, caught by an in-memory span exporter: run → lease and batches →
checkpoint updates and downstream calls (a real simulator over HTTP), with the seed's
attributes and without item ids; the run's trace id is in every event it logs. Off by
default, and a bad endpoint setting is a one-line error.

Tests ``qo_ops.platform.observability.tracing``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from datetime import date, timedelta

import pytest
import sqlalchemy as sa
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from qo_ops.demo.data import load_demo_data
from qo_ops.errors import ConfigError
from qo_ops.jobs.catalog import CATALOG
from qo_ops.platform.job.options import RunOptions
from qo_ops.platform.job.scope import Scope
from qo_ops.platform.observability import tracing
from qo_ops.platform.observability.resource import process_resource
from qo_ops.platform.run.runner import run_job
from qo_ops_tests.conftest import base_env, run_cli
from qo_ops_tests.dagster.conftest import AS_OF

TENANT = "tenant-001"
SEED_ATTRIBUTES = {"job.name", "job.run_id", "job.trigger", "job.status", "items.processed"}


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = tracing.build_provider(SimpleSpanProcessor(exporter))
    tracing.use_provider(provider)
    yield exporter
    tracing.use_provider(None)
    provider.shutdown()


def _execute(engine, job: str, scope: Scope, **options):
    opts = {"mode": "execute", "trigger": "schedule", "progress_interval_s": 0.0, **options}
    return run_job(CATALOG[job], scope, RunOptions(**opts), engine=engine)


def _events(caplog) -> list[dict]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == "qo_ops.events"]


def test_a_run_is_one_trace_of_lease_batches_and_downstream_calls(
    db, downstream, monkeypatch, spans, caplog
):
    load_demo_data(db.engine, tenants=1, quotes=300, seed=3, as_of=AS_OF)
    with db.engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE delivery_attempt_item SET status = 'READY', attempt_count = 0, "
                "next_attempt_at = now() - interval '1 minute', payload = payload - 'fault'"
            )
        )
        item_ids = {
            str(i) for i in conn.execute(sa.text("SELECT id FROM delivery_attempt_item")).scalars()
        }
    monkeypatch.setenv("QO_OPS_DOWNSTREAM_URL", downstream.url)
    caplog.set_level(logging.INFO, logger="qo_ops.events")

    summary = _execute(db.engine, "delivery_retry", Scope(TENANT), batch_size=10)
    assert summary.counts.processed > 10  # several batches

    finished = spans.get_finished_spans()
    roots = [s for s in finished if s.parent is None]
    assert [s.name for s in roots] == ["Job delivery_retry"]
    root = roots[0]
    assert SEED_ATTRIBUTES | {"items.failed"} <= set(root.attributes)
    assert root.attributes["job.run_id"] == summary.job_run_id
    assert root.attributes["job.status"] == summary.status
    assert root.attributes["items.processed"] == summary.counts.processed
    assert {s.context.trace_id for s in finished} == {root.context.trace_id}

    by_id = {s.context.span_id: s for s in finished}
    children = [s for s in finished if s.parent and s.parent.span_id == root.context.span_id]
    assert {s.name for s in children} >= {"lease.acquire", "batch"}
    batches = [s for s in children if s.name == "batch"]
    assert sum(s.attributes["items.processed"] for s in batches) == summary.counts.processed
    calls = [
        s
        for s in finished
        if s.attributes.get("http.request.method") or s.attributes.get("http.method")
    ]
    assert len(calls) >= summary.counts.processed  # one span per downstream request at least
    assert all(by_id[c.parent.span_id].name == "batch" for c in calls)  # calls inside batches
    for s in batches:  # counts only: no item id anywhere on a batch span
        assert not {str(v) for v in s.attributes.values()} & item_ids
        assert not any("id" in k.split(".")[-1] for k in s.attributes if k != "batch.number")

    events = _events(caplog)
    assert events and {e.get("trace.id") for e in events} == {format(root.context.trace_id, "032x")}
    process = dict(process_resource().attributes)  # the spans name the process its events do
    assert {s.resource.attributes.get("service.name") for s in finished} == {"qo-ops"}
    assert all(s.resource.attributes.items() >= process.items() for s in finished)
    assert all(e.items() >= process.items() for e in events)


def test_checkpoint_updates_are_spans_of_their_batch(db, spans):
    load_demo_data(db.engine, tenants=1, quotes=300, seed=3, as_of=AS_OF)
    day = next(
        d
        for d in (date(2026, 1, 1) + timedelta(days=n) for n in range(60))
        if _execute(
            db.engine, "pricing_snapshot_recalculation", Scope(TENANT, d, d + timedelta(days=1)),
            mode="dry_run",
        ).eligible_count > 2
    )  # fmt: skip
    spans.clear()
    summary = _execute(
        db.engine, "pricing_snapshot_recalculation", Scope(TENANT, day, day + timedelta(days=1)),
        batch_size=1,
    )  # fmt: skip
    finished = spans.get_finished_spans()
    by_id = {s.context.span_id: s for s in finished}
    updates = [s for s in finished if s.name == "checkpoint.update"]
    assert len(updates) == summary.batches >= 2
    assert all(by_id[u.parent.span_id].name == "batch" for u in updates)


def test_tracing_is_off_by_default(db, caplog):
    load_demo_data(db.engine, tenants=1, quotes=50, seed=3, as_of=AS_OF)
    caplog.set_level(logging.INFO, logger="qo_ops.events")
    tracing.use_provider(None)
    _execute(db.engine, "quote_expiration", Scope(TENANT))
    events = _events(caplog)
    assert events and not any("trace.id" in e for e in events)


def test_a_bad_endpoint_is_a_one_line_error(db):
    with pytest.raises(ConfigError, match="http"):
        tracing.configure_from_env({tracing.OTLP_ENV: "collector:4318"})
    result = run_cli(
        ["info"], base_env(QO_OPS_DATABASE_URL=db.env_url, QO_OPS_OTLP_ENDPOINT="ftp://x")
    )
    assert result.code == 2 and result.stderr.count("\n") == 1
    assert "QO_OPS_OTLP_ENDPOINT" in result.stderr and "Traceback" not in result.stderr
