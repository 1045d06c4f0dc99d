"""Least-privilege database roles: one NOLOGIN group role per kind of process, granted in
this database exactly what that process does (``docs/security.md``).

- ``qo_ops_runner``: ``qo-ops run`` and the other job commands, the Dagster code location
  (run workers, sensors). Platform tables as the runtime writes them, ``job_audit`` append
  only, on business tables what the ten jobs do — nothing of ``api_token``/``api_idempotency``.
- ``qo_ops_api``: the operator HTTP API. Creates and updates ``job_run`` rows, appends to
  ``job_audit``, reads tokens, keeps idempotency keys, reads everything its status and
  backlog counts read; writes no business table.
- ``qo_ops_readonly``: the metrics exporter and dashboards. SELECT on every table except
  ``api_token`` (secret hashes) and ``api_idempotency``.

The roles are cluster-wide: each is created only if it does not exist yet (a DBA may have
created them beforehand; then the migrating user needs no CREATEROLE). Everything else is
granted in the current database only. No role may create objects: CREATE on schema public
and TEMPORARY/CONNECT on the database are taken from PUBLIC, CONNECT given to the three.

Row locks count as writes to PostgreSQL: ``SELECT … FOR UPDATE/SHARE`` needs UPDATE on the
locked table, so the runner holds UPDATE on ``catalog_item``, ``temp_file`` and
``audit_record``, which its jobs lock but never update. ``qo_ops_alembic_version`` is
readable by all three: every command checks the schema revision before it starts.

This is frozen history: the grants are written out here and never derived from code that
may change later (``qo_ops/db/roles.py`` states the same matrix for the tests).

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

_ROLES = "qo_ops_runner, qo_ops_api, qo_ops_readonly"

_BUSINESS_TABLES = (
    "tenant, price_book, quote, quote_line, pricing_snapshot, customer_order, "
    "downstream_order, order_read_model, delivery_attempt_item, notification, "
    "checkout_session, temp_file, audit_record, audit_archive_manifest, catalog_item, "
    "catalog_cache, reconciliation_result, temp_file_tombstone"
)

_GRANTS = (
    # ---------------------------------------------------------------- qo_ops_runner
    # the run record, the lease, the outbox: inserted and updated, never deleted
    "GRANT SELECT, INSERT, UPDATE ON job_lease, job_run, outbox_event TO qo_ops_runner",
    # a reconciliation forgets its checkpoint once it went through its window
    "GRANT SELECT, INSERT, UPDATE, DELETE ON job_checkpoint TO qo_ops_runner",
    "GRANT SELECT, INSERT ON job_audit TO qo_ops_runner",
    "GRANT SELECT ON tenant, price_book, quote_line TO qo_ops_runner",
    # quote_expiration, abandoned_checkout_close, notification_publish, delivery_retry and
    # order_reconciliation (adopt status, flag, re-submit; read_model_repair locks orders)
    "GRANT SELECT, UPDATE ON quote, checkout_session, notification, delivery_attempt_item, "
    "customer_order TO qo_ops_runner",
    # catalog_cache_refresh locks the items it refreshes (FOR UPDATE needs UPDATE)
    "GRANT SELECT, UPDATE ON catalog_item TO qo_ops_runner",
    # upserts: pricing_snapshot_recalculation, read_model_repair, catalog_cache_refresh
    "GRANT SELECT, INSERT, UPDATE ON pricing_snapshot, order_read_model, catalog_cache "
    "TO qo_ops_runner",
    "GRANT SELECT, INSERT ON reconciliation_result TO qo_ops_runner",
    # temp_file_cleanup: locks, then deletes files; intents are written, completed, dropped
    "GRANT SELECT, UPDATE, DELETE ON temp_file TO qo_ops_runner",
    "GRANT SELECT, INSERT, UPDATE, DELETE ON temp_file_tombstone TO qo_ops_runner",
    # audit_archive: locks and deletes archived records (restore inserts them back), writes,
    # verifies and retires manifests
    "GRANT SELECT, INSERT, UPDATE, DELETE ON audit_record, audit_archive_manifest TO qo_ops_runner",
    "GRANT SELECT ON qo_ops_alembic_version TO qo_ops_runner",
    "GRANT USAGE ON SEQUENCE job_audit_id_seq, pricing_snapshot_id_seq, "
    "reconciliation_result_id_seq, temp_file_tombstone_id_seq TO qo_ops_runner",
    # ---------------------------------------------------------------- qo_ops_api
    # accepts runs, cancels, approves, links the Dagster run; never deletes one
    "GRANT SELECT, INSERT, UPDATE ON job_run TO qo_ops_api",
    "GRANT SELECT, INSERT ON job_audit TO qo_ops_api",
    "GRANT SELECT ON api_token TO qo_ops_api",
    # expired idempotency keys are deleted by the API itself
    "GRANT SELECT, INSERT, DELETE ON api_idempotency TO qo_ops_api",
    # status: leases, checkpoints, and each job's selection (notification_publish's reads
    # the outbox) to count the backlog
    "GRANT SELECT ON job_lease, job_checkpoint, outbox_event TO qo_ops_api",
    f"GRANT SELECT ON {_BUSINESS_TABLES} TO qo_ops_api",
    "GRANT SELECT ON qo_ops_alembic_version TO qo_ops_api",
    "GRANT USAGE ON SEQUENCE job_audit_id_seq TO qo_ops_api",
    # ---------------------------------------------------------------- qo_ops_readonly
    "GRANT SELECT ON job_lease, job_run, job_checkpoint, outbox_event, job_audit "
    "TO qo_ops_readonly",
    f"GRANT SELECT ON {_BUSINESS_TABLES} TO qo_ops_readonly",
    "GRANT SELECT ON qo_ops_alembic_version TO qo_ops_readonly",
)


def upgrade() -> None:
    # Cluster-wide: another database of the cluster may have created them already, or a
    # migration of another database may be creating them right now.
    op.execute(
        """
        DO $$
        DECLARE
            name text;
        BEGIN
            FOREACH name IN ARRAY ARRAY['qo_ops_runner', 'qo_ops_api', 'qo_ops_readonly'] LOOP
                IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = name) THEN
                    BEGIN
                        EXECUTE format(
                            'CREATE ROLE %I NOLOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE '
                            'NOREPLICATION NOBYPASSRLS', name);
                    EXCEPTION WHEN duplicate_object OR unique_violation THEN
                        NULL;  -- created concurrently from another database
                    END;
                END IF;
            END LOOP;
        END $$
        """
    )
    # Nobody but the owner creates objects here, nor connects unless granted.
    op.execute("REVOKE CREATE ON SCHEMA public FROM PUBLIC")
    op.execute(
        f"""
        DO $$
        BEGIN
            EXECUTE format('REVOKE CONNECT, TEMPORARY ON DATABASE %I FROM PUBLIC',
                           current_database());
            EXECUTE format('GRANT CONNECT ON DATABASE %I TO {_ROLES}', current_database());
        END $$
        """
    )
    op.execute(f"GRANT USAGE ON SCHEMA public TO {_ROLES}")
    # Exactly the grants below, whatever the roles held here before.
    op.execute(f"REVOKE ALL ON ALL TABLES IN SCHEMA public FROM {_ROLES}")
    op.execute(f"REVOKE ALL ON ALL SEQUENCES IN SCHEMA public FROM {_ROLES}")
    for grant in _GRANTS:
        op.execute(grant)


def downgrade() -> None:
    # The roles themselves stay: they are cluster-wide and other databases of the cluster
    # may use them. Everything they were granted in this database goes.
    op.execute(
        """
        DO $$
        DECLARE
            name text;
        BEGIN
            FOREACH name IN ARRAY ARRAY['qo_ops_runner', 'qo_ops_api', 'qo_ops_readonly'] LOOP
                CONTINUE WHEN NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = name);
                EXECUTE format('REVOKE ALL ON ALL TABLES IN SCHEMA public FROM %I', name);
                EXECUTE format('REVOKE ALL ON ALL SEQUENCES IN SCHEMA public FROM %I', name);
                EXECUTE format('REVOKE ALL ON SCHEMA public FROM %I', name);
                EXECUTE format('REVOKE ALL ON DATABASE %I FROM %I', current_database(), name);
            END LOOP;
            -- PostgreSQL's defaults for a database, as they were before this revision.
            -- CREATE on schema public is not given back: PostgreSQL 15+ does not give it either.
            EXECUTE format('GRANT CONNECT, TEMPORARY ON DATABASE %I TO PUBLIC', current_database());
        END $$
        """
    )
