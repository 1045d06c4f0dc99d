"""The API's run resource reads like the run report: a run that called the downstream shows
its calls, retry pressure, calls not sent and breaker transitions, and a run the breaker
stopped says ``dependency_unavailable`` and why; a run that called nothing shows none."""

from __future__ import annotations

from qo_ops.jobs import delivery_retry, quote_expiration
from qo_ops.platform.job.options import RunOptions
from qo_ops.platform.job.scope import Scope
from qo_ops.platform.run.runner import run_job
from qo_ops_tests.dagster.stack import free_port


def _execute(spec, db):
    return run_job(
        spec,
        Scope("tenant-001"),
        RunOptions(mode="execute", trigger="manual", requester="test", reason="INC-20 drill"),
        engine=db.engine,
    )


def test_the_run_resource_shows_the_downstream_manners(loaded, api, monkeypatch):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: every connection refused
    monkeypatch.setenv("QO_OPS_DOWNSTREAM_URL", dead)
    stopped = _execute(delivery_retry.SPEC, loaded)
    calm = _execute(quote_expiration.SPEC, loaded)
    assert stopped.error_code == "dependency_unavailable"
    viewer = api.token("vera", "viewer")

    view = api.get(f"/internal/jobs/delivery_retry/runs/{stopped.job_run_id}", viewer).json()
    assert view["status"] == "failed"
    assert view["last_error_code"] == "dependency_unavailable"
    assert view["status_reason"] == f"circuit breaker open for {dead}"
    figures = view["downstream"]
    tally = stopped.tally
    assert figures["calls"] == tally["downstream.calls"] > 0
    assert figures["retries"] == tally.get("downstream.retries", 0)
    assert figures["retry_pressure"] == round(figures["retries"] / figures["calls"], 4)
    assert figures["not_sent_breaker_open"] == tally["downstream.refused_open"] > 0
    assert figures["spared"] == tally["downstream.spared"] > 0
    assert figures["breaker_transitions"] == {"open": 1, "half_open": 0, "closed": 0}
    assert figures["rate_limit_pauses"] == 0 and figures["rate_limit_wait_s"] == 0
    assert "tally" not in view  # the figures, not the raw counters

    other = api.get(f"/internal/jobs/quote_expiration/runs/{calm.job_run_id}", viewer).json()
    assert other["status"] == "success" and other["downstream"] is None
