"""The one rewrite of a finished catalog (``copy`` into another repository, ``repack``), checked by the reader."""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

from ogrefs.repo.catalog.reader import Catalog
from ogrefs.repo.pack import BlobLocation


def rewrite_blobs(src: Path, dst: Path, moves: dict[bytes, tuple[bytes, BlobLocation]]) -> None:
    """Write to ``dst`` a copy of catalog ``src`` whose chunks are renamed and relocated by ``moves``.

    ``moves`` maps every chunk id of ``src`` to (new chunk id, new location):
    ``ogrefs copy`` uses it for a catalog that moves into another repository,
    whose packs (and, keyed, chunk ids) differ, and ``repack`` for blobs moved
    into new packs (their ids unchanged).  The one rewrite of a catalog
    outside its writer: the result is checked as a readable catalog (the
    reader's own validation) before either replaces anything.
    """
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

