"""Replaying an access trace: entries resolved to the chunks of the mounted catalog, fetched in order.

A trace's entries are ``(path, file offset)`` (:mod:`ogrefs.repo.traces`).
:class:`EntryResolver` maps them onto a catalog — which may be a *newer*
snapshot's than the one the trace was recorded on: a path is resolved in this
catalog, an offset mapped to the extent that holds it, and entries whose file
or data no longer exist are dropped.  :func:`load_trace` finds the trace a
mount replays and puts the mounted snapshot's newest coherent checkpoint in
place of a stale one the trace read (:mod:`ogrefs.lazy.newer_checkpoint`).

:class:`Replayer` feeds a list of chunks to the fetcher at a priority, in
order, a bounded number of bytes at a time (the windowed request engine of
:mod:`ogrefs.lazy.window`).

Ownership: a Replayer belongs to the trio loop (its stats are read by the
status file on the same loop).  Resolution and catalog queries run in a
worker thread, on the catalog and the immutable entry list only; the
resolver lives in that thread alone.
"""

from __future__ import annotations

import logging
import os
from bisect import bisect_right
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterable

import trio

from ogrefs.errors import CorruptObject
from ogrefs.lazy.fetcher import ChunkRef, FetchError, Fetcher, Keep, Priority, Ticket
from ogrefs.lazy.newer_checkpoint import replace_stale_checkpoints
from ogrefs.lazy.window import RequestWindow, groups
from ogrefs.repo.catalog import Catalog, Extent
from ogrefs.repo.traces import Entry, find_trace

if TYPE_CHECKING:
    from ogrefs.repo import Repository

log = logging.getLogger(__name__)

MiB = 1024 * 1024


def load_trace(repo: Repository, manifest: dict[str, Any], catalog: Catalog) -> list[Entry]:
    """The entries a mount of ``manifest`` (whose catalog is ``catalog``) replays ([] when there is none).  Blocking.

    The trace :func:`~ogrefs.repo.traces.find_trace` picks, with the reads of
    a training checkpoint older than the newest coherent one of its run in
    ``manifest`` turned into reads of that newest one: a run resumed from this
    snapshot loads the newest checkpoint, not the one the trace's run loaded.
    """
    found = find_trace(repo, manifest)
    if not found.entries:
        return []
    return replace_stale_checkpoints(found.entries, manifest, found.recorded_on, lambda p: _chunk_starts(catalog, p))


def _chunk_starts(catalog: Catalog, path: bytes) -> list[int]:
    """The offsets of a file's chunks in ``catalog`` ([] if it is no regular file there, or unreadable)."""
    try:
        node = catalog.resolve(path)
        return [e.offset for e in catalog.extents(node.ino)] if node is not None and node.is_reg else []
    except CorruptObject as exc:
        log.warning("trace: %s: %s", os.fsdecode(path), exc)
        return []


# -- mapping entries to chunks -------------------------------------------------------------------------
@dataclass(frozen=True)
class Resolved:
    ino: int
    extent: Extent

    @property
    def ref(self) -> ChunkRef:
        return ChunkRef.from_extent(self.extent)


class EntryResolver:
    """Maps (path, offset) entries to the extents of a catalog; memoizes files.  Blocking (one thread)."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self._files: dict[bytes, tuple[int, list[Extent], list[int]] | None] = {}
        self.dropped = 0  # entries whose file or data does not exist in this catalog

    def _file(self, path: bytes) -> tuple[int, list[Extent], list[int]] | None:
        if path in self._files:
            return self._files[path]
        try:
            node = self.catalog.resolve(path)
            info = None
            if node is not None and node.is_reg and node.size:
                extents = self.catalog.extents(node.ino)
                info = (node.ino, extents, [e.offset for e in extents])
        except CorruptObject as exc:
            log.warning("trace entry %s: %s", os.fsdecode(path), exc)
            info = None
        self._files[path] = info
        return info

    def resolve(self, entries: Iterable[Entry]) -> list[Resolved]:
        """The extent holding each entry, in order, each extent once; entries that map to nothing are dropped."""
        out: list[Resolved] = []
        seen: set[tuple[int, int]] = set()
        for path, off in entries:
            info = self._file(path)
            if info is None:
                self.dropped += 1
                continue
            ino, extents, starts = info
            k = bisect_right(starts, off) - 1
            if k < 0 or off >= extents[k].end:
                self.dropped += 1  # a hole now, or past the end of the file
                continue
            if (ino, extents[k].offset) not in seen:
                seen.add((ino, extents[k].offset))
                out.append(Resolved(ino, extents[k]))
        return out


def resolve_entries(catalog: Catalog, entries: Iterable[Entry]) -> list[Resolved]:
    return EntryResolver(catalog).resolve(entries)


# -- replay ----------------------------------------------------------------------------------------------
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
        self.hold = hold  # held in the fetcher's memory until the materializer takes them (Fetcher.hold)
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
            refs = [r.ref for r in resolver.resolve(self.entries)]
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
        refs, self.stats.dropped = await trio.to_thread.run_sync(self._plan)
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
