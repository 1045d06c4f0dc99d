"""The breaker probe sensor: an open downstream breaker is probed on schedule, even when no
run has work to probe it with (``qo_ops.platform.calls.idle_probe``). It launches nothing;
its tick message says what each probe found."""

from __future__ import annotations

import dagster as dg
from sqlalchemy.exc import SQLAlchemyError

from qo_ops.dagster_defs.resources import QoOpsDatabase
from qo_ops.downstream.calls import ask_for_probe, manners_from_env
from qo_ops.errors import ConfigError, one_line
from qo_ops.platform.calls.idle_probe import probe_idle_breakers

PROBE_INTERVAL_S = 30  # the default QO_OPS_BREAKER_OPEN_S: a due probe waits at most this


@dg.sensor(
    name="breaker_probe_sensor",
    minimum_interval_seconds=PROBE_INTERVAL_S,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Probes each open downstream breaker whose probe is due, even when no run has "
    "work; closes it when the downstream answers, keeps it open when not",
)
def breaker_probe_sensor(
    context: dg.SensorEvaluationContext, database: QoOpsDatabase
) -> dg.SkipReason:
    try:
        settings = manners_from_env().breaker
        reports = probe_idle_breakers(database.engine(), settings, ask_for_probe)
    except (ConfigError, SQLAlchemyError) as exc:  # one line, never a traceback
        text = one_line(str(getattr(exc, "orig", None) or exc), 200)
        context.log.warning(f"breaker probe not made: {text}")
        return dg.SkipReason(f"breaker probe not made: {text}")
    if not reports:
        return dg.SkipReason("no open breaker due for a probe")
    text = "; ".join(r.line() for r in reports)
    if any(r.outcome != "closed" for r in reports):
        context.log.warning(f"breaker probe: {text}")
    else:
        context.log.info(f"breaker probe: {text}")
    return dg.SkipReason(f"breaker probe: {text}")
