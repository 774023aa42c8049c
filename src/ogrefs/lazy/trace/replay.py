"""Replaying an access trace (or a list of chunks): fetched in order, at a priority, a window at a time.

:class:`Replayer` feeds a list of chunks to the fetcher at a priority, in
order, in groups of neighbours, a bounded number of bytes outstanding (the
windowed request engine of :mod:`ogrefs.lazy.trace.window`).  A trace's entries are
first resolved to the mounted catalog's chunks (:mod:`ogrefs.lazy.trace.resolve`).

Ownership: a Replayer belongs to the trio loop (its stats are read by the
status file on the same loop).  Resolution runs in a worker thread, on the
catalog and the immutable entry list only, and returns its result: the
thread assigns nothing of the Replayer's.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Awaitable, Callable

import trio

from ogrefs.lazy.fetch.fetcher import FetchError, Fetcher, Keep, Priority, Ticket
from ogrefs.repo.chunkref import ChunkRef
from ogrefs.lazy.trace.resolve import EntryResolver
from ogrefs.lazy.fetch.threadnice import to_background_thread
from ogrefs.lazy.trace.window import RequestWindow, groups
from ogrefs.repo.catalog import Catalog
from ogrefs.repo.traces import Entry
from ogrefs.units import MiB

log = logging.getLogger(__name__)


@dataclass
class ReplayStats:
    entries: int = 0
    dropped: int = 0  # entries that no longer exist
    chunks: int = 0  # distinct chunks to fetch
    bytes_total: int = 0
    bytes_done: int = 0
    chunks_done: int = 0
    failed: int = 0
    finished: bool = False


class Replayer:
    """Fetch the chunks of a list of entries, in order, at ``priority``, keeping ``window_bytes`` outstanding.

    Used for a trace (``Priority.TRACE``) and, with :meth:`from_refs`, for
    catalog hints (``Priority.HINT``) when nothing is materialized: the
    chunks land in the chunk cache (``keep=True``); before the materializer's
    tree exists, held in memory for it (``hold=True``).  ``max_bytes`` bounds what
    is fetched at all (a trace or a hint set larger than the bounded cache
    would only evict itself).  Failures are counted, never raised.
    """

    def __init__(self, catalog: Catalog, fetcher: Fetcher, entries: list[Entry] | None = None, *,
                 priority: Priority = Priority.TRACE, window_bytes: int = 64 * MiB,
                 group_bytes: int = 16 * MiB, max_bytes: int | None = None, keep: "Keep | bool" = True,
                 bridge: bool = False, hold: bool = False,
                 pace: Callable[[], Awaitable[None]] | None = None) -> None:
        self.catalog = catalog
        self.fetcher = fetcher
        self.entries = entries or []
        self.priority = priority
        self.window_bytes = window_bytes
        self.group_bytes = group_bytes
        self.max_bytes = max_bytes
        self.keep = keep
        self.bridge = bridge  # nothing of the snapshot is on local disk yet: GETs may bridge gaps
        self.hold = hold  # held in the fetcher's memory until the materializer takes them (Residency.hold)
        self.pace = pace  # awaited before each group is requested (background work that yields)
        self.stats = ReplayStats(entries=len(self.entries))
        self._refs: list[ChunkRef] | None = None

    @classmethod
    def from_refs(cls, catalog: Catalog, fetcher: Fetcher, refs: list[ChunkRef], **kw) -> "Replayer":
        r = cls(catalog, fetcher, None, **kw)
        r._refs = refs
        return r

    def _plan(self) -> tuple[list[ChunkRef], int]:
        """Worker thread: the chunks to fetch, in order, each once, within ``max_bytes``; and the entries dropped."""
        dropped = 0
        if self._refs is not None:
            refs = self._refs
        else:
            resolver = EntryResolver(self.catalog)
            refs = [ChunkRef.from_extent(r.extent) for r in resolver.resolve(self.entries)]
            dropped = resolver.dropped
        out, seen, total = [], set(), 0
        for ref in refs:
            if ref.chunk in seen:
                continue
            if self.max_bytes is not None and total + ref.raw_len > self.max_bytes:
                break
            seen.add(ref.chunk)
            out.append(ref)
            total += ref.raw_len
        return out, dropped

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> ReplayStats:
        task_status.started()
        refs, self.stats.dropped = await to_background_thread(self._plan)
        self.stats.chunks = len(refs)
        self.stats.bytes_total = sum(r.raw_len for r in refs)
        window = RequestWindow(self.window_bytes)
        outstanding: deque[Ticket] = deque()  # in order
        for group in groups(refs, self.group_bytes, size=lambda r: r.raw_len):
            size = sum(r.raw_len for r in group)
            while not window.fits(size):
                await self._finish(outstanding.popleft(), window)
            if self.pace is not None:
                await self.pace()
            if self.priority >= Priority.HINT:  # hints and background wait out a snapshot of the box
                await self.fetcher.until_not_yielding()  # (not even probing the disk cache meanwhile)
            window.take(size)
            outstanding.extend(self.fetcher.request(group, self.priority, keep=self.keep, bridge=self.bridge,
                                                    hold=self.hold))
        while outstanding:
            await self._finish(outstanding.popleft(), window)
        self.stats.finished = True
        return self.stats

    async def _finish(self, ticket: Ticket, window: RequestWindow) -> None:
        """Wait for the oldest outstanding chunk and give its bytes back to the window."""
        try:
            await ticket.result()
            self.stats.bytes_done += ticket.ref.raw_len
            self.stats.chunks_done += 1
        except FetchError:
            self.stats.failed += 1
        window.finished(ticket.ref.raw_len)
