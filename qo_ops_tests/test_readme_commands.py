"""Every command of the README's command block, read from the README and run as written, in
its order, on a fresh demo: the embedded PostgreSQL under a new QO_OPS_HOME, the real
``qo-ops``, no QO_OPS_DATABASE_URL or QO_OPS_DOWNSTREAM_URL (a new user's first hour). A
command exits 0; a server (the simulator, the API, the exporter) answers on its port and
stops on SIGTERM. Placeholders are filled the way a person fills them: ``…`` with words,
``RUN_ID`` with a running run's id, ``ORD-…`` with an item ``qo-ops review list`` shows,
``apr-…`` with the approval the README's grant printed, ``[--tenant T]`` with the tenant;
fixed ports with free ones. What is not run is listed with the reason, and the list is
checked against the README (a command added there is run here, or named here)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from qo_ops.db.engine import stop_embedded_server
from qo_ops_tests.conftest import QO_OPS_BIN, REPO, base_env, run_cli

README = REPO / "README.md"
NOT_RUN = {
    "make demo": "CI runs it on a clean clone (the README's first screen)",
    "make test": "CI runs it (.ci/run)",
    "export PATH=$PWD/.venv/bin:$PATH": "this test calls the venv's qo-ops by its path",
    "python -m bench.nemesis --seed 7 --seconds 120": (
        "two minutes of faults: qo_ops_tests/bench/test_nemesis.py runs a seeded nemesis"
    ),
    "make nemesis SEED=7 ITERATIONS=12": "the same nemesis, replayed by make",
}
SERVERS = ("qo-ops downstream --port", "qo-ops api --port", "qo-ops metrics --port")
WORDS = "README test"


def readme_commands() -> list[str]:
    """The commands of the README's shell blocks, in order: continuation lines joined,
    trailing comments dropped."""
    text = README.read_text()
    commands: list[str] = []
    for block in re.findall(r"```(?:sh)?\n(.*?)```", text, re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            command = re.split(r"\s{2,}#\s|\s+#\s(?=[A-Za-z`])", line.strip())[0].strip()
            if command and not command.startswith("#"):
                commands.append(command)
    return commands


@pytest.fixture
def home() -> Iterator[Path]:
    """A new QO_OPS_HOME (short: the embedded server's socket lives under it); its server
    stopped and the folder removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="qo-readme-"))
    os.chmod(path, 0o755)  # the embedded server may run as another user (pgserver, as root)
    try:
        yield path
    finally:
        stop_embedded_server(path / "pgdata")
        shutil.rmtree(path, ignore_errors=True)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Filler:
    """Fills a command's placeholders from what the commands before it did."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.approval: str | None = None
        self.slow: subprocess.Popen[bytes] | None = None

    def fill(self, command: str) -> str:
        command = re.sub(r"\[(--tenant [\w-]+)\]", r"\1", command)  # an optional flag, given
        if "apr-…" in command:
            assert self.approval, "the README grants an approval before it cites one"
            command = command.replace("apr-…", self.approval)
        if "ORD-…" in command:
            command = command.replace("ORD-…", self._flagged_order())
        if "RUN_ID" in command:
            command = command.replace("RUN_ID", self._running_run())
        return command.replace("…", WORDS)

    def _flagged_order(self) -> str:
        """An order waiting for review: one order flagged, as order_reconciliation flags a
        status drift (the demo's data has none of its own)."""
        from qo_ops.config import load_settings
        from qo_ops.db.engine import get_engine, resolve_target

        engine = get_engine(resolve_target(load_settings(self.env)))
        with engine.begin() as conn:
            number = conn.execute(
                sa.text(
                    "UPDATE customer_order SET needs_manual_review = true WHERE id = "
                    "(SELECT id FROM customer_order WHERE tenant_id = 'tenant-001' ORDER BY id "
                    "LIMIT 1) RETURNING order_number"
                )
            ).scalar_one()
        waiting = json.loads(run_cli(["review", "list", "--json"], self.env).stdout)["waiting"]
        assert [w["item"] for w in waiting] == [number]
        return str(number)

    def _running_run(self) -> str:
        """A run at work (a slow execute of tenant-003): the run `qo-ops cancel` stops."""
        self.slow = subprocess.Popen(
            [QO_OPS_BIN, "run", "quote_expiration", "--tenant", "tenant-003", "--mode",
             "execute", "--reason", WORDS, "--batch-size", "1", "--throttle-ms", "500"],
            env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            found = json.loads(
                run_cli(
                    ["runs", "quote_expiration", "--tenant", "tenant-003", "--json"], self.env
                ).stdout
            )["runs"]
            running = [r["id"] for r in found if r["status"] == "running"]
            if running:
                return str(running[0])
            time.sleep(0.2)
        raise AssertionError("the slow run never started")


def _serve(command: str, env: dict[str, str]) -> None:
    """Start a server command on a free port, see it answer, stop it with SIGTERM."""
    port = _free_port()
    argv = shlex.split(re.sub(r"--port \d+", f"--port {port}", command))
    extra = {}
    while "=" in argv[0]:  # VAR=value prefixes
        name, _, value = argv.pop(0).partition("=")
        extra[name] = value
    argv[0] = QO_OPS_BIN
    process = subprocess.Popen(
        argv, env={**env, **extra}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        path = "/metrics" if "metrics" in argv else "/healthz"
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, (
                command,
                process.stderr.read() if process.stderr else "",
            )
            try:
                if httpx.get(f"http://127.0.0.1:{port}{path}", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"{command} never answered on {path}"
            time.sleep(0.2)
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) is not None


def test_every_readme_command_runs_as_written_on_a_fresh_demo(home):
    commands = readme_commands()
    assert set(NOT_RUN) <= set(commands), set(NOT_RUN) - set(commands)  # no stale exclusion
    env = {
        k: v
        for k, v in base_env(QO_OPS_HOME=str(home)).items()
        if k not in ("QO_OPS_DATABASE_URL", "QO_OPS_DOWNSTREAM_URL")
    }
    filler = Filler(env)
    ran: list[str] = []
    try:
        for command in commands:
            if command in NOT_RUN:
                continue
            if command.startswith(SERVERS) or (
                command.startswith("QO_OPS_") and " qo-ops api --port" in command
            ):
                _serve(command, env)
                ran.append(command)
                continue
            if command.startswith('eval "$('):  # what it evaluates: qo-ops db env
                command = command.removeprefix('eval "$(').removesuffix(')"')
            filled = filler.fill(command)
            argv = shlex.split(filled)
            assert argv[0] == "qo-ops", command
            result = run_cli(argv[1:], env, timeout=600)
            assert result.code == 0, (command, result.stdout[-2000:], result.stderr[-2000:])
            assert "Traceback" not in result.stderr, command
            if argv[1:3] == ["approval", "grant"]:
                filler.approval = result.stdout.split()[1].rstrip(":")
            ran.append(command)
    finally:
        if filler.slow is not None:
            filler.slow.kill()
            filler.slow.wait()
    assert len(ran) + len(NOT_RUN) == len(commands)
    assert any(c.startswith("qo-ops run order_reconciliation") for c in ran)
