"""Expand: one rate limit per downstream origin for the whole fleet.

- ``downstream_rate_limit``: a token bucket per origin (scheme://host:port), shared by every
  run, process and pod that calls it: the tokens it held when last counted, when that was
  (by the database clock), and until when a ``429``'s Retry-After pauses every run
  (qo_ops/platform/calls/ratelimit.py). Its own table, not columns of
  ``downstream_breaker``: a batch's record locks the breaker's row for its transaction, and
  a grant must never wait for that.

Expand only: a new table; the release at 0018 keeps running on it (and keeps its limit per
run). The migration runner sets the lock and statement timeouts.

Revision ID: 0019
Revises: 0018
"""

from __future__ import annotations

from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None
phase = "expand"


def upgrade() -> None:
    for statement in EXPAND:
        op.execute(statement)
    op.execute("GRANT SELECT, INSERT, UPDATE ON downstream_rate_limit TO qo_ops_runner")
    op.execute("GRANT SELECT ON downstream_rate_limit TO qo_ops_api, qo_ops_readonly")


# Each statement whole, robust to a rerun after a failure part way.
EXPAND = (
    """
    CREATE TABLE IF NOT EXISTS downstream_rate_limit (
        downstream text NOT NULL,
        tokens double precision NOT NULL,
        counted_at timestamptz NOT NULL,
        paused_until timestamptz,
        CONSTRAINT pk_downstream_rate_limit PRIMARY KEY (downstream),
        CONSTRAINT ck_downstream_rate_limit_tokens_not_negative CHECK (tokens >= 0)
    )
    """,
)


def downgrade() -> None:
    op.execute("DROP TABLE IF EXISTS downstream_rate_limit")
