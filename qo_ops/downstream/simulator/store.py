"""The simulator's persistent state: a SQLite file (never the qo-ops PostgreSQL tables) of
the deliveries, orders and notifications it received, and its counters."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import uuid
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ORDER_STATUS_ON_DELIVERY = "IN_FULFILLMENT"
# A group commit is cut at this many requests, so that the first of a wave of requests is not
# answered only after the whole wave was handled.
GROUP_COMMIT_MAX = 16


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds")


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
