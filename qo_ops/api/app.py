"""The HTTP surface of the operator API (FastAPI). Every request is authenticated (bearer
token), rate-limited per identity, validated against the catalog and authorized; every
decision is audited; a run is created ``accepted`` and handed to Dagster, which executes it
out of band. Errors are one line of JSON: ``{"error": "...", "requestId": "..."}``.

The routes are in ``qo_ops.api.routes`` (one module a resource), what they are given in
``deps``, the framing of every request and its errors in ``handlers``."""

from __future__ import annotations

from fastapi import Depends, FastAPI
from fastapi.exceptions import RequestValidationError
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError
from starlette.exceptions import HTTPException as StarletteHTTPException

from qo_ops.api import handlers, routes
from qo_ops.api.dagster import DagsterClient
from qo_ops.api.deps import ApiState, principal
from qo_ops.api.errors import ApiError
from qo_ops.api.ratelimit import RateLimiter


def create_app(engine: Engine, dagster: DagsterClient, limiter: RateLimiter) -> FastAPI:
    """The operator API over ``engine``, launching through ``dagster``."""
    app = FastAPI(
        title="qo-ops operator API",
        version="1",
        description=(
            "Authenticated, authorized and audited manual runs of qo-ops jobs. Every request "
            "carries `Authorization: Bearer <token>` (`qo-ops api token create`). Runs are "
            "accepted here and executed by Dagster out of band."
        ),
        docs_url=None,
        redoc_url=None,
        generate_unique_id_function=lambda route: route.name,  # operationId: the handler's name
    )
    app.state.api = ApiState(engine, dagster, limiter)
    app.middleware("http")(handlers.request_context)
    app.exception_handler(ApiError)(handlers.api_error)
    app.exception_handler(RequestValidationError)(handlers.invalid_request)
    app.exception_handler(StarletteHTTPException)(handlers.http_error)
    app.exception_handler(DBAPIError)(handlers.database_down)
    for router in routes.PUBLIC:
        app.include_router(router)
    for router in routes.AUTHENTICATED:  # authenticated before anything else is looked at
        app.include_router(router, dependencies=[Depends(principal)])
    return app
