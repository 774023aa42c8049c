"""Background materialization: copy a mounted snapshot, all of it, into a local tree while it is in use.

After a mount is ready, a :class:`Materializer` fetches every chunk of the
snapshot through the mount's :class:`~ogrefs.lazy.fetcher.Fetcher` and writes it
into ``<state_dir>/tree/``, a real local copy of the snapshot tree
(directories, sparse regular files, symlinks, FIFOs, device nodes where
permitted, hardlinks as hardlinks).  Once a file's data is all local, its
owner, mode, xattrs and times are applied and the vfs serves it from the local
file (:meth:`Materializer.local_path`); once everything is local, directories
get their metadata and the store is never contacted again.

Order.  Chunks are fetched in three classes, each at its own fetcher priority
(a reader, ``Priority.READ``, always goes first: the fetcher keeps request
slots for it):

1. ``trace`` (``Priority.TRACE``): the chunks of the access trace of the last
   run, in the order they were first read;
2. ``hint`` (``Priority.HINT``): the catalog's prefetch hints (python, cuda,
   checkpoint) in rank order, each one's files in pack order;
3. ``background`` (``Priority.BACKGROUND``): everything else, in pack order, so
   neighbouring chunks are fetched with one ranged GET.

The link stays full: chunks are requested in pack-ordered groups (16 MiB)
while less than ``window_bytes`` (96 MiB) are requested and not yet written.
Chunks already in memory (a trace or the hints, streamed before the tree
existed and held for the materializer, which takes them) do not count
against the window: they take no link time, and counting them would leave
the link idle while the writer works through them.  Written chunks of 256 KiB
or more leave the page cache once durable (see ``_write_batch``).

Durability.  The state lives in ``<state_dir>/materialize.sqlite``:

* ``chunks``  every distinct chunk to fetch: location, class, order, ``done``;
* ``targets`` where each chunk goes: (chunk, inode, file offset);
* ``files``   one row per regular-file inode: its path in the tree, how many
  targets are still missing, ``complete``;
* ``others``  directories and special files (their metadata is applied at the end);
* ``meta``    snapshot id, ``built`` (the tree exists), ``finished``.

Chunks are written in batches: ``pwrite`` into every target file, then
``fdatasync`` of each file touched, and only then one transaction marks the
batch's chunks done.  So a chunk recorded done is on disk, and a chunk that
was written but not recorded (a crash, kill -9, a full disk in between) is
fetched and written again: a restart with the same state directory never
fetches a done chunk and never trusts an unrecorded one.  Files are served
locally only when every one of their chunks is recorded done.

Adoption.  A chunk fetched from the store for someone else (an application's
read, its read-ahead) while a pass runs is handed to the materializer
(:meth:`Materializer.adopt`, the fetcher's ``adopter`` hook) and written into
the tree at once, by the same durable batch write, instead of going to the
chunk cache and being loaded, verified and copied from there later.  A chunk
is claimed by one writer only: the feeder skips adopted chunks, adoption
skips chunks the feeder has requested.  At most ``adopt_bytes`` wait to be
written; beyond that a chunk goes to the chunk cache as before.

Disk space.  Before anything is written, the bytes still needed (data of the
chunks not yet done, per target file) plus a margin are compared with the free
space of the state directory; if they do not fit, nothing is materialized and
``stats()["reason"]`` says why ("not materializing: needs 12.3 GiB, 8.1 GiB
free"); the lazy mount keeps serving through the bounded chunk cache.  A full
disk during materialization (ENOSPC, EDQUOT, SQLITE_FULL) stops it the same
way; the batch being written is not recorded, so nothing wrong is ever served.

Who owns what: a Materializer and its counters belong to the trio loop.  Its
worker-thread calls (tree building, batch writes with their fsyncs, metadata,
SQLite) get immutable inputs (bytes, tuples) and return new objects; each
thread uses its own SQLite connection, and only one writes at a time (the
writer task and the adoption writer take turns under ``_write_lock``; the
preparation runs before either starts).  ``_claimed`` (chunks requested by the
feeder or adopted, not yet recorded done) and the adoption queue belong to
the loop as well.  :meth:`Materializer.local_paths` is the one method meant
for other threads (the vfs's page-cache push): it reads recorded state only.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import math
import os
import sqlite3
import threading
import time
import urllib.parse
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import trio

from ogrefs.repo.localdb import wal_connect
from ogrefs.units import human_bytes as human
from ogrefs.repo.catalog import ROOT_INO, Catalog
from ogrefs.errors import CorruptObject, OgrefsError
from ogrefs.lazy.fetcher import (
    ChunkMissing,
    ChunkRef,
    FetchError,
    Fetcher,
    Priority,
    StoreUnavailable,
    Ticket,
)
from ogrefs.localtree import LocalTree, pwrite_all
from ogrefs.lazy.trace import Entry, EntryResolver

log = logging.getLogger(__name__)

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

CLASSES = ("trace", "hint", "background")
TRACE, HINT, BACKGROUND = 0, 1, 2
_PRIORITY = {TRACE: Priority.TRACE, HINT: Priority.HINT, BACKGROUND: Priority.BACKGROUND}
#: No class goes to the caches: the tree is the copy, and the vfs reads chunks already written from it
#: (also of files not yet complete).
_KEEP = {TRACE: False, HINT: False, BACKGROUND: False}

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE IF NOT EXISTS files (ino INTEGER PRIMARY KEY, path BLOB NOT NULL, pending INTEGER NOT NULL DEFAULT 0,
                                  complete INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS others (seq INTEGER PRIMARY KEY, ino INTEGER NOT NULL, path BLOB NOT NULL,
                                   dir INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS chunks (id INTEGER PRIMARY KEY, chunk BLOB NOT NULL UNIQUE, pack TEXT NOT NULL,
                                   poff INTEGER NOT NULL, slen INTEGER NOT NULL, rlen INTEGER NOT NULL,
                                   base_cls INTEGER NOT NULL DEFAULT 2, base_seq INTEGER NOT NULL DEFAULT 0,
                                   cls INTEGER NOT NULL DEFAULT 2, seq INTEGER NOT NULL DEFAULT 0,
                                   done INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS targets (chunk BLOB NOT NULL, ino INTEGER NOT NULL, off INTEGER NOT NULL,
                                    PRIMARY KEY (chunk, ino, off)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS chunks_order ON chunks (done, cls, seq, pack, poff, id);
CREATE INDEX IF NOT EXISTS targets_ino ON targets (ino);
"""
_ORDER = "cls, seq, pack, poff, id"
#: A batch that touches more files than this is made durable with one syncfs(2) instead of an fdatasync
#: per file (20,000 files of 2-32 KiB from a local file repository: 5.2 s instead of 6.6 s).
_SYNCFS_ABOVE = 16
#: Chunks at least this large leave the page cache once durable (bulk data; small files stay cached).
_DROP_FROM_PAGE_CACHE = 256 * 1024
_TRACE_CLASS = CLASSES.index("trace")  # its chunks stay in the page cache (see _write_batch)


def _create_entry(tree: LocalTree, path: bytes, node, link_to: bytes | None) -> bool:
    """A non-directory entry of the tree: a hardlink to ``link_to``, an empty file of the node's size, or a
    special file; False for a type that is not materialized (a socket)."""
    if link_to is not None:
        tree.link_name(link_to, path)
        return True
    if node.is_reg:
        tree.create_file(path, node.size)
        return True
    return tree.create_special(path, node)


def _disk_full(exc: BaseException) -> bool:
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    if isinstance(exc, sqlite3.Error):
        return getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL or "full" in str(exc).lower()
    return False


_libc = None


def _syncfs_fd(fd: int) -> None:
    """syncfs(2) of the file system holding ``fd``; os.sync() where it is missing.  Raises OSError on errors."""
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        func = _libc.syncfs
    except (OSError, AttributeError):
        os.sync()
        return
    if func(fd) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _syncfs(path: bytes) -> None:
    """Flush the file system holding ``path`` (the tree's entries were just created)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _syncfs_fd(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True, slots=True)
class _Item:
    """One chunk to fetch and where it goes (immutable: handed to worker threads)."""

    id: int
    ref: ChunkRef
    cls: int
    targets: tuple[tuple[int, int, bytes], ...]  # (ino, file offset, path in the tree)


class _Budget:
    """Bytes requested from the fetcher and not yet written; the feeder waits while the window is full.

    ``used`` counts chunks on their way over the link (or arrived, not yet
    written); ``ready`` counts chunks that came from memory, not yet written.
    The window is ``limit`` plus ``ready``: while the writer works through a
    backlog from memory (a trace or the hints streamed before the tree
    existed), the link keeps fetching what comes after it instead of idling,
    and holds at most as much again as the backlog being written.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.ready = 0
        self._changed = trio.Event()

    async def acquire(self, n: int) -> None:
        while self.used > 0 and self.used + n > self.limit + self.ready:
            await self._changed.wait()
        self.used += n

    def settle(self, *, charged: int, ready: int, acquired: int) -> None:
        """After a request: ``charged`` bytes go over the link (``acquired`` were reserved), ``ready`` came from memory."""
        self.used += charged - acquired
        self.ready += ready
        self._changed.set()
        self._changed = trio.Event()

    def written(self, charged: int, ready: int) -> None:
        self.used -= charged
        self.ready -= ready
        self._changed.set()
        self._changed = trio.Event()

    def release(self, n: int) -> None:
        self.used -= n
        self._changed.set()
        self._changed = trio.Event()


class _Stop(Exception):
    """Materialization cannot go on (disk full, a write error); the reason is recorded."""


class Materializer:
    """Copies a snapshot into ``state_dir/tree`` in the background; see the module docstring.

    Construct it before the mount serves (it loads which files are already
    complete, so the vfs can serve them locally at once), hand it to
    ``SnapshotFS(..., local=materializer)``, and start :meth:`run` in the
    daemon's nursery after the mount is ready.  The vfs also reads chunks
    already done from the tree's files before those files are complete
    (:meth:`chunk_done`, :meth:`tree_path`), so nothing written is fetched again.
    """

    def __init__(self, catalog: Catalog, fetcher: Fetcher, state_dir: Path, *, window_bytes: int = 96 * MiB,
                 group_bytes: int = 16 * MiB, batch_bytes: int = 16 * MiB, batch_chunks: int = 1024,
                 reserve_bytes: int | None = None, flush_after: float = 0.2, retry_delay: float = 10.0,
                 adopt_bytes: int = 64 * MiB) -> None:
        self.catalog = catalog
        self.fetcher = fetcher
        self.state_dir = Path(state_dir)
        self.tree = self.state_dir / "tree"
        self.window_bytes = window_bytes
        self.group_bytes = group_bytes
        self.batch_bytes = batch_bytes
        self.batch_chunks = batch_chunks
        self.reserve_bytes = reserve_bytes
        self.flush_after = flush_after
        self.retry_delay = retry_delay
        self.adopt_bytes = adopt_bytes
        self.adopted_chunks = 0
        self._claimed: set[bytes] = set()  # requested by the feeder or adopted, not yet recorded done
        self._in_hand: dict[bytes, bytes] = {}  # adopted chunks, until recorded done
        self._tickets: dict[bytes, Ticket] = {}  # chunks the feeder requested, until recorded done
        self._adopted: deque[tuple[ChunkRef, bytes]] = deque()
        self._adopted_size = 0
        self._adopting = False  # a pass is running: its writers take adopted chunks
        self._adopt_wakeup = trio.Event()
        self._write_lock = trio.Lock()
        self.state = "idle"
        self.reason: str | None = None
        self.complete = False
        self.files_total = 0
        self.failed_chunks = 0
        self._tree_b = os.fsencode(self.tree)
        self._db_path = self.state_dir / "materialize.sqlite"
        self._local = threading.local()
        self._as_root = os.geteuid() == 0
        self._complete: set[int] = set()
        self._done: set[bytes] = set()  # chunks written to every target, durable and recorded
        self._class_total = [0, 0, 0]
        self._class_done = [0, 0, 0]
        self._samples: deque[tuple[float, int]] = deque()
        self._failed: set[int] = set()  # chunk rows that failed for good in this run
        self._retry = 0  # chunks to try again after a pause (store unavailable)
        self._abort_pass = False
        self._stopped = False
        self._pass_scope: trio.CancelScope | None = None
        self._fresh = False  # the tree was built by this run: nothing was on disk before it started
        self._snap_id = catalog.meta("snapshot_id") or Path(catalog.path).stem
        # The tree's root fd (every entry is reached through it without following links): opened by the
        # preparation, in its worker thread, before any writer starts; only read afterwards.
        self._ltree: LocalTree | None = None
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            db = self._db()
            db.executescript(_SCHEMA)
            owner = self._meta(db, "snapshot")
            if owner is None:
                db.execute("INSERT INTO meta VALUES ('snapshot', ?)", (self._snap_id,))
            elif owner != self._snap_id:
                self.state = "not materializing"
                self.reason = (f"not materializing: {self.state_dir} holds the materialization of snapshot "
                               f"{owner[:12]}, not {self._snap_id[:12]}")
                return
            self._complete = {r[0] for r in db.execute("SELECT ino FROM files WHERE complete=1")}
            self._done = {r[0] for r in db.execute("SELECT chunk FROM chunks WHERE done=1")}
            self.complete = self._meta(db, "finished") == "1"
        except (OSError, sqlite3.Error, OgrefsError) as exc:  # a full or read-only disk: the mount works without a local copy
            self.state = "not materializing"
            self.reason = f"not materializing: the state in {self.state_dir} cannot be opened ({exc})"

    # -- plumbing ---------------------------------------------------------------------------
    def _db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = self._local.db = wal_connect(self._db_path)  # a lost commit only re-fetches chunks
        return db

    @staticmethod
    def _meta(db: sqlite3.Connection, key: str) -> str | None:
        row = db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return row[0] if row else None

    @staticmethod
    def _set_meta(db: sqlite3.Connection, key: str, value: str) -> None:
        db.execute("INSERT OR REPLACE INTO meta VALUES (?,?)", (key, value))

    def _dest(self, path: bytes) -> bytes:
        return self._tree_b + path

    def _lt(self) -> LocalTree:
        assert self._ltree is not None  # (None only when not materializing)
        return self._ltree

    def _apply_metadata(self, path: bytes, node) -> None:
        """Worker thread: an entry's final metadata, by fd; what cannot be set is logged, the rest applied."""
        problems = self._lt().apply_metadata(path, node, self.catalog.xattrs(node.ino), as_root=self._as_root)
        for p in problems:
            log.warning("materialization: %s of %s not set (%s)", p.what, os.fsdecode(path) or "/", p.reason)

    def is_built(self) -> bool:
        """Blocking: whether the local tree exists already (an earlier run of this state directory)."""
        if self.state == "not materializing":
            return False
        return self._meta(self._db(), "built") == "1"

    # -- the vfs side ---------------------------------------------------------------------------
    def local_path(self, ino: int) -> bytes | None:
        """The local copy of regular file ``ino`` if it is complete (data durable, metadata applied), else None."""
        return self._tree_file(ino) if ino in self._complete else None

    def local_paths(self, inos: list[int]) -> dict[int, bytes]:
        """Blocking (a worker thread; its own SQLite connection): the complete local copies among ``inos``.

        Reads the recorded state (a file is recorded complete once its data is
        durable and its metadata applied), so it needs nothing of the loop's.
        """
        if self.state == "not materializing":
            return {}
        out: dict[int, bytes] = {}
        db = self._db()
        for i in range(0, len(inos), 500):
            part = inos[i:i + 500]
            out.update((ino, self._dest(path)) for ino, path in db.execute(
                f"SELECT ino, path FROM files WHERE complete=1 AND ino IN ({','.join('?' * len(part))})", part))
        return out

    def chunk_done(self, chunk: bytes) -> bool:
        """Whether ``chunk`` is in the tree at every place it belongs (durable, recorded)."""
        return chunk in self._done

    def chunk_in_hand(self, chunk: bytes) -> bytes | None:
        """The verified bytes of ``chunk`` if it was fetched for the tree and is not yet recorded done.

        Between its arrival and its durable write a chunk is in neither the
        tree nor any cache (the collector takes tickets in order, so one that
        arrived may wait behind others); a reader asking for it then gets it
        from here instead of fetching it a second time.
        """
        data = self._in_hand.get(chunk)
        if data is None and (ticket := self._tickets.get(chunk)) is not None:
            data = ticket.peek()
        return data

    def adopt(self, ref: ChunkRef, data: bytes) -> bool:
        """Take a chunk the fetcher got from the store for someone else; True if the tree will have it.

        On the trio loop (the fetcher's ``adopter`` hook).  True also for a
        chunk already done or claimed (the feeder asked for it too, and writes
        it from its ticket): the chunk cache need not keep a copy.  False when
        no pass is running or ``adopt_bytes`` are waiting: the caller keeps it
        (chunk cache) as before.
        """
        chunk = ref.chunk
        if not self._adopting:
            return False
        if chunk in self._done or chunk in self._claimed:
            return True
        if self._adopted_size + len(data) > self.adopt_bytes:
            return False
        self._claimed.add(chunk)
        self._in_hand[chunk] = data
        self._adopted.append((ref, data))
        self._adopted_size += len(data)
        self._adopt_wakeup.set()
        return True

    def tree_path(self, ino: int) -> bytes | None:
        """The tree's file for regular file ``ino``, complete or not (its done chunks are in place)."""
        return self._tree_file(ino) if self._done else None

    def _tree_file(self, ino: int) -> bytes | None:
        row = self._db().execute("SELECT path FROM files WHERE ino=?", (ino,)).fetchone()
        return self._dest(row[0]) if row else None

    # -- progress ---------------------------------------------------------------------------
    def _sample(self) -> None:
        now = time.monotonic()
        self._samples.append((now, sum(self._class_done)))
        while len(self._samples) > 2 and now - self._samples[1][0] > 10.0:
            self._samples.popleft()

    def rate(self) -> float:
        """Bytes per second written over the last ~10 s."""
        if not self._samples:
            return 0.0
        t0, b0 = self._samples[0]
        now, done = time.monotonic(), sum(self._class_done)
        return (done - b0) / (now - t0) if now - t0 > 0.05 else 0.0

    def stats(self) -> dict[str, Any]:
        total, done = sum(self._class_total), sum(self._class_done)
        rate = self.rate()
        eta = (total - done) / rate if rate > 0 and self.state == "running" else None
        return {
            "state": self.state, "reason": self.reason, "complete": self.complete, "tree": str(self.tree),
            "classes": {name: {"bytes_done": self._class_done[i], "bytes_total": self._class_total[i]}
                        for i, name in enumerate(CLASSES)},
            "bytes_done": done, "bytes_total": total, "rate_bps": round(rate), "eta_s": None if eta is None else round(eta, 1),
            "files_complete": len(self._complete), "files_total": self.files_total, "failed_chunks": self.failed_chunks,
            "adopted_chunks": self.adopted_chunks,
        }

    # -- running --------------------------------------------------------------------------------
    async def run(self, trace: list[Entry] | None = None, *, on_prepared: Callable[[], None] | None = None,
                  task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Materialize until everything is local, the disk is full, or cancelled; never raises for those.

        ``trace``: (path, offset) entries of the access trace to fetch first.
        ``on_prepared``: called once the tree and the plan exist (or materialization was refused).
        """
        task_status.started()
        if self.state == "not materializing":
            log.info("%s", self.reason)
            return
        self.state = "preparing"
        try:
            try:
                ok = await trio.to_thread.run_sync(self._prepare, trace or [])
            finally:
                if on_prepared is not None:
                    on_prepared()
            if not ok:
                self.state = "not materializing"
                log.warning("%s", self.reason)
                return
            self.state = "running"
            self._sample()
            delay = self.retry_delay
            while True:
                self._retry = 0
                self._abort_pass = False
                await self._pass()
                if not self._retry:
                    break
                self.state = "waiting"
                self.reason = f"the store is unavailable; trying again in {delay:.0f} s"
                log.warning("materialization: %s", self.reason)
                await trio.sleep(delay)
                delay = min(delay * 2, 300.0)
                self.state, self.reason = "running", None
            self.complete = await trio.to_thread.run_sync(self._finish)
        except _Stop:
            self.state = "stopped"
            log.error("%s", self.reason)
            return
        if self.complete:
            self.state, self.reason = "done", None
            log.info("materialization complete: %s in %s", human(sum(self._class_done)), self.tree)
        else:
            self.state = "incomplete"
            self.reason = f"{self.failed_chunks} chunk(s) could not be fetched; their files are served lazily"
            log.error("materialization incomplete: %s", self.reason)

    def _stop(self, exc: BaseException, what: str) -> _Stop:
        done, total = human(sum(self._class_done)), human(sum(self._class_total))
        if _disk_full(exc):
            self.reason = (f"stopped: the disk of {self.state_dir} is full ({what}; {done} of {total} local);"
                           " serving the rest lazily")
        else:
            self.reason = f"stopped: {what} failed ({exc}); {done} of {total} local, serving the rest lazily"
        return _Stop(self.reason)

    # -- preparation (worker thread) ---------------------------------------------------------------
    def _free_bytes(self) -> tuple[int, int]:
        st = os.statvfs(self.state_dir)
        return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize

    def _catalog_data_bytes(self) -> int:
        uri = f"file:{urllib.parse.quote(str(Path(self.catalog.path).absolute()))}?mode=ro&immutable=1"
        with contextlib.closing(sqlite3.connect(uri, uri=True)) as db:
            try:
                return int(db.execute("SELECT coalesce(sum(length), 0) FROM extents").fetchone()[0])
            except (sqlite3.Error, TypeError, ValueError):
                raise CorruptObject(f"catalog {self.catalog.path.name} is damaged") from None

    def _fits(self, needed: int) -> bool:
        free, size = self._free_bytes()
        margin = self.reserve_bytes if self.reserve_bytes is not None else max(64 * MiB, min(GiB, size // 50))
        if needed and needed + margin > free:
            self.reason = (f"not materializing: needs {human(needed + margin)} ({human(needed)} of data + "
                           f"{human(margin)} margin), {human(free)} free in {self.state_dir}")
            return False
        return True

    def _prepare(self, trace: list[Entry]) -> bool:
        db = self._db()
        try:
            return self._prepare_in(db, trace)
        except BaseException:
            if db.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    db.execute("ROLLBACK")
            raise

    def _prepare_in(self, db: sqlite3.Connection, trace: list[Entry]) -> bool:
        try:
            if self._meta(db, "built") != "1":
                if not self._fits(self._catalog_data_bytes()):
                    return False
                self._ltree = LocalTree(self._tree_b)
                self._build(db)
                self._fresh = True
            else:
                needed = db.execute("SELECT coalesce(sum(c.rlen), 0) FROM targets t JOIN chunks c ON c.chunk = t.chunk"
                                    " WHERE c.done = 0").fetchone()[0]
                if not self._fits(needed):
                    return False
                self._ltree = LocalTree(self._tree_b, create=False)
            self._classify_trace(db, trace)
            self._complete_files(db, [r[0] for r in db.execute(
                "SELECT ino FROM files WHERE pending <= 0 AND complete = 0")])
        except (OSError, sqlite3.Error) as exc:
            raise self._stop(exc, "preparing the local tree") from None
        except OgrefsError as exc:
            raise self._stop(exc, "preparing the local tree") from None
        for cls, total, done in db.execute("SELECT cls, sum(rlen), sum(rlen * done) FROM chunks GROUP BY cls"):
            self._class_total[cls] = total
            self._class_done[cls] = done
        self.files_total = db.execute("SELECT count(*) FROM files").fetchone()[0]
        self._complete = {r[0] for r in db.execute("SELECT ino FROM files WHERE complete=1")}
        self._done = {r[0] for r in db.execute("SELECT chunk FROM chunks WHERE done=1")}
        return True

    def _build(self, db: sqlite3.Connection) -> None:
        """Create the tree and the plan (from scratch: an interrupted build is redone)."""
        t0 = time.monotonic()
        db.execute("BEGIN")
        for table in ("files", "others", "chunks", "targets"):
            db.execute(f"DELETE FROM {table}")
        db.execute("DELETE FROM meta WHERE key IN ('built', 'finished')")
        root = self.catalog.get(ROOT_INO)
        if root is None:
            raise CorruptObject("catalog has no root directory")
        tree = self._lt()
        others: list[tuple[int, bytes, int]] = [(ROOT_INO, b"", 1)]
        files: list[tuple[int, bytes]] = []
        first: dict[int, bytes] = {}  # hardlinked inode -> its first path
        for path, node in self.catalog.walk():
            if node.is_dir:
                tree.make_dir(path)
                others.append((node.ino, path, 1))
            else:
                link_to = first.get(node.ino) if node.nlink > 1 else None
                try:
                    made = _create_entry(tree, path, node, link_to)
                except PermissionError as exc:  # device nodes need root; the mount still serves them
                    log.info("materialization: cannot create %s (%s)", os.fsdecode(path), exc.strerror)
                    continue
                if not made or link_to is not None:
                    continue
                if node.nlink > 1:
                    first[node.ino] = path
                if node.is_reg:
                    files.append((node.ino, path))
                else:
                    others.append((node.ino, path, 0))
            if len(files) >= 1000:
                db.executemany("INSERT INTO files (ino, path) VALUES (?,?)", files)
                files.clear()
            if len(others) >= 1000:
                db.executemany("INSERT INTO others (ino, path, dir) VALUES (?,?,?)", others)
                others.clear()
        db.executemany("INSERT INTO files (ino, path) VALUES (?,?)", files)
        db.executemany("INSERT INTO others (ino, path, dir) VALUES (?,?,?)", others)
        # the plan: every extent of every file in the tree, each distinct chunk once
        rows: list[tuple] = []
        bad: set[int] = set()  # files whose data the catalog locates wrongly: never local, read lazily (EIO)
        for ino, off, length, chunk, pack, poff, slen in self.catalog.all_extents(
                on_malformed=lambda ino, _why: bad.add(ino)):
            if pack is None:
                bad.add(ino)
                continue
            rows.append((ino, off, length, chunk, pack, poff, slen))
            if len(rows) >= 2000:
                self._add_extents(db, rows)
                rows.clear()
        self._add_extents(db, rows)
        if bad:
            log.error("materialization: %d file(s) have malformed data locations in the catalog; they are "
                      "not materialized (reading them fails)", len(bad))
            db.executemany("DELETE FROM files WHERE ino=?", [(ino,) for ino in bad])
        db.execute("DELETE FROM targets WHERE ino NOT IN (SELECT ino FROM files)")
        db.execute("DELETE FROM chunks WHERE chunk NOT IN (SELECT chunk FROM targets)")
        db.execute("UPDATE files SET pending = (SELECT count(*) FROM targets t WHERE t.ino = files.ino)")
        # hints, in rank order: their files' chunks come before everything else but the trace
        for seq, (klass, ino, _rank) in enumerate(self.catalog.hints()):
            for fino in self._hint_files(ino):
                db.execute("UPDATE chunks SET base_cls=?, base_seq=? WHERE base_cls=? AND chunk IN "
                           "(SELECT chunk FROM targets WHERE ino=?)", (HINT, seq, BACKGROUND, fino))
        db.execute("UPDATE chunks SET cls=base_cls, seq=base_seq")
        # special files are complete now; regular files without data too (below, via pending = 0)
        for ino, path in db.execute("SELECT ino, path FROM others WHERE dir=0").fetchall():
            node = self.catalog.get(ino)
            if node is not None:
                self._apply_metadata(path, node)
        _syncfs(self._tree_b)
        self._set_meta(db, "built", "1")
        db.execute("COMMIT")
        n = db.execute("SELECT count(*), coalesce(sum(rlen), 0) FROM chunks").fetchone()
        log.info("materialization: local tree built in %.1f s (%d files, %d chunks, %s to fetch)",
                 time.monotonic() - t0, db.execute("SELECT count(*) FROM files").fetchone()[0], n[0], human(n[1]))

    @staticmethod
    def _add_extents(db: sqlite3.Connection, rows: list[tuple]) -> None:
        db.executemany("INSERT OR IGNORE INTO chunks (chunk, pack, poff, slen, rlen) VALUES (?,?,?,?,?)",
                       [(chunk, pack, poff, slen, length) for _i, _o, length, chunk, pack, poff, slen in rows])
        db.executemany("INSERT OR IGNORE INTO targets VALUES (?,?,?)",
                       [(chunk, ino, off) for ino, off, _l, chunk, _p, _po, _s in rows])

    def _hint_files(self, ino: int) -> Iterable[int]:
        node = self.catalog.get(ino)
        if node is None:
            return
        if node.is_reg:
            yield ino
        elif node.is_dir:
            for _path, child in self.catalog.walk(ino):
                if child.is_reg:
                    yield child.ino

    def _classify_trace(self, db: sqlite3.Connection, trace: list[Entry]) -> None:
        """This run's trace chunks (not yet done) go first, in trace order; an older run's trace class is undone."""
        db.execute("BEGIN")
        db.execute("UPDATE chunks SET cls=base_cls, seq=base_seq WHERE cls=?", (TRACE,))
        if trace:
            resolver = EntryResolver(self.catalog)
            order: dict[bytes, int] = {}
            for r in resolver.resolve(trace):
                order.setdefault(r.extent.chunk, len(order))
            db.executemany("UPDATE chunks SET cls=?, seq=? WHERE chunk=? AND done=0",
                           [(TRACE, seq, chunk) for chunk, seq in order.items()])
            log.info("materialization: %d trace chunks first (%d trace entries no longer exist)",
                     len(order), resolver.dropped)
        db.execute("COMMIT")

    def _complete_files(self, db: sqlite3.Connection, inos: list[int]) -> list[int]:
        """Apply the final metadata of files whose data is all done, then record them complete."""
        done = []
        for ino in inos:
            row = db.execute("SELECT path FROM files WHERE ino=?", (ino,)).fetchone()
            node = self.catalog.get(ino)
            if row is None or node is None:
                continue
            self._apply_metadata(row[0], node)
            done.append(ino)
        if done:
            db.execute("BEGIN")
            db.executemany("UPDATE files SET complete=1 WHERE ino=?", [(i,) for i in done])
            db.execute("COMMIT")
        return done

    def _finish(self) -> bool:
        """Directories get their metadata (deepest first) once every file is complete; True if all is local."""
        db = self._db()
        if self._meta(db, "finished") == "1":
            return True
        left = db.execute("SELECT count(*) FROM files WHERE complete=0").fetchone()[0]
        if left:
            return False
        try:
            for ino, path in db.execute("SELECT ino, path FROM others WHERE dir=1 ORDER BY seq DESC").fetchall():
                node = self.catalog.get(ino)
                if node is not None:
                    self._apply_metadata(path, node)
            _syncfs(self._tree_b)
            db.execute("BEGIN")
            self._set_meta(db, "finished", "1")
            db.execute("COMMIT")
        except (OSError, sqlite3.Error) as exc:
            raise self._stop(exc, "applying directory metadata") from None
        return True

    # -- one pass over what is not done ---------------------------------------------------------------
    def _page(self, after: tuple | None, limit: int) -> tuple[list[_Item], tuple | None]:
        """Worker thread: the next ``limit`` chunks not done, in order, with their targets; and the last one's key."""
        db = self._db()
        cols = "id, chunk, pack, poff, slen, rlen, cls, seq"
        if after is None:
            rows = db.execute(f"SELECT {cols} FROM chunks WHERE done=0 ORDER BY {_ORDER} LIMIT ?", (limit,)).fetchall()
        else:
            rows = db.execute(f"SELECT {cols} FROM chunks WHERE done=0 AND ({_ORDER}) > (?,?,?,?,?) "
                              f"ORDER BY {_ORDER} LIMIT ?", (*after, limit)).fetchall()
        if not rows:
            return [], None
        targets = self._targets(db, [r[1] for r in rows])
        items = [_Item(id_, ChunkRef(chunk, pack, poff, slen, rlen), cls, tuple(targets.get(chunk, ())))
                 for id_, chunk, pack, poff, slen, rlen, cls, _seq in rows]
        id_, _c, pack, poff, _s, _r, cls, seq = rows[-1]
        return items, (cls, seq, pack, poff, id_)

    @staticmethod
    def _targets(db: sqlite3.Connection, chunks: list[bytes]) -> dict[bytes, list[tuple[int, int, bytes]]]:
        targets: dict[bytes, list[tuple[int, int, bytes]]] = {}
        marks = ",".join("?" * len(chunks))
        for chunk, ino, off, path in db.execute(
                f"SELECT t.chunk, t.ino, t.off, f.path FROM targets t JOIN files f ON f.ino = t.ino "
                f"WHERE t.chunk IN ({marks})", chunks):
            targets.setdefault(chunk, []).append((ino, off, path))
        return targets

    def _adopted_items(self, refs: tuple[ChunkRef, ...]) -> list[_Item | None]:
        """Worker thread: the plan rows of adopted chunks (None for a chunk the plan does not hold, or done)."""
        db = self._db()
        rows = {}
        for i in range(0, len(refs), 500):
            part = [r.chunk for r in refs[i:i + 500]]
            marks = ",".join("?" * len(part))
            rows.update((chunk, (id_, cls)) for id_, chunk, cls in db.execute(
                f"SELECT id, chunk, cls FROM chunks WHERE done=0 AND chunk IN ({marks})", part))
        targets = self._targets(db, list(rows))
        out: list[_Item | None] = []
        for ref in refs:
            row = rows.get(ref.chunk)
            out.append(None if row is None else _Item(row[0], ref, row[1], tuple(targets.get(ref.chunk, ()))))
        return out

    async def _pass(self) -> None:
        """Fetch and write every chunk not done yet: feeder -> collector -> writer, in order."""
        budget = _Budget(self.window_bytes)
        items_send, items_recv = trio.open_memory_channel[tuple[_Item, Ticket, bool]](math.inf)
        batch_send, batch_recv = trio.open_memory_channel[tuple[list[tuple[_Item, bytes]], int]](1)
        self._stopped = False
        self._claimed = set()
        self._in_hand, self._tickets = {}, {}
        async with trio.open_nursery() as outer:
            self._pass_scope = outer.cancel_scope
            self._adopting = True
            outer.start_soon(self._write_adopted)
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._feed, budget, items_send)
                    nursery.start_soon(self._collect, budget, items_recv, batch_send)
                    nursery.start_soon(self._write, budget, batch_recv)
            finally:
                self._adopting = False  # no more; the adoption writer drains what it has and ends
                self._adopt_wakeup.set()
        self._in_hand, self._tickets = {}, {}  # (empty unless the pass stopped: a write failed, or cancelled)
        if self._stopped:
            raise _Stop(self.reason)

    async def _feed(self, budget: _Budget, send: trio.MemorySendChannel) -> None:
        """Request chunks in pack-ordered groups of one class while the window has room."""
        async with send:
            after = None
            while not self._abort_pass:
                page, after = await trio.to_thread.run_sync(self._page, after, 512)
                if not page:
                    return
                groups: list[list[_Item]] = []
                size = 0
                for item in page:
                    if item.id in self._failed or item.ref.chunk in self._claimed or item.ref.chunk in self._done:
                        continue  # (adopted meanwhile, or written since the page was read)
                    if not groups or item.cls != groups[-1][0].cls or size + item.ref.raw_len > self.group_bytes:
                        groups.append([])
                        size = 0
                    groups[-1].append(item)
                    size += item.ref.raw_len
                for group in groups:
                    # the window counts what must come over the link: chunks in memory are ready
                    size = sum(i.ref.raw_len for i in group if not self.fetcher.is_cached_in_memory(i.ref.chunk))
                    await budget.acquire(size)
                    if self._abort_pass:
                        budget.release(size)
                        return
                    # adopted (and perhaps written) while the window was full
                    group = [i for i in group if i.ref.chunk not in self._claimed and i.ref.chunk not in self._done]
                    if not group:
                        budget.release(size)
                        continue
                    self._claimed.update(i.ref.chunk for i in group)
                    # A fresh tree's GETs may bridge small gaps (what is in them was fetched by this
                    # run, e.g. the trace chunks among a venv's files); after a restart they never do,
                    # so no chunk already on disk is fetched again.
                    tickets = self.fetcher.request([i.ref for i in group], _PRIORITY[group[0].cls],
                                                   keep=_KEEP[group[0].cls], bridge=self._fresh, take=True)
                    # (a chunk evicted from memory since the check above is fetched after all: charge it)
                    ready = sum(i.ref.raw_len for i, t in zip(group, tickets) if t.ready)
                    budget.settle(charged=sum(i.ref.raw_len for i in group) - ready, ready=ready, acquired=size)
                    for i, t in zip(group, tickets):
                        self._tickets[i.ref.chunk] = t
                        send.send_nowait((i, t, not t.ready))

    async def _collect(self, budget: _Budget, recv: trio.MemoryReceiveChannel,
                       send: trio.MemorySendChannel) -> None:
        batch: list[tuple[_Item, bytes]] = []
        size = 0
        charged = 0  # of the batch's bytes, those counted against the window

        async def flush() -> None:
            nonlocal batch, size, charged
            if batch:
                await send.send((batch, charged))
                batch, size, charged = [], 0, 0

        async with send, recv:
            current: tuple[_Item, Ticket, bool] | None = None
            while True:
                if current is None:
                    if batch:
                        with trio.move_on_after(self.flush_after):
                            try:
                                current = await recv.receive()
                            except trio.EndOfChannel:
                                break
                        if current is None:
                            await flush()  # the next chunk is slow to come: write what we have meanwhile
                            continue
                    else:
                        try:
                            current = await recv.receive()
                        except trio.EndOfChannel:
                            break
                item, ticket, is_charged = current
                try:
                    if batch:
                        data = None
                        with trio.move_on_after(self.flush_after):
                            data = await ticket.result()
                        if data is None:
                            await flush()
                            continue
                    else:
                        data = await ticket.result()
                except FetchError as exc:
                    current = None
                    if is_charged:
                        budget.release(item.ref.raw_len)
                    self._claimed.discard(item.ref.chunk)
                    self._tickets.pop(item.ref.chunk, None)
                    self._fetch_failed(item, exc)
                    continue
                current = None
                batch.append((item, data))
                size += len(data)
                if is_charged:
                    charged += item.ref.raw_len
                if size >= self.batch_bytes or len(batch) >= self.batch_chunks:
                    await flush()
            await flush()

    def _fetch_failed(self, item: _Item, exc: FetchError) -> None:
        if isinstance(exc, StoreUnavailable):
            self._retry += 1
            self._abort_pass = True  # stop asking for more; what is requested drains, then the run pauses
            return
        self._failed.add(item.id)
        self.failed_chunks += 1
        kind = "missing from the store" if isinstance(exc, ChunkMissing) else "corrupt"
        paths = b", ".join(t[2] for t in item.targets[:3])
        log.error("materialization: chunk of %s is %s: %s", os.fsdecode(paths), kind, exc.reason)

    async def _write(self, budget: _Budget, recv: trio.MemoryReceiveChannel) -> None:
        async with recv:
            async for batch, charged in recv:
                if not await self._write_locked(batch):
                    return
                budget.written(charged, sum(item.ref.raw_len for item, _ in batch) - charged)

    async def _write_locked(self, batch: list[tuple[_Item, bytes]]) -> bool:
        """Write one batch (taking turns with the other writer) and record it here; False if the pass stops."""
        try:
            async with self._write_lock:
                newly = await trio.to_thread.run_sync(self._write_batch, batch)
        except (OSError, sqlite3.Error, OgrefsError) as exc:
            self._stop(exc, "writing the local tree")
            self._stopped = True
            assert self._pass_scope is not None
            self._pass_scope.cancel()
            return False
        for item, _data in batch:
            self._class_done[item.cls] += item.ref.raw_len
            self._done.add(item.ref.chunk)
            self._claimed.discard(item.ref.chunk)
            self._in_hand.pop(item.ref.chunk, None)
            self._tickets.pop(item.ref.chunk, None)
        self._complete.update(newly)
        self._sample()
        return True

    async def _write_adopted(self) -> None:
        """Write adopted chunks into the tree in batches until the pass ends and nothing is left."""
        while True:
            if not self._adopted:
                if not self._adopting:
                    return
                self._adopt_wakeup = trio.Event()
                await self._adopt_wakeup.wait()
                continue
            take, size = [], 0
            while self._adopted and (not take or size < self.batch_bytes) and len(take) < self.batch_chunks:
                ref, data = self._adopted.popleft()
                take.append((ref, data))
                size += len(data)
            items = await trio.to_thread.run_sync(self._adopted_items, tuple(r for r, _ in take))
            batch = []
            for (ref, data), item in zip(take, items):
                if item is None:
                    self._claimed.discard(ref.chunk)
                    self._in_hand.pop(ref.chunk, None)
                else:
                    batch.append((item, data))
            ok = not batch or await self._write_locked(batch)
            self._adopted_size -= size
            self.adopted_chunks += len(batch)
            if not ok:
                return

    def _write_batch(self, batch: list[tuple[_Item, bytes]]) -> list[int]:
        """Worker thread: write, fdatasync, then record done; returns the inodes that became complete."""
        fds: dict[int, int] = {}
        written: list[tuple[int, int, int]] = []  # (fd, offset, length)
        try:
            for item, data in batch:
                for ino, off, path in item.targets:
                    fd = fds.get(ino)
                    if fd is None:
                        fd = fds[ino] = self._lt().open(path, os.O_WRONLY)
                    pwrite_all(fd, data, off)
                    if item.cls != _TRACE_CLASS:
                        written.append((fd, off, len(data)))
            if len(fds) > _SYNCFS_ABOVE:
                _syncfs_fd(next(iter(fds.values())))  # many small files: one flush of the file system is cheaper
            else:
                for fd in fds.values():
                    os.fdatasync(fd)
            # Durable now: the written pages leave the page cache.  The application that reads them
            # has them in the mount's own page cache already (adopted chunks) or reads them from disk
            # later, as after a reboot; a copy of the whole snapshot in the page cache would only
            # push out what the box is using (its training data) and, in a VM whose free memory is
            # handed back to the host, make every new page cost a fault in the host.
            # Not the trace's chunks: the trace is what the application reads next (its start-up,
            # bounded by the replay's memory), and dropping them sent those reads to the disk, where
            # on a busy box they queued behind another writer's fsyncs (issue 17).
            for fd, off, n in written:
                if n >= _DROP_FROM_PAGE_CACHE:
                    os.posix_fadvise(fd, off, n, os.POSIX_FADV_DONTNEED)
        finally:
            for fd in fds.values():
                os.close(fd)
        db = self._db()
        pending: Counter[int] = Counter()
        db.execute("BEGIN")
        try:
            for item, _ in batch:
                # only a chunk that was not done yet counts towards its files (never twice: a file must
                # not look complete before every one of its chunks is in place)
                if db.execute("UPDATE chunks SET done=1 WHERE id=? AND done=0", (item.id,)).rowcount:
                    pending.update(ino for ino, _o, _p in item.targets)
            db.executemany("UPDATE files SET pending=pending-? WHERE ino=?", [(n, ino) for ino, n in pending.items()])
            db.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                db.execute("ROLLBACK")
            raise
        ready = []
        for ino in pending:
            row = db.execute("SELECT pending, complete FROM files WHERE ino=?", (ino,)).fetchone()
            if row is not None and row[0] <= 0 and not row[1]:
                ready.append(ino)
        return self._complete_files(db, ready)

