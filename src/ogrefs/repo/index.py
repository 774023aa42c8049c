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

Every cached row carries a check value (keyed BLAKE3 of the row under a key
derived from the repository key, or plain BLAKE3 when unencrypted); a row that
fails it on lookup is dropped and every index object is merged again on the
next ``sync``, so a damaged cache never makes a snapshot reference a wrong
location.  An index object in the store that does not decode is skipped with
one warning naming it (its packs are found again by orphan recovery).

Concurrency: one ChunkIndex is owned by one thread for writes (``sync``,
``add``); ``lookup`` may be called from any thread and uses a per-thread
read connection (SQLite WAL allows concurrent readers). ``sync`` fetches and
decodes the index objects it has not merged several at a time
(fetchmany.py: threads that only GET and decode) and inserts them itself.
"""

from __future__ import annotations

import logging
import sqlite3
import struct
import threading
from pathlib import Path
from typing import Iterable, Iterator

import blake3

from ogrefs.repo import codec
from ogrefs.repo.localdb import wal_connect
from ogrefs.errors import CorruptObject
from ogrefs.store.base import NotFound, Store
from ogrefs.repo.fetchmany import in_order
from ogrefs.repo.pack import BlobLocation

log = logging.getLogger(__name__)

_ENTRY = struct.Struct("<32s32sQII")
#: Cache schema version (PRAGMA user_version): 2 added the per-row check value.
_SCHEMA_VERSION = 2

IndexEntry = tuple[bytes, str, int, int, int]  # chunk id, pack name (hex), offset, stored_len, raw_len


def encode_index(entries: Iterable[IndexEntry], rc: codec.RepoCodec | None = None, name: str = "") -> bytes:
    body = b"".join(_ENTRY.pack(cid, bytes.fromhex(pack), off, slen, rlen) for cid, pack, off, slen, rlen in entries)
    return rc.seal(name, body) if rc else codec.wrap(body)


def index_limit(stored_len: int) -> int:
    """Bound on an index object's plaintext: its entries are random ids and barely compress."""
    return 16 * stored_len + 16 * 1024 * 1024


def decode_index(obj: bytes, what: str, rc: codec.RepoCodec | None = None) -> Iterator[IndexEntry]:
    limit = index_limit(len(obj))
    raw = rc.open(what, obj, limit) if rc else codec.unwrap(obj, what, limit)
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
        key = rc.local_key("ogrefs 2026 index cache rows") if rc is not None else None
        self._row_key = key or blake3.blake3(b"", derive_key_context="ogrefs 2026 index cache rows").digest()
        if self._db.execute("PRAGMA user_version").fetchone()[0] < _SCHEMA_VERSION:
            self._db.executescript("DROP TABLE IF EXISTS chunks; DROP TABLE IF EXISTS merged;")
        self._db.executescript(
            f"""
            CREATE TABLE IF NOT EXISTS chunks (
                id BLOB NOT NULL, pack TEXT NOT NULL, offset INTEGER NOT NULL,
                stored_len INTEGER NOT NULL, raw_len INTEGER NOT NULL, mac BLOB NOT NULL,
                PRIMARY KEY (id, pack)) WITHOUT ROWID;
            CREATE TABLE IF NOT EXISTS merged (name TEXT PRIMARY KEY) WITHOUT ROWID;
            PRAGMA user_version = {_SCHEMA_VERSION};
            """
        )
        self._local = threading.local()

    def _mac(self, cid: object, pack: object, off: object, slen: object, rlen: object) -> bytes:
        row = repr((cid, pack, off, slen, rlen)).encode()
        return blake3.blake3(row, key=self._row_key).digest()[:16]

    def _rows(self, entries: Iterable[IndexEntry]) -> list[tuple]:
        return [(*e, self._mac(*e)) for e in entries]

    def _connect(self) -> sqlite3.Connection:
        return wal_connect(self._path)

    def sync(self) -> int:
        """Merge index objects not yet in the cache; returns how many were merged."""
        names = {k.rsplit("/", 1)[1] for k in self._store.list("index/")}
        merged = {r[0] for r in self._db.execute("SELECT name FROM merged")}
        self.forget_merged(merged - names)
        count = 0
        for name, fetched in in_order(self._fetch, sorted(names - merged)):  # several round trips at once
            try:
                entries = fetched()
            except NotFound:
                continue  # deleted between list and get: its content lives in a consolidated object
            except CorruptObject as exc:
                log.warning("warning: skipped index object index/%s: %s", name, exc)
                continue
            self._db.execute("BEGIN")
            self._db.executemany("INSERT OR IGNORE INTO chunks VALUES (?,?,?,?,?,?)", self._rows(entries))
            self._db.execute("INSERT OR IGNORE INTO merged VALUES (?)", (name,))
            self._db.execute("COMMIT")
            count += 1
        return count

    def _fetch(self, name: str) -> list[IndexEntry]:
        """One index object, decoded (in a fetch thread: the store and the codec are thread-safe)."""
        return list(decode_index(self._store.get(f"index/{name}"), f"index/{name}", self._rc))

    def add(self, entries: list[IndexEntry], merged_name: str | None = None) -> None:
        """Record entries we just wrote ourselves (and, optionally, the object that holds them)."""
        self._db.execute("BEGIN")
        self._db.executemany("INSERT OR IGNORE INTO chunks VALUES (?,?,?,?,?,?)", self._rows(entries))
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
        for pack, off, slen, rlen, mac in db.execute(
                "SELECT pack, offset, stored_len, raw_len, mac FROM chunks WHERE id=?", (cid,)).fetchall():
            if mac != self._mac(cid, pack, off, slen, rlen):
                self._drop_damaged(db, cid, pack)
                continue
            if live_packs is None or pack in live_packs:
                return BlobLocation(pack, off, slen, rlen)
        return None

    def _drop_damaged(self, db: sqlite3.Connection, cid: bytes, pack: object) -> None:
        """A row that fails its check: gone, and every index object is merged again at the next sync."""
        log.warning("warning: the local index cache %s has a damaged row (chunk %s); it is rebuilt",
                    self._path, cid.hex()[:16])
        db.execute("DELETE FROM chunks WHERE id=? AND pack=?", (cid, pack))
        db.execute("DELETE FROM merged")

    def packs(self) -> set[str]:
        return {r[0] for r in self._db.execute("SELECT DISTINCT pack FROM chunks")}

    def __len__(self) -> int:
        return self._db.execute("SELECT count(*) FROM chunks").fetchone()[0]
