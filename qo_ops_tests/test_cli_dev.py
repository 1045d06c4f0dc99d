"""`make ui` (``qo-ops dev``) as a new user meets it: the port is theirs to choose, the demo
data is replaced only when asked (the Makefile's default, said before it happens), and a busy
port is refused before anything changes.

``qo-ops dev`` is started for real (Dagster webserver + daemon over the test's database) and
stopped once it has said where the UI is: what is tested here happens before Dagster serves.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

import pytest
import sqlalchemy as sa
from dagster_graphql import DagsterGraphQLClient

from qo_ops.db.digest import database_digest
from qo_ops.demo.data import load_demo_data
from qo_ops.downstream.client import DownstreamClient
from qo_ops.downstream.local import simulator_process
from qo_ops_tests.conftest import (
    QO_OPS_BIN,
    REPO,
    _free_port,
    base_env,
    drop_database,
    run_cli,
)

UI_LINE = "Dagster UI on http://127.0.0.1:"
# the queued-run coordinator's "Launched %d runs." (one tick may launch more than one run)
LAUNCHED = re.compile(r"QueuedRunCoordinatorDaemon - .*INFO.* - Launched [1-9][0-9]* runs")


def _digest(db) -> dict[str, str]:
    with db.engine.connect() as conn:
        return database_digest(conn)


@contextmanager
def _dev(db, tmp_path: Path, *args: str) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    """``qo-ops dev ARGS`` in its own session, its output in a file; the whole session is
    stopped afterwards (Dagster's children included)."""
    out = tmp_path / "dev.out"
    env = base_env(QO_OPS_DATABASE_URL=db.env_url, QO_OPS_HOME=str(tmp_path / "home"))
    with out.open("w") as sink:
        proc = subprocess.Popen(
            [QO_OPS_BIN, "dev", *args],
            stdout=sink,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            text=True,
            start_new_session=True,
        )
    try:
        yield proc, out
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                continue
        drop_database(db.url.set(database="postgres"), f"{db.url.database}_dagster")


def _until_the_ui_line(proc: subprocess.Popen[str], out: Path, timeout: float = 120) -> str:
    """The command's output up to and including the line naming the UI's address."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = out.read_text()
        if UI_LINE in text:
            return text
        if proc.poll() is not None:
            pytest.fail(f"qo-ops dev ended with {proc.returncode} before the UI: {text}")
        time.sleep(0.2)  # polling the output file for a condition, not a timed wait
    pytest.fail(f"qo-ops dev did not name its UI within {timeout} s: {out.read_text()}")


@pytest.fixture
def demo(db):
    """Two demo tenants, a run on record and one in the audit trail."""
    load_demo_data(db.engine, tenants=2, quotes=200, seed=7, as_of=datetime.now(UTC))
    env = base_env(QO_OPS_DATABASE_URL=db.env_url)
    ran = run_cli(["run", "quote_expiration", "--tenant", "tenant-001", "--json"], env)
    assert ran.code == 0, ran.stderr
    assert run_cli(["suspend", "delivery_retry", "--reason", "INC-1"], env).code == 0
    return db


def _count(db, sql: str) -> int:
    with db.engine.connect() as conn:
        return int(conn.scalar(sa.text(sql)) or 0)


def _simulator_url(text: str) -> str:
    return re.search(r"downstream simulator on (http://127\.0\.0\.1:\d+)", text).group(1)  # type: ignore[union-attr]


def test_dev_with_reset_says_so_first_then_serves_fresh_demo_data_on_the_port_asked(demo, tmp_path):
    port = _free_port()
    audit = _count(demo, "SELECT count(*) FROM job_audit")
    # the local simulator's store still holds an order of an earlier demo
    with (
        simulator_process(tmp_path / "home" / "downstream.sqlite3") as old,
        DownstreamClient(old.url) as client,
    ):
        client.put_order("ORD-OF-AN-OLD-DEMO", "tenant-009", "shipped")
    with _dev(demo, tmp_path, "--port", str(port), "--reset-demo-data") as (proc, out):
        text = _until_the_ui_line(proc, out)
        said, loaded, ui = (
            text.index("replacing the data in"),
            text.index("loaded "),
            text.index(f"{UI_LINE}{port} "),
        )
        assert said < loaded < ui  # said before it happened, then the UI on the port asked
        assert "KEEP_DATA=1" in text[said:loaded]  # and how to keep the data next time
        assert _count(demo, "SELECT count(*) FROM tenant") == 3  # the demo's own data
        assert _count(demo, "SELECT count(*) FROM job_run") == 0  # the old history is gone
        assert _count(demo, "SELECT count(*) FROM job_control") == 0  # and the suspension
        assert _count(demo, "SELECT count(*) FROM job_audit") >= audit  # the audit trail stays
        # the simulator holds the new demo's orders, and only those
        assert "simulator store" in text[loaded:ui] and "emptied" in text[loaded:ui]
        with DownstreamClient(_simulator_url(text)) as client:
            assert client.get_order("ORD-OF-AN-OLD-DEMO") is None
            assert (
                client.stats(detail=False)["orders"]
                == _count(demo, "SELECT count(*) FROM downstream_order")
                > 0
            )


def test_a_simulator_that_dies_is_restarted_on_its_url_and_said(demo, tmp_path):
    """qo-ops dev watches the simulator it started: killed, it is started again on the same
    URL (the one Dagster's processes were given), over the same store, and qo-ops says so."""
    with _dev(demo, tmp_path, "--port", str(_free_port())) as (proc, out):
        url = _simulator_url(_until_the_ui_line(proc, out))
        [first] = [p for p, cmd in _descendants(proc.pid).items() if "qo_ops.downstream.cli" in cmd]
        with DownstreamClient(url) as client:
            orders = client.stats(detail=False)["orders"]
            assert orders > 0  # seeded from the demo
            os.kill(first, signal.SIGKILL)
            deadline = time.monotonic() + 60
            while "restarted on" not in out.read_text():
                assert proc.poll() is None and time.monotonic() < deadline, out.read_text()[-2000:]
                time.sleep(0.2)
            said = [line for line in out.read_text().splitlines() if "restarted on" in line]
            assert said == [f"downstream simulator exited (killed by SIGKILL); restarted on {url}"]
            [second] = [
                p for p, cmd in _descendants(proc.pid).items() if "qo_ops.downstream.cli" in cmd
            ]
            assert second != first and client.healthy()
            assert client.stats(detail=False)["orders"] == orders  # the same store


def test_dev_without_reset_keeps_the_data_and_says_so(demo, tmp_path):
    port = _free_port()
    before = _digest(demo)
    with _dev(demo, tmp_path, "--port", str(port)) as (proc, out):
        text = _until_the_ui_line(proc, out)
        assert "as it is: 2 tenant(s)" in text
        assert "replacing" not in text and "loaded " not in text
        assert f"{UI_LINE}{port} " in text
        assert _digest(demo) == before


def test_dev_on_a_busy_port_is_refused_before_any_data_is_replaced(demo, tmp_path):
    before = _digest(demo)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # in its own session: were the check broken, Dagster's processes are stopped too
        with _dev(demo, tmp_path, "--port", str(port), "--reset-demo-data") as (proc, out):
            code = proc.wait(timeout=120)
    assert code == 2, out.read_text()
    [line] = out.read_text().splitlines()  # stdout and stderr: the one line of the error
    assert f"port {port} on 127.0.0.1 is in use" in line and "UI_PORT=" in line
    assert _digest(demo) == before


# --------------------------------------------------------------------------- the Makefile


def _make_n(tmp_path: Path, *args: str) -> list[str]:
    """The commands ``make -n ARGS`` would run, with the shared venv's bin."""
    stamp = tmp_path / "installed"
    stamp.touch()  # newer than pyproject.toml: nothing to install
    proc = subprocess.run(
        ["make", "-n", "--no-print-directory", "-C", str(REPO), *args]
        + [f"BIN={Path(QO_OPS_BIN).parent}", f"STAMP={stamp}"],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if k not in ("UI_PORT", "KEEP_DATA")},
    )
    assert proc.returncode == 0, proc.stderr
    return [line.rstrip() for line in proc.stdout.splitlines()]


@pytest.mark.parametrize(
    ("args", "dev"),
    [
        ((), f"{QO_OPS_BIN} dev --port 3000 --reset-demo-data"),
        (("UI_PORT=3001",), f"{QO_OPS_BIN} dev --port 3001 --reset-demo-data"),
        (("KEEP_DATA=1",), f"{QO_OPS_BIN} dev --port 3000"),
        (("KEEP_DATA=0", "UI_PORT=3002"), f"{QO_OPS_BIN} dev --port 3002 --reset-demo-data"),
    ],
)
def test_make_ui_passes_the_port_and_resets_the_data_unless_told_to_keep_it(tmp_path, args, dev):
    commands = _make_n(tmp_path, "ui", *args)
    assert commands == [f"{QO_OPS_BIN} db upgrade", dev]  # nothing else resets the data
    assert not any(" demo-data " in c for c in commands)  # (qo-ops demo-data …)


def test_make_demo_keeps_json_out_of_the_way_and_says_how_to_see_its_runs(tmp_path):
    commands = _make_n(tmp_path, "demo")
    assert f"{QO_OPS_BIN} demo-dagster --tenant tenant-001" in commands  # no --verbose/--json
    assert any("make ui KEEP_DATA=1" in c for c in commands)


def test_docs_name_the_port_and_keep_data_options():
    readme = (REPO / "README.md").read_text()
    dagster = (REPO / "docs" / "dagster.md").read_text()
    for text in (readme, dagster):
        assert "UI_PORT=" in text and "KEEP_DATA=1" in text and "--port" in text


def _descendants(pid: int) -> dict[int, str]:
    """pid → command line of every live process below ``pid`` (from /proc; zombies are gone,
    only not reaped yet). Dagster starts some children in sessions of their own, so the
    family tree is followed, not the session."""
    parents: dict[int, int] = {}
    lines: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if fields[0] == "Z":
                continue
            parents[int(entry.name)] = int(fields[1])
            lines[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (FileNotFoundError, ProcessLookupError, PermissionError, IndexError):
            continue
    found: dict[int, str] = {}
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        for child, ppid in parents.items():
            if ppid == parent and child not in found:
                found[child] = lines[child]
                frontier.append(child)
    return found


def _group_of(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[2])
    except (FileNotFoundError, ProcessLookupError):
        return None


def _in_groups(groups: set[int]) -> list[int]:
    """Live processes (not zombies) whose process group is one of ``groups``."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if fields[0] != "Z" and int(fields[2]) in groups:
            members.append(int(entry.name))
    return members


def _alive(pids) -> list[int]:
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            continue
        if state != "Z":
            alive.append(pid)
    return alive


@pytest.mark.parametrize("to", ["group", "qo-ops", "sigterm"])
def test_ctrl_c_stops_dagster_and_everything_it_started(demo, tmp_path, to):
    """Ctrl-C in the terminal (SIGINT to the whole foreground group), or a SIGINT or SIGTERM
    to the qo-ops process alone (a supervisor), ends `make ui` with exit 0 and no webserver, daemon,
    code server or run worker left behind listening or holding the database, within 10 s
    of Dagster's own shutdown steps (qo_ops.cli.dev.STOP_STEPS) plus the simulator's stop.

    The signal comes as a run is launched (a dry run submitted through the UI's GraphQL, as
    the Launchpad does): a code server with a run starting delays its own shutdown, which is
    what left Dagster's processes behind before its whole process group was stopped."""
    port = _free_port()
    with _dev(demo, tmp_path, "--port", str(port)) as (proc, out):
        _until_the_ui_line(proc, out)
        deadline = time.monotonic() + 180
        while True:  # the webserver answers: its children (daemon, code server) are up
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert time.monotonic() < deadline, out.read_text()[-2000:]
            time.sleep(0.5)
        DagsterGraphQLClient("127.0.0.1", port_number=port).submit_job_execution(
            "quote_expiration",
            repository_location_name="qo_ops.definitions",
            run_config={
                "ops": {
                    "quote_expiration_op": {
                        "config": {"mode": "dry_run", "tenants": ["tenant-002"]}
                    }
                }
            },
        )
        deadline = time.monotonic() + 120
        while not LAUNCHED.search(out.read_text()):  # the daemon hands a run to a code server
            assert proc.poll() is None and time.monotonic() < deadline, out.read_text()[-2000:]
            time.sleep(0.2)
        family = _descendants(proc.pid)  # dagster dev, its webserver, daemon, code server…
        assert len(family) >= 3, family
        groups = {g for g in map(_group_of, [proc.pid, *family]) if g is not None}
        assert len(groups) >= 2  # qo-ops's own and Dagster's (started in a session of its own)
        if to == "group":
            os.killpg(proc.pid, signal.SIGINT)
        else:  # a supervisor stopping qo-ops alone (kill -INT, or SIGTERM as systemd does)
            os.kill(proc.pid, signal.SIGTERM if to == "sigterm" else signal.SIGINT)
        proc.wait(timeout=120)
        # a stop asked for ends cleanly: exit 0, not Dagster's own code (make said "Error 241")
        assert proc.returncode == 0, out.read_text()[-2000:]
        assert "Dagster and the simulator stopped" in out.read_text()
        deadline = time.monotonic() + 30
        while _alive(family) and time.monotonic() < deadline:
            time.sleep(0.5)  # children exiting after their parent: polled, not assumed
        assert not _alive(family), {pid: family[pid] for pid in _alive(family)}
        assert not _in_groups(groups)  # nothing left in qo-ops's group or in Dagster's


# A Dagster that ignores Ctrl-C and SIGTERM, and so does the child it started: a process
# tree that only SIGKILL ends (as a webserver or code server stuck in its own shutdown).
STUBBORN = (
    "import signal, subprocess, sys, time\n"
    "for s in (signal.SIGINT, signal.SIGTERM): signal.signal(s, signal.SIG_IGN)\n"
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
    "time.sleep(600)\n"
)


def test_a_dagster_deaf_to_ctrl_c_is_still_stopped_with_everything_it_started():
    """qo-ops dev's stop does not wait on Dagster's own shutdown: its whole process group gets
    SIGINT, then SIGTERM, then SIGKILL (STOP_STEPS), and the stop returns once the group
    is gone. Here only SIGKILL works (signals ignored, inherited by the child)."""
    import sys
    import threading

    from qo_ops.cli.dev import STOP_STEPS, _wait_for_dagster_dev

    assert [sig for sig, _ in STOP_STEPS] == [signal.SIGINT, signal.SIGTERM, signal.SIGKILL]
    dev = subprocess.Popen([sys.executable, "-c", STUBBORN], start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while len(_descendants(dev.pid)) < 1:  # its child is up
            assert time.monotonic() < deadline and dev.poll() is None
            time.sleep(0.1)
        family = {dev.pid, *_descendants(dev.pid)}
        # Ctrl-C reaching qo-ops (this process), while it waits for Dagster; Python's own
        # SIGINT handler, as in qo-ops (an earlier test in this process may have replaced it)
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
            code, asked = _wait_for_dagster_dev(dev)
        finally:
            signal.signal(signal.SIGINT, previous)
        assert asked and code == -signal.SIGKILL  # neither SIGINT nor SIGTERM ended it
        deadline = time.monotonic() + 30
        while _alive(family) and time.monotonic() < deadline:
            time.sleep(0.2)  # the orphaned child is reaped by init: polled, not assumed
        assert not _alive(family), {pid: "alive" for pid in _alive(family)}
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(dev.pid, signal.SIGKILL)
