"""The downstream simulator as a real process over real HTTP on loopback: idempotent
deliveries, notification dedupe, orders, every injected fault, the admin API, persistence
of its SQLite store across restarts, and its command line."""

from __future__ import annotations

import random
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import typer

from qo_ops.downstream.cli import downstream_app
from qo_ops.downstream.client import DownstreamClient, DownstreamError
from qo_ops.errors import BadInput
from qo_ops.platform.calls.retry import ErrorClass
from qo_ops_tests.conftest import DownstreamServer, _free_port, base_env

TENANT = "tenant-001"


HTTP = httpx.Client(timeout=10)  # raw requests, to see statuses and bodies as sent


@pytest.fixture(autouse=True, scope="module")
def _close_http() -> Iterator[None]:
    yield
    HTTP.close()


def post_delivery(
    server: DownstreamServer, key: str | None, order: str = "ORD-1", **extra: object
) -> httpx.Response:
    body = {"tenant_id": TENANT, "order_number": order, "payload": {"lines": 2}, **extra}
    headers = {"Idempotency-Key": key} if key is not None else {}
    return HTTP.post(f"{server.url}/fulfilment/deliveries", json=body, headers=headers)


def post_notification(server: DownstreamServer, event_id: str, **payload: object) -> httpx.Response:
    body = {"event_id": event_id, "event_type": "quote.expired", "tenant_id": TENANT}
    return HTTP.post(f"{server.url}/notifications", json={**body, "payload": payload})


# ------------------------------------------------------------------------ deliveries


def test_same_key_twice_is_one_delivery_with_the_original_id(downstream: DownstreamServer) -> None:
    first = post_delivery(downstream, "key-1", "ORD-1")
    again = post_delivery(downstream, "key-1", "ORD-1")
    other_body = post_delivery(downstream, "key-1", "ORD-2", payload={"changed": True})

    assert first.status_code == 201
    body = first.json()
    assert body["delivery_id"].startswith("dlv_")
    assert body == {
        "delivery_id": body["delivery_id"],
        "order_number": "ORD-1",
        "status": "RECEIVED",
        "duplicate": False,
    }
    assert again.status_code == 200
    assert again.json() == {**body, "duplicate": True}
    # A repeated key with another body is answered with the original result, nothing new.
    assert other_body.status_code == 200
    assert other_body.json() == {**body, "duplicate": True}

    stats = downstream.client.stats()
    assert stats["deliveries_distinct"] == 1
    assert stats["delivery_requests"] == 3
    assert stats["duplicates_suppressed"] == 2
    assert stats["deliveries_by_key"] == {"key-1": 3}
    order = downstream.client.get_order("ORD-1")
    assert order is not None
    assert (order.tenant_id, order.status) == (TENANT, "IN_FULFILLMENT")
    assert downstream.client.get_order("ORD-2") is None  # the second body was not stored

    result = downstream.client.submit_delivery("key-1", TENANT, "ORD-1", {})
    assert (result.delivery_id, result.duplicate) == (body["delivery_id"], True)
    fresh = downstream.client.submit_delivery("key-2", TENANT, "ORD-3", {"x": 1})
    assert fresh.duplicate is False
    assert fresh.delivery_id != body["delivery_id"]
    assert downstream.client.stats(detail=False)["deliveries_distinct"] == 2


def test_delivery_without_key_or_with_bad_body_is_400(downstream: DownstreamServer) -> None:
    missing = post_delivery(downstream, None)
    assert missing.status_code == 400
    assert missing.json()["error"] == "missing_idempotency_key"
    no_tenant = httpx.post(
        f"{downstream.url}/fulfilment/deliveries",
        json={"order_number": "ORD-1", "payload": {}},
        headers={"Idempotency-Key": "k"},
    )
    assert no_tenant.status_code == 400
    assert no_tenant.json()["error"] == "bad_request"
    bad_payload = post_delivery(downstream, "k", payload=[1, 2])
    assert bad_payload.status_code == 400
    not_json = httpx.post(
        f"{downstream.url}/fulfilment/deliveries",
        content=b"{nope",
        headers={"Idempotency-Key": "k"},
    )
    assert not_json.status_code == 400
    stats = downstream.client.stats()
    assert (stats["deliveries_distinct"], stats["delivery_requests"]) == (0, 0)


# ------------------------------------------------------------------------ poison


def test_poison_payload_is_rejected_on_every_attempt(downstream: DownstreamServer) -> None:
    for _ in range(4):
        response = post_delivery(downstream, "poison-key", payload={"fault": "poison"})
        assert response.status_code == 422
        assert response.json() == {"error": "poison", "retryable": False}
    for _ in range(3):
        with pytest.raises(DownstreamError) as caught:
            downstream.client.submit_delivery("poison-key", TENANT, "ORD-1", {"fault": "poison"})
        assert caught.value.error_class is ErrorClass.NON_RETRYABLE
        assert caught.value.code == "poison"
        assert not caught.value.retryable
    with pytest.raises(DownstreamError) as caught:
        downstream.client.publish_notification(
            "evt-p", "quote.expired", TENANT, {"fault": "poison"}
        )
    assert (caught.value.code, caught.value.error_class) == ("poison", ErrorClass.NON_RETRYABLE)

    stats = downstream.client.stats()
    assert stats["deliveries_distinct"] == 0
    assert stats["delivery_requests"] == 0
    assert stats["notifications_distinct"] == 0
    assert stats["faults_injected"]["poison"] == 8
    assert downstream.client.get_order("ORD-1") is None
    # Another key for the same order is not poison: poison follows the item, not the order.
    assert downstream.client.submit_delivery("good-key", TENANT, "ORD-1", {}).duplicate is False


def test_poison_rate_picks_the_same_keys_every_time(downstream_factory) -> None:
    server = downstream_factory(poison_rate=0.5, seed=11)
    keys = [f"key-{i}" for i in range(40)]
    events = [f"evt-{i}" for i in range(20)]

    def outcomes() -> tuple[dict[str, int], dict[str, int]]:
        by_key = {k: post_delivery(server, k, f"ORD-{k}").status_code for k in keys}
        by_event = {e: post_notification(server, e).status_code for e in events}
        return by_key, by_event

    first, first_events = outcomes()
    assert set(first.values()) == {201, 422}  # both poison and clean keys at rate 0.5
    assert set(first_events.values()) == {202, 422}
    for _ in range(2):  # retries: a poison key stays poison, a clean key is a duplicate now
        again, again_events = outcomes()
        assert {k for k, s in again.items() if s == 422} == {
            k for k, s in first.items() if s == 422
        }
        assert {k for k, s in again.items() if s == 200} == {
            k for k, s in first.items() if s == 201
        }
        assert {e for e, s in again_events.items() if s == 422} == {
            e for e, s in first_events.items() if s == 422
        }
    stored = server.client.stats()["deliveries_by_key"]
    assert set(stored) == {k for k, s in first.items() if s == 201}
    assert all(count == 3 for count in stored.values())

    server.restart()  # the same seed in a new process: the same poison keys
    after_restart = {k: post_delivery(server, k, f"ORD-{k}").status_code for k in keys}
    assert {k for k, s in after_restart.items() if s == 422} == {
        k for k, s in first.items() if s == 422
    }

    other_seed = downstream_factory(poison_rate=0.5, seed=12)
    other = {k: post_delivery(other_seed, k).status_code for k in keys}
    assert {k for k, s in other.items() if s == 422} != {k for k, s in first.items() if s == 422}


# ------------------------------------------------------------------------ injected faults


def test_injected_5xx_stores_nothing(downstream_factory) -> None:
    server = downstream_factory(error_rate=1.0)
    response = post_delivery(server, "key-1")
    assert response.status_code == 503
    assert response.json() == {"error": "injected"}
    assert httpx.get(f"{server.url}/fulfilment/orders/ORD-1").status_code == 503
    assert (
        httpx.get(f"{server.url}/fulfilment/orders", params={"tenant_id": TENANT}).status_code
        == 503
    )
    assert post_notification(server, "evt-1").status_code == 503
    for _ in range(3):
        with pytest.raises(DownstreamError) as caught:
            server.client.submit_delivery("key-1", TENANT, "ORD-1", {})
        assert (caught.value.error_class, caught.value.code) == (ErrorClass.RETRYABLE, "http_503")
        assert caught.value.retryable

    stats = server.client.stats()  # the admin API never sees faults
    assert stats["deliveries_distinct"] == 0
    assert stats["delivery_requests"] == 0
    assert stats["notifications_distinct"] == 0
    assert stats["orders"] == 0
    assert stats["faults_injected"]["error"] == 7

    server.client.set_faults(error_rate=0.0)
    assert server.client.submit_delivery("key-1", TENANT, "ORD-1", {}).duplicate is False


def test_timeout_stores_the_delivery_before_hanging_unknown_outcome(downstream_factory) -> None:
    server = downstream_factory(timeout_rate=1.0, timeout_s=1.5)
    impatient = DownstreamClient(server.url, read_timeout=0.3)
    try:
        with pytest.raises(DownstreamError) as caught:
            impatient.submit_delivery("key-1", TENANT, "ORD-1", {"lines": 1})
        assert (caught.value.error_class, caught.value.code) == (ErrorClass.RETRYABLE, "timeout")
        assert caught.value.outcome_unknown
        # The client gave up, yet the downstream has it: exactly once.
        stats = server.client.stats()
        assert stats["deliveries_distinct"] == 1
        assert stats["deliveries_by_key"] == {"key-1": 1}
        order = server.client.get_order("ORD-1")
        assert order is not None and order.status == "IN_FULFILLMENT"

        with pytest.raises(DownstreamError) as caught:  # a retry, still timing out
            impatient.publish_notification("evt-1", "quote.expired", TENANT, {})
        assert caught.value.code == "timeout"
        assert server.client.stats()["notifications_by_event"] == {"evt-1": 1}

        # A patient client gets the answer, late: the fault is a delay, not a drop.
        patient = DownstreamClient(server.url, read_timeout=10)
        started = time.monotonic()
        late = patient.submit_delivery("key-1", TENANT, "ORD-1", {"lines": 1})
        assert time.monotonic() - started >= 1.5
        assert late.duplicate is True
        patient.close()

        # The retry with the same key once the fault is gone: duplicate, the original id.
        server.client.set_faults(timeout_rate=0.0)
        retry = impatient.submit_delivery("key-1", TENANT, "ORD-1", {"lines": 1})
        assert retry.duplicate is True
        assert retry.delivery_id == late.delivery_id
        stats = server.client.stats()
        assert stats["deliveries_distinct"] == 1
        assert stats["deliveries_by_key"] == {"key-1": 3}
        assert stats["duplicates_suppressed"] == 2
        assert stats["faults_injected"]["timeout"] == 3
    finally:
        impatient.close()


def test_reset_stores_the_delivery_then_drops_the_connection(downstream_factory) -> None:
    server = downstream_factory(reset_rate=1.0)
    with pytest.raises(httpx.RemoteProtocolError):  # no HTTP status at all
        post_delivery(server, "key-1")
    with pytest.raises(DownstreamError) as caught:
        server.client.submit_delivery("key-2", TENANT, "ORD-2", {})
    assert (caught.value.error_class, caught.value.code) == (
        ErrorClass.RETRYABLE,
        "connection_reset",
    )
    assert caught.value.outcome_unknown
    with pytest.raises(DownstreamError) as caught:
        server.client.publish_notification("evt-1", "quote.expired", TENANT, {})
    assert caught.value.code == "connection_reset"

    stats = server.client.stats()
    assert stats["deliveries_by_key"] == {"key-1": 1, "key-2": 1}
    assert stats["notifications_by_event"] == {"evt-1": 1}
    assert stats["faults_injected"]["reset"] == 3

    server.client.set_faults(reset_rate=0.0)
    assert server.client.submit_delivery("key-2", TENANT, "ORD-2", {}).duplicate is True
    assert server.client.publish_notification("evt-1", "quote.expired", TENANT, {}) is True


def test_latency_is_added_to_every_business_request(downstream_factory) -> None:
    server = downstream_factory(latency_ms=250)
    for i in range(3):
        started = time.monotonic()
        server.client.submit_delivery(f"key-{i}", TENANT, f"ORD-{i}", {})
        assert time.monotonic() - started >= 0.25
    started = time.monotonic()
    assert server.client.get_order("ORD-0") is not None
    assert time.monotonic() - started >= 0.25
    stats = server.client.stats()
    assert stats["latency_injected_ms"] == 4 * 250
    assert stats["deliveries_distinct"] == 3


# ------------------------------------------------------------------------ notifications


def test_notifications_dedupe_by_event_id_with_counts(downstream: DownstreamServer) -> None:
    first = post_notification(downstream, "evt-1", quote="Q-1")
    assert (first.status_code, first.json()) == (202, {"duplicate": False})
    assert downstream.client.publish_notification("evt-1", "quote.expired", TENANT, {}) is True
    assert downstream.client.publish_notification("evt-2", "quote.expired", TENANT, {}) is False
    assert downstream.client.publish_notification("evt-1", "quote.expired", TENANT, {}) is True
    bad = httpx.post(f"{downstream.url}/notifications", json={"event_id": "evt-3"})
    assert bad.status_code == 400

    stats = downstream.client.stats()
    assert stats["notifications_distinct"] == 2
    assert stats["notification_requests"] == 4
    assert stats["notification_duplicates"] == 2
    assert stats["notifications_by_event"] == {"evt-1": 3, "evt-2": 1}
    assert stats["deliveries_distinct"] == 0

    brief = downstream.client.stats(detail=False)
    assert "notifications_by_event" not in brief and "deliveries_by_key" not in brief
    assert brief["notifications_distinct"] == 2


# ------------------------------------------------------------------------ orders


def test_get_order_404_then_200(downstream: DownstreamServer) -> None:
    missing = httpx.get(f"{downstream.url}/fulfilment/orders/ORD-9")
    assert (missing.status_code, missing.json()) == (404, {"error": "not_found"})
    assert downstream.client.get_order("ORD-9") is None

    planted = downstream.client.put_order("ORD-9", TENANT, "SHIPPED")
    found = httpx.get(f"{downstream.url}/fulfilment/orders/ORD-9")
    assert found.status_code == 200
    assert found.json() == {
        "order_number": "ORD-9",
        "tenant_id": TENANT,
        "status": "SHIPPED",
        "updated_at": planted.updated_at,
    }
    downstream.client.put_order("ORD-9", TENANT, "DELIVERED")
    order = downstream.client.get_order("ORD-9")
    assert order is not None and order.status == "DELIVERED"

    assert downstream.client.delete_order("ORD-9") is True
    assert downstream.client.get_order("ORD-9") is None
    assert downstream.client.delete_order("ORD-9") is False


def test_list_orders_pages_by_order_number(downstream: DownstreamServer) -> None:
    numbers = [f"ORD-{i:03d}" for i in range(7)]
    for n in random.Random(1).sample(numbers, len(numbers)):
        downstream.client.put_order(n, TENANT, "IN_FULFILLMENT")
    for n in ("ORD-000b", "ORD-100"):
        downstream.client.put_order(n, "tenant-002", "SHIPPED")

    pages, after = [], None
    while True:
        page = downstream.client.list_orders(TENANT, after=after, limit=3)
        pages.append([o.order_number for o in page])
        if len(page) < 3:
            break
        after = page[-1].order_number
    assert pages == [numbers[0:3], numbers[3:6], numbers[6:7]]
    assert [o.order_number for o in downstream.client.iter_orders(TENANT, page_size=2)] == numbers
    assert [o.order_number for o in downstream.client.list_orders("tenant-002")] == [
        "ORD-000b",
        "ORD-100",
    ]
    assert downstream.client.list_orders(TENANT, after=numbers[-1]) == []
    raw = httpx.get(
        f"{downstream.url}/fulfilment/orders", params={"tenant_id": TENANT, "limit": 100000}
    )
    assert raw.status_code == 200 and len(raw.json()["orders"]) == 7  # capped, not refused
    for params in ({"tenant_id": TENANT, "limit": 0}, {"tenant_id": TENANT, "limit": "x"}, {}):
        assert httpx.get(f"{downstream.url}/fulfilment/orders", params=params).status_code == 400


def test_list_orders_default_limit_is_500(downstream: DownstreamServer) -> None:
    for i in range(501):
        downstream.client.put_order(f"ORD-{i:04d}", TENANT, "IN_FULFILLMENT")
    raw = httpx.get(f"{downstream.url}/fulfilment/orders", params={"tenant_id": TENANT})
    orders = raw.json()["orders"]
    assert len(orders) == 500
    assert orders[-1]["order_number"] == "ORD-0499"
    assert len(downstream.client.list_orders(TENANT, after="ORD-0499")) == 1


# ------------------------------------------------------------------------ admin


def test_faults_change_at_run_time(downstream: DownstreamServer) -> None:
    client = downstream.client
    assert client.submit_delivery("key-1", TENANT, "ORD-1", {}).duplicate is False
    current = client.set_faults(error_rate=1.0, latency_ms=5)
    assert current == {
        "latency_ms": 5,
        "error_rate": 1.0,
        "timeout_rate": 0.0,
        "reset_rate": 0.0,
        "poison_rate": 0.0,
        "seed": 0,
        "timeout_s": 2.0,
        "rate_limit": None,
        "outage": None,
    }
    with pytest.raises(DownstreamError) as caught:
        client.submit_delivery("key-2", TENANT, "ORD-2", {})
    assert caught.value.code == "http_503"

    for bad in ({"error_rate": 2}, {"nope": 1}, {"seed": "x"}, {"timeout_s": 0}, {"seed": 1.5}):
        response = httpx.post(f"{downstream.url}/admin/faults", json=bad)
        assert response.status_code == 400, bad
    with pytest.raises(DownstreamError) as caught:
        client.set_faults(error_rate=-1)
    assert (caught.value.code, caught.value.error_class) == ("http_400", ErrorClass.NON_RETRYABLE)

    assert client.set_faults(error_rate=0)["latency_ms"] == 5  # bad updates changed nothing
    assert client.submit_delivery("key-2", TENANT, "ORD-2", {}).duplicate is False


def test_admin_reset_clears_everything(downstream: DownstreamServer) -> None:
    client = downstream.client
    first = client.submit_delivery("key-1", TENANT, "ORD-1", {})
    client.publish_notification("evt-1", "quote.expired", TENANT, {})
    client.put_order("ORD-2", TENANT, "SHIPPED")
    client.set_faults(latency_ms=1)

    client.reset()
    stats = client.stats()
    assert stats["deliveries_distinct"] == stats["delivery_requests"] == 0
    assert stats["notifications_distinct"] == stats["notification_requests"] == 0
    assert stats["orders"] == 0
    assert stats["deliveries_by_key"] == {} and stats["notifications_by_event"] == {}
    assert client.get_order("ORD-1") is None and client.get_order("ORD-2") is None
    again = client.submit_delivery("key-1", TENANT, "ORD-1", {})
    assert again.duplicate is False and again.delivery_id != first.delivery_id
    assert client.set_faults()["latency_ms"] == 1  # faults are settings, not data: kept


def test_store_persists_across_a_restart(downstream: DownstreamServer) -> None:
    client = downstream.client
    first = client.submit_delivery("key-1", TENANT, "ORD-1", {"lines": 1})
    client.submit_delivery("key-1", TENANT, "ORD-1", {"lines": 1})
    client.publish_notification("evt-1", "quote.expired", TENANT, {})
    client.put_order("ORD-2", TENANT, "SHIPPED")
    before = client.stats()
    old_pid = downstream.process.pid

    downstream.restart()
    assert downstream.process.pid != old_pid
    assert client.stats() == before
    again = client.submit_delivery("key-1", TENANT, "ORD-1", {"lines": 1})
    assert (again.delivery_id, again.duplicate) == (first.delivery_id, True)
    assert client.publish_notification("evt-1", "quote.expired", TENANT, {}) is True
    order = client.get_order("ORD-2")
    assert order is not None and order.status == "SHIPPED"
    with sqlite3.connect(downstream.store) as db:  # the state lives in the store file
        assert db.execute("SELECT count(*) FROM delivery").fetchone() == (1,)


def test_healthz(downstream: DownstreamServer) -> None:
    response = httpx.get(f"{downstream.url}/healthz")
    assert (response.status_code, response.json()) == (200, {"status": "ok"})
    assert downstream.client.healthy()


# ------------------------------------------------------------------------ command line


@pytest.mark.parametrize(
    "args",
    [
        ["--port", "80"],
        ["--port", "70000"],
        ["--error-rate", "1.5"],
        ["--poison-rate", "-0.1"],
        ["--reset-rate", "2"],
        ["--timeout-rate", "x"],
        ["--latency-ms", "-1"],
        ["--rate-limit", "0"],
        ["--rate-limit", "-5"],
        ["--rate-limit", "nan"],
        ["--rate-limit", "inf"],
        ["--rate-limit", "x"],
        ["--outage", "502"],
        ["--outage"],
        ["--bogus"],
    ],
)
def test_bad_cli_arguments_exit_2_with_one_line(args: list[str], tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "qo_ops.downstream.cli", *args, "--store", str(tmp_path / "s.db")],
        capture_output=True,
        text=True,
        timeout=60,
        env=base_env(),
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("qo-ops downstream: error: ")
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "s.db").exists()


def test_cli_store_defaults_to_qo_ops_home(tmp_path: Path) -> None:
    home = tmp_path / "home"
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "qo_ops.downstream.cli", "--port", str(port), "--seed", "3"],
        env=base_env(QO_OPS_HOME=str(home)),
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        client = DownstreamClient(url)
        deadline = time.monotonic() + 30
        while not client.healthy():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        client.submit_delivery("key-1", TENANT, "ORD-1", {})
        assert client.set_faults()["seed"] == 3
        client.close()
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=30)
    # uvicorn shuts down gracefully on SIGTERM, then re-raises it: killed by SIGTERM, no trace.
    assert proc.returncode in (0, -signal.SIGTERM)
    assert f"http://127.0.0.1:{port}" in stderr.decode()
    assert "Traceback" not in stderr.decode()
    with sqlite3.connect(home / "downstream.sqlite3") as db:
        assert db.execute("SELECT idempotency_key FROM delivery").fetchall() == [("key-1",)]


def test_downstream_app_registers_as_a_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    parent = typer.Typer()
    parent.add_typer(downstream_app, name="downstream")

    @parent.command()
    def other() -> None:
        """A second command, as in qo-ops."""

    command = typer.main.get_command(parent)
    command.main(["downstream", "--help"], prog_name="qo-ops", standalone_mode=False)
    shown = capsys.readouterr().out
    assert "Usage: qo-ops downstream [OPTIONS]" in shown
    for option in ("--port", "--store", "--error-rate", "--poison-rate", "--seed", "--rate-limit"):
        assert option in shown
    with pytest.raises(BadInput, match="--error-rate must be between 0 and 1"):
        command.main(["downstream", "--error-rate", "3"], prog_name="qo-ops", standalone_mode=False)
    with pytest.raises(BadInput, match="^--rate-limit must be a positive number"):
        command.main(
            ["downstream", "--rate-limit", "-1"], prog_name="qo-ops", standalone_mode=False
        )
