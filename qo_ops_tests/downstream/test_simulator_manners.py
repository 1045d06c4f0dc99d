"""The simulator's rate limit and outage switch, over real HTTP against the real process:
a greedy client held to the rate (±10 %), Retry-After on every 429, a client that honours
it refused once, outages (503 and dropped connections) switched on and off at run time with
nothing stored meanwhile, bad settings refused without changing anything; and the store's
group commit: exact counters under concurrency, nothing acknowledged lost to a SIGKILL."""

from __future__ import annotations

import json
import sqlite3
import statistics
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from qo_ops.downstream.client import DownstreamError, retry_after_seconds
from qo_ops.downstream.simulator import BURST_S
from qo_ops.platform.calls.retry import ErrorClass
from qo_ops_tests.conftest import DownstreamServer

TENANT = "tenant-001"


def delivery(http: httpx.Client, url: str, key: str) -> httpx.Response:
    return http.post(
        f"{url}/fulfilment/deliveries",
        json={"tenant_id": TENANT, "order_number": f"ORD-{key}", "payload": {}},
        headers={"Idempotency-Key": key},
    )


def fresh_key() -> str:
    return f"key-{uuid.uuid4().hex}"


class Pacer:
    """Hands out send times ``1 / rate`` apart to any number of threads; never early, and
    after a stall it does not catch up (no burst): a client keeping to ``rate``."""

    def __init__(self, rate: float) -> None:
        self.gap = 1.0 / rate
        self.next_at = time.monotonic()
        self.lock = threading.Lock()

    def wait(self) -> None:
        with self.lock:
            now = time.monotonic()
            at = max(self.next_at, now)
            self.next_at = at + self.gap
        time.sleep(max(0.0, at - now))

    def pause(self, seconds: float) -> None:
        with self.lock:
            self.next_at = max(self.next_at, time.monotonic() + seconds)


# ------------------------------------------------------------------------ rate limit


def test_a_greedy_client_is_held_to_the_rate_within_10_percent(downstream_factory) -> None:
    rate, attempts_per_s, seconds = 50.0, 200.0, 4.0
    server: DownstreamServer = downstream_factory(rate_limit=rate)
    answers: list[tuple[float, int, str | None, bytes]] = []
    pacer = Pacer(attempts_per_s)  # 4 × the limit, ignoring every 429
    started = time.monotonic()

    def greedy() -> None:
        with httpx.Client(timeout=10) as http:
            while time.monotonic() - started < seconds:
                pacer.wait()
                response = delivery(http, server.url, fresh_key())
                answers.append(
                    (
                        time.monotonic(),
                        response.status_code,
                        response.headers.get("retry-after"),
                        response.content,
                    )
                )

    with ThreadPoolExecutor(4) as pool:
        for future in [pool.submit(greedy) for _ in range(4)]:
            future.result()
    elapsed = max(at for at, *_ in answers) - started

    admitted = [a for a in answers if a[1] == 201]
    limited = [a for a in answers if a[1] == 429]
    assert len(admitted) + len(limited) == len(answers)  # nothing but 201 and 429
    # Within 10 % of the rate over the whole run (the burst of 1 + rate/5 included).
    assert abs(len(admitted) / elapsed - rate) <= 0.1 * rate, (len(admitted), elapsed)
    assert len(admitted) <= rate * elapsed + 1 + rate * BURST_S
    # At least 90 % of what went beyond the rate was refused.
    excess = len(answers) - rate * elapsed
    assert excess > 2 * rate  # the client really was greedy
    assert len(limited) >= 0.9 * excess
    # Second by second (client side), after the first second that holds the burst: the
    # typical second is within 10 % of the rate too.
    windows = [0] * int(elapsed)
    for at, *_ in admitted:
        second = int(at - started)
        if second < len(windows):
            windows[second] += 1
    assert abs(statistics.median(windows[1:]) - rate) <= 0.1 * rate, windows

    for _, _, retry_after, body in limited:  # every 429 says when to come back
        assert retry_after is not None and retry_after.isdigit() and int(retry_after) >= 1
        assert retry_after_seconds(retry_after) == int(retry_after)
        assert json.loads(body) == {"error": "rate_limited"}

    stats = server.client.stats(detail=False)  # refused requests stored nothing
    assert stats["deliveries_distinct"] == stats["delivery_requests"] == len(admitted)
    assert stats["rate_limited"] == len(limited)
    per_s = stats["rate_limit_per_s"]
    assert sum(s["admitted"] for s in per_s) == len(admitted)
    assert sum(s["rate_limited"] for s in per_s) == len(limited)


def test_a_client_honouring_retry_after_is_refused_once(downstream_factory) -> None:
    rate = 20.0
    server: DownstreamServer = downstream_factory(rate_limit=rate)
    statuses: list[int] = []
    with httpx.Client(timeout=10) as http:
        # As fast as it can, until the downstream says no.
        while not statuses or statuses[-1] != 429:
            response = delivery(http, server.url, fresh_key())
            statuses.append(response.status_code)
        assert len(statuses) >= 1 + rate * BURST_S  # the burst passed first
        retry_after = retry_after_seconds(response.headers.get("retry-after"))
        assert retry_after is not None and retry_after >= 1

        # Then it waits as told and keeps to the rate, four workers sharing one pace.
        pacer = Pacer(rate)
        pacer.pause(retry_after)
        after: list[int] = []

        def polite(n: int) -> None:
            with httpx.Client(timeout=10) as own:
                for _ in range(n):
                    pacer.wait()
                    after.append(delivery(own, server.url, fresh_key()).status_code)

        with ThreadPoolExecutor(4) as pool:
            for future in [pool.submit(polite, 15) for _ in range(4)]:
                future.result()
    assert after == [201] * 60
    assert statuses.count(429) == 1
    stats = server.client.stats(detail=False)
    assert stats["rate_limited"] == 1
    assert stats["deliveries_distinct"] == len(statuses) - 1 + 60


def test_rate_limit_switched_at_run_time_and_kept_off_admin(downstream: DownstreamServer) -> None:
    client, url = downstream.client, downstream.url
    with httpx.Client(timeout=10) as http:
        assert [delivery(http, url, fresh_key()).status_code for _ in range(30)] == [201] * 30
        # 0.5/s: a burst of 1.1, then one token in 2 s, longer than these requests take
        assert client.set_faults(rate_limit=0.5)["rate_limit"] == 0.5
        statuses = [delivery(http, url, fresh_key()).status_code for _ in range(10)]
        assert statuses == [201] + [429] * 9
        other = [
            http.get(f"{url}/fulfilment/orders/ORD-1").status_code,
            http.get(f"{url}/fulfilment/orders", params={"tenant_id": TENANT}).status_code,
            http.post(
                f"{url}/notifications",
                json={"event_id": "evt-1", "event_type": "quote.expired", "tenant_id": TENANT},
            ).status_code,
        ]
        assert other == [429, 429, 429]  # one bucket for every business endpoint
        for _ in range(20):  # never for the admin API
            assert http.get(f"{url}/healthz").status_code == 200
            assert http.get(f"{url}/admin/stats", params={"detail": 0}).status_code == 200
        with pytest.raises(DownstreamError) as caught:
            client.submit_delivery(fresh_key(), TENANT, "ORD-9", {})
        assert (caught.value.code, caught.value.error_class) == ("http_429", ErrorClass.RETRYABLE)
        assert caught.value.retry_after_s is not None and caught.value.retry_after_s >= 1

        assert client.set_faults(rate_limit=None)["rate_limit"] is None
        assert [delivery(http, url, fresh_key()).status_code for _ in range(30)] == [201] * 30
    stats = client.stats(detail=False)
    assert stats["rate_limited"] == 9 + 3 + 1
    assert stats["notifications_distinct"] == 0


# ------------------------------------------------------------------------ outage


def test_outage_503_switched_on_and_off_stores_nothing(downstream: DownstreamServer) -> None:
    client, url = downstream.client, downstream.url
    first = client.submit_delivery("key-1", TENANT, "ORD-1", {})
    before = client.stats()
    assert client.set_faults(outage="503")["outage"] == "503"
    with httpx.Client(timeout=10) as http:
        answers = [
            delivery(http, url, "key-2"),
            delivery(http, url, "key-1"),  # a retry of a stored one is refused too
            http.post(
                f"{url}/notifications",
                json={"event_id": "evt-1", "event_type": "quote.expired", "tenant_id": TENANT},
            ),
            http.get(f"{url}/fulfilment/orders/ORD-1"),
            http.get(f"{url}/fulfilment/orders", params={"tenant_id": TENANT}),
        ]
        assert [(a.status_code, a.json()) for a in answers] == [(503, {"error": "outage"})] * 5
        assert http.get(f"{url}/healthz").status_code == 200  # admin keeps answering
    with pytest.raises(DownstreamError) as caught:
        client.submit_delivery("key-3", TENANT, "ORD-3", {})
    assert (caught.value.code, caught.value.error_class) == ("http_503", ErrorClass.RETRYABLE)

    during = client.stats()
    assert during["outage_refused"] == 6
    assert {k: v for k, v in during.items() if k != "outage_refused"} == {
        k: v for k, v in before.items() if k != "outage_refused"
    }  # nothing stored, nothing else counted

    assert client.set_faults(outage=None)["outage"] is None
    again = client.submit_delivery("key-1", TENANT, "ORD-1", {})
    assert (again.delivery_id, again.duplicate) == (first.delivery_id, True)
    assert client.submit_delivery("key-2", TENANT, "ORD-2", {}).duplicate is False
    assert client.stats()["deliveries_by_key"] == {"key-1": 2, "key-2": 1}


def test_outage_refuse_drops_connections_until_switched_off(downstream_factory) -> None:
    server: DownstreamServer = downstream_factory(outage="refuse")  # --outage refuse
    assert server.client.set_faults()["outage"] == "refuse"
    with httpx.Client(timeout=10) as http:
        for _ in range(3):
            with pytest.raises(httpx.TransportError):  # no HTTP answer at all
                delivery(http, server.url, "key-1")
        with pytest.raises(httpx.TransportError):
            http.get(f"{server.url}/fulfilment/orders/ORD-1")
    with pytest.raises(DownstreamError) as caught:
        server.client.publish_notification("evt-1", "quote.expired", TENANT, {})
    assert caught.value.error_class is ErrorClass.RETRYABLE
    assert caught.value.code in ("connection_reset", "connect_error", "transport_error")

    stats = server.client.stats()  # the admin API answers during the outage
    assert stats["outage_refused"] == 5
    assert stats["deliveries_distinct"] == stats["delivery_requests"] == 0
    assert stats["notifications_distinct"] == stats["notification_requests"] == 0

    server.client.set_faults(outage=503)  # the number is understood as "503" too
    with httpx.Client(timeout=10) as http:
        assert delivery(http, server.url, "key-1").status_code == 503
    server.client.set_faults(outage=None)
    assert server.client.submit_delivery("key-1", TENANT, "ORD-1", {}).duplicate is False
    assert server.client.stats()["deliveries_by_key"] == {"key-1": 1}


def test_cli_starts_in_a_503_outage_with_a_rate_limit(downstream_factory) -> None:
    server: DownstreamServer = downstream_factory(outage="503", rate_limit=1000)
    faults = server.client.set_faults()
    assert (faults["outage"], faults["rate_limit"]) == ("503", 1000.0)
    with httpx.Client(timeout=10) as http:
        assert delivery(http, server.url, "key-1").status_code == 503
    assert server.client.stats()["rate_limited"] == 0  # an outage takes no token


# ------------------------------------------------------------------------ bad settings


@pytest.mark.parametrize(
    "body",
    [
        b'{"rate_limit": -1}',
        b'{"rate_limit": 0}',
        b'{"rate_limit": NaN}',
        b'{"rate_limit": Infinity}',
        b'{"rate_limit": "10"}',
        b'{"rate_limit": true}',
        b'{"outage": "502"}',
        b'{"outage": 502}',
        b'{"outage": true}',
        b'{"outage": ""}',
        b'{"rate_limit": 5, "outage": "bogus"}',  # one bad field: none of them is applied
        b'{"latency_ms": NaN}',
    ],
)
def test_bad_manners_settings_are_400_and_change_nothing(
    downstream: DownstreamServer, body: bytes
) -> None:
    before = downstream.client.set_faults(rate_limit=1000, latency_ms=1)
    response = httpx.post(
        f"{downstream.url}/admin/faults",
        content=body,
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 400
    answer = response.json()
    assert answer["error"] == "bad_request"
    detail = answer["detail"]
    assert "\n" not in detail and len(detail) < 200
    assert detail.startswith(("rate_limit ", "outage ", "latency_ms ")), detail
    assert downstream.client.set_faults() == before


# ------------------------------------------------------------------------ group commit


def test_concurrent_requests_keep_idempotency_and_counters_exact(
    downstream: DownstreamServer,
) -> None:
    keys = [f"key-{i}" for i in range(40)]
    sends = [key for key in keys for _ in range(5)]  # every key five times, interleaved
    local = threading.local()

    def send(key: str) -> tuple[str, int, str]:
        if not hasattr(local, "http"):
            local.http = httpx.Client(timeout=10)
        response = delivery(local.http, downstream.url, key)
        return key, response.status_code, response.json()["delivery_id"]

    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(send, sends))
    ids: dict[str, set[str]] = {}
    for key, status, delivery_id in answers:
        assert status in (200, 201)
        ids.setdefault(key, set()).add(delivery_id)
    assert all(len(one) == 1 for one in ids.values())  # one delivery id per key
    assert sum(status == 201 for _, status, _ in answers) == len(keys)
    stats = downstream.client.stats()
    assert stats["deliveries_distinct"] == len(keys)
    assert stats["delivery_requests"] == len(sends)
    assert stats["duplicates_suppressed"] == len(sends) - len(keys)
    assert stats["deliveries_by_key"] == dict.fromkeys(keys, 5)


def test_nothing_acknowledged_is_lost_when_the_process_is_killed(
    downstream: DownstreamServer,
) -> None:
    keys = [f"key-{i}" for i in range(200)]
    local = threading.local()

    def send(key: str) -> int:
        if not hasattr(local, "http"):
            local.http = httpx.Client(timeout=10)
        return delivery(local.http, downstream.url, key).status_code

    with ThreadPoolExecutor(16) as pool:
        assert list(pool.map(send, keys)) == [201] * len(keys)
    assert downstream.process is not None
    downstream.process.kill()  # SIGKILL: no shutdown, no last commit
    downstream.process.wait()
    with sqlite3.connect(downstream.store) as db:
        stored = {key for (key,) in db.execute("SELECT idempotency_key FROM delivery")}
        counters = dict(db.execute("SELECT name, value FROM counter"))
    assert stored == set(keys)
    assert counters["delivery_requests"] == len(keys)
    downstream.start()
    assert downstream.client.stats(detail=False)["deliveries_distinct"] == len(keys)
