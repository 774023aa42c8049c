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

A handle read front to back (the kernel's 1 MiB READs of a checkpoint) is
served from *spans*: whole chunks of about ``LOCAL_SPAN`` bytes read and named
in one worker-thread call (:func:`read_span`: each chunk named right after it
is read, while it is in the CPU's cache), then held by the handle, whose next
READs are answered from it on the loop with no read, no hash and no thread
hop.  Before, each 1 MiB READ was one thread hop reading its range together
with the whole of each new chunk it touched, so every byte was read from the
copy about twice (docs/benchmarks.md, issue 49).  The bytes a handle holds
are bounded by ``LOCAL_SPAN`` plus a chunk or two, and all handles' together
by ``LOCAL_SPANS_MAX`` (past it a span serves the READ that read it and is
not kept).

Who owns what: a LocalReads belongs to its SnapshotFS and so to the trio
loop, as do the handles it is given (their fd, the set of chunks found
right, the span they hold and the event of the span being read) and the
count of bytes held.  Worker threads get an fd, a size and an offset, or
bytes to name, and return new objects; a span is never written after the
worker that read it returns.  ``_cachestat`` (whether the kernel has cachestat)
is set once, by whichever caller first finds it missing; every call builds
its own ctypes buffers.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import sqlite3
import stat
from bisect import bisect_right
from typing import TYPE_CHECKING, Any, Callable, Protocol

import trio

from ogrefs.errors import OgrefsError
from ogrefs.inspect.machine import usable_cpus
from ogrefs.localtree import copy_identity
from ogrefs.repo.catalog import Catalog, Extent
from ogrefs.units import MiB

if TYPE_CHECKING:
    from ogrefs.lazy.fs.types import AccessRecorder, VfsStats

log = logging.getLogger(__name__)

#: Reads of complete local copies up to this size are served inline (see the module docstring).
LOCAL_INLINE_READ = 128 * 1024
#: A sequential reader of a complete local copy is served from spans of whole chunks of at least this many bytes
#: (one thread hop, one read and one naming of each byte per span; see the module docstring).  8 MiB: 8 READs
#: of the kernel's per hop; each chunk is named straight after its read, so the span's size is not the CPU
#: cache's concern.
LOCAL_SPAN = 8 * MiB
#: A local copy named whole (:func:`name_whole`) is read and hashed in pieces of this size (in the CPU's L2 cache).
NAME_PIECE = 128 * 1024
#: ... and a large one in parts of at least this many bytes at once, one worker thread each (up to one per core).
NAME_PART_MIN = 64 * MiB
#: A copy its writer did not record (:meth:`LocalReads.whole`) is named at an open only up to this size: the open
#: waits for the whole file to be read and hashed, which a reader of a few pages of a 50 GB file would wait for
#: (~0.25 s for 256 MiB read from a 1 GB/s disk); a larger one is left to the daemon, which names what is read.
NAME_AT_OPEN_MAX = 256 * MiB
#: The most bytes of spans all handles hold at once (16 sequential readers' worth).
LOCAL_SPANS_MAX = 128 * MiB
#: A READ that starts this close to where the handle's previous one ended is sequential: the kernel's
#: read-ahead sends several READs at once, which may arrive out of order.
SEQUENTIAL_SLACK = 2 * MiB


class LocalHandle(Protocol):
    """What a read of a complete local copy needs of an open file (the vfs's per-handle state)."""

    ino: int
    size: int
    local_fd: int | None  # the complete local copy; None once it was found damaged
    # the complete local copy found damaged, closed only at release: another READ's worker thread may still be
    # reading it, and a number closed at once could be reused by another open meanwhile (that read would then
    # return another file's bytes)
    dropped_fd: int | None
    local_pending: bytes | None  # the complete local copy's path until the first read opens it
    extents: list[Extent]
    starts: list[int]
    verified: set[int]  # indices of extents whose local bytes were read and found right
    partial_fd: int | None  # the incomplete local copy (done_chunk), -1 when it cannot be opened
    span: memoryview | None  # bytes of the complete local copy from span_start, every chunk in them verified
    span_start: int
    span_loading: trio.Event | None  # set when the span being read is in (and then cleared)
    local_next: int  # where the handle's previous read of the local copy ended

    def set_extents(self, extents: list[Extent]) -> None: ...


class LocalReads:
    """Opens and reads complete local copies for the vfs; see the module docstring."""

    def __init__(self, catalog: Catalog, chunk_id: Callable[[bytes], bytes], stats: "VfsStats",
                 recorder: "AccessRecorder | None", chunk_hasher: Callable[[], Any],
                 written_identity: Callable[[int], str | None] | None = None) -> None:
        self.catalog = catalog
        self.written_identity = written_identity  # (blocking: LocalCopy.written_identity, in a worker thread)
        self.chunk_id = chunk_id  # the repository's (keyed when encrypted)
        self.chunk_hasher = chunk_hasher  # the same, in pieces (:meth:`whole`)
        self.stats = stats
        self.recorder = recorder
        self.held_bytes = 0  # of the spans all handles hold (LOCAL_SPANS_MAX)
        # inode -> the identity of its local copy when it was last named whole (:meth:`whole`)
        self._named_whole: dict[int, tuple[int, ...]] = {}

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

    async def whole(self, ino: int, path: bytes, size: int) -> int | None:
        """An fd of the complete local copy at ``path``, every byte of it the snapshot's, or None (the caller
        closes the fd; a file served from it by the kernel is never seen by the daemon again).

        Trusted as it is when it is the same file (same inode, size, mtime and
        ctime: a write to it changes the ctime, and nobody can set that back)
        as when it was named before, or as when the materializer recorded it
        complete in this boot (``written_identity``: it wrote the copy from
        chunks it had verified, so it is as good as named; a copy that
        materializes while a job runs is then served by the kernel at no cost).
        Otherwise it is named whole in worker threads (:func:`name_whole`:
        each chunk, and the gaps between them read as zeros), if it is at most
        ``NAME_AT_OPEN_MAX`` bytes; a larger one is left to the daemon (None).
        """
        fd = self.open(path, size)
        if fd is None:
            return None
        st = os.fstat(fd)
        known = _identity(st)
        if self._named_whole.get(ino) == known:
            return fd
        try:
            if self.written_identity is not None:
                recorded = await trio.to_thread.run_sync(self.written_identity, ino)
                if recorded is not None and recorded == copy_identity(st):
                    self._named_whole[ino] = known
                    self.stats.local_written_whole += 1
                    return fd
        except (sqlite3.Error, OgrefsError) as exc:  # (the plan cannot be read: the copy is named instead)
            log.warning("the record of local copy of inode %d cannot be read (%s)", ino, exc)
        except BaseException:  # (cancelled: the open is abandoned)
            os.close(fd)
            raise
        if size > NAME_AT_OPEN_MAX:
            os.close(fd)
            self.stats.local_too_large_to_name += 1
            return None
        try:
            extents = await trio.to_thread.run_sync(self.catalog.extents, ino)
            chunks = tuple((e.offset, e.length, e.chunk) for e in extents)
            ok = await self._name_in_parts(fd, size, chunks)
            ok = ok and _identity(os.fstat(fd)) == known
        except (OSError, sqlite3.Error, OgrefsError) as exc:  # (the catalog's extents, the copy's reads)
            os.close(fd)
            log.error("local copy of inode %d cannot be named (%s); the daemon serves it", ino,
                      getattr(exc, "strerror", None) or exc)
            return None
        if not ok:
            os.close(fd)
            self.stats.local_corrupt += 1
            log.error("local copy of inode %d does not hold the snapshot's bytes; the daemon serves it", ino)
            return None
        self._named_whole[ino] = known
        self.stats.local_named_whole += 1
        return fd

    async def _name_in_parts(self, fd: int, size: int, chunks: tuple[tuple[int, int, bytes], ...]) -> bool:
        """:func:`name_whole` of ``[0, size)``, a large file's in up to ``usable_cpus()`` parts at once, each
        part whole chunks (and the gaps after them): the open that waits for it waits for the slowest part,
        not for the whole file on one core (a 100 GB checkpoint: ~50 s on one core of this VM)."""
        parts = max(1, min(usable_cpus(), len(chunks), size // NAME_PART_MIN))
        firsts = [len(chunks) * k // parts for k in range(parts)] + [len(chunks)]  # each part's first chunk
        cuts = [0] + [chunks[firsts[k]][0] for k in range(1, parts)] + [size]
        results: list[bool] = []

        async def one(k: int) -> None:
            mine = chunks[firsts[k]:firsts[k + 1]]
            results.append(await trio.to_thread.run_sync(name_whole, fd, size, mine, self.chunk_hasher,
                                                         cuts[k], cuts[k + 1]))

        async with trio.open_nursery() as nursery:
            for k in range(parts):
                nursery.start_soon(one, k)
        return all(results)

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
        (BLAKE3) the first time; afterwards the handle trusts it.  A READ the
        handle's span holds is answered from it; one that needs a chunk not
        named yet, or that continues a sequential reader, reads a span of
        whole chunks (:meth:`_read_span`); any other (all its chunks named:
        a small file read again) is one plain read.  None when a chunk does
        not hold its bytes: a copy damaged on disk since it was written is
        never served.
        """
        assert f.local_fd is not None
        if not f.extents and f.size:
            f.set_extents(await trio.to_thread.run_sync(self.catalog.extents, f.ino))
        while (held := _held(f, offset, end)) is None and f.span_loading is not None:
            await f.span_loading.wait()  # another READ of this handle is reading the span that may hold this one
        if f.local_fd is None:
            return None  # that READ found the copy damaged
        sequential = f.local_next - SEQUENTIAL_SLACK <= offset <= f.local_next + SEQUENTIAL_SLACK and offset > 0
        f.local_next = end
        if held is not None:
            return held
        # a span is read ahead only where it can be held (its own span is let go of first), and not for a READ
        # behind the span held (the kernel's READs out of order): that one reads what it needs
        sequential = (sequential and (f.span is None or offset >= f.span_start)
                      and self.held_bytes - len(f.span or b"") + LOCAL_SPAN <= LOCAL_SPANS_MAX)
        first = max(0, bisect_right(f.starts, offset) - 1)
        stop = end if not sequential else min(f.size, max(end, offset + LOCAL_SPAN))
        last = first
        while last < len(f.extents) and f.extents[last].offset < stop:
            last += 1
        if not sequential and all(k in f.verified for k in range(first, last) if f.extents[k].end > offset):
            return await pread(f.local_fd, end - offset, offset)
        return await self._read_span(f, offset, end, first, last)

    async def _read_span(self, f: LocalHandle, offset: int, end: int, first: int, last: int) -> memoryview | None:
        """Chunks ``first`` to ``last`` (and at least ``[offset, end)``) read in one worker-thread call, the ones
        not named yet named there; the span is then the handle's (within ``LOCAL_SPANS_MAX``) and
        ``[offset, end)`` of it is served."""
        assert f.local_fd is not None
        # a chunk named before need not be read whole: the span starts where the READ does (a sequential
        # reader's previous span held that chunk's start)
        start = min(offset, f.extents[first].offset) if first < last and first not in f.verified else offset
        stop = max(end, f.extents[last - 1].end) if first < last else end
        chunks = tuple((f.extents[k].offset - start, f.extents[k].length, f.extents[k].chunk)
                       for k in range(first, last) if k not in f.verified)
        keep = f.span is None or offset >= f.span_start  # (a READ behind the span leaves it held)
        if keep:
            self.drop_span(f)
        f.span_loading = loading = trio.Event()
        try:
            span = await trio.to_thread.run_sync(read_span, f.local_fd, start, stop - start, chunks, self.chunk_id)
        finally:
            f.span_loading = None
            loading.set()
        if span is None:
            return None
        f.verified.update(range(first, last))
        if keep and f.span is None and self.held_bytes + len(span) <= LOCAL_SPANS_MAX and f.local_fd is not None:
            f.span, f.span_start = span, start
            self.held_bytes += len(span)
        return span[offset - start:end - start]

    def drop_span(self, f: LocalHandle) -> None:
        """Let go of the handle's span (a new one is read, the handle is released or its copy found damaged)."""
        if f.span is not None:
            self.held_bytes -= len(f.span)
            f.span = None

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
            if f.local_fd is None:
                return None  # another READ of the handle found the copy damaged, and said so
            self.stats.local_corrupt += 1
            log.error("local copy of inode %d does not hold the snapshot's bytes near offset %d; "
                      "reading it from the store", f.ino, offset)
            f.dropped_fd, f.local_fd = f.local_fd, None
            f.verified.clear()
            self.drop_span(f)
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


def _identity(st: os.stat_result) -> tuple[int, ...]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def name_whole(fd: int, size: int, chunks: tuple[tuple[int, int, bytes], ...],
               chunk_hasher: Callable[[], Any], start: int = 0, end: int | None = None) -> bool:
    """Worker thread: whether the ``size`` bytes of ``fd`` are the file whose chunks are ``chunks`` (offset,
    length, id; in file order), what lies between them zeros; only ``[start, end)`` of it (the chunks given
    are those that start there) when asked.

    Read in pieces of ``NAME_PIECE`` bytes, each hashed while it is in the
    CPU's cache: a chunk read whole first and hashed after costs a copy
    through memory more (about twice the CPU: docs/benchmarks.md, issue 49).
    """
    view = memoryview(bytearray(NAME_PIECE))
    pos = start
    for off, length, cid in chunks + ((size if end is None else end, 0, None),):
        if off > pos and not _zeros(fd, pos, off, view):
            return False
        if cid is None:
            return True
        h = chunk_hasher()
        got = 0
        while got < length and (n := os.preadv(fd, [view[:min(NAME_PIECE, length - got)]], off + got)):
            h.update(view[:n])
            got += n
        if got < length or h.digest() != cid:
            return False
        pos = off + length
    return True


def _zeros(fd: int, start: int, end: int, view: memoryview) -> bool:
    """Whether ``[start, end)`` of ``fd`` reads as zeros (its holes are skipped, the data in it is read)."""
    pos = start
    while pos < end:
        try:
            pos = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # no data past pos: a hole to the end of the file
                return True
            raise
        if pos >= end:
            return True
        n = os.preadv(fd, [view[:min(len(view), end - pos)]], pos)
        if not n or bytes(view[:n]).count(0) != n:  # (gaps with data are rare: a copy is cheap enough)
            return False
        pos += n
    return True


def _held(f: LocalHandle, offset: int, end: int) -> memoryview | None:
    """``[offset, end)`` from the handle's span, if it holds all of it."""
    if f.span is None or not f.span_start <= offset or end > f.span_start + len(f.span):
        return None
    return f.span[offset - f.span_start:end - f.span_start]


def read_span(fd: int, offset: int, size: int, chunks: tuple[tuple[int, int, bytes | None], ...],
              chunk_id: Callable[[bytes | memoryview], bytes]) -> memoryview | None:
    """Worker thread: ``size`` bytes at ``offset`` (fewer at the end of the file), or None unless every chunk
    (offset in the range, length, id; in range order) is whole and names itself.

    Read into one buffer a chunk at a time, each named right after its read
    (its bytes still in the CPU's cache), so a READ anywhere in the span is a
    view of it, never a join.
    """
    view = memoryview(bytearray(size))
    got = 0
    for off, length, cid in chunks + ((size, 0, None),):
        while got < off + length and (n := os.preadv(fd, [view[got:off + length]], offset + got)):
            got += n
        if cid is None:
            break
        if got < off + length or chunk_id(view[off:off + length]) != cid:
            return None
    return view[:got].toreadonly()


async def pread(fd: int, size: int, offset: int) -> bytes:
    """A read of a local file: inline up to ``LOCAL_INLINE_READ`` bytes when cached, else in a worker thread."""
    if size <= LOCAL_INLINE_READ and (data := pread_if_cached(fd, size, offset)) is not None:
        return data
    return await trio.to_thread.run_sync(os.pread, fd, size, offset)
