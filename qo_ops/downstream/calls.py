"""What delivery_retry and notification_publish share: their settings, calling the
downstream for each claimed item, and turning recorded results into a batch outcome."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from qo_ops.downstream.client import DownstreamClient, DownstreamError, downstream_url
from qo_ops.platform.external import NotCalled, call_each
from qo_ops.platform.retry import CallResult, Disposition, RetryPolicy, policy_from_env
from qo_ops.platform.spec import BatchContext, BatchOutcome, run_settings

_CLIENT_PARAM = "downstream_client"


@dataclass(frozen=True)
class CallSettings:
    """What a job that sends items to the downstream works with: where it is, and how a
    failed item is retried. Read and checked once, before the run claims anything."""

    downstream_url: str
    retry: RetryPolicy


def call_settings(environ: Mapping[str, str] | None = None) -> CallSettings:
    """``QO_OPS_DOWNSTREAM_URL`` and the retry policy (``QO_OPS_RETRY_BASE_S``/``_CAP_S``),
    checked (``ConfigError``): the ``validate_settings`` of the jobs that call
    :func:`call_for_each`."""
    return CallSettings(downstream_url(environ), policy_from_env(environ=environ))


def downstream_client(ctx: BatchContext, url: str) -> DownstreamClient:
    """The run's client for ``url`` (the run's checked setting), made once per run."""
    client = ctx.params.get(_CLIENT_PARAM)
    if client is None:
        client = ctx.params[_CLIENT_PARAM] = DownstreamClient(url)
    return client


def call_for_each(
    ctx: BatchContext,
    work: list[dict[str, Any]],
    call: Callable[[DownstreamClient, dict[str, Any]], bool],
    *,
    attempt_field: str,
    max_attempts: Callable[[dict[str, Any]], int],
) -> list[CallResult]:
    """``call(client, item)`` for every claimed item, concurrently; failures become results.
    ``call`` answers whether the downstream had already seen the item (a duplicate)."""
    client = downstream_client(ctx, run_settings(ctx, call_settings).downstream_url)

    def one(item: dict[str, Any]) -> CallResult:
        base = {
            "item_id": str(item["id"]),
            "attempt": item[attempt_field],
            "max_attempts": max_attempts(item),
        }
        try:
            duplicate = call(client, item)
        except DownstreamError as exc:
            return CallResult(
                **base,
                ok=False,
                error_class=exc.error_class,
                code=exc.code,
                message=exc.message,
                # an unreadable answer came from a request that arrived: its effect is unknown
                outcome_unknown=exc.outcome_unknown or exc.code == "bad_response",
            )
        return CallResult(**base, ok=True, duplicate=duplicate is True)

    results = call_each(work, one, ctx.params["limits"]["concurrency"], ctx.stop)
    return [
        _released(r, attempt_field, max_attempts) if isinstance(r, NotCalled) else r
        for r in results
    ]


def _released(
    not_called: NotCalled[dict[str, Any]],
    attempt_field: str,
    max_attempts: Callable[[dict[str, Any]], int],
) -> CallResult:
    """The result of a call the stopping run did not make, or did not wait for."""
    item = not_called.item
    return CallResult(
        item_id=str(item["id"]),
        attempt=item[attempt_field],
        max_attempts=max_attempts(item),
        ok=False,
        code="terminated" if not_called.sent else "not_sent",
        outcome_unknown=not_called.sent,
        released=True,
    )


_STATE_NAMES = {
    "done": "delivered",
    "retry": "retry_scheduled",
    "dead": "dead_lettered",
    "release": "released",
}


def outcome_of(
    decisions: list[tuple[CallResult, Disposition]], recorded: dict[str, str], side_effect: str
) -> BatchOutcome:
    """Counters from what was recorded (``recorded``: item id → done | retry | dead); an item
    missing there lost its claim meanwhile and is counted skipped.

    Each call is one attempt at ``side_effect``: ``success``; ``duplicate_prevented`` when
    the downstream answered that it had this idempotency key already; ``failed``; or
    ``ambiguous`` -- the request may have landed (``<code>_after_send``: a read timeout, a
    reset after sending, an unreadable answer), or it landed and its result could not be
    recorded because the claim had passed to another run (``claim_lost_after_call``), or the
    stopping run did not wait for its answer (``terminated_after_send``). A call the stopping
    run never sent is no attempt; its item is released (counted skipped)."""
    states = [recorded.get(r.item_id) for r, _ in decisions]
    failed = [
        (r.item_id, r.code or "unknown")
        for r, _ in decisions
        if recorded.get(r.item_id) in ("retry", "dead")
    ]
    tally: dict[str, int] = {}
    for r, _ in decisions:  # outcomes by error class and attempt, for the run's report
        klass = "ok" if r.ok else "stopped" if r.released else str(r.error_class or "unknown")
        state = _STATE_NAMES.get(recorded.get(r.item_id) or "", "claim_lost")
        key = f"outcome.{klass}.attempt_{r.attempt}.{state}"
        tally[key] = tally.get(key, 0) + 1
    outcome = BatchOutcome(
        succeeded=states.count("done"),
        failed=len(failed),
        skipped=states.count(None) + states.count("release"),
        retry_scheduled=states.count("retry"),
        deadlettered=states.count("dead"),
        duplicates_prevented=sum(
            1 for r, _ in decisions if r.ok and r.duplicate and r.item_id in recorded
        ),
        failed_items=failed,
        tally=tally,
    )
    for r, _ in decisions:
        if r.ok and r.item_id not in recorded:
            outcome.side_effect(side_effect, "ambiguous", reason="claim_lost_after_call")
        elif r.ok:
            outcome.side_effect(side_effect, "duplicate_prevented" if r.duplicate else "success")
        elif r.released and not r.outcome_unknown:
            continue  # never sent: no attempt at the side effect
        elif r.outcome_unknown:
            reason = "unreadable_answer" if r.code == "bad_response" else f"{r.code}_after_send"
            outcome.side_effect(side_effect, "ambiguous", reason=reason)
        else:
            outcome.side_effect(side_effect, "failed")
    return outcome
