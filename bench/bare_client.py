"""The fastest clients we have for the simulator, with no qo-ops and no database: the limit
a job's delivery rate is compared with ("the fastest bare client at the same concurrency").

``bare_rate(url, concurrency, seconds=… | count=…)`` posts deliveries (``POST
/fulfilment/deliveries``, a fresh ``Idempotency-Key`` each) from ``concurrency`` keep-alive
connections, each with one request in flight, and returns deliveries per second. Two kinds:

* ``asyncio``: one event loop (uvloop when installed), raw streams, HTTP/1.1 written and
  parsed by hand: the least client CPU per request we know how to spend in Python;
* ``threads``: a thread per connection, each with its own stdlib ``http.client`` connection.

``limit_rate`` measures both and returns the faster. Every answer must be ``201``: anything
else (a fault, a duplicate, a 429) raises ``BareClientError``, so a figure always means
that many distinct deliveries were stored.

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
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

KINDS = ("asyncio", "threads")
TENANT = "tenant-bare"
PATH = "/fulfilment/deliveries"


class BareClientError(RuntimeError):
    """The simulator answered something other than 201 (or not at all)."""


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
) -> float:
    """Deliveries per second from ``concurrency`` bare connections: for ``seconds`` of wall
    time, or until ``count`` deliveries were answered (exactly one of the two)."""
    return bare_run(url, concurrency, seconds=seconds, count=count, kind=kind).per_s


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
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    budget = _Budget(count, seconds)
    cpu = _own_cpu_s()
    started = time.perf_counter()
    if kind == "asyncio":
        _run_asyncio(host, port, concurrency, budget)
    else:
        _run_threads(host, port, concurrency, budget)
    elapsed = time.perf_counter() - started
    return BareRun(kind, concurrency, budget.done, elapsed, _own_cpu_s() - cpu)


class _Budget:
    """How many requests may still start; the count of answered ones (one lock, or the loop)."""

    def __init__(self, count: int | None, seconds: float | None) -> None:
        self.left = count
        self.deadline = time.perf_counter() + seconds if seconds is not None else None
        self.done = 0
        self.lock = threading.Lock()
        self.prefix = f"bare:{uuid.uuid4().hex[:12]}:"
        self.issued = 0

    def next_key(self) -> str | None:
        """A fresh idempotency key, or ``None`` when the budget is spent."""
        if self.deadline is not None:
            if time.perf_counter() >= self.deadline:
                return None
        elif self.left is not None:
            if self.left <= 0:
                return None
            self.left -= 1
        self.issued += 1
        return f"{self.prefix}{self.issued}"


def _request_bytes(host: str, port: int, key: str) -> bytes:
    body = json.dumps(
        {"tenant_id": TENANT, "order_number": key, "payload": {"lines": 1}},
        separators=(",", ":"),
    ).encode()
    head = (
        f"POST {PATH} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Idempotency-Key: {key}\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def _content_length(head: bytes) -> int:
    for line in head.lower().split(b"\r\n"):
        if line.startswith(b"content-length:"):
            return int(line[15:])
    raise BareClientError("an answer without Content-Length")


def _run_asyncio(host: str, port: int, concurrency: int, budget: _Budget) -> None:
    async def connection() -> None:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            while (key := budget.next_key()) is not None:  # one loop, no lock needed
                writer.write(_request_bytes(host, port, key))
                head = await reader.readuntil(b"\r\n\r\n")
                await reader.readexactly(_content_length(head))
                if head[9:12] != b"201":
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


def _run_threads(host: str, port: int, concurrency: int, budget: _Budget) -> None:
    errors: list[BaseException] = []

    def connection() -> None:
        conn = http.client.HTTPConnection(host, port, timeout=30)
        try:
            while True:
                with budget.lock:
                    key = budget.next_key()
                if key is None:
                    return
                body = json.dumps(
                    {"tenant_id": TENANT, "order_number": key, "payload": {"lines": 1}}
                )
                conn.request(
                    "POST",
                    PATH,
                    body=body,
                    headers={"Idempotency-Key": key, "Content-Type": "application/json"},
                )
                response = conn.getresponse()
                response.read()
                if response.status != 201:
                    raise BareClientError(f"HTTP {response.status} for a fresh key")
                with budget.lock:
                    budget.done += 1
        except BaseException as exc:
            errors.append(exc)
        finally:
            conn.close()

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
