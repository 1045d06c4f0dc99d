"""The demo data as SQL: one set-based ``INSERT ... SELECT`` per table over
``generate_series`` and a seeded hash (``hashint8extended``), so 1,000,000 quotes load in
seconds and the same (seed, as-of, sizes) give the same rows. Which rows are anomalies
depends only on each row's index within its tenant (``rules.py``), never on the hash. The
values of a load (tenant numbers, sizes, seed, as-of) are bound parameters; the fragments
spliced in are the fixed expressions below."""

from __future__ import annotations

from qo_ops.demo.rules import (
    CHECKOUT_IDLE_TIMEOUT_HOURS,
    CURRENT_PRICE_BOOK_VERSION,
    ORDER_STATUS_BY_DIGIT,
)

OBJECT_BYTES = (64, 4096)  # a demo temp file's stored object: small, real bytes


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
