"""A real HTTP service standing in for the downstream fulfilment system and notification sink.

It keeps its own state in a SQLite file (never the qo-ops PostgreSQL tables) and injects
faults on demand, so jobs that call other systems can be tested against real HTTP:

* outage: every fulfilment/notification request is answered ``503 {"error": "outage"}``
  (``outage="503"``) or its connection is dropped at once (``outage="refuse"``), nothing
  stored;
* rate limit: beyond ``rate_limit`` requests a second (a token bucket over the
  fulfilment/notification endpoints), ``429 {"error": "rate_limited"}`` with a
  ``Retry-After`` in whole seconds, nothing stored;
* latency: every fulfilment/notification request that passes the two above waits
  ``latency_ms`` first;
* poison: deterministic per idempotency key / event id (``hash(seed:key) < poison_rate``) or
  when the payload says ``"fault": "poison"``: answered 422 on every attempt, nothing stored;
* error: an injected 503, nothing stored (random per request, seeded RNG);
* timeout: the request IS stored, then the answer is delayed by ``timeout_s`` — a client
  with a shorter read timeout cannot know it went through (the unknown-outcome case);
* reset: the request IS stored, then the connection is dropped without any answer.

Admin endpoints (``/admin/...``, ``/healthz``) never see faults. ``serve()`` runs it with
uvicorn; ``qo-ops downstream`` (``qo_ops.downstream.cli``) is the command line.

Speed: the four business endpoints are plain ASGI (no framework between uvicorn and them;
Starlette serves the admin API), and the store commits once per turn of the event loop for
all the requests of that turn (each still answered only after its commit).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import math
import random
import sqlite3
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

DEFAULT_LIST_LIMIT = 500
MAX_LIST_LIMIT = 5000
ORDER_STATUS_ON_DELIVERY = "IN_FULFILLMENT"
OUTAGES = ("503", "refuse")
# A rate limit's burst is 1 + rate × this: a client keeping to the rate with a burst of its
# own up to 0.1 s (qo-ops' is rate/10) and 0.1 s of jitter is never refused.
BURST_S = 0.2
RATE_WINDOW_S = 60  # how many recent seconds /admin/stats counts per second
# A group commit is cut at this many requests, so that the first of a wave of requests is not
# answered only after the whole wave was handled.
GROUP_COMMIT_MAX = 16

_RATES = ("error_rate", "timeout_rate", "reset_rate", "poison_rate")


@dataclass(frozen=True)
class Faults:
    """Which faults the simulator injects. Rates are probabilities in [0, 1];
    ``rate_limit`` is requests a second (``None``: no limit); ``outage`` is ``None``,
    ``"503"`` or ``"refuse"``."""

    latency_ms: int = 0
    error_rate: float = 0.0
    timeout_rate: float = 0.0
    reset_rate: float = 0.0
    poison_rate: float = 0.0
    seed: int = 0
    timeout_s: float = 2.0  # how long a 'timeout' answer hangs
    rate_limit: float | None = None
    outage: str | None = None

    def __post_init__(self) -> None:
        problem = self.problem()
        if problem:
            raise ValueError(problem)

    def problem(self) -> str | None:
        """What is wrong with these settings, or ``None`` (one line, starting with the field)."""
        for name in _RATES:
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                return f"{name} must be between 0 and 1, got {value}"
        if self.latency_ms < 0:
            return f"latency_ms must not be negative, got {self.latency_ms}"
        if not self.timeout_s > 0:
            return f"timeout_s must be positive, got {self.timeout_s}"
        if self.rate_limit is not None and not (
            math.isfinite(self.rate_limit) and self.rate_limit > 0
        ):
            return (
                f"rate_limit must be a positive number of requests a second, got {self.rate_limit}"
            )
        if self.outage is not None and self.outage not in OUTAGES:
            return f"outage must be one of {', '.join(OUTAGES)} (or null), got {self.outage!r}"
        return None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def updated(self, fields: dict[str, Any]) -> Faults:
        """A copy with ``fields`` (JSON values) changed; ``ValueError`` on a bad name or value."""
        known = {f.name for f in dataclasses.fields(self)}
        changes: dict[str, Any] = {}
        for name, value in fields.items():
            if name not in known:
                raise ValueError(f"unknown fault field {name!r}")
            if value is None and name in ("rate_limit", "outage"):
                changes[name] = None  # switched off
            elif name == "outage":
                if value == 503 and not isinstance(value, bool):  # the number is meant too
                    value = "503"
                if not isinstance(value, str):
                    raise ValueError(f"outage must be one of {', '.join(OUTAGES)} (or null)")
                changes[name] = value
            elif isinstance(value, bool) or not isinstance(value, int | float):
                nullable = " or null" if name == "rate_limit" else ""
                raise ValueError(f"{name} must be a number{nullable}")
            elif name in ("latency_ms", "seed"):
                if not math.isfinite(value) or value != int(value):
                    raise ValueError(f"{name} must be an integer")
                changes[name] = int(value)
            else:
                changes[name] = float(value)
        return dataclasses.replace(self, **changes)


def poison_score(key: str, seed: int) -> float:
    """A stable number in [0, 1) for ``key``: the key is poison when it is below poison_rate."""
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds")


# ---------------------------------------------------------------------------- store

_SCHEMA = """
CREATE TABLE IF NOT EXISTS delivery (
    idempotency_key   TEXT PRIMARY KEY,
    delivery_id       TEXT NOT NULL UNIQUE,
    tenant_id         TEXT NOT NULL,
    order_number      TEXT NOT NULL,
    payload           TEXT NOT NULL,
    times_received    INTEGER NOT NULL,
    first_received_at TEXT NOT NULL,
    last_received_at  TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS downstream_order (
    order_number TEXT PRIMARY KEY,
    tenant_id    TEXT NOT NULL,
    status       TEXT NOT NULL,
    updated_at   TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS downstream_order_tenant ON downstream_order (tenant_id, order_number);
CREATE TABLE IF NOT EXISTS notification (
    event_id          TEXT PRIMARY KEY,
    event_type        TEXT NOT NULL,
    tenant_id         TEXT NOT NULL,
    payload           TEXT NOT NULL,
    times_received    INTEGER NOT NULL,
    first_received_at TEXT NOT NULL,
    last_received_at  TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS counter (
    name  TEXT PRIMARY KEY,
    value INTEGER NOT NULL
);
"""

_COUNTERS = (
    "delivery_requests",
    "duplicates_suppressed",
    "notification_requests",
    "notification_duplicates",
    "faults_poison",
    "faults_error",
    "faults_timeout",
    "faults_reset",
    "latency_injected_ms",
    "rate_limited",
    "outage_refused",
)

# One statement per delivery: a new key inserts (times_received 1), a repeated one counts
# the arrival and hands back the original delivery_id.
# Twice: the idempotency key is the primary key, so a repeat only counts one more arrival:
# never a second delivery.
_UPSERT_DELIVERY = """
INSERT INTO delivery VALUES (?, ?, ?, ?, ?, 1, ?, ?)
ON CONFLICT (idempotency_key) DO UPDATE SET
    times_received = times_received + 1, last_received_at = excluded.last_received_at
RETURNING delivery_id, order_number, times_received
"""
# The downstream's view of an order (a delivery moves it on; the admin API sets it).
# Twice: an upsert on order_number: the same status written again leaves the same row.
_UPSERT_ORDER = """
INSERT INTO downstream_order (order_number, tenant_id, status, updated_at) VALUES (?, ?, ?, ?)
ON CONFLICT (order_number) DO UPDATE SET
    tenant_id = excluded.tenant_id, status = excluded.status, updated_at = excluded.updated_at
"""
# One statement per notification, like a delivery.
# Twice: the event id is the primary key, so a repeat only counts one more arrival.
_UPSERT_NOTIFICATION = """
INSERT INTO notification VALUES (?, ?, ?, ?, 1, ?, ?)
ON CONFLICT (event_id) DO UPDATE SET
    times_received = times_received + 1, last_received_at = excluded.last_received_at
RETURNING times_received
"""
# A counter's value as the store holds it (written with the group commit).
# Twice: it sets the value, not adds to it, so writing it again leaves it as it is.
_SET_COUNTER = (
    "INSERT INTO counter (name, value) VALUES (?, ?) "
    "ON CONFLICT (name) DO UPDATE SET value = excluded.value"
)


class Store:
    """The simulator's persistent state: one SQLite connection (WAL), used from the event
    loop's thread only.

    Group commit: a write joins the transaction open in this turn of the loop, which is
    committed at the end of the turn (``call_soon``); a handler awaits ``committed()`` before
    it answers, so nothing is acknowledged that is not in the file. Counters live in memory
    and are written with that commit. Admin writes commit at once (``commit()``)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._conn = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._conn.execute("PRAGMA journal_mode=WAL")
        # No fsync: a crash of the process loses nothing (WAL), only the machine's could.
        self._conn.execute("PRAGMA synchronous=OFF")
        self._conn.execute("PRAGMA busy_timeout=5000")
        self._conn.executescript(_SCHEMA)
        self._counters = self._load_counters()
        self._dirty: set[str] = set()
        self._open = False
        self._waiters: list[asyncio.Future[None]] = []

    def _load_counters(self) -> dict[str, int]:
        counters = dict.fromkeys(_COUNTERS, 0)
        counters.update(self._conn.execute("SELECT name, value FROM counter").fetchall())
        return counters

    def _begin(self) -> sqlite3.Connection:
        """The open transaction, begun (and its commit scheduled) if there is none."""
        if not self._open:
            self._conn.execute("BEGIN IMMEDIATE")
            self._open = True
            with contextlib.suppress(RuntimeError):  # no loop (a plain call): caller commits
                asyncio.get_running_loop().call_soon(self.commit)
        return self._conn

    def commit(self) -> None:
        """Commit the open transaction (with the counters) and release its waiters."""
        if not self._open:
            return
        waiters, self._waiters = self._waiters, []
        try:
            if self._dirty:
                self._conn.executemany(
                    _SET_COUNTER, [(name, self._counters[name]) for name in self._dirty]
                )
                self._dirty.clear()
            self._conn.execute("COMMIT")
            self._open = False
        except BaseException as exc:
            self._rollback(waiters, exc)
            raise
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _rollback(self, waiters: Iterable[asyncio.Future[None]], exc: BaseException) -> None:
        """Undo the whole open transaction: none of its requests has been answered yet."""
        if self._conn.in_transaction:
            self._conn.execute("ROLLBACK")
        self._open = False
        self._dirty.clear()
        self._counters = self._load_counters()
        for waiter in waiters:
            if not waiter.done():
                waiter.set_exception(exc)

    async def committed(self) -> None:
        """Wait until what this request wrote is committed (at once if nothing is open)."""
        if self._open and len(self._waiters) + 1 >= GROUP_COMMIT_MAX:
            self.commit()  # a full group: commit now, its first answers wait no longer
        if self._open:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            await waiter

    def close(self) -> None:
        self.commit()
        self._conn.close()

    def bump(self, name: str, by: int = 1) -> None:
        """Add to a counter (committed with the open transaction)."""
        self._begin()
        self._counters[name] += by
        self._dirty.add(name)

    @contextlib.contextmanager
    def _writing(self) -> Iterator[sqlite3.Connection]:
        """The open transaction for some writes; any error undoes the whole transaction."""
        conn = self._begin()
        try:
            yield conn
        except BaseException as exc:
            waiters, self._waiters = self._waiters, []
            self._rollback(waiters, exc)
            raise

    def record_delivery(
        self, key: str, tenant_id: str, order_number: str, payload: dict[str, Any]
    ) -> tuple[dict[str, Any], bool]:
        """Store a delivery once per key: ``(the stored delivery, duplicate)``."""
        now = _now()
        self.bump("delivery_requests")
        payload_text = json.dumps(payload)
        new_id = f"dlv_{uuid.uuid4().hex}"
        with self._writing() as conn:
            ((delivery_id, stored_order, times),) = conn.execute(
                _UPSERT_DELIVERY, (key, new_id, tenant_id, order_number, payload_text, now, now)
            ).fetchall()
            if times > 1:
                self.bump("duplicates_suppressed")
                return {"delivery_id": delivery_id, "order_number": stored_order}, True
            conn.execute(_UPSERT_ORDER, (order_number, tenant_id, ORDER_STATUS_ON_DELIVERY, now))
        return {"delivery_id": delivery_id, "order_number": order_number}, False

    def record_notification(
        self, event_id: str, event_type: str, tenant_id: str, payload: dict[str, Any]
    ) -> bool:
        """Store a notification once per event id; ``True`` when it was a duplicate."""
        now = _now()
        self.bump("notification_requests")
        with self._writing() as conn:
            ((times,),) = conn.execute(
                _UPSERT_NOTIFICATION,
                (event_id, event_type, tenant_id, json.dumps(payload), now, now),
            ).fetchall()
        if times > 1:
            self.bump("notification_duplicates")
            return True
        return False

    def get_order(self, order_number: str) -> dict[str, Any] | None:
        row = self._conn.execute(
            "SELECT order_number, tenant_id, status, updated_at FROM downstream_order "
            "WHERE order_number = ?",
            (order_number,),
        ).fetchone()
        return _order(row) if row else None

    def list_orders(self, tenant_id: str, after: str | None, limit: int) -> list[dict[str, Any]]:
        rows = self._conn.execute(
            "SELECT order_number, tenant_id, status, updated_at FROM downstream_order "
            "WHERE tenant_id = ? AND order_number > ? ORDER BY order_number LIMIT ?",
            (tenant_id, after or "", limit),
        ).fetchall()
        return [_order(r) for r in rows]

    def put_order(self, order_number: str, tenant_id: str, status: str) -> dict[str, Any]:
        now = _now()
        with self._writing() as conn:
            conn.execute(_UPSERT_ORDER, (order_number, tenant_id, status, now))
        self.commit()
        return {
            "order_number": order_number,
            "tenant_id": tenant_id,
            "status": status,
            "updated_at": now,
        }

    def delete_order(self, order_number: str) -> bool:
        with self._writing() as conn:
            deleted = conn.execute(
                "DELETE FROM downstream_order WHERE order_number = ?", (order_number,)
            ).rowcount
        self.commit()
        return bool(deleted)

    def reset(self) -> None:
        with self._writing() as conn:
            for table in ("delivery", "downstream_order", "notification", "counter"):
                conn.execute(f"DELETE FROM {table}")
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._dirty.clear()
        self.commit()

    def stats(self, detail: bool) -> dict[str, Any]:
        conn, counters = self._conn, self._counters
        deliveries = conn.execute("SELECT count(*) FROM delivery").fetchone()[0]
        notifications = conn.execute("SELECT count(*) FROM notification").fetchone()[0]
        orders = conn.execute("SELECT count(*) FROM downstream_order").fetchone()[0]
        stats: dict[str, Any] = {
            "deliveries_distinct": deliveries,
            "delivery_requests": counters["delivery_requests"],
            "duplicates_suppressed": counters["duplicates_suppressed"],
            "notifications_distinct": notifications,
            "notification_requests": counters["notification_requests"],
            "notification_duplicates": counters["notification_duplicates"],
            "orders": orders,
            "faults_injected": {
                kind: counters[f"faults_{kind}"] for kind in ("poison", "error", "timeout", "reset")
            },
            "latency_injected_ms": counters["latency_injected_ms"],
            "rate_limited": counters["rate_limited"],
            "outage_refused": counters["outage_refused"],
        }
        if detail:
            stats["deliveries_by_key"] = dict(
                conn.execute("SELECT idempotency_key, times_received FROM delivery")
            )
            stats["notifications_by_event"] = dict(
                conn.execute("SELECT event_id, times_received FROM notification")
            )
        return stats


def _order(row: tuple[Any, ...]) -> dict[str, Any]:
    return {"order_number": row[0], "tenant_id": row[1], "status": row[2], "updated_at": row[3]}


# ---------------------------------------------------------------------------- faults


class RateBucket:
    """A token bucket: ``rate`` tokens a second, at most ``1 + rate × BURST_S`` held."""

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.burst = 1.0 + rate * BURST_S
        self._clock = clock
        self._tokens = self.burst
        self._at = clock()

    def take(self) -> float:
        """``0.0`` when a token was taken (admitted); else the seconds until one is there."""
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return 0.0
        return (1.0 - self._tokens) / self.rate


class _FaultState:
    """The current faults, the seeded RNG that decides the random ones per request, and the
    rate limit's bucket with its recent per-second counts (in memory)."""

    def __init__(self, faults: Faults) -> None:
        self.faults = faults
        self.rng = random.Random(faults.seed)
        self.bucket = RateBucket(faults.rate_limit) if faults.rate_limit else None
        # [unix second, admitted, rate_limited] for the last RATE_WINDOW_S seconds
        self.per_second: deque[list[int]] = deque(maxlen=RATE_WINDOW_S)

    def update(self, fields: dict[str, Any]) -> Faults:
        new = self.faults.updated(fields)
        if "seed" in fields:
            self.rng = random.Random(new.seed)
        if "rate_limit" in fields:  # a new limit starts with a full bucket
            self.bucket = RateBucket(new.rate_limit) if new.rate_limit else None
        self.faults = new
        return new

    def rate_limited(self) -> float:
        """``0.0`` when this request may pass the rate limit, else seconds to wait."""
        if self.bucket is None:
            return 0.0
        wait = self.bucket.take()
        second = int(time.time())
        if not self.per_second or self.per_second[-1][0] != second:
            self.per_second.append([second, 0, 0])
        self.per_second[-1][1 if wait == 0.0 else 2] += 1
        return wait

    def draw(self) -> tuple[bool, bool, bool]:
        """``(error, timeout, reset)`` for one request: three draws every time, so the
        sequence of decisions depends only on the seed and the order of requests."""
        f = self.faults
        r_error, r_timeout, r_reset = self.rng.random(), self.rng.random(), self.rng.random()
        timeout = r_timeout < f.timeout_rate
        return r_error < f.error_rate, timeout, (not timeout) and r_reset < f.reset_rate

    def is_poison(self, key: str, payload: dict[str, Any]) -> bool:
        if payload.get("fault") == "poison":
            return True
        return self.faults.poison_rate > 0 and poison_score(key, self.faults.seed) < (
            self.faults.poison_rate
        )


# ---------------------------------------------------------------------------- plain ASGI


class BadRequest(Exception):
    """The request is malformed: answered 400 ``{"error": "bad_request", "detail": …}``."""


class _Gone(Exception):
    """The client went away before its request body arrived: nothing to answer."""


async def _answer(
    send: Send, status: int, body: dict[str, Any], headers: tuple[tuple[bytes, bytes], ...] = ()
) -> None:
    """A JSON answer, encoded as Starlette's ``JSONResponse`` does."""
    data = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-length", str(len(data)).encode()),
                (b"content-type", b"application/json"),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": data})


async def _bad(send: Send, detail: str, error: str = "bad_request") -> None:
    await _answer(send, 400, {"error": error, "detail": detail})


async def _body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise _Gone
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _json_object(receive: Receive) -> dict[str, Any]:
    try:
        body = json.loads(await _body(receive))
    except (ValueError, UnicodeDecodeError):
        raise BadRequest("the body must be a JSON object") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


def _header(scope: Scope, name: bytes) -> str:
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return ""


def _text(body: dict[str, Any], name: str) -> str:
    value = body.get(name)
    if not isinstance(value, str) or not value:
        raise BadRequest(f"{name} must be a non-empty string")
    return value


def _payload(body: dict[str, Any]) -> dict[str, Any]:
    value = body.get("payload", {})
    if not isinstance(value, dict):
        raise BadRequest("payload must be a JSON object")
    return value


async def _drop_connection(send: Send) -> None:
    """Close the client's connection without sending any answer (an injected reset)."""
    cycle = getattr(send, "__self__", None)  # uvicorn's RequestResponseCycle
    transport = getattr(cycle, "transport", None)
    abort = getattr(transport, "abort", None)  # asyncio's or uvloop's transport
    if not callable(abort):
        raise RuntimeError("injected reset needs uvicorn (no transport to drop)")
    abort()
    # Let the server notice the lost connection, so it does not answer 500 instead.
    for _ in range(100):
        if getattr(cycle, "disconnected", True):
            return
        await asyncio.sleep(0.001)


class _Business:
    """The fulfilment and notification endpoints, as plain ASGI handlers."""

    def __init__(self, store: Store, state: _FaultState) -> None:
        self.store = store
        self.state = state

    async def turned_away(self, send: Send) -> bool:
        """Answer an outage or the rate limit (nothing stored); ``True`` when it did."""
        outage = self.state.faults.outage
        if outage is not None:
            self.store.bump("outage_refused")
            if outage == "refuse":
                await _drop_connection(send)
            else:
                await _answer(send, 503, {"error": "outage"})
            return True
        wait = self.state.rate_limited()
        if wait > 0:
            self.store.bump("rate_limited")
            # Whole seconds, as RFC 9110 writes delay-seconds and strict clients parse it.
            retry_after = str(max(1, math.ceil(wait))).encode()
            await _answer(send, 429, {"error": "rate_limited"}, ((b"retry-after", retry_after),))
            return True
        return False

    async def latency(self) -> None:
        ms = self.state.faults.latency_ms
        if ms > 0:
            await asyncio.sleep(ms / 1000)
            self.store.bump("latency_injected_ms", ms)

    async def poisoned(self, send: Send, key: str, payload: dict[str, Any]) -> bool:
        """Refuse a poison item with 422 (nothing stored); ``True`` when it did."""
        if self.state.is_poison(key, payload):
            self.store.bump("faults_poison")
            await _answer(send, 422, {"error": "poison", "retryable": False})
            return True
        return False

    async def injected_error(self, send: Send) -> None:
        self.store.bump("faults_error")
        await _answer(send, 503, {"error": "injected"})

    async def after_store(self, send: Send, timeout: bool, reset: bool) -> bool:
        """Commit, then apply a timeout (delay) or reset (drop); ``True``: nothing to answer."""
        await self.store.committed()
        if timeout:
            self.store.bump("faults_timeout")
            await asyncio.sleep(self.state.faults.timeout_s)
        elif reset:
            self.store.bump("faults_reset")
            await _drop_connection(send)
            return True
        return False

    async def post_delivery(self, scope: Scope, receive: Receive, send: Send) -> None:
        if await self.turned_away(send):
            return
        await self.latency()
        key = _header(scope, b"idempotency-key").strip()
        if not key:
            return await _bad(
                send, "the Idempotency-Key header is required", "missing_idempotency_key"
            )
        try:
            body = await _json_object(receive)
            tenant_id, order_number = _text(body, "tenant_id"), _text(body, "order_number")
            payload = _payload(body)
        except BadRequest as exc:
            return await _bad(send, str(exc))
        if await self.poisoned(send, key, payload):
            return
        error, timeout, reset = self.state.draw()
        if error:
            return await self.injected_error(send)
        delivery, duplicate = self.store.record_delivery(key, tenant_id, order_number, payload)
        if await self.after_store(send, timeout, reset):
            return
        await _answer(
            send,
            200 if duplicate else 201,
            {**delivery, "status": "RECEIVED", "duplicate": duplicate},
        )

    async def post_notification(self, scope: Scope, receive: Receive, send: Send) -> None:
        if await self.turned_away(send):
            return
        await self.latency()
        try:
            body = await _json_object(receive)
            event_id, event_type = _text(body, "event_id"), _text(body, "event_type")
            tenant_id, payload = _text(body, "tenant_id"), _payload(body)
        except BadRequest as exc:
            return await _bad(send, str(exc))
        if await self.poisoned(send, event_id, payload):
            return
        error, timeout, reset = self.state.draw()
        if error:
            return await self.injected_error(send)
        duplicate = self.store.record_notification(event_id, event_type, tenant_id, payload)
        if await self.after_store(send, timeout, reset):
            return
        await _answer(send, 202, {"duplicate": duplicate})

    async def get_order(self, order_number: str, send: Send) -> None:
        if await self.turned_away(send):
            return
        await self.latency()
        error, _, _ = self.state.draw()
        if error:
            return await self.injected_error(send)
        order = self.store.get_order(order_number)
        if order is None:
            return await _answer(send, 404, {"error": "not_found"})
        await _answer(send, 200, order)

    async def list_orders(self, scope: Scope, send: Send) -> None:
        if await self.turned_away(send):
            return
        await self.latency()
        params = dict(parse_qsl(scope["query_string"].decode("latin-1"), keep_blank_values=True))
        tenant_id = params.get("tenant_id", "")
        if not tenant_id:
            return await _bad(send, "the tenant_id query parameter is required")
        try:
            limit = int(params.get("limit", str(DEFAULT_LIST_LIMIT)))
        except ValueError:
            return await _bad(send, "limit must be an integer")
        if limit < 1:
            return await _bad(send, "limit must be at least 1")
        error, _, _ = self.state.draw()
        if error:
            return await self.injected_error(send)
        orders = self.store.list_orders(
            tenant_id, params.get("after") or None, min(limit, MAX_LIST_LIMIT)
        )
        await _answer(send, 200, {"orders": orders})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> bool:
        """Serve the request if it is a business one; ``False`` when it is not."""
        path, method = scope["path"], scope["method"]
        try:
            if path == "/fulfilment/deliveries":
                if method != "POST":
                    return await _not_allowed(send, "POST")
                await self.post_delivery(scope, receive, send)
            elif path == "/notifications":
                if method != "POST":
                    return await _not_allowed(send, "POST")
                await self.post_notification(scope, receive, send)
            elif path == "/fulfilment/orders":
                if method not in ("GET", "HEAD"):
                    return await _not_allowed(send, "GET, HEAD")
                await self.list_orders(scope, send)
            elif path.startswith("/fulfilment/orders/") and "/" not in path[19:] and path[19:]:
                if method not in ("GET", "HEAD"):
                    return await _not_allowed(send, "GET, HEAD")
                await self.get_order(path[19:], send)
            else:
                return False
        except _Gone:
            pass
        return True


async def _not_allowed(send: Send, allow: str) -> bool:
    body = b"Method Not Allowed"
    await send(
        {
            "type": "http.response.start",
            "status": 405,
            "headers": [
                (b"content-length", str(len(body)).encode()),
                (b"content-type", b"text/plain; charset=utf-8"),
                (b"allow", allow.encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
    return True


class _SimulatorApp:
    """The ASGI app: business requests go straight to ``_Business``; the rest (admin API,
    /healthz, lifespan, 404s) to Starlette."""

    def __init__(self, business: _Business, admin: Starlette) -> None:
        self.business = business
        self.admin = admin

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and await self.business(scope, receive, send):
            return
        await self.admin(scope, receive, send)


# ---------------------------------------------------------------------------- app


def create_app(store_path: Path, faults: Faults) -> _SimulatorApp:
    """The simulator as an ASGI app over the SQLite store at ``store_path``."""
    store = Store(store_path)
    state = _FaultState(faults)

    def bad(detail: str) -> JSONResponse:
        return JSONResponse({"error": "bad_request", "detail": detail}, status_code=400)

    async def json_object(request: Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            raise BadRequest("the body must be a JSON object") from None
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        return body

    async def admin_stats(request: Request) -> Response:
        detail = request.query_params.get("detail", "1").lower() not in ("0", "false", "no")
        stats = store.stats(detail)
        stats["rate_limit_per_s"] = [
            {"second": second, "admitted": admitted, "rate_limited": limited}
            for second, admitted, limited in state.per_second
        ]
        return JSONResponse(stats)

    async def admin_faults(request: Request) -> Response:
        try:
            body = await json_object(request)
            return JSONResponse(state.update(body).to_dict())
        except (BadRequest, ValueError) as exc:
            return bad(str(exc))

    async def admin_put_order(request: Request) -> Response:
        try:
            body = await json_object(request)
            tenant_id, status = _text(body, "tenant_id"), _text(body, "status")
        except BadRequest as exc:
            return bad(str(exc))
        return JSONResponse(store.put_order(request.path_params["order_number"], tenant_id, status))

    async def admin_delete_order(request: Request) -> Response:
        return JSONResponse({"deleted": store.delete_order(request.path_params["order_number"])})

    async def admin_reset(request: Request) -> Response:
        store.reset()
        state.per_second.clear()
        return JSONResponse({"reset": True, "faults": state.faults.to_dict()})

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        store.close()

    admin = Starlette(
        routes=[
            Route("/admin/stats", admin_stats, methods=["GET"]),
            Route("/admin/faults", admin_faults, methods=["POST"]),
            Route("/admin/orders/{order_number}", admin_put_order, methods=["PUT"]),
            Route("/admin/orders/{order_number}", admin_delete_order, methods=["DELETE"]),
            Route("/admin/reset", admin_reset, methods=["POST"]),
            Route("/healthz", healthz, methods=["GET"]),
        ],
        lifespan=lifespan,
    )
    admin.state.store = store
    admin.state.faults = state
    return _SimulatorApp(_Business(store, state), admin)


def serve(host: str, port: int, store_path: Path, faults: Faults) -> None:
    """Run the simulator with uvicorn until SIGINT/SIGTERM."""
    import uvicorn

    config = uvicorn.Config(
        create_app(store_path, faults),
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        proxy_headers=False,  # one middleware less per request; nothing stands in front
        timeout_graceful_shutdown=1,
    )
    uvicorn.Server(config).run()
