"""The retry model: error classification, exponential backoff with bounded jitter, the attempt
budget, and the audited requeue of dead letters (on a real database, and through the CLI).

Tests ``qo_ops.platform.calls.retry`` (and the requeue of
``qo_ops.platform.actions.recovery``).
"""

from __future__ import annotations

import random
import uuid
from datetime import UTC, datetime, timedelta

import httpx
import pytest
import sqlalchemy as sa

from qo_ops.db.schema import delivery_attempt_item
from qo_ops.demo.data import load_demo_data
from qo_ops.jobs.delivery_retry import SPEC as DELIVERY_RETRY
from qo_ops.platform.actions import recovery
from qo_ops.platform.calls.retry import (
    ErrorClass,
    RetryPolicy,
    classify_exception,
    classify_http_status,
)

AS_OF = datetime(2026, 3, 1, tzinfo=UTC)
TENANT = "tenant-001"
OTHER = "tenant-002"


# --------------------------------------------------------------------- classification


@pytest.mark.parametrize("status", [408, 425, 429, 500, 502, 503, 504])
def test_transient_http_statuses_are_retryable(status):
    assert classify_http_status(status) is ErrorClass.RETRYABLE


@pytest.mark.parametrize("status", [501, 505, 507, 599])
def test_other_5xx_statuses_are_retryable(status):
    assert classify_http_status(status) is ErrorClass.RETRYABLE


@pytest.mark.parametrize("status", [400, 401, 403, 404, 409, 410, 413, 422, 451, 499])
def test_client_error_statuses_are_not_retryable(status):
    assert classify_http_status(status) is ErrorClass.NON_RETRYABLE


@pytest.mark.parametrize("status", [100, 204, 301, 304, 399])
def test_unexpected_non_error_statuses_are_unknown(status):
    assert classify_http_status(status) is ErrorClass.UNKNOWN


class ReadTimeout(Exception):
    """Named like a client library's timeout, unrelated to TimeoutError."""


class ConnectError(Exception):
    """Named like a client library's connection failure."""


class RemoteProtocolError(Exception):
    """Named like a client library's protocol failure."""


class PoolFull(Exception):
    """Nothing in its name or type says what it is."""


@pytest.mark.parametrize(
    "exc",
    [
        TimeoutError("slow"),
        ConnectionError("gone"),
        ConnectionResetError("reset"),
        ConnectionRefusedError("refused"),
        BrokenPipeError("pipe"),
        ReadTimeout(),
        ConnectError(),
        RemoteProtocolError(),
        httpx.ReadTimeout("read timed out"),
        httpx.ConnectError("connection refused"),
        httpx.RemoteProtocolError("server disconnected"),
        httpx.ReadError("read failed"),
        httpx.WriteError("write failed"),
    ],
    ids=lambda e: type(e).__qualname__,
)
def test_transport_failures_are_retryable(exc):
    assert classify_exception(exc) is ErrorClass.RETRYABLE


@pytest.mark.parametrize(
    "exc",
    [
        ValueError("bad"),
        TypeError("wrong"),
        KeyError("missing"),
        UnicodeDecodeError("utf-8", b"\xff", 0, 1, "x"),
    ],
    ids=lambda e: type(e).__qualname__,
)
def test_bad_input_failures_are_not_retryable(exc):
    assert classify_exception(exc) is ErrorClass.NON_RETRYABLE


@pytest.mark.parametrize(
    "exc", [RuntimeError("?"), PoolFull(), ArithmeticError()], ids=lambda e: type(e).__qualname__
)
def test_other_failures_are_unknown(exc):
    assert classify_exception(exc) is ErrorClass.UNKNOWN


# --------------------------------------------------------------------- backoff


class EdgeRng:
    """A fake RNG whose ``uniform`` returns one end of the range, recording what it was asked."""

    def __init__(self, end: str) -> None:
        self.end = end
        self.calls: list[tuple[float, float]] = []

    def uniform(self, a: float, b: float) -> float:
        self.calls.append((a, b))
        return a if self.end == "low" else b


def test_delay_without_jitter_doubles_each_attempt_until_the_cap():
    policy = RetryPolicy(base=timedelta(seconds=30), cap=timedelta(hours=1), jitter=0.0)
    rng = random.Random(1)
    delays = [policy.delay(n, rng).total_seconds() for n in range(1, 11)]
    assert delays == [30, 60, 120, 240, 480, 960, 1920, 3600, 3600, 3600]


def test_delay_grows_exponentially_from_the_base():
    policy = RetryPolicy(base=timedelta(seconds=2), cap=timedelta(days=1), jitter=0.0)
    for attempt in range(1, 15):
        assert policy.delay(attempt, random.Random(0)) == timedelta(seconds=2 * 2 ** (attempt - 1))


def test_delay_never_exceeds_the_cap_even_for_huge_attempt_numbers():
    policy = RetryPolicy(base=timedelta(seconds=30), cap=timedelta(minutes=10), jitter=0.5)
    rng = random.Random(42)
    for attempt in (6, 7, 50, 500, 1000):
        assert policy.delay(attempt, rng) <= timedelta(minutes=10)
    assert policy.delay(1000, EdgeRng("high")) == timedelta(minutes=10)
    assert policy.delay(1000, EdgeRng("low")) == timedelta(minutes=5)


def test_jitter_range_ends_are_delay_times_one_minus_jitter_and_delay():
    policy = RetryPolicy(base=timedelta(seconds=30), cap=timedelta(hours=1), jitter=0.25)
    for attempt, raw in [(1, 30.0), (2, 60.0), (3, 120.0), (8, 3600.0), (9, 3600.0)]:
        low, high = EdgeRng("low"), EdgeRng("high")
        assert policy.delay(attempt, low).total_seconds() == pytest.approx(raw * 0.75)
        assert policy.delay(attempt, high).total_seconds() == pytest.approx(raw)
        assert low.calls == [(pytest.approx(raw * 0.75), pytest.approx(raw))]


def test_jittered_delays_stay_within_bounds_and_actually_vary():
    policy = RetryPolicy(base=timedelta(seconds=30), cap=timedelta(hours=1), jitter=0.5)
    rng = random.Random(20260301)
    for attempt in range(1, 12):
        raw = min(30 * 2 ** (attempt - 1), 3600)
        samples = [policy.delay(attempt, rng).total_seconds() for _ in range(200)]
        assert all(raw * 0.5 <= s <= raw for s in samples), (attempt, min(samples), max(samples))
        assert len(set(samples)) > 100  # jitter, not a constant


def test_same_seed_gives_the_same_delays():
    policy = RetryPolicy()
    first = [policy.delay(n, random.Random(7)) for n in range(1, 9)]
    second = [policy.delay(n, random.Random(7)) for n in range(1, 9)]
    assert first == second


def test_default_policy_jitter_stays_within_its_documented_range():
    policy = RetryPolicy()  # 30 s base, 1 h cap, 50 % jitter, 8 attempts
    for attempt in range(1, 12):
        raw = min(30 * 2 ** (attempt - 1), 3600)
        d = policy.delay(attempt).total_seconds()  # module-level random
        assert raw * 0.5 <= d <= raw


@pytest.mark.parametrize("attempt", [0, -1])
def test_delay_rejects_attempts_below_one(attempt):
    with pytest.raises(ValueError):
        RetryPolicy().delay(attempt)


# --------------------------------------------------------------------- decide


def test_non_retryable_errors_go_straight_to_the_dead_letter():
    policy = RetryPolicy(max_attempts=8)
    for attempts in (1, 2, 7, 8):
        assert policy.decide(ErrorClass.NON_RETRYABLE, attempts) == "dead_letter"


@pytest.mark.parametrize("error", [ErrorClass.RETRYABLE, ErrorClass.UNKNOWN])
def test_retryable_and_unknown_errors_retry_until_the_budget_is_spent(error):
    policy = RetryPolicy(max_attempts=5)
    assert [policy.decide(error, n) for n in range(1, 8)] == [
        "retry",
        "retry",
        "retry",
        "retry",
        "dead_letter",
        "dead_letter",
        "dead_letter",
    ]


def test_a_budget_of_one_attempt_never_retries():
    policy = RetryPolicy(max_attempts=1)
    assert policy.decide(ErrorClass.RETRYABLE, 1) == "dead_letter"


# --------------------------------------------------------------------- requeue (real db)


def _items(engine: sa.Engine) -> dict[uuid.UUID, tuple]:
    """Every delivery item, by id: the columns a requeue may (or must not) touch."""
    t = delivery_attempt_item
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(
                t.c.id,
                t.c.tenant_id,
                t.c.status,
                t.c.attempt_count,
                t.c.next_attempt_at,
                t.c.updated_at,
            )
        ).all()
    return {r.id: tuple(r) for r in rows}


def _dead_letters(engine: sa.Engine, tenant: str) -> list[uuid.UUID]:
    """Dead-lettered items of ``tenant``, oldest first (the order a requeue takes them)."""
    with engine.connect() as conn:
        return list(
            conn.execute(
                sa.text(
                    "SELECT id FROM delivery_attempt_item WHERE tenant_id = :t AND status = 'DEAD_LETTER' "
                    "ORDER BY updated_at, id"
                ),
                {"t": tenant},
            ).scalars()
        )


def requeue_dead_letters(
    engine: sa.Engine,
    *,
    tenant_id: str,
    requester: str,
    reason: str,
    item_ids: list[uuid.UUID] | None = None,
    limit: int = 1000,
) -> int:
    """delivery_retry's dead letters requeued the way ``qo-ops requeue`` does: how many moved."""
    return recovery.requeue(
        engine,
        DELIVERY_RETRY,
        recovery.Who(requester, reason),
        recovery.DeadLetters(tenant_id, item_ids, limit),
    ).changed


def _audit_rows(engine: sa.Engine) -> list[sa.Row]:
    with engine.connect() as conn:
        return conn.execute(sa.text("SELECT * FROM job_audit ORDER BY id")).all()


def _changed(before: dict, after: dict) -> set[uuid.UUID]:
    assert before.keys() == after.keys()
    return {k for k in before if before[k] != after[k]}


@pytest.fixture
def dead(db):
    """Demo data for three tenants, each with several dead letters."""
    load_demo_data(db.engine, tenants=3, quotes=3000, seed=3, as_of=AS_OF)
    per_tenant = {t: _dead_letters(db.engine, t) for t in (TENANT, OTHER, "tenant-003")}
    assert all(len(ids) >= 5 for ids in per_tenant.values()), per_tenant
    return db, per_tenant


def _assert_requeued(after: dict, ids: set[uuid.UUID]) -> None:
    for item_id in ids:
        _, tenant, status, attempts, next_at, _ = after[item_id]
        assert (tenant, status, attempts) == (TENANT, "READY", 0)
        assert next_at > AS_OF  # due now, not at its old time


def test_requeue_moves_only_the_tenants_dead_letters_and_audits_once(dead):
    db, per_tenant = dead
    before, audit_before = _items(db.engine), _audit_rows(db.engine)

    moved = requeue_dead_letters(
        db.engine, tenant_id=TENANT, requester="alice", reason="INC-42 downstream fixed"
    )

    after = _items(db.engine)
    assert moved == len(per_tenant[TENANT])
    assert _changed(before, after) == set(per_tenant[TENANT])
    _assert_requeued(after, set(per_tenant[TENANT]))
    assert _dead_letters(db.engine, TENANT) == []
    assert _dead_letters(db.engine, OTHER) == per_tenant[OTHER]

    audit = _audit_rows(db.engine)
    assert len(audit) == len(audit_before) + 1
    row = audit[-1]
    assert (row.actor, row.action, row.scope, row.reason, row.mode) == (
        "alice",
        "requeue",
        TENANT,
        "INC-42 downstream fixed",
        "execute",
    )
    assert row.decision == f"requeued {moved}"
    assert row.details["requeued"] == moved
    assert row.details["limit"] == 1000


def test_a_second_requeue_moves_nothing_but_is_still_audited(dead):
    db, per_tenant = dead
    first = requeue_dead_letters(db.engine, tenant_id=TENANT, requester="alice", reason="first")
    assert first == len(per_tenant[TENANT]) > 0
    before, audit_before = _items(db.engine), _audit_rows(db.engine)

    second = requeue_dead_letters(db.engine, tenant_id=TENANT, requester="bob", reason="again")

    assert second == 0
    assert _items(db.engine) == before
    audit = _audit_rows(db.engine)
    assert len(audit) == len(audit_before) + 1
    assert (audit[-1].actor, audit[-1].reason, audit[-1].decision) == ("bob", "again", "requeued 0")
    assert audit[-1].details["requeued"] == 0


def test_requeue_respects_the_limit_oldest_first(dead):
    db, per_tenant = dead
    oldest = per_tenant[TENANT][:2]
    before, audit_before = _items(db.engine), _audit_rows(db.engine)

    moved = requeue_dead_letters(
        db.engine, tenant_id=TENANT, requester="alice", reason="two only", limit=2
    )

    after = _items(db.engine)
    assert moved == 2
    assert _changed(before, after) == set(oldest)
    _assert_requeued(after, set(oldest))
    assert _dead_letters(db.engine, TENANT) == per_tenant[TENANT][2:]
    audit = _audit_rows(db.engine)
    assert len(audit) == len(audit_before) + 1
    assert audit[-1].details["limit"] == 2 and audit[-1].details["requeued"] == 2


def test_requeue_by_item_ids_moves_only_those_dead_letters_of_the_tenant(dead):
    db, per_tenant = dead
    chosen = [per_tenant[TENANT][1], per_tenant[TENANT][3]]
    with db.engine.connect() as conn:
        ready_id = conn.execute(
            sa.text(
                "SELECT id FROM delivery_attempt_item WHERE tenant_id = :t AND status = 'READY' LIMIT 1"
            ),
            {"t": TENANT},
        ).scalar_one()
    foreign = per_tenant[OTHER][0]  # another tenant's dead letter: must not move
    unknown = uuid.uuid4()
    before, audit_before = _items(db.engine), _audit_rows(db.engine)

    moved = requeue_dead_letters(
        db.engine,
        tenant_id=TENANT,
        requester="alice",
        reason="these two",
        item_ids=[*chosen, ready_id, foreign, unknown],
    )

    after = _items(db.engine)
    assert moved == 2
    assert _changed(before, after) == set(chosen)
    _assert_requeued(after, set(chosen))
    assert after[foreign] == before[foreign] and after[ready_id] == before[ready_id]
    audit = _audit_rows(db.engine)
    assert len(audit) == len(audit_before) + 1
    assert audit[-1].details["requested_ids"] == 5
    assert audit[-1].details["requeued"] == 2


def test_requeue_cli_moves_dead_letters_and_audits_requester_and_reason(dead, cli):
    db, per_tenant = dead
    before, audit_before = _items(db.engine), _audit_rows(db.engine)

    result = cli(
        "requeue",
        "delivery_retry",
        "--tenant",
        TENANT,
        "--reason",
        "INC-7 replay",
        "--requester",
        "carol",
        "--limit",
        "3",
        "--all-dead",
    )

    assert result.code == 0, result.stderr
    assert f"requeued 3 dead-lettered delivery item(s) of {TENANT}" in result.stdout
    after = _items(db.engine)
    assert _changed(before, after) == set(per_tenant[TENANT][:3])
    _assert_requeued(after, set(per_tenant[TENANT][:3]))
    audit = _audit_rows(db.engine)
    assert len(audit) == len(audit_before) + 1
    row = audit[-1]
    assert (row.actor, row.action, row.scope, row.reason) == (
        "carol",
        "requeue",
        TENANT,
        "INC-7 replay",
    )
    assert row.details["requeued"] == 3


def test_requeue_cli_by_item_and_a_second_call_moves_nothing(dead, cli):
    db, per_tenant = dead
    item = per_tenant[TENANT][-1]

    first = cli(
        "requeue",
        "delivery_retry",
        "--tenant",
        TENANT,
        "--reason",
        "one item",
        "--requester",
        "dave",
        "--item",
        str(item),
    )
    assert first.code == 0, first.stderr
    assert f"requeued 1 dead-lettered delivery item(s) of {TENANT}" in first.stdout
    assert item not in _dead_letters(db.engine, TENANT)
    before = _items(db.engine)

    second = cli(
        "requeue",
        "delivery_retry",
        "--tenant",
        TENANT,
        "--reason",
        "one item",
        "--requester",
        "dave",
        "--item",
        str(item),
    )
    assert second.code == 0, second.stderr
    assert f"requeued 0 dead-lettered delivery item(s) of {TENANT}" in second.stdout
    assert _items(db.engine) == before
    audit = [r for r in _audit_rows(db.engine) if r.action == "requeue"]
    assert [(r.actor, r.decision) for r in audit] == [
        ("dave", "requeued 1"),
        ("dave", "requeued 0"),
    ]


@pytest.mark.parametrize(
    "args",
    [
        ["--tenant", TENANT, "--reason", "   "],
        ["--tenant", "Tenant_001", "--reason", "x"],
        ["--tenant", TENANT, "--reason", "x", "--item", "not-a-uuid"],
        ["--tenant", TENANT, "--reason", "x", "--limit", "0"],
    ],
)
def test_requeue_cli_rejects_bad_input_and_changes_nothing(dead, cli, args):
    db, _ = dead
    before, audit_before = _items(db.engine), _audit_rows(db.engine)
    result = cli("requeue", "delivery_retry", *args)
    assert result.code == 2
    assert result.stderr.startswith("qo-ops: error:")
    assert "Traceback" not in result.stderr
    assert _items(db.engine) == before
    assert _audit_rows(db.engine) == audit_before
