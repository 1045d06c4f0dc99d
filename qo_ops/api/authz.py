"""Who may do what: per job, per mode, per tenant. Pure functions; the caller audits.

- ``viewer`` reads.
- ``operator`` dry-runs anything, executes non-destructive jobs, cancels, and may approve
  another identity's held run.
- ``approver`` does all that and executes destructive jobs (cleanup, archive, repair).
- A destructive execute cites an approval (the rule every path shares,
  ``qo_ops/platform/actions/approvals.py``): an approver's own request grants it; an operator's
  cites one an approver granted (``approvalId``), or asks to be held for a second
  identity's approval (``requestApproval``), which then grants it; no one approves their
  own request. Otherwise it is refused.
- ``approver`` alone suspends and resumes jobs (the kill switch); a job-wide suspension
  needs a token that is not limited to one tenant.
- Recovery actions (requeue, a review decision) are for operators and approvers; a
  checkpoint reset, which makes work be done again, for approvers (a dry run: operators).
- A tenant-scoped token touches only its tenant.
"""

from __future__ import annotations

from dataclasses import dataclass

from qo_ops.api.tokens import Principal
from qo_ops.platform.job.spec import JobSpec

WRITERS = frozenset({"operator", "approver"})


@dataclass(frozen=True)
class Decision:
    allowed: bool
    reason: str
    hold_for_approval: bool = False
    grant_approval: bool = False  # an approver's own destructive execute grants its approval


def _tenant(p: Principal, tenant_id: str) -> Decision | None:
    if not p.can_touch(tenant_id):
        return Decision(False, f"token is limited to tenant {p.tenant_id}")
    return None


def may_read(p: Principal, tenant_id: str | None) -> Decision:
    if tenant_id is not None and (denied := _tenant(p, tenant_id)):
        return denied
    return Decision(True, "any role may read")


def may_submit(
    p: Principal,
    spec: JobSpec,
    mode: str,
    tenant_id: str,
    request_approval: bool,
    cites_approval: bool = False,
) -> Decision:
    if denied := _tenant(p, tenant_id):
        return denied
    if not p.roles & WRITERS:
        return Decision(False, "role viewer may only read")
    if mode == "dry_run":
        return Decision(True, "dry-run allowed for operator and approver")
    if not spec.destructive:
        return Decision(True, f"execute of non-destructive {spec.name} allowed")
    if cites_approval:  # whether it allows this run is checked next (check_approval)
        return Decision(True, f"execute of destructive {spec.name} cites an approval")
    if "approver" in p.roles:
        return Decision(
            True, f"execute of destructive {spec.name} approved by approver", grant_approval=True
        )
    if request_approval:
        return Decision(True, "held for a second identity's approval", hold_for_approval=True)
    return Decision(
        False,
        f"executing {spec.name} (destructive) needs an approval: the approver role, an "
        "approvalId an approver granted (POST /internal/jobs/{job}/approvals), or requestApproval and "
        "a second identity's approval",
    )


def may_grant(p: Principal, tenants: list[str] | None) -> Decision:
    """Only an approver grants an approval; a tenant's token only for its tenant."""
    if "approver" not in p.roles:
        return Decision(False, "granting an approval needs the approver role")
    if tenants is None and p.tenant_id is not None:
        return Decision(False, f"token is limited to tenant {p.tenant_id}: name it")
    for tenant_id in tenants or ():
        if denied := _tenant(p, tenant_id):
            return denied
    return Decision(True, "approver grants an approval")


def may_cancel(p: Principal, tenant_id: str) -> Decision:
    if denied := _tenant(p, tenant_id):
        return denied
    if not p.roles & WRITERS:
        return Decision(False, "role viewer may only read")
    return Decision(True, "cancel allowed for operator and approver")


def may_approve(p: Principal, requester: str | None, tenant_id: str) -> Decision:
    if denied := _tenant(p, tenant_id):
        return denied
    if not p.roles & WRITERS:
        return Decision(False, "role viewer may only read")
    if requester == p.identity:
        return Decision(False, "a run needs a second identity's approval, not its requester's")
    return Decision(True, f"approved by a second identity ({p.identity})")


def may_control(p: Principal, tenant_id: str | None) -> Decision:
    """Suspend or resume a job (for one tenant, or every scope when ``tenant_id`` is None)."""
    if "approver" not in p.roles:
        return Decision(False, "suspend and resume need the approver role")
    if tenant_id is None and p.tenant_id is not None:
        return Decision(False, f"token is limited to tenant {p.tenant_id}: name it")
    if tenant_id is not None and (denied := _tenant(p, tenant_id)):
        return denied
    return Decision(True, "suspend/resume allowed for approver")


def may_recover(p: Principal, tenant_id: str, *, destructive: bool, dry_run: bool) -> Decision:
    """A recovery action for ``tenant_id`` (requeue, a review decision, a checkpoint reset):
    operators and approvers; a ``destructive`` one (a checkpoint reset: the work is done
    again) needs an approver unless it is a dry run."""
    if denied := _tenant(p, tenant_id):
        return denied
    if not p.roles & WRITERS:
        return Decision(False, "role viewer may only read")
    if destructive and not dry_run and "approver" not in p.roles:
        return Decision(False, "this recovery action is destructive: it needs the approver role")
    return Decision(True, "recovery allowed")
