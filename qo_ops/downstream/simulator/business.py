"""The simulator's four business endpoints (fulfilment deliveries and orders, notifications)
as plain ASGI: no framework between uvicorn and them, each request passing the faults in
order (outage, rate limit, latency, poison, error) before the store, then timeout or reset."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any
from urllib.parse import parse_qsl

from starlette.types import Receive, Scope, Send

from qo_ops.downstream.simulator.faults import FaultState
from qo_ops.downstream.simulator.store import Store

DEFAULT_LIST_LIMIT = 500
MAX_LIST_LIMIT = 5000


class BadRequest(Exception):
    """The request is malformed: answered 400 ``{"error": "bad_request", "detail": …}``."""


class _Gone(Exception):
    """The client went away before its request body arrived: nothing to answer."""


async def _answer(
    send: Send, status: int, body: dict[str, Any], headers: tuple[tuple[bytes, bytes], ...] = ()
) -> None:
    """A JSON answer, encoded as Starlette's ``JSONResponse`` does."""
    data = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-length", str(len(data)).encode()),
                (b"content-type", b"application/json"),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": data})


async def _bad(send: Send, detail: str, error: str = "bad_request") -> None:
    await _answer(send, 400, {"error": error, "detail": detail})


async def _body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise _Gone
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _json_object(receive: Receive) -> dict[str, Any]:
    try:
        body = json.loads(await _body(receive))
    except (ValueError, UnicodeDecodeError):
        raise BadRequest("the body must be a JSON object") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


def _header(scope: Scope, name: bytes) -> str:
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return ""


def required_text(body: dict[str, Any], name: str) -> str:
    value = body.get(name)
    if not isinstance(value, str) or not value:
        raise BadRequest(f"{name} must be a non-empty string")
    return value


def _payload(body: dict[str, Any]) -> dict[str, Any]:
    value = body.get("payload", {})
    if not isinstance(value, dict):
        raise BadRequest("payload must be a JSON object")
    return value


async def _drop_connection(send: Send) -> None:
    """Close the client's connection without sending any answer (an injected reset)."""
    cycle = getattr(send, "__self__", None)  # uvicorn's RequestResponseCycle
    transport = getattr(cycle, "transport", None)
    abort = getattr(transport, "abort", None)  # asyncio's or uvloop's transport
    if not callable(abort):
        raise RuntimeError("injected reset needs uvicorn (no transport to drop)")
    abort()
    # Let the server notice the lost connection, so it does not answer 500 instead.
    for _ in range(100):
        if getattr(cycle, "disconnected", True):
            return
        await asyncio.sleep(0.001)


class Business:
    """The fulfilment and notification endpoints, as plain ASGI handlers."""

    def __init__(self, store: Store, state: FaultState) -> None:
        self.store = store
        self.state = state

    async def turned_away(self, send: Send) -> bool:
        """Answer an outage or the rate limit (nothing stored); ``True`` when it did."""
        outage = self.state.faults.outage
        if outage is not None:
            self.store.bump("outage_refused")
            if outage == "refuse":
                await _drop_connection(send)
            else:
                await _answer(send, 503, {"error": "outage"})
            return True
        wait = self.state.rate_limited()
        if wait > 0:
            self.store.bump("rate_limited")
            # Whole seconds, as RFC 9110 writes delay-seconds and strict clients parse it.
            retry_after = str(max(1, math.ceil(wait))).encode()
            await _answer(send, 429, {"error": "rate_limited"}, ((b"retry-after", retry_after),))
            return True
        return False

    async def latency(self) -> None:
        ms = self.state.faults.latency_ms
        if ms > 0:
            await asyncio.sleep(ms / 1000)
            self.store.bump("latency_injected_ms", ms)

    async def poisoned(self, send: Send, key: str, payload: dict[str, Any]) -> bool:
        """Refuse a poison item with 422 (nothing stored); ``True`` when it did."""
        if self.state.is_poison(key, payload):
            self.store.bump("faults_poison")
            await _answer(send, 422, {"error": "poison", "retryable": False})
            return True
        return False

    async def injected_error(self, send: Send) -> None:
        self.store.bump("faults_error")
        await _answer(send, 503, {"error": "injected"})

    async def after_store(self, send: Send, timeout: bool, reset: bool) -> bool:
        """Commit, then apply a timeout (delay) or reset (drop); ``True``: nothing to answer."""
        await self.store.committed()
        if timeout:
            self.store.bump("faults_timeout")
            await asyncio.sleep(self.state.faults.timeout_s)
        elif reset:
            self.store.bump("faults_reset")
            await _drop_connection(send)
            return True
        return False

    async def post_delivery(self, scope: Scope, receive: Receive, send: Send) -> None:
        if await self.turned_away(send):
            return
        await self.latency()
        key = _header(scope, b"idempotency-key").strip()
        if not key:
            return await _bad(
                send, "the Idempotency-Key header is required", "missing_idempotency_key"
            )
        try:
            body = await _json_object(receive)
            tenant_id, order_number = (
                required_text(body, "tenant_id"),
                required_text(body, "order_number"),
            )
            payload = _payload(body)
        except BadRequest as exc:
            return await _bad(send, str(exc))
        if await self.poisoned(send, key, payload):
            return
        error, timeout, reset = self.state.draw()
        if error:
            return await self.injected_error(send)
        delivery, duplicate = self.store.record_delivery(key, tenant_id, order_number, payload)
        if await self.after_store(send, timeout, reset):
            return
        await _answer(
            send,
            200 if duplicate else 201,
            {**delivery, "status": "RECEIVED", "duplicate": duplicate},
        )

    async def post_notification(self, scope: Scope, receive: Receive, send: Send) -> None:
        if await self.turned_away(send):
            return
        await self.latency()
        try:
            body = await _json_object(receive)
            event_id, event_type = (
                required_text(body, "event_id"),
                required_text(body, "event_type"),
            )
            tenant_id, payload = required_text(body, "tenant_id"), _payload(body)
        except BadRequest as exc:
            return await _bad(send, str(exc))
        if await self.poisoned(send, event_id, payload):
            return
        error, timeout, reset = self.state.draw()
        if error:
            return await self.injected_error(send)
        duplicate = self.store.record_notification(event_id, event_type, tenant_id, payload)
        if await self.after_store(send, timeout, reset):
            return
        await _answer(send, 202, {"duplicate": duplicate})

    async def get_order(self, order_number: str, send: Send) -> None:
        if await self.turned_away(send):
            return
        await self.latency()
        error, _, _ = self.state.draw()
        if error:
            return await self.injected_error(send)
        order = self.store.get_order(order_number)
        if order is None:
            return await _answer(send, 404, {"error": "not_found"})
        await _answer(send, 200, order)

    async def list_orders(self, scope: Scope, send: Send) -> None:
        if await self.turned_away(send):
            return
        await self.latency()
        params = dict(parse_qsl(scope["query_string"].decode("latin-1"), keep_blank_values=True))
        tenant_id = params.get("tenant_id", "")
        if not tenant_id:
            return await _bad(send, "the tenant_id query parameter is required")
        try:
            limit = int(params.get("limit", str(DEFAULT_LIST_LIMIT)))
        except ValueError:
            return await _bad(send, "limit must be an integer")
        if limit < 1:
            return await _bad(send, "limit must be at least 1")
        error, _, _ = self.state.draw()
        if error:
            return await self.injected_error(send)
        orders = self.store.list_orders(
            tenant_id, params.get("after") or None, min(limit, MAX_LIST_LIMIT)
        )
        await _answer(send, 200, {"orders": orders})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> bool:
        """Serve the request if it is a business one; ``False`` when it is not."""
        path, method = scope["path"], scope["method"]
        try:
            if path == "/fulfilment/deliveries":
                if method != "POST":
                    return await _not_allowed(send, "POST")
                await self.post_delivery(scope, receive, send)
            elif path == "/notifications":
                if method != "POST":
                    return await _not_allowed(send, "POST")
                await self.post_notification(scope, receive, send)
            elif path == "/fulfilment/orders":
                if method not in ("GET", "HEAD"):
                    return await _not_allowed(send, "GET, HEAD")
                await self.list_orders(scope, send)
            elif path.startswith("/fulfilment/orders/") and "/" not in path[19:] and path[19:]:
                if method not in ("GET", "HEAD"):
                    return await _not_allowed(send, "GET, HEAD")
                await self.get_order(path[19:], send)
            else:
                return False
        except _Gone:
            pass
        return True


async def _not_allowed(send: Send, allow: str) -> bool:
    body = b"Method Not Allowed"
    await send(
        {
            "type": "http.response.start",
            "status": 405,
            "headers": [
                (b"content-length", str(len(body)).encode()),
                (b"content-type", b"text/plain; charset=utf-8"),
                (b"allow", allow.encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
    return True
