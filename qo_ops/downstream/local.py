"""A local simulator for the demo and `qo-ops dev`: started as its own process on a free
loopback port, seeded with the demo's view of the fulfilment system, stopped afterwards."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from qo_ops.config import load_settings
from qo_ops.downstream.client import DownstreamClient
from qo_ops.errors import DatabaseUnavailable

DOWNSTREAM_URL_ENV = "QO_OPS_DOWNSTREAM_URL"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class SimulatorProcess:
    """A simulator running as a process of its own: its ``url`` and ``process``."""

    url: str
    process: subprocess.Popen[bytes]

    def cpu_s(self) -> float:
        """User + system CPU seconds the process has used so far (Linux ``/proc``)."""
        stat = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")


@contextmanager
def simulator_process(store: Path, *flags: str, wait_s: float = 30.0) -> Iterator[SimulatorProcess]:
    """Run ``qo-ops downstream --store STORE FLAGS…`` on a free 127.0.0.1 port until the
    block ends (output in STORE with the suffix ``.log``)."""
    store.parent.mkdir(parents=True, exist_ok=True)
    log_path = store.with_suffix(".log")
    for _ in range(3):  # a free port can be taken before the server binds it
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        with log_path.open("ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "qo_ops.downstream.cli", "--host", "127.0.0.1"]
                + ["--port", str(port), "--store", str(store), *flags],
                stdout=log,
                stderr=log,
                stdin=subprocess.DEVNULL,
            )
        if _wait_healthy(proc, url, wait_s):
            break
        exited = proc.poll() is not None  # e.g. the port was taken: try another
        _stop(proc)
        if not exited:
            raise DatabaseUnavailable(f"the downstream simulator did not answer (see {log_path})")
    else:
        raise DatabaseUnavailable(f"the downstream simulator did not start (see {log_path})")
    try:
        yield SimulatorProcess(url, proc)
    finally:
        _stop(proc)


def _wait_healthy(proc: subprocess.Popen[bytes], url: str, wait_s: float) -> bool:
    deadline = time.monotonic() + wait_s
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return True
        except httpx.HTTPError:
            time.sleep(0.05)
    return False


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextmanager
def local_simulator(store: Path | None = None) -> Iterator[str]:
    """Run the simulator on 127.0.0.1 until the block ends; yields its URL."""
    with simulator_process(store or load_settings().home / "downstream.sqlite3") as sim:
        yield sim.url


# The demo's downstream view: what the simulator should know of every order.
_DOWNSTREAM_ORDERS = sa.text("SELECT order_number, tenant_id, status FROM downstream_order")


def seed_from_demo(engine: Engine, url: str) -> int:
    """Give an empty simulator the demo's downstream view (the `downstream_order` rows)."""
    with DownstreamClient(url) as client:
        if client.stats(detail=False).get("orders"):
            return 0
        with engine.connect() as conn:
            rows = conn.execute(_DOWNSTREAM_ORDERS).all()
        for row in rows:
            client.put_order(row.order_number, row.tenant_id, row.status)
        return len(rows)


@contextmanager
def downstream_for_demo(engine: Engine) -> Iterator[str]:
    """QO_OPS_DOWNSTREAM_URL if set; else a seeded local simulator for the block."""
    if os.environ.get(DOWNSTREAM_URL_ENV):
        yield os.environ[DOWNSTREAM_URL_ENV]
        return
    with local_simulator() as url:
        seed_from_demo(engine, url)
        os.environ[DOWNSTREAM_URL_ENV] = url
        try:
            yield url
        finally:
            os.environ.pop(DOWNSTREAM_URL_ENV, None)
