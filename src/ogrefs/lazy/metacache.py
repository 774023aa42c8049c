"""Bounded memory of catalog answers the vfs gives again and again: a snapshot never changes.

Every FUSE request costs a round trip to the daemon, and the kernel sends
some on every use however long it caches names, attributes and pages: an
OPEN and a RELEASE per ``open()``, an OPENDIR, READDIRPLUS and RELEASEDIR
per listing.  A program started a second time (the next training step, its
``import torch``) repeats some 1,700 opens and 220 listings, all served from
the page cache, and each of those requests asked SQLite for the same inode
row or the same first page of a directory.  The answers never change, so
the vfs keeps them here and a warm request costs no query.

:class:`BoundedCache` is a plain dict with first-in-first-out eviction by
weight (an inode weighs 1, a page of a listing its entries): old entries go
first, and the bound holds memory to a few MiB whatever the tree's size.

Who owns what: a cache belongs to its owner's trio loop (the SnapshotFS or
the PagePusher); worker threads never touch it.
"""

from __future__ import annotations

from typing import Generic, TypeVar

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
