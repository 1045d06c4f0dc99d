"""A local simulator for the demo and `qo-ops dev`: started as its own process on a free
loopback port, seeded with the demo's view of the fulfilment system, stopped afterwards."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
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


@dataclass
class SimulatorProcess:
    """A simulator running as a process of its own: its ``url``, its ``process`` (the one
    running now: :meth:`revive` replaces it), and how it was started."""

    url: str
    process: subprocess.Popen[bytes]
    store: Path
    flags: tuple[str, ...]

    def cpu_s(self) -> float:
        """User + system CPU seconds the process has used so far (Linux ``/proc``)."""
        stat = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")

    def revive(self) -> str | None:
        """If the process has exited (killed, crashed), start it again on the same URL, which
        every process given that URL keeps using, and say so; None while it runs. Its store
        is the same file: nothing it acknowledged is lost."""
        code = self.process.poll()
        if code is None:
            return None
        port = int(self.url.rsplit(":", 1)[1])
        self.process = _start(self.store, self.flags, wait_s=30.0, port=port).process
        return f"downstream simulator exited ({_exit_cause(code)}); restarted on {self.url}"


def _exit_cause(code: int) -> str:
    if code < 0:
        with suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def _start(
    store: Path, flags: tuple[str, ...], wait_s: float, port: int | None = None
) -> SimulatorProcess:
    """Start ``qo-ops downstream --store STORE FLAGS…`` on ``port`` (else a free one), once
    it answers ``/healthz``; output appended to STORE with the suffix ``.log``."""
    store.parent.mkdir(parents=True, exist_ok=True)
    log_path = store.with_suffix(".log")
    for _ in range(3 if port is None else 1):  # a free port can be taken before it binds
        chosen = port or _free_port()
        url = f"http://127.0.0.1:{chosen}"
        with log_path.open("ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "qo_ops.downstream.cli", "--host", "127.0.0.1"]
                + ["--port", str(chosen), "--store", str(store), *flags],
                stdout=log,
                stderr=log,
                stdin=subprocess.DEVNULL,
            )
        try:
            healthy = _wait_healthy(proc, url, wait_s)
        except BaseException:  # Ctrl-C while it starts: it is not left running
            _stop(proc)
            raise
        if healthy:
            return SimulatorProcess(url, proc, store, flags)
        exited = proc.poll() is not None  # e.g. the port was taken: try another
        _stop(proc)
        if not exited:
            raise DatabaseUnavailable(f"the downstream simulator did not answer (see {log_path})")
    raise DatabaseUnavailable(f"the downstream simulator did not start (see {log_path})")


@contextmanager
def simulator_process(store: Path, *flags: str, wait_s: float = 30.0) -> Iterator[SimulatorProcess]:
    """Run ``qo-ops downstream --store STORE FLAGS…`` on a free 127.0.0.1 port until the
    block ends (output in STORE with the suffix ``.log``)."""
    sim = _start(store, flags, wait_s)
    try:
        yield sim
    finally:
        _stop(sim.process)


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


def local_store() -> Path:
    """The store of the local simulator (``qo-ops dev``, the demo): QO_OPS_HOME's."""
    return load_settings().home / "downstream.sqlite3"


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


def reset_local_simulator(engine: Engine, store: Path | None = None) -> str:
    """Make the local simulator's store match the demo data just loaded (``demo-data
    --reset``), and say what was done: a simulator serving it now is reset through its
    admin API and seeded; a store nobody serves is emptied (seeded when it next starts)."""
    from qo_ops.downstream.simulator.app import served_url_file
    from qo_ops.downstream.simulator.store import Store

    store = store or local_store()
    url_file = served_url_file(store)
    url = url_file.read_text().strip() if url_file.exists() else None
    if url is not None:
        with DownstreamClient(url) as client:
            if client.healthy():
                client.reset()
                seeded = seed_from_demo(engine, url)
                return f"downstream simulator at {url} reset and seeded with {seeded:,} orders"
    if not store.exists():
        return f"no downstream simulator store yet ({store}): seeded when it first starts"
    emptied = Store(store)
    try:
        emptied.reset()
    finally:
        emptied.close()
    return f"downstream simulator store {store} emptied: seeded when it next starts"


@dataclass(frozen=True)
class DemoDownstream:
    """The downstream of the demo and ``qo-ops dev``: its URL, and the local simulator
    process behind it (None for QO_OPS_DOWNSTREAM_URL's, which is not ours to watch)."""

    url: str
    simulator: SimulatorProcess | None


@contextmanager
def downstream_for_demo(engine: Engine) -> Iterator[DemoDownstream]:
    """QO_OPS_DOWNSTREAM_URL if set; else a seeded local simulator for the block."""
    if os.environ.get(DOWNSTREAM_URL_ENV):
        yield DemoDownstream(os.environ[DOWNSTREAM_URL_ENV], None)
        return
    with simulator_process(local_store()) as sim:
        seed_from_demo(engine, sim.url)
        os.environ[DOWNSTREAM_URL_ENV] = sim.url
        try:
            yield DemoDownstream(sim.url, sim)
        finally:
            os.environ.pop(DOWNSTREAM_URL_ENV, None)
