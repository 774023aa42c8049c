"""Fetch errors end one read, never the mount (issue 15's two bugs, on real FUSE mounts).

* A forged location in a *sibling's* chunk list (the small neighbours a first
  open in a directory prefetches) used to escape the fetcher and end the mount
  daemon; now that file's reads are EIO and everything else is still served.
* A cache directory whose path holds ``#``, ``?`` or ``%`` could not be mounted
  (an unquoted SQLite URI); now it mounts.
"""

from __future__ import annotations

import errno
import os
import secrets
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from ogrefs.box.mountsys import mounted_fstype
from ogrefs.repo import Repository
from ogrefs.repo.catalog import Catalog
from ogrefs.snapshot.pipeline import SnapshotOptions, take_snapshot

pytestmark = [
    pytest.mark.fuse,
    pytest.mark.timeout(120),
    pytest.mark.skipif(not os.path.exists("/dev/fuse") or os.geteuid() != 0, reason="needs /dev/fuse and root"),
]


def _cli(env: dict[str, str], url: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run([sys.executable, "-m", "ogrefs", "--repo", url, *args], env=env, capture_output=True,
                         text=True, timeout=60, stdin=subprocess.DEVNULL)
    if check:
        assert res.returncode == 0, f"ogrefs {' '.join(args)}: {res.stderr}"
    return res


class _Mount:
    """One read-only mount through the CLI, always unmounted (lazily if it has to be)."""

    def __init__(self, tmp: Path, url: str, cache_root: Path) -> None:
        self.url = url
        self.env = dict(os.environ, OGREFS_RUNTIME_DIR=str(tmp / "run"), OGREFS_CACHE_DIR=str(cache_root))
        self.mp = tmp / "mnt"
        self.mp.mkdir()

    def mount(self, snap: str, *opts: str) -> Path:
        _cli(self.env, self.url, "mount", snap, str(self.mp), "--read-only", *opts)
        assert mounted_fstype(self.mp) == "fuse.ogrefs"
        return self.mp

    def close(self) -> None:
        if mounted_fstype(self.mp) is not None and _cli(self.env, self.url, "unmount", str(self.mp),
                                                       check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(self.mp)], capture_output=True, timeout=30)


def _small_dir(tmp: Path) -> Path:
    src = tmp / "src"
    (src / "dir").mkdir(parents=True)
    for name in ("a.txt", "b.txt", "c.txt"):
        (src / "dir" / name).write_bytes(name.encode() * 300)
    (src / "other.txt").write_bytes(b"other\n" * 100)
    return src


def _store_forged(repo: Repository, snap: dict, src: Path, tmp: Path, column: str, value: object) -> str:
    """A copy of ``snap``'s catalog in which b.txt's blob has ``column`` set to ``value``, stored as a snapshot."""
    cat = Catalog(repo.catalog_path(snap["id"]))
    victim = cat.resolve(os.fsencode(src / "dir" / "b.txt")).ino
    path = tmp / "forged.sqlite"
    path.write_bytes(repo.catalog_path(snap["id"]).read_bytes())
    forged_id = secrets.token_hex(32)
    db = sqlite3.connect(path)
    if column == "pack":  # a pack row of its own, so that the other files keep their pack
        db.execute("INSERT INTO packs (id, name) VALUES (999, ?)", (value,))
        value = 999
    db.execute(f"UPDATE blobs SET {column}=? WHERE id=(SELECT blob FROM extents WHERE ino=?)", (value, victim))
    db.execute("UPDATE meta SET value=? WHERE key='snapshot_id'", (forged_id,))
    db.commit()
    db.close()
    repo.put_catalog(forged_id, path)
    repo.put_manifest({**repo.load_manifest(snap["id"]), "id": forged_id})
    return forged_id


@pytest.mark.parametrize("column, value", [
    ("pack", "../../../../etc/passwd"),  # a key no store accepts
    ("pack", "zz"),  # a name that is not a pack name
    ("offset", "x"),  # text where a number belongs (SQLite does not enforce column types)
    ("stored_len", -1),
], ids=["pack-escape", "pack-short", "offset-text", "negative-length"])
def test_a_forged_sibling_location_fails_its_file_and_the_mount_lives(tmp_path, column, value):
    src = _small_dir(tmp_path)
    repo = Repository.init(f"file://{tmp_path}/repo", cache_root=tmp_path / "xdg")
    snap = take_snapshot(repo, SnapshotOptions(paths=[os.fsencode(src)], no_parent=True))
    forged = _store_forged(repo, snap, src, tmp_path, column, value)
    m = _Mount(tmp_path, repo.store.url, tmp_path / "xdg2")
    try:
        inside = m.mount(forged, "--no-materialize") / str(src).lstrip("/")
        # the first small file opened in dir/ prefetches its siblings, b.txt's forged location among them
        assert (inside / "dir" / "a.txt").read_bytes() == b"a.txt" * 300
        with pytest.raises(OSError) as e:
            (inside / "dir" / "b.txt").read_bytes()
        assert e.value.errno == errno.EIO
        # the daemon lives on: other files, listings and a fresh read all work
        assert (inside / "dir" / "c.txt").read_bytes() == b"c.txt" * 300
        assert (inside / "other.txt").read_bytes() == b"other\n" * 100
        assert sorted(os.listdir(inside / "dir")) == ["a.txt", "b.txt", "c.txt"]
        assert mounted_fstype(m.mp) == "fuse.ogrefs"
    finally:
        m.close()


@pytest.mark.parametrize("name", ["cache#1", "cache?x=1", "cache%41"])
def test_a_cache_directory_with_uri_characters_mounts(tmp_path, name):
    src = _small_dir(tmp_path)
    repo = Repository.init(f"file://{tmp_path}/repo", cache_root=tmp_path / "xdg")
    snap = take_snapshot(repo, SnapshotOptions(paths=[os.fsencode(src)], no_parent=True))
    m = _Mount(tmp_path, repo.store.url, tmp_path / name)  # the catalog and the mount's state go there
    try:
        inside = m.mount(snap["id"], "--cache-dir", str(tmp_path / name / "chunks")) / str(src).lstrip("/")
        assert (inside / "dir" / "b.txt").read_bytes() == b"b.txt" * 300
        assert (inside / "other.txt").read_bytes() == b"other\n" * 100
    finally:
        m.close()
