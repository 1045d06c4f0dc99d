"""The database roles of qo-ops and what each may do, as plain data, and a reader of what
the database actually grants (``docs/security.md``).

Migration 0005 creates the roles and writes the grants out literally; this module states
the same matrix so that a test can compare the two, table by table and privilege by
privilege. A table added by a later migration needs an entry here (and grants there): the
test reads every table of schema ``public`` and fails on one this module does not know.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from qo_ops.db.migrate import SERVES_TABLE, VERSION_TABLE
from qo_ops.db.schema import BUSINESS_TABLES, PLATFORM_TABLES

RUNNER = "qo_ops_runner"  # qo-ops run and the job commands; Dagster run workers and sensors
API = "qo_ops_api"  # qo-ops api, the operator HTTP API
READONLY = "qo_ops_readonly"  # the metrics exporter, read-only dashboards
ROLES = (RUNNER, API, READONLY)

# Every table privilege PostgreSQL knows (16): the matrix checks all of them, so a stray
# REFERENCES or TRIGGER grant shows up as well.
TABLE_PRIVILEGES = ("SELECT", "INSERT", "UPDATE", "DELETE", "TRUNCATE", "REFERENCES", "TRIGGER")

Matrix = dict[str, dict[str, frozenset[str]]]


def _p(privileges: str = "") -> frozenset[str]:
    return frozenset(privileges.split())


NONE = _p()
S = _p("SELECT")
SI = _p("SELECT INSERT")
SU = _p("SELECT UPDATE")
SID = _p("SELECT INSERT DELETE")
SIU = _p("SELECT INSERT UPDATE")
SUD = _p("SELECT UPDATE DELETE")
SD = _p("SELECT DELETE")
SIUD = _p("SELECT INSERT UPDATE DELETE")

# The tables of qo_ops.db.schema, plus Alembic's version table (which the migrations create).
PLATFORM_TABLE_NAMES = tuple(t.name for t in PLATFORM_TABLES)
BUSINESS_TABLE_NAMES = tuple(t.name for t in BUSINESS_TABLES)
TABLE_NAMES = (*PLATFORM_TABLE_NAMES, *BUSINESS_TABLE_NAMES, VERSION_TABLE, SERVES_TABLE)

# Why each write: ``SELECT … FOR UPDATE`` (the runner's batch selection, archive and
# cleanup locks) needs UPDATE on the locked table, which is why the runner may UPDATE
# catalog_item, temp_file and audit_record although no job runs an UPDATE on them.
EXPECTED: Matrix = {
    RUNNER: {
        "job_lease": SIU,  # acquire (upsert), heartbeat, release (expire): never deleted
        "job_run": SIUD,  # create, adopt, count, finish, reap, cancel; run_history_retention
        "job_checkpoint": SIUD,  # cursor saved per batch, forgotten after a full rescan, pruned
        "outbox_event": SIU,  # events written with the transition; relay claims/records
        "job_audit": SI,  # append only
        "api_token": NONE,
        "api_idempotency": NONE,
        "job_control": SIUD,  # every run reads it; `qo-ops suspend/resume` writes it
        "downstream_breaker": SIU,  # the item jobs read it and add their evidence
        "downstream_refund": SID,  # an opening owes attempts; the item's claim takes them
        "downstream_rate_limit": SIU,  # every calling run takes its tokens from it
        "run_approval": S,  # a destructive execute's cited approval is read, never granted
        "job_schedule_tick": SIUD,  # the schedules record their ticks and prune old ones
        "job_run_queue": SIU,  # run_queue_sensor upserts one row per job
        "tenant": S,
        "price_book": S,
        "quote": SU,  # quote_expiration
        "quote_line": S,
        "pricing_snapshot": SIU,  # pricing_snapshot_recalculation upserts
        "customer_order": SU,  # order_reconciliation adopts/flags; read_model_repair locks
        "downstream_order": NONE,  # the fulfilment system's store: no job reads it
        "order_read_model": SIU,  # read_model_repair upserts
        "delivery_attempt_item": SU,  # delivery_retry, re-submit, requeue
        "notification": SU,  # notification_publish marks SENT
        "checkout_session": SU,  # abandoned_checkout_close
        "temp_file": SUD,  # temp_file_cleanup locks and deletes
        "audit_record": SIUD,  # audit_archive locks and deletes; `archive restore` inserts
        "audit_archive_manifest": SIUD,  # written, verified/failed, stale ones retired
        "catalog_item": SU,  # catalog_cache_refresh locks the items it refreshes
        "catalog_cache": SIU,  # catalog_cache_refresh upserts
        "reconciliation_result": SI,
        "order_resubmission": SI,  # order_reconciliation appends one row per re-submission
        "temp_file_tombstone": SIUD,  # intents written, completed, dropped
        VERSION_TABLE: S,  # every command checks the schema revision
        SERVES_TABLE: S,  # and the oldest code revision it serves
        "schema_migration": S,  # upgrades are recorded by the migrating owner only
    },
    API: {
        "job_lease": SIU,  # a recovery action takes its scope's lease and gives it back
        "job_run": SIU,  # accept, approve, cancel, link the Dagster run; never delete
        "job_checkpoint": SD,  # read; a checkpoint reset deletes
        "outbox_event": SIU,  # notification_publish's backlog; requeue; a decision's event
        "job_audit": SI,
        "api_token": S,  # bearer token check
        "api_idempotency": SID,  # keys kept, expired ones deleted
        "job_control": SIUD,  # approvers suspend and resume
        "downstream_breaker": S,  # the exporter's breaker gauges
        "downstream_refund": S,
        "downstream_rate_limit": S,
        "run_approval": SIU,  # an approver grants (POST /internal/jobs/{job}/approvals) and revokes
        "job_schedule_tick": S,
        "job_run_queue": S,
        **dict.fromkeys(BUSINESS_TABLE_NAMES, S),  # backlog counts run job selections
        # the recovery actions (migration 0014): what qo-ops requeue, review resolve write
        "delivery_attempt_item": SU,
        "customer_order": SU,
        "order_resubmission": SI,
        VERSION_TABLE: S,
        SERVES_TABLE: S,
        "schema_migration": S,  # qo-ops db status
    },
    READONLY: {
        **dict.fromkeys(PLATFORM_TABLE_NAMES, S),
        "api_token": NONE,  # secret hashes
        "api_idempotency": NONE,
        **dict.fromkeys(BUSINESS_TABLE_NAMES, S),
        VERSION_TABLE: S,
        SERVES_TABLE: S,
    },
}

# Sequences of the identity columns each role inserts into (USAGE).
EXPECTED_SEQUENCES: dict[str, frozenset[str]] = {
    RUNNER: frozenset(
        {
            "job_audit_id_seq",
            "pricing_snapshot_id_seq",
            "reconciliation_result_id_seq",
            "temp_file_tombstone_id_seq",
        }
    ),
    API: frozenset({"job_audit_id_seq"}),
    READONLY: frozenset(),
}

_TABLE_MATRIX = sa.text(
    """
    SELECT r.rolname AS role, c.relname AS table_name, p.privilege,
           CASE WHEN p.privilege IN ('SELECT', 'INSERT', 'UPDATE', 'REFERENCES')
                -- a column grant counts too: true when the table or any column has it
                THEN has_any_column_privilege(r.oid, c.oid, p.privilege)
                ELSE has_table_privilege(r.oid, c.oid, p.privilege) END AS granted
      FROM pg_roles r
      CROSS JOIN pg_class c
      JOIN pg_namespace n ON n.oid = c.relnamespace
      CROSS JOIN unnest(CAST(:privileges AS text[])) AS p(privilege)
     WHERE r.rolname = ANY(CAST(:roles AS text[]))
       AND n.nspname = 'public' AND c.relkind IN ('r', 'p', 'v', 'm', 'f')
    """
)

_SEQUENCE_USAGE = sa.text(
    """
    SELECT r.rolname AS role, c.relname AS sequence_name
      FROM pg_roles r
      CROSS JOIN pg_class c
      JOIN pg_namespace n ON n.oid = c.relnamespace
     WHERE r.rolname = ANY(CAST(:roles AS text[]))
       AND n.nspname = 'public' AND c.relkind = 'S'
       AND (has_sequence_privilege(r.oid, c.oid, 'USAGE')
            OR has_sequence_privilege(r.oid, c.oid, 'SELECT')
            OR has_sequence_privilege(r.oid, c.oid, 'UPDATE'))
    """
)


def _existing(conn: Connection, roles: Iterable[str]) -> list[str]:
    wanted = list(roles)
    found = set(
        conn.execute(
            sa.text("SELECT rolname FROM pg_roles WHERE rolname = ANY(CAST(:r AS text[]))"),
            {"r": wanted},
        ).scalars()
    )
    missing = [r for r in wanted if r not in found]
    if missing:
        raise LookupError(f"no such database role: {', '.join(missing)}")
    return wanted


def privilege_matrix(conn: Connection, roles: Iterable[str] = ROLES) -> Matrix:
    """What the database grants: role → table of schema public → the table privileges
    (``TABLE_PRIVILEGES``) the role holds, directly, through a role it belongs to, or
    through PUBLIC. Every table is present, with an empty set when nothing is granted."""
    names = _existing(conn, roles)
    matrix: dict[str, dict[str, set[str]]] = {role: {} for role in names}
    rows = conn.execute(_TABLE_MATRIX, {"roles": names, "privileges": list(TABLE_PRIVILEGES)})
    for row in rows:
        held = matrix[row.role].setdefault(row.table_name, set())
        if row.granted:
            held.add(row.privilege)
    return {
        role: {table: frozenset(held) for table, held in tables.items()}
        for role, tables in matrix.items()
    }


def sequence_privileges(
    conn: Connection, roles: Iterable[str] = ROLES
) -> dict[str, frozenset[str]]:
    """The sequences of schema public each role may use (USAGE, SELECT or UPDATE)."""
    names = _existing(conn, roles)
    found: dict[str, set[str]] = {role: set() for role in names}
    for row in conn.execute(_SEQUENCE_USAGE, {"roles": names}):
        found[row.role].add(row.sequence_name)
    return {role: frozenset(seqs) for role, seqs in found.items()}


def differences(expected: Matrix, actual: Mapping[str, Mapping[str, frozenset[str]]]) -> list[str]:
    """One line per (role, table) whose privileges differ: ``role table: +extra -missing``."""
    lines = []
    for role in sorted(set(expected) | set(actual)):
        want, have = expected.get(role, {}), actual.get(role, {})
        for table in sorted(set(want) | set(have)):
            w, h = want.get(table), have.get(table)
            if w is None or h is None:
                lines.append(
                    f"{role} {table}: {'unknown to roles.py' if w is None else 'no such table'}"
                )
            elif w != h:
                extra, missing = sorted(h - w), sorted(w - h)
                lines.append(
                    f"{role} {table}: "
                    + " ".join([*(f"+{p}" for p in extra), *(f"-{p}" for p in missing)])
                )
    return lines
