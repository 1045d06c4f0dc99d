"""A job's own state between its steps within one run: one object per type, reached through
``BatchContext.run_state`` (qo_ops.platform.job.outcome)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import pytest

from qo_ops.platform.job.outcome import BatchContext
from qo_ops.platform.job.scope import Scope


@dataclass
class GateRun:
    gate: str | None = None
    refused: set[int] = field(default_factory=set)


@dataclass
class CallsRun:
    url: str


def _ctx() -> BatchContext:
    return BatchContext("some_job", Scope("tenant-a"), "execute", uuid.uuid4())


def test_a_run_state_is_made_once_and_kept_for_the_run():
    ctx = _ctx()
    assert ctx.run_state_if_made(GateRun) is None  # nothing made yet
    ctx.run_state(GateRun).gate = "passed"
    ctx.run_state(GateRun).refused.add(7)
    assert ctx.run_state(GateRun) == GateRun("passed", {7})
    assert ctx.run_state_if_made(GateRun) is ctx.run_state(GateRun)


def test_each_type_is_its_own_state_and_make_runs_only_on_first_use():
    ctx = _ctx()
    made: list[str] = []

    def make() -> CallsRun:
        made.append("x")
        return CallsRun("http://downstream")

    first = ctx.run_state(CallsRun, make)
    assert ctx.run_state(CallsRun, make) is first and made == ["x"]
    assert ctx.run_state(GateRun) == GateRun()  # another type: another object
    assert _ctx().run_state_if_made(CallsRun) is None  # another run (context): none


def test_a_state_of_the_wrong_type_is_refused():
    with pytest.raises(TypeError, match="run state CallsRun"):
        _ctx().run_state(CallsRun, lambda: GateRun())  # type: ignore[arg-type, return-value]
