"""What mountinfo says is on top at a path, when a mount was moved beneath another (box/mountsys.py, issue 46).

``finalize`` moves each new overlay beneath the old one (MOVE_MOUNT_BENEATH): the kernel then lists the
old one, now mounted on the new one, *before* it in mountinfo. Every check before an umount2 asks
``mount_at`` what is on top; the last line at the path is not the answer then.
"""

from __future__ import annotations

from ogrefs.box import mountsys
from ogrefs.box.mountsys import MountRow


def _rows(monkeypatch, rows):
    monkeypatch.setattr(mountsys, "mount_table", lambda: rows)


def test_the_mount_on_top_is_the_one_nothing_there_is_mounted_on(monkeypatch):
    root = MountRow(1, "/", "ext4", "/dev/vda", ("rw",), 0)
    old = MountRow(75, "/var", "overlay", "ogrefs", ("rw", "lowerdir=/s/lower/var"), 83)  # listed first
    new = MountRow(83, "/var", "overlay", "ogrefs", ("rw", "lowerdir=/s/tree/var"), 1)  # moved beneath it
    _rows(monkeypatch, [root, old, new])
    assert mountsys.mount_at("/var") is old
    _rows(monkeypatch, [root, new])  # the old one detached
    assert mountsys.mount_at("/var") is new


def test_plain_stacks_and_nothing_mounted(monkeypatch):
    root = MountRow(1, "/", "ext4", "/dev/vda", ("rw",), 0)
    first = MountRow(5, "/mnt", "tmpfs", "a", ("rw",), 1)
    second = MountRow(6, "/mnt", "tmpfs", "b", ("rw",), 5)  # mounted over the first
    _rows(monkeypatch, [root, first, second])
    assert mountsys.mount_at("/mnt") is second
    assert mountsys.mount_at("/srv") is None


def test_an_option_is_read_unescaped():
    row = MountRow(9, "/x", "overlay", "ogrefs", ("rw", "lowerdir=/a\\040b:/c", "upperdir=/u"), 1)
    assert row.option("lowerdir") == "/a b:/c" and row.option("upperdir") == "/u"
    assert row.option("workdir") is None
