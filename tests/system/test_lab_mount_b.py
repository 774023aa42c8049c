"""Issue 12's lab, part 2: box B (another provider's fresh box) runs ``ogrefs mount {SNAP} /``.

Box A snapshots itself as a whole box from inside into a file:// repository
under /srv (a disk both boxes see, bind-mounted at /srv/ogrefs); box B, a
chroot in its own private mount namespace, mounts the snapshot at ``/`` and
must stay box B: its identity, network, name resolution, disks, login and GPU
driver, with A's project, venv and checkpoint back exactly.  Everything runs
twice: with ogrefs on Debian's Python 3.11.2 (B's /usr/local/bin/ogrefs, a
venv of /usr/bin/python3) and on the project's Python (the repository's
.venv, bind-mounted into B at its own path).  Every step has a timeout.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.lab import fixtures, roots
from tests.lab.box import Box, StepFailed
from tests.lab.providers import PROVIDERS

pytestmark = [pytest.mark.lab, pytest.mark.fuse, pytest.mark.slow]

A, B = PROVIDERS["a"], PROVIDERS["b"]
MOUNT_TIMEOUT_S = 120
SNAP = os.environ.get("OGREFS_LAB_SNAP") or f"{A.box}:latest"  # A's newest (a bare `latest` on B is B's)
B_OWN = tuple(p for p in fixtures.IDENTITY_FILES if p not in ("/etc/passwd", "/etc/group", "/etc/shadow"))
PYTHONS = {
    "debian-3.11.2": ("/usr/local/bin/ogrefs", ()),
    "project": (f"{roots.REPO}/.venv/bin/ogrefs", (str(Path(sys.base_prefix).resolve()), str(roots.REPO))),
}


@pytest.fixture(scope="module")
def lab():
    return fixtures.lab_roots()


@pytest.fixture(scope="module")
def snap_a(lab, tmp_path_factory):
    root = fixtures.prepared_box(lab["a"], tmp_path_factory.mktemp("lab-a") / "root")
    return fixtures.snapshot_box_a(root, tmp_path_factory.mktemp("lab-srv") / "ogrefs")


def start_b(lab, snap_a, python: str, dest: Path) -> tuple[Box, str]:
    ogrefs, binds = PYTHONS[python]
    root = fixtures.prepared_box(lab["b"], dest)
    box = Box(root, B, snap_a.repo_dir, scratch_file="B's local NVMe\n", binds=binds).start()
    return box, ogrefs


def mount(box: Box, ogrefs: str):
    """``ogrefs mount SNAP /`` in the box; a failure carries the daemon's log."""
    try:
        return box.sh(f"{ogrefs} mount {SNAP} /", timeout=MOUNT_TIMEOUT_S)
    except StepFailed as exc:
        try:
            log = box.sh("tail -n 40 /run/ogrefs/mounts/*.log", timeout=10, check=False).stdout
        except StepFailed as again:  # a box that hangs on a read of /run: say so, keep the first failure
            log = f"(unreadable: {str(again).splitlines()[0]})"
        raise StepFailed(f"{exc}\ndaemon log:\n{log}") from None


def mounts_of_kind(box: Box, *kinds: str) -> list[str]:
    """Mount points of the given file-system types in the box (as the box sees them).

    The box's namespace began as a copy of the host's, so mounts of other
    runs on this machine (outside the box's root) are in it too: not counted.
    """
    lines = Path(f"/proc/{box.init_pid}/mountinfo").read_text().splitlines()
    root = str(box.root).rstrip("/")
    found = []
    for line in lines:
        fields = line.split()
        point = fields[4]
        if fields[fields.index("-") + 1].split(".")[0] in kinds and (point == root or point.startswith(root + "/")):
            found.append(point[len(root):] or "/")
    return found


def assert_pure_b(box: Box, before: dict[str, str]) -> None:
    """Nothing of A left: no overlay or FUSE mount, B's files, no A project."""
    assert mounts_of_kind(box, "overlay", "fuse") == []
    assert fixtures.file_sums(box, B_OWN) == {p: before[p] for p in B_OWN}
    assert box.out("test -e /opt/project || echo gone").strip() == "gone"


#: Box B trained on in a project directory of the same name: its newer checkpoint, the highest-numbered, is
#: what A's resume loop would take if it showed in A's project (issue 47: a whole box is exact there).
B_WENT_ON = ("mkdir -p /opt/project/checkpoints && "
             "printf '{\"step\": 5000, \"loss\": 0.1}' > /opt/project/checkpoints/step-5000.json")


@pytest.fixture(scope="module", params=list(PYTHONS))
def b_mounted(request, lab, snap_a, tmp_path_factory):
    box, ogrefs = start_b(lab, snap_a, request.param, tmp_path_factory.mktemp("lab-b") / "root")
    try:
        before = fixtures.file_sums(box)
        box.sh(B_WENT_ON)
        mounted = mount(box, ogrefs)
        yield box, ogrefs, before, mounted
        box.sh(f"{ogrefs} unmount /", timeout=MOUNT_TIMEOUT_S, check=False)
    finally:
        box.close()


def test_mount_returns_and_the_box_answers(b_mounted, snap_a):
    box, ogrefs, _, mounted = b_mounted
    assert "Traceback" not in mounted.stderr
    box.sh("ls /etc /usr/bin /var /opt >/dev/null && /usr/bin/python3 -c 'import json, ssl'", timeout=30)
    status = json.loads(box.out(f"{ogrefs} status / --json", timeout=30))
    assert (status["mountpoint"], status["snapshot"]) == ("/", snap_a.manifest["id"])
    said = mounted.stdout + mounted.stderr  # mount says what it kept from the box and what stays visible
    assert "kept from this box: " in said and "/etc/hostname" in said and "/mnt/scratch" in said
    exact = next(line for line in said.splitlines() if line.startswith("exact: "))
    assert "/opt/project" in exact.removeprefix("exact: ").split(" (")[0].split(", "), exact  # from its in-project venv (exact.owned)


def test_identity_network_disks_config_and_cloud_init_stay_b(b_mounted):
    box, _, before, _ = b_mounted
    after = fixtures.file_sums(box, B_OWN)
    assert {p: d for p, d in after.items() if d != before[p]} == {}
    assert box.out("getent hosts node-b-42").split()[0] == "127.0.1.1"
    assert box.out("readlink /var/lib/cloud/instance").strip() == f"/var/lib/cloud/instances/{B.instance_id}"


def test_login_user_and_its_keys_stay_b(b_mounted):
    box, _, _, mounted = b_mounted
    # uid 1000 is B's login user, and only B's (A's user with the same uid gives way: its files are B's user's)
    assert box.out("awk -F: '$3 == 1000' /etc/passwd | cut -d: -f1,3,6").strip() == f"{B.user}:1000:/home/{B.user}"
    assert box.out("getent passwd 1000 | cut -d: -f1").strip() == B.user
    assert box.out(f"getent passwd {A.user} || echo none").strip() == "none"
    assert box.out("getent group 1000 | cut -d: -f1").strip() == B.user
    keys = box.out(f"cat /home/{B.user}/.ssh/authorized_keys")
    assert f"provider-key@{B.hostname}" in keys
    assert box.out(f"stat -c %u:%a /home/{B.user}/.ssh/authorized_keys").strip() == "1000:600"
    assert box.out(f"sudo -n -l -U {B.user} | grep -c NOPASSWD").strip() == "1"
    assert box.out(f"stat -c %U /home/{A.user}").strip() == B.user  # A's home: owned by uid 1000, B's user now
    assert f"the snapshot's {A.user} gives its uid to this box's {B.user}" in mounted.stdout + mounted.stderr


def test_driver_package_record_stays_b(b_mounted):
    box, _, _, _ = b_mounted
    assert box.out("dpkg-query -W -f '${Version}' nvidia-driver-lab") == f"{B.driver}-1"
    assert box.out("dpkg-query -W -f '${Status}' libc6") == "install ok installed"  # the others: A's records


def test_gpu_driver_stays_b(b_mounted):
    box, _, _, _ = b_mounted
    smi = box.sh("nvidia-smi", timeout=30)
    assert f"Driver Version: {B.driver}" in smi.stdout
    assert box.out("/usr/bin/python3 -c 'import ctypes; print(ctypes.CDLL(\"libcuda.so.1\").cuInit(0), "
                   "ctypes.CDLL(\"libnvidia-ml.so.1\").nvmlInit_v2())'").split() == ["0", "0"]
    cache = box.out("ldconfig -p | grep -E 'libcuda.so.1|libnvidia-ml.so.1'")
    resolved = box.out("readlink -f /usr/lib/x86_64-linux-gnu/libcuda.so.1 /usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1")
    assert cache.count("=>") == 2 and resolved.split() == [
        f"/usr/lib/x86_64-linux-gnu/libcuda.so.{B.driver}", f"/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.{B.driver}"]
    box.sh(f"test -e /var/lib/dkms/nvidia/{B.driver}/source/dkms.conf && test -e /lib/modules/{B.kernel}/updates/dkms/nvidia.ko")
    assert box.out(f"test -e /lib/modules/{A.kernel} || echo absent").strip() == "absent"


def test_a_project_venv_and_checkpoint_exact_and_training_resumes(b_mounted, snap_a):
    box, _, _, _ = b_mounted
    assert box.out(fixtures.PROJECT_SUMS, timeout=60) == snap_a.project_sums
    out = box.out("cd /opt/project && .venv/bin/python train.py 5", timeout=60).splitlines()
    assert out[0] == "resumed from step 100 loss 0.4321" and out[1].startswith("saved step 105 loss ")
    again = box.out("cd /opt/project && .venv/bin/python train.py 1", timeout=60).splitlines()
    assert again[0] == out[1].replace("saved", "resumed from") and again[1].startswith("saved step 106 ")
    assert box.out("cat /root/notes.txt") == "box A's notes\n"


def test_top_level_files_of_the_snapshot_appear(b_mounted):
    box, _, _, _ = b_mounted
    assert box.out("cat /a-provider-top-level.txt") == "a file at the top of box A\n"


def test_b_disks_and_the_repository_under_srv_stay_visible(b_mounted, snap_a):
    box, ogrefs, _, _ = b_mounted
    assert box.out(f"cat /mnt/scratch/{B.hostname}.txt") == "B's local NVMe\n"
    assert sorted(box.out("ls /srv/ogrefs").split()) == sorted(p.name for p in snap_a.repo_dir.iterdir())
    assert snap_a.manifest["id"] in box.out(f"{ogrefs} snapshots --json", timeout=60)
    # A file of the snapshot read through the mount fetches from the repository under /srv.
    box.sh(fixtures.DROP_PROJECT_PAGES, timeout=60)
    assert box.out("sha256sum /opt/project/checkpoints/step-100.pt", timeout=60) in snap_a.project_sums.replace(
        "./checkpoints", "/opt/project/checkpoints")


def test_steps_that_hang_fail_instead_of_hanging(lab, tmp_path):
    """The harness itself: a step past its timeout is a failure, not a hung run."""
    box = Box(lab["b"], B, tmp_path / "repo").start()
    try:
        with pytest.raises(StepFailed, match="hung"):
            box.sh("sleep 30", timeout=1)
    finally:
        box.close()


def test_b_mounts_a_snapshot_from_s3(lab, seaweed, tmp_path):
    """The same with an s3:// repository (SeaweedFS on loopback): B keeps its resolv.conf, reads A's project."""
    bucket = seaweed.new_bucket()
    env = {**seaweed.env(), "OGREFS_REPO": f"s3://{bucket}/repo"}
    box_a = Box(fixtures.prepared_box(lab["a"], tmp_path / "a"), A, tmp_path / "srv-a", env=env).start()
    try:
        box_a.sh("ogrefs -q init")
        box_a.sh("ogrefs -q snapshot --whole-box", timeout=300)
        sums = box_a.out(fixtures.PROJECT_SUMS)
    finally:
        box_a.close()
    box = Box(fixtures.prepared_box(lab["b"], tmp_path / "b"), B, tmp_path / "srv-b", env=env).start()
    try:
        resolv = box.out("cat /etc/resolv.conf")
        mount(box, "ogrefs")
        assert box.out("cat /etc/resolv.conf") == resolv == f"nameserver {B.nameserver}\nsearch {B.search}\n"
        box.sh(fixtures.DROP_PROJECT_PAGES, timeout=60)
        assert box.out(fixtures.PROJECT_SUMS, timeout=120) == sums
        assert f"Driver Version: {B.driver}" in box.out("nvidia-smi", timeout=30)
    finally:
        box.close()
        seaweed.delete_bucket(bucket)
