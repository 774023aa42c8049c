"""Page-cache push: the small complete local copies of a directory a program crawls go into the kernel's
page cache ahead of their reads.

A crawl (tar, rsync, an import of a big package) opens file after file of
one directory; each open, read and close is a round trip to the mount
daemon.  With the neighbours' bytes in the kernel's page cache their reads
are served there, so one round trip is left per file (the open).  The first
small local file opened in a directory sends its small local neighbours
(:meth:`PagePusher.opened`); a listing that reaches its end inside a crawl
sends its own (:meth:`PagePusher.listed`).  Once per directory per mount,
again after the kernel forgot the directory (:meth:`PagePusher.forgotten`);
docs/mount.md.

Who owns what: a PagePusher belongs to its SnapshotFS and so to the trio
loop.  The push channel is the loop's too: :meth:`PagePusher._queue` sends,
:meth:`PagePusher.run` (a task in the mount's nursery) receives; its worker
thread (:func:`push_files`) gets a tuple of (inode, size) and thread-safe
functions: the adapter's store, the local copy's path query (its own SQLite
connection per thread) and the check of a copy's bytes against the catalog.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Callable

import trio

from ogrefs.errors import OgrefsError
from ogrefs.lazy.fs.metacache import BoundedCache
from ogrefs.lazy.fetch.threadnice import to_background_thread
from ogrefs.repo.catalog import ROOT_INO, Catalog
from ogrefs.units import MiB

if TYPE_CHECKING:
    from ogrefs.lazy.fs.types import LocalCopy, VfsStats

log = logging.getLogger(__name__)


#: Page-cache push: complete local copies of files up to this size ...
PUSH_FILE_MAX = 128 * 1024
#: ... up to this many bytes per directory, go into the kernel's page cache together.
PUSH_DIR_MAX = 16 * MiB
PUSH_BATCH = 64  # files opened and read ahead at once
PARENT_CACHE_ENTRIES = 16384


class PagePusher:
    """Sends directories' small local files to the kernel's page cache; see the module docstring."""

    def __init__(self, catalog: Catalog, local: "LocalCopy", page_cache: Callable[[int, bytes], None],
                 chunk_id: Callable[[bytes], bytes], stats: "VfsStats", kernel_holds: Callable[[int], bool],
                 kernel_has_pages: Callable[[int], bool]) -> None:
        self.catalog = catalog
        self.local = local
        # the adapter's: puts a file's whole content into the kernel's page cache (thread-safe, worker threads)
        self.page_cache = page_cache
        self.chunk_id = chunk_id
        self.stats = stats
        self._kernel_holds = kernel_holds  # whether the kernel knows an inode (it drops a push for any other)
        self._dirs_pushed: set[int] = set()  # directories whose small local files went to the page cache
        # files whose pages the kernel already has (a read answered, a push at open; it keeps them: keep_cache),
        # the vfs's answer: pushing them again is only CPU, taken from the reads of the program that opened
        # their neighbour
        self._kernel_has_pages = kernel_has_pages
        # each file's directory (a snapshot never changes): an open asked SQLite for it every time
        self._parents: BoundedCache[int, int] = BoundedCache(PARENT_CACHE_ENTRIES)
        self._send, self._recv = trio.open_memory_channel[tuple[int, int]](64)
        self.in_flight = 0  # directories queued and not yet pushed (loop-owned, like the rest)

    def opened(self, ino: int) -> None:
        """A small file with a complete local copy was opened: its directory's others go too."""
        parent = self._parents.get(ino)
        if parent is None:
            parent = self.catalog.parent_of(ino)
            self._parents.put(ino, parent)
        if parent not in self._dirs_pushed:
            self._queue(parent, ino)

    def listed(self, ino: int) -> None:
        """A listing of directory ``ino`` reached its end: inside a crawl, its small files go to the page cache now.

        A crawl lists a directory, then opens its files in listing order.  When
        the parent's files were pushed, this directory is most likely next, and
        pushing at the listing puts its first files in the page cache before
        their opens arrive, instead of racing them.
        """
        if ino in self._dirs_pushed or ino == ROOT_INO:
            return
        if self.catalog.parent_of(ino) in self._dirs_pushed:
            self._queue(ino, 0)

    def forgotten(self, ino: int) -> None:
        """The kernel forgot inode ``ino``: a directory took its files' cached pages along, push again next time."""
        self._dirs_pushed.discard(ino)

    def _queue(self, parent: int, opened: int) -> None:
        try:
            self._send.send_nowait((parent, opened))
        except trio.WouldBlock:
            return  # busy: a later open in this directory asks again
        self._dirs_pushed.add(parent)
        self.in_flight += 1

    async def run(self) -> None:
        """Serve page-cache pushes until cancelled (a task in the mount's nursery)."""
        async for parent, opened in self._recv:
            try:
                await self._push_dir(parent, opened)
            except Exception as exc:  # noqa: BLE001 - a push only saves round trips
                log.warning("page-cache push for directory inode %d failed: %s", parent, exc)
            finally:
                self.in_flight -= 1

    async def _push_dir(self, parent: int, opened: int) -> None:
        rows = await to_background_thread(self.catalog.small_files, parent, PUSH_FILE_MAX)
        candidates = tuple((ino, size) for ino, size in rows
                           if ino != opened and not self._kernel_has_pages(ino) and self._kernel_holds(ino))
        if candidates:
            self.stats.page_cache_pushed += await to_background_thread(
                push_files, self.page_cache, self.local.local_paths, candidates, self._holds_catalog_bytes)

    def _holds_catalog_bytes(self, ino: int, data: bytes) -> bool:
        """Worker thread: whether ``data`` is file ``ino`` as the catalog names it, chunk by chunk."""
        try:
            extents = self.catalog.extents(ino)
        except OgrefsError:
            return False
        return all(self.chunk_id(data[e.offset:e.end]) == e.chunk for e in extents)


def push_files(store: Callable[[int, bytes], None], local_paths: Callable[[list[int]], dict[int, bytes]],
                candidates: tuple[tuple[int, int], ...],
                is_right: Callable[[int, bytes], bool] = lambda ino, data: True) -> int:
    """Worker thread: hand the bytes of the complete local copies among ``candidates`` (ino, size) to ``store``.

    In listing order, up to ``PUSH_DIR_MAX`` bytes.  Files go in batches: each
    batch is opened and announced to the kernel's read-ahead first
    (WILLNEED), so a cold disk reads them in parallel rather
    than one small read at a time.  A copy that cannot be read whole is
    skipped (its reads then come as usual); so is an inode the kernel no longer
    knows (``store`` raises OSError).  Returns how many files were stored.
    """
    paths = local_paths([ino for ino, _ in candidates])
    files: list[tuple[int, bytes, int]] = []
    total = 0
    for ino, size in candidates:
        path = paths.get(ino)
        if path is None:
            continue
        if total + size > PUSH_DIR_MAX:
            break
        files.append((ino, path, size))
        total += size
    done = 0
    for i in range(0, len(files), PUSH_BATCH):
        fds: list[tuple[int, int, int]] = []
        try:
            for ino, path, size in files[i:i + PUSH_BATCH]:
                try:
                    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
                except OSError:
                    continue
                fds.append((ino, fd, size))
                os.posix_fadvise(fd, 0, size, os.POSIX_FADV_WILLNEED)
            for ino, fd, size in fds:
                try:
                    data = os.pread(fd, size + 1, 0)
                    if len(data) == size and is_right(ino, data):  # a damaged copy is not pushed
                        store(ino, data)
                        done += 1
                except OSError:
                    continue
        finally:
            for _, fd, _ in fds:
                os.close(fd)
    return done
