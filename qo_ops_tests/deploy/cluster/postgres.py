"""Test scaffolding: a PostgreSQL server that containers on the host's network can reach.

``QO_OPS_TEST_DATABASE_URL`` when it names a TCP host; otherwise the embedded server's own
binaries (pgserver), initialised in a temporary directory and listening on 127.0.0.1 at a
free port: the suite's embedded server listens only on a Unix socket in a directory no
container user may enter.
"""

from __future__ import annotations

import os
import pwd
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy.engine import URL

from qo_ops.db.engine import parse_database_url, start_embedded_server, stop_embedded_server
from qo_ops_tests.dagster.stack import free_port


@contextmanager
def tcp_postgres(workdir: Path) -> Iterator[URL]:
    """The URL (database ``postgres``, a superuser) of a server listening on TCP."""
    external = os.environ.get("QO_OPS_TEST_DATABASE_URL")
    if external:
        url = parse_database_url(external)
        if url.host and "host" not in url.query:
            yield url.set(database="postgres")
            return
    from pgserver import _commands

    pgdata = workdir / "pgdata"
    start_embedded_server(pgdata)  # initdb (as pgserver's own user when root) and its settings
    stop_embedded_server(pgdata)
    owner = pgdata.stat().st_uid
    user = pwd.getpwuid(owner).pw_name if owner != os.geteuid() else None
    port = free_port()
    log = workdir / "postgres.log"
    log.touch()
    if user is not None:
        os.chown(log, owner, -1)
    pg_ctl = getattr(_commands, "pg_ctl")  # noqa: B009 - pgserver defines it at import time
    # -l and no captured pipe: the postmaster outlives pg_ctl (see the brief's known traps)
    options = f"-h 127.0.0.1 -p {port} -k '' -c max_connections=200"
    pg_ctl(["-w", "-l", str(log), "-o", options, "start"], pgdata=pgdata, user=user, timeout=60)
    try:
        yield URL.create(
            "postgresql+psycopg",
            username="postgres",
            host="127.0.0.1",
            port=port,
            database="postgres",
        )
    finally:
        stop_embedded_server(pgdata)
