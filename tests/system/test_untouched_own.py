"""A resumed box whose own directory lies below the snapshot: untouched directories come from the catalog and
the own layer, read directly, not walked through the mount (tier 5).

On a real resumed box the overlay's lowest layer is the box's own directory (``keep_existing``:
``lowerdir=<state>/lower<path>:<path>``), so the merged view is the union of the catalog and that
directory.  The keeper holds a descriptor of the own directory (overlay.mount_one ``hold_own``);
snapshot/mounted.py proves it is the overlay's lowest layer and snapshot/untouched.py merges the two
as overlayfs does.  The honest counter is the FUSE daemon's (``dir_opens``, ``xattr_lists``,
``lookups``, ``getattrs``); the truth is the merged view itself (``cp -a`` of what B sees), compared
with a restore of B's snapshot.  Boxes are private mount namespaces with a fresh tmpfs at ``/srv``.
The mount is ``--merge``d: a snapshot of a data path at ``/`` hides this box's own entries below it otherwise
(issue 47's exact directories; their overlays carry a mask layer, which snapshot/mounted.py does not take for
the two-layer union and walks through the mount instead: correct, without this fast path).
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from ogrefs.repo import Repository
from ogrefs.repo.catalog import Catalog
from tests.system.test_loop import BOX, OGREFS, PY, _fresh_status, box, loop  # noqa: F401  (loop: fixture)
from tests.system.test_loop import pytestmark  # noqa: F401  (fuse, unshare, /srv)
from tests.system.test_untouched import _counters, _describe, snapshot_box_a
from tests.treegen import compare_trees

DIRS, FILES = 10, 5  # big/d<i>/f<j>: the catalog's untouched directories

#: Both box scripts start so: ``write(path, text)`` makes the parents.
SCRIPT_HEAD = f'''
import os
box = {BOX!r}
def write(p, text):
    os.makedirs(os.path.dirname(p), exist_ok=True)
    with open(p, "w") as fh:
        fh.write(text)
'''

# Box A: what the snapshot holds.
MAKE_A = SCRIPT_HEAD + f'''for i in range({DIRS}):
    for j in range({FILES}):
        write(f"{{box}}/big/d{{i}}/f{{j}}.txt", f"file {{i}} {{j}}\\n" * (i * 40 + j))
    os.setxattr(f"{{box}}/big/d{{i}}/f1.txt", "user.tag", f"tag {{i}}".encode())
os.setxattr(f"{{box}}/big/d2", "user.dirtag", b"d")
write(f"{{box}}/big/shared/a.txt", "a from the snapshot\\n")
write(f"{{box}}/big/shared/both.txt", "both: the snapshot's\\n")
write(f"{{box}}/big/shared/sub/x.txt", "x from the snapshot\\n")
write(f"{{box}}/big/conf", "a file over the box's own directory\\n")
write(f"{{box}}/big/cdir/c.txt", "a directory over the box's own file\\n")
write(f"{{box}}/big/lib64/cat.so", "the snapshot's lib64 (the box has a symlink there)\\n")
write(f"{{box}}/big/d3/mnt/catfile.txt", "hidden by a mount made on B\\n")
write(f"{{box}}/big/d5/.nobackup", "")  # --exclude-if-present: a marker the catalog has
write(f"{{box}}/work/keep.txt", "keep\\n")
write(f"{{box}}/work/mod.txt", "mod\\n")
write(f"{{box}}/work/del.txt", "del\\n")
write(f"{{box}}/odd/wh/k.txt", "next to a whiteout in the snapshot\\n")
os.mknod(f"{{box}}/odd/wh/gone", 0o600 | 0o020000, os.makedev(0, 0))  # an overlay whiteout, as data
write(f"{{box}}/odd/ow/m.txt", "the snapshot's, next to the box's own whiteout\\n")
write(f"{{box}}/odd/sonly/s.txt", "a directory only the snapshot has\\n")
os.mknod(f"{{box}}/odd/sonly/wo", 0o600 | 0o020000, os.makedev(0, 0))  # a whiteout in the lowest layer there
'''

# Box B, before the mount: its own content at the target (the lowest layer).
MAKE_OWN = SCRIPT_HEAD + f'''write(f"{{box}}/big/d0/own.txt", "the box's own, in a merged directory\\n")
write(f"{{box}}/big/d7/.nobackup", "")  # --exclude-if-present: a marker the own layer has
write(f"{{box}}/big/shared/own.txt", "own\\n")
write(f"{{box}}/big/shared/both.txt", "both: the box's own, longer, hidden by the snapshot's\\n")
write(f"{{box}}/big/shared/sub/y.txt", "y, the box's own\\n")
write(f"{{box}}/big/shared/ownsub/deep/z.txt", "an own-only subtree\\n")
write(f"{{box}}/big/conf/inner.txt", "hidden below the snapshot's file\\n")
write(f"{{box}}/big/cdir", "hidden below the snapshot's directory\\n")
write(f"{{box}}/big/lib/ownlib.so", "the box's own lib\\n")
os.symlink("lib", f"{{box}}/big/lib64")  # not a directory: the snapshot's lib64 is not merged with lib
write(f"{{box}}/big/ownonly/deep/f.txt", "own only\\n")
os.setxattr(f"{{box}}/big/ownonly/deep/f.txt", "user.own", b"yes")
write(f"{{box}}/work/own-work.txt", "own\\n")
write(f"{{box}}/ownhome/deep/f.txt", "an own-only directory B writes in\\n")
write(f"{{box}}/odd/wh/gone", "hidden by the snapshot's whiteout\\n")
write(f"{{box}}/odd/wh/mine.txt", "mine\\n")
write(f"{{box}}/odd/ow/n.txt", "n\\n")
os.mknod(f"{{box}}/odd/ow/wo", 0o600 | 0o020000, os.makedev(0, 0))  # a whiteout in the box's own layer
'''

CHANGE_ON_B = f"""
    echo new > {BOX}/work/new.txt
    echo modified >> {BOX}/work/mod.txt
    rm {BOX}/work/del.txt
    echo added > {BOX}/ownhome/deep/added.txt
    mount -t tmpfs submount {BOX}/big/d3/mnt && echo "another fs" > {BOX}/big/d3/mnt/t.txt
"""

#: Names only in the own layer inside big/'s merged directories: each costs one negative FUSE lookup.
OWN_ONLY_NAMES = 6  # d0/own.txt, shared/own.txt, shared/ownsub, shared/sub/y.txt, lib, ownonly


def _run(loop, tamper: str = "") -> dict:
    """A, then B with its own content below the snapshot; B's snapshots (``tamper``: done before the last)."""
    tmp = loop["tmp"]
    a = snapshot_box_a(loop, MAKE_A)
    (tmp / "make_own.py").write_text(MAKE_OWN)
    box(loop, f"""
        {PY} {tmp}/make_own.py
        {OGREFS} -q mount --merge --no-materialize {a["id"]} /
        {OGREFS} status / --wait --json > /dev/null   # the mount's prefetch has ended: counters are still
        grep " {BOX} " /proc/self/mountinfo > {tmp}/mountinfo
        {CHANGE_ON_B}
        {_fresh_status(tmp / "before.json")}
        {OGREFS} -q snapshot --exclude-if-present .nobackup {BOX}/big --json > {tmp}/big.json
        {_fresh_status(tmp / "after.json")}
        {OGREFS} -q snapshot {BOX} --json > {tmp}/b.json
        {tamper}
        {_fresh_status(tmp / "before2.json")}
        {OGREFS} -q snapshot --exclude-if-present .nobackup {BOX}/big --json > {tmp}/big2.json
        {_fresh_status(tmp / "after2.json")}
        # what B saw (reads it all: after the snapshots); the kernel lists odd/sonly/wo but cannot stat it
        cp -a {BOX} {tmp}/b-view 2> {tmp}/cp.err || true
        umount {BOX}/big/d3/mnt
        {OGREFS} unmount /
    """)
    return {n: json.loads((tmp / f"{n}.json").read_text()) for n in ("a", "big", "b", "big2")}


def _sent(tmp: Path, before: str, after: str) -> dict[str, int]:
    b, a = _counters(tmp, before), _counters(tmp, after)
    return {k: a[k] - b[k] for k in b}


def _restored_equals_b_view(loop, snap: dict, name: str) -> None:
    """A restore of ``snap`` is B's view, plus the lowest-layer whiteout the snapshot kept (B cannot stat it)."""
    tmp = loop["tmp"]
    subprocess.run([PY, "-m", "ogrefs", "-q", "restore", snap["id"], str(tmp / name)], env=loop["env"],
                   check=True, timeout=120)
    assert [ln for ln in (tmp / "cp.err").read_text().splitlines() if ln.strip()] == [
        f"cp: cannot stat '{BOX}/odd/sonly/wo': No such file or directory"]
    kept = Path(f"{tmp}/{name}{BOX}/odd/sonly/wo")
    st = os.lstat(kept)
    assert stat.S_ISCHR(st.st_mode) and st.st_rdev == 0  # A's whiteout, carried through B's snapshot
    parent = os.lstat(kept.parent)
    kept.unlink()
    os.utime(kept.parent, ns=(parent.st_atime_ns, parent.st_mtime_ns))
    assert compare_trees(tmp / "b-view", Path(f"{tmp}/{name}{BOX}")) == []


@pytest.mark.parametrize("store_url", ["file"], indirect=True)
def test_untouched_merged_directories_come_from_catalog_and_own_layer(loop):
    tmp = loop["tmp"]
    snaps = _run(loop)
    assert f"lowerdir={tmp}/state/" in (tmp / "mountinfo").read_text()
    assert f"/lower{BOX}:{BOX}," in (tmp / "mountinfo").read_text()  # the box's own directory is lowest
    big, b = snaps["big"], snaps["b"]
    for m in (big, b, snaps["big2"]):
        assert m["unreadable"] == [], m["unreadable"]  # no own symlink or whiteout taken for a real entry

    # (1) the untouched merged directories sent nothing through the mount but one negative lookup per
    # own-only name, the root's own lookup, getattr and xattrs, and the CLI's look at the root (a merged
    # directory: overlayfs opens its top layer, then reads each layer: two FUSE opendirs); not even
    # --exclude-if-present's question whether each entry holds a marker
    entries = DIRS * (FILES + 1) + 12
    sent = _sent(tmp, "before.json", "after.json")
    assert sent["dir_opens"] <= 2 and sent["xattr_lists"] <= 1 and sent["bytes_fetched"] == 0, sent
    assert sent["lookups"] + sent["getattrs"] <= 8 + OWN_ONLY_NAMES < entries, sent
    assert big["totals"]["mount_reused_files"] >= (DIRS - 2) * FILES and big["totals"]["read_bytes"] > 0, big["totals"]

    # (2) the whole box restores to exactly what B saw: the union, the snapshot's entry where both have one,
    # the symlink's lib64 not merged, whiteouts hiding what they hide, the submount's own files
    _restored_equals_b_view(loop, b, "restored")
    restored = Path(f"{tmp}/restored{BOX}")
    assert (restored / "big/shared/both.txt").read_text() == "both: the snapshot's\n"
    assert sorted(os.listdir(restored / "big/lib64")) == ["cat.so"]
    assert (restored / "big/conf").is_file() and (restored / "big/cdir/c.txt").exists()
    assert sorted(os.listdir(restored / "odd/wh")) == ["k.txt", "mine.txt"]
    assert sorted(os.listdir(restored / "big/d3/mnt")) == ["t.txt"]
    assert (restored / "ownhome/deep/added.txt").read_text() == "added\n"
    assert os.getxattr(restored / "big/ownonly/deep/f.txt", "user.own") == b"yes"
    assert not (restored / "work/del.txt").exists() and (restored / "work/new.txt").exists()

    # (3) the second snapshot of big/ is the same catalog as the first (nothing moved in between)
    repo = Repository.open(loop["env"]["OGREFS_REPO"], cache_root=tmp / "cache-test")
    one, two = (_describe(Catalog(repo.catalog_path(m["id"])), f"{BOX}/big".encode()) for m in (big, snaps["big2"]))
    assert one == two
    cat_big = Catalog(repo.catalog_path(big["id"]))
    assert cat_big.resolve(f"{BOX}/big/d5".encode()) is None and cat_big.resolve(f"{BOX}/big/d7".encode()) is None
    assert cat_big.resolve(f"{BOX}/big/d6/f0.txt".encode()) is not None


@pytest.mark.parametrize("store_url", ["file"], indirect=True)
def test_an_own_descriptor_that_is_not_the_recorded_directory_walks_through_the_mount(loop):
    """overlays.json's own_ino changed: the proof fails, the walk goes through the mount, and is still right."""
    tmp = loop["tmp"]
    tamper = f"""{PY} - <<'PY'
import glob, json
(p,) = glob.glob("{tmp}/state/*/overlays.json")
rows = json.load(open(p))
assert any(r["own_fd"] is not None for r in rows), rows
for r in rows:
    if r["own_ino"] is not None:
        r["own_ino"] += 1
json.dump(rows, open(p, "w"))
PY"""
    snaps = _run(loop, tamper)
    fast, slow = _sent(tmp, "before.json", "after.json"), _sent(tmp, "before2.json", "after2.json")
    assert fast["dir_opens"] <= 2 < DIRS <= slow["dir_opens"], (fast, slow)  # through the mount this time
    repo = Repository.open(loop["env"]["OGREFS_REPO"], cache_root=tmp / "cache-test")
    one, two = (_describe(Catalog(repo.catalog_path(m["id"])), f"{BOX}/big".encode())
                for m in (snaps["big"], snaps["big2"]))
    assert one == two  # the fast path's catalog is the one the walk through the mount makes
    assert snaps["big2"]["unreadable"] == []
