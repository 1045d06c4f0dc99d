"""Whether a run may start. This module checks a run before anything is written, and it
writes the audit row of a run started (or refused) for a person.

A run that cannot be right is refused with nothing written. Examples are impossible options,
a bad setting, the wrong kind of scope, or an unknown tenant. Two other refusals leave an
audit row (``denied``). One is an execute a person may not start: no reason, a reused reason,
or a destructive job without a valid approval. The other is a run of a suspended job."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy.engine import Connection, Engine

from qo_ops.db import audit, migrate
from qo_ops.db.availability import db_retry_s
from qo_ops.errors import BadInput
from qo_ops.platform.actions.control import JobSuspended, suspension_for
from qo_ops.platform.job.options import ExecuteRefused, RunOptions
from qo_ops.platform.job.scope import Scope
from qo_ops.platform.job.spec import JobSpec
from qo_ops.platform.run import consent
from qo_ops.platform.run.stopping import StopSignals
from qo_ops.platform.schedule.drift import drift_warn_s
from qo_ops.platform.schedule.tenants import tenant_exists


def validate_request(engine: Engine, spec: JobSpec, scope: Scope, options: RunOptions) -> object:
    """Reject a run that cannot be right, before anything is written.

    Returns the job's settings (``JobSpec.validate_settings``), which the run then uses
    (``run_settings``)."""
    options.validated()
    consent.check(engine, spec, scope, options)  # a person's execute needs reason, approval
    drift_warn_s(), db_retry_s()  # the runner's own settings, read again when needed
    settings = spec.validate_settings() if spec.validate_settings is not None else None
    windowed = spec.partitioning == "tenant_day"
    if windowed and scope.window_start is None:
        raise BadInput(f"{spec.name} is windowed: give --date or --from/--to")
    if not windowed and scope.window_start is not None:
        raise BadInput(f"{spec.name} is not windowed: drop --date/--from/--to")
    with engine.connect() as conn:
        known = tenant_exists(conn, scope.tenant_id)
    if not known:
        raise BadInput(f"unknown tenant {scope.tenant_id}")
    return settings


@dataclass(frozen=True)
class Admission:
    """A run at the door: this job, over this scope, with these options.

    It is admitted or refused before anything is written, and it writes the audit rows of
    that decision. The operator API's request to run a job is a different type,
    :class:`qo_ops.api.service.RunRequest`. Dagster's ``dg.RunRequest`` is a sensor's or a
    schedule's."""

    spec: JobSpec
    scope: Scope
    options: RunOptions

    def admit(self, engine: Engine, stop: StopSignals) -> object:
        """Raise if the run cannot be right or may not start now, else return the job's settings.

        A refusal is audited when a person or a suspension is behind it."""
        # A queued Dagster run launches in the image it was created with. If a contract step
        # has since retired that code, this line makes the run start nothing.
        migrate.require_current_cached(engine)
        try:
            settings = validate_request(engine, self.spec, self.scope, self.options)
        except ExecuteRefused as refused:  # a person's execute without consent is recorded
            with stop.deferred(), engine.begin() as conn:
                self.audit(
                    conn, "denied", self.options.job_run_id,
                    {"refused": refused.error_code, "cause": str(refused)},
                )  # fmt: skip
            raise
        self._refuse_if_suspended(engine)
        return settings

    def _refuse_if_suspended(self, engine: Engine) -> None:
        """A suspended job starts no run, whatever triggered it. The refusal is audited."""
        with engine.begin() as conn:
            found = suspension_for(conn, self.spec.name, self.scope.tenant_id)
            if found is None:
                return
            self.audit(
                conn, "denied", self.options.job_run_id,
                {"refused": "suspended", "trigger": self.options.trigger, **found.as_dict()},
            )  # fmt: skip
        raise JobSuspended(f"{found.describe()}; nothing was run (resume: qo-ops resume)")

    def audit(
        self, conn: Connection, decision: str, run_id: uuid.UUID | None, details: dict[str, Any]
    ) -> None:
        """The audit row of the run being started (or refused) for ``options.requester``."""
        options = self.options
        trigger: dict[str, str] = {"trigger": options.trigger}
        if options.dagster_run_id:
            trigger["dagster_run_id"] = options.dagster_run_id
        if options.approval:
            trigger["approval"] = options.approval
        audit.append_audit(
            conn,
            audit.AuditEntry(
                actor=options.requester or "unknown",
                action="trigger",
                decision=decision,
                job_name=self.spec.name,
                scope=self.scope.key,
                mode=options.mode,
                reason=options.reason,
                correlation_id=options.correlation_id,
                job_run_id=run_id,
                details={**trigger, **details},
            ),
        )
