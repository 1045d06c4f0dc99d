"""The fastest clients we have for the simulator, with no qo-ops and no database: the limit
a job's delivery rate is compared with ("the fastest bare client at the same concurrency").

``bare_rate(url, concurrency, seconds=… | count=…)`` posts deliveries (``POST
/fulfilment/deliveries``, a fresh ``Idempotency-Key`` each) from ``concurrency`` keep-alive
connections, each with one request in flight, and returns deliveries per second. What is
posted is a :class:`BareRequest` (its path, the body and headers for a fresh key, the status
that means "stored"): deliveries by default, a notification for the downstream section.
With ``count``, every request is built before the clock starts. Two kinds:

* ``asyncio``: one event loop (uvloop when installed), raw streams, HTTP/1.1 written and
  parsed by hand: the least client CPU per request we know how to spend in Python;
* ``threads``: a thread per connection, each with its own stdlib ``http.client`` connection;
* ``sockets``: a thread per connection, each a raw socket: the request's prebuilt bytes in
  one ``sendall``, the answer read with ``recv`` until its head and ``Content-Length`` are in
  (what the jobs' own transport does per call since 2026-12-07, minus its checks).

``limit_rate`` measures all three and returns the fastest. Every answer must be the request's
status (``201`` for a delivery): anything else (a fault, a duplicate, a 429) raises
``BareClientError``, so a figure always means that many distinct items were stored.
``http_client_sender`` is the ``threads`` kind's connection as a function, for a caller that
brings its own threads.

    python -m bench.bare_client --latency-ms 20 --concurrency 32 64 --seconds 5

starts a fresh simulator per measurement and prints the rate, the ideal (concurrency ÷
latency) and the CPU of the simulator and of this client per delivery.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import resource
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

KINDS = ("asyncio", "threads", "sockets")
TENANT = "tenant-bare"
PATH = "/fulfilment/deliveries"


class BareClientError(RuntimeError):
    """The simulator answered something other than the request's status (or not at all)."""


@dataclass(frozen=True)
class BareRequest:
    """What a bare client posts: to ``path``, the JSON body and extra headers ``body(key)``
    builds for a fresh, unique ``key``; ``status`` is the answer that means it was stored."""

    path: str
    body: Callable[[str], tuple[bytes, dict[str, str]]]
    status: int


def delivery(tenant: str) -> BareRequest:
    """A delivery of ``tenant`` keyed (and numbered) by the fresh key: answered 201."""

    def body(key: str) -> tuple[bytes, dict[str, str]]:
        doc = {"tenant_id": tenant, "order_number": key, "payload": {"lines": 1}}
        return json.dumps(doc, separators=(",", ":")).encode(), {"Idempotency-Key": key}

    return BareRequest(PATH, body, 201)


DELIVERY = delivery(TENANT)


@dataclass(frozen=True)
class BareRun:
    """One measurement: ``deliveries`` stored in ``elapsed_s`` by ``kind`` at ``concurrency``."""

    kind: str
    concurrency: int
    deliveries: int
    elapsed_s: float
    client_cpu_s: float  # this process, user + system, during the measurement

    @property
    def per_s(self) -> float:
        return self.deliveries / self.elapsed_s if self.elapsed_s > 0 else 0.0


def bare_rate(
    url: str,
    concurrency: int,
    *,
    seconds: float | None = None,
    count: int | None = None,
    kind: str = "asyncio",
    request: BareRequest = DELIVERY,
) -> float:
    """Deliveries (``request``\ s) per second from ``concurrency`` bare connections: for
    ``seconds`` of wall time, or until ``count`` were answered (exactly one of the two)."""
    return bare_run(
        url, concurrency, seconds=seconds, count=count, kind=kind, request=request
    ).per_s


def limit_rate(
    url: str, concurrency: int, *, seconds: float | None = None, count: int | None = None
) -> float:
    """The fastest of the bare clients (``KINDS``) at this concurrency, deliveries per second."""
    return max(bare_rate(url, concurrency, seconds=seconds, count=count, kind=k) for k in KINDS)


def bare_run(
    url: str,
    concurrency: int,
    *,
    seconds: float | None = None,
    count: int | None = None,
    kind: str = "asyncio",
    request: BareRequest = DELIVERY,
) -> BareRun:
    """Like ``bare_rate``, with the details (deliveries, elapsed time, client CPU)."""
    if (seconds is None) == (count is None):
        raise ValueError("give exactly one of seconds and count")
    if (
        concurrency < 1
        or (seconds is not None and seconds <= 0)
        or (count is not None and count < 1)
    ):
        raise ValueError("concurrency, seconds and count must be positive")
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}")
    host, port = _host_port(url)
    requests = _Requests(request, host, port, count)
    budget = _Budget(count, seconds)
    cpu = _own_cpu_s()
    started = time.perf_counter()
    if kind == "asyncio":
        _run_asyncio(host, port, concurrency, budget, requests)
    else:
        _run_threads(host, port, concurrency, budget, requests, raw=kind == "sockets")
    elapsed = time.perf_counter() - started
    return BareRun(kind, concurrency, budget.done, elapsed, _own_cpu_s() - cpu)


def _host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 80


class _Budget:
    """How many requests may still start; the count of answered ones (one lock, or the loop)."""

    def __init__(self, count: int | None, seconds: float | None) -> None:
        self.left = count
        self.deadline = time.perf_counter() + seconds if seconds is not None else None
        self.done = 0
        self.lock = threading.Lock()
        self.issued = 0

    def next_index(self) -> int | None:
        """The next request's index, or ``None`` when the budget is spent."""
        if self.deadline is not None:
            if time.perf_counter() >= self.deadline:
                return None
        elif self.left is not None:
            if self.left <= 0:
                return None
            self.left -= 1
        self.issued += 1
        return self.issued - 1


class _Requests:
    """Request ``i`` of one measurement under a fresh key: (raw HTTP/1.1 bytes, body,
    headers), all built before the clock starts when their count is known."""

    def __init__(self, request: BareRequest, host: str, port: int, count: int | None) -> None:
        self.request = request
        self.prefix = f"bare:{uuid.uuid4().hex[:12]}:"
        self.head = (
            f"POST {request.path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
            "Content-Type: application/json\r\n"
        )
        self.built = [self._build(i) for i in range(count)] if count is not None else None

    def _build(self, i: int) -> tuple[bytes, bytes, dict[str, str]]:
        body, headers = self.request.body(f"{self.prefix}{i}")
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        raw = f"{self.head}{extra}Content-Length: {len(body)}\r\n\r\n".encode() + body
        return raw, body, headers

    def __getitem__(self, i: int) -> tuple[bytes, bytes, dict[str, str]]:
        return self.built[i] if self.built is not None else self._build(i)


def _content_length(head: bytes) -> int:
    for line in head.lower().split(b"\r\n"):
        if line.startswith(b"content-length:"):
            return int(line[15:])
    raise BareClientError("an answer without Content-Length")


def _run_asyncio(
    host: str, port: int, concurrency: int, budget: _Budget, requests: _Requests
) -> None:
    status = str(requests.request.status).encode()

    async def connection() -> None:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            while (i := budget.next_index()) is not None:  # one loop, no lock needed
                writer.write(requests[i][0])
                head = await reader.readuntil(b"\r\n\r\n")
                await reader.readexactly(_content_length(head))
                if head[9:12] != status:
                    raise BareClientError(f"HTTP {head[9:12].decode()} for a fresh key")
                budget.done += 1
        finally:
            writer.close()

    async def main() -> None:
        await asyncio.gather(*(connection() for _ in range(concurrency)))

    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is pinned, but the stdlib loop works too
        asyncio.run(main())
    else:
        uvloop.run(main())


def _post(
    conn: http.client.HTTPConnection, request: BareRequest, body: bytes, headers: dict
) -> None:
    """One request on a keep-alive ``http.client`` connection, its answer read and checked."""
    conn.request(
        "POST", request.path, body=body, headers={**headers, "Content-Type": "application/json"}
    )
    response = conn.getresponse()
    response.read()
    if response.status != request.status:
        raise BareClientError(f"HTTP {response.status} for a fresh key")


def http_client_sender(url: str, request: BareRequest = DELIVERY) -> Callable[[str], None]:
    """``send(key)``: ``request`` for ``key`` posted on the calling thread's own keep-alive
    ``http.client`` connection (the ``threads`` kind's, for a caller's own threads)."""
    host, port = _host_port(url)
    local = threading.local()

    def send(key: str) -> None:
        conn = getattr(local, "conn", None)
        if conn is None:
            conn = local.conn = http.client.HTTPConnection(host, port, timeout=30)
        _post(conn, request, *request.body(key))

    return send


def _raw_post(sock: socket.socket, raw: bytes, status: bytes) -> None:
    """One request's bytes on a keep-alive socket, its whole answer read and checked."""
    sock.sendall(raw)
    data = b""
    while (end := data.find(b"\r\n\r\n")) < 0:
        chunk = sock.recv(65536)
        if not chunk:
            raise BareClientError("closed without an answer")
        data += chunk
    want = end + 4 + _content_length(data[:end])
    while len(data) < want:
        chunk = sock.recv(65536)
        if not chunk:
            raise BareClientError("closed mid-answer")
        data += chunk
    if data[9:12] != status:
        raise BareClientError(f"HTTP {data[9:12].decode()} for a fresh key")


def _run_threads(
    host: str, port: int, concurrency: int, budget: _Budget, requests: _Requests, raw: bool
) -> None:
    errors: list[BaseException] = []
    status = str(requests.request.status).encode()

    def connection() -> None:
        conn = http.client.HTTPConnection(host, port, timeout=30)
        sock = socket.create_connection((host, port), timeout=30) if raw else None
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while True:
                with budget.lock:
                    i = budget.next_index()
                if i is None:
                    return
                data, body, headers = requests[i]
                if sock is not None:
                    _raw_post(sock, data, status)
                else:
                    _post(conn, requests.request, body, headers)
                with budget.lock:
                    budget.done += 1
        except BaseException as exc:
            errors.append(exc)
        finally:
            conn.close()
            if sock is not None:
                sock.close()

    threads = [threading.Thread(target=connection, daemon=True) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def _own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# ---------------------------------------------------------------------- the command


def measure(
    latency_ms: int,
    concurrency: int,
    kind: str,
    seconds: float,
    extra_flags: tuple[str, ...] = (),
) -> dict[str, float | int | str]:
    """One measurement against a fresh simulator process (its own empty store)."""
    from qo_ops.downstream.local import simulator_process

    with tempfile.TemporaryDirectory(prefix="qo-ops-bare-") as tmp:
        flags = ("--latency-ms", str(latency_ms), *extra_flags)
        with simulator_process(Path(tmp) / "store.sqlite3", *flags) as sim:
            bare_run(sim.url, concurrency, count=200, kind=kind)  # warm up: connections, caches
            sim_cpu, machine = sim.cpu_s(), _machine_ticks()
            result = bare_run(sim.url, concurrency, seconds=seconds, kind=kind)
            sim_cpu = sim.cpu_s() - sim_cpu
            busy, total = (b - a for a, b in zip(machine, _machine_ticks(), strict=True))
    ideal = concurrency / (latency_ms / 1000) if latency_ms else float("nan")
    return {
        "kind": kind,
        "concurrency": concurrency,
        "latency_ms": latency_ms,
        "deliveries": result.deliveries,
        "per_s": result.per_s,
        "ideal_per_s": ideal,
        "ratio": result.per_s / ideal,
        "simulator_cpu_share": sim_cpu / result.elapsed_s,
        "simulator_cpu_ms": 1000 * sim_cpu / result.deliveries,
        "client_cpu_ms": 1000 * result.client_cpu_s / result.deliveries,
        # the whole machine's cores busy (anyone's work): on 2 cores it is our slowness too
        "machine_busy_share": busy / total if total else 0.0,
    }


def _machine_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks of all cores so far, from /proc/stat (Linux)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bare_client", description=__doc__)
    parser.add_argument("--latency-ms", type=int, default=20)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--kind", choices=KINDS, nargs="+", default=list(KINDS))
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--json", action="store_true", help="one JSON object per measurement")
    args = parser.parse_args(argv)
    for concurrency in args.concurrency:
        for kind in args.kind:
            row = measure(args.latency_ms, concurrency, kind, args.seconds)
            if args.json:
                print(json.dumps(row))
            else:
                print(
                    f"{kind:8} c={concurrency:<3} +{args.latency_ms} ms: {row['per_s']:7,.0f}/s"
                    f" of {row['ideal_per_s']:,.0f} ({row['ratio']:.2f}); simulator"
                    f" {100 * float(row['simulator_cpu_share']):.0f}% of a core,"
                    f" {row['simulator_cpu_ms']:.3f} ms CPU/delivery; client"
                    f" {row['client_cpu_ms']:.3f} ms CPU/delivery; machine"
                    f" {100 * float(row['machine_busy_share']):.0f}% busy"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
