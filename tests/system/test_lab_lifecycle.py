"""Issue 12's lab, part 4: unmount, hard kill and remount of a whole box, with the box in use.

Every process started on box B after the mount runs from the /usr overlay
(the shell, the ``ogrefs`` CLI itself), so a plain ``umount /usr`` from the
box is busy. ``ogrefs unmount /`` and ``finalize /`` refuse up front (one
line, nothing changed) while another process holds the tree, and detach
lazily what only the caller's own shell holds; ``--lazy`` detaches
regardless. Each test checks that B is B again and that a remount brings
A's tree back with B's writes.

SIGKILL of both the daemon and its keeper leaves the overlays on a dead FUSE
lower: the box can no longer start /bin/sh; a shell started before the mount
sources the rescue script (box/rescue.py) and the box is B again.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.lab import fixtures
from tests.lab.box import Box
from tests.lab.providers import PROVIDERS
from .test_lab_mount_b import MOUNT_TIMEOUT_S, PYTHONS, lab, mount, mounts_of_kind, snap_a, start_b  # noqa: F401

pytestmark = [pytest.mark.lab, pytest.mark.fuse, pytest.mark.slow]
B = PROVIDERS["b"]
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
        assert "/usr" in mounts_of_kind(box, "overlay")  # the filter sees the box's own mounts (as the box names them)
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


def daemon_pids(box: Box) -> list[int]:
    """The mount's keeper and daemon (host pids), found by the box's PID namespace."""
    pids = []
    for pid in box.namespace_pids():
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"/ogrefs") for a in args) and b"mount" in args:
            pids.append(pid)
    return pids


def wait_gone(box: Box, timeout: float = 60.0) -> list[int]:
    """The mount's processes still alive after waiting (they exit once the caller's shell let go)."""
    deadline = time.monotonic() + timeout
    while (left := daemon_pids(box)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@pytest.mark.parametrize("python", list(PYTHONS))
def test_unmount_with_a_process_running_refuses_whole_then_unmounts_from_the_box(lab, snap_a, tmp_path, python):
    """Plain unmount from inside the box: refused up front while another process holds the tree (nothing
    changed, one line naming it); once only the caller's own shell does, it unmounts; remount resumes."""
    box, ogrefs = start_b(lab, snap_a, python, tmp_path / "root")
    try:
        before = fixtures.file_sums(box)
        mount(box, ogrefs)
        up = sorted(mounts_of_kind(box, "overlay", "fuse"))
        box.sh("echo written on B > /root/written-on-b.txt")
        sleeper = box.out("cd /opt/project && setsid sh -c 'exec 3</opt/project/train.py; exec sleep 600' "
                          "</dev/null >/dev/null 2>&1 & echo $!").strip()
        res = box.sh(f"{ogrefs} unmount /", timeout=MOUNT_TIMEOUT_S, check=False)
        assert res.returncode != 0 and "Traceback" not in res.stderr
        assert len(res.stderr.strip().splitlines()) == 1, res.stderr
        assert f"{sleeper} sleep" in res.stderr and "--lazy" in res.stderr
        assert "/usr" in up and sorted(mounts_of_kind(box, "overlay", "fuse")) == up  # nothing was unmounted
        assert box.out("cat /root/notes.txt /root/written-on-b.txt") == "box A's notes\nwritten on B\n"
        box.sh(f"kill -KILL {sleeper}")
        res = box.sh(f"{ogrefs} unmount /", timeout=MOUNT_TIMEOUT_S)
        assert "Traceback" not in res.stderr
        assert_pure_b(box, before)
        assert wait_gone(box) == []
        mount(box, ogrefs)
        assert box.out("cat /root/written-on-b.txt") == "written on B\n"
        assert box.out(fixtures.PROJECT_SUMS, timeout=60) == snap_a.project_sums
        box.sh(f"{ogrefs} unmount /", timeout=MOUNT_TIMEOUT_S)
        assert_pure_b(box, before)
    finally:
        box.close()


@pytest.mark.parametrize("python", list(PYTHONS))
def test_finalize_a_whole_box_from_inside(lab, snap_a, tmp_path, python):
    box, ogrefs = start_b(lab, snap_a, python, tmp_path / "root")
    try:
        before = fixtures.file_sums(box)
        mount(box, ogrefs)
        box.sh(f"{ogrefs} status / --wait", timeout=300)
        res = box.sh(f"{ogrefs} finalize /", timeout=MOUNT_TIMEOUT_S)
        assert "Traceback" not in res.stderr and "now run from local disk" in res.stdout
        assert mounts_of_kind(box, "fuse") == [] and len(mounts_of_kind(box, "overlay")) > 3
        assert wait_gone(box) == []  # no daemon, no keeper once the finalizing shell has exited
        assert box.out(fixtures.PROJECT_SUMS, timeout=60) == snap_a.project_sums
        assert fixtures.file_sums(box, B_OWN) == {p: before[p] for p in B_OWN}
        assert f"Driver Version: {B.driver}" in box.out("nvidia-smi", timeout=30)
        assert box.out("getent passwd 1000 | cut -d: -f1").strip() == B.user
    finally:
        box.close()


def test_finalize_of_a_box_whose_mounts_are_shared_as_systemd_leaves_them(lab, snap_a, tmp_path):
    """Issue 47: under systemd every mount is shared, so the bind-back of the state directory on the /var
    overlay is a peer of `/`; detaching the old overlay took the FUSE lower and the host layers with it, and
    finalize failed on every overlay, leaving the box on its own files. Now it finalizes."""
    root = fixtures.prepared_box(lab["b"], tmp_path / "root")
    box = Box(root, B, snap_a.repo_dir, scratch_file="B's local NVMe\n", shared=True).start()
    try:
        before = fixtures.file_sums(box)
        assert " shared:" in Path(f"/proc/{box.init_pid}/mountinfo").read_text()
        mount(box, "ogrefs")
        box.sh("ogrefs status / --wait", timeout=300)
        res = box.sh("ogrefs finalize /", timeout=MOUNT_TIMEOUT_S, check=False)
        assert res.returncode == 0 and "now run from local disk" in res.stdout, res.stderr
        assert mounts_of_kind(box, "fuse") == [] and len(mounts_of_kind(box, "overlay")) > 3
        assert box.out(fixtures.PROJECT_SUMS, timeout=60) == snap_a.project_sums
        assert fixtures.file_sums(box, B_OWN) == {p: before[p] for p in B_OWN}
    finally:
        box.close()


def in_box(box: Box, path: str) -> Path:
    """A path of the box as the host reaches it (through the box's PID 1: its mount namespace)."""
    return Path(f"/proc/{box.init_pid}/root{box.root}{path}")


@pytest.mark.parametrize("python", list(PYTHONS))
def test_hard_kill_of_keeper_and_daemon_then_the_rescue_script_brings_the_box_back(lab, snap_a, tmp_path, python):
    """kill -9 of both: programs under the overlays cannot start; a shell that was running before the
    mount sources the rescue script (no program through the overlays), then unmount and remount work."""
    box, ogrefs = start_b(lab, snap_a, python, tmp_path / "root")
    try:
        before = fixtures.file_sums(box)
        # a login shell of this box, started before the mount, reading commands from a FIFO
        box.sh("mkfifo /tmp/ctl && setsid sh -c 'exec 3<>/tmp/ctl; while read -r line <&3; do eval \"$line\"; "
               "done' </dev/null >/dev/null 2>&1 &")
        mount(box, ogrefs)
        box.sh("echo written on B > /root/written-on-b.txt")
        daemons = daemon_pids(box)
        assert len(daemons) >= 2, "keeper and daemon expected"
        for pid in daemons:
            os.kill(pid, signal.SIGKILL)
        assert wait_gone(box) == []
        broken = box.sh("cat /etc/hostname", timeout=30, check=False)  # /bin/sh is on the dead /usr overlay
        assert broken.returncode != 0
        with open(in_box(box, "/tmp/ctl"), "w") as ctl:
            ctl.write(". /run/ogrefs/rescue/*/detach.sh >/tmp/rescue.out 2>&1; echo done >/tmp/rescue.done\n")
        deadline = time.monotonic() + 60
        while not in_box(box, "/tmp/rescue.done").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        said = in_box(box, "/tmp/rescue.out").read_text()
        assert "ogrefs: detached; now run: ogrefs unmount /" in said, said
        res = box.sh(f"{ogrefs} unmount /", timeout=MOUNT_TIMEOUT_S)  # the box starts programs again
        assert "Traceback" not in res.stderr
        assert_pure_b(box, before)
        mount(box, ogrefs)
        assert box.out("cat /root/written-on-b.txt") == "written on B\n"
        assert box.out(fixtures.PROJECT_SUMS, timeout=60) == snap_a.project_sums
    finally:
        box.close()
