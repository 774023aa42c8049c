"""The windowed request engine: ask the fetcher for chunks in order, a bounded number of bytes at a time.

Everything that streams a known list of chunks (a trace or hint replay, the
materializer's feeder) does the same two things, written once here:

* :func:`groups` cuts the ordered list into runs of neighbours of at most
  ``group_bytes`` (one request each, so that neighbours in a pack share a
  GET), never mixing items of different kinds (``key``: e.g. priority
  classes);
* :class:`RequestWindow` bounds the bytes requested and not yet finished: a
  requester waits (:meth:`RequestWindow.acquire`) or checks
  (:meth:`RequestWindow.fits`) before each group, and the consumer gives the
  bytes back when it is done with them (fetched, or written to disk).  Bytes
  that came from memory (``ready``) cost the link nothing: while a consumer
  works through such a backlog the window widens by as much, so the link
  keeps fetching what comes next instead of idling.

A request always fits an empty window, so a group larger than the window
still goes (alone).

Ownership: a RequestWindow belongs to the trio loop; the tasks of one stream
(its requester and its consumer) share it and nothing else touches it.
"""

from __future__ import annotations

from typing import Callable, Hashable, Iterable, Iterator, TypeVar

import trio

T = TypeVar("T")


def groups(items: Iterable[T], group_bytes: int, *, size: Callable[[T], int],
           key: Callable[[T], Hashable] | None = None) -> Iterator[list[T]]:
    """Consecutive runs of ``items`` of at most ``group_bytes`` (a run holds at least one) and one ``key`` each."""
    group: list[T] = []
    total = 0
    kind: Hashable = None
    for item in items:
        n = size(item)
        k = key(item) if key is not None else None
        if group and (k != kind or total + n > group_bytes):
            yield group
            group, total = [], 0
        group.append(item)
        total += n
        kind = k
    if group:
        yield group


class RequestWindow:
    """Bytes requested and not yet finished; a requester waits while the window is full.

    ``used`` counts bytes on their way over the link (or arrived and not yet
    finished with); ``ready`` counts bytes that came from memory, not yet
    finished with.  The window is ``limit`` plus ``ready``.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.ready = 0
        self._changed = trio.Event()

    def fits(self, n: int) -> bool:
        """Whether ``n`` more bytes may be requested now (always, when nothing is outstanding)."""
        return self.used <= 0 or self.used + n <= self.limit + self.ready

    async def acquire(self, n: int) -> None:
        """Wait until ``n`` bytes fit, then reserve them."""
        while not self.fits(n):
            await self._changed.wait()
        self.used += n

    def take(self, n: int) -> None:
        """Reserve ``n`` bytes without waiting (the caller checked :meth:`fits`)."""
        self.used += n

    def settle(self, *, charged: int, ready: int, acquired: int) -> None:
        """After a request: ``charged`` bytes go over the link (``acquired`` were reserved);
        ``ready`` came from memory."""
        self.used += charged - acquired
        self.ready += ready
        self._wake()

    def finished(self, charged: int, ready: int = 0) -> None:
        """The consumer is done with ``charged`` bytes from the link and ``ready`` bytes from memory."""
        self.used -= charged
        self.ready -= ready
        self._wake()

    def release(self, n: int) -> None:
        """Give back ``n`` reserved bytes that will not be finished (not requested after all, or failed)."""
        self.finished(n)

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()
