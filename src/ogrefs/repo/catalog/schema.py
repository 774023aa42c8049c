"""The catalog's schema and what a row must be: both validators side by side.

The tables (docs/format.md has the authoritative description; the package's
docstring a summary), the named tuples a reader returns, the schema's
creation, and the checks every row passes before it reaches a caller: in
Python for a row at a time (:func:`check_inode`, :func:`check_location`,
:func:`valid_name`, :func:`valid_xattr`) and the same rules in SQL for the
bulk scans that never bring rows into Python (:data:`NAME_OK_SQL`,
:data:`INODE_OK_SQL`, :data:`EXTENT_OK_SQL`).  A change to one is a change to
the other; they stand here together so that it is made to both.
"""

from __future__ import annotations

import re
import stat
import sqlite3
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

from ogrefs.errors import CorruptObject
from ogrefs.repo.pack import BlobLocation

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


INODE_COLS = "ino, mode, uid, gid, user, grp, size, atime_ns, mtime_ns, ctime_ns, nlink, rdev, target, src_dev, src_ino, flags"
I_COLS = ", ".join("i." + c.strip() for c in INODE_COLS.split(","))


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


def sqlite_utils_module() -> ModuleType:
    """sqlite_utils, imported without the pandas and numpy it imports whenever they are installed.

    Only :func:`reference_schema` (the schema's definition, which the plain DDL below is checked against)
    imports it: a snapshot never does.  Its numpy and pandas column types are never used by a catalog, but
    with ogrefs installed in a training venv they would be imported: ~50 ms and 80 modules for numpy,
    several hundred ms for pandas.  Either one already imported by the process stays as it is.
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


def reference_schema(path: Path) -> None:
    """The catalog's tables as sqlite-utils defines them: what :data:`CATALOG_DDL` must create, statement for
    statement (tests/unit/test_startup_imports.py compares the two)."""
    db = sqlite_utils_module().Database(path)
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


def _table(name: str, cols: str, pk: str = "") -> str:
    body = ",\n".join(f"   {c}" for c in cols.split(", ")) + (f",\n   PRIMARY KEY ({pk})" if pk else "")
    return f'CREATE TABLE "{name}" (\n{body}\n);\n'


def _index(name: str, table: str, col: str, unique: bool = False) -> str:
    return f'CREATE {"UNIQUE " if unique else ""}INDEX "{name}"\n    ON "{table}" ("{col}");\n'


#: The catalog's tables, as SQLite stores the statements sqlite-utils generates for :func:`reference_schema`:
#: created in one transaction, without importing sqlite-utils (~100 ms, with its plugin scan of every
#: installed package) or committing each statement (eleven fsyncs): a quarter of a no-change snapshot of a
#: small box.
CATALOG_DDL = (
    _table("inodes", '"ino" INTEGER PRIMARY KEY, "mode" INTEGER, "uid" INTEGER, "gid" INTEGER, "user" TEXT, '
           '"grp" TEXT, "size" INTEGER, "atime_ns" INTEGER, "mtime_ns" INTEGER, "ctime_ns" INTEGER, '
           '"nlink" INTEGER, "rdev" INTEGER, "target" BLOB, "src_dev" INTEGER, "src_ino" INTEGER, "flags" INTEGER')
    + _table("dirents", '"parent" INTEGER, "name" BLOB, "ino" INTEGER', '"parent", "name"')
    + _table("xattrs", '"ino" INTEGER, "name" BLOB, "value" BLOB', '"ino", "name"')
    + _table("extents", '"ino" INTEGER, "offset" INTEGER, "length" INTEGER, "blob" INTEGER', '"ino", "offset"')
    + _table("blobs", '"id" INTEGER PRIMARY KEY, "chunk" BLOB, "pack" INTEGER, "offset" INTEGER, '
             '"stored_len" INTEGER, "raw_len" INTEGER')
    + _index("idx_blobs_chunk", "blobs", "chunk", unique=True)
    + _table("packs", '"id" INTEGER PRIMARY KEY, "name" TEXT')
    + _index("idx_packs_name", "packs", "name", unique=True)
    + _table("roots", '"path" BLOB PRIMARY KEY')
    + _table("hints", '"class" TEXT, "ino" INTEGER, "rank" INTEGER', '"class", "ino"')
    + _table("meta", '"key" TEXT PRIMARY KEY, "value" TEXT')
    + _index("idx_dirents_ino", "dirents", "ino")
)


def create_schema(path: Path) -> None:
    """An empty catalog at ``path`` (a new file: the writer's, synced when it is stored)."""
    db = sqlite3.connect(path, isolation_level=None)
    try:
        db.execute("PRAGMA journal_mode=OFF")
        db.execute("PRAGMA synchronous=OFF")
        db.executescript("BEGIN;\n" + CATALOG_DDL + "COMMIT;\n")
    finally:
        db.close()


def valid_xattr(name: object, value: object) -> bool:
    """What every reader of a catalog's xattrs checks: a non-empty name without NUL, bytes both."""
    return type(name) is bytes and bool(name) and b"\0" not in name and type(value) is bytes


NAME_MAX = 255
U32 = 2**32
I64 = 2**63
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


def int_in(v: object, lo: int, hi: int) -> bool:
    return type(v) is int and lo <= v < hi


def check_inode(row: tuple, where: str) -> Inode:
    """An Inode from a catalog row, or CorruptObject if a column has the wrong type or range.

    SQLite does not enforce column types, so a damaged or forged catalog can
    hold text where a mode is expected, negative sizes, or a NUL in a symlink
    target; none of that may reach ``os`` calls (where it would raise
    TypeError, OverflowError or ValueError instead of a clean error).
    """
    (ino, mode, uid, gid, user, grp, size, atime, mtime, ctime, nlink, rdev, target, src_dev, src_ino,
     flags) = row
    ok = (int_in(ino, 1, I64) and int_in(mode, 0, U32) and int_in(uid, 0, U32) and int_in(gid, 0, U32)
          and (user is None or type(user) is str) and (grp is None or type(grp) is str)
          and int_in(size, 0, I64) and int_in(atime, -I64, I64) and int_in(mtime, -I64, I64)
          and int_in(ctime, -I64, I64) and int_in(nlink, 0, I64) and int_in(rdev, 0, I64)
          and (target is None or (type(target) is bytes and b"\0" not in target))
          and type(src_dev) is int and type(src_ino) is int and type(flags) is int)
    if not ok:
        raise CorruptObject(f"catalog {where}: inode {ino!r} has a malformed row")
    return Inode(*row)


def check_location(chunk: object, pack: object, poff: object, slen: object, where: str) -> None:
    if not (type(chunk) is bytes and len(chunk) == 32 and type(pack) is str
            and (pack in _GOOD_PACKS or _good_pack(pack)) and int_in(poff, 0, I64) and int_in(slen, 1, U32)):
        raise CorruptObject(f"catalog {where}: a blob location is malformed")


PACK_NAME = re.compile(r"[0-9a-f]{64}")
#: Pack names already matched (a catalog names a few packs for thousands of blobs; only good ones are kept).
_GOOD_PACKS: set[str] = set()


def _good_pack(name: str) -> bool:
    if not PACK_NAME.fullmatch(name):
        return False
    if len(_GOOD_PACKS) < 1 << 16:
        _GOOD_PACKS.add(name)
    return True

#: Every table and column a reader uses; checked once when a catalog is opened.
TABLES = {
    "inodes": INODE_COLS,
    "dirents": "parent, name, ino",
    "xattrs": "ino, name, value",
    "extents": "ino, offset, length, blob",
    "blobs": "id, chunk, pack, offset, stored_len, raw_len",
    "packs": "id, name",
    "roots": "path",
    "hints": "class, ino, rank",
    "meta": "key, value",
}


def sql_int(col: str, lo: int | None = None, hi: int | None = None) -> str:
    """SQL for :func:`int_in`: an INTEGER (SQLite's are 64-bit, so within the I64 bounds) in [lo, hi)."""
    return " AND ".join([f"typeof({col}) = 'integer'"] + ([f"{col} >= {lo}"] if lo is not None else [])
                        + ([f"{col} < {hi}"] if hi is not None else []))


#: :func:`valid_name` of ``t.name`` in SQL.
NAME_OK_SQL = (f"(typeof(t.name) = 'blob' AND length(t.name) BETWEEN 1 AND {NAME_MAX} "
                "AND t.name NOT IN (x'2e', x'2e2e') AND instr(t.name, x'2f') = 0 AND instr(t.name, x'00') = 0)")
#: :func:`check_inode` of inode row ``i`` in SQL.
INODE_OK_SQL = "(" + " AND ".join([
    sql_int("i.ino", 1), *(sql_int(f"i.{c}", 0, U32) for c in ("mode", "uid", "gid")),
    *(f"(i.{c} IS NULL OR typeof(i.{c}) = 'text')" for c in ("user", "grp")),
    *(sql_int(f"i.{c}", 0) for c in ("size", "nlink", "rdev")),
    *(sql_int(f"i.{c}") for c in ("atime_ns", "mtime_ns", "ctime_ns", "src_dev", "src_ino", "flags")),
    "(i.target IS NULL OR (typeof(i.target) = 'blob' AND instr(i.target, x'00') = 0))",
]) + ")"
#: :meth:`Catalog._located` of extent ``e`` (blob ``b``, pack ``p``) of file ``i`` in SQL; ``prev_end``: the
#: end of the file's previous extent (0 for its first).  The pack's name is checked once per pack, in Python
#: (a GLOB per extent was half the cost).
EXTENT_OK_SQL = "(" + " AND ".join([
    sql_int("e.offset", 0), sql_int("e.length", 0, U32), sql_int("b.raw_len", 1, MAX_CHUNK + 1),
    "e.length = b.raw_len", sql_int("i.size", 0), "e.offset >= prev_end", "e.offset + e.length <= i.size",
    "typeof(b.chunk) = 'blob'", "length(b.chunk) = 32",
    "(p.name IS NULL OR (" + sql_int("b.offset", 0) + " AND " + sql_int("b.stored_len", 1, U32) + "))",
]) + ")"
S_IFREG_SQL = f"(i.mode & {0o170000}) = {stat.S_IFREG}"


