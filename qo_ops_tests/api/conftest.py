"""API fixtures: a real ``qo-ops api`` process on a free loopback port, and tokens made with
the real ``qo-ops api token create`` command.

    def test_x(api):                       # Dagster unreachable: launches answer 503
        viewer = api.token("vera", "viewer")
        r = api.get("/internal/jobs", viewer)

``api_factory(dagster_url=..., **env)`` starts one with other settings.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from qo_ops_tests.conftest import QO_OPS_BIN, base_env, run_cli
from qo_ops_tests.dagster.conftest import loaded  # noqa: F401  (demo data for the Dagster path)
from qo_ops_tests.dagster.stack import free_port


def _qo_ops_api(port: int) -> list[str]:
    return [QO_OPS_BIN, "api", "--host", "127.0.0.1", "--port", str(port)]


class ApiServer:
    """A running ``qo-ops api``: ``.url``, ``.log`` (its stdout+stderr), ``.env``."""

    def __init__(
        self,
        env: dict[str, str],
        log: Path,
        admin_env: dict[str, str],
        command: Callable[[int], list[str]] | None = None,
    ) -> None:
        """Start it (``command(port)``, by default ``qo-ops api`` on ``port``) and wait for
        its ``/healthz``."""
        self.env, self.log, self.admin_env = env, log, admin_env
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = (command or _qo_ops_api)(self.port)
        with log.open("ab") as out:
            self.process = subprocess.Popen(
                argv,
                env=env,
                stdout=out,
                stderr=out,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"qo-ops api exited: {log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("qo-ops api did not answer /healthz in 60 s")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()

    def token(
        self, identity: str, *roles: str, tenant: str | None = None, expires_in: str = "90d"
    ) -> str:
        """A new token from the real CLI: the last line of its output."""
        args = ["api", "token", "create", "--identity", identity, "--expires-in", expires_in]
        for role in roles:
            args += ["--role", role]
        if tenant:
            args += ["--tenant", tenant]
        result = run_cli(args, self.admin_env)  # tokens are made by the schema owner
        assert result.code == 0, result.stderr
        return result.stdout.strip().splitlines()[-1]

    def request(
        self,
        method: str,
        path: str,
        token: str | None = None,
        json: Any = None,
        headers: dict[str, str] | None = None,
        content: bytes | None = None,
    ) -> httpx.Response:
        sent = dict(headers or {})
        if token is not None:
            sent["Authorization"] = f"Bearer {token}"
        return httpx.request(
            method, f"{self.url}{path}", json=json, content=content, headers=sent, timeout=30
        )

    def get(self, path: str, token: str | None = None, **kw: Any) -> httpx.Response:
        return self.request("GET", path, token, **kw)

    def post(self, path: str, token: str | None = None, **kw: Any) -> httpx.Response:
        return self.request("POST", path, token, **kw)


@pytest.fixture
def api_factory(db, tmp_path) -> Iterator[Callable[..., ApiServer]]:
    servers: list[ApiServer] = []

    def start(
        dagster_url: str | None = None, database_url: str | None = None, **extra: str
    ) -> ApiServer:
        env = base_env(
            QO_OPS_DATABASE_URL=database_url or db.env_url,
            QO_OPS_DAGSTER_URL=dagster_url or f"http://127.0.0.1:{free_port()}",  # nothing there
            QO_OPS_HOME=str(tmp_path),
            **extra,
        )
        admin = base_env(QO_OPS_DATABASE_URL=db.env_url, QO_OPS_HOME=str(tmp_path))
        server = ApiServer(env, tmp_path / f"api-{len(servers)}.log", admin)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def api(api_factory) -> ApiServer:
    return api_factory()
