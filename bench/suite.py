"""The benchmark suite: one table of figures, each against its limit measured in the same run
on the same machine, written to BENCHMARKS.md.

    python -m bench.suite                 # default sizes (make bench): ~75 minutes (the soak
                                          # ~45: 3 runs and 1 under load, the nemesis ~10)
    python -m bench.suite --profile full  # the published sizes (1,000,000 rows, 10,000,000 big)
    python -m bench.suite --profile quick # seconds: a smoke check (make test), no figures kept
    python -m bench.suite --only jobs,partitions
    python -m bench.suite --profile full --only orchestration  # re-measure one section

Each section is a module ``bench/section_<name>.py`` with ``TITLE`` and
``run(profile: Profile) -> Section``. A section measures, verifies that the work was really
done (a benchmark of wrong work is worthless), and returns rows; medians are over
``profile.repeats`` runs. Raw figures go to ``bench/results/<profile>.json``; the full and
default profiles also write ``BENCHMARKS.md``. With ``--only``, the sections measured replace
their own rows, notes and raw figures there (a section's ``REPLACES`` names titles it had
before) and the rest stay as they were measured.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
SECTIONS = (
    "jobs",
    "partitions",
    "orchestration",
    "big_tables",
    "dry_run",
    "downstream",
    "breaker",
    "soak",
    "nemesis",
    "migrations",
)


@dataclass(frozen=True)
class Profile:
    """Sizes of one suite run."""

    name: str
    rows: int  # eligible rows per job throughput run (section 1)
    memory_sizes: tuple[int, ...]  # rows for the peak-RSS curve (section 2)
    repeats: int  # runs per figure; the table shows medians
    tenants_parallel: tuple[int, ...]  # concurrent tenant processes (section 4)
    rows_per_tenant: int  # section 4
    # orchestration: a schedule tick through Dagster at each size (the largest is the
    # daemon's real tick), the chunk sizes compared at the largest, the tenants of the
    # staggered-load tick, and the tenants of the tick-evaluation and partition counts
    orchestration_tenants: tuple[int, ...]
    chunk_sizes: tuple[int, ...]
    stagger_tenants: int
    eval_tenants: int
    big_rows: int  # rows in the largest tables for sensors and the exporter (section 6)
    dry_run_rows: int  # eligible rows to count (section 7)
    downstream_items: int  # due items per downstream job run (section 8)
    # the soak: tenants of demo data, tenants per run (small: more runs than the deployment
    # starts), and how long every schedule and sensor runs (the downstream out for a third)
    soak_tenants: int
    soak_tenants_per_run: int
    soak_s: int
    nemesis_s: int  # seconds of nemesis iterations (then its final clean pass, ~1-2 min more)
    # the breaker: tenants of demo data (400 delivery items, 600 events each), flaky rounds
    breaker_tenants: int
    breaker_rounds: int


PROFILES = {
    "quick": Profile(
        "quick",
        2_000,
        (500, 1_000, 2_000),
        1,
        (1, 2),
        1_000,
        orchestration_tenants=(3, 8),
        chunk_sizes=(3, 50),
        stagger_tenants=4,
        eval_tenants=300,
        big_rows=20_000,
        dry_run_rows=2_000,
        downstream_items=1_000,
        soak_tenants=3,
        soak_tenants_per_run=1,
        soak_s=150,
        nemesis_s=30,
        breaker_tenants=1,
        breaker_rounds=8,
    ),  # fmt: skip
    "default": Profile(
        "default",
        250_000,
        (10_000, 100_000, 250_000),
        3,
        (1, 2, 4),
        100_000,
        orchestration_tenants=(100, 1_000),
        chunk_sizes=(20, 50, 100),
        stagger_tenants=100,
        eval_tenants=10_000,
        big_rows=2_000_000,
        dry_run_rows=1_000_000,
        downstream_items=20_000,
        soak_tenants=30,
        soak_tenants_per_run=5,
        soak_s=540,
        nemesis_s=420,
        breaker_tenants=3,
        breaker_rounds=12,
    ),  # fmt: skip
    "full": Profile(
        "full",
        1_000_000,
        (10_000, 100_000, 1_000_000),
        3,
        (1, 2, 4),
        250_000,
        orchestration_tenants=(100, 1_000),
        chunk_sizes=(20, 50, 100),
        stagger_tenants=100,
        eval_tenants=10_000,
        big_rows=10_000_000,
        dry_run_rows=1_000_000,
        downstream_items=50_000,
        soak_tenants=30,
        soak_tenants_per_run=5,
        soak_s=1_200,
        nemesis_s=960,
        breaker_tenants=3,
        breaker_rounds=12,
    ),  # fmt: skip
}


@dataclass
class Row:
    """One line of the table: a measured figure beside its limit."""

    what: str
    size: str
    figure: str  # e.g. "41,200 rows/s"
    limit: str  # e.g. "52,000 rows/s (one UPDATE)"
    ratio: float | None  # figure / limit where that is meaningful
    goal: str  # e.g. ">= 0.7"
    met: bool | None
    note: str = ""
    # the lowest and highest ratio of the runs whose median is ``ratio`` (pair by pair where
    # the figure and its limit were measured in alternation), so a swing reads as noise
    ratio_range: tuple[float, float] | None = None


@dataclass
class Section:
    title: str
    rows: list[Row]
    notes: list[str] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict)


def median(values: list[float]) -> float:
    return float(statistics.median(values))


@dataclass(frozen=True)
class Spread:
    """Min, median and max of one figure's repeats: the median is the figure, min and max say
    how much of a difference between two runs is noise."""

    low: float
    mid: float
    high: float
    runs: int

    @classmethod
    def of(cls, values: list[float]) -> Spread:
        return cls(float(min(values)), median(values), float(max(values)), len(values))

    @property
    def range(self) -> tuple[float, float] | None:
        """(min, max), or None for a single run (nothing to compare it with)."""
        return (self.low, self.high) if self.runs > 1 else None

    def show(self, fmt: Callable[[float], str]) -> str:
        """``fmt(median)``, then ``(fmt(min)–fmt(max))`` when there was more than one run."""
        if self.runs < 2:
            return fmt(self.mid)
        return f"{fmt(self.mid)} ({fmt(self.low)}–{fmt(self.high)})"


def pairwise_ratios(figures: list[float], limits: list[float]) -> Spread:
    """The ratio figure/limit of each repeat (each pair measured back to back, in alternating
    order), as a spread: a drift of the machine's speed between repeats hits both sides of a
    pair alike."""
    return Spread.of([f / lim for f, lim in zip(figures, limits, strict=True)])


def repeat(times: int, measure: Callable[[int], dict[str, Any]]) -> list[dict[str, Any]]:
    """``measure(i)`` for i in range(times): every run's raw figures, for medians."""
    return [measure(i) for i in range(times)]


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_kb = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem_kb = int(line.split()[1])
    except OSError:
        pass
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        commit = "?"
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(mem_kb / 1024 / 1024, 1),
        "python": platform.python_version(),
        "postgresql": "16 (pgserver, embedded)"
        if not os.environ.get("QO_OPS_TEST_DATABASE_URL")
        else "QO_OPS_TEST_DATABASE_URL",
        "commit": commit,
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }


def table_rows(section: Section) -> list[str]:
    """The section's lines of the table (markdown)."""
    lines = []
    for r in section.rows:
        ratio = "" if r.ratio is None else f"{r.ratio:.2f}"
        if r.ratio is not None and r.ratio_range is not None:
            ratio += f" ({r.ratio_range[0]:.2f}–{r.ratio_range[1]:.2f})"
        met = "" if r.met is None else ("yes" if r.met else "**no**")
        lines.append(
            f"| {section.title} | {r.what} | {r.size} | {r.figure} | {r.limit} | {ratio} | "
            f"{r.goal} | {met} |"
        )
    return lines


TABLE_HEADER = [
    "| section | what | size | figure | limit / baseline | ratio | goal | met |",
    "|---|---|---|---|---|---|---|---|",
]


def render_table(sections: list[Section]) -> str:
    """The one table (markdown), section by section."""
    return "\n".join(TABLE_HEADER + [line for s in sections for line in table_rows(s)])


def write_benchmarks_md(profile: Profile, sections: list[Section], took_s: float) -> None:
    m = machine()
    parts = [
        "# Benchmarks",
        "",
        "Written by `python -m bench.suite` (`make bench`). Every figure is a median of "
        f"{profile.repeats} run(s), beside its limit measured in the same run on the same "
        "machine; the ratio is the figure. Where a row shows a range in brackets, it is the "
        "lowest and highest of those runs (for a ratio: of each run's figure over the limit "
        "measured beside it, in alternating order), so that a swing between two suite runs "
        "within that range reads as noise, not as a regression.",
        "",
        f"- profile: **{profile.name}** ({json.dumps(asdict(profile))})",
        f"- machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB; Python "
        f"{m['python']}; PostgreSQL {m['postgresql']}; commit {m['commit']}; {m['date']}",
        f"- the suite took {took_s / 60:.1f} minutes",
        "",
        render_table(sections),
        "",
    ]
    for s in sections:
        if s.notes:
            parts += [f"## {s.title}", "", *[f"- {n}" for n in s.notes], ""]
    tuning = REPO / "bench" / "TUNING.md"
    if tuning.exists():
        parts += [tuning.read_text().strip(), ""]
    (REPO / "BENCHMARKS.md").write_text("\n".join(parts))


def _replaces(name: str) -> set[str]:
    """The titles whose rows and notes section ``name`` replaces: its own, and the older
    titles it names in ``REPLACES``."""
    module = importlib.import_module(f"bench.section_{name}")
    return {module.TITLE, *getattr(module, "REPLACES", ())}


def write_results(
    profile: Profile, sections: list[Section], took_s: float, replaced: dict[str, set[str]] | None
) -> None:
    """Raw figures to bench/results/<profile>.json; with ``replaced`` (an --only run), only the
    sections measured replace theirs in the existing file."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{profile.name}.json"
    fresh = [asdict(s) for s in sections]
    data: dict[str, Any] = {
        "machine": machine(),
        "profile": asdict(profile),
        "took_s": took_s,
        "sections": fresh,
    }
    if replaced is not None and path.exists():
        old = json.loads(path.read_text())
        gone = set().union(*replaced.values())
        kept = [s for s in old.get("sections", []) if s.get("title") not in gone]
        data = {**old, "sections": kept + fresh}
        data.setdefault("remeasured", {}).update(
            {s.title: {"machine": machine(), "took_s": took_s} for s in sections}
        )
    path.write_text(json.dumps(data, indent=2, default=str))


def update_benchmarks_md(
    profile: Profile,
    sections: list[Section],
    replaced: list[set[str]],
    names: list[str],
    took_s: float,
    path: Path = REPO / "BENCHMARKS.md",
) -> None:
    """Re-measured sections replace their table rows (in place) and their notes in
    BENCHMARKS.md; a line under the header says which were re-measured, when and how. The
    other sections stay as they were measured."""
    if not path.exists():
        write_benchmarks_md(profile, sections, took_s)
        return
    lines = path.read_text().splitlines()
    top = lines.index(TABLE_HEADER[0])
    end = next((i for i in range(top + 2, len(lines)) if not lines[i].startswith("|")), len(lines))
    owner = {title: s for s, titles in zip(sections, replaced, strict=True) for title in titles}
    rows: list[str] = []
    placed: set[str] = set()
    for line in lines[top + 2 : end]:
        section = owner.get(line.split("|")[1].strip())
        if section is None:
            rows.append(line)
        elif section.title not in placed:
            rows += table_rows(section)
            placed.add(section.title)
    for section in sections:
        if section.title not in placed:
            rows += table_rows(section)
    m = machine()
    head = [line for line in lines[:top] if not any(
        line.startswith(f"- re-measured: {s.title} ") for s in sections
    )]  # fmt: skip
    while head and not head[-1].strip():
        head.pop()
    for section in sections:
        head.append(
            f"- re-measured: {section.title} ({profile.name} profile, commit {m['commit']}, "
            f"{m['date']}, {took_s / 60:.1f} minutes for {', '.join(names)}): `python -m "
            f"bench.suite --profile {profile.name} --only {','.join(names)}`"
        )
    rest = lines[end:]
    out_rest: list[str] = []
    i = 0
    done: set[str] = set()
    while i < len(rest):
        line = rest[i]
        section = owner.get(line[3:].strip()) if line.startswith("## ") else None
        if section is None:
            out_rest.append(line)
            i += 1
            continue
        i += 1
        while i < len(rest) and not rest[i].startswith("## ") and not rest[i].startswith("# "):
            i += 1
        if section.title not in done:
            out_rest += [f"## {section.title}", "", *[f"- {n}" for n in section.notes], ""]
            done.add(section.title)
    for section in sections:
        if section.title not in done and section.notes:
            out_rest += [f"## {section.title}", "", *[f"- {n}" for n in section.notes], ""]
    path.write_text("\n".join([*head, "", *TABLE_HEADER, *rows, *out_rest]) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.suite", description=__doc__)
    parser.add_argument("--profile", choices=sorted(PROFILES), default="default")
    parser.add_argument("--only", default="", help=f"comma-separated subset of {SECTIONS}")
    parser.add_argument("--no-write", action="store_true", help="do not write BENCHMARKS.md")
    args = parser.parse_args(argv)
    profile = PROFILES[args.profile]
    chosen = [s for s in args.only.split(",") if s] or list(SECTIONS)
    unknown = sorted(set(chosen) - set(SECTIONS))
    if unknown:
        print(f"unknown section(s): {', '.join(unknown)}", file=sys.stderr)
        return 2
    started = time.monotonic()
    sections: list[Section] = []
    for name in chosen:
        module = importlib.import_module(f"bench.section_{name}")
        print(f"== {module.TITLE} ({profile.name})", flush=True)
        t0 = time.monotonic()
        section: Section = module.run(profile)
        print(f"   {time.monotonic() - t0:.0f} s", flush=True)
        sections.append(section)
    took = time.monotonic() - started
    table = render_table(sections)
    print()
    print(table)
    every = chosen == list(SECTIONS)
    replaced = {name: _replaces(name) for name in chosen}
    write_results(profile, sections, took, None if every else replaced)
    if profile.name != "quick" and not args.no_write:
        if every:
            write_benchmarks_md(profile, sections, took)
            print(f"\nwrote BENCHMARKS.md ({took / 60:.1f} minutes)")
        else:
            update_benchmarks_md(profile, sections, list(replaced.values()), chosen, took)
            print(f"\nupdated {', '.join(chosen)} in BENCHMARKS.md ({took / 60:.1f} minutes)")
    failed = [r.what for s in sections for r in s.rows if r.met is False]
    if failed:
        print(f"goals missed: {', '.join(failed)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
