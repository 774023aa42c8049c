"""A snapshot from a mount takes what nothing changed from the mounted catalog, not through the mount (tier 5).

snapshot/untouched.py: a directory with no counterpart in the overlay's upper
directory holds exactly the mounted snapshot's entries, so the snapshot lists
it, stats it and reads its xattrs from the catalog.  The honest counter is
the mount's own: the daemon's status counts the FUSE requests it answered
(``lookups``, ``getattrs``, ``dir_opens``, ``xattr_lists``).  Boxes are private
mount namespaces with a fresh tmpfs at ``/srv`` (see test_loop.py).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from ogrefs.repo import Repository
from ogrefs.repo.catalog import Catalog
from tests.system.test_loop import BOX, OGREFS, PY, _fresh_status, box, loop  # noqa: F401  (loop: fixture)
from tests.system.test_loop import pytestmark  # noqa: F401  (fuse, unshare, /srv)
from tests.treegen import compare_trees

DIRS, FILES = 12, 6  # the untouched subtree: big/d<i>/f<j> (+ a symlink, xattrs, an excluded file)

MAKE_A = f'''
import os
box = {BOX!r}
for i in range(DIRS):
    d = f"{{box}}/big/d{{i}}"
    os.makedirs(d)
    for j in range(FILES):
        with open(f"{{d}}/f{{j}}.txt", "w") as fh:
            fh.write(f"file {{i}} {{j}}\\n" * (i * 50 + j))
    os.chmod(f"{{d}}/f0.txt", 0o640)
    os.setxattr(f"{{d}}/f1.txt", "user.tag", f"tag {{i}}".encode())
os.setxattr(f"{{box}}/big/d2", "user.dirtag", b"d")
os.symlink("d0/f1.txt", f"{{box}}/big/link")
os.makedirs(f"{{box}}/big/d3/mnt")
with open(f"{{box}}/big/d4/cache.skip", "w") as fh:
    fh.write("excluded")
os.makedirs(f"{{box}}/work/olddir/deep")
for name in ("keep", "mod", "del", "chmod", "xattr"):
    with open(f"{{box}}/work/{{name}}.txt", "w") as fh:
        fh.write(name + "\\n")
with open(f"{{box}}/work/olddir/deep/x.txt", "w") as fh:
    fh.write("moved with its directory\\n")
os.makedirs(f"{{box}}/links")
with open(f"{{box}}/links/h1", "w") as fh:
    fh.write("one inode, two names\\n")
os.link(f"{{box}}/links/h1", f"{{box}}/links/h2")
'''.replace("DIRS", str(DIRS)).replace("FILES", str(FILES))

CHANGE_ON_B = f"""
    echo new > {BOX}/work/new.txt
    echo modified >> {BOX}/work/mod.txt
    rm {BOX}/work/del.txt
    chmod 0600 {BOX}/work/chmod.txt
    {PY} -c 'import os; os.setxattr("{BOX}/work/xattr.txt", "user.set", b"on b")'
    mkdir {BOX}/work/newdir && echo inside > {BOX}/work/newdir/n.txt
    mv {BOX}/work/olddir {BOX}/work/renamed
    mount -t tmpfs submount {BOX}/big/d3/mnt && echo "another fs" > {BOX}/big/d3/mnt/t.txt
"""


def _describe(cat: Catalog, below: bytes) -> dict[bytes, tuple]:
    """Names, modes, owners, sizes, times, targets, xattrs and chunk lists of everything below ``below``."""
    node = cat.resolve(below)
    assert node is not None and node.is_dir
    return {p: (n.mode, n.uid, n.gid, n.size if not n.is_dir else None, n.mtime_ns, n.target,
                tuple(cat.xattrs(n.ino)), tuple(e[2] for e in cat.located_extents(n.ino)) if n.is_reg else None)
            for p, n in cat.walk(node.ino)}


def _counters(tmp: Path, name: str) -> dict[str, int]:
    st = json.loads((tmp / name).read_text())
    return {k: st[k] for k in ("lookups", "getattrs", "dir_opens", "xattr_lists", "bytes_fetched")}


def snapshot_box_a(loop, script: str) -> dict:
    """Box A: ``script`` (Python) builds it, then A's snapshot of BOX; its manifest."""
    tmp = loop["tmp"]
    (tmp / "make_a.py").write_text(script)
    box(loop, f"""
        {PY} {tmp}/make_a.py
        {OGREFS} -q snapshot {BOX} --json > {tmp}/a.json
    """)
    return json.loads((tmp / "a.json").read_text())


@pytest.mark.parametrize("store_url", ["file"], indirect=True)
@pytest.mark.parametrize("metacopy", [False, True], ids=["copy-up", "metacopy"])
def test_untouched_subtrees_come_from_the_catalog_and_changes_are_all_caught(loop, metacopy):
    """metacopy=on implies redirect_dir=on: the renamed directory is then a redirect to the lower's."""
    tmp = loop["tmp"]
    if metacopy:
        loop["env"]["OGREFS_METACOPY"] = "1"
    a = snapshot_box_a(loop, MAKE_A)
    box(loop, f"""
        {OGREFS} -q mount --no-materialize {a["id"]} /
        {OGREFS} status / --wait --json > /dev/null   # the mount's prefetch has ended: counters are still
        grep " {BOX} " /proc/self/mountinfo > {tmp}/mountinfo
        {CHANGE_ON_B}
        {PY} -c 'import glob, os; (d,) = glob.glob("{tmp}/state/*/upper/*/work/renamed"); print(os.listxattr(d))' \
            > {tmp}/renamed.xattrs
        {_fresh_status(tmp / "before.json")}
        {OGREFS} -q snapshot --one-file-system --exclude '*.skip' {BOX}/big --json > {tmp}/big.json
        {_fresh_status(tmp / "after.json")}
        {OGREFS} -q snapshot --one-file-system --exclude '*.skip' {BOX} --json > {tmp}/b.json
        cp -a {BOX} {tmp}/b-view                  # what B saw (reads it all: after the snapshots)
        umount {BOX}/big/d3/mnt
        {OGREFS} unmount /
    """)
    assert ("metacopy=on" in (tmp / "mountinfo").read_text()) == metacopy
    big, b = json.loads((tmp / "big.json").read_text()), json.loads((tmp / "b.json").read_text())
    entries = DIRS * (FILES + 1) + 2  # files and directories of big/, its symlink and d3/mnt
    assert big["totals"]["mount_reused_files"] == DIRS * FILES and big["totals"]["read_bytes"] == 0, big["totals"]

    # (1) the untouched subtree sent nothing through the mount but for its root (a lookup, a getattr, its
    # xattrs, and the CLI's check that not everything below it is excluded): far fewer than its entries
    before, after = _counters(tmp, "before.json"), _counters(tmp, "after.json")
    sent = {k: after[k] - before[k] for k in before}
    assert sent["dir_opens"] <= 1 and sent["xattr_lists"] <= 1 and sent["bytes_fetched"] == 0, sent
    assert sent["lookups"] + sent["getattrs"] <= 8 < entries, sent
    # ... and its catalog is the mounted one's (what a walk through the mount shows), less the excluded file
    # and the submount's contents
    repo = Repository.open(loop["env"]["OGREFS_REPO"], cache_root=tmp / "cache-test")
    cat_a, cat_big = Catalog(repo.catalog_path(a["id"])), Catalog(repo.catalog_path(big["id"]))
    want = _describe(cat_a, f"{BOX}/big".encode())
    del want[b"/d4/cache.skip"]
    got = _describe(cat_big, f"{BOX}/big".encode())
    mnt = got.pop(b"/d3/mnt")
    want_mnt = want.pop(b"/d3/mnt")
    assert got == want
    # the submount's own root as the walk sees it (tmpfs: 1777), not the catalog's directory below it
    assert mnt[0] == 0o041777 != want_mnt[0] and cat_big.resolve(f"{BOX}/big/d3/mnt/t.txt".encode()) is None

    # (3) the submount inside the untouched d3 is listed, in both snapshots
    for m in (big, b):
        assert [s["path"] for s in m["skipped_mounts"]] == [f"{BOX}/big/d3/mnt"], m["skipped_mounts"]
    # (4) excludes apply to entries taken from the catalog
    assert cat_big.resolve(f"{BOX}/big/d4/cache.skip".encode()) is None

    # (2) every change in upper is caught: the whole box restores to exactly what B saw
    t = b["totals"]
    assert t["mount_reused_files"] >= DIRS * FILES + 2 and t["files"] == DIRS * FILES + 8, t  # + 7 in work/, the hard link pair once
    subprocess.run([PY, "-m", "ogrefs", "-q", "restore", b["id"], str(tmp / "restored")], env=loop["env"],
                   check=True, timeout=120)
    os.unlink(tmp / "b-view/big/d3/mnt/t.txt")  # cp -a went into the submount; the snapshot did not
    os.unlink(tmp / "b-view/big/d4/cache.skip")
    diffs = compare_trees(tmp / "b-view", Path(f"{tmp}/restored{BOX}"))
    # b-view's d3/mnt and d4 were just changed by the unlinks: their mtime only
    assert [d for d in diffs if not d.startswith(("differs b'big/d3/mnt'", "differs b'big/d4'"))] == [], diffs
    assert ("trusted.overlay.redirect" in (tmp / "renamed.xattrs").read_text()) == metacopy
    restored = Path(f"{tmp}/restored{BOX}")
    assert (restored / "work/new.txt").read_text() == "new\n" and not (restored / "work/del.txt").exists()
    assert (restored / "work/renamed/deep/x.txt").exists() and not (restored / "work/olddir").exists()
    assert os.getxattr(restored / "work/xattr.txt", "user.set") == b"on b"
    assert os.lstat(restored / "work/chmod.txt").st_mode & 0o777 == 0o600
    assert os.getxattr(restored / "big/d2", "user.dirtag") == b"d"
    h1, h2 = os.lstat(restored / "links/h1"), os.lstat(restored / "links/h2")
    assert h1.st_ino == h2.st_ino  # a hard link pair in an untouched directory stays one inode
