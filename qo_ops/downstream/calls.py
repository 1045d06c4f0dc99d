"""What delivery_retry and notification_publish share: calling the downstream for each
claimed item, and turning recorded results into a batch outcome."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from qo_ops.downstream.client import DownstreamClient, DownstreamError, client_from_env
from qo_ops.platform.external import call_each
from qo_ops.platform.retry import CallResult, Disposition
from qo_ops.platform.spec import BatchContext, BatchOutcome


def downstream_client(ctx: BatchContext) -> DownstreamClient:
    """The run's client (made once per run from QO_OPS_DOWNSTREAM_URL)."""
    client = ctx.params.get("downstream_client")
    if client is None:
        client = ctx.params["downstream_client"] = client_from_env()
    return client


def call_for_each(
    ctx: BatchContext,
    work: list[dict[str, Any]],
    call: Callable[[DownstreamClient, dict[str, Any]], object],
    *,
    attempt_field: str,
    max_attempts: Callable[[dict[str, Any]], int],
) -> list[CallResult]:
    """``call(client, item)`` for every claimed item, concurrently; failures become results."""
    client = downstream_client(ctx)

    def one(item: dict[str, Any]) -> CallResult:
        base = {
            "item_id": str(item["id"]),
            "attempt": item[attempt_field],
            "max_attempts": max_attempts(item),
        }
        try:
            call(client, item)
        except DownstreamError as exc:
            return CallResult(
                **base, ok=False, error_class=exc.error_class, code=exc.code, message=exc.message
            )
        return CallResult(**base, ok=True)

    return call_each(work, one, ctx.params["limits"]["concurrency"])


_STATE_NAMES = {"done": "delivered", "retry": "retry_scheduled", "dead": "dead_lettered"}


def outcome_of(
    decisions: list[tuple[CallResult, Disposition]], recorded: dict[str, str]
) -> BatchOutcome:
    """Counters from what was recorded (``recorded``: item id → done | retry | dead); an item
    missing there lost its claim meanwhile and is counted skipped."""
    states = [recorded.get(r.item_id) for r, _ in decisions]
    failed = [
        (r.item_id, r.code or "unknown")
        for r, _ in decisions
        if recorded.get(r.item_id) in ("retry", "dead")
    ]
    tally: dict[str, int] = {}
    for r, _ in decisions:  # outcomes by error class and attempt, for the run's report
        klass = "ok" if r.ok else str(r.error_class or "unknown")
        state = _STATE_NAMES.get(recorded.get(r.item_id) or "", "claim_lost")
        key = f"outcome.{klass}.attempt_{r.attempt}.{state}"
        tally[key] = tally.get(key, 0) + 1
    return BatchOutcome(
        succeeded=states.count("done"),
        failed=len(failed),
        skipped=states.count(None),
        retry_scheduled=states.count("retry"),
        deadlettered=states.count("dead"),
        failed_items=failed,
        tally=tally,
    )
