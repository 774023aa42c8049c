"""Bulk scans of a catalog: a directory at once, a whole subtree checked in SQL, paths of many inodes.

Each is a function of a :class:`~.reader.Catalog` through its public
primitives; a scan's scratch table (``temp.subtree_rows``) lives in the
calling thread's own connection.
"""

from __future__ import annotations

import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, NamedTuple

from ogrefs.errors import CorruptObject
from ogrefs.repo.catalog.reader import DB_ERRORS, Catalog, one_line
from ogrefs.repo.catalog.schema import (EXTENT_OK_SQL, INODE_OK_SQL, NAME_OK_SQL, PACK_NAME, ROOT_INO, S_IFREG_SQL, U32,
                                        Extent, Listed, int_in, valid_name, valid_xattr)

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
    for ino, name, value in cat.query(
            "SELECT x.ino, x.name, x.value FROM xattrs x WHERE x.ino IN (SELECT ino FROM dirents WHERE parent=?) "
            "ORDER BY x.ino, x.name", (parent,)):
        if valid_xattr(name, value):
            xattrs.setdefault(ino, []).append((name, value))
        else:
            cat.reject(ino, b"xattr " + (name if type(name) is bytes else repr(name).encode()),
                         "malformed extended attribute")
    rows = child_extent_rows(cat, parent)
    return [Listed(name, node, xattrs.get(node.ino, []),
                   cat.located(node.ino, rows.get(node.ino, ())) if node.is_reg else [])
            for name, node in kids]


def child_extent_rows(cat: Catalog, parent: int) -> dict[int, list[tuple]]:
    """The extent rows ``(offset, length, chunk, pack, pack offset, stored, raw, size)`` of every child of
    directory ``parent``, by inode, in one query: unchecked; :meth:`Catalog.located` checks one file's."""
    rows: dict[int, list[tuple]] = {}
    for r in cat.query(
            "SELECT e.ino, e.offset, e.length, b.chunk, p.name, b.offset, b.stored_len, b.raw_len, i.size "
            "FROM extents e JOIN blobs b ON b.id = e.blob JOIN inodes i ON i.ino = e.ino "
            "LEFT JOIN packs p ON p.id = b.pack WHERE e.ino IN (SELECT ino FROM dirents WHERE parent=?) "
            "ORDER BY e.ino, e.offset", (parent,)):
        rows.setdefault(r[0], []).append(r[1:])
    return rows


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


def _fill_subtree_rows(cat: Catalog, top: int, limit: int) -> int:
    """Fill the thread's temporary table ``subtree_rows`` with the dirents below ``top`` (at most
    ``limit + 1``), for :func:`subtree`'s queries to join instead of each running the recursive query;
    returns how many it holds.  The table is the connection's own (SQLite's temp schema): the file
    stays read-only."""
    db = cat.connection()
    try:
        db.execute("CREATE TEMP TABLE IF NOT EXISTS subtree_rows (parent INTEGER, name BLOB, ino INTEGER)")
        db.execute("CREATE INDEX IF NOT EXISTS temp.subtree_rows_ino ON subtree_rows (ino)")
        db.execute("DELETE FROM temp.subtree_rows")
        n = db.execute("INSERT INTO temp.subtree_rows " + _subtree_sql("SELECT parent, name, ino FROM t LIMIT :limit"),
                       {"top": top, "limit": limit + 1}).rowcount
        db.commit()
        return n
    except DB_ERRORS as exc:
        db.rollback()
        raise CorruptObject(f"catalog {cat.path.name} is damaged ({one_line(exc)})") from None


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
    for parent, name, ino, mode, nlink, size, flags, ok, n_chunks in cat.query(
            f"SELECT t.parent, t.name, i.ino, i.mode, i.nlink, i.size, i.flags, {INODE_OK_SQL} AND {NAME_OK_SQL}, "
            f"CASE WHEN {S_IFREG_SQL} THEN (SELECT count(*) FROM extents e JOIN blobs b ON b.id = e.blob "
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
    for ino, name, value in cat.query(
            "SELECT x.ino, x.name, x.value FROM xattrs x WHERE x.ino IN (SELECT ino FROM temp.subtree_rows) "
            "ORDER BY x.ino, x.name"):
        if not valid_xattr(name, value):
            return None  # listing() reports it, directory by directory
        xattrs.setdefault(ino, []).append((name, value))
    # per pack (NULL: no location) the extents that fail their checks
    by_pack = cat.query(
        "SELECT pack, sum(ok IS NOT 1) FROM ("
        f"SELECT {EXTENT_OK_SQL} AS ok, p.name AS pack FROM (SELECT e.*, coalesce(lag(e.offset + e.length) "
        "OVER (PARTITION BY e.ino ORDER BY e.offset), 0) AS prev_end FROM extents e "
        "WHERE e.ino IN (SELECT ino FROM temp.subtree_rows)) e JOIN blobs b ON b.id = e.blob "
        f"JOIN inodes i ON i.ino = e.ino LEFT JOIN packs p ON p.id = b.pack WHERE {S_IFREG_SQL}) GROUP BY pack")
    packs = frozenset(p for p, _ in by_pack if p is not None)
    if any(bad for _, bad in by_pack) or not all(type(p) is str and PACK_NAME.fullmatch(p) for p in packs):
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
    rows = cat.query("SELECT parent, name FROM dirents WHERE ino=? LIMIT 1", (ino,))
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
    rows = cat.query("SELECT e.offset, b.raw_len FROM extents e JOIN blobs b ON b.id = e.blob "
                     "WHERE e.ino=? ORDER BY e.offset", (ino,))
    raw = {off: rlen for off, rlen in rows}
    out = []
    for ext in cat.extents(ino):
        rlen = raw.get(ext.offset)
        if not int_in(rlen, 0, U32):
            raise CorruptObject(f"catalog {cat.path.name}: a blob length is malformed")
        out.append((ext, rlen))
    return out


