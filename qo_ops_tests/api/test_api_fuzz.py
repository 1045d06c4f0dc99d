"""The operator API against its own contract: schemathesis generates requests from the
OpenAPI document the API serves (every check, the stateful phase following the document's
links) and sends them to a real ``qo-ops api`` on a real PostgreSQL, in front of a real
Dagster webserver (no daemon: a launched run is taken and stays queued, nothing executes).

Once with an approver's token for every tenant, once with an operator's token limited to
one tenant. The seed is fixed in ``make test`` (and so in CI); ``make fuzz`` draws a new one
each time (``QO_OPS_FUZZ_SEED=random``); either way it is printed, and
``QO_OPS_FUZZ_SEED=N`` replays one. A failure prints schemathesis's report, with
the ``curl`` line that reproduces each failing request.

What the document cannot say is in ``schemathesis.toml`` beside this file: which refusals
of a request valid by its schema are the API's rules rather than a broken contract.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from qo_ops_tests.api.conftest import ApiServer
from qo_ops_tests.conftest import base_env
from qo_ops_tests.dagster.stack import dagster_stack

HERE = Path(__file__).resolve().parent
CONFIG = HERE / "schemathesis.toml"
SCHEMATHESIS = str(Path(sys.executable).with_name("schemathesis"))
SEED_ENV = "QO_OPS_FUZZ_SEED"
FIXED_SEED = 20261203
EXAMPLES = 25  # per operation and phase: the whole run stays well under a minute
TENANT = "tenant-001"  # the demo data's (and the document's examples')


def _seed() -> int:
    """``QO_OPS_FUZZ_SEED``: a number replays that run, ``random`` draws a new one (`make
    fuzz`); unset (``make test``, CI), the fixed seed."""
    given = os.environ.get(SEED_ENV, "").strip()
    if given == "random":
        return random.randrange(2**31)
    return int(given) if given else FIXED_SEED


def fuzz(api: ApiServer, token: str, *extra: str) -> subprocess.CompletedProcess:
    """One schemathesis run against ``api`` as ``token``'s holder; its output is printed, so
    that a failing test shows the report and the reproducing ``curl`` lines."""
    seed = _seed()
    cmd = [
        SCHEMATHESIS,
        "--config-file",
        str(CONFIG),
        "run",
        f"{api.url}/openapi.json",
        "--checks",
        "all",
        "--max-examples",
        str(EXAMPLES),
        "--seed",
        str(seed),
        "--workers",
        "1",
        "--generation-database",
        "none",
        "--header",
        f"Authorization: Bearer {token}",
        *extra,
    ]
    env = base_env(SCHEMATHESIS_TELEMETRY="false", NO_COLOR="1")
    done = subprocess.run(
        cmd, cwd=api.log.parent, env=env, capture_output=True, text=True, timeout=600
    )
    print(f"schemathesis seed {seed} (replay: {SEED_ENV}={seed})")
    # a generated body can be a very long line: each line is cut, so that the report's
    # headings and every failure's curl line stay in view (st replay gives the whole)
    lines = [line if len(line) <= 3000 else f"{line[:3000]} …" for line in done.stdout.splitlines()]
    print("\n".join(lines)[-30000:])
    print(done.stderr[-5000:])
    return done


@pytest.fixture
def fuzzed_api(loaded, api_factory, tmp_path) -> ApiServer:
    home = tmp_path / "dagster"
    home.mkdir()
    with dagster_stack(loaded, home, daemon=False) as (_, instance, port):
        instance.add_dynamic_partitions("tenants", ["tenant-001", "tenant-002"])
        api = api_factory(
            dagster_url=f"http://127.0.0.1:{port}",
            QO_OPS_API_RATE_LIMIT="100000",  # the fuzzer is one identity sending hundreds
        )
        try:
            yield api
        finally:  # first: its open connections would hold the webserver's shutdown for 30 s
            api.stop()


@pytest.mark.parametrize("who", ["approver, every tenant", "operator, one tenant"])
def test_the_api_keeps_its_openapi_contract_under_fuzzing(fuzzed_api, who):
    if who.startswith("approver"):
        token = fuzzed_api.token("ada", "approver")
    else:
        token = fuzzed_api.token("otto", "operator", tenant=TENANT)
    done = fuzz(fuzzed_api, token)  # every phase: examples, coverage, fuzzing, stateful
    assert done.returncode == 0, f"schemathesis found failures ({who}): see its report above"
    assert "Scenarios:" in done.stdout  # the stateful phase ran its scenarios


PLANTED = """
import sys
from fastapi.responses import JSONResponse
from qo_ops.api import cli

app = cli.build_app()

@app.middleware("http")
async def teapot(request, call_next):  # a route answering a status its document never names
    if request.url.path == "/internal/jobs":
        return JSONResponse({"error": "teapot", "requestId": "x"}, status_code=418)
    return await call_next(request)

import uvicorn
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""


def test_an_undocumented_status_fails_the_fuzzing(loaded, api_factory, tmp_path):
    """The planted broken outcome: the same API with one route answering 418, which its
    document does not list. The run must fail, naming it, with a curl line to reproduce."""
    reference = api_factory()  # its environment and a token, from the real fixture
    token = reference.token("ada", "approver")
    planted = ApiServer(
        {**reference.env, "QO_OPS_API_RATE_LIMIT": "100000"},
        tmp_path / "planted.log",
        reference.admin_env,
        command=lambda port: [sys.executable, "-c", PLANTED, str(port)],
    )
    try:
        done = fuzz(planted, token, "--include-path", "/internal/jobs", "--include-method", "GET")
    finally:
        planted.stop()
    assert done.returncode != 0
    assert "Undocumented status code" in done.stdout and "Received: 418" in done.stdout
    assert "curl" in done.stdout
