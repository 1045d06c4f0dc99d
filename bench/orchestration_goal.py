"""Only the orchestration section's throughput goal: the real daemon tick over 1,000 tenants
and the tick's RunRequests over 100 tenants through launchRun, each against the ``run_job``
loop over the same tenants (before and after the deployment, its mean the limit), as
``bench/section_orchestration.py`` measures them, without the chunk sizes, the staggered
tick and the 10,000-tenant evaluation (minutes instead of most of an hour).

    PYTHONPATH=. python -P -m bench.orchestration_goal [big] [small]

Prints one line per figure and a JSON summary; writes nothing (``BENCHMARKS.md`` is the
suite's). Its databases have their own names, so it may run beside the suite."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import cloned_database, fresh_database, stopwatch
from bench.orchestration_data import (
    JOB,
    PREFIX,
    eligible,
    load,
    loops,
    partition_start,
    tenant_key,
)
from bench.orchestration_deployment import deployment
from bench.orchestration_ticks import real_tick, submitted_tick, wait_runs

GOAL_PREFIX = f"{PREFIX}_goal"
_FIGURES = (
    "tick_s",
    "dagster_runs",
    "queued_s_median",
    "process_start_s_median",
    "worker_s_median",
    "run_job_ms_median",
    "op_overhead_ms_per_tenant",
    "events_per_tenant",
    "storage_sessions_per_tenant",
    "storage_commits_per_tenant",
)


def measure(big: int = 1_000, small: int = 100) -> dict[str, Any]:
    """The two ticks and their loops; the ratios loop / tick."""
    from qo_ops.jobs.catalog import CATALOG

    chunk = CATALOG[JOB].deployment.tenants_per_run
    sets = {
        f"tick_{big}": [tenant_key(i) for i in range(1, big + 1)],
        f"tick_{small}": [tenant_key(i) for i in range(big + 1, big + small + 1)],
    }
    out: dict[str, Any] = {"load_average_start": os.getloadavg()}
    with fresh_database(f"{GOAL_PREFIX}_tpl") as template:
        load(template, big + small)
        expected = {name: eligible(template, t) for name, t in sets.items()}
        before = loops(template, sets, expected, 10)
        ticks: dict[str, Any] = {}
        with (
            cloned_database(template, f"{GOAL_PREFIX}_dagster") as url,
            tempfile.TemporaryDirectory(prefix="qo-ops-bench-goal-") as tmp,
        ):
            env = {
                "QO_OPS_PARTITION_START": partition_start().isoformat(),
                "QO_OPS_DOWNSTREAM_URL": "http://127.0.0.1:9",
            }
            with deployment(url, Path(tmp), env) as d:
                d.set_tenants(sets[f"tick_{small}"][:1])
                with stopwatch() as warm:
                    warm_id = d.launch(
                        {"mode": "dry_run", "tenants": sets[f"tick_{small}"][:2]},
                        {"qo_ops/scope": f"{JOB}:warm-up"},
                    )
                    wait_runs(d, url, [warm_id], 300)
                print(f"   deployment up; warm-up run {warm[0]:.1f} s", flush=True)
                ticks[big] = real_tick(d, url, sets[f"tick_{big}"], expected[f"tick_{big}"])
                print(f"   real tick, {big} tenants: {ticks[big]['tick_s']:.1f} s", flush=True)
                ticks[small] = submitted_tick(
                    d, url, sets[f"tick_{small}"], chunk, expected[f"tick_{small}"]
                )
                print(f"   launchRun, {small} tenants: {ticks[small]['tick_s']:.1f} s", flush=True)
        after = loops(template, sets, expected, 11)
    for n in (big, small):
        loop = (before[f"tick_{n}"]["wall_s"] + after[f"tick_{n}"]["wall_s"]) / 2
        out[n] = {
            "loop_s": (before[f"tick_{n}"]["wall_s"], after[f"tick_{n}"]["wall_s"]),
            "ratio": loop / ticks[n]["tick_s"],
            **{k: ticks[n].get(k) for k in _FIGURES},
        }
    out["load_average_end"] = os.getloadavg()
    return out


if __name__ == "__main__":
    sizes = [int(a) for a in sys.argv[1:3]]
    result = measure(*sizes)
    for n in (k for k in result if isinstance(k, int)):
        r = result[n]
        print(
            f"{n} tenants: tick {r['tick_s']:.1f} s, loop {r['loop_s'][0]:.1f} / "
            f"{r['loop_s'][1]:.1f} s, ratio {r['ratio']:.2f}"
        )
    print(json.dumps(result, default=str))
