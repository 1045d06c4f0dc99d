"""Consent decides whether an execute a person asked for may start. The whole rule is here,
in the order :func:`check` applies it. The runner calls it through
``admission.validate_request``.

1. **A reason, and an approval cited.** An execute with a person behind it
   (``RunOptions.person_behind``) gives a reason, and a destructive job's execute cites an
   approval. This part needs no database, so it lives beside ``RunOptions``
   (:func:`qo_ops.platform.job.options.check_consent`). ``RunOptions.validated`` applies it
   to a blank reason, and the CLI and Dagster's run coordinator apply it before they connect.
2. **The approval allows it** (:func:`check_approval`). The cited approval exists, is for
   this job, covers the tenant, and is neither revoked nor expired. Approvals are granted
   and revoked in :mod:`qo_ops.platform.actions.approvals`.
3. **The reason is new** (:func:`check_reason_is_new`). A reason is not silently repeated on
   one scope.

Each refusal is an :class:`~qo_ops.platform.job.options.ExecuteRefused` whose
``error_code`` is ``reason_required``, ``approval_required`` or ``reason_reused``. The
runner audits it ``denied``. The Dagster run coordinator, the backfill op and the operator
API apply steps 2 and 3 early, one line before a run is queued or accepted. The runner
applies them all again at start.

Why step 3? Dagster's Launchpad pre-fills an earlier run's config ("Open in Launchpad", or
the tab's last session). ``mode: execute`` and that run's reason come along. So a relaunch
would execute the same scope again under an old incident's reason that nobody typed this
time. :func:`check_reason_is_new` refuses an execute whose reason an earlier Dagster execute
of the same job gave *for the same scope*, before anything is claimed.

One incident's reason covers many tenants. "INC-88 stale quotes after the price outage"
may execute quote_expiration for tenant-001, then tenant-002, and so on, because an
incident over 40 tenants needs one sentence, not 40. Only the same job over the same scope
is refused.

Step 3 covers what a person launches in Dagster (trigger ``manual`` with a Dagster run
id), because that is where the pre-fill is. A Dagster re-execution of a run that executed
with the reason keeps it, because "Re-execute" copies the config on purpose, on the page of
the run it repeats. The CLI and the operator API are left alone. There the reason is typed
(or sent) with each request, and repeating a request that failed is how those callers
resume.
"""

from __future__ import annotations

from datetime import UTC, datetime

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from qo_ops.platform.actions.approvals import Approval, find
from qo_ops.platform.job.options import (
    APPROVAL_REQUIRED,
    REASON_REUSED,
    ExecuteRefused,
    RunOptions,
    check_consent,
)
from qo_ops.platform.job.scope import Scope
from qo_ops.platform.job.spec import JobSpec

# The newest earlier Dagster execute of the job over the same scope with the same reason,
# ignoring case and spaces (normalized_reason). The parent run comes first. Every trigger
# counts except the CLI's.
# ix_job_run_dagster_reason (0012) holds exactly these rows, by that expression, so this is
# a lookup.
_EARLIER_EXECUTE = sa.text(
    r"""
    SELECT dagster_run_id, started_at
      FROM job_run
     WHERE job_name = :job AND mode = 'execute' AND dagster_run_id IS NOT NULL
       AND reason IS NOT NULL AND dagster_run_id <> :run AND scope = :scope
       AND btrim(regexp_replace(lower(reason), '\s+', ' ', 'g')) = :reason
     ORDER BY dagster_run_id = :parent DESC, started_at DESC
     LIMIT 1
    """
)


def check(engine: Engine, spec: JobSpec, scope: Scope, options: RunOptions) -> None:
    """Raise :class:`ExecuteRefused` when the execute ``options`` asks for of ``spec`` over
    ``scope`` may not start. The checks, in order, are: no reason, no approval cited, an
    approval that does not allow it, and a reused reason. A run without a person behind it
    passes."""
    check_consent(options, destructive=spec.destructive, job_name=spec.name)
    check_approval(engine, spec, scope, options)  # a destructive execute's cited approval
    check_reason_is_new(engine, spec.name, scope.key, options)  # a Launchpad's copied reason


def requires_approval(spec: JobSpec, options: RunOptions) -> bool:
    """Whether this run needs an approval. Only a destructive job's execute with a person
    behind it does. Schedules and sensors run what the catalog declares, and need none."""
    return spec.destructive and options.mode == "execute" and options.person_behind


def check_approval(engine: Engine, spec: JobSpec, scope: Scope, options: RunOptions) -> None:
    """Raise :class:`ExecuteRefused` (``approval_required``) when this run needs an approval
    and cites none, or cites one that does not allow it. Such an approval is unknown, for
    another job, not for its tenant, expired or revoked."""
    if not requires_approval(spec, options):
        return
    check_consent(options, destructive=True, job_name=spec.name)  # cites one at all
    assert options.approval is not None
    with engine.connect() as conn:
        found = find(conn, options.approval)
        now: datetime = conn.execute(sa.select(sa.func.now())).scalar_one()
    problem = _why_not(found, options.approval, spec.name, scope.tenant_id, now)
    if problem is not None:
        raise ExecuteRefused(
            f"approval {options.approval} {problem}: ask an approver for one (qo-ops approval "
            f"grant {spec.name} --tenant {scope.tenant_id} --reason …, or POST "
            f"/internal/jobs/{spec.name}/approvals) and cite it",
            error_code=APPROVAL_REQUIRED,
        )


def _why_not(
    found: Approval | None, cited: str, job_name: str, tenant_id: str, now: datetime
) -> str | None:
    if found is None:
        return "does not exist"
    if found.job_name != job_name:
        return f"is for {found.job_name}, not {job_name}"
    if found.tenants is not None and tenant_id not in found.tenants:
        return f"does not cover {tenant_id} (it covers {found.covers()})"
    if found.revoked_at is not None:
        return f"was revoked by {found.revoked_by} at {found.revoked_at.astimezone(UTC):%H:%M} UTC"
    if found.expires_at <= now:
        return f"expired at {found.expires_at.astimezone(UTC):%Y-%m-%d %H:%M} UTC"
    return None


def normalized_reason(reason: str) -> str:
    """A reason as the rule compares it: trimmed, in lower case, with runs of spaces as one."""
    return " ".join(reason.lower().split())


def check_reason_is_new(engine: Engine, job_name: str, scope: str, options: RunOptions) -> None:
    """Raise :class:`ExecuteRefused` (``reason_reused``) for an execute a person launched in
    Dagster whose reason an earlier Dagster execute of the job already gave for the same
    scope (``Scope.key``). A run that re-executes a run that executed with it passes."""
    if options.mode != "execute" or options.trigger != "manual" or not options.dagster_run_id:
        return
    reason = normalized_reason(options.reason or "")
    if not reason:  # check_consent refuses it
        return
    with engine.connect() as conn:
        earlier = conn.execute(
            _EARLIER_EXECUTE,
            {
                "job": job_name,
                "scope": scope,
                "run": options.dagster_run_id,
                "reason": reason,
                "parent": options.dagster_parent_run_id or "",
            },
        ).first()
    if earlier is None or earlier.dagster_run_id == options.dagster_parent_run_id:
        return
    raise ExecuteRefused(
        f"an earlier execute of {job_name} for {scope} gave this reason (Dagster run "
        f"{earlier.dagster_run_id[:8]}, {earlier.started_at.astimezone(UTC):%Y-%m-%d %H:%M} UTC): the Launchpad "
        "copies an earlier run's config; give this run its own reason (config: reason), or "
        "re-execute that run from its page to repeat it",
        error_code=REASON_REUSED,
    )
