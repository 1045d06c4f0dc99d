"""The transport's own HTTP/1.1 against a real loopback server that answers with scripted
bytes: each answer shape a server may send is read whole (chunked with trailers, an interim
``100 Continue``, a body that ends at the close, a ``HEAD``), a connection is reused only
when the answer says it may be and nothing is left over, a garbled or cut answer is a reset
whose outcome is unknown, and a header that would split the request is refused before
anything leaves."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

from qo_ops.downstream.client import DownstreamClient, DownstreamError
from qo_ops.platform.calls.retry import ErrorClass

OK_JSON = b'{"status": "ok"}'


def _answer(body: bytes = OK_JSON, *head: bytes) -> bytes:
    lines = [b"HTTP/1.1 200 OK", b"Content-Type: application/json", *head]
    if not any(h.lower().startswith((b"content-length", b"transfer-encoding")) for h in head):
        lines.append(b"Content-Length: " + str(len(body)).encode())
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


@dataclass
class Wire:
    """What the scripted server saw (each request's head, by connection), and what it
    answers: ``script(n)`` gives the n-th request's bytes to send and whether to close."""

    script: Callable[[int], tuple[bytes, bool]]
    requests: list[tuple[int, bytes]] = field(default_factory=list)
    connections: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def _read_request(conn: socket.socket, pending: bytearray) -> bytes | None:
    """One request's head (and its body, by Content-Length) off ``conn``; None at its end."""
    while b"\r\n\r\n" not in pending:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        pending += chunk
    end = pending.index(b"\r\n\r\n") + 4
    head = bytes(pending[:end])
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    while len(pending) < end + length:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        pending += chunk
    del pending[: end + length]
    return head


def _serve(listener: socket.socket, wire: Wire) -> None:
    def one(conn: socket.socket, number: int) -> None:
        pending = bytearray()
        with conn:
            while (head := _read_request(conn, pending)) is not None:
                with wire.lock:
                    n = len(wire.requests)
                    wire.requests.append((number, head))
                data, close = wire.script(n)
                conn.sendall(data)
                if close:
                    conn.shutdown(socket.SHUT_WR)
                    return

    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        with wire.lock:
            wire.connections += 1
            number = wire.connections
        threading.Thread(target=one, args=(conn, number), daemon=True).start()


@pytest.fixture
def scripted() -> Iterator[Callable[[Callable[[int], tuple[bytes, bool]]], tuple[str, Wire]]]:
    listeners: list[socket.socket] = []

    def start(script: Callable[[int], tuple[bytes, bool]]) -> tuple[str, Wire]:
        listener = socket.create_server(("127.0.0.1", 0))
        listeners.append(listener)
        wire = Wire(script)
        threading.Thread(target=_serve, args=(listener, wire), daemon=True).start()
        return f"http://127.0.0.1:{listener.getsockname()[1]}", wire

    yield start
    for listener in listeners:
        listener.close()


def _get(client: DownstreamClient, method: str = "GET", **kw: object) -> object:
    return client._call(method, "/healthz", "GET /healthz", **kw)  # type: ignore[arg-type]


def test_a_chunked_answer_with_trailers_is_read_whole_and_the_connection_reused(
    scripted,
) -> None:
    chunked = _answer(
        b'5\r\n{"sta\r\n4;ext=1\r\ntus"\r\nA\r\n: "ok"}   \r\n0\r\nX-Trailer: t\r\n\r\n',
        b"Transfer-Encoding: chunked",
    )
    url, wire = scripted(lambda n: (chunked, False))
    with DownstreamClient(url) as client:
        assert [_get(client) for _ in range(3)] == [{"status": "ok"}] * 3
    assert wire.connections == 1


def test_an_interim_100_continue_is_skipped(scripted) -> None:
    url, wire = scripted(lambda n: (b"HTTP/1.1 100 Continue\r\n\r\n" + _answer(), False))
    with DownstreamClient(url) as client:
        assert _get(client) == {"status": "ok"}
        assert _get(client) == {"status": "ok"}  # nothing of the first answer left over
    assert wire.connections == 1


def test_a_body_without_length_ends_at_the_close_and_that_connection_is_not_reused(
    scripted,
) -> None:
    url, wire = scripted(lambda n: (b"HTTP/1.0 200 OK\r\n\r\n" + OK_JSON, True))
    with DownstreamClient(url) as client:
        assert _get(client) == {"status": "ok"}
        assert _get(client) == {"status": "ok"}
    assert wire.connections == 2


@pytest.mark.parametrize(
    "head",
    [b"Connection: close", b"Connection: keep-alive, Close"],
)
def test_an_answer_that_says_close_is_not_reused(scripted, head: bytes) -> None:
    url, wire = scripted(lambda n: (_answer(OK_JSON, head), False))  # the server keeps it open
    with DownstreamClient(url) as client:
        assert _get(client) == {"status": "ok"}
        assert _get(client) == {"status": "ok"}
    assert wire.connections == 2


def test_http_1_0_with_keep_alive_is_reused(scripted) -> None:
    answer = _answer(OK_JSON, b"Connection: keep-alive").replace(b"HTTP/1.1", b"HTTP/1.0", 1)
    url, wire = scripted(lambda n: (answer, False))
    with DownstreamClient(url) as client:
        assert _get(client) == {"status": "ok"}
        assert _get(client) == {"status": "ok"}
    assert wire.connections == 1


def test_bytes_no_request_asked_for_keep_the_connection_from_reuse(scripted) -> None:
    url, wire = scripted(lambda n: (_answer() + b"HTTP/1.1 200 OK\r\n", False))
    with DownstreamClient(url) as client:
        assert _get(client) == {"status": "ok"}
        # reused, the leftover would be read as the next answer (or a garbled one)
        assert _get(client) == {"status": "ok"}
    assert wire.connections == 2


def test_a_head_answer_has_no_body_even_with_a_length(scripted) -> None:
    answer = _answer(b"", b"Content-Length: 16")  # the length a GET would have had
    url, wire = scripted(lambda n: (answer, False))
    with DownstreamClient(url) as client:
        for _ in range(2):
            with pytest.raises(DownstreamError) as caught:
                _get(client, "HEAD")
            assert caught.value.code == "bad_response"  # answered (200), just no JSON
    assert wire.connections == 1


@pytest.mark.parametrize(
    ("answer", "kind"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 40\r\n\r\n" + OK_JSON, "IncompleteRead"),
        (b"SMTP ready\r\n\r\n", "BadStatusLine"),
        (b"HTTP/1.1 2xx OK\r\n\r\n", "BadStatusLine"),
        (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "BadStatusLine"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", "HTTPException"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "IncompleteRead"),
        (b"HTTP/1.1 200 OK\r\nX: " + b"a" * 70_000, "LineTooLong"),
        (b"", "RemoteDisconnected"),
    ],
)
def test_a_cut_or_garbled_answer_is_a_reset_whose_outcome_is_unknown(
    scripted, answer: bytes, kind: str
) -> None:
    url, wire = scripted(lambda n: (answer, True) if n == 0 else (_answer(), False))
    with DownstreamClient(url) as client:
        with pytest.raises(DownstreamError) as caught:
            _get(client)
        err = caught.value
        assert (err.error_class, err.code, err.outcome_unknown) == (
            ErrorClass.RETRYABLE,
            "connection_reset",
            True,
        )
        assert str(err).endswith(kind)
        assert _get(client) == {"status": "ok"}  # on a new connection
    assert wire.connections == 2


@pytest.mark.parametrize(
    "headers",
    [{"x-note": "a\r\nX-Injected: yes"}, {"x-note": "a\nb"}, {"bad name": "v"}, {"x": "\x00"}],
)
def test_a_header_that_could_split_the_request_is_refused_before_anything_leaves(
    scripted, headers: dict[str, str]
) -> None:
    url, wire = scripted(lambda n: (_answer(), False))
    with DownstreamClient(url) as client:
        with pytest.raises(DownstreamError) as caught:
            _get(client, headers=headers)
        assert (caught.value.code, caught.value.outcome_unknown) == ("transport_error", False)
        assert _get(client) == {"status": "ok"}
    assert len(wire.requests) == 1  # only the good one
    assert b"Injected" not in wire.requests[0][1]


def test_the_request_is_one_well_formed_write(scripted) -> None:
    url, wire = scripted(lambda n: (_answer(), False))
    with DownstreamClient(url) as client:
        client._call("POST", "/fulfilment/deliveries", "POST", body={"a": 1}, ok=(200,))
    head = wire.requests[0][1]
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /fulfilment/deliveries HTTP/1.1"
    port = url.rsplit(":", 1)[1].encode()
    assert b"Host: 127.0.0.1:" + port in lines
    assert b"Content-Length: 8" in lines  # {"a": 1}
    assert b"content-type: application/json" in [line.lower() for line in lines]
