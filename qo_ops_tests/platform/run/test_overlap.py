"""Overlapped batches (qo_ops.platform.run.overlap): the next batch claimed and the last one
recorded while a batch's calls are in flight, against a real simulator process and real
PostgreSQL, with faults, a real SIGKILL and an outage that opens the breaker."""

from __future__ import annotations

import signal
import subprocess
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import sqlalchemy as sa

from qo_ops.demo.data import load_demo_data
from qo_ops.jobs import delivery_retry
from qo_ops.platform.job.spec import Batching, Checkpointing, ExternalPhase, Positions
from qo_ops_tests.conftest import QO_OPS_BIN, base_env, run_cli
from qo_ops_tests.jobs.test_downstream_jobs import (
    AS_OF,
    BASE_S,
    TENANT,
    drain,
    execute,
    make_all_deliveries_due,
    scalar,
    wait_for,
    wait_for_claims_to_lapse,
)
from qo_ops_tests.jobs.test_downstream_manners import requests_seen

CLAIMED = "SELECT count(*) FROM delivery_attempt_item WHERE status = 'IN_PROGRESS'"
DELIVERED = "SELECT count(*) FROM delivery_attempt_item WHERE status = 'DELIVERED'"


class MostClaimed:
    """Polls how many items are claimed at once while a run works (another connection)."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine, self.most = engine, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> MostClaimed:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        with self.engine.connect() as conn:
            while not self._stop.wait(0.002):
                self.most = max(self.most, conn.execute(sa.text(CLAIMED)).scalar() or 0)
                conn.rollback()


def test_overlapped_batches_deliver_each_item_once_under_faults(
    db, downstream_factory, monkeypatch
):
    monkeypatch.setenv("QO_OPS_RETRY_BASE_S", str(BASE_S))
    monkeypatch.setenv("QO_OPS_RETRY_CAP_S", "1")
    load_demo_data(db.engine, tenants=1, quotes=1000, seed=5, as_of=AS_OF)
    items = make_all_deliveries_due(db, strip_poison=True)
    server = downstream_factory(
        latency_ms=10, error_rate=0.2, timeout_rate=0.05, reset_rate=0.02, seed=3, timeout_s=1.2
    )
    monkeypatch.setenv("QO_OPS_DOWNSTREAM_URL", server.url)

    def nothing_due() -> bool:
        return (
            scalar(db.engine, CLAIMED.replace("= 'IN_PROGRESS'", "IN ('READY', 'IN_PROGRESS')"))
            == 0
        )

    with MostClaimed(db.engine) as claimed:
        runs = drain(delivery_retry.SPEC, db, nothing_due, batch_size=50, concurrency=8)
    assert claimed.most > 50  # two batches were claimed at once: the next while calls flew
    assert any(r.counts.retry_scheduled > 0 for r in runs)  # the faults really bit
    assert scalar(db.engine, DELIVERED) == items
    stats = server.client.stats()
    assert stats["faults_injected"]["timeout"] > 0 and stats["faults_injected"]["error"] > 0
    assert stats["deliveries_distinct"] == items  # each item delivered once downstream
    # each item recorded delivered exactly once, over every batch of every run
    assert scalar(db.engine, "SELECT sum(succeeded_count) FROM job_run") == items
    assert sum(r.counts.succeeded for r in runs) == items


def test_a_sigkill_while_two_batches_are_claimed_leaves_them_to_the_next_run(
    db, downstream_factory, tmp_path: Path
):
    load_demo_data(db.engine, tenants=1, quotes=1000, seed=5, as_of=AS_OF)
    items = make_all_deliveries_due(db, strip_poison=True)
    server = downstream_factory(latency_ms=40)
    env = base_env(
        QO_OPS_DATABASE_URL=db.env_url,
        QO_OPS_DOWNSTREAM_URL=server.url,
        QO_OPS_RETRY_BASE_S=str(BASE_S),
    )
    args = ["run", "delivery_retry", "--tenant", TENANT, "--mode", "execute", "--reason", "k"]
    args += ["--lease-ttl-s", "1", "--batch-size", "50", "--concurrency", "4"]
    proc = subprocess.Popen(
        [QO_OPS_BIN, *args],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=(tmp_path / "stdout").open("w"),
        stderr=(tmp_path / "stderr").open("w"),
    )
    try:  # mid-run: a batch recorded, calls in flight and the next batch claimed ahead
        wait_for(
            lambda: scalar(db.engine, DELIVERED) >= 50 and scalar(db.engine, CLAIMED) > 50,
            60,
            "a recorded batch and two claimed ones",
        )
    finally:
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
    recorded = scalar(db.engine, DELIVERED)
    left_claimed = scalar(db.engine, CLAIMED)
    assert recorded < items and left_claimed > 50  # the kill left two batches claimed
    assert scalar(db.engine, "SELECT sum(succeeded_count) FROM job_run") == recorded
    wait_for_claims_to_lapse(db.engine, 30)
    rerun = run_cli(args, env)
    assert rerun.code == 0, rerun.stderr[-800:]
    assert scalar(db.engine, DELIVERED) == items and scalar(db.engine, CLAIMED) == 0
    stats = server.client.stats()
    assert stats["deliveries_distinct"] == items  # every key delivered, once
    # a key sent twice was sent by the killed run and not recorded: the rerun's re-send was
    # answered from the idempotency key. Nothing the killed run recorded was sent again.
    resent = {k for k, n in stats["deliveries_by_key"].items() if n > 1}
    assert len(resent) == stats["duplicates_suppressed"] <= left_claimed
    assert set(stats["deliveries_by_key"].values()) <= {1, 2}
    # every item recorded delivered exactly once, over the killed run and the rerun
    assert scalar(db.engine, "SELECT sum(succeeded_count) FROM job_run") == items
    assert (
        scalar(
            db.engine,
            "SELECT status || '/' || status_reason FROM job_run ORDER BY started_at LIMIT 1",
        )
        == "failed/orphaned"
    )


def test_when_the_breaker_opens_the_batch_claimed_ahead_is_released_unsent(
    db, downstream_factory, monkeypatch
):
    """ "This batch", for the breaker, is the batch whose calls are in flight when it opens:
    its systemic failures are spared and its calls not yet made are refused. The batch
    claimed ahead sends nothing (the open breaker refuses each call) and is given back,
    attempt kept; the run stops after recording both."""
    load_demo_data(db.engine, tenants=1, quotes=1000, seed=3, as_of=AS_OF)
    assert make_all_deliveries_due(db, strip_poison=True) > 100
    server = downstream_factory(error_rate=1.0)  # down from the start
    monkeypatch.setenv("QO_OPS_DOWNSTREAM_URL", server.url)

    run = execute(delivery_retry.SPEC, db, batch_size=50, concurrency=4)
    assert (run.status, run.error_code) == ("failed", "dependency_unavailable")
    sent = requests_seen(server)
    assert 10 <= sent <= 10 + 4  # as without overlap: ten in a row open it, 4 were in flight
    assert run.counts.processed == 100  # the batch in flight and the one claimed ahead …
    assert run.counts.skipped == 100  # … both given back: spared, refused or never sent
    assert run.tally["downstream.calls"] == sent == run.tally["downstream.spared"]
    assert scalar(db.engine, CLAIMED) == 0
    assert scalar(db.engine, "SELECT max(attempt_count) FROM delivery_attempt_item") == 0
    assert run.tally["breaker.open"] == 1


def test_an_overlapping_phase_refuses_a_selection_that_depends_on_the_batch_before():
    spec = delivery_retry.SPEC
    assert isinstance(spec.then, ExternalPhase) and spec.then.overlap
    with pytest.raises(ValueError, match="overlapping external phase"):
        replace(spec, batching=Batching(positions=Positions()))
    with pytest.raises(ValueError, match="overlapping external phase"):
        replace(spec, batching=Batching(checkpoint=Checkpointing(rescan_when_complete=False)))
    replace(spec, then=replace(spec.then, overlap=False), batching=Batching(positions=Positions()))
