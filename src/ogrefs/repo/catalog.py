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
(reader) opens one read-only SQLite connection per thread that uses it; its
``rejected`` record is guarded by ``_rejected_lock``.  The scratch table
:func:`subtree` fills (``temp.subtree_rows``) lives in that connection's own
temp schema, so each thread has its own.  A CatalogWriter attaches the
catalogs :meth:`~CatalogWriter.add_copied` reads to its own connection,
read-only and immutable.
"""

from __future__ import annotations

import logging
import re
import sqlite3
import stat
import sys
import threading
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Callable, Iterable, Iterator, NamedTuple


from ogrefs.errors import CorruptObject
from ogrefs.repo.pack import BlobLocation

log = logging.getLogger(__name__)

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


class Listed(NamedTuple):
    """One entry of a directory as :func:`listing` gives it."""

    name: bytes
    node: Inode
    xattrs: list[tuple[bytes, bytes]]
    extents: list[tuple[int, int, bytes, BlobLocation | None]]  # regular files only


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


def _sqlite_utils() -> ModuleType:
    """sqlite_utils, imported without the pandas and numpy it imports whenever they are installed.

    Imported here, not at the top: only writers create a schema, and
    sqlite_utils (70-odd modules) is a third of a read-only mount's start-up.
    Its numpy and pandas column types are never used by a catalog, but with
    ogrefs installed in a training venv they would be imported by every
    snapshot: ~50 ms and 80 modules for numpy, several hundred ms for pandas,
    at a preemption notice, and hundreds of files read on a cold box.  Either
    one already imported by the process stays as it is.
    """
    if "sqlite_utils" in sys.modules:
        return sys.modules["sqlite_utils"]
    blocked = [name for name in ("pandas", "numpy") if name not in sys.modules]
    for name in blocked:
        sys.modules[name] = None  # type: ignore[assignment]  # `import name` raises ImportError
    try:
        import sqlite_utils
    finally:
        for name in blocked:
            if sys.modules.get(name, 0) is None:
                del sys.modules[name]
    return sqlite_utils


def create_schema(path: Path) -> None:
    db = _sqlite_utils().Database(path)
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


_COPY_INODE_SQL = f"INSERT OR REPLACE INTO inodes ({_INODE_COLS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)"


def _copied_inode(ino: int, old: Inode) -> tuple:
    """``old``'s row under inode ``ino``; nlink 0, counted again at close."""
    return (ino, *old[1:10], 0, *old[11:])


def _valid_xattr(name: object, value: object) -> bool:
    """What every reader of a catalog's xattrs checks: a non-empty name without NUL, bytes both."""
    return type(name) is bytes and bool(name) and b"\0" not in name and type(value) is bytes


class CatalogWriter:
    """Builds a catalog file.  Owned by one thread; call :meth:`close` once."""

    def __init__(self, path: Path) -> None:
        create_schema(path)
        self.path = path
        # a URI, so that ATTACH (add_copied) takes one too: the catalogs it reads are opened read-only
        self._db = sqlite3.connect(f"file:{urllib.parse.quote(str(Path(path).absolute()))}", uri=True,
                                   isolation_level=None)
        self._db.execute("PRAGMA journal_mode=OFF")
        self._db.execute("PRAGMA synchronous=OFF")
        self._db.execute("BEGIN")
        self._next_ino = ROOT_INO
        self._blob_ids: dict[bytes, int] = {}
        self._pack_ids: dict[str, int] = {}
        self._attached: dict[Path, str] = {}  # catalogs add_copied reads, by the schema name they have here

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
        self._db.execute(_COPY_INODE_SQL, _copied_inode(ino, old))

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
        self._insert_located([(ino, extents)])

    def add_copied(self, tree: "Subtree", new_top: int, inodes: list[tuple[int, int]],
                   xattrs: list[tuple[int, bytes, bytes]]) -> None:
        """Entries of ``tree`` copied in SQL from its catalog: ``inodes`` maps each one's inode there to its
        new number here (the top directory, ``new_top``, is the caller's); what :meth:`add_dirent`,
        :meth:`copy_inode`, :meth:`add_xattrs` and :meth:`add_located_extents` do one by one, in one
        statement per table, the rows never passing through Python.

        Every chunk must be located in one of ``tree.packs`` (treecopy.py refuses the copy otherwise); a
        chunk new to this catalog gets its blob row, location included, one it already has keeps its own (it
        may be this run's, located at commit).  The number of extents written is checked against what
        :func:`subtree` counted: a copy that would leave a hole raises instead.
        """
        db, src = self._db, self._attach(tree.source)
        db.execute("CREATE TEMP TABLE IF NOT EXISTS copied (old INTEGER PRIMARY KEY, new INTEGER NOT NULL)")
        db.execute("CREATE TEMP TABLE IF NOT EXISTS copied_packs (name TEXT PRIMARY KEY, id INTEGER NOT NULL)")
        db.execute("DELETE FROM temp.copied")
        db.execute("DELETE FROM temp.copied_packs")
        db.executemany("INSERT INTO temp.copied VALUES (?,?)", inodes)
        db.executemany("INSERT INTO temp.copied_packs VALUES (?,?)", [(p, self._pack_id(p)) for p in tree.packs])
        db.execute(f"INSERT OR REPLACE INTO main.inodes ({_INODE_COLS}) SELECT c.new, i.mode, i.uid, i.gid, i.user, "
                   "i.grp, i.size, i.atime_ns, i.mtime_ns, i.ctime_ns, 0, i.rdev, i.target, i.src_dev, i.src_ino, "
                   f"i.flags FROM temp.copied c JOIN {src}.inodes i ON i.ino = c.old")
        db.execute("INSERT OR REPLACE INTO main.dirents SELECT coalesce(p.new, :top), d.name, c.new FROM temp.copied c "
                   f"JOIN {src}.dirents d ON d.ino = c.old LEFT JOIN temp.copied p ON p.old = d.parent "
                   "WHERE p.new IS NOT NULL OR d.parent = :old_top", {"top": new_top, "old_top": tree.top})
        # the copied regular files' extents (e) with their blobs (b) in the source
        extents = (f"temp.copied c JOIN {src}.inodes i ON i.ino = c.old JOIN {src}.extents e ON e.ino = c.old "
                   f"JOIN {src}.blobs b ON b.id = e.blob")
        known = len(self._blob_ids)
        db.execute("INSERT OR IGNORE INTO main.blobs (chunk, raw_len, pack, offset, stored_len) "
                   f"SELECT b.chunk, b.raw_len, cp.id, b.offset, b.stored_len FROM {extents} "
                   f"JOIN {src}.packs p ON p.id = b.pack JOIN temp.copied_packs cp ON cp.name = p.name "
                   f"WHERE {_S_IFREG_SQL}")
        for bid, chunk in db.execute("SELECT id, chunk FROM main.blobs WHERE id > ? ORDER BY id", (known,)).fetchall():
            if bid != len(self._blob_ids) + 1:
                raise RuntimeError(f"catalog writer: blob numbers are not dense ({bid} after {len(self._blob_ids)})")
            self._blob_ids[chunk] = bid
        n = db.execute(f"INSERT INTO main.extents SELECT c.new, e.offset, e.length, mb.id FROM {extents} "
                       f"JOIN main.blobs mb ON mb.chunk = b.chunk WHERE {_S_IFREG_SQL}").rowcount
        want = sum(tree.chunks.get(old, 0) for old, _ in inodes)
        if n != want:
            raise RuntimeError(f"catalog writer: a copied subtree has {n} extents where its catalog counted {want}")
        db.executemany("INSERT OR REPLACE INTO main.xattrs VALUES (?,?,?)", xattrs)

    def _attach(self, source: Path) -> str:
        """The schema name under which catalog ``source`` is attached (read-only, once per file)."""
        name = self._attached.get(source)
        if name is None:
            name = self._attached[source] = f"copysrc{len(self._attached)}"
            uri = f"file:{urllib.parse.quote(str(Path(source).absolute()))}?mode=ro&immutable=1"
            self._db.execute(f"ATTACH DATABASE ? AS {name}", (uri,))
        return name

    def _insert_located(self, extents: list[tuple[int, list[tuple[int, int, bytes, BlobLocation]]]]) -> None:
        """Extent rows of files whose chunks are located; a chunk new to this catalog gets its blob row,
        location included (one it already has keeps its own: it may be this run's, located at commit)."""
        new_blobs, rows = [], []
        for ino, located in extents:
            for off, length, cid, loc in located:
                bid = self._blob_ids.get(cid)
                if bid is None:
                    bid = self._blob_ids[cid] = len(self._blob_ids) + 1
                    new_blobs.append((bid, cid, length, self._pack_id(loc.pack), loc.offset, loc.stored_len))
                rows.append((ino, off, length, bid))
        self._db.executemany("INSERT INTO blobs (id, chunk, raw_len, pack, offset, stored_len) VALUES (?,?,?,?,?,?)",
                             new_blobs)
        self._db.executemany("INSERT INTO extents VALUES (?,?,?,?)", rows)

    def _pack_id(self, pack: str) -> int:
        pid = self._pack_ids.get(pack)
        if pid is None:
            pid = self._pack_ids[pack] = len(self._pack_ids) + 1
            self._db.execute("INSERT INTO packs VALUES (?,?)", (pid, pack))
        return pid

    def set_location(self, chunk: bytes, loc: BlobLocation) -> None:
        bid = self._blob_ids.get(chunk)
        if bid is None:
            return
        self._db.execute("UPDATE blobs SET pack=?, offset=?, stored_len=? WHERE id=?",
                         (self._pack_id(loc.pack), loc.offset, loc.stored_len, bid))

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


#: Longest file name Linux accepts (NAME_MAX); the snapshot walk never records a longer one.
NAME_MAX = 255
_U32 = 2**32
_I64 = 2**63
#: The largest chunk the format allows (config caps the chunker's max_size at 16 MiB).
MAX_CHUNK = 16 * 1024 * 1024


def valid_name(name: object) -> bool:
    """True if ``name`` can be a directory entry: non-empty bytes, not ``.``/``..``, no ``/`` or NUL.

    A catalog is only ever written by ``snapshot`` from ``listdir``, so it never
    holds anything else; a name that fails this came from a damaged or forged
    catalog, and joining it to a path could escape the restore target.
    """
    return (type(name) is bytes and 0 < len(name) <= NAME_MAX and name != b"." and name != b".."
            and b"/" not in name and b"\0" not in name)


def _int_in(v: object, lo: int, hi: int) -> bool:
    return type(v) is int and lo <= v < hi


def _check_inode(row: tuple, where: str) -> Inode:
    """An Inode from a catalog row, or CorruptObject if a column has the wrong type or range.

    SQLite does not enforce column types, so a damaged or forged catalog can
    hold text where a mode is expected, negative sizes, or a NUL in a symlink
    target; none of that may reach ``os`` calls (where it would raise
    TypeError, OverflowError or ValueError instead of a clean error).
    """
    (ino, mode, uid, gid, user, grp, size, atime, mtime, ctime, nlink, rdev, target, src_dev, src_ino,
     flags) = row
    ok = (_int_in(ino, 1, _I64) and _int_in(mode, 0, _U32) and _int_in(uid, 0, _U32) and _int_in(gid, 0, _U32)
          and (user is None or type(user) is str) and (grp is None or type(grp) is str)
          and _int_in(size, 0, _I64) and _int_in(atime, -_I64, _I64) and _int_in(mtime, -_I64, _I64)
          and _int_in(ctime, -_I64, _I64) and _int_in(nlink, 0, _I64) and _int_in(rdev, 0, _I64)
          and (target is None or (type(target) is bytes and b"\0" not in target))
          and type(src_dev) is int and type(src_ino) is int and type(flags) is int)
    if not ok:
        raise CorruptObject(f"catalog {where}: inode {ino!r} has a malformed row")
    return Inode(*row)


def _check_location(chunk: object, pack: object, poff: object, slen: object, where: str) -> None:
    if not (type(chunk) is bytes and len(chunk) == 32 and type(pack) is str and _PACK_NAME.fullmatch(pack)
            and _int_in(poff, 0, _I64) and _int_in(slen, 1, _U32)):
        raise CorruptObject(f"catalog {where}: a blob location is malformed")


_PACK_NAME = re.compile(r"[0-9a-f]{64}")
#: What a damaged SQLite file can raise: its own errors, and a column *name* that is not UTF-8.
_DB_ERRORS = (sqlite3.Error, UnicodeDecodeError)


def _one_line(exc: BaseException) -> str:
    """SQLite quotes schema text (newlines included) in its errors; the user gets one line."""
    return " ".join(str(exc).split())[:300]


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape")

#: Every table and column a reader uses; checked once when a catalog is opened.
_SCHEMA = {
    "inodes": _INODE_COLS,
    "dirents": "parent, name, ino",
    "xattrs": "ino, name, value",
    "extents": "ino, offset, length, blob",
    "blobs": "id, chunk, pack, offset, stored_len, raw_len",
    "packs": "id, name",
    "roots": "path",
    "hints": "class, ino, rank",
    "meta": "key, value",
}


class Catalog:
    """Read access to a catalog file; safe to share between threads.

    The reader trusts nothing in the file: a catalog that is not SQLite, lacks
    a table, or holds a row of the wrong shape raises CorruptObject (never a
    sqlite3, Type or Overflow error).  Directory entries whose name is not a
    valid file name (empty, ``.``, ``..``, containing ``/`` or NUL, longer
    than NAME_MAX), repeated names, and a directory reached a second time
    (a loop or a hard-linked directory) are *skipped*: logged once as a
    warning and recorded in :attr:`rejected`, so that neither a restore nor a
    mount can be led outside its tree.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._local = threading.local()
        self._rejected_lock = threading.Lock()
        #: (parent ino, name, reason) of every entry skipped so far.
        self.rejected: dict[tuple[int, bytes], str] = {}
        self._uri = f"file:{urllib.parse.quote(str(Path(path).absolute()))}?mode=ro&immutable=1"
        try:
            db = self._db()
            for table, cols in _SCHEMA.items():
                db.execute(f"SELECT {cols} FROM {table} LIMIT 0").fetchall()
            row = db.execute(f"SELECT {_INODE_COLS} FROM inodes WHERE ino=?", (ROOT_INO,)).fetchone()
        except _DB_ERRORS as exc:
            raise CorruptObject(f"catalog {path.name} is not a readable SQLite catalog ({_one_line(exc)})") from None
        if row is None or not stat.S_ISDIR(_check_inode(row, path.name).mode):
            raise CorruptObject(f"catalog {path.name} has no root directory")

    def _db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(self._uri, uri=True, check_same_thread=False)
            db.text_factory = _text  # a damaged file may hold text that is not UTF-8
            self._local.db = db
        return db

    def _rows(self, sql: str, args: tuple = ()) -> list[tuple]:
        try:
            return self._db().execute(sql, args).fetchall()
        except _DB_ERRORS as exc:
            raise CorruptObject(f"catalog {self.path.name} is damaged ({_one_line(exc)})") from None

    def _iter(self, sql: str, args: tuple = ()) -> Iterator[tuple]:
        try:
            cur = self._db().execute(sql, args)
            while rows := cur.fetchmany(1024):
                yield from rows
        except _DB_ERRORS as exc:
            raise CorruptObject(f"catalog {self.path.name} is damaged ({_one_line(exc)})") from None

    def _reject(self, parent: int, name: object, reason: str) -> None:
        key = (parent, name if isinstance(name, bytes) else repr(name).encode())
        with self._rejected_lock:
            if key in self.rejected:
                return
            self.rejected[key] = reason
        log.warning("catalog %s: skipped entry %r in directory inode %d: %s", self.path.name, key[1], parent, reason)

    def get(self, ino: int) -> Inode | None:
        rows = self._rows(f"SELECT {_INODE_COLS} FROM inodes WHERE ino=?", (ino,))
        return _check_inode(rows[0], self.path.name) if rows else None

    def lookup(self, parent: int, name: bytes) -> Inode | None:
        if not valid_name(name):
            return None
        rows = self._rows(
            f"SELECT {_I_COLS} FROM dirents d "
            "JOIN inodes i ON i.ino = d.ino WHERE d.parent=? AND d.name=? LIMIT 1",
            (parent, name),
        )
        return _check_inode(rows[0], self.path.name) if rows else None

    def children(self, parent: int, after: bytes | None = None, limit: int = -1) -> list[tuple[bytes, Inode]]:
        """Up to ``limit`` valid entries of ``parent`` whose name sorts after ``after``, in name order.

        Invalid and repeated names are skipped (see the class docstring); the
        page is refilled so that a short page still means "end of directory".
        """
        out: list[tuple[bytes, Inode]] = []
        cursor = after or b""
        prev: bytes | None = None
        while limit < 0 or len(out) < limit:
            want = -1 if limit < 0 else limit - len(out)
            rows = self._rows(
                f"SELECT d.name, {_I_COLS} FROM dirents d JOIN inodes i ON i.ino = d.ino "
                "WHERE d.parent=? AND d.name > ? ORDER BY d.name LIMIT ?",
                (parent, cursor, want),
            )
            for r in rows:
                name = r[0]
                if not valid_name(name):
                    self._reject(parent, name, "not a valid file name")
                elif name == prev:
                    self._reject(parent, name, "name appears twice in one directory")
                else:
                    out.append((name, _check_inode(r[1:], self.path.name)))
                prev = name
            if want < 0 or len(rows) < want:
                break
            last = rows[-1][0]
            if type(last) is not bytes:
                break  # a non-blob name sorts before every blob: nothing valid follows in this order
            cursor = last
        return out

    def xattrs(self, ino: int) -> list[tuple[bytes, bytes]]:
        out = []
        for name, value in self._rows("SELECT name, value FROM xattrs WHERE ino=? ORDER BY name", (ino,)):
            if _valid_xattr(name, value):
                out.append((name, value))
            else:
                self._reject(ino, b"xattr " + (name if type(name) is bytes else repr(name).encode()),
                             "malformed extended attribute")
        return out

    def extents(self, ino: int) -> list[Extent]:
        rows = self._rows(
            "SELECT e.offset, e.length, b.chunk, p.name, b.offset, b.stored_len, b.raw_len, i.size FROM extents e "
            "JOIN blobs b ON b.id = e.blob JOIN inodes i ON i.ino = e.ino LEFT JOIN packs p ON p.id = b.pack "
            "WHERE e.ino=? ORDER BY e.offset",
            (ino,),
        )
        out = []
        end = 0
        for off, length, chunk, pack, poff, slen, rlen, size in rows:
            if pack is None:
                hexid = chunk.hex()[:12] if isinstance(chunk, bytes) else "?"
                raise CorruptObject(f"catalog {self.path.name}: chunk {hexid} has no location")
            end = self._check_layout(ino, off, length, rlen, size, end)
            _check_location(chunk, pack, poff, slen, self.path.name)
            out.append(Extent(off, length, chunk, pack, poff, slen))
        return out

    def _check_extent(self, off: object, length: object) -> None:
        if not (_int_in(off, 0, _I64) and _int_in(length, 0, _U32)):
            raise CorruptObject(f"catalog {self.path.name}: an extent is malformed")

    def _check_layout(self, ino: object, off: object, length: object, raw_len: object, size: object,
                      prev_end: int) -> int:
        """One extent of a file, in offset order: it must lie where a snapshot could have put it.

        Extents follow each other without overlap (gaps are holes), end within
        the file's size, and are exactly one chunk long: as long as their blob
        says and no longer than the largest chunk the format allows. Anything
        else would make restore write wrong bytes or a huge file. Returns the
        extent's end.
        """
        self._check_extent(off, length)
        ok = (_int_in(raw_len, 1, MAX_CHUNK + 1) and length == raw_len and _int_in(size, 0, _I64)
              and off >= prev_end and off + length <= size)
        if not ok:
            raise CorruptObject(f"catalog {self.path.name}: the extents of inode {ino!r} do not lay out its "
                                f"data (offset {off!r}, length {length!r}, chunk of {raw_len!r} bytes, "
                                f"file of {size!r} bytes)")
        return off + length

    def located_extents(self, ino: int) -> list[tuple[int, int, bytes, BlobLocation | None]]:
        """(offset, length, chunk id, location or None) in one query: for incremental reuse."""
        return self._located(ino, self._rows(
            "SELECT e.offset, e.length, b.chunk, p.name, b.offset, b.stored_len, b.raw_len, i.size FROM extents e "
            "JOIN blobs b ON b.id = e.blob JOIN inodes i ON i.ino = e.ino LEFT JOIN packs p ON p.id = b.pack "
            "WHERE e.ino=? ORDER BY e.offset", (ino,)))

    def _located(self, ino: int, rows: Iterable[tuple]) -> list[tuple[int, int, bytes, BlobLocation | None]]:
        """One file's extent rows ``(offset, length, chunk, pack, pack offset, stored, raw, size)``, checked."""
        out = []
        end = 0
        for off, ln, cid, pack, poff, slen, rlen, size in rows:
            end = self._check_layout(ino, off, ln, rlen, size, end)
            if pack is not None:
                _check_location(cid, pack, poff, slen, self.path.name)
            elif not (type(cid) is bytes and len(cid) == 32):
                raise CorruptObject(f"catalog {self.path.name}: a chunk id is malformed")
            out.append((off, ln, cid, BlobLocation(pack, poff, slen, rlen) if pack else None))
        return out

    def raw_extents(self, ino: int) -> list[tuple[int, int, bytes, int]]:
        """(offset, length, chunk id, raw_len) without locations: for incremental reuse."""
        return self._rows(
            "SELECT e.offset, e.length, b.chunk, b.raw_len FROM extents e JOIN blobs b ON b.id = e.blob "
            "WHERE e.ino=? ORDER BY e.offset", (ino,))

    def blob_location(self, chunk: bytes) -> BlobLocation | None:
        rows = self._rows(
            "SELECT p.name, b.offset, b.stored_len, b.raw_len FROM blobs b JOIN packs p ON p.id = b.pack "
            "WHERE b.chunk=? LIMIT 1", (chunk,))
        if not rows:
            return None
        pack, poff, slen, rlen = rows[0]
        _check_location(chunk, pack, poff, slen, self.path.name)
        return BlobLocation(pack, poff, slen, rlen)

    def pack_names(self) -> list[str]:
        names = [r[0] for r in self._rows("SELECT name FROM packs")]
        for n in names:
            if not (type(n) is str and _PACK_NAME.fullmatch(n)):
                raise CorruptObject(f"catalog {self.path.name}: a pack name is malformed")
        return names

    def roots(self) -> list[bytes]:
        return [r[0] for r in self._rows("SELECT path FROM roots ORDER BY path")]

    def hints(self) -> list[tuple[str, int, int]]:
        return self._rows("SELECT class, ino, rank FROM hints ORDER BY rank")

    def meta(self, key: str) -> str | None:
        rows = self._rows("SELECT value FROM meta WHERE key=?", (key,))
        return rows[0][0] if rows else None

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
        """Depth-first (path, inode) for every entry below ``ino`` (not ``ino`` itself), names sorted.

        Each directory is entered once: a directory inode met again (a loop, or
        a hard-linked directory) is skipped and recorded in :attr:`rejected`,
        so a damaged catalog cannot make a walk endless.
        """
        seen = {ino}
        stack = [(ino, prefix)]
        while stack:
            dino, dpath = stack.pop()
            kids = []
            for name, node in self.children(dino):
                if node.is_dir:
                    if node.ino in seen:
                        self._reject(dino, name, f"directory inode {node.ino} is reached a second time")
                        continue
                    seen.add(node.ino)
                kids.append((name, node))
            for name, node in kids:
                yield dpath + b"/" + name, node
            for name, node in reversed(kids):
                if node.is_dir:
                    stack.append((node.ino, dpath + b"/" + name))

    # -- the mount's queries (lazy/fs/vfs.py, lazy/background/materialize) -------------------------------------------
    def _total(self, sql: str, args: tuple = ()) -> int:
        """A sum over rows that a snapshot wrote as integers: a forged text or real column is CorruptObject."""
        value = self._rows(sql, args)[0][0]
        if not _int_in(value, 0, _I64):
            raise CorruptObject(f"catalog {self.path.name}: a length is malformed")
        return value

    def data_bytes(self, ino: int) -> int:
        """Bytes of data (not holes) file ``ino`` holds: what its st_blocks count."""
        return self._total("SELECT coalesce(sum(length), 0) FROM extents WHERE ino=?", (ino,))

    def data_bytes_many(self, inos: list[int]) -> dict[int, int]:
        """:meth:`data_bytes` of each of ``inos`` that has data (a page of a listing: one query per 500)."""
        out: dict[int, int] = {}
        for i in range(0, len(inos), 500):
            part = tuple(inos[i:i + 500])
            for ino, total in self._rows(f"SELECT ino, sum(length) FROM extents WHERE ino IN "
                                         f"({','.join('?' * len(part))}) GROUP BY ino", part):
                if not _int_in(total, 0, _I64):
                    raise CorruptObject(f"catalog {self.path.name}: the extents of inode {ino!r} are malformed")
                out[ino] = total
        return out

    def file_data_total(self) -> int:
        """Bytes of file data in the snapshot, counted per file (hardlinks once, shared chunks each time)."""
        return self._total("SELECT coalesce(sum(length), 0) FROM extents")

    def unique_data_total(self) -> int:
        """Bytes of distinct chunk plaintext in the snapshot (what statfs reports as the size)."""
        return self._total("SELECT coalesce(sum(raw_len), 0) FROM blobs")

    def has_xattrs(self) -> bool:
        """Whether any inode has an extended attribute (none: the mount answers getxattr with ENOSYS)."""
        return bool(self._rows("SELECT 1 FROM xattrs LIMIT 1"))

    def parent_of(self, ino: int) -> int:
        """The directory holding ``ino`` (one of them for a hardlink); the root for the root and the unlisted."""
        rows = self._rows("SELECT parent FROM dirents WHERE ino=? LIMIT 1", (ino,))
        if not rows:
            return ROOT_INO
        if not _int_in(rows[0][0], 1, _I64):
            raise CorruptObject(f"catalog {self.path.name}: a directory entry of inode {ino!r} is malformed")
        return rows[0][0]

    def path_of(self, ino: int) -> bytes:
        """One path of ``ino`` (hardlinks have several), for messages; ends at a loop or a missing entry."""
        parts: list[bytes] = []
        seen = set()
        while ino != ROOT_INO and ino not in seen:
            seen.add(ino)
            rows = self._rows("SELECT parent, name FROM dirents WHERE ino=? LIMIT 1", (ino,))
            if not rows:
                return b"<inode %d>" % ino if type(ino) is int else b"<inode ?>"
            ino, name = rows[0]
            parts.append(name if valid_name(name) else repr(name).encode())
        return b"/" + b"/".join(reversed(parts))

    def small_files(self, parent: int, max_size: int, limit: int = 8192) -> list[tuple[int, int]]:
        """(ino, size) of the non-empty regular files of directory ``parent`` up to ``max_size``, in name order.

        Entries the listing would skip (see the class docstring) are left out here too."""
        out = []
        for name, ino, size in self._rows(
                "SELECT d.name, i.ino, i.size FROM dirents d JOIN inodes i ON i.ino = d.ino WHERE d.parent = ? "
                "AND i.mode & 61440 = 32768 AND i.size > 0 AND i.size <= ? ORDER BY d.name LIMIT ?",
                (parent, max_size, limit)):
            if valid_name(name) and _int_in(ino, 1, _I64) and _int_in(size, 1, max_size + 1):
                out.append((ino, size))
        return out

    def small_sibling_chunks(self, parent: int, max_chunk: int, max_bytes: int) -> list[tuple[bytes, BlobLocation]]:
        """(chunk id, location) of the chunks of the small files of directory ``parent``, in pack order,
        up to ``max_bytes`` stored (directory read-ahead).

        A malformed row (a forged pack name, text where an offset belongs) is
        left out: this is a prefetch, and the file it belongs to fails on its
        own (EIO) when it is read, while its neighbours are still served.
        """
        out: list[tuple[bytes, BlobLocation]] = []
        total = 0
        for chunk, pack, off, slen, rlen in self._rows(
                "SELECT b.chunk, p.name, b.offset, b.stored_len, b.raw_len FROM dirents d "
                "JOIN extents e ON e.ino = d.ino JOIN blobs b ON b.id = e.blob JOIN packs p ON p.id = b.pack "
                "WHERE d.parent = ? AND e.length <= ? ORDER BY p.name, b.offset LIMIT 512", (parent, max_chunk)):
            try:
                _check_location(chunk, pack, off, slen, self.path.name)
            except CorruptObject:
                continue
            if not _int_in(rlen, 1, MAX_CHUNK + 1):
                continue
            if total + slen > max_bytes:
                break
            out.append((chunk, BlobLocation(pack, off, slen, rlen)))
            total += slen
        return out

    def counts(self) -> dict[str, int]:
        return {
            "inodes": self._rows("SELECT count(*) FROM inodes")[0][0],
            "blobs": self._rows("SELECT count(*) FROM blobs")[0][0],
            "packs": self._rows("SELECT count(*) FROM packs")[0][0],
        }

    def all_blobs(self, *, skip_malformed: bool = False) -> Iterator[tuple[bytes, str, int, int, int]]:
        """(chunk, pack, offset, stored_len, raw_len) for every blob, pack by pack.

        A malformed row raises CorruptObject, or is left out with ``skip_malformed`` (a prefetch: the
        file it belongs to fails on its own when it is read, the rest of the snapshot is fetched)."""
        for row in self._iter(
                "SELECT b.chunk, p.name, b.offset, b.stored_len, b.raw_len FROM blobs b JOIN packs p ON p.id = b.pack "
                "ORDER BY p.name, b.offset"):
            try:
                _check_location(row[0], row[1], row[2], row[3], self.path.name)
                if not _int_in(row[4], 0, _U32):
                    raise CorruptObject(f"catalog {self.path.name}: a blob length is malformed")
            except CorruptObject:
                if skip_malformed:
                    continue
                raise
            yield row

    def all_extents(self, *, on_malformed: Callable[[int, str], None] | None = None
                    ) -> Iterator[tuple[int, int, int, bytes, str | None, int, int]]:
        """(ino, file offset, length, chunk, pack, pack offset, stored_len) for every extent, file by file.

        Each file's layout is checked as in :meth:`extents`.  A malformed row raises CorruptObject; with
        ``on_malformed`` that file's remaining rows are left out and ``on_malformed(ino, reason)`` is called
        instead, so that the caller fails that file alone (restore, materialization) and never treats it
        as complete with a hole where the bad extent was.
        """
        prev_ino, end, bad = None, 0, False
        for row in self._iter(
                "SELECT e.ino, e.offset, e.length, b.chunk, p.name, b.offset, b.stored_len, b.raw_len, i.size "
                "FROM extents e JOIN blobs b ON b.id = e.blob JOIN inodes i ON i.ino = e.ino "
                "LEFT JOIN packs p ON p.id = b.pack ORDER BY e.ino, e.offset"):
            if row[0] != prev_ino:
                prev_ino, end, bad = row[0], 0, False
            if bad:
                continue
            try:
                end = self._check_layout(row[0], row[1], row[2], row[7], row[8], end)
                if row[4] is not None:
                    _check_location(row[3], row[4], row[5], row[6], self.path.name)
            except CorruptObject as exc:
                if on_malformed is None or type(row[0]) is not int:
                    raise
                on_malformed(row[0], str(exc))
                bad = True
                continue
            yield row[:7]


def listing(cat: Catalog, parent: int) -> list[Listed]:
    """Every valid entry of directory ``parent`` with its xattrs and located extents, in three queries
    (hard links within the directory: their rows once).

    What a snapshot of a box running from a mount takes for a directory
    nothing has changed (snapshot/untouched.py): the same rows as
    :meth:`Catalog.children`, :meth:`~Catalog.xattrs` and :meth:`~Catalog.located_extents` give one
    entry at a time, checked the same way, for a whole directory at once.
    """
    kids = cat.children(parent)
    xattrs: dict[int, list[tuple[bytes, bytes]]] = {}
    for ino, name, value in cat._rows(
            "SELECT x.ino, x.name, x.value FROM xattrs x WHERE x.ino IN (SELECT ino FROM dirents WHERE parent=?) "
            "ORDER BY x.ino, x.name", (parent,)):
        if _valid_xattr(name, value):
            xattrs.setdefault(ino, []).append((name, value))
        else:
            cat._reject(ino, b"xattr " + (name if type(name) is bytes else repr(name).encode()),
                         "malformed extended attribute")
    rows: dict[int, list[tuple]] = {}
    for r in cat._rows(
            "SELECT e.ino, e.offset, e.length, b.chunk, p.name, b.offset, b.stored_len, b.raw_len, i.size "
            "FROM extents e JOIN blobs b ON b.id = e.blob JOIN inodes i ON i.ino = e.ino "
            "LEFT JOIN packs p ON p.id = b.pack WHERE e.ino IN (SELECT ino FROM dirents WHERE parent=?) "
            "ORDER BY e.ino, e.offset", (parent,)):
        rows.setdefault(r[0], []).append(r[1:])
    return [Listed(name, node, xattrs.get(node.ino, []),
                   cat._located(node.ino, rows.get(node.ino, ())) if node.is_reg else [])
            for name, node in kids]


class SubtreeEntry(NamedTuple):
    """What the copy of an untouched subtree decides on for one entry; the rest of its row is copied in SQL."""

    ino: int
    mode: int
    nlink: int
    size: int
    flags: int

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)

    @property
    def is_reg(self) -> bool:
        return stat.S_ISREG(self.mode)


@dataclass(frozen=True)
class Subtree:
    """Everything below one directory of a catalog, as :func:`subtree` read and checked it.

    ``children``: directory inode -> its entries in name order (the top
    directory's included); ``xattrs`` by inode, checked as :func:`listing`
    checks them; ``chunks``: a regular file's number of extents; ``packs``:
    every pack its files' chunks are located in, ``unlocated``: whether some
    chunk has no location.  The rows themselves stay in ``source``, from
    which :meth:`CatalogWriter.add_copied` copies them in SQL.
    """

    source: Path
    top: int
    children: dict[int, list[tuple[bytes, SubtreeEntry]]]
    xattrs: dict[int, list[tuple[bytes, bytes]]]
    chunks: dict[int, int]
    packs: frozenset[str]
    unlocated: bool

    def __len__(self) -> int:
        return sum(len(v) for v in self.children.values())


def _subtree_sql(top_select: str) -> str:
    """The dirents below ``:top`` as ``t``, for ``top_select``, which must have a LIMIT: UNION ALL (a third
    faster than UNION's de-duplication) goes round a directory loop of a damaged catalog until the outer
    LIMIT stops it, and the caller finds the inode reached twice."""
    return ("WITH RECURSIVE t(parent, name, ino) AS (SELECT parent, name, ino FROM dirents WHERE parent=:top "
            "UNION ALL SELECT d.parent, d.name, d.ino FROM dirents d JOIN t ON d.parent = t.ino) " + top_select)


def _sql_int(col: str, lo: int | None = None, hi: int | None = None) -> str:
    """SQL for :func:`_int_in`: an INTEGER (SQLite's are 64-bit, so within the I64 bounds) in [lo, hi)."""
    return " AND ".join([f"typeof({col}) = 'integer'"] + ([f"{col} >= {lo}"] if lo is not None else [])
                        + ([f"{col} < {hi}"] if hi is not None else []))


#: :func:`valid_name` of ``t.name`` in SQL.
_NAME_OK_SQL = (f"(typeof(t.name) = 'blob' AND length(t.name) BETWEEN 1 AND {NAME_MAX} "
                "AND t.name NOT IN (x'2e', x'2e2e') AND instr(t.name, x'2f') = 0 AND instr(t.name, x'00') = 0)")
#: :func:`_check_inode` of inode row ``i`` in SQL.
_INODE_OK_SQL = "(" + " AND ".join([
    _sql_int("i.ino", 1), *(_sql_int(f"i.{c}", 0, _U32) for c in ("mode", "uid", "gid")),
    *(f"(i.{c} IS NULL OR typeof(i.{c}) = 'text')" for c in ("user", "grp")),
    *(_sql_int(f"i.{c}", 0) for c in ("size", "nlink", "rdev")),
    *(_sql_int(f"i.{c}") for c in ("atime_ns", "mtime_ns", "ctime_ns", "src_dev", "src_ino", "flags")),
    "(i.target IS NULL OR (typeof(i.target) = 'blob' AND instr(i.target, x'00') = 0))",
]) + ")"
#: :meth:`Catalog._located` of extent ``e`` (blob ``b``, pack ``p``) of file ``i`` in SQL; ``prev_end``: the
#: end of the file's previous extent (0 for its first).  The pack's name is checked once per pack, in Python
#: (a GLOB per extent was half the cost).
_EXTENT_OK_SQL = "(" + " AND ".join([
    _sql_int("e.offset", 0), _sql_int("e.length", 0, _U32), _sql_int("b.raw_len", 1, MAX_CHUNK + 1),
    "e.length = b.raw_len", _sql_int("i.size", 0), "e.offset >= prev_end", "e.offset + e.length <= i.size",
    "typeof(b.chunk) = 'blob'", "length(b.chunk) = 32",
    "(p.name IS NULL OR (" + _sql_int("b.offset", 0) + " AND " + _sql_int("b.stored_len", 1, _U32) + "))",
]) + ")"
_S_IFREG_SQL = f"(i.mode & {0o170000}) = {stat.S_IFREG}"


def _fill_subtree_rows(cat: Catalog, top: int, limit: int) -> int:
    """Fill the thread's temporary table ``subtree_rows`` with the dirents below ``top`` (at most
    ``limit + 1``), for :func:`subtree`'s queries to join instead of each running the recursive query;
    returns how many it holds.  The table is the connection's own (SQLite's temp schema): the file
    stays read-only."""
    db = cat._db()
    try:
        db.execute("CREATE TEMP TABLE IF NOT EXISTS subtree_rows (parent INTEGER, name BLOB, ino INTEGER)")
        db.execute("CREATE INDEX IF NOT EXISTS temp.subtree_rows_ino ON subtree_rows (ino)")
        db.execute("DELETE FROM temp.subtree_rows")
        n = db.execute("INSERT INTO temp.subtree_rows " + _subtree_sql("SELECT parent, name, ino FROM t LIMIT :limit"),
                       {"top": top, "limit": limit + 1}).rowcount
        db.commit()
        return n
    except _DB_ERRORS as exc:
        db.rollback()
        raise CorruptObject(f"catalog {cat.path.name} is damaged ({_one_line(exc)})") from None


def subtree(cat: Catalog, top: int, limit: int) -> Subtree | None:
    """Every entry below directory ``top``, checked in SQL, for a copy in SQL.

    What a snapshot of a box running from a mount takes for a directory that
    nothing below has changed (snapshot/treecopy.py), instead of
    :func:`listing` directory by directory.  Each row gets the checks
    :func:`listing` makes, as SQL expressions over the whole subtree, so only
    the few columns the copy decides on reach Python.  None, for the caller
    to go directory by directory (where each oddity is reported or refused as
    it is there), when the subtree has more than ``limit`` entries or is not
    a plain tree of valid rows: an inode reached twice (a hard link, a loop),
    an entry below a non-directory, a name :func:`valid_name` refuses, a
    malformed inode, xattr or extent.
    """
    if _fill_subtree_rows(cat, top, limit) > limit:
        return None
    children: dict[int, list[tuple[bytes, SubtreeEntry]]] = {top: []}
    chunks: dict[int, int] = {}
    seen = {top}
    for parent, name, ino, mode, nlink, size, flags, ok, n_chunks in cat._rows(
            f"SELECT t.parent, t.name, i.ino, i.mode, i.nlink, i.size, i.flags, {_INODE_OK_SQL} AND {_NAME_OK_SQL}, "
            f"CASE WHEN {_S_IFREG_SQL} THEN (SELECT count(*) FROM extents e JOIN blobs b ON b.id = e.blob "
            "WHERE e.ino = i.ino) END FROM temp.subtree_rows t JOIN inodes i ON i.ino = t.ino"):
        if not ok or ino in seen:
            return None
        seen.add(ino)
        node = SubtreeEntry(ino, mode, nlink, size, flags)
        children.setdefault(parent, []).append((name, node))
        if node.is_dir:
            children.setdefault(ino, [])
        elif n_chunks is not None:
            chunks[ino] = n_chunks
    kinds = {n.ino: n for kids in children.values() for _, n in kids}
    if any(p != top and (p not in kinds or not kinds[p].is_dir) for p in children):
        return None  # entries below a non-directory, or below an inode that is not in the tree
    for kids in children.values():
        kids.sort(key=lambda e: e[0])
    xattrs: dict[int, list[tuple[bytes, bytes]]] = {}
    for ino, name, value in cat._rows(
            "SELECT x.ino, x.name, x.value FROM xattrs x WHERE x.ino IN (SELECT ino FROM temp.subtree_rows) "
            "ORDER BY x.ino, x.name"):
        if not _valid_xattr(name, value):
            return None  # listing() reports it, directory by directory
        xattrs.setdefault(ino, []).append((name, value))
    # per pack (NULL: no location) the extents that fail their checks
    by_pack = cat._rows(
        "SELECT pack, sum(ok IS NOT 1) FROM ("
        f"SELECT {_EXTENT_OK_SQL} AS ok, p.name AS pack FROM (SELECT e.*, coalesce(lag(e.offset + e.length) "
        "OVER (PARTITION BY e.ino ORDER BY e.offset), 0) AS prev_end FROM extents e "
        "WHERE e.ino IN (SELECT ino FROM temp.subtree_rows)) e JOIN blobs b ON b.id = e.blob "
        f"JOIN inodes i ON i.ino = e.ino LEFT JOIN packs p ON p.id = b.pack WHERE {_S_IFREG_SQL}) GROUP BY pack")
    packs = frozenset(p for p, _ in by_pack if p is not None)
    if any(bad for _, bad in by_pack) or not all(type(p) is str and _PACK_NAME.fullmatch(p) for p in packs):
        return None
    return Subtree(cat.path, top, children, xattrs, chunks, packs, any(p is None for p, _ in by_pack))


# -- queries of the browse commands (ls, dump, stats, copy) ------------------------------------------
def paths_of(cat: Catalog, inos: Iterable[int]) -> dict[int, bytes | None]:
    """One absolute path of each inode (a hard link has several; any one will do), None if unreachable.

    The inverse of :meth:`Catalog.resolve`, for the access trace (which stores
    paths): walks ``dirents`` up to the root, remembering every directory it
    met, so a trace's thousands of files cost one query each.  A name that is
    not a valid file name, or a parent chain deeper than 4096 or looping,
    gives None.
    """
    dirs: dict[int, bytes | None] = {ROOT_INO: b""}
    out: dict[int, bytes | None] = {}
    for ino in inos:
        if ino not in out:
            pn = _parent_and_name(cat, ino)
            parent = None if pn is None else _dir_path(cat, pn[0], dirs)
            out[ino] = None if parent is None else parent + b"/" + pn[1]
    return out


def _parent_and_name(cat: Catalog, ino: int) -> tuple[int, bytes] | None:
    rows = cat._rows("SELECT parent, name FROM dirents WHERE ino=? LIMIT 1", (ino,))
    if not rows or type(rows[0][0]) is not int or not valid_name(rows[0][1]):
        return None
    return rows[0][0], rows[0][1]


def _dir_path(cat: Catalog, ino: int, dirs: dict[int, bytes | None]) -> bytes | None:
    """The path of directory ``ino`` (memoized in ``dirs``), iteratively: a deep tree cannot overflow."""
    chain: list[tuple[int, bytes]] = []
    on_chain: set[int] = set()
    cur = ino
    while cur not in dirs:
        pn = _parent_and_name(cat, cur) if len(chain) < 4096 else None
        on_chain.add(cur)
        if pn is None or pn[0] in on_chain:
            for c, _name in chain:
                dirs[c] = None
            dirs[cur] = None
            return None
        chain.append((cur, pn[1]))
        cur = pn[0]
    path = dirs[cur]
    for c, name in reversed(chain):
        path = None if path is None else path + b"/" + name
        dirs[c] = path
    return dirs[ino]


def file_chunks(cat: Catalog, ino: int) -> list[tuple[Extent, int]]:
    """A regular file's extents in file order, each with its chunk's plaintext length (to decode it)."""
    rows = cat._rows("SELECT e.offset, b.raw_len FROM extents e JOIN blobs b ON b.id = e.blob "
                     "WHERE e.ino=? ORDER BY e.offset", (ino,))
    raw = {off: rlen for off, rlen in rows}
    out = []
    for ext in cat.extents(ino):
        rlen = raw.get(ext.offset)
        if not _int_in(rlen, 0, _U32):
            raise CorruptObject(f"catalog {cat.path.name}: a blob length is malformed")
        out.append((ext, rlen))
    return out


def rewrite_blobs(src: Path, dst: Path, moves: dict[bytes, tuple[bytes, BlobLocation]]) -> None:
    """Write to ``dst`` a copy of catalog ``src`` whose chunks are renamed and relocated by ``moves``.

    ``moves`` maps every chunk id of ``src`` to (new chunk id, new location):
    ``ogrefs copy`` uses it for a catalog that moves into another repository,
    whose packs (and, keyed, chunk ids) differ, and ``repack`` for blobs moved
    into new packs (their ids unchanged).  The one rewrite of a catalog
    outside its writer: the result is checked as a readable catalog (the
    reader's own validation) before either replaces anything.
    """
    import shutil

    shutil.copyfile(src, dst)
    db = sqlite3.connect(dst, isolation_level=None)
    try:
        db.execute("BEGIN")
        rows = db.execute("SELECT id, chunk FROM blobs").fetchall()
        names = sorted({loc.pack for _cid, loc in moves.values()})
        db.execute("DELETE FROM packs")
        db.executemany("INSERT INTO packs (id, name) VALUES (?, ?)", list(enumerate(names, 1)))
        pack_id = {name: i for i, name in enumerate(names, 1)}
        db.execute("UPDATE blobs SET chunk = -id")  # frees every chunk id: renames may swap two
        for bid, chunk in rows:
            cid, loc = moves[chunk]
            db.execute("UPDATE blobs SET chunk=?, pack=?, offset=?, stored_len=?, raw_len=? WHERE id=?",
                       (cid, pack_id[loc.pack], loc.offset, loc.stored_len, loc.raw_len, bid))
        db.execute("COMMIT")
        db.execute("VACUUM")
    finally:
        db.close()
    for _row in Catalog(dst).all_blobs():  # the schema, then every location, through the reader's own checks
        pass
