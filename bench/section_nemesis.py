"""Nemesis: seeded random faults over real processes (``bench/nemesis``), for the profile's
``nemesis_s`` seconds of iterations, then a final clean pass and the invariant checker.

Each iteration appends a demo tenant and starts overlapping real ``qo-ops run`` executes of a
few catalog jobs (all eleven within a few iterations), with one or two faults at seeded
moments: SIGKILL, SIGTERM, SIGSTOP past the lease TTL, ``pg_ctl restart``,
``pg_terminate_backend``, a downstream outage (503 or refused) and a flaky downstream.

It reports the iterations, the faults by kind, the violations (goal 0) and the time from
the last fault of an iteration to a clean end (nothing recorded running, no lease held, a
rerun of every touched job and scope not skipped), p50 and p99 against a goal of 3 s. The
seed is ``QO_OPS_NEMESIS_SEED``, else a new one each suite run (printed with its replay
command). The server is the nemesis's own embedded one (restarted for real), or
QO_OPS_TEST_DATABASE_URL's, which it never restarts (its restarts are counted missed).
"""

from __future__ import annotations

import os
import random

from bench.common import percentile
from bench.nemesis.harness import NemesisConfig, run_nemesis
from bench.nemesis.report import (
    clean_end_seconds,
    faults_by_kind,
    freed_after_kill_seconds,
    reaped_after_kill_seconds,
    summary_lines,
)
from bench.suite import Profile, Row, Section

TITLE = "Nemesis: seeded random faults"
CLEAN_END_GOAL_S = 3.0
SEED_ENV = "QO_OPS_NEMESIS_SEED"


def run(profile: Profile) -> Section:
    seed = int(os.environ.get(SEED_ENV) or random.SystemRandom().randrange(1, 1_000_000))
    config = NemesisConfig(seed, seconds=profile.nemesis_s)
    print(f"   seed {seed}, iterations for {profile.nemesis_s} s", flush=True)
    result = run_nemesis(config, say=lambda line: print(f"   {line.strip()}", flush=True))
    for line in summary_lines(result):
        print(f"   {line}", flush=True)
    iterations = len(result.iterations)
    landed, missed = faults_by_kind(result), faults_by_kind(result, landed=False)
    seconds = clean_end_seconds(result)
    p50, p99 = percentile(seconds, 0.5), percentile(seconds, 0.99)
    reaped, freed = reaped_after_kill_seconds(result), freed_after_kill_seconds(result)
    timed_out = iterations - len(seconds)
    size = f"{profile.nemesis_s / 60:.1f} min, seed {seed}"
    by_kind = ", ".join(f"{k} {n}" for k, n in landed.items())
    replay = f"`{result.replay}` (`make nemesis SEED={seed} ITERATIONS={iterations}`)"
    rows = [
        Row("iterations", size, f"{iterations}", "", None, "", None),
        Row("faults by kind", size, by_kind, "", None, "", None),
        Row("violations", size, f"{len(result.violations)}", "0", None, "0", not result.violations),
        _kill_row("a SIGKILLed run: scope free (its process gone), p99", size, freed),
        _kill_row("a SIGKILLed run: record finished (reaped), p99", size, reaped),
        Row("time to a clean end p50", size, f"{p50:.1f} s", "", None, "", None),
        Row(
            "time to a clean end p99 (every fault)",
            size,
            f"{p99:.1f} s" + (f" ({timed_out} timed out)" if timed_out else ""),
            "",
            None,
            "none timed out",
            not timed_out,
        ),
    ]
    missed_text = ", ".join(f"{k} {n}" for k, n in missed.items() if n) or "none"
    notes = [
        f"Seed {seed}: {iterations} iterations in {result.took_s / 60:.1f} minutes, a final "
        f"clean pass of {len(result.final_runs)} runs; replay: {replay}.",
        f"Faults that found nothing to hit (a signal with no run alive, a restart of a server "
        f"that is not the nemesis's): {missed_text}.",
        "A SIGKILLed run (issue 40's goal: 3 s at p99; before, 31-37 s, the lease's TTL): "
        "its scope is free once PostgreSQL shows its process gone (its liveness lock "
        "dropped: the lease's and the reaper's one predicate, polled every 10 ms from the "
        f"kill; each: {', '.join(f'{s:.2f}' for s in freed)} s); its record is finished by "
        "the next reaper, any run that starts or beats its heartbeat (from the kill to the "
        f"record's finished_at, the database's clock; each: "
        f"{', '.join(f'{s:.1f}' for s in reaped)} s).",
        "Time to a clean end: from the end of an iteration's last fault (a signal sent, the "
        "server back, the downstream healed, a frozen run continued) until no run is "
        "recorded running, no lease is held and a rerun of each touched job and scope (every "
        "0.5 s) is not skipped: runs at work when the faults ended are waited for too, so it "
        f"is reported without a goal; each iteration: {', '.join(f'{s:.1f}' for s in seconds)} s.",
        *[f"Violation: {v}" for v in result.violations],
    ]
    raw = {
        "seed": seed,
        "iterations": iterations,
        "faults_by_kind": landed,
        "faults_missed": missed,
        "clean_end_s": seconds,
        "reaped_after_kill_s": reaped,
        "freed_after_kill_s": freed,
        "violations": [str(v) for v in result.violations],
        "replay": result.replay,
    }
    return Section(TITLE, rows, notes, raw)


def _kill_row(what: str, size: str, seconds: list[float]) -> Row:
    """A row of the kills' seconds against the 3 s goal (none: no kill hit a running run)."""
    if not seconds:
        return Row(what, size, "no kill hit a running run", "", None, "", None)
    p99 = percentile(seconds, 0.99)
    return Row(
        what,
        size,
        f"{p99:.2f} s (p50 {percentile(seconds, 0.5):.2f} s, {len(seconds)} kills)",
        f"{CLEAN_END_GOAL_S:.0f} s",
        p99 / CLEAN_END_GOAL_S,
        f"≤ {CLEAN_END_GOAL_S:.0f} s at p99",
        p99 <= CLEAN_END_GOAL_S,
    )
