"""The simulator as one ASGI app: business requests go to the plain-ASGI endpoints
(``business.py``), the admin API and ``/healthz`` to Starlette; ``serve()`` runs it with
uvicorn."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from qo_ops.downstream.simulator.business import BadRequest, Business, required_text
from qo_ops.downstream.simulator.faults import Faults, FaultState
from qo_ops.downstream.simulator.store import Store


class _SimulatorApp:
    """The ASGI app: business requests go straight to ``Business``; the rest (admin API,
    /healthz, lifespan, 404s) to Starlette."""

    def __init__(self, business: Business, admin: Starlette) -> None:
        self.business = business
        self.admin = admin

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and await self.business(scope, receive, send):
            return
        await self.admin(scope, receive, send)


def create_app(store_path: Path, faults: Faults) -> _SimulatorApp:
    """The simulator as an ASGI app over the SQLite store at ``store_path``."""
    store = Store(store_path)
    state = FaultState(faults)

    def bad(detail: str) -> JSONResponse:
        return JSONResponse({"error": "bad_request", "detail": detail}, status_code=400)

    async def json_object(request: Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            raise BadRequest("the body must be a JSON object") from None
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        return body

    async def admin_stats(request: Request) -> Response:
        detail = request.query_params.get("detail", "1").lower() not in ("0", "false", "no")
        stats = store.stats(detail)
        stats["rate_limit_per_s"] = [
            {"second": second, "admitted": admitted, "rate_limited": limited}
            for second, admitted, limited in state.per_second
        ]
        return JSONResponse(stats)

    async def admin_faults(request: Request) -> Response:
        try:
            body = await json_object(request)
            return JSONResponse(state.update(body).to_dict())
        except (BadRequest, ValueError) as exc:
            return bad(str(exc))

    async def admin_put_order(request: Request) -> Response:
        try:
            body = await json_object(request)
            tenant_id, status = required_text(body, "tenant_id"), required_text(body, "status")
        except BadRequest as exc:
            return bad(str(exc))
        return JSONResponse(store.put_order(request.path_params["order_number"], tenant_id, status))

    async def admin_delete_order(request: Request) -> Response:
        return JSONResponse({"deleted": store.delete_order(request.path_params["order_number"])})

    async def admin_reset(request: Request) -> Response:
        store.reset()
        state.per_second.clear()
        return JSONResponse({"reset": True, "faults": state.faults.to_dict()})

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        store.close()

    admin = Starlette(
        routes=[
            Route("/admin/stats", admin_stats, methods=["GET"]),
            Route("/admin/faults", admin_faults, methods=["POST"]),
            Route("/admin/orders/{order_number}", admin_put_order, methods=["PUT"]),
            Route("/admin/orders/{order_number}", admin_delete_order, methods=["DELETE"]),
            Route("/admin/reset", admin_reset, methods=["POST"]),
            Route("/healthz", healthz, methods=["GET"]),
        ],
        lifespan=lifespan,
    )
    admin.state.store = store
    admin.state.faults = state
    return _SimulatorApp(Business(store, state), admin)


def serve(host: str, port: int, store_path: Path, faults: Faults) -> None:
    """Run the simulator with uvicorn until SIGINT/SIGTERM."""
    import uvicorn

    config = uvicorn.Config(
        create_app(store_path, faults),
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        proxy_headers=False,  # one middleware less per request; nothing stands in front
        timeout_graceful_shutdown=1,
    )
    # where it answers, for `qo-ops demo-data --reset` (qo_ops.downstream.local): removed at
    # exit; left behind by a SIGKILL, it names a port nobody answers on (checked there)
    url_file = served_url_file(store_path)
    url_file.write_text(f"http://{host}:{port}\n")
    try:
        uvicorn.Server(config).run()
    finally:
        url_file.unlink(missing_ok=True)


def served_url_file(store_path: Path) -> Path:
    """The file naming the URL of the simulator serving ``store_path`` while it runs."""
    return store_path.with_name(store_path.name + ".url")
