"""A real HTTP service standing in for the downstream fulfilment system and notification sink.

It keeps its own state in a SQLite file (never the qo-ops PostgreSQL tables) and injects
faults on demand, so jobs that call other systems can be tested against real HTTP:

* latency: every fulfilment/notification request waits ``latency_ms`` first;
* poison: deterministic per idempotency key / event id (``hash(seed:key) < poison_rate``) or
  when the payload says ``"fault": "poison"``: answered 422 on every attempt, nothing stored;
* error: an injected 503, nothing stored (random per request, seeded RNG);
* timeout: the request IS stored, then the answer is delayed by ``timeout_s`` — a client
  with a shorter read timeout cannot know it went through (the unknown-outcome case);
* reset: the request IS stored, then the connection is dropped without any answer.

Admin endpoints (``/admin/...``, ``/healthz``) never see faults. ``serve()`` runs it with
uvicorn; ``qo-ops downstream`` (``qo_ops.downstream.cli``) is the command line.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import random
import sqlite3
import threading
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

DEFAULT_LIST_LIMIT = 500
MAX_LIST_LIMIT = 5000
ORDER_STATUS_ON_DELIVERY = "IN_FULFILLMENT"
_RAW_SEND = "qo_ops.raw_send"  # scope key: the server's own ``send``, to drop a connection

_RATES = ("error_rate", "timeout_rate", "reset_rate", "poison_rate")


@dataclass(frozen=True)
class Faults:
    """Which faults the simulator injects. Rates are probabilities in [0, 1]."""

    latency_ms: int = 0
    error_rate: float = 0.0
    timeout_rate: float = 0.0
    reset_rate: float = 0.0
    poison_rate: float = 0.0
    seed: int = 0
    timeout_s: float = 2.0  # how long a 'timeout' answer hangs

    def __post_init__(self) -> None:
        problem = self.problem()
        if problem:
            raise ValueError(problem)

    def problem(self) -> str | None:
        """What is wrong with these settings, or ``None``."""
        for name in _RATES:
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                return f"{name} must be between 0 and 1, got {value}"
        if self.latency_ms < 0:
            return f"latency_ms must not be negative, got {self.latency_ms}"
        if not self.timeout_s > 0:
            return f"timeout_s must be positive, got {self.timeout_s}"
        return None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def updated(self, fields: dict[str, Any]) -> Faults:
        """A copy with ``fields`` (JSON values) changed; ``ValueError`` on a bad name or value."""
        known = {f.name: f.type for f in dataclasses.fields(self)}
        changes: dict[str, Any] = {}
        for name, value in fields.items():
            if name not in known:
                raise ValueError(f"unknown fault field {name!r}")
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{name} must be a number")
            if name in ("latency_ms", "seed"):
                if value != int(value):
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
)


class Store:
    """The simulator's persistent state: one SQLite connection (WAL) behind one lock."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        with self._lock:
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._conn.execute("PRAGMA busy_timeout=5000")
            self._conn.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def _bump(self, name: str, by: int = 1) -> None:
        self._conn.execute(
            "INSERT INTO counter (name, value) VALUES (?, ?) "
            "ON CONFLICT (name) DO UPDATE SET value = value + excluded.value",
            (name, by),
        )

    def _tx(self) -> _Transaction:
        return _Transaction(self._lock, self._conn)

    def bump(self, name: str, by: int = 1) -> None:
        with self._tx():
            self._bump(name, by)

    def record_delivery(
        self, key: str, tenant_id: str, order_number: str, payload: dict[str, Any]
    ) -> tuple[dict[str, Any], bool]:
        """Store a delivery once per key: ``(the stored delivery, duplicate)``."""
        now = _now()
        with self._tx() as conn:
            self._bump("delivery_requests")
            row = conn.execute(
                "SELECT delivery_id, order_number FROM delivery WHERE idempotency_key = ?", (key,)
            ).fetchone()
            if row is not None:
                conn.execute(
                    "UPDATE delivery SET times_received = times_received + 1, last_received_at = ? "
                    "WHERE idempotency_key = ?",
                    (now, key),
                )
                self._bump("duplicates_suppressed")
                return {"delivery_id": row[0], "order_number": row[1]}, True
            delivery_id = f"dlv_{uuid.uuid4().hex}"
            conn.execute(
                "INSERT INTO delivery VALUES (?, ?, ?, ?, ?, 1, ?, ?)",
                (key, delivery_id, tenant_id, order_number, json.dumps(payload), now, now),
            )
            conn.execute(
                "INSERT INTO downstream_order (order_number, tenant_id, status, updated_at) "
                "VALUES (?, ?, ?, ?) ON CONFLICT (order_number) DO UPDATE SET "
                "tenant_id = excluded.tenant_id, status = excluded.status, "
                "updated_at = excluded.updated_at",
                (order_number, tenant_id, ORDER_STATUS_ON_DELIVERY, now),
            )
            return {"delivery_id": delivery_id, "order_number": order_number}, False

    def record_notification(
        self, event_id: str, event_type: str, tenant_id: str, payload: dict[str, Any]
    ) -> bool:
        """Store a notification once per event id; ``True`` when it was a duplicate."""
        now = _now()
        with self._tx() as conn:
            self._bump("notification_requests")
            updated = conn.execute(
                "UPDATE notification SET times_received = times_received + 1, "
                "last_received_at = ? WHERE event_id = ?",
                (now, event_id),
            ).rowcount
            if updated:
                self._bump("notification_duplicates")
                return True
            conn.execute(
                "INSERT INTO notification VALUES (?, ?, ?, ?, 1, ?, ?)",
                (event_id, event_type, tenant_id, json.dumps(payload), now, now),
            )
            return False

    def get_order(self, order_number: str) -> dict[str, Any] | None:
        with self._tx() as conn:
            row = conn.execute(
                "SELECT order_number, tenant_id, status, updated_at FROM downstream_order "
                "WHERE order_number = ?",
                (order_number,),
            ).fetchone()
        return _order(row) if row else None

    def list_orders(self, tenant_id: str, after: str | None, limit: int) -> list[dict[str, Any]]:
        with self._tx() as conn:
            rows = conn.execute(
                "SELECT order_number, tenant_id, status, updated_at FROM downstream_order "
                "WHERE tenant_id = ? AND order_number > ? ORDER BY order_number LIMIT ?",
                (tenant_id, after or "", limit),
            ).fetchall()
        return [_order(r) for r in rows]

    def put_order(self, order_number: str, tenant_id: str, status: str) -> dict[str, Any]:
        now = _now()
        with self._tx() as conn:
            conn.execute(
                "INSERT INTO downstream_order (order_number, tenant_id, status, updated_at) "
                "VALUES (?, ?, ?, ?) ON CONFLICT (order_number) DO UPDATE SET "
                "tenant_id = excluded.tenant_id, status = excluded.status, "
                "updated_at = excluded.updated_at",
                (order_number, tenant_id, status, now),
            )
        return {
            "order_number": order_number,
            "tenant_id": tenant_id,
            "status": status,
            "updated_at": now,
        }

    def delete_order(self, order_number: str) -> bool:
        with self._tx() as conn:
            return bool(
                conn.execute(
                    "DELETE FROM downstream_order WHERE order_number = ?", (order_number,)
                ).rowcount
            )

    def reset(self) -> None:
        with self._tx() as conn:
            for table in ("delivery", "downstream_order", "notification", "counter"):
                conn.execute(f"DELETE FROM {table}")

    def stats(self, detail: bool) -> dict[str, Any]:
        with self._tx() as conn:
            counters = dict.fromkeys(_COUNTERS, 0)
            counters.update(conn.execute("SELECT name, value FROM counter").fetchall())
            deliveries = conn.execute("SELECT count(*) FROM delivery").fetchone()[0]
            notifications = conn.execute("SELECT count(*) FROM notification").fetchone()[0]
            orders = conn.execute("SELECT count(*) FROM downstream_order").fetchone()[0]
            by_key = by_event = None
            if detail:
                by_key = dict(conn.execute("SELECT idempotency_key, times_received FROM delivery"))
                by_event = dict(conn.execute("SELECT event_id, times_received FROM notification"))
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
        }
        if detail:
            stats["deliveries_by_key"] = by_key
            stats["notifications_by_event"] = by_event
        return stats


class _Transaction:
    """``with``: take the store lock and run one SQLite transaction (rolled back on error)."""

    def __init__(self, lock: threading.Lock, conn: sqlite3.Connection) -> None:
        self._lock = lock
        self._conn = conn

    def __enter__(self) -> sqlite3.Connection:
        self._lock.acquire()
        try:
            self._conn.execute("BEGIN IMMEDIATE")
        except BaseException:
            self._lock.release()
            raise
        return self._conn

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        try:
            self._conn.execute("ROLLBACK" if exc_type else "COMMIT")
        finally:
            self._lock.release()


def _order(row: tuple[Any, ...]) -> dict[str, Any]:
    return {"order_number": row[0], "tenant_id": row[1], "status": row[2], "updated_at": row[3]}


# ---------------------------------------------------------------------------- faults


class _FaultState:
    """The current faults and the seeded RNG that decides the random ones per request."""

    def __init__(self, faults: Faults) -> None:
        self.faults = faults
        self.rng = random.Random(faults.seed)

    def update(self, fields: dict[str, Any]) -> Faults:
        new = self.faults.updated(fields)
        if "seed" in fields:
            self.rng = random.Random(new.seed)
        self.faults = new
        return new

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


class BadRequest(Exception):
    """The request is malformed: answered 400 ``{"error": "bad_request", "detail": …}``."""


def _bad(detail: str, error: str = "bad_request") -> JSONResponse:
    return JSONResponse({"error": error, "detail": detail}, status_code=400)


async def _json_object(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (ValueError, UnicodeDecodeError):
        raise BadRequest("the body must be a JSON object") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


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


async def _drop_connection(request: Request) -> None:
    """Close the client's connection without sending any answer (an injected reset)."""
    raw_send = request.scope.get(_RAW_SEND)
    cycle = getattr(raw_send, "__self__", None)  # uvicorn's RequestResponseCycle
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


class _SimulatorApp(Starlette):
    """Starlette, plus the server's raw ``send`` in the scope (needed to drop a connection)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[_RAW_SEND] = send
        await super().__call__(scope, receive, send)


# ---------------------------------------------------------------------------- app


def create_app(store_path: Path, faults: Faults) -> Starlette:
    """The simulator as an ASGI app over the SQLite store at ``store_path``."""
    store = Store(store_path)
    state = _FaultState(faults)

    async def latency() -> None:
        ms = state.faults.latency_ms
        if ms > 0:
            await asyncio.sleep(ms / 1000)
            store.bump("latency_injected_ms", ms)

    def poison() -> JSONResponse:
        store.bump("faults_poison")
        return JSONResponse({"error": "poison", "retryable": False}, status_code=422)

    def injected_error() -> JSONResponse:
        store.bump("faults_error")
        return JSONResponse({"error": "injected"}, status_code=503)

    async def after_store(request: Request, timeout: bool, reset: bool) -> bool:
        """Apply a timeout (delay) or reset (drop); ``True`` when nothing must be answered."""
        if timeout:
            store.bump("faults_timeout")
            await asyncio.sleep(state.faults.timeout_s)
        elif reset:
            store.bump("faults_reset")
            await _drop_connection(request)
            return True
        return False

    async def post_delivery(request: Request) -> Response:
        await latency()
        key = request.headers.get("idempotency-key", "").strip()
        if not key:
            return _bad("the Idempotency-Key header is required", "missing_idempotency_key")
        try:
            body = await _json_object(request)
            tenant_id, order_number = _text(body, "tenant_id"), _text(body, "order_number")
            payload = _payload(body)
        except BadRequest as exc:
            return _bad(str(exc))
        if state.is_poison(key, payload):
            return poison()
        error, timeout, reset = state.draw()
        if error:
            return injected_error()
        delivery, duplicate = store.record_delivery(key, tenant_id, order_number, payload)
        if await after_store(request, timeout, reset):
            return Response(status_code=204)  # never sent: the connection is gone
        return JSONResponse(
            {**delivery, "status": "RECEIVED", "duplicate": duplicate},
            status_code=200 if duplicate else 201,
        )

    async def get_order(request: Request) -> Response:
        await latency()
        error, _, _ = state.draw()
        if error:
            return injected_error()
        order = store.get_order(request.path_params["order_number"])
        if order is None:
            return JSONResponse({"error": "not_found"}, status_code=404)
        return JSONResponse(order)

    async def list_orders(request: Request) -> Response:
        await latency()
        tenant_id = request.query_params.get("tenant_id", "")
        if not tenant_id:
            return _bad("the tenant_id query parameter is required")
        raw_limit = request.query_params.get("limit", str(DEFAULT_LIST_LIMIT))
        try:
            limit = int(raw_limit)
        except ValueError:
            return _bad("limit must be an integer")
        if limit < 1:
            return _bad("limit must be at least 1")
        error, _, _ = state.draw()
        if error:
            return injected_error()
        after = request.query_params.get("after") or None
        orders = store.list_orders(tenant_id, after, min(limit, MAX_LIST_LIMIT))
        return JSONResponse({"orders": orders})

    async def post_notification(request: Request) -> Response:
        await latency()
        try:
            body = await _json_object(request)
            event_id, event_type = _text(body, "event_id"), _text(body, "event_type")
            tenant_id, payload = _text(body, "tenant_id"), _payload(body)
        except BadRequest as exc:
            return _bad(str(exc))
        if state.is_poison(event_id, payload):
            return poison()
        error, timeout, reset = state.draw()
        if error:
            return injected_error()
        duplicate = store.record_notification(event_id, event_type, tenant_id, payload)
        if await after_store(request, timeout, reset):
            return Response(status_code=204)
        return JSONResponse({"duplicate": duplicate}, status_code=202)

    async def admin_stats(request: Request) -> Response:
        detail = request.query_params.get("detail", "1").lower() not in ("0", "false", "no")
        return JSONResponse(store.stats(detail))

    async def admin_faults(request: Request) -> Response:
        try:
            body = await _json_object(request)
            return JSONResponse(state.update(body).to_dict())
        except (BadRequest, ValueError) as exc:
            return _bad(str(exc))

    async def admin_put_order(request: Request) -> Response:
        try:
            body = await _json_object(request)
            tenant_id, status = _text(body, "tenant_id"), _text(body, "status")
        except BadRequest as exc:
            return _bad(str(exc))
        return JSONResponse(store.put_order(request.path_params["order_number"], tenant_id, status))

    async def admin_delete_order(request: Request) -> Response:
        return JSONResponse({"deleted": store.delete_order(request.path_params["order_number"])})

    async def admin_reset(request: Request) -> Response:
        store.reset()
        return JSONResponse({"reset": True, "faults": state.faults.to_dict()})

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        store.close()

    app = _SimulatorApp(
        routes=[
            Route("/fulfilment/deliveries", post_delivery, methods=["POST"]),
            Route("/fulfilment/orders", list_orders, methods=["GET"]),
            Route("/fulfilment/orders/{order_number}", get_order, methods=["GET"]),
            Route("/notifications", post_notification, methods=["POST"]),
            Route("/admin/stats", admin_stats, methods=["GET"]),
            Route("/admin/faults", admin_faults, methods=["POST"]),
            Route("/admin/orders/{order_number}", admin_put_order, methods=["PUT"]),
            Route("/admin/orders/{order_number}", admin_delete_order, methods=["DELETE"]),
            Route("/admin/reset", admin_reset, methods=["POST"]),
            Route("/healthz", healthz, methods=["GET"]),
        ],
        lifespan=lifespan,
    )
    app.state.store = store
    app.state.faults = state
    return app


def serve(host: str, port: int, store_path: Path, faults: Faults) -> None:
    """Run the simulator with uvicorn until SIGINT/SIGTERM."""
    import uvicorn

    config = uvicorn.Config(
        create_app(store_path, faults),
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=1,
    )
    uvicorn.Server(config).run()
