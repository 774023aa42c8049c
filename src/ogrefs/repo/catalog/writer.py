"""Writing a catalog: :class:`CatalogWriter`, owned by the snapshotting thread.

It attaches the catalogs :meth:`~CatalogWriter.add_copied` reads to its own
connection, read-only and immutable.
"""

from __future__ import annotations

import sqlite3
import stat
import urllib.parse
from pathlib import Path
from typing import TYPE_CHECKING

from ogrefs.repo.catalog.schema import INODE_COLS, ROOT_INO, S_IFREG_SQL, Inode, create_schema
from ogrefs.repo.pack import BlobLocation

if TYPE_CHECKING:
    from ogrefs.repo.catalog.scans import Subtree

_INODE_SQL = f"INSERT OR REPLACE INTO inodes ({INODE_COLS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)"
_DIRENT_SQL = "INSERT OR REPLACE INTO dirents VALUES (?,?,?)"
_XATTR_SQL = "INSERT OR REPLACE INTO xattrs VALUES (?,?,?)"
_EXTENT_SQL = "INSERT INTO extents VALUES (?,?,?,?)"
_BLOB_SQL = "INSERT INTO blobs (id, chunk, raw_len, pack, offset, stored_len) VALUES (?,?,?,?,?,?)"
#: Rows are written a few thousand at a time, one executemany per table: a walk of 40,000 unchanged files
#: made 180,000 single-row calls into sqlite3 (a fifth of a no-change snapshot's time).
_FLUSH_ROWS = 4096


def _copied_inode(ino: int, old: Inode) -> tuple:
    """``old``'s row under inode ``ino``; nlink 0, counted again at close."""
    return (ino, *old[1:10], 0, *old[11:])


class CatalogWriter:
    """Builds a catalog file.  Owned by one thread; call :meth:`close` once.

    Rows are buffered per statement (one per table, so a later row for the same key still replaces an
    earlier one) and written before anything reads the file back (:meth:`_flush`)."""

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
        self._rows: dict[str, list[tuple]] = {}  # statement -> rows not written yet, in order
        self._buffered = 0

    def new_ino(self) -> int:
        ino = self._next_ino
        self._next_ino += 1
        return ino

    def add_inode(self, ino: int, st, user: str | None, grp: str | None, *, size: int | None = None,
                  target: bytes | None = None, flags: int = 0) -> None:
        self._add(_INODE_SQL, [
            (ino, st.st_mode, st.st_uid, st.st_gid, user, grp, st.st_size if size is None else size,
             st.st_atime_ns, st.st_mtime_ns, st.st_ctime_ns, 0,
             st.st_rdev if (stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)) else 0,
             target, st.st_dev, st.st_ino, flags)])

    def copy_inode(self, ino: int, old: Inode) -> None:
        self._add(_INODE_SQL, [_copied_inode(ino, old)])

    def add_dirent(self, parent: int, name: bytes, ino: int) -> None:
        self._add(_DIRENT_SQL, [(parent, name, ino)])

    def add_xattrs(self, ino: int, items: list[tuple[bytes, bytes]]) -> None:
        self._add(_XATTR_SQL, [(ino, n, v) for n, v in items])

    def _add(self, sql: str, rows: list[tuple]) -> None:
        self._rows.setdefault(sql, []).extend(rows)
        self._buffered += len(rows)
        if self._buffered >= _FLUSH_ROWS:
            self._flush()

    def _flush(self) -> None:
        """Write the buffered rows (before anything reads the file, and at close)."""
        for sql, rows in self._rows.items():
            self._db.executemany(sql, rows)
        self._rows.clear()
        self._buffered = 0

    def add_extents(self, ino: int, extents: list[tuple[int, int, bytes]]) -> None:
        """(file offset, length, chunk id) for each chunk of the file (located at commit: set_location)."""
        new_blobs, rows = [], []
        for off, length, cid in extents:
            bid = self._blob_ids.get(cid)
            if bid is None:
                bid = self._blob_ids[cid] = len(self._blob_ids) + 1
                new_blobs.append((bid, cid, length, None, None, None))
            rows.append((ino, off, length, bid))
        self._add(_BLOB_SQL, new_blobs)
        self._add(_EXTENT_SQL, rows)

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
        self._flush()
        db, src = self._db, self._attach(tree.source)
        db.execute("CREATE TEMP TABLE IF NOT EXISTS copied (old INTEGER PRIMARY KEY, new INTEGER NOT NULL)")
        db.execute("CREATE TEMP TABLE IF NOT EXISTS copied_packs (name TEXT PRIMARY KEY, id INTEGER NOT NULL)")
        db.execute("DELETE FROM temp.copied")
        db.execute("DELETE FROM temp.copied_packs")
        db.executemany("INSERT INTO temp.copied VALUES (?,?)", inodes)
        db.executemany("INSERT INTO temp.copied_packs VALUES (?,?)", [(p, self._pack_id(p)) for p in tree.packs])
        db.execute(f"INSERT OR REPLACE INTO main.inodes ({INODE_COLS}) SELECT c.new, i.mode, i.uid, i.gid, i.user, "
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
                   f"WHERE {S_IFREG_SQL}")
        for bid, chunk in db.execute("SELECT id, chunk FROM main.blobs WHERE id > ? ORDER BY id", (known,)).fetchall():
            if bid != len(self._blob_ids) + 1:
                raise RuntimeError(f"catalog writer: blob numbers are not dense ({bid} after {len(self._blob_ids)})")
            self._blob_ids[chunk] = bid
        n = db.execute(f"INSERT INTO main.extents SELECT c.new, e.offset, e.length, mb.id FROM {extents} "
                       f"JOIN main.blobs mb ON mb.chunk = b.chunk WHERE {S_IFREG_SQL}").rowcount
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
        self._add(_BLOB_SQL, new_blobs)
        self._add(_EXTENT_SQL, rows)

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
        self._flush()
        self._db.execute("UPDATE blobs SET pack=?, offset=?, stored_len=? WHERE id=?",
                         (self._pack_id(loc.pack), loc.offset, loc.stored_len, bid))

    def unlocated(self) -> list[bytes]:
        self._flush()
        return [r[0] for r in self._db.execute("SELECT chunk FROM blobs WHERE pack IS NULL")]

    def add_root(self, path: bytes) -> None:
        self._db.execute("INSERT OR IGNORE INTO roots VALUES (?)", (path,))

    def add_hint(self, klass: str, ino: int, rank: int) -> None:
        self._db.execute("INSERT OR IGNORE INTO hints VALUES (?,?,?)", (klass, ino, rank))

    def resolve(self, path: bytes) -> int | None:
        """The inode number at an absolute path written so far (for hints)."""
        self._flush()
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
        self._flush()
        self._db.execute("UPDATE inodes SET nlink = (SELECT count(*) FROM dirents d WHERE d.ino = inodes.ino)")
        self._db.execute(
            "UPDATE inodes SET nlink = nlink + 1 + (SELECT count(*) FROM dirents d JOIN inodes c ON c.ino = d.ino "
            "WHERE d.parent = inodes.ino AND (c.mode & 61440) = 16384) WHERE (mode & 61440) = 16384"
        )
        self._db.execute("COMMIT")
        self._db.execute("VACUUM")
        self._db.close()


#: Longest file name Linux accepts (NAME_MAX); the snapshot walk never records a longer one.
