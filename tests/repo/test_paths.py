"""Path safety: a forged or damaged catalog must not lead a restore or a mount outside its tree.

Each test takes a real snapshot, copies its catalog, edits the copy with raw
SQLite (names such as ``..``, ``a/b``, ``/abs``, NUL, a directory loop,
duplicate names that turn a file into a symlink pointing outside, escaping
roots), restores it into ``<tmp>/box/a/b/target`` and proves that nothing
outside the target changed, that the bad entries were skipped and reported,
and that the good entries still restore bit for bit.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import shutil
import sqlite3
import stat
import threading
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from ogrefs.repo import codec
from ogrefs.repo.catalog import ROOT_INO, Catalog
from ogrefs.lazy.fetch.fetcher import Fetcher
from ogrefs.repo import Repository
from ogrefs.restore import Restorer
from ogrefs.snapshot.pipeline import SnapshotOptions, take_snapshot
from ogrefs.lazy.fs.types import FsError
from ogrefs.lazy.fs.vfs import SnapshotFS

pytestmark = pytest.mark.timeout(60)  # a directory loop must not make a walk endless

PAYLOAD = bytes(range(256)) * 1200  # ~300 KB, one chunk


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("paths")
    src = d / "src"
    (src / "dir").mkdir(parents=True)
    (src / "data.bin").write_bytes(PAYLOAD)
    (src / "dir" / "inner.txt").write_bytes(b"inner\n")
    repo = Repository.init(f"memory://paths-{secrets.token_hex(4)}", cache_root=d / "cache")
    m = take_snapshot(repo, SnapshotOptions(paths=[os.fsencode(src)], no_parent=True))
    return repo, repo.catalog_path(m["id"]), src


class Forged:
    """A writable copy of a catalog, edited with raw SQL."""

    def __init__(self, base_path: Path, dest: Path, src: Path) -> None:
        shutil.copyfile(base_path, dest)
        self.path = dest
        self.db = sqlite3.connect(dest, isolation_level=None)
        cat = Catalog(base_path)
        self.src_ino = cat.resolve(os.fsencode(src)).ino
        self.dir_ino = cat.resolve(os.fsencode(src / "dir")).ino
        self.data_ino = cat.resolve(os.fsencode(src / "data.bin")).ino

    def next_ino(self) -> int:
        return self.db.execute("SELECT max(ino) FROM inodes").fetchone()[0] + 1

    def add_inode(self, like: int, **cols) -> int:
        """A new inode copied from ``like`` with some columns replaced."""
        ino = self.next_ino()
        names = [r[1] for r in self.db.execute("PRAGMA table_info(inodes)")]
        row = dict(zip(names, self.db.execute("SELECT * FROM inodes WHERE ino=?", (like,)).fetchone()))
        row.update(cols, ino=ino)
        self.db.execute(f"INSERT INTO inodes ({','.join(row)}) VALUES ({','.join('?' * len(row))})",
                        tuple(row.values()))
        return ino

    def link(self, parent: int, name: bytes, ino: int) -> None:
        self.db.execute("INSERT INTO dirents (parent, name, ino) VALUES (?,?,?)", (parent, name, ino))

    def drop_dirent_key(self) -> None:
        """Recreate ``dirents`` without its primary key, so that one directory can hold a name twice."""
        self.db.executescript(
            "CREATE TABLE d2 (parent INTEGER, name BLOB, ino INTEGER);"
            "INSERT INTO d2 SELECT parent, name, ino FROM dirents ORDER BY parent, name;"
            "DROP TABLE dirents; ALTER TABLE d2 RENAME TO dirents;")

    def close(self) -> Catalog:
        self.db.close()
        return Catalog(self.path)


def _state(root: Path, skips: tuple[Path, ...]) -> dict[str, tuple]:
    """Every entry under ``root`` except ``skips`` and below: type, mode, size, mtime, content digest."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if Path(dirpath, d) not in skips]
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            if Path(p) in skips:
                continue
            st = os.lstat(p)
            digest = codec.chunk_id(Path(p).read_bytes()) if stat.S_ISREG(st.st_mode) else None
            out[p] = (stat.S_IFMT(st.st_mode), st.st_mode, st.st_size, st.st_mtime_ns, digest)
    return out


@pytest.fixture
def sandbox(tmp_path):
    """``(target, check)``: ``check()`` asserts nothing outside ``target`` changed since the fixture ran."""
    target = tmp_path / "box" / "a" / "b" / "target"
    target.mkdir(parents=True)
    (tmp_path / "box" / "victim").write_bytes(b"do not touch\n")
    (tmp_path / "outside").mkdir()
    (tmp_path / "work").mkdir()  # forged catalogs go here
    skips = (target, tmp_path / "work")
    before = _state(tmp_path, skips)

    def check() -> None:
        assert _state(tmp_path, skips) == before, "the restore changed something outside its target"

    return target, check


def _restore(cat: Catalog, repo: Repository, target: Path, read_range=None) -> Restorer:
    r = Restorer(cat, read_range or repo.read_pack_range, os.fsencode(target), workers=2)
    r.run()
    return r


def _good_entries_restored(target: Path, src: Path) -> None:
    base = target / str(src).lstrip("/")
    assert (base / "data.bin").read_bytes() == PAYLOAD
    assert (base / "dir" / "inner.txt").read_bytes() == b"inner\n"


def _escape(src: Path) -> bytes:
    """A relative name that, joined below ``<target>/<src>``, points at the target's parent."""
    return b"../" * (len(src.parts)) + b"escaped"


BAD_NAMES = {
    "dotdot": b"..",
    "dot": b".",
    "empty": b"",
    "slash": b"a/b",
    "escape": None,  # filled in from the source depth
    "absolute": None,
    "nul": b"evil\0name",
    "too-long": b"L" * 256,
}


@pytest.mark.parametrize("kind", ["file", "dir", "symlink"])
@pytest.mark.parametrize("bad", sorted(BAD_NAMES))
def test_bad_names_are_skipped_and_nothing_escapes(base, tmp_path, sandbox, caplog, expect_log, bad, kind):
    repo, cat_path, src = base
    target, check = sandbox
    name = BAD_NAMES[bad]
    if bad == "escape":
        name = _escape(src)
    elif bad == "absolute":
        name = os.fsencode(tmp_path / "outside" / "abs-escaped")
    if name:  # an empty name never even sorts into a listing (nothing to report)
        expect_log(r"skipped entry", logger="ogrefs.repo.catalog")
    f = Forged(cat_path, tmp_path / "work" / "forged.sqlite", src)
    if kind == "file":
        ino = f.data_ino  # a second name for a file with data: the data write must not follow it out
    elif kind == "dir":
        ino = f.add_inode(f.dir_ino)
        f.link(ino, b"planted", f.data_ino)
    else:
        ino = f.add_inode(f.data_ino, mode=stat.S_IFLNK | 0o777, size=4, target=b"/etc")
    f.link(f.src_ino, name, ino)
    f.link(ROOT_INO, name, ino)  # at the top of the tree too
    cat = f.close()
    with caplog.at_level(logging.WARNING, logger="ogrefs.repo.catalog"):
        r = _restore(cat, repo, target)
    check()
    _good_entries_restored(target, src)
    assert not r.failed
    if name:  # an empty name never even sorts into a listing (nothing to report)
        assert (f.src_ino, name) in cat.rejected and (ROOT_INO, name) in cat.rejected
        assert any(repr(name) in s for s in r.skipped)
        assert "skipped entry" in caplog.text
    assert not any(p.name == "planted" for p in target.rglob("*"))


@pytest.mark.expect_log(r"skipped entry", logger="ogrefs.repo.catalog")
def test_duplicate_name_cannot_turn_a_file_into_a_symlink_out(base, tmp_path, sandbox):
    """Two rows for one name (no primary key): a regular file with data, then a symlink to a file outside.

    Without protection the restore creates the file, replaces it by the symlink,
    and then writes the file's data through the symlink into the victim.
    """
    repo, cat_path, src = base
    target, check = sandbox
    victim = tmp_path / "box" / "victim"
    f = Forged(cat_path, tmp_path / "work" / "forged.sqlite", src)
    f.drop_dirent_key()
    link = f.add_inode(f.data_ino, mode=stat.S_IFLNK | 0o777, size=len(os.fsencode(victim)),
                       target=os.fsencode(victim))
    f.link(f.src_ino, b"data.bin", link)  # after the file's own row
    evil_dir = f.add_inode(f.dir_ino)
    f.link(f.src_ino, b"dir", evil_dir)  # a second "dir"
    f.link(evil_dir, b"inner.txt", f.data_ino)
    cat = f.close()
    r = _restore(cat, repo, target)
    check()
    assert victim.read_bytes() == b"do not touch\n"
    _good_entries_restored(target, src)
    assert not os.path.islink(target / str(src).lstrip("/") / "data.bin")
    assert (f.src_ino, b"data.bin") in cat.rejected and (f.src_ino, b"dir") in cat.rejected
    assert len(r.skipped) == 2


@pytest.mark.parametrize("kept", [True, False], ids=["fd-kept", "fd-by-name"])
def test_data_write_never_follows_a_symlink(base, tmp_path, sandbox, monkeypatch, kept):
    """Defence in depth: a restored file's temporary name (where the data goes) swapped for a symlink right
    after it was made, before its data arrives: the victim is never written, the file is reported and not
    put in place — whether the restore kept the file open from its creation (its writes then go to its own
    inode, and the swap is found when the name is put in place) or opens it by name per write (the write
    fails on the link)."""
    import ogrefs.restore as restore_mod
    from ogrefs.localtree import LocalTree

    repo, cat_path, src = base
    target, check = sandbox
    victim = tmp_path / "box" / "victim"
    restored = target / str(src).lstrip("/") / "data.bin"
    size = Catalog(cat_path).resolve(str(src).encode() + b"/data.bin").size
    done = []
    create_open = LocalTree.create_open

    def create_then_swap(self, rel, n, **kw):
        made = create_open(self, rel, n, **kw)
        tmp = Path(os.fsdecode(self.root + rel))
        if n == size and tmp.parent == restored.parent and not done:
            tmp.unlink()
            tmp.symlink_to(victim)
            done.append(tmp)
        return made

    monkeypatch.setattr(LocalTree, "create_open", create_then_swap)
    if not kept:
        monkeypatch.setattr(restore_mod, "fds_to_keep", lambda: 0)
    r = _restore(Catalog(cat_path), repo, target)
    check()
    assert done, "the swap never happened"
    assert victim.read_bytes() == b"do not touch\n"
    reason = r.failed.get(os.fsencode(restored), "")
    assert ("temporary file lost" if kept else "write failed") in reason, reason
    assert not os.path.lexists(restored)


@pytest.mark.expect_log(r"skipped entry", logger="ogrefs.repo.catalog")
@pytest.mark.parametrize("loop", ["self", "ancestor", "root", "hardlinked-dir"])
def test_directory_loops_end(base, tmp_path, sandbox, loop):
    repo, cat_path, src = base
    target, check = sandbox
    f = Forged(cat_path, tmp_path / "work" / "forged.sqlite", src)
    to = {"self": f.dir_ino, "ancestor": f.src_ino, "root": ROOT_INO, "hardlinked-dir": f.dir_ino}[loop]
    where = f.src_ino if loop == "hardlinked-dir" else f.dir_ino
    f.link(where, b"zz-loop", to)
    cat = f.close()
    r = _restore(cat, repo, target)
    check()
    _good_entries_restored(target, src)
    assert (where, b"zz-loop") in cat.rejected and len(r.skipped) == 1
    assert not any(p.name == "zz-loop" for p in target.rglob("*"))


def test_escaping_roots_are_not_used(base, tmp_path, sandbox):
    """``roots`` is informational: absolute, relative or escaping paths in it change nothing."""
    repo, cat_path, src = base
    target, check = sandbox
    f = Forged(cat_path, tmp_path / "work" / "forged.sqlite", src)
    for p in (b"/../../../outside", b"../../outside", b"relative", b"/etc/passwd", b"\0"):
        f.db.execute("INSERT INTO roots VALUES (?)", (p,))
    cat = f.close()
    r = _restore(cat, repo, target)
    check()
    _good_entries_restored(target, src)
    assert not r.failed and not r.skipped


def test_restore_over_planted_symlinks_replaces_them(base, tmp_path, sandbox):
    """A target that already holds symlinks where directories and files go: they are replaced, not followed."""
    repo, cat_path, src = base
    target, check = sandbox
    base_dir = target / str(src).lstrip("/")
    base_dir.mkdir(parents=True)
    os.symlink(tmp_path / "outside", base_dir / "dir")
    os.symlink(tmp_path / "box" / "victim", base_dir / "data.bin")
    r = _restore(Catalog(cat_path), repo, target)
    check()
    _good_entries_restored(target, src)
    assert not os.path.islink(base_dir / "dir") and not os.path.islink(base_dir / "data.bin")
    assert not r.failed and os.listdir(tmp_path / "outside") == []


# -- the mount's view: the vfs never serves such names -------------------------------------------------

def _forged_with_everything(base, tmp_path) -> tuple[Catalog, Forged]:
    repo, cat_path, src = base
    (tmp_path / "work").mkdir(exist_ok=True)
    f = Forged(cat_path, tmp_path / "work" / "forged.sqlite", src)
    for name in (b"..", b".", b"a/b", b"evil\0name", _escape(src), b"L" * 256):
        f.link(f.src_ino, name, f.data_ino)
    f.link(f.dir_ino, b"zz-loop", f.src_ino)
    return f.close(), f


@pytest.mark.expect_log(r"skipped entry", logger="ogrefs.repo.catalog")
def test_vfs_does_not_list_or_look_up_bad_names(base, tmp_path):
    repo, _, src = base
    cat, f = _forged_with_everything(base, tmp_path)

    async def body(fs: SnapshotFS) -> None:
        fh = await fs.opendir(f.src_ino)
        names: list[bytes] = []
        await fs.readdir(fh, 0, lambda name, attr, nxt: names.append(name) or True)
        fs.releasedir(fh)
        assert names == [b"data.bin", b"dir"]
        for bad in (b"a/b", b"evil\0name", _escape(src), b"L" * 256):
            with pytest.raises(FsError) as e:
                await fs.lookup(f.src_ino, bad)
            assert e.value.errno == errno.ENOENT
        # ".." is the real parent, never the planted entry
        up = await fs.lookup(f.src_ino, b"..")
        assert up.node.ino != f.data_ino
        # the loop entry is listed by readdir (the kernel refuses a second alias of a directory itself);
        # what matters is that a walk of the tree ends, which Catalog.walk guarantees
        fh = await fs.opendir(f.dir_ino)
        inner: list[bytes] = []
        await fs.readdir(fh, 0, lambda name, attr, nxt: inner.append(name) or True)
        fs.releasedir(fh)
        assert b"inner.txt" in inner

    fetcher = Fetcher(repo.read_pack_range, None)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(fetcher.run)
            await body(SnapshotFS(cat, fetcher))
            nursery.cancel_scope.cancel()

    trio.run(main)
    paths = [path for path, _ in cat.walk()]  # ends, despite the loop
    assert len(paths) == len(set(paths)) == len(src.parts) + 2
    assert all(valid for p in paths for valid in [all(part and part not in (b".", b"..") and len(part) < 256
                                                      for part in p.split(b"/")[1:])])


@pytest.mark.fuse
@pytest.mark.skipif(not os.path.exists("/dev/fuse") or os.geteuid() != 0, reason="needs /dev/fuse and root")
def test_real_mount_of_a_forged_snapshot_stays_inside(base, tmp_path):
    """The forged catalog stored as a snapshot of its own, mounted through the CLI."""
    _, _, src = base
    repo = Repository.init(f"file://{tmp_path}/repo", cache_root=tmp_path / "xdg")
    m = take_snapshot(repo, SnapshotOptions(paths=[os.fsencode(src)], no_parent=True))
    cat, _ = _forged_with_everything((repo, repo.catalog_path(m["id"]), src), tmp_path)
    forged_id = secrets.token_hex(32)
    db = sqlite3.connect(cat.path)
    db.execute("UPDATE meta SET value=? WHERE key='snapshot_id'", (forged_id,))
    db.commit()
    db.close()
    repo.put_catalog(forged_id, cat.path)
    repo.put_manifest({**repo.load_manifest(m["id"]), "id": forged_id})
    mp = tmp_path / "mnt"
    mp.mkdir()
    env = dict(os.environ, OGREFS_RUNTIME_DIR=str(tmp_path / "run"), OGREFS_CACHE_DIR=str(tmp_path / "xdg2"))
    cmd = [sys.executable, "-m", "ogrefs", "--repo", repo.store.url]
    res = subprocess.run([*cmd, "mount", forged_id, str(mp), "--read-only"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    try:
        inside = mp / str(src).lstrip("/")
        assert sorted(os.listdir(inside)) == ["data.bin", "dir"]
        assert (inside / "data.bin").read_bytes() == PAYLOAD
        assert (inside / "dir" / "inner.txt").read_bytes() == b"inner\n"
        # everything reachable by walking the mount stays below it and the walk ends
        seen = [os.path.realpath(os.path.join(d, n)) for d, ds, fs in os.walk(mp) for n in ds + fs]
        assert seen and all(p.startswith(str(mp) + "/") for p in seen)
    finally:
        res = subprocess.run([*cmd, "unmount", str(mp)], env=env, capture_output=True, text=True, timeout=60)
        if res.returncode != 0:
            subprocess.run(["umount", "-l", str(mp)], capture_output=True)


@pytest.mark.expect_log(r"skipped entry", logger="ogrefs.repo.catalog")
def test_check_read_data_reports_entries_restore_would_refuse(base, tmp_path):
    """A forged catalog stored as a snapshot: ``check --read-data`` names each entry restore would skip."""
    from ogrefs.maint.check import check_repository

    _, _, src = base
    repo = Repository.init(f"memory://paths-check-{secrets.token_hex(4)}", cache_root=tmp_path / "xdg")
    m = take_snapshot(repo, SnapshotOptions(paths=[os.fsencode(src)], no_parent=True))
    assert check_repository(repo, read_data=True).problems == []
    cat, f = _forged_with_everything((repo, repo.catalog_path(m["id"]), src), tmp_path)
    forged_id = secrets.token_hex(32)
    repo.put_catalog(forged_id, cat.path)
    repo.put_manifest({**repo.load_manifest(m["id"]), "id": forged_id})
    problems = check_repository(repo, read_data=True).problems
    assert any("b'..'" in p and forged_id[:12] in p for p in problems)
    assert any("zz-loop" in p and "second time" in p for p in problems)
    assert not any(m["id"][:12] in p for p in problems)  # the genuine snapshot is fine


@pytest.mark.parametrize("bad", ["dotdot", "escape", "slash", "absolute"])
def test_the_no_fuse_mount_skips_bad_names_writes_nothing_outside_and_says_so(base, tmp_path, sandbox, caplog,
                                                                             expect_log, bad):
    """The write-in-place engine (issue 48) over a forged catalog: what restore promises, and not finished."""
    from ogrefs.box.copyplan import Plan
    from ogrefs.inplace.engine import InPlace, Order

    repo, cat_path, src = base
    target, check = sandbox
    name = {"escape": _escape(src), "absolute": os.fsencode(tmp_path / "outside" / "abs-escaped")}.get(
        bad, BAD_NAMES[bad])
    expect_log(r"skipped entry", logger="ogrefs.repo.catalog")
    f = Forged(cat_path, tmp_path / "work" / "forged.sqlite", src)
    planted = f.add_inode(f.dir_ino)
    f.link(planted, b"planted", f.data_ino)
    f.link(f.src_ino, name, planted)
    cat = f.close()
    plan = Plan(tmp_path / "work" / "plan.sqlite")
    engine = InPlace(cat, repo.read_pack_range, os.fsencode(target), plan, snapshot_id="forged",
                     skip=lambda *a: False, workers=2)
    with caplog.at_level(logging.WARNING, logger="ogrefs.repo.catalog"):
        engine.prepare(Order())
        engine.run()
    check()
    _good_entries_restored(target, src)
    assert not any(p.name == "planted" for p in target.rglob("*"))
    assert any(repr(name) in s for s in engine.status()["skipped"]) and plan.meta("finished") is None
