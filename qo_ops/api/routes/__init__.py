"""The API's routes, one module a resource: ``health`` (liveness, no authentication),
``jobs`` (the catalog and a job's status), ``runs`` (request, read and cancel a run),
``approvals`` (release a held run), ``control`` (the kill switch) and ``recovery`` (dead
letters, the review queue, checkpoints). Every router but
``health`` is included behind the :func:`~qo_ops.api.deps.principal` dependency."""

from fastapi import APIRouter

from qo_ops.api.routes import approvals, control, health, jobs, recovery, runs

PUBLIC: tuple[APIRouter, ...] = (health.router,)
AUTHENTICATED: tuple[APIRouter, ...] = (
    jobs.router,
    runs.router,
    approvals.router,
    control.router,
    recovery.router,
)
