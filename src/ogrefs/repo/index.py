"""The repository-wide chunk index, and its local SQLite cache.

In the store, the index is a set of immutable ``index/<name>`` objects, each
listing (chunk id, pack, offset, stored length, raw length) for some packs.
Writers never modify an index object; they add new ones, so any number of
boxes can write at once and readers take the union.  Each snapshot writes one
index object per pack as soon as the pack is uploaded (so an interrupted
snapshot's packs are reused by the next run) and a consolidated object at the
end, after which it deletes its per-pack objects.

Locally the union is cached in ``<cache>/index.sqlite`` (never in RAM: lesson 3
of ANCHORS.md).  An index object that disappears from the store was either
consolidated into another one or dropped together with its packs; either way
its rows may stay in the cache, because the cache is only ever used together
with the current listing of ``packs/`` (a row whose pack is not listed counts as
absent), so it never makes a snapshot reference a pack that is gone.

Concurrency: one ChunkIndex is owned by one thread for writes (``sync``,
``add``); ``lookup`` may be called from any thread and uses a per-thread
read connection (SQLite WAL allows concurrent readers).
"""

from __future__ import annotations

import sqlite3
import struct
import threading
from pathlib import Path
from typing import Iterable, Iterator

from .. import codec
from ..localdb import wal_connect
from ..errors import CorruptObject
from ..store.base import NotFound, Store
from .pack import BlobLocation

_ENTRY = struct.Struct("<32s32sQII")

IndexEntry = tuple[bytes, str, int, int, int]  # chunk id, pack name (hex), offset, stored_len, raw_len


def encode_index(entries: Iterable[IndexEntry], rc: codec.RepoCodec | None = None, name: str = "") -> bytes:
    body = b"".join(_ENTRY.pack(cid, bytes.fromhex(pack), off, slen, rlen) for cid, pack, off, slen, rlen in entries)
    return rc.seal(name, body) if rc else codec.wrap(body)


def decode_index(obj: bytes, what: str, rc: codec.RepoCodec | None = None) -> Iterator[IndexEntry]:
    raw = rc.open(what, obj) if rc else codec.unwrap(obj, what)
    if len(raw) % _ENTRY.size:
        raise CorruptObject(f"{what}: index has a partial entry")
    for i in range(0, len(raw), _ENTRY.size):
        cid, pack, off, slen, rlen = _ENTRY.unpack_from(raw, i)
        yield cid, pack.hex(), off, slen, rlen


class ChunkIndex:
    def __init__(self, store: Store, path: Path, rc: codec.RepoCodec | None = None) -> None:
        self._store = store
        self._rc = rc
        self._path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = self._connect()
        self._db.executescript(
            """
            CREATE TABLE IF NOT EXISTS chunks (
                id BLOB NOT NULL, pack TEXT NOT NULL, offset INTEGER NOT NULL,
                stored_len INTEGER NOT NULL, raw_len INTEGER NOT NULL, PRIMARY KEY (id, pack)) WITHOUT ROWID;
            CREATE TABLE IF NOT EXISTS merged (name TEXT PRIMARY KEY) WITHOUT ROWID;
            """
        )
        self._local = threading.local()

    def _connect(self) -> sqlite3.Connection:
        return wal_connect(self._path)

    def sync(self) -> int:
        """Merge index objects not yet in the cache; returns how many were merged."""
        names = {k.rsplit("/", 1)[1] for k in self._store.list("index/")}
        merged = {r[0] for r in self._db.execute("SELECT name FROM merged")}
        self.forget_merged(merged - names)
        count = 0
        for name in sorted(names - merged):
            try:
                obj = self._store.get(f"index/{name}")
            except NotFound:
                continue  # deleted between list and get: its content lives in a consolidated object
            entries = list(decode_index(obj, f"index/{name}", self._rc))
            self._db.execute("BEGIN")
            self._db.executemany("INSERT OR IGNORE INTO chunks VALUES (?,?,?,?,?)", entries)
            self._db.execute("INSERT OR IGNORE INTO merged VALUES (?)", (name,))
            self._db.execute("COMMIT")
            count += 1
        return count

    def add(self, entries: list[IndexEntry], merged_name: str | None = None) -> None:
        """Record entries we just wrote ourselves (and, optionally, the object that holds them)."""
        self._db.execute("BEGIN")
        self._db.executemany("INSERT OR IGNORE INTO chunks VALUES (?,?,?,?,?)", entries)
        if merged_name:
            self._db.execute("INSERT OR IGNORE INTO merged VALUES (?)", (merged_name,))
        self._db.execute("COMMIT")

    def forget_merged(self, names: Iterable[str]) -> None:
        self._db.executemany("DELETE FROM merged WHERE name=?", [(n,) for n in names])

    def lookup(self, cid: bytes, live_packs: set[str] | None = None) -> BlobLocation | None:
        """A location of ``cid``; with ``live_packs``, only one in a pack that is listed and not trash.

        A chunk can be in several packs (two boxes stored it at once, or it
        was stored again after its first pack was marked for deletion).
        """
        db = getattr(self._local, "db", None)
        if db is None:
            db = self._local.db = self._connect()
        for row in db.execute("SELECT pack, offset, stored_len, raw_len FROM chunks WHERE id=?", (cid,)):
            if live_packs is None or row[0] in live_packs:
                return BlobLocation(*row)
        return None

    def packs(self) -> set[str]:
        return {r[0] for r in self._db.execute("SELECT DISTINCT pack FROM chunks")}

    def __len__(self) -> int:
        return self._db.execute("SELECT count(*) FROM chunks").fetchone()[0]
