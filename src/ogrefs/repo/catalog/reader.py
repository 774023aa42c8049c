"""Reading a catalog: :class:`Catalog`, which trusts nothing in the file.

Concurrency: a Catalog opens one read-only SQLite connection per thread that
uses it; its ``rejected`` record is guarded by ``_rejected_lock``.  The bulk
scans (:mod:`.scans`) go through its public primitives (:meth:`Catalog.query`,
:meth:`Catalog.scan`, :meth:`Catalog.reject`, :meth:`Catalog.located`,
:meth:`Catalog.connection`), never its private members.
"""

from __future__ import annotations

import logging
import sqlite3
import stat
import threading
import urllib.parse
from pathlib import Path
from typing import Callable, Iterable, Iterator

from ogrefs.errors import CorruptObject
from ogrefs.repo.catalog.schema import (I_COLS, INODE_COLS, INODE_OK_SQL, MAX_CHUNK, PACK_NAME, ROOT_INO, TABLES, U32, I64, Extent, Inode,
                                        check_inode, check_location, int_in, valid_name, valid_xattr)
from ogrefs.repo.pack import BlobLocation

log = logging.getLogger(__name__)

#: The inodes one bulk query names (SQLite's bound on parameters is 999 before 3.32).
MANY = 500
#: An extent's row: what :meth:`Catalog.all_extents` yields, then the blob's raw length and the file's size.
_EXTENT_ROWS = ("SELECT e.ino, e.offset, e.length, b.chunk, p.name, b.offset, b.stored_len, b.raw_len, i.size "
                "FROM extents e JOIN blobs b ON b.id = e.blob JOIN inodes i ON i.ino = e.ino "
                "LEFT JOIN packs p ON p.id = b.pack ")

#: What a damaged SQLite file can raise: its own errors, and a column *name* that is not UTF-8.
DB_ERRORS = (sqlite3.Error, UnicodeDecodeError)


def one_line(exc: BaseException) -> str:
    """SQLite quotes schema text (newlines included) in its errors; the user gets one line."""
    return " ".join(str(exc).split())[:300]


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape")


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
            db = self.connection()
            for table, cols in TABLES.items():
                db.execute(f"SELECT {cols} FROM {table} LIMIT 0").fetchall()
            row = db.execute(f"SELECT {INODE_COLS} FROM inodes WHERE ino=?", (ROOT_INO,)).fetchone()
        except DB_ERRORS as exc:
            raise CorruptObject(f"catalog {path.name} is not a readable SQLite catalog ({one_line(exc)})") from None
        if row is None or not stat.S_ISDIR(check_inode(row, path.name).mode):
            raise CorruptObject(f"catalog {path.name} has no root directory")
        #: No inode has an extended attribute (the file is opened immutable: that stays true).
        self._no_xattrs = not self.has_xattrs()

    def connection(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(self._uri, uri=True, check_same_thread=False)
            db.text_factory = _text  # a damaged file may hold text that is not UTF-8
            self._local.db = db
        return db

    def query(self, sql: str, args: tuple = ()) -> list[tuple]:
        try:
            return self.connection().execute(sql, args).fetchall()
        except DB_ERRORS as exc:
            raise CorruptObject(f"catalog {self.path.name} is damaged ({one_line(exc)})") from None

    def scan(self, sql: str, args: tuple = ()) -> Iterator[tuple]:
        try:
            cur = self.connection().execute(sql, args)
            while rows := cur.fetchmany(1024):
                yield from rows
        except DB_ERRORS as exc:
            raise CorruptObject(f"catalog {self.path.name} is damaged ({one_line(exc)})") from None

    def reject(self, parent: int, name: object, reason: str) -> None:
        key = (parent, name if isinstance(name, bytes) else repr(name).encode())
        with self._rejected_lock:
            if key in self.rejected:
                return
            self.rejected[key] = reason
        log.warning("catalog %s: skipped entry %r in directory inode %d: %s", self.path.name, key[1], parent, reason)

    def get(self, ino: int) -> Inode | None:
        rows = self.query(f"SELECT {INODE_COLS} FROM inodes WHERE ino=?", (ino,))
        return check_inode(rows[0], self.path.name) if rows else None

    def get_many(self, inos: Iterable[int]) -> dict[int, Inode]:
        """:meth:`get` of each of ``inos`` that is in the catalog, one query per :data:`MANY`."""
        wanted = list(dict.fromkeys(inos))
        out: dict[int, Inode] = {}
        for i in range(0, len(wanted), MANY):
            part = tuple(wanted[i:i + MANY])
            for row in self.query(f"SELECT {INODE_COLS} FROM inodes WHERE ino IN ({','.join('?' * len(part))})",
                                  part):
                node = check_inode(row, self.path.name)
                out[node.ino] = node
        return out

    def lookup(self, parent: int, name: bytes) -> Inode | None:
        if not valid_name(name):
            return None
        rows = self.query(
            f"SELECT {I_COLS} FROM dirents d "
            "JOIN inodes i ON i.ino = d.ino WHERE d.parent=? AND d.name=? LIMIT 1",
            (parent, name),
        )
        return check_inode(rows[0], self.path.name) if rows else None

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
            rows = self.query(  # (each row checked by check_inode's twin in SQL: a page at C speed)
                f"SELECT d.name, {I_COLS}, {INODE_OK_SQL} FROM dirents d JOIN inodes i ON i.ino = d.ino "
                "WHERE d.parent=? AND d.name > ? ORDER BY d.name LIMIT ?",
                (parent, cursor, want),
            )
            for r in rows:
                name = r[0]
                if not valid_name(name):
                    self.reject(parent, name, "not a valid file name")
                elif name == prev:
                    self.reject(parent, name, "name appears twice in one directory")
                else:
                    out.append((name, Inode(*r[1:-1]) if r[-1] == 1 else check_inode(r[1:-1], self.path.name)))
                prev = name
            if want < 0 or len(rows) < want:
                break
            last = rows[-1][0]
            if type(last) is not bytes:
                break  # a non-blob name sorts before every blob: nothing valid follows in this order
            cursor = last
        return out

    def xattrs(self, ino: int) -> list[tuple[bytes, bytes]]:
        if self._no_xattrs:
            return []  # (most catalogs: a restore asks once a file, and would find nothing each time)
        out = []
        for name, value in self.query("SELECT name, value FROM xattrs WHERE ino=? ORDER BY name", (ino,)):
            if valid_xattr(name, value):
                out.append((name, value))
            else:
                self.reject(ino, b"xattr " + (name if type(name) is bytes else repr(name).encode()),
                             "malformed extended attribute")
        return out

    def extents(self, ino: int) -> list[Extent]:
        rows = self.query(
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
            check_location(chunk, pack, poff, slen, self.path.name)
            out.append(Extent(off, length, chunk, pack, poff, slen))
        return out

    def _check_extent(self, off: object, length: object) -> None:
        if not (int_in(off, 0, I64) and int_in(length, 0, U32)):
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
        ok = (int_in(raw_len, 1, MAX_CHUNK + 1) and length == raw_len and int_in(size, 0, I64)
              and off >= prev_end and off + length <= size)
        if not ok:
            raise CorruptObject(f"catalog {self.path.name}: the extents of inode {ino!r} do not lay out its "
                                f"data (offset {off!r}, length {length!r}, chunk of {raw_len!r} bytes, "
                                f"file of {size!r} bytes)")
        return off + length

    def located_extents(self, ino: int) -> list[tuple[int, int, bytes, BlobLocation | None]]:
        """(offset, length, chunk id, location or None) in one query: for incremental reuse."""
        return self.located(ino, self.query(
            "SELECT e.offset, e.length, b.chunk, p.name, b.offset, b.stored_len, b.raw_len, i.size FROM extents e "
            "JOIN blobs b ON b.id = e.blob JOIN inodes i ON i.ino = e.ino LEFT JOIN packs p ON p.id = b.pack "
            "WHERE e.ino=? ORDER BY e.offset", (ino,)))

    def located(self, ino: int, rows: Iterable[tuple]) -> list[tuple[int, int, bytes, BlobLocation | None]]:
        """One file's extent rows ``(offset, length, chunk, pack, pack offset, stored, raw, size)``, checked."""
        out = []
        end = 0
        for off, ln, cid, pack, poff, slen, rlen, size in rows:
            end = self._check_layout(ino, off, ln, rlen, size, end)
            if pack is not None:
                check_location(cid, pack, poff, slen, self.path.name)
            elif not (type(cid) is bytes and len(cid) == 32):
                raise CorruptObject(f"catalog {self.path.name}: a chunk id is malformed")
            out.append((off, ln, cid, BlobLocation(pack, poff, slen, rlen) if pack else None))
        return out

    def raw_extents(self, ino: int) -> list[tuple[int, int, bytes, int]]:
        """(offset, length, chunk id, raw_len) without locations: for incremental reuse."""
        return self.query(
            "SELECT e.offset, e.length, b.chunk, b.raw_len FROM extents e JOIN blobs b ON b.id = e.blob "
            "WHERE e.ino=? ORDER BY e.offset", (ino,))

    def blob_location(self, chunk: bytes) -> BlobLocation | None:
        rows = self.query(
            "SELECT p.name, b.offset, b.stored_len, b.raw_len FROM blobs b JOIN packs p ON p.id = b.pack "
            "WHERE b.chunk=? LIMIT 1", (chunk,))
        if not rows:
            return None
        pack, poff, slen, rlen = rows[0]
        check_location(chunk, pack, poff, slen, self.path.name)
        return BlobLocation(pack, poff, slen, rlen)

    def pack_names(self) -> list[str]:
        names = [r[0] for r in self.query("SELECT name FROM packs")]
        for n in names:
            if not (type(n) is str and PACK_NAME.fullmatch(n)):
                raise CorruptObject(f"catalog {self.path.name}: a pack name is malformed")
        return names

    def roots(self) -> list[bytes]:
        return [r[0] for r in self.query("SELECT path FROM roots ORDER BY path")]

    def hints(self) -> list[tuple[str, int, int]]:
        return self.query("SELECT class, ino, rank FROM hints ORDER BY rank")

    def meta(self, key: str) -> str | None:
        rows = self.query("SELECT value FROM meta WHERE key=?", (key,))
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
                        self.reject(dino, name, f"directory inode {node.ino} is reached a second time")
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
        value = self.query(sql, args)[0][0]
        if not int_in(value, 0, I64):
            raise CorruptObject(f"catalog {self.path.name}: a length is malformed")
        return value

    def data_bytes(self, ino: int) -> int:
        """Bytes of data (not holes) file ``ino`` holds: what its st_blocks count."""
        return self._total("SELECT coalesce(sum(length), 0) FROM extents WHERE ino=?", (ino,))

    def data_bytes_many(self, inos: list[int]) -> dict[int, int]:
        """:meth:`data_bytes` of each of ``inos`` that has data (a page of a listing: one query per :data:`MANY`)."""
        out: dict[int, int] = {}
        for i in range(0, len(inos), MANY):
            part = tuple(inos[i:i + MANY])
            for ino, total in self.query(f"SELECT ino, sum(length) FROM extents WHERE ino IN "
                                         f"({','.join('?' * len(part))}) GROUP BY ino", part):
                if not int_in(total, 0, I64):
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
        return bool(self.query("SELECT 1 FROM xattrs LIMIT 1"))

    def parent_of(self, ino: int) -> int:
        """The directory holding ``ino`` (one of them for a hardlink); the root for the root and the unlisted."""
        rows = self.query("SELECT parent FROM dirents WHERE ino=? LIMIT 1", (ino,))
        if not rows:
            return ROOT_INO
        if not int_in(rows[0][0], 1, I64):
            raise CorruptObject(f"catalog {self.path.name}: a directory entry of inode {ino!r} is malformed")
        return rows[0][0]

    def path_of(self, ino: int) -> bytes:
        """One path of ``ino`` (hardlinks have several), for messages; ends at a loop or a missing entry."""
        parts: list[bytes] = []
        seen = set()
        while ino != ROOT_INO and ino not in seen:
            seen.add(ino)
            rows = self.query("SELECT parent, name FROM dirents WHERE ino=? LIMIT 1", (ino,))
            if not rows:
                return b"<inode %d>" % ino if type(ino) is int else b"<inode ?>"
            ino, name = rows[0]
            parts.append(name if valid_name(name) else repr(name).encode())
        return b"/" + b"/".join(reversed(parts))

    def small_files(self, parent: int, max_size: int, limit: int = 8192) -> list[tuple[int, int]]:
        """(ino, size) of the non-empty regular files of directory ``parent`` up to ``max_size``, in name order.

        Entries the listing would skip (see the class docstring) are left out here too."""
        out = []
        for name, ino, size in self.query(
                "SELECT d.name, i.ino, i.size FROM dirents d JOIN inodes i ON i.ino = d.ino WHERE d.parent = ? "
                "AND i.mode & 61440 = 32768 AND i.size > 0 AND i.size <= ? ORDER BY d.name LIMIT ?",
                (parent, max_size, limit)):
            if valid_name(name) and int_in(ino, 1, I64) and int_in(size, 1, max_size + 1):
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
        for chunk, pack, off, slen, rlen in self.query(
                "SELECT b.chunk, p.name, b.offset, b.stored_len, b.raw_len FROM dirents d "
                "JOIN extents e ON e.ino = d.ino JOIN blobs b ON b.id = e.blob JOIN packs p ON p.id = b.pack "
                "WHERE d.parent = ? AND e.length <= ? ORDER BY p.name, b.offset LIMIT 512", (parent, max_chunk)):
            try:
                check_location(chunk, pack, off, slen, self.path.name)
            except CorruptObject:
                continue
            if not int_in(rlen, 1, MAX_CHUNK + 1):
                continue
            if total + slen > max_bytes:
                break
            out.append((chunk, BlobLocation(pack, off, slen, rlen)))
            total += slen
        return out

    def counts(self) -> dict[str, int]:
        return {
            "inodes": self.query("SELECT count(*) FROM inodes")[0][0],
            "blobs": self.query("SELECT count(*) FROM blobs")[0][0],
            "packs": self.query("SELECT count(*) FROM packs")[0][0],
        }

    def all_blobs(self, *, skip_malformed: bool = False) -> Iterator[tuple[bytes, str, int, int, int]]:
        """(chunk, pack, offset, stored_len, raw_len) for every blob, pack by pack.

        A malformed row raises CorruptObject, or is left out with ``skip_malformed`` (a prefetch: the
        file it belongs to fails on its own when it is read, the rest of the snapshot is fetched)."""
        for row in self.scan(
                "SELECT b.chunk, p.name, b.offset, b.stored_len, b.raw_len FROM blobs b JOIN packs p ON p.id = b.pack "
                "ORDER BY p.name, b.offset"):
            try:
                check_location(row[0], row[1], row[2], row[3], self.path.name)
                if not int_in(row[4], 0, U32):
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
        return self._checked_extents(self.scan(_EXTENT_ROWS + "ORDER BY e.ino, e.offset"), on_malformed)

    def extents_of(self, inos: Iterable[int], *, on_malformed: Callable[[int, str], None] | None = None
                   ) -> Iterator[tuple[int, int, int, bytes, str | None, int, int]]:
        """:meth:`all_extents`' rows for files ``inos`` only, in inode order: one query per
        :data:`MANY` files instead of one a file (the no-FUSE copy adds its files a group at a time)."""
        wanted = sorted(set(inos))
        for i in range(0, len(wanted), MANY):
            part = tuple(wanted[i:i + MANY])
            rows = self.scan(f"{_EXTENT_ROWS}WHERE e.ino IN ({','.join('?' * len(part))}) ORDER BY e.ino, e.offset",
                             part)
            # (a damaged file may store an inode number as 5.0, which ``IN`` matches: it is file 5's row)
            yield from self._checked_extents((r if type(r[0]) is int else (int(r[0]), *r[1:]) for r in rows),
                                             on_malformed)

    def _checked_extents(self, rows: Iterable[tuple], on_malformed: Callable[[int, str], None] | None
                         ) -> Iterator[tuple[int, int, int, bytes, str | None, int, int]]:
        prev_ino, end, bad = None, 0, False
        for row in rows:
            if row[0] != prev_ino:
                prev_ino, end, bad = row[0], 0, False
            if bad:
                continue
            try:
                end = self._check_layout(row[0], row[1], row[2], row[7], row[8], end)
                if row[4] is not None:
                    check_location(row[3], row[4], row[5], row[6], self.path.name)
            except CorruptObject as exc:
                if on_malformed is None or type(row[0]) is not int:
                    raise
                on_malformed(row[0], str(exc))
                bad = True
                continue
            yield row[:7]


