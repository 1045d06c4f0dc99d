"""call_each, the bounded call pool of an external phase: at most ``concurrency`` calls at
once, results in item order, its threads kept for the next batch — except one still stuck
in a call a stopping run stopped waiting for, which the next batch does not wait for.

Tests ``qo_ops.platform.calls.external``.
"""

from __future__ import annotations

import os
import signal
import threading

from qo_ops.platform.calls.external import NotCalled, call_each
from qo_ops.platform.run.stopping import StopSignals


def test_calls_are_bounded_in_order_and_their_threads_serve_the_next_batch() -> None:
    lock = threading.Lock()
    in_flight, most = 0, 0
    gate = threading.Barrier(4, timeout=10)  # the first four calls all wait for each other

    def call(item: int) -> tuple[int, int]:
        nonlocal in_flight, most
        with lock:
            in_flight += 1
            most = max(most, in_flight)
        if item < 4:
            gate.wait()  # all four workers really run at once
        with lock:
            in_flight -= 1
        return item, threading.get_ident()

    first = call_each(list(range(40)), call, 4)
    second = call_each(list(range(40)), call, 4)
    assert [r[0] for r in first] == [r[0] for r in second] == list(range(40))  # type: ignore[index]
    assert most == 4
    threads = {r[1] for r in first}  # type: ignore[index]
    assert len(threads) == 4
    assert {r[1] for r in second} <= threads  # type: ignore[index]  # no new thread started


def test_a_call_stuck_past_the_grace_does_not_hold_up_the_next_batch() -> None:
    started, release = threading.Event(), threading.Event()

    def stuck(item: str) -> tuple[str, int]:
        started.set()
        release.wait(60)
        return item, threading.get_ident()

    stop = StopSignals(grace_s=0.2)
    stopper = threading.Thread(target=lambda: started.wait(10) and stop.request())
    stopper.start()
    stopped = call_each(["a", "b"], stuck, 1, stop)
    stopper.join()
    assert stopped == [NotCalled("a", sent=True), NotCalled("b", sent=False)]

    def quick(item: str) -> tuple[str, int]:
        return item, threading.get_ident()

    after: list[object] = []
    batch = threading.Thread(target=lambda: after.extend(call_each(["c", "d", "e"], quick, 3)))
    batch.start()
    try:
        batch.join(timeout=20)  # done while "a" is still stuck: nobody waits for that thread
        assert not batch.is_alive() and not release.is_set()
        assert [r[0] for r in after] == ["c", "d", "e"]  # type: ignore[index]
    finally:
        release.set()
        batch.join()


def test_a_forked_child_starts_threads_of_its_own() -> None:
    call_each([1, 2], lambda i: i, 2)  # leaves idle threads behind, which a child won't have
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its batch must run although the parent's threads are not here
        signal.alarm(20)  # a hung child ends (SIGALRM) instead of hanging the test
        try:
            os.write(write, repr(call_each([3, 4, 5], lambda i: i * 2, 2)).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as answer:
        got = answer.read()  # EOF when the child exits; empty if it hung and was killed
    os.waitpid(pid, 0)
    assert got == "[6, 8, 10]"
