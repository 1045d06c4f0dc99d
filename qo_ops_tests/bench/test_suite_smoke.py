"""The benchmark suite still runs: every section at the `quick` profile, on the test
server, end to end (a smoke check only — figures are for `make bench`, never asserted)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bench.suite import SECTIONS
from qo_ops_tests.conftest import REPO, base_env


@pytest.mark.timeout(1140)  # the subprocess's own 1,080 s first: its output is the failure
def test_every_section_runs_at_the_quick_profile(pg_server, tmp_path):
    server = pg_server.set(drivername="postgresql").render_as_string(hide_password=False)
    result = subprocess.run(
        [sys.executable, "-m", "bench.suite", "--profile", "quick", "--no-write"],
        cwd=REPO,
        env=base_env(QO_OPS_TEST_DATABASE_URL=server, QO_OPS_HOME=str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=1080,  # the nemesis and breaker sections take about a minute each
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "| section | what | size | figure |" in result.stdout
    for name in SECTIONS:
        module = __import__(f"bench.section_{name}", fromlist=["TITLE"])
        assert f"== {module.TITLE} (quick)" in result.stdout
    # the orchestration section went through a real daemon tick and evaluated every tick
    assert "(real daemon tick)" in result.stdout
    assert "| tick evaluation: quote_expiration_schedule |" in result.stdout
    assert "| partitions: tenants (dynamic) |" in result.stdout
    # the soak sampled a real deployment with everything on, through an outage
    assert "downstream stopped" in result.stdout and "restarted on http" in result.stdout
    assert "| Run queue, deepest (soak) |" in result.stdout
    # the nemesis ran iterations of faults and its checker (violations are figures here)
    assert "| Nemesis: seeded random faults | iterations |" in result.stdout
    assert "| Nemesis: seeded random faults | violations |" in result.stdout
    assert "final clean pass over" in result.stdout
    # the breaker section drove the real jobs through a flaky and a down simulator
    assert "| Breaker: flaky is not down | flaky downstream" in result.stdout
    assert "| Breaker: flaky is not down | outage of timeouts" in result.stdout
    assert "Traceback" not in result.stderr
