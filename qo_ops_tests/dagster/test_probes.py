"""breaker_probe_sensor, evaluated for real (build_sensor_context, a Dagster instance) against
the database and the downstream simulator: an open breaker whose probe is due is probed with
no work queued and no run, closed when the downstream answers, kept open (its probe pushed
on) when not, and an origin it cannot reach is one line in the tick, never a traceback."""

from __future__ import annotations

from typing import Any

import dagster as dg
import sqlalchemy as sa

from qo_ops.dagster_defs.probes import breaker_probe_sensor
from qo_ops.dagster_defs.resources import QoOpsDatabase
from qo_ops_tests.conftest import _free_port

LATENCY_MS = 10  # the simulator counts the latency it adds, so its requests can be counted


def open_row(db, origin: str, due: bool = True) -> None:
    """The shared row of ``origin`` open since a minute ago, its probe due (or not yet)."""
    with db.engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO downstream_breaker (downstream, state, opened_at, probe_after, "
                "reason, opened_count) VALUES (:o, 'open', now() - interval '1 minute', "
                "now() + CASE WHEN :due THEN interval '-1 second' ELSE interval '1 minute' END, "
                "'http_503 10_in_a_row', 1)"
            ),
            {"o": origin, "due": due},
        )


def row(db, origin: str) -> Any:
    with db.engine.connect() as conn:
        return conn.execute(
            sa.text(
                "SELECT state, reason, opened_count, opened_at, changed_by_run, "
                "probe_after > clock_timestamp() + interval '20 seconds' AS pushed_on "
                "FROM downstream_breaker WHERE downstream = :o"
            ),
            {"o": origin},
        ).one()


def tick(db) -> str:
    with dg.instance_for_test() as instance:
        context = dg.build_sensor_context(
            instance=instance, resources={"database": QoOpsDatabase(url=db.env_url)}
        )
        said = breaker_probe_sensor.evaluate_tick(context).skip_message
    assert said is not None
    return said


def lookups(server) -> int:
    return int(server.client.stats(detail=False)["latency_injected_ms"]) // LATENCY_MS


def test_an_open_breaker_is_closed_by_the_sensor_once_the_downstream_answers(
    db, downstream_factory, monkeypatch
):
    """No item queued, no run: the tick sends the three probes and closes the shared row
    (``opened_at`` and ``probe_after`` cleared, as a run's probe does). A breaker whose probe
    is not due yet is left alone.

    Planted once: with the sensor not registered, nothing probed and the row stayed open
    (the test of the definitions below); with ``_TAKE`` matching no row, the tick said the
    probe was taken and the row stayed open."""
    server = downstream_factory(latency_ms=LATENCY_MS)
    monkeypatch.setenv("QO_OPS_DOWNSTREAM_URL", server.url)
    open_row(db, server.url)
    later = f"http://127.0.0.1:{_free_port()}"
    open_row(db, later, due=False)

    said = tick(db)
    assert said == f"breaker probe: {server.url} closed (probes_answered 3)"
    assert lookups(server) == 3
    closed = row(db, server.url)
    assert (closed.state, closed.opened_at, closed.pushed_on) == ("closed", None, None)
    assert closed.reason == "probes_answered 3 idle_probe" and closed.changed_by_run is None
    assert row(db, later).state == "open"  # not due: not probed
    assert tick(db) == "no open breaker due for a probe"
    assert lookups(server) == 3


def test_a_downstream_still_down_keeps_its_breaker_open_and_the_probe_pushed_on(
    db, downstream_factory, monkeypatch
):
    """The downstream still in its outage: one probe fails, the breaker opens again for
    ``QO_OPS_BREAKER_OPEN_S`` (counted, ``opened_at`` kept), and the next tick leaves it."""
    server = downstream_factory(outage="503")
    monkeypatch.setenv("QO_OPS_BREAKER_OPEN_S", "60")
    open_row(db, server.url)
    began = row(db, server.url).opened_at

    assert tick(db) == f"breaker probe: {server.url} open (probe_failed http_503)"
    assert server.client.stats(detail=False)["outage_refused"] == 1  # one probe, then none
    reopened = row(db, server.url)
    assert (reopened.state, reopened.pushed_on, reopened.opened_count) == ("open", True, 2)
    assert reopened.opened_at == began  # the outage's start
    assert tick(db) == "no open breaker due for a probe"
    assert server.client.stats(detail=False)["outage_refused"] == 1


def test_an_origin_it_cannot_reach_is_one_line_never_a_traceback(db):
    """Nothing listens at one origin, another is no URL a client can be made for: each is
    one clause of one line, and each breaker stays open with its next probe pushed on (the
    unreachable one by a failed probe, the bad one by the probe's lease)."""
    nobody, bad = f"http://127.0.0.1:{_free_port()}", "http://host:99999"
    for origin in (nobody, bad):
        open_row(db, origin)

    said = tick(db)
    assert "\n" not in said and "Traceback" not in said
    assert f"{nobody} open (probe_failed connect_error)" in said
    assert f"{bad} not_probed (ValueError: Port out of range 0-65535)" in said
    for origin in (nobody, bad):
        assert (row(db, origin).state, row(db, origin).pushed_on) == ("open", True)
    assert row(db, bad).opened_count == 1  # no probe was made, so no verdict was written


def test_the_sensor_is_in_the_code_location(defs):
    sensor = defs.resolve_sensor_def("breaker_probe_sensor")
    assert sensor.minimum_interval_seconds == 30
    assert sensor.default_status == dg.DefaultSensorStatus.RUNNING
