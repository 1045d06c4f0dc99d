"""Bearer tokens: ``qoops_<id>_<secret>``. Only a SHA-256 of the 256-bit secret is stored;
``id`` finds the row, a constant-time comparison proves the secret. Each token is bound to
one identity, its roles and optionally one tenant, and expires."""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from qo_ops.db.schema import API_ROLES, api_token
from qo_ops.errors import BadInput
from qo_ops.platform.job.scope import TENANT_ID

PREFIX = "qoops_"
_TOKEN = re.compile(r"^qoops_([0-9a-f]{16})_([A-Za-z0-9_-]{43})$")
IDENTITY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@:-]{0,127}$")
MAX_TTL = timedelta(days=366)


# Twice: a second call stores a second token under its own random id and never touches the
# first (the same id again would fail on the primary key); each can be revoked.
_INSERT_TOKEN = (
    sa.insert(api_token)
    .values(expires_at=sa.func.now() + sa.bindparam("ttl", type_=sa.Interval))
    .returning(api_token.c.expires_at)
)

# A live token by its id (its secret is checked by the caller, in constant time).
_LIVE_TOKEN = sa.select(api_token).where(
    api_token.c.id == sa.bindparam("token_id"),
    api_token.c.revoked_at.is_(None),
    api_token.c.expires_at > sa.func.now(),
)

# Twice: a second revoke finds the token already revoked and matches nothing.
_REVOKE_TOKEN = (
    sa.update(api_token)
    .where(api_token.c.id == sa.bindparam("token_id"), api_token.c.revoked_at.is_(None))
    .values(revoked_at=sa.func.now())
    .returning(api_token.c.id)
)

# Every token's metadata, never its secret's hash, newest first.
_LIST_TOKENS = sa.select(*(c for c in api_token.c if c.name != "secret_sha256")).order_by(
    api_token.c.created_at.desc()
)


@dataclass(frozen=True)
class Principal:
    """Who a valid token says is calling."""

    identity: str
    roles: frozenset[str]
    tenant_id: str | None  # None: every tenant
    token_id: str

    def can_touch(self, tenant_id: str) -> bool:
        return self.tenant_id is None or self.tenant_id == tenant_id


@dataclass(frozen=True)
class IssuedToken:
    token: str  # shown once, never stored
    token_id: str
    identity: str
    roles: tuple[str, ...]
    tenant_id: str | None
    expires_at: datetime


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def create_token(
    engine: Engine,
    identity: str,
    roles: list[str],
    tenant_id: str | None,
    ttl: timedelta,
    created_by: str,
) -> IssuedToken:
    """Store a new token's hash and return the token (the only time it is visible)."""
    if not IDENTITY.match(identity):
        raise BadInput("identity must be 1-128 characters: letters, digits and . _ @ : -")
    unknown = sorted(set(roles) - set(API_ROLES))
    if not roles or unknown:
        raise BadInput(f"role must be one of {', '.join(API_ROLES)}")
    if tenant_id is not None and not TENANT_ID.match(tenant_id):
        raise BadInput("tenant must be a short key of lowercase letters, digits and '-'")
    if not timedelta(minutes=1) <= ttl <= MAX_TTL:
        raise BadInput("token lifetime must be between 1 minute and 366 days")
    token_id, secret = secrets.token_hex(8), secrets.token_urlsafe(32)
    ordered = tuple(r for r in API_ROLES if r in roles)
    with engine.begin() as conn:
        expires_at = conn.execute(
            _INSERT_TOKEN,
            {
                "id": token_id,
                "identity": identity,
                "roles": list(ordered),
                "tenant_id": tenant_id,
                "secret_sha256": _digest(secret),
                "created_by": created_by,
                "ttl": ttl,
            },
        ).scalar_one()
    return IssuedToken(
        f"{PREFIX}{token_id}_{secret}", token_id, identity, ordered, tenant_id, expires_at
    )


def authenticate(engine: Engine, presented: str | None) -> Principal | None:
    """The principal of a valid, unexpired, unrevoked token; None for anything else."""
    match = _TOKEN.match(presented or "")
    if match is None:
        return None
    token_id, secret = match.groups()
    with engine.connect() as conn:
        row = conn.execute(_LIVE_TOKEN, {"token_id": token_id}).first()
    if row is None or not hmac.compare_digest(row.secret_sha256, _digest(secret)):
        return None
    return Principal(row.identity, frozenset(row.roles), row.tenant_id, row.id)


def revoke_token(engine: Engine, token_id: str) -> bool:
    """Revoke a token by its id; False when there is no such live token."""
    with engine.begin() as conn:
        done = conn.execute(_REVOKE_TOKEN, {"token_id": token_id}).first()
    return done is not None


def list_tokens(engine: Engine) -> list[dict[str, object]]:
    """Every token's metadata (never a secret or its hash), newest first."""
    with engine.connect() as conn:
        return [dict(r._mapping) for r in conn.execute(_LIST_TOKENS)]
