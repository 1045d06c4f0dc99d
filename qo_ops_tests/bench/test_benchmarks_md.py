"""Re-measuring one section (`python -m bench.suite --only NAME`) replaces that section's
rows and notes in BENCHMARKS.md, under its new title too, and leaves every other section as
it was measured."""

from __future__ import annotations

from bench.suite import (
    PROFILES,
    Row,
    Section,
    Spread,
    pairwise_ratios,
    table_rows,
    update_benchmarks_md,
)

BEFORE = """# Benchmarks

- profile: **full** (...)
- the suite took 30.2 minutes

| section | what | size | figure | limit / baseline | ratio | goal | met |
|---|---|---|---|---|---|---|---|
| Jobs | throughput | 1 | 10 rows/s | 20 rows/s | 0.50 | >= 0.5 | yes |
| Old orchestration | one run per tenant | 100 | 182.8 s | 3.4 s | 0.02 | report |  |
| Old orchestration | per-run overhead | 100 | 1.79 s/run | 26 ms |  | report |  |
| Sensors | tick | 10 | 9 ms | 1 s | 0.01 | < 1 s | yes |

## Jobs

- jobs note

## Old orchestration

- old note one
- old note two

## Sensors

- sensors note

# Tuning

- tuning text
"""


def section(figure: str) -> Section:
    rows = [
        Row("chunked tick", "1,000", figure, "37.9 s", 0.5, ">= 0.5", True),
        Row("tick evaluation", "10,000", "0.1 s", "10 s", 0.01, "< 10 s", True),
    ]
    return Section("Orchestration at tenant scale", rows, [f"new note {figure}"])


def test_one_section_replaces_its_rows_and_notes_and_nothing_else(tmp_path):
    path = tmp_path / "BENCHMARKS.md"
    path.write_text(BEFORE)
    titles = [{"Orchestration at tenant scale", "Old orchestration"}]
    update_benchmarks_md(
        PROFILES["full"], [section("75.0 s")], titles, ["orchestration"], 600.0, path
    )
    text = path.read_text()
    lines = text.splitlines()
    table = [line for line in lines if line.startswith("| ") and "section | what" not in line]
    assert table == [
        "| Jobs | throughput | 1 | 10 rows/s | 20 rows/s | 0.50 | >= 0.5 | yes |",
        "| Orchestration at tenant scale | chunked tick | 1,000 | 75.0 s | 37.9 s | 0.50 | >= 0.5 | yes |",
        "| Orchestration at tenant scale | tick evaluation | 10,000 | 0.1 s | 10 s | 0.01 | < 10 s | yes |",
        "| Sensors | tick | 10 | 9 ms | 1 s | 0.01 | < 1 s | yes |",
    ]
    assert "Old orchestration" not in text and "old note" not in text
    headings = [line for line in lines if line.startswith("#")]
    assert headings == [
        "# Benchmarks",
        "## Jobs",
        "## Orchestration at tenant scale",
        "## Sensors",
        "# Tuning",
    ]
    assert "- new note 75.0 s" in lines and "- sensors note" in lines and "- jobs note" in lines
    assert "- the suite took 30.2 minutes" in lines
    remeasured = [line for line in lines if line.startswith("- re-measured: ")]
    assert len(remeasured) == 1
    assert "--profile full --only orchestration" in remeasured[0]

    # again: its rows are replaced once more, nothing is duplicated
    update_benchmarks_md(
        PROFILES["full"], [section("70.0 s")], titles, ["orchestration"], 600.0, path
    )
    again = path.read_text()
    assert again.count("| Orchestration at tenant scale | chunked tick |") == 1
    assert "70.0 s" in again and "75.0 s" not in again
    assert again.count("- re-measured: ") == 1
    assert again.count("## Orchestration at tenant scale") == 1

    def without_remeasured(t: str) -> str:
        return "\n".join(x for x in t.splitlines() if not x.startswith("- re-measured: "))

    assert without_remeasured(again).replace("70.0 s", "75.0 s") == without_remeasured(text)


def test_a_figure_shows_its_spread_and_a_ratio_its_pairs_range():
    job = Spread.of([900.0, 1_000.0, 1_100.0])
    ratio = pairwise_ratios([900.0, 1_000.0, 1_100.0], [1_500.0, 1_400.0, 1_500.0])
    assert (ratio.low, ratio.high) == (0.6, 1_100.0 / 1_500.0)
    assert round(ratio.mid, 4) == round(1_000.0 / 1_400.0, 4)  # the median pair, not med/med
    row = Row("throughput", "3", job.show(lambda v: f"{v:,.0f}"), "l", ratio.mid, ">= 0.7",
              ratio.mid >= 0.7, ratio_range=ratio.range)  # fmt: skip
    line = table_rows(Section("Jobs", [row]))[0]
    assert "| 1,000 (900–1,100) |" in line
    assert "| 0.71 (0.60–0.73) | >= 0.7 | yes |" in line
    single = Spread.of([1_000.0])
    assert single.show(lambda v: f"{v:,.0f}") == "1,000" and single.range is None
