"""What the jobs that call the downstream share: their settings and manners (rate limit,
retry budget, the shared circuit breaker), calling the downstream for each claimed item
(delivery_retry, notification_publish), and turning recorded results into a batch outcome.
order_reconciliation shares the manners: :func:`watch_breaker`, :func:`refuse_while_open`
and :func:`finish_lookups`."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from contextlib import suppress
from dataclasses import dataclass, field, replace
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, RowMapping

from qo_ops.config import number, whole_number
from qo_ops.downstream.client import DownstreamClient, DownstreamError, downstream_url
from qo_ops.errors import ConfigError
from qo_ops.platform.calls.breaker import (
    CLOSED,
    OPEN,
    BatchEvidence,
    BreakerSettings,
    CircuitBreaker,
    SharedState,
    Spent,
    read_shared,
    share_batch,
    take_owed,
)
from qo_ops.platform.calls.call_stats import DEPENDENCY_UNAVAILABLE
from qo_ops.platform.calls.external import NotCalled, call_each
from qo_ops.platform.calls.ratelimit import Limiter, SharedTokenBucket, TokenBucket
from qo_ops.platform.calls.retry import (
    CallResult,
    Disposition,
    ErrorClass,
    RetryPolicy,
    policy_from_env,
)
from qo_ops.platform.job.labels import (
    CALL_TIMEOUT,
    ITEM_RETRY_EXHAUSTED,
    ITEM_RETRY_PREFIX,
    retry_reason,
)
from qo_ops.platform.job.outcome import (
    BatchContext,
    BatchOutcome,
    SideEffectResult,
    run_settings,
)

RATE_LIMIT_ENV = "QO_OPS_DOWNSTREAM_RATE_LIMIT"
RETRY_BUDGET_ENV = "QO_OPS_RETRY_BUDGET"
BREAKER_OPEN_ENV = "QO_OPS_BREAKER_OPEN_S"
SYSTEMIC_CODES = frozenset({CALL_TIMEOUT, "connect_error", "connection_reset", "transport_error"})


@dataclass(frozen=True)
class Manners:
    """How a run treats the downstream: its request rate (calls a second to the origin for
    every run, process and pod together; None: no limit of ours), how many retries it may
    make, its circuit breaker."""

    rate_limit: float | None = None
    retry_budget: int = 1000
    breaker: BreakerSettings = field(default_factory=BreakerSettings)


def manners_from_env(environ: Mapping[str, str] | None = None) -> Manners:
    """``QO_OPS_DOWNSTREAM_RATE_LIMIT`` (calls a second for the fleet, per origin; 0 or
    unset: none),
    ``QO_OPS_RETRY_BUDGET`` (calls for items that failed before, per run; default 1000) and
    ``QO_OPS_BREAKER_OPEN_S`` (how long the breaker stays open before a probe; default 30),
    checked (``ConfigError``)."""
    rate = number(RATE_LIMIT_ENV, 0.0, 0.0, 100_000.0, unit="calls a second", environ=environ)
    budget = whole_number(RETRY_BUDGET_ENV, 1000, 0, 10_000_000, unit="calls", environ=environ)
    open_s = number(BREAKER_OPEN_ENV, 30.0, 0.1, 86_400.0, unit="seconds", environ=environ)
    return Manners(rate or None, budget, BreakerSettings(open_s=open_s))


@dataclass(frozen=True)
class CallSettings:
    """What a job that sends items to the downstream works with: where it is, how a failed
    item is retried, and its manners. Read and checked once, before the run claims anything."""

    downstream_url: str
    retry: RetryPolicy
    manners: Manners = field(default_factory=Manners)


def call_settings(environ: Mapping[str, str] | None = None) -> CallSettings:
    """``QO_OPS_DOWNSTREAM_URL``, the retry policy (``QO_OPS_RETRY_BASE_S``/``_CAP_S``) and
    the manners (:func:`manners_from_env`), checked (``ConfigError``): the
    ``validate_settings`` of the jobs that call :func:`call_for_each`."""
    return CallSettings(
        downstream_url(environ), policy_from_env(environ=environ), manners_from_env(environ)
    )


def origin(url: str) -> str:
    """The downstream's name for the breaker and metrics: scheme://host:port (no credentials,
    no path)."""
    import httpx  # only to parse the URL: slow to import, and a job that calls nobody needs none

    parsed = httpx.URL(url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    return f"{parsed.scheme}://{parsed.host}:{port}"


@dataclass
class RunCalls:
    """One run's dealings with the downstream: its client, limiter and breaker, and what its
    calls added up to (for the report). One per run, kept as its run state
    (:func:`run_calls`)."""

    client: DownstreamClient
    limiter: Limiter
    downstream: str
    manners: Manners
    breaker: CircuitBreaker | None = None
    calls: int = 0  # calls sent
    retries: int = 0  # of which for items that had failed before (the retry budget)
    budget_refused: int = 0  # retries not made: the budget was used up
    spared: int = 0  # attempts kept or given back because the downstream was down
    held: int = 0  # last attempts kept: a systemic failure while the downstream was not up
    reported: dict[str, float] = field(default_factory=dict)  # what the tally already has
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def take_call(self, retry: bool) -> bool:
        """Count a call about to go; ``False`` for a retry once the budget is used up."""
        with self._lock:
            if retry and self.retries >= self.manners.retry_budget:
                self.budget_refused += 1
                return False
            self.calls += 1
            self.retries += retry
            return True

    def not_sent(self, retry: bool) -> None:
        """A call counted by :meth:`take_call` did not go after all (breaker, stopping)."""
        with self._lock:
            self.calls -= 1
            self.retries -= retry


def run_calls(ctx: BatchContext, url: str, manners: Manners) -> RunCalls:
    """The run's :class:`RunCalls` for ``url``, made on first use (without a breaker: the
    item jobs load theirs with :func:`prepare_calls`)."""

    def make() -> RunCalls:
        downstream, rate = origin(url), manners.rate_limit
        limiter: Limiter = (  # the fleet's limit, in PostgreSQL; outside a run, this process's
            SharedTokenBucket(ctx.engine, downstream, rate)
            if rate and ctx.engine is not None
            else TokenBucket(rate)
        )
        client = DownstreamClient(url, limiter=limiter, stop=ctx.stop.event)
        return RunCalls(client, limiter, downstream, manners)

    return ctx.run_state(RunCalls, make)


# An order number no tenant has: the downstream answers its lookup 404 when it is up.
PROBE_ORDER = "qo-ops-breaker-probe"


def ask_for_probe(downstream: str, breaker: CircuitBreaker) -> None:
    """One idle probe call to the ``downstream`` origin (``qo_ops.platform.calls.idle_probe``).

    It looks up an order nobody has (``GET /fulfilment/orders/qo-ops-breaker-probe``), the
    cheapest call the jobs make, on the business path an outage stops (a health endpoint
    may answer while that path is down). A 404 is an answer, so the downstream is up; no
    answer or a 5xx is a failure. The breaker hears the answer. The configured
    ``QO_OPS_DOWNSTREAM_URL`` is used when it is this origin (it may carry a path)."""
    base = downstream
    try:
        configured = downstream_url()
    except ConfigError:
        configured = None
    if configured is not None and origin(configured) == downstream:
        base = configured
    # A failure is not raised: the breaker heard how it failed.
    with DownstreamClient(base, breaker=breaker) as client, suppress(DownstreamError):
        client.get_order(PROBE_ORDER)


def downstream_client(
    ctx: BatchContext, url: str, manners: Manners | None = None
) -> DownstreamClient:
    """The run's client for ``url`` (the run's checked setting), made once per run."""
    return run_calls(ctx, url, manners or Manners()).client


def prepare_calls(
    conn: Connection, ctx: BatchContext, side_effect: str, give_back: sa.TextClause, selected: int
) -> BatchOutcome | None:
    """In each claim, before anything is claimed: the run's breaker takes up the shared row
    (:func:`watch_breaker`), and what an outage owes this tenant's items of ``side_effect`` is
    given back (``give_back``: the job's statement over ``:ids``/``:attempts``/``:refunds``/
    ``:revives``). Returns None, or the outcome of a claim refused while the breaker is open
    (:func:`refuse_while_open`): the caller claims nothing."""
    settings = run_settings(ctx, call_settings)
    calls = watch_breaker(conn, ctx, settings.downstream_url, settings.manners)
    _give_back_owed(conn, calls, side_effect, ctx.scope.tenant_id, give_back)
    return refuse_while_open(calls, selected)


def watch_breaker(conn: Connection, ctx: BatchContext, url: str, manners: Manners) -> RunCalls:
    """The run's :class:`RunCalls` with its breaker, which takes up the shared row now: its
    state and evidence; an open one whose probe is due comes back half-open. Each batch of a
    job that calls the downstream does this before it takes any work."""
    calls = run_calls(ctx, url, manners)
    if calls.breaker is None:
        calls.breaker = CircuitBreaker(manners.breaker)
        calls.client.breaker = calls.breaker
    calls.breaker.sync(read_shared(conn, calls.downstream, manners.breaker))
    return calls


def refuse_while_open(calls: RunCalls, selected: int) -> BatchOutcome | None:
    """The outcome of a batch that takes nothing because the breaker is open and its probe
    is not due, or None when the batch may go on.

    The ``selected`` items are counted skipped and not sent (breaker open), and the run
    halts with ``dependency_unavailable``. So each tenant of a chunk stops at its first
    claim, having claimed nothing, once any run opened the breaker."""
    breaker = calls.breaker
    if breaker is None or breaker.state != OPEN:
        return None
    breaker.refuse(selected)
    outcome = BatchOutcome(skipped=selected)
    _report_counts(calls, outcome)
    outcome.halt = (DEPENDENCY_UNAVAILABLE, f"circuit breaker open for {calls.downstream}")
    return outcome


def _give_back_owed(
    conn: Connection, calls: RunCalls, side_effect: str, tenant_id: str, give_back: sa.TextClause
) -> None:
    """Give back what an outage owes the tenant's items (taken off ``downstream_refund``)."""
    owed = take_owed(conn, side_effect, tenant_id)
    if owed:
        given = conn.execute(
            give_back,
            {
                "ids": [o.item_id for o in owed],
                "attempts": [o.attempt for o in owed],
                "refunds": [o.refund for o in owed],
                "revives": [o.revive for o in owed],
            },
        ).rowcount
        calls.spared += given


def claim_seconds(ctx: BatchContext, items: int) -> float:
    """How long a batch's claim hides its items: twice the lease TTL, plus the time our
    rate limit needs to send them and a batch as large before them (so a slow, polite
    batch claimed ahead never outlives its claim)."""
    rate = run_settings(ctx, call_settings).manners.rate_limit
    # overlapped batches: a batch claimed ahead waits for the calls of the one before it
    return 2 * ctx.limits.lease_ttl_s + (2 * items / rate if rate else 0.0)


def systemic(result: CallResult) -> bool:
    """A failure that says the downstream is down or struggling, not that the item is bad:
    no answer (connection error, timeout, reset) or a 5xx."""
    code = result.code or ""
    return (
        not result.ok
        and not result.released
        and not result.rate_limited
        and (code in SYSTEMIC_CODES or code.startswith("http_5"))
    )


@dataclass(frozen=True)
class ClaimedItem:
    """One item a claim took, as its call sees it: its id, the attempt number the claim gave
    it (which its result must match to be recorded), how many attempts it has, and the
    claim's row (the columns the job's statement returned, which its call sends)."""

    id: str
    attempt: int
    max_attempts: int
    row: RowMapping


def call_for_each(
    ctx: BatchContext,
    work: list[ClaimedItem],
    call: Callable[[DownstreamClient, RowMapping], bool],
) -> list[CallResult]:
    """``call(client, item.row)`` for every claimed item, concurrently; failures become
    results. ``call`` answers whether the downstream had already seen the item (a
    duplicate).

    Manners: no call while the breaker is open (the item is released, not failed), a retry
    only within the run's budget, and when the breaker opens during these calls every
    systemic failure among them is spared (the item keeps its attempt).

    With overlapped batches, these calls start before the last batch is recorded. So no
    call of this batch goes once an earlier batch used the retry budget up (its items are
    released unsent, as the next batch of a run that stopped would not have been claimed),
    and the breaker opens "during these calls" also when a record or claim running
    alongside takes up an opening from the shared row."""
    settings = run_settings(ctx, call_settings)
    calls = run_calls(ctx, settings.downstream_url, settings.manners)
    if calls.budget_refused:  # the run stops after the batch that used the budget up
        return [_released(NotCalled(item, sent=False)) for item in work]
    breaker = calls.breaker
    opened_before = breaker.opened if breaker is not None else 0
    closed_before = breaker is not None and breaker.state == CLOSED

    def one(item: ClaimedItem) -> CallResult:
        base: dict[str, Any] = {
            "item_id": item.id,
            "attempt": item.attempt,
            "max_attempts": item.max_attempts,
        }
        retry = item.attempt > 1
        if not calls.take_call(retry):
            return CallResult(**base, ok=False, code="retry_budget", released=True)
        try:
            duplicate = call(calls.client, item.row)
        except DownstreamError as exc:
            if not exc.sent:  # the breaker is open, or the run is stopping: never sent
                calls.not_sent(retry)
                return CallResult(**base, ok=False, code=exc.code, released=True)
            return CallResult(
                **base,
                ok=False,
                error_class=exc.error_class,
                code=exc.code,
                message=exc.message,
                # an unreadable answer came from a request that arrived: its effect is unknown
                outcome_unknown=exc.outcome_unknown or exc.code == "bad_response",
                rate_limited=exc.code == "http_429",
                retry_after_s=exc.retry_after_s,
            )
        return CallResult(**base, ok=True, duplicate=duplicate is True)

    results = call_each(work, one, ctx.limits.concurrency, ctx.stop)
    done = [_released(r) if isinstance(r, NotCalled) else r for r in results]
    opened = breaker is not None and (
        breaker.opened > opened_before or (closed_before and breaker.state == OPEN)
    )
    if opened:
        done = [replace(r, spared=True) if systemic(r) else r for r in done]
    return done


def hold_unless_up(
    ctx: BatchContext, decisions: list[tuple[CallResult, Disposition]], policy: RetryPolicy
) -> list[tuple[CallResult, Disposition]]:
    """A systemic failure dead-letters its item only when the downstream is up (the shared
    evidence knows enough calls and does not say down): otherwise the failure may be the
    outage's, not the item's, and the item is held: it keeps its last attempt and is tried
    again at its backoff."""
    calls = ctx.run_state_if_made(RunCalls)
    breaker = calls.breaker if calls is not None else None
    if breaker is None or breaker.up():
        return decisions
    held = []
    for result, disposition in decisions:
        if disposition.state == "dead" and systemic(result):
            disposition = Disposition("hold", policy.delay(result.attempt).total_seconds())
        held.append((result, disposition))
    return held


@dataclass(frozen=True)
class CallSteps:
    """What :func:`finish_calls` needs of the job: its side effect (which names its items in
    the breaker's evidence) and its statement that gives attempts back."""

    side_effect: str
    give_back: sa.TextClause


def finish_calls(
    conn: Connection,
    ctx: BatchContext,
    decisions: list[tuple[CallResult, Disposition]],
    recorded: dict[str, str],
    steps: CallSteps,
) -> BatchOutcome:
    """The batch's outcome (:func:`outcome_of`), and the run's manners in it: the batch's
    evidence added to the shared row (:func:`~qo_ops.platform.calls.breaker.share_batch`), its
    breaker transitions reported (events, tally); when the breaker opened, what the outage's
    failures spent is given back to this tenant's items now (other tenants' and jobs' at
    their next claim); the run stops when the breaker is open (``dependency_unavailable``)
    or the retry budget is used up."""
    outcome = outcome_of(decisions, recorded, steps.side_effect)
    calls = ctx.run_state_if_made(RunCalls)
    if calls is None:
        return outcome
    calls.spared += sum(1 for r, d in decisions if d.state == "spare" and r.item_id in recorded)
    calls.held += sum(1 for r, d in decisions if d.state == "hold" and r.item_id in recorded)
    breaker = calls.breaker
    if breaker is not None:
        tenant = ctx.scope.tenant_id
        spent = [
            Spent(steps.side_effect, tenant, r.item_id, r.attempt, recorded[r.item_id] == "dead")
            for r, _ in decisions
            if systemic(r) and recorded.get(r.item_id) in ("retry", "dead")
        ]
        if _share(conn, ctx, calls, spent, outcome):
            _give_back_owed(conn, calls, steps.side_effect, tenant, steps.give_back)
    _report_counts(calls, outcome)
    _halt_when_held_back(calls, outcome)
    return outcome


def _halt_when_held_back(calls: RunCalls, outcome: BatchOutcome) -> None:
    """Stop the run after this batch when its manners hold its calls back: the breaker is
    open (``dependency_unavailable``), the fleet's rate limit cannot be read, or the retry
    budget is used up."""
    if calls.breaker is not None and calls.breaker.state == OPEN:
        outcome.halt = (DEPENDENCY_UNAVAILABLE, f"circuit breaker open for {calls.downstream}")
    elif calls.limiter.unavailable:  # no call goes without the fleet's permission
        reason = f"rate limit unavailable for {calls.downstream}: {calls.limiter.unavailable}"
        outcome.halt = (None, reason)
    elif calls.budget_refused:
        outcome.halt = (None, f"retry budget used up ({calls.manners.retry_budget} retries)")


def finish_lookups(
    conn: Connection, ctx: BatchContext, outcome: BatchOutcome, sent: int
) -> BatchOutcome:
    """The run's manners in the outcome of a batch that only asks the downstream
    (order_reconciliation, whose calls use no item's attempt): its ``sent`` calls counted,
    their evidence added to the shared row, its breaker transitions reported, and the run
    stopped when its calls are held back (:func:`_halt_when_held_back`: a lookup not made
    is looked at by a later run, so this run must not go round again)."""
    calls = ctx.run_state_if_made(RunCalls)
    if calls is None or calls.breaker is None:
        return outcome
    with calls._lock:
        calls.calls += sent
    _share(conn, ctx, calls, [], outcome)
    _report_counts(calls, outcome)
    _halt_when_held_back(calls, outcome)
    return outcome


def _share(
    conn: Connection, ctx: BatchContext, calls: RunCalls, spent: list[Spent], outcome: BatchOutcome
) -> bool:
    """Add the batch's evidence to the shared row and report its breaker transitions in
    ``outcome``. Returns whether the breaker is open after it (this run stops too)."""
    breaker = calls.breaker
    assert breaker is not None
    evidence = BatchEvidence(
        calls.downstream, ctx.job_run_id, breaker.take_added(), breaker.drain(), spent
    )
    shared = share_batch(conn, evidence, breaker.settings)
    for t in shared.transitions:
        outcome.tally[f"breaker.{t.to}"] = outcome.tally.get(f"breaker.{t.to}", 0) + 1
        outcome.notes.append(
            (f"downstream.breaker.{t.to}", {"downstream": calls.downstream, "reason": t.reason})
        )
    if shared.transitions and shared.transitions[-1].to == OPEN:
        breaker.sync(SharedState(OPEN))  # opened on the shared evidence: this run stops too
        return True
    return False


def _report_counts(calls: RunCalls, outcome: BatchOutcome) -> None:
    """The run's call counters since the last batch, into the tally (summed per run)."""
    now = {
        "downstream.calls": calls.calls,
        "downstream.retries": calls.retries,
        "downstream.retry_budget_refused": calls.budget_refused,
        "downstream.refused_open": calls.breaker.refused if calls.breaker is not None else 0,
        "downstream.spared": calls.spared,
        "downstream.held": calls.held,
        "downstream.rate_limit_pauses": calls.limiter.pauses,
        "downstream.rate_limit_wait_ms": int(calls.limiter.waited_s * 1000),
    }
    for key, value in now.items():
        delta = int(value - calls.reported.get(key, 0))
        calls.reported[key] = value
        if delta:
            outcome.tally[key] = outcome.tally.get(key, 0) + delta


def _released(not_called: NotCalled[ClaimedItem]) -> CallResult:
    """The result of a call the stopping run did not make, or did not wait for."""
    item = not_called.item
    return CallResult(
        item_id=item.id,
        attempt=item.attempt,
        max_attempts=item.max_attempts,
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
    "wait": "rate_limited",
    "spare": "spared",
    "hold": "held",
}


def _retry_signals(result: CallResult, state: str | None) -> list[str]:
    """The seed's retry signals of one recorded call (``qo_ops.platform.job.labels``): a retry
    scheduled (or a rate-limited wait) by reason, or a dead letter after every attempt."""
    if state in ("retry", "wait", "hold"):
        reason = "dependency_rate_limited" if state == "wait" else retry_reason(result.code)
        return [ITEM_RETRY_PREFIX + reason]
    exhausted = result.error_class is not ErrorClass.NON_RETRYABLE
    if state == "dead" and exhausted and result.attempt >= result.max_attempts:
        return [ITEM_RETRY_EXHAUSTED]
    return []


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
        if recorded.get(r.item_id) in ("retry", "dead", "hold")
    ]
    tally: dict[str, int] = {}
    for r, _ in decisions:  # outcomes by error class and attempt, for the run's report
        klass = "ok" if r.ok else "stopped" if r.released else str(r.error_class or "unknown")
        state = _STATE_NAMES.get(recorded.get(r.item_id) or "", "claim_lost")
        key = f"outcome.{klass}.attempt_{r.attempt}.{state}"
        tally[key] = tally.get(key, 0) + 1
        for signal in _retry_signals(r, recorded.get(r.item_id)):
            tally[signal] = tally.get(signal, 0) + 1
    outcome = BatchOutcome(
        succeeded=states.count("done"),
        failed=len(failed),
        skipped=states.count(None) + states.count("release") + states.count("spare"),
        retry_scheduled=states.count("retry") + states.count("wait") + states.count("hold"),
        deadlettered=states.count("dead"),
        duplicates_prevented=sum(
            1 for r, _ in decisions if r.ok and r.duplicate and r.item_id in recorded
        ),
        failed_items=failed,
        tally=tally,
    )
    for r, _ in decisions:
        if r.ok and r.item_id not in recorded:
            outcome.side_effect(
                side_effect, SideEffectResult.AMBIGUOUS, reason="claim_lost_after_call"
            )
        elif r.ok:
            outcome.side_effect(
                side_effect,
                SideEffectResult.DUPLICATE_PREVENTED if r.duplicate else SideEffectResult.SUCCESS,
            )
        elif r.released and not r.outcome_unknown:
            continue  # never sent: no attempt at the side effect
        elif r.outcome_unknown:
            reason = "unreadable_answer" if r.code == "bad_response" else f"{r.code}_after_send"
            outcome.side_effect(side_effect, SideEffectResult.AMBIGUOUS, reason=reason)
        else:
            outcome.side_effect(side_effect, SideEffectResult.FAILED)
    return outcome
