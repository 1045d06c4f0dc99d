"""The client qo-ops uses to call the downstream fulfilment system and notification sink.

One pool of keep-alive connections (``transport.ConnectionPool``, thread-safe) per
``DownstreamClient``. Every failure is a
``DownstreamError`` carrying an ``ErrorClass`` from ``qo_ops.platform.calls.retry``, a short
code (``timeout``, ``connect_error``, ``connection_reset``, ``poison``, ``http_<status>``,
``bad_response``, ``invalid_payload``, ``transport_error``) and a one-line message that
never contains payloads, headers or secrets.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from qo_ops.downstream.transport import ConnectionPool, NoAnswer
from qo_ops.errors import ConfigError, one_line
from qo_ops.platform.calls.breaker import CircuitBreaker
from qo_ops.platform.calls.ratelimit import Limiter, LimiterUnavailable
from qo_ops.platform.calls.retry import DEFAULT_WAIT_S, ErrorClass, classify_http_status
from qo_ops.platform.observability.tracing import client_span

DOWNSTREAM_URL_ENV = "QO_OPS_DOWNSTREAM_URL"
_SAFE_TOKEN = re.compile(r"^[a-z][a-z0-9_]{0,39}$")


@dataclass(frozen=True)
class DeliveryResult:
    """The downstream's answer to a delivery: its id, and whether the key was seen before."""

    delivery_id: str
    duplicate: bool


@dataclass(frozen=True)
class DownstreamOrder:
    """An order as the downstream fulfilment system knows it."""

    order_number: str
    tenant_id: str
    status: str
    updated_at: str


class DownstreamError(Exception):
    """A call to the downstream failed. ``error_class`` says whether retrying can help.

    ``outcome_unknown`` is true when the request may have reached the downstream although no
    answer came back (read timeout, reset after sending): retry with the same idempotency key.
    """

    def __init__(
        self,
        error_class: ErrorClass,
        code: str,
        message: str,
        *,
        outcome_unknown: bool = False,
        retry_after_s: float | None = None,
        sent: bool = True,
    ) -> None:
        self.error_class = error_class
        self.code = code
        self.message = one_line(message, 200)
        self.outcome_unknown = outcome_unknown
        self.retry_after_s = retry_after_s  # the downstream's Retry-After, when it sent one
        self.sent = sent  # False: the client never sent it (breaker open, run stopping)
        super().__init__(f"{code}: {self.message}")

    @property
    def retryable(self) -> bool:
        """True unless retrying cannot help (``NON_RETRYABLE``); ``UNKNOWN`` counts as retryable."""
        return self.error_class is not ErrorClass.NON_RETRYABLE


def _transport_error(exc: NoAnswer, what: str) -> DownstreamError:
    """Map a request that got no HTTP answer to a ``DownstreamError``: timeouts, connection
    failures and resets are retryable; ``outcome_unknown`` when the request may have landed
    (a write/read timeout, a reset after sending), not when it never left (connect)."""
    if exc.code == "transport_error":
        return DownstreamError(ErrorClass.UNKNOWN, "transport_error", f"{what}: {exc.kind}")
    return DownstreamError(
        ErrorClass.RETRYABLE, exc.code, f"{what}: {exc.kind}", outcome_unknown=exc.sent
    )


@dataclass(frozen=True)
class Answer:
    """One HTTP answer as the transport got it: status, headers (lower-case names), body."""

    status: int
    headers: Mapping[str, str]
    body: bytes

    def json(self) -> Any:
        """The body decoded as JSON (``ValueError`` when it is not)."""
        return json.loads(self.body)


MAX_RETRY_AFTER_S = 3600.0  # a longer Retry-After is taken as this: an hour is the retry cap


def retry_after_seconds(value: str | None) -> float | None:
    """A ``Retry-After`` header's delay in seconds (delta-seconds, fractions accepted), at
    most an hour; ``None`` when absent or not a number (an HTTP date is not honoured)."""
    if value is None:
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        return None
    if seconds != seconds or seconds < 0:  # NaN, negative
        return None
    return min(seconds, MAX_RETRY_AFTER_S)


def _http_error(answer: Answer, what: str) -> DownstreamError:
    """Map an unexpected HTTP status to a ``DownstreamError`` (poison has its own code)."""
    status = answer.status
    error = _error_token(answer)
    if status == 422 and error == "poison":
        return DownstreamError(ErrorClass.NON_RETRYABLE, "poison", f"{what}: rejected as poison")
    detail = f" ({error})" if error else ""
    return DownstreamError(
        classify_http_status(status),
        f"http_{status}",
        f"{what}: HTTP {status}{detail}",
        retry_after_s=retry_after_seconds(answer.headers.get("retry-after")),
    )


def _error_token(answer: Answer) -> str | None:
    """The ``error`` field of a JSON error body, only when it is a short, safe token."""
    try:
        body = answer.json()
    except ValueError:
        return None
    error = body.get("error") if isinstance(body, dict) else None
    return error if isinstance(error, str) and _SAFE_TOKEN.match(error) else None


def _acquire(limiter: Limiter, stop: threading.Event | None, what: str) -> bool:
    """The limiter's token (False: the run is stopping). A shared limit that cannot be read
    lets nothing go: ``rate_limit_unavailable``, never sent."""
    try:
        return limiter.acquire(stop)
    except LimiterUnavailable as exc:
        raise DownstreamError(
            ErrorClass.RETRYABLE, "rate_limit_unavailable", f"{what}: {exc}", sent=False
        ) from None


class DownstreamClient:
    """Calls the downstream over HTTP. Safe to share between threads; ``close()`` when done."""

    def __init__(
        self,
        base_url: str,
        connect_timeout: float = 1.0,
        read_timeout: float = 1.0,
        max_connections: int = 64,
        *,
        pool_timeout: float = 30.0,
        limiter: Limiter | None = None,
        breaker: CircuitBreaker | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        # manners (a run's client): the request rate, the shared breaker, the run's stop
        self.limiter, self.breaker, self.stop = limiter, breaker, stop
        self.base_url = base_url.rstrip("/")
        self._pool = ConnectionPool(
            self.base_url,
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            max_connections=max_connections,
            pool_timeout=pool_timeout,
            headers={"user-agent": "qo-ops-downstream-client"},
        )

    def close(self) -> None:
        self._pool.close()

    def __enter__(self) -> DownstreamClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ plumbing

    def _call(
        self,
        method: str,
        path: str,
        what: str,
        *,
        ok: tuple[int, ...] = (200,),
        body: Any = None,
        params: Mapping[str, str | int] | None = None,
        headers: Mapping[str, str] | None = None,
        none_on_404: bool = False,
    ) -> Any:
        """One request; the decoded JSON answer when its status is in ``ok``, ``None`` on a
        not-found 404 when ``none_on_404``, else a ``DownstreamError``. ``what`` names the
        call in messages (a path template: no ids, no payloads)."""
        content = None
        send_headers = dict(headers or {})
        if body is not None:
            try:
                content = json.dumps(body, allow_nan=False).encode()
            except (TypeError, ValueError):
                raise DownstreamError(
                    ErrorClass.NON_RETRYABLE, "invalid_payload", f"{what}: body is not valid JSON"
                ) from None
            send_headers["content-type"] = "application/json"
        answer = self._mannerly(method, path, what, content, params, send_headers)
        if none_on_404 and answer.status == 404 and _error_token(answer) == "not_found":
            return None
        if answer.status not in ok:
            raise _http_error(answer, what)
        try:
            return answer.json()
        except ValueError:
            raise DownstreamError(
                ErrorClass.UNKNOWN, "bad_response", f"{what}: HTTP {answer.status}, not JSON"
            ) from None

    def _mannerly(
        self,
        method: str,
        path: str,
        what: str,
        content: bytes | None,
        params: Mapping[str, str | int] | None,
        headers: Mapping[str, str],
    ) -> Answer:
        """``_request`` as a polite client makes it: not while the breaker is open, at most
        the limiter's rate, everyone paused for a ``429``'s ``Retry-After``; each answer
        told to the breaker (a 5xx or no answer: failed; a 429: neither; else: up)."""
        breaker = self.breaker
        ticket = breaker.allow(self.stop) if breaker is not None else None
        if breaker is not None and ticket is None:
            raise DownstreamError(
                ErrorClass.RETRYABLE, "circuit_open", f"{what}: circuit open", sent=False
            )
        told = False  # the breaker hears of every ticket it gave: its evidence is in start order
        try:
            if self.limiter is not None and not _acquire(self.limiter, self.stop, what):
                raise DownstreamError(
                    ErrorClass.RETRYABLE, "not_sent", f"{what}: stopping", sent=False
                )
            try:
                answer = self._request(method, path, what, content, params, headers)
            except DownstreamError as exc:
                if breaker is not None and ticket is not None:
                    breaker.failed(ticket, exc.code)
                    told = True
                raise
            if answer.status == 429 and self.limiter is not None:
                retry_after = retry_after_seconds(answer.headers.get("retry-after"))
                self.limiter.pause(DEFAULT_WAIT_S if retry_after is None else retry_after)
            if breaker is not None and ticket is not None:
                if answer.status >= 500:
                    breaker.failed(ticket, f"http_{answer.status}")
                elif answer.status != 429:  # a 429 says nothing about health
                    breaker.succeeded(ticket)
                else:
                    breaker.neutral(ticket)
                told = True
            return answer
        finally:
            if breaker is not None and ticket is not None and not told:
                breaker.neutral(ticket)  # not sent after all (stopping), or a bug

    def _request(
        self,
        method: str,
        path: str,
        what: str,
        content: bytes | None,
        params: Mapping[str, str | int] | None,
        headers: Mapping[str, str],
    ) -> Answer:
        """The transport: one request, its answer, or a ``DownstreamError`` when no answer
        came (timeouts, connection errors). Each request is a span of the run's trace when
        tracing is on (named by ``what``, a path template: no ids)."""
        target = self._pool.target(path, params)
        send = dict(headers)
        with client_span(what, method, f"{self.base_url}{path}", send) as traced:
            try:
                status, answer_headers, body = self._pool.request(method, target, content, send)
            except NoAnswer as exc:
                if traced is not None:
                    traced.set_failure(exc.kind)
                raise _transport_error(exc, what) from None
            if traced is not None:
                traced.set_answer(status)
        return Answer(status, answer_headers, body)

    @staticmethod
    def _order(data: Any, what: str) -> DownstreamOrder:
        try:
            return DownstreamOrder(
                order_number=str(data["order_number"]),
                tenant_id=str(data["tenant_id"]),
                status=str(data["status"]),
                updated_at=str(data["updated_at"]),
            )
        except (KeyError, TypeError):
            raise DownstreamError(
                ErrorClass.UNKNOWN, "bad_response", f"{what}: unexpected answer"
            ) from None

    # ------------------------------------------------------------------ fulfilment

    def submit_delivery(
        self, idempotency_key: str, tenant_id: str, order_number: str, payload: Mapping[str, Any]
    ) -> DeliveryResult:
        """Hand an order to fulfilment, at most once per ``idempotency_key``: a repeated key
        answers the original ``delivery_id`` with ``duplicate=True``."""
        what = "POST /fulfilment/deliveries"
        if not idempotency_key or not idempotency_key.isascii():
            raise DownstreamError(
                ErrorClass.NON_RETRYABLE, "invalid_payload", f"{what}: bad idempotency key"
            )
        data = self._call(
            "POST",
            "/fulfilment/deliveries",
            what,
            ok=(200, 201),
            body={"tenant_id": tenant_id, "order_number": order_number, "payload": dict(payload)},
            headers={"Idempotency-Key": idempotency_key},
        )
        try:
            return DeliveryResult(str(data["delivery_id"]), bool(data["duplicate"]))
        except (KeyError, TypeError):
            raise DownstreamError(
                ErrorClass.UNKNOWN, "bad_response", f"{what}: unexpected answer"
            ) from None

    def get_order(self, order_number: str) -> DownstreamOrder | None:
        """The downstream's view of an order, or ``None`` when it does not know it."""
        what = "GET /fulfilment/orders/{order_number}"
        data = self._call(
            "GET", f"/fulfilment/orders/{quote(order_number, safe='')}", what, none_on_404=True
        )
        return None if data is None else self._order(data, what)

    def list_orders(
        self, tenant_id: str, after: str | None = None, limit: int = 500
    ) -> list[DownstreamOrder]:
        """One page of a tenant's downstream orders, by order number, after ``after``
        (the server caps ``limit`` at 5000)."""
        what = "GET /fulfilment/orders"
        params: dict[str, str | int] = {"tenant_id": tenant_id, "limit": limit}
        if after is not None:
            params["after"] = after
        data = self._call("GET", "/fulfilment/orders", what, params=params)
        if not isinstance(data, dict) or not isinstance(data.get("orders"), list):
            raise DownstreamError(ErrorClass.UNKNOWN, "bad_response", f"{what}: unexpected answer")
        return [self._order(o, what) for o in data["orders"]]

    def iter_orders(self, tenant_id: str, page_size: int = 500) -> Iterator[DownstreamOrder]:
        """Every downstream order of a tenant, page by page (keyset on order number)."""
        after: str | None = None
        while True:
            page = self.list_orders(tenant_id, after=after, limit=page_size)
            yield from page
            if len(page) < page_size:
                return
            after = page[-1].order_number

    # ------------------------------------------------------------------ notifications

    def publish_notification(
        self, event_id: str, event_type: str, tenant_id: str, payload: Mapping[str, Any]
    ) -> bool:
        """Publish an event; ``True`` when the sink had already received this event id."""
        what = "POST /notifications"
        data = self._call(
            "POST",
            "/notifications",
            what,
            ok=(202,),
            body={
                "event_id": event_id,
                "event_type": event_type,
                "tenant_id": tenant_id,
                "payload": dict(payload),
            },
        )
        if not isinstance(data, dict) or "duplicate" not in data:
            raise DownstreamError(ErrorClass.UNKNOWN, "bad_response", f"{what}: unexpected answer")
        return bool(data["duplicate"])

    # ------------------------------------------------------------------ admin (simulator)

    def stats(self, detail: bool = True) -> dict[str, Any]:
        """The simulator's counters (``detail=False`` leaves out the per-key maps)."""
        params = None if detail else {"detail": 0}
        result: dict[str, Any] = self._call(
            "GET", "/admin/stats", "GET /admin/stats", params=params
        )
        return result

    def set_faults(self, **fields: Any) -> dict[str, Any]:
        """Change some fault settings at run time; returns all current settings."""
        result: dict[str, Any] = self._call(
            "POST", "/admin/faults", "POST /admin/faults", body=fields
        )
        return result

    def put_order(self, order_number: str, tenant_id: str, status: str) -> DownstreamOrder:
        """Plant or change an order in the downstream (for reconciliation tests)."""
        what = "PUT /admin/orders/{order_number}"
        data = self._call(
            "PUT",
            f"/admin/orders/{quote(order_number, safe='')}",
            what,
            body={"tenant_id": tenant_id, "status": status},
        )
        return self._order(data, what)

    def delete_order(self, order_number: str) -> bool:
        """Remove an order from the downstream; ``True`` when it was there."""
        what = "DELETE /admin/orders/{order_number}"
        data = self._call("DELETE", f"/admin/orders/{quote(order_number, safe='')}", what)
        return bool(data.get("deleted")) if isinstance(data, dict) else False

    def reset(self) -> None:
        """Forget every delivery, order, notification and counter (faults stay as they are)."""
        self._call("POST", "/admin/reset", "POST /admin/reset")

    def healthy(self) -> bool:
        """``True`` when the service answers ``/healthz``."""
        try:
            self._call("GET", "/healthz", "GET /healthz")
        except DownstreamError:
            return False
        return True


def downstream_url(environ: Mapping[str, str] | None = None) -> str:
    """``QO_OPS_DOWNSTREAM_URL``, checked: an http(s) URL with a host. Unset, blank or
    anything else raises ``ConfigError`` (one line, no password shown)."""
    env = os.environ if environ is None else environ
    url = (env.get(DOWNSTREAM_URL_ENV) or "").strip()
    if not url:
        raise ConfigError(
            f"{DOWNSTREAM_URL_ENV} is not set: give the downstream's base URL, "
            "e.g. http://127.0.0.1:8089 (`qo-ops downstream` runs a simulator)"
        )
    import httpx  # only to parse the URL: slow to import, and a job that calls nobody needs none

    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, ValueError):
        parsed = None
    if (
        parsed is None
        or parsed.scheme not in ("http", "https")
        or not parsed.host
        or "%" in parsed.host  # httpx quotes what no host name may hold (a space…)
        or not 1 <= (80 if parsed.port is None else parsed.port) <= 65535
    ):
        raise ConfigError(f"{DOWNSTREAM_URL_ENV} must be an http(s) URL with a host, got {url!r}")
    return url


def client_from_env(environ: Mapping[str, str] | None = None, **options: Any) -> DownstreamClient:
    """A client for ``QO_OPS_DOWNSTREAM_URL`` (:func:`downstream_url`); ``options`` go to
    ``DownstreamClient``."""
    return DownstreamClient(downstream_url(environ), **options)
