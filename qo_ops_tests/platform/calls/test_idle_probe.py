"""``qo_ops.platform.calls.idle_probe``: the idle probe takes its probe before sending and
writes its verdict only over the row it took, so it never races a run's half-open probe into
two verdicts (real PostgreSQL, the real simulator). The sensor's own cases (closed, kept
open, bad origin) are in qo_ops_tests/dagster/test_probes.py."""

from __future__ import annotations

import uuid

import pytest
import sqlalchemy as sa

from qo_ops.downstream.calls import ask_for_probe
from qo_ops.platform.calls.breaker import (
    CLOSED,
    HALF_OPEN,
    OPEN,
    BatchEvidence,
    BreakerSettings,
    CircuitBreaker,
    Transition,
    read_shared,
    share_batch,
)
from qo_ops.platform.calls.idle_probe import ProbeReport, probe_idle_breakers

SETTINGS = BreakerSettings()


def open_and_due(db, origin: str) -> None:
    with db.engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO downstream_breaker (downstream, state, opened_at, probe_after, "
                "opened_count) VALUES (:o, 'open', now(), now() - interval '1 second', 1)"
            ),
            {"o": origin},
        )


def the_row(db):
    with db.engine.connect() as conn:
        return conn.execute(
            sa.text("SELECT state, reason, changed_by_run, opened_count FROM downstream_breaker")
        ).one()


def test_a_runs_probe_that_decides_first_wins_and_the_idle_probe_writes_nothing(db, downstream):
    """A run read the row due just before the idle probe took it, and records its half-open
    probe (three answers: closed) while the idle probe's calls are out. The idle probe then
    finds the row no longer the one it took and writes nothing: one verdict, the run's.

    Planted once: without the ``_STILL_TAKEN`` check, the idle probe wrote a second
    ``closed`` over the run's (the row named no run and gave the idle probe's reason)."""
    open_and_due(db, downstream.url)
    run_id = uuid.uuid4()
    asked: list[str] = []

    def ask_while_a_run_records(origin: str, breaker: CircuitBreaker) -> None:
        if not asked:
            moves = [Transition(HALF_OPEN, "probe_due"), Transition(CLOSED, "probes_answered 3")]
            with db.engine.begin() as conn:
                share_batch(conn, BatchEvidence(origin, run_id, "S", moves, []), SETTINGS)
        asked.append(origin)
        ask_for_probe(origin, breaker)

    reports = probe_idle_breakers(db.engine, SETTINGS, ask_while_a_run_records)
    assert reports == [ProbeReport(downstream.url, "taken", "a run's probe decided first")]
    assert len(asked) == SETTINGS.probes  # its calls went, and their verdict was dropped
    row = the_row(db)
    assert (row.state, row.reason, row.changed_by_run) == (CLOSED, "probes_answered 3", run_id)


def test_a_taken_probe_keeps_runs_and_other_probers_off_the_row(db, downstream):
    """While the idle probe's calls are out, a run starting a batch reads the breaker open and
    not due (so it claims nothing), and a second prober finds nothing due. The probe's
    verdict is then written once."""
    open_and_due(db, downstream.url)
    seen: list[tuple[str, bool, list[ProbeReport]]] = []

    def ask_and_look(origin: str, breaker: CircuitBreaker) -> None:
        if not seen:
            with db.engine.connect() as conn:
                shared = read_shared(conn, origin, SETTINGS)
            again = probe_idle_breakers(db.engine, SETTINGS, ask_for_probe)
            seen.append((shared.state, shared.probe_due, again))
        ask_for_probe(origin, breaker)

    reports = probe_idle_breakers(db.engine, SETTINGS, ask_and_look)
    assert seen == [("open", False, [])]
    assert reports == [ProbeReport(downstream.url, CLOSED, "probes_answered 3")]
    row = the_row(db)
    assert (row.state, row.changed_by_run, row.opened_count) == (CLOSED, None, 1)


@pytest.mark.parametrize("run_probe", ["answered", "failed"])
def test_a_runs_probe_recorded_after_the_idle_probe_closed_it_is_no_second_verdict(
    db, downstream, run_probe
):
    """A run took up the row open and due (half-open) just before the idle probe took it;
    the idle probe closes it; then the run's probe records. The run's half-open and verdict
    are not written again over the closed row: its probes' answers join the evidence (a
    failed probe as one failure, which does not open a closed breaker).

    Planted once: with ``_after_other_probes`` returning the run's transitions as they are,
    the run wrote a second half-open and closed (or reopened the breaker on one failure)."""
    open_and_due(db, downstream.url)
    run = CircuitBreaker(SETTINGS)
    with db.engine.connect() as conn:
        run.sync(read_shared(conn, downstream.url, SETTINGS))
    assert run.state == HALF_OPEN

    idle = probe_idle_breakers(db.engine, SETTINGS, ask_for_probe)
    assert idle == [ProbeReport(downstream.url, CLOSED, "probes_answered 3")]
    if run_probe == "failed":
        downstream.client.set_faults(outage="503")
    for _ in range(SETTINGS.probes):
        if run.state == HALF_OPEN:
            ask_for_probe(downstream.url, run)
    moves = run.drain()
    assert moves[0].to == HALF_OPEN and moves[-1].to == (
        CLOSED if run_probe == "answered" else OPEN
    )
    evidence = BatchEvidence(downstream.url, uuid.uuid4(), run.take_added(), moves, [])
    with db.engine.begin() as conn:
        shared = share_batch(conn, evidence, SETTINGS)
    assert shared.transitions == [] and not shared.opened_now
    row = the_row(db)
    assert (row.state, row.reason, row.changed_by_run) == (
        CLOSED,
        "probes_answered 3 idle_probe",
        None,
    )
    with db.engine.connect() as conn:
        recent = conn.execute(sa.text("SELECT recent FROM downstream_breaker")).scalar_one()
    assert recent.endswith("F" if run_probe == "failed" else "S")
