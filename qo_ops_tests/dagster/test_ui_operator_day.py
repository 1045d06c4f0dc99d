"""The operator's day in a real browser (issue 41): Dagster's webserver and daemon on
loopback over PostgreSQL storage with demo data, pages opened in headless Chromium.

- a tenant fixed from the CLI (``qo-ops run``, no Dagster run) shows Materialized on the
  outcome asset's Partitions tab (``outside_runs_sensor``, running by default, put it there),
  while a tenant nothing fixed shows Missing; on the check's Partitions tab the fixed tenant
  is Passed and a tenant a CLI execute left behind (``--max-items 1``) Failed, judged by the
  ``outcome_checks_job`` run the sensor launched;
- a destructive job's Launchpad execute without an approval is refused before queueing:
  its run page says Canceled and why in one line, it is not among the Failure runs, and the
  same execute citing an approver's approval runs;
- "Execute all" on the Checks tab of every outcome asset (clicked in the browser) runs each
  of its checks on every tenant's partition and never crashes: a failing check is a judged
  tenant, not a stack trace;
- a run executed in process as `make demo` does is on its job's Runs tab and the Overview
  timeline;
- Dagster's own Launch backfill over three days × the tenant chunk of a windowed job (no
  run config, no YAML) is one entry in the Backfills list, its page shows it completed, and
  it ran as chunks: one run per day and chunk, each covering exactly the chunk's tenants
  (more chunks than one: test_instance.py, at 150 tenants).

Runs and backfills are launched through the webserver's GraphQL API, the calls the UI's
Launchpad and Launch backfill dialog make."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import dagster as dg
import pytest
import sqlalchemy as sa
from dagster_graphql import DagsterGraphQLClient

from qo_ops.dagster_defs.freshness import RECENT_SUCCESS_CHECK
from qo_ops.dagster_defs.sensors import OUTSIDE_CHECKS_TAG
from qo_ops.demo.data import load_demo_data
from qo_ops.jobs.catalog import CATALOG
from qo_ops.platform.actions import approvals
from qo_ops.platform.job.options import RunOptions
from qo_ops.platform.job.scope import Scope
from qo_ops.platform.run.runner import run_job
from qo_ops.platform.schedule.tenants import chunk_members
from qo_ops_tests.conftest import TestDatabase as Database
from qo_ops_tests.dagster.browser import chromium_page, require_chromium, save_screenshot
from qo_ops_tests.dagster.conftest import AS_OF
from qo_ops_tests.dagster.stack import LOCATION, dagster_stack, wait_for
from qo_ops_tests.dagster.test_instance import _backfill
from qo_ops_tests.dagster.test_ui_browser import (
    _database,
    _partition_dot,
    expect_check_on_partition,
)

if TYPE_CHECKING:
    from playwright.sync_api import Page

TENANTS = ("tenant-001", "tenant-002", "tenant-003")
FIXED = "tenant-002"  # fixed from the CLI
BEHIND = "tenant-001"  # a CLI execute of one item left it with overdue quotes
UNTOUCHED = "tenant-003"  # nothing ran for it
QUOTES = dg.AssetKey(["qo_ops", "quotes"])
DESTRUCTIVE = "run_history_retention"  # one tenant a partition
WINDOWED = "pricing_snapshot_recalculation"
DAYS = ["2026-02-10", "2026-02-11", "2026-02-12"]
CHUNK = "chunk-001"  # the demo's three tenants: one tenant chunk
FINISHED = (dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED)


@dataclass
class Day:
    db: Database
    instance: dg.DagsterInstance
    url: str
    refused: str  # the Launchpad execute without an approval
    approved: str  # the same, citing one
    backfill: str  # Dagster's own backfill of three days × the tenant chunk of WINDOWED
    in_process: str  # a run executed in process as `make demo` does, placed in the location


def _launch(client: DagsterGraphQLClient, job: str, tenant: str, config: dict) -> str:
    return client.submit_job_execution(
        job,
        repository_location_name=LOCATION,
        run_config={"ops": {f"{job}_op": {"config": config}}},
        tags={"dagster/partition": tenant, "qo_ops/scope": f"{job}:{tenant}"},
    )


def _status(instance: dg.DagsterInstance, run_id: str) -> dg.DagsterRunStatus:
    run = instance.get_run_by_id(run_id)
    assert run is not None
    return run.status


@pytest.fixture(scope="module")
def day(pg_server, template_database, tmp_path_factory) -> Iterator[Day]:
    home = tmp_path_factory.mktemp("ui-operator-day")
    dagster_home = home / "dagster"
    (dagster_home / ".nux").mkdir(parents=True)
    (dagster_home / ".nux" / "nux.yaml").write_text("seen: 1\n")
    with _database(pg_server, template_database) as db:
        load_demo_data(db.engine, tenants=len(TENANTS), quotes=400, seed=9, as_of=AS_OF)
        fixed = run_job(  # what `qo-ops run … --mode execute` hands the runner
            CATALOG["quote_expiration"],
            Scope(FIXED),
            RunOptions(mode="execute", reason="INC-41 fixed from the CLI", progress_interval_s=60),
            engine=db.engine,
        )
        assert fixed.status == "success" and fixed.counts.succeeded > 0
        behind = run_job(
            CATALOG["quote_expiration"],
            Scope(BEHIND),
            RunOptions(mode="execute", reason="INC-41 one quote", max_items=1),
            engine=db.engine,
        )
        assert behind.counts.succeeded == 1 and not all(c.passed for c in behind.checks)
        env = {"QO_OPS_HOME": str(home / "qo_ops")}
        with dagster_stack(db, dagster_home, env=env) as (client, instance, port):
            instance.add_dynamic_partitions("tenants", list(TENANTS))
            instance.add_dynamic_partitions("tenant_chunks", [CHUNK])
            execute = {"mode": "execute", "reason": "INC-41 old run history"}
            refused = _launch(client, DESTRUCTIVE, "tenant-001", execute)
            wait_for(lambda: _status(instance, refused) in FINISHED, 60, "the refusal")
            granted = approvals.grant(
                db.engine,
                CATALOG[DESTRUCTIVE],
                approvals.Grant(DESTRUCTIVE, ["tenant-001"], "INC-41 old run history", "ana"),
            )
            approved = _launch(
                client, DESTRUCTIVE, "tenant-001", {**execute, "approval": granted.id}
            )
            wait_for(lambda: _status(instance, approved) in FINISHED, 180, "the approved run")
            keys = [f"{d}|{CHUNK}" for d in DAYS]  # the dialog: days × chunks ticked
            backfill = _backfill(port, WINDOWED, keys, {})  # Launch backfill: no tags, no config

            def backfill_runs() -> list[dg.DagsterRun]:
                return instance.get_runs(filters=dg.RunsFilter(tags={"dagster/backfill": backfill}))

            wait_for(
                lambda: (
                    len(backfill_runs()) == len(DAYS)
                    and all(r.status in FINISHED for r in backfill_runs())
                ),
                300,
                "the backfill's day runs",
            )
            wait_for(  # the daemon marks the backfill done after its runs end
                lambda: instance.get_backfill(backfill).status.value == "COMPLETED_SUCCESS",
                120,
                "the backfill to be marked completed",
            )
            in_process = _as_the_demo_runs(db, instance)
            # outside_runs_sensor (every 30 s) puts the CLI's run on FIXED's partition
            wait_for(lambda: FIXED in instance.get_materialized_partitions(QUOTES), 120, "it")
            judged = dg.RunsFilter(
                tags={OUTSIDE_CHECKS_TAG: "quote_expiration run outside Dagster"}
            )
            wait_for(  # and launched the run that judges both tenants' checks
                lambda: (
                    [r.status for r in instance.get_runs(filters=judged)]
                    == [dg.DagsterRunStatus.FAILURE]
                ),  # BEHIND's blocking check failed
                180,
                "the checks of the tenants executed from the CLI",
            )
            url = f"http://127.0.0.1:{port}"
            yield Day(db, instance, url, refused, approved, backfill, in_process)


def _as_the_demo_runs(db: Database, instance: dg.DagsterInstance) -> str:
    """A dry run of quote_expiration for UNTOUCHED executed in this process, as `make demo`
    executes its runs (``qo_ops/cli/demo.py``), placed in the code location the same way."""
    from qo_ops.dagster_defs.instance import local_location_tags, place_in_local_location
    from qo_ops.dagster_defs.resources import QoOpsDatabase
    from qo_ops.definitions import build_definitions

    job = build_definitions().resolve_job_def("quote_expiration")
    result = job.execute_in_process(
        partition_key=UNTOUCHED,
        instance=instance,
        run_config={"ops": {"quote_expiration_op": {"config": {"mode": "dry_run"}}}},
        resources={"database": QoOpsDatabase(url=db.env_url)},
        tags=local_location_tags(),
    )
    assert result.success
    place_in_local_location(instance, result.run_id)
    return result.run_id


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> Iterator[Page]:
    require_chromium()
    with chromium_page(tmp_path_factory.mktemp("chromium") / "profile") as opened:
        yield opened


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("screenshots")


def test_a_tenant_fixed_from_the_cli_shows_materialized_and_one_never_run_missing(
    page: Page, day: Day, shots: Path
):
    from playwright.sync_api import expect

    try:
        page.goto(f"{day.url}/assets/qo_ops/quotes?view=partitions&partition={FIXED}")
        # FIXED and BEHIND: each had an execute that ended success (BEHIND's checks fail)
        expect(page.get_by_text("Materialized (2)", exact=True)).to_be_visible()
        expect(_partition_dot(page, FIXED)).to_have_attribute("style", re.compile("green"))
        expect(_partition_dot(page, UNTOUCHED)).not_to_have_attribute("style", re.compile("green"))
        expect(page.get_by_text("outside_runs_sensor").first).to_be_visible()  # who put it
    finally:
        save_screenshot(page, shots, "asset-partition-cli-run")


def test_the_check_partitions_show_the_cli_fixed_tenant_passing_and_the_one_left_behind_failing(
    page: Page, day: Day, shots: Path
):
    try:
        expect_check_on_partition(page, day, "no_overdue_active_quotes", FIXED, "Passed")
        pane = expect_check_on_partition(page, day, "no_overdue_active_quotes", BEHIND, "Failed")
        from playwright.sync_api import expect

        expect(pane.get_by_text("overdue", exact=False).first).to_be_visible()  # its figures
    finally:
        save_screenshot(page, shots, "check-partitions-cli-runs")


def test_a_destructive_launchpad_execute_without_approval_is_refused_not_failed(
    page: Page, day: Day, shots: Path
):
    from playwright.sync_api import expect

    assert _status(day.instance, day.refused) == dg.DagsterRunStatus.CANCELED
    assert _status(day.instance, day.approved) == dg.DagsterRunStatus.SUCCESS
    failures = day.instance.get_runs(filters=dg.RunsFilter(statuses=[dg.DagsterRunStatus.FAILURE]))
    assert day.refused not in {r.run_id for r in failures}  # not a Failure run
    with day.db.engine.connect() as conn:
        cited = conn.execute(
            sa.text("SELECT approval_id FROM job_run WHERE dagster_run_id = :r"),
            {"r": day.approved},
        ).scalar_one()
    assert cited is not None and cited.startswith("apr-")
    try:
        page.goto(f"{day.url}/runs/{day.refused}")
        expect(page.get_by_text("Canceled").first).to_be_visible()
        expect(page.get_by_text(re.compile("refused before queueing: executing "
                                           f"{DESTRUCTIVE} \\(destructive\\) needs an approval")).first).to_be_visible()  # fmt: skip
        expect(page.get_by_text(re.compile("Traceback"))).to_have_count(0)
        save_screenshot(page, shots, "run-refused-approval")
        page.goto(f"{day.url}/runs?q%5B0%5D=status%3AFAILURE")  # Runs filtered to Failure
        expect(page.get_by_text(day.refused[:8], exact=True)).to_have_count(0)
    finally:
        save_screenshot(page, shots, "runs-failure-filter", publish=False)


def test_a_days_backfill_of_a_windowed_job_is_one_backfill_running_as_chunks(
    page: Page, day: Day, shots: Path
):
    from playwright.sync_api import expect

    runs = day.instance.get_runs(filters=dg.RunsFilter(tags={"dagster/backfill": day.backfill}))
    assert {r.status for r in runs} == {dg.DagsterRunStatus.SUCCESS}
    # one run per day and tenant chunk, as a tick requests them
    assert sorted(r.tags["dagster/partition"] for r in runs) == [f"{d}|{CHUNK}" for d in DAYS]
    assert {r.tags["dagster/partition/tenant_chunk"] for r in runs} == {CHUNK}
    with day.db.engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT dagster_run_id, scope FROM job_run WHERE dagster_run_id = ANY(:ids)"),
            {"ids": [r.run_id for r in runs]},
        ).all()
        members = set(chunk_members(conn, CHUNK))
    assert members == set(TENANTS)
    for run in runs:  # each run: exactly its chunk's tenants, once each
        covered = [r.scope.split("/")[0] for r in rows if r.dagster_run_id == run.run_id]
        assert sorted(covered) == sorted(members)
    try:
        page.goto(f"{day.url}/overview/backfills")
        expect(page.get_by_text(day.backfill, exact=True).first).to_be_visible()
        page.goto(f"{day.url}/runs/b/{day.backfill}")
        expect(page.get_by_text(WINDOWED).first).to_be_visible()
        expect(page.get_by_text("100% completed").first).to_be_visible()  # its progress
        status = page.locator("div", has_text=re.compile(r"Status\s*Succeeded")).first
        expect(status).to_be_visible()  # the backfill's own status, not "In progress"
        row = page.get_by_role("row").filter(has_text=f"{WINDOWED}_partition_set")
        expect(row.get_by_role("cell")).to_have_text(
            [re.compile(WINDOWED), "3", "0", "3", "0"]  # targeted, in progress, done, failed
        )
    finally:
        save_screenshot(page, shots, "backfill-days")


def _outcome_assets() -> dict[str, list[str]]:
    """Each outcome asset and the checks on it: the declared ones and recent_success."""
    assets: dict[str, list[str]] = {}
    for spec in CATALOG.values():
        if spec.presentation.outcome_asset:
            names = [c.name for c in spec.checks] + [RECENT_SUCCESS_CHECK]
            assets.setdefault(spec.presentation.outcome_asset, []).extend(names)
    return assets


def test_execute_all_on_every_assets_checks_judges_every_tenant_and_never_crashes(
    page: Page, day: Day, shots: Path
):
    from playwright.sync_api import expect

    launched: dict[str, str] = {}
    try:
        for asset in _outcome_assets():
            before = {r.run_id for r in day.instance.get_runs()}
            page.goto(f"{day.url}/assets/qo_ops/{asset}?view=checks")
            button = page.get_by_role("button", name="Execute all")
            expect(button).to_be_enabled()
            button.click()

            def new_run(before: set[str] = before) -> str | None:
                runs = [r for r in day.instance.get_runs(limit=5) if r.run_id not in before]
                return runs[0].run_id if runs else None

            wait_for(lambda: new_run() is not None, 60, f"the run Execute all on {asset} starts")
            launched[asset] = new_run()  # type: ignore[assignment]
        for asset, run_id in launched.items():
            wait_for(
                lambda run_id=run_id: _status(day.instance, run_id) in FINISHED,
                300,
                f"{asset}'s checks",
            )
    finally:
        save_screenshot(page, shots, "execute-all", publish=False)
    for asset, checks in _outcome_assets().items():
        run_id = launched[asset]
        events = day.instance.all_logs(run_id)
        crashes = [
            e.dagster_event.step_failure_data.error.cls_name  # type: ignore[union-attr]
            for e in events
            if e.dagster_event is not None
            and e.dagster_event.is_step_failure
            and e.dagster_event.step_failure_data.error is not None  # type: ignore[union-attr]
        ]
        assert set(crashes) <= {"Failure"}, (asset, crashes)  # a judged failure, no crash
        judged = {
            (
                e.dagster_event.event_specific_data.check_name,
                e.dagster_event.event_specific_data.partition,
            )  # type: ignore[union-attr]
            for e in events
            if e.dagster_event is not None
            and e.dagster_event.event_type_value == "ASSET_CHECK_EVALUATION"
        }
        assert judged >= {(c, t) for c in checks for t in TENANTS}, asset
        if _status(day.instance, run_id) == dg.DagsterRunStatus.FAILURE:
            failed = {
                (c, t) for c, t in judged if t is not None and not _evaluation_passed(events, c, t)
            }
            assert failed, f"{asset}: the run failed but every check passed on every tenant"


def _evaluation_passed(events: list, check: str, tenant: str) -> bool:
    """Whether the run's last evaluation of ``check`` on ``tenant`` passed."""
    found = [
        e.dagster_event.event_specific_data
        for e in events
        if e.dagster_event is not None
        and e.dagster_event.event_type_value == "ASSET_CHECK_EVALUATION"
        and e.dagster_event.event_specific_data.check_name == check
        and e.dagster_event.event_specific_data.partition == tenant
    ]
    return bool(found[-1].passed)


def test_a_run_executed_in_process_as_the_demo_does_is_on_its_jobs_runs_tab_and_the_timeline(
    page: Page, day: Day, shots: Path
):
    """`make demo` executes its runs in process; they were missing from the job's Runs tab
    and the Overview timeline ("No runs or scheduled ticks"), which find a run by its code
    location."""
    from playwright.sync_api import expect

    short = day.in_process[:8]
    try:
        page.goto(f"{day.url}/locations/qo_ops.definitions/jobs/quote_expiration/runs")
        expect(page.get_by_text(short, exact=True).first).to_be_visible()
        page.goto(f"{day.url}/overview/activity/timeline")
        expect(page.get_by_text("No runs or scheduled ticks")).to_have_count(0)
        expect(page.get_by_text("quote_expiration", exact=True).first).to_be_visible()
    finally:
        save_screenshot(page, shots, "timeline-demo-runs", publish=False)


def test_the_launchpad_shows_the_mode_once_a_tenant_is_picked_and_launches_a_dry_run(
    page: Page, day: Day, shots: Path
):
    """Launchpad, clicked as a person does: picking a tenant fills the editor with the
    partition's config, ``mode: dry_run`` and the empty ``reason``; Launch Run as shown runs
    a dry run (nothing changes for UNTOUCHED)."""
    from playwright.sync_api import expect

    try:
        page.goto(f"{day.url}/locations/qo_ops.definitions/jobs/quote_expiration/playground")
        editor = page.locator(".CodeMirror").first
        expect(editor).not_to_contain_text("mode:")  # no partition yet: nothing to show
        picker = page.get_by_role("combobox", name="Partition")
        picker.click()
        picker.fill(UNTOUCHED)
        picker.press("Enter")
        expect(editor).to_contain_text(re.compile(r"mode: '?dry_run'?"))  # YAML may quote it
        expect(editor).to_contain_text("reason: null")
        expect(page.get_by_text("No errors")).to_be_visible()
        save_screenshot(page, shots, "launchpad-mode")
        before = {r.run_id for r in day.instance.get_runs()}
        page.get_by_role("button", name="Launch Run").click()

        def launched() -> list[dg.DagsterRun]:
            return [r for r in day.instance.get_runs(limit=5) if r.run_id not in before]

        wait_for(lambda: len(launched()) == 1, 60, "the Launchpad's run")
        (run,) = launched()
        assert run.job_name == "quote_expiration" and run.tags["dagster/partition"] == UNTOUCHED
        wait_for(lambda: _status(day.instance, run.run_id) in FINISHED, 180, "the dry run")
        assert _status(day.instance, run.run_id) == dg.DagsterRunStatus.SUCCESS
    finally:
        save_screenshot(page, shots, "launchpad-launched", publish=False)
    with day.db.engine.connect() as conn:
        mode, trigger, scope = conn.execute(
            sa.text("SELECT mode, trigger_type, scope FROM job_run WHERE dagster_run_id = :r"),
            {"r": run.run_id},
        ).one()
    assert (mode, trigger, scope) == ("dry_run", "manual", UNTOUCHED)
