"""What every benchmark needs: a fresh database on a real server, and a table of figures."""

from __future__ import annotations

import compileall
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import URL, Engine
from sqlalchemy.exc import DBAPIError

from qo_ops.db import migrate
from qo_ops.db.engine import parse_database_url, start_embedded_server

REPO = Path(__file__).resolve().parent.parent


def bench_server() -> URL:
    """``QO_OPS_TEST_DATABASE_URL``'s server, or an embedded one kept in .qo_ops/bench-pgdata."""
    external = os.environ.get("QO_OPS_TEST_DATABASE_URL")
    if external:
        return parse_database_url(external).set(database="postgres")
    return start_embedded_server(REPO / ".qo_ops" / "bench-pgdata").set(database="postgres")


@contextmanager
def fresh_database(name: str, server: URL | None = None, revision: str = "head") -> Iterator[URL]:
    """A new database at schema ``revision`` (head) on ``server`` (the bench's), dropped
    afterwards."""
    server = server or bench_server()
    admin = sa.create_engine(server, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    with admin.connect() as conn:
        conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    url = server.set(database=name)
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    migrate.upgrade(engine, revision)
    engine.dispose()
    try:
        yield url
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


@contextmanager
def stopwatch() -> Iterator[list[float]]:
    """Measure wall time: ``with stopwatch() as t: …; t[0]`` is the seconds taken."""
    box: list[float] = []
    start = time.perf_counter()
    yield box
    box.append(time.perf_counter() - start)


def print_table(title: str, headers: list[str], rows: list[list[object]]) -> None:
    """Plain aligned columns (benchmarks are read in logs as often as on terminals)."""
    cells = [headers] + [
        [
            f"{v:,.2f}" if isinstance(v, float) else f"{v:,}" if isinstance(v, int) else str(v)
            for v in r
        ]
        for r in rows
    ]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    print(f"\n{title}")
    for r in cells:
        print(
            "  ".join(
                c.rjust(w) if i else c.ljust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=True))
            )
        )


def engine_for(url: URL) -> Engine:
    return sa.create_engine(url, poolclass=sa.pool.NullPool)


def admin_engine() -> Engine:
    return sa.create_engine(
        bench_server(), isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool
    )


def env_url(url: URL) -> str:
    """``url`` as ``QO_OPS_DATABASE_URL`` takes it."""
    return url.set(drivername="postgresql").render_as_string(hide_password=False)


@contextmanager
def cloned_database(template: URL, name: str) -> Iterator[URL]:
    """``CREATE DATABASE name TEMPLATE template``, dropped afterwards (and on failure):
    every measured run starts from the same bytes."""
    admin = admin_engine()
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            for attempt in range(20):
                try:
                    conn.exec_driver_sql(f'CREATE DATABASE "{name}" TEMPLATE "{template.database}"')
                    break
                except DBAPIError as exc:  # an autovacuum worker may be on it for a moment
                    if "being accessed by other users" not in str(exc.orig) or attempt == 19:
                        raise
                    time.sleep(0.5)
        yield template.set(database=name)
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


def settle(url: URL, timeout_s: float = 60.0) -> None:
    """CHECKPOINT, then wait (bounded) until no autovacuum worker runs on the server, so a
    leftover vacuum does not skew the next figure (2 cores)."""
    engine = engine_for(url)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql("CHECKPOINT")
        until = time.monotonic() + timeout_s
        while (
            time.monotonic() < until
            and conn.exec_driver_sql(
                "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'autovacuum worker'"
            ).scalar()
        ):
            time.sleep(0.5)
    engine.dispose()


# Runs one command and writes its wall time, exit code, output and peak RSS to a file. A
# fresh helper per measurement: RUSAGE_CHILDREN then covers exactly that one process.
RSS_HELPER = """
import json, resource, subprocess, sys, time
started = time.perf_counter()
proc = subprocess.run(json.loads(sys.argv[1]), capture_output=True, text=True, check=False)
wall = time.perf_counter() - started
with open(sys.argv[2], "w") as out:
    json.dump({"returncode": proc.returncode, "wall_s": wall, "stdout": proc.stdout,
               "stderr": proc.stderr,
               "maxrss_kb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}, out)
"""
QO_OPS = str(Path(sys.executable).with_name("qo-ops"))


def compile_package() -> None:
    """Write the bytecode of ``qo_ops`` beside its sources, as ``pip install`` does for an
    installed package (the image's). The editable install of a checkout has none, and with
    ``PYTHONDONTWRITEBYTECODE=1`` (this machine's environment) every ``qo-ops`` process would
    compile its ~80 modules from source again (~0.1 s), a cost no installed copy pays."""
    if not compileall.compile_dir(REPO / "qo_ops", quiet=1):
        raise SystemExit("bench: qo_ops does not compile")


def measure_command(cmd: list[str], env: dict[str, str]) -> dict[str, object]:
    """Run ``cmd`` in its own process: wall seconds, return code, stdout/stderr, peak RSS (KiB)."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "measured.json"
        subprocess.run(
            [sys.executable, "-c", RSS_HELPER, json.dumps(cmd), str(result)], env=env, check=True
        )
        return dict(json.loads(result.read_text()))


def percentile(values: Sequence[float], share: float) -> float:
    """The value below which ``share`` of ``values`` lie (nearest rank; 0.0 for none)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * share))] if ordered else 0.0


def stop_group(proc: subprocess.Popen[Any], grace_s: float = 30.0) -> None:
    """SIGTERM to the process group ``proc`` leads (started with ``start_new_session``),
    then SIGKILL if it has not exited within ``grace_s``."""
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def standing_approvals(engine: Any) -> dict[str, str]:
    """An approval of every destructive job's execute for every tenant, granted by the bench
    as their approver (a day long): the id each ``qo-ops run --approval`` cites, by job."""
    from qo_ops.jobs.catalog import CATALOG
    from qo_ops.platform.actions.approvals import Grant, grant

    return {
        spec.name: grant(
            engine, spec, Grant(spec.name, None, "bench: standing approval", "bench", 86_400)
        ).id
        for spec in CATALOG.values()
        if spec.destructive
    }
