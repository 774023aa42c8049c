"""Issue 12's lab, part 4: unmount, hard kill and remount of a whole box, with the box in use.

Every process started on box B after the mount runs from the /usr overlay
(the shell, the ``ogrefs`` CLI itself), so a plain ``umount /usr`` from the
box is busy; these tests take the box down with ``ogrefs unmount --lazy /``
(detach, the daemon serves what is still open) and check that B is B again
and that a remount brings A's tree back with B's writes.

Not here yet: SIGKILL of both the daemon and its keeper leaves the overlays on
a dead FUSE lower, and the box can no longer start /bin/sh (issue 12, open).
"""

from __future__ import annotations


import pytest

from tests.lab import fixtures
from tests.lab.box import Box
from .test_lab_mount_b import MOUNT_TIMEOUT_S, PYTHONS, lab, mount, mounts_of_kind, snap_a, start_b  # noqa: F401

pytestmark = [pytest.mark.lab, pytest.mark.fuse, pytest.mark.slow]
B_OWN = tuple(p for p in fixtures.IDENTITY_FILES if p not in ("/etc/passwd", "/etc/group", "/etc/shadow"))


def assert_pure_b(box: Box, before: dict[str, str]) -> None:
    """Nothing of A in B's view: no overlay or FUSE mount, B's own files, no A project."""
    assert mounts_of_kind(box, "overlay", "fuse") == []
    assert fixtures.file_sums(box, B_OWN) == {p: before[p] for p in B_OWN}
    assert box.out("test -e /opt/project || echo gone").strip() == "gone"


@pytest.mark.parametrize("python", list(PYTHONS))
def test_lazy_unmount_with_a_process_running_then_remount(lab, snap_a, tmp_path, python):
    box, ogrefs = start_b(lab, snap_a, python, tmp_path / "root")
    try:
        before = fixtures.file_sums(box)
        mount(box, ogrefs)
        assert "/usr" in [p[len(str(box.root)):] for p in mounts_of_kind(box, "overlay")]  # the filter sees the box's
        box.sh("echo written on B > /root/written-on-b.txt")
        sleeper = box.out("cd /opt/project && setsid sh -c 'exec 3</opt/project/train.py; exec sleep 600' "
                          "</dev/null >/dev/null 2>&1 & echo $!").strip()
        res = box.sh(f"{ogrefs} unmount --lazy /", timeout=MOUNT_TIMEOUT_S)
        assert "Traceback" not in res.stderr
        assert box.out(f"cat /proc/{sleeper}/cmdline | tr '\\0' ' '").startswith("sleep 600")  # still running
        assert_pure_b(box, before)
        box.sh(f"kill -KILL {sleeper}")
        mount(box, ogrefs)
        assert box.out("cat /root/written-on-b.txt") == "written on B\n"
        assert box.out(fixtures.PROJECT_SUMS, timeout=60) == snap_a.project_sums
    finally:
        box.close()
