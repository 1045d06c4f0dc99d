"""The downstream client's transport over real loopback HTTP/1.1: connections are kept
alive and reused (never more than ``max_connections``), a connection the server closed
while idle is not reused (no false "reset after sending"), a caller that waits too long for
a connection gets a timeout that never left, and each call is a client span whose trace
context reaches the server."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from qo_ops.downstream.client import DownstreamClient, DownstreamError
from qo_ops.platform.calls.retry import ErrorClass
from qo_ops.platform.observability import tracing


@dataclass
class Seen:
    """What the stub server saw: each request's client port and headers; closed sockets."""

    requests: list[tuple[int, dict[str, str]]] = field(default_factory=list)
    closed: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(0))
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def connections(self) -> set[int]:
        return {port for port, _ in self.requests}


class _Handler(BaseHTTPRequestHandler):
    """HTTP/1.1 with keep-alive. ``/healthz`` answers; ``…?drop=1`` answers, then closes the
    connection without saying so (as a server's idle timeout does); ``…?slow=1`` answers
    after half a second."""

    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body are two writes: no delayed-ACK stall
    seen: Seen

    def do_GET(self) -> None:
        with self.seen.lock:
            self.seen.requests.append(
                (self.client_address[1], {k.lower(): v for k, v in self.headers.items()})
            )
        if "slow=1" in self.path:
            time.sleep(0.5)
        body = json.dumps({"status": "ok"}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        if "drop=1" in self.path:
            self.close_connection = True  # no "Connection: close" header: the client can't know

    def log_message(self, *args: object) -> None:
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def shutdown_request(self, request: object) -> None:
        super().shutdown_request(request)  # type: ignore[arg-type]
        self.seen.closed.release()  # type: ignore[attr-defined]


@pytest.fixture
def server() -> Iterator[tuple[str, Seen]]:
    seen = Seen()
    handler = type("Handler", (_Handler,), {"seen": seen})
    httpd = _Server(("127.0.0.1", 0), handler)
    httpd.seen = seen  # type: ignore[attr-defined]
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", seen
    httpd.shutdown()
    httpd.server_close()


def _get(client: DownstreamClient, query: str = "") -> dict[str, object]:
    path = "/healthz" + (f"?{query}" if query else "")
    result: dict[str, object] = client._call("GET", path, "GET /healthz")
    return result


def test_one_connection_serves_many_calls_one_after_another(server) -> None:
    url, seen = server
    with DownstreamClient(url) as client:
        for _ in range(50):
            assert _get(client) == {"status": "ok"}
    assert len(seen.requests) == 50
    assert len(seen.connections) == 1


def test_many_threads_share_at_most_max_connections(server) -> None:
    url, seen = server
    with DownstreamClient(url, max_connections=4) as client, ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda _: _get(client), range(400)))
    assert answers == [{"status": "ok"}] * 400
    assert 1 <= len(seen.connections) <= 4


def test_a_connection_the_server_closed_while_idle_is_not_reused(server) -> None:
    url, seen = server
    with DownstreamClient(url) as client:
        assert _get(client, "drop=1") == {"status": "ok"}
        assert seen.closed.acquire(timeout=10)  # the server has closed that connection
        # reused, it would fail as connection_reset (outcome unknown) although nothing left
        assert _get(client) == {"status": "ok"}
    assert len(seen.connections) == 2


def test_waiting_too_long_for_a_connection_is_a_timeout_that_never_left(server) -> None:
    url, seen = server
    with DownstreamClient(url, max_connections=1, pool_timeout=0.1) as client:
        slow = threading.Thread(target=_get, args=(client, "slow=1"))
        slow.start()
        deadline = time.monotonic() + 10
        while not seen.requests and time.monotonic() < deadline:
            time.sleep(0.01)  # until the slow call holds the only connection
        with pytest.raises(DownstreamError) as caught:
            _get(client)
        slow.join()
    err = caught.value
    assert (err.error_class, err.code) == (ErrorClass.RETRYABLE, "timeout")
    assert not err.outcome_unknown  # it never left: nothing can be there
    assert len(seen.requests) == 1


def test_each_call_is_a_client_span_whose_trace_reaches_the_server(server) -> None:
    url, seen = server
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use_provider(provider)
    try:
        with DownstreamClient(url) as client, tracing.span("batch"):
            _get(client)
            _get(client)
    finally:
        tracing.use_provider(None)
        provider.shutdown()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    calls = [s for s in exporter.get_finished_spans() if s.name == "GET /healthz"]
    assert len(calls) == 2
    for call, (_, headers) in zip(calls, seen.requests, strict=True):
        assert call.parent is not None and call.parent.span_id == spans["batch"].context.span_id
        assert call.attributes["http.request.method"] == "GET"
        assert call.attributes["http.response.status_code"] == 200
        assert call.attributes["url.full"] == f"{url}/healthz"  # no query string
        # W3C traceparent: version-traceid-spanid-flags, the call's own span as the parent
        _, trace_id, span_id, _ = headers["traceparent"].split("-")
        assert (int(trace_id, 16), int(span_id, 16)) == (
            call.context.trace_id,
            call.context.span_id,
        )


def test_without_tracing_no_trace_header_is_sent(server) -> None:
    url, seen = server
    tracing.use_provider(None)
    with DownstreamClient(url) as client:
        _get(client)
    assert "traceparent" not in seen.requests[0][1]


def test_credentials_in_the_url_are_sent_as_basic_auth(server) -> None:
    url, seen = server
    with DownstreamClient(url.replace("http://", "http://ops:s%20cret@")) as client:
        _get(client)
    assert seen.requests[0][1]["authorization"] == "Basic b3BzOnMgY3JldA=="  # ops:s cret
