"""The downstream client's transport: keep-alive HTTP/1.1 connections to one origin, shared
by threads (the standard library's ``http.client``, pooled).

Lean on purpose: a call takes an idle connection (last used first) or opens one, sends one
request and reads the whole answer, then gives the connection back. At most
``max_connections`` are open; a caller waits up to ``pool_timeout`` for one. An idle
connection is not reused once the server has closed it, or after ``keepalive_s`` (4 s:
below the 5 s idle timeout of uvicorn, Node and others, so a request does not race the
server's close). A request that got no answer raises :class:`NoAnswer`, saying whether it
may have reached the server.
"""

from __future__ import annotations

import http.client
import select
import socket
import ssl
import threading
import time
from base64 import b64encode
from collections.abc import Mapping
from urllib.parse import unquote, urlencode, urlsplit

KEEPALIVE_S = 4.0
# The failure code of a call that got no answer in time (labels.CALL_TIMEOUT: the transport
# imports nothing of qo_ops)
TIMEOUT = "timeout"


class NoAnswer(Exception):
    """No HTTP answer came. ``code``: ``timeout``, ``connect_error``, ``connection_reset`` or
    ``transport_error``; ``sent``: the request may have reached the server; ``kind``: the
    underlying failure's type name (never its text: it may quote what was sent)."""

    def __init__(self, code: str, sent: bool, kind: str) -> None:
        self.code, self.sent, self.kind = code, sent, kind
        super().__init__(f"{code} ({kind})")


def _no_answer(exc: BaseException, reading: bool) -> NoAnswer:
    """A failure once the connection was open: the request may have landed, except when it
    was refused locally before anything was written."""
    kind = type(exc).__name__
    if isinstance(exc, TimeoutError):  # socket.timeout while writing or reading
        return NoAnswer(TIMEOUT, True, "ReadTimeout" if reading else "WriteTimeout")
    if isinstance(exc, OSError | http.client.HTTPException):  # reset, EOF, a garbled answer
        return NoAnswer("connection_reset", True, kind)
    return NoAnswer("transport_error", False, kind)  # e.g. an illegal header value


class ConnectionPool:
    """Keep-alive connections to the origin of ``base_url``; safe to share between threads."""

    def __init__(
        self,
        base_url: str,
        *,
        connect_timeout: float,
        read_timeout: float,
        max_connections: int,
        pool_timeout: float,
        headers: Mapping[str, str] | None = None,
        keepalive_s: float = KEEPALIVE_S,
    ) -> None:
        parts = urlsplit(base_url)
        self.scheme = parts.scheme
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.base_path = parts.path.rstrip("/")
        self.connect_timeout, self.read_timeout = connect_timeout, read_timeout
        self.pool_timeout, self.keepalive_s = pool_timeout, keepalive_s
        self.headers = dict(headers or {})
        if parts.username is not None:  # credentials in the URL: HTTP basic auth, as httpx did
            secret = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
            self.headers["authorization"] = f"Basic {b64encode(secret.encode()).decode()}"
        self._tls = ssl.create_default_context() if parts.scheme == "https" else None
        self._slots = threading.BoundedSemaphore(max_connections)
        self._idle: list[tuple[http.client.HTTPConnection, float]] = []  # (connection, idle since)
        self._lock = threading.Lock()
        self._closed = False

    def target(self, path: str, params: Mapping[str, str | int] | None = None) -> str:
        """The request target of ``path`` (under the base URL's path) with ``params``."""
        query = f"?{urlencode(params)}" if params else ""
        return f"{self.base_path}{path}{query}"

    def request(
        self, method: str, target: str, body: bytes | None, headers: Mapping[str, str]
    ) -> tuple[int, dict[str, str], bytes]:
        """Send one request; its status, headers (lower-case names) and body, or
        :class:`NoAnswer`."""
        if not self._slots.acquire(timeout=self.pool_timeout):
            raise NoAnswer(TIMEOUT, False, "PoolTimeout")
        try:
            conn = self._take_idle() or self._connect()
            reading = False
            try:
                conn.request(method, target, body=body, headers={**self.headers, **headers})
                reading = True
                response = conn.getresponse()
                data = response.read()
            except Exception as exc:
                conn.close()
                raise _no_answer(exc, reading) from None
            except BaseException:  # e.g. the interpreter shutting down: never reuse it
                conn.close()
                raise
            if response.will_close:
                conn.close()
            else:
                self._give_back(conn)
            return response.status, {k.lower(): v for k, v in response.getheaders()}, data
        finally:
            self._slots.release()

    def _connect(self) -> http.client.HTTPConnection:
        conn: http.client.HTTPConnection
        if self._tls is not None:
            conn = http.client.HTTPSConnection(
                self.host, self.port, timeout=self.connect_timeout, context=self._tls
            )
        else:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=self.connect_timeout)
        try:
            conn.connect()  # TCP (and TLS): nothing of the request has left yet
        except TimeoutError:
            conn.close()
            raise NoAnswer(TIMEOUT, False, "ConnectTimeout") from None
        except OSError as exc:  # refused, unreachable, no such host, a TLS failure
            conn.close()
            raise NoAnswer("connect_error", False, type(exc).__name__) from None
        assert conn.sock is not None
        conn.sock.settimeout(self.read_timeout)  # from here on: write and read timeouts
        return conn

    def _take_idle(self) -> http.client.HTTPConnection | None:
        """The most recently used idle connection that is still good, if any."""
        now = time.monotonic()
        while True:
            with self._lock:
                if not self._idle:
                    return None
                conn, since = self._idle.pop()
            if now - since < self.keepalive_s and not _dropped(conn.sock):
                return conn
            conn.close()

    def _give_back(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append((conn, time.monotonic()))
                return
        conn.close()

    def close(self) -> None:
        """Close the idle connections; those in use close when their call ends."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn, _ in idle:
            conn.close()


def _dropped(sock: socket.socket | None) -> bool:
    """Whether an idle connection can be read from: the server closed it (or sent what no
    request asked for). Either way it must not carry another request."""
    if sock is None:
        return True
    try:
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return True
