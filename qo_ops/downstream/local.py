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


@contextmanager
def local_simulator(store: Path | None = None) -> Iterator[str]:
    """Run the simulator on 127.0.0.1 until the block ends; yields its URL."""
    store = store or load_settings().home / "downstream.sqlite3"
    store.parent.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    log = open(store.with_suffix(".log"), "ab")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "qo_ops.downstream.cli",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--store",
            str(store),
        ],
        stdout=log,
        stderr=log,
        stdin=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise DatabaseUnavailable(
                    f"the downstream simulator did not start (see {store.with_suffix('.log')})"
                )
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def seed_from_demo(engine: Engine, url: str) -> int:
    """Give an empty simulator the demo's downstream view (the `downstream_order` rows)."""
    with DownstreamClient(url) as client:
        if client.stats(detail=False).get("orders"):
            return 0
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text("SELECT order_number, tenant_id, status FROM downstream_order")
            ).all()
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
