"""The demo data's rules, per row index: each table's rows are numbered 1..n within a
tenant, and these functions are the whole story of which of them are anomalies (the SQL of
``statements.py`` applies the same rules). :class:`DemoPlan` says from them exactly how many
of each anomaly a load of given sizes creates."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# Retention and timeout rules the demo anomalies are placed around (the jobs' defaults).
TEMP_FILE_RETENTION_DAYS = 7
AUDIT_RETENTION_DAYS = 365
CHECKOUT_IDLE_TIMEOUT_HOURS = 24
CURRENT_PRICE_BOOK_VERSION = 2


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
