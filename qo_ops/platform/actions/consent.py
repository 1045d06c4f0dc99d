"""A reason is not silently repeated on one scope: the consent rule that needs the run
history.

Dagster's Launchpad pre-fills an earlier run's config ("Open in Launchpad", or the tab's
last session): ``mode: execute`` and that run's reason come along, so a relaunch would
execute the same scope again under an old incident's reason that nobody typed this time.
:func:`check_reason_is_new` refuses an execute whose reason an earlier Dagster execute of
the same job gave *for the same scope*, before anything is claimed; the runner audits the
refusal as ``denied``, as it does the rules of :func:`qo_ops.platform.job.options.check_consent`
(which need no database).

One incident's reason covers many tenants: "INC-88 stale quotes after the price outage"
may execute quote_expiration for tenant-001, then tenant-002, … (an incident over 40
tenants needs one sentence, not 40). Only the same job over the same scope is refused.

The rule covers what a person launches in Dagster (trigger ``manual`` with a Dagster run
id), where the pre-fill is. A Dagster re-execution of a run that executed with the reason
keeps it: "Re-execute" copies the config on purpose, on the page of the run it repeats.
The CLI and the operator API are left alone: there the reason is typed (or sent) with
each request, and repeating a request that failed is how those callers resume.
"""

from __future__ import annotations

from datetime import UTC

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from qo_ops.platform.job.options import ExecuteRefused, RunOptions

REASON_REUSED = "reason_reused"

# the newest earlier Dagster execute of the job over the same scope with the same reason
# (case and spaces aside: normalized_reason), the parent run's first; every trigger counts
# but the CLI's.
# ix_job_run_dagster_reason (0012) holds exactly these rows, by that expression: a lookup.
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


def normalized_reason(reason: str) -> str:
    """A reason as the rule compares it: trimmed, lower case, runs of spaces as one."""
    return " ".join(reason.lower().split())


def check_reason_is_new(engine: Engine, job_name: str, scope: str, options: RunOptions) -> None:
    """Raise :class:`ExecuteRefused` (``reason_reused``) for an execute a person launched in
    Dagster whose reason an earlier Dagster execute of the job already gave for the same
    scope (``Scope.key``), unless this run re-executes a run that executed with it."""
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
