"""The demo: ``qo-ops demo-data`` loads deterministic demo data (anomalies included), and
``qo-ops demo-dagster`` runs every catalog job through Dagster over one tenant, a few lines
per run."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import uuid
from collections.abc import Iterator
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from qo_ops.cli_support import SHORT_ID, JsonOpt, emit_json, print_table, ready_engine
from qo_ops.errors import BadInput, ConfigError, one_line

if TYPE_CHECKING:
    import sqlalchemy as sa

    from qo_ops.platform.job.spec import JobSpec

# Dagster, the catalog, the platform and SQLAlchemy are imported inside each command
# (qo_ops.cli_support).

DEMO_TENANTS, DEMO_QUOTES, DEMO_SEED = 3, 2000, 1  # `make demo` and `make ui` load these
DEMO_EVENTS_LOG = "logs/demo-dagster.jsonl"  # under QO_OPS_HOME, rewritten by each demo
QUIET_CONSOLE = {"console": {"config": {"log_level": "CRITICAL"}}}  # Dagster's own lines


# ------------------------------------------------------------------------- demo data


def parse_timestamp(value: str, option: str) -> datetime:
    """Parse an ISO-8601 timestamp; a naive one is taken as UTC."""
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise BadInput(f"{option} must be an ISO-8601 timestamp, got {value!r}") from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def demo_data_command(
    tenants: Annotated[int, typer.Option(help="How many tenants to create.")] = DEMO_TENANTS,
    quotes: Annotated[int, typer.Option(help="Quotes per tenant.")] = DEMO_QUOTES,
    seed: Annotated[int, typer.Option(help="Seed: the same seed gives the same data.")] = DEMO_SEED,
    as_of: Annotated[
        str | None, typer.Option("--as-of", help="Time the data is relative to (default: now).")
    ] = None,
    append: Annotated[bool, typer.Option("--append", help="Add tenants to existing data.")] = False,
    reset: Annotated[bool, typer.Option("--reset", help="Replace existing data.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Load deterministic demo data, anomalies included, in one transaction."""
    from qo_ops.demo.data import load_demo_data
    from qo_ops.platform.calls.object_store import objects_root

    anchor = (
        parse_timestamp(as_of, "--as-of") if as_of else datetime.now(UTC).replace(microsecond=0)
    )
    engine = ready_engine()
    report = load_demo_data(
        engine,
        tenants=tenants,
        quotes=quotes,
        seed=seed,
        as_of=anchor,
        append=append,
        reset=reset,
        objects=objects_root(),  # temp_file_cleanup's store: the demo's files are real
    )
    downstream = None
    if reset:  # the local simulator's orders are the demo's too: the old demo's go
        from qo_ops.downstream.local import reset_local_simulator

        downstream = reset_local_simulator(engine)
    if as_json:
        emit_json(
            {
                "tenants": report.tenants,
                "rows": report.rows,
                "objects": {"written": report.objects_written, "removed": report.objects_removed},
                "anomalies": report.anomalies,
                "seconds": round(report.seconds, 3),
                "as_of": anchor.isoformat(),
                "seed": seed,
                "downstream": downstream,
            }
        )
        return
    total = sum(report.rows.values())
    typer.echo(
        f"loaded {total:,} rows for {len(report.tenants)} tenants "
        f"({report.tenants[0]} … {report.tenants[-1]}) in {report.seconds:.1f}s, as of {anchor.isoformat()}"
    )
    typer.echo(
        f"stored {report.objects_written:,} temp file objects under {objects_root()}"
        + (
            f" (removed {report.objects_removed:,} of the replaced rows)"
            if report.objects_removed
            else ""
        )
    )
    if downstream:
        typer.echo(downstream)
    print_table(
        "anomalies planted", ["anomaly", "rows"], [[k, v] for k, v in report.anomalies.items()]
    )


# ------------------------------------------------------------------------- demo-dagster


def _latest_day_with_work(
    engine: sa.Engine, spec: JobSpec, tenant: str, last: date, days: int = 30
) -> date:
    """The most recent day (back from ``last``) on which ``spec`` has something to do."""
    from qo_ops.platform.job.outcome import BatchContext
    from qo_ops.platform.job.scope import Scope
    from qo_ops.platform.run.runner import count_eligible

    with engine.connect() as conn:
        for back in range(days):
            day = last - timedelta(days=back)
            ctx = BatchContext(
                spec.name, Scope(tenant, day, day + timedelta(days=1)), "dry_run", uuid.uuid4()
            )
            if count_eligible(conn, spec, ctx):
                return day
    return last


@dataclasses.dataclass
class DemoRun:
    """What one Dagster run of ``qo-ops demo-dagster`` did, for a person or as JSON."""

    job_name: str
    tenant: str
    scope: str
    mode: str
    dagster_run_id: str
    dagster_success: bool
    status: str  # the runner's status; "not run" when the run failed before it
    eligible_count: int | None
    processed_count: int | None
    succeeded_count: int | None
    failed_count: int | None
    duration_ms: int | None
    job_run_id: str | None
    checks: dict[str, bool]  # outcome check -> passed
    error: str | None  # the failed step's one line, when the Dagster run failed

    def lines(self) -> list[str]:
        """Two or three lines: what ran and how it ended, its counts, its checks."""
        from qo_ops.platform.job.scope import scope_text

        counts = (
            f"eligible {self.eligible_count:,}, processed {self.processed_count:,}, "
            f"succeeded {self.succeeded_count:,}, failed {self.failed_count:,}"
            f" in {self.duration_ms:,} ms"
            if self.eligible_count is not None
            else "no counts: the runner did not finish"
        )
        out = [
            f"{self.job_name} · {scope_text(self.scope)} · {self.mode}: {self.status}"
            f" (dagster run {self.dagster_run_id[:SHORT_ID]}"
            f"{'' if self.dagster_success else ' FAILED'})",
            f"  {counts}",
        ]
        failed = [name for name, passed in self.checks.items() if not passed]
        passed = [name for name, ok in self.checks.items() if ok]
        if failed:
            out.append(f"  checks FAILED: {', '.join(failed)}; passed: {len(passed)}")
        elif passed:
            out.append(f"  checks passed: {', '.join(passed)}")
        if self.error:
            out.append(f"  error: {self.error}")
        return out


def _demo_run(spec: JobSpec, tenant: str, result: Any) -> DemoRun:
    """A ``DemoRun`` from a Dagster ``ExecuteInProcessResult`` of ``spec``'s job."""
    node = f"{spec.name}_op"
    try:
        output = result.output_for_node(node)
    except Exception:  # the op failed: no output, its failure says why
        output = {}
    summary = output["runs"][0] if output.get("runs") else output  # a run of named tenants
    error = None
    if not result.success:
        failure = result.failure_data_for_node(node)
        described = failure.user_failure_data.description if failure else None
        error = one_line(described or (failure.error.message if failure else "run failed"))
    return DemoRun(
        job_name=spec.name,
        tenant=tenant,
        scope=summary.get("scope", tenant),
        mode=summary.get("mode", "execute"),
        dagster_run_id=result.run_id,
        dagster_success=result.success,
        status=summary.get("status", "not run"),
        eligible_count=summary.get("eligible_count"),
        processed_count=summary.get("processed_count"),
        succeeded_count=summary.get("succeeded_count"),
        failed_count=summary.get("failed_count"),
        duration_ms=summary.get("duration_ms"),
        job_run_id=summary.get("job_run_id"),
        checks={e.check_name: e.passed for e in result.get_asset_check_evaluations()},
        error=error,
    )


@contextlib.contextmanager
def _events_to_file(path: Path) -> Iterator[None]:
    """The runner's JSON events (logger qo_ops.events) also go to ``path``, one a line."""
    from qo_ops.platform.observability.events import EVENT_LOGGER, json_log_handler

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        stream = path.open("w", encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc.strerror} (QO_OPS_HOME)") from None
    handler = json_log_handler(stream)
    logger = logging.getLogger(EVENT_LOGGER)
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        stream.close()


def demo_dagster_command(
    tenant: Annotated[str, typer.Option(help="The tenant partition to run.")] = "tenant-001",
    verbose: Annotated[
        bool,
        typer.Option("--verbose", help="Also show Dagster's log lines (the JSON events) here."),
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Run every catalog job through Dagster for one tenant: a few lines per run (status,
    counts, outcome checks); the runs' JSON events go to QO_OPS_HOME/logs/demo-dagster.jsonl."""
    from datetime import date as date_cls

    import dagster as dg

    from qo_ops.config import load_settings
    from qo_ops.dagster_defs.instance import (
        local_location_tags,
        place_in_local_location,
        prepare_dagster_home,
    )
    from qo_ops.db.engine import resolve_target
    from qo_ops.definitions import build_definitions
    from qo_ops.jobs.catalog import CATALOG
    from qo_ops.platform.actions.approvals import Grant, grant
    from qo_ops.platform.job.scope import Scope
    from qo_ops.platform.schedule.partition_keys import partition_key_for
    from qo_ops.platform.schedule.tenants import chunk_of

    Scope(tenant)
    target = resolve_target()
    engine = ready_engine(target)
    prepare_dagster_home(target)
    from qo_ops.downstream.local import downstream_for_demo

    events_log = load_settings().home / DEMO_EVENTS_LOG
    defs = build_definitions()
    yesterday = date_cls.today() - timedelta(days=1)
    # its own reason each time: a Dagster execute may not repeat an earlier one's reason
    reason = f"make demo ({datetime.now(UTC):%Y-%m-%d %H:%M:%S} UTC)"
    runs: list[DemoRun] = []
    with (
        _events_to_file(events_log),
        downstream_for_demo(engine) as downstream,
        dg.DagsterInstance.get() as instance,
    ):
        if not as_json:
            typer.echo(
                f"every catalog job through Dagster for {tenant}, mode execute "
                f"(downstream simulator {downstream.url}); JSON events: {events_log}"
            )
        if tenant not in instance.get_dynamic_partitions("tenants"):
            instance.add_dynamic_partitions("tenants", [tenant])
        # the destructive jobs' executes cite an approval, as on every path: the demo plays
        # the approver (qo-ops approval grant), one approval per job for this tenant
        approved = {
            spec.name: grant(
                engine, spec, Grant(spec.name, [tenant], reason, "make demo (approver)", 900)
            ).id
            for spec in CATALOG.values()
            if spec.destructive
        }
        if not as_json:
            typer.echo(
                f"approvals for the destructive jobs' executes ({', '.join(approved)}), "
                "granted by the demo as their approver: " + ", ".join(approved.values())
            )
        for spec in CATALOG.values():
            job = defs.resolve_job_def(spec.name)
            day = (
                _latest_day_with_work(engine, spec, tenant, yesterday)
                if spec.partitioning == "tenant_day"
                else None
            )
            op_config = {
                "mode": "execute",
                "reason": reason,
                **({"approval": approved[spec.name]} if spec.name in approved else {}),
                **({"tenants": [tenant]} if day is not None else {}),
            }
            chunk = None
            if day is not None:  # a windowed run's partition: the day and the tenant's chunk
                with engine.connect() as conn:
                    chunk = chunk_of(conn, tenant)
                if chunk is not None and chunk not in instance.get_dynamic_partitions(
                    "tenant_chunks"
                ):
                    instance.add_dynamic_partitions("tenant_chunks", [chunk])
            result = job.execute_in_process(
                partition_key=partition_key_for(spec, tenant, day, chunk),
                instance=instance,
                run_config={
                    "ops": {f"{spec.name}_op": {"config": op_config}},
                    **({} if verbose else {"loggers": QUIET_CONSOLE}),
                },
                tags=local_location_tags(),  # the job's Runs tab counts it
                raise_on_error=False,
            )
            place_in_local_location(instance, result.run_id)  # and the Overview timeline
            runs.append(_demo_run(spec, tenant, result))
            if not as_json:
                for line in runs[-1].lines():
                    typer.echo(line)
    failures = sum(not r.dagster_success for r in runs)
    if as_json:
        emit_json(
            {
                "tenant": tenant,
                "events_log": str(events_log),
                "runs": [dataclasses.asdict(r) for r in runs],
                "dagster_failures": failures,
            }
        )
    else:
        statuses: dict[str, int] = {}
        for r in runs:
            statuses[r.status] = statuses.get(r.status, 0) + 1
        checks = [ok for r in runs for ok in r.checks.values()]
        typer.echo(
            f"{len(runs)} Dagster runs, {len(runs) - failures} succeeded "
            f"({', '.join(f'{n} {s}' for s, n in sorted(statuses.items()))}); "
            f"outcome checks: {sum(checks)} passed, {len(checks) - sum(checks)} failed"
        )
        typer.echo(f"JSON events of these runs: {events_log} (--verbose shows them here)")
    raise typer.Exit(1 if failures else 0)
