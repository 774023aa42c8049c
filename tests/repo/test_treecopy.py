"""Untouched subtrees copied whole (snapshot/treecopy.py, repo/catalog.py ``subtree`` and ``add_copied``).

The system tests (tests/system/test_untouched*.py, test_loop.py) take this
path on real mounts and compare what they restore with what the box saw;
here the two primitives are held against the entry-by-entry answers on a
real catalog, and each rule that must refuse a copy is tried alone.
"""

from __future__ import annotations

import os
import secrets
import shutil
import sqlite3
from pathlib import Path

import pytest

from ogrefs.repo import Repository
from ogrefs.repo.catalog import FLAG_CHANGED, ROOT_INO, Catalog, CatalogWriter, listing, subtree
from ogrefs.snapshot.pipeline import SnapshotOptions, live_extents, take_snapshot
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
        out[path] = (node, tuple(tree.xattrs.get(node.ino, [])), tuple(tree.extents.get(node.ino, [])))
        if node.is_dir:
            out.update(_by_subtree(tree, node.ino, path))
    return out


def _venv(snap) -> tuple[Catalog, int]:
    repo, cat_path, src = snap
    cat = Catalog(cat_path)
    return cat, cat.resolve(os.fsencode(src / "venv")).ino


def test_subtree_is_what_listing_gives_directory_by_directory(snap):
    cat, top = _venv(snap)
    tree = subtree(cat, top, limit=1000)
    assert tree is not None and len(tree) == 3 * 4 + 2
    assert _by_subtree(tree, top) == _by_listing(cat, top)


def test_subtree_refuses_more_than_its_limit(snap):
    cat, top = _venv(snap)
    assert subtree(cat, top, limit=13) is None and subtree(cat, top, limit=14) is not None


def _damaged(snap, tmp_path: Path, sql: str) -> tuple[Catalog, int]:
    cat_path = tmp_path / "damaged.sqlite"
    shutil.copyfile(snap[1], cat_path)
    _, top = _venv(snap)
    db = sqlite3.connect(cat_path)
    db.execute(sql, {"top": top})
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


def _plan(snap, rules: WalkRules | None = None, never: set[bytes] | None = None, locate=None, tree=None):
    repo, _, src = snap
    cat, top = _venv(snap)
    tree = tree or subtree(cat, top, limit=1000)
    counter = iter(range(100, 10_000))
    live = {k.rsplit("/", 1)[1] for k in repo.store.list("packs/")}
    return plan_copy(tree, os.fsencode(src / "venv"), 50, rules=rules or WalkRules(), never=never or set(),
                     dev=0, root_dev=0, new_ino=lambda: next(counter),
                     locate=locate or (lambda ext: live_extents(repo, live, ext)), visible_xattrs=visible_xattrs)


def test_a_copied_subtree_is_the_catalog_the_walk_would_have_written(snap, tmp_path):
    cat, top = _venv(snap)
    plan = _plan(snap)
    assert isinstance(plan, CopyPlan)
    assert (plan.dirs, plan.files, plan.others) == (3 * 2 + 1, 6, 1)
    assert plan.bytes == sum(n.size for _, n in cat.walk(top) if n.is_reg)
    src = os.fsencode(snap[2] / "venv")
    assert plan.observed[0] == (src + b"/empty", []) and (src + b"/pkg1", [b"mod.py", b"sub"]) in plan.observed
    assert sorted(plan.unchanged) == sorted(src + p for p, n in cat.walk(top) if n.is_reg)

    w = CatalogWriter(tmp_path / "new.sqlite")
    assert w.new_ino() == ROOT_INO
    w.add_inode(ROOT_INO, os.lstat("/"), "root", "root")
    w.add_dirent(ROOT_INO, b"venv", 50)
    w.copy_inode(50, cat.get(top))
    w.add_copied(plan.dirents, plan.inodes, plan.xattrs, plan.extents)
    w.close()
    new = Catalog(tmp_path / "new.sqlite")
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
    # data gone from the repository: the file is read again, through the walk
    refused = _plan(snap, locate=lambda ext: None)
    assert isinstance(refused, Refused) and "a file to read again" in refused.why
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
