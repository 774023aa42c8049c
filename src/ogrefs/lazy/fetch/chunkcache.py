"""The local chunk cache on disk: verified plaintext chunks, bounded by size, LRU.

Layout under the cache root (default ``<XDG cache>/ogrefs/chunks``)::

    data/<hh>/<64 hex>      one file per chunk, its plaintext
    tmp/                    files being written (renamed into data/ when complete)
    lru.sqlite              (id, size, used) per chunk, WAL, shared by processes

Why it is safe to share between mounts and processes, and to crash at any time:

* A chunk file is written under ``tmp/`` and renamed into place, so a writer
  that dies leaves no half chunk under its name.  It is not fsynced: a cache
  needs no durability, and after a power loss a renamed file may be empty or
  torn, which the verification on load (below) catches like any other damage.
  (An fsync per chunk cost the first minutes of a mount thousands of disk
  flushes for the small files of a Python environment.)  Its row is inserted
  before the rename: a crash in between leaves a row without a file, which
  reads as a miss and is dropped by the next eviction.
* Every load is verified (raw length and BLAKE3 of the plaintext against the
  name; keyed BLAKE3 for an encrypted repository) before its bytes are used.  BLAKE3 runs at several GB/s, so this costs
  ~0.2 ms per MiB and protects against a torn disk, bit rot and tampering; a
  file that fails is deleted and the chunk is fetched again.
* Eviction deletes the least recently used rows and then their files.  A reader
  in another process that has the file open keeps reading it (POSIX unlink
  semantics); one that opens it a moment later sees a miss.

Recency is recorded lazily: a hit adds the id to an in-memory batch that
:meth:`flush` writes in one transaction (the fetcher calls it about once a
second), so a hot read path never waits on an SQLite write.

Chunks are plaintext, also those of encrypted repositories (a mount serves
plaintext anyway): the root and its directories are 0700, chunk files and
``lru.sqlite`` (with its -wal and -shm files) 0600.

Concurrency: every method blocks (disk and SQLite) and is meant to be called
from worker threads.  Each thread gets its own SQLite connection; ``_lock``
guards the pending-recency batch and the running size estimate, and nothing
else.  Several processes may open the same root at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import blake3

from ogrefs.repo.localdb import wal_connect
from ogrefs.units import GiB

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 10 * GiB

#: After an eviction the cache holds at most this fraction of its bound, so that
#: eviction runs in batches rather than on every insert.
_LOW_WATER = 0.9
#: Temporary files older than this are debris from a crashed writer.
_STALE_TMP_SECONDS = 3600


def default_cache_size(root: Path) -> int:
    """10 GiB, or a quarter of the free space of the file system if that is less."""
    try:
        st = os.statvfs(root if root.exists() else root.parent)
        free = st.f_bavail * st.f_frsize
    except OSError:
        return DEFAULT_MAX_BYTES
    return max(256 * 1024 * 1024, min(DEFAULT_MAX_BYTES, free // 4))


class CacheCipher:
    """AES-256-GCM for cache files; immutable and thread-safe."""

    overhead = 12 + 16  # nonce + tag

    def __init__(self, key: bytes) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        self._aead = AESGCM(key)

    def seal(self, cid: bytes, data: bytes) -> bytes:
        nonce = os.urandom(12)
        return nonce + self._aead.encrypt(nonce, data, cid)

    def open(self, cid: bytes, blob: bytes) -> bytes | None:
        from cryptography.exceptions import InvalidTag

        if len(blob) < self.overhead:
            return None
        try:
            return self._aead.decrypt(blob[:12], blob[12:], cid)
        except InvalidTag:
            return None


class ChunkCache:
    """A directory of verified chunks shared by every mount of this user."""

    def __init__(self, root: Path, max_bytes: int | None = None, *, verify: bool = True,
                 chunk_id: Callable[[bytes], bytes] | None = None, cipher: "CacheCipher | None" = None) -> None:
        """``cipher`` (``--encrypt-cache``): chunk files are sealed with AES-GCM under a key derived
        from the repository's master key, bound to their chunk id; a file that fails to open is
        treated as damaged."""
        self.root = Path(root)
        self.cipher = cipher
        self.data_dir = self.root / "data"
        self.tmp_dir = self.root / "tmp"
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        if self.root.stat().st_mode & 0o077:
            os.chmod(self.root, 0o700)  # chunk ids, sizes and access times are private too
        self.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.tmp_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.max_bytes = max_bytes if max_bytes is not None else default_cache_size(self.root)
        self.verify = verify
        # an encrypted repository names chunks by keyed BLAKE3: verify with its function
        self._chunk_id = chunk_id or (lambda data: blake3.blake3(data).digest())
        self._db_path = self.root / "lru.sqlite"
        self._local = threading.local()
        self._lock = threading.Lock()
        self._touched: dict[bytes, float] = {}
        db = self._db()
        db.execute(
            "CREATE TABLE IF NOT EXISTS chunks (id BLOB PRIMARY KEY, size INTEGER NOT NULL, used REAL NOT NULL)"
            " WITHOUT ROWID")
        db.execute("CREATE INDEX IF NOT EXISTS chunks_used ON chunks(used)")
        self._size = self.usage()
        self._sweep_tmp()

    # -- plumbing ------------------------------------------------------------------
    def _db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = self._local.db = wal_connect(self._db_path)
        return db

    def path(self, cid: bytes) -> Path:
        h = cid.hex()
        return self.data_dir / h[:2] / h

    def _sweep_tmp(self) -> None:
        cutoff = time.time() - _STALE_TMP_SECONDS
        with os.scandir(self.tmp_dir) as it:
            for entry in it:
                with contextlib.suppress(OSError):
                    if entry.stat().st_mtime < cutoff:
                        os.unlink(entry.path)

    # -- the operations ----------------------------------------------------------------
    def contains(self, cid: bytes) -> bool:
        """Whether a file for the chunk exists (it is verified only when loaded)."""
        return self.path(cid).exists()

    def load(self, cid: bytes, raw_len: int) -> bytes | None:
        """The chunk's verified plaintext, or None when absent or damaged (then removed)."""
        path = self.path(cid)
        extra = self.cipher.overhead if self.cipher else 0
        try:
            with open(path, "rb", buffering=0) as fh:
                data = fh.read(raw_len + extra + 1)
        except FileNotFoundError:
            return None
        if self.cipher is not None:
            opened = self.cipher.open(cid, data)
            if opened is None:
                log.warning("chunk cache: %s does not decrypt; dropping it", path)
                self.discard(cid)
                return None
            data = opened
        if len(data) != raw_len or (self.verify and self._chunk_id(data) != cid):
            log.warning("chunk cache: %s is damaged (%d bytes, expected %d); dropping it", path, len(data), raw_len)
            self.discard(cid)
            return None
        with self._lock:
            self._touched[cid] = time.time()
        return data

    def store(self, cid: bytes, data: bytes) -> None:
        """Add a chunk atomically; the caller has verified ``data`` against ``cid``."""
        path = self.path(cid)
        if path.exists():
            return
        db = self._db()
        db.execute("INSERT OR REPLACE INTO chunks VALUES (?,?,?)", (cid, len(data), time.time()))
        fd, tmp_path = tempfile.mkstemp(dir=self.tmp_dir, prefix=cid.hex()[:16] + ".")
        try:
            view = memoryview(self.cipher.seal(cid, data) if self.cipher else data)
            while view:
                view = view[os.write(fd, view):]
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp_path)
            raise
        os.close(fd)
        path.parent.mkdir(exist_ok=True, mode=0o700)
        os.replace(tmp_path, path)
        with self._lock:
            self._size += len(data)
            over = self._size > self.max_bytes
        if over:
            self.evict()

    def discard(self, cid: bytes) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(cid))
        self._db().execute("DELETE FROM chunks WHERE id=?", (cid,))

    # -- bookkeeping -------------------------------------------------------------------
    def flush(self) -> None:
        """Write the recency of recent hits (batched so hits never wait on SQLite)."""
        with self._lock:
            touched, self._touched = self._touched, {}
        if touched:
            db = self._db()
            db.execute("BEGIN")
            db.executemany("UPDATE chunks SET used=? WHERE id=?", [(t, c) for c, t in touched.items()])
            db.execute("COMMIT")

    def usage(self) -> int:
        """Bytes of chunks recorded by every process sharing this cache."""
        return self._db().execute("SELECT coalesce(sum(size), 0) FROM chunks").fetchone()[0]

    def evict(self, target: int | None = None) -> int:
        """Drop least recently used chunks until at most ``target`` bytes remain; returns bytes freed."""
        self.flush()
        target = int(self.max_bytes * _LOW_WATER) if target is None else target
        db = self._db()
        total = self.usage()
        freed = 0
        victims: list[bytes] = []
        if total > target:
            for cid, size in db.execute("SELECT id, size FROM chunks ORDER BY used"):
                if total - freed <= target:
                    break
                victims.append(cid)
                freed += size
            db.execute("BEGIN")
            db.executemany("DELETE FROM chunks WHERE id=?", [(c,) for c in victims])
            db.execute("COMMIT")
            for cid in victims:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path(cid))
        with self._lock:
            self._size = total - freed
        return freed

    def close(self) -> None:
        """Flush recency; per-thread connections close with their threads."""
        self.flush()
