"""The mount's catalog queries (Catalog.data_bytes ... small_sibling_chunks): right answers, and validated rows.

They used to be raw SQL in lazy/fs/vfs.py (``_CatalogExtra``) with an unquoted
SQLite URI; now they are Catalog methods, so a forged catalog gives
CorruptObject or a left-out row, never a TypeError far away, and any cache
path opens.
"""

from __future__ import annotations

import os
import secrets
import shutil
import sqlite3
from pathlib import Path

import pytest

from ogrefs.errors import CorruptObject
from ogrefs.repo import Repository
from ogrefs.repo.catalog import ROOT_INO, Catalog, listing
from ogrefs.snapshot.pipeline import SnapshotOptions, take_snapshot


@pytest.fixture(scope="module")
def snap(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("catq")
    src = d / "src"
    (src / "dir").mkdir(parents=True)
    (src / "dir" / "a.txt").write_bytes(b"a" * 1000)
    (src / "dir" / "b.txt").write_bytes(b"b" * 3000)
    (src / "big.bin").write_bytes(os.urandom(600_000))
    repo = Repository.init(f"memory://catq-{secrets.token_hex(4)}", cache_root=d / "cache")
    m = take_snapshot(repo, SnapshotOptions(paths=[os.fsencode(src)], no_parent=True))
    return repo.catalog_path(m["id"]), src


def _copy(snap: tuple[Path, Path], dest: Path) -> Path:
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(snap[0], dest)
    return dest


def test_the_mount_queries_answer_what_the_snapshot_holds(snap, tmp_path):
    cat = Catalog(_copy(snap, tmp_path / "cache#1" / "q?x=1%41.sqlite"))  # URI characters in the path
    src = snap[1]
    a = cat.resolve(os.fsencode(src / "dir" / "a.txt"))
    b = cat.resolve(os.fsencode(src / "dir" / "b.txt"))
    d = cat.resolve(os.fsencode(src / "dir"))
    assert cat.data_bytes(a.ino) == 1000 and cat.data_bytes_many([a.ino, b.ino]) == {a.ino: 1000, b.ino: 3000}
    assert cat.file_data_total() == 604_000
    assert 0 < cat.unique_data_total() <= 604_000
    assert cat.parent_of(a.ino) == d.ino and cat.parent_of(ROOT_INO) == ROOT_INO
    assert cat.path_of(b.ino) == os.fsencode(src / "dir" / "b.txt")
    assert cat.small_files(d.ino, 2000) == [(a.ino, 1000)]
    assert not cat.has_xattrs()
    chunks = cat.small_sibling_chunks(d.ino, 256 * 1024, 4 << 20)
    assert {c for c, _ in chunks} == {e.chunk for ino in (a.ino, b.ino) for e in cat.extents(ino)}


@pytest.mark.parametrize("column, value", [("offset", "x"), ("stored_len", -1), ("raw_len", "y"), ("pack", 999)])
def test_a_malformed_sibling_location_is_left_out_and_the_others_stay(snap, tmp_path, column, value):
    path = _copy(snap, tmp_path / "forged.sqlite")
    good = Catalog(path)
    src = snap[1]
    a = good.resolve(os.fsencode(src / "dir" / "a.txt"))
    b = good.resolve(os.fsencode(src / "dir" / "b.txt"))
    d = good.resolve(os.fsencode(src / "dir"))
    db = sqlite3.connect(path)
    if column == "pack":
        db.execute("INSERT INTO packs (id, name) VALUES (999, '../../etc/passwd')")
    db.execute(f"UPDATE blobs SET {column}=? WHERE id=(SELECT blob FROM extents WHERE ino=?)", (value, b.ino))
    db.commit()
    db.close()
    cat = Catalog(path)
    chunks = cat.small_sibling_chunks(d.ino, 256 * 1024, 4 << 20)
    assert [c for c, _ in chunks] == [e.chunk for e in cat.extents(a.ino)]  # b's is left out, a's stays
    with pytest.raises(CorruptObject):
        cat.extents(b.ino)  # b itself fails on its own (EIO when it is opened)


def test_forged_lengths_and_entries_are_corrupt_object_not_type_errors(snap, tmp_path):
    path = _copy(snap, tmp_path / "forged2.sqlite")
    src = snap[1]
    good = Catalog(path)
    a = good.resolve(os.fsencode(src / "dir" / "a.txt"))
    b = good.resolve(os.fsencode(src / "dir" / "b.txt"))
    d = good.resolve(os.fsencode(src / "dir"))
    db = sqlite3.connect(path)
    db.execute("UPDATE extents SET length='many' WHERE ino=?", (a.ino,))
    db.execute("INSERT INTO dirents (parent, name, ino) VALUES (?, ?, ?)", (d.ino, b"x/../y", b.ino))
    db.execute("UPDATE dirents SET parent='up' WHERE ino=?", (d.ino,))
    db.commit()
    db.close()
    cat = Catalog(path)
    for query in (lambda: cat.data_bytes(a.ino), lambda: cat.data_bytes_many([a.ino]), cat.file_data_total,
                  lambda: cat.parent_of(d.ino)):
        with pytest.raises(CorruptObject):
            query()
    assert cat.small_files(d.ino, 1 << 20) == [(a.ino, 1000), (b.ino, 3000)]  # the bad name is skipped


def test_listing_gives_a_directory_as_children_xattrs_and_located_extents_do_one_by_one(tmp_path):
    """snapshot/untouched.py takes whole directories with it: the same rows, a hard link pair's once."""
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.bin").write_bytes(os.urandom(300_000))
    (src / "b.txt").write_bytes(b"b" * 10)
    os.link(src / "a.bin", src / "a-link.bin")
    os.setxattr(src / "b.txt", "user.k", b"v")
    os.setxattr(src / "sub", "user.d", b"dir")
    os.symlink("b.txt", src / "ln")
    repo = Repository.init(f"memory://list-{secrets.token_hex(4)}", cache_root=tmp_path / "cache")
    m = take_snapshot(repo, SnapshotOptions(paths=[os.fsencode(src)], no_parent=True))
    cat = Catalog(repo.catalog_path(m["id"]))
    d = cat.resolve(os.fsencode(src))
    listed = listing(cat, d.ino)
    assert [e.name for e in listed] == [b"a-link.bin", b"a.bin", b"b.txt", b"ln", b"sub"]
    for e, (name, node) in zip(listed, cat.children(d.ino)):
        assert (e.name, e.node) == (name, node)
        assert e.xattrs == cat.xattrs(node.ino)
        assert e.extents == (cat.located_extents(node.ino) if node.is_reg else [])
    assert listed[0].node.ino == listed[1].node.ino and len(listed[0].extents) >= 1
    assert listed[2].xattrs == [(b"user.k", b"v")] and listed[4].xattrs == [(b"user.d", b"dir")]


def test_bulk_reads_give_what_one_file_at_a_time_gives(snap, tmp_path, monkeypatch):
    """get_many and extents_of (the no-FUSE copy's groups) answer as get and all_extents do, across query
    pages (MANY), for inodes the catalog does not hold too; xattrs of a catalog without any asks nothing."""
    from ogrefs.repo.catalog import reader
    monkeypatch.setattr(reader, "MANY", 2)  # several pages from a small catalog
    cat = Catalog(_copy(snap, tmp_path / "bulk.sqlite"))
    inos = [ino for ino, in cat.query("SELECT ino FROM inodes")]
    files = [ino for ino in inos if cat.get(ino).is_reg]
    assert len(inos) > 4 and len(files) == 3
    assert cat.get_many(inos + [10**9, inos[0]]) == {ino: cat.get(ino) for ino in inos}
    assert list(cat.extents_of(reversed(files + [10**9]))) == list(cat.all_extents())
    assert list(cat.extents_of(files[1:2])) == [r for r in cat.all_extents() if r[0] == files[1]]
    asked = []
    monkeypatch.setattr(Catalog, "query", lambda self, *a: asked.append(a) or [])
    assert cat.xattrs(files[0]) == [] and not asked


def test_extents_of_fails_a_malformed_file_alone(snap, tmp_path):
    """A file whose extent is forged is named to on_malformed and left out; the others' rows stay; without
    on_malformed it raises CorruptObject. An inode number stored as a float is that file's row."""
    path = _copy(snap, tmp_path / "forged3.sqlite")
    src = snap[1]
    good = Catalog(path)
    a, b, big = (good.resolve(os.fsencode(src / n)) for n in ("dir/a.txt", "dir/b.txt", "big.bin"))
    db = sqlite3.connect(path)
    db.execute("UPDATE extents SET length='many' WHERE ino=?", (a.ino,))
    db.execute("UPDATE extents SET ino=? WHERE ino=?", (float(b.ino), b.ino))
    db.commit()
    db.close()
    cat = Catalog(path)
    bad: dict[int, str] = {}
    rows = list(cat.extents_of([a.ino, b.ino, big.ino], on_malformed=bad.setdefault))
    assert list(bad) == [a.ino] and "malformed" in bad[a.ino]
    assert {r[0] for r in rows} == {b.ino, big.ino} and all(type(r[0]) is int for r in rows)
    assert [r[1:] for r in rows if r[0] == big.ino] == [r[1:] for r in Catalog(snap[0]).all_extents() if r[0] == big.ino]
    with pytest.raises(CorruptObject):
        list(cat.extents_of([a.ino]))


# -- the one rewrite: repack's and copy's catalogs pass the reader's validation through it ----------------
def test_repack_and_copy_rewrite_catalogs_through_the_one_validated_rewrite():
    from ogrefs.maint import copy, repack
    from ogrefs.repo import catalog

    assert repack.rewrite_blobs is catalog.rewrite_blobs and copy.rewrite_blobs is catalog.rewrite_blobs


def test_a_rewrite_the_reader_refuses_raises(snap, tmp_path):
    from ogrefs.repo.catalog import rewrite_blobs
    from ogrefs.repo.pack import BlobLocation

    src = _copy(snap, tmp_path / "src.sqlite")
    blobs = list(Catalog(src).all_blobs())
    good = {c: (c, BlobLocation(p, o, s, r)) for c, p, o, s, r in blobs}
    rewrite_blobs(src, tmp_path / "ok.sqlite", good)
    assert sorted(Catalog(tmp_path / "ok.sqlite").all_blobs()) == sorted(blobs)
    chunk = blobs[0][0]
    bad = good | {chunk: (chunk, BlobLocation("not-a-pack-name", -5, 1, 1))}
    with pytest.raises(CorruptObject):
        rewrite_blobs(src, tmp_path / "bad.sqlite", bad)


def test_only_the_catalog_package_names_a_catalog_table_in_sql():
    """Where a private format is read or written is a structural rule: the catalog's tables appear in SQL
    in the repo/catalog package alone (maint/repack.py had a rewrite of its own beside copy's)."""
    import ast
    import re

    tables = r"(inodes|dirents|xattrs|extents|blobs|packs|roots|hints)"
    sql = re.compile(rf"\b(FROM|INTO|UPDATE|JOIN|TABLE)\s+(main\.)?{tables}\b")  # SQL, not prose
    src = Path(__file__).resolve().parents[2] / "src" / "ogrefs"
    found = []
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and sql.search(node.value):
                found.append(rel)
    assert found and all(rel.startswith("repo/catalog/") for rel in found), sorted(set(found))
