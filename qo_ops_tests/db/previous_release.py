"""The previous release's code, taken from git history and run beside today's schema.

"The previous code" is the newest commit whose ``qo_ops/db/migrate.py`` has ``HEAD_REVISION``
equal to the revision before today's head (the ``down_revision`` of today's head migration):

* today's head migration not committed yet (the work tree is ahead of ``HEAD``): ``HEAD``
  itself, when its ``HEAD_REVISION`` is that revision;
* otherwise ``B^``, where ``B`` is the commit that last changed the ``HEAD_REVISION = …``
  line (``git log -1 -G '^HEAD_REVISION = ' -- qo_ops/db/migrate.py``; one that rewrote
  the line without moving it is passed over), and ``B^``'s must be that revision.

``QO_OPS_PREVIOUS_CODE_COMMIT=<commit>`` names another commit instead (any commit-ish: to try
a release by hand, or to see the harness fail on code that needs another schema revision).

Missing history (a shallow clone, a tarball) fails with a message saying so, never skips:
the check is the point of the test. The commit is checked out with ``git worktree add``
in a temporary folder and its code runs as separate processes of this venv's interpreter
with ``PYTHONPATH`` (and the working directory) at the checkout: the path finder comes
before the venv's editable finder, so the checkout's ``qo_ops`` is the one imported; every
process checks that itself (``qo_ops.__file__``) before it does anything.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from qo_ops.db import migrate
from qo_ops_tests.conftest import REPO, CliResult, base_env

PREVIOUS_COMMIT_ENV = "QO_OPS_PREVIOUS_CODE_COMMIT"
MIGRATE_PY = "qo_ops/db/migrate.py"
HEAD_LINE = re.compile(r'^HEAD_REVISION = "([^"]+)"', re.MULTILINE)
# What every process of the previous code prints and exits with when it would import a
# qo_ops other than the checkout's.
NOT_PREVIOUS = "not the previous code"
NOT_PREVIOUS_EXIT = 97


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["git", *args], cwd=REPO, capture_output=True, text=True, stdin=subprocess.DEVNULL
    )


def _history_missing(what: str) -> None:
    shallow = _git("rev-parse", "--is-shallow-repository").stdout.strip() == "true"
    hint = (
        "this clone is shallow: `git fetch --unshallow` (CI: fetch-depth 0)"
        if shallow
        else "the test needs the repository's full git history"
    )
    pytest.fail(f"cannot find the previous release's code: {what}; {hint}", pytrace=False)


def head_revision_at(commit: str) -> str | None:
    """``HEAD_REVISION`` of ``qo_ops/db/migrate.py`` at ``commit`` (None: no such line)."""
    shown = _git("show", f"{commit}:{MIGRATE_PY}")
    if shown.returncode != 0:
        return None
    found = HEAD_LINE.search(shown.stdout)
    return found.group(1) if found else None


def revision_before_head() -> str:
    """The ``down_revision`` of today's head migration (Alembic's script directory)."""
    from alembic.script import ScriptDirectory

    script = ScriptDirectory(str(migrate.MIGRATIONS_DIR))
    head = script.get_revision(migrate.HEAD_REVISION)
    assert head is not None, f"no migration file for HEAD_REVISION {migrate.HEAD_REVISION}"
    down = head.down_revision
    assert isinstance(down, str), (
        f"today's head {migrate.HEAD_REVISION} has no single down revision ({down!r})"
    )
    return down


@dataclass(frozen=True)
class PreviousCode:
    """A commit of the previous code: its id, the schema revision it was written for (its
    ``HEAD_REVISION``) and how it was found."""

    commit: str
    revision: str | None
    found_by: str


def find_previous_code() -> PreviousCode:
    """The previous code's commit (see the module docstring); fails when history is missing."""
    if _git("rev-parse", "--git-dir").returncode != 0:
        pytest.fail(f"{REPO} is not a git checkout: the previous release's code is in its history")
    override = os.environ.get(PREVIOUS_COMMIT_ENV, "").strip()
    if override:
        resolved = _git("rev-parse", "--verify", "--quiet", f"{override}^{{commit}}")
        if resolved.returncode != 0:
            _history_missing(f"{PREVIOUS_COMMIT_ENV}={override} names no commit here")
        commit = resolved.stdout.strip()
        return PreviousCode(commit, head_revision_at(commit), f"{PREVIOUS_COMMIT_ENV}={override}")

    today, wanted = migrate.HEAD_REVISION, revision_before_head()
    if head_revision_at("HEAD") == wanted:  # today's head migration is not committed yet
        commit = _git("rev-parse", "HEAD").stdout.strip()
        return PreviousCode(commit, wanted, f"HEAD (at {wanted}; the work tree is at {today})")
    changed = _git("log", "--format=%H", "-G", "^HEAD_REVISION = ", "--", MIGRATE_PY)
    if changed.returncode != 0 or not changed.stdout.strip():
        _history_missing(f"no commit changes the HEAD_REVISION line of {MIGRATE_PY}")
    for moved in changed.stdout.split():  # newest first; B: the one that moved it to today's
        at_moved = head_revision_at(moved)
        assert at_moved == today, (
            f"{moved[:12]}, the last commit to move HEAD_REVISION, moved it to {at_moved}, but "
            f"the work tree's is {today}: commit the migration, or set {PREVIOUS_COMMIT_ENV}"
        )
        parent = _git("rev-parse", "--verify", "--quiet", f"{moved}^")
        if parent.returncode != 0:
            _history_missing(f"{moved[:12]} (HEAD_REVISION {today}) has no parent commit here")
        commit = parent.stdout.strip()
        at_parent = head_revision_at(commit)
        if at_parent != today:  # (else the line was touched, not moved: look further back)
            break
    assert at_parent == wanted, (
        f"the code before {moved[:12]} has HEAD_REVISION {at_parent}, not {wanted} (the "
        f"down_revision of today's head {today}): a migration was skipped or squashed"
    )
    return PreviousCode(commit, wanted, f"the parent of {moved[:12]}, which moved it to {today}")


@contextmanager
def checked_out(commit: str, where: Path) -> Iterator[Path]:
    """``commit`` in a detached git worktree at ``where`` (a path that does not exist yet);
    the worktree is removed afterwards."""
    added = _git("worktree", "add", "--detach", str(where), commit)
    assert added.returncode == 0, added.stderr
    try:
        yield where
    finally:
        _git("worktree", "remove", "--force", str(where))
        _git("worktree", "prune")


# ``python -c`` launchers: the checkout's qo_ops, or exit NOT_PREVIOUS_EXIT saying why not.
_CHECK = f"""
import sys
import qo_ops
if not qo_ops.__file__.startswith(sys.argv[1] + "/"):
    print("{NOT_PREVIOUS}: qo_ops is " + qo_ops.__file__, file=sys.stderr)
    sys.exit({NOT_PREVIOUS_EXIT})
"""
# the previous code's `qo-ops` (its `python -m qo_ops.cli`), arguments after the checkout
CLI_LAUNCHER = (
    _CHECK
    + """
import runpy
root = sys.argv.pop(1)
sys.argv[0] = "qo-ops"
runpy.run_module("qo_ops.cli", run_name="__main__", alter_sys=True)
"""
)
# The previous code's job catalog (name -> what the test needs of a spec), its HEAD_REVISION
# and its verdict on the database's schema (require_current), as one JSON object.
CATALOG_SCRIPT = (
    _CHECK
    + """
import json
import qo_ops.db.migrate as m
from qo_ops.db.engine import get_engine
from qo_ops.jobs.catalog import CATALOG
try:  # the check each of its commands makes first
    m.require_current(get_engine())
    schema_check = "ok"
except Exception as exc:
    schema_check = type(exc).__name__ + ": " + str(exc)
print(json.dumps({
    "qo_ops": qo_ops.__file__,
    "head_revision": m.HEAD_REVISION,
    "schema_check": schema_check,
    "jobs": {
        name: {
            "partitioning": spec.partitioning,
            "destructive": bool(getattr(spec, "destructive", False)),
            # a JobSpec with a Deployment part declares it there, an older one at the top
            "calls_downstream": bool(
                getattr(getattr(spec, "deployment", spec), "calls_downstream", False)
            ),
        }
        for name, spec in CATALOG.items()
    },
}))
"""
)
# The previous code's Dagster code location (qo_ops.definitions), on an ephemeral instance
# and this database: argv[2] is a JSON task. "launched": runs a Dagster webserver was asked
# to launch, each executed in process as a run worker would (its run config and tags);
# "sensors": one tick of every sensor (tenants_sensor's partitions applied first, as the
# daemon does), and run_failure_recorder on a run that fails (an execute without a reason).
# Prints one JSON object; a sensor's exception is its "error" (its traceback).
DAGSTER_SCRIPT = (
    _CHECK
    + """
import json
import os
import traceback

import dagster as dg
from dagster._core.definitions.partitions.context import partition_loading_context

from qo_ops.dagster_defs.resources import QoOpsDatabase
from qo_ops.definitions import defs
try:  # the module's home since issue 43; the previous release may predate it
    from qo_ops.platform.schedule.partition_keys import SCOPE_TAG
except ModuleNotFoundError:
    from qo_ops.platform.partition_keys import SCOPE_TAG

task = json.loads(sys.argv[2])
database = QoOpsDatabase(url=os.environ["QO_OPS_DATABASE_URL"])
out = {"qo_ops": qo_ops.__file__, "launched": [], "sensors": {}}


def tick(sensor, instance):
    context = dg.build_sensor_context(
        instance=instance, resources={"database": database}, definitions=defs
    )
    with partition_loading_context(dynamic_partitions_store=instance):
        return sensor.evaluate_tick(context)


with dg.instance_for_test() as instance:
    for run in task.get("launched", []):
        instance.add_dynamic_partitions("tenants", task["tenants"])
        tags = dict(run["tags"])
        partition = tags.pop("dagster/partition", None)
        result = defs.resolve_job_def(run["job"]).execute_in_process(
            run_config=run["run_config"], tags=tags, partition_key=partition,
            instance=instance, raise_on_error=False,
        )
        out["launched"].append({"job": run["job"], "success": result.success})
    if task.get("sensors"):
        sensors = sorted(defs.sensors, key=lambda s: s.name != "tenants_sensor")
        for sensor in sensors:
            if isinstance(sensor, dg.RunStatusSensorDefinition):
                continue
            seen = out["sensors"][sensor.name] = {}
            try:
                result = tick(sensor, instance)
            except Exception:
                seen["error"] = traceback.format_exc()
                continue
            seen["run_requests"] = len(result.run_requests or [])
            seen["skip_message"] = result.skip_message
            seen["asset_events"] = len(result.asset_events or [])
            for request in result.dynamic_partitions_requests or []:
                if isinstance(request, dg.AddDynamicPartitionsRequest):
                    instance.add_dynamic_partitions(
                        request.partitions_def_name, request.partition_keys
                    )
                    # every request's keys: a release may keep more than one dynamic set
                    added = {*seen.get("added_partitions", []), *request.partition_keys}
                    seen["added_partitions"] = sorted(added)
        for sensor in defs.sensors:
            if not isinstance(sensor, dg.RunStatusSensorDefinition):
                continue
            seen = out["sensors"][sensor.name] = {}
            try:
                failed = defs.resolve_job_def("quote_expiration").execute_in_process(
                    partition_key=task["tenants"][0],
                    instance=instance,
                    run_config={"ops": {"quote_expiration_op": {"config": {"mode": "execute"}}}},
                    tags={SCOPE_TAG: "quote_expiration:" + task["tenants"][0]},
                    raise_on_error=False,
                )
                event = instance.all_logs(
                    failed.run_id, of_type=dg.DagsterEventType.RUN_FAILURE
                )[0].dagster_event
                context = dg.build_run_status_sensor_context(
                    sensor_name=sensor.name,
                    dagster_event=event,
                    dagster_instance=instance,
                    dagster_run=instance.get_run_by_id(failed.run_id),
                    resources={"database": database},
                ).for_run_failure()
                sensor(context)
                seen["failed_run"] = failed.run_id
            except Exception:
                seen["error"] = traceback.format_exc()
print(json.dumps(out))
"""
)


@dataclass
class PreviousRelease:
    """The previous code checked out at ``path``; runs it as separate processes."""

    code: PreviousCode
    path: Path

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of a previous-code process: ``base_env`` with ``PYTHONPATH`` at
        the checkout, plus ``extra``."""
        return base_env(PYTHONPATH=str(self.path), **extra)

    def python(self, script: str, *args: str) -> list[str]:
        """The argv of ``python -c script <checkout> args…`` (a launcher above)."""
        return [sys.executable, "-P", "-c", script, str(self.path), *args]

    def cli_argv(self, *args: str) -> list[str]:
        """The argv of the previous code's ``qo-ops args…``."""
        return self.python(CLI_LAUNCHER, *args)

    def popen(self, argv: list[str], env: dict[str, str], **kw: Any) -> subprocess.Popen[str]:
        return subprocess.Popen(
            argv, env=env, cwd=self.path, stdin=subprocess.DEVNULL, text=True, **kw
        )

    def run(self, argv: list[str], env: dict[str, str], timeout: float = 300) -> CliResult:
        done = subprocess.run(
            argv,
            env=env,
            cwd=self.path,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
        return CliResult(done.returncode, done.stdout, done.stderr)

    def cli(self, env: dict[str, str], *args: str, timeout: float = 300) -> CliResult:
        """Run the previous code's ``qo-ops args…`` to its end."""
        return self.run(self.cli_argv(*args), env, timeout)

    def catalog(self, env: dict[str, str]) -> dict[str, Any]:
        """The previous code's catalog (CATALOG_SCRIPT's object)."""
        done = self.run(self.python(CATALOG_SCRIPT), env)
        assert done.code == 0, done.stderr[-3000:]
        return dict(json.loads(done.stdout))

    def dagster(self, env: dict[str, str], task: dict[str, Any]) -> dict[str, Any]:
        """Run DAGSTER_SCRIPT with ``task``; its JSON object."""
        done = self.run(self.python(DAGSTER_SCRIPT, json.dumps(task)), env, timeout=600)
        assert done.code == 0, done.stderr[-5000:]
        return dict(json.loads(done.stdout.strip().splitlines()[-1]))


# --------------------------------------------------------------- a Dagster that takes launches


@dataclass
class RecordingDagster:
    """Stands in for Dagster's webserver before the API (``QO_OPS_DAGSTER_URL``): its
    GraphQL endpoint takes every launch (``LaunchRunSuccess``, a new run id) and records
    what it was asked to run, answers a run's status (``status``), agrees to terminate.
    What a launched run would do in Dagster, a test does with ``launched``."""

    status: str = "QUEUED"
    launched: list[dict[str, Any]] = field(default_factory=list)
    server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def answer(self, body: dict[str, Any]) -> dict[str, Any]:
        query, variables = body.get("query", ""), body.get("variables") or {}
        if "launchRun" in query:
            params = variables["executionParams"]
            run_id = str(uuid.uuid4())
            self.launched.append(
                {
                    "run_id": run_id,
                    "job": params["selector"]["jobName"],
                    "run_config": params["runConfigData"],
                    "tags": {t["key"]: t["value"] for t in params["executionMetadata"]["tags"]},
                }
            )
            return {"launchRun": {"__typename": "LaunchRunSuccess", "run": {"runId": run_id}}}
        if "terminateRun" in query:
            return {"terminateRun": {"__typename": "TerminateRunSuccess"}}
        if "runOrError" in query:
            return {"runOrError": {"__typename": "Run", "status": self.status}}
        raise AssertionError(f"a GraphQL request the API is not known to send: {query[:200]}")

    @contextmanager
    def serving(self) -> Iterator[RecordingDagster]:
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                length = int(self.headers.get("Content-Length") or 0)
                payload = json.dumps({"data": recorder.answer(json.loads(self.rfile.read(length)))})
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(payload.encode())

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self.server.shutdown()
            self.server.server_close()
            thread.join(timeout=10)
