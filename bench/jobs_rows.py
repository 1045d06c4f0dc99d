"""The jobs section's row jobs (quote_expiration, abandoned_checkout_close,
pricing_snapshot_recalculation, read_model_repair): their data, their limit and the check that
the work was done.

Each limit is the job's own selection (``SPEC.eligible``, every row, no LIMIT) and the job's
own batch statement over all of those rows at once, in one transaction: the job without its
batches, imported rather than copied so that the limit cannot drift from the job.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import URL

from bench.bench_quote_expiration import LOAD_SQL as QUOTE_LOAD_SQL
from bench.bench_quote_expiration import VERIFY_SQL as QUOTE_VERIFY_SQL
from bench.common import engine_for
from bench.jobs_common import (
    IDLE_HOURS,
    TENANT,
    TENANT_SQL,
    Window,
    one_row,
    scope_of,
    spread,
    transition_sql,
)
from qo_ops.jobs.catalog import get_spec
from qo_ops.jobs.pricing_snapshot_recalculation import VERIFY_WINDOW
from qo_ops.platform.job.outcome import BatchContext

# ------------------------------------------------------------------------------ data


def quote_load(n: int, _w: Window | None) -> str:
    return QUOTE_LOAD_SQL.format(n=n)


def checkout_load(n: int, _w: Window | None) -> str:
    # OPEN sessions idle 2 to ~350 days, the oldest (lowest id) idle longest
    return f"""
    {TENANT_SQL}
    INSERT INTO checkout_session (tenant_id, status, started_at, last_activity_at)
    SELECT 'tenant-001', 'OPEN', a - interval '20 minutes', a
      FROM generate_series(1::bigint, {n}) AS i,
           LATERAL (SELECT now() - interval '2 days'
                           - make_interval(secs => ({n} - i) * 30000000.0 / {n})) AS t(a);
    """


def pricing_load(n: int, w: Window | None) -> str:
    # quotes created in the window (created order scattered over id order), 1-3 lines each,
    # each with a snapshot for the old price book only: the job adds one at version 2
    assert w is not None
    return f"""
    {TENANT_SQL}
    INSERT INTO price_book (tenant_id, version, is_current, effective_from, price_factor)
    VALUES ('tenant-001', 1, false, now() - interval '400 days', 1),
           ('tenant-001', 2, true, now() - interval '1 day', 1.1);
    INSERT INTO quote (id, tenant_id, quote_number, customer_ref, status, total_amount,
                       price_book_version, created_at, updated_at, expires_at)
    SELECT i, 'tenant-001', 'Q-' || i, 'c-' || mod(i, 997), 'ACCEPTED', 0, 1, c, c,
           c + interval '30 days'
      FROM generate_series(1::bigint, {n}) AS i,
           LATERAL (SELECT {spread("i - 1", n, w)}) AS t(c);
    INSERT INTO quote_line (quote_id, tenant_id, line_no, sku, quantity, unit_price, amount)
    SELECT i, 'tenant-001', k, 'SKU-' || mod(i * k, 500), v.qty, v.price, v.qty * v.price
      FROM generate_series(1::bigint, {n}) AS i,
           LATERAL generate_series(1, 1 + mod(i, 3)::int) AS k,
           LATERAL (SELECT 1 + mod(i + k, 5) AS qty,
                           round((5 + mod(i * 31 + k, 1000)) / 1.0, 2) AS price) AS v;
    UPDATE quote q SET total_amount = s.total
      FROM (SELECT quote_id, sum(amount) AS total FROM quote_line GROUP BY quote_id) s
     WHERE s.quote_id = q.id;
    INSERT INTO pricing_snapshot (tenant_id, quote_id, price_book_version, total_amount,
                                  line_count, computed_at)
    SELECT 'tenant-001', q.id, 1, q.total_amount, 1 + mod(q.id, 3)::int, q.created_at
      FROM quote q;
    """


def read_model_load(n: int, w: Window | None) -> str:
    # orders (each from its quote) submitted in the window; every read-model row drifted: a
    # third missing, the rest one source version behind, half of those with a wrong total
    assert w is not None
    return f"""
    {TENANT_SQL}
    INSERT INTO quote (id, tenant_id, quote_number, customer_ref, status, total_amount,
                       price_book_version, created_at, updated_at, expires_at)
    SELECT i, 'tenant-001', 'Q-' || i, 'c-' || mod(i, 997), 'ACCEPTED', mod(i, 100000) / 100.0,
           1, s, s, s + interval '30 days'
      FROM generate_series(1::bigint, {n}) AS i,
           LATERAL (SELECT {spread("i - 1", n, w)} - interval '1 day') AS t(s);
    INSERT INTO customer_order (id, tenant_id, quote_id, order_number, status, total_amount,
                                line_count, submitted_at, updated_at, version)
    SELECT i, 'tenant-001', i, 'ORD-' || lpad(i::text, 9, '0'),
           (ARRAY['SUBMITTED', 'IN_FULFILLMENT', 'COMPLETED'])[1 + mod(i, 3)],
           mod(i, 100000) / 100.0, 1 + mod(i, 3)::int, s, s, 2
      FROM generate_series(1::bigint, {n}) AS i,
           LATERAL (SELECT {spread("i - 1", n, w)}) AS t(s);
    INSERT INTO order_read_model (order_id, tenant_id, order_number, quote_number, status,
                                  total_amount, line_count, source_version, refreshed_at)
    SELECT o.id, o.tenant_id, o.order_number, q.quote_number, o.status,
           CASE WHEN mod(o.id, 6) IN (1, 2) THEN o.total_amount + 1 ELSE o.total_amount END,
           o.line_count, 1, o.submitted_at
      FROM customer_order o JOIN quote q ON q.id = o.quote_id WHERE mod(o.id, 3) <> 0;
    """


# ------------------------------------------------------------------------------ limits

# Each takes (url, n, window, home), does the job's whole state change in ONE transaction
# and returns the rows it changed; the caller times it.


def all_at_once(url: URL, job: str, w: Window | None) -> Any:
    """The job's own selection (every eligible row, no LIMIT) and its own batch statement
    over all of them, in one transaction: the row the statement returns."""
    spec = get_spec(job)
    settings = IDLE_HOURS if job == "abandoned_checkout_close" else None
    ctx = BatchContext(spec.name, scope_of(w), "execute", uuid.uuid4(), settings=settings)
    engine = engine_for(url)
    with engine.begin() as conn:
        ids = [int(i) for i in conn.execute(spec.eligible(ctx)).scalars()]
        row = conn.execute(*transition_sql(job, ids, ctx)).one()
    engine.dispose()
    return row


def quote_baseline(url: URL, n: int, w: Window | None, home: Path) -> int:
    row = all_at_once(url, "quote_expiration", w)
    if row.expired != n or row.events != n:
        raise SystemExit(f"quote_expiration baseline: {row.expired} expired, {row.events} events")
    return int(row.expired)


def checkout_baseline(url: URL, n: int, w: Window | None, home: Path) -> int:
    row = all_at_once(url, "abandoned_checkout_close", w)
    if row.closed != n or row.events != n:
        raise SystemExit(f"abandoned_checkout_close baseline: {row.closed} closed, {row.events}")
    return int(row.closed)


def pricing_baseline(url: URL, n: int, w: Window | None, home: Path) -> int:
    row = all_at_once(url, "pricing_snapshot_recalculation", w)
    if row.changed != n:
        raise SystemExit(f"pricing_snapshot_recalculation baseline: {row.changed} changed")
    return int(row.changed)


def read_model_baseline(url: URL, n: int, w: Window | None, home: Path) -> int:
    row = all_at_once(url, "read_model_repair", w)
    if row.repaired != n:
        raise SystemExit(f"read_model_repair baseline: {row.repaired} repaired")
    return int(row.repaired)


def then_checks(
    job: str, baseline: Callable[[URL, int, Window | None, Path], int]
) -> Callable[[URL, int, Window | None, Path], int]:
    """``baseline``, then the job's own outcome checks and lag on the state it left: what a
    run does after its batches, before it may report success (its duration includes them)."""

    def measured(url: URL, n: int, w: Window | None, home: Path) -> int:
        changed = baseline(url, n, w, home)
        spec = get_spec(job)
        ctx = BatchContext(spec.name, scope_of(w), "execute", uuid.uuid4())
        engine = engine_for(url)
        with engine.connect() as conn:
            failed = [c.name for c in spec.check(conn, ctx) if not c.passed]
            if spec.signals.lag is not None:
                spec.signals.lag(conn, ctx)
        engine.dispose()
        if failed:
            raise SystemExit(f"{job} second limit: outcome checks failed: {failed}")
        return changed

    return measured


CHECKS_NOTE = (
    "the limit above, then the job's own outcome checks and lag (`JobSpec.check`, "
    "`JobSpec.signals.lag`, the same statements on a new connection, every check required to pass): "
    "the proof of the outcome a run must give before it reports success, inside the job's "
    "duration and not in the first limit"
)


# ------------------------------------------------------------------------------ verification


def verify_quote(url: URL, n: int, w: Window | None, home: Path) -> dict[str, Any]:
    engine = engine_for(url)
    with engine.connect() as conn:
        row = conn.execute(QUOTE_VERIFY_SQL, {"tenant": TENANT}).one()._asdict()
    engine.dispose()
    ok = row["overdue"] == 0 and row["expired"] == row["events"] == row["quotes_with_event"] == n
    return {"ok": ok, **row}


def verify_checkout(url: URL, n: int, w: Window | None, home: Path) -> dict[str, Any]:
    row = one_row(
        url,
        """
        SELECT (SELECT count(*) FROM checkout_session WHERE tenant_id = :t AND status = 'OPEN')
                   AS still_open,
               (SELECT count(*) FROM checkout_session
                 WHERE tenant_id = :t AND status = 'ABANDONED' AND version = 2
                   AND closed_at IS NOT NULL) AS abandoned,
               (SELECT count(DISTINCT aggregate_id) FROM outbox_event
                 WHERE event_type = 'CheckoutAbandoned') AS with_event,
               (SELECT count(*) FROM outbox_event) AS events
        """,
        {"t": TENANT},
    )
    ok = row["still_open"] == 0 and row["abandoned"] == row["with_event"] == row["events"] == n
    return {"ok": ok, **row}


def verify_pricing(url: URL, n: int, w: Window | None, home: Path) -> dict[str, Any]:
    assert w is not None
    engine = engine_for(url)
    with engine.connect() as conn:
        row = (
            conn.execute(VERIFY_WINDOW, {"tenant": TENANT, "start": w.start, "end": w.end})
            .one()
            ._asdict()
        )
        row["current_snapshots"] = conn.execute(
            sa.text("SELECT count(*) FROM pricing_snapshot WHERE price_book_version = 2")
        ).scalar_one()
    engine.dispose()
    ok = (
        row["quotes"] == n
        and row["missing"] == 0
        and row["mismatched"] == 0
        and row["current_snapshots"] == n
    )
    return {"ok": ok, **row}


def verify_read_model(url: URL, n: int, w: Window | None, home: Path) -> dict[str, Any]:
    row = one_row(
        url,
        """
        SELECT count(*) AS orders, count(r.order_id) AS rows,
               count(*) FILTER (WHERE r.order_id IS NULL OR r.status <> o.status
                                  OR r.total_amount <> o.total_amount
                                  OR r.line_count <> o.line_count
                                  OR r.order_number <> o.order_number
                                  OR r.quote_number IS DISTINCT FROM q.quote_number
                                  OR r.source_version <> o.version) AS drifted
          FROM customer_order o LEFT JOIN order_read_model r ON r.order_id = o.id
          LEFT JOIN quote q ON q.id = o.quote_id
         WHERE o.tenant_id = :t
        """,
        {"t": TENANT},
    )
    ok = row["orders"] == row["rows"] == n and row["drifted"] == 0
    return {"ok": ok, **row}
