"""Deterministic demo data with the anomalies the jobs exist for.

Every row is computed set-based in PostgreSQL from ``generate_series`` and a seeded hash,
so 1,000,000 quotes load in seconds and the same (seed, as-of, sizes) give the same rows.
Which rows are anomalies depends only on each row's index within its tenant, never on the
hash, so :class:`DemoPlan` can say exactly how many of each anomaly a load creates. All of
a load is one transaction: it lands whole or not at all.

Every temp file row gets a real stored object (small, of its ``size_bytes``) in the object
store temp_file_cleanup uses, so that a demo cleanup removes what production's would. The
objects are written while PostgreSQL finishes the load, before it commits; a load that fails
removes the objects it created, and ``--reset`` removes the objects of the rows it replaces.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from qo_ops.db.schema import BUSINESS_TABLES, PLATFORM_TABLES
from qo_ops.errors import BadInput, ConfigError
from qo_ops.platform.objects import ObjectStore, ObjectStoreError

# Retention and timeout rules the demo anomalies are placed around (the jobs' defaults).
TEMP_FILE_RETENTION_DAYS = 7
AUDIT_RETENTION_DAYS = 365
CHECKOUT_IDLE_TIMEOUT_HOURS = 24
CURRENT_PRICE_BOOK_VERSION = 2

MAX_TENANTS = 999
MAX_QUOTES_PER_TENANT = 5_000_000
OBJECT_BYTES = (64, 4096)  # a demo temp file's stored object: small, real bytes

# ---------------------------------------------------------------- the rules, per index
# Each table's rows are numbered 1..n within a tenant; these functions are the whole story
# of which of them are anomalies. The SQL below applies the same rules.


def quote_status(i: int) -> str:
    """Status of the i-th quote of a tenant (i % 20 == 0 is ACTIVE but already expired)."""
    r = i % 20
    if r in (1, 2):
        return "EXPIRED"
    if 3 <= r <= 6:
        return "ACCEPTED"
    return {7: "CANCELLED", 8: "DRAFT"}.get(r, "ACTIVE")


def order_ordinal(i: int) -> int | None:
    """0-based ordinal of the order placed from quote i, or None if quote i has no order."""
    r = i % 20
    return 4 * (i // 20) + (r - 3) if 3 <= r <= 6 else None


ORDER_STATUS_BY_DIGIT = (
    "IN_FULFILLMENT",
    "IN_FULFILLMENT",
    "IN_FULFILLMENT",
    "IN_FULFILLMENT",
    "SUBMITTED",
    "SUBMITTED",
    "COMPLETED",
    "COMPLETED",
    "COMPLETED",
    "CANCELLED",
)


def order_status(o: int) -> str:
    """Status of order ordinal o in qo-ops."""
    return ORDER_STATUS_BY_DIGIT[o % 10]


def downstream_status(o: int) -> str | None:
    """What the fulfilment system holds for order o (None: it never received it)."""
    status = order_status(o)
    in_flight = status in ("SUBMITTED", "IN_FULFILLMENT")
    if in_flight and o % 7 == 0:
        return "COMPLETED"  # finished downstream, qo-ops never heard
    if status == "IN_FULFILLMENT" and o % 11 == 1:
        return None  # lost on the way
    return status


def read_model_drift(o: int) -> str | None:
    """How order o's read-model row differs from its source: 'missing', 'total' or None."""
    if o % 17 == 3:
        return "missing"
    if o % 13 == 5:
        return "total"
    return None


def delivery_state(o: int) -> str:
    """State of order o's fulfilment delivery item: due, poison, waiting, dead or delivered."""
    if o % 50 == 0:
        return "poison"  # READY, due, and the downstream will always refuse it
    if o % 5 == 0:
        return "due"
    if o % 5 == 1:
        return "waiting"
    if o % 100 == 7:
        return "dead"
    return "delivered"


def order_event_state(o: int) -> str:
    """State of order o's OrderSubmitted outbox event: published, due or delayed."""
    return {3: "due", 4: "delayed"}.get(o % 10, "published")


def checkout_state(c: int) -> str:
    """State of the c-th checkout of a tenant: idle (abandoned, still OPEN), open or closed."""
    d = c % 10
    if d == 0:
        return "idle"
    if d in (1, 2):
        return "open"
    return "completed" if d <= 7 else "abandoned"


def temp_file_age_days(m: int) -> int:
    """Age in whole days of the m-th temp file (plus 1–600 minutes)."""
    return m % 30


def temp_file_status(m: int) -> str:
    """Status of the m-th temp file of a tenant."""
    return ("PENDING", "COMPLETED", "FAILED_TERMINAL")[m % 3]


def temp_file_legal_hold(m: int) -> bool:
    """Whether the m-th temp file is on legal hold."""
    return m % 17 == 0


def audit_age_days(a: int) -> int:
    """Age in whole days of the a-th audit record (plus 1–600 minutes)."""
    return a % 400


def catalog_cache_state(c: int) -> str:
    """State of the c-th catalog item's cache entry: missing, stale or fresh."""
    if c % 20 == 1:
        return "missing"
    return "stale" if c % 8 == 0 else "fresh"


@dataclass(frozen=True)
class DemoPlan:
    """Sizes of one load; the per-tenant row counts derive from ``quotes``."""

    tenants: int
    quotes: int

    @property
    def checkouts(self) -> int:
        return max(1, self.quotes // 5)

    @property
    def temp_files(self) -> int:
        return max(1, self.quotes // 10)

    @property
    def audit_records(self) -> int:
        return max(1, self.quotes // 2)

    @property
    def catalog_items(self) -> int:
        return max(10, min(500, self.quotes // 20))

    def order_ordinals(self) -> Iterable[int]:
        for i in range(1, self.quotes + 1):
            o = order_ordinal(i)
            if o is not None:
                yield o

    def expected_anomalies(self) -> dict[str, int]:
        """Exactly how many rows of each anomaly a load of this plan creates."""
        q, orders = range(1, self.quotes + 1), list(self.order_ordinals())
        files = range(1, self.temp_files + 1)
        past = [m for m in files if temp_file_age_days(m) >= TEMP_FILE_RETENTION_DAYS]
        per_tenant = {
            "expired_active_quotes": sum(1 for i in q if i % 20 == 0),
            "quotes_without_current_snapshot": sum(1 for i in q if i % 2 == 1),
            "abandoned_checkouts": sum(
                1 for c in range(1, self.checkouts + 1) if checkout_state(c) == "idle"
            ),
            "due_deliveries": sum(1 for o in orders if delivery_state(o) in ("due", "poison")),
            "poison_deliveries": sum(1 for o in orders if delivery_state(o) == "poison"),
            "dead_letters": sum(1 for o in orders if delivery_state(o) == "dead"),
            "unpublished_due_events": sum(1 for o in orders if order_event_state(o) == "due"),
            "drifted_orders": sum(1 for o in orders if downstream_status(o) != order_status(o)),
            "drifted_read_models": sum(1 for o in orders if read_model_drift(o) is not None),
            "stale_catalog_cache": sum(
                1 for c in range(1, self.catalog_items + 1) if catalog_cache_state(c) != "fresh"
            ),
            "temp_files_past_retention": sum(
                1 for m in past if temp_file_status(m) != "PENDING" and not temp_file_legal_hold(m)
            ),
            "legal_hold_past_retention": sum(1 for m in past if temp_file_legal_hold(m)),
            "old_audit_records": sum(
                1
                for a in range(1, self.audit_records + 1)
                if audit_age_days(a) >= AUDIT_RETENTION_DAYS
            ),
        }
        return {k: v * self.tenants for k, v in per_tenant.items()}


@dataclass
class DemoReport:
    """What a load did: the tenants it created, rows per table, anomalies planted."""

    tenants: list[str]
    rows: dict[str, int] = field(default_factory=dict)
    anomalies: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    objects_written: int = 0  # stored objects of the new temp file rows
    objects_removed: int = 0  # stored objects of the rows a reset replaced


# ---------------------------------------------------------------- SQL building blocks


def _rnd(key: str, salt: int) -> str:
    """SQL for a uniform [0, 1) value from the load's seed, a salt and a bigint key."""
    return f"((hashint8extended(({key})::bigint, :seed * 1000 + {salt}) & 2147483647)::float8 / 2147483648.0)"


def _minutes(key: str, salt: int, lo: int, hi: int) -> str:
    """SQL interval of lo..hi minutes, chosen by the seeded hash."""
    return f"(({lo} + floor({_rnd(key, salt)} * {hi - lo + 1}))::int * interval '1 minute')"


TENANT = "('tenant-' || lpad(t::text, 3, '0'))"
TKEY = "(t::bigint << 32)"  # hash key prefix of tenant t
QUOTE_ID = ":id_base + (t - :t0)::bigint * :q + i"
LINE_KEY = "((t::bigint << 40) + (i::bigint << 3) + k)"
# A line's quantity and price; the quote total is the sum over its 1 + i % 3 lines.
LINE_QTY = f"(1 + floor({_rnd(LINE_KEY, 11)} * 10))::int"
LINE_PRICE = f"round((5 + {_rnd(LINE_KEY, 12)} * 995)::numeric, 2)"


def _line_amount(k: int) -> str:
    return f"({LINE_QTY} * {LINE_PRICE})".replace(" + k)", f" + {k})")


# The quote total is the sum of its 1 + i % 3 line amounts, unrolled (no subquery per row).
QUOTE_TOTAL = (
    f"({_line_amount(1)} + CASE WHEN i % 3 >= 1 THEN {_line_amount(2)} ELSE 0 END"
    f" + CASE WHEN i % 3 = 2 THEN {_line_amount(3)} ELSE 0 END)"
)
QUOTE_CREATED = (
    f"(:as_of - (1 + i % 90) * interval '1 day' - {_minutes(f'{TKEY} + i', 1, 0, 1439)})"
)
ORDER_ORD = "(4 * (i / 20) + (i % 20 - 3))"  # order ordinal of quote i (quotes with i%20 in 3..6)
ORDER_NUMBER = f"('ORD-' || lpad(t::text, 3, '0') || '-' || lpad({ORDER_ORD}::text, 7, '0'))"


ORDER_STATUS_SQL = (
    "(ARRAY[" + ", ".join(f"'{s}'" for s in ORDER_STATUS_BY_DIGIT) + f"])[{ORDER_ORD} % 10 + 1]"
)
DOWNSTREAM_STATUS_SQL = (
    f"CASE WHEN {ORDER_STATUS_SQL} IN ('SUBMITTED', 'IN_FULFILLMENT') AND {ORDER_ORD} % 7 = 0 "
    f"THEN 'COMPLETED' ELSE {ORDER_STATUS_SQL} END"
)
ORDER_EXISTS_DOWNSTREAM = (
    f"NOT ({ORDER_STATUS_SQL} = 'IN_FULFILLMENT' AND {ORDER_ORD} % 11 = 1 "
    f"AND NOT ({ORDER_ORD} % 7 = 0))"
)
QUOTE_GRID = "generate_series(:t0, :t1) AS t CROSS JOIN generate_series(1, :q) AS i"
ORDER_GRID = f"{QUOTE_GRID} WHERE i % 20 BETWEEN 3 AND 6"

STATEMENTS: list[tuple[str, str]] = [
    (
        "tenant",
        f"""
        INSERT INTO tenant (id, name, time_zone, created_at)
        SELECT {TENANT}, 'Demo tenant ' || t,
               (ARRAY['UTC', 'Europe/Berlin', 'Asia/Jakarta', 'America/New_York'])[1 + t % 4],
               :as_of - interval '400 days'
        FROM generate_series(:t0, :t1) AS t
        """,
    ),
    (  # early: its objects are written while the database loads the rest
        "temp_file",
        f"""
        INSERT INTO temp_file (tenant_id, storage_path, size_bytes, status, legal_hold, created_at)
        SELECT {TENANT}, 'tmp/' || {TENANT} || '/' || lpad(m::text, 7, '0') || '.bin',
               {OBJECT_BYTES[0]}
                 + floor({_rnd(f"{TKEY} + m", 71)} * {OBJECT_BYTES[1] - OBJECT_BYTES[0] + 1})::bigint,
               (ARRAY['PENDING', 'COMPLETED', 'FAILED_TERMINAL'])[1 + m % 3], m % 17 = 0,
               :as_of - (m % 30) * interval '1 day' - {_minutes(f"{TKEY} + m", 72, 1, 600)}
        FROM generate_series(:t0, :t1) AS t CROSS JOIN generate_series(1, :temp_files) AS m
        ORDER BY t, m
        """,
    ),
    (
        "price_book",
        f"""
        INSERT INTO price_book (tenant_id, version, is_current, effective_from, price_factor)
        SELECT {TENANT}, v, v = {CURRENT_PRICE_BOOK_VERSION},
               :as_of - (CASE WHEN v = 1 THEN 180 ELSE 30 END) * interval '1 day', 1
        FROM generate_series(:t0, :t1) AS t CROSS JOIN generate_series(1, 2) AS v
        ORDER BY t, v
        """,
    ),
    (
        "catalog_item",
        f"""
        INSERT INTO catalog_item (tenant_id, sku, name, list_price, version, updated_at)
        SELECT {TENANT}, 'SKU-' || lpad(c::text, 5, '0'), 'Catalog item ' || c,
               round((5 + {_rnd(f"{TKEY} + c", 21)} * 995)::numeric, 2), 1 + c % 4,
               :as_of - {_minutes(f"{TKEY} + c", 22, 60, 100000)}
        FROM generate_series(:t0, :t1) AS t CROSS JOIN generate_series(1, :catalog) AS c
        ORDER BY t, c
        """,
    ),
    (
        "catalog_cache",
        f"""
        INSERT INTO catalog_cache (catalog_item_id, tenant_id, cached_version, payload, refreshed_at)
        SELECT ci.id, ci.tenant_id,
               CASE WHEN c % 8 = 0 THEN ci.version - 1 ELSE ci.version END,
               jsonb_build_object('sku', ci.sku, 'list_price', ci.list_price),
               ci.updated_at
        FROM generate_series(:t0, :t1) AS t CROSS JOIN generate_series(1, :catalog) AS c
        JOIN catalog_item ci ON ci.tenant_id = {TENANT} AND ci.sku = 'SKU-' || lpad(c::text, 5, '0')
        WHERE c % 20 <> 1
        ORDER BY ci.id
        """,
    ),
    (
        "quote",
        f"""
        INSERT INTO quote (id, tenant_id, quote_number, customer_ref, status, currency,
                           total_amount, price_book_version, created_at, updated_at, expires_at)
        SELECT {QUOTE_ID}, {TENANT},
               'Q-' || lpad(t::text, 3, '0') || '-' || lpad(i::text, 7, '0'),
               'cust-' || substr(md5(:seed || ':' || t || ':' || (i % 997)), 1, 12),
               CASE WHEN i % 20 IN (1, 2) THEN 'EXPIRED'
                    WHEN i % 20 BETWEEN 3 AND 6 THEN 'ACCEPTED'
                    WHEN i % 20 = 7 THEN 'CANCELLED'
                    WHEN i % 20 = 8 THEN 'DRAFT'
                    ELSE 'ACTIVE' END,
               'EUR', {QUOTE_TOTAL},
               CASE WHEN i % 2 = 0 THEN {CURRENT_PRICE_BOOK_VERSION} ELSE 1 END,
               c.created, c.created,
               CASE WHEN i % 20 = 0 THEN :as_of - interval '1 hour' - {_minutes(f"{TKEY} + i", 2, 0, 14400)}
                    WHEN i % 20 IN (1, 2) THEN :as_of - interval '1 day' - {_minutes(f"{TKEY} + i", 3, 0, 43200)}
                    WHEN i % 20 >= 9 THEN :as_of + interval '1 hour' + {_minutes(f"{TKEY} + i", 4, 0, 43200)}
                    ELSE c.created + interval '30 days' END
        FROM {QUOTE_GRID} CROSS JOIN LATERAL (SELECT {QUOTE_CREATED} AS created) c
        ORDER BY t, i
        """,
    ),
    (
        "quote_line",
        f"""
        INSERT INTO quote_line (quote_id, tenant_id, line_no, sku, quantity, unit_price, amount)
        SELECT {QUOTE_ID}, {TENANT}, k,
               'SKU-' || lpad((1 + (i * 7 + k) % :catalog)::text, 5, '0'),
               v.qty, v.price, v.qty * v.price
        FROM {QUOTE_GRID} CROSS JOIN LATERAL generate_series(1, 1 + i % 3) AS k
        CROSS JOIN LATERAL (SELECT {LINE_QTY} AS qty, {LINE_PRICE} AS price) v
        ORDER BY t, i, k
        """,
    ),
    (
        "pricing_snapshot",
        f"""
        INSERT INTO pricing_snapshot (tenant_id, quote_id, price_book_version, total_amount,
                                      line_count, computed_at)
        SELECT q.tenant_id, q.id, q.price_book_version, q.total_amount, 1 + i % 3,
               q.created_at + interval '5 minutes'
        FROM {QUOTE_GRID} JOIN quote q ON q.id = {QUOTE_ID}
        ORDER BY q.id
        """,
    ),
    (
        "customer_order",
        f"""
        INSERT INTO customer_order (id, tenant_id, quote_id, order_number, status, total_amount,
                                    line_count, submitted_at, updated_at)
        SELECT q.id, q.tenant_id, q.id, {ORDER_NUMBER}, {ORDER_STATUS_SQL}, q.total_amount,
               1 + i % 3, s.submitted, s.submitted + {_minutes(f"{TKEY} + i", 31, 0, 600)}
        FROM {QUOTE_GRID}
        JOIN quote q ON q.id = {QUOTE_ID}
        CROSS JOIN LATERAL (SELECT :as_of - interval '12 hours' - (i % 30) * interval '1 day'
                                   - {_minutes(f"{TKEY} + i", 32, 0, 600)} AS submitted) s
        WHERE i % 20 BETWEEN 3 AND 6
        ORDER BY q.id
        """,
    ),
    (
        "downstream_order",
        f"""
        INSERT INTO downstream_order (order_number, tenant_id, status, received_at, updated_at)
        SELECT o.order_number, o.tenant_id, {DOWNSTREAM_STATUS_SQL},
               o.submitted_at + interval '1 minute', o.updated_at + interval '2 minutes'
        FROM {QUOTE_GRID} JOIN customer_order o ON o.id = {QUOTE_ID}
        WHERE i % 20 BETWEEN 3 AND 6 AND {ORDER_EXISTS_DOWNSTREAM}
        ORDER BY o.order_number
        """,
    ),
    (
        "order_read_model",
        f"""
        INSERT INTO order_read_model (order_id, tenant_id, order_number, quote_number, status,
                                      total_amount, line_count, source_version, refreshed_at)
        SELECT o.id, o.tenant_id, o.order_number, q.quote_number, o.status,
               CASE WHEN {ORDER_ORD} % 13 = 5 THEN o.total_amount + 1 ELSE o.total_amount END,
               o.line_count, o.version, o.updated_at
        FROM {QUOTE_GRID}
        JOIN customer_order o ON o.id = {QUOTE_ID} JOIN quote q ON q.id = o.quote_id
        WHERE i % 20 BETWEEN 3 AND 6 AND {ORDER_ORD} % 17 <> 3
        ORDER BY o.id
        """,
    ),
    (
        "delivery_attempt_item",
        f"""
        INSERT INTO delivery_attempt_item (id, tenant_id, business_key, order_id, status,
            attempt_count, max_attempts, next_attempt_at, last_error_code, last_error_message,
            last_error_at, payload, created_at, updated_at)
        SELECT md5(:seed || '/delivery/' || o.order_number)::uuid, o.tenant_id,
               'fulfil:' || o.order_number, o.id,
               CASE WHEN d.state IN ('due', 'poison', 'waiting') THEN 'READY'
                    WHEN d.state = 'dead' THEN 'DEAD_LETTER' ELSE 'DELIVERED' END,
               CASE WHEN d.state = 'dead' THEN 8 WHEN d.state = 'delivered' THEN 1
                    ELSE {ORDER_ORD} % 3 END,
               8,
               CASE WHEN d.state = 'waiting' THEN :as_of + {_minutes(f"{TKEY} + i", 41, 1, 60)}
                    ELSE :as_of - {_minutes(f"{TKEY} + i", 42, 1, 120)} END,
               CASE WHEN d.state = 'dead' THEN 'DOWNSTREAM_REJECTED'
                    WHEN d.state IN ('due', 'poison', 'waiting') AND {ORDER_ORD} % 3 > 0
                        THEN 'DOWNSTREAM_5XX' END,
               CASE WHEN d.state = 'dead' THEN 'downstream refused the request (422)'
                    WHEN d.state IN ('due', 'poison', 'waiting') AND {ORDER_ORD} % 3 > 0
                        THEN 'downstream answered 503' END,
               CASE WHEN d.state = 'dead' OR (d.state IN ('due', 'poison', 'waiting')
                                               AND {ORDER_ORD} % 3 > 0)
                    THEN o.submitted_at + interval '3 minutes' END,
               jsonb_build_object('kind', 'fulfilment_request', 'order_number', o.order_number,
                                  'line_count', o.line_count)
                 || CASE WHEN d.state = 'poison' THEN '{{"fault": "poison"}}'::jsonb
                         ELSE '{{}}'::jsonb END,
               o.submitted_at, o.updated_at
        FROM {QUOTE_GRID}
        JOIN customer_order o ON o.id = {QUOTE_ID}
        CROSS JOIN LATERAL (SELECT CASE WHEN {ORDER_ORD} % 50 = 0 THEN 'poison'
                                        WHEN {ORDER_ORD} % 5 = 0 THEN 'due'
                                        WHEN {ORDER_ORD} % 5 = 1 THEN 'waiting'
                                        WHEN {ORDER_ORD} % 100 = 7 THEN 'dead'
                                        ELSE 'delivered' END AS state) d
        WHERE i % 20 BETWEEN 3 AND 6
        ORDER BY o.id
        """,
    ),
    (
        "outbox_event",
        f"""
        INSERT INTO outbox_event (id, business_key, tenant_id, aggregate_type, aggregate_id,
                                  event_type, payload, created_at, available_at, published_at,
                                  publish_attempts)
        SELECT md5(:seed || '/event/' || e.business_key)::uuid, e.business_key, e.tenant_id,
               e.aggregate_type, e.aggregate_id, e.event_type, e.payload, e.created_at,
               e.available_at, e.published_at, CASE WHEN e.published_at IS NULL THEN 0 ELSE 1 END
        FROM (
            SELECT format('quote:%s:expired', q.id) AS business_key, q.tenant_id,
                   'quote' AS aggregate_type, q.id::text AS aggregate_id,
                   'QuoteExpired' AS event_type,
                   jsonb_build_object('quote_id', q.id, 'expired_at', q.expires_at) AS payload,
                   q.expires_at AS created_at, q.expires_at AS available_at,
                   q.expires_at + interval '2 minutes' AS published_at, q.id AS sort_key, 1 AS kind
            FROM {QUOTE_GRID} JOIN quote q ON q.id = {QUOTE_ID}
            WHERE i % 20 IN (1, 2)
            UNION ALL
            SELECT format('order:%s:submitted', o.id), o.tenant_id, 'order', o.id::text,
                   'OrderSubmitted',
                   jsonb_build_object('order_number', o.order_number, 'notify', 'order_confirmation'),
                   o.submitted_at,
                   CASE WHEN {ORDER_ORD} % 10 = 3 THEN :as_of - {_minutes(f"{TKEY} + i", 51, 1, 90)}
                        WHEN {ORDER_ORD} % 10 = 4 THEN :as_of + {_minutes(f"{TKEY} + i", 52, 30, 1440)}
                        ELSE o.submitted_at END,
                   CASE WHEN {ORDER_ORD} % 10 IN (3, 4) THEN NULL
                        ELSE o.submitted_at + interval '1 minute' END,
                   o.id, 2
            FROM {QUOTE_GRID} JOIN customer_order o ON o.id = {QUOTE_ID}
            WHERE i % 20 BETWEEN 3 AND 6
        ) e
        ORDER BY e.kind, e.sort_key
        """,
    ),
    (
        "notification",
        f"""
        INSERT INTO notification (id, tenant_id, order_id, channel, template, recipient_ref,
                                  status, outbox_event_id, send_after, sent_at, created_at)
        SELECT md5(:seed || '/notification/' || o.id)::uuid, o.tenant_id, o.id,
               (ARRAY['email', 'sms'])[1 + ({ORDER_ORD} / 2) % 2], 'order_confirmation',
               'recipient-' || substr(md5(:seed || '/r/' || o.id), 1, 12),
               CASE WHEN e.published_at IS NULL THEN 'PENDING' ELSE 'SENT' END,
               e.id, e.available_at, e.published_at, o.submitted_at
        FROM {QUOTE_GRID}
        JOIN customer_order o ON o.id = {QUOTE_ID}
        JOIN outbox_event e ON e.business_key = format('order:%s:submitted', o.id)
        WHERE i % 20 BETWEEN 3 AND 6 AND {ORDER_ORD} % 2 = 0
        ORDER BY o.id
        """,
    ),
    (
        "checkout_session",
        f"""
        INSERT INTO checkout_session (tenant_id, quote_id, status, started_at, last_activity_at,
                                      closed_at)
        SELECT {TENANT}, :id_base + (t - :t0)::bigint * :q + 1 + (c * 5 - 1) % :q,
               CASE WHEN c % 10 IN (0, 1, 2) THEN 'OPEN'
                    WHEN c % 10 BETWEEN 3 AND 7 THEN 'COMPLETED' ELSE 'ABANDONED' END,
               a.last_activity - interval '20 minutes', a.last_activity,
               CASE WHEN c % 10 >= 3 THEN a.last_activity + interval '5 minutes' END
        FROM generate_series(:t0, :t1) AS t CROSS JOIN generate_series(1, :checkouts) AS c
        CROSS JOIN LATERAL (SELECT CASE
            WHEN c % 10 = 0 THEN :as_of - interval '{CHECKOUT_IDLE_TIMEOUT_HOURS} hours'
                                 - {_minutes(f"{TKEY} + c", 61, 60, 7200)}
            WHEN c % 10 IN (1, 2) THEN :as_of - {_minutes(f"{TKEY} + c", 62, 0, 60)}
            ELSE :as_of - {_minutes(f"{TKEY} + c", 63, 120, 43200)} END AS last_activity) a
        ORDER BY t, c
        """,
    ),
    (
        "audit_record",
        f"""
        INSERT INTO audit_record (tenant_id, occurred_at, actor_ref, action, entity_type,
                                  entity_id, details)
        SELECT {TENANT},
               :as_of - (a % 400) * interval '1 day' - {_minutes(f"{TKEY} + a", 81, 1, 600)},
               'user-' || substr(md5(:seed || '/actor/' || t || ':' || (a % 50)), 1, 10),
               (ARRAY['quote.created', 'quote.updated', 'order.submitted', 'price.overridden'])[1 + a % 4],
               (ARRAY['quote', 'quote', 'order', 'quote'])[1 + a % 4],
               (:id_base + (t - :t0)::bigint * :q + 1 + a % :q)::text,
               jsonb_build_object('source', 'demo', 'n', a)
        FROM generate_series(:t0, :t1) AS t CROSS JOIN generate_series(1, :audit_records) AS a
        ORDER BY t, a
        """,
    ),
]

# Tables whose ids the load sets explicitly: their identity must move past them.
_EXPLICIT_ID_TABLES = ("quote", "customer_order")


_INT_PARAMS = re.compile(r":(t0|t1|q|catalog|checkouts|temp_files|audit_records)\b")
_BIGINT_PARAMS = re.compile(r":(seed|id_base)\b")


def _typed_params(sql: str) -> str:
    """Cast integer binds explicitly: the driver would send small ints as smallint."""
    sql = _INT_PARAMS.sub(r"CAST(:\1 AS int)", sql)
    return _BIGINT_PARAMS.sub(r"CAST(:\1 AS bigint)", sql)


@contextlib.contextmanager
def _bulk_load(conn: Connection, tables: list[str]) -> Iterator[None]:
    """Load fast inside the current transaction, without weakening what ends committed.

    Secondary indexes are dropped and rebuilt once at the end (a sorted build beats a
    million incremental inserts); as superuser, foreign-key triggers are skipped for the
    load, which builds every reference from rows it has just inserted.
    """
    conn.exec_driver_sql("SET LOCAL maintenance_work_mem = '256MB'")
    if conn.scalar(sa.text("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")):
        conn.exec_driver_sql("SET LOCAL session_replication_role = replica")
    indexes = conn.execute(
        sa.text(
            """
            SELECT i.indexrelid::regclass::text AS name, pg_get_indexdef(i.indexrelid) AS ddl
            FROM pg_index i
            WHERE i.indrelid = ANY (CAST(:tables AS regclass[]))
              AND NOT EXISTS (SELECT 1 FROM pg_constraint c WHERE c.conindid = i.indexrelid)
            """
        ),
        {"tables": tables},
    ).all()
    for name, _ in indexes:
        conn.exec_driver_sql(f"DROP INDEX {name}")
    yield
    for _, ddl in indexes:
        conn.exec_driver_sql(ddl)
    conn.exec_driver_sql("SET LOCAL session_replication_role = origin")


class DemoDataExists(BadInput):
    """demo-data was asked to load into a database that already holds business data."""


def _existing_tenant_numbers(conn: Connection) -> list[int]:
    rows = conn.execute(sa.text("SELECT id FROM tenant ORDER BY id")).scalars()
    numbers = []
    for tid in rows:
        prefix, _, digits = tid.rpartition("-")
        if prefix == "tenant" and digits.isdigit():
            numbers.append(int(digits))
    return numbers


def reset_demo_data(conn: Connection) -> None:
    """Empty every business and platform table except the append-only audit trail and the
    API's tokens (credentials outlive demo data)."""
    keep = ("job_audit", "api_token")
    names = [t.name for t in BUSINESS_TABLES + PLATFORM_TABLES if t.name not in keep]
    conn.execute(sa.text(f"TRUNCATE {', '.join(names)} RESTART IDENTITY CASCADE"))


def _truncate_empty(conn: Connection, tables: list[str]) -> None:
    """Truncate the tables that are empty anyway: rows loaded into a table truncated in the
    same transaction skip WAL (the embedded server runs with wal_level=minimal)."""
    empty = [t for t in tables if not conn.scalar(sa.text(f"SELECT EXISTS (SELECT 1 FROM {t})"))]
    if empty:
        # CASCADE reaches only tables referencing an empty one; with no tenant, all are empty
        conn.execute(sa.text(f"TRUNCATE {', '.join(empty)} RESTART IDENTITY CASCADE"))


# ---------------------------------------------------------------- stored objects


def demo_object(storage_path: str, size: int, seed: int) -> bytes:
    """The bytes the demo stores for a temp file: a line naming it, repeated to its size."""
    line = f"qo-ops demo temp file {storage_path} (seed {seed})\n".encode()
    return (line * (size // len(line) + 1))[:size]


class _ObjectWriter(threading.Thread):
    """Stores the new temp files' objects while the rest of the load runs (the database
    inserts, this thread writes files: the two overlap)."""

    def __init__(self, root: Path, files: Sequence[tuple[str, int]], seed: int) -> None:
        super().__init__(name="demo-objects", daemon=True)
        self.root, self.files, self.seed = root, files, seed
        self.created: list[str] = []  # new objects, removed again if the load fails
        self.error: ObjectStoreError | None = None

    def run(self) -> None:
        try:
            with ObjectStore(self.root) as store:
                for path, size in self.files:
                    if store.put(path, demo_object(path, size, self.seed)):
                        self.created.append(path)
        except ObjectStoreError as exc:
            self.error = exc

    def finish(self) -> None:
        """Wait for the writer; a write that failed fails the load (before its commit)."""
        self.join()
        if self.error is not None:
            raise ConfigError(f"demo objects under {self.root}: {self.error}")


def _remove_objects(root: Path, paths: Iterable[str]) -> int:
    """Remove the stored objects at ``paths`` (never through a symlink): how many went. One
    that cannot be removed, or whose path would leave the store, is left."""
    removed = 0
    with ObjectStore(root) as store:
        for path in paths:
            with contextlib.suppress(ObjectStoreError):
                removed += store.remove(path)
    return removed


def load_demo_data(
    engine: Engine,
    *,
    tenants: int,
    quotes: int,
    seed: int,
    as_of: datetime,
    append: bool = False,
    reset: bool = False,
    objects: Path | None = None,
) -> DemoReport:
    """Load ``tenants`` demo tenants of ``quotes`` quotes each, in one transaction.

    Refuses (changing nothing) when business data exists and neither ``append`` nor
    ``reset`` is given. ``reset`` empties the tables first; ``append`` adds new tenants
    numbered after the existing ones. ``objects`` is the object store root (the CLI: the
    one temp_file_cleanup uses, ``QO_OPS_HOME/objects``): each new temp file's object is
    stored there, and a reset removes the objects of the rows it replaces. None: rows only.
    """
    if not 1 <= tenants <= MAX_TENANTS:
        raise BadInput(f"--tenants must be between 1 and {MAX_TENANTS}, got {tenants}")
    if not 1 <= quotes <= MAX_QUOTES_PER_TENANT:
        raise BadInput(f"--quotes must be between 1 and {MAX_QUOTES_PER_TENANT}, got {quotes}")
    if append and reset:
        raise BadInput("--append and --reset exclude each other: choose one")
    if as_of.tzinfo is None:
        raise BadInput("--as-of needs a time zone (e.g. 2026-01-31T00:00:00Z)")
    if not 0 <= seed < 2**31:
        raise BadInput(f"--seed must be between 0 and {2**31 - 1}, got {seed}")

    plan = DemoPlan(tenants=tenants, quotes=quotes)
    started = time.perf_counter()
    writer: _ObjectWriter | None = None
    replaced: set[str] = set()  # storage paths of the rows a reset empties
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql("SET LOCAL synchronous_commit = off")
            conn.exec_driver_sql("SET LOCAL work_mem = '256MB'")
            existing = _existing_tenant_numbers(conn)
            has_data = conn.scalar(
                sa.text("SELECT EXISTS (SELECT 1 FROM tenant) OR EXISTS (SELECT 1 FROM quote)")
            )
            if has_data and not (append or reset):
                raise DemoDataExists(
                    "the database already holds business data: pass --append to add tenants "
                    "or --reset to replace everything (the job_audit trail is kept)"
                )
            if reset:
                if objects is not None:
                    replaced = set(conn.scalars(sa.text("SELECT storage_path FROM temp_file")))
                reset_demo_data(conn)
                existing = []
            elif not has_data:
                _truncate_empty(conn, [table for table, _ in STATEMENTS])
            t0 = (max(existing) if existing else 0) + 1
            t1 = t0 + tenants - 1
            if t1 > MAX_TENANTS:
                raise BadInput(
                    f"tenant numbers would pass tenant-{MAX_TENANTS}: load fewer tenants"
                )
            new_tenants = [f"tenant-{n:03d}" for n in range(t0, t1 + 1)]
            id_base = conn.scalar(sa.text("SELECT coalesce(max(id), 0) FROM quote")) or 0
            params = {
                "t0": t0,
                "t1": t1,
                "q": quotes,
                "seed": seed,
                "as_of": as_of,
                "id_base": id_base,
                "catalog": plan.catalog_items,
                "checkouts": plan.checkouts,
                "temp_files": plan.temp_files,
                "audit_records": plan.audit_records,
            }
            rows: dict[str, int] = {}
            with _bulk_load(conn, [table for table, _ in STATEMENTS]):
                for table, sql in STATEMENTS:
                    rows[table] = conn.execute(sa.text(_typed_params(sql)), params).rowcount
                    if table == "temp_file" and objects is not None:
                        files = conn.execute(
                            sa.text(
                                "SELECT storage_path, size_bytes FROM temp_file "
                                "WHERE tenant_id = ANY(CAST(:tenants AS text[]))"
                            ),
                            {"tenants": new_tenants},
                        ).all()
                        writer = _ObjectWriter(objects, [(f[0], f[1]) for f in files], seed)
                        writer.start()
            for table in _EXPLICIT_ID_TABLES:
                conn.execute(
                    sa.text(
                        f"SELECT setval(pg_get_serial_sequence('{table}', 'id'), "
                        f"(SELECT coalesce(max(id), 1) FROM {table}))"
                    )
                )
            if writer is not None:
                writer.finish()  # every new row's object is stored before the rows commit
    except BaseException:
        if writer is not None:  # the rows are gone again: so are the objects made for them
            writer.join()
            _remove_objects(writer.root, writer.created)
        raise
    removed = 0
    if objects is not None and replaced:  # the old rows are gone for good now
        kept = {path for path, _ in writer.files} if writer is not None else set()
        removed = _remove_objects(objects, sorted(replaced - kept))
    return DemoReport(
        tenants=new_tenants,
        rows=rows,
        anomalies=plan.expected_anomalies(),
        seconds=time.perf_counter() - started,
        objects_written=len(writer.files) if writer is not None else 0,
        objects_removed=removed,
    )
