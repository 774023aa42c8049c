"""Untouched subtrees copied whole (snapshot/treecopy.py, repo/catalog/scans.py ``subtree``, repo/catalog/writer.py ``add_copied``).

The system tests (tests/system/test_untouched*.py, test_loop.py) take this
path on real mounts and compare what they restore with what the box saw;
here the two primitives are held against the entry-by-entry answers on a
real catalog, and each rule that must refuse a copy is tried alone.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import shutil
import sqlite3
from pathlib import Path

import pytest

from ogrefs.errors import CorruptObject
from ogrefs.repo import Repository
from ogrefs.repo.catalog import FLAG_CHANGED, ROOT_INO, Catalog, CatalogWriter, listing, subtree
from ogrefs.snapshot.pipeline import SnapshotOptions, take_snapshot
from ogrefs.snapshot.treecopy import CopyPlan, PathSet, Refused, plan_copy
from ogrefs.snapshot.untouched import visible_xattrs
from ogrefs.snapshot.walk import WalkRules


@pytest.fixture(scope="module")
def snap(tmp_path_factory) -> tuple[Repository, Path, Path]:
    d = tmp_path_factory.mktemp("treecopy")
    src = d / "src"
    for i in range(3):
        (src / "venv" / f"pkg{i}" / "sub").mkdir(parents=True)
        (src / "venv" / f"pkg{i}" / "mod.py").write_text(f"x = {i}\n" * (i + 1))
        (src / "venv" / f"pkg{i}" / "sub" / "data.bin").write_bytes(os.urandom(300_000 + i))
    os.symlink("pkg0/mod.py", src / "venv" / "link")
    os.setxattr(src / "venv" / "pkg1" / "mod.py", "user.tag", b"one")
    os.setxattr(src / "venv" / "pkg2", "user.dir", b"two")
    (src / "venv" / "empty").mkdir()
    repo = Repository.init(f"memory://treecopy-{secrets.token_hex(4)}", cache_root=d / "cache")
    m = take_snapshot(repo, SnapshotOptions(paths=[os.fsencode(src)], no_parent=True))
    return repo, repo.catalog_path(m["id"]), src


def _by_listing(cat: Catalog, ino: int, prefix: bytes = b"") -> dict[bytes, tuple]:
    """What the walk gets directory by directory: listing() of every directory, recursively."""
    out = {}
    for e in listing(cat, ino):
        path = prefix + b"/" + e.name
        out[path] = (e.node, tuple(e.xattrs), tuple(e.extents))
        if e.node.is_dir:
            out.update(_by_listing(cat, e.node.ino, path))
    return out


def _by_subtree(tree, ino: int, prefix: bytes = b"") -> dict[bytes, tuple]:
    out = {}
    for name, node in tree.children[ino]:
        path = prefix + b"/" + name
        out[path] = (node, tuple(tree.xattrs.get(node.ino, [])), tree.chunks.get(node.ino))
        if node.is_dir:
            out.update(_by_subtree(tree, node.ino, path))
    return out


def _listed_as_subtree(listed: dict[bytes, tuple]) -> dict[bytes, tuple]:
    """listing()'s answer cut to what a Subtree holds: the deciding columns, xattrs, a file's chunk count."""
    return {p: ((n.ino, n.mode, n.nlink, n.size, n.flags), xattrs, len(extents) if n.is_reg else None)
            for p, (n, xattrs, extents) in listed.items()}


def _venv(snap) -> tuple[Catalog, int]:
    repo, cat_path, src = snap
    cat = Catalog(cat_path)
    return cat, cat.resolve(os.fsencode(src / "venv")).ino


def test_subtree_is_what_listing_gives_directory_by_directory(snap):
    cat, top = _venv(snap)
    tree = subtree(cat, top, limit=1000)
    assert tree is not None and len(tree) == 3 * 4 + 2
    listed = _by_listing(cat, top)
    assert {p: (tuple(n), x, c) for p, (n, x, c) in _by_subtree(tree, top).items()} == _listed_as_subtree(listed)
    assert tree.packs == {e[3].pack for _, _, extents in listed.values() for e in extents} and not tree.unlocated
    assert tree.source == cat.path


def test_subtree_refuses_more_than_its_limit(snap):
    cat, top = _venv(snap)
    assert subtree(cat, top, limit=13) is None and subtree(cat, top, limit=14) is not None


def _damaged(snap, tmp_path: Path, sql: str) -> tuple[Catalog, int]:
    cat_path = tmp_path / "damaged.sqlite"
    shutil.copyfile(snap[1], cat_path)
    _, top = _venv(snap)
    db = sqlite3.connect(cat_path)
    for statement in sql.split(";"):  # (no statement here has a ";" of its own)
        db.execute(statement, {"top": top})
    db.commit()
    db.close()
    return Catalog(cat_path), top


@pytest.mark.parametrize("sql", [
    # a second name for a file below (a hard link): the walk keeps it one inode, entry by entry
    "INSERT INTO dirents SELECT :top, x'6832', ino FROM dirents WHERE name = x'6c696e6b'",
    # a directory loop: pkg0/sub/up -> venv
    "INSERT INTO dirents SELECT ino, x'7570', :top FROM dirents WHERE name = x'737562' LIMIT 1",
    # a name the walk never records
    "UPDATE dirents SET name = x'612f62' WHERE name = x'6c696e6b'",
    # an entry below a symlink
    "INSERT INTO dirents SELECT ino, x'6b6964', (SELECT max(ino) FROM inodes) FROM dirents WHERE name = x'6c696e6b'",
], ids=["hard-link", "loop", "bad-name", "below-a-symlink"])
def test_subtree_refuses_what_only_the_entry_by_entry_walk_handles(snap, tmp_path, sql):
    cat, top = _damaged(snap, tmp_path, sql)
    assert subtree(cat, top, limit=1000) is None


# Rows listing() refuses (CorruptObject) or skips (Catalog.rejected): subtree()'s checks are SQL, held here
# against the Python ones, each damage alone.  (pkg1/sub/data.bin has one extent, 300,001 bytes.)
_DATA1 = "(SELECT ino FROM dirents WHERE name = x'646174612e62696e' AND parent IN " \
         "(SELECT ino FROM dirents WHERE name = x'737562' AND parent IN (SELECT ino FROM dirents WHERE name = x'706b6731')))"


@pytest.mark.parametrize("sql", [
    "UPDATE inodes SET mode = 'x' WHERE ino = (SELECT ino FROM dirents WHERE name = x'6c696e6b')",
    f"UPDATE inodes SET size = -1 WHERE ino = {_DATA1}",
    f"UPDATE inodes SET uid = 4294967296 WHERE ino = {_DATA1}",
    "UPDATE inodes SET target = x'6100' WHERE ino = (SELECT ino FROM dirents WHERE name = x'6c696e6b')",
    "UPDATE inodes SET user = x'61' WHERE ino = (SELECT ino FROM dirents WHERE name = x'6c696e6b')",
    f"UPDATE inodes SET size = 10 WHERE ino = {_DATA1}",  # an extent past the end of the file
    f"UPDATE extents SET length = length - 1 WHERE ino = {_DATA1}",  # shorter than its chunk
    f"UPDATE extents SET offset = 'a' WHERE rowid = (SELECT min(rowid) FROM extents WHERE ino = {_DATA1})",  # one row: (ino, offset) is unique
    f"UPDATE inodes SET size = size * 2 WHERE ino = {_DATA1}; "  # overlapping, both within the file (the first extent: a 300 KB file is sometimes two)
    f"INSERT INTO extents SELECT ino, 5, length, blob FROM extents WHERE ino = {_DATA1} AND offset = 0",
    f"UPDATE blobs SET chunk = x'00' WHERE id IN (SELECT blob FROM extents WHERE ino = {_DATA1})",
    f"UPDATE blobs SET stored_len = 0 WHERE id IN (SELECT blob FROM extents WHERE ino = {_DATA1})",
    f"UPDATE packs SET name = 'ABC' || substr(name, 4) WHERE id IN (SELECT pack FROM blobs WHERE id IN "
    f"(SELECT blob FROM extents WHERE ino = {_DATA1}))",
    "INSERT INTO xattrs VALUES ((SELECT ino FROM dirents WHERE name = x'6c696e6b'), x'', x'76')",
], ids=["mode-text", "size-negative", "uid-too-big", "target-nul", "user-blob", "extent-past-end", "extent-short",
        "offset-text", "extents-overlap", "chunk-id-short", "stored-len-zero", "pack-name", "xattr-name-empty"])
def test_subtree_checks_every_row_as_listing_does(snap, tmp_path, sql, expect_log):
    cat, top = _damaged(snap, tmp_path, sql)
    assert subtree(cat, top, limit=1000) is None
    expect_log(r"skipped entry .*malformed", required=False)  # listing() warns of what it skips
    try:
        _by_listing(cat, top)
    except CorruptObject:
        return
    assert cat.rejected, "listing() took the damaged row: subtree() refuses more than the walk"


def test_a_copy_that_would_leave_a_hole_raises(snap, tmp_path):
    """A chunk whose pack the copy was not given has no blob row to point to: the writer counts and raises."""
    cat, top = _venv(snap)
    tree = subtree(cat, top, limit=1000)
    plan = _plan(snap, tree=tree)
    with pytest.raises(RuntimeError, match="extents"):
        _copied_into(tmp_path, cat, top, dataclasses.replace(tree, packs=frozenset()), plan)


def test_a_chunk_the_new_catalog_has_keeps_its_own_row(snap, tmp_path):
    """This run's chunk (located at commit) is not given the parent's location by a copy that shares it."""
    cat, top = _venv(snap)
    tree = subtree(cat, top, limit=1000)
    data1 = cat.resolve(os.fsencode(snap[2] / "venv" / "pkg1" / "sub" / "data.bin"))
    (off, length, cid, loc), = cat.located_extents(data1.ino)

    def this_runs_file(w):
        w.add_dirent(ROOT_INO, b"new.bin", 7)
        w.copy_inode(7, data1)
        w.add_extents(7, [(off, length, cid)])

    new = _copied_into(tmp_path, cat, top, tree, _plan(snap, tree=tree), before=this_runs_file)
    copied = new.resolve(b"/venv/pkg1/sub/data.bin")
    assert [e[2:] for e in new.located_extents(copied.ino)] == [(cid, None)]  # the run's own row, unlocated
    assert [e[2:] for e in new.located_extents(new.resolve(b"/new.bin").ino)] == [(cid, None)]
    others = new.located_extents(new.resolve(b"/venv/pkg0/sub/data.bin").ino)
    assert others and all(e[3] is not None for e in others)


def _plan(snap, rules: WalkRules | None = None, never: set[bytes] | None = None, packs_live=None, tree=None):
    repo, _, src = snap
    cat, top = _venv(snap)
    tree = tree or subtree(cat, top, limit=1000)
    counter = iter(range(100, 10_000))
    live = {k.rsplit("/", 1)[1] for k in repo.store.list("packs/")}
    return plan_copy(tree, os.fsencode(src / "venv"), rules=rules or WalkRules(), never=never or set(),
                     dev=0, root_dev=0, new_ino=lambda: next(counter),
                     packs_live=packs_live or (lambda packs: packs <= live), visible_xattrs=visible_xattrs)


def _copied_into(tmp_path: Path, cat: Catalog, top: int, tree, plan, before=None) -> Catalog:
    """A new catalog holding ``plan`` copied under inode 50, as the walk makes one (root, then the top)."""
    w = CatalogWriter(tmp_path / "new.sqlite")
    assert w.new_ino() == ROOT_INO
    w.add_inode(ROOT_INO, os.lstat("/"), "root", "root")
    w.add_dirent(ROOT_INO, b"venv", 50)
    w.copy_inode(50, cat.get(top))
    if before:
        before(w)
    w.add_copied(tree, 50, plan.inodes, plan.xattrs)
    w.close()
    return Catalog(tmp_path / "new.sqlite")


def test_a_copied_subtree_is_the_catalog_the_walk_would_have_written(snap, tmp_path):
    cat, top = _venv(snap)
    plan = _plan(snap)
    assert isinstance(plan, CopyPlan)
    assert (plan.dirs, plan.files, plan.others) == (3 * 2 + 1, 6, 1)
    assert plan.bytes == sum(n.size for _, n in cat.walk(top) if n.is_reg)
    src = os.fsencode(snap[2] / "venv")
    assert plan.observed[0] == (src + b"/empty", []) and (src + b"/pkg1", [b"mod.py", b"sub"]) in plan.observed
    assert sorted(plan.unchanged) == sorted(src + p for p, n in cat.walk(top) if n.is_reg)

    new = _copied_into(tmp_path, cat, top, subtree(cat, top, limit=1000), plan)
    got = {p: (n.mode, n.size, n.mtime_ns, n.target, tuple(new.xattrs(n.ino)),
               tuple(e[2:] for e in new.located_extents(n.ino)) if n.is_reg else None)
           for p, n in new.walk(50)}
    want = {p: (n.mode, n.size, n.mtime_ns, n.target, tuple(cat.xattrs(n.ino)),
                tuple(e[2:] for e in cat.located_extents(n.ino)) if n.is_reg else None)
            for p, n in cat.walk(top)}
    assert got == want and len(got) == 14


def test_every_rule_of_the_walk_refuses_the_copy_and_names_the_way_down(snap):
    src = os.fsencode(snap[2] / "venv")
    cat, top = _venv(snap)
    pkg1 = cat.resolve(src + b"/pkg1").ino
    refused = _plan(snap, rules=WalkRules(excludes=["*.bin"]))
    assert isinstance(refused, Refused) and refused.why.endswith("pkg0/sub/data.bin: excluded")
    assert refused.dirs == (top, cat.resolve(src + b"/pkg0").ino, cat.resolve(src + b"/pkg0/sub").ino)
    refused = _plan(snap, never={src + b"/pkg1/mod.py"})
    assert isinstance(refused, Refused) and refused.dirs == (top, pkg1) and "excluded" in refused.why
    refused = _plan(snap, rules=WalkRules(table={src + b"/pkg2/sub": None}))
    assert isinstance(refused, Refused) and "a mount point" in refused.why
    refused = _plan(snap, rules=WalkRules(skip_paths={src + b"/empty"}))
    assert isinstance(refused, Refused) and "not descended into" in refused.why
    refused = _plan(snap, rules=WalkRules(exclude_if_present=[(b"mod.py", None)]))
    assert isinstance(refused, Refused) and refused.why.endswith("pkg0: excluded")
    # data in a pack this run does not see (gone, or repacked): the walk finds each file's chunks again
    refused = _plan(snap, packs_live=lambda packs: False)
    assert isinstance(refused, Refused) and refused.dirs == (top,) and "live packs" in refused.why
    # a file A flagged as changing while read
    tree = subtree(cat, top, limit=1000)
    kids = tree.children[pkg1]
    tree.children[pkg1][:] = [(n, node._replace(flags=FLAG_CHANGED) if n == b"mod.py" else node) for n, node in kids]
    refused = _plan(snap, tree=tree)
    assert isinstance(refused, Refused) and refused.why.endswith("pkg1/mod.py: a file to read again")


def test_path_sets_answer_strictly_below():
    s = PathSet([b"/a/b", b"/ab", b"/c", b"/"])
    assert s.any_below(b"/a") and s.any_below(b"/") and not s.any_below(b"/a/b") and not s.any_below(b"/ab")
    assert not PathSet([b"/"]).any_below(b"/") and PathSet([b"/", b"/x"]).any_below(b"/")
