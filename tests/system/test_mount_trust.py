"""A local user against a writable mount at / (issue 46): nothing a user controls is followed by root.

Real FUSE and overlayfs at real paths, in ``unshare --mount --propagation
private``. The box's "user" is uid 4321: it owns a home directory; what it
plants there (a symlink where the snapshot has a directory, a symlink, FIFO
or huge file at a host-merged path) is made as root and handed to it with
lchown, as the user would have made it. Each shell step has a timeout.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.daemons import kill_registered_daemons
from tests.nsbox import in_namespace

pytestmark = [
    pytest.mark.fuse,
    pytest.mark.timeout(240),
    pytest.mark.skipif(not os.path.exists("/dev/fuse") and not os.environ.get("CI"), reason="no /dev/fuse here"),
    pytest.mark.skipif(shutil.which("unshare") is None, reason="util-linux unshare missing"),
]

USER = 4321
OGREFS = f"timeout 60 {sys.executable} -m ogrefs"


@pytest.fixture
def home(tmp_path):
    """A snapshot of box/home/u/proj (with an evil script), box/home/u/.ssh and box/usr, each a root path
    (an overlay of its own at / on this box); then the user's own home."""
    box = tmp_path / "box"
    (box / "home/u/proj").mkdir(parents=True)
    (box / "home/u/proj/zz-evil.sh").write_text("echo pwned\n")
    (box / "home/u/.ssh").mkdir(mode=0o700)
    (box / "home/u/.ssh/authorized_keys").write_text("ssh-ed25519 AAAA-snapshot-key u@a\n")
    (box / "usr").mkdir()
    (box / "usr/marker").write_text("snap\n")
    env = dict(os.environ, OGREFS_REPO=str(tmp_path / "repo"), OGREFS_CACHE_DIR=str(tmp_path / "cache"),
               OGREFS_STATE_DIR=str(tmp_path / "state"), OGREFS_RUNTIME_DIR=str(tmp_path / "run"))
    subprocess.run([sys.executable, "-m", "ogrefs", "-q", "init"], env=env, check=True, timeout=60)
    roots = [str(box / "home/u/proj"), str(box / "home/u/.ssh"), str(box / "usr")]
    out = subprocess.run([sys.executable, "-m", "ogrefs", "-q", "snapshot", "--json", *roots], env=env, check=True,
                         capture_output=True, text=True, timeout=120).stdout
    (box / "usr/marker").write_text("host\n")
    root_only = tmp_path / "root-only"  # a directory only root may read, e.g. /etc's stand-in
    (root_only / "dir").mkdir(parents=True)
    (root_only / "dir/secret.conf").write_text("SECRET-LINE\n")
    root_only.chmod(0o700)
    for p in [box / "home/u", *(box / "home/u").rglob("*")]:
        os.lchown(p, USER, USER)
    os.chmod(tmp_path, 0o755)  # the user reaches its home
    os.chmod(box, 0o755)
    yield {"env": env, "box": box, "snap": json.loads(out)["id"], "tmp": tmp_path, "root_only": root_only}
    kill_registered_daemons(tmp_path / "run")


def _plant_symlink(link: Path, target: Path) -> None:
    """What the user does before root mounts: its entry becomes a symlink to ``target`` (the user's own link)."""
    if link.is_dir() and not link.is_symlink():
        shutil.rmtree(link)
    else:
        link.unlink()
    link.symlink_to(target)
    os.lchown(link, USER, USER)


def test_a_users_symlink_where_the_snapshot_has_a_directory_is_never_overlaid(home):
    box, tmp, secret_dir = home["box"], home["tmp"], home["root_only"] / "dir"
    _plant_symlink(box / "home/u/proj", secret_dir)
    proc = in_namespace(home, f"""
        {OGREFS} mount {home['snap']} / > {tmp}/mount.out
        ls -a {secret_dir} > {tmp}/listing.txt           # what the root-only directory shows while mounted
        cat {box}/usr/marker > {tmp}/marker.txt           # the other root path is overlaid as always
        {OGREFS} status / > {tmp}/status.txt
        grep " - overlay " /proc/self/mountinfo | cut -d' ' -f5 > {tmp}/overlays.txt
        {OGREFS} unmount /
    """, check=False)
    assert "zz-evil.sh" not in (tmp / "listing.txt").read_text()
    assert str(secret_dir) not in (tmp / "overlays.txt").read_text()
    assert (tmp / "marker.txt").read_text() == "snap\n"
    why = f"{box}/home/u/proj not overlaid: {box}/home/u/proj is a symlink that user {USER} can change"
    assert why in (tmp / "mount.out").read_text() + proc.stderr
    assert why in (tmp / "status.txt").read_text()
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(secret_dir)) == ["secret.conf"]


def test_a_users_own_directory_is_overlaid_through_its_descriptor(home):
    """Not refused: a real directory of the user's. The snapshot's data path is exact by default (issue 47):
    the user's own file is hidden while mounted; with --merge it stays visible below the snapshot's."""
    box, tmp = home["box"], home["tmp"]
    (box / "home/u/proj/mine.txt").write_text("the user's\n")
    in_namespace(home, f"""
        {OGREFS} mount {home['snap']} /
        cat {box}/home/u/proj/zz-evil.sh > {tmp}/exact.txt
        ls -a {box}/home/u/proj > {tmp}/exact-listing.txt
        {OGREFS} unmount /
        {OGREFS} mount --merge {home['snap']} /
        cat {box}/home/u/proj/zz-evil.sh {box}/home/u/proj/mine.txt > {tmp}/merged.txt
        {OGREFS} unmount /
    """)
    assert (tmp / "exact.txt").read_text() == "echo pwned\n"
    assert "mine.txt" not in (tmp / "exact-listing.txt").read_text().split()
    assert (tmp / "merged.txt").read_text() == "echo pwned\nthe user's\n"
    assert (box / "home/u/proj/mine.txt").read_text() == "the user's\n"  # the user's own file, back afterwards


@pytest.mark.parametrize("planted", ["symlink to a root-only file", "fifo", "1 GiB file"])
def test_host_merge_of_authorized_keys_reads_only_a_plain_small_file_of_the_users(home, planted):
    """The user's authorized_keys is merged with the snapshot's; what the user planted there instead is
    never read (nor waited on, nor held in memory): the snapshot's copy is shown and the mount says why."""
    box, tmp = home["box"], home["tmp"]
    keys = box / "home/u/.ssh/authorized_keys"
    secret = home["root_only"] / "shadow"
    secret.write_text("root:SECRET-HASH:19000::::::\n")
    secret.chmod(0o600)
    if planted == "symlink to a root-only file":
        _plant_symlink(keys, secret)
    elif planted == "fifo":
        keys.unlink()
        os.mkfifo(keys, 0o600)
        os.chown(keys, USER, USER)
    else:
        with open(keys, "ab") as fh:
            fh.truncate(1 << 30)
    rule = f"merge:{box}/home/*/.ssh/authorized_keys"
    proc = in_namespace(home, f"""
        {OGREFS} mount {home['snap']} / --host-path {rule} > {tmp}/mount.out
        cat {keys} > {tmp}/merged.txt
        {OGREFS} unmount /
    """, check=False)
    merged = (tmp / "merged.txt").read_text() if (tmp / "merged.txt").exists() else ""
    assert "SECRET" not in merged
    assert proc.returncode == 0, proc.stderr
    assert merged == "ssh-ed25519 AAAA-snapshot-key u@a\n"
    why = {"symlink to a root-only file": "is a symlink: not followed", "fifo": "is not a regular file",
           "1 GiB file": "is larger than 1 MiB"}[planted]
    assert f"not merged ({keys} {why}); the snapshot's copy is shown" in (tmp / "mount.out").read_text()


def test_a_fifo_swapped_in_after_the_plan_never_holds_the_keeper(tmp_path):
    """The plan saw a regular authorized_keys; the user swaps in a FIFO before the keeper merges it: the
    keeper's open does not wait for a writer (the mount would hang 120 s), it refuses and goes on."""
    keys = tmp_path / "box/home/u/.ssh/authorized_keys"
    state = tmp_path / "state"
    snap_side = Path(f"{state}/lower{keys.parent}")
    snap_side.mkdir(parents=True)
    (snap_side / "authorized_keys").write_text("ssh-ed25519 AAAA-snapshot-key u@a\n")
    keys.parent.mkdir(parents=True)
    os.mkfifo(keys, 0o600)
    os.chown(keys, USER, USER)
    script = f"""
import json
from ogrefs.box import hostpaths
from ogrefs.box.records import Overlay
o = Overlay("{keys.parent}", "{snap_side}", "{state}/upper/0", "{state}/work/0", keep_existing=True)
layer = hostpaths.prepare([o], __import__("pathlib").Path("{state}"), hostpaths.HostPlan(merges=[("merge", "{keys}")]))
print(json.dumps(layer.kept))
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, "-c", script],
                          capture_output=True, text=True, timeout=30, env=env)  # today's code: blocked in open()
    assert proc.returncode == 0, proc.stderr
    why = f"{keys}: not merged ({keys} is not a regular file); the snapshot's copy is shown"
    assert json.loads(proc.stdout) == [why]


def test_run_of_a_snapshot_with_a_symlink_where_a_bind_goes_makes_nothing_outside_its_root(tmp_path):
    """A snapshot from another box has ``mnt -> <outside>``, where this box has a data disk mounted at
    ``mnt/data``: `ogrefs run` binds that disk only beneath its root, never through the snapshot's symlink."""
    top = tmp_path / "top"
    top.mkdir()
    (top / "marker").write_text("snap\n")
    outside = tmp_path / "outside"
    outside.mkdir()
    (top / "mnt").symlink_to(outside)  # absolute: resolved by root from the box's /
    env = dict(os.environ, OGREFS_REPO=str(tmp_path / "repo"), OGREFS_CACHE_DIR=str(tmp_path / "cache"),
               OGREFS_STATE_DIR=str(tmp_path / "state"), OGREFS_RUNTIME_DIR=str(tmp_path / "run"),
               OGREFS_RUN_DIR=str(tmp_path / "runs"))
    subprocess.run([sys.executable, "-m", "ogrefs", "-q", "init"], env=env, check=True, timeout=60)
    subprocess.run([sys.executable, "-m", "ogrefs", "-q", "snapshot", str(top)], env=env, check=True, timeout=120)
    (top / "mnt").unlink()
    (top / "mnt/data").mkdir(parents=True)  # this box's own data disk is mounted there
    try:
        proc = in_namespace({"env": env}, f"""
            mount -t tmpfs -o size=1m ogrefs-test-disk {top}/mnt/data
            {OGREFS} run latest --no-host-paths -- cat {top}/marker > {tmp_path}/ran.txt
        """, check=False)
    finally:
        kill_registered_daemons(tmp_path / "run")
    assert os.listdir(outside) == []
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "ran.txt").read_text() == "snap\n"
    assert f"this box's {top}/mnt/data is not shown inside the snapshot" in proc.stderr
