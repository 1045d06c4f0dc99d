"""Calling another system for the items of a batch: in parallel, bounded, outside any
database transaction."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from qo_ops.platform.tracing import in_current_context

T = TypeVar("T")
R = TypeVar("R")


def call_each(items: Sequence[T], call: Callable[[T], R], concurrency: int) -> list[R]:
    """``call`` for every item, at most ``concurrency`` at once; results in item order.

    ``call`` must not raise for an item's failure: it returns that failure as its result.
    """
    if concurrency <= 1 or len(items) <= 1:
        return [call(item) for item in items]
    with ThreadPoolExecutor(
        max_workers=min(concurrency, len(items)), thread_name_prefix="qo-ops-call"
    ) as pool:
        return list(pool.map(in_current_context(call), items))  # calls join the batch's trace
