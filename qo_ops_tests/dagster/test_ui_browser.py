"""What an operator sees, in a real browser: Dagster's webserver and daemon on loopback over
PostgreSQL storage with demo data, runs launched through GraphQL, pages opened in headless
Chromium (Debian's, driven by Playwright; see ``browser.py`` for when this skips).

Where Dagster 1.13.27 shows each thing (its UI source, ``ui-core/src``):

- a run's report: ``/runs/<run id>?logs=type:STEP_OUTPUT`` filters the run's log to the op's
  output event; metadata taller than a log row (200 px) sits behind "View full message",
  which opens a dialog where a table entry is an HTML table (``TableMetadataEntryComponent``);
- a run's mode: user tags such as ``qo_ops/mode`` are pinned in the run list (``/runs``); the
  run page's header shows only Dagster's own tags (the rest: "View tags and config");
- an outcome asset (partitioned by tenant) has the tabs Overview, Partitions, Events,
  Checks, Lineage (no Plots tab);
- a tenant's status: the asset's Partitions tab (``?view=partitions&partition=<tenant>``)
  lists the tenants with a status dot and counts ("Materialized (3)"); a tenant's page there
  has the "Materialized" tag, its latest run and the metadata of its latest
  materialization. It shows no checks;
- a tenant's checks: Checks tab → a check (``?view=checks&checkDetail=<check>``) → its own
  "Partitions" tab (a button, not in the URL): counts by status ("Failed (1)", "Passed (2)",
  "Missing (0)"...), a dot per tenant, and for the tenant picked its latest evaluation: a
  "Passed"/"Failed" tag, the run, the target materialization and the metadata. The check's
  "Overview" tab shows the latest evaluation of any tenant ("Partition: <tenant>");
- plots: the asset's Overview has a Metadata section with a Table/Plots toggle; for a
  partitioned asset Plots has a "Partitions"/"Events" toggle. Partitions: one chart per
  numeric metadata label, one point per tenant (its latest materialization, else its latest
  observation), the tenants on the x axis; Events: the last events of every tenant over time.

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
import sqlalchemy as sa
from dagster_graphql import DagsterGraphQLClient

from qo_ops.dagster_defs.freshness import RECENT_SUCCESS_JOB
from qo_ops.demo.data import load_demo_data
from qo_ops.jobs.catalog import CATALOG
from qo_ops.platform.schedule.partition_keys import MODE_TAG, chunk_scope_tag, scope_tag
from qo_ops_tests.conftest import TestDatabase as Database
from qo_ops_tests.conftest import _test_database, approval_config
from qo_ops_tests.dagster.browser import chromium_page, require_chromium, save_screenshot
from qo_ops_tests.dagster.conftest import AS_OF
from qo_ops_tests.dagster.event_metadata import event_values, find_leaks, forbidden_values
from qo_ops_tests.dagster.stack import LOCATION, dagster_stack, wait_for
from qo_ops_tests.dagster.test_jobs import work_partition

if TYPE_CHECKING:
    from playwright.sync_api import Locator, Page

TENANT = "tenant-001"
TENANTS = ("tenant-001", "tenant-002", "tenant-003")
HEALTHY = "tenant-002"  # a tenant the chunk run kept right
STALE = "tenant-003"  # more overdue quotes than a run may expire: its check fails
LEFT_BEHIND = 12  # STALE's overdue quotes beyond the chunk run's max_items
NOT_RECENT = "tenant-001"  # its last success of quote_expiration is made 2 hours old
WINDOWED = "temp_file_cleanup"
OUTCOME_JOB = "quote_expiration"
QUOTES_PAGE = "/assets/qo_ops/quotes"
OVERDUE_CHECK = "no_overdue_active_quotes"
EVENT_CHECK = "one_event_per_expired_quote"  # passes on every tenant
REPORT_COLUMNS = ("kind", "name", "count", "detail")
FINISHED = (dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED)
OVERDUE = sa.text(  # what no_overdue_active_quotes counts (past expiry beyond its grace)
    "SELECT tenant_id, count(*) FROM quote WHERE status = 'ACTIVE' "
    "AND expires_at < now() - interval '5 minutes' GROUP BY tenant_id"
)


@dataclass
class Deployment:
    db: Database
    instance: dg.DagsterInstance
    url: str
    runs: dict[str, str]  # what was run → Dagster run id
    window_partition: str
    freshness_run: str  # recent_success_job judging NOT_RECENT


def _launch(client: DagsterGraphQLClient, job: str, partition: str | None, config: dict) -> str:
    """Submit a run through the webserver: of one partition, or (none) of config tenants."""
    spec = CATALOG[job]
    if partition is None:  # a chunk run, tagged as the schedules tag theirs
        tags = chunk_scope_tag(spec, config["tenants"])
    else:
        tags = {"dagster/partition": partition, **scope_tag(spec, partition)}
    return client.submit_job_execution(
        job,
        repository_location_name=LOCATION,
        run_config={"ops": {f"{job}_op": {"config": config}}},
        tags=tags,
    )


def _finish(instance: dg.DagsterInstance, run_id: str, expected: dg.DagsterRunStatus) -> None:
    """Wait for the run to end; fail with its error messages unless it ended as expected."""

    def status() -> dg.DagsterRunStatus:
        run = instance.get_run_by_id(run_id)
        assert run is not None
        return run.status

    wait_for(lambda: status() in FINISHED, 300, f"run {run_id}")
    if status() != expected:
        errors = [
            str(e.user_message)
            for e in instance.all_logs(run_id)
            if e.dagster_event is not None and e.dagster_event.is_failure
        ]
        pytest.fail(f"run {run_id} ended {status()}, not {expected}: {errors}")


def _overdue(db: Database) -> dict[str, int]:
    with db.engine.connect() as conn:
        return {t: 0 for t in TENANTS} | dict(conn.execute(OVERDUE).tuples().all())


def plant_overdue_quotes(db: Database, tenant: str, count: int) -> None:
    """``count`` more of the tenant's quotes ACTIVE and two days past their expiry."""
    with db.engine.begin() as conn:
        changed = conn.execute(
            sa.text(
                "UPDATE quote SET status = 'ACTIVE', expires_at = now() - interval '2 days' "
                "WHERE id IN (SELECT id FROM quote WHERE tenant_id = :tenant "
                "AND status = 'DRAFT' ORDER BY id LIMIT :count)"
            ),
            {"tenant": tenant, "count": count},
        ).rowcount
    assert changed == count, f"{tenant} has only {changed} draft quotes"


@contextmanager
def _database(pg_server, template_database: str) -> Iterator[Database]:
    yield from _test_database(pg_server, template_database)


@pytest.fixture(scope="module")
def deployment(pg_server, template_database, tmp_path_factory) -> Iterator[Deployment]:
    """Webserver + daemon over demo data of three tenants: quote_expiration dry-run then
    execute for one tenant, a windowed job executed for that tenant on a day with work, then
    one chunk run of quote_expiration over the three tenants, as a schedule tick makes it,
    with a max_items that leaves STALE, which has more overdue quotes, LEFT_BEHIND of them."""
    home = tmp_path_factory.mktemp("ui-browser")
    dagster_home = home / "dagster"
    # the "Join the Dagster community" dialog covers every page on 127.0.0.1 until this
    # instance has seen it (dagster/_core/nux.py)
    (dagster_home / ".nux").mkdir(parents=True)
    (dagster_home / ".nux" / "nux.yaml").write_text("seen: 1\n")
    with _database(pg_server, template_database) as db:
        load_demo_data(db.engine, tenants=len(TENANTS), quotes=400, seed=9, as_of=AS_OF)
        window_partition = work_partition(db, WINDOWED, TENANT)
        overdue = _overdue(db)
        max_items = max(n for t, n in overdue.items() if t != STALE)  # enough for the others
        plant_overdue_quotes(db, STALE, max_items - overdue[STALE] + LEFT_BEHIND)
        env = {"QO_OPS_HOME": str(home / "qo_ops")}  # the object store of temp_file_cleanup
        with dagster_stack(db, dagster_home, env=env) as (client, instance, port):
            instance.add_dynamic_partitions("tenants", list(TENANTS))
            instance.add_dynamic_partitions("tenant_chunks", ["chunk-001"])
            runs = {}
            success, failure = dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.FAILURE
            execute = {"mode": "execute", "reason": "UI test: expire overdue quotes"}
            chunk = {  # its own reason: a Launchpad execute may not repeat an earlier one's
                **execute,
                "reason": "UI test: expire every tenant's overdue quotes",
                "tenants": list(TENANTS),
                "max_items": max_items,
            }
            for name, job, partition, config, ends in (
                ("dry_run", OUTCOME_JOB, TENANT, {"mode": "dry_run"}, success),
                ("execute", OUTCOME_JOB, TENANT, execute, success),
                (
                    "window",
                    WINDOWED,
                    window_partition,
                    {
                        "mode": "execute",
                        "reason": "UI test: clean one day",
                        "tenants": [TENANT],
                        **approval_config(WINDOWED),
                    },
                    success,
                ),
                # it fails: STALE missed its blocking outcome check
                ("chunk", OUTCOME_JOB, None, chunk, failure),
            ):
                runs[name] = _launch(client, job, partition, config)
                _finish(instance, runs[name], ends)  # one after the other: the plot has an order
            # NOT_RECENT's last success 2 hours back (3 cadences are 45 min): the run that
            # stale_success_sensor requests for such a tenant marks it stale on its partition
            with db.engine.begin() as conn:
                conn.execute(
                    sa.text(
                        "UPDATE job_run SET started_at = started_at - interval '2 hours', "
                        "finished_at = finished_at - interval '2 hours', "
                        "created_at = created_at - interval '2 hours' "
                        "WHERE job_name = :job AND scope = :tenant"
                    ),
                    {"job": OUTCOME_JOB, "tenant": NOT_RECENT},
                )
                conn.execute(sa.text("UPDATE tenant SET created_at = now() - interval '1 day'"))
            freshness = client.submit_job_execution(
                RECENT_SUCCESS_JOB,
                repository_location_name=LOCATION,
                run_config={
                    "ops": {
                        "recent_success_op": {"config": {"tenants": {OUTCOME_JOB: [NOT_RECENT]}}}
                    }
                },
            )
            _finish(instance, freshness, success)
            yield Deployment(
                db, instance, f"http://127.0.0.1:{port}", runs, window_partition, freshness
            )


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


DOT = "div[style*='border-radius: 100%']"  # a partition's status dot


def _partition_row(page: Page, tenant: str) -> Locator:
    """The tenant's row in a list of partitions: the innermost box holding its name (the one
    with a tooltip; the partition picker's chips have one too, but no dot) and a dot."""
    name = page.locator(f"div[data-tooltip='{tenant}']")
    return page.locator("div").filter(has=name).filter(has=page.locator(DOT)).last


def _partition_dot(page: Page, tenant: str) -> Locator:
    return _partition_row(page, tenant).locator(DOT)


def _metadata_value(pane: Locator, label: str) -> Locator:
    """The value cell of a metadata row (``label`` in its first cell)."""
    row = pane.locator("tr").filter(has=pane.page.locator("td", has_text=_exact(label)))
    return row.locator("td").nth(1)


NAV_COLLAPSED = "dagster-nav-collapsed"  # Dagster keeps "Hide navigation" in localStorage


def show_navigation(page: Page, shown: bool) -> None:
    """Dagster's left navigation shown or hidden from the next page on ("Hide navigation")."""
    store = "removeItem(key)" if shown else "setItem(key, 'true')"
    page.evaluate(f"key => localStorage.{store}", NAV_COLLAPSED)


def open_check_partition(page: Page, deployment: Deployment, check: str, tenant: str) -> Locator:
    """The asset's Checks tab → ``check`` → its Partitions tab → ``tenant``: the pane with
    the tenant's latest evaluation of the check (its tag, run, target and metadata). The
    navigation is hidden: at 1280 px with it the pane's right edge, where the tag is, lies
    outside the window (``show_navigation(page, True)`` brings it back)."""
    from playwright.sync_api import expect

    page.goto(f"{deployment.url}{QUOTES_PAGE}?view=checks&checkDetail={check}")
    show_navigation(page, False)
    page.reload()
    tab = page.locator("button[role='tab']#partitions")  # the check's tab (the asset's: a link)
    expect(tab).to_be_visible()
    tab.click()
    _partition_row(page, tenant).click()
    pane = (
        page.locator("div")
        .filter(has=page.get_by_text("Target materialization", exact=True))
        .filter(has=page.locator(f"[title='{tenant}']"))
        .last  # the innermost: the detail pane, not the page around it
    )
    expect(pane).to_be_visible()
    return pane


def expect_check_on_partition(
    page: Page, deployment: Deployment, check: str, tenant: str, result: str
) -> Locator:
    """What a person sees of ``check`` on the tenant's partition: its dot in the check's list
    of partitions (green for "Passed", red for "Failed") and the result's tag on the tenant's
    latest evaluation, in the window. Any check partitioned by tenant: a declared one, or
    recent_success (``expect_check_on_partition(page, d, "recent_success", t, "Failed")``)."""
    from playwright.sync_api import expect

    pane = open_check_partition(page, deployment, check, tenant)
    expect(pane.locator(f"[title='{tenant}']").first).to_be_in_viewport()  # its heading
    expect(pane.get_by_text(result, exact=True)).to_be_in_viewport()  # the tag beside it
    colour = {"Passed": "accent-green", "Failed": "accent-red"}[result]
    expect(_partition_dot(page, tenant)).to_have_attribute("style", re.compile(colour))
    return pane


def _chart_data(canvas: Locator) -> dict:
    """What a Chart.js chart was drawn from: the props react-chartjs-2 was given (its x
    labels, its points' y values, its title) — the canvas itself is only pixels."""
    return canvas.evaluate(
        """c => {
          const key = Object.keys(c).find(k => k.startsWith('__reactFiber$'));
          for (let f = key && c[key]; f; f = f.return) {
            const d = f.memoizedProps && f.memoizedProps.data;
            if (d && d.datasets) {
              return {label: d.datasets[0].label, labels: d.labels || null,
                      ys: d.datasets[0].data.map(p => Number.isNaN(p.y) ? null : p.y)};
            }
          }
          return null;
        }"""
    )


def _latest_materialization(deployment: Deployment, tenant: str) -> dg.EventLogRecord:
    records = deployment.instance.fetch_materializations(
        dg.AssetRecordsFilter(
            asset_key=dg.AssetKey(["qo_ops", "quotes"]), asset_partitions=[tenant]
        ),
        limit=1,
    ).records
    assert records, f"{tenant} has no materialization"
    return records[0]


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
        day = deployment.window_partition.partition("|")[0]  # its partition: day|tenant chunk
        for key in ("first_day", "last_day", "fencing_token"):
            expect(dialog.get_by_text(key, exact=True)).to_be_visible()
        # one day: the first and the last day are that day (the last included)
        expect(_metadata_value(dialog, "first_day")).to_have_text(day)
        expect(_metadata_value(dialog, "last_day")).to_have_text(day)
        table = _report_table(dialog)
        _centre(table)
        expect(table.locator("td", has_text=_exact(day)).first).to_be_visible()  # per-day rows
    finally:
        save_screenshot(page, shots, "windowed-run-report", publish=False)


def test_asset_check_page_shows_the_passing_check(page: Page, deployment: Deployment, shots: Path):
    from playwright.sync_api import expect

    try:
        page.goto(f"{deployment.url}{QUOTES_PAGE}?view=checks&checkDetail={EVENT_CHECK}")
        expect(page.get_by_text(EVENT_CHECK, exact=True).first).to_be_visible()
        expect(page.get_by_text("Latest execution", exact=True)).to_be_visible()
        expect(page.get_by_text("Passed", exact=True)).to_be_visible()  # the evaluation result
        # the latest evaluation is one tenant's: the chunk's last
        expect(page.get_by_text("Partition", exact=True)).to_be_visible()
        expect(page.get_by_text(TENANTS[-1], exact=True).first).to_be_visible()
    finally:
        save_screenshot(page, shots, "asset-check", publish=False)


def test_partition_page_shows_a_tenants_materialization_and_checks(
    page: Page, deployment: Deployment, shots: Path
):
    """(a) a tenant the chunk run kept right: Materialized on its partition, with the
    chunk run and its figures, and each declared check Passed on that partition."""
    from playwright.sync_api import expect

    try:
        page.goto(f"{deployment.url}{QUOTES_PAGE}?view=partitions&partition={HEALTHY}")
        expect(page.get_by_text(f"Materialized ({len(TENANTS)})", exact=True)).to_be_visible()
        for tenant in TENANTS:  # every tenant's run kept its quotes' state: a green dot
            expect(_partition_dot(page, tenant)).to_have_attribute("style", re.compile("green"))
        pane = (
            page.locator("div")
            .filter(has=page.get_by_text("Latest materialization", exact=True))
            .filter(has=page.get_by_text("Materialized", exact=True))
            .last
        )
        expect(pane.locator(f"[title='{HEALTHY}']").first).to_be_visible()
        expect(pane.get_by_text(deployment.runs["chunk"][:8], exact=True)).to_be_visible()
        with deployment.db.engine.connect() as conn:
            job_run = conn.execute(
                sa.text("SELECT id FROM job_run WHERE dagster_run_id = :run AND scope = :tenant"),
                {"run": deployment.runs["chunk"], "tenant": HEALTHY},
            ).scalar_one()
        for label, value in (("status", "success"), ("backlog", "0"), ("job_run_id", job_run)):
            expect(_metadata_value(pane, label)).to_have_text(_exact(str(value)))
        save_screenshot(page, shots, "asset-partition")
        for check in CATALOG[OUTCOME_JOB].checks:
            expect_check_on_partition(page, deployment, check.name, HEALTHY, "Passed")
    finally:
        save_screenshot(page, shots, "asset-check-partition-passed", publish=False)
        show_navigation(page, True)


def test_stale_tenant_shows_its_failing_check_on_its_partition(
    page: Page, deployment: Deployment, shots: Path
):
    """(c) the tenant left behind: its check Failed on its partition (the others Passed),
    with the overdue quotes the check counted."""
    from playwright.sync_api import expect

    try:
        pane = expect_check_on_partition(page, deployment, OVERDUE_CHECK, STALE, "Failed")
        expect(pane.get_by_text(deployment.runs["chunk"][:8], exact=True)).to_be_visible()
        expect(_metadata_value(pane, "overdue_active_quotes")).to_have_text(
            _exact(str(LEFT_BEHIND))
        )
        expect(pane.get_by_text("Passed", exact=True)).to_have_count(0)
        for label in ("Failed (1)", f"Passed ({len(TENANTS) - 1})", "Missing (0)"):
            expect(page.get_by_text(label, exact=True)).to_be_in_viewport()
        for tenant in TENANTS:
            colour = "red" if tenant == STALE else "green"
            expect(_partition_dot(page, tenant)).to_have_attribute("style", re.compile(colour))
    finally:
        save_screenshot(page, shots, "asset-check-partitions")
        show_navigation(page, True)


def test_asset_plots_show_each_tenants_backlog(page: Page, deployment: Deployment, shots: Path):
    """(b) the backlog by tenant: one point per tenant partition, each the backlog its
    latest materialization recorded — 0 where the run kept up, LEFT_BEHIND for STALE."""
    from playwright.sync_api import expect

    try:
        page.goto(f"{deployment.url}{QUOTES_PAGE}?view=overview")
        plots = page.get_by_role("button", name="Plots")  # the Metadata section's toggle
        expect(plots).to_be_visible()
        plots.click()
        by_partition = page.get_by_role("button", name="Partitions")  # (the other: Events)
        expect(by_partition).to_be_visible()
        by_partition.click()
        heading = page.get_by_text("backlog", exact=True)
        expect(heading).to_be_visible()
        box = page.locator("div").filter(has=heading).filter(has=page.locator("canvas")).last
        chart = box.locator("canvas")
        expect(chart).to_be_visible()
        _centre(chart)
        recorded = [
            _latest_materialization(deployment, t).asset_materialization.metadata["backlog"].value  # type: ignore[union-attr]
            for t in TENANTS
        ]
        assert recorded == [0, 0, LEFT_BEHIND]
        wait_for(lambda: _chart_data(chart) is not None, 60, "the backlog chart's data")
        assert _chart_data(chart) == {"label": "backlog", "labels": list(TENANTS), "ys": recorded}
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
        for mode, count in (("dry_run", 1), ("execute", 3)):
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
    assert modes == {
        "dry_run": "dry_run",
        "execute": "execute",
        "window": "execute",
        "chunk": "execute",
    }


def test_nothing_the_deployment_recorded_carries_personal_data(deployment: Deployment):
    found = event_values(deployment.instance)
    outputs = [  # of the catalog runs (the daemon's sensors may launch runs of their own)
        e
        for run_id in deployment.runs.values()
        for e in deployment.instance.all_logs(run_id, of_type=dg.DagsterEventType.STEP_OUTPUT)
    ]
    assert len(outputs) == len(deployment.runs) - 1  # the chunk failed
    tenant_runs = len(deployment.runs) - 1 + len(TENANTS)  # each records its outcome
    outcomes = found.event_types["ASSET_OBSERVATION"] + found.event_types["ASSET_MATERIALIZATION"]
    assert outcomes >= tenant_runs
    leaks = find_leaks(found, forbidden_values(deployment.db.engine, deployment.db.url.password))
    assert not leaks, "\n".join(leaks)


def test_a_tenant_without_a_recent_success_is_stale_on_its_partition(
    page: Page, deployment: Deployment, shots: Path
):
    """A tenant whose last success is older than 3 cadences: recent_success Failed on its
    partition, saying so, judged by the run stale_success_sensor requests for it."""
    from playwright.sync_api import expect

    try:
        pane = expect_check_on_partition(page, deployment, "recent_success", NOT_RECENT, "Failed")
        expect(pane.get_by_text(deployment.freshness_run[:8], exact=True)).to_be_visible()
        expect(pane.get_by_text(re.compile(r"^STALE: ")).first).to_be_visible()
        expect(pane.get_by_text("Passed", exact=True)).to_have_count(0)
        for tenant in TENANTS:  # the others succeeded within the limit (the chunk run)
            colour = "red" if tenant == NOT_RECENT else "green"
            expect(_partition_dot(page, tenant)).to_have_attribute("style", re.compile(colour))
    finally:
        save_screenshot(page, shots, "asset-recent-success")
        show_navigation(page, True)
