"""A nemesis's figures: faults by kind, time to a clean end (p50/p99), violations; as a few
lines for a person or one JSON object."""

from __future__ import annotations

from collections import Counter
from typing import Any

from bench.common import percentile
from bench.nemesis.harness import NemesisResult
from bench.nemesis.plan import FaultKind


def faults_by_kind(result: NemesisResult, landed: bool = True) -> dict[str, int]:
    """How many faults of each kind landed (or, ``landed=False``, were missed: a signal
    with no run alive, a restart of a server that is not ours), every kind named."""
    counted = Counter(
        r.kind.value for i in result.iterations for r in i.faults if r.landed is landed
    )
    return {kind.value: counted.get(kind.value, 0) for kind in FaultKind}


def clean_end_seconds(result: NemesisResult) -> list[float]:
    """Each iteration's time from its last fault to a clean end (timed-out ones left out)."""
    return [i.clean_end.seconds for i in result.iterations if i.clean_end.seconds is not None]


def reaped_after_kill_seconds(result: NemesisResult) -> list[float]:
    """Each SIGKILL that ended a recorded run: seconds until its record was finished and its
    scope free (the next run of its job reaps it; its lease is free once its lock is gone)."""
    return [s for i in result.iterations for s in i.reaped_after_kill_s]


def freed_after_kill_seconds(result: NemesisResult) -> list[float]:
    """Each SIGKILL that hit a running run: seconds until PostgreSQL showed it gone."""
    return [
        r.freed_after_s for i in result.iterations for r in i.faults if r.freed_after_s is not None
    ]


def as_dict(result: NemesisResult) -> dict[str, Any]:
    """The figures as one JSON-able object."""
    seconds = clean_end_seconds(result)
    reaped = reaped_after_kill_seconds(result)
    freed = freed_after_kill_seconds(result)
    return {
        "seed": result.config.seed,
        "iterations": len(result.iterations),
        "took_s": round(result.took_s, 1),
        "faults_by_kind": faults_by_kind(result),
        "faults_missed": {k: n for k, n in faults_by_kind(result, landed=False).items() if n},
        "clean_end_s": {
            "p50": round(percentile(seconds, 0.5), 2),
            "p99": round(percentile(seconds, 0.99), 2),
            "timed_out": len(result.iterations) - len(seconds),
            "each": [round(s, 2) for s in seconds],
        },
        "reaped_after_kill_s": {
            "p50": round(percentile(reaped, 0.5), 2) if reaped else None,
            "p99": round(percentile(reaped, 0.99), 2) if reaped else None,
            "each": [round(s, 2) for s in reaped],
        },
        "freed_after_kill_s": {
            "p50": round(percentile(freed, 0.5), 3) if freed else None,
            "p99": round(percentile(freed, 0.99), 3) if freed else None,
            "each": [round(s, 3) for s in freed],
        },
        "final_runs": len(result.final_runs),
        "checked": result.checked,
        "violations": [{"invariant": v.invariant, "what": v.what} for v in result.violations],
        "replay": result.replay,
        "logs": str(result.logs) if result.logs else None,
    }


def _reaped_line(reaped: dict[str, Any], freed: dict[str, Any]) -> str:
    if not reaped["each"] and not freed["each"]:
        return "a SIGKILLed run: no kill hit a recorded running run"
    line = "a SIGKILLed run"
    if freed["each"]:
        line += (
            f": scope free (its process gone) p50 {freed['p50']:.2f} s, "
            f"p99 {freed['p99']:.2f} s ({len(freed['each'])} kills)"
        )
    if reaped["each"]:
        line += (
            f"; record finished p50 {reaped['p50']:.1f} s, p99 {reaped['p99']:.1f} s "
            f"({len(reaped['each'])} kills)"
        )
    return line


def summary_lines(result: NemesisResult) -> list[str]:
    """What a person reads: iterations, faults by kind, clean ends, violations, the replay."""
    data = as_dict(result)
    faults = ", ".join(f"{k} {n}" for k, n in data["faults_by_kind"].items())
    missed = ", ".join(f"{k} {n}" for k, n in data["faults_missed"].items())
    clean = data["clean_end_s"]
    lines = [
        f"nemesis seed {result.config.seed}: {data['iterations']} iterations in "
        f"{result.took_s:.0f} s, final clean pass of {data['final_runs']} runs",
        f"faults by kind: {faults}" + (f" (missed: {missed})" if missed else ""),
        f"time to a clean end: p50 {clean['p50']:.1f} s, p99 {clean['p99']:.1f} s"
        + (f", {clean['timed_out']} timed out" if clean["timed_out"] else ""),
        _reaped_line(data["reaped_after_kill_s"], data["freed_after_kill_s"]),
        "checked: " + ", ".join(f"{n:,} {what}" for what, n in result.checked.items()),
        f"violations: {len(result.violations)}",
        *[f"  - {v}" for v in result.violations],
        f"replay: {result.replay}",
    ]
    if result.logs:
        lines.append(f"the runs' output is kept in {result.logs}")
    return lines
