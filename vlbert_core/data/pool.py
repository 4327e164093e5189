"""A bounded, order-preserving parallel map for I/O-bound work (downloads)."""

from __future__ import annotations

import collections
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterable, Iterator, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def imap_ordered(
    fn: Callable[[T], R], items: Iterable[T], threads: int, max_in_flight: int | None = None
) -> Iterator[R]:
    """Yield fn(item) for each item, in input order, running up to `threads` calls at once.

    At most `max_in_flight` (default 4 x threads) items are submitted ahead of the one being
    yielded, so a shard of millions of rows never queues millions of futures. Results come back
    in input order, which keeps whatever the caller writes deterministic. An exception raised by
    fn propagates at its item's turn, and the remaining work is cancelled.
    """
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    window = max(threads, max_in_flight if max_in_flight is not None else 4 * threads)
    pending: collections.deque[Future[R]] = collections.deque()
    iterator = iter(items)
    executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="fetch")
    try:
        for item in iterator:
            pending.append(executor.submit(fn, item))
            if len(pending) >= window:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        executor.shutdown(wait=True, cancel_futures=True)
