"""The one runner every trigger calls: ``run_job(spec, scope, options) -> RunSummary``.

    reap orphans -> lease -> bounded batches (guard, select, transition, checkpoint,
    counters: one transaction each) -> final status -> outcome check -> release

A run stops between batches in three cases. Its deadline passes (``timeout``). It is asked
to stop by a flag on its job_run row or by SIGTERM/SIGINT (``cancelled``). Its lease is gone
(``failed``/``lease_lost``). Whatever committed stays, and a rerun carries on from there.

One run is one :class:`JobRun`, which ``run_job`` makes. Its ``run`` method reads top to
bottom in the order the run goes, and each step is a method of its own.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum
from typing import Any

from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError

from qo_ops.db.availability import UNAVAILABLE, db_retry_s, is_unavailable, retry_while_unavailable
from qo_ops.errors import DatabaseUnavailable
from qo_ops.platform.job.counts import PROGRESS, SPAN, Counts
from qo_ops.platform.job.options import RunOptions
from qo_ops.platform.job.outcome import (
    CHECKPOINT_RESETS,
    CHECKPOINT_UPDATES,
    BatchContext,
    BatchOutcome,
    RunSummary,
)
from qo_ops.platform.job.scope import Scope
from qo_ops.platform.job.spec import ExternalPhase, JobSpec
from qo_ops.platform.job.statuses import ENDED_WELL, RunStatus
from qo_ops.platform.observability.events import METRICS, EventContext, JobMetrics
from qo_ops.platform.observability.tracing import SpanLike, span
from qo_ops.platform.run import checkpoint, records
from qo_ops.platform.run.admission import Admission
from qo_ops.platform.run.faults import crash_point, hold_point
from qo_ops.platform.run.lease import Heartbeat, Lease, LeaseLost, acquire
from qo_ops.platform.run.liveness import Liveness
from qo_ops.platform.run.overlap import overlapped_batches
from qo_ops.platform.run.pipeline import pipelined_batches
from qo_ops.platform.run.report import add_report
from qo_ops.platform.run.selection import count_eligible, select_batch, take_batch
from qo_ops.platform.run.stopping import TERMINATED, StopSignals, Terminated, stop_grace_s
from qo_ops.platform.schedule.drift import drift_reason, drift_s, drift_warn_s

# count_eligible and select_batch live in selection.py. Callers import them from here too.
__all__ = ["JobRun", "RunSummary", "count_eligible", "owner_identity", "run_job", "select_batch"]

log = logging.getLogger(__name__)

QUIET_ENDINGS = (*ENDED_WELL, RunStatus.SKIPPED)  # job.finished at INFO, the rest at WARNING


def owner_identity() -> str:
    """Who holds a lease, as host, process and a per-process nonce. It holds no secrets."""
    return f"{socket.gethostname()}:{os.getpid()}:{_PROCESS_NONCE}"


_PROCESS_NONCE = uuid.uuid4().hex[:8]


def run_job(
    spec: JobSpec,
    scope: Scope,
    options: RunOptions,
    *,
    engine: Engine,
    metrics: JobMetrics = METRICS,
) -> RunSummary:
    """Run ``spec`` over ``scope`` once, safely. The module docstring shows the shape.

    Something may happen after the run record is written: SIGTERM/SIGINT at any point, the
    database restarting, or a bug. In every case the record is finished and the lease given
    back before this returns, or before it re-raises a foreign interrupt such as Dagster's."""
    with StopSignals(stop_grace_s()) as stop:  # a signal before the record writes nothing
        return JobRun(engine, Admission(spec, scope, options), stop, metrics).run()


class _Step(Enum):
    """How a batch that recorded nothing leaves the batch loop."""

    AGAIN = "again"  # one last pass from the start of the selection
    DONE = "done"  # no more work, or the run must stop (its summary says why)


class JobRun:
    """One run of one job over one scope, from its admission to its finished record.

    It holds what the run's steps share, so each step takes only what varies (a connection,
    a batch's outcome). From the start it holds spec, options, limits, owner, stop signals
    and metrics. Once the run is recorded, it also holds the context the batches see, the
    summary and the events. Once leased, it holds the lease, its heartbeat, the deadline and
    the batch timings."""

    # once the record is written (_open)
    run_id: uuid.UUID
    ctx: BatchContext
    summary: RunSummary
    events: EventContext
    started: float  # monotonic, just before the record. The run's duration counts from it.
    # once the lease is taken (_acquire; then ``leased`` is True)
    lease: Lease
    heartbeat: Heartbeat
    deadline: float  # monotonic
    batches_started: float  # monotonic. The progress event's elapsed time counts from it.

    def __init__(
        self, engine: Engine, admission: Admission, stop: StopSignals, metrics: JobMetrics
    ) -> None:
        self.engine, self.admission, self.stop, self.metrics = engine, admission, stop, metrics
        self.spec, self.scope, self.options = admission.spec, admission.scope, admission.options
        self.limits = self.spec.defaults.overridden_by(self.options)
        self.owner = owner_identity()
        self.liveness: Liveness | None = None  # taken before the record, given back after it
        self.leased = False  # whether lease and heartbeat are set: the lease is to be given back
        self.batch_ms: list[float] = []  # batch transaction times (guard to commit)

    # ------------------------------------------------------------------ the run
    def run(self) -> RunSummary:
        """Admit the run, write its record, do the work, and end the run."""
        settings = self.admission.admit(self.engine, self.stop)  # it writes nothing before
        self._open(settings)
        with span(f"Job {self.spec.name}", **self._root_attributes()) as root:
            ended_by: BaseException | None = None
            try:
                self._work()
            except BaseException as exc:  # the record is finished whatever ended the work
                ended_by = exc
            self._end(root, ended_by)
        if ended_by is not None and not isinstance(ended_by, Terminated | Exception):
            raise ended_by  # a foreign interrupt (Dagster terminating the run) goes on
        return self.summary

    def _open(self, settings: object) -> None:
        """Write the run's ``running`` record, then make the context, summary and events."""
        spec, scope, options = self.spec, self.scope, self.options
        self.started = time.monotonic()
        with self.stop.deferred():
            self.liveness = Liveness.take(self.engine)  # before the record, never "gone" early
            owner = records.RunOwner(self.owner, self.liveness.key if self.liveness else None)
            try:
                with self.engine.begin() as conn:  # a person's run is audited with its record
                    self.run_id = records.create_run(
                        conn, spec.name, scope, options, owner, self.limits.as_dict()
                    )
                    # A person's run is audited here, unless the API accepted it (and audited it).
                    if options.person_behind and options.job_run_id is None:
                        limits = {"limits": self.limits.as_dict()}
                        self.admission.audit(conn, "allowed", self.run_id, limits)
            except BaseException:
                self._let_go()
                raise
        self.ctx = BatchContext(
            spec.name, scope, options.mode, self.run_id,
            limits=self.limits, settings=settings, stop=self.stop, engine=self.engine,
        )  # fmt: skip
        self.summary = RunSummary(
            job_run_id=str(self.run_id), job_name=spec.name, status=RunStatus.RUNNING,
            mode=options.mode, scope=scope.key, trigger=options.trigger,
            requester=options.requester,
        )  # fmt: skip
        self.events = EventContext(
            job_name=spec.name, run_id=str(self.run_id), trigger=options.trigger,
            scope=scope.tenant_id, mode=options.mode,
            window_start=scope.window_start.isoformat() if scope.window_start else None,
            window_end=scope.window_end.isoformat() if scope.window_end else None,
            progress_interval_s=options.progress_interval_s,
        )  # fmt: skip

    def _root_attributes(self) -> dict[str, Any]:
        return {
            "job.name": self.spec.name, "job.run_id": str(self.run_id),
            "job.trigger": self.options.trigger, "job.mode": self.options.mode,
            "job.scope": self.scope.key,
        }  # fmt: skip

    def _work(self) -> None:
        """Everything between the run record's creation and its end. That is the start
        events, the orphans, the work (dry run or batches), then the outcome checks."""
        self._announce()
        with self.stop.deferred():
            self._reap()  # orphans
        if self.options.mode == "dry_run" and not self.spec.batching.dry_run_scans:
            self._dry_run()
        else:
            self._execute()
        crash_point("before_finalize")
        summary = self.summary
        not_done = (
            summary.status in (RunStatus.SKIPPED, RunStatus.RUNNING)
            or summary.error_code == UNAVAILABLE
        )
        if not_done or self.stop.requested:
            return  # nothing was done, or the checks cannot run now, so nothing is checked
        self._check_outcome()

    def _announce(self) -> None:
        """Emit job.started, and job.scheduler.drift.detected when a scheduled run is late."""
        self.metrics.started.labels(self.spec.name).inc()
        late, tick = drift_s(self.options), self.options.scheduled_for
        self.events.emit(
            "job.started", scheduled_for=tick, limits=self.limits.as_dict(),
            **({"scheduler.drift_s": round(late, 3)} if late is not None else {}),
        )  # fmt: skip
        if late is not None and late > drift_warn_s():
            assert tick is not None
            reason = drift_reason(self.engine, self.spec.name, self.scope.key, self.run_id, tick)
            self.events.emit(
                "job.scheduler.drift.detected",
                logging.WARNING,
                scheduled_for=tick,
                reason=reason,
                **{"scheduler.drift_s": round(late, 3), "scheduler.drift_warn_s": drift_warn_s()},
            )

    def _reap(self) -> None:
        """Finish the records of runs whose process is gone (any job). Also finish those of
        this job's runs whose heartbeat and lease lapsed."""
        reaped = records.reap_orphans(self.engine, self.spec.name, grace_s=self.limits.lease_ttl_s)
        if ids := [str(r) for r in reaped]:
            self.events.emit("job.orphans.reaped", logging.WARNING, count=len(ids), run_ids=ids)

    def _on_beat(self) -> None:
        """At each heartbeat, in its thread, keep the liveness lock and reap. So any run still
        at work finishes a killed run's record, not only the next run to start."""
        if self.liveness is not None:
            self.liveness.keep(self.run_id)
        self._reap()

    # ------------------------------------------------------------------ the work
    def _load_checkpoint(self) -> None:
        """A checkpointed job starts (and a dry run looks) where the last run stopped."""
        if self.spec.batching.checkpoint is not None:
            self.ctx.cursor = checkpoint.load(self.engine, self.spec.name, self.scope.key)
            self.summary.checkpoint_before = checkpoint.as_text(self.ctx.cursor)

    def _dry_run(self) -> None:
        """Count and sample exactly what execute would select. Write nothing but the run row."""
        spec, ctx, summary = self.spec, self.ctx, self.summary
        self._load_checkpoint()
        with self.engine.connect() as conn:
            summary.eligible_count = count_eligible(conn, spec, ctx)
            sample = conn.execute(spec.eligible(ctx).limit(self.options.sample_size)).scalars()
            summary.sample_ids = [str(v) for v in sample]
        records.set_eligible(self.engine, self.run_id, summary.eligible_count, None)
        summary.status = RunStatus.SUCCESS if summary.eligible_count else RunStatus.NO_WORK

    def _execute(self) -> None:
        """Run the batches under the lease, which goes back, whatever happens once it is ours."""
        summary = self.summary
        try:
            lease = self._acquire()  # from here on, self.leased says whether to give it back
            if lease is None:
                return
            self.deadline = time.monotonic() + self.limits.deadline_s
            crash_point("after_lease_acquire")
            hold_point("after_lease_acquire")
            self._load_checkpoint()
            with self.engine.connect() as conn:
                summary.eligible_count = count_eligible(conn, self.spec, self.ctx)
            with self.stop.deferred():
                records.set_eligible(
                    self.engine, self.run_id, summary.eligible_count, lease.fencing_token
                )
            self._batches()
        except LeaseLost as exc:
            summary.status, summary.error_code = RunStatus.FAILED, "lease_lost"
            summary.status_reason, summary.error_text = "lease_lost", str(exc)
            self.events.emit("job.lock.lost", logging.ERROR, **{"lock.name": self._lock_name()})
        except Exception as exc:  # any failure ends the run failed, with a safe one-line reason
            if not self.leased:
                raise  # taking the lease failed: nothing to give back, the run's end records it
            self._failed(exc)
            if summary.error_code != UNAVAILABLE and not self._still_held():
                summary.error_code = summary.status_reason = "lease_lost"
        finally:  # on a signal too, the lease goes back before the run is recorded as ended
            if self.leased:
                self.heartbeat.stop()
                with self.stop.deferred():
                    self._release()
        if summary.status == RunStatus.RUNNING:
            summary.status = records.final_status(summary)

    def _lock_name(self) -> str:
        return f"{self.spec.name}:{self.scope.key}"

    def _acquire(self) -> Lease | None:
        """The scope's lease, or None. Then the summary says why (skipped, or cancelled
        while waiting)."""
        summary = self.summary
        with (
            span("lease.acquire", **{"lock.name": self._lock_name()}) as acquiring,
            self.stop.deferred(),  # taken or not, never half, because the token must reach us
        ):
            asked = time.monotonic()
            lease = acquire(
                self.engine, self.spec.name, self.scope.key, self.owner,
                self.limits.lease_ttl_s, self.run_id,
            )  # fmt: skip
            if lease is not None:  # held and beating before a signal can interrupt the run
                beat = Heartbeat(self.engine, lease, self.run_id, self._on_beat)
                self.lease, self.heartbeat, self.leased = lease, beat.start(), True
            summary.lock_wait_ms = int((time.monotonic() - asked) * 1000)
            acquiring.set_attribute("lock.acquired", lease is not None)
        hold_point("lease_taken")  # a signal here, before the batches' guard, still frees it
        if lease is None:
            if self.stop.requested:  # asked to stop while waiting for the lease
                summary.status, summary.status_reason = RunStatus.CANCELLED, TERMINATED
                return None
            self.metrics.lock_failed.labels(self.spec.name).inc()
            refused = {"lock.name": self._lock_name(), "wait_ms": summary.lock_wait_ms}
            self.events.emit("job.lock.acquire.failed", logging.WARNING, **refused)
            summary.status, summary.status_reason = RunStatus.SKIPPED, "lease-not-acquired"
            return None
        self.events.emit(
            "job.lock.acquire.succeeded",
            **{
                "lock.name": self._lock_name(),
                "lock.ttl_ms": int(lease.ttl_s * 1000),
                "lock.fencing_token": lease.fencing_token,
                "wait_ms": summary.lock_wait_ms,
            },
        )
        summary.fencing_token = lease.fencing_token
        return lease

    def _release(self) -> None:
        """Give the lease back, riding out a database restart for a bounded time. If the
        database stays away, the lease expires by itself after its TTL."""
        try:
            retry_while_unavailable(
                lambda: self.lease.release(self.engine),
                limit_s=self._db_patience(),
                what="giving the lease back",
            )
        except DBAPIError:
            return  # it expires by itself
        self.events.emit("job.lock.released", **{"lock.name": self._lock_name()})

    def _still_held(self) -> bool:
        try:
            return self.lease.still_held(self.engine)
        except DBAPIError:
            return False

    def _db_patience(self) -> float:
        """How long a write rides out a database restart. That is ``QO_OPS_DB_RETRY_S``,
        capped by what is left of the stop grace once a stop was asked."""
        if self.stop.requested:
            return min(db_retry_s(), self.stop.remaining_s())
        return db_retry_s()

    # ------------------------------------------------------------------ the batches
    def _batches(self) -> None:
        """Run the batch loop on one connection, and put the batch times on the summary."""
        try:
            with self.engine.connect() as conn:  # one connection for all of the run's batches
                self._batch_loop(conn)
        finally:
            if self.batch_ms:
                ordered, summary = sorted(self.batch_ms), self.summary
                summary.batch_ms_p50 = round(ordered[len(ordered) // 2], 2)
                summary.batch_ms_p99 = round(
                    ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))], 2
                )
                summary.batch_ms_max = round(ordered[-1], 2)

    def _batch_loop(self, conn: Connection) -> None:
        """Batch after batch, until the work is done or the run must stop."""
        self.batches_started = time.monotonic()
        then = self.spec.then
        if isinstance(then, ExternalPhase) and then.overlap:
            overlapped_batches(self, conn, then)  # claims and records while calls are in flight
            return
        if isinstance(then, ExternalPhase) and then.pipelined:  # records on a second connection
            return pipelined_batches(self, conn, then, self.engine.connect)
        while (room := self.room()) > 0:
            number = self.summary.batches + 1
            with (
                self.stop.deferred(),  # a signal waits for the batch (and its calls) to be recorded
                span(
                    "batch", **{"batch.number": number, **Counts().event_fields(SPAN)}
                ) as batch_span,
            ):
                outcome = self._batch(conn, room)
                halted = isinstance(outcome, BatchOutcome) and self.recorded(outcome, batch_span)
            if outcome is _Step.AGAIN:
                continue
            if outcome is _Step.DONE or halted:
                return
            if self.limits.throttle_ms:  # a stop signal wakes it, and the loop head ends the run
                self.stop.event.wait(self.limits.throttle_ms / 1000.0)

    def room(self) -> int:
        """How many more items this run may take. It is 0 when the run must end now, because
        of a stop, its deadline or its item limit. The summary says which."""
        summary = self.summary
        if self.heartbeat.lost.is_set():
            raise LeaseLost("heartbeat found the lease taken over or expired")
        if self.stop.requested:  # SIGTERM/SIGINT. Every batch before this one is recorded.
            summary.status, summary.status_reason = RunStatus.CANCELLED, TERMINATED
            return 0
        if time.monotonic() >= self.deadline:
            summary.status, summary.status_reason = RunStatus.TIMEOUT, "deadline reached"
            return 0
        room = self.limits.max_items - summary.counts.processed
        if room <= 0:
            summary.status_reason = "max items reached"
        return max(room, 0)

    @contextmanager
    def _transaction(self, conn: Connection) -> Iterator[str | None]:
        """One batch's transaction on the run's connection, under the lease's guard.

        The guard also cuts the transaction off if it idles past the lease's TTL. Yields why
        the run must stop (a cancel asked, the job suspended), or None."""
        with conn.begin():
            yield self.lease.guard(conn, self.run_id)

    def _batch(self, conn: Connection, room: int) -> BatchOutcome | _Step:
        """One batch: its claim (``claim``), then what follows the claim (``_second_step``)."""
        started = time.perf_counter()
        claimed = self.claim(conn, room)
        if not isinstance(claimed, BatchOutcome):
            return claimed
        outcome = claimed if claimed.ends_at_claim else self._second_step(conn, claimed)
        self.batch_ms.append((time.perf_counter() - started) * 1000)
        return outcome

    def claim(self, conn: Connection, room: int) -> BatchOutcome | _Step:
        """A batch's first transaction: guard, select and transition. For a job without a
        second step it also writes the checkpoint and counters, so the batch is recorded."""
        with self._transaction(conn) as must_stop:
            if must_stop:  # at a batch boundary, so the batches before it are all committed
                self.summary.status, self.summary.status_reason = RunStatus.CANCELLED, must_stop
                return _Step.DONE
            items = take_batch(conn, self.spec, self.ctx, min(self.limits.batch_size, room))
            if not items and self.ctx.position is not None:
                self.ctx.position = None
                if self._anything_left(conn):
                    return _Step.AGAIN  # a last pass from the start, for rows others held
            if not items:
                self._rescan_next_time(conn)
                return _Step.DONE
            crash_point("after_batch_select")
            if isinstance(items, BatchOutcome):  # one statement selected and wrote it
                outcome = items
            else:
                outcome = self.spec.transition(conn, self.ctx, items)
                outcome.processed = len(items)
            crash_point("before_commit")
            if self.spec.then is None or outcome.ends_at_claim:
                self._commit_effects(conn, outcome)
        crash_point("after_commit")
        return outcome

    def _anything_left(self, conn: Connection) -> bool:
        """Whether the last pass from the start may find anything. It may, unless the job
        counts its selection first (``Positions.count_before_last_pass``) and the count,
        held rows included, is zero."""
        positions = self.spec.batching.positions
        counts_first = positions is not None and positions.count_before_last_pass
        return not counts_first or count_eligible(conn, self.spec, self.ctx) > 0

    def _second_step(self, conn: Connection, claimed: BatchOutcome) -> BatchOutcome:
        """Do what follows the claim's commit (``JobSpec.then``).

        An external phase first calls the other system, with no transaction open and no rows
        locked. Then a second guarded transaction records the batch. For any other job the
        outcome is already recorded."""
        then = self.spec.then
        if then is None:
            return claimed
        if isinstance(then, ExternalPhase):
            results = then.call(self.ctx, claimed.work)
            crash_point("after_external_call")
        else:  # a second transaction, nothing called in between
            results = claimed.work
        return self.record(conn, claimed, results)

    def record(self, conn: Connection, claimed: BatchOutcome, results: list[Any]) -> BatchOutcome:
        """A claimed batch's second transaction, under the lease's guard: the job's record
        (or finish) of ``results``, the checkpoint and the counters."""
        then = self.spec.then
        assert then is not None
        finish = then.record if isinstance(then, ExternalPhase) else then.finish
        with self._transaction(conn):
            outcome = finish(conn, self.ctx, results)
            outcome.processed = claimed.processed  # the claim knows what was selected
            outcome.cursor = outcome.cursor or claimed.cursor  # and the position
            self._commit_effects(conn, outcome)
        return outcome

    def _commit_effects(self, conn: Connection, outcome: BatchOutcome) -> None:
        """Write the rest of a batch's transaction, the checkpoint and the run counters."""
        checkpointed = self.spec.batching.checkpoint is not None
        if checkpointed and outcome.cursor is not None and self.ctx.mode == "execute":
            with span("checkpoint.update", **{"job.name": self.spec.name}):
                checkpoint.save(conn, self.spec.name, self.scope.key, self.run_id, outcome.cursor)
            outcome.tally[CHECKPOINT_UPDATES] = outcome.tally.get(CHECKPOINT_UPDATES, 0) + 1
        records.add_counts(conn, self.run_id, outcome, outcome.tally)

    def _rescan_next_time(self, conn: Connection) -> None:
        """A job that re-checks its whole scope each run forgets its finished cursor."""
        spec, checkpointing = self.spec, self.spec.batching.checkpoint
        rescan = checkpointing is not None and checkpointing.rescan_when_complete
        if (
            rescan
            and self.ctx.mode == "execute"
            and checkpoint.forget(conn, spec.name, self.scope.key)
        ):
            records.add_counts(conn, self.run_id, Counts(), {CHECKPOINT_RESETS: 1})
            self.summary.tally[CHECKPOINT_RESETS] = 1

    def recorded(self, outcome: BatchOutcome, batch_span: SpanLike) -> bool:
        """Take a recorded batch into the run: counters, span, position, events. Return
        whether it stops the run (``_halted``)."""
        self._account(outcome)
        for name, count in outcome.event_fields(SPAN).items():
            batch_span.set_attribute(name, count)  # counts only, never ids
        self._move_on(outcome)
        self._emit_batch(outcome)
        return self._halted(outcome)

    def _account(self, outcome: BatchOutcome) -> None:
        """Add a recorded batch's counters to the summary and the metrics."""
        summary = self.summary
        summary.batches += 1
        summary.counts += outcome
        for key, value in outcome.tally.items():
            summary.tally[key] = summary.tally.get(key, 0) + value
        self.metrics.count_batch(self.spec.name, outcome)

    def _move_on(self, outcome: BatchOutcome) -> None:
        """Set where the next batch starts: the outcome's position, and a checkpointed
        job's cursor."""
        if outcome.position is not None:
            if self.spec.batching.positions is None:
                raise TypeError(f"{self.spec.name} returned a position but declares no positions")
            self.ctx.position = outcome.position
        if self.spec.batching.checkpoint is not None and outcome.cursor is not None:
            self.ctx.cursor = outcome.cursor
            self.events.emit(
                "job.checkpoint.updated",
                **{"checkpoint.updated": True, "batch_number": self.summary.batches},
            )

    def _emit_batch(self, outcome: BatchOutcome) -> None:
        """Emit a recorded batch's events: its failed items, its notes, the run's progress."""
        events, summary = self.events, self.summary
        for item_id, item_error in outcome.failed_items:
            failed = {"item.id": item_id, "error.type": item_error}
            events.emit("job.item.failed", logging.WARNING, **failed)
        for name, fields in outcome.notes:  # e.g. downstream.breaker.open
            events.emit(name, logging.WARNING if name.endswith("open") else logging.INFO, **fields)
        elapsed = time.monotonic() - self.batches_started
        events.progress(
            **{
                "batch_number": summary.batches,
                **summary.counts.event_fields(PROGRESS),
                "elapsed_ms": int(elapsed * 1000),
                "throughput_per_second": round(summary.counts.processed / elapsed, 1)
                if elapsed
                else None,
            }
        )

    def _halted(self, outcome: BatchOutcome) -> bool:
        """Whether the outcome stops the run (for example, the downstream's breaker opened)."""
        if outcome.halt is None:
            return False
        code, reason = outcome.halt
        if code is not None:
            self.summary.status, self.summary.error_code = RunStatus.FAILED, code
        self.summary.status_reason = reason
        return True

    # ------------------------------------------------------------------ the end
    def _check_outcome(self) -> None:
        """Run the business outcome checks, read the job's lag, and report what is left."""
        summary = self.summary
        try:
            hold_point("before_finalize")  # a signal sees this as the outcome-check phase
            with self.engine.connect() as conn:
                summary.checks = self.spec.check(conn, self.ctx)
                lag_of = self.spec.signals.lag
                lag = lag_of(conn, self.ctx) if lag_of else None
                summary.oldest_due_age_s = lag
                add_report(conn, self.spec, self.ctx, self.summary)
            self.metrics.lag.labels(self.spec.name).set(lag or 0.0)
        except Terminated:
            summary.checks = []
            self._stopped_by_signal(" during outcome checks")
            raise
        except Exception as exc:
            if not is_unavailable(exc):
                raise
            summary.checks = []  # the work is recorded. Its checks wait for the next run.
            summary.status_reason = (
                summary.status_reason or "outcome checks skipped: database unavailable"
            )
        except BaseException:
            summary.status_reason = summary.status_reason or "interrupted during outcome checks"
            raise

    def _stopped_by_signal(self, where: str) -> None:
        """A run stopped by SIGTERM/SIGINT ends ``cancelled``/``terminated``. If its work was
        already over, it keeps its status, and the reason says what was cut short."""
        summary = self.summary
        if summary.status == RunStatus.RUNNING:
            summary.status, summary.status_reason = RunStatus.CANCELLED, TERMINATED
        else:
            summary.status_reason = summary.status_reason or f"{TERMINATED}{where}"

    def _failed(self, exc: BaseException) -> None:
        """A run that ends on an error is ``failed``, with its class and a safe one-line text."""
        records.mark_failed(self.summary, exc)
        log.debug("run failed", exc_info=True)

    def _interrupted(self) -> None:
        """A run its caller interrupted is ``cancelled``, unless its work was already over."""
        if self.summary.status == RunStatus.RUNNING:
            self.summary.status = RunStatus.CANCELLED
        self.summary.status_reason = self.summary.status_reason or "interrupted"

    def _end(self, root: SpanLike, ended_by: BaseException | None) -> None:
        """End the run. This is the only place it ends, whatever ended it. It sets the status
        and duration, writes the final record and metrics, emits job.finished and sets the
        root span's attributes."""
        if isinstance(ended_by, Terminated):
            self._stopped_by_signal("")
        elif isinstance(ended_by, Exception):  # a failure outside the batches
            self._failed(ended_by)
        elif ended_by is not None:  # interrupted by the caller. The batches' outcome stays.
            self._interrupted()
        summary = self.summary
        summary.duration_ms = int((time.monotonic() - self.started) * 1000)  # checks included
        with self.stop.deferred():
            try:
                self._write_record()
            finally:
                self._let_go()
        self.metrics.count_run(self.spec, summary, time.monotonic() - self.started)
        self.events.emit(
            "job.finished",
            logging.INFO if summary.status in QUIET_ENDINGS else logging.WARNING,
            **{
                "job.status": summary.status,
                "job.status_reason": summary.status_reason,
                "duration_ms": summary.duration_ms,
                "items.eligible": summary.eligible_count,
                **summary.counts.event_fields(),
                "tally": summary.tally or None,
                "error.class": summary.error_code,
                "checks.failed": [c.name for c in summary.checks if not c.passed],
                **({"stop.signal": self.stop.signal_name} if self.stop.requested else {}),
            },
        )
        root.set_attribute("job.status", summary.status)
        for name, count in summary.counts.event_fields(SPAN).items():
            root.set_attribute(name, count)

    def _let_go(self) -> None:
        """Give the liveness lock back, once the record is finished (or was never written)."""
        if self.liveness is not None:
            self.liveness.release()
            self.liveness = None

    def _write_record(self) -> None:
        """Write the run's final record, riding out a database restart for a bounded time
        (the stop grace, when stopping). If the database never comes back, the reaper ends it."""
        limit = self._db_patience()
        try:
            retry_while_unavailable(
                lambda: records.finish_run(self.engine, self.summary, self.owner),
                limit_s=limit,
                what="finishing the run record",
            )
        except DBAPIError as exc:
            if not is_unavailable(exc):
                raise
            raise DatabaseUnavailable(
                f"the database did not come back within {limit:.0f} s: run {self.run_id} ended "
                f"{self.summary.status} but its record says running until the reaper ends it "
                f"(qo-ops reap)",
                exit_code=1,
            ) from None
