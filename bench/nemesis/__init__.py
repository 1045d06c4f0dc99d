"""The nemesis: seeded random faults over real processes, and an invariant checker.

Each iteration appends a demo tenant (new work of every kind), starts overlapping real
``qo-ops run … --mode execute`` processes of a few catalog jobs (every job comes up within a
few iterations), and injects one or two faults at seeded moments: SIGKILL, SIGTERM, SIGSTOP
past the lease TTL (a rival takes over, then SIGCONT), ``pg_ctl restart``,
``pg_terminate_backend`` of qo-ops's sessions, a downstream outage (503 or refused
connections) and a flaky downstream, through the simulator's admin API. After healing, it
times the way to a clean end (reruns every half second until none is skipped, nothing is
recorded running and no lease is held). At the end a clean pass runs every (job, scope) once
more and ``invariants.check_all`` judges the result.

    python -m bench.nemesis --seed 7 --iterations 12     # replays that seed exactly
    python -m bench.nemesis --seed 7 --seconds 120 --json
"""

from bench.nemesis.harness import NemesisConfig, NemesisResult, run_nemesis

__all__ = ["NemesisConfig", "NemesisResult", "run_nemesis"]
