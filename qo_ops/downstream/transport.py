"""The downstream client's transport: keep-alive HTTP/1.1 connections to one origin, shared
by threads.

Lean on purpose: a call takes an idle connection (last used first) or opens one, sends one
request and reads the whole answer, then gives the connection back. At most
``max_connections`` are open; a caller waits up to ``pool_timeout`` for one. An idle
connection is not reused once the server has closed it, or after ``keepalive_s`` (4 s:
below the 5 s idle timeout of uvicorn, Node and others, so a request does not race the
server's close). A request that got no answer raises :class:`NoAnswer`, saying whether it
may have reached the server.

The HTTP/1.1 of one exchange is written here (:class:`_Connection`), not taken from
``http.client``: a request is one ``sendall``, and an answer is read from the connection's
own buffer, usually in one ``recv``. ``http.client`` made a file object per answer and parsed
its headers with the ``email`` package: at 64 calls at once that was a sixth of a delivery's
CPU (bench/TUNING.md). What it checks is checked here too: no CR, LF or control character in
the request line or a header (refused before anything is sent), bounded status and header
lines, ``Content-Length`` or chunked bodies (else read to the close), ``1xx`` answers
skipped, ``Connection: close`` and HTTP/1.0 honoured. The failures keep ``http.client``'s
exception types, so a failure's kind reads as before.
"""

from __future__ import annotations

import http.client
import re
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
        default_port = self.port == (443 if parts.scheme == "https" else 80)
        host = f"[{self.host}]" if ":" in self.host else self.host  # an IPv6 literal
        self._host_header = host if default_port else f"{host}:{self.port}"
        self._tls = ssl.create_default_context() if parts.scheme == "https" else None
        self._slots = threading.BoundedSemaphore(max_connections)
        self._idle: list[tuple[_Connection, float]] = []  # (connection, idle since)
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
                request = _request_bytes(
                    method, target, self._host_header, {**self.headers, **headers}, body
                )
                conn.sock.sendall(request)
                reading = True
                status, answer_headers, data, will_close = conn.answer(method)
            except Exception as exc:
                conn.close()
                raise _no_answer(exc, reading) from None
            except BaseException:  # e.g. the interpreter shutting down: never reuse it
                conn.close()
                raise
            if will_close:
                conn.close()
            else:
                self._give_back(conn)
            return status, answer_headers, data
        finally:
            self._slots.release()

    def _connect(self) -> _Connection:
        try:  # TCP (and TLS): nothing of the request has left yet
            sock = socket.create_connection((self.host, self.port), timeout=self.connect_timeout)
        except TimeoutError:
            raise NoAnswer(TIMEOUT, False, "ConnectTimeout") from None
        except OSError as exc:  # refused, unreachable, no such host
            raise NoAnswer("connect_error", False, type(exc).__name__) from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock, server_hostname=self.host)
        except TimeoutError:
            sock.close()
            raise NoAnswer(TIMEOUT, False, "ConnectTimeout") from None
        except OSError as exc:  # a TLS failure (ssl.SSLError is an OSError)
            sock.close()
            raise NoAnswer("connect_error", False, type(exc).__name__) from None
        sock.settimeout(self.read_timeout)  # from here on: write and read timeouts
        return _Connection(sock)

    def _take_idle(self) -> _Connection | None:
        """The most recently used idle connection that is still good, if any."""
        now = time.monotonic()
        while True:
            with self._lock:
                if not self._idle:
                    return None
                conn, since = self._idle.pop()
            if now - since < self.keepalive_s and not conn.dropped():
                return conn
            conn.close()

    def _give_back(self, conn: _Connection) -> None:
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


# What a request line and headers may hold: the target no space or control character, a
# header's name a token, its value no CR, LF or NUL (each is a way to smuggle a request)
_BAD_TARGET = re.compile(r"[\x00-\x20\x7f]")
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_BAD_VALUE = re.compile(r"[\r\n\x00]")
_MAX_LINE = 65536  # a status or header line longer than this is no answer (as http.client)
_MAX_HEADERS = 100
_NO_BODY = frozenset((204, 304))


def _request_bytes(
    method: str, target: str, host: str, headers: Mapping[str, str], body: bytes | None
) -> bytes:
    """One request, head and body, ready to send in one write. ``ValueError`` (before
    anything is sent) for a header or target that could split the request."""
    if _BAD_TARGET.search(target) or not _TOKEN.fullmatch(method):
        raise ValueError("illegal request line")
    lines = [f"{method} {target} HTTP/1.1", f"Host: {host}"]
    for name, value in headers.items():
        if not _TOKEN.fullmatch(name) or _BAD_VALUE.search(value):
            raise ValueError("illegal header")
        lines.append(f"{name}: {value}")
    if body is not None:
        lines.append(f"Content-Length: {len(body)}")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")  # as http.client encodes
    return head + body if body is not None else head


class _Connection:
    """One keep-alive HTTP/1.1 connection: its socket, what was read from it and not yet
    used, and a poller to see whether the server closed it while it was idle."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buffer = bytearray()
        self._poller = select.poll()
        self._poller.register(sock, select.POLLIN)

    def close(self) -> None:
        self.sock.close()

    def dropped(self) -> bool:
        """Whether the idle connection can be read from: the server closed it (or sent what
        no request asked for). Either way it must not carry another request."""
        try:
            return bool(self._buffer) or bool(self._poller.poll(0))
        except (OSError, ValueError):
            return True

    def answer(self, method: str) -> tuple[int, dict[str, str], bytes, bool]:
        """The answer to the request just sent: status, headers (lower-case names; a
        repeated one: its last value), body, and whether the connection must close."""
        while True:  # an interim answer (100 Continue, 103 Early Hints) is skipped
            version, status = self._status_line()
            headers = self._headers()
            if not 100 <= status < 200 or status == 101:
                break
        tokens = {t.strip().lower() for t in headers.get("connection", "").split(",")}
        will_close = "close" in tokens or (version == "HTTP/1.0" and "keep-alive" not in tokens)
        will_close = will_close or status == 101  # switched away from HTTP: never reused
        if method == "HEAD" or status in _NO_BODY or 100 <= status < 200:
            body = b""
        elif "chunked" in headers.get("transfer-encoding", "").lower():
            body = self._chunked()
        elif "content-length" in headers:
            length = headers["content-length"].strip()
            if not length.isdigit():
                raise http.client.HTTPException("bad content-length")  # answers nothing
            body = self._exactly(int(length))
        else:  # no length: the body ends when the server closes
            body, will_close = self._to_close(), True
        return status, headers, body, will_close

    def _status_line(self) -> tuple[str, int]:
        line = self._line()
        if not line:
            raise http.client.RemoteDisconnected("closed without an answer")
        parts = line.decode("latin-1").split(None, 2)
        version = parts[0] if parts else ""
        if len(parts) < 2 or not version.startswith("HTTP/1.") or not parts[1].isdigit():
            raise http.client.BadStatusLine("not an HTTP/1.x status line")
        status = int(parts[1])
        if not 100 <= status <= 999:
            raise http.client.BadStatusLine("status out of range")
        return version, status

    def _headers(self) -> dict[str, str]:
        headers: dict[str, str] = {}
        last = ""
        for _ in range(_MAX_HEADERS + 1):
            line = self._line().decode("latin-1")
            if line in ("\r\n", "\n", ""):
                return headers
            if line[0] in " \t" and last:  # an obsolete folded continuation
                headers[last] += " " + line.strip()
                continue
            name, colon, value = line.partition(":")
            if not colon:
                raise http.client.BadStatusLine("a header line without a colon")
            last = name.strip().lower()
            headers[last] = value.strip()
        raise http.client.HTTPException("too many headers")

    def _chunked(self) -> bytes:
        parts: list[bytes] = []
        while True:
            size_field = self._line().split(b";", 1)[0].strip()
            try:
                size = int(size_field, 16)
            except ValueError:
                raise http.client.IncompleteRead(b"".join(parts)) from None
            if size == 0:
                while self._line() not in (b"\r\n", b"\n", b""):
                    pass  # trailers: read, not used
                return b"".join(parts)
            parts.append(self._exactly(size))
            if self._line() not in (b"\r\n", b"\n"):
                raise http.client.IncompleteRead(b"".join(parts))

    def _fill(self) -> bool:
        """Read what the socket has (blocking up to the read timeout); False at its end."""
        chunk = self.sock.recv(65536)
        self._buffer += chunk
        return bool(chunk)

    def _line(self) -> bytes:
        """The next line with its end; what is left if the connection ends first."""
        start = 0
        while (end := self._buffer.find(b"\n", start)) < 0:
            if len(self._buffer) > _MAX_LINE:
                raise http.client.LineTooLong("status or header line")
            start = len(self._buffer)
            if not self._fill():
                end = len(self._buffer) - 1
                break
        line = bytes(self._buffer[: end + 1])
        del self._buffer[: end + 1]
        return line

    def _exactly(self, n: int) -> bytes:
        while len(self._buffer) < n:
            if not self._fill():
                raise http.client.IncompleteRead(bytes(self._buffer), n - len(self._buffer))
        data = bytes(self._buffer[:n])
        del self._buffer[:n]
        return data

    def _to_close(self) -> bytes:
        while self._fill():
            pass
        data = bytes(self._buffer)
        self._buffer.clear()
        return data
