"""``qo-ops api``: serve the operator API; ``qo-ops api token …``: manage its bearer tokens;
``qo-ops api openapi``: print its OpenAPI document."""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from datetime import timedelta
from typing import Annotated

import typer

from qo_ops.cli_support import emit_json, print_table, ready_engine, resolve_requester, when_text
from qo_ops.errors import BadInput, ConfigError

DAGSTER_URL_ENV = "QO_OPS_DAGSTER_URL"
DAGSTER_PUBLIC_URL_ENV = "QO_OPS_DAGSTER_PUBLIC_URL"
DAGSTER_LOCATION_ENV = "QO_OPS_DAGSTER_LOCATION"
RATE_LIMIT_ENV = "QO_OPS_API_RATE_LIMIT"  # requests per minute per identity
DEFAULT_RATE_LIMIT = 120

api_app = typer.Typer(
    help="The operator API: authenticated, authorized, audited manual runs through Dagster.",
    invoke_without_command=True,
)
token_app = typer.Typer(help="Bearer tokens of the operator API.", no_args_is_help=True)
api_app.add_typer(token_app, name="token")


def _rate_limit() -> int:
    raw = os.environ.get(RATE_LIMIT_ENV, "").strip()
    if not raw:
        return DEFAULT_RATE_LIMIT
    if not raw.isdigit() or not 1 <= int(raw) <= 100_000:
        raise ConfigError(
            f"{RATE_LIMIT_ENV} must be a whole number of requests per minute (1-100000)"
        )
    return int(raw)


def _dagster_url(name: str, required: bool) -> str | None:
    value = os.environ.get(name, "").strip()
    if not value:
        if required:
            raise ConfigError(f"set {name} to Dagster's webserver URL, e.g. http://127.0.0.1:3000")
        return None
    if not re.match(r"^https?://[^\s/@]+(:\d+)?(/\S*)?$", value):
        raise ConfigError(f"{name} must be an http(s) URL without credentials")
    return value


def build_app() -> object:
    """The API app as configured by the environment (database, Dagster, rate limit)."""
    from qo_ops.api.app import create_app
    from qo_ops.api.dagster import DagsterClient
    from qo_ops.api.ratelimit import RateLimiter

    url = _dagster_url(DAGSTER_URL_ENV, required=True)
    assert url is not None
    dagster = DagsterClient(
        url,
        location=os.environ.get(DAGSTER_LOCATION_ENV, "").strip() or "qo_ops.definitions",
        public_url=_dagster_url(DAGSTER_PUBLIC_URL_ENV, required=False),
    )
    limiter = RateLimiter(_rate_limit())
    return create_app(ready_engine(), dagster, limiter)


@api_app.callback()
def serve(
    ctx: typer.Context,
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8090,
) -> None:
    """Serve the operator API (finds Dagster through QO_OPS_DAGSTER_URL)."""
    if ctx.invoked_subcommand is not None:
        return
    if not 1 <= port <= 65535:
        raise BadInput("--port must be between 1 and 65535")
    import uvicorn

    from qo_ops.platform.observability.events import json_log_handler

    app = build_app()
    api_log = logging.getLogger("qo_ops.api")
    api_log.addHandler(json_log_handler(sys.stdout))
    api_log.setLevel(logging.INFO)
    api_log.propagate = False
    typer.echo(json.dumps({"event": "api.listening", "host": host, "port": port}), err=True)
    uvicorn.run(
        app,  # type: ignore[arg-type]
        host=host,
        port=port,
        access_log=False,  # our own request line leaves out query strings and headers
        log_level="warning",
        server_header=False,
        log_config=None,
    )


@api_app.command("openapi")
def openapi() -> None:
    """Print the OpenAPI document (committed as docs/openapi.json)."""
    typer.echo(openapi_document())


def openapi_document() -> str:
    """The API's OpenAPI document as stable, sorted JSON."""
    from qo_ops.api.app import create_app
    from qo_ops.api.dagster import DagsterClient
    from qo_ops.api.ratelimit import RateLimiter

    app = create_app(None, DagsterClient("http://dagster.invalid"), RateLimiter(1))  # type: ignore[arg-type]
    return json.dumps(app.openapi(), indent=2, sort_keys=True)


def _ttl(value: str) -> timedelta:
    match = re.fullmatch(r"(\d{1,4})([mhd])", value.strip())
    if match is None:
        raise BadInput("--expires-in must look like 30m, 12h or 90d")
    amount, unit = int(match[1]), match[2]
    return {
        "m": timedelta(minutes=amount),
        "h": timedelta(hours=amount),
        "d": timedelta(days=amount),
    }[unit]


@token_app.command("create")
def token_create(
    identity: Annotated[str, typer.Option(help="Who the token speaks for, e.g. alice@ops.")],
    role: Annotated[list[str], typer.Option(help="viewer, operator or approver (repeatable).")],
    tenant: Annotated[
        str | None, typer.Option(help="Limit the token to one tenant (default: every tenant).")
    ] = None,
    expires_in: Annotated[str, typer.Option(help="Lifetime: 30m, 12h, 90d.")] = "90d",
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Create a token; it is printed once, alone on the last line, and never stored."""
    from qo_ops.api.tokens import create_token

    ttl = _ttl(expires_in)
    engine = ready_engine()
    issued = create_token(engine, identity, role, tenant, ttl, resolve_requester(None))
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "token_id": issued.token_id,
                    "identity": issued.identity,
                    "roles": list(issued.roles),
                    "tenant": issued.tenant_id,
                    "expires_at": issued.expires_at.isoformat(),
                    "token": issued.token,
                }
            )
        )
        return
    typer.echo(
        f"token {issued.token_id} for {issued.identity} ({', '.join(issued.roles)}"
        f"{', tenant ' + issued.tenant_id if issued.tenant_id else ', every tenant'}), "
        f"expires {issued.expires_at:%Y-%m-%d %H:%M}Z. Shown once; store it now:"
    )
    typer.echo(issued.token)


@token_app.command("list")
def token_list(
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Every token's id, identity, roles, tenant, expiry and revocation (never a secret)."""
    from qo_ops.api.tokens import list_tokens

    tokens = list_tokens(ready_engine())
    if as_json:
        emit_json({"tokens": tokens})
        return
    print_table(
        "API tokens",
        ["id", "identity", "roles", "tenant", "created", "expires", "revoked"],
        [
            [
                t["id"],
                t["identity"],
                ",".join(t["roles"]),  # type: ignore[arg-type]
                t["tenant_id"] or "*",
                when_text(t["created_at"]),  # type: ignore[arg-type]
                when_text(t["expires_at"]),  # type: ignore[arg-type]
                when_text(t["revoked_at"]),  # type: ignore[arg-type]
            ]
            for t in tokens
        ],
    )


@token_app.command("revoke")
def token_revoke(
    token_id: Annotated[str, typer.Argument(help="The token's id (from `token list`).")],
) -> None:
    """Revoke a token at once."""
    from qo_ops.api.tokens import revoke_token

    if not re.fullmatch(r"[0-9a-f]{16}", token_id):
        raise BadInput("a token id is 16 hex characters (see `qo-ops api token list`)")
    if not revoke_token(ready_engine(), token_id):
        raise BadInput(f"no live token {token_id}")
    typer.echo(f"token {token_id} revoked")
