"""Bounded memory of catalog answers the vfs gives again and again: a snapshot never changes.

Every FUSE request costs a round trip to the daemon, and the kernel sends
some on every use however long it caches names, attributes and pages: an
OPEN and a RELEASE per ``open()``, an OPENDIR, READDIRPLUS and RELEASEDIR
per listing.  A program started a second time (the next training step, its
``import torch``) repeats some 1,700 opens and 220 listings, all served from
the page cache, and each of those requests asked SQLite for the same inode
row or the same first page of a directory.  The answers never change, so
the vfs keeps them here and a warm request costs no query.

A cold step asks too: ~2,900 lookups for the hf shape's step, each a query
for the entry and one for its size in blocks, and a query gives up the GIL:
when one of the mount's fetch or materializer threads takes it, the loop
sleeps until it is handed back and then waits for a core (a lazy run's
lookups waited 2.5x as long as a bare mount's).  A directory looked up in a
second time is therefore read whole, once, in a worker thread, with its
entries' attributes (:meth:`Remembered.child`): the names an import probes
next, present or not, are answered from a dict.

:class:`BoundedCache` is a plain dict with first-in-first-out eviction by
weight (an inode weighs 1, a page of a listing its entries): old entries go
first, and the bound holds memory to a few MiB whatever the tree's size.

Who owns what: a cache belongs to its owner's trio loop (the SnapshotFS or
the PagePusher); worker threads never touch it (a directory read whole is
read in one and handed back; the loop keeps it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Generic, TypeVar

import trio

from ogrefs.errors import CorruptObject
from ogrefs.repo.catalog import Inode

if TYPE_CHECKING:
    from ogrefs.lazy.fs.types import LocalCopy
    from ogrefs.repo.catalog import Catalog

#: Inode rows and complete local paths kept, and entries of first listing pages kept: a few MiB each at most,
#: several times what a training step opens and lists (the pointer box: 1,674 files, 220 directories).
NODE_CACHE_ENTRIES = 16384
LISTING_CACHE_ENTRIES = 16384
#: A directory is read whole for lookups at its second lookup and kept when it holds at most DIR_INDEX_MAX
#: entries (a larger one, a dataset's shards, goes on being asked name by name); DIR_INDEX_ENTRIES bound them all.
DIR_INDEX_AFTER = 2
DIR_INDEX_MAX = 2048
DIR_INDEX_ENTRIES = 32768

#: :meth:`Remembered.child`'s answer when the directory is not read whole (ask the catalog)
NOT_INDEXED: Any = object()
_NOT_KEPT: dict = {}  # the index of a directory over DIR_INDEX_MAX entries, or one that could not be read

K = TypeVar("K")
V = TypeVar("V")


class BoundedCache(Generic[K, V]):
    """A dict of at most ``max_weight`` total weight; the oldest entries are dropped first."""

    def __init__(self, max_weight: int) -> None:
        self.max_weight = max_weight
        self._items: dict[K, tuple[V, int]] = {}
        self._weight = 0

    def get(self, key: K) -> V | None:
        item = self._items.get(key)
        return None if item is None else item[0]

    def put(self, key: K, value: V, weight: int = 1) -> None:
        if weight > self.max_weight:
            return
        old = self._items.pop(key, None)
        if old is not None:
            self._weight -= old[1]
        while self._weight + weight > self.max_weight:
            oldest = next(iter(self._items))
            self._weight -= self._items.pop(oldest)[1]
        self._items[key] = (value, weight)
        self._weight += weight

    def __len__(self) -> int:
        return len(self._items)

    @property
    def weight(self) -> int:
        return self._weight


class Remembered:
    """What the vfs asks at every open and listing, asked once: inode rows, first pages, complete local copies.

    ``first_page(ino)`` reads a directory's first page of entries with their
    attributes (the vfs's); ``local`` is the vfs's LocalCopy or None.  Only
    answers that cannot change are kept: an inode that exists, a page, the
    path of a copy once complete (a file once complete stays so, at the same
    path; each handle still checks the copy's bytes at its first read).
    """

    def __init__(self, catalog: "Catalog", local: "LocalCopy | None",
                 first_page: Callable[[int], list[tuple[bytes, Any]]],
                 listing: Callable[[int, int], list[tuple[bytes, Any]]]) -> None:
        self.catalog = catalog
        self.local = local
        self._read_first_page = first_page
        self._read_listing = listing  # blocking: (directory, at most n) -> [(name, attributes)] in name order
        self._indexes: BoundedCache[int, dict[bytes, Any]] = BoundedCache(DIR_INDEX_ENTRIES)
        self._lookups_in: BoundedCache[int, int] = BoundedCache(NODE_CACHE_ENTRIES)
        self._nodes: BoundedCache[int, Inode] = BoundedCache(NODE_CACHE_ENTRIES)
        self._pages: BoundedCache[int, list[tuple[bytes, Any]]] = BoundedCache(LISTING_CACHE_ENTRIES)
        self._local_paths: BoundedCache[int, bytes] = BoundedCache(NODE_CACHE_ENTRIES)

    def node(self, ino: int) -> Inode | None:
        node = self._nodes.get(ino)
        if node is None and (node := self.catalog.get(ino)) is not None:
            self._nodes.put(ino, node)
        return node

    def remember(self, node: Inode) -> None:
        """An inode row the vfs has just read (a lookup's): the open that follows asks no query."""
        self._nodes.put(node.ino, node)

    async def child(self, parent: int, name: bytes) -> Any:
        """``name``'s attributes in directory ``parent`` read whole; None: no such entry; NOT_INDEXED: not read
        whole (its first lookup, over DIR_INDEX_MAX entries, a damaged row, or being read by another lookup):
        the caller asks the catalog for this one name.

        The second lookup in a directory reads it, in a worker thread: up to
        DIR_INDEX_MAX + 1 rows are more than the loop reads inline.
        """
        index = self._indexes.get(parent)
        if index is None:
            seen = (self._lookups_in.get(parent) or 0) + 1
            self._lookups_in.put(parent, seen)
            if seen == DIR_INDEX_AFTER:
                index = await self._read_whole(parent)
        if index is None or index is _NOT_KEPT:
            return NOT_INDEXED
        return index.get(name)

    async def _read_whole(self, parent: int) -> dict[bytes, Any]:
        try:
            entries = await trio.to_thread.run_sync(self._read_listing, parent, DIR_INDEX_MAX + 1)
        except CorruptObject:  # one malformed row: the names that are fine are still found one by one
            entries = None
        if entries is None or len(entries) > DIR_INDEX_MAX:
            index, weight = _NOT_KEPT, 1
        else:
            index, weight = dict(entries), len(entries) + 1
        self._indexes.put(parent, index, weight)
        return index

    def first_page(self, ino: int) -> list[tuple[bytes, Any]]:
        page = self._pages.get(ino)
        if page is None:
            page = self._read_first_page(ino)
            self._pages.put(ino, page, len(page) + 1)
        return page

    def local_path(self, ino: int) -> bytes | None:
        """The complete local copy of ``ino``, or None (no local copy, or not complete yet: asked again)."""
        if self.local is None:
            return None
        path = self._local_paths.get(ino)
        if path is None and (path := self.local.local_path(ino)) is not None:
            self._local_paths.put(ino, path)
        return path
