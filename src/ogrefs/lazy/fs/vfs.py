"""A snapshot as a read-only file system: protocol-free, async, testable without mounting.

Metadata comes from the snapshot's SQLite catalog alone, one query at a time:
there is no in-memory tree, so a snapshot of a million files mounts as fast as
one of a thousand and memory does not grow with the file count.  Inode numbers
are the catalog's: stable across mounts, shared by hardlinks.  File data comes
from the :class:`~ogrefs.lazy.fetch.fetcher.Fetcher`.

Catalog access, decided: point queries (one inode, one directory entry, the
xattrs of one inode) run inline on the trio thread.  They are indexed lookups
in a local, immutable SQLite file and take microseconds, less than the hop to
a worker thread would.  Queries that scale with the data (a page of a
directory listing, the extent list of a large file) run in a worker thread.
The same rule holds for complete local copies (:mod:`ogrefs.lazy.fs.localread`):
a small read the page cache holds is one ``pread`` inline, any other goes to
a worker thread.

Per-open-file state (:class:`_OpenFile`) holds the file's extents, their
cumulative start offsets (bisect maps a read offset to its chunk) and the
read-ahead position, looked up at the handle's first read through the store
(an open whose pages the kernel caches, a program started again, is never
read and costs no query).  A read that continues where the
previous one ended is sequential: the handle then asks the fetcher for the
chunks of the next ``window`` bytes (doubling up to ``readahead_max``), which
the fetcher coalesces into few ranged GETs.

Fewer round trips: a snapshot without extended attributes answers getxattr
with ENOSYS (the kernel stops asking), and the small complete local copies of
a directory a program is crawling go into the kernel's page cache ahead of
their reads (:mod:`ogrefs.lazy.fs.pagepush`; docs/mount.md).

Who owns what: a SnapshotFS, its lookup counts and its handle tables belong to
the trio loop; every method is called from trio tasks only.  Worker threads
get the Catalog (thread-safe: one SQLite connection per thread) and an inode
number or name, and return fresh lists.  The page-cache pusher
(:class:`~ogrefs.lazy.fs.pagepush.PagePusher`) and the open-time push
(:class:`~ogrefs.lazy.fs.openpush.OpenPush`) belong to the SnapshotFS and say
who owns their channel and nursery.

Errors: methods raise :class:`~.fs.types.FsError` (an errno); :func:`~.fs.types.errno_for` is the one
place that turns any exception into an errno for an adapter.
"""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
from bisect import bisect_right
from typing import Any, Callable

import trio

from ogrefs.repo import codec
from ogrefs.repo.catalog import Catalog, Extent, Inode
from ogrefs.errors import OgrefsError
from ogrefs.lazy.fetch.fetcher import FetchError, Fetcher, Keep, Priority
from ogrefs.lazy.fs.types import AccessRecorder, Attr, FsError, LocalCopy, StatFs, VfsStats
from ogrefs.repo.chunkref import ChunkRef
from ogrefs.lazy.fs.localread import LocalReads
from ogrefs.lazy.fs.metacache import NOT_INDEXED, Remembered
from ogrefs.lazy.fs.openpush import OPEN_PUSH_MAX, OpenPush, whole_in_memory
from ogrefs.lazy.fs.pagepush import PUSH_FILE_MAX, PagePusher
from ogrefs.lazy.fetch.residency import IN_TREE
from ogrefs.units import MiB

log = logging.getLogger(__name__)


#: The snapshot never changes, so the kernel may cache names and attributes "forever".
CACHE_TIMEOUT = 24 * 3600.0
#: The first page of a listing is read inline (most directories are small: one
#: indexed query beats a thread hop); later pages, READDIR_PAGE entries each, in a thread.
READDIR_FIRST_PAGE = 64
READDIR_PAGE = 512
#: Files up to this size (a few dozen chunks) load their extent list inline at open.
INLINE_EXTENTS_BELOW = 16 * MiB
#: A file read up to this size is marked as the kernel's (``_kernel_pages``): the largest either pusher sends.
KERNEL_PAGES_MAX = max(OPEN_PUSH_MAX, PUSH_FILE_MAX)
#: Directory read-ahead: files up to this size are fetched with their small neighbours ...
SIBLING_FILE_MAX = 256 * 1024
#: ... up to this many stored bytes per directory (memory LRU is 128 MiB).
SIBLING_BYTES_MAX = 4 * MiB
BLOCK_SIZE = 4096
#: On a mount without a local copy (read-only, --no-materialize), a file at least this large read front to back
#: streams (a checkpoint, a data shard): what it fetches goes to memory, not to the disk cache (``Keep.LOCAL``).
#: Writing it there cost the daemon 0.6-1.0 CPU-s per GB of a 2.6-2.9 total (docs/benchmarks.md, issue 49), the
#: kernel's page cache keeps the file for the mount anyway (keep_cache), and a 100 GB checkpoint would push every
#: small file a remount needs out of a 10 GiB cache.  A mount that builds a local copy keeps caching: its
#: materialization finds there what it did not adopt, instead of fetching it again.
STREAM_FILE_MIN = 256 * MiB


#: Extended attributes overlayfs interprets on its lower layers (metacopy, redirect, opaque, origin):
#: a snapshot of an overlay's upper directory carries them, and served as they are they make
#: overlayfs read a file as a metadata-only copy (EPERM) or follow a redirect. The mount never
#: serves them (restore still writes them); docs/mount.md.
OVERLAY_XATTRS = (b"trusted.overlay.", b"user.overlay.")


async def _extents_of(catalog: Catalog, ino: int, size: int) -> list[Extent]:
    """A file's extents: inline up to INLINE_EXTENTS_BELOW (a handful of rows: cheaper than a thread hop, and
    an import reads many small files), else in a worker thread."""
    if size <= INLINE_EXTENTS_BELOW:
        return catalog.extents(ino)
    return await trio.to_thread.run_sync(catalog.extents, ino)


class _OpenFile:
    __slots__ = ("ino", "size", "extents", "starts", "refs", "next_offset", "window", "ahead", "local_fd",
                 "partial_fd", "verified", "local_pending", "store_read", "span", "span_start", "span_loading",
                 "local_next", "dropped_fd")

    def __init__(self, ino: int, size: int, extents: list[Extent]) -> None:
        self.ino = ino
        self.size = size
        self.set_extents(extents)
        self.verified: set[int] = set()  # indices of extents whose local bytes were read and found right
        self.next_offset = 0  # where a sequential reader reads next
        self.window = 0  # read-ahead distance; 0 until reads look sequential
        self.ahead = 0  # index of the first extent not yet requested by read-ahead
        self.local_fd: int | None = None  # the complete local copy, when there is one
        self.dropped_fd: int | None = None  # the complete local copy found damaged: closed at release
        self.partial_fd: int | None = None  # the incomplete local copy, opened for its done chunks
        # the complete local copy, opened at the first read: a file opened again whose pages the kernel
        # caches (an import run a second time) is never read, so its open costs no query and no fd
        self.local_pending: bytes | None = None
        self.store_read = False  # the handle has read through the store (its small neighbours were asked for)
        # a sequential reader of the complete local copy: the verified span it is served from (lazy/fs/localread.py)
        self.span: memoryview | None = None
        self.span_start = 0
        self.span_loading: trio.Event | None = None
        self.local_next = 0

    def set_extents(self, extents: list[Extent]) -> None:
        self.extents = extents
        self.starts = [e.offset for e in extents]
        self.refs = [ChunkRef.from_extent(e) for e in extents]


class _OpenDir:
    __slots__ = ("ino", "base", "entries", "complete", "listed")

    def __init__(self, ino: int) -> None:
        self.ino = ino
        self.listed = False  # the kernel has been told the end of the listing
        self.base = 0  # directory position of entries[0]
        self.entries: list[tuple[bytes, Attr]] = []
        self.complete = False  # entries reach the end of the directory


def _read_ahead(f: _OpenFile, offset: int, end: int, next_index: int, window_min: int,
                window_max: int) -> list[ChunkRef]:
    """On sequential reads, the chunks of the next ``window`` bytes not yet requested.

    Chunks are requested a quarter window at a time, once less than three
    quarters of a window is requested ahead of the reader: each request to
    the fetcher is a run of neighbours it can fetch with one GET, and the
    next run is on its way long before the reader reaches it.
    """
    # the kernel's own read-ahead sends several requests at once, which may arrive out of order:
    # anything near where the reader is counts as sequential
    slack = f.window + 2 * MiB
    if offset == 0 or f.next_offset - slack <= offset <= f.next_offset + slack:
        f.window = min(max(f.window * 2, window_min), window_max)
    else:
        f.window = 0
        f.ahead = 0
    f.next_offset = max(end, f.next_offset) if f.window else end
    if not f.window:
        return []
    start = max(next_index, f.ahead)
    if start < len(f.extents) and f.extents[start].offset - end >= f.window * 3 // 4:
        return []  # still most of a window requested ahead
    stop = start
    limit = end + f.window
    while stop < len(f.extents) and f.extents[stop].offset < limit:
        stop += 1
    f.ahead = max(f.ahead, stop)
    return f.refs[start:stop]


class SnapshotFS:
    """The file-system operations of one mounted snapshot."""

    def __init__(self, catalog: Catalog, fetcher: Fetcher, *, readahead_max: int = 32 * MiB,
                 readahead_min: int = 4 * MiB, recorder: AccessRecorder | None = None,
                 local: LocalCopy | None = None,
                 page_cache: Callable[[int, bytes], None] | None = None, open_push: bool = True,
                 chunk_id: Callable[[bytes], bytes] = codec.chunk_id,
                 chunk_hasher: Callable[[], Any] = codec.chunk_hasher) -> None:
        self.catalog = catalog
        # Names a chunk from its bytes (the repository's: keyed when encrypted); every chunk read from the
        # local copy is checked with it once per open file, in a worker thread (docs/reliability.md).
        self.chunk_id = chunk_id
        self.fetcher = fetcher
        self.recorder = recorder  # told the first chunks each read touches (access trace)
        self.local = local  # complete local copies of files are read from there, never from the store
        self._dirs_prefetched: set[int] = set()  # directories whose small files were requested together
        self.readahead_max = readahead_max
        self.readahead_min = readahead_min
        self.stats = VfsStats()
        # page_cache: puts a file's whole content into the kernel's page cache (the adapter's); its reads
        # then never reach the daemon. None: no such thing, and no pushes
        self._local_reads = LocalReads(catalog, chunk_id, self.stats, recorder, chunk_hasher,
                                       local.written_identity if local is not None else None)
        self._lookups: dict[int, int] = {}
        # small files whose pages the kernel holds (a read answered, a push at open; keep_cache) until it forgets
        # them: neither pusher sends them again
        self._kernel_pages: set[int] = set()
        # larger files this mount has answered READs of: the kernel may cache their pages (keep_cache), so they
        # stay with the daemon rather than go to a reader that bypasses it (verified_copy)
        self._daemon_read: set[int] = set()
        self._pusher = (PagePusher(catalog, local, page_cache, chunk_id, self.stats, self._lookups.__contains__,
                                   self._kernel_pages.__contains__)
                        if page_cache is not None and local is not None else None)
        # small files whose chunks memory holds go to the page cache at their open (lazy/fs/openpush.py)
        self.open_push = (OpenPush(page_cache, self._kernel_pages)
                          if page_cache is not None and open_push else None)
        self._files: dict[int, _OpenFile] = {}
        self._handles: dict[int, int] = {}  # inode -> its open handles (a READ can only come through one)
        # the answers every open and listing asks for, asked of the catalog once (a snapshot never changes)
        self._memo = Remembered(catalog, local, lambda ino: self._page(ino, None, 0, READDIR_FIRST_PAGE),
                                lambda ino, n: self._page(ino, None, 0, n))
        self._dirs: dict[int, _OpenDir] = {}
        self._next_fh = 1
        self._last_request = -float("inf")  # trio time of the latest application request
        counts = catalog.counts()
        self._inode_count = counts["inodes"]
        self._data_bytes = catalog.unique_data_total()
        self._has_xattrs = catalog.has_xattrs()

    def idle_for(self) -> float:
        """Seconds since an application last asked the mount for anything (lookup, open, read, listing)."""
        return trio.current_time() - self._last_request

    def _busy(self) -> None:
        self._last_request = trio.current_time()

    # -- attributes --------------------------------------------------------------------
    def _attr(self, node: Inode) -> Attr:
        return Attr(node, self._blocks(node, self.catalog.data_bytes(node.ino) if node.is_reg and node.size else 0))

    @staticmethod
    def _blocks(node: Inode, data_bytes: int) -> int:
        if node.is_reg:
            return (data_bytes + 511) // 512
        if node.is_lnk:
            return 0
        return (node.size + 511) // 512

    def _node(self, ino: int) -> Inode:
        node = self._memo.node(ino)
        if node is None:
            raise FsError(errno.ENOENT)
        return node

    async def getattr(self, ino: int) -> Attr:
        self.stats.getattrs += 1
        return self._attr(self._node(ino))

    async def lookup(self, parent: int, name: bytes) -> Attr:
        """The entry ``name`` in directory ``parent``; counts one kernel reference."""
        self.stats.lookups += 1
        self._busy()
        if name == b".":
            attr = self._attr(self._node(parent))
        elif name == b"..":
            attr = self._attr(self._node(self.catalog.parent_of(parent)))
        elif (attr := await self._memo.child(parent, name)) is NOT_INDEXED:
            node = self.catalog.lookup(parent, name)
            attr = self._attr(node) if node is not None else None
        if attr is None:
            if not self._node(parent).is_dir:
                raise FsError(errno.ENOTDIR)
            raise FsError(errno.ENOENT)
        self._memo.remember(attr.node)
        self._ref(attr.node.ino)
        return attr

    def _ref(self, ino: int) -> None:
        self._lookups[ino] = self._lookups.get(ino, 0) + 1

    def forget(self, items: list[tuple[int, int]]) -> None:
        """The kernel dropped ``n`` references to each inode; never raises."""
        for ino, n in items:
            left = self._lookups.get(ino, 0) - n
            if left > 0:
                self._lookups[ino] = left
            else:
                self._lookups.pop(ino, None)
                self._kernel_pages.discard(ino)
                if self._pusher is not None:
                    self._pusher.forgotten(ino)

    def lookup_count(self, ino: int) -> int:
        return self._lookups.get(ino, 0)

    @property
    def referenced_inodes(self) -> int:
        return len(self._lookups)

    async def readlink(self, ino: int) -> bytes:
        node = self._node(ino)
        if not node.is_lnk:
            raise FsError(errno.EINVAL)
        return node.target or b""

    async def getxattr(self, ino: int, name: bytes) -> bytes:
        if not self._has_xattrs:
            # ENOSYS tells the kernel to stop asking (it then answers "not supported" itself):
            # overlayfs asks every lower file it looks up for trusted.overlay.metacopy, one
            # round trip each, for a snapshot that holds no extended attribute at all.
            raise FsError(errno.ENOSYS)
        if not name.startswith(OVERLAY_XATTRS):
            for n, value in self.catalog.xattrs(ino):
                if n == name:
                    return value
        self._node(ino)
        raise FsError(errno.ENODATA)

    async def listxattr(self, ino: int) -> list[bytes]:
        self.stats.xattr_lists += 1
        self._node(ino)
        return [n for n, _ in self.catalog.xattrs(ino) if not n.startswith(OVERLAY_XATTRS)]

    async def statfs(self) -> StatFs:
        return StatFs(bsize=BLOCK_SIZE, blocks=(self._data_bytes + BLOCK_SIZE - 1) // BLOCK_SIZE,
                      files=self._inode_count, namemax=255)

    # -- directories ------------------------------------------------------------------------
    async def opendir(self, ino: int) -> int:
        self.stats.dir_opens += 1
        if not self._node(ino).is_dir:
            raise FsError(errno.ENOTDIR)
        fh = self._new_fh()
        self._dirs[fh] = _OpenDir(ino)
        return fh

    def _page(self, ino: int, after: bytes | None, skip: int, size: int) -> list[tuple[bytes, Attr]]:
        """Up to ``size`` entries after ``after`` (or ``skip`` entries in), with their attributes."""
        rows = self.catalog.children(ino, after=after, limit=skip + size)[skip:]
        data = self.catalog.data_bytes_many([n.ino for _, n in rows if n.is_reg and n.size])
        return [(name, Attr(node, self._blocks(node, data.get(node.ino, 0)))) for name, node in rows]

    async def readdir(self, fh: int, start: int, emit: Callable[[bytes, Attr, int], bool]) -> None:
        """Report entries from position ``start`` through ``emit(name, attr, next_position)``.

        ``emit`` returns False when the reply is full; each accepted entry counts
        one kernel reference (readdirplus).  Positions are indexes in name order;
        the handle keeps a page of entries so a listing costs one query per page.
        """
        d = self._dirs.get(fh)
        if d is None:
            raise FsError(errno.EBADF)
        self._busy()
        pos = start
        while True:
            i = pos - d.base
            if not 0 <= i < len(d.entries):
                if i == len(d.entries) and d.complete:
                    if not d.listed:
                        d.listed = True
                        if self._pusher is not None:
                            self._pusher.listed(d.ino)
                    return
                if i == len(d.entries) and d.entries:
                    after, skip = d.entries[-1][0], 0
                else:  # the first page, or a seek elsewhere (rewinddir, telldir/seekdir)
                    after, skip = None, pos
                if pos == 0:
                    size = READDIR_FIRST_PAGE
                    page = self._memo.first_page(d.ino)
                else:
                    size = READDIR_PAGE
                    page = await trio.to_thread.run_sync(self._page, d.ino, after, skip, size)
                d.base, d.entries, d.complete = pos, page, len(page) < size
                if not page:
                    return
                i = 0
            name, attr = d.entries[i]
            if not emit(name, attr, pos + 1):
                return
            self._ref(attr.node.ino)
            pos += 1

    def releasedir(self, fh: int) -> None:
        self._dirs.pop(fh, None)

    # -- files ------------------------------------------------------------------------------
    def _new_fh(self) -> int:
        fh = self._next_fh
        self._next_fh += 1
        return fh

    def _new_file(self, ino: int, size: int) -> tuple[int, _OpenFile]:
        fh = self._new_fh()
        f = self._files[fh] = _OpenFile(ino, size, [])
        self._handles[ino] = self._handles.get(ino, 0) + 1
        return fh, f

    async def open(self, ino: int, flags: int) -> int:
        self._busy()
        node = self._node(ino)
        if flags & os.O_ACCMODE != os.O_RDONLY or flags & os.O_TRUNC:
            raise FsError(errno.EROFS)
        if node.is_dir:
            raise FsError(errno.EISDIR)
        if not node.is_reg:
            raise FsError(errno.ENXIO)
        if (path := self._memo.local_path(ino)) is not None:
            # a complete local copy: opened there at the first read (_open_local), not now
            fh, f = self._new_file(ino, node.size)
            f.local_pending = path
            self.stats.opens += 1
            self.stats.local_opens += 1
            if self._pusher is not None and node.size <= PUSH_FILE_MAX:
                self._pusher.opened(ino)
            return fh
        # the extents are looked up at the first read (read, _extents_of), not now: a file opened again whose
        # pages the kernel caches (the next training step's imports: ~1,700 opens) is never read
        fh, f = self._new_file(ino, node.size)
        self.stats.opens += 1
        if self.open_push is not None and self.open_push.wanted(ino, node.size):
            await self._push_at_open(f)
        return fh

    def handles_of(self, ino: int) -> int:
        """The open handles of ``ino`` (on the loop)."""
        return self._handles.get(ino, 0)

    async def verified_copy(self, ino: int) -> int | None:
        """An fd of ``ino``'s complete local copy, every byte of it the snapshot's (named, or as the materializer
        wrote it from verified chunks: :meth:`LocalReads.whole <ogrefs.lazy.fs.localread.LocalReads.whole>`), for a reader
        that bypasses :meth:`read` (FUSE passthrough: mount/passthrough.py); None for a file without one or of
        at most ``KERNEL_PAGES_MAX`` bytes (those are pushed to the kernel's page cache instead), and for one this
        mount has answered READs of: its pages may be in the kernel's cache, which serves the next reader at no
        cost, where a bypassing reader would name the copy and read it from disk again; and None while an access
        trace is recorded: the daemon would not see the reads the trace is made of.  The caller closes the fd."""
        node = self._node(ino)
        if (not node.is_reg or node.size <= KERNEL_PAGES_MAX or ino in self._daemon_read
                or (self.recorder is not None and self.recorder.active)
                or (path := self._memo.local_path(ino)) is None):
            return None
        return await self._local_reads.whole(ino, path, node.size)

    async def _push_at_open(self, f: _OpenFile) -> None:
        """A small file memory holds whole goes to the page cache before its open is answered (lazy/fs/openpush.py)."""
        assert self.open_push is not None
        try:
            f.set_extents(await _extents_of(self.catalog, f.ino, f.size))  # (inline: OPEN_PUSH_MAX is small)
        except (OgrefsError, sqlite3.Error):
            return  # the read asks again, and says what is wrong
        data = whole_in_memory(f.size, f.extents, self.fetcher.residency.in_memory)
        # with no other handle of the file open no READ of it can be on its way, so no page of it is locked
        # waiting for the loop: stored on the loop, like the answer to the READ it replaces (lazy/fs/openpush.py)
        if data is None or not await self.open_push.push(f.ino, data, inline=self._handles[f.ino] == 1):
            return
        self.stats.open_pushed += 1
        if self.recorder is not None and self.recorder.active:  # what the read it replaces would have recorded
            for ext in f.extents:
                self.recorder.record(f.ino, ext.offset, ext.end - ext.offset)

    async def _prefetch_siblings(self, ino: int) -> None:
        """The first small file opened in a directory brings its small neighbours along.

        An import opens many small files of one directory one after the other;
        snapshots pack a directory's files next to each other, so their chunks
        are one ranged GET instead of one round trip per file (directory
        read-ahead).  Once per directory per mount.
        """
        parent = self.catalog.parent_of(ino)
        if parent in self._dirs_prefetched:
            return
        self._dirs_prefetched.add(parent)
        chunks = await trio.to_thread.run_sync(self.catalog.small_sibling_chunks, parent, SIBLING_FILE_MAX,
                                               SIBLING_BYTES_MAX)
        refs = [ChunkRef(chunk, loc.pack, loc.offset, loc.stored_len, loc.raw_len) for chunk, loc in chunks]
        if refs:
            self.fetcher.prefetch(refs, Priority.READ)

    def pushes_idle(self) -> bool:
        """Whether every page-cache push asked for so far is done (on the loop)."""
        return self._pusher is None or self._pusher.in_flight == 0

    async def run_pushes(self) -> None:
        """Serve page-cache pushes until cancelled (a task in the mount's nursery; see :mod:`ogrefs.lazy.fs.pagepush`
        and :mod:`ogrefs.lazy.fs.openpush`)."""
        async with trio.open_nursery() as nursery:
            if self._pusher is not None:
                nursery.start_soon(self._pusher.run)
            if self.open_push is not None:
                nursery.start_soon(self.open_push.run)

    def release(self, fh: int) -> None:
        f = self._files.pop(fh, None)
        if f is not None:
            self._local_reads.drop_span(f)
            if (left := self._handles.pop(f.ino) - 1) > 0:
                self._handles[f.ino] = left
            for fd in (f.local_fd, f.partial_fd, f.dropped_fd):
                if fd is not None and fd >= 0:
                    os.close(fd)

    @property
    def open_files(self) -> int:
        return len(self._files)

    async def read(self, fh: int, offset: int, size: int) -> bytes | memoryview:
        """Up to ``size`` bytes at ``offset``; holes read as zeros; a chunk that cannot be had is EIO."""
        f = self._files.get(fh)
        if f is None:
            raise FsError(errno.EBADF)
        self._busy()
        end = min(offset + size, f.size)
        if offset >= end:
            return b""
        if f.local_pending is not None:
            await self._local_reads.open_pending(f, f.local_pending)
        if f.local_fd is not None:
            local_data = await self._local_reads.read(f, offset, end)
            if local_data is not None:
                self._served(f)
                return local_data
        if not f.store_read:  # the handle's first read through the store: its extents, its small neighbours
            if f.size <= SIBLING_FILE_MAX:
                await self._prefetch_siblings(f.ino)
            if not f.extents:  # (an open that tried a push has them)
                f.set_extents(await _extents_of(self.catalog, f.ino, f.size))
            f.store_read = True
        first = max(0, bisect_right(f.starts, offset) - 1)
        last = first
        while last < len(f.extents) and f.extents[last].offset < end:
            last += 1
        wanted = [k for k in range(first, last) if f.extents[k].end > offset]
        if self.recorder is not None and self.recorder.active:
            for k in wanted:
                self.recorder.record(f.ino, f.extents[k].offset, f.extents[k].end - f.extents[k].offset)
        ahead = _read_ahead(f, offset, end, last, self.readahead_min, self.readahead_max)
        keep = Keep.LOCAL if f.window and f.size >= STREAM_FILE_MIN and self.local is None else Keep.ALL
        if len(wanted) > 1 or ahead:
            # one call: the chunks of this read and of the read-ahead are probed and queued together (the
            # fetcher skips what the residency has: in memory, in the materializer's hand, in the local tree)
            self.fetcher.prefetch([f.refs[k] for k in wanted] + ahead, Priority.READ, keep)
        where = self.fetcher.residency.where if self.local is not None else None
        parts: list[bytes | memoryview] = []
        pos = offset
        try:
            for k in wanted:
                ext = f.extents[k]
                if ext.offset > pos:
                    parts.append(bytes(ext.offset - pos))
                    pos = ext.offset
                # the residency says where the chunk is: in the local tree it is read from there (unless
                # the copy is unreadable or damaged); in memory (cached, held, in the materializer's hand)
                # the fetcher answers at once; absent, the fetcher gets it
                if where is not None and where(f.refs[k].chunk) == IN_TREE and (
                        tree := await self._local_reads.done_chunk(f, ext, k, self.local.tree_path)) is not None:
                    data = tree
                else:
                    t0 = trio.current_time()
                    data = await self.fetcher.get(f.refs[k], Priority.READ, keep)
                    self.stats.read_wait += trio.current_time() - t0
                stop = min(end, ext.end)
                parts.append(memoryview(data)[pos - ext.offset:stop - ext.offset])
                pos = stop
        except FetchError as exc:
            self.stats.read_errors += 1
            path = await trio.to_thread.run_sync(self.catalog.path_of, f.ino)
            log.error("read of %s at offset %d failed: %s", os.fsdecode(path), offset, exc)
            raise FsError(errno.EIO) from None
        if pos < end:
            parts.append(bytes(end - pos))
        self.stats.reads += 1
        self.stats.bytes_read += end - offset
        self._served(f)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _served(self, f: _OpenFile) -> None:
        if f.size <= KERNEL_PAGES_MAX:
            self._kernel_pages.add(f.ino)
        else:
            self._daemon_read.add(f.ino)
