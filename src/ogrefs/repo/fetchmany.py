"""Many small objects from the store, several round trips at once, consumed in order.

A box that has cached nothing (a fresh box at boot, or at a preemption
notice) reads every manifest and every index object of a bucket that
several boxes share: hundreds of GETs, each one round trip. One after the
other that is seconds at 20–30 ms; ``WORKERS`` at a time it is a fraction.

Ownership: :func:`in_order` runs in the caller's thread and owns its pool;
the pool's threads run only ``fetch(item)`` (which must be thread-safe: a
store GET and a decode of what came back) and hand the result back through
its future; the caller alone consumes the results, in the items' order, so
it needs no lock for what it does with them.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterable, Iterator, TypeVar

T = TypeVar("T")
R = TypeVar("R")

#: Fetches in flight at once, within the S3 client's connection pool (store/s3.py MAX_POOL_CONNECTIONS).
WORKERS = 16
#: Results fetched ahead of the one consumed: bounds the memory of results that wait for their turn.
AHEAD = 4 * WORKERS

_END = object()


def in_order(fetch: Callable[[T], R], items: Iterable[T], *, workers: int = WORKERS,
             ahead: int = AHEAD) -> Iterator[tuple[T, Callable[[], R]]]:
    """``(item, result)`` per item, in order; ``result()`` returns ``fetch(item)`` or raises its exception.

    At most ``workers`` fetches run at once and at most ``ahead`` items are
    fetched or waiting beyond the one the consumer holds. A consumer that
    stops early (or raises) cancels what has not started and waits for what
    has.
    """
    todo = list(items)
    if len(todo) <= 1:
        for item in todo:
            yield item, (lambda item=item: fetch(item))
        return
    pool = ThreadPoolExecutor(min(workers, len(todo)), thread_name_prefix="ogrefs-fetch")
    window: deque[tuple[T, Future]] = deque()
    try:
        it = iter(todo)
        for item in it:
            window.append((item, pool.submit(fetch, item)))
            if len(window) >= ahead:
                break
        while window:
            item, fut = window.popleft()
            nxt = next(it, _END)
            if nxt is not _END:
                window.append((nxt, pool.submit(fetch, nxt)))
            yield item, fut.result
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
