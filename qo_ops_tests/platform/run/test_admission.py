"""A bad setting or an impossible date is refused before a run claims or changes anything.

Every case runs the real ``qo-ops run … --mode execute`` against demo data whose delivery
items and outbox events are all due, with a real downstream simulator at hand: the run must
exit 2 with one line on stderr and no traceback, leave every business and platform table
as it was (no claim, no attempt counted, no job_run row), and send nothing downstream. One
run with good settings proves the same command would have claimed and called.

A person's run is audited: one ``trigger`` row per run, append-only, with the requester,
reason, mode and correlation id; an execute without a reason is refused before anything is
written (quote_expiration is the job these drive).

Tests ``qo_ops.platform.run.admission``, with the settings it checks (``qo_ops.config``, the
retry policy of ``qo_ops.platform.calls.retry``, the calendar of
``qo_ops.platform.job.scope``).
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Iterator
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import sqlalchemy as sa

from qo_ops.config import number
from qo_ops.db.digest import database_digest
from qo_ops.demo.data import load_demo_data
from qo_ops.downstream.client import downstream_url
from qo_ops.errors import BadInput, ConfigError
from qo_ops.jobs.catalog import CATALOG
from qo_ops.platform.calls.retry import RetryPolicy, policy_from_env
from qo_ops.platform.job.scope import LAST_DAY, Scope
from qo_ops.platform.schedule.partition_keys import scope_from_partition_key
from qo_ops_tests.conftest import DownstreamServer, _test_database, approval_args, base_env, run_cli
from qo_ops_tests.platform.run.quote_runs import JOB, digest_without, rows, run, run_row, scalar

if TYPE_CHECKING:
    from qo_ops_tests.conftest import TestDatabase

TENANT = "tenant-001"
AS_OF = datetime(2026, 3, 1, tzinfo=UTC)
DAY = "2026-02-20"  # a day of the demo data, for the windowed jobs


def _make_work_due(db: TestDatabase) -> None:
    """Every delivery item READY and due, every outbox event due: a run has work to claim."""
    with db.engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE delivery_attempt_item SET status = 'READY', attempt_count = 0, "
                "max_attempts = 30, next_attempt_at = now() - interval '1 minute', "
                "payload = payload - 'fault'"
            )
        )
        conn.execute(
            sa.text(
                "UPDATE outbox_event SET published_at = NULL, dead_lettered_at = NULL, "
                "available_at = now() - interval '1 minute'"
            )
        )


@pytest.fixture(scope="module")
def demo(pg_server, template_database) -> Iterator[TestDatabase]:
    """One demo tenant with due work, shared by the cases: each refusal changes nothing,
    and each case compares the tables before and after itself."""
    made = _test_database(pg_server, template_database)
    db = next(made)
    load_demo_data(db.engine, tenants=1, quotes=300, seed=5, as_of=AS_OF)
    _make_work_due(db)
    yield db
    made.close()


@pytest.fixture(scope="module")
def simulator(tmp_path_factory) -> Iterator[DownstreamServer]:
    where = tmp_path_factory.mktemp("downstream")
    server = DownstreamServer(where / "store.sqlite3", where / "simulator.log", {})
    yield server
    server.close()


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("home")


def _env(db: TestDatabase, simulator: DownstreamServer, home: Path, **changes: str | None):
    """Good settings, with ``changes`` applied (None: the variable is not set at all)."""
    env = base_env(
        QO_OPS_DATABASE_URL=db.env_url,
        QO_OPS_HOME=str(home),
        QO_OPS_DOWNSTREAM_URL=simulator.url,
        QO_OPS_RETRY_BASE_S="0.2",
        QO_OPS_RETRY_CAP_S="1",
    )
    for name, value in changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def _execute(job: str, *extra: str) -> list[str]:
    window = ["--date", DAY] if CATALOG[job].partitioning == "tenant_day" else []
    return ["run", job, "--tenant", TENANT, "--mode", "execute", "--reason", "drill",
            *approval_args(job), *window, *extra]  # fmt: skip


def _claims(db: TestDatabase) -> tuple[int, int, int]:
    """(delivery attempts, items in progress, publish attempts): what a claim moves."""
    with db.engine.connect() as conn:
        row = conn.execute(
            sa.text(
                "SELECT (SELECT coalesce(sum(attempt_count), 0) FROM delivery_attempt_item), "
                "(SELECT count(*) FROM delivery_attempt_item WHERE status = 'IN_PROGRESS'), "
                "(SELECT coalesce(sum(publish_attempts), 0) FROM outbox_event)"
            )
        ).one()
    return int(row[0]), int(row[1]), int(row[2])


def _digest(db: TestDatabase) -> dict[str, str]:
    with db.engine.connect() as conn:
        return database_digest(conn)  # business and platform tables: job_run included


def _sent(simulator: DownstreamServer) -> tuple[int, int]:
    stats = simulator.client.stats(detail=False)
    return stats["delivery_requests"], stats["notification_requests"]


def _assert_refused(result, says: str) -> None:
    assert result.code == 2, (result.code, result.stdout, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and says in lines[0], result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert result.stdout == ""


# job, environment changes, what the one line names
BAD_SETTINGS = {
    "delivery: downstream URL unset": (
        "delivery_retry", {"QO_OPS_DOWNSTREAM_URL": None}, "QO_OPS_DOWNSTREAM_URL is not set"
    ),
    "delivery: downstream URL blank": (
        "delivery_retry", {"QO_OPS_DOWNSTREAM_URL": "  "}, "QO_OPS_DOWNSTREAM_URL is not set"
    ),
    "delivery: downstream URL ftp": (
        "delivery_retry", {"QO_OPS_DOWNSTREAM_URL": "ftp://x"}, "QO_OPS_DOWNSTREAM_URL must be"
    ),
    "delivery: downstream URL without a host": (
        "delivery_retry", {"QO_OPS_DOWNSTREAM_URL": "http://"}, "QO_OPS_DOWNSTREAM_URL must be"
    ),
    "delivery: downstream URL not a URL": (
        "delivery_retry", {"QO_OPS_DOWNSTREAM_URL": "127.0.0.1:8089"}, "QO_OPS_DOWNSTREAM_URL"
    ),
    "delivery: retry base abc": ("delivery_retry", {"QO_OPS_RETRY_BASE_S": "abc"}, "QO_OPS_RETRY_BASE_S"),
    "delivery: retry base nan": ("delivery_retry", {"QO_OPS_RETRY_BASE_S": "nan"}, "QO_OPS_RETRY_BASE_S"),
    "delivery: retry base 0": ("delivery_retry", {"QO_OPS_RETRY_BASE_S": "0"}, "QO_OPS_RETRY_BASE_S"),
    "delivery: retry base negative": ("delivery_retry", {"QO_OPS_RETRY_BASE_S": "-5"}, "QO_OPS_RETRY_BASE_S"),
    "delivery: retry cap inf": ("delivery_retry", {"QO_OPS_RETRY_CAP_S": "inf"}, "QO_OPS_RETRY_CAP_S"),
    "delivery: retry cap below base": (
        "delivery_retry", {"QO_OPS_RETRY_BASE_S": "60", "QO_OPS_RETRY_CAP_S": "10"}, "must not be below"
    ),
    "delivery: drift threshold abc": ("delivery_retry", {"QO_OPS_DRIFT_WARN_S": "abc"}, "QO_OPS_DRIFT_WARN_S"),
    # read only when the database fails mid-run: checked up front all the same
    "delivery: database retry abc": ("delivery_retry", {"QO_OPS_DB_RETRY_S": "abc"}, "QO_OPS_DB_RETRY_S"),
    "publish: downstream URL unset": (
        "notification_publish", {"QO_OPS_DOWNSTREAM_URL": None}, "QO_OPS_DOWNSTREAM_URL is not set"
    ),
    "publish: retry cap abc": ("notification_publish", {"QO_OPS_RETRY_CAP_S": "abc"}, "QO_OPS_RETRY_CAP_S"),
    "publish: retry base 1e400": ("notification_publish", {"QO_OPS_RETRY_BASE_S": "1e400"}, "QO_OPS_RETRY_BASE_S"),
    "delivery: rate limit abc": ("delivery_retry", {"QO_OPS_DOWNSTREAM_RATE_LIMIT": "abc"}, "QO_OPS_DOWNSTREAM_RATE_LIMIT"),
    "delivery: rate limit negative": ("delivery_retry", {"QO_OPS_DOWNSTREAM_RATE_LIMIT": "-1"}, "QO_OPS_DOWNSTREAM_RATE_LIMIT"),
    "delivery: retry budget 1.5": ("delivery_retry", {"QO_OPS_RETRY_BUDGET": "1.5"}, "QO_OPS_RETRY_BUDGET"),
    "publish: breaker open 0": ("notification_publish", {"QO_OPS_BREAKER_OPEN_S": "0"}, "QO_OPS_BREAKER_OPEN_S"),
    "reconciliation: rate limit nan": (
        "order_reconciliation", {"QO_OPS_DOWNSTREAM_RATE_LIMIT": "nan"}, "QO_OPS_DOWNSTREAM_RATE_LIMIT"
    ),
    "reconciliation: resubmit max 11": (
        "order_reconciliation", {"QO_OPS_RESUBMIT_MAX": "11"}, "QO_OPS_RESUBMIT_MAX"
    ),
    "reconciliation: downstream URL ftp": (
        "order_reconciliation", {"QO_OPS_DOWNSTREAM_URL": "ftp://x"}, "QO_OPS_DOWNSTREAM_URL must be"
    ),
    "checkout close: idle hours 0": (
        "abandoned_checkout_close", {"QO_OPS_CHECKOUT_IDLE_HOURS": "0"}, "QO_OPS_CHECKOUT_IDLE_HOURS"
    ),
    "run history: days abc": ("run_history_retention", {"QO_OPS_RUN_HISTORY_DAYS": "abc"}, "QO_OPS_RUN_HISTORY_DAYS"),
    "cleanup: max share 2": ("temp_file_cleanup", {"QO_OPS_CLEANUP_MAX_SHARE": "2"}, "QO_OPS_CLEANUP_MAX_SHARE"),
    "archive: retention abc": ("audit_archive", {"QO_OPS_AUDIT_RETENTION_DAYS": "abc"}, "QO_OPS_AUDIT_RETENTION_DAYS"),
}  # fmt: skip


@pytest.mark.parametrize(("job", "changes", "says"), BAD_SETTINGS.values(), ids=BAD_SETTINGS)
def test_a_bad_setting_is_refused_before_anything_is_claimed(
    demo, simulator, home, job, changes, says
):
    _make_work_due(demo)  # each case finds work to claim, whatever an earlier one did
    before, claims, sent = _digest(demo), _claims(demo), _sent(simulator)
    result = run_cli(_execute(job), _env(demo, simulator, home, **changes))
    _assert_refused(result, says)
    assert _claims(demo) == claims  # no attempt counted, nothing IN_PROGRESS
    assert _digest(demo) == before  # no business row, no job_run, lease or audit row
    assert _sent(simulator) == sent  # nothing reached the downstream


def test_a_password_in_a_bad_downstream_url_is_not_shown(demo, simulator, home):
    bad = "ftp://ops:hunter2@fulfilment.example/x"
    result = run_cli(
        _execute("delivery_retry"), _env(demo, simulator, home, QO_OPS_DOWNSTREAM_URL=bad)
    )
    _assert_refused(result, "QO_OPS_DOWNSTREAM_URL must be")
    assert "hunter2" not in result.stderr


def test_an_archive_home_that_cannot_be_written_is_refused(demo, simulator, home):
    not_a_directory = home / "home-is-a-file"
    not_a_directory.write_text("x")
    before = _digest(demo)
    result = run_cli(
        _execute("audit_archive"),
        _env(demo, simulator, home, QO_OPS_HOME=str(not_a_directory)),
    )
    _assert_refused(result, "not a writable directory")
    assert _digest(demo) == before


def test_with_good_settings_the_same_command_claims_and_calls(db, downstream, tmp_path):
    """The control: the refusals above are not vacuous — this is what they prevented."""
    load_demo_data(db.engine, tenants=1, quotes=300, seed=5, as_of=AS_OF)
    _make_work_due(db)
    claims, sent = _claims(db), _sent(downstream)
    result = run_cli(_execute("delivery_retry"), _env(db, downstream, tmp_path))
    assert result.code == 0, result.stderr
    assert _claims(db)[0] > claims[0]
    assert _sent(downstream)[0] > sent[0]


# ------------------------------------------------------------------------ edge dates

EDGE_DATES = {
    "first day of the calendar": ("order_reconciliation", ["--date", "0001-01-01"]),
    "last day of the calendar": ("order_reconciliation", ["--date", "9999-12-31"]),
    "a range ending on the last day": (
        "order_reconciliation", ["--from", "9999-12-30", "--to", "9999-12-31"]
    ),
    "a range starting before 1900": (
        "order_reconciliation", ["--from", "1899-12-31", "--to", "1900-01-01"]
    ),
    "a day past the calendar": ("order_reconciliation", ["--date", "10000-01-01"]),
    "read model, last day": ("read_model_repair", ["--date", "9999-12-31"]),
    "pricing, last day": ("pricing_snapshot_recalculation", ["--date", "9999-12-31"]),
    "cleanup, last day": ("temp_file_cleanup", ["--date", "9999-12-31"]),
    "archive, first day": ("audit_archive", ["--date", "0001-01-01"]),
}  # fmt: skip


@pytest.mark.parametrize(("job", "window"), EDGE_DATES.values(), ids=EDGE_DATES)
def test_a_day_at_the_edge_of_the_calendar_is_refused(demo, simulator, home, job, window):
    before = _digest(demo)
    args = ["run", job, "--tenant", TENANT, "--mode", "execute", "--reason", "drill", *window]
    args += approval_args(job)
    result = run_cli(args, _env(demo, simulator, home))
    _assert_refused(result, "--" if "10000" in window[-1] else "a window's days must lie")
    assert _digest(demo) == before


def test_the_last_day_whose_end_is_a_date_still_runs(demo, simulator, home):
    result = run_cli(
        ["run", "read_model_repair", "--tenant", TENANT, "--date", LAST_DAY.isoformat()],
        _env(demo, simulator, home),
    )
    assert result.code == 0, result.stderr  # a dry run over 9999-12-30 finds nothing to do


@pytest.mark.parametrize(
    "key", ["9999-12-31|tenant-001", "0001-01-01|tenant-001", "2026-13-01|tenant-001"]
)
def test_a_partition_key_outside_the_calendar_becomes_bad_input(key):
    with pytest.raises(BadInput):  # the op turns it into a one-line Dagster failure
        scope_from_partition_key(CATALOG["order_reconciliation"], key)


def test_scope_days_counts_both_ends_and_refuses_overflow():
    assert Scope.days(TENANT, date(2026, 2, 1), date(2026, 2, 3)).window_end == date(2026, 2, 4)
    with pytest.raises(BadInput):
        Scope.days(TENANT, date.max, date.max)
    with pytest.raises(BadInput):  # constructed directly (the API, an accepted row) too
        Scope(TENANT, date(1, 1, 1), date(1, 1, 2))


# ------------------------------------------------------------------------ the readers


@pytest.mark.parametrize(
    "value",  # fmt: skip
    [
        None,
        "",
        "ftp://x",
        "http://",
        "https://",
        "mailto:a@b.c",
        "//host",
        "http://a b",
        "x",
        "http://x:0",
        "http://x:99999",
    ],
)
def test_the_downstream_url_must_be_http_with_a_host(value):
    with pytest.raises(ConfigError) as caught:
        downstream_url({} if value is None else {"QO_OPS_DOWNSTREAM_URL": value})
    assert "QO_OPS_DOWNSTREAM_URL" in str(caught.value) and caught.value.exit_code == 2


def test_a_good_downstream_url_is_kept_as_given():
    assert downstream_url({"QO_OPS_DOWNSTREAM_URL": " https://f.example:8443/base "}) == (
        "https://f.example:8443/base"
    )


@pytest.mark.parametrize(
    ("base", "cap"),
    [("abc", "60"), ("0", "60"), ("-1", "60"), ("nan", "60"), ("inf", "60"), ("30", "0.001"),
     ("30", "1e9"), ("60", "10")],
)  # fmt: skip
def test_the_retry_policy_needs_positive_seconds_with_base_at_most_cap(base, cap):
    env = {"QO_OPS_RETRY_BASE_S": base, "QO_OPS_RETRY_CAP_S": cap}
    with pytest.raises(ConfigError):
        policy_from_env(environ=env)


def test_the_retry_policy_defaults_and_a_short_drill_policy():
    assert policy_from_env(environ={}) == RetryPolicy()
    drill = policy_from_env(environ={"QO_OPS_RETRY_BASE_S": "0.2", "QO_OPS_RETRY_CAP_S": "1"})
    assert (drill.base, drill.cap) == (timedelta(seconds=0.2), timedelta(seconds=1))


def test_a_delay_after_thousands_of_attempts_is_the_cap_not_an_overflow():
    policy = RetryPolicy(base=timedelta(seconds=30), cap=timedelta(hours=1), jitter=0.0)
    assert policy.delay(5000) == timedelta(hours=1)


@pytest.mark.parametrize("raw", ["abc", "nan", "inf", "-inf", "1e400", "0", "11"])
def test_number_refuses_what_is_not_a_finite_number_in_range(raw):
    with pytest.raises(ConfigError, match="QO_OPS_X must be a number"):
        number("QO_OPS_X", 1.0, 0.5, 10.0, environ={"QO_OPS_X": raw})
    assert number("QO_OPS_X", 1.0, 0.5, 10.0, environ={"QO_OPS_X": " 2.5 "}) == 2.5
    assert math.isclose(number("QO_OPS_X", 1.0, 0.5, 10.0, environ={}), 1.0)


# ------------------------------------------------------------------------- audit


def _trigger_audit(engine: sa.Engine, run_id: str) -> list[sa.Row]:
    return rows(
        engine,
        "SELECT * FROM job_audit WHERE action = 'trigger' AND job_run_id = :id",
        id=uuid.UUID(run_id),
    )


def test_manual_run_appends_one_trigger_audit_row_that_cannot_be_changed(loaded):
    db, _ = loaded
    audit_before = scalar(db.engine, "SELECT count(*) FROM job_audit")

    summary = run(
        db.engine,
        requester="ops:dana",
        reason="INC-11 expire backlog",
        correlation_id="corr-11",
        max_items=5,
    )

    assert scalar(db.engine, "SELECT count(*) FROM job_audit") == audit_before + 1
    audit = _trigger_audit(db.engine, summary.job_run_id)
    assert len(audit) == 1
    a = audit[0]
    assert (a.actor, a.reason, a.scope, a.mode, a.correlation_id, a.job_name, a.decision) == (
        "ops:dana",
        "INC-11 expire backlog",
        TENANT,
        "execute",
        "corr-11",
        JOB,
        "allowed",
    )
    assert str(a.job_run_id) == summary.job_run_id
    row = run_row(db.engine, summary.job_run_id)
    assert (row.requester, row.reason, row.correlation_id, row.trigger_type) == (
        "ops:dana",
        "INC-11 expire backlog",
        "corr-11",
        "manual",
    )

    with pytest.raises(sa.exc.DBAPIError, match="append-only"), db.engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE job_audit SET reason = 'rewritten', actor = 'mallory' WHERE id = :id"),
            {"id": a.id},
        )
    with pytest.raises(sa.exc.DBAPIError, match="append-only"), db.engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM job_audit WHERE id = :id"), {"id": a.id})
    assert _trigger_audit(db.engine, summary.job_run_id) == audit


def test_cli_run_audits_requester_reason_mode_and_correlation_id(loaded, cli):
    db, _ = loaded

    result = cli(
        "run",
        JOB,
        "--tenant",
        TENANT,
        "--requester",
        "ops:erin",
        "--reason",
        "check backlog",
        "--correlation-id",
        "TICKET-5",
        "--json",
    )

    assert result.code == 0, result.stderr
    run_id = json.loads(result.stdout)["job_run_id"]
    audit = _trigger_audit(db.engine, run_id)
    assert [(a.actor, a.reason, a.scope, a.mode, a.correlation_id) for a in audit] == [
        ("ops:erin", "check backlog", TENANT, "dry_run", "TICKET-5")
    ]


def test_a_manual_execute_without_a_reason_is_refused_before_anything_is_written(loaded, cli):
    db, _ = loaded
    before = digest_without(db.engine)

    result = cli("run", JOB, "--tenant", TENANT, "--mode", "execute")

    assert result.code == 2
    assert "reason" in result.stderr
    assert digest_without(db.engine) == before
