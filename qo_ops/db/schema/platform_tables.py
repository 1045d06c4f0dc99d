"""The platform's own tables: run records, leases, checkpoints, the kill switch, the
downstream's circuit breakers, the outbox, the audit trail and the operator API's tokens and
idempotency keys."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB, UUID

from qo_ops.db.schema.base import NOW, TS, metadata, status_check
from qo_ops.platform.job.statuses import RunStatus

# job_run.status's check constraint (a status added here needs a migration: test_migrations)
JOB_RUN_STATUSES = tuple(s.value for s in RunStatus)
RUN_MODES = ("dry_run", "execute")
TRIGGER_TYPES = ("schedule", "sensor", "manual", "backfill", "retry", "api")
# How a schema upgrade ended (schema_migration.outcome): not a run's status
UPGRADE_OUTCOMES = ("ok", "failed", "refused")

# One row per (job, scope): whoever holds an unexpired lease may write for that scope.
job_lease = sa.Table(
    "job_lease",
    metadata,
    sa.Column("job_name", sa.Text, primary_key=True),
    sa.Column("scope", sa.Text, primary_key=True),
    sa.Column("owner_id", sa.Text, nullable=False),
    sa.Column("lease_token", sa.Text, nullable=False),
    sa.Column("fencing_token", sa.BigInteger, nullable=False),
    sa.Column("acquired_at", TS, nullable=False),
    sa.Column("heartbeat_at", TS, nullable=False),
    sa.Column("expires_at", TS, nullable=False),
    sa.Column("job_run_id", UUID(as_uuid=True)),
)

job_run = sa.Table(
    "job_run",
    metadata,
    sa.Column("id", UUID(as_uuid=True), primary_key=True),
    sa.Column("job_name", sa.Text, nullable=False),
    sa.Column("scope", sa.Text, nullable=False),
    sa.Column("window_start", sa.Date),
    sa.Column("window_end", sa.Date),
    sa.Column("mode", sa.Text, nullable=False),
    sa.Column("trigger_type", sa.Text, nullable=False),
    sa.Column("requester", sa.Text),
    sa.Column("reason", sa.Text),
    sa.Column("correlation_id", sa.Text),
    sa.Column("scheduled_for", TS),
    sa.Column("dagster_run_id", sa.Text),
    sa.Column("owner_id", sa.Text, nullable=False),
    sa.Column("fencing_token", sa.BigInteger),
    sa.Column("options", JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
    sa.Column("created_at", TS, nullable=False, server_default=NOW),
    sa.Column("started_at", TS, nullable=False, server_default=NOW),
    sa.Column("heartbeat_at", TS, nullable=False, server_default=NOW),
    sa.Column("finished_at", TS),
    sa.Column("status", sa.Text, nullable=False),
    sa.Column("status_reason", sa.Text),
    sa.Column("cancel_requested_at", TS),
    sa.Column("eligible_count", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("processed_count", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("succeeded_count", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("failed_count", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("skipped_count", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("retry_scheduled_count", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("deadlettered_count", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column(
        "tally", JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")
    ),  # job-specific counts
    sa.Column("last_error_code", sa.Text),
    sa.Column("last_error_text", sa.Text),
    sa.Column("duplicates_prevented_count", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("approved_by", sa.Text),  # the second identity that released a held run
    sa.Column("approved_at", TS),
    # when the run was asked for: the Dagster run's creation, the API's acceptance (0012)
    sa.Column("requested_at", TS),
    sa.Column("lock_wait_ms", sa.Integer),  # how long taking the lease took (execute runs)
    # which of its trigger's retries this run is (0: the first attempt), of retries_max
    sa.Column("retry_number", sa.Integer, nullable=False, server_default="0"),
    sa.Column("retries_max", sa.Integer),
    # the run's liveness (0016): the session advisory lock its process holds while it runs,
    # and when it took it (database clock). A lock gone while the server that granted it is
    # still up means the process is gone (qo_ops/platform/run/liveness.py); NULL: not known
    sa.Column("liveness_key", sa.BigInteger),
    sa.Column("liveness_since", TS),
    sa.Column("approval_id", sa.Text),  # the approval a destructive execute cited (0017)
    # the code that ran it (0018): its package version and the schema revision it was built
    # for; NULL: a release before 0018. A contract step waits for older code's runs.
    sa.Column("code_version", sa.Text),
    sa.Column("code_revision", sa.Text),
    status_check("status", JOB_RUN_STATUSES),
    status_check("mode", RUN_MODES),
    status_check("trigger_type", TRIGGER_TYPES),
    sa.Index("ix_job_run_history", "job_name", "scope", sa.text("started_at DESC")),
    sa.Index("ix_job_run_running", "job_name", postgresql_where=sa.text("status = 'running'")),
    # the metrics exporter reads what started and finished since its last scrape
    sa.Index("ix_job_run_created", "created_at"),
    sa.Index("ix_job_run_job_started", "job_name", sa.text("started_at DESC")),
    sa.Index(
        "ix_job_run_finished", "finished_at", postgresql_where=sa.text("finished_at IS NOT NULL")
    ),
    sa.Index(
        "ix_job_run_job_finished",
        "job_name",
        sa.text("finished_at DESC"),
        postgresql_where=sa.text("finished_at IS NOT NULL"),
    ),
    # the exporter's missed-run judgement starts at a job's first scheduled run
    sa.Index(
        "ix_job_run_scheduled",
        "job_name",
        "scheduled_for",
        postgresql_where=sa.text("scheduled_for IS NOT NULL"),
    ),
    # an earlier Dagster execute of a job with the same reason (qo_ops/platform/run/consent.py)
    sa.Index(
        "ix_job_run_dagster_reason",
        "job_name",
        sa.text(r"btrim(regexp_replace(lower(reason), '\s+', ' ', 'g'))"),
        postgresql_where=sa.text(
            "mode = 'execute' AND reason IS NOT NULL AND dagster_run_id IS NOT NULL"
        ),
    ),
    sa.Index(
        "ix_job_run_active",
        "job_name",
        "scope",
        postgresql_where=sa.text("status IN ('awaiting_approval', 'accepted', 'running')"),
    ),
    # run_history_retention: a tenant's runs (scope T or T/<window>) by finished_at; not
    # partial, so that ANALYZE keeps statistics on the expression (the planner then knows
    # how many runs a tenant has and walks the index in order)
    sa.Index("ix_job_run_retention", sa.text("split_part(scope, '/', 1)"), "finished_at"),
)

# The resume point of a (job, scope); written in the transaction of the batch it follows.
job_checkpoint = sa.Table(
    "job_checkpoint",
    metadata,
    sa.Column("job_name", sa.Text, primary_key=True),
    sa.Column("scope", sa.Text, primary_key=True),
    sa.Column("cursor", JSONB, nullable=False),
    sa.Column("updated_at", TS, nullable=False, server_default=NOW),
    sa.Column("job_run_id", UUID(as_uuid=True)),
    # run_history_retention: a tenant's checkpoints, least recently written first
    sa.Index("ix_job_checkpoint_retention", sa.text("split_part(scope, '/', 1)"), "updated_at"),
)

# The kill switch: a row suspends a job for one tenant, or (tenant_id '') for every scope.
# Resuming deletes the row; who suspended and resumed what, when and why is in job_audit.
job_control = sa.Table(
    "job_control",
    metadata,
    sa.Column("job_name", sa.Text, primary_key=True),
    sa.Column("tenant_id", sa.Text, primary_key=True, server_default=""),  # '' = every scope
    sa.Column("suspended_by", sa.Text, nullable=False),
    sa.Column("reason", sa.Text, nullable=False),
    sa.Column("suspended_at", TS, nullable=False, server_default=NOW),
    sa.CheckConstraint("length(btrim(reason)) > 0", name="reason_given"),
)

# The downstream's circuit breaker (migration 0011): one row per downstream origin
# (scheme://host:port, never credentials), shared by every run that calls it, with the
# evidence it is judged on (0016): the recent calls' outcomes in start order, added to by
# every run's batches. When the evidence says down it is ``open`` until ``probe_after`` (the
# database's clock + the open time); the next run after that probes with a few calls
# (``half_open``) and writes ``closed`` when they answer. See qo_ops/platform/calls/breaker.py.
downstream_breaker = sa.Table(
    "downstream_breaker",
    metadata,
    sa.Column("downstream", sa.Text, primary_key=True),
    sa.Column("state", sa.Text, nullable=False),
    sa.Column("opened_at", TS),  # when the outage began (kept while failed probes reopen it)
    sa.Column("probe_after", TS),  # an open breaker is probed from then on
    sa.Column("reason", sa.Text),  # why it last changed: a short code, e.g. connect_error 7/10
    sa.Column("opened_count", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("changed_at", TS, nullable=False, server_default=NOW),
    sa.Column("changed_by_run", UUID(as_uuid=True)),
    # the evidence: F (failed) / S (answered) per call, oldest first, the last 50 at most
    sa.Column("recent", sa.Text, nullable=False, server_default=""),
    sa.Column("recent_at", TS),  # when a batch last added to it (older than 15 min: forgotten)
    # the failures in the evidence that used an attempt: owed back if it opens
    sa.Column("spent", JSONB, nullable=False, server_default=sa.text("'[]'::jsonb")),
    sa.CheckConstraint("state IN ('closed', 'open', 'half_open')", name="state_known"),
)

# The fleet's rate limit per downstream origin (0019, qo_ops/platform/calls/ratelimit.py): a
# token bucket every run, process and pod takes its calls' tokens from, counted by the
# database clock, and the pause a 429's Retry-After asked of all of them.
downstream_rate_limit = sa.Table(
    "downstream_rate_limit",
    metadata,
    sa.Column("downstream", sa.Text, primary_key=True),  # scheme://host:port, never credentials
    sa.Column("tokens", sa.Double, nullable=False),  # held when last counted
    sa.Column("counted_at", TS, nullable=False),  # the database's clock at that count
    sa.Column("paused_until", TS),  # no run calls the origin before then
    sa.CheckConstraint("tokens >= 0", name="tokens_not_negative"),
)

# Attempts owed back to items after an outage (0016): when the breaker opens, each item
# whose systemic failures were in its evidence gets a row; the item's job takes and gives
# them back in the tenant's next claim, before it claims anything.
downstream_refund = sa.Table(
    "downstream_refund",
    metadata,
    sa.Column("side_effect", sa.Text, primary_key=True),  # the job's: submit_delivery, …
    sa.Column("tenant_id", sa.Text, primary_key=True),  # the claim takes its tenant's
    sa.Column("item_id", UUID(as_uuid=True), primary_key=True),
    sa.Column("attempt", sa.BigInteger, nullable=False),  # given back only while still at it
    sa.Column("refund", sa.BigInteger, nullable=False),  # how many attempts
    sa.Column("revive", sa.Boolean, nullable=False),  # dead-lettered by the outage: back to due
    sa.Column("owed_at", TS, nullable=False, server_default=NOW),
)

# Approvals a destructive execute cites (0017, qo_ops/platform/actions/approvals.py): granted by an
# approver for one job over some tenants (NULL: every tenant), until expires_at or revoked.
run_approval = sa.Table(
    "run_approval",
    metadata,
    sa.Column("id", sa.Text, primary_key=True),  # apr-…: short enough to type in a form
    sa.Column("job_name", sa.Text, nullable=False),
    sa.Column("tenants", sa.ARRAY(sa.Text)),
    sa.Column("reason", sa.Text, nullable=False),
    sa.Column("granted_by", sa.Text, nullable=False),
    sa.Column("granted_at", TS, nullable=False, server_default=NOW),
    sa.Column("expires_at", TS, nullable=False),
    sa.Column("revoked_at", TS),
    sa.Column("revoked_by", sa.Text),
)

# Events written in the business transaction, published later by the relay.
outbox_event = sa.Table(
    "outbox_event",
    metadata,
    sa.Column("id", UUID(as_uuid=True), primary_key=True),
    sa.Column("business_key", sa.Text, nullable=False, unique=True),
    sa.Column("tenant_id", sa.Text, nullable=False),
    sa.Column("aggregate_type", sa.Text, nullable=False),
    sa.Column("aggregate_id", sa.Text, nullable=False),
    sa.Column("event_type", sa.Text, nullable=False),
    sa.Column("payload", JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
    sa.Column("created_at", TS, nullable=False, server_default=NOW),
    sa.Column("available_at", TS, nullable=False, server_default=NOW),
    sa.Column("published_at", TS),
    sa.Column("publish_attempts", sa.Integer, nullable=False, server_default="0"),
    sa.Column("last_error_code", sa.Text),
    sa.Column("dead_lettered_at", TS),  # poison or out of attempts: never published
    # notification_publish: a tenant's due, unpublished events, oldest first
    sa.Index(
        "ix_outbox_event_unpublished",
        "tenant_id",
        "available_at",
        "id",
        postgresql_where=sa.text("published_at IS NULL AND dead_lettered_at IS NULL"),
    ),
    sa.Index("ix_outbox_event_aggregate", "aggregate_type", "aggregate_id"),
    sa.Index(
        "ix_outbox_event_dead",
        "dead_lettered_at",
        postgresql_where=sa.text("dead_lettered_at IS NOT NULL"),
    ),
)

# Append-only record of every manual action; the database refuses UPDATE/DELETE/TRUNCATE.
job_audit = sa.Table(
    "job_audit",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    sa.Column("occurred_at", TS, nullable=False, server_default=NOW),
    sa.Column("actor", sa.Text, nullable=False),
    sa.Column("action", sa.Text, nullable=False),
    sa.Column("job_name", sa.Text),
    sa.Column("scope", sa.Text),
    sa.Column("mode", sa.Text),
    sa.Column("reason", sa.Text),
    sa.Column("correlation_id", sa.Text),
    sa.Column("decision", sa.Text, nullable=False),
    sa.Column("job_run_id", UUID(as_uuid=True)),
    sa.Column("details", JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
    sa.Column("request_id", sa.Text),  # the API request this decision answered
    sa.Column("client_address", sa.Text),
    sa.Index("ix_job_audit_job", "job_name", "occurred_at"),
    sa.Index("ix_job_audit_actor", "actor", "occurred_at"),
)

API_ROLES = ("viewer", "operator", "approver")

# Bearer tokens of the operator API: only a SHA-256 of the secret part is stored. The token
# a client holds is ``qoops_<id>_<secret>``; ``id`` finds the row, the secret proves it.
api_token = sa.Table(
    "api_token",
    metadata,
    sa.Column("id", sa.Text, primary_key=True),
    sa.Column("identity", sa.Text, nullable=False),
    sa.Column("roles", sa.ARRAY(sa.Text), nullable=False),
    sa.Column("tenant_id", sa.Text),  # NULL: every tenant
    sa.Column("secret_sha256", sa.Text, nullable=False),
    sa.Column("created_at", TS, nullable=False, server_default=NOW),
    sa.Column("created_by", sa.Text, nullable=False),
    sa.Column("expires_at", TS, nullable=False),
    sa.Column("revoked_at", TS),
    sa.CheckConstraint("id ~ '^[0-9a-f]{16}$'", name="id_format"),
    sa.CheckConstraint("secret_sha256 ~ '^[0-9a-f]{64}$'", name="secret_sha256_format"),
    sa.CheckConstraint(
        "cardinality(roles) > 0 AND roles <@ ARRAY['viewer', 'operator', 'approver']::text[]",
        name="roles_known",
    ),
    sa.Index("ix_api_token_identity", "identity"),
)

# Idempotent submission: one (identity, Idempotency-Key) names one run, for a day at least.
api_idempotency = sa.Table(
    "api_idempotency",
    metadata,
    sa.Column("identity", sa.Text, primary_key=True),
    sa.Column("idempotency_key", sa.Text, primary_key=True),
    sa.Column("request_sha256", sa.Text, nullable=False),
    sa.Column("job_run_id", UUID(as_uuid=True), nullable=False),
    sa.Column("created_at", TS, nullable=False, server_default=NOW),
    sa.Index("ix_api_idempotency_created", "created_at"),
)

# What a job's schedule decided at a tick (migration 0015), so that a missed run says why
# (qo_ops/platform/schedule/missed.py): ``evaluated`` (no tenants) records that the tick was
# evaluated at all; ``previous_run_queued`` and ``previous_run_active`` name the tenants it
# asked nothing for because a run of their scope was still queued or running in Dagster.
# A row per (job, tick, decision); the schedule prunes its rows older than two days.
TICK_DECISIONS = ("evaluated", "previous_run_queued", "previous_run_active")
job_schedule_tick = sa.Table(
    "job_schedule_tick",
    metadata,
    sa.Column("job_name", sa.Text, primary_key=True),
    sa.Column("scheduled_for", TS, primary_key=True),
    sa.Column("decision", sa.Text, primary_key=True),
    sa.Column("tenants", sa.ARRAY(sa.Text), nullable=False, server_default="{}"),
    sa.Column("recorded_at", TS, nullable=False, server_default=NOW),
    status_check("decision", TICK_DECISIONS),
)

# Dagster's run queue per job, as the run_queue_sensor last sampled it from the instance's
# run storage (migration 0015): the exporter's job_run_queue_depth and _oldest_seconds.
job_run_queue = sa.Table(
    "job_run_queue",
    metadata,
    sa.Column("job_name", sa.Text, primary_key=True),
    sa.Column("depth", sa.Integer, nullable=False),
    sa.Column("oldest_queued_at", TS),
    sa.Column("sampled_at", TS, nullable=False, server_default=NOW),
)

# Every `qo-ops db upgrade` that changed something or failed (migration 0018): who, why,
# from → to, how long, the lock timeouts it met, and its outcome (qo_ops/db/migrate.py).
schema_migration = sa.Table(
    "schema_migration",
    metadata,
    sa.Column("id", UUID(as_uuid=True), primary_key=True),
    sa.Column("started_at", TS, nullable=False, server_default=NOW),
    sa.Column("from_revision", sa.Text),
    sa.Column("to_revision", sa.Text),
    sa.Column("applied", sa.ARRAY(sa.Text), nullable=False, server_default="{}"),
    sa.Column("contract", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Column("requested_by", sa.Text),
    sa.Column("reason", sa.Text),
    sa.Column("outcome", sa.Text, nullable=False),
    sa.Column("error", sa.Text),
    sa.Column("lock_timeouts", sa.Integer, nullable=False, server_default="0"),
    sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
    sa.Column("duration_ms", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("code_version", sa.Text),
    status_check("outcome", UPGRADE_OUTCOMES),
)

PLATFORM_TABLES = (
    job_lease,
    job_run,
    job_checkpoint,
    outbox_event,
    job_audit,
    api_token,
    api_idempotency,
    job_control,
    downstream_breaker,
    downstream_refund,
    downstream_rate_limit,
    run_approval,
    job_schedule_tick,
    job_run_queue,
    schema_migration,
)
