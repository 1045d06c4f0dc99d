"""bench/bare_client.py, the bare-client limit other benchmarks compare with: every figure
means that many distinct deliveries stored, and anything but a 201 stops it loudly."""

from __future__ import annotations

import pytest

from bench.bare_client import KINDS, BareClientError, bare_rate, bare_run, measure
from qo_ops_tests.conftest import DownstreamServer


@pytest.mark.parametrize("kind", KINDS)
def test_bare_run_stores_exactly_what_it_counts(downstream: DownstreamServer, kind: str) -> None:
    run = bare_run(downstream.url, 8, count=300, kind=kind)
    assert (run.kind, run.concurrency, run.deliveries) == (kind, 8, 300)
    assert run.per_s == 300 / run.elapsed_s
    assert bare_rate(downstream.url, 4, seconds=0.3, kind=kind) > 0
    stats = downstream.client.stats(detail=False)
    assert stats["deliveries_distinct"] == stats["delivery_requests"] > 300  # fresh keys
    assert stats["duplicates_suppressed"] == 0


@pytest.mark.parametrize("kind", KINDS)
def test_a_refused_request_stops_the_measurement(downstream_factory, kind: str) -> None:
    server: DownstreamServer = downstream_factory(rate_limit=5)
    with pytest.raises(BareClientError, match="HTTP 429"):
        bare_run(server.url, 4, count=100, kind=kind)


def test_bad_arguments_are_refused(downstream: DownstreamServer) -> None:
    for kwargs in ({}, {"seconds": 1, "count": 1}, {"count": 0}, {"seconds": -1}):
        with pytest.raises(ValueError):
            bare_run(downstream.url, 4, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kind"):
        bare_run(downstream.url, 4, count=1, kind="curl")
    assert downstream.client.stats(detail=False)["delivery_requests"] == 0


def test_measure_starts_its_own_simulator() -> None:
    row = measure(latency_ms=5, concurrency=4, kind="asyncio", seconds=0.5)
    assert row["deliveries"] > 0
    assert row["ideal_per_s"] == 4 / 0.005
    assert float(row["simulator_cpu_ms"]) >= 0 and 0 <= float(row["machine_busy_share"]) <= 1
