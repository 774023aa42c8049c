"""The per-snapshot catalog: a SQLite database describing every entry and chunk.

Schema (docs/format.md has the authoritative description):

* ``inodes``   one row per inode: full st_mode, owner ids and names, size,
               times in ns, rdev, symlink target, source dev/ino (for the
               incremental check), nlink within the snapshot, flags.
* ``dirents``  (parent, name) -> ino; names are raw bytes (any byte but / and NUL).
* ``xattrs``   (ino, name) -> value.
* ``extents``  a regular file's data as (file offset, length, blob); gaps are holes.
* ``blobs``    catalog-local blob number -> chunk id and its location
               (pack, offset, stored length, raw length).
* ``packs``    catalog-local pack number -> pack name.
* ``roots``    the absolute paths that were snapshotted.
* ``hints``    prefetch hints: (class, ino, rank).
* ``meta``     key/value.

Inode 1 is ``/``; inode numbers are assigned in walk order and never change, so
they are stable across mounts.  A reader needs only this file and the packs.

Concurrency: a CatalogWriter belongs to the snapshotting thread.  A Catalog
(reader) opens one read-only SQLite connection per thread that uses it.
"""

from __future__ import annotations

import sqlite3
import stat
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, NamedTuple

import sqlite_utils

from .errors import CorruptObject
from .repo.pack import BlobLocation

ROOT_INO = 1
FLAG_CHANGED = 1  # the file kept changing while it was read


class Inode(NamedTuple):
    ino: int
    mode: int
    uid: int
    gid: int
    user: str | None
    grp: str | None
    size: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    nlink: int
    rdev: int
    target: bytes | None
    src_dev: int
    src_ino: int
    flags: int

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)

    @property
    def is_reg(self) -> bool:
        return stat.S_ISREG(self.mode)

    @property
    def is_lnk(self) -> bool:
        return stat.S_ISLNK(self.mode)


_INODE_COLS = "ino, mode, uid, gid, user, grp, size, atime_ns, mtime_ns, ctime_ns, nlink, rdev, target, src_dev, src_ino, flags"
_I_COLS = ", ".join("i." + c.strip() for c in _INODE_COLS.split(","))


@dataclass(frozen=True)
class Extent:
    """A run of file data backed by one chunk."""

    offset: int  # in the file
    length: int
    chunk: bytes
    pack: str
    pack_offset: int
    stored_len: int

    @property
    def end(self) -> int:
        return self.offset + self.length


def create_schema(path: Path) -> None:
    db = sqlite_utils.Database(path)
    db["inodes"].create(
        {"ino": int, "mode": int, "uid": int, "gid": int, "user": str, "grp": str, "size": int,
         "atime_ns": int, "mtime_ns": int, "ctime_ns": int, "nlink": int, "rdev": int, "target": bytes,
         "src_dev": int, "src_ino": int, "flags": int},
        pk="ino",
    )
    db["dirents"].create({"parent": int, "name": bytes, "ino": int}, pk=("parent", "name"))
    db["xattrs"].create({"ino": int, "name": bytes, "value": bytes}, pk=("ino", "name"))
    db["extents"].create({"ino": int, "offset": int, "length": int, "blob": int}, pk=("ino", "offset"))
    db["blobs"].create({"id": int, "chunk": bytes, "pack": int, "offset": int, "stored_len": int, "raw_len": int},
                       pk="id")
    db["blobs"].create_index(["chunk"], unique=True)
    db["packs"].create({"id": int, "name": str}, pk="id")
    db["packs"].create_index(["name"], unique=True)
    db["roots"].create({"path": bytes}, pk="path")
    db["hints"].create({"class": str, "ino": int, "rank": int}, pk=("class", "ino"))
    db["meta"].create({"key": str, "value": str}, pk="key")
    db["dirents"].create_index(["ino"])
    db.conn.close()


class CatalogWriter:
    """Builds a catalog file.  Owned by one thread; call :meth:`close` once."""

    def __init__(self, path: Path) -> None:
        create_schema(path)
        self.path = path
        self._db = sqlite3.connect(path, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=OFF")
        self._db.execute("PRAGMA synchronous=OFF")
        self._db.execute("BEGIN")
        self._next_ino = ROOT_INO
        self._blob_ids: dict[bytes, int] = {}
        self._pack_ids: dict[str, int] = {}

    def new_ino(self) -> int:
        ino = self._next_ino
        self._next_ino += 1
        return ino

    def add_inode(self, ino: int, st, user: str | None, grp: str | None, *, size: int | None = None,
                  target: bytes | None = None, flags: int = 0) -> None:
        self._db.execute(
            f"INSERT OR REPLACE INTO inodes ({_INODE_COLS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (ino, st.st_mode, st.st_uid, st.st_gid, user, grp, st.st_size if size is None else size,
             st.st_atime_ns, st.st_mtime_ns, st.st_ctime_ns, 0,
             st.st_rdev if (stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)) else 0,
             target, st.st_dev, st.st_ino, flags),
        )

    def copy_inode(self, ino: int, old: Inode) -> None:
        self._db.execute(
            f"INSERT OR REPLACE INTO inodes ({_INODE_COLS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (ino, *old[1:10], 0, *old[11:]),
        )

    def add_dirent(self, parent: int, name: bytes, ino: int) -> None:
        self._db.execute("INSERT OR REPLACE INTO dirents VALUES (?,?,?)", (parent, name, ino))

    def add_xattrs(self, ino: int, items: list[tuple[bytes, bytes]]) -> None:
        self._db.executemany("INSERT OR REPLACE INTO xattrs VALUES (?,?,?)", [(ino, n, v) for n, v in items])

    def _blob(self, chunk: bytes, raw_len: int) -> int:
        bid = self._blob_ids.get(chunk)
        if bid is None:
            bid = len(self._blob_ids) + 1
            self._blob_ids[chunk] = bid
            self._db.execute("INSERT INTO blobs (id, chunk, raw_len) VALUES (?,?,?)", (bid, chunk, raw_len))
        return bid

    def add_extents(self, ino: int, extents: list[tuple[int, int, bytes]]) -> None:
        """(file offset, length, chunk id) for each chunk of the file."""
        self._db.executemany(
            "INSERT INTO extents VALUES (?,?,?,?)",
            [(ino, off, length, self._blob(cid, length)) for off, length, cid in extents],
        )

    def add_located_extents(self, ino: int, extents: list[tuple[int, int, bytes, BlobLocation]]) -> None:
        """Like add_extents, for chunks whose location is already known (reused from a parent)."""
        rows = []
        for off, length, cid, loc in extents:
            new = cid not in self._blob_ids
            bid = self._blob(cid, length)
            if new:
                self.set_location(cid, loc)
            rows.append((ino, off, length, bid))
        self._db.executemany("INSERT INTO extents VALUES (?,?,?,?)", rows)

    def set_location(self, chunk: bytes, loc: BlobLocation) -> None:
        bid = self._blob_ids.get(chunk)
        if bid is None:
            return
        pid = self._pack_ids.get(loc.pack)
        if pid is None:
            pid = self._pack_ids[loc.pack] = len(self._pack_ids) + 1
            self._db.execute("INSERT INTO packs VALUES (?,?)", (pid, loc.pack))
        self._db.execute("UPDATE blobs SET pack=?, offset=?, stored_len=? WHERE id=?",
                         (pid, loc.offset, loc.stored_len, bid))

    def unlocated(self) -> list[bytes]:
        return [r[0] for r in self._db.execute("SELECT chunk FROM blobs WHERE pack IS NULL")]

    def add_root(self, path: bytes) -> None:
        self._db.execute("INSERT OR IGNORE INTO roots VALUES (?)", (path,))

    def add_hint(self, klass: str, ino: int, rank: int) -> None:
        self._db.execute("INSERT OR IGNORE INTO hints VALUES (?,?,?)", (klass, ino, rank))

    def resolve(self, path: bytes) -> int | None:
        """The inode number at an absolute path written so far (for hints)."""
        ino = ROOT_INO
        for part in path.split(b"/"):
            if not part:
                continue
            row = self._db.execute("SELECT ino FROM dirents WHERE parent=? AND name=?", (ino, part)).fetchone()
            if row is None:
                return None
            ino = row[0]
        return ino

    def set_meta(self, key: str, value: str) -> None:
        self._db.execute("INSERT OR REPLACE INTO meta VALUES (?,?)", (key, value))

    def close(self) -> None:
        """Fix link counts, commit, and compact the file for upload."""
        self._db.execute("UPDATE inodes SET nlink = (SELECT count(*) FROM dirents d WHERE d.ino = inodes.ino)")
        self._db.execute(
            "UPDATE inodes SET nlink = nlink + 1 + (SELECT count(*) FROM dirents d JOIN inodes c ON c.ino = d.ino "
            "WHERE d.parent = inodes.ino AND (c.mode & 61440) = 16384) WHERE (mode & 61440) = 16384"
        )
        self._db.execute("COMMIT")
        self._db.execute("VACUUM")
        self._db.close()


class Catalog:
    """Read access to a catalog file; safe to share between threads."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._local = threading.local()
        try:
            db = self._db()
            db.execute("SELECT 1 FROM inodes WHERE ino=?", (ROOT_INO,)).fetchone()
        except sqlite3.DatabaseError as exc:
            raise CorruptObject(f"catalog {path.name} is not a readable SQLite catalog ({exc})") from None

    def _db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(f"file:{self.path}?mode=ro&immutable=1", uri=True, check_same_thread=False)
            self._local.db = db
        return db

    def get(self, ino: int) -> Inode | None:
        row = self._db().execute(f"SELECT {_INODE_COLS} FROM inodes WHERE ino=?", (ino,)).fetchone()
        return Inode(*row) if row else None

    def lookup(self, parent: int, name: bytes) -> Inode | None:
        row = self._db().execute(
            f"SELECT {_I_COLS} FROM dirents d "
            "JOIN inodes i ON i.ino = d.ino WHERE d.parent=? AND d.name=?",
            (parent, name),
        ).fetchone()
        return Inode(*row) if row else None

    def children(self, parent: int, after: bytes | None = None, limit: int = -1) -> list[tuple[bytes, Inode]]:
        rows = self._db().execute(
            f"SELECT d.name, {_I_COLS} FROM dirents d JOIN inodes i ON i.ino = d.ino "
            "WHERE d.parent=? AND d.name > ? ORDER BY d.name LIMIT ?",
            (parent, after or b"", limit),
        )
        return [(r[0], Inode(*r[1:])) for r in rows]

    def xattrs(self, ino: int) -> list[tuple[bytes, bytes]]:
        return [(r[0], r[1]) for r in self._db().execute("SELECT name, value FROM xattrs WHERE ino=? ORDER BY name", (ino,))]

    def extents(self, ino: int) -> list[Extent]:
        rows = self._db().execute(
            "SELECT e.offset, e.length, b.chunk, p.name, b.offset, b.stored_len FROM extents e "
            "JOIN blobs b ON b.id = e.blob LEFT JOIN packs p ON p.id = b.pack WHERE e.ino=? ORDER BY e.offset",
            (ino,),
        ).fetchall()
        out = []
        for off, length, chunk, pack, poff, slen in rows:
            if pack is None:
                raise CorruptObject(f"catalog {self.path.name}: chunk {chunk.hex()[:12]} has no location")
            out.append(Extent(off, length, chunk, pack, poff, slen))
        return out

    def located_extents(self, ino: int) -> list[tuple[int, int, bytes, BlobLocation | None]]:
        """(offset, length, chunk id, location or None) in one query: for incremental reuse."""
        return [(off, ln, cid, BlobLocation(pack, poff, slen, rlen) if pack else None)
                for off, ln, cid, pack, poff, slen, rlen in self._db().execute(
                    "SELECT e.offset, e.length, b.chunk, p.name, b.offset, b.stored_len, b.raw_len FROM extents e "
                    "JOIN blobs b ON b.id = e.blob LEFT JOIN packs p ON p.id = b.pack WHERE e.ino=? ORDER BY e.offset",
                    (ino,))]

    def raw_extents(self, ino: int) -> list[tuple[int, int, bytes, int]]:
        """(offset, length, chunk id, raw_len) without locations: for incremental reuse."""
        return self._db().execute(
            "SELECT e.offset, e.length, b.chunk, b.raw_len FROM extents e JOIN blobs b ON b.id = e.blob "
            "WHERE e.ino=? ORDER BY e.offset", (ino,)).fetchall()

    def blob_location(self, chunk: bytes) -> BlobLocation | None:
        row = self._db().execute(
            "SELECT p.name, b.offset, b.stored_len, b.raw_len FROM blobs b JOIN packs p ON p.id = b.pack "
            "WHERE b.chunk=?", (chunk,)).fetchone()
        return BlobLocation(*row) if row else None

    def pack_names(self) -> list[str]:
        return [r[0] for r in self._db().execute("SELECT name FROM packs")]

    def roots(self) -> list[bytes]:
        return [r[0] for r in self._db().execute("SELECT path FROM roots ORDER BY path")]

    def hints(self) -> list[tuple[str, int, int]]:
        return self._db().execute("SELECT class, ino, rank FROM hints ORDER BY rank").fetchall()

    def meta(self, key: str) -> str | None:
        row = self._db().execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return row[0] if row else None

    def resolve(self, path: bytes) -> Inode | None:
        """The inode at an absolute path, or None."""
        node = self.get(ROOT_INO)
        for part in path.split(b"/"):
            if not part:
                continue
            if node is None or not node.is_dir:
                return None
            node = self.lookup(node.ino, part)
        return node

    def walk(self, ino: int = ROOT_INO, prefix: bytes = b"") -> Iterator[tuple[bytes, Inode]]:
        """Depth-first (path, inode) for every entry below ``ino`` (not ``ino`` itself), names sorted."""
        stack = [(ino, prefix)]
        while stack:
            dino, dpath = stack.pop()
            kids = self.children(dino)
            for name, node in kids:
                path = dpath + b"/" + name
                yield path, node
            for name, node in reversed(kids):
                if node.is_dir:
                    stack.append((node.ino, dpath + b"/" + name))

    def counts(self) -> dict[str, int]:
        db = self._db()
        return {
            "inodes": db.execute("SELECT count(*) FROM inodes").fetchone()[0],
            "blobs": db.execute("SELECT count(*) FROM blobs").fetchone()[0],
            "packs": db.execute("SELECT count(*) FROM packs").fetchone()[0],
        }

    def all_blobs(self) -> Iterator[tuple[bytes, str, int, int, int]]:
        """(chunk, pack, offset, stored_len, raw_len) for every blob, pack by pack."""
        yield from self._db().execute(
            "SELECT b.chunk, p.name, b.offset, b.stored_len, b.raw_len FROM blobs b JOIN packs p ON p.id = b.pack "
            "ORDER BY p.name, b.offset")

    def all_extents(self) -> Iterator[tuple[int, int, int, bytes, str | None, int, int]]:
        """(ino, file offset, length, chunk, pack, pack offset, stored_len) for every extent."""
        yield from self._db().execute(
            "SELECT e.ino, e.offset, e.length, b.chunk, p.name, b.offset, b.stored_len FROM extents e "
            "JOIN blobs b ON b.id = e.blob LEFT JOIN packs p ON p.id = b.pack")
