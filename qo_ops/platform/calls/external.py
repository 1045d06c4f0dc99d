"""Calling another system for the items of a batch.

The calls run in parallel, with a bound on how many run at once, and outside any database
transaction. They can be stopped. Once the run is asked to stop, no further call is sent.
Calls already sent are waited for only until half of the stop grace is gone. A batch whose
run gave up on it (:func:`giving_up`) sends no further call and waits for none."""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Generic, TypeVar

from qo_ops.platform.job.outcome import StopRequest
from qo_ops.platform.observability.tracing import in_current_context

T = TypeVar("T")
R = TypeVar("R")

_POLL_S = 0.05  # a waiting batch checks the stop request this often (seconds)
_IDLE_S = 30.0  # an idle caller thread waits this long for the next batch, then ends


class _Callers:
    """Daemon threads that make the calls, kept idle between batches.

    Starting dozens of threads for every batch would cost CPU, and nothing would be in flight
    meanwhile. A thread still busy with a call past a stop's grace is simply not idle, so the
    next batch starts another."""

    def __init__(self) -> None:
        self.forget()

    def forget(self) -> None:
        """Forget all idle threads.

        This is the fresh start, and also a forked child's start, since the parent's threads
        are gone in the child."""
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue[tuple[Callable[[], None], Callable[[], None]]]] = []

    def start(self, work: Callable[[], None], then: Callable[[], None]) -> None:
        """Run ``work`` on an idle thread, or on a new one. ``work`` must not raise.

        ``then`` runs once the thread is idle again, so the next batch finds it."""
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
        if inbox is None:
            inbox = queue.SimpleQueue()
            threading.Thread(
                target=self._serve, args=(inbox,), name="qo-ops-call", daemon=True
            ).start()
        inbox.put((work, then))

    def _serve(
        self, inbox: queue.SimpleQueue[tuple[Callable[[], None], Callable[[], None]]]
    ) -> None:
        while True:
            try:
                work, then = inbox.get(timeout=_IDLE_S)
            except queue.Empty:
                with self._lock:
                    if any(i is inbox for i in self._idle):  # nobody took it, so retire
                        self._idle = [i for i in self._idle if i is not inbox]
                        return
                work, then = inbox.get()  # someone took it just now; its work is on the way
            work()
            with self._lock:
                self._idle.append(inbox)
            then()


_CALLERS = _Callers()
# A forked child has none of the parent's threads, so it must not hand work to their inboxes.
os.register_at_fork(after_in_child=_CALLERS.forget)


# Set while a batch's calls run on a thread the run may give up on (the overlapped batches).
_GIVE_UP: ContextVar[threading.Event | None] = ContextVar("qo_ops_give_up", default=None)


@contextmanager
def giving_up(event: threading.Event) -> Iterator[None]:
    """Within it, :func:`call_each` sends no further call once ``event`` is set, and returns
    at once (what it did not wait for is ``NotCalled``). For a run that ends on an error
    while a batch's calls are in flight: its items stay claimed until the claim lapses."""
    token = _GIVE_UP.set(event)
    try:
        yield
    finally:
        _GIVE_UP.reset(token)


@dataclass(frozen=True)
class NotCalled(Generic[T]):
    """An item whose call a stopping run did not make or did not wait for.

    ``sent`` is False when the call was not made. It is True when the run did not wait for
    the answer, so the request may have landed. Either way, the item's claim must be given
    back."""

    item: T
    sent: bool


def call_each(
    items: Sequence[T],
    call: Callable[[T], R],
    concurrency: int,
    stop: StopRequest | None = None,
) -> list[R | NotCalled[T]]:
    """Run ``call`` for every item, at most ``concurrency`` at once, and return the results in
    item order.

    ``call`` must not raise for an item's failure. It returns that failure as its result.
    The calls run on daemon threads, which are kept for the next batch. So a call stuck past
    the grace never holds up the process's exit. Its item comes back as
    ``NotCalled(sent=True)``.
    """
    pending = object()
    results: list[object] = [pending] * len(items)
    sent: set[int] = set()
    lock = threading.Lock()
    todo = iter(range(len(items)))
    finished = threading.Semaphore(0)
    traced = in_current_context(call)
    workers = max(1, min(concurrency, len(items)))
    raised: list[BaseException] = []
    give_up = _GIVE_UP.get()

    def halted() -> bool:
        return (stop is not None and stop.requested) or (give_up is not None and give_up.is_set())

    def work() -> None:  # each of the ``workers`` threads takes the next item until none is left
        while True:
            with lock:
                index = None if halted() else next(todo, None)
                if index is not None:
                    sent.add(index)
            if index is None:
                return
            try:
                results[index] = traced(items[index])
            except BaseException as exc:  # a bug, not an item's failure, so the batch fails
                raised.append(exc)
                with lock:
                    for _ in todo:
                        pass

    for _ in range(workers):
        _CALLERS.start(work, finished.release)
    idle = 0
    while idle < workers:
        deadline = stop.calls_deadline() if stop is not None else None
        if deadline is not None and time.monotonic() >= deadline:
            break
        if give_up is not None and give_up.is_set():
            break
        if finished.acquire(timeout=_POLL_S):
            idle += 1
    with lock:  # from here on, no worker takes another item
        for _ in todo:
            pass
        if raised:
            raise raised[0]
        return [
            NotCalled(items[i], sent=i in sent) if r is pending else r  # type: ignore[misc]
            for i, r in enumerate(results)
        ]
