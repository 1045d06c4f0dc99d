"""The API's rules on their own: the authorization matrix, the rate limiter (with a fake
clock), the `qo-ops api` configuration and token commands refusing bad input in one line,
and oversized bodies refused before anything is read into the database."""

from __future__ import annotations

import sqlalchemy as sa

from qo_ops.api import authz
from qo_ops.api.ratelimit import RateLimiter
from qo_ops.api.tokens import Principal
from qo_ops.errors import redact
from qo_ops.jobs.catalog import CATALOG
from qo_ops_tests.conftest import base_env, run_cli


def _p(*roles: str, tenant: str | None = None, identity: str = "someone") -> Principal:
    return Principal(identity, frozenset(roles), tenant, "0" * 16)


def test_authorization_matrix_per_role_mode_and_job():
    sweep, destructive = CATALOG["quote_expiration"], CATALOG["temp_file_cleanup"]
    assert destructive.destructive and not sweep.destructive
    table = {
        # (roles, job, mode, requestApproval) -> (allowed, held)
        (("viewer",), sweep, "dry_run", False): (False, False),
        (("viewer",), sweep, "execute", False): (False, False),
        (("operator",), sweep, "dry_run", False): (True, False),
        (("operator",), sweep, "execute", False): (True, False),
        (("operator",), destructive, "dry_run", False): (True, False),
        (("operator",), destructive, "execute", False): (False, False),
        (("operator",), destructive, "execute", True): (True, True),
        (("approver",), destructive, "execute", False): (True, False),
        (("viewer", "approver"), destructive, "execute", False): (True, False),
    }
    for (roles, spec, mode, ask), expected in table.items():
        decision = authz.may_submit(_p(*roles), spec, mode, "tenant-001", ask)
        assert (decision.allowed, decision.hold_for_approval) == expected, (roles, spec.name, mode)
        assert decision.reason and "\n" not in decision.reason

    scoped = _p("approver", tenant="tenant-001")
    assert authz.may_submit(scoped, sweep, "dry_run", "tenant-001", False).allowed
    assert not authz.may_submit(scoped, sweep, "dry_run", "tenant-002", False).allowed
    assert not authz.may_read(scoped, "tenant-002").allowed
    assert authz.may_read(_p("viewer"), "tenant-002").allowed
    assert not authz.may_cancel(_p("viewer"), "tenant-001").allowed
    assert authz.may_cancel(_p("operator"), "tenant-001").allowed
    assert not authz.may_approve(_p("operator", identity="olga"), "olga", "tenant-001").allowed
    assert authz.may_approve(_p("operator", identity="otto"), "olga", "tenant-001").allowed
    assert not authz.may_approve(_p("viewer", identity="vera"), "olga", "tenant-001").allowed


def test_rate_limiter_counts_a_sliding_window_per_key():
    now = [1000.0]
    limiter = RateLimiter(3, window_s=60, clock=lambda: now[0])
    assert [limiter.hit("a") for _ in range(3)] == [None, None, None]
    wait = limiter.hit("a")
    assert wait is not None and 59 < wait <= 60
    assert limiter.hit("b") is None  # keys are independent
    now[0] += 30
    assert limiter.hit("a") is not None  # still inside the window
    now[0] += 30.5
    assert limiter.hit("a") is None  # the first three hits have left the window


def test_redaction_strips_api_tokens_bearer_values_and_url_passwords():
    token = "qoops_0123456789abcdef_" + "S" * 43
    text = redact(f"auth Bearer {token} then {token} and postgresql://u:pw123@h/db")
    assert "S" * 43 not in text and "pw123" not in text
    assert "qoops_0123456789abcdef_***" in text


def test_api_command_refuses_bad_configuration_in_one_line(db):
    cases = [
        ({}, "set QO_OPS_DAGSTER_URL"),
        ({"QO_OPS_DAGSTER_URL": "http://admin:pw@127.0.0.1:3000"}, "without credentials"),
        ({"QO_OPS_DAGSTER_URL": "ftp://x"}, "http(s) URL"),
        (
            {"QO_OPS_DAGSTER_URL": "http://127.0.0.1:3000", "QO_OPS_API_RATE_LIMIT": "lots"},
            "QO_OPS_API_RATE_LIMIT",
        ),
    ]
    for extra, message in cases:
        result = run_cli(["api", "--port", "1"], base_env(QO_OPS_DATABASE_URL=db.env_url, **extra))
        assert result.code == 2, (extra, result.stderr)
        assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1
        assert "pw" not in result.stderr


def test_token_commands_refuse_bad_input_and_write_nothing(cli, db):
    for args, message in [
        (["--identity", "a b", "--role", "viewer"], "identity must be"),
        (["--identity", "ok", "--role", "admin"], "role must be one of"),
        (["--identity", "ok", "--role", "viewer", "--tenant", "../x"], "tenant must be"),
        (["--identity", "ok", "--role", "viewer", "--expires-in", "forever"], "--expires-in"),
        (["--identity", "ok", "--role", "viewer", "--expires-in", "999d"], "366 days"),
    ]:
        result = cli("api", "token", "create", *args)
        assert result.code == 2 and message in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr
    assert cli("api", "token", "revoke", "nope").code == 2
    with db.engine.connect() as conn:
        assert conn.scalar(sa.text("SELECT count(*) FROM api_token")) == 0


def test_oversized_or_unsized_bodies_are_refused(api, db):
    operator = api.token("olga", "operator")
    huge = b'{"mode": "dry_run", "tenant": "tenant-001", "reason": "' + b"x" * 20_000 + b'"}'
    response = api.post(
        "/internal/jobs/quote_expiration/runs",
        operator,
        content=huge,
        headers={"Content-Type": "application/json"},
    )
    assert response.status_code == 413 and "body larger" in response.json()["error"]
    with db.engine.connect() as conn:
        assert conn.scalar(sa.text("SELECT count(*) FROM job_run")) == 0
