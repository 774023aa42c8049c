"""Resolving an access trace: its entries mapped to the chunks of the mounted catalog.  Worker threads only.

A trace's entries are ``(path, file offset)`` (:mod:`ogrefs.repo.traces`).
:class:`EntryResolver` maps them onto a catalog — which may be a *newer*
snapshot's than the one the trace was recorded on: a path is resolved in this
catalog, an offset mapped to the extent that holds it, and entries whose file
or data no longer exist are dropped.  :func:`load_trace` finds the trace a
mount replays and puts the mounted snapshot's newest coherent checkpoint in
place of a stale one the trace read (:mod:`ogrefs.lazy.trace.newer_checkpoint`).

Everything here blocks (catalog queries, store reads) and has no event loop:
the replayer (:mod:`ogrefs.lazy.trace.replay`) and the materializer's plan builder
call it from a worker thread, the mount before its daemon starts.  A resolver
belongs to the one thread that made it.
"""

from __future__ import annotations

import logging
import os
from bisect import bisect_right
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable

from ogrefs.errors import CorruptObject
from ogrefs.lazy.trace.newer_checkpoint import replace_stale_checkpoints
from ogrefs.repo.catalog import Catalog, Extent
from ogrefs.repo.traces import Entry, FoundTrace, find_trace

if TYPE_CHECKING:
    from ogrefs.repo import Repository

log = logging.getLogger(__name__)


def load_trace(repo: Repository, manifest: dict[str, Any], catalog: Catalog,
               notes: list[str] | None = None) -> list[Entry]:
    """The entries a mount of ``manifest`` (whose catalog is ``catalog``) replays ([] when there is none).  Blocking.

    The trace :func:`~ogrefs.repo.traces.find_trace` picks, with the reads of
    a training checkpoint older than the newest coherent one of its run in
    ``manifest`` turned into reads of that newest one: a run resumed from this
    snapshot loads the newest checkpoint, not the one the trace's run loaded.
    ``notes`` receives one line per checkpoint so replaced (else they are logged).
    """
    return entries_to_replay(find_trace(repo, manifest), manifest, catalog, notes)


def entries_to_replay(found: FoundTrace, manifest: dict[str, Any], catalog: Catalog,
                      notes: list[str] | None = None) -> list[Entry]:
    """:func:`load_trace` once the trace is found (a mount finds it beside fetching the catalog).  Blocking."""
    if not found.entries:
        return []
    return replace_stale_checkpoints(found.entries, manifest, found.recorded_on, lambda p: _chunk_starts(catalog, p),
                                     notes)


def _chunk_starts(catalog: Catalog, path: bytes) -> list[int]:
    """The offsets of a file's chunks in ``catalog`` ([] if it is no regular file there, or unreadable)."""
    try:
        node = catalog.resolve(path)
        return [e.offset for e in catalog.extents(node.ino)] if node is not None and node.is_reg else []
    except CorruptObject as exc:
        log.warning("trace: %s: %s", os.fsdecode(path), exc)
        return []


@dataclass(frozen=True)
class Resolved:
    """The extent of file ``ino`` that an entry read."""

    ino: int
    extent: Extent


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
