"""The materialization plan: ``<state_dir>/materialize.sqlite``, what is to fetch, where it goes, what is done.

Tables:

* ``chunks``  every distinct chunk to fetch: location, class, order, ``done``;
* ``targets`` where each chunk goes: (chunk, inode, file offset);
* ``files``   one row per regular-file inode: its path in the tree, how many
  targets are still missing, ``complete``, and for a large file what it was when
  recorded complete (``written``: :func:`ogrefs.localtree.copy_identity`);
* ``others``  directories and special files (their metadata is applied at the end);
* ``links``   the other names of a hard-linked regular file (``files`` holds its first);
* ``meta``    snapshot id, ``built`` (the tree exists), ``finished``.

A chunk recorded done is on disk at every one of its targets (the writer
records it only after the data is durable); a file is recorded complete once
its data is all done and its metadata applied.  Its ``written`` identity says
that the copy holds what the writer wrote from verified chunks for as long as
the file is unchanged (the daemon's FUSE passthrough hands such a copy to the
kernel without reading it back: lazy/fs/localread.py).

This module is the plan's one reader and writer: the build (its child
process), the materializer and a snapshot of a box running from a mount
(:func:`complete_paths_at`) call it; none of them writes SQL of its own.

Who owns what: a :class:`Plan` is used from worker threads (and, for a few
point queries, from the loop); each thread has its own SQLite connection
(``threading.local``), and only one thread writes at a time (the
materializer's preparation, then its writers under one lock).  Every method
takes immutable inputs and returns new objects; a Plan holds no state of the
loop's.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import urllib.parse
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from ogrefs.repo.chunkref import ChunkRef
from ogrefs.repo.localdb import wal_connect

CLASSES = ("trace", "hint", "background")
TRACE, HINT, BACKGROUND = 0, 1, 2

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE IF NOT EXISTS files (ino INTEGER PRIMARY KEY, path BLOB NOT NULL, pending INTEGER NOT NULL DEFAULT 0,
                                  complete INTEGER NOT NULL DEFAULT 0, written TEXT);
CREATE TABLE IF NOT EXISTS others (seq INTEGER PRIMARY KEY, ino INTEGER NOT NULL, path BLOB NOT NULL,
                                   dir INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS links (path BLOB PRIMARY KEY, ino INTEGER NOT NULL) WITHOUT ROWID;
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
#: Rows per ``IN (...)`` query (well below SQLite's variable limit).
_IN_BATCH = 500


@dataclass(frozen=True, slots=True)
class Item:
    """One chunk to fetch and where it goes (immutable: handed to worker threads)."""

    id: int
    ref: ChunkRef
    cls: int
    targets: tuple[tuple[int, int, bytes], ...]  # (ino, file offset, path in the tree)


#: (chunk class, seq, pack, pack offset, row id) of the last item of a page: where the next page starts.
PageKey = tuple[int, int, str, int, int]


class Plan:
    """The plan database of one state directory; see the module docstring."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._local = threading.local()

    def db(self) -> sqlite3.Connection:
        """This thread's connection."""
        db = getattr(self._local, "db", None)
        if db is None:
            db = self._local.db = wal_connect(self.path)  # a lost commit only re-fetches chunks
        return db

    def open(self, snapshot_id: str) -> str | None:
        """Create the schema; returns the snapshot whose plan this is (``snapshot_id`` once claimed)."""
        db = self.db()
        db.executescript(_SCHEMA)
        if "written" not in {r[1] for r in db.execute("PRAGMA table_info(files)")}:  # a plan of an older ogrefs
            db.execute("ALTER TABLE files ADD COLUMN written TEXT")
        owner = self.meta("snapshot")
        if owner is None:
            db.execute("INSERT INTO meta VALUES ('snapshot', ?)", (snapshot_id,))
            owner = snapshot_id
        return owner

    def meta(self, key: str) -> str | None:
        row = self.db().execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return row[0] if row else None

    def set_meta(self, key: str, value: str) -> None:
        self.db().execute("INSERT OR REPLACE INTO meta VALUES (?,?)", (key, value))

    def rollback(self) -> None:
        """Undo this thread's open transaction, if any (after a failure)."""
        db = self.db()
        if db.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                db.execute("ROLLBACK")

    # -- building (the build's child): one transaction, so nothing looks built until it commits ---------
    def begin_build(self) -> None:
        """Start a build from scratch (an interrupted one is redone): every row of a former build goes."""
        db = self.db()
        db.execute("BEGIN")
        for table in ("files", "others", "links", "chunks", "targets"):
            db.execute(f"DELETE FROM {table}")
        db.execute("DELETE FROM meta WHERE key IN ('built', 'finished')")

    def add_entries(self, files: list[tuple[int, bytes]], others: list[tuple[int, bytes, int]],
                    links: list[tuple[bytes, int]]) -> None:
        """Regular files (ino, path), directories and specials (ino, path, is_dir), more names (path, ino)."""
        db = self.db()
        db.executemany("INSERT INTO files (ino, path) VALUES (?,?)", files)
        db.executemany("INSERT INTO others (ino, path, dir) VALUES (?,?,?)", others)
        db.executemany("INSERT OR REPLACE INTO links (path, ino) VALUES (?,?)", links)

    def add_extents(self, rows: list[tuple]) -> None:
        """(ino, file offset, length, chunk, pack, pack offset, stored length): each distinct chunk once."""
        db = self.db()
        db.executemany("INSERT OR IGNORE INTO chunks (chunk, pack, poff, slen, rlen) VALUES (?,?,?,?,?)",
                       [(chunk, pack, poff, slen, length) for _i, _o, length, chunk, pack, poff, slen in rows])
        db.executemany("INSERT OR IGNORE INTO targets VALUES (?,?,?)",
                       [(chunk, ino, off) for ino, off, _l, chunk, _p, _po, _s in rows])

    def settle_files(self, unplanned: set[int]) -> None:
        """Files in ``unplanned`` are not materialized; every other file learns how many targets it waits for."""
        db = self.db()
        db.executemany("DELETE FROM files WHERE ino=?", [(ino,) for ino in unplanned])
        db.execute("DELETE FROM links WHERE ino NOT IN (SELECT ino FROM files)")
        db.execute("DELETE FROM targets WHERE ino NOT IN (SELECT ino FROM files)")
        db.execute("DELETE FROM chunks WHERE chunk NOT IN (SELECT chunk FROM targets)")
        db.execute("UPDATE files SET pending = (SELECT count(*) FROM targets t WHERE t.ino = files.ino)")

    def hint_file(self, seq: int, ino: int) -> None:
        """File ``ino``'s chunks are hinted (rank ``seq``): before everything else but the trace."""
        self.db().execute("UPDATE chunks SET base_cls=?, base_seq=? WHERE base_cls=? AND chunk IN "
                          "(SELECT chunk FROM targets WHERE ino=?)", (HINT, seq, BACKGROUND, ino))

    def commit_build(self) -> tuple[int, int]:
        """The build is whole: classes settled, ``built`` recorded, committed; (chunks, bytes) to fetch."""
        db = self.db()
        db.execute("UPDATE chunks SET cls=base_cls, seq=base_seq")
        self.set_meta("built", "1")
        db.execute("COMMIT")
        return tuple(db.execute("SELECT count(*), coalesce(sum(rlen), 0) FROM chunks").fetchone())

    # -- what is recorded -----------------------------------------------------------------------------
    def complete_inos(self) -> frozenset[int]:
        return frozenset(r[0] for r in self.db().execute("SELECT ino FROM files WHERE complete=1"))

    def done_chunks(self) -> frozenset[bytes]:
        return frozenset(r[0] for r in self.db().execute("SELECT chunk FROM chunks WHERE done=1"))

    def class_bytes(self) -> tuple[tuple[int, int, int], ...]:
        """(class, bytes in all, bytes done) per chunk class."""
        return tuple(self.db().execute("SELECT cls, sum(rlen), sum(rlen * done) FROM chunks GROUP BY cls"))

    def count_files(self) -> int:
        return self.db().execute("SELECT count(*) FROM files").fetchone()[0]

    def files_left(self) -> int:
        return self.db().execute("SELECT count(*) FROM files WHERE complete=0").fetchone()[0]

    def bytes_needed(self) -> int:
        """Bytes still to write: every target of every chunk not done."""
        return self.db().execute("SELECT coalesce(sum(c.rlen), 0) FROM targets t JOIN chunks c ON c.chunk = t.chunk"
                                 " WHERE c.done = 0").fetchone()[0]

    def file_path(self, ino: int) -> bytes | None:
        """The path in the tree of regular file ``ino`` (relative to the tree, starting with ``/``)."""
        row = self.db().execute("SELECT path FROM files WHERE ino=?", (ino,)).fetchone()
        return row[0] if row else None

    def complete_paths(self, inos: list[int]) -> dict[int, bytes]:
        """The tree paths of the complete files among ``inos``."""
        out: dict[int, bytes] = {}
        db = self.db()
        for i in range(0, len(inos), _IN_BATCH):
            part = inos[i:i + _IN_BATCH]
            out.update(db.execute(
                f"SELECT ino, path FROM files WHERE complete=1 AND ino IN ({','.join('?' * len(part))})", part))
        return out

    def ready_files(self) -> list[int]:
        """Files whose data is all done but that are not recorded complete (metadata not applied yet)."""
        return [r[0] for r in self.db().execute("SELECT ino FROM files WHERE pending <= 0 AND complete = 0")]

    def specials(self) -> list[tuple[int, bytes]]:
        return self.db().execute("SELECT ino, path FROM others WHERE dir=0").fetchall()

    def dirs_deepest_first(self) -> list[tuple[int, bytes]]:
        return self.db().execute("SELECT ino, path FROM others WHERE dir=1 ORDER BY seq DESC").fetchall()

    # -- pages of work ----------------------------------------------------------------------------------
    def page(self, after: PageKey | None, limit: int) -> tuple[list[Item], PageKey | None]:
        """The next ``limit`` chunks not done, in order, with their targets; and the last one's key."""
        db = self.db()
        cols = "id, chunk, pack, poff, slen, rlen, cls, seq"
        if after is None:
            rows = db.execute(f"SELECT {cols} FROM chunks WHERE done=0 ORDER BY {_ORDER} LIMIT ?", (limit,)).fetchall()
        else:
            rows = db.execute(f"SELECT {cols} FROM chunks WHERE done=0 AND ({_ORDER}) > (?,?,?,?,?) "
                              f"ORDER BY {_ORDER} LIMIT ?", (*after, limit)).fetchall()
        if not rows:
            return [], None
        targets = self._targets([r[1] for r in rows])
        items = [Item(id_, ChunkRef(chunk, pack, poff, slen, rlen), cls, tuple(targets.get(chunk, ())))
                 for id_, chunk, pack, poff, slen, rlen, cls, _seq in rows]
        id_, _c, pack, poff, _s, _r, cls, seq = rows[-1]
        return items, (cls, seq, pack, poff, id_)

    def _targets(self, chunks: list[bytes]) -> dict[bytes, list[tuple[int, int, bytes]]]:
        targets: dict[bytes, list[tuple[int, int, bytes]]] = {}
        marks = ",".join("?" * len(chunks))
        for chunk, ino, off, path in self.db().execute(
                f"SELECT t.chunk, t.ino, t.off, f.path FROM targets t JOIN files f ON f.ino = t.ino "
                f"WHERE t.chunk IN ({marks})", chunks):
            targets.setdefault(chunk, []).append((ino, off, path))
        return targets

    def items_for(self, refs: tuple[ChunkRef, ...]) -> list[Item | None]:
        """The plan rows of these chunks (None for a chunk the plan does not hold, or done): adopted chunks."""
        db = self.db()
        rows: dict[bytes, tuple[int, int]] = {}
        for i in range(0, len(refs), _IN_BATCH):
            part = [r.chunk for r in refs[i:i + _IN_BATCH]]
            marks = ",".join("?" * len(part))
            rows.update((chunk, (id_, cls)) for id_, chunk, cls in db.execute(
                f"SELECT id, chunk, cls FROM chunks WHERE done=0 AND chunk IN ({marks})", part))
        targets = self._targets(list(rows)) if rows else {}
        out: list[Item | None] = []
        for ref in refs:
            row = rows.get(ref.chunk)
            out.append(None if row is None else Item(row[0], ref, row[1], tuple(targets.get(ref.chunk, ()))))
        return out

    # -- recording --------------------------------------------------------------------------------------
    def record_done(self, items: Iterable[Item]) -> list[int]:
        """One transaction: these chunks are done (their data is durable); returns the files now all done."""
        db = self.db()
        pending: Counter[int] = Counter()
        db.execute("BEGIN")
        try:
            for item in items:
                # only a chunk that was not done yet counts towards its files (never twice: a file must
                # not look complete before every one of its chunks is in place)
                if db.execute("UPDATE chunks SET done=1 WHERE id=? AND done=0", (item.id,)).rowcount:
                    pending.update(ino for ino, _o, _p in item.targets)
            db.executemany("UPDATE files SET pending=pending-? WHERE ino=?", [(n, ino) for ino, n in pending.items()])
            db.execute("COMMIT")
        except BaseException:
            self.rollback()
            raise
        ready = []
        for ino in pending:
            row = db.execute("SELECT pending, complete FROM files WHERE ino=?", (ino,)).fetchone()
            if row is not None and row[0] <= 0 and not row[1]:
                ready.append(ino)
        return ready

    def mark_complete(self, inos: list[int], written: dict[int, str] | None = None) -> None:
        """These files are complete; ``written``: what some of them were once complete (their identity)."""
        if inos:
            written = written or {}
            db = self.db()
            db.execute("BEGIN")
            db.executemany("UPDATE files SET complete=1, written=? WHERE ino=?", [(written.get(i), i) for i in inos])
            db.execute("COMMIT")

    def mark_incomplete(self, inos: list[int]) -> None:
        """These files are not complete after all (a rerun found a name of theirs removed): written again."""
        if inos:
            db = self.db()
            db.execute("BEGIN")
            db.executemany("UPDATE files SET complete=0, written=NULL WHERE ino=?", [(i,) for i in inos])
            db.execute("COMMIT")

    def written(self, ino: int) -> str | None:
        """The identity complete file ``ino`` had when it was recorded complete, if it was recorded (a point query)."""
        row = self.db().execute("SELECT written FROM files WHERE ino=? AND complete=1", (ino,)).fetchone()
        return row[0] if row else None

    def mark_finished(self) -> None:
        db = self.db()
        db.execute("BEGIN")
        self.set_meta("finished", "1")
        db.execute("COMMIT")

    def classify_trace(self, order: dict[bytes, int]) -> None:
        """This run's trace chunks (``order``: chunk -> position) go first; an older run's trace class is undone."""
        db = self.db()
        db.execute("BEGIN")
        db.execute("UPDATE chunks SET cls=base_cls, seq=base_seq WHERE cls=?", (TRACE,))
        db.executemany("UPDATE chunks SET cls=?, seq=? WHERE chunk=? AND done=0",
                       [(TRACE, seq, chunk) for chunk, seq in order.items()])
        db.execute("COMMIT")


def complete_paths_at(path: str) -> set[bytes]:
    """Read only, from any process: the tree paths whose file holds all its data, every name of a hard link.

    A plan that cannot be read (absent, damaged, locked past the timeout) answers with nothing: no file
    counts as local, so a reader goes through the mount instead.  A plan written before ``links`` existed
    names the first path of a hard link only.
    """
    if not os.path.exists(path):
        return set()
    uri = f"file:{urllib.parse.quote(path)}?mode=ro"
    try:
        with contextlib.closing(sqlite3.connect(uri, uri=True, timeout=5)) as db:
            found = {bytes(r[0]) for r in db.execute("SELECT path FROM files WHERE complete=1")}
            if db.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='links'").fetchone():
                found.update(bytes(r[0]) for r in db.execute(
                    "SELECT l.path FROM links l JOIN files f ON f.ino = l.ino WHERE f.complete=1"))
            return found
    except sqlite3.Error:
        return set()
