"""What an operator sees, in a real browser: Dagster's webserver and daemon on loopback over
PostgreSQL storage with demo data, runs launched through GraphQL, pages opened in headless
Chromium (Debian's, driven by Playwright; see ``browser.py`` for when this skips).

Where Dagster 1.13.27 shows each thing (its UI source, ``ui-core/src``):

- a run's report: ``/runs/<run id>?logs=type:STEP_OUTPUT`` filters the run's log to the op's
  output event; metadata taller than a log row (200 px) sits behind "View full message",
  which opens a dialog where a table entry is an HTML table (``TableMetadataEntryComponent``);
- an asset check: ``/assets/qo_ops/quotes?view=checks&checkDetail=<check>``, its latest
  result as a "Passed"/"Failed" tag and the list of its executions;
- a run's mode: user tags such as ``qo_ops/mode`` are pinned in the run list (``/runs``); the
  run page's header shows only Dagster's own tags (the rest: "View tags and config");
- plots: there is no Plots tab; the asset's Overview (``?view=overview``) has a Metadata
  section with a Table/Plots toggle, and Plots draws one chart per numeric metadata label of
  the asset's last 100 materializations *and observations*, over time
  (``AssetTimeMetadataPlots``), each titled with its label.

Screenshots (1280×800) land in the test's temporary folder, and in ``docs/screenshots/``
with ``QO_OPS_UPDATE_SCREENSHOTS=1``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import dagster as dg
import pytest
from dagster_graphql import DagsterGraphQLClient

from qo_ops.dagster_defs.partitions import MODE_TAG, SCOPE_TAG, scope_from_partition_key
from qo_ops.demo.data import load_demo_data
from qo_ops.jobs.catalog import CATALOG
from qo_ops_tests.conftest import TestDatabase as Database
from qo_ops_tests.conftest import _test_database
from qo_ops_tests.dagster.browser import chromium_page, require_chromium, save_screenshot
from qo_ops_tests.dagster.conftest import AS_OF
from qo_ops_tests.dagster.event_metadata import event_values, find_leaks, forbidden_values
from qo_ops_tests.dagster.stack import LOCATION, dagster_stack, wait_for
from qo_ops_tests.dagster.test_jobs import work_partition

if TYPE_CHECKING:
    from playwright.sync_api import Locator, Page

TENANT = "tenant-001"
WINDOWED = "temp_file_cleanup"
QUOTES_PAGE = "/assets/qo_ops/quotes"
CHECK = "no_overdue_active_quotes"
REPORT_COLUMNS = ("kind", "name", "count", "detail")
FINISHED = (dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED)


@dataclass
class Deployment:
    db: Database
    instance: dg.DagsterInstance
    url: str
    runs: dict[str, str]  # what was run → Dagster run id
    window_partition: str


def _launch(client: DagsterGraphQLClient, job: str, partition: str, config: dict) -> str:
    spec = CATALOG[job]
    return client.submit_job_execution(
        job,
        repository_location_name=LOCATION,
        run_config={"ops": {f"{job}_op": {"config": config}}},
        tags={
            "dagster/partition": partition,
            SCOPE_TAG: f"{job}:{scope_from_partition_key(spec, partition).key}",
        },
    )


def _finish(instance: dg.DagsterInstance, run_id: str) -> None:
    """Wait for the run to end; fail with its error messages unless it succeeded."""

    def status() -> dg.DagsterRunStatus:
        run = instance.get_run_by_id(run_id)
        assert run is not None
        return run.status

    wait_for(lambda: status() in FINISHED, 300, f"run {run_id}")
    if status() != dg.DagsterRunStatus.SUCCESS:
        errors = [
            str(e.user_message)
            for e in instance.all_logs(run_id)
            if e.dagster_event is not None and e.dagster_event.is_failure
        ]
        pytest.fail(f"run {run_id} ended {status()}: {errors}")


@contextmanager
def _database(pg_server, template_database: str) -> Iterator[Database]:
    yield from _test_database(pg_server, template_database)


@pytest.fixture(scope="module")
def deployment(pg_server, template_database, tmp_path_factory) -> Iterator[Deployment]:
    """Webserver + daemon over demo data; quote_expiration dry-run then execute for a
    tenant, and a windowed job executed for a tenant × day with work."""
    home = tmp_path_factory.mktemp("ui-browser")
    dagster_home = home / "dagster"
    # the "Join the Dagster community" dialog covers every page on 127.0.0.1 until this
    # instance has seen it (dagster/_core/nux.py)
    (dagster_home / ".nux").mkdir(parents=True)
    (dagster_home / ".nux" / "nux.yaml").write_text("seen: 1\n")
    with _database(pg_server, template_database) as db:
        load_demo_data(db.engine, tenants=2, quotes=400, seed=9, as_of=AS_OF)
        window_partition = work_partition(db, WINDOWED, TENANT)
        env = {"QO_OPS_HOME": str(home / "qo_ops")}  # the object store of temp_file_cleanup
        with dagster_stack(db, dagster_home, env=env) as (client, instance, port):
            instance.add_dynamic_partitions("tenants", ["tenant-001", "tenant-002"])
            runs = {}
            for name, job, partition, config in (
                ("dry_run", "quote_expiration", TENANT, {"mode": "dry_run"}),
                (
                    "execute",
                    "quote_expiration",
                    TENANT,
                    {"mode": "execute", "reason": "UI test: expire overdue quotes"},
                ),
                (
                    "window",
                    WINDOWED,
                    window_partition,
                    {"mode": "execute", "reason": "UI test: clean one day"},
                ),
            ):
                runs[name] = _launch(client, job, partition, config)
                _finish(instance, runs[name])  # one after the other: the plot has an order
            yield Deployment(db, instance, f"http://127.0.0.1:{port}", runs, window_partition)


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("screenshots")


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> Iterator[Page]:
    """Headless Chromium; requested first by the browser tests, so that they skip (fail under
    CI) before the deployment starts when Chromium or Playwright is missing."""
    require_chromium()
    with chromium_page(tmp_path_factory.mktemp("chromium") / "profile") as opened:
        yield opened


def _exact(text: str) -> re.Pattern[str]:
    return re.compile(rf"^\s*{re.escape(text)}\s*$")


def _centre(locator: Locator) -> None:
    """Scroll so that ``locator`` is in the middle of its scrolling box (for screenshots)."""
    locator.evaluate("e => e.scrollIntoView({block: 'center'})")


def _open_report(page: Page, deployment: Deployment, run: str) -> Locator:
    """The run page filtered to the op's output event, its metadata opened in a dialog."""
    from playwright.sync_api import expect

    page.goto(f"{deployment.url}/runs/{deployment.runs[run]}?logs=type:STEP_OUTPUT")
    expect(page.get_by_text("STEP_OUTPUT", exact=True).first).to_be_visible()
    expand = page.get_by_role("button", name="View full message").first
    expect(expand).to_be_visible()  # the metadata is taller than a log row
    expand.click()
    dialog = page.get_by_role("dialog")
    expect(dialog.get_by_text("eligible_count", exact=True).first).to_be_visible()
    return dialog


def _report_table(dialog: Locator) -> Locator:
    """The table of the ``report`` entry: the one with the report's four columns."""
    from playwright.sync_api import expect

    headers = dialog.locator("th", has_text=_exact("detail"))
    expect(headers).to_have_count(1)
    table = headers.locator("xpath=ancestor::table[1]")  # (the metadata list is a table too)
    for column in REPORT_COLUMNS:
        expect(table.locator("th", has_text=_exact(column))).to_be_visible()
    return table


def _row(table: Locator, kind: str) -> Locator:
    return table.locator("tbody tr").filter(has=table.page.locator("td", has_text=_exact(kind)))


def test_run_page_shows_the_dry_run_report(page: Page, deployment: Deployment, shots: Path):
    from playwright.sync_api import expect

    try:
        table = _report_table(_open_report(page, deployment, "dry_run"))
        _centre(table)
        # what execute would change, counted, and a sample of it: quote ids and transitions only
        expect(_row(table, "would_change").first).to_be_visible()
        sample = _row(table, "sample")
        expect(sample.first).to_be_visible()
        cells = sample.first.locator("td")
        expect(cells.nth(1)).to_have_text(re.compile(r"^\s*\d+\s*$"))  # a quote id
        expect(cells.nth(2)).to_have_text(_exact("1"))
        expect(cells.nth(3)).to_contain_text("ACTIVE → EXPIRED")
    finally:
        save_screenshot(page, shots, "run-report")


def test_windowed_run_page_shows_its_window_and_report(
    page: Page, deployment: Deployment, shots: Path
):
    from playwright.sync_api import expect

    try:
        dialog = _open_report(page, deployment, "window")
        day = deployment.window_partition.split("|")[0]
        for key in ("window_start", "window_end", "fencing_token"):
            expect(dialog.get_by_text(key, exact=True)).to_be_visible()
        table = _report_table(dialog)
        _centre(table)
        expect(table.locator("td", has_text=_exact(day)).first).to_be_visible()  # per-day rows
    finally:
        save_screenshot(page, shots, "windowed-run-report", publish=False)


def test_asset_check_page_shows_the_passing_check(page: Page, deployment: Deployment, shots: Path):
    from playwright.sync_api import expect

    try:
        page.goto(f"{deployment.url}{QUOTES_PAGE}?view=checks&checkDetail={CHECK}")
        expect(page.get_by_text(CHECK, exact=True).first).to_be_visible()
        expect(page.get_by_text("Latest execution", exact=True)).to_be_visible()
        expect(page.get_by_text("Passed", exact=True)).to_be_visible()  # the evaluation result
        expect(page.get_by_text("Failed", exact=True)).to_have_count(0)
    finally:
        save_screenshot(page, shots, "asset-check")


def test_asset_plots_show_the_backlog_over_time(page: Page, deployment: Deployment, shots: Path):
    from playwright.sync_api import expect

    try:
        page.goto(f"{deployment.url}{QUOTES_PAGE}?view=overview")
        plots = page.get_by_role("button", name="Plots")  # the Metadata section's toggle
        expect(plots).to_be_visible()
        plots.click()
        title = page.get_by_text("backlog", exact=True)
        expect(title).to_be_visible()
        heading = page.get_by_text("backlog", exact=True)  # the chart's own box holds both
        box = page.locator("div").filter(has=heading).filter(has=page.locator("canvas")).last
        chart = box.locator("canvas")
        expect(chart).to_be_visible()
        _centre(chart)
        # Chart.js has painted the series (and its axes) into the canvas
        wait_for(
            lambda: chart.evaluate(
                "c => c.getContext('2d').getImageData(0, 0, c.width, c.height).data"
                ".some((v, i) => i % 4 === 3 && v > 0)"
            ),
            60,
            "the backlog chart to be drawn",
        )
    finally:
        save_screenshot(page, shots, "asset-plots")


def test_runs_list_shows_each_runs_mode(page: Page, deployment: Deployment, shots: Path):
    from playwright.sync_api import expect

    try:
        page.goto(f"{deployment.url}/runs")
        # user tags are pinned in the run list; the run page's header shows Dagster's own
        for mode, count in (("dry_run", 1), ("execute", 2)):
            tags = page.get_by_text(_exact(f"{MODE_TAG}: {mode}"))
            expect(tags).to_have_count(count)
            expect(tags.first).to_be_visible()
    finally:
        save_screenshot(page, shots, "runs-list", publish=False)


def test_runs_carry_their_mode_tag(deployment: Deployment):
    modes = {}
    for name, run_id in deployment.runs.items():
        run = deployment.instance.get_run_by_id(run_id)
        assert run is not None
        modes[name] = run.tags.get(MODE_TAG)
    assert modes == {"dry_run": "dry_run", "execute": "execute", "window": "execute"}


def test_nothing_the_deployment_recorded_carries_personal_data(deployment: Deployment):
    found = event_values(deployment.instance)
    assert found.event_types["STEP_OUTPUT"] == len(deployment.runs)
    assert found.event_types["ASSET_OBSERVATION"] >= len(deployment.runs)
    leaks = find_leaks(found, forbidden_values(deployment.db.engine, deployment.db.url.password))
    assert not leaks, "\n".join(leaks)
