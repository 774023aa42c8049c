"""A snapshot's data path: changed files → chunks → hash workers → packs → upload workers.

Ownership (snapshot/pipeline.py's picture, steps 2-4):

* The *main thread* (the walk) calls :meth:`Packer.read_file`; it alone owns
  the open pack, the ``_pending`` queue of chunks in flight, the upload queue
  and the local chunk index's write side, and it records a file's inode and
  extents in the catalog writer once all of its chunks are back.
* *Hash workers* get one chunk each, an immutable ``bytes`` or a read-only
  view into one (snapshot/chunker.py): they hash it, ask
  :meth:`Packer._claim` whether this run must store it (the claim set and the
  index lookup are guarded by ``_claim_lock``) and compress it if so.
* Results are consumed strictly in submission order, so blobs land in packs
  in walk order (files of one directory stay together); a pack is sealed at
  the target size (or after a file of at least a pack, so that its tail is
  not held until the walk ends) and handed to an *upload worker*, which puts
  it and its per-pack index object; the main thread then records it in the
  local index.
"""

from __future__ import annotations

import os
import stat
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from ogrefs.repo import Repository
from ogrefs.repo.catalog import FLAG_CHANGED, CatalogWriter
from ogrefs.repo.index import ChunkIndex
from ogrefs.snapshot.chunker import Chunker, data_extents
from ogrefs.snapshot.indexsync import IndexSync

MAX_PENDING_CHUNKS = 64
MAX_REREADS = 3


@dataclass
class PackStats:
    """What the data path did; the snapshot's Stats extend it."""

    read_bytes: int = 0
    chunks: int = 0
    new_chunks: int = 0
    new_raw_bytes: int = 0
    stored_bytes: int = 0  # bytes of blobs written by this run
    packs: int = 0


@dataclass
class _FileRec:
    ino: int
    path: bytes
    st: os.stat_result
    user: str | None
    grp: str | None
    extents: list[tuple[int, int, bytes]] = field(default_factory=list)
    remaining: int = 0
    closed: bool = False
    discarded: bool = False
    flags: int = 0


def _same_content_stat(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_size, a.st_mtime_ns, a.st_ctime_ns, a.st_ino, a.st_dev) == (
        b.st_size, b.st_mtime_ns, b.st_ctime_ns, b.st_ino, b.st_dev)


class Packer:
    """Reads files into chunks, stores each new chunk once, and seals and uploads packs.

    ``live_packs`` is the snapshot's set of packs that may be referenced (the
    store's, less the trash); sealed packs join it. ``unreadable(path, exc)``
    reports a file that could not be read; ``tick()`` lets the caller show
    progress. Call :meth:`finish` after the last file, :meth:`close` always.
    """

    def __init__(self, repo: Repository, cat: CatalogWriter, stats: PackStats, live_packs: set[str],
                 workers: int, upload_workers: int, unreadable: Callable[[bytes, OSError], None],
                 tick: Callable[[], None], index: ChunkIndex | IndexSync | None = None) -> None:
        self.repo = repo
        self.index = index if index is not None else repo.index  # lookup and add (an IndexSync waits for its sync)
        self.cat = cat
        self.stats = stats
        self.live_packs = live_packs
        self._unreadable = unreadable
        self._tick = tick
        self._chunker = Chunker(repo.config.chunker)
        self._codec = repo.codec  # immutable, thread-safe: hash workers use it
        self._claim_lock = threading.Lock()
        self._claimed: set[bytes] = set()
        self._pending: deque[tuple[Future, _FileRec, int, int]] = deque()
        self._uploads: deque[Future] = deque()
        self._pack = repo.new_pack()
        self._upload_workers = upload_workers
        self.run_packs: list[str] = []
        self.run_index: list[tuple[bytes, str, int, int, int]] = []
        self.changed: list[str] = []  # files that kept changing while read (recorded FLAG_CHANGED)
        self._hash_pool = ThreadPoolExecutor(workers, thread_name_prefix="ogrefs-hash")
        self._upload_pool = ThreadPoolExecutor(upload_workers, thread_name_prefix="ogrefs-upload")

    def close(self) -> None:
        self._hash_pool.shutdown(wait=True, cancel_futures=True)
        self._upload_pool.shutdown(wait=True, cancel_futures=True)

    # -- worker side ------------------------------------------------------------
    def _claim(self, cid: bytes) -> bool:
        """True if this run must store ``cid`` (called from hash workers)."""
        with self._claim_lock:
            if cid in self._claimed:
                return False
            if self.index.lookup(cid, self.live_packs) is not None:
                return False
            self._claimed.add(cid)
            return True

    def _process(self, data: bytes) -> tuple[bytes, bytes | None]:
        cid = self._codec.chunk_id(data)
        if not self._claim(cid):
            return cid, None
        return cid, self._codec.encode_blob(cid, data)

    def _upload(self, name: str, body: bytes, entries: list[tuple[bytes, int, int, int]]) -> tuple[str, list]:
        index_entries = [(cid, name, off, slen, rlen) for cid, off, slen, rlen in entries]
        self.repo.put_pack(name, body)
        self.repo.write_index(name, index_entries)
        return name, index_entries

    # -- main thread -------------------------------------------------------------
    def read_file(self, path: bytes, ino: int, user: str | None, group: str | None,
                  record_st: os.stat_result | None = None) -> None:
        """Chunk a regular file, re-reading it if it changes underneath us.

        ``record_st``: the attributes to record when ``path`` is a copy of the
        file (a mount's local copy) rather than the file itself.
        """
        for attempt in range(MAX_REREADS):
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError as exc:
                self._unreadable(path, exc)
                return
            try:
                st0 = os.fstat(fd)
                if not stat.S_ISREG(st0.st_mode):
                    raise OSError(0, "replaced by a non-regular file while snapshotting")
                rec = _FileRec(ino, path, record_st or st0, user, group)
                self._submit_chunks(fd, st0, rec)
                st1 = os.fstat(fd)
            except OSError as exc:
                os.close(fd)
                self._unreadable(path, exc)
                return
            os.close(fd)
            if _same_content_stat(st0, st1):
                break
            if attempt < MAX_REREADS - 1:
                rec.discarded = True
                continue
            rec.flags |= FLAG_CHANGED
            self.changed.append(os.fsdecode(path))
        rec.closed = True
        if rec.remaining == 0:
            self._finish_file(rec)
        if st0.st_size >= self.repo.config.pack_target_size:
            self._flush_tail()

    def _flush_tail(self) -> None:
        """After a large file: its last chunks into the open pack, and the pack on its way if it holds much.

        Otherwise the file's tail (up to MAX_PENDING_CHUNKS chunks and a
        partly filled pack) waits for the next file read or for
        :meth:`finish`, and a snapshot whose walk goes on for a while after
        its one new checkpoint (the rest of the box, from the catalog) starts
        the checkpoint's last upload only when the walk ends: in the spot
        loop, 0.8 s after it, on the notice's critical path.  The pack is
        handed to the upload pool without waiting for a free worker, so the
        walk goes on; the next seal that waits takes the queue back down.
        """
        self._drain()
        if self._pack.size >= self.repo.config.pack_target_size // 4:
            self._seal_pack(wait=False)

    def _submit_chunks(self, fd: int, st: os.stat_result, rec: _FileRec) -> None:
        for off, data in self._chunker.chunks(fd, data_extents(fd, st.st_size)):
            rec.remaining += 1
            self.stats.read_bytes += len(data)
            self._pending.append((self._hash_pool.submit(self._process, data), rec, off, len(data)))
            if len(self._pending) > MAX_PENDING_CHUNKS:
                self._drain(keep=MAX_PENDING_CHUNKS // 2)
            self._tick()

    def finish(self) -> None:
        """Every chunk consumed, the last pack sealed, every upload done and indexed."""
        self._drain()
        self._seal_pack()
        self._reap_uploads(keep=0)

    def _consume_one(self) -> None:
        fut, rec, off, length = self._pending.popleft()
        cid, blob = fut.result()
        self.stats.chunks += 1
        if blob is not None:
            self._pack.add(cid, blob, length)
            self.stats.new_chunks += 1
            self.stats.new_raw_bytes += length
            self.stats.stored_bytes += len(blob)
            if self._pack.size >= self.repo.config.pack_target_size:
                self._seal_pack()
        rec.extents.append((off, length, cid))
        rec.remaining -= 1
        if rec.remaining == 0 and rec.closed:
            self._finish_file(rec)

    def _drain(self, keep: int = 0) -> None:
        while len(self._pending) > keep:
            self._consume_one()

    def _reap_uploads(self, keep: int) -> None:
        while len(self._uploads) > keep or (self._uploads and self._uploads[0].done()):
            name, entries = self._uploads.popleft().result()
            self.index.add(entries, merged_name=name)
            self.run_packs.append(name)
            self.run_index.extend(entries)

    def _seal_pack(self, wait: bool = True) -> None:
        """Seal the open pack and submit its upload; with ``wait``, then wait until at most
        ``upload_workers`` uploads are outstanding (the bound on packs held in memory)."""
        if not len(self._pack):
            return
        name, body, entries = self._pack.finish()
        self._pack = self.repo.new_pack()
        self.live_packs.add(name)
        self.stats.packs += 1
        self._uploads.append(self._upload_pool.submit(self._upload, name, body, entries))
        self._reap_uploads(keep=self._upload_workers if wait else len(self._uploads))

    def _finish_file(self, rec: _FileRec) -> None:
        if rec.discarded:
            return
        self.cat.add_inode(rec.ino, rec.st, rec.user, rec.grp, flags=rec.flags)
        rec.extents.sort()
        self.cat.add_extents(rec.ino, rec.extents)
