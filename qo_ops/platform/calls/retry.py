"""The retry model for items that call other systems.

It classifies the error, backs off exponentially with jitter up to a cap, and stops after an
attempt budget. An item that runs out of attempts becomes a dead letter. A person requeues
dead letters with ``qo_ops.platform.actions.recovery``."""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from enum import StrEnum

from qo_ops.config import number
from qo_ops.errors import ConfigError


class ErrorClass(StrEnum):
    """How an item failure should be handled."""

    RETRYABLE = "retryable"  # timeouts, resets, 5xx and 429; the next attempt may succeed
    NON_RETRYABLE = "non_retryable"  # 4xx validation and poison input; retrying cannot help
    UNKNOWN = "unknown"  # treated as retryable, but counted apart


RETRYABLE_HTTP = frozenset({408, 425, 429, 500, 502, 503, 504})
# The dispositions in which the item keeps its attempt.
REFUNDED = frozenset({"release", "wait", "spare", "hold"})


def classify_http_status(status: int) -> ErrorClass:
    """Classify a downstream HTTP answer that was not a success."""
    if status in RETRYABLE_HTTP:
        return ErrorClass.RETRYABLE
    if 400 <= status < 500:
        return ErrorClass.NON_RETRYABLE
    return ErrorClass.UNKNOWN if status < 500 else ErrorClass.RETRYABLE


def classify_exception(exc: BaseException) -> ErrorClass:
    """Classify a transport failure: timeouts and connection errors are retryable."""
    if isinstance(exc, TimeoutError | ConnectionError):
        return ErrorClass.RETRYABLE
    name = type(exc).__name__
    if any(
        part in name for part in ("Timeout", "Connect", "RemoteProtocol", "ReadError", "WriteError")
    ):
        return ErrorClass.RETRYABLE
    if isinstance(exc, ValueError | TypeError | KeyError):
        return ErrorClass.NON_RETRYABLE
    return ErrorClass.UNKNOWN


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff of ``base * 2**(attempt-1)``, capped, with full jitter and an
    attempt budget."""

    base: timedelta = timedelta(seconds=30)
    cap: timedelta = timedelta(hours=1)
    max_attempts: int = 8
    jitter: float = 0.5  # the delay is drawn from [delay * (1 - jitter), delay]

    def delay(self, attempt: int, rng: random.Random | None = None) -> timedelta:
        """The delay before attempt ``attempt + 1``, after ``attempt`` failures (attempt ≥ 1)."""
        if attempt < 1:
            raise ValueError("attempt counts from 1")
        doublings = min(attempt - 1, 64)  # 64 is far past the cap; 2**1024 overflows a float
        raw = min(self.base.total_seconds() * 2**doublings, self.cap.total_seconds())
        low = raw * (1 - self.jitter)
        return timedelta(seconds=(rng or random).uniform(low, raw))

    def decide(self, error: ErrorClass, attempts_so_far: int) -> str:
        """Decide ``retry`` or ``dead_letter`` for an item that just failed its
        ``attempts_so_far``-th try."""
        if error is ErrorClass.NON_RETRYABLE or attempts_so_far >= self.max_attempts:
            return "dead_letter"
        return "retry"


RETRY_BASE_ENV = "QO_OPS_RETRY_BASE_S"
RETRY_CAP_ENV = "QO_OPS_RETRY_CAP_S"
MIN_RETRY_S = 0.01  # a shorter backoff is a hot loop against the other system
MAX_RETRY_S = 7 * 86400.0


def policy_from_env(max_attempts: int = 8, environ: Mapping[str, str] | None = None) -> RetryPolicy:
    """The retry policy of the downstream jobs.

    The base and the cap may be set in the environment. Tests and drills shorten them, and
    production keeps 30 s and 1 h. A value that is not a number of seconds from 0.01 to a
    week raises ``ConfigError``, and so does a cap below the base."""
    base = number(RETRY_BASE_ENV, 30.0, MIN_RETRY_S, MAX_RETRY_S, unit="seconds", environ=environ)
    cap = number(RETRY_CAP_ENV, 3600.0, MIN_RETRY_S, MAX_RETRY_S, unit="seconds", environ=environ)
    if cap < base:
        raise ConfigError(
            f"{RETRY_CAP_ENV} ({cap:g} s) must not be below {RETRY_BASE_ENV} ({base:g} s)"
        )
    return RetryPolicy(
        base=timedelta(seconds=base), cap=timedelta(seconds=cap), max_attempts=max_attempts
    )


@dataclass(frozen=True)
class CallResult:
    """The result of one external call for one claimed item."""

    item_id: str
    attempt: int  # the attempt number this call was (after the claim incremented it)
    max_attempts: int
    ok: bool
    error_class: ErrorClass | None = None
    code: str | None = None
    message: str | None = None
    duplicate: bool = False  # the other system had seen this idempotency key, so not done twice
    outcome_unknown: bool = False  # failed, but the request may have landed
    # The run stopped (SIGTERM) before making this call, or before its answer came (then
    # ``outcome_unknown`` is also set). This is not the item's failure, so its claim and
    # attempt are given back.
    released: bool = False
    # The other system asked to be called less often (429). The item waits ``retry_after_s``
    # and keeps its attempt.
    rate_limited: bool = False
    retry_after_s: float | None = None
    # The call failed while the circuit breaker judged the failures systemic (an outage).
    # This is not the item's failure, so it keeps its attempt.
    spared: bool = False


# After a 429 without a usable Retry-After, the item waits this long and the run pauses as
# long.
DEFAULT_WAIT_S = 1.0


@dataclass(frozen=True)
class Disposition:
    """What to do with an item after a call: delivered, retry after ``delay_s``, or dead."""

    # One of these values:
    # - "done", "retry" or "dead".
    # - "release": the item is due again now.
    # - "wait": the item was rate-limited and is due after Retry-After.
    # - "spare": an outage; the item is due again now.
    # - "hold": a last attempt failed systemically while the downstream was not known to be
    #   up; the item is retried at its backoff.
    # The last four keep their attempt.
    state: str
    delay_s: float = 0.0

    @property
    def refund(self) -> bool:
        """Whether the item gets back the attempt its claim took, because the failure was not
        its own."""
        return self.state in REFUNDED


# Shared, as a Disposition is frozen: most of a batch's results are done (one object each was
# a measurable share of a call's CPU at concurrency 64).
_DONE, _RELEASE, _SPARE = Disposition("done"), Disposition("release"), Disposition("spare")


def dispose(
    result: CallResult, policy: RetryPolicy, rng: random.Random | None = None
) -> Disposition:
    """Apply the retry model to one call result."""
    if result.ok:
        return _DONE
    if result.released:
        return _RELEASE
    if result.rate_limited:
        wait = DEFAULT_WAIT_S if result.retry_after_s is None else result.retry_after_s
        return Disposition("wait", wait)
    if result.spared:
        return _SPARE
    error = result.error_class or ErrorClass.UNKNOWN
    budget = RetryPolicy(policy.base, policy.cap, result.max_attempts, policy.jitter)
    if budget.decide(error, result.attempt) == "dead_letter":
        return Disposition("dead")
    return Disposition("retry", budget.delay(result.attempt, rng).total_seconds())
