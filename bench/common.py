"""What every benchmark needs: a fresh database on a real server, and a table of figures."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.engine import URL

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
def fresh_database(name: str) -> Iterator[URL]:
    """A new database at the head schema revision, dropped afterwards."""
    server = bench_server()
    admin = sa.create_engine(server, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    with admin.connect() as conn:
        conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    url = server.set(database=name)
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    migrate.upgrade(engine)
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
