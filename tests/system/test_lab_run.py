"""Issue 12's lab, part 5: ``ogrefs run`` and ``ogrefs shell`` on box B enter A's snapshot without covering B.

The command runs in A's tree (project, venv, checkpoint, notes) with B's
host-owned paths (hostname, driver, login user), exits with its own code,
and leaves B's own view untouched: no overlay or FUSE mount, B's files, no
/opt/project. Writes persist in the run's state directory (the next run of
the same snapshot resumes training from them). ``--nspawn`` runs the same
under systemd-nspawn (the host's, bound into B: the lab roots carry no
systemd-container).
"""

from __future__ import annotations

import shutil

import pytest

from tests.lab import fixtures
from tests.lab.box import Box
from tests.lab.providers import PROVIDERS
from .test_lab_mount_b import MOUNT_TIMEOUT_S, PYTHONS, lab, mounts_of_kind, snap_a, start_b  # noqa: F401
from .test_lab_lifecycle import B_OWN

pytestmark = [pytest.mark.lab, pytest.mark.fuse, pytest.mark.slow]
B = PROVIDERS["b"]
INSIDE = ("cat /etc/hostname; nvidia-smi | grep -o 'Driver Version: [0-9.]*'; getent passwd 1000 | cut -d: -f1; "
          "cat /root/notes.txt; cd /opt/project && .venv/bin/python train.py {steps}")


def assert_b_untouched(box: Box, before: dict[str, str]) -> None:
    assert mounts_of_kind(box, "overlay", "fuse") == []
    assert fixtures.file_sums(box, B_OWN) == {p: before[p] for p in B_OWN}
    assert box.out("test -e /opt/project || echo gone").strip() == "gone"


@pytest.mark.parametrize("python", list(PYTHONS))
def test_run_and_shell_enter_a_keeping_b(lab, snap_a, tmp_path, python):
    box, ogrefs = start_b(lab, snap_a, python, tmp_path / "root")
    try:
        before = fixtures.file_sums(box)
        snap = snap_a.manifest["id"]  # run/shell take a snapshot id or `latest` (not BOX:latest)
        res = box.sh(f"{ogrefs} -q run {snap} -- sh -c \"{INSIDE.format(steps=2)}; exit 7\"",
                     timeout=MOUNT_TIMEOUT_S, check=False)
        assert res.returncode == 7, res.stderr
        assert "Traceback" not in res.stderr
        lines = res.stdout.splitlines()
        assert lines[:5] == [B.hostname, f"Driver Version: {B.driver}", B.user, "box A's notes",
                             "resumed from step 100 loss 0.4321"], res.stdout
        assert lines[5].startswith("saved step 102 ")
        assert_b_untouched(box, before)
        res = box.sh(f"printf '%s\\n' 'cd /opt/project && .venv/bin/python train.py 1' 'exit 3' | "
                     f"{ogrefs} -q shell {snap}", timeout=MOUNT_TIMEOUT_S, check=False)
        assert res.returncode == 3, res.stderr
        assert res.stdout.splitlines()[0] == lines[5].replace("saved", "resumed from")  # the run's write stayed
        assert_b_untouched(box, before)
    finally:
        box.close()


@pytest.mark.skipif(shutil.which("systemd-nspawn") is None, reason="systemd-nspawn not on this host")
def test_run_nspawn_enters_a_keeping_b(lab, snap_a, tmp_path):
    ogrefs, binds = PYTHONS["debian-3.11.2"]
    root = fixtures.prepared_box(lab["b"], tmp_path / "root")
    nspawn = shutil.which("systemd-nspawn")
    box = Box(root, B, snap_a.repo_dir, scratch_file="B's local NVMe\n", binds=(*binds, nspawn),
              cgroups=True).start()
    try:
        before = fixtures.file_sums(box)
        # the fake driver reads its "kernel module" from /run, which nspawn gives a fresh tmpfs: the
        # driver is checked by its files here (the chroot test above runs nvidia-smi)
        inside = ("cat /etc/hostname; readlink -f /usr/lib/x86_64-linux-gnu/libcuda.so.1; getent passwd 1000 | "
                  "cut -d: -f1; cat /root/notes.txt; cd /opt/project && .venv/bin/python train.py 1")
        res = box.sh(f"{ogrefs} -q run --nspawn {snap_a.manifest['id']} -- sh -c \"{inside}; exit 5\"",
                     timeout=MOUNT_TIMEOUT_S, check=False)
        assert res.returncode == 5, res.stderr
        lines = res.stdout.splitlines()
        assert lines[:5] == [B.hostname, f"/usr/lib/x86_64-linux-gnu/libcuda.so.{B.driver}", B.user,
                             "box A's notes", "resumed from step 100 loss 0.4321"], res.stdout + res.stderr
        assert_b_untouched(box, before)
    finally:
        box.close()
