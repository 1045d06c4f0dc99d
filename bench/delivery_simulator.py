"""The downstream simulator for the delivery benchmarks: a fresh process with an empty store
and its counters, waiting for a quiet machine, and the simulator alone (no qo-ops, no
PostgreSQL) served by the job's own client, urllib3 and the bare ``http.client`` client."""

from __future__ import annotations

import dataclasses
import json
import resource
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from bench.bare_client import delivery, http_client_sender
from bench.common import stopwatch
from qo_ops.downstream.client import DownstreamClient
from qo_ops.downstream.local import SimulatorProcess, simulator_process

TENANT = "tenant-001"
LATENCY_MS = 20
QUIET_BUSY, QUIET_WAIT_S = 0.10, 20.0  # wait (bounded) for other work to leave the cores


# ---------------------------------------------------------------------- the simulator


@dataclasses.dataclass
class Simulator:
    """A fresh simulator process (``qo_ops.downstream.local.simulator_process``) and a
    client of it for its counters."""

    process: SimulatorProcess
    client: DownstreamClient

    @property
    def url(self) -> str:
        return self.process.url

    def stats(self) -> dict[str, Any]:
        return self.client.stats(detail=False)

    def cpu_s(self) -> float:
        """User + system CPU seconds the simulator process has used so far (Linux)."""
        return self.process.cpu_s()


@contextmanager
def simulator(latency_ms: int = LATENCY_MS, *flags: str) -> Iterator[Simulator]:
    """A fresh simulator process with an empty store (more ``flags`` of ``qo-ops
    downstream``, e.g. ``--rate-limit``), stopped afterwards."""
    with (
        tempfile.TemporaryDirectory(prefix="qo-ops-bench-downstream-") as tmp,
        simulator_process(
            Path(tmp) / "store.sqlite3", "--latency-ms", str(latency_ms), *flags
        ) as proc,
    ):
        client = DownstreamClient(proc.url)
        try:
            yield Simulator(proc, client)
        finally:
            client.close()


def verify_simulator(sim: Simulator, n: int, label: str) -> dict[str, Any]:
    """Exactly ``n`` distinct deliveries from ``n`` requests, no fault injected."""
    stats = sim.stats()
    ok = (
        stats["deliveries_distinct"] == n
        and stats["delivery_requests"] == n
        and stats["duplicates_suppressed"] == 0
        and not any(stats["faults_injected"].values())
    )
    if not ok:
        raise SystemExit(f"{label}: simulator verification failed: {stats} (expected {n})")
    return stats


# ---------------------------------------------------------------------- CPU accounting


def machine_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of all cores, from /proc/stat."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values) - idle, sum(values)


def _busy_share(seconds: float = 1.0) -> float:
    """How busy all cores were over the next ``seconds`` (0..1)."""
    before = machine_ticks()
    time.sleep(seconds)
    busy, total = (after - b for after, b in zip(machine_ticks(), before, strict=True))
    return busy / total if total else 0.0


def wait_quiet(limit_s: float = QUIET_WAIT_S) -> float:
    """Wait (bounded) until the machine is idle enough to measure; the last busy share.

    Nothing of this bench runs meanwhile, so whatever is busy is someone else's (a test
    suite, a build): with 2 cores, it would be measured as our slowness.
    """
    until = time.monotonic() + limit_s
    busy = _busy_share()
    while busy > QUIET_BUSY and time.monotonic() < until:
        busy = _busy_share()
    if busy > QUIET_BUSY:
        print(f"  warning: the machine is {200 * busy:.0f}% busy (of 200%) with other work")
    return busy


# ---------------------------------------------------------------------- the simulator alone


def _urllib3_sender(url: str) -> Callable[[str], None]:
    """urllib3's thread-safe connection pool (a dependency already pinned)."""
    import urllib3

    parsed = httpx.URL(url)
    pool = urllib3.HTTPConnectionPool(parsed.host, parsed.port, maxsize=64, timeout=10.0)

    def send(key: str) -> None:
        body = json.dumps({"tenant_id": TENANT, "order_number": key, "payload": {"lines": 1}})
        response = pool.request(
            "POST",
            "/fulfilment/deliveries",
            body=body,
            headers={"Idempotency-Key": key, "content-type": "application/json"},
        )
        json.loads(response.data)
        if response.status != 201:
            raise SystemExit(f"probe: HTTP {response.status}")

    return send


def own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def probe(client_kind: str, concurrency: int, latency_ms: int, n: int) -> dict[str, Any]:
    """``n`` deliveries from ``concurrency`` threads in this process, nothing else running."""
    with simulator(latency_ms) as sim:
        job_client = DownstreamClient(sim.url)
        send: Callable[[str], None]
        if client_kind == "httpx":

            def send(key: str) -> None:
                job_client.submit_delivery(key, TENANT, key, {"lines": 1})

        elif client_kind == "urllib3":
            send = _urllib3_sender(sim.url)
        else:
            send = http_client_sender(sim.url, delivery(TENANT))  # the bare client's own
        keys = [f"probe:{uuid.uuid4().hex}" for _ in range(n)]
        busy_before = wait_quiet()
        sim_cpu, own_cpu, machine = sim.cpu_s(), own_cpu_s(), machine_ticks()
        with stopwatch() as took, ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(send, keys))
        busy = [after - before for after, before in zip(machine_ticks(), machine, strict=True)]
        sim_cpu, own_cpu = sim.cpu_s() - sim_cpu, own_cpu_s() - own_cpu
        job_client.close()
        verify_simulator(sim, n, f"probe {client_kind}")
    ideal = concurrency / (latency_ms / 1000) if latency_ms else None
    result = {
        "client": client_kind,
        "concurrency": concurrency,
        "latency_ms": latency_ms,
        "items": n,
        "seconds": took[0],
        "deliveries_per_s": n / took[0],
        "ideal_per_s": ideal,
        "ratio": n / took[0] / ideal if ideal else None,
        "simulator_cpu_s": sim_cpu,
        "simulator_cpu_ms_per_request": 1000 * sim_cpu / n,
        "client_cpu_s": own_cpu,
        "client_cpu_ms_per_request": 1000 * own_cpu / n,
        "machine_busy_share": busy[0] / busy[1] if busy[1] else None,
        "machine_busy_share_before": busy_before,
    }
    print(
        f"  simulator alone, {client_kind} client, c={concurrency}, latency {latency_ms} ms: "
        f"{result['deliveries_per_s']:,.0f}/s"
    )
    return result
