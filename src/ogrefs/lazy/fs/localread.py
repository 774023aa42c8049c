"""Reads of complete local copies (the materializer's tree), verified before they are served.

A file whose local copy is complete is opened there (:meth:`LocalReads.open`)
and read there, never from the store; each chunk a handle reads is named
(BLAKE3, in a worker thread) the first time, so a copy damaged on disk since
it was written is never served: the handle then reads through the store for
good.  A read of up to ``LOCAL_INLINE_READ`` bytes is one ``pread`` inline (a
thread hop costs more than the read when a crawl opens thousands of small
files) when the page cache holds it (:func:`pread_if_cached`: cachestat(2),
then ``RWF_NOWAIT``); a read that would wait for the disk, and every larger
read, goes to a worker thread (:func:`pread`).

Who owns what: a LocalReads belongs to its SnapshotFS and so to the trio
loop, as do the handles it is given (their fd and the set of chunks found
right).  Worker threads get an fd, a size and an offset, or bytes to name,
and return new objects.  ``_cachestat`` (whether the kernel has cachestat)
is set once, by whichever caller first finds it missing; every call builds
its own ctypes buffers.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import stat
from bisect import bisect_right
from typing import TYPE_CHECKING, Callable, Protocol

import trio

from ogrefs.repo.catalog import Catalog, Extent

if TYPE_CHECKING:
    from ogrefs.lazy.fs.types import AccessRecorder, VfsStats

log = logging.getLogger(__name__)

#: Reads of complete local copies up to this size are served inline (see the module docstring).
LOCAL_INLINE_READ = 128 * 1024


class LocalHandle(Protocol):
    """What a read of a complete local copy needs of an open file (the vfs's per-handle state)."""

    ino: int
    size: int
    local_fd: int | None  # the complete local copy; None once it was found damaged
    local_pending: bytes | None  # the complete local copy's path until the first read opens it
    extents: list[Extent]
    starts: list[int]
    verified: set[int]  # indices of extents whose local bytes were read and found right
    partial_fd: int | None  # the incomplete local copy (done_chunk), -1 when it cannot be opened

    def set_extents(self, extents: list[Extent]) -> None: ...


class LocalReads:
    """Opens and reads complete local copies for the vfs; see the module docstring."""

    def __init__(self, catalog: Catalog, chunk_id: Callable[[bytes], bytes], stats: "VfsStats",
                 recorder: "AccessRecorder | None") -> None:
        self.catalog = catalog
        self.chunk_id = chunk_id  # the repository's (keyed when encrypted)
        self.stats = stats
        self.recorder = recorder

    def open(self, path: bytes, size: int) -> int | None:
        """An fd of the complete local copy at ``path`` of a file of ``size`` bytes, or None (then the store
        serves it).

        Inline on the trio thread, like a catalog point query: one open and one
        fstat of a local file.  A copy that cannot be opened or has the wrong size
        is not used.
        """
        flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW
        try:
            try:
                fd = os.open(path, flags | os.O_NOATIME)
            except PermissionError:  # O_NOATIME needs ownership (or root)
                fd = os.open(path, flags)
        except OSError as exc:
            log.warning("local copy %s cannot be opened (%s); reading from the store", os.fsdecode(path),
                        exc.strerror)
            return None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            os.close(fd)
            log.warning("local copy %s is not the snapshot's file (size %d, expected %d); reading from the store",
                        os.fsdecode(path), st.st_size, size)
            return None
        return fd

    async def open_pending(self, f: LocalHandle, path: bytes) -> None:
        """The first read of a handle whose local copy was complete at open: open the copy, else use the store.

        The vfs opens a complete copy here rather than at open: a file opened
        again whose pages the kernel caches is never read.  Inline (one open
        and one fstat); only a copy that cannot be opened awaits, for the
        extent list the store path needs, and a read that comes meanwhile does
        the same rather than read without extents.
        """
        fd = self.open(path, f.size)
        if fd is not None:
            f.local_fd, f.local_pending = fd, None
            return
        extents = await trio.to_thread.run_sync(self.catalog.extents, f.ino) if f.size else []
        if f.local_pending is not None:
            f.set_extents(extents)
            f.local_pending = None
            self.stats.local_opens -= 1  # served by the store after all

    async def _read_verified(self, f: LocalHandle, offset: int, end: int) -> bytes | memoryview | None:
        """``[offset, end)`` of the complete local copy, every chunk of it holding the catalog's bytes.

        A chunk this handle has not read before is read whole and named
        (BLAKE3) the first time; afterwards the handle trusts it.  The chunks
        to name and the range asked for are read together, named, and the
        range served from the same bytes, all in one worker-thread call (one
        read of each byte instead of two, one thread hop instead of three:
        docs/benchmarks.md, issue 49).  None when a chunk does not hold its
        bytes: a copy damaged on disk since it was written is never served.
        """
        assert f.local_fd is not None
        if not f.extents and f.size:
            f.set_extents(await trio.to_thread.run_sync(self.catalog.extents, f.ino))
        k = max(0, bisect_right(f.starts, offset) - 1)
        unverified: list[int] = []
        while k < len(f.extents) and f.extents[k].offset < end:
            if k not in f.verified and f.extents[k].end > offset:
                unverified.append(k)
            k += 1
        if not unverified:
            return await pread(f.local_fd, end - offset, offset)
        start = min(offset, f.extents[unverified[0]].offset)
        stop = max(end, f.extents[unverified[-1]].end)
        chunks = tuple((f.extents[k].offset - start, f.extents[k].length, f.extents[k].chunk) for k in unverified)
        span = await trio.to_thread.run_sync(read_and_name, f.local_fd, start, stop - start, chunks, self.chunk_id)
        if span is None:
            return None
        f.verified.update(unverified)
        return memoryview(span)[offset - start:end - start]

    async def read(self, f: LocalHandle, offset: int, end: int) -> bytes | memoryview | None:
        """A read served from the complete local copy (pread in a worker thread), its chunks verified first.

        None when the copy is damaged or cannot be read: the handle then reads through the store for good.
        """
        assert f.local_fd is not None
        try:
            data = await self._read_verified(f, offset, end)
        except OSError as exc:
            log.error("read of the local copy of inode %d at offset %d failed: %s", f.ino, offset, exc.strerror)
            data = None
        if data is None:
            self.stats.local_corrupt += 1
            log.error("local copy of inode %d does not hold the snapshot's bytes near offset %d; "
                      "reading it from the store", f.ino, offset)
            os.close(f.local_fd)
            f.local_fd = None
            f.verified.clear()
            return None
        if self.recorder is not None and self.recorder.active:
            granule = 1 << 20  # no extent list here: record per 1 MiB (the average chunk)
            for off in range(offset - offset % granule, end, granule):
                self.recorder.record(f.ino, off, granule)
        if len(data) != end - offset:
            self.stats.read_errors += 1
            if data:
                log.error("local copy of inode %d is shorter than the snapshot's file", f.ino)
            raise OSError(errno.EIO, "the local copy is shorter than the snapshot's file")  # EIO (errno_for)
        self.stats.reads += 1
        self.stats.local_reads += 1
        self.stats.bytes_read += len(data)
        return data

    async def done_chunk(self, f: "LocalHandle", ext: Extent, k: int,
                         tree_path: Callable[[int], bytes | None]) -> bytes | None:
        """A chunk the materializer has written into this file's incomplete local copy; None if unreadable
        or not the chunk's bytes (then it comes from the store).

        The materializer records a chunk done only once it is durable at
        every place it belongs, and its bytes were verified before they were
        written; a disk may still change them afterwards, so the bytes read
        back are named again (BLAKE3, in a worker thread) the first time this
        handle reads them.
        """
        if f.partial_fd is None:
            path = tree_path(f.ino)
            try:
                f.partial_fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW) if path else -1
            except OSError as exc:
                log.warning("local copy of inode %d cannot be opened (%s); reading from the store", f.ino,
                            exc.strerror)
                f.partial_fd = -1
        if f.partial_fd < 0:
            return None
        try:
            data = await pread(f.partial_fd, ext.length, ext.offset)
        except OSError as exc:
            log.warning("local copy of inode %d: read failed (%s); reading from the store", f.ino, exc.strerror)
            return None
        if len(data) != ext.length:
            return None
        if k not in f.verified:
            if await trio.to_thread.run_sync(self.chunk_id, data) != ext.chunk:
                self.stats.local_corrupt += 1
                log.error("local copy of inode %d: the chunk at offset %d is damaged; reading it from the store",
                          f.ino, ext.offset)
                return None
            f.verified.add(k)
        self.stats.local_reads += 1
        return data

class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64)
                for name in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


_SYS_CACHESTAT = 451  # the same number on every architecture (Linux 6.5)
_libc = ctypes.CDLL(None, use_errno=True)
_cachestat = True  # until the kernel (or a seccomp filter) says otherwise


def _cached_pages(fd: int, size: int, offset: int) -> bool | None:
    """Whether every page of the range is in the page cache, by cachestat(2), which starts no I/O;
    None where the kernel cannot tell (before 6.5, or the call is filtered)."""
    global _cachestat
    if not _cachestat:
        return None
    rng, st = _CachestatRange(offset, size), _Cachestat()
    if _libc.syscall(_SYS_CACHESTAT, ctypes.c_uint(fd), ctypes.byref(rng), ctypes.byref(st), ctypes.c_uint(0)) != 0:
        if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM, errno.EOPNOTSUPP):
            _cachestat = False
            return None
        return False  # EBADF and the like: the thread's plain read reports it
    pages = (offset + size - 1) // mmap.PAGESIZE - offset // mmap.PAGESIZE + 1
    return st.nr_cache >= pages


def pread_if_cached(fd: int, size: int, offset: int) -> bytes | None:
    """``size`` bytes at ``offset`` if the page cache holds them all; None if the read would wait for the disk.

    On a busy box (another job writing with fsync) a page-cache miss queues
    behind that writer's I/O for hundreds of milliseconds, and an inline
    read would stop the whole loop meanwhile.  cachestat(2) asks the cache
    first: ``preadv2(RWF_NOWAIT)`` alone is the kernel's IOCB_NOWAIT, not
    IOCB_NOIO, so a miss starts readahead, which a fast disk can finish
    inside the call (the read was then done inline after all).  The read
    itself stays ``RWF_NOWAIT``, for pages evicted in between and for
    kernels without cachestat.  A file system without RWF_NOWAIT (tmpfs:
    memory anyway) is read plainly.  A short answer (part cached, or the end
    of the file) is None too: the caller's thread read sorts it out.
    """
    if _cached_pages(fd, size, offset) is False:
        return None
    buf = bytearray(size)
    try:
        n = os.preadv(fd, [buf], offset, os.RWF_NOWAIT)
    except BlockingIOError:
        return None
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
            return os.pread(fd, size, offset)
        raise
    return bytes(buf) if n == size else None


def read_and_name(fd: int, offset: int, size: int, chunks: tuple[tuple[int, int, bytes], ...],
                  chunk_id: Callable[[bytes], bytes]) -> bytes | None:
    """Worker thread: ``size`` bytes at ``offset``, or None unless every chunk (offset in the range, length,
    id) in them is whole and names itself.  A read that ends early leaves the chunks past it short: None."""
    data = os.pread(fd, size, offset)
    view = memoryview(data)
    for off, length, cid in chunks:
        piece = view[off:off + length]
        if len(piece) != length or chunk_id(piece) != cid:
            return None
    return data


async def pread(fd: int, size: int, offset: int) -> bytes:
    """A read of a local file: inline up to ``LOCAL_INLINE_READ`` bytes when cached, else in a worker thread."""
    if size <= LOCAL_INLINE_READ and (data := pread_if_cached(fd, size, offset)) is not None:
        return data
    return await trio.to_thread.run_sync(os.pread, fd, size, offset)
