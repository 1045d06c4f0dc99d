"""The cases of the one consent rule for a destructive execute, shared by the tests of each
path (CLI, Launchpad, backfills: qo_ops_tests/dagster/test_approval_paths.py; the operator
API: qo_ops_tests/api/test_api_approvals.py): the approval each cites, planted as an approver
grants them, and what the one-line refusal says."""

from __future__ import annotations

import sqlalchemy as sa

from qo_ops.db.digest import database_digest
from qo_ops.db.schema import BUSINESS_TABLES, job_run
from qo_ops.jobs.catalog import CATALOG
from qo_ops.platform.actions import approvals

JOB = "run_history_retention"  # destructive, one tenant a partition
SPEC = CATALOG[JOB]
TENANT = "tenant-001"
REASON = "INC-77 run history past retention"

# case -> what the one-line refusal says (None: allowed)
CASES = {
    "none": "needs an approval",
    "other_tenant": "does not cover tenant-001",
    "other_job": "is for temp_file_cleanup",
    "revoked": "was revoked by",
    "expired": "expired at",
    "valid": None,
}


def plant(engine) -> dict[str, str | None]:
    """The approval each case cites, granted as an approver would (qo-ops approval grant)."""

    def granted(job: str, tenants: list[str] | None) -> str:
        spec = CATALOG[job]
        return approvals.grant(engine, spec, approvals.Grant(job, tenants, REASON, "ana")).id

    cited: dict[str, str | None] = {
        "none": None,
        "other_tenant": granted(JOB, ["tenant-002"]),
        "other_job": granted("temp_file_cleanup", [TENANT]),
        "revoked": granted(JOB, [TENANT]),
        "expired": granted(JOB, None),  # every tenant, but no longer
        "valid": granted(JOB, [TENANT]),
    }
    approvals.revoke(engine, cited["revoked"], "ana")  # type: ignore[arg-type]
    with engine.begin() as conn:  # planted: the clock past its end
        conn.execute(
            sa.text(
                "UPDATE run_approval SET expires_at = now() - interval '1 second' WHERE id = :i"
            ),
            {"i": cited["expired"]},
        )
    return cited


def run_rows(engine) -> list[sa.Row]:
    with engine.connect() as conn:
        return conn.execute(
            sa.select(job_run.c.trigger_type, job_run.c.approval_id, job_run.c.status)
        ).all()


def denied_audits(engine) -> list[sa.Row]:
    with engine.connect() as conn:
        return conn.execute(
            sa.text(
                "SELECT actor, action, details FROM job_audit "
                "WHERE decision LIKE 'denied%' ORDER BY id"
            )
        ).all()


def business_digest(engine) -> dict[str, str]:
    with engine.connect() as conn:
        return database_digest(conn, BUSINESS_TABLES)
